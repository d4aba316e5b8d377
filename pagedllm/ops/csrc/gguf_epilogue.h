// The float epilogue of one row and block, written once for every vector width.
//
// gguf_linear.cpp includes this file in each path's namespace before the tile bodies
// (gguf_tile.h, gguf_tile512.h). Every path applies, per column and in this order,
//     acc += float(dot) * (d * step) ;  acc += m * sum
// so the paths give the same bits whatever the width of their registers. `V` names the
// vector type and its few operations: Lanes8 (256-bit, here) or Lanes16 (512-bit, in
// gguf_tile512.h).

struct Lanes8 {
  using F = __m256;
  using I = __m256i;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F mul(F x, F y) { return _mm256_mul_ps(x, y); }
  static F fmadd(F x, F y, F z) { return _mm256_fmadd_ps(x, y, z); }
  static F to_float(I x) { return _mm256_cvtepi32_ps(x); }
};

// One half's (or a whole block's) update of a row's accumulator.
template <class V>
PAGEDLLM_ALWAYS_INLINE typename V::F half_epilogue(typename V::F acc, typename V::I dot, typename V::F d,
                                                   typename V::F m, float step, float sum) {
  acc = V::fmadd(V::to_float(dot), V::mul(d, V::set1(step)), acc);
  return V::fmadd(m, V::set1(sum), acc);
}

template <class V, int HALVES>
PAGEDLLM_ALWAYS_INLINE typename V::F block_epilogue(typename V::F acc,
                                                    const typename V::I (&dots)[HALVES],
                                                    const typename V::F (&d)[HALVES],
                                                    const typename V::F (&m)[HALVES],
                                                    const Activations& a, int64_t at) {
  for (int h = 0; h < HALVES; ++h)
    acc = half_epilogue<V>(acc, dots[h], d[h], m[h], a.step[at], HALVES == 1 ? a.sum[at] : a.sum16[at * 2 + h]);
  return acc;
}
