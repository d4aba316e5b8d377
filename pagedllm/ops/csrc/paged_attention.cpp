// Paged attention on the CPU: reads K/V in place from the paged cache through each
// request's block table (no gather), for decode and (chunked) prefill in one call.
//
// Layout (see pagedllm/ops/attention.py): query [T, H, D] fp32 or bf16 (out alike), caches
// [num_blocks, block_size, Hkv, D] in fp32 / bf16 / fp16, or int8 / fp8 (e4m3, e5m2) with
// an fp32 scale per token and kv head ([num_blocks, block_size, Hkv]: pagedllm/ops/kv_quant.py)
// dequantized in the inner loops (a key's scale multiplies its scores, a value's its
// weight), never into a full-precision copy; block tables [R, M] int32,
// query_start_loc [R + 1] and seq_lens [R] int32. Request r's queries sit at positions
// seq_len - query_len .. seq_len - 1 and see keys 0 .. their own position (causal), or
// with a sliding window W only the last W of those (position - W + 1 .. position): blocks
// wholly before a row's window are never read (they may be the null block).
//
// A work item is (request, kv head, tile of query tokens): a decode is one item per kv
// head (or one for all its kv heads when decodes are many), a prefill chunk one per kv
// head and tile. Its rows are the tile's tokens times the query heads of the kv head's
// group (GQA), so every K/V row of a block is fetched from memory once per item and
// reused from L1 by all rows. A prefill tile takes a block's keys sixteen at a time,
// transposed into the vector lanes once for all its rows, and its rows six at a time, so
// each key vector loaded serves six rows. Softmax is online over the blocks
// (running max and sum per row, fp32), so nothing is materialized per context. Items are
// spread over OpenMP threads costliest first with dynamic scheduling, because their costs
// (context lengths) differ widely. Asked for `tiles`, a bf16 cache's prefill tiles run on
// tiles instead (attention_amx.h: "amx", or "bf16_dots", AVX512-BF16 dot products doing
// their work; the weights rounded to bf16 before P V), and its decodes too: on AMX (of up to
// 16 query heads a kv head), AMX's tiles configured once per thread and call; on dot products
// a slice of keys at a time for all of a kv head's rows (decode_dots.h).

// Registered as torch.ops.pagedllm.* through TORCH_LIBRARY rather than a pybind11 module:
// it compiles in a third of the time (~15 s here: no torch/extension.h, no pybind11) and
// the dispatcher releases the GIL for the call.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <omp.h>
#include <torch/library.h>

#include "attention_amx.h"
#include "decode_dots.h"
#include "vec_avx2.h"
#include "vec_avx512.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace pagedllm_vec;

// ---- the three steps of one row over one block -----------------------------------------

// scores[j] = q . K[j] for j < n, four keys at a time so one reduction serves four dot
// products, each split over two accumulators so the FMA chains are half as long. Key rows
// past n are clamped to n - 1 (their lanes are masked later): they may lie outside the block.
template <int NV, typename T>
inline void block_scores(const float* q, const T* keys, int64_t stride, int n, float* scores) {
  for (int j = 0; j < n; j += 4) {
    const T* k0 = keys + j * stride;
    const T* k1 = keys + std::min(j + 1, n - 1) * stride;
    const T* k2 = keys + std::min(j + 2, n - 1) * stride;
    const T* k3 = keys + std::min(j + 3, n - 1) * stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
#pragma GCC unroll 16
    for (int v = 0; v + 1 < NV; v += 2) {
      const __m256 qa = _mm256_loadu_ps(q + 8 * v), qb = _mm256_loadu_ps(q + 8 * v + 8);
      a0 = _mm256_fmadd_ps(qa, load8(k0 + 8 * v), a0);
      a1 = _mm256_fmadd_ps(qa, load8(k1 + 8 * v), a1);
      a2 = _mm256_fmadd_ps(qa, load8(k2 + 8 * v), a2);
      a3 = _mm256_fmadd_ps(qa, load8(k3 + 8 * v), a3);
      b0 = _mm256_fmadd_ps(qb, load8(k0 + 8 * v + 8), b0);
      b1 = _mm256_fmadd_ps(qb, load8(k1 + 8 * v + 8), b1);
      b2 = _mm256_fmadd_ps(qb, load8(k2 + 8 * v + 8), b2);
      b3 = _mm256_fmadd_ps(qb, load8(k3 + 8 * v + 8), b3);
    }
    if constexpr (NV % 2) {
      const __m256 qa = _mm256_loadu_ps(q + 8 * (NV - 1));
      a0 = _mm256_fmadd_ps(qa, load8(k0 + 8 * (NV - 1)), a0);
      a1 = _mm256_fmadd_ps(qa, load8(k1 + 8 * (NV - 1)), a1);
      a2 = _mm256_fmadd_ps(qa, load8(k2 + 8 * (NV - 1)), a2);
      a3 = _mm256_fmadd_ps(qa, load8(k3 + 8 * (NV - 1)), a3);
    }
    const __m128 dots = reduce4(_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1),
                                _mm256_add_ps(a2, b2), _mm256_add_ps(a3, b3));
    _mm_storeu_ps(scores + j, dots);
  }
}

inline float masked_max(const float* scores, int n) {
  __m256 m = _mm256_set1_ps(kNegInf);
  for (int j = 0; j < n; j += 8) {
    const __m256 s = _mm256_blendv_ps(_mm256_set1_ps(kNegInf), _mm256_loadu_ps(scores + j),
                                      lanes_below(j, n));
    m = _mm256_max_ps(m, s);
  }
  return hmax(m);
}

// scores[j] <- exp(scores[j] - max), exactly 0 past n; returns their sum.
inline float exp_and_sum(float* scores, int n, float max) {
  __m256 sum = _mm256_setzero_ps();
  const __m256 m = _mm256_set1_ps(max);
  for (int j = 0; j < n; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + j), m));
    const __m256 p = _mm256_and_ps(e, lanes_below(j, n));
    _mm256_storeu_ps(scores + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  return hsum(sum);
}

// acc <- acc * rescale + sum_j p[j] V[j], in chunks of at most 8 vectors so the
// accumulators stay in registers across the block's keys.
template <int NV, int C0 = 0, typename T>
inline void accumulate_values(float* acc, const T* values, int64_t stride, const float* p,
                              int n, float rescale) {
  constexpr int NC = NV - C0 < 8 ? NV - C0 : 8;
  __m256 a[NC];
  const __m256 r = _mm256_set1_ps(rescale);
  for (int v = 0; v < NC; ++v) a[v] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * (C0 + v)), r);
  for (int j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const T* row = values + j * stride + 8 * C0;
#pragma GCC unroll 8
    for (int v = 0; v < NC; ++v) a[v] = _mm256_fmadd_ps(pj, load8(row + 8 * v), a[v]);
  }
  for (int v = 0; v < NC; ++v) _mm256_storeu_ps(acc + 8 * (C0 + v), a[v]);
  if constexpr (C0 + 8 < NV) accumulate_values<NV, C0 + 8>(acc, values, stride, p, n, rescale);
}

// Blocks are scattered over the cache, which the hardware prefetchers cannot guess, so the
// next block is prefetched in software: into L2, since L1 has too few miss buffers for a
// block in flight, and a slice per row rather than all at once, because a burst of
// prefetches stalls the pipeline once the miss queues are full.
template <typename T>
inline void prefetch_rows(const T* first_row, int64_t stride, int n, int64_t row_elements) {
  const int64_t row_bytes = row_elements * static_cast<int64_t>(sizeof(T));
  for (int j = 0; j < n; ++j) {
    const char* row = reinterpret_cast<const char*>(first_row + j * stride);
    for (int64_t offset = 0; offset < row_bytes; offset += 64) {
      _mm_prefetch(row + offset, _MM_HINT_T1);
    }
  }
}

// x[j] *= unit * scale[j * stride] for j < n: a quantized cache's per-key factors applied
// to scores (keys) or softmax weights (values).
inline void scale_by_rows(float* x, const float* scale, int64_t stride, int n, float unit) {
  for (int j = 0; j < n; ++j) x[j] *= unit * scale[j * stride];
}

// ---- problem, work items, per-thread scratch -------------------------------------------

// Query rows per work item: a prefill tile is this many rows over the tokens of one kv
// head's group, so its queries and accumulators stay in L1/L2 beside the block in use.
constexpr int kRowsPerItem = 48;

