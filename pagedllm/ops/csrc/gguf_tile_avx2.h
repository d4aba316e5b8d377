// The AVX2 path's main loops for 4-bit weights (Q4_K, Q4_0, Q4_1 and 4-bit packed
// checkpoints), 5-bit (Q5_K, Q5_0), Q6_K and 8-bit weights, included in `avx2_path` only,
// after gguf_tile.h.
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
//
// Every pass fetches its tile's blocks ahead, not only a work item's first (streams): the
// later passes read the tiles from L2, and their loads stalled the rows' sums, as on the VNNI
// path (stream_pair_tile). Two threads, Llama-3.2-1B's gate+up (Q4_K) at 32 and 256 rows
// 9.01 -> 8.03 and 77.1 -> 63.9 ms, its head (Q6_K) 105 -> 87 and 825 -> 687, Q5_K's gate+up
// at 32 rows 21.6 -> 18.1 on one thread; 1-4 rows within 3% (AMD Zen 5 on this path,
// benchmarks.gguf_kernel_ab --isa 1).

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
    prefetch_ahead<1, 4>(w, tile, b);
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

// Q6_K's tiles, one half (16 weights of each column, 4 groups) at a time. vector_tile kept
// the block's 8 unpacked groups live beside 4 rows' accumulators and the sums, which spilled
// with AVX2's 16 registers; a half needs 4. Each half's two pairs of groups are summed in
// int16 (two groups of 6-bit weights stay below 2^15) and widened by vpmaddwd, which also
// applies the high digit's factor of 256, so the integer dots are block_dots' and the
// float epilogue runs per row in vector_tile's order: the same bits. Llama-3.2-1B's v and
// down projections at 16-256 rows: 57-95 integer GOP/s against 44-71 (four alternating
// rounds, AMD EPYC, benchmarks.gguf_matmul's shapes); at one and two rows no slower.
template <int R, int DIGITS>
void six_bit_tile(const Activations& a, const Weights& w, int64_t row, int64_t tile, const Output& out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* tile_base = w.packed + tile * w.tile_bytes;
  constexpr int64_t bytes = block_bytes(6);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  const __m256i ones = _mm256_set1_epi16(1), high_digit = _mm256_set1_epi16(256);
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* block = tile_base + b * bytes;
    prefetch_ahead<1, 6>(w, tile, b);
    const int64_t at = a.at(row, b);
    const int8_t* digits = a.hi(row, b);  // the pass's rows follow, DIGITS * kBlock apart
    __m256 d[2], m[2];
    block_scales<true, 2>(w, tile, b, d, m);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
      const __m256i high_bits[4] = {
          _mm256_and_si256(_mm256_slli_epi16(plane, 4), bits45),
          _mm256_and_si256(_mm256_slli_epi16(plane, 2), bits45), _mm256_and_si256(plane, bits45),
          _mm256_and_si256(_mm256_srli_epi16(plane, 2), bits45)};
      __m256i wv[4];
      for (int s = 0; s < 4; ++s) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * s));
        const __m256i nibbles = h == 0 ? v : _mm256_srli_epi16(v, 4);
        wv[s] = _mm256_or_si256(_mm256_and_si256(nibbles, low_nibbles), high_bits[s]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m256i dot = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int j = 0; j < DIGITS; ++j) {
          const int8_t* x = digits + (r * DIGITS + j) * kBlock + 16 * h;
          const __m256i factor = DIGITS == 2 && j == 0 ? high_digit : ones;
#pragma GCC unroll 2
          for (int s = 0; s < 4; s += 2) {
            int32_t four_first, four_second;
            std::memcpy(&four_first, x + 4 * s, sizeof(four_first));
            std::memcpy(&four_second, x + 4 * (s + 1), sizeof(four_second));
            const __m256i pairs =
                _mm256_add_epi16(_mm256_maddubs_epi16(wv[s], _mm256_set1_epi32(four_first)),
                                 _mm256_maddubs_epi16(wv[s + 1], _mm256_set1_epi32(four_second)));
            dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, factor));
            keep_chain(dot);
          }
        }
        acc[r] = half_epilogue<Lanes8>(acc[r], dot, d[h], m[h], a.step[at + r], a.sum16[(at + r) * 2 + h]);
      }
    }
  }
  store_tile_rows<R>(acc, row, tile, out);
}

