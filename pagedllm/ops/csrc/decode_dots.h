// A decode's attention on AVX512-BF16 dot products (`vdpbf16ps`: CPUs without AMX whose
// dot products outrun their fp32 FMAs, AMD Zen 4/5), for a bf16 cache and bf16 queries.
// paged_attention.cpp routes its decode items here when its engine is "bf16_dots".
//
// The vector kernel spends a 16-bit cache's decode on loads: every key and value vector is
// widened to fp32 once for each query row that uses it, and each score is a horizontal sum.
// Here a 16-key slice of one kv head is taken for all the head's query rows (its GQA
// group) at once:
//
// - S = q K^T: the slice's keys are transposed once so each vector holds one pair of d for
//   the 16 keys (key j in lane j); a row's scores are then D / 2 dot products of those
//   vectors with the row's query pair broadcast, with no horizontal sums and no widening.
// - The online softmax runs on a row's 16 scores in one vector; its weights are rounded to
//   bf16, as the prefill tiles (attention_amx.h) and Transformers' bf16 SDPA round them.
// - O += P V: two keys' values interleaved into pairs (lane i of a vector holds one d of
//   both), each dot product adding both keys' weighted values to 16 of a row's sums. The
//   interleave works within 128-bit lanes, so the sums' d order is permuted: `store_row`
//   undoes it once per item.
//
// Rows see keys [first, limit) (one token's rows: the same for all); a slice's keys outside
// it are masked in the scores and read as zeros in the values, so stale cache rows never
// reach a sum. Slices lie inside their blocks (block_size a multiple of 16), so reading a
// whole slice never leaves the block.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tile_ops.h"
#include "vec_avx2.h"
#include "vec_avx512.h"

namespace pagedllm_decode_dots {

using pagedllm_tiles::transpose16;

constexpr int kSliceKeys = 16;

// Rows taken together (head sizes 32, 64 and 128, as attention_amx.h's `covers`): each keeps
// D / 16 sums in registers through the values (16 in all at most) and two score chains.
template <int D>
constexpr int kGroupRows = 256 / D < 4 ? 256 / D : 4;

// One decode: its kv heads' keys and values in the paged cache, its query rows and outputs.
struct Decode {
  const at::BFloat16* key_cache;
  const at::BFloat16* value_cache;
  int64_t block_stride, token_stride;  // elements
  const int32_t* block_table;
  int block_size;
  int kv_head_begin, kv_head_end, group;
  int first, limit;  // keys visible to every row
  float scale;
  // Row r (query head kv_head_begin * group + r): its query at query + r * query_head_stride,
  // its output at out + r * D.
  const at::BFloat16* query;
  int64_t query_head_stride;
  at::BFloat16* out;
};

// Per-thread working memory, grown to the rows and head size of the largest item.
struct Scratch {
  std::vector<uint32_t> query;   // row r's query as bf16 pairs: D / 2 at r * D / 2
  std::vector<uint32_t> weights;  // row r's slice weights as bf16 pairs: 8 at r * 8
  std::vector<float> acc, m, l;   // row r's sums (permuted d order) at r * D, max, sum
  std::vector<uint32_t> keys_t;   // the slice's keys transposed: D / 2 vectors of 16 keys

  void reserve(int rows, int head_dim) {
    const size_t r = static_cast<size_t>(rows), d = static_cast<size_t>(head_dim);
    if (query.size() < r * d / 2) query.resize(r * d / 2);
    if (weights.size() < r * 8) weights.resize(r * 8);
    if (acc.size() < r * d) acc.resize(r * d);
    if (m.size() < r) m.resize(r);
    if (l.size() < r) l.resize(r);
    if (keys_t.size() < d / 2 * kSliceKeys) keys_t.resize(d / 2 * kSliceKeys);
  }
};

// The next block's tokens, prefetched into L2 a token at a time over the current block's
// value pairs (`step`), not in bursts: a burst stalls the loads once the miss queues fill.
struct Ahead {
  const Decode& d;
  int64_t block = 0, head = 0, run = 0;  // the next block's offset; the item's kv-head run
  int tokens = 0, slots = 1, slot = 0;

