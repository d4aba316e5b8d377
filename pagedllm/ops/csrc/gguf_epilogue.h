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

template <class V, int HALVES>
PAGEDLLM_ALWAYS_INLINE typename V::F block_epilogue(typename V::F acc,
                                                    const typename V::I (&dots)[HALVES],
                                                    const typename V::F (&d)[HALVES],
                                                    const typename V::F (&m)[HALVES],
                                                    const Activations& a, int64_t at) {
  const typename V::F step = V::set1(a.step[at]);
  for (int h = 0; h < HALVES; ++h) {
    const float sum = HALVES == 1 ? a.sum[at] : a.sum16[at * 2 + h];
    acc = V::fmadd(V::to_float(dots[h]), V::mul(d[h], step), acc);
    acc = V::fmadd(m[h], V::set1(sum), acc);
  }
  return acc;
}
