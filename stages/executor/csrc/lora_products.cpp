// LoRA adapters' products for a step whose rows mix adapters, in the executor process:
// torch.ops.llm_cpu.lora_add, which stages/executor/lora.py calls once per adapted projection.
//
// What it adds: y[t] += sum over the parts p of token t's adapter of
//   (x[t] . A[c0_p .. c0_p + r_p)) @ B_p^T  into outputs [o0_p, o1_p),
// each token only its own adapter's columns (a fused q/k/v or gate/up projection's parts each
// their own rank's; tokens of the base model untouched). This is the segmented product of
// vLLM's punica kernels (SGMV: shrink, then expand per segment): in torch the step's adapters
// were stacked and masked, every row computing every resident adapter's columns and a fused
// projection's block-diagonal B, 3x the multiply-adds the rows need (docs/BENCHMARKS.md).
//
// The step's adapted tokens come ordered by adapter (`rows`, `groups`, made once a step by
// lora.py) and go to torch's threads in tiles of up to kTile tokens of one adapter: a tile
// reads its adapter's A and B once for all its tokens, and writes only its tokens' rows of y,
// so no two threads share an output. Within a token, each sum runs over its inputs in one
// order whatever tile or step it is in: a row's result does not depend on the other rows.
//
// Formats: float32 or bf16, x, y, A and B alike; the sums in float32, y rounded once (bf16:
// to nearest even, as torch rounds).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "work_queue.h"

