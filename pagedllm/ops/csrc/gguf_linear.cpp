// y = x W^T with W kept in GGUF's 4- or 8-bit blocks (CPU): the `quantization="gguf"` matmul.
//
// A GGUF Q4_0 / Q4_1 / Q8_0 row is blocks of 32 weights w = d*q + m (q unsigned: Q4_0 is
// m = -8d, Q8_0 is stored as q + 128 with m = -128d). The weights are used exactly as the
// file holds them. Each 32-wide block of an input row is quantized to integers with its own
// scale: one int8 digit (8 bits), or two (hi + lo/256, ~15 bits, which keeps greedy output
// on the fp32 model's tokens; see benchmarks/int8_accuracy.py). Per block and output
// column the integer dot is exact, and the float epilogue is
//     acc += float(dot) * (d * step) ;  acc += m * sum(quantized x)
// in that order, so the VNNI path (vpdpbusd: u8 weights x s8 digits into int32) and the
// portable path give the same bits.
//
// Packed layout (pagedllm/model/layers/gguf_linear.py builds it): columns in tiles of 8;
// per tile and block, 8 groups of 4 consecutive k for the 8 columns, 32 bytes a group.
// 4-bit: groups g and g+4 share bytes (low and high nibble), 128 bytes a tile-block;
// 8-bit: 256 bytes. d and m: float [tiles][blocks][8].

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kBlock = 32;
constexpr int kTileCols = 8;
// Tiles per parallel work item: 32 columns, so even a 192-column projection splits into
// 6 items and two threads share them evenly.
constexpr int64_t kTilesPerItem = 4;
constexpr int kRowsPerPass = 4;

struct Activations {
  const int8_t* hi;
  const int8_t* lo;
  const float* step;  // per row and block: the value of one unit of the combined integer
  const float* sum;   // per row and block: sum of the quantized values
  int64_t k;
  int64_t blocks;
};

struct Weights {
  const uint8_t* packed;
  const float* scales;
  const float* mins;
  int64_t blocks;
  int bits;
  int64_t tile_bytes;
};

struct Output {
  float* data;
  int64_t stride;
  int64_t cols;
};

int64_t group_bytes_per_block(int bits) { return bits == 4 ? 128 : 256; }

inline __m256i pack_int8(__m256i a, __m256i b, __m256i c, __m256i d) {
  // packs work within 128-bit lanes; the permute puts the four 8-value runs back in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// One row's blocks to integer digits: hi = round(x / step), lo = round(residual * 256 / step),
// step = max |x| / 127 of the block. Vectorized: done per call for every input row, a scalar
// loop cost 17% of a 2,048-row matmul.
void quantize_row(const float* x, const Activations& a, int64_t row, int digits) {
  int8_t* hi = const_cast<int8_t*>(a.hi) + row * a.k;
  int8_t* lo = const_cast<int8_t*>(a.lo) + row * a.k;
  float* step_out = const_cast<float*>(a.step) + row * a.blocks;
  float* sum_out = const_cast<float*>(a.sum) + row * a.blocks;
  const __m256 sign = _mm256_set1_ps(-0.f), limit = _mm256_set1_ps(127.f);
  const __m256 neg_limit = _mm256_set1_ps(-127.f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t b = 0; b < a.blocks; ++b) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + b * kBlock + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float block_max = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float step = block_max / 127.f;
    const float inv = block_max > 0.f ? 127.f / block_max : 0.f;
    const __m256 inv_v = _mm256_set1_ps(inv), step_v = _mm256_set1_ps(step);
    const __m256 inv_lo = _mm256_set1_ps(inv * 256.f);
    __m256i h[4], l[4], total = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256 hf = _mm256_min_ps(
          limit, _mm256_max_ps(neg_limit, _mm256_round_ps(_mm256_mul_ps(v[j], inv_v), kRound)));
      h[j] = _mm256_cvtps_epi32(hf);
      if (digits == 2) {
        const __m256 residual = _mm256_fnmadd_ps(hf, step_v, v[j]);
        const __m256 lf = _mm256_min_ps(
            limit,
            _mm256_max_ps(neg_limit, _mm256_round_ps(_mm256_mul_ps(residual, inv_lo), kRound)));
        l[j] = _mm256_cvtps_epi32(lf);
        total = _mm256_add_epi32(total, _mm256_add_epi32(_mm256_slli_epi32(h[j], 8), l[j]));
      } else {
        total = _mm256_add_epi32(total, h[j]);
      }
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + b * kBlock), pack_int8(h[0], h[1], h[2], h[3]));
    if (digits == 2)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + b * kBlock), pack_int8(l[0], l[1], l[2], l[3]));
    step_out[b] = digits == 2 ? step / 256.f : step;
    sum_out[b] = step_out[b] * static_cast<float>(hsum_epi32(total));
  }
}

// ---- portable path --------------------------------------------------------------------

