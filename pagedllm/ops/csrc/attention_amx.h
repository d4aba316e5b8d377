// Attention on tiles (bf16 caches and queries): paged_attention.cpp routes its prefill tile
// items (attend_rows) here when asked (`tiles`), on AMX (CPUs with AMX-BF16) or on
// AVX512-BF16 dot products doing the tiles' work (attention_dots.h: AMD Zen 4/5), and on AMX
// its decodes too (attend_decode, at the end). The functions take the engine as a template
// argument (tile_ops.h's AmxTiles, or attention_dots.h's Registers).
//
// The 16- and 8-lane tiles spend 128 fused multiply-adds a score on q . k and p . v, which
// set their pace; here those products are tile dot products (tdpbf16ps, fp32 sums) and the
// vector units keep the softmax. Keys are taken 32 at a time (two 16-key slices of their
// blocks) against the item's rows 16 at a time (a row tile):
//
// - S^T = K Q^T: the keys are A tiles read in place from the cache (a slice's 16 rows lie
//   token_stride apart), the row tile's queries one B tile per 32 of d, transposed into
//   the tiles' pair order once per item. S^T's rows are keys and its lanes the tile's rows,
//   so the online softmax runs lane-wise: a row's max, weights and sum over the 32 keys are
//   vector operations with no horizontal reductions.
// - The weights are rounded to bf16 (as the bf16 softmax(q k^T) v of Transformers' SDPA
//   path multiplies them) and transposed into an A tile (rows, key pairs).
// - O += P V: V's 32 keys in pair order (a B tile per 16 of d, built once per 32 keys for
//   all row tiles), the product's fp32 tile added to the row's fp32 sums after they are
//   rescaled by the running max's change.
//
// Rows see keys [first, limit) (causal, and windowed); others get weight 0. A slice's rows
// past the context lie inside its block (block_size a multiple of 16, slices aligned): their
// scores are masked and their values replaced by zeros, so stale cache contents never reach
// a sum.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx_tiles.h"
#include "attention_dots.h"
#include "tile_ops.h"
#include "vec_avx2.h"
#include "vec_avx512.h"

namespace pagedllm_amx_attention {

using pagedllm_tiles::dot;
using pagedllm_tiles::load;
using pagedllm_tiles::store;
using pagedllm_tiles::transpose16;
using pagedllm_tiles::zero;

constexpr int kRowTile = 16;    // rows of a row tile: the lanes of S^T
constexpr int kSliceKeys = 16;  // keys of an A tile of K
constexpr int kStepKeys = 32;   // keys a step takes: the k of one P V product
using pagedllm_tiles::kTileDwords;

// The head sizes and block sizes taken here: a multiple of 32 of d for each q . k tile,
// at most four of them (Q^T's B tiles sit beside S^T's and K's), and slices aligned in
// their blocks.
inline bool covers(int head_dim, int block_size) {
  return (head_dim == 32 || head_dim == 64 || head_dim == 128) && block_size % kSliceKeys == 0;
}

// One kv head's keys and values in the paged cache, and a request's block table.
struct Context {
  const at::BFloat16* key_cache;
  const at::BFloat16* value_cache;
  int64_t block_stride, token_stride, head_offset;  // elements
  const int32_t* block_table;
  int block_size;
};

// An item's query rows; the caller fills the row arrays (`resize` first).
struct Scratch {
  std::vector<const at::BFloat16*> query;
  std::vector<at::BFloat16*> out;
  std::vector<int> first, limit;  // keys [first, limit) visible to a row
  std::vector<int> tile_first, tile_limit;  // the least first and greatest limit of a tile
  std::vector<uint32_t> query_t;  // per row tile and 32 of d: Q^T as a B tile
  std::vector<uint32_t> values;   // per 16 of d: V's 32 keys as a B tile
  std::vector<uint32_t> keys;     // the step's keys side by side (attention_dots.h)
  // acc: the rows' output sums, a row's D at a time (AMX) or, per row tile, d by the tile's
  // 16 row lanes (attention_dots.h); partial: a row tile's P V product (AMX).
  std::vector<float> acc, partial, m, l;
  std::vector<float> row_scores;         // a decode's rows' scores over its context
  std::vector<uint16_t> row_weights;     // their bf16 weights, 16 rows (an A tile's)
  alignas(64) float scores[kStepKeys * kRowTile];
  alignas(64) uint32_t weights[kTileDwords];  // row k: keys 2k, 2k + 1 of each row (lanes)
  alignas(64) uint32_t weights_t[kTileDwords];
  alignas(64) float rescale[kRowTile];

