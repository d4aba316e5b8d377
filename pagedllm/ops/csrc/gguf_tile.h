// The vector body of gguf_linear.cpp, written once and compiled once per instruction set.
//
// gguf_linear.cpp includes this file twice: in namespace `avx2_path` with the file's
// baseline (AVX2 + FMA), and in `vnni_path` under `#pragma GCC target` for AVX-512 VNNI.
// Before each include it defines `block_dots<BITS, HALVES>(wv, digits, dots)`: the integer
// dots of one 32-wide block of the tile's 8 columns with one row's 32 int8 digits, as
// HALVES sums of 32 / HALVES values each (Q6_K scales blocks of 16). The dots are exact
// integers on both paths, and everything after them is the same code, so the two paths
// and the portable one give the same bits.
//
// Expects from the includer: gguf_layout.h's names, Activations, Weights, Output,
// gguf_epilogue.h, block_dots as above, kRowsPerPass (rows a pass keeps in registers: 4 or
// 8) and wide_tiles<R, BITS, DIGITS, KQUANT, HALVES>(a, w, row, tile_begin, tile_end, out),
// which runs the tiles it has a better body for (pairs of tiles in 512-bit registers on the
// VNNI path, 4-, 5-, 6- and 8-bit tiles on AVX2) and returns the first one it left.

// The tile-block's weights as 8 groups of 4 consecutive k for its 8 columns, one byte a
// weight (values below 2^BITS). Layout (gguf_linear.py packs it): 4-, 5- and 6-bit weights
// keep their low nibbles in 128 bytes (groups g and g+4 share a byte); 5-bit add one plane
// of 32 bytes whose bit g is group g's high bit; 6-bit add two planes of 32 bytes whose
// bits 2s..2s+1 of plane v are group 4v+s's high bits. 8-bit weights are 256 plain bytes.
template <int BITS>
PAGEDLLM_ALWAYS_INLINE void unpack_tile_block(const uint8_t* p, __m256i (&wv)[8]) {
  if constexpr (BITS == 8) {
    for (int g = 0; g < 8; ++g) wv[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * g));
    return;
  } else {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    for (int g = 0; g < 4; ++g) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * g));
      wv[g] = _mm256_and_si256(v, low_nibbles);
      wv[g + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
    }
    if constexpr (BITS == 5) {
      // Bit g of each byte to bit 4. 16-bit shifts: bit 4 of either byte of a lane comes
      // from the same byte for shifts of at most 4 left or 3 right.
      const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128));
      const __m256i bit4 = _mm256_set1_epi8(0x10);
      wv[0] = _mm256_or_si256(wv[0], _mm256_and_si256(_mm256_slli_epi16(plane, 4), bit4));
      wv[1] = _mm256_or_si256(wv[1], _mm256_and_si256(_mm256_slli_epi16(plane, 3), bit4));
      wv[2] = _mm256_or_si256(wv[2], _mm256_and_si256(_mm256_slli_epi16(plane, 2), bit4));
      wv[3] = _mm256_or_si256(wv[3], _mm256_and_si256(_mm256_slli_epi16(plane, 1), bit4));
      wv[4] = _mm256_or_si256(wv[4], _mm256_and_si256(plane, bit4));
      wv[5] = _mm256_or_si256(wv[5], _mm256_and_si256(_mm256_srli_epi16(plane, 1), bit4));
      wv[6] = _mm256_or_si256(wv[6], _mm256_and_si256(_mm256_srli_epi16(plane, 2), bit4));
      wv[7] = _mm256_or_si256(wv[7], _mm256_and_si256(_mm256_srli_epi16(plane, 3), bit4));
    }
    if constexpr (BITS == 6) {
      const __m256i bits45 = _mm256_set1_epi8(0x30);
      for (int v = 0; v < 2; ++v) {
        const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * v));
        __m256i* w = wv + 4 * v;
        w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_slli_epi16(plane, 4), bits45));
        w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_slli_epi16(plane, 2), bits45));
        w[2] = _mm256_or_si256(w[2], _mm256_and_si256(plane, bits45));
        w[3] = _mm256_or_si256(w[3], _mm256_and_si256(_mm256_srli_epi16(plane, 2), bits45));
      }
    }
  }
}

