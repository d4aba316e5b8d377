// AMX's tile operations as attention_amx.h is written in them (tilezero, tileloadd,
// tdpbf16ps, tilestored; every tile 16 rows of 64 bytes, attention_amx.h's configure_tiles),
// and the 16 x 16 transpose both tile engines use (attention_amx.h, attention_dots.h and
// decode_dots.h).
//
// A tile product C[m][n] += sum_k A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1] over k < 16,
// summed in fp32. attention_dots.h does the same products on AVX512-BF16 dot products for
// CPUs without AMX; the last bits of a sum may differ between the two engines (the order of
// a pair's two products and the accumulator).
//
// Tile numbers are template arguments (AMX's intrinsics take them as literal tokens), so
// the operations are spelled out for each number and product used.
#pragma once

#include <immintrin.h>

#include <cstdint>

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

}  // namespace pagedllm_tiles