  Scratch(int max_rows, int head_dim) {
    const int tiles = (max_rows + kRowTile - 1) / kRowTile, padded = tiles * kRowTile;
    query.resize(padded);
    out.resize(padded);
    first.resize(padded);
    limit.resize(padded);
    tile_first.resize(tiles);
    tile_limit.resize(tiles);
    query_t.resize(static_cast<size_t>(tiles) * head_dim / 32 * kTileDwords);
    values.resize(static_cast<size_t>(head_dim) / 16 * kTileDwords);
    keys.resize(static_cast<size_t>(kStepKeys) * head_dim / 2);
    acc.resize(static_cast<size_t>(padded) * head_dim);
    partial.resize(static_cast<size_t>(kRowTile) * head_dim);
    m.resize(padded);
    l.resize(padded);
  }
};

// The engine a call's tiles run on; kNone: the vector kernel (paged_attention.cpp's own).
enum class Engine { kNone, kAmx, kBf16Dots };

// f(tiles) with the engine's tiles: AMX's, or the dot products' registers.
template <typename F>
inline void on_tiles(Engine engine, F&& f) {
  if (engine == Engine::kAmx) {
    pagedllm_tiles::AmxTiles amx;
    f(amx);
  } else {
    pagedllm_attention_dots::Registers registers;
    f(registers);
  }
}

PAGEDLLM_AMX inline void configure_tiles() {
  pagedllm_amx::TileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.rows[i] = 16;
    config.colsb[i] = 64;
  }
  pagedllm_amx::load_config(config);
}

// The tiles configured for attend_rows and attend_decode while it lives, on the thread that
// made it: once per thread and call, since loading a configuration costs as much as a short
// decode's attention (ldtilecfg clears every tile).
struct TileSession {
  TileSession() { configure_tiles(); }
  ~TileSession() { pagedllm_amx::release_tiles(); }
  TileSession(const TileSession&) = delete;
  TileSession& operator=(const TileSession&) = delete;
};

// Q^T of each row tile, per 32 of d: B[k][i] = (q_i[32 s + 2 k], q_i[32 s + 2 k + 1]).
template <int D>
PAGEDLLM_AMX void load_queries(int rows, Scratch& s) {
  constexpr int kSteps = D / 32;
  for (int r0 = 0; r0 < rows; r0 += kRowTile) {
    for (int step = 0; step < kSteps; ++step) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = r0 + i < rows ? _mm512_loadu_si512(s.query[r0 + i] + 32 * step)
                             : _mm512_setzero_si512();
      }
      transpose16(r);
      uint32_t* tile = s.query_t.data() + (r0 / kRowTile * kSteps + step) * kTileDwords;
      for (int k = 0; k < 16; ++k) _mm512_storeu_si512(tile + 16 * k, r[k]);
    }
  }
}