template <typename T>
struct Problem {
  // query [T, H, D] and out (contiguous, shaped alike) in fp32, or both in bf16 (a bf16
  // model's: read as fp32, each output rounded once, as the fp32 round trip would give).
  const void* query;
  int64_t query_token_stride, query_head_stride;
  void* out;
  bool bf16_io;
  const T* key_cache;
  const T* value_cache;
  int64_t block_stride, token_stride;  // in elements
  // Quantized caches' scales (null otherwise): the row at element offset o (a multiple of
  // head_dim) has its scale at o / head_dim, so a token's are token_stride / head_dim apart.
  const float* key_scale;
  const float* value_scale;
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  int num_heads, group, head_dim, block_size;
  float scale;
  int window;  // sliding window in tokens; 0: none
  // The engine prefill tiles (and, on AMX, decodes) run on (attention_amx.h): kNone but for
  // bf16 caches and queries at head and block sizes it covers.
  pagedllm_amx_attention::Engine tiles;
};

// Query tokens [q_begin, q_end) of a request (indices within its chunk) against kv heads
// [kv_head, kv_head_end); its rows are those tokens times the heads' query heads,
// token-major.
struct WorkItem {
  int req, kv_head, kv_head_end, q_begin, q_end;
  int64_t cost;
};

// Rows that share a kv head are taken together (up to kMaxGroupRows): every K and V vector
// loaded (and, for a 16-bit cache, converted) then serves all of them, where a row at a time
// loads each vector once per row and the loads, not the FMAs, set the pace. Six rows keep
// twelve score chains in flight (FMA latency times throughput is eight) in 15 registers;
// against four, a 2,048-token prompt's call took 4-5% less and 8 x 256 tokens' 8% less.
constexpr int kMaxGroupRows = 6;

// A tile's keys are taken kSliceKeys at a time, transposed so the keys lie in the lanes:
// a row's scores are then FMAs over d (a broadcast query element times a vector of keys)
// with no horizontal reductions, and its softmax runs on the two score vectors in registers.
// The transposition is paid once per slice and item and serves all of the tile's rows.
constexpr int kSliceKeys = 16;

struct Scratch {
  std::vector<float> q, acc, m, l, scores;
  std::vector<int> limit, first;
  std::vector<int64_t> head_offset;  // of the row's kv head within a cache token, elements
  std::vector<float> key_t;          // a slice's keys transposed: head_dim x kSliceKeys
  std::vector<float> group_scores;   // kMaxGroupRows rows of a slice's weights
  std::unique_ptr<pagedllm_amx_attention::Scratch> amx;  // where the tiles run
  pagedllm_decode_dots::Scratch dots;  // decodes on dot products (grown on first use)
  Scratch(int max_rows, int head_dim, int block_size, bool tiles)
      : q(max_rows * head_dim), acc(max_rows * head_dim), m(max_rows), l(max_rows),
        scores((block_size + 15) / 16 * 16), limit(max_rows), first(max_rows),
        head_offset(max_rows),
        key_t(head_dim * kSliceKeys), group_scores(kMaxGroupRows * kSliceKeys),
        amx(tiles ? std::make_unique<pagedllm_amx_attention::Scratch>(max_rows, head_dim)
                  : nullptr) {}
};

// Scaled queries into scratch; a row sees keys [first, limit) (causal, and windowed).
template <int NV, typename T>
void load_rows(const Problem<T>& p, const WorkItem& w, int context_start, Scratch& s) {
  constexpr int D = NV * 8;
  const int q0 = p.query_start_loc[w.req];
  const int heads = (w.kv_head_end - w.kv_head) * p.group;
  for (int t = w.q_begin, r = 0; t < w.q_end; ++t) {
    for (int h = 0; h < heads; ++h, ++r) {
      const int head = w.kv_head * p.group + h;
      const int64_t at = static_cast<int64_t>(q0 + t) * p.query_token_stride +
                         static_cast<int64_t>(head) * p.query_head_stride;
      if (p.bf16_io) {
        const auto* src = static_cast<const at::BFloat16*>(p.query) + at;
        for (int d = 0; d < D; ++d) s.q[r * D + d] = static_cast<float>(src[d]) * p.scale;
      } else {
        const float* src = static_cast<const float*>(p.query) + at;
        for (int d = 0; d < D; ++d) s.q[r * D + d] = src[d] * p.scale;
      }
      std::fill_n(s.acc.begin() + r * D, D, 0.0f);
      s.m[r] = kNegInf;
      s.l[r] = 0.0f;
      s.limit[r] = context_start + t + 1;
      s.first[r] = p.window > 0 ? std::max(0, s.limit[r] - p.window) : 0;
      s.head_offset[r] = static_cast<int64_t>(head / p.group) * D;
    }
  }
}

template <int NV, typename T>
void store_rows(const Problem<T>& p, const WorkItem& w, const Scratch& s) {
  constexpr int D = NV * 8;
  const int q0 = p.query_start_loc[w.req];
  const int heads = (w.kv_head_end - w.kv_head) * p.group;
  for (int t = w.q_begin, r = 0; t < w.q_end; ++t) {
    const int64_t at = (static_cast<int64_t>(q0 + t) * p.num_heads + w.kv_head * p.group) * D;
    for (int h = 0; h < heads; ++h, ++r) {
      const float inv = 1.0f / s.l[r];
      if (p.bf16_io) {
        auto* dst = static_cast<at::BFloat16*>(p.out) + at + h * D;
        for (int d = 0; d < D; ++d) dst[d] = static_cast<at::BFloat16>(s.acc[r * D + d] * inv);
      } else {
        float* dst = static_cast<float*>(p.out) + at + h * D;
        for (int d = 0; d < D; ++d) dst[d] = s.acc[r * D + d] * inv;
      }
    }
  }
}

// ---- a group of rows over one block -----------------------------------------------------

// The group's share of the next block, to prefetch: its keys before the scores and its
// values before the value pass, so no burst outruns the miss queues (see prefetch_rows).
template <typename T>
struct Ahead {
  const T* keys;
  const T* values;
  int tokens;
  int64_t run_elements;
};

// key_t[d * kSliceKeys + j] = K[j][d] for the slice's first n keys; rows past n repeat row
// n - 1 (finite, and masked later): they may lie outside the block.
// A quantized cache's keys are dequantized here, by their scales (at `scale`, `scale_stride`).
template <int NV, typename T>
inline void transpose_keys(const T* keys, int64_t stride, int n, float* key_t,
                           const float* scale, int64_t scale_stride) {
  for (int j0 = 0; j0 < kSliceKeys; j0 += 8) {
    const T* row[8];
    __m256 factor[8];
    for (int i = 0; i < 8; ++i) {
      row[i] = keys + std::min(j0 + i, n - 1) * stride;
      if constexpr (kQuantized<T>) {
        factor[i] = _mm256_set1_ps(kRawUnit<T> * scale[std::min(j0 + i, n - 1) * scale_stride]);
      }
    }
    for (int v = 0; v < NV; ++v) {
      __m256 x[8];
      for (int i = 0; i < 8; ++i) x[i] = load8(row[i] + 8 * v);
      if constexpr (kQuantized<T>) {
        for (int i = 0; i < 8; ++i) x[i] = _mm256_mul_ps(x[i], factor[i]);
      }
      transpose8(x);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(key_t + (8 * v + i) * kSliceKeys + j0, x[i]);
    }
  }
}

