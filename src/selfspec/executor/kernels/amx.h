// What the kernels' AMX builds share (gguf_amx.h, bf16_rows.cpp with SELFSPEC_BF16_AMX): the
// tile state's permission and the tile configuration.
#pragma once

#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace selfspec_amx {

// Linux (>= 5.16) hands the AMX tile state to a process that asks for it: arch_prctl
// ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18). True where granted; a tile
// instruction without it dies of SIGILL.
inline bool permission() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// ldtilecfg's 64-byte operand (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Not _tile_loadconfig: GCC 12's macro declares only 8 bytes of its operand read, so the
// compiler may drop the stores of the rest (tiles left unconfigured: SIGILL).
inline void load_config(const TileConfig& c) { __asm__ __volatile__("ldtilecfg %0" : : "m"(c)); }

}  // namespace selfspec_amx