// V's keys 2k and 2k + 1 side by side per d, one B tile per 16 of d (G tiles from column
// col0); keys past `count` (past the context) are zeros.
template <int G>
PAGEDLLM_AMX void load_values(const at::BFloat16* const (&rows)[kStepKeys], int count, int col0,
                              Scratch& s) {
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                       40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                       32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int k = 0; k < kStepKeys / 2; ++k) {
    for (int c = 0; c < G / 2; ++c) {
      const __m512i a = 2 * k < count ? _mm512_loadu_si512(rows[2 * k] + col0 + 32 * c)
                                      : _mm512_setzero_si512();
      const __m512i b = 2 * k + 1 < count ? _mm512_loadu_si512(rows[2 * k + 1] + col0 + 32 * c)
                                          : _mm512_setzero_si512();
      uint32_t* tile = s.values.data() + 2 * c * kTileDwords + 16 * k;
      _mm512_storeu_si512(tile, _mm512_permutex2var_epi16(a, low, b));
      _mm512_storeu_si512(tile + kTileDwords, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

// s.scores[j * 16 + i] = k_j . q_i for the step's keys (slices at k0 and k1, k1 null when
// the step holds one slice) and the row tile's rows.
template <int D, typename Tiles>
PAGEDLLM_AMX void tile_scores(const at::BFloat16* k0, const at::BFloat16* k1, int64_t stride,
                              const uint32_t* query_t, Scratch& s, Tiles& t) {
  zero<0>(t);
  zero<1>(t);
  for (int step = 0; step < D / 32; ++step) {
    load<3>(t, query_t + step * kTileDwords, 64);
    load<2>(t, k0 + 32 * step, stride * 2);
    dot<0, 2, 3>(t);
    if (k1 != nullptr) {
      load<4>(t, k1 + 32 * step, stride * 2);
      dot<1, 4, 3>(t);
    }
  }
  store<0>(t, s.scores, 64);
  if (k1 != nullptr) store<1>(t, s.scores + kSliceKeys * kRowTile, 64);
}

// The online-softmax update of a row tile (rows r0 ..) over the step's `count` keys from
// position `position`: weights into s.weights (bf16, key pairs per row lane), the running
// max and sum updated, each row's rescale factor into s.rescale.
PAGEDLLM_AMX inline void tile_softmax(int r0, int position, int count, float scale, Scratch& s) {
  using pagedllm_vec::kNegInf;
  const __m512i first = _mm512_loadu_si512(s.first.data() + r0);
  const __m512i limit = _mm512_loadu_si512(s.limit.data() + r0);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  __mmask16 visible[kStepKeys] = {};
  __m512 step_max = neg_inf;
  for (int j = 0; j < count; ++j) {
    const __m512i at = _mm512_set1_epi32(position + j);
    visible[j] = _mm512_cmplt_epi32_mask(at, limit) & _mm512_cmpge_epi32_mask(at, first);
    const __m512 score = _mm512_mul_ps(_mm512_load_ps(s.scores + 16 * j), _mm512_set1_ps(scale));
    _mm512_store_ps(s.scores + 16 * j, score);
    step_max = _mm512_max_ps(step_max, _mm512_mask_blend_ps(visible[j], neg_inf, score));
  }
  const __m512 m_old = _mm512_loadu_ps(s.m.data() + r0);
  const __m512 m_new = _mm512_max_ps(m_old, step_max);
  // Rows with no visible key yet keep max -inf; their weights and factor are 0.
  const __m512 m_use = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m_new, neg_inf, _CMP_NEQ_OQ), m_new);
  const __m512 rescale = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m_old, neg_inf, _CMP_NEQ_OQ),
                                             pagedllm_vec512::exp512(_mm512_sub_ps(m_old, m_use)));
  __m512 sum = _mm512_setzero_ps();
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  for (int k = 0; k < kStepKeys / 2; ++k) {
    __m512 p[2];
    for (int e = 0; e < 2; ++e) {
      const int j = 2 * k + e;
      p[e] = j < count ? _mm512_maskz_mov_ps(
                             visible[j], pagedllm_vec512::exp512(_mm512_sub_ps(
                                             _mm512_load_ps(s.scores + 16 * j), m_use)))
                       : _mm512_setzero_ps();
      sum = _mm512_add_ps(sum, p[e]);
    }
    const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p[1], p[0]));
    _mm512_store_si512(s.weights + 16 * k, _mm512_permutexvar_epi16(pairs, packed));
  }
  _mm512_storeu_ps(s.l.data() + r0,
                   _mm512_fmadd_ps(_mm512_loadu_ps(s.l.data() + r0), rescale, sum));
  _mm512_storeu_ps(s.m.data() + r0, m_new);
  _mm512_store_ps(s.rescale, rescale);
}

