// y = x W^T with W kept in GGUF's blocks (CPU): the `quantization="gguf"` matmul.
//
// Every GGUF type the kernel takes is, per block of 32 weights (16 for Q6_K's halves),
// w = d*q + m with q unsigned: Q4_0 is m = -8d, Q5_0 m = -16d, Q8_0 is stored as q + 128
// with m = -128d, Q4_1 keeps its own m; the K-quants (Q4_K, Q5_K, Q6_K) give each block an
// integer scale and min under a float per super-block of 256 (d = D*sc, m = M*mn; Q6_K:
// M = -32D, mn = sc).
// The weights are used exactly as the file holds them. Each 32-wide block of an input row is
// quantized to integers with its own scale: one int8 digit (8 bits), or two (hi + lo/256,
// ~15 bits, which keeps greedy output on the fp32 model's tokens; see
// benchmarks/int8_accuracy.py). Per block and output column the integer dot is exact, and
// the float epilogue is
//     acc += float(dot) * (d * step) ;  acc += m * sum(quantized x)
// in that order, so every path gives the same bits: AVX-512 VNNI (vpdpbusd, u8 weights x s8
// digits into int32), AVX2 (vpmaddubsw into int16 pairs, widened before they can overflow)
// and the portable loop; AMX-INT8 tiles (tdpbsud) make the same integer dots for groups of
// 16 rows. Which one runs: the caller's `isa` (0 portable, 1 AVX2, 2 VNNI, 3 AMX), lowered
// to what this CPU has.
//
// Packed layout (pagedllm/model/layers/gguf_linear.py builds it): columns in tiles of 8; per
// tile and block, 8 groups of 4 consecutive k for the 8 columns, 32 bytes a group, stored
// as gguf_tile.h's unpack_tile_block reads them. Float scales: d and m [tiles][groups][8]
// (Q4_0, Q5_0 and Q8_0: d alone, m = d * gguf_layout::symmetric_min_factor); d may be fp16
// (the file's own) or bf16 and m uint8 zero points (a packed checkpoint's; gguf_scales.h).
// K-quants: D and M float [tiles][super-blocks][8], sc and mn int8 [tiles][sub-blocks][8].

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "amx_tiles.h"
#include "gguf_layout.h"

#include <cpuid.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

// The tile bodies' helpers pass register arrays by reference: called rather than inlined
// (GCC's choice for Q6_K's unpacking), those arrays go through the stack on every block.
#define PAGEDLLM_ALWAYS_INLINE inline __attribute__((always_inline))

namespace {

using gguf_layout::block_bytes;
using gguf_layout::check_table;
using gguf_layout::kBlock;
using gguf_layout::kSuperBlock;
using gguf_layout::kTileCols;
// Tiles per parallel work item: 32 columns, so even a 192-column projection splits into
// 6 items and two threads share them evenly.
constexpr int64_t kTilesPerItem = 4;

enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kVnni = 2, kAmx = 3 };
enum ScaleType : int { kScaleF32 = 0, kScaleF16 = 1, kScaleBF16 = 2 };

// The quantized input in groups of a pass's rows (the path's kRowsPerPass), each group
// block-major: for block b the group's digits lie side by side (hi then lo, 32 bytes each),
// so a pass reads one contiguous run. Row-major, rows 2^k bytes apart (k = 8,192 for an 8B
// model's down projection) landed in the same L1 sets: a pass of 8 rows ran at a quarter of
// the rate it reaches at k = 2,048. Block-major over all rows put a pass's blocks rows * 64
// bytes apart: from 256 rows its runs fell in a few L1 and L2 sets and every work item
// read them from L3 (Llama-3.2-1B's gate+up at 512 rows: 77 integer GOP/s against 130 at
// 64 rows; AMD EPYC, AVX2). The last group holds the rows left over; at up to a pass's
// rows (decode) the layout is plain block-major.
struct Activations {
  const int8_t* digits;  // [groups][blocks][group rows][digits][32]
  const float* step;     // [groups][blocks][group rows]: the value of one unit of the combined integer
  const float* sum;      // the same: sum of the quantized values
  const float* sum16;    // [groups][blocks][group rows][2]: the same over each 16 values
  int64_t rows;
  int64_t blocks;
  int64_t digit_count;
  int group_shift;  // rows per group: 1 << group_shift