  void start(int64_t next_block, int next_tokens, int num_slots) {
    block = next_block;
    tokens = next_tokens;
    slots = std::max(1, num_slots);
    slot = 0;
  }
  void step() {
    const int j0 = slot * tokens / slots, j1 = (slot + 1) * tokens / slots;
    for (int j = j0; j < j1; ++j) {
      const int64_t at = block + j * d.token_stride + head;
      const char* k = reinterpret_cast<const char*>(d.key_cache + at);
      const char* v = reinterpret_cast<const char*>(d.value_cache + at);
      for (int64_t b = 0; b < run * 2; b += 64) {
        _mm_prefetch(k + b, _MM_HINT_T1);
        _mm_prefetch(v + b, _MM_HINT_T1);
      }
    }
    slot += slot < slots;
  }
  void finish() {
    while (slot < slots) step();
  }
};

// The 16 keys from `keys` (token_stride apart) as D / 2 vectors of one d pair each.
template <int D>
PAGEDLLM_BF16_DOTS inline void transpose_slice(const at::BFloat16* keys, int64_t stride,
                                               uint32_t* keys_t) {
  for (int c = 0; c < D / 32; ++c) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(keys + j * stride + 32 * c);
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(keys_t + (16 * c + i) * 16, r[i]);
  }
}

PAGEDLLM_BF16_DOTS inline __m512 dot(__m512 acc, __m512i a, uint32_t pair) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a),
                          reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair))));
}

// Rows r0 .. r0 + R - 1 over the transposed slice: scores (keys in lanes, `visible` lanes
// kept), the online-softmax update of each row's max and sum, its bf16 weights into
// s.weights; returns each row's rescale factor in `rescale`.
template <int D, int R>
PAGEDLLM_BF16_DOTS inline void slice_weights(int r0, __mmask16 visible, float scale, Scratch& s,
                                             float (&rescale)[R]) {
  __m512 even[R], odd[R];
  for (int i = 0; i < R; ++i) even[i] = odd[i] = _mm512_setzero_ps();
  const uint32_t* query = s.query.data() + static_cast<size_t>(r0) * D / 2;
  for (int k = 0; k < D / 2; k += 2) {
    const __m512i k0 = _mm512_loadu_si512(s.keys_t.data() + k * 16);
    const __m512i k1 = _mm512_loadu_si512(s.keys_t.data() + (k + 1) * 16);
    for (int i = 0; i < R; ++i) {
      even[i] = dot(even[i], k0, query[i * D / 2 + k]);
      odd[i] = dot(odd[i], k1, query[i * D / 2 + k + 1]);
    }
  }
  const __m512 neg_inf = _mm512_set1_ps(pagedllm_vec::kNegInf);
  for (int i = 0; i < R; ++i) {
    const int r = r0 + i;
    const __m512 score = _mm512_mask_blend_ps(
        visible, neg_inf, _mm512_mul_ps(_mm512_add_ps(even[i], odd[i]), _mm512_set1_ps(scale)));
    const float m_new = std::max(s.m[r], _mm512_reduce_max_ps(score));
    // exp(-inf) = 0 on the first slice; libm's exp is worth skipping when the max holds.
    rescale[i] = m_new == s.m[r] ? 1.0f : std::exp(s.m[r] - m_new);
    const __m512 p = _mm512_maskz_mov_ps(
        visible, pagedllm_vec512::exp512(_mm512_sub_ps(score, _mm512_set1_ps(m_new))));
    s.l[r] = s.l[r] * rescale[i] + _mm512_reduce_add_ps(p);
    s.m[r] = m_new;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.weights.data() + r * 8),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
  }
}