// acc[r0 + i] <- acc[r0 + i] * rescale[i] + (P V)[i] for the row tile's `rows` rows.
template <int D, typename Tiles>
PAGEDLLM_AMX void tile_values(int r0, int rows, Scratch& s, Tiles& t) {
  __m512i w[16];
  for (int k = 0; k < 16; ++k) w[k] = _mm512_load_si512(s.weights + 16 * k);
  transpose16(w);
  for (int i = 0; i < 16; ++i) _mm512_store_si512(s.weights_t + 16 * i, w[i]);
  load<5>(t, s.weights_t, 64);
  float* partial = s.partial.data();
  for (int g = 0; g < D / 16; g += 4) {
    // Up to four 16-column tiles of the product at a time (tiles 0-3).
    zero<0>(t);
    zero<1>(t);
    zero<2>(t);
    zero<3>(t);
    const uint32_t* v = s.values.data() + g * kTileDwords;
    load<6>(t, v, 64);
    dot<0, 5, 6>(t);
    load<7>(t, v + kTileDwords, 64);
    dot<1, 5, 7>(t);
    store<0>(t, partial + 16 * g, D * 4);
    store<1>(t, partial + 16 * (g + 1), D * 4);
    if (g + 2 < D / 16) {
      load<6>(t, v + 2 * kTileDwords, 64);
      dot<2, 5, 6>(t);
      load<7>(t, v + 3 * kTileDwords, 64);
      dot<3, 5, 7>(t);
      store<2>(t, partial + 16 * (g + 2), D * 4);
      store<3>(t, partial + 16 * (g + 3), D * 4);
    }
  }
  for (int i = 0; i < rows; ++i) {
    const __m512 factor = _mm512_set1_ps(s.rescale[i]);
    float* acc = s.acc.data() + static_cast<int64_t>(r0 + i) * D;
    for (int d = 0; d < D; d += 16) {
      _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(_mm512_loadu_ps(acc + d), factor,
                                                _mm512_loadu_ps(partial + i * D + d)));
    }
  }
}

// The element offset of the key at `position` in the context's cache (its kv head's run).
inline int64_t key_offset(const Context& c, int position) {
  return static_cast<int64_t>(c.block_table[position / c.block_size]) * c.block_stride +
         static_cast<int64_t>(position % c.block_size) * c.token_stride + c.head_offset;
}

// Where the rows of keys position .. position + count - 1 start in `cache` (count <=
// kStepKeys; a 16-key slice never crosses a block).
inline void key_rows(const Context& c, int position, int count,
                     const at::BFloat16* (&rows)[kStepKeys], const at::BFloat16* cache) {
  for (int j0 = 0; j0 < count; j0 += kSliceKeys) {
    const at::BFloat16* first = cache + key_offset(c, position + j0);
    for (int j = j0; j < std::min(count, j0 + kSliceKeys); ++j) {
      rows[j] = first + (j - j0) * c.token_stride;
    }
  }
}

// Row r's output acc[r] / sums[r], rounded once to bf16 into s.out[r].
template <int D>
PAGEDLLM_AMX void store_outputs(int rows, const float* sums, Scratch& s) {
  for (int r = 0; r < rows; ++r) {
    const __m512 inverse = _mm512_set1_ps(1.0f / sums[r]);
    const float* acc = s.acc.data() + static_cast<int64_t>(r) * D;
    for (int d = 0; d < D; d += 16) {
      pagedllm_vec512::store16(s.out[r] + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), inverse));
    }
  }
}

// ---- the engine's parts of attend_rows: AMX's tiles above, or the dot products' registers
// (attention_dots.h), which keep each row tile's sums transposed ----------------------------

// The step's keys where the engine reads them: AMX reads its A tiles in place in the cache;
// the dot products want them side by side, copied once for all row tiles.
template <int D, typename Tiles>
PAGEDLLM_AMX inline void stage_keys(const at::BFloat16* const (&)[2], int64_t, Scratch&, Tiles&) {}

template <int D>
PAGEDLLM_AMX inline void stage_keys(const at::BFloat16* const (&keys)[2], int64_t stride,
                                    Scratch& s, pagedllm_attention_dots::Registers&) {
  pagedllm_attention_dots::copy_keys<D>(keys, stride, s.keys.data());
}

