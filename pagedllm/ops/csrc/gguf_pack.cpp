// GGUF blocks -> gguf_linear.cpp's tile layout, in one pass over the file's bytes.
//
// The same transformation as pagedllm/model/layers/gguf_linear.py's `unpack_blocks` /
// `unpack_k_blocks` + `pack_q` / `per_tile` (numpy, the reference the tests hold this to),
// which take ~15 passes over memory: ~19 s for a 1B model's weights, minutes at 8B. Here
// each tile of 8 rows is decoded and scattered once, tiles in parallel.
//
// Per block of 32 weights the kernel wants q (unsigned, below 2^bits) in groups of 4
// consecutive k for the tile's 8 columns: the low nibbles of groups g and g + 4 share the
// byte (g % 4) * 32 + col * 4 + t; 5-bit weights add a 32-byte plane (bit g = group g's
// high bit), 6-bit two (plane g / 4, bits 2 (g % 4) and up); 8-bit weights are one byte
// each, group g at g * 32. Float scales: d, m [tiles][blocks][8]; K-quants: D, M
// [tiles][super-blocks][8] and int8 sc, mn [tiles][sub-blocks][8].

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include "gguf_layout.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

using gguf_layout::check_table;
using gguf_layout::kBlock;
using gguf_layout::kTileCols;
constexpr int kSuper = gguf_layout::kSuperBlock;

// GGML type ids (gguf's GGMLQuantizationType).
enum GgmlType : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14
};

struct Layout {
  int64_t type;
  int bits;
  int64_t file_block_bytes;
  int file_block_weights;
  int halves;  // scales per 32 weights
};

Layout layout_of(int64_t type) {
  switch (type) {
    case kQ4_0: return {type, 4, 18, 32, 1};
    case kQ4_1: return {type, 4, 20, 32, 1};
    case kQ5_0: return {type, 5, 22, 32, 1};
    case kQ8_0: return {type, 8, 34, 32, 1};
    case kQ4_K: return {type, 4, 144, 256, 1};
    case kQ5_K: return {type, 5, 176, 256, 1};
    case kQ6_K: return {type, 6, 210, 256, 2};
  }
  TORCH_CHECK(false, "gguf_pack: GGUF type ", type, " has no kernel");
}


inline uint32_t load4(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

float fp16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);  // F16C, part of the kernels' baseline; exact
}

// One file block decoded: q values (count = block weights) and its scales.
struct Decoded {
  uint8_t q[kSuper];
  float d[kSuper / kBlock], m[kSuper / kBlock];  // float kinds: [0] only
  float super_d, super_m;
  int8_t sc[kSuper / 16], mn[kSuper / 16];
};

