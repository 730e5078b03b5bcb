// LoRA adapters' products for a step whose rows mix adapters, in the executor process:
// torch.ops.llm_cpu.lora_add, which stages/executor/lora.py calls once per adapted projection.
//
// What it adds: y[t] += sum over the parts p of token t's adapter of
//   (x[t] . A[c0_p .. c0_p + r_p)) @ B_p^T  into the part's outputs (Part::at),
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
#include <type_traits>
#include <vector>

#include "bf16_vector.h"  // (LLM_CPU_BF16_VECTOR: AVX512-BF16's pair products)
#include "vector_math.h"
#include "work_queue.h"

namespace {

constexpr int64_t kLanes = 16;  // floats a vector
// Tokens a tile: A and B read once for them. A block of a tile's sums is 8 tokens x 3 vectors
// (24 of the 32 vector registers): 8 or more independent sums even at one vector (a rank-16
// adapter's single part), enough to keep both FMA pipes busy.
constexpr int kTile = 8;
constexpr int kBlock = 3;  // vectors of columns (shrink) or outputs (expand) a block

typedef float Vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint32_t Vu __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t Vh __attribute__((vector_size(kLanes * sizeof(uint16_t))));

inline Vf load(const float* p) {
  Vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline Vf load(const c10::BFloat16* p) { return llm_cpu_vec::widen_lanes<Vf, Vh, Vu>(p); }

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

// One adapter's part: its shrink columns [c0, c0 + cn) feed `width` outputs through the B
// block at b_offset (cn rows of width: B transposed, scaled). Output o is y's column at(o):
// chunks of 16 outputs `stride` columns apart from o0 (16: contiguous; 32: a fused gate/up
// product's gate or up chunks, interleaved with the other's, amx.py interleave_gate_up).
struct Part {
  int64_t c0, cn, o0, width, b_offset, stride;
  int64_t at(int64_t o) const { return o0 + (o / kLanes) * stride + o % kLanes; }
};

// A tile's shrink for V vectors of columns: s[j * width + c] = x[t_j] . A[c] for its N tokens
// and columns [c, c + V * kLanes), from A transposed (`at`: [in, width]). Each sum runs over
// the inputs in order in one lane: N x V sums in registers, and no sum across lanes.
template <typename T, int N, int V>
inline void shrink_block(const T* const* x, const T* at, int64_t in, int64_t width,
                         int64_t c, float* s) {
  Vf acc[N][V] = {};
  for (int64_t i = 0; i < in; ++i) {
    Vf w[V];
    for (int v = 0; v < V; ++v) w[v] = load(at + i * width + c + v * kLanes);
    for (int j = 0; j < N; ++j) {
      const float f = scalar(x[j][i]);
      for (int v = 0; v < V; ++v) acc[j][v] += f * w[v];
    }
  }
  for (int j = 0; j < N; ++j) {
    for (int v = 0; v < V; ++v) std::memcpy(s + j * width + c + v * kLanes, &acc[j][v], sizeof(Vf));
  }
}

template <typename T, int N>
void shrink(const T* const* x, const T* at, int64_t in, int64_t width, float* s) {
  int64_t c = 0;
  for (; c + kBlock * kLanes <= width; c += kBlock * kLanes)
    shrink_block<T, N, kBlock>(x, at, in, width, c, s);
  switch ((width - c) / kLanes) {
    case 2: shrink_block<T, N, 2>(x, at, in, width, c, s); break;
    case 1: shrink_block<T, N, 1>(x, at, in, width, c, s); break;
    default: break;
  }
}

// A tile's expand of V vectors of outputs [o, o + V * kLanes) of one part:
// y[t_j] += s_j[part's columns] @ the part's B there.
template <typename T, int N, int V>
inline void expand_block(T* const* y, const T* b, const Part& part, int64_t o, const float* sp,
                         int64_t s_width) {
  const int64_t width = part.width, cn = part.cn;
  Vf acc[N][V] = {};
  for (int64_t k = 0; k < cn; ++k) {
    Vf w[V];
    for (int v = 0; v < V; ++v) w[v] = load(b + k * width + o + v * kLanes);
    for (int j = 0; j < N; ++j) {
      const float f = sp[j * s_width + k];
      for (int v = 0; v < V; ++v) acc[j][v] += f * w[v];
    }
  }
  for (int j = 0; j < N; ++j) {
    for (int v = 0; v < V; ++v) {
      T* out = y[j] + part.at(o + v * kLanes);
      store(out, load(out) + acc[j][v]);
    }
  }
}

template <typename T, int N>
void expand(T* const* y, const T* b, const Part& part, const float* s, int64_t s_width) {
  const int64_t width = part.width;
  const float* sp = s + part.c0;
  int64_t o = 0;
  for (; o + kBlock * kLanes <= width; o += kBlock * kLanes)
    expand_block<T, N, kBlock>(y, b, part, o, sp, s_width);
  for (; o + kLanes <= width; o += kLanes) expand_block<T, N, 1>(y, b, part, o, sp, s_width);
  for (; o < width; ++o) {
    for (int j = 0; j < N; ++j) {
      float sum = 0.0f;
      for (int64_t k = 0; k < part.cn; ++k) sum += sp[j * s_width + k] * scalar(b[k * width + o]);
      T& out = y[j][part.at(o)];
      out = static_cast<T>(scalar(out) + sum);
    }
  }
}

#if LLM_CPU_BF16_VECTOR
// bf16 on AVX512-BF16: VDPBF16PS multiplies 16 pairs of bf16 by a broadcast pair and adds both
// products into 16 float32 sums, half the instructions of widening each value. A and B are
// then held as pairs along their sums' dimension (`pairs`): A transposed as [ceil(in / 2),
// width, 2], a part's B block as [ceil(cn / 2), its outputs, 2] (an odd count's last pair's
// second value zero), and the shrink's sums rounded to bf16 before the expand (as torch's
// bf16 products round x A^T before multiplying it by B).

// Two bf16 values (the first in the low half, as memory holds a pair) in every 32-bit lane;
// `last_alone`: p[0] is the last value, its pair's other half zero.
template <bool last_alone = false>
inline __m512bh pair_lanes(const c10::BFloat16* p) {
  uint32_t bits;
  if constexpr (last_alone) {
    bits = p[0].x;
  } else {
    std::memcpy(&bits, p, sizeof bits);
  }
  return (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(bits));
}

inline __m512bh load_pairs(const c10::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}

// N x V sums of pair products: acc[j][v] = sum over k < count of src[j][k] * w's row k at
// columns [col + v * 16, col + v * 16 + 16), w held as pairs ([count / 2, width, 2]).
template <int N, int V>
inline void pair_sums(__m512 (&acc)[N][V], const c10::BFloat16* w, int64_t width, int64_t col,
                      const c10::BFloat16* const* src, int64_t count) {
  for (int j = 0; j < N; ++j)
    for (int v = 0; v < V; ++v) acc[j][v] = _mm512_setzero_ps();
  const auto step = [&]<bool last_alone>(int64_t k) {
    __m512bh pairs[V];
    for (int v = 0; v < V; ++v)
      pairs[v] = load_pairs(w + ((k / 2) * width + col + v * kLanes) * 2);
    for (int j = 0; j < N; ++j) {
      const __m512bh values = pair_lanes<last_alone>(src[j] + k);
      for (int v = 0; v < V; ++v) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], pairs[v], values);
    }
  };
  int64_t k = 0;
  for (; k + 2 <= count; k += 2) step.template operator()<false>(k);
  if (k < count) step.template operator()<true>(k);
}