  int64_t at(int64_t row, int64_t b) const {
    const int64_t first = row >> group_shift << group_shift;
    const int64_t group_rows = std::min<int64_t>(int64_t{1} << group_shift, rows - first);
    return first * blocks + b * group_rows + (row - first);
  }
  const int8_t* hi(int64_t row, int64_t b) const { return digits + at(row, b) * digit_count * kBlock; }
  const int8_t* lo(int64_t row, int64_t b) const { return hi(row, b) + kBlock; }
};

struct Weights {
  const uint8_t* packed;
  int64_t blocks;
  int64_t super_blocks;
  int bits;
  int64_t tile_bytes;
  // Float scales (Q4_0, Q4_1, Q8_0, packed checkpoints' groups), or null: fp32, fp16 or bf16
  // as `scale_type` says. The min is fp32 `mins`, or uint8 zero points (m = d * -zero), or
  // neither (Q4_0, Q8_0, symmetric groups: m = d * min_factor). See gguf_scales.h.
  const void* scales;
  ScaleType scale_type;
  const float* mins;
  const uint8_t* zeros;
  float min_factor;
  // Block b's float scale and min are group b >> scale_shift's: 2^scale_shift consecutive
  // blocks share one (GPTQ's groups of 64, 128, ... or a whole row); 0 for GGUF's blocks.
  // The tables hold [tiles][scale_groups][8].
  int scale_shift;
  int64_t scale_groups;
  // K-quant scales, or null.
  const float* super_d;
  const float* super_m;
  const int8_t* sub_sc;
  const int8_t* sub_mn;
  int halves;  // sub-blocks per 32-wide block: 2 for Q6_K, else 1
};

struct Output {
  float* data;
  int64_t stride;
  int64_t cols;
};

inline __m256i pack_int8(__m256i a, __m256i b, __m256i c, __m256i d) {
  // packs work within 128-bit lanes; the permute puts the four 8-value runs back in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// One row's blocks to integer digits: hi = round(x / step), lo = round(residual * 256 / step),
// step = max |x| / 127 of the block. Vectorized: done per call for every input row, a scalar
// loop cost 17% of a 2,048-row matmul.
void quantize_row(const float* x, const Activations& a, int64_t row, int digits) {
  float* step_out = const_cast<float*>(a.step);
  float* sum_out = const_cast<float*>(a.sum);
  float* sum16_out = const_cast<float*>(a.sum16);
  const __m256 sign = _mm256_set1_ps(-0.f), limit = _mm256_set1_ps(127.f);
  const __m256 neg_limit = _mm256_set1_ps(-127.f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t b = 0; b < a.blocks; ++b) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + b * kBlock + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float block_max = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float step = block_max / 127.f;
    const float inv = block_max > 0.f ? 127.f / block_max : 0.f;
    const __m256 inv_v = _mm256_set1_ps(inv), step_v = _mm256_set1_ps(step);
    const __m256 inv_lo = _mm256_set1_ps(inv * 256.f);
    __m256i h[4], l[4], half_total[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int j = 0; j < 4; ++j) {
      const __m256 hf = _mm256_min_ps(
          limit, _mm256_max_ps(neg_limit, _mm256_round_ps(_mm256_mul_ps(v[j], inv_v), kRound)));
      h[j] = _mm256_cvtps_epi32(hf);
      if (digits == 2) {
        const __m256 residual = _mm256_fnmadd_ps(hf, step_v, v[j]);
        const __m256 lf = _mm256_min_ps(
            limit,
            _mm256_max_ps(neg_limit, _mm256_round_ps(_mm256_mul_ps(residual, inv_lo), kRound)));
        l[j] = _mm256_cvtps_epi32(lf);
        half_total[j / 2] = _mm256_add_epi32(half_total[j / 2],
                                             _mm256_add_epi32(_mm256_slli_epi32(h[j], 8), l[j]));
      } else {
        half_total[j / 2] = _mm256_add_epi32(half_total[j / 2], h[j]);
      }
    }
    int8_t* hi = const_cast<int8_t*>(a.hi(row, b));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), pack_int8(h[0], h[1], h[2], h[3]));
    if (digits == 2)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + kBlock), pack_int8(l[0], l[1], l[2], l[3]));
    const int64_t at = a.at(row, b);
    step_out[at] = digits == 2 ? step / 256.f : step;
    const int32_t first = hsum_epi32(half_total[0]), second = hsum_epi32(half_total[1]);
    sum_out[at] = step_out[at] * static_cast<float>(first + second);
    sum16_out[2 * at] = step_out[at] * static_cast<float>(first);
    sum16_out[2 * at + 1] = step_out[at] * static_cast<float>(second);
  }
}


