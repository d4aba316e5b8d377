// y = x W^T for the rows of a decode step (fp32, CPU), spread over all threads.
//
// With one to a few rows a linear layer is a pass over its weight: the time is the weight's
// bytes over memory bandwidth. MKL's sgemm runs such shapes on one thread (12 GB/s here,
// half of what two cores draw), so a batch-1 decode of the default model took 45 ms in its
// matmuls. Here each thread streams its own range of weight rows once and keeps the input
// rows in L1; up to some 100 rows this also beats sgemm, whose blocking is made for larger
// problems (benchmarks/RESULTS.md, "Skinny linear").

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
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

struct Operands {
  const float* x;
  int64_t x_stride;
  const float* w;
  int64_t w_stride;
  float* out;
  int64_t out_stride;
  int64_t k;
};

// out[m..m+MR, n] over the whole reduction. One weight row at a time, read front to back:
// a single sequential stream per thread is what the prefetcher serves best (four rows read
// side by side drew 27 GB/s where this draws 32, of the 34 GB/s two cores stream here).
// Two accumulators per input row hide the FMA latency.
template <int MR>
inline void weight_row(const float* x, int64_t x_stride, const float* w, int64_t k, float* out,
                       int64_t out_stride) {
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  int64_t kk = 0;
  for (; kk + 16 <= k; kk += 16) {
    const __m256 w0 = _mm256_loadu_ps(w + kk);
    const __m256 w1 = _mm256_loadu_ps(w + kk + 8);
    for (int i = 0; i < MR; ++i) {
      acc[i][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * x_stride + kk), acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i * x_stride + kk + 8), acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float sum = hsum(_mm256_add_ps(acc[i][0], acc[i][1]));
    for (int64_t t = kk; t < k; ++t) sum += x[i * x_stride + t] * w[t];
    out[i * out_stride] = sum;
  }
}

template <int MR>
void weight_rows(const Operands& a, int64_t m, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    weight_row<MR>(a.x + m * a.x_stride, a.x_stride, a.w + n * a.w_stride, a.k,
                   a.out + m * a.out_stride + n, a.out_stride);
  }
}

// out [M, N] = x [M, K] @ weight [N, K]^T, rows with unit stride in the last dimension.
void skinny_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& weight) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &x, &weight}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 2 &&
                    t->stride(1) == 1,
                "skinny_linear: expected 2-D fp32 CPU tensors with unit stride in the last "
                "dimension");
  }
  TORCH_CHECK(x.size(1) == weight.size(1) && out.size(0) == x.size(0) &&
                  out.size(1) == weight.size(0),
              "skinny_linear: shapes do not match: out ", out.sizes(), ", x ", x.sizes(),
              ", weight ", weight.sizes());
  const Operands a{x.data_ptr<float>(),   x.stride(0),   weight.data_ptr<float>(),
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("skinny_linear(Tensor(a!) out, Tensor x, Tensor weight) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("skinny_linear", &skinny_linear); }
