// bf16 linear layers on AVX512-BF16 dot products for the few rows of a decode step (CPUs
// whose `vdpbf16ps` runs at least at the fp32 FMA rate and that have no AMX: AMD Zen 4/5).
//
// oneDNN's packed bf16 linear runs these shapes on the same instruction, but a call costs
// ~11 us of host work and its blocking is made for larger problems: the default model's
// projections at 32 rows ran at 520 of the cores' 920 GFLOP/s on AMD Zen 5
// (benchmarks/results/bf16.md, "Zen 5"). Here a call is one pass over the weight.
//
// Weight layout: amx_linear.cpp's (`amx_pack_weight`), [N/32][K/32][16][32][2]. Within a
// block of 32 output columns the K/2 pair-rows lie back to back, each 32 columns of
// (W[c][2p], W[c][2p + 1]): the second operand of `vdpbf16ps` for columns 0-15 and 16-31.
// The first operand is a row of x's pair (x[r][2p], x[r][2p + 1]) broadcast to every lane.
// Sums are fp32, the bias added in fp32, each output rounded to bf16 once, as oneDNN's and
// the AMX kernel's are (their sums run in other orders: the last bits may differ).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "tile_layout_checks.h"

namespace {

constexpr int64_t kBlockN = 32;  // output columns of a weight block: two vectors of 16
// Rows of x a pass over a block takes: 2 x 12 accumulators, the block's two vectors and the
// broadcasts fill the 32 registers; 32 rows take three passes, the block in L1 or L2.
constexpr int kMaxChunkRows = 12;

// How far ahead of its loads a block's first pass prefetches the weight into L1. A thread's
// blocks lie back to back, so the prefetches run on into its next block. The hardware
// prefetchers alone left the first pass waiting on memory: on AMD Zen 5 (2 threads) a pass
// over the default model's projections ran 1.68x / 1.41x / 1.22x faster at 16 / 32 / 64 rows
// with 8 KB (4 KB: 1.46x / 1.31x / 1.19x; 12-32 KB: as 8 KB; one row unchanged),
// benchmarks/results/bf16.md, 2026-12-02.
constexpr int64_t kPrefetchBytes = 8192;

#define BF16_DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

// Rows [0, R) of x (row stride `x_stride`, in bf16) against one block of `pairs` pair-rows;
// out[r, 0..32) = bf16(sum + bias). The block's first pass (`prefetch`) fetches ahead.
template <int R>
BF16_DOT_TARGET void block_rows(const at::BFloat16* x, int64_t x_stride,
                                const at::BFloat16* block, int64_t pairs, const float* bias,
                                at::BFloat16* out, int64_t out_stride, bool prefetch) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const auto* w = reinterpret_cast<const __m512i*>(block);
  for (int64_t p = 0; p < pairs; ++p) {
    if (prefetch) {  // prefetches do not fault: past the weight's end they are dropped
      const char* ahead = reinterpret_cast<const char*>(w + 2 * p) + kPrefetchBytes;
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
    }
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + 2 * p));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + 2 * p + 1));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * x_stride + 2 * p, sizeof(pair));
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
    }
  }
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    const __m512bh rounded =
        _mm512_cvtne2ps_pbh(_mm512_add_ps(acc[r][1], b1), _mm512_add_ps(acc[r][0], b0));
    _mm512_storeu_si512(out + r * out_stride, reinterpret_cast<__m512i>(rounded));
  }
}

using BlockRows = void (*)(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t,
                           const float*, at::BFloat16*, int64_t, bool);

template <int... R>
constexpr auto make_table(std::integer_sequence<int, R...>) {
  return std::array<BlockRows, sizeof...(R)>{&block_rows<R + 1>...};
}
// kBlockRows[R - 1]: the kernel for R rows.
constexpr auto kBlockRows = make_table(std::make_integer_sequence<int, kMaxChunkRows>{});

// Blocks [begin, end) for every row of x, on the calling thread: for each block the rows
// kMaxChunkRows at a time, so a block read once from memory serves them all from L1/L2.
void block_range(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                 const float* bias, int64_t begin, int64_t end) {
  const int64_t rows = x.size(0), pairs = x.size(1) / 2;
  const auto* weight = packed.data_ptr<at::BFloat16>();
  const auto* xs = x.data_ptr<at::BFloat16>();
  auto* os = out.data_ptr<at::BFloat16>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  for (int64_t j = begin; j < end; ++j) {
    const at::BFloat16* block = weight + j * pairs * 2 * kBlockN;
    for (int64_t m = 0; m < rows; m += kMaxChunkRows) {
      const int64_t chunk = std::min<int64_t>(kMaxChunkRows, rows - m);
      kBlockRows[chunk - 1](xs + m * x_stride, x_stride, block, pairs,
                            bias ? bias + j * kBlockN : nullptr,
                            os + m * out_stride + j * kBlockN, out_stride, m == 0);
    }
  }
}

// Columns [blocks * 32) per thread: a grain that keeps both cores busy on the narrowest
// layers (18 blocks for 576 columns).
constexpr int64_t kBlockGrain = 4;

// out [M, N] = x [M, K] @ W^T (+ bias), W packed by amx_pack_weight; bf16 x and out, fp32
// bias. K and N multiples of 32.
void bf16_dot_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw"),
              "bf16_dot_linear: the CPU has no AVX512-BF16");
  const float* bias_data =
      pagedllm_tile_layout::check_operands("bf16_dot_linear", out, x, packed, bias);
  const int64_t n = out.size(1);
  if (x.size(0) == 0) return;
  at::parallel_for(0, n / kBlockN, kBlockGrain, [&](int64_t begin, int64_t end) {
    block_range(out, x, packed, bias_data, begin, end);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("bf16_dot_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("bf16_dot_linear", &bf16_dot_linear); }