inline int32_t weight_at(const uint8_t* tile_block, int bits, int col, int i) {
  const int group = i / 4, t = i % 4;
  if (bits == 8) return tile_block[group * 32 + col * 4 + t];
  const uint8_t byte = tile_block[(group % 4) * 32 + col * 4 + t];
  return group < 4 ? (byte & 0x0F) : (byte >> 4);
}

void portable_tile(const Activations& a, const Weights& w, int64_t row, int64_t tile, int digits,
                   const Output& out) {
  const uint8_t* tile_base = w.packed + tile * w.tile_bytes;
  const int64_t block_bytes = group_bytes_per_block(w.bits);
  for (int col = 0; col < kTileCols; ++col) {
    const int64_t n = tile * kTileCols + col;
    if (n >= out.cols) break;
    float acc = 0.f;
    for (int64_t b = 0; b < w.blocks; ++b) {
      const int8_t* hi = a.hi + row * a.k + b * kBlock;
      const int8_t* lo = a.lo + row * a.k + b * kBlock;
      int32_t dot_hi = 0, dot_lo = 0;
      for (int i = 0; i < kBlock; ++i) {
        const int32_t q = weight_at(tile_base + b * block_bytes, w.bits, col, i);
        dot_hi += q * hi[i];
        if (digits == 2) dot_lo += q * lo[i];
      }
      const int32_t dot = digits == 2 ? dot_hi * 256 + dot_lo : dot_hi;
      const int64_t at = (tile * w.blocks + b) * kTileCols + col;
      const float scale = w.scales[at] * a.step[row * a.blocks + b];
      acc = std::fma(static_cast<float>(dot), scale, acc);
      acc = std::fma(w.mins[at], a.sum[row * a.blocks + b], acc);
    }
    out.data[row * out.stride + n] = acc;
  }
}

// ---- AVX-512 VNNI path (256-bit vectors) ------------------------------------------------

#define PAGEDLLM_VNNI __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")))

// acc += w (u8) . the 4 signed bytes at p, repeated in every lane. The broadcast rides in
// the instruction's memory operand ({1to8}): with it as a separate vpbroadcastd (which is
// what the compiler emits for _mm256_set1_epi32), broadcasts were 16 of ~40 vector ops a
// row, tile and block.
PAGEDLLM_VNNI inline __m256i dot4(__m256i acc, __m256i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// One block's integer dots of the tile's 8 columns with a row's digits, in two chains of
// four vpdpbusd (even and odd groups) so each waits on half as many: a layer's four
// matmuls ran 0-5% faster than with one chain of eight (benchmarks/gguf_matmul.py,
// RESULTS.md "sixth run"), never slower.
PAGEDLLM_VNNI inline __m256i block_dot(const __m256i (&wv)[8], const int8_t* digits) {
  __m256i even = _mm256_setzero_si256(), odd = even;
  for (int g = 0; g < 8; g += 2) {
    even = dot4(even, wv[g], digits + 4 * g);
    odd = dot4(odd, wv[g + 1], digits + 4 * g + 4);
  }
  return _mm256_add_epi32(even, odd);
}

template <int R, int BITS, int DIGITS>
PAGEDLLM_VNNI void vnni_tile(const Activations& a, const Weights& w, int64_t row, int64_t tile,
                             const Output& out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* tile_base = w.packed + tile * w.tile_bytes;
  const float* scales = w.scales + tile * w.blocks * kTileCols;
  const float* mins = w.mins + tile * w.blocks * kTileCols;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m256i wv[8];
    if (BITS == 4) {
      const uint8_t* p = tile_base + b * 128;
      for (int g = 0; g < 4; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * g));
        wv[g] = _mm256_and_si256(v, low_nibbles);
        wv[g + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
      }
    } else {
      const uint8_t* p = tile_base + b * 256;
      for (int g = 0; g < 8; ++g)
        wv[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * g));
    }
    const __m256 d = _mm256_loadu_ps(scales + b * kTileCols);
    const __m256 m = _mm256_loadu_ps(mins + b * kTileCols);
    for (int r = 0; r < R; ++r) {
      const int64_t offset = (row + r) * a.k + b * kBlock;
      __m256i dot = block_dot(wv, a.hi + offset);
      if constexpr (DIGITS == 2) {
        dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8), block_dot(wv, a.lo + offset));
      }
      const int64_t at = (row + r) * a.blocks + b;
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(a.step[at]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sum[at]), acc[r]);
    }
  }
  const int64_t n0 = tile * kTileCols;
  const int64_t valid = std::min<int64_t>(kTileCols, out.cols - n0);
  for (int r = 0; r < R; ++r) {
    float* dst = out.data + (row + r) * out.stride + n0;
    if (valid == kTileCols) {
      _mm256_storeu_ps(dst, acc[r]);
    } else {
      alignas(32) float tmp[kTileCols];
      _mm256_store_ps(tmp, acc[r]);
      std::memcpy(dst, tmp, valid * sizeof(float));
    }
  }
}

