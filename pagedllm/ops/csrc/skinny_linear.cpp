// y = x W^T for the rows of a decode step (fp32, CPU), spread over all threads.
//
// With one to a few rows a linear layer is a pass over its weight: the time is the weight's
// bytes over memory bandwidth. MKL's sgemm runs such shapes on one thread (12 GB/s here,
// half of what two cores draw), so a batch-1 decode of the default model took 45 ms in its
// matmuls. Here each thread streams its own range of weight rows once and keeps the input
// rows in L1; up to some 100 rows this also beats sgemm, whose blocking is made for larger
// problems (benchmarks/RESULTS.md, "Skinny linear").
//
// The weight may also be fp16 or bf16 (a quantized checkpoint's LM head kept in its stored
// dtype, model/layers/stored_vocab.py): each weight vector is converted to fp32 in registers
// (exact) and multiplied in the same order, so the sums are the fp32 weight's bit for bit
// while half the bytes are read.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "vec_avx2.h"

namespace {

using namespace pagedllm_vec;

// Input rows that share one pass over a weight row: their two partial sums each take 8 of
// the 16 vector registers, with room left for the two weight vectors and an input vector.
constexpr int kRowsPerPass = 4;
// Weight rows a thread takes at a time: 64 rows of 576..1536 floats are 150..400 KB, which
// stay in L2 while the later passes of input rows read them again.
constexpr int64_t kWeightRowGrain = 64;

// Eight weights as fp32: fp32 as is, fp16 through F16C, bf16 as the
// high half of an fp32.
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const at::Half* w) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}
inline __m256 load8(const at::BFloat16* w) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// The last k % 16 products, one code path for every weight dtype (the compiler would
// otherwise contract or vectorize each dtype's loop its own way, and the sums would differ).
__attribute__((noinline)) float tail_sum(const float* x, const float* w, int64_t n, float sum) {
  for (int64_t t = 0; t < n; ++t) sum += x[t] * w[t];
  return sum;
}

// The tail's weights as fp32: an fp32 weight's own, a 16-bit one's converted (n < 16) into a
// per-thread buffer.
inline const float* tail_as_fp32(const float* w, int64_t) { return w; }
template <typename W>
inline const float* tail_as_fp32(const W* w, int64_t n) {
  thread_local float converted[16];
  for (int64_t t = 0; t < n; ++t) converted[t] = static_cast<float>(w[t]);
  return converted;
}

template <typename W>
struct Operands {
  const float* x;
  int64_t x_stride;
  const W* w;
  int64_t w_stride;
  float* out;
  int64_t out_stride;
  int64_t k;
};

// out[m..m+MR, n] over the whole reduction. One weight row at a time, read front to back:
// a single sequential stream per thread is what the prefetcher serves best (four rows read
// side by side drew 27 GB/s where this draws 32, of the 34 GB/s two cores stream here).
// Two accumulators per input row hide the FMA latency.
template <int MR, typename W>
inline void weight_row(const float* x, int64_t x_stride, const W* w, int64_t k, float* out,
                       int64_t out_stride) {
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  int64_t kk = 0;
  for (; kk + 16 <= k; kk += 16) {
    const __m256 w0 = load8(w + kk);
    const __m256 w1 = load8(w + kk + 8);
    for (int i = 0; i < MR; ++i) {
      acc[i][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * x_stride + kk), acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i * x_stride + kk + 8), acc[i][1]);
    }
  }
  const float* tail = tail_as_fp32(w + kk, k - kk);
  for (int i = 0; i < MR; ++i) {
    const float sum = hsum(_mm256_add_ps(acc[i][0], acc[i][1]));
    out[i * out_stride] = tail_sum(x + i * x_stride + kk, tail, k - kk, sum);
  }
}

template <int MR, typename W>
void weight_rows(const Operands<W>& a, int64_t m, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    weight_row<MR>(a.x + m * a.x_stride, a.x_stride, a.w + n * a.w_stride, a.k,
                   a.out + m * a.out_stride + n, a.out_stride);
  }
}

template <typename W>
void skinny_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  const Operands<W> a{x.data_ptr<float>(),   x.stride(0),   weight.data_ptr<W>(),
                      weight.stride(0),      out.data_ptr<float>(), out.stride(0),
                      x.size(1)};
  const int64_t rows = x.size(0);
  at::parallel_for(0, weight.size(0), kWeightRowGrain, [&](int64_t begin, int64_t end) {
    // With more rows than one pass takes, the later passes over a slice of weight rows
    // find it in L2 (a slice is at most 400 KB).
    for (int64_t n = begin; n < end; n += kWeightRowGrain) {
      const int64_t n_end = std::min(end, n + kWeightRowGrain);
      int64_t m = 0;
      for (; m + kRowsPerPass <= rows; m += kRowsPerPass) {
        weight_rows<kRowsPerPass>(a, m, n, n_end);
      }
      for (; m + 2 <= rows; m += 2) weight_rows<2>(a, m, n, n_end);
      for (; m < rows; ++m) weight_rows<1>(a, m, n, n_end);
    }
  });
}

// out [M, N] = x [M, K] @ weight [N, K]^T, rows with unit stride in the last dimension; out
// and x fp32, weight fp32, fp16 or bf16.
void skinny_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& weight) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &x, &weight}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 2 && t->stride(1) == 1,
                "skinny_linear: expected 2-D CPU tensors with unit stride in the last "
                "dimension");
  }
  const auto weight_type = weight.scalar_type();
  TORCH_CHECK(out.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
                  (weight_type == at::kFloat || weight_type == at::kHalf ||
                   weight_type == at::kBFloat16),
              "skinny_linear: expected fp32 out and x, and an fp32, fp16 or bf16 weight");
  TORCH_CHECK(x.size(1) == weight.size(1) && out.size(0) == x.size(0) &&
                  out.size(1) == weight.size(0),
              "skinny_linear: shapes do not match: out ", out.sizes(), ", x ", x.sizes(),
              ", weight ", weight.sizes());
  if (weight_type == at::kHalf) {
    skinny_rows<at::Half>(out, x, weight);
  } else if (weight_type == at::kBFloat16) {
    skinny_rows<at::BFloat16>(out, x, weight);
  } else {
    skinny_rows<float>(out, x, weight);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("skinny_linear(Tensor(a!) out, Tensor x, Tensor weight) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("skinny_linear", &skinny_linear); }
