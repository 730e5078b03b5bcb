// A mixture of experts' routed experts in one call on AVX512-BF16, in the executor process:
// torch.ops.llm_cpu.moe_experts, which stages/executor/models/moe_block.py calls where the
// experts' weights are packed bf16 (amx_linear.cpp's layout, gate and up interleaved).
//
// Why one call: an expert is small (Qwen3-30B-A3B's: 768 x 2048), a token takes 8 of 128, and
// a step runs a few to all of them, each on a handful of rows. As separate products (two a
// routed expert, each a dispatch and a parallel region with its barrier, each too small to
// keep two threads streaming) a one-token step of the mid-size benchmark MoE ran at ~half the
// memory's speed. Here the step is two parallel passes:
//   1. gate/up: every routed expert's panels are units of one queue; a unit multiplies the
//      expert's rows, read in place from x, and writes silu(gate) * up for them, rounded to
//      bf16 as the model's dtype rounds it between the two products.
//   2. down: each unit is a group of the output's panels; it runs every routed expert's down
//      product on them and adds each row's result, times its routing weight, into its token's
//      float32 sums, experts in ascending order: nothing is shared between threads, and a
//      token's sum does not depend on the other tokens of the step.
// Every expert's weights stream from memory once per step however many tokens it has.
//
// Rounding: transformers rounds each expert's output to bf16 before weighting and summing; here
// the k weighted outputs are summed in float32 and rounded once.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16_vector.h"
#include "moe_routes.h"
#include "work_queue.h"

namespace {

using llm_cpu_bf16::kChunkBytes;
using llm_cpu_bf16::kChunkK;
using llm_cpu_bf16::kPanel;

using llm_cpu_bf16::kGroupBytes;
using llm_cpu_bf16::kRowBlock;

#if LLM_CPU_BF16_VECTOR

using llm_cpu_bf16::kPrefetch;
using llm_cpu_bf16::rows_by_panels;
using llm_cpu_bf16::store_bf16;
using llm_cpu_bf16::store_gated;
using llm_cpu_moe::Routes;
using llm_cpu_work::Order;
using llm_cpu_work::parallel_queue;
using llm_cpu_work::WorkQueue;

// One projection of every expert, stacked: E x panels of panel_bytes; bias float32 [E, N].
struct Stacked {
  const uint8_t* w;
  int64_t panels, chunks, panel_bytes;
  const float* bias;

