// bf16 linear layers on AMX tiles for the few rows of a decode step (CPUs with AMX-BF16).
//
// oneDNN's packed bf16 linear runs these shapes on AMX too, but each call costs ~20-30 us
// of host work before its kernel starts (7-9 us), and a decode step of the default model
// makes 121 such calls; its weight stream also drew 9 GB/s of the ~20 two cores read here
// (benchmarks/results/bf16.md, "AMX"). Here a call is one pass over the weight, stored in
// the tiles' own layout so each thread reads its range of columns front to back.
//
// Weight layout (`amx_pack_weight`, once at load): W [N, K] as [N/32][K/32][16][32][2]:
// a block of 32 output columns holds all of K, 32 at a time, as 16 rows of column-pairs
// (AMX's VNNI order: row r, column c holds W[c][2r], W[c][2r + 1]). Its first and second 16
// columns are two B tiles 128 bytes a row apart. x [M, K] bf16 is read in place as A tiles.
// Sums are fp32 (tdpbf16ps), the bias added in fp32, each output rounded to bf16 once, as
// oneDNN's bf16 linear rounds.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "tile_layout_checks.h"

namespace {

constexpr int64_t kBlockN = 32;     // output columns of a weight block: two B tiles
constexpr int64_t kStepK = 32;      // bf16 of the reduction a tile row holds (64 bytes)
constexpr int64_t kTileRows = 16;   // rows of x an A tile (and a C tile) holds
constexpr int64_t kChunkRows = 32;  // rows of x a pass over a block takes: two A tiles
constexpr int64_t kBlockStepBytes = kTileRows * kBlockN * 2 * 2;  // one k-step of a block

using pagedllm_amx::TileConfig;

// Tiles 0-3: C for (row tile i, column tile j) at 2i + j; 4-5: A for row tiles 0 and 1;
// 6-7: B for column tiles 0 and 1. `rows0` / `rows1`: x's rows in each row tile (0: unused).
__attribute__((target("amx-tile,amx-bf16"))) void configure_tiles(int rows0, int rows1) {
  TileConfig config;
  const int rows[2] = {rows0, rows1};
  for (int i = 0; i < 2; ++i) {
    if (rows[i] == 0) continue;
    for (int j = 0; j < 2; ++j) {
      config.rows[2 * i + j] = static_cast<uint8_t>(rows[i]);
      config.colsb[2 * i + j] = 64;
    }
    config.rows[4 + i] = static_cast<uint8_t>(rows[i]);
    config.colsb[4 + i] = 64;
  }
  for (int j = 6; j < 8; ++j) {
    config.rows[j] = kTileRows;
    config.colsb[j] = 64;
  }
  pagedllm_amx::load_config(config);
}

// out[r, c] = bf16(acc[r, c] + bias[c]) for the chunk's rows and the block's 32 columns.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void store_rows(
    const float* acc, int rows, const float* bias, at::BFloat16* out, int64_t out_stride) {
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(acc + r * kBlockN), b0);
    const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(acc + r * kBlockN + 16), b1);
    const __m512bh packed = _mm512_cvtne2ps_pbh(hi, lo);
    _mm512_storeu_si512(out + r * out_stride, reinterpret_cast<__m512i>(packed));
  }
}

// How far ahead of its tile loads a k-step prefetches the weight into L1: tile loads do
// not overlap (no tile renaming, each B tile waits for the products that read it), so where
// memory's latency is long the stream stalls on every k-step. On an Emerald Rapids VM
// (2.6 GHz; benchmarks/results/bf16.md, 2026-12-02) a pass over the default model's
// projections ran 1.30x / 1.48x / 1.52x / 1.33x faster with it at 1 / 8 / 32 / 64 rows, and
// Llama-3.2-1B's 1.53x at 1 and 32 (medians of 15 paired passes); on a Sapphire Rapids VM
// prefetching 1-4 k-steps ahead changed nothing beyond the run-to-run spread (the hardware
// prefetchers kept up there), and the next whole block was slower (17.0 against 19.4 GB/s).
constexpr int64_t kPrefetchSteps = 2;

