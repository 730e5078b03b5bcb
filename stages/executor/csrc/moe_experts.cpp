// A mixture of experts' routed experts in one call (bf16 weights, AVX512-BF16): for a step's
// tokens x [T, H] and each token's k experts and weights, the weighted sum of the experts'
// gated MLPs, silu(x W_gate) * (x W_up) W_down. Registered as torch.ops.llm_cpu.moe_experts;
// stages/executor/models/moe_block.py calls it where the experts' weights are packed bf16.
//
// Why one call: an expert is small (Qwen3-30B-A3B's: 768 x 2048), a token takes 8 of 128, and
// a step runs a few to all of them, each on a handful of rows. As separate products (two a
// routed expert, each a dispatch and a parallel region with its barrier, each too small to
// keep two threads streaming) a one-token step of the mid-size benchmark MoE ran at ~half the
// memory's speed. Here the step is two parallel passes:
//   1. gate/up: every routed expert's panels (amx_linear.cpp's layout, gate and up columns
//      interleaved 16 by 16) are units of one queue; a unit multiplies the expert's rows, read
//      in place from x, and writes silu(gate) * up for them, rounded to bf16 as the model's
//      dtype rounds it between the two products.
//   2. down: each unit is a panel of the output's columns; it runs every routed expert's down
//      product on that panel and adds each row's result, times its routing weight, into its
//      token's float32 sums, experts in ascending order: nothing is shared between threads,
//      and a token's sum does not depend on the other tokens of the step.
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
#include "work_queue.h"

namespace llm_cpu_bf16 {
void rows_by_panels(const c10::BFloat16* const* x, int64_t rows, const uint8_t* w,
                    int64_t panel_bytes, int64_t chunks, int64_t panels, float* out);
}