// 5-bit weights (Q5_K, Q5_0), half a block at a time: groups 4h..4h+3 are the 4 nibble runs'
// low (h = 0) or high (h = 1) nibbles, each with its bit of the plane moved to bit 4 as
// unpack_tile_block does. vector_tile kept the block's 8 unpacked groups beside a pass's
// accumulators and sums (44 stack moves in its 4-row body, 26 here). A half's four groups of
// pairs stay below 2^15 in int16 (4 x 7,874) and vpmaddwd widens them with the high digit's
// factor of 256, so each row's block sum is block_dots' integer and block_epilogue runs once
// a block, in vector_tile's order: the same bits. Llama-3.2-1B's projections as Q5_K, one
// thread at 4-256 rows: q+k 69-72 -> 94-96 integer GOP/s, gate+up 51-103 -> 60-107, down
// 62-109 -> 63-114 (AMD Zen 5 on this path, benchmarks.gguf_kernel_ab --isa 1).
template <int R, int DIGITS, bool KQUANT>
void five_bit_tile(const Activations& a, const Weights& w, int64_t row, int64_t tile, const Output& out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* tile_base = w.packed + tile * w.tile_bytes;
  constexpr int64_t bytes = block_bytes(5);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  const __m256i ones = _mm256_set1_epi16(1), high_digit = _mm256_set1_epi16(256);
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* block = tile_base + b * bytes;
    prefetch_ahead<1, 5>(w, tile, b);
    const int64_t at = a.at(row, b);
    const int8_t* digits = a.hi(row, b);  // the pass's rows follow, DIGITS * kBlock apart
    const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128));
    __m256i dots[R];
    for (int r = 0; r < R; ++r) dots[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256i wv[4];
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * s));
        const __m256i nibbles = h == 0 ? v : _mm256_srli_epi16(v, 4);
        // Bit g = 4h + s of each byte to bit 4 (16-bit shifts, as unpack_tile_block's).
        const int shift = 4 - (4 * h + s);
        const __m256i moved = shift >= 0 ? _mm256_slli_epi16(plane, shift) : _mm256_srli_epi16(plane, -shift);
        wv[s] = _mm256_or_si256(_mm256_and_si256(nibbles, low_nibbles), _mm256_and_si256(moved, bit4));
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
        for (int j = 0; j < DIGITS; ++j) {
          const int8_t* x = digits + (r * DIGITS + j) * kBlock + 16 * h;
          __m256i pairs = _mm256_setzero_si256();
#pragma GCC unroll 4
          for (int s = 0; s < 4; ++s) {
            int32_t four;
            std::memcpy(&four, x + 4 * s, sizeof(four));
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(wv[s], _mm256_set1_epi32(four)));
          }
          const __m256i factor = DIGITS == 2 && j == 0 ? high_digit : ones;
          dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(pairs, factor));
          keep_chain(dots[r]);
        }
      }
    }
    __m256 d[1], m[1];
    block_scales<KQUANT, 1>(w, tile, b, d, m);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i dot[1] = {dots[r]};
      acc[r] = block_epilogue<Lanes8, 1>(acc[r], dot, d, m, a, at + r);
    }
  }
  store_tile_rows<R>(acc, row, tile, out);
}

