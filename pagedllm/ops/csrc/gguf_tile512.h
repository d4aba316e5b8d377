// Two neighbouring tiles (16 columns) in 512-bit registers: the VNNI path's main loop.
//
// gguf_linear.cpp includes this file in `vnni_path` only, after block_dots and
// gguf_epilogue.h and before gguf_tile.h. It defines `wide_tiles`, which gguf_tile.h's row passes call first: it runs
// the pairs of tiles of [tile_begin, tile_end) and returns the first tile it left (the odd
// one), which the 256-bit vector_tile then runs. Each vpdpbusd here serves 16 columns
// instead of 8, and the weights are unpacked once per block for all of a pass's rows: all 8
// groups at once for a pass of one or two rows (pair_tile), one group at a time for 4 and 8
// (stream_pair_tile; a Q6_K half's 4 groups at a time at two digits).
//
// The packed layout is the 8-column one: a pair's block is the two tiles' blocks side by
// side in one register (the first tile in the low half). Every lane does the same integer
// dot, and block_epilogue the same float operations, as gguf_tile.h's vector_tile does for
// its column, so both give the same bits.

struct Lanes16 {
  using F = __m512;
  using I = __m512i;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F mul(F x, F y) { return _mm512_mul_ps(x, y); }
  static F fmadd(F x, F y, F z) { return _mm512_fmadd_ps(x, y, z); }
  static F to_float(I x) { return _mm512_cvtepi32_ps(x); }
};

// The 32-byte runs at `first` and `second` as the low and high halves of one register.
inline __m512i join_bytes(const uint8_t* first, const uint8_t* second) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second)), 1);
}

inline __m512 join_floats(const float* first, const float* second) {
  return _mm512_castpd_ps(_mm512_insertf64x4(
      _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(first))),
      _mm256_castps_pd(_mm256_loadu_ps(second)), 1));
}

// 8 int8 values at `first` and 8 at `second` as 16 floats.
inline __m512 join_int8_as_floats(const int8_t* first, const int8_t* second) {
  const __m128i bytes =
      _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(first)),
                         _mm_loadl_epi64(reinterpret_cast<const __m128i*>(second)));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

// The 16-bit scales at `first` and `second` (8 each) as one register.
inline __m256i join_8_halves(const void* table, int64_t first, int64_t second) {
  const uint16_t* halves = static_cast<const uint16_t*>(table);
  return _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + first))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + second)), 1);
}

// gguf_scales.h's scales8 for the pair's two tiles, converted 16 at a time.
inline __m512 pair_scales16(const Weights& w, int64_t first, int64_t second) {
  switch (w.scale_type) {
    case kScaleF16:
      return _mm512_cvtph_ps(join_8_halves(w.scales, first, second));
    case kScaleBF16:
      return _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(join_8_halves(w.scales, first, second)), 16));
    default: {
      const float* scales = static_cast<const float*>(w.scales);
      return join_floats(scales + first, scales + second);
    }
  }
}

// gguf_scales.h's mins8 for the pair: the same per-lane operations.
inline __m512 pair_mins16(const Weights& w, int64_t first, int64_t second, __m512 d) {
  if (w.mins != nullptr) return join_floats(w.mins + first, w.mins + second);
  if (w.zeros == nullptr) return _mm512_mul_ps(d, _mm512_set1_ps(w.min_factor));
  const __m128i zeros =
      _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.zeros + first)),
                         _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.zeros + second)));
  const __m512 zero = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(zeros));
  return _mm512_mul_ps(d, _mm512_castsi512_ps(_mm512_xor_si512(
                              _mm512_castps_si512(zero), _mm512_set1_epi32(INT32_MIN))));
}

// acc |= (v & mask): one vpternlogd (0xF8 is A | (B & C)).
inline __m512i or_masked(__m512i acc, __m512i v, __m512i mask) {
  return _mm512_ternarylogic_epi32(acc, v, mask, 0xF8);
}

// The high-bit planes of the pair's block (5-bit weights: one, 6-bit: two; none else).
template <int BITS>
PAGEDLLM_ALWAYS_INLINE void pair_planes(const uint8_t* first, const uint8_t* second, __m512i (&planes)[2]) {
  planes[0] = planes[1] = _mm512_setzero_si512();
  if constexpr (BITS == 5 || BITS == 6) planes[0] = join_bytes(first + 128, second + 128);
  if constexpr (BITS == 6) planes[1] = join_bytes(first + 160, second + 160);
}