// At one or two rows a matmul is a pass over its weights from memory, and the hardware
// prefetcher alone fell behind: single-stream decode of a Llama-3.2-1B shape drew 22.5
// tokens/s, 25.9 with each block's lines fetched 16 blocks ahead (8: 25.0, 32: 25.3).
// Prefetching never faults, so running past the table's end is harmless.
constexpr int kPrefetchRows = 2;
constexpr int64_t kPrefetchBlocks = 16;

// Whether a pass of R rows from `row` fetches ahead (prefetch_ahead): every pass of one or
// two rows, and the first pass over a work item's tiles (row 0), which brings them from
// memory for the passes after it. Prefetching on that first pass too took a 1B shape's
// matmuls at 8 rows from 71 to 51 ms, at 16 from 173 to 156, at 32 from 293 to 245, and 64
// rows stayed at 565 (AMD Zen 5, VNNI; the AVX2 path at 8 rows 128 -> 109 ms).
template <int R>
PAGEDLLM_ALWAYS_INLINE bool streams(int64_t row) {
  return R <= kPrefetchRows || row == 0;
}

// A block's lines. Its size a template argument, so the loop is unrolled before GCC's
// vectorizer sees it: that pass drops prefetches from the loops it takes, and a loop of
// nothing else goes with them (GCC 12 left none of a first version's, whose size was an
// argument).
template <int64_t BYTES>
PAGEDLLM_ALWAYS_INLINE void prefetch_block(const uint8_t* block) {
#pragma GCC unroll 4
  for (int64_t line = 0; line < BYTES; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + line), _MM_HINT_T0);
}

// One line of the scale table `table` (`tile_bytes` a tile) for the TILES tiles from
// `next_tile`: the one b / blocks of the way through them, so a pass's blocks sweep them all.
template <int TILES>
PAGEDLLM_ALWAYS_INLINE void sweep_table(const void* table, int64_t tile_bytes, int64_t next_tile,
                                        int64_t b, int64_t blocks) {
  if (table == nullptr) return;
  const char* next = static_cast<const char*>(table) + next_tile * tile_bytes;
  _mm_prefetch(next + TILES * tile_bytes * b / blocks, _MM_HINT_T0);
}

// The scale tables' lines for the TILES tiles from `next`, a line a block (sweep_table).
template <int TILES>
PAGEDLLM_ALWAYS_INLINE void prefetch_next_scales(const Weights& w, int64_t next, int64_t b) {
  if (w.super_d != nullptr) {
    const int64_t super_bytes = w.super_blocks * kTileCols * 4;
    const int64_t sub_bytes = w.blocks * w.halves * kTileCols;
    sweep_table<TILES>(w.super_d, super_bytes, next, b, w.blocks);
    sweep_table<TILES>(w.super_m, super_bytes, next, b, w.blocks);
    sweep_table<TILES>(w.sub_sc, sub_bytes, next, b, w.blocks);
    if (w.sub_mn != w.sub_sc) sweep_table<TILES>(w.sub_mn, sub_bytes, next, b, w.blocks);
    return;
  }
  const int64_t group_values = w.scale_groups * kTileCols;
  sweep_table<TILES>(w.scales, group_values * (w.scale_type == kScaleF32 ? 4 : 2), next, b, w.blocks);
  sweep_table<TILES>(w.mins, group_values * 4, next, b, w.blocks);
  sweep_table<TILES>(w.zeros, group_values, next, b, w.blocks);
}

