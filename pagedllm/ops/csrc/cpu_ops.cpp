// Fused element-wise kernels of the decoder step (fp32 and bf16) and the sampler's plain
// draw (fp32), on the CPU: each reads and writes its tensors once, where the eager torch sequence makes
// four to twelve passes and as many temporary tensors (RMSNorm, SiLU * up, RoPE), or a
// softmax, a cumulative sum and a search over the vocabulary (sampling).
//
// Rows are spread over torch's intra-op threads with at::parallel_for.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/gelu.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec_avx2.h"
#include "vec_avx512.h"

// Either width gives the same bits: the wide spans below (and paged attention's tiles) do
// each element's operations in the 8-lane order, and the reductions stay 8-lane.
int pagedllm_vec512::vector_lanes = 8;
namespace {
bool cpu_rounds_bf16() {
  __builtin_cpu_init();  // the flag below is set before the constructors that would call it
  return __builtin_cpu_supports("avx512bf16") != 0;
}
}  // namespace
bool pagedllm_vec512::native_bf16_round = cpu_rounds_bf16();

namespace {

using namespace pagedllm_vec;

// Rows handed to one thread at a time: small row counts stay on the calling thread.
constexpr int64_t kRowGrain = 16;

using pagedllm_vec512::vector_lanes;

// ---- 16-lane spans: each returns how many leading elements (a multiple of 16) it did ----

// out[j] = round(x[j] * inv) * (offset + weight[j]): RMSNorm's scaling pass.
template <typename T>
PAGEDLLM_AVX512 int64_t norm_span16(const T* x, const T* weight, T* out, int64_t n, float inv,
                                    float offset) {
  namespace v = pagedllm_vec512;
  const __m512 scale = _mm512_set1_ps(inv);
  const __m512 shift = _mm512_set1_ps(offset);
  const bool shifted = offset != 0.0f;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 r = v::round_to<T>(_mm512_mul_ps(v::load16(x + j), scale));
    const __m512 w = shifted ? _mm512_add_ps(shift, v::load16(weight + j)) : v::load16(weight + j);
    v::store16(out + j, _mm512_mul_ps(r, w));
  }
  return j;
}

// residual[j] += x[j].
template <typename T>
PAGEDLLM_AVX512 int64_t add_span16(T* residual, const T* x, int64_t n) {
  namespace v = pagedllm_vec512;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    v::store16(residual + j, _mm512_add_ps(v::load16(residual + j), v::load16(x + j)));
  }
  return j;
}

// out[j] = round(silu(gate[j])) * up[j].
template <typename T>
PAGEDLLM_AVX512 int64_t silu_span16(const T* gate, const T* up, T* out, int64_t d) {
  namespace v = pagedllm_vec512;
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 zero = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= d; j += 16) {
    const __m512 g = v::load16(gate + j);
    const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, v::exp512(_mm512_sub_ps(zero, g))));
    v::store16(out + j, _mm512_mul_ps(v::round_to<T>(_mm512_mul_ps(g, sig)), v::load16(up + j)));
  }
  return j;
}

// Sets the lanes of the per-element passes: 8, or 16 where the CPU has AVX-512 F.
void set_vector_lanes(int64_t lanes) {
  TORCH_CHECK(lanes == 8 || lanes == 16, "set_vector_lanes: lanes must be 8 or 16, got ", lanes);
  TORCH_CHECK(lanes == 8 || __builtin_cpu_supports("avx512f"),
              "set_vector_lanes: this CPU has no AVX-512");
  vector_lanes = static_cast<int>(lanes);
}

int64_t get_vector_lanes() { return vector_lanes; }

// Whether bf16 results are rounded by the CPU's own conversion (vec_avx512.h's
// native_bf16_round): on by default where it has AVX512-BF16; tests turn it off to compare.
void set_native_bf16_round(bool native) {
  TORCH_CHECK(!native || cpu_rounds_bf16(),
              "set_native_bf16_round: this CPU has no AVX512-BF16");
  pagedllm_vec512::native_bf16_round = native;
}

bool get_native_bf16_round() { return pagedllm_vec512::native_bf16_round; }

