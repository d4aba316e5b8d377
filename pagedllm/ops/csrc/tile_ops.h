// The tile operations attention_amx.h is written in, on two engines:
//
// - AmxTiles: AMX itself (tilezero, tileloadd, tdpbf16ps, tilestored), every tile 16 rows
//   of 64 bytes (attention_amx.h's configure_tiles);
// - DotTiles: the same operations on AVX512-BF16 dot products, for CPUs without AMX whose
//   `vdpbf16ps` runs at least at the fp32 FMA rate (AMD Zen 4/5). A and B operands are read
//   where they lie (a load notes the address and row stride), C tiles are fp32 arrays.
//
// A tile product C[m][n] += sum_k A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1] over
// k < 16 is, per row m of C, `vdpbf16ps` of A[m]'s k-th pair broadcast against B's row k:
// sixteen rows of sixteen dot products. Both engines sum in fp32; the last bits of a sum may
// differ between them (the order of the pair's two products and the accumulator).
//
// Tile numbers are template arguments (AMX's intrinsics take them as literal tokens), so
// the AMX engine's operations are spelled out for each number and product used.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define PAGEDLLM_AMX \
  __attribute__((target("avx2,fma,avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")))
#define PAGEDLLM_BF16_DOTS __attribute__((target("avx2,fma,avx512f,avx512bw,avx512bf16")))

namespace pagedllm_tiles {

constexpr int kTileRows = 16;
constexpr int kTileDwords = 16 * 16;

// Rows i of r become columns: r[k][i] = r_in[i][k], 16 x 16 dwords (AVX-512 alone: the
// tiles of attention_amx.h and the decode slices of decode_dots.h).
PAGEDLLM_BF16_DOTS inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4g + c]: column c, c + 4, c + 8, c + 12 of rows 4g .. 4g + 3, a 128-bit lane each.
  for (int g = 0; g < 4; ++g) {
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  // t[2c], t[2c + 1] (and t[8 + ...] for rows 8-15): columns c, c + 8 and c + 4, c + 12 of
  // rows 0-7, as 128-bit lanes.
  for (int h = 0; h < 2; ++h) {
    for (int c = 0; c < 4; ++c) {
      t[8 * h + 2 * c] = _mm512_shuffle_i32x4(u[8 * h + c], u[8 * h + 4 + c], 0x88);
      t[8 * h + 2 * c + 1] = _mm512_shuffle_i32x4(u[8 * h + c], u[8 * h + 4 + c], 0xdd);
    }
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[2 * c], t[8 + 2 * c], 0x88);
    r[c + 8] = _mm512_shuffle_i32x4(t[2 * c], t[8 + 2 * c], 0xdd);
    r[c + 4] = _mm512_shuffle_i32x4(t[2 * c + 1], t[8 + 2 * c + 1], 0x88);
    r[c + 12] = _mm512_shuffle_i32x4(t[2 * c + 1], t[8 + 2 * c + 1], 0xdd);
  }
}

// ---- AMX ---------------------------------------------------------------------------------

struct AmxTiles {};

template <int T>
void zero(AmxTiles&);
template <int T>
void load(AmxTiles&, const void* base, int64_t stride);
template <int T>
void store(AmxTiles&, void* base, int64_t stride);
template <int C, int A, int B>
void dot(AmxTiles&);

#define PAGEDLLM_AMX_TILE(n)                                                               \
  template <>                                                                              \
  PAGEDLLM_AMX inline void zero<n>(AmxTiles&) {                                            \
    _tile_zero(n);                                                                         \
  }                                                                                        \
  template <>                                                                              \
  PAGEDLLM_AMX inline void load<n>(AmxTiles&, const void* base, int64_t stride) {          \
    _tile_loadd(n, base, stride);                                                          \
  }                                                                                        \
  template <>                                                                              \
  PAGEDLLM_AMX inline void store<n>(AmxTiles&, void* base, int64_t stride) {               \
    _tile_stored(n, base, stride);                                                         \
  }