// What block b of a pass over TILES tiles from `tile` (1, or a pair side by side) fetches
// ahead: each tile's block b + kPrefetchBlocks or, past their end, the next tiles' (tiles
// lie in order), and for a pair a line of the next pair's scale tables. A pass over a pair
// once fetched each tile's own bytes only, and the next pair started cold: at K = 640
// (Gemma 3 270M, 5 KB a tile) its 262k-row head read 25.2 GB/s, 31-36 with the prefetch
// running on across pairs; a Llama-3.2-1B shape's single-stream matmuls 24.9 GB/s, 27.0
// running on and 31.2 with the scale tables too (AMD Zen 5; benchmarks/results/real_size.md).
// A single tile's pass (the AVX2 path) ran 10-20% slower with the tables' lines: there the
// hardware prefetcher keeps up with them alone.
template <int TILES, int BITS>
PAGEDLLM_ALWAYS_INLINE void prefetch_ahead(const Weights& w, int64_t tile, int64_t b) {
  constexpr int64_t kBytes = block_bytes(BITS);
  const int64_t ahead = b + kPrefetchBlocks;
  // Past the pass's end, the next tiles: TILES - 1 tiles further on. (A tile of fewer than
  // kPrefetchBlocks blocks sends it past them, to bytes read soon after; prefetching never
  // faults.)
  const int64_t wrap = ahead < w.blocks ? 0 : (TILES - 1) * w.tile_bytes;
  const uint8_t* at = w.packed + tile * w.tile_bytes + ahead * kBytes + wrap;
  for (int t = 0; t < TILES; ++t) prefetch_block<kBytes>(at + t * w.tile_bytes);
  if constexpr (TILES > 1) prefetch_next_scales<TILES>(w, tile + TILES, b);
}

// ---- portable path --------------------------------------------------------------------

inline int32_t weight_at(const uint8_t* tile_block, int bits, int col, int i) {
  const int group = i / 4, at = col * 4 + i % 4;
  if (bits == 8) return tile_block[group * 32 + at];
  const uint8_t byte = tile_block[(group % 4) * 32 + at];
  int32_t q = group < 4 ? (byte & 0x0F) : (byte >> 4);
  if (bits == 5) q |= ((tile_block[128 + at] >> group) & 1) << 4;
  if (bits == 6) q |= ((tile_block[128 + (group / 4) * 32 + at] >> (2 * (group % 4))) & 3) << 4;
  return q;
}

// One scale of the float tables as fp32 (gguf_scales.h's scales8, a lane at a time).
inline float scale_at(const Weights& w, int64_t at) {
  const uint16_t* half = static_cast<const uint16_t*>(w.scales);
  if (w.scale_type == kScaleF16) return _cvtsh_ss(half[at]);  // F16C, the baseline; exact
  if (w.scale_type == kScaleBF16) {
    const uint32_t bits = static_cast<uint32_t>(half[at]) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  }
  return static_cast<const float*>(w.scales)[at];
}

inline void scalar_scales(const Weights& w, int64_t tile, int64_t b, int h, int col, float& d,
                          float& m) {
  if (w.super_d == nullptr) {
    const int64_t at = (tile * w.scale_groups + (b >> w.scale_shift)) * kTileCols + col;
    d = scale_at(w, at);
    if (w.mins != nullptr) m = w.mins[at];
    else if (w.zeros != nullptr) m = d * -static_cast<float>(w.zeros[at]);
    else m = d * w.min_factor;
    return;
  }
  const int64_t super_at = (tile * w.super_blocks + b * kBlock / kSuperBlock) * kTileCols + col;
  const int64_t sub_at = (tile * w.blocks * w.halves + b * w.halves + h) * kTileCols + col;
  d = w.super_d[super_at] * static_cast<float>(w.sub_sc[sub_at]);
  m = w.super_m[super_at] * static_cast<float>(w.sub_mn[sub_at]);
}