// tile_scores on the dot products: the staged keys' one or two slices.
template <int D>
PAGEDLLM_AMX void tile_scores(const at::BFloat16*, const at::BFloat16* k1, int64_t,
                              const uint32_t* query_t, Scratch& s,
                              pagedllm_attention_dots::Registers&) {
  pagedllm_attention_dots::slice_scores<D>(s.keys.data(), query_t, s.scores);
  if (k1 != nullptr) {
    pagedllm_attention_dots::slice_scores<D>(s.keys.data() + kSliceKeys * D / 2, query_t,
                                             s.scores + kSliceKeys * kRowTile);
  }
}

// tile_values on the dot products: the row tile's transposed sums, all 16 lanes.
template <int D>
PAGEDLLM_AMX void tile_values(int r0, int, Scratch& s, pagedllm_attention_dots::Registers&) {
  pagedllm_attention_dots::step_values<D>(s.weights, s.values.data(), s.rescale,
                                          s.acc.data() + static_cast<int64_t>(r0) * D);
}

// Every row's output from its sums (s.acc) over s.l, rounded once to bf16 into s.out.
template <int D, typename Tiles>
PAGEDLLM_AMX void store_rows(int rows, Scratch& s, Tiles&) {
  store_outputs<D>(rows, s.l.data(), s);
}

template <int D>
PAGEDLLM_AMX void store_rows(int rows, Scratch& s, pagedllm_attention_dots::Registers&) {
  for (int r0 = 0; r0 < rows; r0 += kRowTile) {
    pagedllm_attention_dots::store_rows<D>(std::min(kRowTile, rows - r0),
                                           s.acc.data() + static_cast<int64_t>(r0) * D,
                                           s.l.data() + r0, s.out.data() + r0);
  }
}

// Attention of `rows` rows (s.query, s.first, s.limit filled) over keys [kv_begin, kv_end)
// of the context, each row's output rounded once to bf16 into s.out.
template <int D, typename Tiles>
PAGEDLLM_AMX void attend_rows(const Context& c, int rows, int kv_begin, int kv_end, float scale,
                              Scratch& s, Tiles& t) {
  const int tiles = (rows + kRowTile - 1) / kRowTile;
  for (int r = rows; r < tiles * kRowTile; ++r) s.first[r] = s.limit[r] = 0;
  std::fill_n(s.acc.begin(), static_cast<int64_t>(tiles) * kRowTile * D, 0.0f);
  std::fill_n(s.m.begin(), tiles * kRowTile, pagedllm_vec::kNegInf);
  std::fill_n(s.l.begin(), tiles * kRowTile, 0.0f);
  // Keys each row tile may see, to skip the steps wholly outside them.
  for (int tile = 0; tile < tiles; ++tile) {
    const auto begin = s.first.begin() + tile * kRowTile;
    const int end = std::min(rows, (tile + 1) * kRowTile) - tile * kRowTile;
    s.tile_first[tile] = *std::min_element(begin, begin + end);
    const auto limits = s.limit.begin() + tile * kRowTile;
    s.tile_limit[tile] = *std::max_element(limits, limits + end);
  }
  load_queries<D>(rows, s);
  for (int position = kv_begin / kSliceKeys * kSliceKeys; position < kv_end;
       position += kStepKeys) {
    const int count = std::min(kStepKeys, kv_end - position);
    const at::BFloat16* keys[2] = {c.key_cache + key_offset(c, position), nullptr};
    if (count > kSliceKeys) keys[1] = c.key_cache + key_offset(c, position + kSliceKeys);
    const at::BFloat16* value_rows[kStepKeys];
    key_rows(c, position, count, value_rows, c.value_cache);
    load_values<D / 16>(value_rows, count, 0, s);
    stage_keys<D>(keys, c.token_stride, s, t);
    for (int tile = 0; tile < tiles; ++tile) {
      if (position >= s.tile_limit[tile] || position + count <= s.tile_first[tile]) continue;
      const int r0 = tile * kRowTile;
      tile_scores<D>(keys[0], keys[1], c.token_stride,
                     s.query_t.data() + tile * (D / 32) * kTileDwords, s, t);
      tile_softmax(r0, position, count, scale, s);
      tile_values<D>(r0, std::min(kRowTile, rows - r0), s, t);
    }
  }
  store_rows<D>(rows, s, t);
}