// unpack_tile_block's (gguf_tile.h) group g (0-7) for the pair: the same bit moves on both
// halves, from the block's nibble run g % 4 and its high-bit planes (pair_planes).
template <int BITS>
PAGEDLLM_ALWAYS_INLINE __m512i pair_group(const uint8_t* first, const uint8_t* second, int g,
                                          const __m512i (&planes)[2]) {
  if constexpr (BITS == 8) {
    return join_bytes(first + 32 * g, second + 32 * g);
  } else {
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
    const __m512i v = join_bytes(first + 32 * (g % 4), second + 32 * (g % 4));
    __m512i q = _mm512_and_si512(g < 4 ? v : _mm512_srli_epi16(v, 4), low_nibbles);
    if constexpr (BITS == 5 || BITS == 6) {
      // Bit g (5-bit) or bits 2(g % 4)..+1 of plane g / 4 (6-bit) to bit 4 (and 5). 16-bit
      // shifts: those bits of either byte of a lane come from the same byte.
      const int shift = BITS == 5 ? 4 - g : 4 - 2 * (g % 4);
      const __m512i plane = planes[BITS == 5 ? 0 : g / 4];
      const __m512i moved = shift >= 0 ? _mm512_slli_epi16(plane, shift) : _mm512_srli_epi16(plane, -shift);
      q = or_masked(q, moved, _mm512_set1_epi8(BITS == 5 ? 0x10 : 0x30));
    }
    return q;
  }
}

// The pair's whole block, as unpack_tile_block lays a tile's out.
template <int BITS>
PAGEDLLM_ALWAYS_INLINE void unpack_pair_block(const uint8_t* first, const uint8_t* second, __m512i (&wv)[8]) {
  __m512i planes[2];
  pair_planes<BITS>(first, second, planes);
  for (int g = 0; g < 8; ++g) wv[g] = pair_group<BITS>(first, second, g, planes);
}

// block_scales (gguf_tile.h) for the pair: the products are the same per lane.
template <bool KQUANT, int HALVES>
PAGEDLLM_ALWAYS_INLINE void pair_block_scales(const Weights& w, int64_t tile, int64_t b, __m512 (&d)[HALVES],
                              __m512 (&m)[HALVES]) {
  if constexpr (!KQUANT) {
    const int64_t at = (tile * w.scale_groups + (b >> w.scale_shift)) * kTileCols;
    const int64_t next = w.scale_groups * kTileCols;
    d[0] = pair_scales16(w, at, at + next);
    m[0] = pair_mins16(w, at, at + next, d[0]);
  } else {
    const int64_t super_at = (tile * w.super_blocks + b * kBlock / kSuperBlock) * kTileCols;
    const int64_t super_next = w.super_blocks * kTileCols;
    const __m512 super_d = join_floats(w.super_d + super_at, w.super_d + super_at + super_next);
    const __m512 super_m = join_floats(w.super_m + super_at, w.super_m + super_at + super_next);
    const int64_t sub_next = w.blocks * HALVES * kTileCols;
    for (int h = 0; h < HALVES; ++h) {
      const int64_t sub_at = (tile * w.blocks * HALVES + b * HALVES + h) * kTileCols;
      d[h] = _mm512_mul_ps(super_d, join_int8_as_floats(w.sub_sc + sub_at, w.sub_sc + sub_at + sub_next));
      m[h] = _mm512_mul_ps(super_m, join_int8_as_floats(w.sub_mn + sub_at, w.sub_mn + sub_at + sub_next));
    }
  }
}