// scores[r] = (q_r . K[0..7], q_r . K[8..15]) for R rows. Each row's sums over d are split
// into C chains so that at least eight FMA chains are in flight for any R.
template <int NV, int R>
inline void group_scores(const float* q, const float* key_t, __m256 (&scores)[R][2]) {
  constexpr int D = NV * 8, C = (4 + R - 1) / R;
  __m256 a[C][R][2];
  for (int c = 0; c < C; ++c) {
    for (int r = 0; r < R; ++r) a[c][r][0] = a[c][r][1] = _mm256_setzero_ps();
  }
#pragma GCC unroll 8
  for (int d = 0; d < D; d += C) {
    for (int c = 0; c < C; ++c) {
      const __m256 k0 = _mm256_loadu_ps(key_t + (d + c) * kSliceKeys);
      const __m256 k1 = _mm256_loadu_ps(key_t + (d + c) * kSliceKeys + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_broadcast_ss(q + r * D + d + c);
        a[c][r][0] = _mm256_fmadd_ps(x, k0, a[c][r][0]);
        a[c][r][1] = _mm256_fmadd_ps(x, k1, a[c][r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    scores[r][0] = a[0][r][0];
    scores[r][1] = a[0][r][1];
    for (int c = 1; c < C; ++c) {
      scores[r][0] = _mm256_add_ps(scores[r][0], a[c][r][0]);
      scores[r][1] = _mm256_add_ps(scores[r][1], a[c][r][1]);
    }
  }
}

// Row r's online-softmax update over a slice whose keys lo .. n - 1 it may see (lo > 0: a
// window starts inside the slice): weights (0 outside) to p, running max and sum updated;
// returns the factor for its accumulator.
inline float slice_softmax(const __m256 (&scores)[2], int lo, int n, int r, Scratch& s,
                           float* p) {
  const __m256 in0 = _mm256_andnot_ps(lanes_below(0, lo), lanes_below(0, n));
  const __m256 in1 = _mm256_andnot_ps(lanes_below(8, lo), lanes_below(8, n));
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  const __m256 s0 = _mm256_blendv_ps(neg_inf, scores[0], in0);
  const __m256 s1 = _mm256_blendv_ps(neg_inf, scores[1], in1);
  const float m_new = std::max(s.m[r], hmax(_mm256_max_ps(s0, s1)));
  const float rescale = m_new == s.m[r] ? 1.0f : std::exp(s.m[r] - m_new);
  const __m256 m = _mm256_set1_ps(m_new);
  const __m256 p0 = _mm256_and_ps(exp256(_mm256_sub_ps(s0, m)), in0);
  const __m256 p1 = _mm256_and_ps(exp256(_mm256_sub_ps(s1, m)), in1);
  _mm256_storeu_ps(p, p0);
  _mm256_storeu_ps(p + 8, p1);
  s.l[r] = s.l[r] * rescale + hsum(_mm256_add_ps(p0, p1));
  s.m[r] = m_new;
  return rescale;
}

// acc_r <- acc_r * rescale[r] + sum_j p_r[j] V[j] for R rows (p_r at p + r * kSliceKeys), in
// chunks of NC vectors so the R * NC accumulators and the R broadcast weights fit the 16
// registers.
template <int NV, int R, int C0 = 0, typename T>
inline void group_values(float* acc, const T* values, int64_t stride, const float* p,
                         int n, const float* rescale) {
  constexpr int D = NV * 8;
  constexpr int kRegs = (14 - R) / R;
  constexpr int NC = NV - C0 < kRegs ? NV - C0 : kRegs;
  __m256 a[R][NC];
  for (int r = 0; r < R; ++r) {
    const __m256 scale = _mm256_set1_ps(rescale[r]);
    for (int v = 0; v < NC; ++v) {
      a[r][v] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + 8 * (C0 + v)), scale);
    }
  }
  for (int j = 0; j < n; ++j) {
    const T* row = values + j * stride + 8 * C0;
    __m256 pj[R];
    for (int r = 0; r < R; ++r) pj[r] = _mm256_set1_ps(p[r * kSliceKeys + j]);
#pragma GCC unroll 8
    for (int v = 0; v < NC; ++v) {
      const __m256 x = load8(row + 8 * v);
      for (int r = 0; r < R; ++r) a[r][v] = _mm256_fmadd_ps(pj[r], x, a[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NC; ++v) _mm256_storeu_ps(acc + r * D + 8 * (C0 + v), a[r][v]);
  }
  if constexpr (C0 + NC < NV) {
    group_values<NV, R, C0 + NC>(acc, values, stride, p, n, rescale);
  }
}

// One row against the first n keys of a block: the online-softmax update. Decode items'
// rows take this path (prefill tiles take attend_group's).
// A quantized cache's scales (key_scale, value_scale: the first key's, scale_stride apart)
// multiply the raw dot products and the weights of the raw values.
template <int NV, typename T>
inline void attend_block(const T* keys, const T* values, int64_t stride, int n, int r,
                         Scratch& s, const float* key_scale, const float* value_scale,
                         int64_t scale_stride) {
  constexpr int D = NV * 8;
  float* scores = s.scores.data();
  block_scores<NV>(&s.q[r * D], keys, stride, n, scores);
  if constexpr (kQuantized<T>) scale_by_rows(scores, key_scale, scale_stride, n, kRawUnit<T>);
  const float m_new = std::max(s.m[r], masked_max(scores, n));
  // exp(-inf) = 0 on the first block; libm's exp is worth skipping when the max holds.
  const float rescale = m_new == s.m[r] ? 1.0f : std::exp(s.m[r] - m_new);
  s.l[r] = s.l[r] * rescale + exp_and_sum(scores, n, m_new);
  s.m[r] = m_new;
  if constexpr (kQuantized<T>) scale_by_rows(scores, value_scale, scale_stride, n, kRawUnit<T>);
  accumulate_values<NV>(&s.acc[r * D], values, stride, scores, n, rescale);
}

// Rows r0 .. r0 + R - 1 (one kv head) against the first n keys of a slice (its keys in
// s.key_t), row r seeing keys lo[r] .. valid[r] - 1 of them: the online-softmax update. A
// row's weights outside its own keys are zero, so the shared value pass leaves it as it was.
// A quantized cache's value factors (kRawUnit times each key's value scale, 0 past the
// slice: kSliceKeys of them) multiply the rows' weights.
template <int NV, int R, typename T>
inline void attend_group(const T* values, int64_t stride, int n, int r0, const int* lo,
                         const int* valid, const Ahead<T>& ahead, Scratch& s,
                         const float* value_factor) {
  constexpr int D = NV * 8;
  float* p = s.group_scores.data();
  prefetch_rows(ahead.keys, stride, ahead.tokens, ahead.run_elements);
  __m256 scores[R][2];
  group_scores<NV, R>(&s.q[r0 * D], s.key_t.data(), scores);
  float rescale[R];
  for (int i = 0; i < R; ++i) {
    rescale[i] = slice_softmax(scores[i], lo[i], std::max(valid[i], 0), r0 + i, s,
                               p + i * kSliceKeys);
    if constexpr (kQuantized<T>) {
      float* weights = p + i * kSliceKeys;
      for (int h = 0; h < kSliceKeys; h += 8) {
        _mm256_storeu_ps(weights + h, _mm256_mul_ps(_mm256_loadu_ps(weights + h),
                                                    _mm256_loadu_ps(value_factor + h)));
      }
    }
  }
  prefetch_rows(ahead.values, stride, ahead.tokens, ahead.run_elements);
  group_values<NV, R>(&s.acc[r0 * D], values, stride, p, n, rescale);
}

// ---- the same group on 16 lanes (AVX-512; fp32 and bf16 caches) --------------------------
//
// A slice's 16 keys fill one register, so a row's scores are one vector and its values'
// sums half the vectors. Every lane does the 8-lane code's operations in its order (the
// score chains, the exp, the sum of weights as two halves): the same bits.

template <typename T>
constexpr bool kWideLanes = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>;

template <int NV, int R>
PAGEDLLM_AVX512 inline void group_scores16(const float* q, const float* key_t,
                                           __m512 (&scores)[R]) {
  constexpr int D = NV * 8, C = (4 + R - 1) / R;
  __m512 a[C][R];
  for (int c = 0; c < C; ++c) {
    for (int r = 0; r < R; ++r) a[c][r] = _mm512_setzero_ps();
  }
#pragma GCC unroll 8
  for (int d = 0; d < D; d += C) {
    for (int c = 0; c < C; ++c) {
      const __m512 k = _mm512_loadu_ps(key_t + (d + c) * kSliceKeys);
      for (int r = 0; r < R; ++r) {
        a[c][r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d + c]), k, a[c][r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    scores[r] = a[0][r];
    for (int c = 1; c < C; ++c) scores[r] = _mm512_add_ps(scores[r], a[c][r]);
  }
}

PAGEDLLM_AVX512 inline float slice_softmax16(__m512 scores, int lo, int n, int r, Scratch& s,
                                             float* p) {
  // Lanes lo .. n - 1 (lo may lie past the slice: a window starting after it).
  const unsigned below_n = (1u << std::clamp(n, 0, kSliceKeys)) - 1u;
  const unsigned below_lo = (1u << std::clamp(lo, 0, kSliceKeys)) - 1u;
  const __mmask16 in = static_cast<__mmask16>(below_n & ~below_lo);
  const __m512 masked = _mm512_mask_blend_ps(in, _mm512_set1_ps(kNegInf), scores);
  const float m_new = std::max(s.m[r], _mm512_reduce_max_ps(masked));
  const float rescale = m_new == s.m[r] ? 1.0f : std::exp(s.m[r] - m_new);
  const __m512 weights = _mm512_maskz_mov_ps(
      in, pagedllm_vec512::exp512(_mm512_sub_ps(masked, _mm512_set1_ps(m_new))));
  _mm512_storeu_ps(p, weights);
  const __m256 low = _mm512_castps512_ps256(weights);
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(weights), 1));
  s.l[r] = s.l[r] * rescale + hsum(_mm256_add_ps(low, high));
  s.m[r] = m_new;
  return rescale;
}

template <int NV, int R, int C0 = 0, typename T>
PAGEDLLM_AVX512 inline void group_values16(float* acc, const T* values, int64_t stride,
                                           const float* p, int n, const float* rescale) {
  constexpr int D = NV * 8, NV16 = D / 16;
  constexpr int kRegs = (30 - R) / R;
  constexpr int NC = NV16 - C0 < kRegs ? NV16 - C0 : kRegs;
  __m512 a[R][NC];
  for (int r = 0; r < R; ++r) {
    const __m512 scale = _mm512_set1_ps(rescale[r]);
    for (int v = 0; v < NC; ++v) {
      a[r][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * (C0 + v)), scale);
    }
  }
  for (int j = 0; j < n; ++j) {
    const T* row = values + j * stride + 16 * C0;
    __m512 pj[R];
    for (int r = 0; r < R; ++r) pj[r] = _mm512_set1_ps(p[r * kSliceKeys + j]);
#pragma GCC unroll 8
    for (int v = 0; v < NC; ++v) {
      const __m512 x = pagedllm_vec512::load16(row + 16 * v);
      for (int r = 0; r < R; ++r) a[r][v] = _mm512_fmadd_ps(pj[r], x, a[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NC; ++v) _mm512_storeu_ps(acc + r * D + 16 * (C0 + v), a[r][v]);
  }
  if constexpr (C0 + NC < NV16) {
    group_values16<NV, R, C0 + NC>(acc, values, stride, p, n, rescale);
  }
}

template <int NV, int R, typename T>
PAGEDLLM_AVX512 inline void attend_group16(const T* values, int64_t stride, int n, int r0,
                                           const int* lo, const int* valid,
                                           const Ahead<T>& ahead, Scratch& s) {
  constexpr int D = NV * 8;
  float* p = s.group_scores.data();
  prefetch_rows(ahead.keys, stride, ahead.tokens, ahead.run_elements);
  __m512 scores[R];
  group_scores16<NV, R>(&s.q[r0 * D], s.key_t.data(), scores);
  float rescale[R];
  for (int i = 0; i < R; ++i) {
    rescale[i] = slice_softmax16(scores[i], lo[i], std::max(valid[i], 0), r0 + i, s,
                                 p + i * kSliceKeys);
  }
  prefetch_rows(ahead.values, stride, ahead.tokens, ahead.run_elements);
  group_values16<NV, R>(&s.acc[r0 * D], values, stride, p, n, rescale);
}

// A decode row against a block on 16 lanes: its dot products take the 8-lane code's two
// accumulators (even and odd 8-element chunks of d) as the two halves of one register, its
// weights' sum adds the halves in the 8-lane order.
template <int NV, typename T>
PAGEDLLM_AVX512 inline void block_scores16(const float* q, const T* keys, int64_t stride, int n,
                                           float* scores) {
  for (int j = 0; j < n; j += 4) {
    const T* k[4];
    for (int i = 0; i < 4; ++i) k[i] = keys + std::min(j + i, n - 1) * stride;
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
#pragma GCC unroll 16
    for (int v = 0; v < NV / 2; ++v) {
      const __m512 qv = _mm512_loadu_ps(q + 16 * v);
      for (int i = 0; i < 4; ++i) {
        a[i] = _mm512_fmadd_ps(qv, pagedllm_vec512::load16(k[i] + 16 * v), a[i]);
      }
    }
    __m256 halves[4];
    for (int i = 0; i < 4; ++i) {
      halves[i] = _mm256_add_ps(
          _mm512_castps512_ps256(a[i]),
          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1)));
    }
    _mm_storeu_ps(scores + j, reduce4(halves[0], halves[1], halves[2], halves[3]));
  }
}

PAGEDLLM_AVX512 inline float exp_and_sum16(float* scores, int n, float max) {
  __m256 sum = _mm256_setzero_ps();
  const __m512 m = _mm512_set1_ps(max);
  for (int j = 0; j < n; j += 16) {
    const int left = n - j;
    const __mmask16 in = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1u);
    const __m512 p = _mm512_maskz_mov_ps(
        in, pagedllm_vec512::exp512(_mm512_sub_ps(_mm512_loadu_ps(scores + j), m)));
    _mm512_storeu_ps(scores + j, p);
    sum = _mm256_add_ps(sum, _mm512_castps512_ps256(p));
    if (left > 8) {
      sum = _mm256_add_ps(sum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1)));
    }
  }
  return hsum(sum);
}