// ---- a decode: one token's rows over its whole context, in two passes ---------------------
//
// A decode's rows are one token's query heads of a kv head (its GQA group: a few rows), all
// seeing the same keys. attend_rows would run its softmax with those few rows in 16 lanes,
// an exp of 16 lanes for every key. Here the context's scores come first (S^T = K Q^T per
// 16 keys, transposed back so each row's scores lie in the lanes), then each row's softmax
// over them with its final max, then O = P V summed in C tiles over the whole context, with
// no running max to rescale by. The weights are rounded to bf16 as attend_rows rounds them.

// A slice's 16 rows of D elements, into the cache level `Hint` names.
template <int D, int Hint>
PAGEDLLM_AMX inline void prefetch_slice(const at::BFloat16* first, int64_t stride) {
  for (int j = 0; j < kSliceKeys; ++j) {
    const char* row = reinterpret_cast<const char*>(first + j * stride);
    for (int b = 0; b < D * 2; b += 64) _mm_prefetch(row + b, static_cast<_mm_hint>(Hint));
  }
}

// Pass one: row r's scores for keys [begin, begin + 16 * slices) into
// s.row_scores[r * width ..], -inf outside [first, limit); returns each row's max in `max`.
template <int D, typename Tiles>
PAGEDLLM_AMX void decode_scores(const Context& c, int rows, int first, int limit, int begin,
                                int width, float scale, Scratch& s, float* max, Tiles& tiles) {
  __m512 row_max[kRowTile];
  for (int r = 0; r < rows; ++r) row_max[r] = _mm512_set1_ps(pagedllm_vec::kNegInf);
  const __m512 neg_inf = _mm512_set1_ps(pagedllm_vec::kNegInf);
  const __m512 scale16 = _mm512_set1_ps(scale);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int position = begin; position < limit; position += kSliceKeys) {
    const at::BFloat16* keys = c.key_cache + key_offset(c, position);
    // The next slice's keys into L1 while this one multiplies, and this slice's values
    // into L2 for the second pass.
    if (position + kSliceKeys < limit) {
      prefetch_slice<D, _MM_HINT_T0>(c.key_cache + key_offset(c, position + kSliceKeys),
                                     c.token_stride);
    }
    prefetch_slice<D, _MM_HINT_T1>(c.value_cache + key_offset(c, position), c.token_stride);
    zero<0>(tiles);
    for (int step = 0; step < D / 32; ++step) {
      load<3>(tiles, s.query_t.data() + step * kTileDwords, 64);
      load<2>(tiles, keys + 32 * step, c.token_stride * 2);
      dot<0, 2, 3>(tiles);
    }
    store<0>(tiles, s.scores, 64);
    __m512i t[16];
    for (int k = 0; k < 16; ++k) t[k] = _mm512_load_si512(s.scores + 16 * k);
    transpose16(t);
    const __m512i at = _mm512_add_epi32(_mm512_set1_epi32(position), lane);
    const __mmask16 visible = _mm512_cmplt_epi32_mask(at, _mm512_set1_epi32(limit)) &
                              _mm512_cmpge_epi32_mask(at, _mm512_set1_epi32(first));
    for (int r = 0; r < rows; ++r) {
      const __m512 score =
          _mm512_mask_blend_ps(visible, neg_inf, _mm512_mul_ps(_mm512_castsi512_ps(t[r]), scale16));
      _mm512_storeu_ps(s.row_scores.data() + static_cast<int64_t>(r) * width + position - begin,
                       score);
      row_max[r] = _mm512_max_ps(row_max[r], score);
    }
  }
  for (int r = 0; r < rows; ++r) max[r] = _mm512_reduce_max_ps(row_max[r]);
}