template <int BITS, int DIGITS>
PAGEDLLM_VNNI void vnni_item(const Activations& a, const Weights& w, int64_t rows,
                             int64_t tile_begin, int64_t tile_end, const Output& out) {
  // Rows outer: a pass's few activation rows stay in L1 while the item's tiles (32 columns
  // of weights, at most ~200 KB) come from L2.
  int64_t row = 0;
  for (; row + kRowsPerPass <= rows; row += kRowsPerPass)
    for (int64_t t = tile_begin; t < tile_end; ++t)
      vnni_tile<kRowsPerPass, BITS, DIGITS>(a, w, row, t, out);
  for (; row < rows; ++row)
    for (int64_t t = tile_begin; t < tile_end; ++t) vnni_tile<1, BITS, DIGITS>(a, w, row, t, out);
}

void vnni_dispatch(const Activations& a, const Weights& w, int64_t rows, int64_t tile_begin,
                   int64_t tile_end, int digits, const Output& out) {
  if (w.bits == 4 && digits == 2) return vnni_item<4, 2>(a, w, rows, tile_begin, tile_end, out);
  if (w.bits == 4) return vnni_item<4, 1>(a, w, rows, tile_begin, tile_end, out);
  if (digits == 2) return vnni_item<8, 2>(a, w, rows, tile_begin, tile_end, out);
  return vnni_item<8, 1>(a, w, rows, tile_begin, tile_end, out);
}

bool vnni_available() {
  static const bool available = __builtin_cpu_supports("avx512vnni") &&
                                __builtin_cpu_supports("avx512vl") &&
                                __builtin_cpu_supports("avx512bw");
  return available;
}

void check_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                const at::Tensor& scales, const at::Tensor& mins, int64_t bits, int64_t digits) {
  TORCH_CHECK(bits == 4 || bits == 8, "gguf_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(digits == 1 || digits == 2, "gguf_linear: digits must be 1 or 2, got ", digits);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              "gguf_linear: x must be a contiguous 2-D fp32 CPU tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0),
              "gguf_linear: out must be fp32 [rows, cols] with unit column stride");
  TORCH_CHECK(x.size(1) % kBlock == 0, "gguf_linear: in_features ", x.size(1),
              " is not a multiple of ", kBlock);
  const int64_t blocks = x.size(1) / kBlock;
  const int64_t tiles = (out.size(1) + kTileCols - 1) / kTileCols;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == tiles * blocks * group_bytes_per_block(bits),
              "gguf_linear: packed weight has ", packed.numel(), " bytes, expected ",
              tiles * blocks * group_bytes_per_block(bits));
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->numel() == tiles * blocks * kTileCols,
                "gguf_linear: scales and mins must be contiguous fp32 [tiles, blocks, 8]");
  }
}

// out [M, N] = x [M, K] @ W^T for W packed as above; allow_vnni=false forces the portable path.
void gguf_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                 const at::Tensor& scales, const at::Tensor& mins, int64_t bits, int64_t digits,
                 bool allow_vnni) {
  check_args(out, x, packed, scales, mins, bits, digits);
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock;
  const at::Tensor digit_buf = at::empty({2, rows, k}, x.options().dtype(at::kChar));
  const at::Tensor row_buf = at::empty({2, rows, blocks}, x.options());
  const Activations a{digit_buf.data_ptr<int8_t>(),     digit_buf.data_ptr<int8_t>() + rows * k,
                      row_buf.data_ptr<float>(),        row_buf.data_ptr<float>() + rows * blocks,
                      k,                                blocks};
  const float* x_data = x.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(x_data + r * k, a, r, static_cast<int>(digits));
  });
  const Weights w{packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), mins.data_ptr<float>(),
                  blocks, static_cast<int>(bits), blocks * group_bytes_per_block(bits)};
  const Output o{out.data_ptr<float>(), out.stride(0), out.size(1)};
  const int64_t tiles = (out.size(1) + kTileCols - 1) / kTileCols;
  const int64_t items = (tiles + kTilesPerItem - 1) / kTilesPerItem;
  const bool vnni = allow_vnni && vnni_available();
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    const int64_t tile_begin = begin * kTilesPerItem;
    const int64_t tile_end = std::min(tiles, end * kTilesPerItem);
    if (vnni) return vnni_dispatch(a, w, rows, tile_begin, tile_end, static_cast<int>(digits), o);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t t = tile_begin; t < tile_end; ++t)
        portable_tile(a, w, r, t, static_cast<int>(digits), o);
  });
}

bool gguf_vnni_available() { return vnni_available(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def(
      "gguf_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor scales, Tensor mins, "
      "int bits, int digits, bool allow_vnni) -> ()");
  m.def("gguf_vnni_available() -> bool", &gguf_vnni_available);
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("gguf_linear", &gguf_linear); }
