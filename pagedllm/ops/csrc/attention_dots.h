// Prefill attention's tile products on AVX512-BF16 dot products (`vdpbf16ps`), for CPUs
// without AMX whose dot products outrun their fp32 FMAs (AMD Zen 4/5): attention_amx.h's
// attend_rows runs these in place of the AMX tiles when its engine is `Registers`.
//
// A tile product done as memory-resident tiles (a C tile loaded and stored around each
// 16 x 16 x 32 product, P transposed into an A tile, the product stored and added to the
// rows' sums in a pass of its own) spent more time moving tiles than multiplying. Here the
// sums stay in registers for a whole product:
//
// - S^T = K Q^T, a 16-key slice at a time: 16 accumulators (key j's scores, lane i row i),
//   each pair of d a load of Q^T's row and 16 broadcasts of the keys' pairs. The step's keys
//   are copied side by side once for all row tiles, so each broadcast is at a fixed offset.
// - O^T += V^T P^T, 16 of d at a time: 16 accumulators (d's sums, lane i row i), each key
//   pair a load of the softmax's weight row (as tile_softmax leaves it: lane i row i's two
//   weights) and 16 broadcasts of V's pairs (as load_values lays them). The rows' running
//   sums are kept transposed (d by row lanes), so rescaling them by the running max's change
//   is one multiply-add a d with no per-row broadcast.
//
// The same products are summed in the same order as the tiles sum them: the bits equal the
// memory-resident tiles'.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

#include "tile_ops.h"
#include "vec_avx512.h"

namespace pagedllm_attention_dots {

using pagedllm_tiles::kTileDwords;

constexpr int kLanes = 16;  // rows of a row tile, keys of a slice, d of a value group

// attend_rows' engine tag (attention_amx.h's overloads take it to the functions below).
struct Registers {};

// A step's keys (one slice at slices[0], a second at slices[1] or null; a slice's rows
// `stride` elements apart) side by side: key j's D / 2 pairs at keys + j * D / 2.
template <int D>
PAGEDLLM_BF16_DOTS inline void copy_keys(const at::BFloat16* const (&slices)[2], int64_t stride,
                                         uint32_t* keys) {
  for (int h = 0; h < 2 && slices[h] != nullptr; ++h) {
    for (int j = 0; j < kLanes; ++j) {
      const at::BFloat16* row = slices[h] + j * stride;
      uint32_t* to = keys + (kLanes * h + j) * (D / 2);
      for (int d = 0; d < D; d += 32) _mm512_storeu_si512(to + d / 2, _mm512_loadu_si512(row + d));
    }
  }
}

// scores[16 j + i] = k_j . q_i for a slice's 16 keys (at `keys`, side by side) and a row
// tile's rows (query_t: pair p of d for the 16 rows at 16 p), pairs summed in order of d.
template <int D>
PAGEDLLM_BF16_DOTS inline void slice_scores(const uint32_t* keys, const uint32_t* query_t,
                                            float* scores) {
  __m512 acc[kLanes];
  for (int j = 0; j < kLanes; ++j) acc[j] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    const __m512bh rows = reinterpret_cast<__m512bh>(_mm512_loadu_si512(query_t + kLanes * p));
    for (int j = 0; j < kLanes; ++j) {
      const __m512i pair = _mm512_set1_epi32(static_cast<int>(keys[j * (D / 2) + p]));
      acc[j] = _mm512_dpbf16_ps(acc[j], reinterpret_cast<__m512bh>(pair), rows);
    }
  }
  for (int j = 0; j < kLanes; ++j) _mm512_store_ps(scores + kLanes * j, acc[j]);
}

// acc_t[16 d + i] <- acc_t[16 d + i] * rescale[i] + sum over the step's key pairs k of row
// i's weights for keys 2k, 2k + 1 (weights + 16 k, lane i) times their values at d (values:
// per 16 of d a tile whose row k holds the pairs of its 16 d).
template <int D>
PAGEDLLM_BF16_DOTS inline void step_values(const uint32_t* weights, const uint32_t* values,
                                           const float* rescale, float* acc_t) {
  const __m512 factor = _mm512_load_ps(rescale);
  for (int g = 0; g < D / kLanes; ++g) {
    const uint32_t* tile = values + g * kTileDwords;
    __m512 part[kLanes];
    for (int e = 0; e < kLanes; ++e) part[e] = _mm512_setzero_ps();
    for (int k = 0; k < kLanes; ++k) {
      const __m512bh w = reinterpret_cast<__m512bh>(_mm512_load_si512(weights + kLanes * k));
      for (int e = 0; e < kLanes; ++e) {
        const __m512i pair = _mm512_set1_epi32(static_cast<int>(tile[kLanes * k + e]));
        part[e] = _mm512_dpbf16_ps(part[e], reinterpret_cast<__m512bh>(pair), w);
      }
    }
    float* acc = acc_t + kLanes * kLanes * g;
    for (int e = 0; e < kLanes; ++e) {
      _mm512_storeu_ps(acc + kLanes * e,
                       _mm512_fmadd_ps(_mm512_loadu_ps(acc + kLanes * e), factor, part[e]));
    }
  }
}

// A row tile's first `rows` rows: out[i][d] = acc_t[16 d + i] / sums[i], rounded once to bf16.
template <int D>
PAGEDLLM_BF16_DOTS inline void store_rows(int rows, const float* acc_t, const float* sums,
                                          at::BFloat16* const* out) {
  float inverse[kLanes];
  for (int i = 0; i < rows; ++i) inverse[i] = 1.0f / sums[i];
  for (int g = 0; g < D / kLanes; ++g) {
    __m512i by_row[kLanes];
    for (int e = 0; e < kLanes; ++e) {
      by_row[e] = _mm512_castps_si512(_mm512_loadu_ps(acc_t + kLanes * (kLanes * g + e)));
    }
    pagedllm_tiles::transpose16(by_row);
    for (int i = 0; i < rows; ++i) {
      pagedllm_vec512::store16(out[i] + kLanes * g, _mm512_mul_ps(_mm512_castsi512_ps(by_row[i]),
                                                                  _mm512_set1_ps(inverse[i])));
    }
  }
}

}  // namespace pagedllm_attention_dots
