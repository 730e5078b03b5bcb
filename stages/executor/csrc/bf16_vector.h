// bf16 products on AVX512-BF16 over amx_linear.cpp's packed layout, in the executor process:
// the blocks of bf16_vector.cpp (linear layers) and moe_experts.cpp (routed experts).
//
// For a CPU without AMX tiles (AMD Zen 4 and 5, Intel Cooper Lake).
// The layout (amx_linear.cpp's header says it whole): panels of 32 output columns, each K / 32
// chunks of 2 KB; a chunk is two halves (columns 0-15, then 16-31), each 16 K-pairs x 16
// columns x 2 bf16. One K-pair of a half is 64 bytes, one ZMM register: VDPBF16PS multiplies it
// by a row's pair of x values broadcast to every lane and adds both products into that half's
// 16 float32 sums. A panel is one contiguous stream, read once per block of rows.
//
// Rounding: every (row, column) sum runs over K in order in one float32 accumulator, whatever
// block of rows and panels it is computed in, so a row's result does not depend on how many
// rows share the call (the batching identity the scheduler's tests rest on).
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define LLM_CPU_BF16_VECTOR 1
#include <immintrin.h>
#else
#define LLM_CPU_BF16_VECTOR 0
#endif

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#include "vector_math.h"

namespace llm_cpu_bf16 {

constexpr int64_t kPanel = 32;         // output columns a panel
constexpr int64_t kChunkK = 32;        // K values a chunk
constexpr int64_t kChunkBytes = 2048;  // a chunk: two halves of 16 pairs x 64 bytes
// How far ahead in its panel a block of more than 4 rows prefetches (into L2): 4-12 KB
// measured alike at 8 rows on the AMD test host, 8 KB the best.
constexpr int64_t kPrefetch = 8192;
constexpr int64_t kRowBlock = 8;          // rows a block of rows_by_panels takes at most
constexpr int64_t kGroupBytes = 1 << 18;  // panels that blocks of many rows read from L2

// The arguments of a packed bf16 product (`op`: amx_linear or bf16_vector_linear), or an error
// that names what is wrong: x bf16 [M, K], K a multiple of 32; packed uint8 [panels,
// K / 32 * 2048]; bias float32 [N] or none; gated: N a multiple of 32.
inline void check_linear(const char* op, const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias, int64_t n, bool gated,
                         int64_t chunk_bytes = kChunkBytes) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, op,
              ": x must be a contiguous bf16 matrix");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              op, ": the packed weight must be a contiguous uint8 matrix");
  const int64_t k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(k > 0 && k % kChunkK == 0, op, ": x has ", k, " columns, not a multiple of ",
              kChunkK);
  TORCH_CHECK(packed.size(1) == (k / kChunkK) * chunk_bytes, op, ": a panel of ",
              packed.size(1), " bytes for ", k, " inputs");
  TORCH_CHECK(n > 0 && panels == (n + kPanel - 1) / kPanel, op, ": ", panels,
              " panels of 32 for ", n, " outputs");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                op, ": bias must be float32 [N]");
  }
  TORCH_CHECK(!gated || n % kPanel == 0, op, ": gated outputs come in panels of 16 gate and 16 "
              "up columns; ", n, " is not a multiple of 32");
}

#if LLM_CPU_BF16_VECTOR