namespace {

constexpr int64_t kLanes = 16;  // floats a vector
constexpr int kTile = 4;        // tokens a tile: A and B read once for them

typedef float Vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint32_t Vu __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t Vh __attribute__((vector_size(kLanes * sizeof(uint16_t))));

inline Vf load(const float* p) {
  Vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline Vf load(const c10::BFloat16* p) {
  Vh h;
  std::memcpy(&h, p, sizeof h);
  const Vu wide = __builtin_convertvector(h, Vu) << 16;
  Vf v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

inline void store(float* p, Vf v) { std::memcpy(p, &v, sizeof v); }

inline void store(c10::BFloat16* p, Vf v) {
  Vu bits;
  std::memcpy(&bits, &v, sizeof bits);
  // Round to nearest even, NaN to the quiet NaN torch gives (c10::BFloat16's rounding)
  Vu rounded = (bits + (0x7fffu + ((bits >> 16) & 1u))) >> 16;
  rounded = v != v ? Vu{} + 0x7fc0u : rounded;
  const Vh h = __builtin_convertvector(rounded, Vh);
  std::memcpy(p, &h, sizeof h);
}

inline float scalar(float v) { return v; }
inline float scalar(c10::BFloat16 v) { return static_cast<float>(v); }

inline float lanes_sum(Vf v) {
  float s = 0.0f;
  for (int64_t i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// One adapter's part: its shrink columns [c0, c0 + cn) of the layer's A feed outputs
// [o0, o1) through the B block at b (cn rows of o1 - o0, B transposed and scaled).
struct Part {
  int64_t c0, cn, o0, o1;
  int64_t b_offset;
};

// A tile's shrink over K columns at once: s[j * cols + k] = x[t_j] . A[c + k] for its N
// tokens, each sum over the inputs in order (the tail past the last whole vector after it).
// N x K sums in registers: each vector of A or x read feeds N or K multiply-adds.
template <typename T, int N, int K>
inline void shrink_block(const T* const* x, const T* a, int64_t in, int64_t c, float* s,
                         int64_t cols, int64_t k0) {
  const int64_t whole = in - in % kLanes;
  Vf acc[N][K] = {};
  for (int64_t i = 0; i < whole; i += kLanes) {
    Vf w[K];
    for (int k = 0; k < K; ++k) w[k] = load(a + (c + k) * in + i);
    for (int j = 0; j < N; ++j) {
      const Vf v = load(x[j] + i);
      for (int k = 0; k < K; ++k) acc[j][k] += w[k] * v;
    }
  }
  for (int j = 0; j < N; ++j) {
    for (int k = 0; k < K; ++k) {
      float sum = lanes_sum(acc[j][k]);
      for (int64_t i = whole; i < in; ++i) sum += scalar(a[(c + k) * in + i]) * scalar(x[j][i]);
      s[j * cols + k0 + k] = sum;
    }
  }
}

template <typename T, int N>
void shrink(const T* const* x, const T* a, int64_t in, int64_t c_begin, int64_t cols,
            float* s) {
  int64_t k = 0;
  for (; k + 4 <= cols; k += 4) shrink_block<T, N, 4>(x, a, in, c_begin + k, s, cols, k);
  for (; k < cols; ++k) shrink_block<T, N, 1>(x, a, in, c_begin + k, s, cols, k);
}

// A tile's expand of V vectors of outputs [o, o + V * kLanes) of one part:
// y[t_j] += s_j[part's columns] @ the part's B there.
template <typename T, int N, int V>
inline void expand_block(T* const* y, const T* b, int64_t width, int64_t cn, int64_t o,
                         int64_t o_abs, const float* sp, int64_t cols) {
  Vf acc[N][V] = {};
  for (int64_t k = 0; k < cn; ++k) {
    Vf w[V];
    for (int v = 0; v < V; ++v) w[v] = load(b + k * width + o + v * kLanes);
    for (int j = 0; j < N; ++j) {
      const float f = sp[j * cols + k];
      for (int v = 0; v < V; ++v) acc[j][v] += f * w[v];
    }
  }
  for (int j = 0; j < N; ++j) {
    for (int v = 0; v < V; ++v) {
      T* out = y[j] + o_abs + v * kLanes;
      store(out, load(out) + acc[j][v]);
    }
  }
}

template <typename T, int N>
void expand(T* const* y, const T* b, const Part& part, const float* s, int64_t cols,
            int64_t first_col) {
  const int64_t width = part.o1 - part.o0;
  const float* sp = s + (part.c0 - first_col);
  int64_t o = 0;
  for (; o + 4 * kLanes <= width; o += 4 * kLanes)
    expand_block<T, N, 4>(y, b, width, part.cn, o, part.o0 + o, sp, cols);
  for (; o + kLanes <= width; o += kLanes)
    expand_block<T, N, 1>(y, b, width, part.cn, o, part.o0 + o, sp, cols);
  for (; o < width; ++o) {
    for (int j = 0; j < N; ++j) {
      float sum = 0.0f;
      for (int64_t k = 0; k < part.cn; ++k) sum += sp[j * cols + k] * scalar(b[k * width + o]);
      T& out = y[j][part.o0 + o];
      out = static_cast<T>(scalar(out) + sum);
    }
  }
}

template <typename T, int N>
void tile(const T* const* x, T* const* y, const T* a, const T* b, int64_t in,
          const std::vector<Part>& parts, int64_t first_col, int64_t cols, float* s) {
  shrink<T, N>(x, a, in, first_col, cols, s);
  for (const Part& part : parts) expand<T, N>(y, b + part.b_offset, part, s, cols, first_col);
}

template <typename T>
void lora_add_typed(at::Tensor& y, const at::Tensor& x, const at::Tensor& rows,
                    const at::Tensor& groups, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& parts) {
  const int64_t in = x.size(1), out = y.size(1);
  const int32_t* row = rows.data_ptr<int32_t>();
  const int64_t* group = groups.data_ptr<int64_t>();
  const int64_t* part = parts.data_ptr<int64_t>();
  // Each group's parts, its columns, and its tiles (units of the queue)
  struct Group {
    std::vector<Part> parts;
    int64_t first_col = 0, cols = 0, begin = 0, end = 0;
  };
  std::vector<Group> work;
  std::vector<std::pair<int64_t, int64_t>> units;  // (group, first token of its tile)
  for (int64_t g = 0; g < groups.size(0); ++g) {
    Group entry;
    for (int64_t p = 0; p < parts.size(0); ++p) {
      const int64_t* q = part + p * 6;
      if (q[0] != group[g * 3]) continue;
      TORCH_CHECK(q[1] >= 0 && q[2] > 0 && q[1] + q[2] <= a.size(0) && q[3] >= 0 &&
                      q[3] < q[4] && q[4] <= out && q[5] >= 0 &&
                      q[5] + q[2] * (q[4] - q[3]) <= b.numel(),
                  "lora_add: part ", p, " lies outside A, B or y");
      entry.parts.push_back(Part{q[1], q[2], q[3], q[4], q[5]});
    }
    if (entry.parts.empty()) continue;  // (this adapter does not target this projection)
    int64_t last = 0;
    entry.first_col = entry.parts[0].c0;
    for (const Part& p : entry.parts) {
      entry.first_col = std::min(entry.first_col, p.c0);
      last = std::max(last, p.c0 + p.cn);
    }
    entry.cols = last - entry.first_col;
    entry.begin = group[g * 3 + 1];
    entry.end = group[g * 3 + 2];
    TORCH_CHECK(0 <= entry.begin && entry.begin <= entry.end && entry.end <= rows.size(0),
                "lora_add: group ", g, " lies outside rows");
    for (int64_t t = entry.begin; t < entry.end; t += kTile) {
      units.emplace_back(static_cast<int64_t>(work.size()), t);
    }
    work.push_back(std::move(entry));
  }
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(0 <= row[i] && row[i] < x.size(0), "lora_add: row ", row[i], " of ",
                x.size(0));
  }
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  const int64_t y_stride = y.stride(0);
  const auto n = static_cast<int64_t>(units.size());
  llm_cpu_work::parallel_queue(
      n, 1, llm_cpu_work::Order::kShared, [&](llm_cpu_work::WorkQueue& queue, int64_t w) {
        std::vector<float> s;
        int64_t begin = 0, end = 0;
        while (queue.take(w, begin, end)) {
          for (int64_t u = begin; u < end; ++u) {
            const Group& g = work[units[u].first];
            const int64_t first = units[u].second;
            const int count = static_cast<int>(std::min<int64_t>(kTile, g.end - first));
            const T* xs[kTile];
            T* ys[kTile];
            for (int j = 0; j < count; ++j) {
              xs[j] = xp + row[first + j] * in;
              ys[j] = yp + row[first + j] * y_stride;
            }
            s.resize(kTile * g.cols);
            switch (count) {
              case 4: tile<T, 4>(xs, ys, ap, bp, in, g.parts, g.first_col, g.cols, s.data()); break;
              case 3: tile<T, 3>(xs, ys, ap, bp, in, g.parts, g.first_col, g.cols, s.data()); break;
              case 2: tile<T, 2>(xs, ys, ap, bp, in, g.parts, g.first_col, g.cols, s.data()); break;
              default: tile<T, 1>(xs, ys, ap, bp, in, g.parts, g.first_col, g.cols, s.data());
            }
          }
        }
      });
}

// y [T, out] += each adapted token's own adapter's products. rows int32 [n]: the adapted
// tokens, grouped by adapter; groups int64 [G, 3]: (adapter, begin, end) of rows; a [C, in]:
// the layer's adapters' A stacked; b: their parts' B blocks, each [cn, o1 - o0] (B
// transposed, scaled), flat; parts int64 [P, 6]: (adapter, c0, cn, o0, o1, offset in b).
void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& rows,
              const at::Tensor& groups, const at::Tensor& a, const at::Tensor& b,
              const at::Tensor& parts) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && y.dim() == 2 && y.stride(1) == 1 &&
                  y.size(0) == x.size(0),
              "lora_add: x must be a contiguous [T, in] matrix and y [T, out] with rows of "
              "unit stride");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == x.scalar_type() &&
                  b.scalar_type() == x.scalar_type(),
              "lora_add: x, y, A and B must share one dtype");
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && a.size(1) == x.size(1) && b.is_contiguous(),
              "lora_add: A must be a contiguous [C, ", x.size(1), "] matrix and B contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kInt && rows.dim() == 1 && rows.is_contiguous() &&
                  groups.scalar_type() == at::kLong && groups.dim() == 2 &&
                  groups.size(1) == 3 && groups.is_contiguous() &&
                  parts.scalar_type() == at::kLong && parts.dim() == 2 &&
                  parts.size(1) == 6 && parts.is_contiguous(),
              "lora_add: rows int32 [n], groups int64 [G, 3], parts int64 [P, 6]");
  if (x.scalar_type() == at::kFloat) {
    lora_add_typed<float>(y, x, rows, groups, a, b, parts);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "lora_add: float32 or bf16, not ",
                x.scalar_type());
    lora_add_typed<c10::BFloat16>(y, x, rows, groups, a, b, parts);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor rows, Tensor groups, Tensor a, Tensor b, "
        "Tensor parts) -> ()");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) { m.impl("lora_add", TORCH_FN(lora_add)); }
