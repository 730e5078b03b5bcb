// A step's routing as the expert kernels take it (moe_experts.cpp: bf16 weights;
// quant_kernels.cpp: quantized ones): the (token, expert) pairs grouped by expert.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

namespace llm_cpu_moe {

// The pairs grouped by expert, tokens ascending within an expert.
struct Routes {
  std::vector<int64_t> token;   // [pairs]
  std::vector<float> weight;    // [pairs]
  std::vector<int64_t> first;   // [E + 1]: expert e's pairs are [first[e], first[e + 1])
  std::vector<int64_t> used;    // the experts with any pair, ascending

  int64_t rows(int64_t e) const { return first[e + 1] - first[e]; }
};

// experts int64 [T, k] and weights (float32 or bf16) [T, k] of x's T tokens, or an error that
// names `op` and what is wrong.
inline Routes group_by_expert(const char* op, const at::Tensor& experts,
                              const at::Tensor& weights, int64_t tokens, int64_t num_experts) {
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == tokens &&
                  experts.scalar_type() == at::kLong && weights.sizes() == experts.sizes(),
              op, ": experts (int64) and weights must both be [T, k] for ", tokens, " tokens");
  const int64_t k = experts.size(1);
  const at::Tensor chosen = experts.contiguous();
  const int64_t* ex = chosen.const_data_ptr<int64_t>();
  Routes r;
  r.first.assign(num_experts + 1, 0);
  for (int64_t p = 0; p < tokens * k; ++p) {
    TORCH_CHECK(ex[p] >= 0 && ex[p] < num_experts, op, ": expert ", ex[p], " of ", num_experts);
    ++r.first[ex[p] + 1];
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
    const int64_t at = next[ex[p]]++;
    r.token[at] = p / k;
    r.weight[at] = wp[p];
  }
  return r;
}

}  // namespace llm_cpu_moe