void portable_tile(const Activations& a, const Weights& w, int64_t row, int64_t tile, int digits,
                   const Output& out) {
  const uint8_t* tile_base = w.packed + tile * w.tile_bytes;
  const int width = kBlock / w.halves;
  for (int col = 0; col < kTileCols; ++col) {
    const int64_t n = tile * kTileCols + col;
    if (n >= out.cols) break;
    float acc = 0.f;
    for (int64_t b = 0; b < w.blocks; ++b) {
      const int8_t* hi = a.hi(row, b);
      const int8_t* lo = a.lo(row, b);
      const int64_t at = a.at(row, b);
      for (int h = 0; h < w.halves; ++h) {
        int32_t dot_hi = 0, dot_lo = 0;
        for (int i = h * width; i < (h + 1) * width; ++i) {
          const int32_t q = weight_at(tile_base + b * block_bytes(w.bits), w.bits, col, i);
          dot_hi += q * hi[i];
          if (digits == 2) dot_lo += q * lo[i];
        }
        const int32_t dot = digits == 2 ? dot_hi * 256 + dot_lo : dot_hi;
        float d, m;
        scalar_scales(w, tile, b, h, col, d, m);
        const float sum = w.halves == 1 ? a.sum[at] : a.sum16[at * 2 + h];
        acc = std::fma(static_cast<float>(dot), d * a.step[at], acc);
        acc = std::fma(m, sum, acc);
      }
    }
    out.data[row * out.stride + n] = acc;
  }
}

// ---- AVX2 path ----------------------------------------------------------------------------

namespace avx2_path {

// vpmaddubsw multiplies u8 weights by s8 digits and adds pairs into int16, saturating. With
// digits in [-127, 127] one pair of weights of up to 6 bits stays below 2^15, and so do sums
// over a few groups: 4-bit (|pair| <= 3,810) over 8 groups, 5-bit (7,874) over 4, 6-bit
// (16,002) over 2. The int16 sums are widened (vpmaddwd by ones) after that many groups.
// 8-bit weights (a pair reaches 64,770) are split into two nibbles, each a 4-bit dot.
template <int BITS>
PAGEDLLM_ALWAYS_INLINE __m256i groups_dot(const __m256i* wv, const int8_t* digits, int count) {
  constexpr int kSpan = BITS <= 4 ? 8 : BITS == 5 ? 4 : 2;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i total = _mm256_setzero_si256();
  for (int g0 = 0; g0 < count; g0 += kSpan) {
    __m256i pairs = _mm256_setzero_si256();
    for (int g = g0; g < std::min(count, g0 + kSpan); ++g) {
      int32_t four;
      std::memcpy(&four, digits + 4 * g, sizeof(four));
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(wv[g], _mm256_set1_epi32(four)));
    }
    total = _mm256_add_epi32(total, _mm256_madd_epi16(pairs, ones));
  }
  return total;
}

template <int BITS, int HALVES>
PAGEDLLM_ALWAYS_INLINE void block_dots(const __m256i (&wv)[8], const int8_t* digits, __m256i (&dots)[HALVES]) {
  constexpr int kGroups = 8 / HALVES;
  if constexpr (BITS == 8) {
    __m256i low[8], high[8];
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int g = 0; g < 8; ++g) {
      low[g] = _mm256_and_si256(wv[g], nibble);
      high[g] = _mm256_and_si256(_mm256_srli_epi16(wv[g], 4), nibble);
    }
    for (int h = 0; h < HALVES; ++h) {
      const int8_t* half = digits + 4 * kGroups * h;
      dots[h] = _mm256_add_epi32(_mm256_slli_epi32(groups_dot<4>(high + kGroups * h, half, kGroups), 4),
                                 groups_dot<4>(low + kGroups * h, half, kGroups));
    }
  } else {
    for (int h = 0; h < HALVES; ++h)
      dots[h] = groups_dot<BITS>(wv + kGroups * h, digits + 4 * kGroups * h, kGroups);
  }
}

