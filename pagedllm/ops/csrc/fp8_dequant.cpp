// fp8 e4m3 weights dequantized into fp32 (CPU) for the FP8 checkpoint layers
// (pagedllm/model/layers/w8a8_linear.py): `fp8_dequant` makes a band of rows for torch.mm
// (many input rows), `fp8_linear` multiplies input rows by the weights directly, each weight
// decoded and scaled in registers once per pass of up to eight input rows, so a decode step
// reads one byte a weight. Two paths, the same bits (fp8_tile.h): AVX2 + F16C, and AVX-512
// (F, BW, VL) where the CPU has it; the caller's `isa` picks (1 AVX2, 2 AVX-512), lowered to
// what the CPU runs.
//
// out[r, k] = e4m3(values[r, k]) * scales[r / row_block, k / col_block]: per output channel
// (row_block 1, col_block K) or per block (128 x 128), one rounding, as the reference's fp32
// dequantization. The e4m3 value is made exactly from its bits (torch's own conversion runs
// one value at a time, ~100x slower than this):
// - fast (every byte but the NaNs): the sign and the 7 magnitude bits placed in an fp16's
//   (sign to bit 15, magnitude to bits 7..13) are the fp16 e4m3 * 2^-8, subnormals included
//   (the fp16's 5-bit exponent spans e4m3's range shifted down by 8); F16C's vcvtph2ps makes
//   it fp32 exactly and the scale carries the 2^8 back (s * 256 is exact, so the one product
//   rounds the same real number as e4m3 * s);
// - exact slow path, for 16 bytes holding a NaN (0x7F / 0xFF: the fast path would read 480)
//   or a scale too large to carry 2^8: a normal number's exponent and mantissa move into an
//   fp32's with the exponent bias raised by 120; a subnormal one (exponent field 0) is
//   m * 2^-9, made from the integer m so that no fp32 subnormal is involved (a CPU flushing
//   those would zero it).

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

#define PAGEDLLM_ALWAYS_INLINE inline __attribute__((always_inline))

namespace {

constexpr int kExponentShift = 20;         // e4m3's 7 magnitude bits under fp32's exponent
constexpr int32_t kBiasRaise = 120 << 23;  // fp32 bias 127 minus e4m3 bias 7
constexpr int32_t kNanMagnitude = 0x7F;
constexpr int64_t kRowGrain = 16;
constexpr int64_t kWeightRowGrain = 64;
constexpr float kFold = 256.0f;  // the fast decode's e4m3 * 2^-8, carried by the scale
constexpr int64_t kAvx2 = 1, kAvx512 = 2;

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

// e4m3 bytes whose sign and magnitude, moved into an fp16's, are e4m3 * 2^-8 (16-bit
// lanes of the sign-extended bytes: the shift leaves a copy of the sign in bit 14, cleared).
inline __m256i half_bits(__m256i words) {
  return _mm256_and_si256(_mm256_slli_epi16(words, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
}

// Whether any of 16 bytes is a NaN (0x7F or 0xFF).
inline bool has_nan(__m128i bytes) {
  const __m128i nan = _mm_set1_epi8(0x7F);
  return _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_and_si128(bytes, nan), nan)) != 0;
}

// Whether s * 256 is exact (it overflows only for s near fp32's largest; inf and NaN scales
// stay what they are).
inline bool folds_exactly(float s) { return std::isfinite(s * kFold) || !std::isfinite(s); }

// ---- AVX2 path: 16 lanes in two 256-bit registers --------------------------------------------

namespace avx2_path {

struct Lanes {
  struct V {
    __m256 lo, hi;
  };
  struct Scale {
    __m256 exact, folded;
    bool fast;
  };
  static V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Scale scale(float s) {
    return {_mm256_set1_ps(s), _mm256_set1_ps(s * kFold), folds_exactly(s)};
  }
  // 16 weights e4m3(bytes[i]) * s, exactly (see the file comment).
  static PAGEDLLM_ALWAYS_INLINE V decode(const uint8_t* bytes, const Scale& s) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
    if (s.fast && !has_nan(raw)) [[likely]] {
      const __m256i h = half_bits(_mm256_cvtepi8_epi16(raw));
      return {_mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), s.folded),
              _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), s.folded)};
    }
    return exact(bytes, s.exact);
  }
  // Out of line: inlined, its registers pushed the sums out of theirs.
  static __attribute__((noinline)) V exact(const uint8_t* bytes, __m256 s) {
    return {_mm256_mul_ps(decode8(bytes), s), _mm256_mul_ps(decode8(bytes + 8), s)};
  }
  static PAGEDLLM_ALWAYS_INLINE V fmadd(const V& w, const float* x, const V& acc) {
    return {_mm256_fmadd_ps(w.lo, _mm256_loadu_ps(x), acc.lo),
            _mm256_fmadd_ps(w.hi, _mm256_loadu_ps(x + 8), acc.hi)};
  }
  static float reduce(const V& v) { return pagedllm_vec::hsum(_mm256_add_ps(v.lo, v.hi)); }
  static void store(float* out, const V& v) {
    _mm256_storeu_ps(out, v.lo);
    _mm256_storeu_ps(out + 8, v.hi);
  }
};