template <int NV, int C0 = 0, typename T>
PAGEDLLM_AVX512 inline void accumulate_values16(float* acc, const T* values, int64_t stride,
                                                const float* p, int n, float rescale) {
  constexpr int NV16 = NV / 2, NC = NV16 - C0 < 16 ? NV16 - C0 : 16;
  __m512 a[NC];
  const __m512 r = _mm512_set1_ps(rescale);
  for (int v = 0; v < NC; ++v) a[v] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * (C0 + v)), r);
  for (int j = 0; j < n; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j]);
    const T* row = values + j * stride + 16 * C0;
#pragma GCC unroll 16
    for (int v = 0; v < NC; ++v) {
      a[v] = _mm512_fmadd_ps(pj, pagedllm_vec512::load16(row + 16 * v), a[v]);
    }
  }
  for (int v = 0; v < NC; ++v) _mm512_storeu_ps(acc + 16 * (C0 + v), a[v]);
  if constexpr (C0 + NC < NV16) {
    accumulate_values16<NV, C0 + NC>(acc, values, stride, p, n, rescale);
  }
}

template <int NV, typename T>
PAGEDLLM_AVX512 inline void attend_block16(const T* keys, const T* values, int64_t stride, int n,
                                           int r, Scratch& s) {
  constexpr int D = NV * 8;
  float* scores = s.scores.data();
  block_scores16<NV>(&s.q[r * D], keys, stride, n, scores);
  const float m_new = std::max(s.m[r], masked_max(scores, n));
  const float rescale = m_new == s.m[r] ? 1.0f : std::exp(s.m[r] - m_new);
  s.l[r] = s.l[r] * rescale + exp_and_sum16(scores, n, m_new);
  s.m[r] = m_new;
  accumulate_values16<NV>(&s.acc[r * D], values, stride, scores, n, rescale);
}

template <int NV, typename T>
inline void attend_rows(const T* values, int64_t stride, int n, int r0, int count,
                        const int* lo, const int* valid, const Ahead<T>& ahead, Scratch& s,
                        const float* vf) {
  if constexpr (kWideLanes<T> && NV % 2 == 0) {
    if (pagedllm_vec512::vector_lanes == 16) {
      switch (count) {
        case 1: return attend_group16<NV, 1>(values, stride, n, r0, lo, valid, ahead, s);
        case 2: return attend_group16<NV, 2>(values, stride, n, r0, lo, valid, ahead, s);
        case 3: return attend_group16<NV, 3>(values, stride, n, r0, lo, valid, ahead, s);
        case 4: return attend_group16<NV, 4>(values, stride, n, r0, lo, valid, ahead, s);
        case 5: return attend_group16<NV, 5>(values, stride, n, r0, lo, valid, ahead, s);
        default: return attend_group16<NV, 6>(values, stride, n, r0, lo, valid, ahead, s);
      }
    }
  }
  switch (count) {
    case 1: return attend_group<NV, 1>(values, stride, n, r0, lo, valid, ahead, s, vf);
    case 2: return attend_group<NV, 2>(values, stride, n, r0, lo, valid, ahead, s, vf);
    case 3: return attend_group<NV, 3>(values, stride, n, r0, lo, valid, ahead, s, vf);
    case 4: return attend_group<NV, 4>(values, stride, n, r0, lo, valid, ahead, s, vf);
    case 5: return attend_group<NV, 5>(values, stride, n, r0, lo, valid, ahead, s, vf);
    default: return attend_group<NV, 6>(values, stride, n, r0, lo, valid, ahead, s, vf);
  }
}

