// How fast this core's bf16 dot products run against its fp32 FMAs, measured in registers.
//
// AVX512-BF16 alone does not say whether bf16 matmuls beat fp32 ones: where vdpbf16ps
// issues once a cycle (AMD Zen 4) it does twice an fp32 FMA's work, and where it issues
// every other cycle (Intel cores whose AMX is absent or hidden) it does half the work of
// the two FMA pipes. The two loops below are the same shape: 24 independent accumulator
// chains, no memory, 512-bit vectors, so their ratio is the core's and not the load's.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace {

#define PROBE_ZERO \
  ".irp r,0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25\n\t" \
  "vpxord %%zmm\\r,%%zmm\\r,%%zmm\\r\n\t.endr\n\t"
#define PROBE_LOOP(INSN)                                                                 \
  __asm__ volatile(PROBE_ZERO                                                            \
                   "1:\n\t.irp r,0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21," \
                   "22,23\n\t" INSN " %%zmm24,%%zmm25,%%zmm\\r\n\t.endr\n\t"             \
                   "dec %0\n\tjnz 1b"                                                    \
                   : "+r"(iterations)                                                    \
                   :                                                                     \
                   : "cc");

__attribute__((target("avx512f,avx512bf16"))) void bf16_dot_loop(int64_t iterations) {
  PROBE_LOOP("vdpbf16ps")
}

__attribute__((target("avx512f"))) void fp32_fma_loop(int64_t iterations) {
  PROBE_LOOP("vfmadd231ps")
}

template <typename Loop>
double seconds(Loop loop, int64_t iterations) {
  const auto start = std::chrono::steady_clock::now();
  loop(iterations);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// FLOP a second of vdpbf16ps over those of vfmadd231ps (each instruction: 64 and 32 FLOP),
// the best of seven alternating runs of each (~0.3 ms a run): 0 where the CPU lacks
// AVX512-BF16.
double bf16_dot_speed_ratio() {
  if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512f")) return 0.0;
  constexpr int64_t kIterations = 20000;
  double best_bf16 = 1e30, best_fp32 = 1e30;
  for (int round = 0; round < 7; ++round) {
    best_bf16 = std::min(best_bf16, seconds(bf16_dot_loop, kIterations));
    best_fp32 = std::min(best_fp32, seconds(fp32_fma_loop, kIterations));
  }
  return (64.0 / best_bf16) / (32.0 / best_fp32);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) { m.def("bf16_dot_speed_ratio() -> float"); }

TORCH_LIBRARY_IMPL(pagedllm, CatchAll, m) { m.impl("bf16_dot_speed_ratio", &bf16_dot_speed_ratio); }