// 16 vector registers: 4 rows' accumulators beside the 8 unpacked weight groups.
constexpr int kRowsPerPass = 4;

// An empty asm on a running sum: GCC's reassociation would otherwise turn each chain of
// integer adds into a tree, computing many products first and keeping them on the stack.
PAGEDLLM_ALWAYS_INLINE void keep_chain(__m256i& sum) { asm("" : "+x"(sum)); }

// Defined in gguf_tile_avx2.h, which needs gguf_tile.h's helpers.
template <int R, int BITS, int DIGITS, bool KQUANT, int HALVES>
int64_t wide_tiles(const Activations& a, const Weights& w, int64_t row, int64_t tile_begin,
                   int64_t tile_end, const Output& out);

#include "gguf_scales.h"
#include "gguf_epilogue.h"
#include "gguf_tile.h"
#include "gguf_tile_avx2.h"

}  // namespace avx2_path

// ---- AVX-512 VNNI path (256-bit vectors) ----------------------------------------------------

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")

namespace vnni_path {

// acc += w (u8) . the 4 signed bytes at p, repeated in every lane. The broadcast rides in
// the instruction's memory operand ({1to8}): with it as a separate vpbroadcastd (which is
// what the compiler emits for _mm256_set1_epi32), broadcasts were 16 of ~40 vector ops a
// row, tile and block.
PAGEDLLM_ALWAYS_INLINE __m256i dot4(__m256i acc, __m256i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// Each half's dots in two chains (even and odd groups) so each waits on half as many: a
// layer's four matmuls ran 0-5% faster than with one chain of eight
// (benchmarks/gguf_matmul.py, RESULTS.md "sixth run"), never slower.
template <int BITS, int HALVES>
PAGEDLLM_ALWAYS_INLINE void block_dots(const __m256i (&wv)[8], const int8_t* digits, __m256i (&dots)[HALVES]) {
  constexpr int kGroups = 8 / HALVES;
  for (int h = 0; h < HALVES; ++h) {
    __m256i even = _mm256_setzero_si256(), odd = even;
    for (int g = kGroups * h; g < kGroups * (h + 1); g += 2) {
      even = dot4(even, wv[g], digits + 4 * g);
      odd = dot4(odd, wv[g + 1], digits + 4 * g + 4);
    }
    dots[h] = _mm256_add_epi32(even, odd);
  }
}

// 32 vector registers: 8 rows' accumulators, 8 weight groups, scales and the dots.
constexpr int kRowsPerPass = 8;

#include "gguf_scales.h"
#include "gguf_epilogue.h"
#include "gguf_tile512.h"
#include "gguf_tile.h"
#include "gguf_tile_amx.h"

}  // namespace vnni_path

#pragma GCC pop_options

bool vnni_available() {
  static const bool available = __builtin_cpu_supports("avx512vnni") &&
                                __builtin_cpu_supports("avx512vl") &&
                                __builtin_cpu_supports("avx512bw");
  return available;
}

// AMX-INT8 (CPUID leaf 7: EDX bit 25; GCC 12's __builtin_cpu_supports does not know it),
// with Linux's grant of the tile data.
bool amx_int8_available() {
  static const bool available = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 25))) return false;
    return pagedllm_amx::request_tiles();
  }();
  return available;
}

int64_t best_isa() {
  if (!vnni_available()) return kAvx2;
  return amx_int8_available() ? kAmx : kVnni;
}

// The path `isa` runs on this CPU: the caller's, lowered to what the CPU has and Linux grants.
int64_t gguf_path(int64_t isa) { return std::min(isa, best_isa()); }

