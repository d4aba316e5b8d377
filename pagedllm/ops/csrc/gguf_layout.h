// The GGUF kernel's packed layout, shared by gguf_linear.cpp (which reads it) and
// gguf_pack.cpp (which writes it): columns in tiles of 8; per tile and block of 32 weights,
// block_bytes(bits) bytes (see gguf_tile.h's unpack_tile_block for their order).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace gguf_layout {

constexpr int kBlock = 32;
constexpr int kSuperBlock = 256;  // K-quants' float scales cover this many weights
constexpr int kTileCols = 8;

// Bytes of one block of a tile: low nibbles (128), plus one or two 32-byte planes of high
// bits for 5- and 6-bit weights; 8-bit weights one byte each.
constexpr int64_t block_bytes(int bits) {
  return bits == 8 ? 256 : bits == 6 ? 192 : bits == 5 ? 160 : 128;
}

// Q4_0 (m = -8 d), Q5_0 (m = -16 d) and Q8_0 (stored q + 128, m = -128 d) need no min
// table: the kernel multiplies d by this factor, a power of two, so its m has the bits a
// stored one would.
constexpr float symmetric_min_factor(int bits) {
  return bits == 8 ? -128.f : bits == 5 ? -16.f : -8.f;
}

// One of the layout's tables: `type`, contiguous, `numel` values.
inline void check_table(const char* op, const at::Tensor& t, at::ScalarType type, int64_t numel,
                        const char* what) {
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.numel() == numel, op, ": ", what,
              " must be contiguous ", c10::toString(type), " with ", numel, " values");
}

}  // namespace gguf_layout