template <int N, int V>
inline void shrink_pairs_block(const c10::BFloat16* const* x, const c10::BFloat16* at,
                               int64_t in, int64_t width, int64_t c, float* s) {
  __m512 acc[N][V];
  pair_sums<N, V>(acc, at, width, c, x, in);
  for (int j = 0; j < N; ++j)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(s + j * width + c + v * kLanes, acc[j][v]);
}

template <int N>
void shrink_pairs(const c10::BFloat16* const* x, const c10::BFloat16* at, int64_t in,
                  int64_t width, float* s) {
  int64_t c = 0;
  for (; c + kBlock * kLanes <= width; c += kBlock * kLanes)
    shrink_pairs_block<N, kBlock>(x, at, in, width, c, s);
  switch ((width - c) / kLanes) {
    case 2: shrink_pairs_block<N, 2>(x, at, in, width, c, s); break;
    case 1: shrink_pairs_block<N, 1>(x, at, in, width, c, s); break;
    default: break;
  }
}

// sp: token j's shrink, rounded to bf16, at sp + j * s_width (the part's first column).
template <int N, int V>
inline void expand_pairs_block(c10::BFloat16* const* y, const c10::BFloat16* b,
                               const Part& part, int64_t o, const c10::BFloat16* sp,
                               int64_t s_width) {
  const c10::BFloat16* src[N];
  for (int j = 0; j < N; ++j) src[j] = sp + j * s_width;
  __m512 acc[N][V];
  pair_sums<N, V>(acc, b, part.width, o, src, part.cn);
  for (int j = 0; j < N; ++j) {
    for (int v = 0; v < V; ++v) {  // (VCVTNEPS2BF16: to nearest even in one instruction)
      c10::BFloat16* out = y[j] + part.at(o + v * kLanes);
      const __m512 sum = _mm512_add_ps((__m512)load(out), acc[j][v]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}

template <int N>
void expand_pairs(c10::BFloat16* const* y, const c10::BFloat16* b, const Part& part,
                  const c10::BFloat16* s, int64_t s_width) {
  const int64_t width = part.width;
  const c10::BFloat16* sp = s + part.c0;
  int64_t o = 0;
  for (; o + kBlock * kLanes <= width; o += kBlock * kLanes)
    expand_pairs_block<N, kBlock>(y, b, part, o, sp, s_width);
  for (; o + kLanes <= width; o += kLanes) expand_pairs_block<N, 1>(y, b, part, o, sp, s_width);
  for (; o < width; ++o) {
    for (int j = 0; j < N; ++j) {
      float sum = 0.0f;
      for (int64_t k = 0; k < part.cn; ++k) {
        sum += static_cast<float>(sp[j * s_width + k]) *
               static_cast<float>(b[((k / 2) * width + o) * 2 + k % 2]);
      }
      c10::BFloat16& out = y[j][part.at(o)];
      out = c10::BFloat16(static_cast<float>(out) + sum);
    }
  }
}
#endif  // LLM_CPU_BF16_VECTOR

bool lora_bf16_pairs() { return LLM_CPU_BF16_VECTOR; }

// A step's adapter: its tokens (rows [begin, end)), its A transposed (at + a_offset, [in,
// width]) and its parts.
struct Group {
  std::vector<Part> parts;
  int64_t a_offset = 0, width = 0, begin = 0, end = 0;
};

template <typename T, int N>
void tile(const T* const* x, T* const* y, const T* a, const T* b, int64_t in, const Group& g,
          bool pairs, float* s, c10::BFloat16* rounded) {
#if LLM_CPU_BF16_VECTOR
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (pairs) {
      shrink_pairs<N>(x, a + g.a_offset, in, g.width, s);
      for (int64_t i = 0; i < N * g.width; i += kLanes) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(rounded + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + i)));
      }
      for (const Part& part : g.parts)
        expand_pairs<N>(y, b + part.b_offset, part, rounded, g.width);
      return;
    }
  }