// The element types of the fused ops: fp32, and bf16 read as fp32 with every result rounded
// where the eager model's bf16 op would round it (Transformers' Llama: the normalized row
// before the weight, silu before the product, cos/sin and each RoPE product), so a bf16
// model gives the reference's bits in most places instead of fp32-accurate values.
template <typename Fn>
void dispatch_dtype(const at::Tensor& t, const char* what, Fn&& fn) {
  TORCH_CHECK(t.device().is_cpu(), what, ": expected a CPU tensor");
  if (t.scalar_type() == at::kFloat) {
    fn(float{});
  } else if (t.scalar_type() == at::kBFloat16) {
    fn(at::BFloat16{});
  } else {
    TORCH_CHECK(false, what, ": expected fp32 or bf16, got ", t.scalar_type());
  }
}

template <typename T>
void check_rows(const at::Tensor& t, int64_t cols, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == c10::CppTypeToScalarType<T>::value,
              what, ": expected a CPU tensor of the kernel's dtype");
  TORCH_CHECK(t.dim() == 2 && t.size(1) == cols && t.stride(1) == 1, what,
              ": expected [rows, ", cols, "] with unit stride in the last dimension");
}

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

// out = x * rsqrt(mean(x^2) + eps) * (offset + weight), one row of n elements (the sum of
// squares in fp32; in bf16 the normalized row is rounded before the weight multiplies it).
// Gemma stores its weight as an offset from one: offset 1 adds it in fp32 as the eager
// `1.0 + weight` does, so the graph needs no scale tensor made at every step; offset 0
// leaves the weight untouched (adding 0 would turn a -0 weight into +0).
template <typename T>
inline void rms_norm_row(const T* x, const T* weight, T* out, int64_t n, float eps,
                         float offset) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = load8(x + j);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float sum = hsum(acc);
  for (; j < n; ++j) sum += to_float(x[j]) * to_float(x[j]);
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  const __m256 scale = _mm256_set1_ps(inv);
  const bool shifted = offset != 0.0f;
  const __m256 shift = _mm256_set1_ps(offset);
  j = vector_lanes == 16 ? norm_span16(x, weight, out, n, inv, offset) : 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = round_to<T>(_mm256_mul_ps(load8(x + j), scale));
    const __m256 w = shifted ? _mm256_add_ps(shift, load8(weight + j)) : load8(weight + j);
    store8(out + j, _mm256_mul_ps(v, w));
  }
  for (; j < n; ++j) {
    const float w = shifted ? offset + to_float(weight[j]) : to_float(weight[j]);
    out[j] = static_cast<T>(round_to<T>(to_float(x[j]) * inv) * w);
  }
}

// Where row i of a [rows, n] or [a, b, n] tensor starts (unit stride within a row): a 3-D x
// is a strided range of heads, such as the query heads of a fused q/k/v output.
struct RowAddress {
  int64_t inner, outer_stride, inner_stride;
  explicit RowAddress(const at::Tensor& t)
      : inner(t.dim() == 3 ? t.size(1) : 1),
        outer_stride(t.stride(0)),
        inner_stride(t.dim() == 3 ? t.stride(1) : 0) {}
  int64_t operator()(int64_t i) const { return i / inner * outer_stride + i % inner * inner_stride; }
};

template <typename T>
void check_row_stack(const at::Tensor& t, int64_t cols, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == c10::CppTypeToScalarType<T>::value,
              what, ": expected a CPU tensor of the kernel's dtype");
  TORCH_CHECK((t.dim() == 2 || t.dim() == 3) && t.size(-1) == cols && t.stride(-1) == 1, what,
              ": expected [rows, ", cols, "] or [a, b, ", cols,
              "] with unit stride in the last dimension");
}