// acc += w (u8) . the 4 signed bytes at p, broadcast to all 16 lanes by the memory operand.
PAGEDLLM_ALWAYS_INLINE __m512i dot4_wide(__m512i acc, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// Adds one digit's dots to `dots`, each half in two chains (even and odd groups): a pass of
// one or two rows has too few chains to keep the vpdpbusd pipes busy otherwise.
template <int HALVES>
PAGEDLLM_ALWAYS_INLINE void pair_block_dots(const __m512i (&wv)[8], const int8_t* digits, __m512i (&dots)[HALVES]) {
  constexpr int kGroups = 8 / HALVES;
  for (int h = 0; h < HALVES; ++h) {
    __m512i even = dots[h], odd = _mm512_setzero_si512();
    for (int g = kGroups * h; g < kGroups * (h + 1); g += 2) {
      even = dot4_wide(even, wv[g], digits + 4 * g);
      odd = dot4_wide(odd, wv[g + 1], digits + 4 * g + 4);
    }
    dots[h] = _mm512_add_epi32(even, odd);
  }
}

// One row's integer dots for one block: hi (and, with two digits, hi * 256 + lo).
template <int DIGITS, int HALVES>
PAGEDLLM_ALWAYS_INLINE void pair_row_dots(const __m512i (&wv)[8], const Activations& a, int64_t row,
                                          int64_t b, __m512i (&dots)[HALVES]) {
  for (int h = 0; h < HALVES; ++h) dots[h] = _mm512_setzero_si512();
  pair_block_dots<HALVES>(wv, a.hi(row, b), dots);
  if constexpr (DIGITS == 2 && HALVES == 2) {
    // Q6_K's halves give a row 4 chains: the low digit's dots continue the shifted high
    // ones' (integer sums, so the order does not change the bits), saving a zeroed chain and
    // an add. With one half a row's 2 chains would wait on each other: there the low digit
    // keeps a chain of its own.
    for (int h = 0; h < HALVES; ++h) dots[h] = _mm512_slli_epi32(dots[h], 8);
    pair_block_dots<HALVES>(wv, a.lo(row, b), dots);
  } else if constexpr (DIGITS == 2) {
    __m512i low[HALVES];
    for (int h = 0; h < HALVES; ++h) low[h] = _mm512_setzero_si512();
    pair_block_dots<HALVES>(wv, a.lo(row, b), low);
    for (int h = 0; h < HALVES; ++h) dots[h] = _mm512_add_epi32(_mm512_slli_epi32(dots[h], 8), low[h]);
  }
}

// A pass's R rows of the pair's 16 columns written out; the second tile may be part padding.
template <int R>
PAGEDLLM_ALWAYS_INLINE void store_pair_rows(const __m512 (&acc)[R], int64_t row, int64_t tile,
                                            const Output& out) {
  const int64_t n0 = tile * kTileCols;
  const int64_t valid = std::min<int64_t>(2 * kTileCols, out.cols - n0);
  const __mmask16 lanes = static_cast<__mmask16>((1u << valid) - 1);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out.data + (row + r) * out.stride + n0, lanes, acc[r]);
}

template <int R, int BITS, int DIGITS, bool KQUANT, int HALVES>
void pair_tile(const Activations& a, const Weights& w, int64_t row, int64_t tile, const Output& out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* first = w.packed + tile * w.tile_bytes;
  const uint8_t* second = first + w.tile_bytes;
  const int64_t bytes = block_bytes(BITS);
  for (int64_t b = 0; b < w.blocks; ++b) {
    if (streams<R>(row)) prefetch_ahead<2, BITS>(w, tile, b);
    __m512i wv[8];
    unpack_pair_block<BITS>(first + b * bytes, second + b * bytes, wv);
    __m512 d[HALVES], m[HALVES];
    pair_block_scales<KQUANT, HALVES>(w, tile, b, d, m);
    // Unrolled, so the rows' accumulators stay in registers (GCC kept them on the stack
    // and ran the rows as a loop).
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512i dots[HALVES];
      pair_row_dots<DIGITS, HALVES>(wv, a, row + r, b, dots);
      acc[r] = block_epilogue<Lanes16, HALVES>(acc[r], dots, d, m, a, a.at(row + r, b));
    }
  }
  store_pair_rows<R>(acc, row, tile, out);
}

// One half (or a whole block) of a pass's R rows, a weight group at a time: each group
// unpacked is used at once by every row and digit, so each row and digit keeps a chain of
// its own (16 at 8 rows and two digits, beside the rows' 8 accumulators and one group), and
// then each row's accumulator takes the half's epilogue. Holding the block's 8 groups, as
// pair_tile does, left a row one chain per digit (or half) of 8-16 dependent vpdpbusd, whose
// latency the out-of-order window did not hide at 8 rows. `digits` is the pass's first
// row's for the block; its rows follow, DIGITS * kBlock apart.
template <int R, int BITS, int DIGITS, int HALVES>
PAGEDLLM_ALWAYS_INLINE void group_major_half(const uint8_t* f, const uint8_t* s,
                                             const __m512i (&planes)[2], int h,
                                             const int8_t* digits, __m512 d, __m512 m,
                                             const Activations& a, int64_t at, __m512 (&acc)[R]) {
  constexpr int kGroups = 8 / HALVES;
  __m512i dots[R][DIGITS];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int j = 0; j < DIGITS; ++j) dots[r][j] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int i = 0; i < kGroups; ++i) {
    // One half: its groups in order. A whole block: g and g + 4 (one nibble run) in turn.
    const int g = HALVES == 2 ? kGroups * h + i : (i % 2) * 4 + i / 2;
    const __m512i wg = pair_group<BITS>(f, s, g, planes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int j = 0; j < DIGITS; ++j)
        dots[r][j] = dot4_wide(dots[r][j], wg, digits + (r * DIGITS + j) * kBlock + 4 * g);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    __m512i dot = dots[r][0];
    if constexpr (DIGITS == 2) dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), dots[r][1]);
    const float sum = HALVES == 1 ? a.sum[at + r] : a.sum16[(at + r) * 2 + h];
    acc[r] = half_epilogue<Lanes16>(acc[r], dot, d, m, a.step[at + r], sum);
  }
}