// 8-bit weights (Q8_0, and Q5_0 repacked as 8-bit), one 32-byte group at a time, split into
// low and high nibbles: vector_tile split all 8 groups at once (24 registers of weights),
// which spilled. A u8 weight times an s8 digit overflows vpmaddubsw's int16 pairs, a nibble
// does not, and the nibbles' pair sums fit int16 over the block's 8 groups. vpmaddwd widens
// them with the factors 16 (high nibble) and 256 (high digit), so the integer dots are
// block_dots' and block_epilogue gives the same bits. Two rows' four sums at two digits (a
// pass of 4 rows runs as two), four rows' at one. Gemma 3 270M's 262k-row head (Q8_0, 640
// in) ran at 20-26 integer GOP/s at one row and 41-46 at 32-256; now 27-30 and 50-65
// (three alternating rounds, AMD EPYC).
template <int R, int DIGITS, bool KQUANT>
void byte_rows(const Activations& a, const Weights& w, int64_t row, int64_t tile, const Output& out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* tile_base = w.packed + tile * w.tile_bytes;
  constexpr int64_t bytes = block_bytes(8);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  // The factors of each sum: [digit][nibble], the high digit and the high nibble first.
  const __m256i factor[2][2] = {
      {_mm256_set1_epi16(DIGITS == 2 ? 4096 : 16), _mm256_set1_epi16(DIGITS == 2 ? 256 : 1)},
      {_mm256_set1_epi16(16), _mm256_set1_epi16(1)}};
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* block = tile_base + b * bytes;
    prefetch_ahead<1, 8>(w, tile, b);
    const int64_t at = a.at(row, b);
    const int8_t* digits = a.hi(row, b);  // the pass's rows follow, DIGITS * kBlock apart
    __m256i pairs[R][DIGITS][2];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < DIGITS; ++j) pairs[r][j][0] = pairs[r][j][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * g));
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
      const __m256i low = _mm256_and_si256(v, low_nibbles);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
        for (int j = 0; j < DIGITS; ++j) {
          int32_t four;
          std::memcpy(&four, digits + (r * DIGITS + j) * kBlock + 4 * g, sizeof(four));
          const __m256i x = _mm256_set1_epi32(four);
          pairs[r][j][0] = _mm256_add_epi16(pairs[r][j][0], _mm256_maddubs_epi16(high, x));
          keep_chain(pairs[r][j][0]);
          pairs[r][j][1] = _mm256_add_epi16(pairs[r][j][1], _mm256_maddubs_epi16(low, x));
          keep_chain(pairs[r][j][1]);
        }
      }
    }
    __m256 d[1], m[1];
    block_scales<KQUANT, 1>(w, tile, b, d, m);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m256i dots[1] = {_mm256_setzero_si256()};
      for (int j = 0; j < DIGITS; ++j)
        for (int n = 0; n < 2; ++n)
          dots[0] = _mm256_add_epi32(dots[0], _mm256_madd_epi16(pairs[r][j][n], factor[j][n]));
      acc[r] = block_epilogue<Lanes8, 1>(acc[r], dots, d, m, a, at + r);
    }
  }
  store_tile_rows<R>(acc, row, tile, out);
}

template <int R, int DIGITS, bool KQUANT>
void byte_tile(const Activations& a, const Weights& w, int64_t row, int64_t tile, const Output& out) {
  if constexpr (DIGITS == 2 && R > 2) {
    for (int r = 0; r < R; r += 2) byte_rows<2, DIGITS, KQUANT>(a, w, row + r, tile, out);
  } else {
    byte_rows<R, DIGITS, KQUANT>(a, w, row, tile, out);
  }
}

// gguf_tile.h's row passes call this first: every type's tiles run here.
template <int R, int BITS, int DIGITS, bool KQUANT, int HALVES>
int64_t wide_tiles(const Activations& a, const Weights& w, int64_t row, int64_t tile_begin,
                   int64_t tile_end, const Output& out) {
  if constexpr (BITS == 5) {
    static_assert(HALVES == 1, "5-bit blocks have one scale each");
    for (int64_t t = tile_begin; t < tile_end; ++t) five_bit_tile<R, DIGITS, KQUANT>(a, w, row, t, out);
    return tile_end;
  }
  if constexpr (BITS == 4) {
    static_assert(HALVES == 1, "4-bit blocks have one scale each");
    for (int64_t t = tile_begin; t < tile_end; ++t) nibble_tile<R, DIGITS, KQUANT>(a, w, row, t, out);
    return tile_end;
  }
  if constexpr (BITS == 8) {
    for (int64_t t = tile_begin; t < tile_end; ++t) byte_tile<R, DIGITS, KQUANT>(a, w, row, t, out);
    return tile_end;
  }
  if constexpr (BITS == 6 && KQUANT) {
    for (int64_t t = tile_begin; t < tile_end; ++t) six_bit_tile<R, DIGITS>(a, w, row, t, out);
    return tile_end;
  }
  return tile_begin;
}
