// 16 rows by 16 columns (a pair of tiles) on AMX-INT8 tiles: the AMX path's main loop.
//
// gguf_linear.cpp includes this file in `vnni_path` only, after gguf_tile512.h and
// gguf_tile.h. It defines `amx_dispatch`, which runs a work item's rows in groups of 16 on
// the tiles and hands what is left (the rows past the last full group, an odd tile) to the
// VNNI body. From 16 rows a matmul is bound by the integer dots and the float epilogue; one
// tile multiply makes 16 x 16 dots of 64 bytes where a vpdpbusd makes 16 of 4.
//
// A pair's weights are unpacked, for all its blocks, into B tiles' own layout:
// unpack_pair_block's 8 registers of a block are the 8 rows of one tile of K = 32 (row g
// holds k = 4g..4g+3 of the 16 columns, 4 bytes a column), so they are stored as they are.
// The quantized rows are read in place as A tiles: with groups of 16 rows (Activations'
// group_shift = 4) block b's 16 rows lie side by side, each row's digits (hi, then lo) one
// stride apart. tdpbsud multiplies the signed digits by the unsigned weights into exact
// int32 sums: the very integers vpdpbusd makes. Every row then takes block_epilogue's float
// operations in the VNNI path's order, so both paths give the same bits. That epilogue, ~6
// vector operations a row, block and 16 columns (12 for Q6_K's halves), is what bounds the
// path: the tiles themselves run at a tenth of their peak.

#define PAGEDLLM_AMX_INT8_TARGET \
  __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8")))

constexpr int kAmxRows = 16;  // rows of an A (and a C) tile
// The unpacked pair: block b's 8 rows of 64 bytes at kAmxBlockAt + b * kAmxBlockStride, and
// 8 rows of zeros before each block (written once: unpacking never touches them). Beside it,
// in a buffer of their own, each block's float scales and mins for the 16 columns (d then m
// for each half, 64 floats a block), made once a pair rather than at every group's block
// from 8 cache lines of the two tiles' tables.
constexpr int64_t kAmxBlockStride = 1024;
constexpr int64_t kAmxBlockAt = 512;
constexpr int64_t kAmxScaleFloats = 64;
// Rows a pass over a pair's blocks takes (4 groups): their fp32 sums, 4 KB, stay in L1, and
// their digits (1 MB at a K of 8,192) in L2 beside the unpacked pair.
constexpr int64_t kAmxChunkGroups = 4;

// A buffer zeroed when made and grown to the widest layer's blocks (an 8B model's down
// projection: 448 blocks, 448 KB of tiles, which stay in L2 while the pair's rows run).
// 64-byte aligned: with a std::vector's 16-byte alignment every tile row straddled two cache
// lines, and Q4_K ran 15-20% slower.
struct ThreadBuffer {
  uint8_t* data = nullptr;
  size_t size = 0;
  ~ThreadBuffer() { std::free(data); }

  uint8_t* at_least(size_t bytes) {
    if (size < bytes) {
      std::free(data);
      const size_t rounded = (bytes + 63) / 64 * 64;
      data = static_cast<uint8_t*>(std::aligned_alloc(64, rounded));
      TORCH_CHECK(data != nullptr, "gguf_linear: out of memory for a ", rounded, "-byte tile buffer");
      std::memset(data, 0, rounded);
      size = rounded;
    }
    return data;
  }
};

// The calling thread's buffers for an unpacked pair and its scales, one pair of them for
// every type and digit count.
inline ThreadBuffer& pair_tile_buffer() {
  thread_local ThreadBuffer buffer;
  return buffer;
}

inline ThreadBuffer& pair_scale_buffer() {
  thread_local ThreadBuffer buffer;
  return buffer;
}