namespace {

using llm_cpu_bf16::kChunkBytes;
using llm_cpu_bf16::kChunkK;
using llm_cpu_bf16::kPanel;
using llm_cpu_bf16::kPrefetch;

constexpr int64_t kRowBlock = 8;          // rows a product block (rows_by_panels)
constexpr int64_t kGroupBytes = 1 << 18;  // an expert's panels that many rows read from L2

#if LLM_CPU_BF16_VECTOR

using llm_cpu_bf16::rows_by_panels;
using llm_cpu_bf16::silu_mul;
using llm_cpu_bf16::store_bf16;
using llm_cpu_work::Order;
using llm_cpu_work::parallel_queue;
using llm_cpu_work::WorkQueue;

// The step's (token, expert) pairs grouped by expert, tokens ascending within an expert.
struct Routes {
  std::vector<int64_t> token;          // [pairs]
  std::vector<float> weight;           // [pairs]
  std::vector<int64_t> first;          // [E + 1]: expert e's pairs are [first[e], first[e + 1])
  std::vector<int64_t> used;           // the experts with any pair, ascending
};

Routes group_by_expert(const int64_t* experts, const at::Tensor& weights, int64_t tokens,
                       int64_t k, int64_t num_experts) {
  Routes r;
  r.first.assign(num_experts + 1, 0);
  for (int64_t p = 0; p < tokens * k; ++p) {
    const int64_t e = experts[p];
    TORCH_CHECK(e >= 0 && e < num_experts, "moe_experts: expert ", e, " of ", num_experts);
    ++r.first[e + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    if (r.first[e + 1] > 0) r.used.push_back(e);
    r.first[e + 1] += r.first[e];
  }
  const at::Tensor w = weights.to(at::kFloat).contiguous();
  const float* wp = w.const_data_ptr<float>();
  r.token.resize(tokens * k);
  r.weight.resize(tokens * k);
  std::vector<int64_t> next(r.first.begin(), r.first.end() - 1);
  for (int64_t p = 0; p < tokens * k; ++p) {
    const int64_t at = next[experts[p]]++;
    r.token[at] = p / k;
    r.weight[at] = wp[p];
  }
  return r;
}

// A unit of the gate/up pass: panels [begin, end) of one expert.
struct Unit {
  int64_t expert, begin, end;
};

void moe_forward(const c10::BFloat16* x, int64_t hidden, const Routes& routes,
                 const uint8_t* w13, int64_t panels13, const float* b13, const uint8_t* w2,
                 int64_t panels2, const float* b2, int64_t inter, c10::BFloat16* h,
                 c10::BFloat16* y, int64_t tokens) {
  const int64_t chunks13 = hidden / kChunkK, bytes13 = chunks13 * kChunkBytes;
  const int64_t chunks2 = inter / kChunkK, bytes2 = chunks2 * kChunkBytes;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());

  // 1. gate/up: h[pair] = silu(x[token] W_gate^T) * (x[token] W_up^T), per expert. An
  // expert with one block of rows streams its panels from memory once, in groups that give each
  // thread several; one with more reads each group's panels from L2 once per block of rows.
  const int64_t few = std::max<int64_t>(
      4, static_cast<int64_t>(routes.used.size()) * panels13 / (threads * 8));
  const int64_t in_l2 = std::max<int64_t>(1, kGroupBytes / bytes13);
  std::vector<Unit> units;
  for (const int64_t e : routes.used) {
    const int64_t group = routes.first[e + 1] - routes.first[e] <= kRowBlock ? few : in_l2;
    for (int64_t p = 0; p < panels13; p += group)
      units.push_back({e, p, std::min(panels13, p + group)});
  }
  const int64_t group = std::max(std::min(few, panels13), std::min(in_l2, panels13));
  parallel_queue(static_cast<int64_t>(units.size()), 1, Order::kShared,
                 [&](WorkQueue& queue, int64_t w_index) {
    std::vector<float> sums(kRowBlock * group * kPanel);
    const c10::BFloat16* rows[kRowBlock];
    for (int64_t begin, end; queue.take(w_index, begin, end);) {
      const Unit& u = units[begin];
      const int64_t count = u.end - u.begin;
      const uint8_t* w = w13 + (u.expert * panels13 + u.begin) * bytes13;
      const float* bias = b13 != nullptr ? b13 + u.expert * panels13 * kPanel : nullptr;
      for (int64_t p0 = routes.first[u.expert]; p0 < routes.first[u.expert + 1];
           p0 += kRowBlock) {
        const int64_t block = std::min(kRowBlock, routes.first[u.expert + 1] - p0);
        for (int64_t r = 0; r < block; ++r) rows[r] = x + routes.token[p0 + r] * hidden;
        rows_by_panels(rows, block, w, bytes13, chunks13, count, sums.data());
        for (int64_t r = 0; r < block; ++r) {
          for (int64_t j = 0; j < count; ++j) {
            const int64_t n0 = (u.begin + j) * kPanel;
            const float* s = sums.data() + r * count * kPanel + j * kPanel;
            __m512 g = _mm512_loadu_ps(s), v = _mm512_loadu_ps(s + 16);
            if (bias != nullptr) {
              g = _mm512_add_ps(g, _mm512_loadu_ps(bias + n0));
              v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + 16));
            }
            store_bf16(h + (p0 + r) * inter + n0 / 2, silu_mul(g, v), 0xffff);
          }
        }
      }
    }
  });

  // 2. down: y[token, panel] = sum over its experts (ascending) of weight * (h W_down^T + b).
  parallel_queue(panels2, 1, Order::kShared, [&](WorkQueue& queue, int64_t w_index) {
    std::vector<float> acc(tokens * kPanel);
    alignas(64) float sums[kRowBlock * kPanel];
    const c10::BFloat16* rows[kRowBlock];
    for (int64_t begin, end; queue.take(w_index, begin, end);) {
      const int64_t n0 = begin * kPanel, cols = std::min<int64_t>(kPanel, hidden - n0);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (size_t i = 0; i < routes.used.size(); ++i) {
        const int64_t e = routes.used[i];
        const uint8_t* w = w2 + (e * panels2 + begin) * bytes2;
        const float* bias = b2 != nullptr ? b2 + e * hidden + n0 : nullptr;
        if (i + 1 < routes.used.size()) {  // the next expert's panel starts elsewhere: its
          // first bytes into L2 now (the blocks prefetch ahead within a panel only)
          const uint8_t* next = w2 + (routes.used[i + 1] * panels2 + begin) * bytes2;
          for (int64_t line = 0; line < std::min(kPrefetch, bytes2); line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(next + line), _MM_HINT_T1);
        }
        for (int64_t p0 = routes.first[e]; p0 < routes.first[e + 1]; p0 += kRowBlock) {
          const int64_t block = std::min(kRowBlock, routes.first[e + 1] - p0);
          for (int64_t r = 0; r < block; ++r) rows[r] = h + (p0 + r) * inter;
          rows_by_panels(rows, block, w, bytes2, chunks2, 1, sums);
          for (int64_t r = 0; r < block; ++r) {
            const __m512 weight = _mm512_set1_ps(routes.weight[p0 + r]);
            float* a = acc.data() + routes.token[p0 + r] * kPanel;
            for (int64_t half = 0; half < 2; ++half) {
              __m512 v = _mm512_loadu_ps(sums + r * kPanel + half * 16);
              if (bias != nullptr) {
                const int64_t c = std::min<int64_t>(16, std::max<int64_t>(0, cols - half * 16));
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(
                                         static_cast<__mmask16>((1u << c) - 1u), bias + half * 16));
              }
              _mm512_storeu_ps(a + half * 16,
                               _mm512_fmadd_ps(weight, v, _mm512_loadu_ps(a + half * 16)));
            }
          }
        }
      }
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t half = 0; half * 16 < cols; ++half) {
          const int64_t c = std::min<int64_t>(16, cols - half * 16);
          store_bf16(y + t * hidden + n0 + half * 16, _mm512_loadu_ps(&acc[t * kPanel + half * 16]),
                     static_cast<__mmask16>((1u << c) - 1u));
        }
      }
    }
  });
}