#endif
  shrink<T, N>(x, a + g.a_offset, in, g.width, s);
  for (const Part& part : g.parts) expand<T, N>(y, b + part.b_offset, part, s, g.width);
}

template <typename T>
void lora_add_typed(at::Tensor& y, const at::Tensor& x, const at::Tensor& rows,
                    const at::Tensor& groups, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& parts, bool pairs) {
  const int64_t in = x.size(1), out = y.size(1);
  const int32_t* row = rows.data_ptr<int32_t>();
  const int64_t* group = groups.data_ptr<int64_t>();
  const int64_t* part = parts.data_ptr<int64_t>();
  std::vector<Group> work;
  std::vector<std::pair<int64_t, int64_t>> units;  // (group, first row of its tile)
  for (int64_t g = 0; g < groups.size(0); ++g) {
    Group entry;
    for (int64_t p = 0; p < parts.size(0); ++p) {
      // (adapter, a_offset, a_width, c0, cn, o0, width, b_offset, stride)
      const int64_t* q = part + p * 9;
      if (q[0] != group[g * 3]) continue;
      if (entry.parts.empty()) {
        entry.a_offset = q[1];
        entry.width = q[2];
      }
      const int64_t in_held = pairs ? (in + 1) / 2 * 2 : in;  // (pairs: an odd one padded)
      const int64_t cn_held = pairs ? (q[4] + 1) / 2 * 2 : q[4];
      TORCH_CHECK(q[1] == entry.a_offset && q[2] == entry.width && q[2] > 0 &&
                      q[2] % kLanes == 0 && q[1] >= 0 && q[1] + in_held * q[2] <= a.numel(),
                  "lora_add: part ", p, ": its adapter's A^T lies outside a, or its "
                  "width is not a multiple of ", kLanes);
      const Part piece{q[3], q[4], q[5], q[6], q[7], q[8]};
      TORCH_CHECK(piece.stride >= kLanes && (piece.stride == kLanes || piece.width % kLanes == 0),
                  "lora_add: part ", p, ": chunks of 16 outputs ", piece.stride,
                  " columns apart, or a width of ", piece.width, " not in whole chunks");
      TORCH_CHECK(piece.c0 >= 0 && piece.cn > 0 && piece.c0 + piece.cn <= q[2] &&
                      piece.o0 >= 0 && piece.width > 0 && piece.at(piece.width - 1) < out &&
                      piece.b_offset >= 0 && piece.b_offset + cn_held * piece.width <= b.numel(),
                  "lora_add: part ", p, " lies outside its adapter's columns, y or b");
      entry.parts.push_back(piece);
    }
    if (entry.parts.empty()) continue;  // (this adapter does not target this projection)
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
        std::vector<c10::BFloat16> rounded;  // (pairs: the shrink's sums in bf16)
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
            s.resize(kTile * g.width);
            rounded.resize(pairs ? kTile * g.width : 0);
            float* sd = s.data();
            c10::BFloat16* rd = rounded.data();
            switch (count) {
              case 8: tile<T, 8>(xs, ys, ap, bp, in, g, pairs, sd, rd); break;
              case 7: tile<T, 7>(xs, ys, ap, bp, in, g, pairs, sd, rd); break;
              case 6: tile<T, 6>(xs, ys, ap, bp, in, g, pairs, sd, rd); break;
              case 5: tile<T, 5>(xs, ys, ap, bp, in, g, pairs, sd, rd); break;
              case 4: tile<T, 4>(xs, ys, ap, bp, in, g, pairs, sd, rd); break;
              case 3: tile<T, 3>(xs, ys, ap, bp, in, g, pairs, sd, rd); break;
              case 2: tile<T, 2>(xs, ys, ap, bp, in, g, pairs, sd, rd); break;
              default: tile<T, 1>(xs, ys, ap, bp, in, g, pairs, sd, rd);
            }
          }
        }
      });
}