// x's pair p of chunk c (two bf16 values) in every 32-bit lane.
inline __m512bh pair_of(const c10::BFloat16* x, int64_t c, int p) {
  int32_t pair;
  std::memcpy(&pair, x + c * kChunkK + 2 * p, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(pair);
}

// Rows `x[0..R)` (R row pointers, each K bf16 values) by P panels, the first at `w`, the next
// `panel_bytes` apart, over `chunks` chunks of K: the float32 sums into
// out[r * out_stride + j * 32 + c]. More than 4 rows prefetch each panel kPrefetch bytes ahead
// as it goes, up to `end` (the end of what the caller streams: its next bytes are its own).
template <int R, int P>
inline void panel_block(const c10::BFloat16* const* x, const uint8_t* w, int64_t panel_bytes,
                        int64_t chunks, float* out, int64_t out_stride, const uint8_t* end) {
  __m512 acc[R][2 * P];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2 * P; ++j) acc[r][j] = _mm512_setzero_ps();
  const auto fetch = [end](const uint8_t* at) {
    if (at + kPrefetch < end) _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetch), _MM_HINT_T1);
  };
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* chunk = w + c * kChunkBytes;
    if constexpr (R <= 4) {
      // Few rows: half by half, each a kilobyte in order, so a panel is read front to back
      // (the two halves' pairs in turn, 1 KB apart, streamed ~40% slower at one row), and
      // the hardware's prefetcher follows on its own: prefetching 8 KB ahead here too made
      // one thread stream at 0.70x the host's bandwidth, against 0.85x without.
      for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 4
        for (int p = 0; p < 16; ++p) {
          __m512bh wv[P];
          for (int j = 0; j < P; ++j)
            wv[j] = (__m512bh)_mm512_loadu_si512(chunk + j * panel_bytes + h * 1024 + p * 64);
          for (int r = 0; r < R; ++r) {
            const __m512bh xb = pair_of(x[r], c, p);
            for (int j = 0; j < P; ++j)
              acc[r][2 * j + h] = _mm512_dpbf16_ps(acc[r][2 * j + h], xb, wv[j]);
          }
        }
      }
    } else {
      // More: a pair's two halves together, so each broadcast of x feeds two products (the
      // compute, not the stream, bounds 8 rows), prefetched kPrefetch ahead (without, 8 rows
      // streamed at 0.3x the host's bandwidth). The sums run in the same order either way.
#pragma GCC unroll 4
      for (int p = 0; p < 16; ++p) {
        __m512bh wv[2 * P];
        for (int j = 0; j < P; ++j) {
          const uint8_t* at = chunk + j * panel_bytes + p * 64;
          fetch(at);
          fetch(at + 1024);
          wv[2 * j] = (__m512bh)_mm512_loadu_si512(at);
          wv[2 * j + 1] = (__m512bh)_mm512_loadu_si512(at + 1024);
        }
        for (int r = 0; r < R; ++r) {
          const __m512bh xb = pair_of(x[r], c, p);
          for (int j = 0; j < 2 * P; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xb, wv[j]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2 * P; ++j) _mm512_storeu_ps(out + r * out_stride + j * 16, acc[r][j]);
}

// Rows x[0..rows) (1 to 8) by P panels from `w`.
template <int P>
inline void panel_rows(const c10::BFloat16* const* x, int64_t rows, const uint8_t* w,
                       int64_t panel_bytes, int64_t chunks, float* out, int64_t out_stride,
                       const uint8_t* end) {
  switch (rows) {
#define LLM_CPU_ROWS(n) \
  case n:               \
    return panel_block<n, P>(x, w, panel_bytes, chunks, out, out_stride, end);
    LLM_CPU_ROWS(1)
    LLM_CPU_ROWS(2)
    LLM_CPU_ROWS(3)
    LLM_CPU_ROWS(4)
    LLM_CPU_ROWS(5)
    LLM_CPU_ROWS(6)
    LLM_CPU_ROWS(7)
    LLM_CPU_ROWS(8)
#undef LLM_CPU_ROWS
    default:
      TORCH_CHECK(false, "panel_rows: ", rows, " rows; a block has 1 to 8");
  }
}

// Rows x[0..rows) (1 to 8) by `panels` panels from `w` (bf16_vector.cpp), prefetching up to
// `end`: their sums into out (rows of panels * 32).
void rows_by_panels(const c10::BFloat16* const* x, int64_t rows, const uint8_t* w,
                    int64_t panel_bytes, int64_t chunks, int64_t panels, float* out,
                    const uint8_t* end);

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// silu(gate) * up of 16 columns (biases added where given).
inline __m512 silu_mul(__m512 g, __m512 u) {
  v16f gv;
  std::memcpy(&gv, &g, sizeof gv);
  const v16f silu = gv / (1.0f + llm_cpu_vec::exp_lanes<v16f, v16i>(v16f{} - gv));
  __m512 s;
  std::memcpy(&s, &silu, sizeof s);
  return _mm512_mul_ps(s, u);
}

inline void store_bf16(c10::BFloat16* to, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(to, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// A gated panel's 32 sums (16 gate, then 16 up columns; `bias` its 32 float32 biases or null)
// as silu(gate) * up, 16 bf16 values at `to`.
inline void store_gated(const float* sums, const float* bias, c10::BFloat16* to) {
  __m512 g = _mm512_loadu_ps(sums), u = _mm512_loadu_ps(sums + 16);
  if (bias != nullptr) {
    g = _mm512_add_ps(g, _mm512_loadu_ps(bias));
    u = _mm512_add_ps(u, _mm512_loadu_ps(bias + 16));
  }
  store_bf16(to, silu_mul(g, u), 0xffff);
}

#endif  // LLM_CPU_BF16_VECTOR

}  // namespace llm_cpu_bf16