// Rows [m, m + rows) of x (rows <= 32) against one weight block. A thread's blocks lie
// back to back, one sequential stream; the prefetches run past a block's end into the next.
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void block_chunk(
    const at::BFloat16* x, int64_t x_stride, const at::BFloat16* block, int64_t k_steps,
    int rows, float* acc) {
  const bool two = rows > kTileRows;
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t x_bytes = x_stride * 2;
  for (int64_t s = 0; s < k_steps; ++s) {
    const char* b = reinterpret_cast<const char*>(block) + s * kBlockStepBytes;
    const char* ahead = b + kPrefetchSteps * kBlockStepBytes;
    for (int64_t line = 0; line < kBlockStepBytes; line += 64) {
      _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    _tile_loadd(6, b, 128);
    _tile_loadd(7, b + 64, 128);
    _tile_loadd(4, x + s * kStepK, x_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, x + kTileRows * x_stride + s * kStepK, x_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, kBlockN * 4);
  _tile_stored(1, acc + 16, kBlockN * 4);
  if (two) {
    _tile_stored(2, acc + kTileRows * kBlockN, kBlockN * 4);
    _tile_stored(3, acc + kTileRows * kBlockN + 16, kBlockN * 4);
  }
}

// Blocks [begin, end) for every row of x, on the calling thread: for each block the rows
// 32 at a time, so a block read once serves them all from L1/L2. Each B tile serves two A
// tiles: passes of 16 rows (double-buffered B tiles, the block re-read from L2 for each
// pass) ran 64 rows at 46.6 against 24.4 ms, and 32 at 18.6 against 17.6, through the
// default model's projections (the weight's prefetch: kPrefetchSteps).
void block_range(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                 const float* bias, int64_t begin, int64_t end) {
  const int64_t rows = x.size(0), k_steps = x.size(1) / kStepK;
  const int64_t block_elements = k_steps * kBlockStepBytes / 2;
  const auto* weight = packed.data_ptr<at::BFloat16>();
  const auto* xs = x.data_ptr<at::BFloat16>();
  auto* os = out.data_ptr<at::BFloat16>();
  alignas(64) float acc[kChunkRows * kBlockN];
  int configured0 = -1, configured1 = -1;
  for (int64_t j = begin; j < end; ++j) {
    const at::BFloat16* block = weight + j * block_elements;
    for (int64_t m = 0; m < rows; m += kChunkRows) {
      const int chunk = static_cast<int>(std::min(kChunkRows, rows - m));
      const int rows0 = std::min<int>(chunk, kTileRows), rows1 = chunk - rows0;
      if (rows0 != configured0 || rows1 != configured1) {
        configure_tiles(rows0, rows1);
        configured0 = rows0;
        configured1 = rows1;
      }
      block_chunk(xs + m * x.stride(0), x.stride(0), block, k_steps, chunk, acc);
      store_rows(acc, chunk, bias ? bias + j * kBlockN : nullptr,
                 os + m * out.stride(0) + j * kBlockN, out.stride(0));
    }
  }
  if (configured0 >= 0) pagedllm_amx::release_tiles();
}

// Columns [blocks * 32) per thread: a grain of blocks that keeps both cores busy on the
// narrowest layers (18 blocks for 576 columns).
constexpr int64_t kBlockGrain = 4;
// The bytes of x a panel holds: a quarter of a 2 MB L2, beside the weight blocks in use.
constexpr int64_t kPanelBytes = 512 * 1024;

// out [M, N] = x [M, K] @ W^T (+ bias), W packed by amx_pack_weight; bf16 x and out, fp32
// bias. K and N multiples of 32.
void amx_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(pagedllm_amx::request_tiles(),
              "amx_linear: the kernel did not grant AMX tile data");
  const float* bias_data =
      pagedllm_tile_layout::check_operands("amx_linear", out, x, packed, bias);
  const int64_t k = x.size(1), n = out.size(1);
  // Rows a panel at a time, so the panel's rows stay in L2 while every weight block passes
  // them (2,048 rows of 576 at once ran at half oneDNN's rate).
  const int64_t panel = std::max(kChunkRows, kPanelBytes / (2 * k) / kChunkRows * kChunkRows);
  const auto run = [&](const at::Tensor& x_panel, const at::Tensor& out_panel) {
    at::parallel_for(0, n / kBlockN, kBlockGrain, [&](int64_t begin, int64_t end) {
      block_range(out_panel, x_panel, packed, bias_data, begin, end);
    });
  };
  if (x.size(0) <= panel) return run(x, out);  // a decode step's rows: no views to make
  for (int64_t m = 0; m < x.size(0); m += panel) {
    const int64_t rows = std::min(panel, x.size(0) - m);
    run(x.narrow(0, m, rows), out.narrow(0, m, rows));
  }
}

// W [N, K] bf16 -> the kernel's layout (see the top of this file).
at::Tensor amx_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "amx_pack_weight: expected a 2-D bf16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % kStepK == 0 && n % kBlockN == 0,
              "amx_pack_weight: K and N must be multiples of 32");
  return weight.reshape({n / kBlockN, kBlockN, k / kStepK, kTileRows, 2})
      .permute({0, 2, 3, 1, 4})
      .contiguous();
}

bool amx_available() { return pagedllm_amx::request_tiles(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("amx_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
  m.def("amx_pack_weight(Tensor weight) -> Tensor");
  m.def("amx_available() -> bool");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_pack_weight", &amx_pack_weight);
}

TORCH_LIBRARY_IMPL(pagedllm, CatchAll, m) { m.impl("amx_available", &amx_available); }
