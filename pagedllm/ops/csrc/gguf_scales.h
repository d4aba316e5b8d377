// The float kinds' per-group tables (Q4_0 / Q4_1 / Q8_0 blocks, a packed checkpoint's
// groups) read as fp32, written once for both vector paths and the portable loop.
//
// gguf_linear.cpp includes this file in each path's namespace, before the tile bodies. A
// group's scale d is stored as fp32 (GGUF), or as fp16 / bf16 where the checkpoint's scales
// are (a packed checkpoint's groups of 32: 2 bytes where fp32 took 4). Its min m is stored as
// fp32, or as a uint8 zero point z with m = d * -z, or not at all (m = d * min_factor).
// Every conversion is exact: fp16 and bf16 widen to fp32 without rounding, and -z d is an
// 11- (8-) bit significand times an integer below 2^8, at most 19 bits; a stored fp32 m of
// -(d * z) holds the same bits (negation commutes with round-to-nearest). So the compact
// tables give the very sums the fp32 ones do, on every path.

// 8 scales at `at` (the tile's 8 columns of one group) as fp32.
inline __m256 scales8(const Weights& w, int64_t at) {
  switch (w.scale_type) {
    case kScaleF16:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
          static_cast<const uint16_t*>(w.scales) + at)));
    case kScaleBF16:
      return _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
              static_cast<const uint16_t*>(w.scales) + at))),
          16));
    default:
      return _mm256_loadu_ps(static_cast<const float*>(w.scales) + at);
  }
}

// The 8 mins at `at` for the scales d read there.
inline __m256 mins8(const Weights& w, int64_t at, __m256 d) {
  if (w.mins != nullptr) return _mm256_loadu_ps(w.mins + at);
  if (w.zeros == nullptr) return _mm256_mul_ps(d, _mm256_set1_ps(w.min_factor));
  const __m256 zero = _mm256_cvtepi32_ps(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.zeros + at))));
  return _mm256_mul_ps(d, _mm256_xor_ps(zero, _mm256_set1_ps(-0.f)));
}