// out[i] = rms_norm(x[i]) * (weight_offset + weight), for every row of x ([rows, n] or
// [a, b, n]).
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps,
              double weight_offset) {
  dispatch_dtype(x, "rms_norm", [&](auto type) {
    using T = decltype(type);
    const int64_t n = weight.numel();
    check_row_stack<T>(x, n, "rms_norm x");
    check_row_stack<T>(out, n, "rms_norm out");
    TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
                    out.sizes() == x.sizes(),
                "rms_norm: weight must be contiguous in x's dtype and out shaped like x");
    const T* w = weight.data_ptr<T>();
    const RowAddress x_row(x), out_row(out);
    at::parallel_for(0, x.numel() / n, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        rms_norm_row(x.data_ptr<T>() + x_row(i), w, out.data_ptr<T>() + out_row(i), n,
                     static_cast<float>(eps), static_cast<float>(weight_offset));
      }
    });
  });
}

// residual += x; x = rms_norm(residual) * (weight_offset + weight) (both in place): the
// residual stream's add and the next norm in one pass.
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight,
                        double eps, double weight_offset) {
  dispatch_dtype(x, "fused_add_rms_norm", [&](auto type) {
    using T = decltype(type);
    const int64_t n = weight.numel();
    check_rows<T>(x, n, "fused_add_rms_norm x");
    check_rows<T>(residual, n, "fused_add_rms_norm residual");
    TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
                    residual.size(0) == x.size(0),
                "fused_add_rms_norm: weight must be contiguous in x's dtype, x and residual "
                "alike");
    const T* w = weight.data_ptr<T>();
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        T* xi = x.data_ptr<T>() + i * x.stride(0);
        T* ri = residual.data_ptr<T>() + i * residual.stride(0);
        int64_t j = vector_lanes == 16 ? add_span16(ri, xi, n) : 0;
        for (; j + 8 <= n; j += 8) store8(ri + j, _mm256_add_ps(load8(ri + j), load8(xi + j)));
        for (; j < n; ++j) ri[j] = static_cast<T>(to_float(ri[j]) + to_float(xi[j]));
        rms_norm_row(ri, w, xi, n, static_cast<float>(eps), static_cast<float>(weight_offset));
      }
    });
  });
}

// out = silu(gate) * up, where x = [gate | up] along the last dimension (in bf16 silu is
// rounded before the product).
void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [rows, 2 * d]");
  dispatch_dtype(x, "silu_and_mul", [&](auto type) {
    using T = decltype(type);
    const int64_t d = x.size(1) / 2;
    check_rows<T>(x, 2 * d, "silu_and_mul x");
    check_rows<T>(out, d, "silu_and_mul out");
    TORCH_CHECK(out.size(0) == x.size(0), "silu_and_mul: out must have x's rows");
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 zero = _mm256_setzero_ps();
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const T* gate = x.data_ptr<T>() + i * x.stride(0);
        const T* up = gate + d;
        T* o = out.data_ptr<T>() + i * out.stride(0);
        int64_t j = vector_lanes == 16 ? silu_span16(gate, up, o, d) : 0;
        for (; j + 8 <= d; j += 8) {
          const __m256 g = load8(gate + j);
          const __m256 sig =
              _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, g))));
          store8(o + j, _mm256_mul_ps(round_to<T>(_mm256_mul_ps(g, sig)), load8(up + j)));
        }
        for (; j < d; ++j) {
          const float g = to_float(gate[j]);
          o[j] = static_cast<T>(round_to<T>(g / (1.0f + std::exp(-g))) * to_float(up[j]));
        }
      }
    });
  });
}

// cos/sin as the eager bf16 ops see them: rounded to T once per token, for all its heads.
template <typename T>
inline void round_angles(const float* cos, const float* sin, int64_t half, float* c, float* s) {
  int64_t j = 0;
  for (; j + 8 <= half; j += 8) {
    _mm256_storeu_ps(c + j, round_to<T>(_mm256_loadu_ps(cos + j)));
    _mm256_storeu_ps(s + j, round_to<T>(_mm256_loadu_ps(sin + j)));
  }
  for (; j < half; ++j) {
    c[j] = round_to<T>(cos[j]);
    s[j] = round_to<T>(sin[j]);
  }
}