// Every block of the pair at `tile`, unpacked to bytes, and its scales, into `b_tiles`.
template <int BITS, bool KQUANT, int HALVES>
PAGEDLLM_AMX_INT8_TARGET void unpack_pair_b_tiles(const Weights& w, int64_t tile, uint8_t* b_tiles,
                                                  float* scales) {
  const uint8_t* first = w.packed + tile * w.tile_bytes;
  const uint8_t* second = first + w.tile_bytes;
  const int64_t bytes = block_bytes(BITS);
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m512i wv[8];
    unpack_pair_block<BITS>(first + b * bytes, second + b * bytes, wv);
    uint8_t* block = b_tiles + b * kAmxBlockStride + kAmxBlockAt;
    for (int g = 0; g < 8; ++g) _mm512_store_si512(block + 64 * g, wv[g]);
    __m512 d[HALVES], m[HALVES];
    pair_block_scales<KQUANT, HALVES>(w, tile, b, d, m);
    for (int h = 0; h < HALVES; ++h) {
      _mm512_store_ps(scales + b * kAmxScaleFloats + 32 * h, d[h]);
      _mm512_store_ps(scales + b * kAmxScaleFloats + 32 * h + 16, m[h]);
    }
  }
}

// Block b's scales and mins as unpack_pair_b_tiles stored them.
template <int HALVES>
PAGEDLLM_AMX_INT8_TARGET PAGEDLLM_ALWAYS_INLINE void stored_scales(const float* scales, int64_t b,
                                                                  __m512 (&d)[HALVES], __m512 (&m)[HALVES]) {
  for (int h = 0; h < HALVES; ++h) {
    d[h] = _mm512_load_ps(scales + b * kAmxScaleFloats + 32 * h);
    m[h] = _mm512_load_ps(scales + b * kAmxScaleFloats + 32 * h + 16);
  }
}

// Both bodies' tile shapes: C tiles 0-3 of 16 rows of int32; A tiles 4 and 5 of 16 rows of
// `a_bytes` digits; B tiles 6 and 7 of `b_rows` rows of 64 bytes.
PAGEDLLM_AMX_INT8_TARGET inline void configure_tiles(int a_bytes, int b_rows) {
  pagedllm_amx::TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = static_cast<uint8_t>(t < 6 ? kAmxRows : b_rows);
    config.colsb[t] = static_cast<uint16_t>(t == 4 || t == 5 ? a_bytes : 64);
  }
  pagedllm_amx::load_config(config);
}

// ---- whole blocks (every type but Q6_K) -----------------------------------------------------
//
// One multiply a digit. With two digits an A tile is a row's 64 bytes as they lie (hi, then
// lo: K = 64), and two B tiles pick one digit each: [W; 0] for hi, [0; W] (the zeros before
// the block, then the block) for lo. A group's multiplies finish long after they issue, so
// the groups run in two sets of tiles: a group's multiplies are issued before the previous
// group's sums are stored and taken through the float epilogue (storing each group's sums
// right after its multiplies ran Q4_K at 64 rows at 332 GOP/s, against 535 pipelined).
//
// Tiles: set s's C tiles (hi, lo) at 2s, 2s + 1 and its A tile at 4 + s; B (hi, lo) at 6, 7.

// The multiplies of one group into set SET, its 16 rows' digits at `rows` (one A tile).
template <int SET, int DIGITS>
PAGEDLLM_AMX_INT8_TARGET PAGEDLLM_ALWAYS_INLINE void issue_group(const int8_t* rows) {
  // The tile intrinsics take their tile numbers as literals.
  if constexpr (SET == 0) {
    _tile_loadd(4, rows, DIGITS * kBlock);
    _tile_zero(0);
    _tile_dpbsud(0, 4, 6);
    if constexpr (DIGITS == 2) {
      _tile_zero(1);
      _tile_dpbsud(1, 4, 7);
    }
  } else {
    _tile_loadd(5, rows, DIGITS * kBlock);
    _tile_zero(2);
    _tile_dpbsud(2, 5, 6);
    if constexpr (DIGITS == 2) {
      _tile_zero(3);
      _tile_dpbsud(3, 5, 7);
    }
  }
}

template <int SET, int DIGITS>
PAGEDLLM_AMX_INT8_TARGET PAGEDLLM_ALWAYS_INLINE void store_group(int32_t (&dots)[1][DIGITS][kAmxRows * 16]) {
  if constexpr (SET == 0) {
    _tile_stored(0, dots[0][0], 64);
    if constexpr (DIGITS == 2) _tile_stored(1, dots[0][1], 64);
  } else {
    _tile_stored(2, dots[0][0], 64);
    if constexpr (DIGITS == 2) _tile_stored(3, dots[0][1], 64);
  }
}