void decode_k_scales(const uint8_t* s, Decoded& out) {
  for (int j = 0; j < 4; ++j) {
    out.sc[j] = static_cast<int8_t>(s[j] & 63);
    out.mn[j] = static_cast<int8_t>(s[j + 4] & 63);
  }
  for (int j = 4; j < 8; ++j) {
    out.sc[j] = static_cast<int8_t>((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
    out.mn[j] = static_cast<int8_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

void decode(const uint8_t* b, const Layout& l, Decoded& out) {
  switch (l.type) {
    case kQ4_0:
    case kQ4_1: {
      const int offset = l.type == kQ4_0 ? 2 : 4;
      out.d[0] = fp16_at(b);
      out.m[0] = l.type == kQ4_0 ? -8.0f * out.d[0] : fp16_at(b + 2);
      for (int j = 0; j < 16; ++j) {
        out.q[j] = b[offset + j] & 0x0F;
        out.q[j + 16] = b[offset + j] >> 4;
      }
      return;
    }
    case kQ5_0: {  // fp16 d, 32 fifth bits (bit j: element j), then Q4_0's nibbles
      out.d[0] = fp16_at(b);
      out.m[0] = -16.0f * out.d[0];
      const uint32_t fifth = load4(b + 2);
      for (int j = 0; j < 16; ++j) {
        out.q[j] = (b[6 + j] & 0x0F) | (((fifth >> j) & 1) << 4);
        out.q[j + 16] = (b[6 + j] >> 4) | (((fifth >> (j + 16)) & 1) << 4);
      }
      return;
    }
    case kQ8_0:
      out.d[0] = fp16_at(b);
      out.m[0] = -128.0f * out.d[0];
      for (int j = 0; j < 32; ++j) out.q[j] = static_cast<uint8_t>(static_cast<int8_t>(b[2 + j]) + 128);
      return;
    case kQ4_K:
    case kQ5_K: {
      out.super_d = fp16_at(b);
      out.super_m = -fp16_at(b + 2);
      decode_k_scales(b + 4, out);
      const uint8_t* qs = b + (l.type == kQ4_K ? 16 : 48);
      const uint8_t* qh = b + 16;
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 32; ++i) {
          uint8_t low = qs[32 * c + i] & 0x0F, high = qs[32 * c + i] >> 4;
          if (l.type == kQ5_K) {
            low |= ((qh[i] >> (2 * c)) & 1) << 4;
            high |= ((qh[i] >> (2 * c + 1)) & 1) << 4;
          }
          out.q[64 * c + i] = low;
          out.q[64 * c + 32 + i] = high;
        }
      return;
    }
    case kQ6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      out.super_d = fp16_at(b + 208);
      out.super_m = -32.0f * out.super_d;
      for (int j = 0; j < 16; ++j) out.sc[j] = out.mn[j] = static_cast<int8_t>(b[192 + j]);
      for (int half = 0; half < 2; ++half)
        for (int i = 0; i < 32; ++i) {
          const uint8_t* lq = ql + 64 * half;
          const uint8_t h = qh[32 * half + i];
          uint8_t* q = out.q + 128 * half;
          q[i] = (lq[i] & 0x0F) | ((h & 3) << 4);
          q[i + 32] = (lq[i + 32] & 0x0F) | (((h >> 2) & 3) << 4);
          q[i + 64] = (lq[i] >> 4) | (((h >> 4) & 3) << 4);
          q[i + 96] = (lq[i + 32] >> 4) | (((h >> 6) & 3) << 4);
        }
      return;
    }
  }
}

// One tile-block (32 weights of 8 columns) in the kernel's bytes, from each column's q.
// A group's 4 values of a column are one 32-bit word, so the layout is built a word at a
// time: each shift is followed by a per-byte mask, which drops the bits a shift carries
// from one byte into the next.
template <int BITS>
void build_tile_block(const uint8_t* const (&q)[kTileCols], uint8_t* out) {
  uint32_t words[64];
  for (int col = 0; col < kTileCols; ++col) {
    if constexpr (BITS == 8) {
      for (int g = 0; g < 8; ++g) words[g * 8 + col] = load4(q[col] + 4 * g);
      continue;
    }
    constexpr uint32_t kLow = 0x0F0F0F0Fu;
    for (int g = 0; g < 4; ++g)
      words[g * 8 + col] = (load4(q[col] + 4 * g) & kLow) | ((load4(q[col] + 4 * g + 16) & kLow) << 4);
    if constexpr (BITS == 5) {
      uint32_t plane = 0;
      for (int g = 0; g < 8; ++g) plane |= ((load4(q[col] + 4 * g) >> 4) & 0x01010101u) << g;
      words[32 + col] = plane;
    }
    if constexpr (BITS == 6) {
      for (int v = 0; v < 2; ++v) {
        uint32_t plane = 0;
        for (int s = 0; s < 4; ++s)
          plane |= ((load4(q[col] + 4 * (4 * v + s)) >> 4) & 0x03030303u) << (2 * s);
        words[32 + 8 * v + col] = plane;
      }
    }
  }
  std::memcpy(out, words, gguf_layout::block_bytes(BITS));
}

struct Tables {
  uint8_t* packed;
  float* d;    // float kinds: d; K: super D
  float* m;    // float kinds: m (null: Q4_0 / Q5_0 / Q8_0 without a min table); K: super M
  int8_t* sc;  // K only
  int8_t* mn;  // K only
};

// Every byte of one tile's tables is written (padding columns as zeros), so the caller's
// tensors need no zeroing: at 8B that would be ~5 GB of page faults on one thread.
template <int BITS>
void pack_tile(const uint8_t* raw, int64_t row_bytes, int64_t rows, const Layout& l, int64_t k,
               int64_t tile, const Tables& t) {
  const int64_t blocks = k / kBlock, file_blocks = k / l.file_block_weights;
  const int per_file = l.file_block_weights / kBlock;
  const bool kquant = l.file_block_weights == kSuper;
  static const Decoded kZero = {};
  Decoded dec[kTileCols];
  for (int64_t fb = 0; fb < file_blocks; ++fb) {
    for (int col = 0; col < kTileCols; ++col) {
      const int64_t row = tile * kTileCols + col;
      if (row < rows) {
        decode(raw + row * row_bytes + fb * l.file_block_bytes, l, dec[col]);
      } else {
        dec[col] = kZero;
      }
    }
    for (int j = 0; j < per_file; ++j) {
      const int64_t b = fb * per_file + j;
      const uint8_t* q[kTileCols];
      for (int col = 0; col < kTileCols; ++col) q[col] = dec[col].q + j * kBlock;
      build_tile_block<BITS>(q, t.packed + (tile * blocks + b) * gguf_layout::block_bytes(BITS));
      for (int col = 0; col < kTileCols; ++col) {
        if (!kquant) {
          t.d[(tile * blocks + b) * kTileCols + col] = dec[col].d[0];
          if (t.m != nullptr) t.m[(tile * blocks + b) * kTileCols + col] = dec[col].m[0];
          continue;
        }
        for (int h = 0; h < l.halves; ++h) {
          const int64_t sub = (tile * blocks + b) * l.halves + h;
          t.sc[sub * kTileCols + col] = dec[col].sc[j * l.halves + h];
          if (t.mn != nullptr) t.mn[sub * kTileCols + col] = dec[col].mn[j * l.halves + h];
        }
      }
    }
    if (kquant)
      for (int col = 0; col < kTileCols; ++col) {
        t.d[(tile * file_blocks + fb) * kTileCols + col] = dec[col].super_d;
        t.m[(tile * file_blocks + fb) * kTileCols + col] = dec[col].super_m;
      }
  }
}

// raw [N, row bytes] -> the kernel's tables, which the caller allocates (uninitialized):
// packed [tiles * blocks * tile-block bytes]; d, m float (m may be empty for Q4_0 and Q8_0);
// sc, mn int8 (K-quants; else empty).
void gguf_pack(const at::Tensor& raw, int64_t type, at::Tensor packed, at::Tensor d, at::Tensor m,
               at::Tensor sc, at::Tensor mn) {
  const Layout l = layout_of(type);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(),
              "gguf_pack: raw must be contiguous uint8 [rows, row bytes]");
  TORCH_CHECK(raw.size(1) % l.file_block_bytes == 0, "gguf_pack: a row of ", raw.size(1),
              " bytes is not whole blocks");
  const int64_t rows = raw.size(0), k = raw.size(1) / l.file_block_bytes * l.file_block_weights;
  const int64_t tiles = (rows + kTileCols - 1) / kTileCols, blocks = k / kBlock;
  const bool kquant = l.file_block_weights == kSuper;
  const int64_t scale_count = tiles * (kquant ? k / kSuper : blocks) * kTileCols;
  const int64_t sub_count = kquant ? tiles * blocks * l.halves * kTileCols : 0;
  check_table("gguf_pack", packed, at::kByte, tiles * blocks * gguf_layout::block_bytes(l.bits), "packed");
  check_table("gguf_pack", d, at::kFloat, scale_count, "d");
  // Q4_0's, Q5_0's and Q8_0's min is a power of two times d
  // (gguf_layout::symmetric_min_factor): the caller may pass no m, and the kernel derives it.
  const bool symmetric = l.type == kQ4_0 || l.type == kQ5_0 || l.type == kQ8_0;
  if (m.numel() != 0 || !symmetric) check_table("gguf_pack", m, at::kFloat, scale_count, "m");
  check_table("gguf_pack", sc, at::kChar, sub_count, "sc");
  // Q6_K's min is its scale: the caller may pass no mn and read sc for both.
  if (mn.numel() != 0 || l.type != kQ6_K) check_table("gguf_pack", mn, at::kChar, sub_count, "mn");
  const Tables t{packed.data_ptr<uint8_t>(), d.data_ptr<float>(),
                 m.numel() != 0 ? m.data_ptr<float>() : nullptr,
                 kquant ? sc.data_ptr<int8_t>() : nullptr,
                 kquant && mn.numel() != 0 ? mn.data_ptr<int8_t>() : nullptr};
  const uint8_t* data = raw.data_ptr<uint8_t>();
  const int64_t row_bytes = raw.size(1);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      switch (l.bits) {
        case 4: pack_tile<4>(data, row_bytes, rows, l, k, tile, t); break;
        case 5: pack_tile<5>(data, row_bytes, rows, l, k, tile, t); break;
        case 6: pack_tile<6>(data, row_bytes, rows, l, k, tile, t); break;
        default: pack_tile<8>(data, row_bytes, rows, l, k, tile, t);
      }
    }
  });
}