PAGEDLLM_AMX_TILE(0)
PAGEDLLM_AMX_TILE(1)
PAGEDLLM_AMX_TILE(2)
PAGEDLLM_AMX_TILE(3)
PAGEDLLM_AMX_TILE(4)
PAGEDLLM_AMX_TILE(5)
PAGEDLLM_AMX_TILE(6)
PAGEDLLM_AMX_TILE(7)
#undef PAGEDLLM_AMX_TILE

#define PAGEDLLM_AMX_DOT(c, a, b)                      \
  template <>                                          \
  PAGEDLLM_AMX inline void dot<c, a, b>(AmxTiles&) {   \
    _tile_dpbf16ps(c, a, b);                           \
  }
PAGEDLLM_AMX_DOT(0, 2, 3)
PAGEDLLM_AMX_DOT(1, 4, 3)
PAGEDLLM_AMX_DOT(0, 5, 6)
PAGEDLLM_AMX_DOT(1, 5, 7)
PAGEDLLM_AMX_DOT(2, 5, 6)
PAGEDLLM_AMX_DOT(3, 5, 7)
PAGEDLLM_AMX_DOT(0, 4, 5)
PAGEDLLM_AMX_DOT(1, 4, 5)
PAGEDLLM_AMX_DOT(2, 4, 5)
PAGEDLLM_AMX_DOT(3, 4, 5)
#undef PAGEDLLM_AMX_DOT

// ---- AVX512-BF16 dot products ------------------------------------------------------------

// Tiles 0-3 may be C tiles (accumulators), any of 0-7 an A or B operand.
struct DotTiles {
  static constexpr int kAccumulators = 4;
  const char* base[8] = {};
  int64_t stride[8] = {};
  alignas(64) float acc[kAccumulators][kTileDwords];
};

template <int T>
PAGEDLLM_BF16_DOTS inline void zero(DotTiles& t) {
  static_assert(T < DotTiles::kAccumulators, "only tiles 0-3 accumulate");
  for (int m = 0; m < kTileRows; ++m) _mm512_store_ps(t.acc[T] + 16 * m, _mm512_setzero_ps());
}

template <int T>
PAGEDLLM_BF16_DOTS inline void load(DotTiles& t, const void* base, int64_t stride) {
  t.base[T] = static_cast<const char*>(base);
  t.stride[T] = stride;
}

template <int T>
PAGEDLLM_BF16_DOTS inline void store(DotTiles& t, void* base, int64_t stride) {
  static_assert(T < DotTiles::kAccumulators, "only tiles 0-3 accumulate");
  for (int m = 0; m < kTileRows; ++m) {
    _mm512_storeu_ps(static_cast<char*>(base) + m * stride, _mm512_load_ps(t.acc[T] + 16 * m));
  }
}

template <int C, int A, int B>
PAGEDLLM_BF16_DOTS inline void dot(DotTiles& t) {
  static_assert(C < DotTiles::kAccumulators, "only tiles 0-3 accumulate");
  const char* a = t.base[A];
  const char* b = t.base[B];
  const int64_t a_stride = t.stride[A], b_stride = t.stride[B];
  __m512 c[kTileRows];
  for (int m = 0; m < kTileRows; ++m) c[m] = _mm512_load_ps(t.acc[C] + 16 * m);
  for (int k = 0; k < 16; ++k) {
    const __m512bh row = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + k * b_stride));
    for (int m = 0; m < kTileRows; ++m) {
      int32_t pair;
      std::memcpy(&pair, a + m * a_stride + 4 * k, sizeof(pair));
      c[m] = _mm512_dpbf16_ps(c[m], reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair)), row);
    }
  }
  for (int m = 0; m < kTileRows; ++m) _mm512_store_ps(t.acc[C] + 16 * m, c[m]);
}

}  // namespace pagedllm_tiles