  const uint8_t* panel(int64_t e, int64_t p) const { return w + (e * panels + p) * panel_bytes; }
};

// Pass 1: h[pair] = silu(x[token] W_gate^T + b) * (x[token] W_up^T + b) for every routed
// expert, h [pairs, I] bf16. An expert with one block of rows streams its panels from memory
// once, in groups that give each thread several; one with more reads each group's panels from
// L2 once per block of rows.
void gate_up_pass(const c10::BFloat16* x, int64_t hidden, const Routes& routes,
                  const Stacked& w13, c10::BFloat16* h) {
  struct Unit {
    int64_t expert, begin, end;  // panels [begin, end) of one expert
  };
  const int64_t inter = w13.panels * kPanel / 2;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t decode_group = std::max<int64_t>(
      4, static_cast<int64_t>(routes.used.size()) * w13.panels / (threads * 8));
  const int64_t l2_group = std::max<int64_t>(1, kGroupBytes / w13.panel_bytes);
  std::vector<Unit> units;
  for (const int64_t e : routes.used) {
    const int64_t group = routes.rows(e) <= kRowBlock ? decode_group : l2_group;
    for (int64_t p = 0; p < w13.panels; p += group)
      units.push_back({e, p, std::min(w13.panels, p + group)});
  }
  const int64_t widest = std::min(w13.panels, std::max(decode_group, l2_group));
  parallel_queue(static_cast<int64_t>(units.size()), 1, Order::kShared,
                 [&](WorkQueue& queue, int64_t w_index) {
    std::vector<float> sums(kRowBlock * widest * kPanel);
    const c10::BFloat16* rows[kRowBlock];
    for (int64_t begin, end; queue.take(w_index, begin, end);) {
      const Unit& u = units[begin];
      const int64_t count = u.end - u.begin;
      const float* bias = w13.bias != nullptr ? w13.bias + u.expert * w13.panels * kPanel : nullptr;
      for (int64_t p0 = routes.first[u.expert]; p0 < routes.first[u.expert + 1];
           p0 += kRowBlock) {
        const int64_t block = std::min(kRowBlock, routes.first[u.expert + 1] - p0);
        for (int64_t r = 0; r < block; ++r) rows[r] = x + routes.token[p0 + r] * hidden;
        rows_by_panels(rows, block, w13.panel(u.expert, u.begin), w13.panel_bytes, w13.chunks,
                       count, sums.data(), w13.panel(u.expert, u.end));
        for (int64_t r = 0; r < block; ++r) {
          for (int64_t j = 0; j < count; ++j) {
            const int64_t n0 = (u.begin + j) * kPanel;
            store_gated(sums.data() + r * count * kPanel + j * kPanel,
                        bias != nullptr ? bias + n0 : nullptr, h + (p0 + r) * inter + n0 / 2);
          }
        }
      }
    }
  });
}

// Pass 2: y[token, unit's columns] = the sum over its experts (ascending) of weight * (h
// W_down^T + b). A unit is a group of output panels whose weights (per expert) fit L2, so an
// expert's blocks of rows after the first, and h's rows, are read once a group, not a panel.
void down_pass(const c10::BFloat16* h, int64_t inter, const Routes& routes, const Stacked& w2,
               int64_t tokens, c10::BFloat16* y) {
  const int64_t hidden = w2.panels * kPanel;
  const int64_t group = std::max<int64_t>(
      1, std::min(kGroupBytes / w2.panel_bytes,
                  w2.panels / (std::max<int64_t>(1, at::get_num_threads()) * 8)));
  parallel_queue(w2.panels, group, Order::kShared, [&](WorkQueue& queue, int64_t w_index) {
    std::vector<float> acc(tokens * group * kPanel), sums(kRowBlock * group * kPanel);
    const c10::BFloat16* rows[kRowBlock];
    for (int64_t begin, end; queue.take(w_index, begin, end);) {
      const int64_t count = end - begin, width = count * kPanel, n0 = begin * kPanel;
      std::fill(acc.begin(), acc.begin() + tokens * width, 0.0f);
      for (size_t i = 0; i < routes.used.size(); ++i) {
        const int64_t e = routes.used[i];
        const float* bias = w2.bias != nullptr ? w2.bias + e * hidden + n0 : nullptr;
        if (i + 1 < routes.used.size()) {  // the next expert's panels start elsewhere: their
          // first bytes into L2 now (a block prefetches within what it streams)
          const uint8_t* next = w2.panel(routes.used[i + 1], begin);
          for (int64_t line = 0; line < std::min(kPrefetch, count * w2.panel_bytes); line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(next + line), _MM_HINT_T1);
        }
        for (int64_t p0 = routes.first[e]; p0 < routes.first[e + 1]; p0 += kRowBlock) {
          const int64_t block = std::min(kRowBlock, routes.first[e + 1] - p0);
          for (int64_t r = 0; r < block; ++r) rows[r] = h + (p0 + r) * inter;
          rows_by_panels(rows, block, w2.panel(e, begin), w2.panel_bytes, w2.chunks, count,
                         sums.data(), w2.panel(e, end));
          for (int64_t r = 0; r < block; ++r) {
            const __m512 weight = _mm512_set1_ps(routes.weight[p0 + r]);
            float* a = acc.data() + routes.token[p0 + r] * width;
            for (int64_t c = 0; c < width; c += 16) {
              __m512 v = _mm512_loadu_ps(sums.data() + r * width + c);
              if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c));
              _mm512_storeu_ps(a + c, _mm512_fmadd_ps(weight, v, _mm512_loadu_ps(a + c)));
            }
          }
        }
      }
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t c = 0; c < width; c += 16)
          store_bf16(y + t * hidden + n0 + c, _mm512_loadu_ps(&acc[t * width + c]), 0xffff);
    }
  });
}