// ---- the ops --------------------------------------------------------------------------------

void check_common(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                  int64_t bits, int64_t digits, int64_t block_multiple) {
  TORCH_CHECK(digits == 1 || digits == 2, "gguf_linear: digits must be 1 or 2, got ", digits);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              "gguf_linear: x must be a contiguous 2-D fp32 CPU tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0),
              "gguf_linear: out must be fp32 [rows, cols] with unit column stride");
  TORCH_CHECK(x.size(1) % block_multiple == 0, "gguf_linear: in_features ", x.size(1),
              " is not a multiple of ", block_multiple);
  const int64_t tiles = (out.size(1) + kTileCols - 1) / kTileCols;
  const int64_t expected = tiles * (x.size(1) / kBlock) * block_bytes(bits);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == expected,
              "gguf_linear: packed weight has ", packed.numel(), " bytes, expected ", expected);
}

void run(at::Tensor& out, const at::Tensor& x, const Weights& w, int64_t digits, int64_t isa) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock;
  const int64_t path = gguf_path(isa);
  // Flat: Activations::at lays them out (in groups of a pass's rows).
  const at::Tensor digit_buf = at::empty({rows * blocks * digits * kBlock}, x.options().dtype(at::kChar));
  const at::Tensor row_buf = at::empty({4 * rows * blocks}, x.options());
  float* row_data = row_buf.data_ptr<float>();
  // Rows grouped as a pass takes them; on the AMX path as an A tile does.
  const int pass_rows = path == kAmx    ? vnni_path::kAmxRows
                        : path == kVnni ? vnni_path::kRowsPerPass
                                        : avx2_path::kRowsPerPass;
  const Activations a{digit_buf.data_ptr<int8_t>(),
                      row_data,
                      row_data + rows * blocks,
                      row_data + 2 * rows * blocks,
                      rows,
                      blocks,
                      digits,
                      __builtin_ctz(pass_rows)};
  const float* x_data = x.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(x_data + r * k, a, r, static_cast<int>(digits));
  });
  const Output o{out.data_ptr<float>(), out.stride(0), out.size(1)};
  const int64_t tiles = (out.size(1) + kTileCols - 1) / kTileCols;
  const int64_t items = (tiles + kTilesPerItem - 1) / kTilesPerItem;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    const int64_t tile_begin = begin * kTilesPerItem;
    const int64_t tile_end = std::min(tiles, end * kTilesPerItem);
    const int d = static_cast<int>(digits);
    if (path == kAmx) return vnni_path::amx_dispatch(a, w, rows, tile_begin, tile_end, d, o);
    if (path == kVnni) return vnni_path::vector_dispatch(a, w, rows, tile_begin, tile_end, d, o);
    if (path == kAvx2) return avx2_path::vector_dispatch(a, w, rows, tile_begin, tile_end, d, o);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t t = tile_begin; t < tile_end; ++t) portable_tile(a, w, r, t, d, o);
  });
}

// The scale table's element type: fp32 (GGUF), or fp16 / bf16 (a packed checkpoint's own).
ScaleType scale_type_of(const at::Tensor& scales) {
  if (scales.scalar_type() == at::kHalf) return kScaleF16;
  if (scales.scalar_type() == at::kBFloat16) return kScaleBF16;
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "gguf_linear: scales must be float32, float16 or ",
              "bfloat16, got ", scales.scalar_type());
  return kScaleF32;
}