#endif  // LLM_CPU_BF16_VECTOR

// x bf16 [T, H]; experts int64 [T, k] and weights (float32 or bf16) [T, k]; w13 uint8
// [E, 2I / 32, H / 32 * 2048] (each expert's gate/up weight packed, gate and up interleaved 16
// by 16), b13 float32 [E, 2I] (interleaved likewise) or none; w2 uint8 [E, ceil(H / 32),
// I / 32 * 2048], b2 float32 [E, H] or none. Returns y bf16 [T, H].
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                       const at::Tensor& w13, const c10::optional<at::Tensor>& b13,
                       const at::Tensor& w2, const c10::optional<at::Tensor>& b2) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "moe_experts: x must be a contiguous bf16 matrix");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == tokens &&
                  experts.scalar_type() == at::kLong && weights.sizes() == experts.sizes(),
              "moe_experts: experts (int64) and weights must both be [T, k] for ", tokens,
              " tokens");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.scalar_type() == at::kByte &&
                  w2.scalar_type() == at::kByte && w13.is_contiguous() && w2.is_contiguous() &&
                  w13.size(0) == w2.size(0),
              "moe_experts: w13 and w2 must be contiguous uint8 [E, panels, bytes]");
  const int64_t num_experts = w13.size(0), panels13 = w13.size(1), inter = panels13 * kPanel / 2;
  TORCH_CHECK(hidden % kChunkK == 0 && inter % kChunkK == 0 &&
                  w13.size(2) == hidden / kChunkK * kChunkBytes &&
                  w2.size(1) == (hidden + kPanel - 1) / kPanel &&
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
  if (tokens == 0) return y;
  const at::Tensor chosen = experts.contiguous();
  const Routes routes = group_by_expert(chosen.const_data_ptr<int64_t>(), weights, tokens,
                                        experts.size(1), num_experts);
  at::Tensor h = at::empty({tokens * experts.size(1), inter}, x.options());
  moe_forward(x.const_data_ptr<c10::BFloat16>(), hidden, routes, w13.const_data_ptr<uint8_t>(),
              panels13, b13.has_value() ? b13->const_data_ptr<float>() : nullptr,
              w2.const_data_ptr<uint8_t>(), w2.size(1),
              b2.has_value() ? b2->const_data_ptr<float>() : nullptr, inter,
              h.mutable_data_ptr<c10::BFloat16>(), y.mutable_data_ptr<c10::BFloat16>(), tokens);
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
