// fp8 e4m3 weights dequantized into fp32 (CPU) for the FP8 checkpoint layers
// (pagedllm/model/layers/w8a8_linear.py): `fp8_dequant` makes a band of rows for torch.mm
// (many input rows), `fp8_linear` multiplies a few input rows by the weights directly, each
// weight decoded and scaled in registers once per pass of up to four input rows, so a decode
// step reads one byte a weight.
//
// out[r, k] = e4m3(values[r, k]) * scales[r / row_block, k / col_block]: per output channel
// (row_block 1, col_block K) or per block (128 x 128). The e4m3 value is made exactly from its
// bits (torch's own conversion runs one value at a time, ~100x slower than this): a normal
// number's exponent and mantissa move into an fp32's with the exponent bias raised by 120;
// a subnormal one (exponent field 0) is m * 2^-9, made from the integer m so that no fp32
// subnormal is involved (a CPU flushing those would zero it); 0x7F / 0xFF are NaN. The one
// product with the scale rounds as the reference's fp32 dequantization does.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>

#include "vec_avx2.h"

namespace {

constexpr int kExponentShift = 20;         // e4m3's 7 magnitude bits under fp32's exponent
constexpr int32_t kBiasRaise = 120 << 23;  // fp32 bias 127 minus e4m3 bias 7
constexpr int32_t kNanMagnitude = 0x7F;
constexpr int64_t kRowGrain = 16;
// fp8_linear: input rows sharing one pass over a weight row (their sums take 4 registers).
constexpr int kRowsPerPass = 4;
constexpr int64_t kWeightRowGrain = 64;

float decode_scalar(uint8_t byte) {
  const int magnitude = byte & 0x7F;
  const int exponent = magnitude >> 3, mantissa = magnitude & 7;
  float value;
  if (magnitude == kNanMagnitude) {
    value = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -9);
  } else {
    value = std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
  }
  return (byte & 0x80) ? -value : value;
}

const std::array<float, 256>& decode_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = decode_scalar(static_cast<uint8_t>(i));
    return t;
  }();
  return table;
}

// Eight e4m3 bytes as fp32 (see the file comment).
inline __m256 decode8(const uint8_t* bytes) {
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  const __m256i magnitude = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(
      _mm256_slli_epi32(magnitude, kExponentShift), _mm256_set1_epi32(kBiasRaise)));
  const __m256 subnormal =
      _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(1.0f / 512.0f));
  const __m256 is_subnormal =
      _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), magnitude));
  const __m256 is_nan =
      _mm256_castsi256_ps(_mm256_cmpeq_epi32(magnitude, _mm256_set1_epi32(kNanMagnitude)));
  __m256 value = _mm256_blendv_ps(normal, subnormal, is_subnormal);
  value = _mm256_blendv_ps(value, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), is_nan);
  return _mm256_or_ps(value, _mm256_castsi256_ps(sign));
}

// One row: columns [begin, end) share the scale s.
void dequant_run(const uint8_t* bytes, float* out, int64_t begin, int64_t end, float s) {
  const __m256 scale = _mm256_set1_ps(s);
  int64_t k = begin;
  for (; k + 8 <= end; k += 8) _mm256_storeu_ps(out + k, _mm256_mul_ps(decode8(bytes + k), scale));
  const auto& table = decode_table();
  for (; k < end; ++k) out[k] = table[bytes[k]] * s;
}

void fp8_dequant(at::Tensor out, const at::Tensor& values, const at::Tensor& scales,
                 int64_t row_block, int64_t col_block) {
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 &&
                  out.stride(1) == 1,
              "fp8_dequant: out must be 2-D fp32 with unit stride in the last dimension");
  TORCH_CHECK(values.dim() == 2 && values.element_size() == 1 && values.stride(1) == 1 &&
                  values.size(0) == out.size(0) && values.size(1) == out.size(1),
              "fp8_dequant: values must be 2-D bytes shaped like out, got ", values.sizes());
  const int64_t rows = values.size(0), cols = values.size(1);
  TORCH_CHECK(row_block > 0 && col_block > 0, "fp8_dequant: blocks must be positive");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.is_contiguous() &&
                  scales.size(0) == (rows + row_block - 1) / row_block &&
                  scales.size(1) == (cols + col_block - 1) / col_block,
              "fp8_dequant: scales ", scales.sizes(), " do not fit ", values.sizes(), " in blocks of ",
              row_block, " x ", col_block);
  decode_table();  // built before the threads start
  const auto* bytes = static_cast<const uint8_t*>(values.data_ptr());
  const float* scale = scales.data_ptr<float>();
  float* target = out.data_ptr<float>();
  const int64_t scale_cols = scales.size(1);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row_scales = scale + (r / row_block) * scale_cols;
      for (int64_t c = 0; c < scale_cols; ++c) {
        dequant_run(bytes + r * values.stride(0), target + r * out.stride(0), c * col_block,
                    std::min(cols, (c + 1) * col_block), row_scales[c]);
      }
    }
  });
}