// A packed checkpoint's q (GPTQ, AWQ, compressed-tensors: uint8 [N, K], any strides, values
// below 2^bits) -> the kernel's packed tiles, which the caller allocates (uninitialized):
// gguf_linear.py's `pack_q` in one pass, tiles in parallel. A torch reference took ~0.4 s a
// Llama-3.2-1B layer on one thread (a reshape, a permute and a copy per plane).
// 8 rows of 8 bytes, `stride` apart, into columns[c][at .. at + 8) (row r at at + r).
inline void transpose_8x8(const uint8_t* rows, int64_t stride, uint8_t (&columns)[kTileCols][kBlock],
                          int at) {
  __m128i r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows + i * stride));
  const __m128i a0 = _mm_unpacklo_epi8(r[0], r[1]), a1 = _mm_unpacklo_epi8(r[2], r[3]);
  const __m128i a2 = _mm_unpacklo_epi8(r[4], r[5]), a3 = _mm_unpacklo_epi8(r[6], r[7]);
  // b: columns 0-3 (lo) and 4-7 (hi), rows 0-3 (a0, a1) and 4-7 (a2, a3), 4 bytes a column
  const __m128i b0 = _mm_unpacklo_epi16(a0, a1), b1 = _mm_unpackhi_epi16(a0, a1);
  const __m128i b2 = _mm_unpacklo_epi16(a2, a3), b3 = _mm_unpackhi_epi16(a2, a3);
  const __m128i pairs[4] = {_mm_unpacklo_epi32(b0, b2), _mm_unpackhi_epi32(b0, b2),
                            _mm_unpacklo_epi32(b1, b3), _mm_unpackhi_epi32(b1, b3)};
  for (int p = 0; p < 4; ++p) {  // pair p: columns 2p (low 8 bytes) and 2p + 1
    _mm_storel_epi64(reinterpret_cast<__m128i*>(columns[2 * p] + at), pairs[p]);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(columns[2 * p + 1] + at), _mm_unpackhi_epi64(pairs[p], pairs[p]));
  }
}

