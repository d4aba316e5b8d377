// The AVX2 path's main loop for 4-bit weights (Q4_K, Q4_0, Q4_1 and 4-bit packed
// checkpoints), included in `avx2_path` only, after gguf_tile.h.
//
// gguf_tile.h's vector_tile unpacks a block's 8 weight groups into 8 registers and keeps a
// pass's rows' float accumulators beside them: with AVX2's 16 registers, the int16 pairs,
// the broadcast digits and the scales went through the stack on every block. Here a block is
// taken one 32-byte load at a time: each load holds groups s (low nibbles) and s + 4 (high
// nibbles), so two weight registers are live, beside each row's and digit's int16 sums (8 at
// 4 rows and two digits) and the rows' accumulators: 4-bit projections of a Llama-3.2-1B
// shape ran at 134-150 integer GOP/s at 16-256 rows against 106-123 (AMD EPYC, AVX2,
// benchmarks.gguf_matmul; a float buffer in L1 in place of the accumulators' registers ran
// at 85-175, from process to process).
//
// The integer dots are the ones block_dots computes (the same products, summed in int16 over
// the block's 8 groups, which 4-bit weights allow, then widened), and block_epilogue applies
// the same float operations in the same order, so this gives the bits vector_tile gives.

template <int R, int DIGITS, bool KQUANT>
void nibble_tile(const Activations& a, const Weights& w, int64_t row, int64_t tile,
                 const Output& out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* tile_base = w.packed + tile * w.tile_bytes;
  constexpr int64_t bytes = block_bytes(4);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* block = tile_base + b * bytes;
    if constexpr (R <= kPrefetchRows) prefetch_block(block + kPrefetchBlocks * bytes, bytes);
    const int64_t at = a.at(row, b);
    const int8_t* digits = a.hi(row, b);  // the pass's rows follow, DIGITS * kBlock apart
    __m256i pairs[R][DIGITS];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < DIGITS; ++j) pairs[r][j] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * s));
      const __m256i first = _mm256_and_si256(v, low_nibbles);
      const __m256i second = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
        for (int j = 0; j < DIGITS; ++j) {
          const int8_t* x = digits + (r * DIGITS + j) * kBlock;
          int32_t four_first, four_second;
          std::memcpy(&four_first, x + 4 * s, sizeof(four_first));
          std::memcpy(&four_second, x + 4 * (s + 4), sizeof(four_second));
          pairs[r][j] = _mm256_add_epi16(
              pairs[r][j], _mm256_maddubs_epi16(first, _mm256_set1_epi32(four_first)));
          keep_chain(pairs[r][j]);
          pairs[r][j] = _mm256_add_epi16(
              pairs[r][j], _mm256_maddubs_epi16(second, _mm256_set1_epi32(four_second)));
          keep_chain(pairs[r][j]);
        }
      }
    }
    __m256 d[1], m[1];
    block_scales<KQUANT, 1>(w, tile, b, d, m);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m256i dots[1] = {_mm256_madd_epi16(pairs[r][0], ones)};
      if constexpr (DIGITS == 2)
        dots[0] = _mm256_add_epi32(_mm256_slli_epi32(dots[0], 8), _mm256_madd_epi16(pairs[r][1], ones));
      acc[r] = block_epilogue<Lanes8, 1>(acc[r], dots, d, m, a, at + r);
    }
  }
  store_tile_rows<R>(acc, row, tile, out);
}

// gguf_tile.h's row passes call this first: 4-bit tiles run here, the rest in vector_tile.
template <int R, int BITS, int DIGITS, bool KQUANT, int HALVES>
int64_t wide_tiles(const Activations& a, const Weights& w, int64_t row, int64_t tile_begin,
                   int64_t tile_end, const Output& out) {
  if constexpr (BITS == 4) {
    static_assert(HALVES == 1, "4-bit blocks have one scale each");
    for (int64_t t = tile_begin; t < tile_end; ++t) nibble_tile<R, DIGITS, KQUANT>(a, w, row, t, out);
    return tile_end;
  }
  return tile_begin;
}