// The float epilogue of one block for a group's 16 rows: their dots dots[half][digit], the
// block's scales and mins, the rows' sums in `acc` (16 floats a row), the rows' first entry
// in the activation tables at `at` (a full group's rows are consecutive there).
template <int HALVES, int DIGITS>
PAGEDLLM_AMX_INT8_TARGET PAGEDLLM_ALWAYS_INLINE void finish_rows(
    const int32_t (&dots)[HALVES][DIGITS][kAmxRows * 16], const __m512 (&d)[HALVES],
    const __m512 (&m)[HALVES], const Activations& a, int64_t at, float* acc) {
#pragma GCC unroll 16
  for (int r = 0; r < kAmxRows; ++r) {
    __m512i row_dots[HALVES];
    for (int h = 0; h < HALVES; ++h) {
      row_dots[h] = _mm512_load_si512(dots[h][0] + 16 * r);
      if constexpr (DIGITS == 2)
        row_dots[h] = _mm512_add_epi32(_mm512_slli_epi32(row_dots[h], 8),
                                       _mm512_load_si512(dots[h][1] + 16 * r));
    }
    const __m512 sum = block_epilogue<Lanes16, HALVES>(_mm512_load_ps(acc + 16 * r), row_dots, d, m, a, at + r);
    _mm512_store_ps(acc + 16 * r, sum);
  }
}

// finish_rows for a group of whole blocks: its rows from `row`, block b.
template <int DIGITS>
PAGEDLLM_AMX_INT8_TARGET PAGEDLLM_ALWAYS_INLINE void finish_group(
    const int32_t (&dots)[1][DIGITS][kAmxRows * 16], const Activations& a, const float* scales,
    int64_t row, int64_t b, float* acc) {
  __m512 d[1], m[1];
  stored_scales<1>(scales, b, d, m);
  finish_rows<1, DIGITS>(dots, d, m, a, a.at(row, b), acc);
}

// A chunk's sums to `out`: the pair's 16 columns, the last pair's part padding.
PAGEDLLM_AMX_INT8_TARGET inline void store_chunk_rows(const float* acc, int64_t row, int64_t groups,
                                                      int64_t tile, const Output& out) {
  const int64_t n0 = tile * kTileCols;
  const int64_t valid = std::min<int64_t>(2 * kTileCols, out.cols - n0);
  const __mmask16 lanes = static_cast<__mmask16>((1u << valid) - 1);
  for (int64_t r = 0; r < groups * kAmxRows; ++r)
    _mm512_mask_storeu_ps(out.data + (row + r) * out.stride + n0, lanes, _mm512_load_ps(acc + 16 * r));
}

// Rows [row, row + 16 * groups) of the pair at `tile`, its blocks unpacked in `b_tiles`. A
// block's B tiles are loaded once for all the groups.
template <int DIGITS>
PAGEDLLM_AMX_INT8_TARGET void amx_pair_chunk(const Activations& a, int64_t blocks, int64_t row,
                                             int64_t groups, int64_t tile, const uint8_t* b_tiles,
                                             const float* scales, const Output& out) {
  alignas(64) float acc[kAmxChunkGroups * kAmxRows * 16];
  std::memset(acc, 0, sizeof(float) * groups * kAmxRows * 16);
  alignas(64) int32_t dots[2][1][DIGITS][kAmxRows * 16];  // [set][half][digit]
  // The group issued before the current one, finished after it (last_b < 0: none yet).
  int64_t last_b = -1, last_g = 0;
  int set = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = b_tiles + b * kAmxBlockStride + kAmxBlockAt;
    _tile_loadd(6, block, 64);
    if constexpr (DIGITS == 2) _tile_loadd(7, block - 8 * 64, 64);
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* rows = a.hi(row + kAmxRows * g, b);
      if (set == 0) issue_group<0, DIGITS>(rows);
      else issue_group<1, DIGITS>(rows);
      if (last_b >= 0) {
        if (set == 0) store_group<1, DIGITS>(dots[1]);
        else store_group<0, DIGITS>(dots[0]);
        finish_group<DIGITS>(dots[set ^ 1], a, scales, row + kAmxRows * last_g, last_b,
                             acc + last_g * kAmxRows * 16);
      }
      last_b = b;
      last_g = g;
      set ^= 1;
    }
  }
  if (set == 0) store_group<1, DIGITS>(dots[1]);
  else store_group<0, DIGITS>(dots[0]);
  finish_group<DIGITS>(dots[set ^ 1], a, scales, row + kAmxRows * last_g, last_b,
                       acc + last_g * kAmxRows * 16);
  store_chunk_rows(acc, row, groups, tile, out);
}