// x' = x * cos + rotate_half(x) * sin for the first 16-lane multiple of `half` pairs (c, s
// rounded already); returns how many it did. Each element's operations in rotate_head's order.
template <typename T>
PAGEDLLM_AVX512 int64_t rotate_span16(T* x, const float* c, const float* s, int64_t half) {
  namespace v = pagedllm_vec512;
  int64_t j = 0;
  for (; j + 16 <= half; j += 16) {
    const __m512 a = v::load16(x + j), b = v::load16(x + half + j);
    const __m512 cj = _mm512_loadu_ps(c + j), sj = _mm512_loadu_ps(s + j);
    if constexpr (std::is_same_v<T, float>) {
      v::store16(x + j, _mm512_fmsub_ps(a, cj, _mm512_mul_ps(b, sj)));
      v::store16(x + half + j, _mm512_fmadd_ps(b, cj, _mm512_mul_ps(a, sj)));
    } else {
      v::store16(x + j, _mm512_sub_ps(v::round_to<T>(_mm512_mul_ps(a, cj)),
                                      v::round_to<T>(_mm512_mul_ps(b, sj))));
      v::store16(x + half + j, _mm512_add_ps(v::round_to<T>(_mm512_mul_ps(b, cj)),
                                             v::round_to<T>(_mm512_mul_ps(a, sj))));
    }
  }
  return j;
}

// Rotate-half RoPE of one head in place: x' = x * cos + rotate_half(x) * sin. In bf16 cos
// and sin come rounded (round_angles) and each product is rounded on its own, as the eager
// bf16 ops round.
template <typename T>
inline void rotate_head(T* x, const float* c, const float* s, int64_t half) {
  int64_t j = vector_lanes == 16 ? rotate_span16(x, c, s, half) : 0;
  for (; j + 8 <= half; j += 8) {
    const __m256 a = load8(x + j), b = load8(x + half + j);
    const __m256 cj = _mm256_loadu_ps(c + j), sj = _mm256_loadu_ps(s + j);
    if constexpr (std::is_same_v<T, float>) {
      store8(x + j, _mm256_fmsub_ps(a, cj, _mm256_mul_ps(b, sj)));
      store8(x + half + j, _mm256_fmadd_ps(b, cj, _mm256_mul_ps(a, sj)));
    } else {
      store8(x + j, _mm256_sub_ps(round_to<T>(_mm256_mul_ps(a, cj)),
                                  round_to<T>(_mm256_mul_ps(b, sj))));
      store8(x + half + j, _mm256_add_ps(round_to<T>(_mm256_mul_ps(b, cj)),
                                         round_to<T>(_mm256_mul_ps(a, sj))));
    }
  }
  for (; j < half; ++j) {
    const float a = to_float(x[j]), b = to_float(x[half + j]);
    x[j] = static_cast<T>(round_to<T>(a * c[j]) - round_to<T>(b * s[j]));
    x[half + j] = static_cast<T>(round_to<T>(b * c[j]) + round_to<T>(a * s[j]));
  }
}

template <typename T>
void check_heads(const at::Tensor& t, int64_t tokens, int64_t head_dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == c10::CppTypeToScalarType<T>::value &&
                  t.dim() == 3 && t.size(0) == tokens && t.size(2) == head_dim &&
                  t.stride(2) == 1,
              what, ": expected [tokens, heads, ", head_dim,
              "] in the kernel's dtype with unit stride in D");
}

// q [T, H, D] and k [T, Hkv, D] rotated in place (any token/head strides: they may be
// views into the fused q/k/v output) at positions [T]; cos/sin caches [max_pos, D] (fp32)
// hold the half-frequencies twice, so their first D / 2 columns are all that is read.
void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& positions,
                      const at::Tensor& cos_cache, const at::Tensor& sin_cache) {
  const int64_t tokens = positions.numel(), head_dim = cos_cache.size(1), half = head_dim / 2;
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "rotary_embedding: positions must be contiguous int64");
  TORCH_CHECK(cos_cache.is_contiguous() && sin_cache.is_contiguous() &&
                  cos_cache.scalar_type() == at::kFloat && sin_cache.sizes() == cos_cache.sizes(),
              "rotary_embedding: cos/sin caches must be contiguous fp32 [max_pos, D]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_embedding: position ", pos[t],
                " outside [0, ", max_pos, ")");
  }
  dispatch_dtype(q, "rotary_embedding", [&](auto type) {
    using T = decltype(type);
    check_heads<T>(q, tokens, head_dim, "rotary_embedding q");
    check_heads<T>(k, tokens, head_dim, "rotary_embedding k");
    at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> angles(2 * half);
      float* c = angles.data();
      float* s = c + half;
      for (int64_t t = begin; t < end; ++t) {
        round_angles<T>(cos_cache.data_ptr<float>() + pos[t] * head_dim,
                        sin_cache.data_ptr<float>() + pos[t] * head_dim, half, c, s);
        for (int64_t h = 0; h < q.size(1); ++h) {
          rotate_head(q.data_ptr<T>() + t * q.stride(0) + h * q.stride(1), c, s, half);
        }
        for (int64_t h = 0; h < k.size(1); ++h) {
          rotate_head(k.data_ptr<T>() + t * k.stride(0) + h * k.stride(1), c, s, half);
        }
      }
    });
  });
}

