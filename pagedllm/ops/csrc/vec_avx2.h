// AVX2/FMA helpers shared by the CPU kernels (paged_attention.cpp, cpu_ops.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <immintrin.h>

#include <cstdint>
#include <limits>
#include <type_traits>

namespace pagedllm_vec {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- 8-wide loads of cache elements as fp32 -------------------------------------------

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::BFloat16* p) {
  // bf16 is the high half of an fp32.
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// ---- bf16 results: rounded as torch rounds (to nearest, ties to even; NaN stays NaN) ----

// v rounded to the nearest bf16, kept as fp32 (the low 16 bits cleared): what a bf16 op
// of the eager model stores, so a fused kernel can round where each of its ops would.
inline __m256 round_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
      _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
  return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// Rounding to the element type T: nothing for fp32.
template <typename T>
inline __m256 round_to(__m256 v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return round_bf16(v);
  } else {
    return v;
  }
}

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// 8-bit caches (kv_cache_dtype int8 / fp8): load8 gives the raw values, kRawUnit<T> times
// smaller than the stored numbers; the kernel multiplies by kRawUnit<T> * the row's scale.
template <typename T>
constexpr bool kQuantized = false;
template <>
constexpr bool kQuantized<int8_t> = true;
template <>
constexpr bool kQuantized<c10::Float8_e4m3fn> = true;
template <>
constexpr bool kQuantized<c10::Float8_e5m2> = true;

template <typename T>
constexpr float kRawUnit = 1.0f;
template <>
constexpr float kRawUnit<c10::Float8_e4m3fn> = 256.0f;

inline __m256 load8(const int8_t* p) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
}

// e5m2 is the high byte of an fp16: exact, subnormals included.
inline __m256 load8(const c10::Float8_e5m2* p) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(raw), 8));
}

// e4m3 (bias 7) as an fp16 (bias 15) with the same sign, mantissa and exponent bits: its
// value / 2^8, exact for normals and subnormals alike (the NaN code 0x7f reads as 480 / 256,
// but a scaled row is never NaN unless its keys were).
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i bits = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(raw), 7),
                                     _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
  return _mm256_cvtph_ps(bits);
}

// ---- vector helpers --------------------------------------------------------------------

// exp(x) with Cephes' range reduction and polynomial (about 1 ulp in fp32), clamped to
// fp32's range; libm's scalar expf per element would cost more than the arithmetic around it.
// The constants are shared with the 16-lane exp512 (vec_avx512.h), whose lanes must give
// these bits.
namespace exp_constants {
constexpr float kMin = -87.3f, kMax = 88.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
// The polynomial's coefficients, highest power first.
constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_constants

inline __m256 exp256(__m256 x) {
  using namespace exp_constants;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kMin)), _mm256_set1_ps(kMax));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2High), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Low), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kPoly[i]));
  y = _mm256_fmadd_ps(y, z, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// Lanes j .. j + 7 that are below n.
inline __m256 lanes_below(int j, int n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(j), lane);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), index));
}

// [sum(a0), sum(a1), sum(a2), sum(a3)]
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// In place: r[i][j] <- r[j][i] for an 8 x 8 block of floats.
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

}  // namespace pagedllm_vec