// ---- Q6_K's halves ----------------------------------------------------------------------------
//
// Two multiplies of K = 16 a digit: a block's first or last 4 B rows (B tiles 6 and 7, loaded
// once a block for all the groups) against the first or last 16 bytes of each row's digit
// (A tiles 4 and 5). C for half h and digit i at 2h + i (0-3); a group's sums are stored
// once its four multiplies are issued.

// A group's dots for both halves into dots[half][digit], its rows' digits at `rows`.
template <int DIGITS>
PAGEDLLM_AMX_INT8_TARGET PAGEDLLM_ALWAYS_INLINE void half_group_dots(const int8_t* rows,
                                                                    int32_t (&dots)[2][DIGITS][kAmxRows * 16]) {
  constexpr int64_t kStride = DIGITS * kBlock;
  _tile_loadd(4, rows, kStride);
  _tile_loadd(5, rows + 16, kStride);
  _tile_zero(0);
  _tile_dpbsud(0, 4, 6);
  _tile_zero(2);
  _tile_dpbsud(2, 5, 7);
  if constexpr (DIGITS == 2) {
    _tile_loadd(4, rows + kBlock, kStride);
    _tile_loadd(5, rows + kBlock + 16, kStride);
    _tile_zero(1);
    _tile_dpbsud(1, 4, 6);
    _tile_zero(3);
    _tile_dpbsud(3, 5, 7);
  }
  _tile_stored(0, dots[0][0], 64);
  _tile_stored(2, dots[1][0], 64);
  if constexpr (DIGITS == 2) {
    _tile_stored(1, dots[0][1], 64);
    _tile_stored(3, dots[1][1], 64);
  }
}

// Rows [row, row + 16 * groups) of the pair at `tile`, as amx_pair_chunk runs whole blocks.
template <int DIGITS>
PAGEDLLM_AMX_INT8_TARGET void amx_pair_halves(const Activations& a, int64_t blocks, int64_t row,
                                              int64_t groups, int64_t tile, const uint8_t* b_tiles,
                                              const float* scales, const Output& out) {
  alignas(64) float acc[kAmxChunkGroups * kAmxRows * 16];
  std::memset(acc, 0, sizeof(float) * groups * kAmxRows * 16);
  alignas(64) int32_t dots[2][DIGITS][kAmxRows * 16];
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = b_tiles + b * kAmxBlockStride + kAmxBlockAt;
    _tile_loadd(6, block, 64);            // half 0: the block's rows 0-3
    _tile_loadd(7, block + 4 * 64, 64);   // half 1: rows 4-7
    __m512 d[2], m[2];
    stored_scales<2>(scales, b, d, m);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t group_row = row + kAmxRows * g;
      half_group_dots<DIGITS>(a.hi(group_row, b), dots);
      finish_rows<2, DIGITS>(dots, d, m, a, a.at(group_row, b), acc + g * kAmxRows * 16);
    }
  }
  store_chunk_rows(acc, row, groups, tile, out);
}