// The scales of the rows at element offset `offset` (null for an unquantized cache).
template <typename T>
inline const float* scales_at(const float* scale, int64_t offset, int head_dim) {
  if constexpr (kQuantized<T>) return scale + offset / head_dim;
  return nullptr;
}

// Calls visit(t0, n, block, next_n, next) for each block of the item's context in order,
// from the one holding key kv_begin: its first position t0, its n keys at element offset
// `block`, and the next block's first next_n tokens at `next` (its kv-head run), to
// prefetch while this one is used.
template <int NV, typename T, typename Visit>
inline void for_each_block(const Problem<T>& p, const WorkItem& w, int kv_begin, int kv_end,
                           Visit&& visit) {
  constexpr int D = NV * 8;
  const int32_t* table = p.block_tables + w.req * p.table_stride;
  // The item's heads are adjacent in a cache token: one contiguous run to prefetch.
  const int64_t run_offset = static_cast<int64_t>(w.kv_head) * D;
  const int b0 = kv_begin / p.block_size;
  for (int b = b0, t0 = b0 * p.block_size; t0 < kv_end; ++b, t0 += p.block_size) {
    const int next_n = std::clamp(kv_end - t0 - p.block_size, 0, p.block_size);
    visit(t0, std::min(p.block_size, kv_end - t0), table[b] * p.block_stride, next_n,
          next_n ? table[b + 1] * p.block_stride + run_offset : int64_t{0});
  }
}

// A decode item's rows one at a time against each block. Grouping its rows (three per kv
// head here) measured 15-40% slower at 256 decodes: a decode's time is memory, not loads.
// This loop is kept apart from the tiles' (below) because sharing one function with it
// slowed it by 10-18% in the A/B runs of RESULTS.md.
template <int NV, typename T>
void attend_decode(const Problem<T>& p, const WorkItem& w, Scratch& s, int rows, int kv_begin,
                   int kv_end) {
  const int64_t run_elements = static_cast<int64_t>(w.kv_head_end - w.kv_head) * NV * 8;
  for_each_block<NV>(p, w, kv_begin, kv_end, [&](int t0, int n, int64_t block, int next_n,
                                                 int64_t next) {
    const int64_t scale_stride = p.token_stride / p.head_dim;
    if constexpr (kQuantized<T>) {  // the next block's scales: a few lines, fetched once
      const int64_t scale_floats = (next_n - 1) * scale_stride + run_elements / p.head_dim;
      prefetch_rows(p.key_scale + next / p.head_dim, 0, 1, next_n ? scale_floats : 0);
      prefetch_rows(p.value_scale + next / p.head_dim, 0, 1, next_n ? scale_floats : 0);
    }
    for (int r = 0; r < rows; ++r) {
      const int j0 = r * next_n / rows, j1 = (r + 1) * next_n / rows;
      const int64_t ahead = next + j0 * p.token_stride;
      prefetch_rows(p.key_cache + ahead, p.token_stride, j1 - j0, run_elements);
      prefetch_rows(p.value_cache + ahead, p.token_stride, j1 - j0, run_elements);
      const int begin = std::max(0, s.first[r] - t0);
      const int end = std::min(n, s.limit[r] - t0);
      if (end <= begin) continue;  // a row that ends before this block or starts after it
      const int64_t offset = block + s.head_offset[r] + begin * p.token_stride;
      if constexpr (kWideLanes<T> && NV % 2 == 0) {
        if (pagedllm_vec512::vector_lanes == 16) {
          attend_block16<NV>(p.key_cache + offset, p.value_cache + offset, p.token_stride,
                             end - begin, r, s);
          continue;
        }
      }
      attend_block<NV>(p.key_cache + offset, p.value_cache + offset, p.token_stride,
                       end - begin, r, s, scales_at<T>(p.key_scale, offset, p.head_dim),
                       scales_at<T>(p.value_scale, offset, p.head_dim), scale_stride);
    }
  });
}

// A prefill tile's rows against each block, a slice of kSliceKeys keys at a time (transposed
// once for all rows), in groups of up to kMaxGroupRows rows. A tile item has one kv head
// (attend routes only those here), so all its rows read the same keys and values.
template <int NV, typename T>
void attend_tile(const Problem<T>& p, const WorkItem& w, Scratch& s, int rows, int kv_begin,
                 int kv_end) {
  const int64_t run_elements = NV * 8;
  for_each_block<NV>(p, w, kv_begin, kv_end, [&](int t0, int n, int64_t block, int next_n,
                                                 int64_t next) {
    for (int k0 = 0; k0 < n; k0 += kSliceKeys) {
      const int slice_n = std::min(kSliceKeys, n - k0);
      const int64_t offset = block + s.head_offset[0] + k0 * p.token_stride;
      const int64_t scale_stride = p.token_stride / p.head_dim;
      transpose_keys<NV>(p.key_cache + offset, p.token_stride, slice_n, s.key_t.data(),
                         scales_at<T>(p.key_scale, offset, p.head_dim), scale_stride);
      // A quantized cache's value factors, once per slice for all its row groups.
      alignas(32) float value_factor[kSliceKeys] = {};
      if constexpr (kQuantized<T>) {
        const float* value_scale = scales_at<T>(p.value_scale, offset, p.head_dim);
        for (int j = 0; j < slice_n; ++j) {
          value_factor[j] = kRawUnit<T> * value_scale[j * scale_stride];
        }
      }
      const int ahead_n = k0 == 0 ? next_n : 0;  // the next block, prefetched once
      for (int r = 0; r < rows; r += kMaxGroupRows) {
        const int count = std::min(kMaxGroupRows, rows - r);
        const int j0 = r * ahead_n / rows, j1 = (r + count) * ahead_n / rows;
        const int64_t next_offset = next + j0 * p.token_stride;
        const Ahead<T> ahead{p.key_cache + next_offset, p.value_cache + next_offset, j1 - j0,
                             run_elements};
        int lo[kMaxGroupRows], valid[kMaxGroupRows], group_n = 0;
        bool any = false;
        for (int i = 0; i < count; ++i) {
          lo[i] = std::max(0, s.first[r + i] - t0 - k0);
          valid[i] = std::min(slice_n, s.limit[r + i] - t0 - k0);
          group_n = std::max(group_n, valid[i]);
          any |= valid[i] > lo[i];
        }
        // Rows that all end before this slice (causal) or start after it (window).
        if (!any) continue;
        attend_rows<NV>(p.value_cache + offset, p.token_stride, group_n, r, count, lo, valid,
                        ahead, s, value_factor);
      }
    }
  });
}

// Row `row` of attention_amx.h's scratch: query head `head` of token `token` and its output.
template <int NV, typename T>
void point_row(const Problem<T>& p, int row, int token, int head,
               pagedllm_amx_attention::Scratch& a) {
  constexpr int D = NV * 8;
  a.query[row] = static_cast<const at::BFloat16*>(p.query) +
                 static_cast<int64_t>(token) * p.query_token_stride +
                 static_cast<int64_t>(head) * p.query_head_stride;
  a.out[row] = static_cast<at::BFloat16*>(p.out) +
               (static_cast<int64_t>(token) * p.num_heads + head) * D;
}

// Request w.req's keys and values of kv head `kv_head`, for attention_amx.h.
template <int NV, typename T>
pagedllm_amx_attention::Context amx_context(const Problem<T>& p, const WorkItem& w,
                                            int kv_head) {
  return {p.key_cache, p.value_cache, p.block_stride, p.token_stride,
          static_cast<int64_t>(kv_head) * NV * 8, p.block_tables + w.req * p.table_stride,
          p.block_size};
}