template <int BITS>
void pack_q_tile(const uint8_t* q, int64_t rows, int64_t k, int64_t row_stride,
                 int64_t k_stride, int64_t tile, uint8_t* packed) {
  const int64_t blocks = k / kBlock;
  uint8_t columns[kTileCols][kBlock];
  const uint8_t* column[kTileCols];
  for (int col = 0; col < kTileCols; ++col) column[col] = columns[col];
  const int64_t first_row = tile * kTileCols;
  const int valid = static_cast<int>(std::min<int64_t>(kTileCols, rows - first_row));
  std::memset(columns, 0, sizeof(columns));  // padding columns stay zero
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* base = q + first_row * row_stride + b * kBlock * k_stride;
    if (k_stride == 1) {
      for (int col = 0; col < valid; ++col) std::memcpy(columns[col], base + col * row_stride, kBlock);
    } else if (row_stride == 1 && valid == kTileCols) {
      // A transposed view ([K, N] rows read as [N, K]): each k's 8 columns are 8 adjacent
      // bytes, turned into the columns' runs 8 k at a time (a scalar gather took 5x longer).
      for (int i = 0; i < kBlock; i += 8) transpose_8x8(base + i * k_stride, k_stride, columns, i);
    } else {
      for (int i = 0; i < kBlock; ++i)
        for (int col = 0; col < valid; ++col) columns[col][i] = base[i * k_stride + col * row_stride];
    }
    build_tile_block<BITS>(column, packed + (tile * blocks + b) * gguf_layout::block_bytes(BITS));
  }
}

void pack_q_tiles(const at::Tensor& q, int64_t bits, at::Tensor packed) {
  TORCH_CHECK(bits == 4 || bits == 8, "pack_q_tiles: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kByte && q.dim() == 2,
              "pack_q_tiles: q must be a 2-D uint8 CPU tensor");
  const int64_t rows = q.size(0), k = q.size(1);
  TORCH_CHECK(k % kBlock == 0, "pack_q_tiles: ", k, " inputs are not whole blocks of ", kBlock);
  const int64_t tiles = (rows + kTileCols - 1) / kTileCols;
  check_table("pack_q_tiles", packed, at::kByte, tiles * (k / kBlock) * gguf_layout::block_bytes(bits),
              "packed");
  const uint8_t* data = q.data_ptr<uint8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  const int64_t row_stride = q.stride(0), k_stride = q.stride(1);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      if (bits == 4) pack_q_tile<4>(data, rows, k, row_stride, k_stride, tile, out);
      else pack_q_tile<8>(data, rows, k, row_stride, k_stride, tile, out);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def(
      "gguf_pack(Tensor raw, int type, Tensor(a!) packed, Tensor(b!) d, Tensor(c!) m, "
      "Tensor(d!) sc, Tensor(e!) mn) -> ()");  // Q6_K: mn may be empty (it equals sc); Q4_0, Q8_0: m
  m.def("pack_q_tiles(Tensor q, int bits, Tensor(a!) packed) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("gguf_pack", &gguf_pack);
  m.impl("pack_q_tiles", &pack_q_tiles);
}
