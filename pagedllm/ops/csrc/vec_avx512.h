// 16-lane (AVX-512) twins of vec_avx2.h's element helpers, for the element-wise kernels'
// per-element passes on CPUs that have AVX-512 (chosen at run time: `set_vector_lanes`).
// Each performs the 8-lane helper's operations in the same order, so a kernel gives the
// same bits on either width.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <type_traits>

#include "vec_avx2.h"

#define PAGEDLLM_AVX512 __attribute__((target("avx2,fma,avx512f")))

namespace pagedllm_vec512 {

// 16 where the kernels' wide passes run (AVX-512, set from Python at load:
// `set_vector_lanes`), 8 for AVX2 alone (defined in cpu_ops.cpp).
extern int vector_lanes;

PAGEDLLM_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

PAGEDLLM_AVX512 inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// True where the CPU rounds fp32 to bf16 itself (AVX512-BF16's vcvtneps2bf16; set at load,
// defined in cpu_ops.cpp). round_bf16 and store16 then take that instruction in place of the
// eight integer operations below wherever a vector holds no fp32 subnormal, which it would
// flush to zero (SiLU·up 0.70 -> 0.59 ms on 1,024 x 1,536 elements a thread, AMD Zen 5):
// to nearest, ties to even, the same bits; a NaN stays a quiet NaN with its sign and payload.
extern bool native_bf16_round;

// vcvtneps2bf16 and vfpclassps written out, so the kernels need not be compiled for
// AVX512-BF16 (they run only where native_bf16_round says the CPU has it; every such CPU
// has AVX512-DQ).
PAGEDLLM_AVX512 inline bool native_rounds(__m512 v) {
  if (!native_bf16_round) return false;
  __mmask16 subnormal;
  asm("vfpclassps $0x20, %1, %0" : "=k"(subnormal) : "v"(v));
  return subnormal == 0;
}

PAGEDLLM_AVX512 inline __m256i native_bf16_bits(__m512 v) {
  __m256i bits;
  asm("vcvtneps2bf16 %1, %0" : "=v"(bits) : "v"(v));
  return bits;
}

// round_bf16's 16 lanes in integer operations: to nearest, ties to even, NaN to the quiet
// NaN torch stores.
PAGEDLLM_AVX512 inline __m512 integer_round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_and_si512(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
      _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(rounded),
                              _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
}

// round_bf16's 16 lanes: the CPU's own rounding where it gives the same bits, else the
// integer one.
PAGEDLLM_AVX512 inline __m512 round_bf16(__m512 v) {
  if (native_rounds(v)) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(native_bf16_bits(v)), 16));
  }
  return integer_round_bf16(v);
}

template <typename T>
PAGEDLLM_AVX512 inline __m512 round_to(__m512 v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return round_bf16(v);
  } else {
    return v;
  }
}

PAGEDLLM_AVX512 inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

PAGEDLLM_AVX512 inline void store16(at::BFloat16* p, __m512 v) {
  if (native_rounds(v)) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), native_bf16_bits(v));
    return;
  }
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(integer_round_bf16(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(high));
}

// exp256's 16 lanes (Cephes' reduction and polynomial, the same constants).
PAGEDLLM_AVX512 inline __m512 exp512(__m512 x) {
  using namespace pagedllm_vec::exp_constants;
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kMin)), _mm512_set1_ps(kMax));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2High), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Low), x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kPoly[i]));
  y = _mm512_fmadd_ps(y, z, _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i exponent = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(exponent));
}

}  // namespace pagedllm_vec512