// Row r's weights exp(score - max) over the `keys` scores written (0 where a score is -inf
// and past them, to width), rounded to bf16 into s.row_weights; returns their fp32 sum.
PAGEDLLM_AMX inline float decode_weights(int r, int keys, int width, float max, Scratch& s) {
  const float* scores = s.row_scores.data() + static_cast<int64_t>(r) * width;
  uint16_t* weights = s.row_weights.data() + static_cast<int64_t>(r) * width;
  const __m512 m = _mm512_set1_ps(max);
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < width; j += 16) {
    __m512 p = _mm512_setzero_ps();
    if (j < keys) {
      const __m512 score = _mm512_loadu_ps(scores + j);
      const __mmask16 seen = _mm512_cmp_ps_mask(score, _mm512_set1_ps(pagedllm_vec::kNegInf),
                                                _CMP_NEQ_OQ);
      p = _mm512_maskz_mov_ps(seen, pagedllm_vec512::exp512(_mm512_sub_ps(score, m)));
    }
    sum = _mm512_add_ps(sum, p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + j),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
  }
  return _mm512_reduce_add_ps(sum);
}

// Pass two: O = P V for columns [col0, col0 + 16 * G) into s.acc (rows 16, stride D).
template <int D, int G, typename Tiles>
PAGEDLLM_AMX void decode_values(const Context& c, int limit, int begin, int width, int col0,
                                Scratch& s, Tiles& t) {
  zero<0>(t);
  if (G > 1) zero<1>(t);
  if (G > 2) zero<2>(t);
  if (G > 3) zero<3>(t);
  const at::BFloat16* rows[kStepKeys];
  for (int position = begin; position < limit; position += kStepKeys) {
    const int count = std::min(kStepKeys, limit - position);
    key_rows(c, position, count, rows, c.value_cache);
    load_values<G>(rows, count, col0, s);
    load<4>(t, s.row_weights.data() + (position - begin), width * 2);
    for (int i = 0; i < G; ++i) {
      load<5>(t, s.values.data() + i * kTileDwords, 64);
      // Tile numbers must be constants: G <= 4 accumulators.
      switch (i) {
        case 0: dot<0, 4, 5>(t); break;
        case 1: dot<1, 4, 5>(t); break;
        case 2: dot<2, 4, 5>(t); break;
        default: dot<3, 4, 5>(t); break;
      }
    }
  }
  float* acc = s.acc.data() + col0;
  store<0>(t, acc, D * 4);
  if (G > 1) store<1>(t, acc + 16, D * 4);
  if (G > 2) store<2>(t, acc + 32, D * 4);
  if (G > 3) store<3>(t, acc + 48, D * 4);
}

// Attention of a decode's `rows` rows (s.query, s.out filled; rows <= 16) over keys
// [first, limit) of the context, each row's output rounded once to bf16 into s.out.
template <int D, typename Tiles>
PAGEDLLM_AMX void attend_decode(const Context& c, int rows, int first, int limit, float scale,
                                Scratch& s, Tiles& t) {
  const int begin = first / kSliceKeys * kSliceKeys;
  const int keys = (limit - begin + kSliceKeys - 1) / kSliceKeys * kSliceKeys;
  const int width = (limit - begin + kStepKeys - 1) / kStepKeys * kStepKeys;
  if (s.row_scores.size() < static_cast<size_t>(rows) * width) {
    s.row_scores.resize(static_cast<size_t>(rows) * width);
  }
  if (s.row_weights.size() < static_cast<size_t>(kRowTile) * width) {
    s.row_weights.resize(static_cast<size_t>(kRowTile) * width);
  }
  load_queries<D>(rows, s);
  float maxima[kRowTile], sum[kRowTile];
  decode_scores<D>(c, rows, first, limit, begin, width, scale, s, maxima, t);
  for (int r = 0; r < rows; ++r) sum[r] = decode_weights(r, keys, width, maxima[r], s);
  constexpr int G = D / 16 < 4 ? D / 16 : 4;
  for (int col0 = 0; col0 < D; col0 += 16 * G) {
    decode_values<D, G>(c, limit, begin, width, col0, s, t);
  }
  store_outputs<D>(rows, sum, s);
}

}  // namespace pagedllm_amx_attention
