// The fp8 kernels' loops, written once over a 16-lane vector type `Lanes` (fp8_dequant.cpp
// includes this file in each of its paths' namespaces: two 256-bit registers for AVX2, one
// 512-bit register for AVX-512).
//
// Every output sums in one fixed order, whichever path, tile shape or row count runs it:
// lane l (0..15) adds x[k] * w[k] for the k of each scale block's 16-column chunks with
// k = l mod 16, in increasing k; the lanes are reduced by `Lanes::reduce` (the same tree on
// both paths); the columns past each block's last whole chunk are added one at a time into
// a scalar, which comes last. So both paths give the same bits, and a sequence's result does
// not depend on which other sequences share its step.
//
// Expects in scope: Lanes (V, Scale, zero, scale, decode, fmadd, reduce, store), decode_table,
// LinearOperands.

// Columns [begin, end) of one row share the scale s.
inline void dequant_run(const uint8_t* bytes, float* out, int64_t begin, int64_t end, float s) {
  const typename Lanes::Scale scale = Lanes::scale(s);
  int64_t k = begin;
  for (; k + 16 <= end; k += 16) Lanes::store(out + k, Lanes::decode(bytes + k, scale));
  const auto& table = decode_table();
  for (; k < end; ++k) out[k] = table[bytes[k]] * s;
}

// out[m .. m+MR, n .. n+NB]: MR input rows against NB weight rows, every weight decoded once
// per tile; MR x NB independent sums, so the FMAs do not wait on each other.
template <int MR, int NB>
inline void tile(const LinearOperands& a, int64_t m, int64_t n) {
  const float* x = a.x + m * a.x_stride;
  const auto& table = decode_table();
  // The sums stay in registers only if every loop over i and j is unrolled (GCC keeps an
  // array it indexes at run time in memory: a load and a store around each FMA).
  typename Lanes::V acc[MR][NB];
  float tail[MR][NB];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < NB; ++j) acc[i][j] = Lanes::zero(), tail[i][j] = 0.0f;
  }
  for (int64_t c = 0; c < a.scale_cols; ++c) {
    const int64_t end = std::min(a.k, (c + 1) * a.col_block);
    float s[NB];
    typename Lanes::Scale scale[NB];
#pragma GCC unroll 16
    for (int j = 0; j < NB; ++j) {
      s[j] = a.scales[((n + j) / a.row_block) * a.scale_cols + c];
      scale[j] = Lanes::scale(s[j]);
    }
    int64_t kk = c * a.col_block;
    for (; kk + 16 <= end; kk += 16) {
#pragma GCC unroll 16
      for (int j = 0; j < NB; ++j) {
        const typename Lanes::V w = Lanes::decode(a.w + (n + j) * a.w_stride + kk, scale[j]);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) acc[i][j] = Lanes::fmadd(w, x + i * a.x_stride + kk, acc[i][j]);
      }
    }
    for (; kk < end; ++kk) {
      for (int j = 0; j < NB; ++j) {
        const float weight = table[a.w[(n + j) * a.w_stride + kk]] * s[j];
        for (int i = 0; i < MR; ++i) tail[i][j] += x[i * a.x_stride + kk] * weight;
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < NB; ++j) {
      a.out[(m + i) * a.out_stride + n + j] = Lanes::reduce(acc[i][j]) + tail[i][j];
    }
  }
}

// Rows [m, m + rows) in one tile, rows < R + 1 (the rows a pass of R leaves over).
template <int R, int NB>
inline void leftover_tile(const LinearOperands& a, int64_t m, int64_t rows, int64_t n) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R, NB>(a, m, n);
    leftover_tile<R - 1, NB>(a, m, rows, n);
  }
}

// All input rows against weight rows [n_begin, n_end): groups of NB weight rows, each
// passed over by MR input rows at a time (the group's bytes stay in L1 between passes),
// the rows a pass leaves over in one smaller tile, then the leftover weight rows alone.
template <int MR, int NB>
inline void weight_rows(const LinearOperands& a, int64_t rows, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  const int64_t whole = rows / MR * MR;
  for (; n + NB <= n_end; n += NB) {
    for (int64_t m = 0; m < whole; m += MR) tile<MR, NB>(a, m, n);
    leftover_tile<MR - 1, NB>(a, whole, rows - whole, n);
  }
  for (; n < n_end; ++n) {
    for (int64_t m = 0; m < whole; m += MR) tile<MR, 1>(a, m, n);
    leftover_tile<MR - 1, 1>(a, whole, rows - whole, n);
  }
}