// A tile item on tiles: its rows' queries, outputs and visible keys for attention_amx.h.
template <int NV, typename T>
void attend_amx(const Problem<T>& p, const WorkItem& w, int context_start, Scratch& s) {
  pagedllm_amx_attention::Scratch& a = *s.amx;
  const int q0 = p.query_start_loc[w.req];
  int rows = 0;
  for (int t = w.q_begin; t < w.q_end; ++t) {
    for (int h = 0; h < p.group; ++h, ++rows) {
      point_row<NV>(p, rows, q0 + t, w.kv_head * p.group + h, a);
      a.limit[rows] = context_start + t + 1;
      a.first[rows] = p.window > 0 ? std::max(0, a.limit[rows] - p.window) : 0;
    }
  }
  pagedllm_amx_attention::on_tiles(p.tiles, [&](auto& tiles) {
    pagedllm_amx_attention::attend_rows<NV * 8>(amx_context<NV>(p, w, w.kv_head), rows,
                                                a.first[0], context_start + w.q_end, p.scale,
                                                a, tiles);
  });
}

// A decode item on AMX: each of its kv heads' query rows over the whole context in two
// passes (attention_amx.h's attend_decode).
template <int NV, typename T>
void attend_amx_decode(const Problem<T>& p, const WorkItem& w, int context_start, Scratch& s) {
  pagedllm_amx_attention::Scratch& a = *s.amx;
  const int token = p.query_start_loc[w.req] + w.q_begin;
  const int limit = context_start + w.q_begin + 1;
  const int first = p.window > 0 ? std::max(0, limit - p.window) : 0;
  for (int kv_head = w.kv_head; kv_head < w.kv_head_end; ++kv_head) {
    for (int h = 0; h < p.group; ++h) point_row<NV>(p, h, token, kv_head * p.group + h, a);
    pagedllm_tiles::AmxTiles tiles;
    pagedllm_amx_attention::attend_decode<NV * 8>(amx_context<NV>(p, w, kv_head), p.group,
                                                  first, limit, p.scale, a, tiles);
  }
}

// A decode item on dot products (decode_dots.h): its kv heads' query rows, one slice of
// keys at a time.
template <int NV, typename T>
void attend_dots_decode(const Problem<T>& p, const WorkItem& w, int context_start, Scratch& s) {
  const int64_t token = p.query_start_loc[w.req] + w.q_begin;
  const int limit = context_start + w.q_begin + 1;
  const int head = w.kv_head * p.group;
  const pagedllm_decode_dots::Decode d{
      p.key_cache, p.value_cache, p.block_stride, p.token_stride,
      p.block_tables + w.req * p.table_stride, p.block_size, w.kv_head, w.kv_head_end, p.group,
      p.window > 0 ? std::max(0, limit - p.window) : 0, limit, p.scale,
      static_cast<const at::BFloat16*>(p.query) + token * p.query_token_stride +
          head * p.query_head_stride,
      p.query_head_stride,
      static_cast<at::BFloat16*>(p.out) + (token * p.num_heads + head) * NV * 8};
  pagedllm_decode_dots::attend_decode<NV * 8>(d, s.dots);
}

// Attention of one work item, written to out. Blocks are visited in order; every row of
// the item uses a block while it is in L1, and the next block is prefetched meanwhile.
template <int NV, typename T>
void attend(const Problem<T>& p, const WorkItem& w, Scratch& s) {
  const int query_len = p.query_start_loc[w.req + 1] - p.query_start_loc[w.req];
  const int context_start = p.seq_lens[w.req] - query_len;
  if constexpr (std::is_same_v<T, at::BFloat16> && (NV == 4 || NV == 8 || NV == 16)) {
    // p.tiles is set only where attention_amx.h covers the head and block sizes. Decodes
    // on dot products take decode_dots.h's slices: the tiles' two passes ran at
    // 0.43-0.88x the vector kernel's speed there (AMD Zen 5, benchmarks/results/bf16.md).
    using pagedllm_amx_attention::Engine;
    if (p.tiles != Engine::kNone && w.q_end - w.q_begin > 1 && w.kv_head_end - w.kv_head == 1) {
      return attend_amx<NV>(p, w, context_start, s);
    }
    if (p.tiles == Engine::kBf16Dots && w.q_end - w.q_begin == 1) {
      return attend_dots_decode<NV>(p, w, context_start, s);
    }
    if (p.tiles == Engine::kAmx && w.q_end - w.q_begin == 1 &&
        p.group <= pagedllm_amx_attention::kRowTile) {
      return attend_amx_decode<NV>(p, w, context_start, s);
    }
  }
  load_rows<NV>(p, w, context_start, s);
  const int rows = (w.q_end - w.q_begin) * (w.kv_head_end - w.kv_head) * p.group;
  const int kv_end = context_start + w.q_end;
  // attend_tile transposes one kv head's keys for all its rows; plan_work gives tiles one
  // kv head, and the row-at-a-time loop takes anything else. Both start at the block of
  // the item's first row's first key (a window's start; 0 without one).
  const int kv_begin = s.first[0];
  if (w.q_end - w.q_begin == 1 || w.kv_head_end - w.kv_head != 1) {
    attend_decode<NV>(p, w, s, rows, kv_begin, kv_end);
  } else {
    attend_tile<NV>(p, w, s, rows, kv_begin, kv_end);
  }
  store_rows<NV>(p, w, s);
}

// A decode takes all its kv heads in one item once there are this many requests per
// thread to balance: the item then reads each block's tokens whole and in order (one run
// of Hkv * D per token), where per-head items read a D-wide stripe of every token, and
// the three stripes of a block at different times, from different threads.
constexpr int kDecodesPerThread = 8;

// Work items, costliest first: with dynamic scheduling that keeps long contexts from
// being left to the end on one thread.
std::vector<WorkItem> plan_work(const int32_t* query_start_loc, const int32_t* seq_lens,
                                int64_t num_requests, int num_kv_heads, int q_tile) {
  std::vector<WorkItem> items;
  const bool whole_decodes = num_requests >= kDecodesPerThread * at::get_num_threads();
  for (int req = 0; req < num_requests; ++req) {
    const int query_len = query_start_loc[req + 1] - query_start_loc[req];
    const int context_start = seq_lens[req] - query_len;
    if (query_len == 1 && whole_decodes) {
      items.push_back({req, 0, num_kv_heads, 0, 1,
                       static_cast<int64_t>(num_kv_heads) * seq_lens[req]});
      continue;
    }
    for (int q_begin = 0; q_begin < query_len; q_begin += q_tile) {
      const int q_end = std::min(query_len, q_begin + q_tile);
      // Keys seen by the tile's rows: the whole context plus half the causal triangle.
      const int64_t cost = static_cast<int64_t>(q_end - q_begin) *
                           (context_start + (q_begin + q_end + 1) / 2);
      for (int h = 0; h < num_kv_heads; ++h) {
        items.push_back({req, h, h + 1, q_begin, q_end, cost});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

template <int NV, typename T>
void run_items(const Problem<T>& p, const std::vector<WorkItem>& items, int max_rows) {
  const int num_items = static_cast<int>(items.size());
  const int threads = std::max(1, std::min(at::get_num_threads(), num_items));
#pragma omp parallel num_threads(threads)
  {
    Scratch scratch(max_rows, p.head_dim, p.block_size,
                    p.tiles != pagedllm_amx_attention::Engine::kNone);
    std::optional<pagedllm_amx_attention::TileSession> tiles;
    if (p.tiles == pagedllm_amx_attention::Engine::kAmx) tiles.emplace();
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < num_items; ++i) attend<NV>(p, items[i], scratch);
  }
}

// Head sizes compiled in (head_dim / 8 vectors of 8 lanes, unrolled); others are refused.
constexpr int kHeadDims[] = {16, 32, 64, 80, 96, 128, 256};

template <typename T>
void dispatch_head_dim(const Problem<T>& p, const std::vector<WorkItem>& items, int max_rows) {
  switch (p.head_dim) {
    case 16: return run_items<2>(p, items, max_rows);
    case 32: return run_items<4>(p, items, max_rows);
    case 64: return run_items<8>(p, items, max_rows);
    case 80: return run_items<10>(p, items, max_rows);
    case 96: return run_items<12>(p, items, max_rows);
    case 128: return run_items<16>(p, items, max_rows);
    case 256: return run_items<32>(p, items, max_rows);
    default: TORCH_CHECK(false, "paged_attention: head_dim ", p.head_dim, " is not supported");
  }
}

// The metadata must describe reads inside the cache: a bad block id or length would
// read out of bounds instead of raising.
void check_metadata(const at::Tensor& block_tables, const int32_t* query_start_loc,
                    const int32_t* seq_lens, int64_t num_requests, int64_t num_tokens,
                    int block_size, int64_t num_blocks) {
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(query_start_loc[0] == 0 && query_start_loc[num_requests] <= num_tokens,
              "paged_attention: query_start_loc does not fit the query");
  for (int64_t req = 0; req < num_requests; ++req) {
    const int query_len = query_start_loc[req + 1] - query_start_loc[req];
    TORCH_CHECK(query_len >= 1 && seq_lens[req] >= query_len, "paged_attention: request ",
                req, " has query_len ", query_len, " and seq_len ", seq_lens[req]);
    const int64_t blocks = (seq_lens[req] + block_size - 1) / block_size;
    TORCH_CHECK(blocks <= block_tables.size(1), "paged_attention: request ", req, " needs ",
                blocks, " blocks but the block table has ", block_tables.size(1));
    for (int64_t b = 0; b < blocks; ++b) {
      const int32_t id = tables[req * block_tables.stride(0) + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_attention: block id ", id,
                  " out of range [0, ", num_blocks, ")");
    }
  }
}

void check_layout(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache,
                  std::initializer_list<const at::Tensor*> index_tensors) {
  for (const auto* t : {&out, &query, &key_cache, &value_cache}) {
    TORCH_CHECK(t->device().is_cpu(), "paged_attention: every tensor must be on the CPU");
  }
  TORCH_CHECK(query.dim() == 3 &&
                  (query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16) &&
                  query.stride(2) == 1,
              "paged_attention: query must be fp32 or bf16 [T, H, D] with unit stride in D");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type() &&
                  out.is_contiguous(),
              "paged_attention: out must be a contiguous tensor shaped like query, of its "
              "dtype");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_attention: caches must be contiguous [blocks, block_size, Hkv, D] pairs");
  TORCH_CHECK(key_cache.size(3) == query.size(2) && query.size(1) % key_cache.size(2) == 0,
              "paged_attention: head shapes of query and cache do not match");
  for (const auto* t : index_tensors) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kInt && t->is_contiguous(),
                "paged_attention: index tensors must be contiguous int32 on the CPU");
  }
}