// acc_r <- acc_r * rescale_r + sum_j w_r[j] V[j] over the slice's keys [lo, hi) for rows
// r0 .. r0 + R - 1; keys outside are read as zeros.
template <int D, int R>
PAGEDLLM_BF16_DOTS inline void slice_values(const at::BFloat16* values, int64_t stride, int lo,
                                            int hi, int r0, const float (&rescale)[R],
                                            Scratch& s, Ahead& ahead) {
  constexpr int V = D / 16;  // sum vectors a row
  __m512 acc[R][V];
  for (int i = 0; i < R; ++i) {
    const __m512 factor = _mm512_set1_ps(rescale[i]);
    for (int v = 0; v < V; ++v) {
      acc[i][v] = _mm512_mul_ps(_mm512_loadu_ps(s.acc.data() + (r0 + i) * D + 16 * v), factor);
    }
  }
  for (int pair = lo / 2; pair < (hi + 1) / 2; ++pair) {
    ahead.step();
    const int j = 2 * pair;
    const __mmask32 first_in = j >= lo ? ~0u : 0u, second_in = j + 1 < hi ? ~0u : 0u;
    __m512i pairs[V];
    for (int c = 0; c < D / 32; ++c) {
      const __m512i a = _mm512_maskz_loadu_epi16(first_in, values + j * stride + 32 * c);
      const __m512i b = _mm512_maskz_loadu_epi16(second_in, values + (j + 1) * stride + 32 * c);
      pairs[2 * c] = _mm512_unpacklo_epi16(a, b);
      pairs[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
    for (int i = 0; i < R; ++i) {
      const uint32_t weight = s.weights[(r0 + i) * 8 + pair];
      for (int v = 0; v < V; ++v) acc[i][v] = dot(acc[i][v], pairs[v], weight);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(s.acc.data() + (r0 + i) * D + 16 * v, acc[i][v]);
  }
}

// Rows r0 .. r0 + R - 1 of one kv head over a transposed slice.
template <int D, int R>
PAGEDLLM_BF16_DOTS inline void slice_rows(const at::BFloat16* values, int64_t stride, int lo,
                                          int hi, int r0, float scale, Scratch& s,
                                          Ahead& ahead) {
  const __mmask16 visible = static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
  float rescale[R];
  slice_weights<D, R>(r0, visible, scale, s, rescale);
  slice_values<D, R>(values, stride, lo, hi, r0, rescale, s, ahead);
}

template <int D>
PAGEDLLM_BF16_DOTS inline void slice_group(const at::BFloat16* values, int64_t stride, int lo,
                                           int hi, int r0, int rows, float scale, Scratch& s,
                                           Ahead& ahead) {
  constexpr int G = kGroupRows<D>;
  for (int r = r0; r < r0 + rows; r += G) {
    switch (std::min(G, r0 + rows - r)) {
      case 1: slice_rows<D, 1>(values, stride, lo, hi, r, scale, s, ahead); break;
      case 2: slice_rows<D, 2>(values, stride, lo, hi, r, scale, s, ahead); break;
      case 3:
        if constexpr (G >= 3) slice_rows<D, 3>(values, stride, lo, hi, r, scale, s, ahead);
        break;
      default:
        if constexpr (G >= 4) slice_rows<D, 4>(values, stride, lo, hi, r, scale, s, ahead);
        break;
    }
  }
}

// Row r's output: its sums in d order over their weights' sum, rounded once to bf16. Sum
// vector 2c (+1) holds, in 128-bit lane q, d = 32c + 8q (+4) + 0..3 (the interleave's order).
template <int D>
inline void store_row(const float* acc, float l, at::BFloat16* out) {
  const float inv = 1.0f / l;
  for (int v = 0; v < D / 16; ++v) {
    for (int lane = 0; lane < 16; ++lane) {
      const int d = 32 * (v / 2) + 8 * (lane / 4) + 4 * (v % 2) + lane % 4;
      out[d] = static_cast<at::BFloat16>(acc[16 * v + lane] * inv);
    }
  }
}

// Attention of one decode, written to d.out. Blocks are taken in order, each token's kv
// heads one after another (one contiguous run), the next block prefetched meanwhile.
template <int D>
PAGEDLLM_BF16_DOTS void attend_decode(const Decode& d, Scratch& s) {
  const int heads = d.kv_head_end - d.kv_head_begin, rows = heads * d.group;
  s.reserve(rows, D);
  for (int r = 0; r < rows; ++r) {
    std::memcpy(s.query.data() + r * D / 2, d.query + r * d.query_head_stride, D * 2);
    std::fill_n(s.acc.data() + r * D, D, 0.0f);
    s.m[r] = pagedllm_vec::kNegInf;
    s.l[r] = 0.0f;
  }
  const int64_t head0 = static_cast<int64_t>(d.kv_head_begin) * D;
  Ahead ahead{d, 0, head0, heads * D};
  // A block's value pairs, over which the next one is prefetched.
  const int pairs = d.block_size / 2 * heads * ((d.group + kGroupRows<D> - 1) / kGroupRows<D>);
  for (int b = d.first / d.block_size; b * d.block_size < d.limit; ++b) {
    const int t0 = b * d.block_size;
    const int64_t block = d.block_table[b] * d.block_stride;
    const int next_n = std::clamp(d.limit - t0 - d.block_size, 0, d.block_size);
    ahead.start(next_n ? d.block_table[b + 1] * d.block_stride : 0, next_n, pairs);
    for (int k0 = 0; k0 < d.block_size && t0 + k0 < d.limit; k0 += kSliceKeys) {
      const int lo = std::max(0, d.first - t0 - k0), hi = std::min(kSliceKeys, d.limit - t0 - k0);
      if (hi <= lo) continue;  // a slice wholly before a window
      for (int h = 0; h < heads; ++h) {
        const int64_t at = block + k0 * d.token_stride + head0 + h * D;
        transpose_slice<D>(d.key_cache + at, d.token_stride, s.keys_t.data());
        slice_group<D>(d.value_cache + at, d.token_stride, lo, hi, h * d.group, d.group,
                       d.scale, s, ahead);
      }
    }
    ahead.finish();
  }
  for (int r = 0; r < rows; ++r) store_row<D>(s.acc.data() + r * D, s.l[r], d.out + r * D);
}

}  // namespace pagedllm_decode_dots