// A work item's tiles for every row: the full groups of 16 rows on the tiles and the rest
// (rows past the last group, an odd last tile) on the VNNI body. Chunks of rows outer, pairs
// inner: a chunk's digits stay in L2 while each pair is unpacked and run over them (pairs
// outer, every row's digits came round for each pair: 4 MB for Llama-3.2-1B's down
// projection at 256 rows, which ran in 26.1 ms against 23.2). Each pair is unpacked into the
// same buffer, where the last one ran: unpacked side by side in a buffer of their own, the
// second pair ran at half the rate at 16 rows (gate+up 4.27 against 2.22 ms), cause unknown.
template <int BITS, int DIGITS, bool KQUANT, int HALVES>
void amx_item(const Activations& a, const Weights& w, int64_t rows, int64_t tile_begin,
              int64_t tile_end, const Output& out) {
  const int64_t tile_rows = rows / kAmxRows * kAmxRows;
  const int64_t pairs = tile_rows > 0 ? (tile_end - tile_begin) / 2 : 0;
  if (pairs > 0) {
    // The zeros go on past the last block: its B tile for hi digits is [W; 0].
    uint8_t* b_tiles = pair_tile_buffer().at_least(w.blocks * kAmxBlockStride + kAmxBlockAt);
    float* scales =
        reinterpret_cast<float*>(pair_scale_buffer().at_least(w.blocks * kAmxScaleFloats * 4));
    // Whole blocks: a row's digits (32 bytes a digit) against the block (one digit) or
    // [W; 0] and [0; W] (two); Q6_K's halves: 16 bytes of a digit against 4 rows of it.
    if constexpr (HALVES == 1) configure_tiles(DIGITS * kBlock, DIGITS * 8);
    else configure_tiles(kBlock / 2, 4);
    for (int64_t row = 0; row < tile_rows; row += kAmxChunkGroups * kAmxRows) {
      const int64_t groups = std::min(kAmxChunkGroups, (tile_rows - row) / kAmxRows);
      for (int64_t t = tile_begin; t < tile_begin + 2 * pairs; t += 2) {
        unpack_pair_b_tiles<BITS, KQUANT, HALVES>(w, t, b_tiles, scales);
        if constexpr (HALVES == 1) amx_pair_chunk<DIGITS>(a, w.blocks, row, groups, t, b_tiles, scales, out);
        else amx_pair_halves<DIGITS>(a, w.blocks, row, groups, t, b_tiles, scales, out);
      }
    }
    pagedllm_amx::release_tiles();
  }
  const int64_t t = tile_begin + 2 * pairs;  // the odd tile left, if any
  if (t < tile_end) vector_item<BITS, DIGITS, KQUANT, HALVES>(a, w, 0, tile_rows, t, tile_end, out);
  vector_item<BITS, DIGITS, KQUANT, HALVES>(a, w, tile_rows, rows, tile_begin, tile_end, out);
}

template <int BITS, bool KQUANT, int HALVES>
void amx_digits(const Activations& a, const Weights& w, int64_t rows, int64_t tile_begin,
                int64_t tile_end, int digits, const Output& out) {
  if (digits == 2) return amx_item<BITS, 2, KQUANT, HALVES>(a, w, rows, tile_begin, tile_end, out);
  return amx_item<BITS, 1, KQUANT, HALVES>(a, w, rows, tile_begin, tile_end, out);
}

// vector_dispatch's combinations, on the tiles.
inline void amx_dispatch(const Activations& a, const Weights& w, int64_t rows, int64_t tile_begin,
                         int64_t tile_end, int digits, const Output& out) {
  const bool kquant = w.super_d != nullptr;
  if (!kquant && w.bits == 4) return amx_digits<4, false, 1>(a, w, rows, tile_begin, tile_end, digits, out);
  if (!kquant && w.bits == 5) return amx_digits<5, false, 1>(a, w, rows, tile_begin, tile_end, digits, out);
  if (!kquant) return amx_digits<8, false, 1>(a, w, rows, tile_begin, tile_end, digits, out);
  if (w.bits == 4) return amx_digits<4, true, 1>(a, w, rows, tile_begin, tile_end, digits, out);
  if (w.bits == 5) return amx_digits<5, true, 1>(a, w, rows, tile_begin, tile_end, digits, out);
  return amx_digits<6, true, 2>(a, w, rows, tile_begin, tile_end, digits, out);
}
