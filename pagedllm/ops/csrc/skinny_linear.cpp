// y = x W^T for the few rows of a decode step (fp32, CPU), spread over all threads.
//
// With one to a few rows a linear layer is a pass over its weight: the time is the weight's
// bytes over memory bandwidth. MKL's sgemm runs such shapes on one thread (12 GB/s here,
// half of what two cores draw), so a batch-1 decode of the default model took 45 ms in its
// matmuls. Here each thread streams its own range of weight rows once and keeps the few
// input rows in L1.

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

// Input rows handled together: their partial sums for four weight rows fill 8 of the 16
// vector registers, leaving room for the four weight vectors and one input vector.
constexpr int kRowsPerPass = 2;
// Weight rows a thread takes at a time: 64 rows of 576..1536 floats are 150..400 KB,
// large enough that the hardware prefetcher streams them.
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

// out[m, n0..n0+NR) for the MR input rows starting at m, over the whole reduction.
template <int MR, int NR>
inline void tile(const Operands& a, int64_t m, int64_t n0) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t kk = 0;
  for (; kk + 8 <= a.k; kk += 8) {
    __m256 w[NR];
    for (int j = 0; j < NR; ++j) w[j] = _mm256_loadu_ps(a.w + (n0 + j) * a.w_stride + kk);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(a.x + (m + i) * a.x_stride + kk);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float sum = hsum(acc[i][j]);
      const float* xi = a.x + (m + i) * a.x_stride;
      const float* wj = a.w + (n0 + j) * a.w_stride;
      for (int64_t t = kk; t < a.k; ++t) sum += xi[t] * wj[t];
      a.out[(m + i) * a.out_stride + n0 + j] = sum;
    }
  }
}

template <int MR>
void weight_rows(const Operands& a, int64_t m, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + 4 <= n_end; n += 4) tile<MR, 4>(a, m, n);
  for (; n < n_end; ++n) tile<MR, 1>(a, m, n);
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
      for (; m < rows; ++m) weight_rows<1>(a, m, n, n_end);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("skinny_linear(Tensor(a!) out, Tensor x, Tensor weight) -> ()", &skinny_linear);
}