// ---- the plain draw ---------------------------------------------------------------------

// Index drawn from softmax(logits * inv_temperature) with the uniform u: the first index
// whose cumulative probability exceeds u (the inverse CDF), found from per-block sums so the
// scan is a pass over block totals and one block. -inf logits have probability 0 and are
// never drawn.
int64_t draw_row(const float* logits, int64_t n, float inv_temperature, float u,
                 std::vector<float>& probs, std::vector<float>& block_sums) {
  constexpr int64_t kBlock = 64;
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 vmax = neg_inf;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(logits + j));
  float max = hmax(vmax);
  for (; j < n; ++j) max = std::max(max, logits[j]);
  const __m256 scale = _mm256_set1_ps(inv_temperature);
  const __m256 shift = _mm256_set1_ps(max * inv_temperature);
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t begin = b * kBlock, end = std::min(n, begin + kBlock);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
      const __m256 x = _mm256_loadu_ps(logits + i);
      // exp256 clamps its argument at -87.3, so -inf logits are zeroed by mask.
      const __m256 finite = _mm256_cmp_ps(x, neg_inf, _CMP_NEQ_OQ);
      const __m256 p = _mm256_and_ps(exp256(_mm256_fmsub_ps(x, scale, shift)), finite);
      _mm256_storeu_ps(probs.data() + i, p);
      acc = _mm256_add_ps(acc, p);
    }
    float sum = hsum(acc);
    for (; i < end; ++i) {
      const bool finite = logits[i] != -std::numeric_limits<float>::infinity();
      probs[i] = finite ? std::exp(logits[i] * inv_temperature - max * inv_temperature) : 0.0f;
      sum += probs[i];
    }
    block_sums[b] = sum;
    total += sum;
  }
  const double target = static_cast<double>(u) * total;
  double seen = 0.0;
  int64_t b = 0;
  for (; b < num_blocks - 1 && seen + block_sums[b] <= target; ++b) seen += block_sums[b];
  // Block sums and the running sum round differently: the scan may run past block b.
  for (int64_t i = b * kBlock; i < n; ++i) {
    seen += probs[i];
    if (probs[i] > 0.0f && seen > target) return i;
  }
  // Rounding left the target at the row's end: the last token that can be drawn.
  for (int64_t i = n - 1; i >= 0; --i) {
    if (probs[i] > 0.0f) return i;
  }
  return 0;  // every logit is -inf: nothing can be drawn, and torch's draw is as arbitrary
}

// out[r] = one token of row r of logits [R, V] from softmax(logits * inv_temperature),
// drawn with uniforms[r].
void sample_plain(at::Tensor out, const at::Tensor& logits, const at::Tensor& inv_temperature,
                  const at::Tensor& uniforms) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  check_rows<float>(logits, n, "sample_plain logits");
  for (const auto* t : {&inv_temperature, &uniforms}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->numel() == rows,
                "sample_plain: inv_temperature and uniforms must be contiguous fp32 [rows]");
  }
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kLong && out.is_contiguous() &&
                  out.numel() == rows,
              "sample_plain: out must be contiguous int64 [rows]");
  int64_t* ids = out.data_ptr<int64_t>();
  const float* temp = inv_temperature.data_ptr<float>();
  const float* u = uniforms.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(n), block_sums(n / 64 + 1);
    for (int64_t r = begin; r < end; ++r) {
      ids[r] = draw_row(logits.data_ptr<float>() + r * logits.stride(0), n, temp[r], u[r],
                        probs, block_sums);
    }
  });
}

