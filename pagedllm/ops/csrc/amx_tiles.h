// What every AMX kernel needs (amx_linear.cpp, attention_amx.h, gguf_tile_amx.h): Linux's
// grant of the tile data, the tile configuration (palette 1), its loading and release.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <mutex>

namespace pagedllm_amx {

// Linux keeps AMX's tile data off until a process asks for it.
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

inline bool request_tiles() {
  static std::once_flag once;
  static bool granted = false;
  std::call_once(once, [] {
    granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  });
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Makes `config` the tiles' configuration.
__attribute__((target("amx-tile"))) inline void load_config(const TileConfig& config) {
  // GCC 12 drops the stores that filled `config` as dead: it does not see ldtilecfg read them.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// Hands the tiles back (their state need not be saved at the next context switch).
__attribute__((target("amx-tile"))) inline void release_tiles() { _tile_release(); }

}  // namespace pagedllm_amx