#include "fp8_tile.h"

// 16 vector registers, each sum taking two: at most 8 of them beside the decode's.
void linear(const LinearOperands& a, int64_t rows, int64_t n_begin, int64_t n_end) {
  if (rows == 1) return weight_rows<1, 2>(a, rows, n_begin, n_end);
  weight_rows<4, 1>(a, rows, n_begin, n_end);
}

}  // namespace avx2_path

// ---- AVX-512 path: 16 lanes in one 512-bit register ------------------------------------------

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw")

namespace avx512_path {

struct Lanes {
  using V = __m512;
  struct Scale {
    __m512 exact, folded;
    bool fast;
  };
  static V zero() { return _mm512_setzero_ps(); }
  static Scale scale(float s) {
    return {_mm512_set1_ps(s), _mm512_set1_ps(s * kFold), folds_exactly(s)};
  }
  static PAGEDLLM_ALWAYS_INLINE V decode(const uint8_t* bytes, const Scale& s) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
    if (s.fast && !has_nan(raw)) [[likely]] {
      return _mm512_mul_ps(_mm512_cvtph_ps(half_bits(_mm256_cvtepi8_epi16(raw))), s.folded);
    }
    return exact(bytes, s.exact);
  }
  static __attribute__((noinline)) V exact(const uint8_t* bytes, __m512 s) {
    const __m512 joined = _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castpd256_pd512(_mm256_castps_pd(decode8(bytes))),
        _mm256_castps_pd(decode8(bytes + 8)), 1));
    return _mm512_mul_ps(joined, s);
  }
  static PAGEDLLM_ALWAYS_INLINE V fmadd(V w, const float* x, V acc) {
    return _mm512_fmadd_ps(w, _mm512_loadu_ps(x), acc);
  }
  // As the AVX2 path's: the high eight lanes added to the low eight, then the same tree.
  static float reduce(V v) {
    const __m256 lo = _mm512_castps512_ps256(v);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return pagedllm_vec::hsum(_mm256_add_ps(lo, hi));
  }
  static void store(float* out, V v) { _mm512_storeu_ps(out, v); }
};

#include "fp8_tile.h"

// 32 vector registers: up to 16 sums beside the decoded weights.
void linear(const LinearOperands& a, int64_t rows, int64_t n_begin, int64_t n_end) {
  if (rows == 1) return weight_rows<1, 4>(a, rows, n_begin, n_end);
  if (rows == 2) return weight_rows<2, 4>(a, rows, n_begin, n_end);
  if (rows <= 4) return weight_rows<4, 4>(a, rows, n_begin, n_end);
  weight_rows<8, 2>(a, rows, n_begin, n_end);
}

}  // namespace avx512_path

#pragma GCC pop_options

bool avx512_available() {
  static const bool available = __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512vl") &&
                                __builtin_cpu_supports("avx512bw");
  return available;
}

// The path to run: the caller's choice, lowered to what this CPU has.
int64_t path_for(int64_t isa) {
  TORCH_CHECK(isa == kAvx2 || isa == kAvx512, "fp8 kernels: isa must be 1 (AVX2) or 2 (AVX-512), got ", isa);
  return isa == kAvx512 && avx512_available() ? kAvx512 : kAvx2;
}

void fp8_dequant(at::Tensor out, const at::Tensor& values, const at::Tensor& scales,
                 int64_t row_block, int64_t col_block, int64_t isa) {
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
  const bool wide = path_for(isa) == kAvx512;
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row_scales = scale + (r / row_block) * scale_cols;
      for (int64_t c = 0; c < scale_cols; ++c) {
        const uint8_t* row = bytes + r * values.stride(0);
        float* row_out = target + r * out.stride(0);
        const int64_t first = c * col_block, last = std::min(cols, (c + 1) * col_block);
        if (wide) {
          avx512_path::dequant_run(row, row_out, first, last, row_scales[c]);
        } else {
          avx2_path::dequant_run(row, row_out, first, last, row_scales[c]);
        }
      }
    }
  });
}

// out [M, N] (rows may be strided) = x [M, K] @ dequant(values [N, K])^T, scales as in
// fp8_dequant.
void fp8_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& values,
                const at::Tensor& scales, int64_t row_block, int64_t col_block, int64_t isa) {
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
  const bool wide = path_for(isa) == kAvx512;
  at::parallel_for(0, n_rows, kWeightRowGrain, [&](int64_t begin, int64_t end) {
    if (wide) return avx512_path::linear(a, rows, begin, end);
    avx2_path::linear(a, rows, begin, end);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def(
      "fp8_dequant(Tensor(a!) out, Tensor values, Tensor scales, int row_block, int col_block, "
      "int isa=1) -> ()");
  m.def(
      "fp8_linear(Tensor(a!) out, Tensor x, Tensor values, Tensor scales, int row_block, "
      "int col_block, int isa=1) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("fp8_dequant", &fp8_dequant);
  m.impl("fp8_linear", &fp8_linear);
}