bool is_quantized(at::ScalarType type) {
  return type == at::kChar || type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2;
}

// A quantized cache's scales: fp32 [blocks, block_size, Hkv], contiguous; none otherwise.
void check_scales(const char* op, const at::Tensor& cache,
                  const std::optional<at::Tensor>& key_scale,
                  const std::optional<at::Tensor>& value_scale) {
  if (!is_quantized(cache.scalar_type())) {
    TORCH_CHECK(!key_scale.has_value() && !value_scale.has_value(), op,
                ": scales are for int8 / fp8 caches only");
    return;
  }
  TORCH_CHECK(key_scale.has_value() && value_scale.has_value(), op, ": a ",
              cache.scalar_type(), " cache needs its key and value scales");
  for (const auto* t : {&*key_scale, &*value_scale}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->dim() == 3 && t->sizes() == cache.sizes().slice(0, 3),
                op, ": scales must be contiguous fp32 [blocks, block_size, Hkv]");
  }
}

const float* scale_data(const std::optional<at::Tensor>& scale) {
  return scale.has_value() ? scale->data_ptr<float>() : nullptr;
}

// The engine `tiles` names where it can run (else the vector kernel): a bf16 cache and
// queries, head and block sizes attention_amx.h covers, and AMX's tile data granted by Linux
// or the CPU's AVX512-BF16.
pagedllm_amx_attention::Engine tile_engine(c10::string_view tiles, bool bf16, int head_dim,
                                           int block_size) {
  using pagedllm_amx_attention::Engine;
  TORCH_CHECK(tiles == "none" || tiles == "amx" || tiles == "bf16_dots",
              "paged_attention: tiles must be \"none\", \"amx\" or \"bf16_dots\", not \"",
              std::string(tiles), "\"");
  if (tiles == "none" || !bf16 || !pagedllm_amx_attention::covers(head_dim, block_size)) {
    return Engine::kNone;
  }
  if (tiles == "amx") return pagedllm_amx::request_tiles() ? Engine::kAmx : Engine::kNone;
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")
             ? Engine::kBf16Dots
             : Engine::kNone;
}

}  // namespace

// out[t] = causal attention of query[t] over its request's cached keys and values.
void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     double scale, int64_t sliding_window,
                     const std::optional<at::Tensor>& key_scale,
                     const std::optional<at::Tensor>& value_scale, c10::string_view tiles) {
  TORCH_CHECK(sliding_window >= 0, "paged_attention: sliding_window must be >= 0");
  check_layout(out, query, key_cache, value_cache, {&block_tables, &query_start_loc, &seq_lens});
  check_scales("paged_attention", key_cache, key_scale, value_scale);
  const int64_t num_requests = seq_lens.numel();
  TORCH_CHECK(query_start_loc.numel() == num_requests + 1 && block_tables.dim() == 2 &&
                  block_tables.size(0) == num_requests,
              "paged_attention: metadata sizes disagree");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int num_heads = query.size(1), head_dim = query.size(2);
  const int num_kv_heads = key_cache.size(2), block_size = key_cache.size(1);
  check_metadata(block_tables, qsl, lens, num_requests, query.size(0), block_size,
                 key_cache.size(0));

  const int group = num_heads / num_kv_heads;
  const int q_tile = std::max(1, kRowsPerItem / group);
  const auto items = plan_work(qsl, lens, num_requests, num_kv_heads, q_tile);
  if (items.empty()) return;
  int max_rows = 0;
  for (const auto& w : items) {
    max_rows = std::max(max_rows, (w.q_end - w.q_begin) * (w.kv_head_end - w.kv_head) * group);
  }

  const auto engine = tile_engine(
      tiles,
      key_cache.scalar_type() == at::kBFloat16 && query.scalar_type() == at::kBFloat16,
      head_dim, block_size);
  const auto run = [&](auto element) {
    using T = decltype(element);
    const Problem<T> problem{
        query.data_ptr(), query.stride(0), query.stride(1), out.data_ptr(),
        query.scalar_type() == at::kBFloat16, key_cache.data_ptr<T>(),
        value_cache.data_ptr<T>(), key_cache.stride(0), key_cache.stride(1),
        scale_data(key_scale), scale_data(value_scale), block_tables.data_ptr<int32_t>(),
        block_tables.stride(0), qsl, lens, num_heads, group, head_dim, block_size,
        static_cast<float>(scale),
        static_cast<int>(std::min<int64_t>(sliding_window, std::numeric_limits<int>::max())),
        engine};
    dispatch_head_dim(problem, items, max_rows);
  };
  switch (key_cache.scalar_type()) {
    case at::kFloat: return run(float{});
    case at::kBFloat16: return run(at::BFloat16{});
    case at::kHalf: return run(at::Half{});
    case at::kChar: return run(int8_t{});
    case at::kFloat8_e4m3fn: return run(c10::Float8_e4m3fn{});
    case at::kFloat8_e5m2: return run(c10::Float8_e5m2{});
    default: TORCH_CHECK(false, "paged_attention: cache dtype ", key_cache.scalar_type(),
                         " is not supported");
  }
}

template <typename T>
void convert_rows(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& key,
                  const at::Tensor& value, const int64_t* slot, int64_t row) {
  const int64_t num_tokens = key.size(0);
  const auto convert = [&](at::Tensor& cache, const at::Tensor& src) {
    T* dst = cache.data_ptr<T>();
    const float* base = src.data_ptr<float>();
    const int64_t stride = src.stride(0);
    at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* in = base + t * stride;
        T* out = dst + slot[t] * row;
        for (int64_t i = 0; i < row; ++i) out[i] = static_cast<T>(in[i]);
      }
    });
  };
  convert(key_cache, key);
  convert(value_cache, value);
}

// ---- quantized writes (kv_cache_dtype int8 / fp8) --------------------------------------

template <typename T>
constexpr float kQuantMax = std::is_same_v<T, int8_t> ? 127.0f
                            : std::is_same_v<T, c10::Float8_e4m3fn> ? 448.0f
                                                                     : 57344.0f;

// x (already within +-kQuantMax) rounded to nearest even into T, as torch's conversions do.
template <typename T>
inline T quantize_one(float x) {
  if constexpr (std::is_same_v<T, int8_t>) {
    return static_cast<int8_t>(std::nearbyint(x));
  } else {
    return T(x);
  }
}