// out [M, N] = x [M, K] @ W^T for Q4_0 / Q4_1 (bits 4), Q5_0 (5) or Q8_0 (8) packed as
// above. `scales` fp32, fp16 or bf16; `mins` fp32 m, uint8 zero points (m = d * -zero), or
// empty (Q4_0, Q5_0, Q8_0 and symmetric groups: m is a power of two times d). 2^scale_shift
// consecutive blocks share one scale and min (0 for GGUF; a GPTQ group of 128 is 2).
void gguf_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                 const at::Tensor& scales, const at::Tensor& mins, int64_t bits, int64_t digits,
                 int64_t isa, int64_t scale_shift) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "gguf_linear: bits must be 4, 5 or 8, got ",
              bits);
  TORCH_CHECK(scale_shift >= 0 && scale_shift < 63, "gguf_linear: scale_shift must be in [0, 63), got ",
              scale_shift);
  check_common(out, x, packed, bits, digits, kBlock);
  const int64_t blocks = x.size(1) / kBlock;
  const int64_t groups = ((blocks - 1) >> scale_shift) + 1;
  const int64_t tiles = (out.size(1) + kTileCols - 1) / kTileCols;
  const int64_t table = tiles * groups * kTileCols;
  const ScaleType scale_type = scale_type_of(scales);
  check_table("gguf_linear", scales, scales.scalar_type(), table, "scales");
  const bool zeros = mins.numel() != 0 && mins.scalar_type() == at::kByte;
  const bool own_mins = mins.numel() != 0 && !zeros;
  if (mins.numel() != 0) check_table("gguf_linear", mins, zeros ? at::kByte : at::kFloat, table, "mins");
  const Weights w{packed.data_ptr<uint8_t>(), blocks, 0, static_cast<int>(bits),
                  blocks * block_bytes(bits), scales.data_ptr(), scale_type,
                  own_mins ? mins.data_ptr<float>() : nullptr,
                  zeros ? mins.data_ptr<uint8_t>() : nullptr,
                  gguf_layout::symmetric_min_factor(static_cast<int>(bits)), static_cast<int>(scale_shift),
                  groups, nullptr, nullptr, nullptr, nullptr, 1};
  run(out, x, w, digits, isa);
}

// The same for K-quants: Q4_K (bits 4), Q5_K (5), Q6_K (6, scales per 16: halves 2).
void gguf_linear_k(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                   const at::Tensor& super_d, const at::Tensor& super_m, const at::Tensor& sub_sc,
                   const at::Tensor& sub_mn, int64_t bits, int64_t digits, int64_t isa) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6, "gguf_linear_k: bits must be 4, 5 or 6, got ",
              bits);
  check_common(out, x, packed, bits, digits, kSuperBlock);
  const int64_t blocks = x.size(1) / kBlock, super_blocks = x.size(1) / kSuperBlock;
  const int64_t tiles = (out.size(1) + kTileCols - 1) / kTileCols;
  const int halves = bits == 6 ? 2 : 1;
  check_table("gguf_linear", super_d, at::kFloat, tiles * super_blocks * kTileCols, "super_d");
  check_table("gguf_linear", super_m, at::kFloat, tiles * super_blocks * kTileCols, "super_m");
  check_table("gguf_linear", sub_sc, at::kChar, tiles * blocks * halves * kTileCols, "sub_sc");
  check_table("gguf_linear", sub_mn, at::kChar, tiles * blocks * halves * kTileCols, "sub_mn");
  const Weights w{packed.data_ptr<uint8_t>(), blocks, super_blocks, static_cast<int>(bits),
                  blocks * block_bytes(bits), nullptr, kScaleF32, nullptr, nullptr, 0.f, 0, 0,
                  super_d.data_ptr<float>(),
                  super_m.data_ptr<float>(), sub_sc.data_ptr<int8_t>(), sub_mn.data_ptr<int8_t>(),
                  halves};
  run(out, x, w, digits, isa);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def(
      "gguf_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor scales, Tensor mins, "
      "int bits, int digits, int isa, int scale_shift=0) -> ()");
  m.def(
      "gguf_linear_k(Tensor(a!) out, Tensor x, Tensor packed, Tensor super_d, Tensor super_m, "
      "Tensor sub_sc, Tensor sub_mn, int bits, int digits, int isa) -> ()");
  m.def("gguf_path(int isa) -> int");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_linear_k", &gguf_linear_k);
}

TORCH_LIBRARY_IMPL(pagedllm, CatchAll, m) { m.impl("gguf_path", &gguf_path); }