// The block's scale and min for each half and the tile's 8 columns: the float tables
// (Q4_0, Q4_1, Q8_0, packed checkpoints' groups; gguf_scales.h), or, for K-quants, a float per super-block of 256 times an int8 per
// sub-block (the products are exact in fp32: an fp16 times a 6- or 8-bit integer).
template <bool KQUANT, int HALVES>
PAGEDLLM_ALWAYS_INLINE void block_scales(const Weights& w, int64_t tile, int64_t b, __m256 (&d)[HALVES],
                         __m256 (&m)[HALVES]) {
  if constexpr (!KQUANT) {
    const int64_t at = (tile * w.scale_groups + (b >> w.scale_shift)) * kTileCols;
    d[0] = scales8(w, at);
    m[0] = mins8(w, at, d[0]);
  } else {
    const int64_t super_at = (tile * w.super_blocks + b * kBlock / kSuperBlock) * kTileCols;
    const __m256 super_d = _mm256_loadu_ps(w.super_d + super_at);
    const __m256 super_m = _mm256_loadu_ps(w.super_m + super_at);
    for (int h = 0; h < HALVES; ++h) {
      const int64_t sub_at = (tile * w.blocks * HALVES + b * HALVES + h) * kTileCols;
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sub_sc + sub_at))));
      const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sub_mn + sub_at))));
      d[h] = _mm256_mul_ps(super_d, sc);
      m[h] = _mm256_mul_ps(super_m, mn);
    }
  }
}

// A pass's R rows of one tile's 8 columns written out; the last tile may be part padding.
template <int R>
PAGEDLLM_ALWAYS_INLINE void store_tile_rows(const __m256 (&acc)[R], int64_t row, int64_t tile,
                                            const Output& out) {
  const int64_t n0 = tile * kTileCols;
  const int64_t valid = std::min<int64_t>(kTileCols, out.cols - n0);
  for (int r = 0; r < R; ++r) {
    float* dst = out.data + (row + r) * out.stride + n0;
    if (valid == kTileCols) {
      _mm256_storeu_ps(dst, acc[r]);
    } else {
      alignas(32) float tmp[kTileCols];
      _mm256_store_ps(tmp, acc[r]);
      std::memcpy(dst, tmp, valid * sizeof(float));
    }
  }
}

template <int R, int BITS, int DIGITS, bool KQUANT, int HALVES>
void vector_tile(const Activations& a, const Weights& w, int64_t row, int64_t tile,
                 const Output& out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* tile_base = w.packed + tile * w.tile_bytes;
  const int64_t bytes = block_bytes(BITS);
  for (int64_t b = 0; b < w.blocks; ++b) {
    if (streams<R>(row)) prefetch_ahead<1, BITS>(w, tile, b);
    __m256i wv[8];
    unpack_tile_block<BITS>(tile_base + b * bytes, wv);
    __m256 d[HALVES], m[HALVES];
    block_scales<KQUANT, HALVES>(w, tile, b, d, m);
    // Unrolled, so the rows' accumulators stay in registers (GCC kept them on the stack
    // and ran the rows as a loop).
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m256i dots[HALVES];
      block_dots<BITS, HALVES>(wv, a.hi(row + r, b), dots);
      if constexpr (DIGITS == 2) {
        __m256i low[HALVES];
        block_dots<BITS, HALVES>(wv, a.lo(row + r, b), low);
        for (int h = 0; h < HALVES; ++h) dots[h] = _mm256_add_epi32(_mm256_slli_epi32(dots[h], 8), low[h]);
      }
      acc[r] = block_epilogue<Lanes8, HALVES>(acc[r], dots, d, m, a, a.at(row + r, b));
    }
  }
  store_tile_rows<R>(acc, row, tile, out);
}

