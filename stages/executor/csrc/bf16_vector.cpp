// bf16 linear layers on AVX512-BF16 (bf16_vector.h), in the executor process:
// torch.ops.llm_cpu.bf16_vector_linear, amx_linear's arguments and layout for a CPU without AMX.
//
// Why not oneDNN's packed product, which runs the same instruction on such a CPU: a decode step
// streams every weight once, and oneDNN's bf16 product reads them at about 0.6x the memory's
// speed at one row on the 2-core AMD test machine (docs/BENCHMARKS.md "bf16 products without
// AMX"). Here each thread streams contiguous panels, two at a time for up to four rows.
//
// Work: torch's threads take groups of panels from one queue (work_queue.h); with more than 8
// rows a group's panels fit L2, so blocks of 8 rows after the first read them from there.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <vector>
#include <cstdint>

#include "bf16_vector.h"
#include "work_queue.h"

namespace llm_cpu_bf16 {

#if LLM_CPU_BF16_VECTOR

namespace {

using llm_cpu_work::grain_for;
using llm_cpu_work::Order;
using llm_cpu_work::parallel_queue;
using llm_cpu_work::WorkQueue;

// The sums of a block (rows x panels * 32, float32) into y: bias added, rounded to bf16; or,
// gated, silu(gate) * up of each panel's 16 gate and 16 up columns into y [M, n / 2].
void store_block(const float* sums, int64_t rows, int64_t panels, int64_t m0, int64_t panel0,
                 int64_t n, const float* bias, bool gated, c10::BFloat16* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = sums + r * panels * kPanel;
    for (int64_t j = 0; j < panels; ++j) {
      const int64_t n0 = (panel0 + j) * kPanel;
      if (gated) {
        store_gated(row + j * kPanel, bias != nullptr ? bias + n0 : nullptr,
                    y + (m0 + r) * (n / 2) + n0 / 2);
        continue;
      }
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t c0 = n0 + h * 16, cols = std::min<int64_t>(16, n - c0);
        if (cols <= 0) break;
        const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
        __m512 v = _mm512_loadu_ps(row + j * kPanel + h * 16);
        if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + c0));
        store_bf16(y + (m0 + r) * n + c0, v, mask);
      }
    }
  }
}

}  // namespace

// Up to four rows go two panels at a time, more one: at most 16 sums, all in registers (one
// row over four panels at a time measured no faster than over two).
void rows_by_panels(const c10::BFloat16* const* x, int64_t rows, const uint8_t* w,
                    int64_t panel_bytes, int64_t chunks, int64_t panels, float* out,
                    const uint8_t* end) {
  const int64_t step = rows <= 4 ? 2 : 1, stride = panels * kPanel;
  for (int64_t j = 0; j < panels;) {
    const int64_t left = panels - j;
    const uint8_t* at = w + j * panel_bytes;
    float* o = out + j * kPanel;
    if (step == 2 && left >= 2) {
      panel_rows<2>(x, rows, at, panel_bytes, chunks, o, stride, end);
      j += 2;
    } else {
      panel_rows<1>(x, rows, at, panel_bytes, chunks, o, stride, end);
      j += 1;
    }
  }
}

void vector_linear(const c10::BFloat16* x, int64_t m, int64_t k, const uint8_t* w,
                   int64_t panels, int64_t n, const float* bias, bool gated, c10::BFloat16* y) {
  const int64_t chunks = k / kChunkK, panel_bytes = chunks * kChunkBytes;
  // A decode step: groups of a quarter of a thread's share (4 panels at least); more rows:
  // groups that fit L2, so blocks of rows after the first read them from there.
  const int64_t group = m <= kRowBlock
                            ? grain_for(panels, 4, 4)
                            : std::max<int64_t>(1, kGroupBytes / panel_bytes);
  parallel_queue(panels, group, Order::kShared, [&](WorkQueue& queue, int64_t w_index) {
    std::vector<float> sums(kRowBlock * group * kPanel);
    const c10::BFloat16* rows[kRowBlock];
    for (int64_t begin, end; queue.take(w_index, begin, end);) {
      const int64_t count = end - begin;
      for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
        const int64_t block = std::min(kRowBlock, m - m0);
        for (int64_t r = 0; r < block; ++r) rows[r] = x + (m0 + r) * k;
        rows_by_panels(rows, block, w + begin * panel_bytes, panel_bytes, chunks, count,
                       sums.data(), w + end * panel_bytes);
        store_block(sums.data(), block, count, m0, begin, n, bias, gated, y);
      }
    }
  });
}

#endif  // LLM_CPU_BF16_VECTOR

}  // namespace llm_cpu_bf16

namespace {

bool bf16_vector_available() { return LLM_CPU_BF16_VECTOR; }

// As amx_linear (same arguments and layout), on AVX512-BF16.
at::Tensor bf16_vector_linear(const at::Tensor& x, const at::Tensor& packed,
                              const c10::optional<at::Tensor>& bias, int64_t n, bool gated) {
  llm_cpu_bf16::check_linear("bf16_vector_linear", x, packed, bias, n, gated);
  const int64_t k = x.size(1), panels = packed.size(0);
  at::Tensor y = at::empty({x.size(0), gated ? n / 2 : n}, x.options());
#if LLM_CPU_BF16_VECTOR
  if (x.size(0) > 0) {
    llm_cpu_bf16::vector_linear(x.const_data_ptr<c10::BFloat16>(), x.size(0), k,
                                packed.const_data_ptr<uint8_t>(), panels, n,
                                bias.has_value() ? bias->const_data_ptr<float>() : nullptr,
                                gated, y.mutable_data_ptr<c10::BFloat16>());
  }
  return y;
#else
  TORCH_CHECK(false, "bf16_vector_linear: these kernels were built for a CPU without "
              "AVX512-BF16");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("bf16_vector_available() -> bool", &bf16_vector_available);
  m.def("bf16_vector_linear(Tensor x, Tensor packed, Tensor? bias, int n, bool gated=False) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) {
  m.impl("bf16_vector_linear", TORCH_FN(bf16_vector_linear));
}
