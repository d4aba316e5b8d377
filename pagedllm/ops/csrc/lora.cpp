// LoRA deltas of many adapters in one pass (fp32, CPU): out[t] += (x[t] A[s]) B[s] for every
// adapter token t of slot s, in the spirit of punica's BGMV/SGMV.
//
// The torch path runs the tokens of every slot as batched matmuls of a handful of rows each;
// with the slots' weights cold (a decode step reads every adapter's weights once, between the
// base model's own matmuls) those ran at 3.6 GB/s here. Here each work item is one slot's
// tokens (at most kTokensPerItem of them), four at a time through register tiles: each
// vector of A[s] and of B[s] read serves four tokens, the accumulators stay in registers over
// a whole reduction, and only each shard's own block of the block-structured B is read (a
// fused q/k/v B is two-thirds zeros).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kTokensPerItem = 8;

// h[t, w0 .. w0 + 8 NV) = sum_k x[t, k] a[k, w0 ..] for MT tokens: the accumulators stay in
// registers over the whole reduction, each A vector serving every token.
template <int MT, int NV>
inline void shrink_block(const float* const* x_rows, const float* a, int64_t in, int64_t width,
                         int64_t w0, float* h) {
  __m256 acc[MT][NV];
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < in; ++k) {
    __m256 a_vec[NV];
    for (int v = 0; v < NV; ++v) a_vec[v] = _mm256_loadu_ps(a + k * width + w0 + 8 * v);
    for (int t = 0; t < MT; ++t) {
      const __m256 xv = _mm256_broadcast_ss(x_rows[t] + k);
      for (int v = 0; v < NV; ++v) acc[t][v] = _mm256_fmadd_ps(a_vec[v], xv, acc[t][v]);
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(h + t * width + w0 + 8 * v, acc[t][v]);
}

// h[t] = x[t] A for MT tokens (h rows of `width`).
template <int MT>
void shrink(const float* const* x_rows, const float* a, int64_t in, int64_t width, float* h) {
  int64_t w0 = 0;
  for (; w0 + 16 <= width; w0 += 16) shrink_block<MT, 2>(x_rows, a, in, width, w0, h);
  for (; w0 + 8 <= width; w0 += 8) shrink_block<MT, 1>(x_rows, a, in, width, w0, h);
  for (; w0 < width; ++w0) {  // a rank that is no multiple of 8
    for (int t = 0; t < MT; ++t) {
      float sum = 0.0f;
      for (int64_t k = 0; k < in; ++k) sum += x_rows[t][k] * a[k * width + w0];
      h[t * width + w0] = sum;
    }
  }
}

// out[t, column ..+size) += sum_j h[t, j] b[j, column ..] over `ranks` rows of b, MT tokens:
// each B vector serves every token, the output vectors stay in registers over the ranks.
template <int MT>
void expand(float* const* out_rows, const float* h, int64_t width, const float* b,
            int64_t b_stride, int64_t ranks, int64_t size) {
  int64_t c = 0;
  for (; c + 16 <= size; c += 16) {
    __m256 acc[MT][2];
    for (int t = 0; t < MT; ++t) {
      acc[t][0] = _mm256_loadu_ps(out_rows[t] + c);
      acc[t][1] = _mm256_loadu_ps(out_rows[t] + c + 8);
    }
    for (int64_t j = 0; j < ranks; ++j) {
      const __m256 b0 = _mm256_loadu_ps(b + j * b_stride + c);
      const __m256 b1 = _mm256_loadu_ps(b + j * b_stride + c + 8);
      for (int t = 0; t < MT; ++t) {
        const __m256 hv = _mm256_broadcast_ss(h + t * width + j);
        acc[t][0] = _mm256_fmadd_ps(hv, b0, acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(hv, b1, acc[t][1]);
      }
    }
    for (int t = 0; t < MT; ++t) {
      _mm256_storeu_ps(out_rows[t] + c, acc[t][0]);
      _mm256_storeu_ps(out_rows[t] + c + 8, acc[t][1]);
    }
  }
  for (; c < size; ++c) {
    for (int t = 0; t < MT; ++t) {
      float sum = out_rows[t][c];
      for (int64_t j = 0; j < ranks; ++j) sum += h[t * width + j] * b[j * b_stride + c];
      out_rows[t][c] = sum;
    }
  }
}

template <int MT>
void apply_tokens(const float* const* x_rows, float* const* out_rows, const float* a,
                  const float* b, int64_t in, int64_t width, int64_t out_features,
                  const int64_t* columns, int64_t num_shards, int64_t max_rank, float* h) {
  shrink<MT>(x_rows, a, in, width, h);
  for (int64_t shard = 0; shard < num_shards; ++shard) {
    float* shard_out[MT];
    for (int t = 0; t < MT; ++t) shard_out[t] = out_rows[t] + columns[shard];
    expand<MT>(shard_out, h + shard * max_rank, width,
               b + shard * max_rank * out_features + columns[shard], out_features, max_rank,
               columns[shard + 1] - columns[shard]);
  }
}

// out: [tokens, out_features]; x: [tokens, in]; lora_a: [slots, in, width];
// lora_b: [slots, width, out_features]; sorted_tokens: the adapter tokens, by slot;
// group_starts: [slots + 1] offsets into sorted_tokens; shard_columns: [shards + 1] output
// column offsets, shard k holding rank rows [k * max_rank, (k + 1) * max_rank) of B.
void lora_sgmv(at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a,
               const at::Tensor& lora_b, const at::Tensor& sorted_tokens,
               const at::Tensor& group_starts, const at::Tensor& shard_columns,
               int64_t max_rank) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(out.stride(1) == 1 && x.stride(1) == 1, "rows must be contiguous");
  TORCH_CHECK(lora_a.is_contiguous() && lora_b.is_contiguous(), "weights must be contiguous");
  const int64_t num_slots = lora_a.size(0), in = lora_a.size(1), width = lora_a.size(2);
  const int64_t out_features = lora_b.size(2);
  const int64_t* tokens = sorted_tokens.data_ptr<int64_t>();
  const int64_t* starts = group_starts.data_ptr<int64_t>();
  const int64_t* columns = shard_columns.data_ptr<int64_t>();
  const int64_t num_shards = shard_columns.numel() - 1;
  const float* a_base = lora_a.data_ptr<float>();
  const float* b_base = lora_b.data_ptr<float>();
  const float* x_base = x.data_ptr<float>();
  float* out_base = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);

  // Work items: (slot, first token in sorted_tokens, token count).
  std::vector<int64_t> items;
  for (int64_t slot = 0; slot < num_slots; ++slot) {
    for (int64_t t = starts[slot]; t < starts[slot + 1]; t += kTokensPerItem) {
      items.insert(items.end(), {slot, t, std::min(kTokensPerItem, starts[slot + 1] - t)});
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size()) / 3;
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(kTokensPerItem * width);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t slot = items[3 * item], first = items[3 * item + 1];
      const int64_t count = items[3 * item + 2];
      const float* a = a_base + slot * in * width;
      const float* b = b_base + slot * width * out_features;
      // Tokens four at a time (the register tiles' height), then the rest one by one.
      for (int64_t t = 0; t < count;) {
        const float* x_rows[4];
        float* out_rows[4];
        const int64_t tile = count - t >= 4 ? 4 : 1;
        for (int64_t i = 0; i < tile; ++i) {
          x_rows[i] = x_base + tokens[first + t + i] * x_stride;
          out_rows[i] = out_base + tokens[first + t + i] * out_stride;
        }
        if (tile == 4) {
          apply_tokens<4>(x_rows, out_rows, a, b, in, width, out_features, columns, num_shards,
                          max_rank, h.data());
        } else {
          apply_tokens<1>(x_rows, out_rows, a, b, in, width, out_features, columns, num_shards,
                          max_rank, h.data());
        }
        t += tile;
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def(
      "lora_sgmv(Tensor(a!) out, Tensor x, Tensor lora_a, Tensor lora_b, Tensor sorted_tokens, "
      "Tensor group_starts, Tensor shard_columns, int max_rank) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("lora_sgmv", &lora_sgmv); }
