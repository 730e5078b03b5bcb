// AMX tiles as the CPU kernels use them (amx_linear.cpp: the products; cpu_kernels.cpp: a
// decode's attention scores): whether the build has them, the tile configuration's layout,
// and the process's permission to use them.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#define LLM_CPU_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define LLM_CPU_AMX 0
#endif

#include <cstdint>

namespace llm_cpu_amx {

#if LLM_CPU_AMX

// LDTILECFG's 64-byte operand (palette 1): each tile's rows and bytes a row.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// LDTILECFG of `config`. GCC does not count the builtin as reading all 64 bytes: compiled out
// of line (amx_linear.cpp's configure, once its callers grew), the stores of rows and colsb
// were dropped as dead and the instruction faulted on a config of zeros. The barrier makes
// them happen first.
inline void load_config(const TileConfig& config) {
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// Linux hands a process AMX's tile state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA); asking again is harmless.
inline bool request_tiles() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

#endif  // LLM_CPU_AMX

}  // namespace llm_cpu_amx