struct LinearOperands {
  const float* x;
  int64_t x_stride;
  const uint8_t* w;
  int64_t w_stride;
  const float* scales;
  int64_t scale_cols;
  int64_t row_block;
  int64_t col_block;
  float* out;
  int64_t out_stride;
  int64_t k;
};

// out[m..m+MR, n] = x[m..m+MR] . (e4m3(w[n]) * scale): each weight is dequantized exactly as
// fp8_dequant makes it, then multiplied in.
template <int MR>
void weight_row(const LinearOperands& a, int64_t m, int64_t n) {
  const float* x = a.x + m * a.x_stride;
  const uint8_t* w = a.w + n * a.w_stride;
  const float* row_scales = a.scales + (n / a.row_block) * a.scale_cols;
  const auto& table = decode_table();
  __m256 acc[MR];
  float tail[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps(), tail[i] = 0.0f;
  for (int64_t c = 0; c < a.scale_cols; ++c) {
    const int64_t end = std::min(a.k, (c + 1) * a.col_block);
    const __m256 scale = _mm256_set1_ps(row_scales[c]);
    int64_t kk = c * a.col_block;
    for (; kk + 8 <= end; kk += 8) {
      const __m256 weight = _mm256_mul_ps(decode8(w + kk), scale);
      for (int i = 0; i < MR; ++i) {
        acc[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(x + i * a.x_stride + kk), acc[i]);
      }
    }
    for (; kk < end; ++kk) {
      const float weight = table[w[kk]] * row_scales[c];
      for (int i = 0; i < MR; ++i) tail[i] += x[i * a.x_stride + kk] * weight;
    }
  }
  for (int i = 0; i < MR; ++i) {
    a.out[(m + i) * a.out_stride + n] = pagedllm_vec::hsum(acc[i]) + tail[i];
  }
}

// out [M, N] (rows may be strided) = x [M, K] @ dequant(values [N, K])^T, scales as in
// fp8_dequant.
void fp8_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& values,
                const at::Tensor& scales, int64_t row_block, int64_t col_block) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
                  out.dim() == 2 && x.dim() == 2 && out.stride(1) == 1 && x.stride(1) == 1,
              "fp8_linear: out and x must be 2-D fp32 with unit stride in the last dimension");
  TORCH_CHECK(values.dim() == 2 && values.element_size() == 1 && values.stride(1) == 1 &&
                  values.size(1) == x.size(1) && out.size(0) == x.size(0) &&
                  out.size(1) == values.size(0),
              "fp8_linear: shapes do not match: out ", out.sizes(), ", x ", x.sizes(),
              ", values ", values.sizes());
  const int64_t n_rows = values.size(0), cols = values.size(1);
  TORCH_CHECK(row_block > 0 && col_block > 0 && scales.scalar_type() == at::kFloat &&
                  scales.dim() == 2 && scales.is_contiguous() &&
                  scales.size(0) == (n_rows + row_block - 1) / row_block &&
                  scales.size(1) == (cols + col_block - 1) / col_block,
              "fp8_linear: scales ", scales.sizes(), " do not fit ", values.sizes(),
              " in blocks of ", row_block, " x ", col_block);
  decode_table();
  const LinearOperands a{x.data_ptr<float>(), x.stride(0), static_cast<const uint8_t*>(values.data_ptr()),
                         values.stride(0), scales.data_ptr<float>(), scales.size(1), row_block,
                         col_block, out.data_ptr<float>(), out.stride(0), cols};
  const int64_t rows = x.size(0);
  at::parallel_for(0, n_rows, kWeightRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      int64_t m = 0;
      for (; m + kRowsPerPass <= rows; m += kRowsPerPass) weight_row<kRowsPerPass>(a, m, n);
      for (; m + 2 <= rows; m += 2) weight_row<2>(a, m, n);
      for (; m < rows; ++m) weight_row<1>(a, m, n);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("fp8_dequant(Tensor(a!) out, Tensor values, Tensor scales, int row_block, int col_block) -> ()");
  m.def(
      "fp8_linear(Tensor(a!) out, Tensor x, Tensor values, Tensor scales, int row_block, "
      "int col_block) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("fp8_dequant", &fp8_dequant);
  m.impl("fp8_linear", &fp8_linear);
}