// y [T, out] += each adapted token's own adapter's products. rows int32 [n]: the adapted
// tokens, grouped by adapter; groups int64 [G, 3]: (adapter, begin, end) of rows; a: each
// adapter's A transposed, [in, width] (width its columns rounded up to a multiple of 16,
// zeros past them), flat; b: the parts' B blocks, each [cn, width] (B transposed, scaled),
// flat; parts int64 [P, 9]: (adapter, its A^T's offset in a, its width, c0, cn, o0, the
// part's outputs, offset in b, its chunks' stride: Part). pairs: bf16 held as pairs (above; lora_bf16_pairs() says whether this build
// has them).
void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& rows,
              const at::Tensor& groups, const at::Tensor& a, const at::Tensor& b,
              const at::Tensor& parts, bool pairs) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && y.dim() == 2 && y.stride(1) == 1 &&
                  y.size(0) == x.size(0),
              "lora_add: x must be a contiguous [T, in] matrix and y [T, out] with rows of "
              "unit stride");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == x.scalar_type() &&
                  b.scalar_type() == x.scalar_type(),
              "lora_add: x, y, A and B must share one dtype");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "lora_add: a and b must be contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kInt && rows.dim() == 1 && rows.is_contiguous() &&
                  groups.scalar_type() == at::kLong && groups.dim() == 2 &&
                  groups.size(1) == 3 && groups.is_contiguous() &&
                  parts.scalar_type() == at::kLong && parts.dim() == 2 &&
                  parts.size(1) == 9 && parts.is_contiguous(),
              "lora_add: rows int32 [n], groups int64 [G, 3], parts int64 [P, 9]");
  TORCH_CHECK(!pairs || (x.scalar_type() == at::kBFloat16 && lora_bf16_pairs()),
              "lora_add: pairs are bf16's, on a CPU with AVX512-BF16");
  if (x.scalar_type() == at::kFloat) {
    lora_add_typed<float>(y, x, rows, groups, a, b, parts, false);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "lora_add: float32 or bf16, not ",
                x.scalar_type());
    lora_add_typed<c10::BFloat16>(y, x, rows, groups, a, b, parts, pairs);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("lora_bf16_pairs() -> bool", &lora_bf16_pairs);
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor rows, Tensor groups, Tensor a, Tensor b, "
        "Tensor parts, bool pairs=False) -> ()");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) { m.impl("lora_add", TORCH_FN(lora_add)); }