// Eight of them, the same bits. int8: cvtps rounds to nearest even. fp8 (finite, in range):
// |x| rounded to T's grid at its binade (2^(e - mantissa bits), e no lower than T's least
// normal exponent: subnormals alike) by adding and removing 2^23 times that step, which
// the FPU rounds to nearest even; the result, exact in fp16, is then re-encoded: e5m2 is
// an fp16's high byte, e4m3 an fp16 of x / 2^8 with its exponent's top bit dropped.
template <typename T>
inline void quantize8(__m256 x, T* out) {
  __m128i bits;
  if constexpr (std::is_same_v<T, int8_t>) {
    const __m256i i = _mm256_cvtps_epi32(x);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    bits = _mm_packs_epi16(w, w);
  } else {
    constexpr bool e4m3 = std::is_same_v<T, c10::Float8_e4m3fn>;
    constexpr int mantissa = e4m3 ? 3 : 2, min_exponent = e4m3 ? -6 : -14;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 a = _mm256_andnot_ps(sign, x);
    const __m256i exponent = _mm256_max_epi32(_mm256_srli_epi32(_mm256_castps_si256(a), 23),
                                              _mm256_set1_epi32(min_exponent + 127));
    const __m256 magic = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(exponent, _mm256_set1_epi32(23 - mantissa)), 23));
    __m256 r = _mm256_sub_ps(_mm256_add_ps(a, magic), magic);
    r = _mm256_or_ps(r, _mm256_and_ps(x, sign));
    if constexpr (e4m3) {
      const __m128i h = _mm256_cvtps_ph(_mm256_mul_ps(r, _mm256_set1_ps(1.0f / 256.0f)),
                                        _MM_FROUND_TO_NEAREST_INT);
      bits = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(h, 8), _mm_set1_epi16(0x80)),
                          _mm_and_si128(_mm_srli_epi16(h, 7), _mm_set1_epi16(0x7F)));
    } else {
      bits = _mm_srli_epi16(_mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT), 8);
    }
    bits = _mm_packus_epi16(bits, bits);
  }
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), bits);
}

// fp32 K/V into an int8 / fp8 cache: each token's row of each kv head scaled by its absmax
// (scale = absmax / QMAX, stored beside it), as pagedllm/ops/kv_quant.py's quantize does,
// in the same fp32 operations, so both store the same bits.
template <typename T>
void quantize_rows(at::Tensor& cache, at::Tensor& scales, const at::Tensor& src,
                   const int64_t* slot) {
  const int64_t num_tokens = src.size(0), heads = cache.size(2), head_dim = cache.size(3);
  constexpr float qmax = kQuantMax<T>;
  T* dst = cache.data_ptr<T>();
  float* dst_scale = scales.data_ptr<float>();
  const float* base = src.data_ptr<float>();
  const int64_t stride = src.stride(0), vector_end = head_dim / 8 * 8;
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const float* in = base + t * stride + h * head_dim;
        const int64_t row = slot[t] * heads + h;
        T* out = dst + row * head_dim;
        __m256 m = _mm256_setzero_ps();
        for (int64_t i = 0; i < vector_end; i += 8) {
          m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(in + i)));
        }
        float absmax = hmax(m);
        for (int64_t i = vector_end; i < head_dim; ++i) absmax = std::max(absmax, std::abs(in[i]));
        dst_scale[row] = absmax / qmax;
        // An all-zero row: zeros, scale 0 (its inverse would be inf, and 0 * inf NaN).
        const float inverse = absmax > 0.0f ? qmax / absmax : 0.0f;
        const __m256 inv = _mm256_set1_ps(inverse), hi = _mm256_set1_ps(qmax);
        const __m256 lo = _mm256_set1_ps(-qmax);
        for (int64_t i = 0; i < vector_end; i += 8) {
          const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(in + i), inv);
          quantize8<T>(_mm256_min_ps(_mm256_max_ps(x, lo), hi), out + i);
        }
        for (int64_t i = vector_end; i < head_dim; ++i) {
          out[i] = quantize_one<T>(std::clamp(in[i] * inverse, -qmax, qmax));
        }
      }
    }
  });
}

// key_cache/value_cache slot slots[t] = key[t] / value[t]: the step's K/V into their
// blocks, a row copy per token spread over threads. Strided sources are read in place
// (k and v are column slices of the fused q/k/v output), where index_copy_ makes them
// contiguous first and copies element by element on one thread.
void write_kv_cache(at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& key,
                    const at::Tensor& value, const at::Tensor& slots,
                    const std::optional<at::Tensor>& key_scale,
                    const std::optional<at::Tensor>& value_scale) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous(),
              "write_kv_cache: caches must be contiguous [blocks, block_size, Hkv, D] pairs");
  const int64_t num_tokens = slots.numel();
  const int64_t row = key_cache.size(2) * key_cache.size(3);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  for (const auto* t : {&key, &value}) {
    TORCH_CHECK(t->device().is_cpu() &&
                    (t->scalar_type() == key_cache.scalar_type() ||
                     t->scalar_type() == at::kFloat) &&
                    t->scalar_type() == key.scalar_type() && t->dim() == 3 &&
                    t->size(0) == num_tokens && t->size(1) * t->size(2) == row &&
                    t->stride(2) == 1 && t->stride(1) == t->size(2),
                "write_kv_cache: key and value must be [T, Hkv, D] in the cache dtype (or "
                "fp32, converted) with contiguous heads");
  }
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 &&
                  slots.is_contiguous(),
              "write_kv_cache: slots must be a contiguous int64 vector");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "write_kv_cache: slot ", slot[t],
                " out of range [0, ", num_slots, ")");
  }
  check_scales("write_kv_cache", key_cache, key_scale, value_scale);
  if (is_quantized(key_cache.scalar_type())) {
    TORCH_CHECK(key.scalar_type() == at::kFloat,
                "write_kv_cache: an int8 / fp8 cache takes fp32 keys and values");
    at::Tensor key_scales = *key_scale, value_scales = *value_scale;
    const auto quantize = [&](auto element) {
      using T = decltype(element);
      quantize_rows<T>(key_cache, key_scales, key, slot);
      quantize_rows<T>(value_cache, value_scales, value, slot);
    };
    switch (key_cache.scalar_type()) {
      case at::kChar: return quantize(int8_t{});
      case at::kFloat8_e4m3fn: return quantize(c10::Float8_e4m3fn{});
      default: return quantize(c10::Float8_e5m2{});
    }
  }
  if (key.scalar_type() != key_cache.scalar_type()) {
    // fp32 K/V into a 16-bit cache (kv_cache_dtype): converted row by row, rounding to
    // nearest as at::Half / at::BFloat16 do.
    switch (key_cache.scalar_type()) {
      case at::kHalf: return convert_rows<at::Half>(key_cache, value_cache, key, value, slot, row);
      case at::kBFloat16:
        return convert_rows<at::BFloat16>(key_cache, value_cache, key, value, slot, row);
      default: TORCH_CHECK(false, "write_kv_cache: cannot convert fp32 into a ",
                           key_cache.scalar_type(), " cache");
    }
  }
  const int64_t bytes = row * key_cache.element_size();
  const auto copy_rows = [&](at::Tensor& cache, const at::Tensor& src) {
    char* dst = static_cast<char*>(cache.data_ptr());
    const char* base = static_cast<const char*>(src.data_ptr());
    const int64_t src_stride = src.stride(0) * src.element_size();
    at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        std::memcpy(dst + slot[t] * bytes, base + t * src_stride, bytes);
      }
    });
  };
  copy_rows(key_cache, key);
  copy_rows(value_cache, value);
}

std::vector<int64_t> supported_head_dims() {
  return std::vector<int64_t>(std::begin(kHeadDims), std::end(kHeadDims));
}

TORCH_LIBRARY(pagedllm, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, "
      "int sliding_window=0, Tensor? key_scale=None, Tensor? value_scale=None, "
      "str tiles=\"none\") -> ()");
  m.def(
      "write_kv_cache(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, "
      "Tensor slots, Tensor(c!)? key_scale=None, Tensor(d!)? value_scale=None) -> ()");
  m.def("supported_head_dims() -> int[]", &supported_head_dims);
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv_cache", &write_kv_cache);
}