#endif  // LLM_CPU_BF16_VECTOR

// x bf16 [T, H], H a multiple of 32; experts int64 [T, k] and weights (float32 or bf16)
// [T, k]; w13 uint8 [E, 2I / 32, H / 32 * 2048] (each expert's gate/up weight packed, gate and
// up interleaved 16 by 16), b13 float32 [E, 2I] (interleaved likewise) or none; w2 uint8
// [E, H / 32, I / 32 * 2048], b2 float32 [E, H] or none. Returns y bf16 [T, H].
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                       const at::Tensor& w13, const c10::optional<at::Tensor>& b13,
                       const at::Tensor& w2, const c10::optional<at::Tensor>& b2) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "moe_experts: x must be a contiguous bf16 matrix");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.scalar_type() == at::kByte &&
                  w2.scalar_type() == at::kByte && w13.is_contiguous() && w2.is_contiguous() &&
                  w13.size(0) == w2.size(0),
              "moe_experts: w13 and w2 must be contiguous uint8 [E, panels, bytes]");
  const int64_t num_experts = w13.size(0), panels13 = w13.size(1), inter = panels13 * kPanel / 2;
  TORCH_CHECK(hidden % kChunkK == 0 && inter % kChunkK == 0 &&
                  w13.size(2) == hidden / kChunkK * kChunkBytes &&
                  w2.size(1) == hidden / kPanel &&
                  w2.size(2) == inter / kChunkK * kChunkBytes,
              "moe_experts: packed weights [", w13.size(1), ", ", w13.size(2), "] and [",
              w2.size(1), ", ", w2.size(2), "] do not fit hidden ", hidden,
              " (a multiple of 32) and an intermediate size of a multiple of 32");
  if (b13.has_value()) {
    TORCH_CHECK(b13->scalar_type() == at::kFloat && b13->is_contiguous() &&
                    b13->numel() == num_experts * 2 * inter,
                "moe_experts: b13 must be float32 [E, 2I]");
  }
  if (b2.has_value()) {
    TORCH_CHECK(b2->scalar_type() == at::kFloat && b2->is_contiguous() &&
                    b2->numel() == num_experts * hidden,
                "moe_experts: b2 must be float32 [E, H]");
  }
  at::Tensor y = at::empty({tokens, hidden}, x.options());
#if LLM_CPU_BF16_VECTOR
  const Routes routes =
      llm_cpu_moe::group_by_expert("moe_experts", experts, weights, tokens, num_experts);
  if (tokens == 0) return y;
  at::Tensor h = at::empty({tokens * experts.size(1), inter}, x.options());
  const auto stacked = [](const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
    return Stacked{w.const_data_ptr<uint8_t>(), w.size(1), w.size(2) / kChunkBytes, w.size(2),
                   bias.has_value() ? bias->const_data_ptr<float>() : nullptr};
  };
  gate_up_pass(x.const_data_ptr<c10::BFloat16>(), hidden, routes, stacked(w13, b13),
               h.mutable_data_ptr<c10::BFloat16>());
  down_pass(h.const_data_ptr<c10::BFloat16>(), inter, routes, stacked(w2, b2), tokens,
            y.mutable_data_ptr<c10::BFloat16>());
  return y;
#else
  TORCH_CHECK(false, "moe_experts: these kernels were built for a CPU without AVX512-BF16");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("moe_experts(Tensor x, Tensor experts, Tensor weights, Tensor w13, Tensor? b13, "
        "Tensor w2, Tensor? b2) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) { m.impl("moe_experts", TORCH_FN(moe_experts)); }