// One pass of R rows over the item's tiles: wide_tiles takes what it can (pairs of tiles on
// the VNNI path, 4-, 5-, 6- and 8-bit tiles on AVX2) and vector_tile the rest.
template <int R, int BITS, int DIGITS, bool KQUANT, int HALVES>
void rows_pass(const Activations& a, const Weights& w, int64_t row, int64_t tile_begin,
               int64_t tile_end, const Output& out) {
  int64_t t = wide_tiles<R, BITS, DIGITS, KQUANT, HALVES>(a, w, row, tile_begin, tile_end, out);
  for (; t < tile_end; ++t) vector_tile<R, BITS, DIGITS, KQUANT, HALVES>(a, w, row, t, out);
}

// Rows [row_begin, rows) of the item's tiles.
template <int BITS, int DIGITS, bool KQUANT, int HALVES>
void vector_item(const Activations& a, const Weights& w, int64_t row_begin, int64_t rows,
                 int64_t tile_begin, int64_t tile_end, const Output& out) {
  // Rows outer: a pass's few activation rows stay in L1 while the item's tiles (32 columns
  // of weights: 72-458 KB at the default model's to an 8B model's shapes) come from L2.
  // The rows left after the full passes go in passes of 4, 2 and 1.
  int64_t row = row_begin;
  for (; row + kRowsPerPass <= rows; row += kRowsPerPass)
    rows_pass<kRowsPerPass, BITS, DIGITS, KQUANT, HALVES>(a, w, row, tile_begin, tile_end, out);
  if constexpr (kRowsPerPass > 4) {
    if (rows - row >= 4) {
      rows_pass<4, BITS, DIGITS, KQUANT, HALVES>(a, w, row, tile_begin, tile_end, out);
      row += 4;
    }
  }
  if (rows - row >= 2) {
    rows_pass<2, BITS, DIGITS, KQUANT, HALVES>(a, w, row, tile_begin, tile_end, out);
    row += 2;
  }
  if (rows - row >= 1) rows_pass<1, BITS, DIGITS, KQUANT, HALVES>(a, w, row, tile_begin, tile_end, out);
}

template <int BITS, bool KQUANT, int HALVES>
void vector_digits(const Activations& a, const Weights& w, int64_t rows, int64_t tile_begin,
                   int64_t tile_end, int digits, const Output& out) {
  if (digits == 2) return vector_item<BITS, 2, KQUANT, HALVES>(a, w, 0, rows, tile_begin, tile_end, out);
  return vector_item<BITS, 1, KQUANT, HALVES>(a, w, 0, rows, tile_begin, tile_end, out);
}

// The combinations the GGUF types use: Q4_0/Q4_1 (4, float), Q5_0 (5, float), Q8_0 (8,
// float), Q4_K (4, K), Q5_K (5, K), Q6_K (6, K, halves of 16).
inline void vector_dispatch(const Activations& a, const Weights& w, int64_t rows,
                            int64_t tile_begin, int64_t tile_end, int digits, const Output& out) {
  const bool kquant = w.super_d != nullptr;
  if (!kquant && w.bits == 4) return vector_digits<4, false, 1>(a, w, rows, tile_begin, tile_end, digits, out);
  if (!kquant && w.bits == 5) return vector_digits<5, false, 1>(a, w, rows, tile_begin, tile_end, digits, out);
  if (!kquant) return vector_digits<8, false, 1>(a, w, rows, tile_begin, tile_end, digits, out);
  if (w.bits == 4) return vector_digits<4, true, 1>(a, w, rows, tile_begin, tile_end, digits, out);
  if (w.bits == 5) return vector_digits<5, true, 1>(a, w, rows, tile_begin, tile_end, digits, out);
  return vector_digits<6, true, 2>(a, w, rows, tile_begin, tile_end, digits, out);
}
