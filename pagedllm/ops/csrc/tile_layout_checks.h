// The operand checks of the linear kernels over the tile-layout weight copy (amx_linear.cpp,
// bf16_dot_linear.cpp): out [M, N] = x [M, K] @ W^T (+ bias), W packed by amx_pack_weight.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pagedllm_tile_layout {

// Checks x, out, the packed weight and the bias for kernel `op` (K and N multiples of 32);
// returns the bias's data, or nullptr without one.
inline const float* check_operands(const char* op, const at::Tensor& out, const at::Tensor& x,
                                   const at::Tensor& packed,
                                   const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.stride(1) == 1,
              op, ": x must be a 2-D bf16 CPU tensor with unit stride in its rows");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0),
              op, ": out must be [M, N] bf16 with unit stride in its rows");
  const int64_t k = x.size(1), n = out.size(1);
  TORCH_CHECK(k % 32 == 0 && n % 32 == 0, op, ": K and N must be multiples of 32");
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
                  packed.numel() == n * k,
              op, ": the weight must be packed by amx_pack_weight for [", n, ", ", k, "]");
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == n,
              op, ": bias must be [N] fp32");
  return bias->data_ptr<float>();
}

}  // namespace pagedllm_tile_layout