// group_major_half for a Q6_K half at two digits: the half's 4 groups held unpacked and a
// row's two digits in one chain, the high dots shifted by 8 before the low ones continue it
// (integer sums: the bits of hi * 256 + lo, as pair_row_dots makes them). A chain per row
// and digit, beside the rows' accumulators, both halves' scales and the high-bit planes,
// needed more than the 32 registers, and GCC spilled the accumulators every block:
// single-threaded, Llama-3.2-1B's down (2,048 x 8,192) at 32 rows took 4.37 ms so and 3.85
// this way, its head 68.6 and 61.3 (AMD Zen 5; alike from 8 to 256 rows, and no slower at 4).
template <int R, int BITS>
PAGEDLLM_ALWAYS_INLINE void chained_half(const uint8_t* f, const uint8_t* s,
                                         const __m512i (&planes)[2], int h, const int8_t* digits,
                                         __m512 d, __m512 m, const Activations& a, int64_t at,
                                         __m512 (&acc)[R]) {
  __m512i wg[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) wg[i] = pair_group<BITS>(f, s, 4 * h + i, planes);
  __m512i dots[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) dots[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      dots[r] = dot4_wide(dots[r], wg[i], digits + (r * 2) * kBlock + 4 * (4 * h + i));
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) dots[r] = _mm512_slli_epi32(dots[r], 8);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      dots[r] = dot4_wide(dots[r], wg[i], digits + (r * 2 + 1) * kBlock + 4 * (4 * h + i));
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    acc[r] = half_epilogue<Lanes16>(acc[r], dots[r], d, m, a.step[at + r], a.sum16[(at + r) * 2 + h]);
}

// pair_tile for passes of 4 and 8 rows, a weight group (group_major_half) or a Q6_K half
// (chained_half) at a time. Single-threaded, a 2,048 x 2,048 projection at 64 rows (tables
// in L3) took 13.3 cycles a row, block and pair of tiles as Q4_K with pair_tile's order (the
// vpdpbusd alone need 7.4) and 17.1 as Q6_K; group_major_half takes 10.8 and 13.7 (AMD Zen 5,
// 3.52 GHz reference; the same bits: integer sums, the epilogue unchanged).
template <int R, int BITS, int DIGITS, bool KQUANT, int HALVES>
void stream_pair_tile(const Activations& a, const Weights& w, int64_t row, int64_t tile, const Output& out) {
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* first = w.packed + tile * w.tile_bytes;
  const uint8_t* second = first + w.tile_bytes;
  constexpr int64_t bytes = block_bytes(BITS);
  for (int64_t b = 0; b < w.blocks; ++b) {
    // Every pass, not only the first (streams): from L2, where the item's tiles are after the
    // first pass, a group's loads stalled the rows' chains that wait on them. Llama-3.2-1B's
    // head (128,256 x 2,048 Q6_K) at 32 rows took 24.0 cycles a row, block and pair, 16.8 so.
    // (Tables left in L3 between calls, as one projection timed over and over, pay ~15%; a
    // model's step streams every layer from memory.)
    prefetch_ahead<2, BITS>(w, tile, b);
    const uint8_t* f = first + b * bytes;
    const uint8_t* s = second + b * bytes;
    __m512i planes[2];
    pair_planes<BITS>(f, s, planes);
    const int64_t at = a.at(row, b);
    const int8_t* digits = a.hi(row, b);
    __m512 d[HALVES], m[HALVES];
    pair_block_scales<KQUANT, HALVES>(w, tile, b, d, m);
#pragma GCC unroll 2
    for (int h = 0; h < HALVES; ++h) {
      if constexpr (HALVES == 2 && DIGITS == 2)
        chained_half<R, BITS>(f, s, planes, h, digits, d[h], m[h], a, at, acc);
      else
        group_major_half<R, BITS, DIGITS, HALVES>(f, s, planes, h, digits, d[h], m[h], a, at, acc);
    }
  }
  store_pair_rows<R>(acc, row, tile, out);
}

template <int R, int BITS, int DIGITS, bool KQUANT, int HALVES>
int64_t wide_tiles(const Activations& a, const Weights& w, int64_t row, int64_t tile_begin,
                   int64_t tile_end, const Output& out) {
  int64_t t = tile_begin;
  for (; t + 1 < tile_end; t += 2) {
    if constexpr (R >= 4) stream_pair_tile<R, BITS, DIGITS, KQUANT, HALVES>(a, w, row, t, out);
    else pair_tile<R, BITS, DIGITS, KQUANT, HALVES>(a, w, row, t, out);
  }
  return t;
}