// The first index of the row's maximum, a NaN counting as above every number: torch.argmax's
// answer. Two vector passes (the maximum, then its first occurrence) where torch's indexed
// reduction took 0.65 ms over a 262k-token vocabulary.
int64_t argmax_row(const float* x, int64_t n) {
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 unordered = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    vmax = _mm256_max_ps(vmax, v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  bool any_nan = _mm256_movemask_ps(unordered) != 0;
  float max = hmax(vmax);
  for (; j < n; ++j) {
    any_nan = any_nan || std::isnan(x[j]);
    max = std::max(max, x[j]);
  }
  if (any_nan) {
    for (int64_t i = 0; i < n; ++i) {
      if (std::isnan(x[i])) return i;
    }
  }
  const __m256 target = _mm256_set1_ps(max);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
    if (hits != 0) return i + __builtin_ctz(hits);
  }
  for (; i < n; ++i) {
    if (x[i] == max) return i;
  }
  return 0;  // no row reaches here: the maximum is one of its elements
}

// out[r] = argmax of row r of logits [R, V] (the sampler's greedy pick).
void argmax_rows(at::Tensor out, const at::Tensor& logits) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  check_rows<float>(logits, n, "argmax_rows logits");
  TORCH_CHECK(n > 0, "argmax_rows: rows must not be empty");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kLong && out.is_contiguous() &&
                  out.numel() == rows,
              "argmax_rows: out must be contiguous int64 [rows]");
  int64_t* ids = out.data_ptr<int64_t>();
  const float* data = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) ids[r] = argmax_row(data + r * stride, n);
  });
}

// out = gelu_tanh(gate) * up, where x = [gate | up] along the last dimension, and logits =
// tanh(logits / cap) * cap in place: ATen's own kernels, called for a compiled graph, which
// would otherwise generate its own tanh (other last bits than the eager step's).
void gelu_tanh_and_mul(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "gelu_tanh_and_mul: x must be [rows, 2 * d]");
  const int64_t d = x.size(1) / 2;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == d &&
                  out.scalar_type() == x.scalar_type(),
              "gelu_tanh_and_mul: out must be [rows, d] in x's dtype");
  at::gelu_out(out, x.narrow(1, 0, d), "tanh");
  out.mul_(x.narrow(1, d, d));
}

void soft_cap(at::Tensor logits, double cap) {
  logits.div_(cap);
  logits.tanh_();
  logits.mul_(cap);
}

}  // namespace

// Schemas here, kernels under the CPU key: tracing (torch.compile) runs the fake kernels
// registered in pagedllm/ops/fake.py instead of these.
TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def(
      "rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps, float weight_offset=0.0) -> "
      "()");
  m.def(
      "fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, "
      "float weight_offset=0.0) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def(
      "rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_cache, "
      "Tensor sin_cache) -> ()");
  m.def(
      "sample_plain(Tensor(a!) out, Tensor logits, Tensor inv_temperature, Tensor uniforms) "
      "-> ()");
  m.def("argmax_rows(Tensor(a!) out, Tensor logits) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("soft_cap(Tensor(a!) logits, float cap) -> ()");
  m.def("set_vector_lanes(int lanes) -> ()");
  m.def("get_vector_lanes() -> int");
  m.def("set_native_bf16_round(bool native) -> ()");
  m.def("get_native_bf16_round() -> bool");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("sample_plain", &sample_plain);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("soft_cap", &soft_cap);
}

TORCH_LIBRARY_IMPL(pagedllm, CatchAll, m) {
  m.impl("set_vector_lanes", &set_vector_lanes);
  m.impl("get_vector_lanes", &get_vector_lanes);
  m.impl("set_native_bf16_round", &set_native_bf16_round);
  m.impl("get_native_bf16_round", &get_native_bf16_round);
}
