// CPU kernels of the eager forward: attention over the paged KV cache in place, and the
// elementwise work around the matrix products (RMSNorm with the residual add, SiLU- and
// gelu-tanh-and-mul).
// Built once per machine by stages/executor/kernels.py (g++ -O3 -march=native, torch's
// headers and its OpenMP runtime) and registered as torch.ops.llm_cpu.*.
//
// Attention (`paged_attention`): one call per layer over the whole flattened batch. Each
// token t of slot s at position p attends to keys lo..p of its own sequence (lo = 0, or
// p - window + 1 with a sliding window), read from block block_table[s][j / BS] at offset
// j % BS of the cache [2, NB, BS, KVH, D]. The call first rotates (rope) this step's keys and
// writes them and the values into the cache, then rotates the queries. Queries are grouped
// into tiles of consecutive positions of one sequence; a work item is a tile (a decode in a
// step of few: one a KV head, and one a part of a long context's keys: kPartitionKeys), whose
// query heads share every key read (in bf16 or fp16 a page's keys and values of the
// head are widened to float once for its query heads: at batch 64 in bf16 the conversions
// per head had made attention 1.7 ms a layer against float32's 1.2). Softmax is online (a
// running max and sum per row), in float32, a page of keys at a time. Nothing is gathered or
// padded: decodes of any lengths and prompt chunks with or without past go through the same
// kernel. A tile of a prompt (kMatrixRows rows or more a KV head) takes the matrix form: its
// rows lie along 16 vector lanes and every product is a sum of outer products (a vector of
// rows times a broadcast key or value element), where a decode's few rows take the vector
// loop, one row's dot products at a time. The prefill of 16 prompts of 128 tokens (the
// default model's heads): 4.4 -> 3.0 ms a layer in bf16, 4.4 -> 2.5 in float32. In bf16 on
// a CPU with AMX, a decode scores its group's heads against 16 keys at a time as one tile
// product (tile_keys), and the matrix form's two products are tile products (3c), keys and
// values read from the cache in place; queries and weights go into them rounded to bf16.
// With a softcap (Gemma 2), every path's scores go through softcap * tanh(score / softcap)
// before the max and the softmax (softmax_page, chunk_softmax).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "kv_formats.h"
#include "vector_math.h"
#include "work_queue.h"

namespace {

using llm_cpu_vec::exp_lanes;

// ---------------------------------------------------------------- element types

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e4m3fn x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e5m2 x) { return static_cast<float>(x); }

template <typename T> inline T from_float(float f);
template <> inline float from_float<float>(float f) { return f; }
template <> inline c10::BFloat16 from_float<c10::BFloat16>(float f) {
  return c10::BFloat16(f);  // round to nearest even, NaN kept
}
template <> inline c10::Half from_float<c10::Half>(float f) { return c10::Half(f); }

// ---------------------------------------------------------------- vectors of 8 floats

// GCC vector extensions: AVX registers where the CPU has them, pairs of SSE ones otherwise.
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// N bf16 or fp16 values widened to a vector of N floats (VF; VU16, VU32: N lanes of 16 and
// 32 bits): bf16's bits shifted into place (vector_math.h), fp16 lane by lane.
using llm_cpu_vec::widen_lanes;
template <typename VF, typename VU16, typename VU32>
inline VF widen_lanes(const c10::Half* p) {
  VF v;
  for (int i = 0; i < static_cast<int>(sizeof(VF) / sizeof(float)); ++i) {
    v[i] = static_cast<float>(p[i]);
  }
  return v;
}
// fp8 (an 8-bit KV cache: kv_formats.h), read in place as bf16 is: through fp16, which the CPU
// widens in one instruction (F16C's vcvtph2ps). e5m2 is fp16's upper byte; e4m3's magnitude
// bits shifted into fp16's place read 2^-8 of its value, subnormals included (fp16 has 5
// exponent bits to e4m3's 4), then scaled back. (Bit work on 32-bit lanes instead,
// fp8_lanes, had a bf16 cache's decode at 2x the time of bf16's.)
template <typename VF, typename VU16, bool kE4M3>
inline VF widen_fp8_lanes(const uint8_t* p) {
  constexpr int n = sizeof(VF) / sizeof(float);
  typedef uint8_t VU8 __attribute__((vector_size(n)));
  VU8 codes;
  std::memcpy(&codes, p, sizeof codes);
  const VU16 b = __builtin_convertvector(codes, VU16);
  const VU16 half = kE4M3 ? static_cast<VU16>(((b & 0x7F) << 7) | ((b & 0x80) << 8))
                          : static_cast<VU16>(b << 8);
  VF out;
  if constexpr (n == 16) {
    __m256i h;
    std::memcpy(&h, &half, sizeof h);
    const __m512 f = _mm512_cvtph_ps(h);
    std::memcpy(&out, &f, sizeof out);
  } else {
    __m128i h;
    std::memcpy(&h, &half, sizeof h);
    const __m256 f = _mm256_cvtph_ps(h);
    std::memcpy(&out, &f, sizeof out);
  }
  return kE4M3 ? out * 256.0f : out;
}
#if defined(__AVX512F__) && defined(__F16C__)
template <typename VF, typename VU16, typename VU32>
inline VF widen_lanes(const c10::Float8_e4m3fn* p) {
  return widen_fp8_lanes<VF, VU16, true>(reinterpret_cast<const uint8_t*>(p));
}
template <typename VF, typename VU16, typename VU32>
inline VF widen_lanes(const c10::Float8_e5m2* p) {
  return widen_fp8_lanes<VF, VU16, false>(reinterpret_cast<const uint8_t*>(p));
}
#else
template <typename VF, typename VU16, typename VU32>
inline VF widen_lanes(const c10::Float8_e4m3fn* p) {
  return llm_cpu_kv::widen_fp8<VF, VU32, 3, 120>(reinterpret_cast<const uint8_t*>(p));
}
template <typename VF, typename VU16, typename VU32>
inline VF widen_lanes(const c10::Float8_e5m2* p) {
  return llm_cpu_kv::widen_fp8<VF, VU32, 2, 112>(reinterpret_cast<const uint8_t*>(p));
}
#endif
template <typename T>
inline v8f load8(const T* p) { return widen_lanes<v8f, v8u16, v8u32>(p); }

const v8i kLanes = {0, 1, 2, 3, 4, 5, 6, 7};

inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }

inline v8f exp8(v8f x) { return exp_lanes<v8f, v8i>(x); }

inline float exp_clamped(float x) { return exp8(v8f{} + x)[0]; }

inline float sum8(v8f v) {
  float total = 0.0f;
  for (int i = 0; i < 8; ++i) total += v[i];
  return total;
}

// Sums of 8 vectors: lane l of the result is the sum of v[l]'s lanes.
inline v8f sum8x8(const v8f* v) {
#ifdef __AVX__
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  return _mm256_permute2f128_ps(ab, cd, 0x20) + _mm256_permute2f128_ps(ab, cd, 0x31);
#else
  v8f out;
  for (int l = 0; l < 8; ++l) out[l] = sum8(v[l]);
  return out;
#endif
}

// Whether the head size takes the vector paths: a constant multiple of 32, at most 128 (its
// accumulators stay in registers).
template <int64_t kD>
constexpr bool kVectorHead = kD > 0 && kD % 32 == 0 && kD <= 128;

// q . k as 8 partial sums (four independent accumulators: one chain of d / 8 dependent
// multiply-adds would bound the loop by their latency, not by the loads).
template <int64_t kD, typename T>
inline v8f dot_parts(const float* q, const T* k) {
  v8f a0 = {}, a1 = {}, a2 = {}, a3 = {};
  for (int64_t e = 0; e < kD; e += 32) {
    a0 += load8(q + e) * load8(k + e);
    a1 += load8(q + e + 8) * load8(k + e + 8);
    a2 += load8(q + e + 16) * load8(k + e + 16);
    a3 += load8(q + e + 24) * load8(k + e + 24);
  }
  return (a0 + a1) + (a2 + a3);
}

// scores[j] = q . k_j for j in [j_lo, j_hi); returns max(top, the scores).
template <int64_t kD, typename T>
inline float page_scores(const float* q, const T* k, int64_t stride, int64_t d, int64_t j_lo,
                         int64_t j_hi, float top, float* scores) {
  if constexpr (kVectorHead<kD>) {
    v8f best = v8f{} + top;
    for (int64_t j0 = j_lo; j0 < j_hi; j0 += 8) {  // 8 keys, then one transposed reduction
      v8f parts[8];
      for (int64_t l = 0; l < 8; ++l) {
        parts[l] = j0 + l < j_hi ? dot_parts<kD>(q, k + (j0 + l) * stride) : v8f{};
      }
      const v8f sums = sum8x8(parts);
      store8(scores + j0, sums);
      const auto valid = (kLanes + static_cast<int32_t>(j0)) < static_cast<int32_t>(j_hi);
      best = (valid & (sums > best)) ? sums : best;
    }
    for (int l = 0; l < 8; ++l) top = std::max(top, best[l]);
  } else {
    for (int64_t j = j_lo; j < j_hi; ++j) {
      const T* kj = k + j * stride;
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t e = 0; e < d; ++e) total += q[e] * to_float(kj[e]);
      scores[j] = total;
      top = std::max(top, total);
    }
  }
  return top;
}

// acc = acc * correction + sum over j of weights[j] * v_j.
template <int64_t kD, typename T>
inline void page_values(float* acc, float correction, const T* v, int64_t stride, int64_t d,
                        int64_t j_lo, int64_t j_hi, const float* weights) {
  if constexpr (kVectorHead<kD>) {
    v8f a[kD / 8];
    for (int64_t c = 0; c < kD / 8; ++c) a[c] = load8(acc + 8 * c) * correction;
    for (int64_t j = j_lo; j < j_hi; ++j) {
      const v8f w = v8f{} + weights[j];
      const T* vj = v + j * stride;
      for (int64_t c = 0; c < kD / 8; ++c) a[c] += w * load8(vj + 8 * c);
    }
    for (int64_t c = 0; c < kD / 8; ++c) store8(acc + 8 * c, a[c]);
  } else {
    if (correction != 1.0f) {
#pragma omp simd
      for (int64_t e = 0; e < d; ++e) acc[e] *= correction;
    }
    for (int64_t j = j_lo; j < j_hi; ++j) {
      const T* vj = v + j * stride;
      const float w = weights[j];
#pragma omp simd
      for (int64_t e = 0; e < d; ++e) acc[e] += w * to_float(vj[e]);
    }
  }
}

// Scores through softcap * tanh(score / softcap) (Gemma 2's attention logit softcapping,
// before the max and the softmax as in transformers' eager attention); softcap 0: none.
inline float softcap_score(float score, float softcap) {
  return softcap * std::tanh(score / softcap);
}

// A decode's scores buffer: a page's scores and spare entries past them, so that a page's last
// keys are read and written 16 lanes at a time whatever the page's size.
constexpr int64_t kScorePad = 16;

// One row's online-softmax step over a page's scores [j_lo, j_hi) whose maximum with the
// row's running one is `top`: scores become exp(score - top), 8 keys at a time (scores has
// kScorePad spare entries past a page), the running max and sum move on; returns the
// correction that rescales what the row accumulated before this page. With a softcap the
// scores are capped here first and `top` found again (the callers' maximum is of the raw
// scores).
inline float softmax_page(float* scores, int64_t j_lo, int64_t j_hi, float top, float& row_max,
                          float& row_sum, float softcap) {
  if (softcap > 0.0f) {
    top = row_max;
    for (int64_t j = j_lo; j < j_hi; ++j) {
      scores[j] = softcap_score(scores[j], softcap);
      top = std::max(top, scores[j]);
    }
  }
  const float correction = row_max == -INFINITY ? 0.0f : exp_clamped(row_max - top);
  v8f sums = {};
  for (int64_t j = j_lo; j < j_hi; j += 8) {
    const v8f e = exp8(load8(scores + j) - top);
    const v8f kept = (kLanes + static_cast<int32_t>(j)) < static_cast<int32_t>(j_hi) ? e : v8f{};
    store8(scores + j, kept);
    sums += kept;
  }
  row_max = top;
  row_sum = row_sum * correction + sum8(sums);
  return correction;
}

// ---------------------------------------------------------------- vectors of 16 floats

// A prompt tile's rows (its tokens x a KV head's query heads) lie along the 16 lanes: scores,
// softmax statistics and outputs are then vectors of rows, and q . k and p . v become sums of
// outer products (a vector of rows times a broadcast key or value element), with no
// horizontal reductions. AVX-512 registers where the CPU has them, pairs or quads otherwise.
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }

typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));

template <typename T>
inline v16f load16(const T* p) { return widen_lanes<v16f, v16u16, v16u32>(p); }

// bf16's bits of 16 floats, rounded to nearest even with NaN made 0x7FC0: c10::BFloat16(float)
// lane by lane.
inline v16u32 bf16_bits(v16f v) {
  v16u32 bits;
  std::memcpy(&bits, &v, sizeof bits);
  const v16u32 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return v != v ? v16u32{} + 0x7FC0u : rounded;
}
inline void store16(c10::BFloat16* p, v16f v) {
  const v16u16 out = __builtin_convertvector(bf16_bits(v), v16u16);
  std::memcpy(p, &out, sizeof out);
}
inline void store16(c10::Half* p, v16f v) {
  for (int i = 0; i < 16; ++i) p[i] = c10::Half(v[i]);
}

// v rounded to T and widened back: to_float(from_float<T>(x)) lane by lane.
template <typename T> inline v16f round16(v16f v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const v16u32 bits = bf16_bits(v) << 16;
    v16f out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
  } else {
    for (int i = 0; i < 16; ++i) v[i] = to_float(from_float<T>(v[i]));
    return v;
  }
}

inline v16f exp16(v16f x) { return exp_lanes<v16f, v16i>(x); }

const v16i kLanes16 = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

inline float sum16(v16f v) {
  return sum8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

// to[e] = T(from[e] * scale) for e < d, 16 at a time (store16 rounds as from_float<T>).
template <typename T>
inline void store_row(const float* from, float scale, int64_t d, T* to) {
  int64_t e = 0;
  for (; e + 16 <= d; e += 16) store16(to + e, load16(from + e) * scale);
  for (; e < d; ++e) to[e] = from_float<T>(from[e] * scale);
}

// A 16 x 16 block of floats transposed in registers (r[i][c] -> r[c][i]): four stages, each
// swapping the off-diagonal h x h blocks of every 2h x 2h block (h = 8, 4, 2, 1), one
// two-source shuffle a row each. (Scalar loops that moved the prompt tiles' queries into
// lanes and their outputs back were a quarter of a bf16 prompt's attention.)
template <int kHalf, int... I>
inline v16f keep_low(v16f a, v16f b, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(a, b, ((I & kHalf) ? I - kHalf + 16 : I)...);
}
template <int kHalf, int... I>
inline v16f keep_high(v16f a, v16f b, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(a, b, ((I & kHalf) ? I + 16 : I + kHalf)...);
}
template <int kHalf>
inline void transpose_stage(v16f* r) {
  constexpr auto lanes = std::make_integer_sequence<int, 16>{};
  for (int i = 0; i < 16; ++i) {
    if (i & kHalf) continue;
    const v16f a = r[i], b = r[i + kHalf];
    r[i] = keep_low<kHalf>(a, b, lanes);
    r[i + kHalf] = keep_high<kHalf>(a, b, lanes);
  }
}
inline void transpose16(v16f* r) {
  transpose_stage<8>(r);
  transpose_stage<4>(r);
  transpose_stage<2>(r);
  transpose_stage<1>(r);
}

constexpr int64_t kChunk = 16;  // keys scored at once (a page of the default block size)

// s[j] = the 16 rows' queries (qt: [d][16], row r in lane r) . key j, for 16 keys.
template <int64_t kD>
inline void chunk_scores(const float* qt, const float* keys, int64_t d, v16f* s) {
  v16f acc[kChunk] = {};
  const int64_t dims = kD > 0 ? kD : d, stride = dims;
  for (int64_t e = 0; e < dims; ++e) {
    const v16f qe = load16(qt + e * 16);
#pragma GCC unroll 16
    for (int64_t j = 0; j < kChunk; ++j) acc[j] += qe * keys[j * stride + e];
  }
  for (int64_t j = 0; j < kChunk; ++j) s[j] = acc[j];
}

// ot[e] = ot[e] * correction + sum over j < n of p[j] * v_j[e], for every dim e (ot: [d][16]).
template <int64_t kD>
inline void chunk_values(float* ot, v16f correction, const v16f* p, const float* values,
                         int64_t d, int64_t n) {
  const int64_t dims = kD > 0 ? kD : d, stride = dims;
  int64_t e = 0;
  for (; e + 16 <= dims; e += 16) {
    v16f acc[16];
#pragma GCC unroll 16
    for (int64_t c = 0; c < 16; ++c) acc[c] = load16(ot + (e + c) * 16) * correction;
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = values + j * stride + e;
#pragma GCC unroll 16
      for (int64_t c = 0; c < 16; ++c) acc[c] += p[j] * vj[c];
    }
#pragma GCC unroll 16
    for (int64_t c = 0; c < 16; ++c) store16(ot + (e + c) * 16, acc[c]);
  }
  for (; e < dims; ++e) {
    v16f acc = load16(ot + e * 16) * correction;
    for (int64_t j = 0; j < n; ++j) acc += p[j] * values[j * stride + e];
    store16(ot + e * 16, acc);
  }
}

// The online-softmax step of 16 rows (lanes) over a chunk's scores s[j] (key key0 + j; the
// first n exist): keys a row does not see (past its position, before its window's start,
// missing) weigh nothing; s[j] become exp(s[j] - the new running max), the running max and
// sum move on; returns the correction that rescales what the rows accumulated before.
inline v16f chunk_softmax(v16f* s, int64_t n, int64_t key0, v16i row_pos, v16i row_lo,
                          v16f& row_max, v16f& row_sum, float softcap) {
  const v16f minus_inf = v16f{} - INFINITY;
  v16f top = row_max;
  if (softcap > 0.0f) {  // (before the masking: lanes it hides weigh nothing either way)
    for (int64_t j = 0; j < kChunk; ++j) {
      for (int l = 0; l < 16; ++l) s[j][l] = softcap_score(s[j][l], softcap);
    }
  }
  for (int64_t j = 0; j < kChunk; ++j) {
    const v16i key = v16i{} + static_cast<int32_t>(key0 + j);
    const v16i seen = (key <= row_pos) & (key >= row_lo) & (v16i{} + (j < n ? -1 : 0));
    s[j] = seen ? s[j] : minus_inf;
    top = top > s[j] ? top : s[j];
  }
  const v16f base = top == minus_inf ? v16f{} : top;  // lanes with no key yet: 0
  // (where row_max is -inf its state is all zeros: any correction keeps it so)
  const v16f correction = exp16(row_max - base);
  v16f total = {};
  for (int64_t j = 0; j < kChunk; ++j) {
    s[j] = s[j] == minus_inf ? v16f{} : exp16(s[j] - base);
    total += s[j];
  }
  row_max = top;
  row_sum = row_sum * correction + total;
  return correction;
}

// ---------------------------------------------------------------- attention

// Attention sinks (gpt-oss): head h's learned logit joins each softmax's denominator and
// weighs no value. A row's online softmax starts as if it had seen one key of score
// sinks[h] and value 0: running max sinks[h], sum exp(0) = 1. Every path's later maxima then
// include the sink (the scores' exponentials never overflow past it), and the sink's
// exp(sink - max) is rescaled with the sum like any key's. Row r = i * heads + h.
inline void start_with_sinks(const float* sinks, int64_t heads, int64_t rows, float* row_max,
                             float* row_sum) {
  for (int64_t r = 0; r < rows; ++r) {
    row_max[r] = sinks[r % heads];
    row_sum[r] = 1.0f;
  }
}

// rows x d values at `stride` apart, as contiguous float rows.
template <typename T>
inline void widen_rows(const T* src, int64_t stride, int64_t d, int64_t rows, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* from = src + r * stride;
    float* to = dst + r * d;
    int64_t e = 0;
    for (; e + 8 <= d; e += 8) store8(to + e, load8(from + e));
    for (; e < d; ++e) to[e] = to_float(from[e]);
  }
}

// A page's keys and values of one KV head into L2 (offset: the head's first element in a
// key; d its elements), or of all (prefetch_page). Pages of a sequence lie anywhere in the
// cache, so the hardware's stream prefetch cannot see the next one coming. Fetching page
// j + 1 while page j runs took the attention of 64 float32 sequences (128-token prompts, 64
// tokens out, the default model) from 3.05 to 2.59 s, decode steps 4% faster overall.
template <typename T>
inline void prefetch_head(const T* k_cache, const T* v_cache, int64_t block, int64_t block_size,
                          int64_t kv_stride, int64_t offset, int64_t d) {
  const int64_t bytes = d * static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < block_size; ++j) {
    const char* k = reinterpret_cast<const char*>(k_cache + (block * block_size + j) * kv_stride +
                                                  offset);
    const char* v = reinterpret_cast<const char*>(v_cache + (block * block_size + j) * kv_stride +
                                                  offset);
    for (int64_t line = 0; line < bytes; line += 64) {
      __builtin_prefetch(k + line, 0, 2);  // (locality 2: L2, as _MM_HINT_T1)
      __builtin_prefetch(v + line, 0, 2);
    }
  }
}
template <typename T>
inline void prefetch_page(const T* k_cache, const T* v_cache, int64_t block, int64_t block_size,
                          int64_t kv_stride) {
  prefetch_head(k_cache, v_cache, block, block_size, kv_stride, 0, kv_stride);  // every head
}

// bf16 in pairs: 32 bf16 values read as 16 lanes of 32 bits hold the even elements in their
// low halves and the odd ones in their high halves, so a shift and a mask make them two
// vectors of floats (elements 0, 2, .., 30 and 1, 3, .., 31) with no shuffle, where widening
// 16 values at a time costs a lane-crossing shuffle each (one port) and twice the loads.
inline void split_pairs(const c10::BFloat16* p, v16f& even, v16f& odd) {
  v16u32 bits;
  std::memcpy(&bits, p, sizeof bits);
  const v16u32 low = bits << 16, high = bits & 0xFFFF0000u;
  std::memcpy(&even, &low, sizeof even);
  std::memcpy(&odd, &high, sizeof odd);
}
// 32 floats as the same two vectors, and back.
inline void split_floats(const float* p, v16f& even, v16f& odd) {
  const v16f a = load16(p), b = load16(p + 16);
  even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
inline void join_floats(v16f even, v16f odd, float* p) {
  store16(p, __builtin_shufflevector(even, odd, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22,
                                     7, 23));
  store16(p + 16, __builtin_shufflevector(even, odd, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29,
                                          14, 30, 15, 31));
}

// The online-softmax step of a decode's kG heads over a page's scores (each head's row of
// `scores`, kScorePad spare entries past a page), whose 8-lane running maxima are best[r]:
// their corrections. softmax_page's steps, with no softcap on 16 lanes at a time and the heads'
// corrections in one exp (a fourth of a bf16 decode's attention had been softmax_page's 8-lane
// exps, three a page and head).
template <int kG>
inline void group_softmax(const v8f (&best)[kG], float* scores, int64_t score_stride,
                          int64_t j_lo, int64_t j_hi, float* row_max, float* row_sum,
                          float softcap, float (&correction)[kG]) {
  static_assert(kG <= 16);
  v16f top = {}, before = {};
  for (int r = 0; r < kG; ++r) {
    float t = row_max[r];
    for (int l = 0; l < 8; ++l) t = std::max(t, best[r][l]);
    top[r] = t;
    before[r] = row_max[r];
  }
  if (softcap > 0.0f) {  // (softmax_page caps the scores, then finds its top again)
    for (int r = 0; r < kG; ++r) {
      correction[r] = softmax_page(scores + r * score_stride, j_lo, j_hi, top[r], row_max[r],
                                   row_sum[r], softcap);
    }
    return;
  }
  const v16f scaled = exp16(before - top);
  const v16f corr = before == v16f{} - INFINITY ? v16f{} : scaled;
  for (int r = 0; r < kG; ++r) {
    float* sr = scores + r * score_stride;
    v16f sums = {};
    for (int64_t j = j_lo; j < j_hi; j += 16) {
      const v16f e = exp16(load16(sr + j) - top[r]);
      const v16f kept = (kLanes16 + static_cast<int32_t>(j)) < static_cast<int32_t>(j_hi)
                            ? e : v16f{};
      store16(sr + j, kept);
      sums += kept;
    }
    correction[r] = corr[r];
    row_max[r] = top[r];
    row_sum[r] = row_sum[r] * corr[r] + sum16(sums);
  }
}

// The dot products of the group's queries with keys [j0, j0 + 8) (fewer at the page's end),
// each head's 8 sums in parts[r][l] as 8 partial sums.
template <int64_t kD, int kG, typename T>
inline void group_scores(const float* q, const T* k, int64_t stride, int64_t j0, int64_t j_hi,
                         v8f (&parts)[kG][8]) {
  for (int64_t l = 0; l < 8; ++l) {
    if (j0 + l >= j_hi) {
      for (int r = 0; r < kG; ++r) parts[r][l] = v8f{};
      continue;
    }
    const T* kj = k + (j0 + l) * stride;
    v16f a[kG];
    if constexpr (std::is_same_v<T, c10::BFloat16>) {  // q: split in pairs (split_floats)
      v16f ke[kD / 32], ko[kD / 32];
      for (int64_t c = 0; c < kD / 32; ++c) split_pairs(kj + 32 * c, ke[c], ko[c]);
      for (int r = 0; r < kG; ++r) {
        const float* qr = q + r * kD;
        v16f a0 = {}, a1 = {};
        for (int64_t c = 0; c < kD / 32; ++c) {
          a0 += load16(qr + 32 * c) * ke[c];
          a1 += load16(qr + 32 * c + 16) * ko[c];
        }
        a[r] = a0 + a1;
      }
    } else {
      v16f kk[kD / 16];
      for (int64_t c = 0; c < kD / 16; ++c) kk[c] = load16(kj + 16 * c);
      for (int r = 0; r < kG; ++r) {
        const float* qr = q + r * kD;
        v16f a0 = {}, a1 = {};
        for (int64_t c = 0; c < kD / 16; c += 2) {
          a0 += load16(qr + 16 * c) * kk[c];
          a1 += load16(qr + 16 * (c + 1)) * kk[c + 1];
        }
        a[r] = a0 + a1;
      }
    }
    for (int r = 0; r < kG; ++r) {
      parts[r][l] = __builtin_shufflevector(a[r], a[r], 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(a[r], a[r], 8, 9, 10, 11, 12, 13, 14, 15);
    }
  }
}

// acc[r] = acc[r] * correction[r] + sum over j of scores[r][j] * v_j, for the group's heads.
template <int64_t kD, int kG, typename T>
inline void group_values(float* acc, const float* correction, const T* v, int64_t stride,
                         int64_t j_lo, int64_t j_hi, const float* scores, int64_t score_stride) {
  constexpr int64_t kParts = kD / 16;
  v16f a[kG][kParts];
  if constexpr (std::is_same_v<T, c10::BFloat16>) {  // a[r][2c], a[r][2c + 1]: even, odd
    for (int r = 0; r < kG; ++r) {
      for (int64_t c = 0; c < kD / 32; ++c) {
        split_floats(acc + r * kD + 32 * c, a[r][2 * c], a[r][2 * c + 1]);
        a[r][2 * c] *= correction[r];
        a[r][2 * c + 1] *= correction[r];
      }
    }
  } else {
    for (int r = 0; r < kG; ++r) {
      for (int64_t c = 0; c < kParts; ++c) a[r][c] = load16(acc + r * kD + 16 * c) * correction[r];
    }
  }
  for (int64_t j = j_lo; j < j_hi; ++j) {
    const T* vj = v + j * stride;
    v16f vv[kParts];
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      for (int64_t c = 0; c < kD / 32; ++c) split_pairs(vj + 32 * c, vv[2 * c], vv[2 * c + 1]);
    } else {
      for (int64_t c = 0; c < kParts; ++c) vv[c] = load16(vj + 16 * c);
    }
    for (int r = 0; r < kG; ++r) {
      const v16f w = v16f{} + scores[r * score_stride + j];
      for (int64_t c = 0; c < kParts; ++c) a[r][c] += w * vv[c];
    }
  }
  for (int r = 0; r < kG; ++r) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      for (int64_t c = 0; c < kD / 32; ++c) {
        join_floats(a[r][2 * c], a[r][2 * c + 1], acc + r * kD + 32 * c);
      }
    } else {
      for (int64_t c = 0; c < kParts; ++c) store16(acc + r * kD + 16 * c, a[r][c]);
    }
  }
}

// A decode's kG query heads of one KV head over keys [j_lo, j_hi) of a page, together: each
// key's and value's vectors are loaded (bf16 and fp16 widened in registers) once for all kG
// heads, not once per head or through a widened copy of the page. q: the heads' rotated,
// scaled queries [kG][kD] (bf16 keys: each 32 split in pairs, split_floats); acc, row_max,
// row_sum: theirs; scores: kG rows of score_stride floats (kScorePad spare past a page). The same
// online softmax as the loop of one head at a time.
template <int64_t kD, int kG, typename T>
inline void group_keys(const float* q, const T* k, const T* v, int64_t stride, int64_t j_lo,
                       int64_t j_hi, float* row_max, float* row_sum, float* acc, float* scores,
                       int64_t score_stride, float softcap) {
  static_assert(kD % 32 == 0);
  v8f best[kG];
  for (int r = 0; r < kG; ++r) best[r] = v8f{} + row_max[r];
  for (int64_t j0 = j_lo; j0 < j_hi; j0 += 8) {  // 8 keys, then one transposed reduction
    v8f parts[kG][8];
    group_scores<kD, kG>(q, k, stride, j0, j_hi, parts);
    const auto valid = (kLanes + static_cast<int32_t>(j0)) < static_cast<int32_t>(j_hi);
    for (int r = 0; r < kG; ++r) {
      const v8f sums = sum8x8(parts[r]);
      store8(scores + r * score_stride + j0, sums);
      best[r] = (valid & (sums > best[r])) ? sums : best[r];
    }
  }
  float correction[kG];
  group_softmax<kG>(best, scores, score_stride, j_lo, j_hi, row_max, row_sum, softcap,
                    correction);
  group_values<kD, kG>(acc, correction, v, stride, j_lo, j_hi, scores, score_stride);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// ---------------------------------------------------------------- a decode over an int8 cache
//
// A decode's kG query heads of one KV head over an int8 page (kv_formats.h: D codes and an fp16
// scale a row), read in place. Scores as integer dot products (VNNI, 64 products an instruction):
// each head's query quantized to int8 with a scale of its own (max|q| / 127, as llama.cpp's
// flash attention quantizes Q to its K type's q8); vpdpbusd takes one side unsigned, so each
// key's codes are offset to u8 (+128, one xor) and the offset taken back out once per head
// (128 * sum q); a score is then q_scale * k_scale * the integer dot. Values as integer
// products too, of int16 weights (int8_group_keys). At 32 sequences x 4,096 tokens the bf16
// cache's decode took 23.5 ms a layer where widening int8 pages into a float buffer first took
// 42 (1.8x slower).

// A head's query q [d] (float, on its int8 grid: round_to_int8_grid) as int8 codes qc, their
// sum and its scale qs.
inline void int8_query(const float* q, int64_t d, int8_t* qc, int32_t* q_sum, float* qs) {
  float amax = 0.0f;
  for (int64_t e = 0; e < d; ++e) amax = std::max(amax, std::fabs(q[e]));
  *qs = amax / 127.0f;
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t sum = 0;
  for (int64_t e = 0; e < d; ++e) {
    qc[e] = static_cast<int8_t>(std::nearbyint(q[e] * inv));
    sum += qc[e];
  }
  *q_sum = sum;
}

// 16 keys' vectors of 16 int32 products as one vector of their sums, lane l key l's: a
// transposed tree, pairs interleaved within 128-bit lanes (pair_sums: keys 2i, 2i + 1), then
// pairs of those (quad_sums: keys 4i .. 4i + 3, each 128-bit lane's part), then the 128-bit
// lanes folded (fold_quads), 45 instructions. Taken as the keys come: 16 keys' 48 vectors (3
// heads) held until a whole-tree sum spilled, and zeroing them was a 3 KB memset a page.
inline __m512i pair_sums(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
inline __m512i quad_sums(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
inline __m512i fold_quads(const __m512i (&u)[4]) {
  const __m512i w0 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x88),
                                      _mm512_shuffle_i32x4(u[0], u[1], 0xDD));
  const __m512i w1 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], 0x88),
                                      _mm512_shuffle_i32x4(u[2], u[3], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(w0, w1, 0x88), _mm512_shuffle_i32x4(w0, w1, 0xDD));
}

// An int8 row's fp16 scale for each of 16 rows from row (`at`: lane l's offset, l * the rows'
// stride; lanes not valid: 0), as floats: one gather of the two bytes before each scale and
// the scale (a row's last four bytes, so that no lane reads past its row).
template <int64_t kD>
inline __m512 int8_row_scales(const uint8_t* row, __m512i at, __mmask16 valid) {
  const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, at,
                                                    row + kD - 2, 1);
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16)));
}

// The int8 decode's order of a head's kD float sums (see int8_group_keys' values): pairs of
// keys' codes unpacked within 128-bit lanes hold, of each 32 elements, 0-3, 8-11, 16-19, 24-27
// (the low unpack's vector) and 4-7, 12-15, 20-23, 28-31 (the high's).
inline void int8_sums_in(const float* acc, int64_t c, __m512& lo, __m512& hi) {
  const __m512 n0 = _mm512_loadu_ps(acc + 16 * c), n1 = _mm512_loadu_ps(acc + 16 * c + 16);
  lo = _mm512_permutex2var_ps(
      n0, _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27), n1);
  hi = _mm512_permutex2var_ps(
      n0, _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31), n1);
}
inline void int8_sums_out(__m512 lo, __m512 hi, int64_t c, float* acc) {
  _mm512_storeu_ps(acc + 16 * c, _mm512_permutex2var_ps(
      lo, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23), hi));
  _mm512_storeu_ps(acc + 16 * c + 16, _mm512_permutex2var_ps(
      lo, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31), hi));
}

// A decode's kG query heads over keys [j_lo, j_hi) of an int8 page, 16 keys at a time, each
// 16 in registers from their scores to their values (no scores buffer between them).
// - Scores: integer dot products (above), 16 keys' summed across lanes together (pair_sums).
// - Softmax: p = exp(score - the head's running max) <= 1. The max moves on only where a score
//   passes it (a unit's first keys, then seldom); there the head's sums so far take their
//   correction. Elsewhere no reduction lies between the scores and the values: the sums of p
//   stay 16 lanes a head until the call's end.
// - Values: sum over j of p_j * scale_j * codes_j in integers. The 16 keys' value scales over
//   their largest, times p, times 32767, are int16 weights (an error of at most 2^-16 of the
//   largest scale, where bf16 rounds to 2^-9); two keys' codes interleaved as int16 pairs,
//   vpdpwssd adds both keys' products to a lane's int32; the 16 keys' sums, as floats times
//   the largest scale / 32767, join the head's float sums in acc.
// Widening each key's codes to floats for float products had taken ~30 cycles a key, and a
// page's scores through a buffer and group_softmax's reductions as much again: 10.5 ns a key
// and head of the default model (3 heads a KV head, pages in L1) against 8.0 now.
// row_max, row_sum, acc: the heads' (acc [kG][kD]).
template <int64_t kD, int kG>
inline void int8_group_keys(const int8_t* qc, const int32_t* q_sum, const float* qs,
                            const uint8_t* k, const uint8_t* v, int64_t stride, int64_t j_lo,
                            int64_t j_hi, float* row_max, float* row_sum, float* acc,
                            float softcap) {
  static_assert(kD % 64 == 0 && kG <= 16);
  constexpr int64_t kParts = kD / 64, kVecs = kD / 16;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // (code + 128 as u8)
  __m512i qv[kG][kParts];
  __m512i offset[kG];
  __m512 sums_p[kG];
  float top[kG];
  const __m512i rows_at = _mm512_mullo_epi32(  // (16 rows' offsets, for int8_row_scales)
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int32_t>(stride)));
  for (int r = 0; r < kG; ++r) {
    for (int64_t c = 0; c < kParts; ++c) qv[r][c] = _mm512_loadu_si512(qc + r * kD + 64 * c);
    offset[r] = _mm512_set1_epi32(128 * q_sum[r]);
    top[r] = row_max[r];
    sums_p[r] = _mm512_maskz_mov_ps(1, _mm512_set1_ps(row_sum[r]));
  }
  for (int64_t j0 = j_lo; j0 < j_hi; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, j_hi - j0);
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    // Scores. A key past the page's end reads the last one's row; its lane is masked below.
    __m512 p[kG];
    {
      __m512i u[kG][4];
      for (int quad = 0; quad < 4; ++quad) {
        __m512i t[kG][2];
        for (int half = 0; half < 2; ++half) {
          __m512i d[2][kG];
          for (int e = 0; e < 2; ++e) {
            const int64_t l = std::min<int64_t>(4 * quad + 2 * half + e, n - 1);
            const uint8_t* kj = k + (j0 + l) * stride;
            for (int64_t c = 0; c < kParts; ++c) {
              const __m512i codes = _mm512_xor_si512(_mm512_loadu_si512(kj + 64 * c), flip);
              for (int r = 0; r < kG; ++r) {
                d[e][r] = _mm512_dpbusd_epi32(c == 0 ? _mm512_setzero_si512() : d[e][r],
                                              codes, qv[r][c]);
              }
            }
          }
          for (int r = 0; r < kG; ++r) t[r][half] = pair_sums(d[0][r], d[1][r]);
        }
        for (int r = 0; r < kG; ++r) u[r][quad] = quad_sums(t[r][0], t[r][1]);
      }
      const __m512 key_scale = int8_row_scales<kD>(k + j0 * stride, rows_at, valid);
      for (int r = 0; r < kG; ++r) {
        const __m512i dot = _mm512_sub_epi32(fold_quads(u[r]), offset[r]);
        p[r] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), key_scale),
                             _mm512_set1_ps(qs[r]));
      }
    }
    // Softmax (a softcap first, on the keys' lanes one at a time).
    if (softcap > 0.0f) {
      for (int r = 0; r < kG; ++r) {
        alignas(64) float capped[16];
        _mm512_store_ps(capped, p[r]);
        for (int64_t l = 0; l < n; ++l) capped[l] = softcap_score(capped[l], softcap);
        p[r] = _mm512_load_ps(capped);
      }
    }
    __mmask16 passed = 0;
    for (int r = 0; r < kG; ++r) {
      passed |= _mm512_mask_cmp_ps_mask(valid, p[r], _mm512_set1_ps(top[r]), _CMP_GT_OQ);
    }
    if (passed != 0) {
      for (int r = 0; r < kG; ++r) {
        const float was = top[r];
        top[r] = std::max(was, _mm512_mask_reduce_max_ps(valid, p[r]));
        if (top[r] == was) continue;
        // (a first page's -inf: no correction, nothing summed yet)
        const __m512 corr = _mm512_set1_ps(was == -INFINITY ? 0.0f : exp_clamped(was - top[r]));
        sums_p[r] = _mm512_mul_ps(sums_p[r], corr);
        for (int64_t c = 0; c < kVecs; ++c) {
          _mm512_storeu_ps(acc + r * kD + 16 * c,
                           _mm512_mul_ps(_mm512_loadu_ps(acc + r * kD + 16 * c), corr));
        }
      }
    }
    for (int r = 0; r < kG; ++r) {
      v16f x;
      const __m512 centred = _mm512_sub_ps(p[r], _mm512_set1_ps(top[r]));
      std::memcpy(&x, &centred, sizeof x);
      const v16f e = exp16(x);
      std::memcpy(&p[r], &e, sizeof e);
      p[r] = _mm512_maskz_mov_ps(valid, p[r]);
      sums_p[r] = _mm512_add_ps(sums_p[r], p[r]);
    }
    // Values.
    const __m512 value_scale = int8_row_scales<kD>(v + j0 * stride, rows_at, valid);
    const float largest = _mm512_reduce_max_ps(value_scale);
    const __m512 to_codes = _mm512_mul_ps(
        value_scale, _mm512_set1_ps(largest > 0.0f ? 32767.0f / largest : 0.0f));
    alignas(32) int16_t weights[kG][16];
    __m512i sums[kG][kVecs];
    for (int r = 0; r < kG; ++r) {
      const __m512i coded = _mm512_cvtps_epi32(_mm512_mul_ps(p[r], to_codes));
      _mm256_store_si256(reinterpret_cast<__m256i*>(weights[r]), _mm512_cvtepi32_epi16(coded));
      for (int64_t c = 0; c < kVecs; ++c) sums[r][c] = _mm512_setzero_si512();
    }
    for (int64_t l = 0; l < n; l += 2) {  // keys j0 + l and the next (or itself, at weight 0)
      const uint8_t* v0 = v + (j0 + l) * stride;
      const uint8_t* v1 = l + 1 < n ? v0 + stride : v0;
      for (int64_t c = 0; c < kVecs; c += 2) {
        const __m512i x0 = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 16 * c)));
        const __m512i x1 = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 16 * c)));
        const __m512i lo = _mm512_unpacklo_epi16(x0, x1), hi = _mm512_unpackhi_epi16(x0, x1);
        for (int r = 0; r < kG; ++r) {
          int32_t pair;
          std::memcpy(&pair, &weights[r][l], sizeof pair);
          const __m512i w = _mm512_set1_epi32(pair);
          sums[r][c] = _mm512_dpwssd_epi32(sums[r][c], lo, w);
          sums[r][c + 1] = _mm512_dpwssd_epi32(sums[r][c + 1], hi, w);
        }
      }
    }
    const __m512 unit = _mm512_set1_ps(largest / 32767.0f);
    for (int r = 0; r < kG; ++r) {  // (the sums join acc here, not held in registers
      for (int64_t c = 0; c < kVecs; c += 2) {  // over the keys: the scores' tree spilled)
        __m512 lo, hi;
        int8_sums_in(acc + r * kD, c, lo, hi);
        lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][c]), unit, lo);
        hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][c + 1]), unit, hi);
        int8_sums_out(lo, hi, c, acc + r * kD);
      }
    }
  }
  for (int r = 0; r < kG; ++r) {
    row_max[r] = top[r];
    row_sum[r] = _mm512_reduce_add_ps(sums_p[r]);
  }
}
#define LLM_CPU_INT8_DOT 1
#else
#define LLM_CPU_INT8_DOT 0
#endif

#if LLM_CPU_AMX
// ---------------------------------------------------------------- a decode's scores on AMX
//
// A decode's kG query heads of one KV head against up to 16 keys of a page as one tile
// product: the keys, read in place (a row of the cache, the cache's stride between them), are
// the A tile; the heads' queries rounded to bf16 (as the model's own attention has them) the
// B tile, in AMX's pair layout with the heads as columns and the other columns zero; the
// result, [keys][16] floats, holds each head's scores in a column. The float dot products of
// group_scores took ~40 vector instructions a key and a transposed reduction every 8; the tile
// product takes a 1 KB load per 32 elements of 16 keys. Values stay on vectors (group_values):
// AMX would need them in pairs of keys, which the cache does not keep.
//
// Tiles: 0 the scores, 1 to kD / 32 the queries (32 elements each), 5 and 6 the keys.
inline void configure_decode_tiles(int64_t rows) {
  llm_cpu_amx::TileConfig config;
  for (int t = 0; t < 7; ++t) {
    config.rows[t] = static_cast<uint8_t>(t >= 1 && t <= 4 ? 16 : rows);
    config.colsb[t] = 64;
  }
  llm_cpu_amx::load_config(config);
}

// The group's queries q [kG][kD] (float) as kD / 32 B tiles in qb (1 KB each: row p holds
// elements 2p, 2p + 1 of the tile's 32 for each head's column), loaded into tiles 1...
template <int64_t kD, int kG>
inline void load_query_tiles(const float* q, uint32_t* qb) {
  std::memset(qb, 0, kD / 32 * 1024);
  for (int c = 0; c < kG; ++c) {
    for (int64_t e = 0; e < kD / 2; ++e) {
      const uint32_t lo = from_float<c10::BFloat16>(q[c * kD + 2 * e]).x;
      const uint32_t hi = from_float<c10::BFloat16>(q[c * kD + 2 * e + 1]).x;
      qb[(e / 16) * 256 + (e % 16) * 16 + c] = lo | (hi << 16);
    }
  }
  _tile_loadd(1, qb, 64);
  if constexpr (kD >= 64) _tile_loadd(2, qb + 256, 64);
  if constexpr (kD >= 96) _tile_loadd(3, qb + 512, 64);
  if constexpr (kD >= 128) _tile_loadd(4, qb + 768, 64);
}

// Scores of the configured rows of keys from k (stride elements apart) against the query
// tiles, into c [rows][16].
template <int64_t kD>
inline void tile_scores(const c10::BFloat16* k, int64_t stride, float* c) {
  const int64_t bytes = stride * static_cast<int64_t>(sizeof(c10::BFloat16));
  _tile_zero(0);
  _tile_loadd(5, k, bytes);
  _tile_dpbf16ps(0, 5, 1);
  if constexpr (kD >= 64) {
    _tile_loadd(6, k + 32, bytes);
    _tile_dpbf16ps(0, 6, 2);
  }
  if constexpr (kD >= 96) {
    _tile_loadd(5, k + 64, bytes);
    _tile_dpbf16ps(0, 5, 3);
  }
  if constexpr (kD >= 128) {
    _tile_loadd(6, k + 96, bytes);
    _tile_dpbf16ps(0, 6, 4);
  }
  _tile_stored(0, c, 64);
}

// One decode over keys [j_lo, j_hi) of a page of KV head g (k, v: the page's first key and
// value of the head; stride between keys): the group's scores by tile products, `rows` keys
// at a time (the configured rows, dividing the page), then the same online softmax and value
// sums as group_keys. The query tiles are loaded. c: a [16][16] float buffer.
template <int64_t kD, int kG>
inline void tile_keys(const c10::BFloat16* k, const c10::BFloat16* v, int64_t stride,
                      int64_t rows, int64_t j_lo, int64_t j_hi, float* row_max, float* row_sum,
                      float* acc, float* scores, int64_t score_stride, float* c,
                      float softcap) {
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  float top[kG];
  for (int r = 0; r < kG; ++r) top[r] = row_max[r];
  for (int64_t j0 = j_lo / rows * rows; j0 < j_hi; j0 += rows) {
    tile_scores<kD>(k + j0 * stride, stride, c);
    const __m512i j = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(j0)));
    const __mmask16 valid =
        _mm512_cmpge_epi32_mask(j, _mm512_set1_epi32(static_cast<int32_t>(j_lo))) &
        _mm512_cmplt_epi32_mask(j, _mm512_set1_epi32(static_cast<int32_t>(j_hi)));
    for (int r = 0; r < kG; ++r) {  // column r: head r's scores of these keys
      const __m512i at = _mm512_add_epi32(_mm512_slli_epi32(lanes, 4), _mm512_set1_epi32(r));
      const __m512 col = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, at, c, 4);
      _mm512_mask_storeu_ps(scores + r * score_stride + j0, valid, col);
      top[r] = std::max(top[r], _mm512_mask_reduce_max_ps(valid, col));
    }
  }
  float correction[kG];
  for (int r = 0; r < kG; ++r) {
    correction[r] = softmax_page(scores + r * score_stride, j_lo, j_hi, top[r], row_max[r],
                                 row_sum[r], softcap);
  }
  group_values<kD, kG>(acc, correction, v, stride, j_lo, j_hi, scores, score_stride);
}

// ---------------------------------------------------------------- a prompt's rows on AMX
//
// The matrix form's products as tile products: a chunk's 16 keys (in place, as for a decode)
// times 16 rows' queries (a B tile of bf16 pairs, the rows as columns) give s[j] for the 16
// keys with the rows in lanes, as chunk_scores does; after the same softmax, the weights
// transposed to [rows][keys] in bf16 (an A tile of 16 keys) times the chunk's values in pairs
// of keys (B tiles of 16 dims, made from the cache's rows) give the rows' [16][16 dims]
// sums, added to float accumulators [row][d] under the rows' corrections.
//
// Tiles: 0 the scores, then each 16 dims' sums; 1 to kD / 32 the keys (32 elements each);
// 5 a row vector's queries (one 32 elements at a time); 6 the weights; 7 16 dims' values.
inline void configure_row_tiles() {
  llm_cpu_amx::TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  config.colsb[6] = 32;  // 16 rows x 16 keys
  config.rows[7] = 8;    // 8 pairs of keys x 16 dims
  llm_cpu_amx::load_config(config);
}

// Rows' queries (rows[l]: kD floats, or none: zeros) as B tiles in qb, 1 KB a 32 elements:
// row p of tile t holds elements 32t + 2p, 32t + 2p + 1 of each row's column.
template <int64_t kD>
inline void row_query_tiles(const float* const* rows, uint32_t* qb) {
  for (int64_t t = 0; t < kD / 32; ++t) {
    v16f pairs[16];  // [row l][pair p] -> transposed to [p][l]
    for (int l = 0; l < 16; ++l) {
      if (!rows[l]) {
        pairs[l] = v16f{};
        continue;
      }
      const __m512 a = _mm512_loadu_ps(rows[l] + 32 * t);
      const __m512 b = _mm512_loadu_ps(rows[l] + 32 * t + 16);
      // (bf16 of 32 floats, in order: cvtne2ps_pbh puts b's in the high half)
      const __m512i bits = (__m512i)_mm512_cvtne2ps_pbh(b, a);
      std::memcpy(&pairs[l], &bits, sizeof bits);
    }
    transpose16(pairs);
    for (int p = 0; p < 16; ++p) std::memcpy(qb + t * 256 + p * 16, &pairs[p], 64);
  }
}

// The chunk's values (16 keys from v, stride apart; the first n exist, the rest count as
// zeros) as kD / 16 B tiles in vb (512 bytes each): row p of tile c pairs keys 2p and 2p + 1
// for each of dims 16c..16c + 15.
template <int64_t kD>
inline void value_tiles(const c10::BFloat16* v, int64_t stride, int64_t n, uint32_t* vb) {
  for (int64_t p = 0; p < 8; ++p) {
    const c10::BFloat16* v0 = v + 2 * p * stride;
    const c10::BFloat16* v1 = v0 + stride;
    for (int64_t c = 0; c < kD / 16; ++c) {
      const __m512i lo = 2 * p < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                         reinterpret_cast<const __m256i*>(v0 + 16 * c)))
                                   : _mm512_setzero_si512();
      const __m512i hi = 2 * p + 1 < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                             reinterpret_cast<const __m256i*>(v1 + 16 * c)))
                                       : _mm512_setzero_si512();
      _mm512_storeu_si512(vb + (c * 8 + p) * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// The chunk's 16 keys (k, stride apart) into tiles 1...
template <int64_t kD>
inline void load_key_tiles(const c10::BFloat16* k, int64_t stride) {
  const int64_t bytes = stride * static_cast<int64_t>(sizeof(c10::BFloat16));
  _tile_loadd(1, k, bytes);
  if constexpr (kD >= 64) _tile_loadd(2, k + 32, bytes);
  if constexpr (kD >= 96) _tile_loadd(3, k + 64, bytes);
  if constexpr (kD >= 128) _tile_loadd(4, k + 96, bytes);
}

// An int8 chunk on the same tiles. Its 16 rows' codes as bf16, exactly (a code has at most 8
// significant bits, bf16 holds 8), and their scales kept apart, out of the products: a key's
// scale multiplies its 16 rows' scores (q . (s c) = s (q . c)), a value's the rows' weights
// for it (p s, rounded to bf16 as a bf16 cache's p are). A key past n: scale 0.
template <int64_t kD>
inline void int8_key_tiles(const uint8_t* k, int64_t stride, int64_t n, c10::BFloat16* kb,
                           float* scale) {
  for (int64_t j = 0; j < kChunk; ++j) {
    const uint8_t* row = k + j * stride;
    scale[j] = j < n ? llm_cpu_kv::row_scale(row, kD) : 0.0f;
    for (int64_t c = 0; c < kD / 16; ++c) {
      const __m256i bits = (__m256i)_mm512_cvtneps_pbh(llm_cpu_kv::int8_codes16(row + 16 * c));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(kb + j * kD + 16 * c), bits);
    }
  }
  load_key_tiles<kD>(kb, kD);
}
// value_tiles' pairs of an int8 chunk (a code's float's high half is its bf16).
template <int64_t kD>
inline void int8_value_tiles(const uint8_t* v, int64_t stride, int64_t n, uint32_t* vb,
                             float* scale) {
  for (int64_t j = 0; j < kChunk; ++j) {
    scale[j] = j < n ? llm_cpu_kv::row_scale(v + j * stride, kD) : 0.0f;
  }
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t p = 0; p < 8; ++p) {
    const uint8_t* v0 = v + 2 * p * stride;
    const uint8_t* v1 = v0 + stride;
    for (int64_t c = 0; c < kD / 16; ++c) {
      const __m512i x0 = _mm512_castps_si512(llm_cpu_kv::int8_codes16(v0 + 16 * c));
      const __m512i x1 = _mm512_castps_si512(llm_cpu_kv::int8_codes16(v1 + 16 * c));
      const __m512i lo = _mm512_srli_epi32(x0, 16), hi = _mm512_and_si512(x1, high);
      _mm512_storeu_si512(vb + (c * 8 + p) * 16, _mm512_or_si512(lo, hi));
    }
  }
}

// s[j] = the 16 rows' queries (qb) . key j of the loaded key tiles; c: [16][16] floats.
template <int64_t kD>
inline void tile_chunk_scores(const uint32_t* qb, float* c, v16f* s) {
  _tile_zero(0);
  _tile_loadd(5, qb, 64);
  _tile_dpbf16ps(0, 1, 5);
  if constexpr (kD >= 64) {
    _tile_loadd(5, qb + 256, 64);
    _tile_dpbf16ps(0, 2, 5);
  }
  if constexpr (kD >= 96) {
    _tile_loadd(5, qb + 512, 64);
    _tile_dpbf16ps(0, 3, 5);
  }
  if constexpr (kD >= 128) {
    _tile_loadd(5, qb + 768, 64);
    _tile_dpbf16ps(0, 4, 5);
  }
  _tile_stored(0, c, 64);
  for (int j = 0; j < 16; ++j) s[j] = load16(c + j * 16);
}

// acc[l] = acc[l] * correction[l] + sum over j of p[j][l] * v_j, for the 16 rows l (acc:
// [16][kD]); p: the chunk's weights with the rows in lanes (transposed here); vb: value_tiles;
// pt, c: scratch of 16 x 16 bf16 and floats.
template <int64_t kD>
inline void tile_chunk_values(float* acc, v16f correction, v16f* p, const uint32_t* vb,
                              c10::BFloat16* pt, float* c) {
  transpose16(p);
  for (int l = 0; l < 16; ++l) {
    const __m256i bits = (__m256i)_mm512_cvtneps_pbh(p[l]);
    std::memcpy(pt + l * 16, &bits, sizeof bits);
  }
  _tile_loadd(6, pt, 32);
  for (int64_t e = 0; e < kD / 16; ++e) {
    _tile_loadd(7, vb + e * 128, 64);
    _tile_zero(0);
    _tile_dpbf16ps(0, 6, 7);
    _tile_stored(0, c, 64);
    for (int l = 0; l < 16; ++l) {
      float* a = acc + l * kD + 16 * e;
      store16(a, load16(a) * correction[l] + load16(c + l * 16));
    }
  }
}
#endif  // LLM_CPU_AMX

// How a thread's AMX tiles are configured (none, tile_keys', or the tile form of a prompt's rows).
constexpr int kNoTiles = 0, kDecodeTiles = 1, kRowTiles = 2;

constexpr int64_t kMaxTileRows = 256;  // query rows (tokens x heads) per tile
// Tiles with this many rows a KV head (tokens x its query heads) or more take the matrix
// form (3b below); fewer, the vector loop (3). Measured at 64 sequences of 256 tokens in bf16:
// a decode (3 rows) 0.90 ms in the loop against 1.33 in matrix form, 2 tokens (6 rows) even,
// 3 tokens (9 rows) 1.85 against 1.50, 4 tokens 2.34 against 1.49.
constexpr int64_t kMatrixRows = 8;

struct Tile {
  int64_t start;  // first token of the tile in the flattened batch
  int64_t len;    // consecutive positions of one sequence
};

// A step's few decodes on every thread. One thread had read a decode's every key while the
// others waited, at ~10 GB/s (a single stream's latency, not the memory's bandwidth): 30
// layers' caches in turn, the default model's heads, one sequence at 1,024 tokens took 78-83
// us a layer, 27 at 256 (`scripts/bench attention`). Now a step of fewer than kHeadSplitUnits
// units a thread splits its decodes by KV head (the same arithmetic: the heads are
// independent), 58-59 and 21 us; at 32 sequences a decode is one unit (a head's rows are a
// third of every page, read with a stride), as fast as before. And a decode's keys come in
// parts of kPartitionKeys (whole pages from page 0), each part's online softmax a unit of its
// own, merged in order (merge_parts): a long context on many threads (one sequence at 4,096:
// 0.43-0.48 ms a layer, now 0.23-0.24). A part costs ~1 us (its partials, its merge, its
// first page unprefetched): parts of 128 keys cost 32 sequences of 256 tokens 10-15%, so they
// are long enough that a part is ~1% of its work. What a row reads, and in which order,
// depends on its position alone, never on the step's other rows.
constexpr int64_t kHeadSplitUnits = 8;
constexpr int64_t kPartitionKeys = 1024;

// The rows of a decode's head group from its parts, in order: part p's row j at
// parts[(p * rows + j) * (d + 2)] holds its d unnormalised sums of values, its running max and
// its sum of exp(score - max). out: the rows' d outputs each, consecutive.
template <typename T>
void merge_parts(const float* parts, int64_t count, int64_t rows, int64_t d, T* out) {
  const int64_t stride = d + 2;
  thread_local std::vector<float> acc;
  acc.resize(d);
  for (int64_t j = 0; j < rows; ++j) {
    float top = -INFINITY;
    for (int64_t p = 0; p < count; ++p) top = std::max(top, parts[(p * rows + j) * stride + d]);
    std::fill(acc.begin(), acc.end(), 0.0f);
    float sum = 0.0f;
    for (int64_t p = 0; p < count; ++p) {
      const float* part = parts + (p * rows + j) * stride;
      const float weight = std::exp(part[d] - top);  // (0 for a part that saw no key)
      sum += part[d + 1] * weight;
      for (int64_t e = 0; e < d; ++e) acc[e] += part[e] * weight;
    }
    store_row(acc.data(), 1.0f / sum, d, out + j * d);
  }
}

// Rope (Hugging Face's rotate_half convention) of one head vector, into float.
template <typename T>
inline void rope(const T* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    out[i] = to_float(x[i]) * cos[i] - to_float(x[i + half]) * sin[i];
  }
#pragma omp simd
  for (int64_t i = half; i < d; ++i) {
    out[i] = to_float(x[i]) * cos[i] + to_float(x[i - half]) * sin[i];
  }
}

// The cache's format F: T itself (the model's dtype), or one of kv_formats.h's 8-bit ones.
template <typename F>
constexpr bool kQuantized = std::is_same_v<F, llm_cpu_kv::Int8Rows> ||
                            std::is_same_v<F, llm_cpu_kv::E4M3Rows> ||
                            std::is_same_v<F, llm_cpu_kv::E5M2Rows>;

// One butterfly stage of the Walsh-Hadamard transform within 16 lanes, lanes kH apart: lane i
// becomes x[i] + x[i + kH] where bit kH of i is clear, x[i - kH] - x[i] where it is set, i.e.
// x[i ^ kH] + sign * x[i].
template <int kH, int... I>
inline v16f hadamard_lanes(v16f v, std::integer_sequence<int, I...>) {
  const v16f partner = __builtin_shufflevector(v, v, (I ^ kH)...);
  const v16f sign = {((I & kH) ? -1.0f : 1.0f)...};
  return partner + v * sign;
}

// q [d] rounded to its int8 grid in place: each element to the nearest multiple of the head's
// scale max|q| / 127 (what int8_query makes codes of, exactly).
inline void round_to_int8_grid(float* q, int64_t d) {
  float amax = 0.0f;
  for (int64_t e = 0; e < d; ++e) amax = std::max(amax, std::fabs(q[e]));
  if (amax == 0.0f) return;
  const float scale = amax / 127.0f, inv = 127.0f / amax;
  for (int64_t e = 0; e < d; ++e) q[e] = std::nearbyint(q[e] * inv) * scale;
}

// x [d] times the orthonormal Walsh-Hadamard matrix (d a power of 2), in place: stages within
// 16 lanes by shuffles, then across vectors (a scalar loop had taken a seventh of an int8
// cache's prefill attention).
inline void hadamard(float* x, int64_t d) {
  const float norm = 1.0f / std::sqrt(static_cast<float>(d));
  if (d % 16 != 0) {
    for (int64_t h = 1; h < d; h *= 2) {
      for (int64_t i = 0; i < d; i += 2 * h) {
        for (int64_t j = i; j < i + h; ++j) {
          const float a = x[j], b = x[j + h];
          x[j] = a + b;
          x[j + h] = a - b;
        }
      }
    }
    for (int64_t j = 0; j < d; ++j) x[j] *= norm;
    return;
  }
  constexpr auto lanes = std::make_integer_sequence<int, 16>{};
  for (int64_t e = 0; e < d; e += 16) {
    v16f v = load16(x + e);
    v = hadamard_lanes<1>(v, lanes);
    v = hadamard_lanes<2>(v, lanes);
    v = hadamard_lanes<4>(v, lanes);
    v = hadamard_lanes<8>(v, lanes);
    store16(x + e, v);
  }
  for (int64_t h = 16; h < d; h *= 2) {
    for (int64_t i = 0; i < d; i += 2 * h) {
      for (int64_t j = i; j < i + h; j += 16) {
        const v16f a = load16(x + j), b = load16(x + j + h);
        store16(x + j, a + b);
        store16(x + j + h, a - b);
      }
    }
  }
  for (int64_t e = 0; e < d; e += 16) store16(x + e, load16(x + e) * norm);
}

// kD: the head size as a constant (64 and 128, the common ones), so that the loops over it
// unroll with no remainder; 0 reads it from the tensors. F: the cache's format (see above): an
// 8-bit cache is written through quantize_row and read a page at a time widened to float rows
// in the thread's buffer, then attended as a float32 cache is (the vector forms: the AMX ones
// take bf16 keys in place, which an 8-bit page is not).
template <typename T, typename F, int64_t kD>
void attention_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      at::Tensor& kv_cache, const at::Tensor& block_table,
                      const at::Tensor& token_slots, const at::Tensor& positions,
                      const at::Tensor& cos_table, const at::Tensor& sin_table, double scale,
                      int64_t window, double softcap, const float* sinks,
                      at::Tensor& out) {
  const int64_t num_tokens = q.size(0), heads = q.size(1), d = kD > 0 ? kD : q.size(2);
  const int64_t kv_heads = k.size(1), block_size = kv_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t cache_half = kv_cache.stride(0);
  const int64_t table_stride = block_table.stride(0);
  constexpr bool quantized = kQuantized<F>;
  // An int8 cache holds each key rotated by the Hadamard matrix H (orthonormal, head sizes that
  // are powers of 2), and the queries are rotated alike, so that q . k is unchanged: a key's
  // few outlier channels, which set its row's scale and left the rest of the row few codes, are
  // spread over every channel (QuaRot's rotation, here on the keys alone).
  const bool rotate_keys = std::is_same_v<F, llm_cpu_kv::Int8Rows> && d > 0 && (d & (d - 1)) == 0;
  // A decode over an int8 cache: scores by integer dot products (int8_group_keys) where the CPU
  // has VNNI and the head size is whole 64s; else its pages are widened as the fp8 ones are.
  constexpr bool int8_dot = std::is_same_v<F, llm_cpu_kv::Int8Rows> && LLM_CPU_INT8_DOT &&
                            kVectorHead<kD> && kD % 64 == 0;
  using C = std::conditional_t<  // the cache's elements
      std::is_same_v<F, llm_cpu_kv::E4M3Rows>, c10::Float8_e4m3fn,
      std::conditional_t<std::is_same_v<F, llm_cpu_kv::E5M2Rows>, c10::Float8_e5m2,
                         std::conditional_t<quantized, uint8_t, T>>>;
  // Elements of a head's row in the cache: its D values, and an 8-bit format's extra bytes.
  const int64_t row = [&] {
    if constexpr (quantized) {
      return d + F::kExtra;
    } else {
      return d;
    }
  }();
  // (An 8-bit format's codes: int8's rows are read through their scales, kv_formats.h; fp8's
  // elements are read in place as bf16's are, load8 and load16 widening them.)
  constexpr bool widen_pages = std::is_same_v<F, llm_cpu_kv::Int8Rows>;
  C* k_cache = static_cast<C*>(kv_cache.data_ptr());
  C* v_cache = k_cache + cache_half;
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k.data_ptr<T>();
  const T* v_ptr = v.data_ptr<T>();
  const int64_t q_row = q.stride(0), k_row = k.stride(0), v_row = v.stride(0);
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cos_ptr = cos_table.data_ptr<float>();
  const float* sin_ptr = sin_table.data_ptr<float>();
  T* out_ptr = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const float fcap = static_cast<float>(softcap);  // 0: none

  auto cache_offset = [&](int64_t slot, int64_t p) {  // element offset of (p, head 0)
    const int64_t block = table[slot * table_stride + p / block_size];
    return (block * block_size + p % block_size) * kv_heads * row;
  };

  // 1. Tiles: runs of consecutive positions of one sequence, at most tile_len tokens. Every
  // index the kernel will follow is checked first (a bad one would read or write another
  // sequence's pages, or outside the cache), before anything is written.
  const int64_t tile_len = std::max<int64_t>(1, std::min<int64_t>(16, kMaxTileRows / heads));
  std::vector<Tile> tiles;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (!tiles.empty()) {
      Tile& last = tiles.back();
      const int64_t prev = last.start + last.len - 1;
      if (last.len < tile_len && slots[t] == slots[prev] && pos[t] == pos[prev] + 1) {
        ++last.len;
        continue;
      }
    }
    tiles.push_back({t, 1});
  }
  const int64_t max_len = cos_table.size(0), num_blocks = kv_cache.size(1);
  const int64_t table_rows = block_table.size(0), table_cols = block_table.size(1);
  for (const Tile& tile : tiles) {
    const int64_t slot = slots[tile.start], first = pos[tile.start];
    const int64_t last = first + tile.len - 1;
    TORCH_CHECK(slot >= 0 && slot < table_rows, "paged_attention: slot ", slot,
                " outside the block table's ", table_rows, " rows");
    TORCH_CHECK(first >= 0 && last < max_len, "paged_attention: position ", last,
                " outside the rope tables' ", max_len, " rows");
    TORCH_CHECK(last / block_size < table_cols, "paged_attention: position ", last,
                " past the block table's ", table_cols, " blocks of ", block_size);
    const int64_t lo = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;
    for (int64_t page = lo / block_size; page <= last / block_size; ++page) {
      const int64_t block = table[slot * table_stride + page];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_attention: block ", block,
                  " (slot ", slot, ", page ", page, ") outside the cache's ", num_blocks);
    }
  }

  // Units of work (3 below): a tile of a prompt in matrix form is one; a tile of the vector
  // loop is one, or one a KV head in a step of few units; a decode's, one a part of its keys,
  // merged in order by whichever thread finishes the last part (see kPartitionKeys).
  const int64_t part_pages = std::max<int64_t>(1, kPartitionKeys / block_size);
  struct Unit {
    int64_t tile, g;            // g: -1, every KV head
    int64_t page_lo, page_hi;   // the pages it reads, of those its rows see
    int64_t part, parts;        // its place among its head's parts; parts > 1: partials
    bool matrix;                // a tile of a prompt in matrix form (3b, 3c)
  };
  // Each tile's parts [first_part, first_part + parts) (a tile in matrix form or of several
  // tokens: one), by the pages' own index (part_pages of them from page 0): what a row reads
  // and in which order depends on its position alone, never on the step's other rows.
  std::vector<int64_t> first_part(tiles.size(), 0), tile_parts(tiles.size(), 1);
  int64_t whole = 0;  // units with no split by KV head
  for (int64_t t = 0; t < static_cast<int64_t>(tiles.size()); ++t) {
    const Tile& tile = tiles[t];
    if (tile.len == 1 && group < kMatrixRows) {
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos[tile.start] - window + 1) : 0;
      first_part[t] = lo / block_size / part_pages;
      tile_parts[t] = pos[tile.start] / block_size / part_pages + 1 - first_part[t];
    }
    whole += tile_parts[t];
  }
  // Whether the vector loop's tiles are split by KV head too: where the step has few units
  // for the threads (a KV head's rows are every key's 1 / kv_heads, read with a stride).
  const bool by_head = whole < kHeadSplitUnits * std::max(1, at::get_num_threads());
  std::vector<Unit> units;
  std::vector<int64_t> partial_at(tiles.size(), -1);  // a split decode's partials, floats in
  int64_t partial_floats = 0;
  for (int64_t t = 0; t < static_cast<int64_t>(tiles.size()); ++t) {
    if (tiles[t].len * group >= kMatrixRows) {
      units.push_back({t, -1, 0, INT64_MAX, 0, 1, true});
      continue;
    }
    const int64_t part_lo = first_part[t], parts = tile_parts[t], part_hi = part_lo + parts;
    if (parts > 1) {
      partial_at[t] = partial_floats;
      partial_floats += kv_heads * parts * group * (d + 2);
    }
    for (int64_t g = 0; g < (by_head ? kv_heads : 1); ++g) {
      for (int64_t p = part_lo; p < part_hi; ++p) {
        units.push_back({t, by_head ? g : -1, parts > 1 ? p * part_pages : 0,
                         parts > 1 ? (p + 1) * part_pages : INT64_MAX, p - part_lo, parts,
                         false});
      }
    }
  }
  // [tile][g][part][row of the group][d values, running max, running sum]
  std::vector<float> partials(partial_floats);
  std::unique_ptr<std::atomic<int64_t>[]> parts_done(  // (only where a decode has parts)
      partial_floats > 0 ? new std::atomic<int64_t>[tiles.size() * kv_heads]() : nullptr);

  // Decodes' scores on AMX tiles (tile_keys) where the build, the CPU and the kernel allow,
  // a page being whole tiles of keys.
  const int64_t tile_rows = std::min<int64_t>(16, block_size);
#if LLM_CPU_AMX
  const bool amx_decode = std::is_same_v<C, c10::BFloat16> && kVectorHead<kD> && group >= 2 &&
                          group <= 4 && block_size % tile_rows == 0 &&
                          llm_cpu_amx::request_tiles();
#else
  const bool amx_decode = false;
#endif
  // The decodes whose queries group_keys reads split in pairs (split_floats, in 2 below: once
  // for every unit of the decode).
  std::vector<char> split_query(num_tokens, 0);
  if (kVectorHead<kD> && std::is_same_v<C, c10::BFloat16> && !amx_decode && group >= 2 &&
      group <= 4) {
    for (const Tile& tile : tiles) split_query[tile.start] = tile.len == 1;
  }

  // 2. This step's keys (rotated) and values into the cache; the queries rotated and scaled.
  at::Tensor qf = at::empty({num_tokens, heads, d}, q.options().dtype(at::kFloat));
  float* qf_ptr = qf.data_ptr<float>();
  llm_cpu_work::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(d), value(quantized ? d : 0);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_ptr + pos[t] * d;
      const float* s = sin_ptr + pos[t] * d;
      const int64_t at = cache_offset(slots[t], pos[t]);
      for (int64_t h = 0; h < kv_heads; ++h) {
        rope(k_ptr + t * k_row + h * d, c, s, d, rotated.data());
        C* kd = k_cache + at + h * row;
        C* vd = v_cache + at + h * row;
        const T* vs = v_ptr + t * v_row + h * d;
        if constexpr (quantized) {
          if (rotate_keys) hadamard(rotated.data(), d);
          llm_cpu_kv::quantize_row(rotated.data(), d, reinterpret_cast<uint8_t*>(kd), F{});
          for (int64_t i = 0; i < d; ++i) value[i] = to_float(vs[i]);
          llm_cpu_kv::quantize_row(value.data(), d, reinterpret_cast<uint8_t*>(vd), F{});
        } else {
          store_row(rotated.data(), 1.0f, d, kd);
          std::memcpy(vd, vs, d * sizeof(T));
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* qd = qf_ptr + (t * heads + h) * d;
        rope(q_ptr + t * q_row + h * d, c, s, d, qd);
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) qd[i] *= fscale;
        if (rotate_keys) hadamard(qd, d);
        // Over an int8 cache every form attends with the query on its int8 grid: a decode's
        // scores are integer dot products of its codes (int8_group_keys), and a prompt's rows
        // or a row verifying drafts then score alike, up to float rounding (a prompt's
        // logprobs are those its decodes would see; bench quality measures what decodes do).
        if constexpr (std::is_same_v<F, llm_cpu_kv::Int8Rows>) round_to_int8_grid(qd, d);
      }
      if (split_query[t]) {
        float* qt = qf_ptr + t * heads * d;
        for (int64_t e = 0; e < heads * d; e += 32) {
          v16f even, odd;
          split_floats(qt + e, even, odd);
          store16(qt + e, even);
          store16(qt + e + 16, odd);
        }
      }
    }
  });

  const int64_t kv_stride = kv_heads * row;  // between keys of one head in a page

  // 3. Attention of a unit of the vector loop: a tile's rows of KV head u.g over its pages in
  // [u.page_lo, u.page_hi) (every KV head where u.g is -1). Row r = i * heads + h holds query
  // i's head h. A part of a decode leaves its rows' unnormalised sums of values, running
  // maxima and sums of exponentials in partials for merge_parts; any other unit writes its
  // rows' outputs.
  auto work = [&](const Unit& u, float* acc, float* row_max, float* row_sum,
                  float* scores, float* page_kv, int& tiles_config) {
    const Tile& tile = tiles[u.tile];
    const int64_t slot = slots[tile.start];
    const int64_t first = pos[tile.start];
    const int64_t last = first + tile.len - 1;
    const int64_t rows = tile.len * heads;
    const int64_t g_lo = u.g < 0 ? 0 : u.g, g_hi = u.g < 0 ? kv_heads : u.g + 1;
    std::fill(acc, acc + rows * d, 0.0f);
    std::fill(row_max, row_max + rows, -INFINITY);
    std::fill(row_sum, row_sum + rows, 0.0f);
    if (sinks != nullptr && u.part == 0) start_with_sinks(sinks, heads, rows, row_max, row_sum);
    const int64_t lo_first = std::max(window > 0 ? std::max<int64_t>(0, first - window + 1) : 0,
                                      u.page_lo * block_size);
    const int64_t last_page = std::min(last / block_size, u.page_hi - 1);
    bool decoded = false;  // by tile_keys
#if LLM_CPU_AMX
    if constexpr (kVectorHead<kD> && std::is_same_v<C, c10::BFloat16>) {
      if (tile.len == 1 && amx_decode) {
        if (tiles_config != kDecodeTiles) {
          configure_decode_tiles(tile_rows);
          tiles_config = kDecodeTiles;
        }
        alignas(64) float c[256];
        alignas(64) uint32_t qb[kD / 32 * 256];
        for (int64_t g = g_lo; g < g_hi; ++g) {  // a head's query tiles stay over its pages
          const int64_t h0 = g * group;
          auto run = [&](auto heads_of_group) {
            constexpr int kG = decltype(heads_of_group)::value;
            load_query_tiles<kD, kG>(qf_ptr + (tile.start * heads + h0) * d, qb);
            for (int64_t page = lo_first / block_size; page <= last_page; ++page) {
              const int64_t page_start = page * block_size;
              const int64_t block = table[slot * table_stride + page];
              if (page < last_page) {  // the next page is elsewhere: fetch it meanwhile
                prefetch_head(k_cache, v_cache, table[slot * table_stride + page + 1],
                              block_size, kv_stride, g * row, row);
              } else if (g + 1 < g_hi) {  // the next head's first page
                prefetch_head(k_cache, v_cache, table[slot * table_stride + lo_first / block_size],
                              block_size, kv_stride, (g + 1) * row, row);
              }
              const int64_t j_lo = std::max(lo_first, page_start) - page_start;
              const int64_t j_hi = std::min(first, page_start + block_size - 1) - page_start + 1;
              const int64_t at = block * block_size * kv_stride + g * row;
              tile_keys<kD, kG>(k_cache + at, v_cache + at, kv_stride, tile_rows, j_lo, j_hi,
                                row_max + h0, row_sum + h0, acc + h0 * d, scores,
                                block_size + kScorePad, c, fcap);
            }
          };
          if (group == 2) run(std::integral_constant<int, 2>{});
          if (group == 3) run(std::integral_constant<int, 3>{});
          if (group == 4) run(std::integral_constant<int, 4>{});
        }
        decoded = true;
      }
    }
#endif
    // A decode over an int8 cache on VNNI: its heads' queries as int8 codes, their sums and
    // scales (int8_group_keys).
    std::vector<int8_t> q_codes;
    std::vector<int32_t> q_sums;
    std::vector<float> q_scales;
#if LLM_CPU_INT8_DOT
    if constexpr (int8_dot) {
      if (tile.len == 1 && group >= 2 && group <= 4) {
        q_codes.resize(heads * d);
        q_sums.resize(heads);
        q_scales.resize(heads);
        for (int64_t h = g_lo * group; h < g_hi * group; ++h) {
          int8_query(qf_ptr + (tile.start * heads + h) * d, d, q_codes.data() + h * d,
                     q_sums.data() + h, q_scales.data() + h);
        }
      }
    }
#endif
    if (!decoded) {
      for (int64_t page = lo_first / block_size; page <= last_page; ++page) {
        const int64_t page_start = page * block_size;
        const int64_t block = table[slot * table_stride + page];
        if (page < last_page) {  // the next page is elsewhere: fetch it while this one runs
          prefetch_head(k_cache, v_cache, table[slot * table_stride + page + 1], block_size,
                        kv_stride, g_lo * row, (g_hi - g_lo) * row);
        }
        for (int64_t g = g_lo; g < g_hi; ++g) {
          const C* kp = k_cache + block * block_size * kv_stride + g * row;
          const C* vp = v_cache + block * block_size * kv_stride + g * row;
          // The tile's rows over this page's keys and values of head g (T, or float widened).
          auto attend = [&](const auto* keys, const auto* values, int64_t stride) {
            for (int64_t i = 0; i < tile.len; ++i) {
              const int64_t p = first + i;
              const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
              const int64_t j_lo = std::max(lo, page_start) - page_start;
              const int64_t j_hi = std::min(p, page_start + block_size - 1) - page_start + 1;
              if (j_hi <= j_lo) continue;
              for (int64_t h = g * group; h < (g + 1) * group; ++h) {
                const int64_t r = i * heads + h;
                const float* qr = qf_ptr + ((tile.start + i) * heads + h) * d;
                const float top = page_scores<kD>(qr, keys, stride, d, j_lo, j_hi, row_max[r],
                                                  scores);
                const float correction =
                    softmax_page(scores, j_lo, j_hi, top, row_max[r], row_sum[r], fcap);
                page_values<kD>(acc + r * d, correction, values, stride, d, j_lo, j_hi, scores);
              }
            }
          };
          // A decode's query heads of head g together (group_keys), over the page's keys and
          // values as given (in the cache, or widened).
          const bool heads_together = kVectorHead<kD> && tile.len == 1 && group >= 2 &&
                                      group <= 4;
          auto decode_heads = [&](const auto* keys, const auto* values, int64_t stride) {
            if constexpr (kVectorHead<kD>) {
              const int64_t lo = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;
              const int64_t j_lo = std::max(lo, page_start) - page_start;
              const int64_t j_hi = std::min(first, page_start + block_size - 1) - page_start + 1;
              if (j_hi > j_lo) {
                const int64_t h0 = g * group;
                const float* qg = qf_ptr + (tile.start * heads + h0) * d;
                auto run = [&](auto heads_of_group) {
                  constexpr int kG = decltype(heads_of_group)::value;
                  if constexpr (std::is_same_v<std::decay_t<decltype(*keys)>, uint8_t>) {
#if LLM_CPU_INT8_DOT
                    if constexpr (kD % 64 == 0) {  // (int8 codes in place, int8_dot below)
                      int8_group_keys<kD, kG>(q_codes.data() + h0 * kD, q_sums.data() + h0,
                                              q_scales.data() + h0,
                                              keys, values, stride, j_lo, j_hi, row_max + h0,
                                              row_sum + h0, acc + h0 * d, fcap);
                    }
#endif
                  } else {
                    group_keys<kD, kG>(qg, keys, values, stride, j_lo, j_hi, row_max + h0,
                                       row_sum + h0, acc + h0 * d, scores,
                                       block_size + kScorePad, fcap);
                  }
                };
                if (group == 2) run(std::integral_constant<int, 2>{});
                if (group == 3) run(std::integral_constant<int, 3>{});
                if (group == 4) run(std::integral_constant<int, 4>{});
              }
            }
          };
          if constexpr (widen_pages) {  // the page's rows of head g as float rows, then as float32
            if (int8_dot && heads_together) {  // (or an int8 page read in place)
              decode_heads(kp, vp, kv_stride);
              continue;
            }
            const int64_t used = std::min(block_size, last - page_start + 1);
            float* page_v = page_kv + block_size * d;
            llm_cpu_kv::widen_int8_rows(kp, kv_stride, d, used, page_kv);
            llm_cpu_kv::widen_int8_rows(vp, kv_stride, d, used, page_v);
            if (heads_together) {
              decode_heads(page_kv, page_v, d);
            } else {
              attend(page_kv, page_v, d);
            }
          } else {
            if (heads_together) {
              decode_heads(kp, vp, kv_stride);
              continue;
            }
            if constexpr (!std::is_same_v<T, float>) {
              if (group > 1) {  // widened once for the group's query heads, not once per head
                const int64_t used = std::min(block_size, last - page_start + 1);
                widen_rows(kp, kv_stride, d, used, page_kv);
                widen_rows(vp, kv_stride, d, used, page_kv + block_size * d);
                attend(page_kv, page_kv + block_size * d, d);
                continue;
              }
            }
            attend(kp, vp, kv_stride);
          }
        }
      }
    }
    if (u.parts == 1) {
      for (int64_t i = 0; i < tile.len; ++i) {
        for (int64_t h = g_lo * group; h < g_hi * group; ++h) {
          const int64_t r = i * heads + h;
          T* o = out_ptr + (tile.start * heads + r) * d;  // rows of a tile are contiguous in out
          store_row(acc + r * d, 1.0f / row_sum[r], d, o);
        }
      }
      return;
    }
    // A decode's part: its heads' rows into partials; the last part to finish merges.
    const int64_t stride = d + 2, head_floats = u.parts * group * stride;
    float* tile_partials = partials.data() + partial_at[u.tile];
    for (int64_t g = g_lo; g < g_hi; ++g) {
      for (int64_t j = 0; j < group; ++j) {
        const int64_t r = g * group + j;
        float* at = tile_partials + g * head_floats + (u.part * group + j) * stride;
        std::memcpy(at, acc + r * d, d * sizeof(float));
        at[d] = row_max[r];
        at[d + 1] = row_sum[r];
      }
    }
    if (parts_done[u.tile * kv_heads + g_lo].fetch_add(1, std::memory_order_acq_rel) + 1 ==
        u.parts) {
      for (int64_t g = g_lo; g < g_hi; ++g) {
        merge_parts(tile_partials + g * head_floats, u.parts, group, d,
                    out_ptr + (tile.start * heads + g * group) * d);
      }
    }
  };

  // 3b. A tile of a prompt (kMatrixRows or more rows a KV head) in matrix form, one KV head g
  // at a time: its rows r = i * group + (h - g * group), token i and query head h, in vectors
  // of 16 lanes (see chunk_scores). The page's keys and values of head g are copied (float32)
  // or widened (bf16, fp16, an 8-bit format) to contiguous float rows once for all its row
  // vectors, 16 keys at a time.
  const int64_t max_vectors = (tile_len * group + 15) / 16;
  struct RowStats {  // per row vector: each lane's online softmax and which keys it sees
    std::vector<v16f> row_max, row_sum;
    std::vector<v16i> row_pos, row_lo;  // each lane's position and first key (-1: no row)
  };
  auto make_stats = [&] {
    return RowStats{std::vector<v16f>(max_vectors), std::vector<v16f>(max_vectors),
                    std::vector<v16i>(max_vectors), std::vector<v16i>(max_vectors)};
  };
  // Row vector b of a tile for KV head g (both forms): its lanes' queries (q_rows; none past
  // the tile's rows) and fresh statistics.
  auto start_rows = [&](const Tile& tile, int64_t g, int64_t b, RowStats& stats,
                        const float* (&q_rows)[16]) {
    const int64_t rows = tile.len * group;
    v16i row_pos = v16i{} - 1;
    for (int64_t l = 0; l < 16; ++l) {
      q_rows[l] = nullptr;
      const int64_t r = b * 16 + l;
      if (r >= rows) continue;
      const int64_t i = r / group, h = g * group + r % group;
      q_rows[l] = qf_ptr + ((tile.start + i) * heads + h) * d;
      row_pos[l] = static_cast<int32_t>(pos[tile.start] + i);
    }
    stats.row_pos[b] = row_pos;
    stats.row_lo[b] = window > 0 ? row_pos - static_cast<int32_t>(window - 1) : v16i{};
    stats.row_max[b] = v16f{} - INFINITY;
    stats.row_sum[b] = v16f{};
    for (int64_t l = 0; l < 16 && sinks != nullptr; ++l) {  // (see start_with_sinks)
      const int64_t r = b * 16 + l;
      if (r >= rows) break;
      stats.row_max[b][l] = sinks[g * group + r % group];
      stats.row_sum[b][l] = 1.0f;
    }
  };
  // Whether row vector b of a tile sees none of keys [key0, key0 + n).
  auto sees_none = [&](const Tile& tile, int64_t b, int64_t key0, int64_t n) {
    const int64_t first = pos[tile.start], rows = tile.len * group;
    const int64_t b_first = first + b * 16 / group;
    const int64_t b_last = first + std::min(rows - 1, b * 16 + 15) / group;
    return key0 > b_last || (window > 0 && key0 + n - 1 < b_first - window + 1);
  };
  struct RowBuffers {
    std::vector<float> qt, ot, keys, values;  // [vector][d][16] x2, [16][d] x2
    RowStats stats;
  };
  auto work_rows = [&](const Tile& tile, RowBuffers& buf) {
    const int64_t slot = slots[tile.start];
    const int64_t first = pos[tile.start];
    const int64_t last = first + tile.len - 1;
    const int64_t rows = tile.len * group;
    const int64_t vectors = (rows + 15) / 16;
    const int64_t lo_first = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;
    const int64_t last_page = last / block_size;
    for (int64_t g = 0; g < kv_heads; ++g) {
      for (int64_t b = 0; b < vectors; ++b) {  // the rows' queries transposed, fresh statistics
        float* qt = buf.qt.data() + b * d * 16;
        const float* q_rows[16];  // (none: a lane past the tile's rows, zeros)
        start_rows(tile, g, b, buf.stats, q_rows);
        int64_t e0 = 0;
        for (; e0 + 16 <= d; e0 += 16) {  // 16 dims of the 16 rows at a time
          v16f block[16];
          for (int l = 0; l < 16; ++l) block[l] = q_rows[l] ? load16(q_rows[l] + e0) : v16f{};
          transpose16(block);
          for (int k = 0; k < 16; ++k) store16(qt + (e0 + k) * 16, block[k]);
        }
        for (int64_t e = e0; e < d; ++e) {
          for (int l = 0; l < 16; ++l) qt[e * 16 + l] = q_rows[l] ? q_rows[l][e] : 0.0f;
        }
        std::fill(buf.ot.begin() + b * d * 16, buf.ot.begin() + (b + 1) * d * 16, 0.0f);
      }
      for (int64_t page = lo_first / block_size; page <= last_page; ++page) {
        const int64_t page_start = page * block_size;
        const int64_t block = table[slot * table_stride + page];
        if (g == 0 && page < last_page) {
          prefetch_page(k_cache, v_cache, table[slot * table_stride + page + 1], block_size,
                        kv_stride);
        }
        const C* kp = k_cache + block * block_size * kv_stride + g * row;
        const C* vp = v_cache + block * block_size * kv_stride + g * row;
        const int64_t used = std::min(block_size, last - page_start + 1);
        for (int64_t j0 = 0; j0 < used; j0 += kChunk) {
          const int64_t n = std::min(kChunk, used - j0);
          // The chunk's keys and values as contiguous float rows (widened, or copied: rows a
          // head's size apart address from one register, where the cache's rows KV heads
          // apart took 16 and left float32 slower than bf16). A short chunk's missing keys
          // are masked below and never weigh a value.
          const float* keys = buf.keys.data();
          const float* values = buf.values.data();
          if constexpr (widen_pages) {
            llm_cpu_kv::widen_int8_rows(kp + j0 * kv_stride, kv_stride, d, n, buf.keys.data());
            llm_cpu_kv::widen_int8_rows(vp + j0 * kv_stride, kv_stride, d, n, buf.values.data());
          } else {
            widen_rows(kp + j0 * kv_stride, kv_stride, d, n, buf.keys.data());
            widen_rows(vp + j0 * kv_stride, kv_stride, d, n, buf.values.data());
          }
          const int64_t key0 = page_start + j0;
          for (int64_t b = 0; b < vectors; ++b) {
            if (sees_none(tile, b, key0, n)) continue;
            v16f s[kChunk];
            chunk_scores<kD>(buf.qt.data() + b * d * 16, keys, d, s);
            RowStats& st = buf.stats;
            const v16f correction = chunk_softmax(s, n, key0, st.row_pos[b], st.row_lo[b],
                                                  st.row_max[b], st.row_sum[b], fcap);
            chunk_values<kD>(buf.ot.data() + b * d * 16, correction, s, values, d, n);
          }
        }
      }
      for (int64_t b = 0; b < vectors; ++b) {  // each row's output, 16 dims at a time
        const v16f inv = 1.0f / buf.stats.row_sum[b];
        const float* ot = buf.ot.data() + b * d * 16;
        T* o_rows[16] = {};
        for (int64_t l = 0; l < 16 && b * 16 + l < rows; ++l) {
          const int64_t r = b * 16 + l, i = r / group, h = g * group + r % group;
          o_rows[l] = out_ptr + ((tile.start + i) * heads + h) * d;
        }
        int64_t e0 = 0;
        for (; e0 + 16 <= d; e0 += 16) {
          v16f block[16];
          for (int k = 0; k < 16; ++k) block[k] = load16(ot + (e0 + k) * 16) * inv;
          transpose16(block);
          for (int l = 0; l < 16; ++l) {
            if (o_rows[l]) store16(o_rows[l] + e0, block[l]);
          }
        }
        for (int64_t e = e0; e < d; ++e) {
          for (int l = 0; l < 16; ++l) {
            if (o_rows[l]) o_rows[l][e] = from_float<T>(ot[e * 16 + l] * inv[l]);
          }
        }
      }
    }
  };

#if LLM_CPU_AMX
  // 3c. A bf16 prompt tile on AMX tiles (tile_chunk_scores, tile_chunk_values): the matrix
  // form's loop and softmax, its two products as tile products, keys and values read from
  // the cache in place (a bf16 cache), or an int8 cache's codes as bf16 with their scales
  // apart (int8_key_tiles, a bf16 model's); pages of whole chunks.
  constexpr bool amx_cache = kVectorHead<kD> && (std::is_same_v<C, c10::BFloat16> ||
                                                 (widen_pages && std::is_same_v<T, c10::BFloat16>));
  const bool amx_rows = amx_cache && block_size % kChunk == 0 && llm_cpu_amx::request_tiles();
  struct TileRows {
    std::vector<uint32_t> qb;    // [vector][d / 32][256]: row_query_tiles
    std::vector<float> acc;      // [vector][16][d]
    std::vector<uint32_t> vb;    // [d / 16][128]: value_tiles
    std::vector<float> c;        // [16][16]
    std::vector<c10::BFloat16> pt;  // [16][16]
    std::vector<c10::BFloat16> kb;  // [16][d]: an int8 chunk's keys (int8_key_tiles)
    RowStats stats;
  };
  auto work_rows_amx = [&](const Tile& tile, TileRows& buf, int& tiles_config) {
    if constexpr (amx_cache) {
      if (tiles_config != kRowTiles) {
        configure_row_tiles();
        tiles_config = kRowTiles;
      }
      const int64_t slot = slots[tile.start];
      const int64_t first = pos[tile.start];
      const int64_t last = first + tile.len - 1;
      const int64_t rows = tile.len * group;
      const int64_t vectors = (rows + 15) / 16;
      const int64_t lo_first = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;
      const int64_t last_page = last / block_size;
      for (int64_t g = 0; g < kv_heads; ++g) {
        for (int64_t b = 0; b < vectors; ++b) {  // the rows' query tiles, fresh statistics
          const float* q_rows[16];  // (none: a lane past the tile's rows, zeros)
          start_rows(tile, g, b, buf.stats, q_rows);
          row_query_tiles<kD>(q_rows, buf.qb.data() + b * kD / 32 * 256);
          std::fill(buf.acc.begin() + b * 16 * kD, buf.acc.begin() + (b + 1) * 16 * kD, 0.0f);
        }
        for (int64_t page = lo_first / block_size; page <= last_page; ++page) {
          const int64_t page_start = page * block_size;
          const int64_t block = table[slot * table_stride + page];
          if (g == 0 && page < last_page) {
            prefetch_page(k_cache, v_cache, table[slot * table_stride + page + 1], block_size,
                          kv_stride);
          }
          const C* kp = k_cache + block * block_size * kv_stride + g * row;
          const C* vp = v_cache + block * block_size * kv_stride + g * row;
          const int64_t used = std::min(block_size, last - page_start + 1);
          for (int64_t j0 = 0; j0 < used; j0 += kChunk) {
            const int64_t n = std::min(kChunk, used - j0);
            const int64_t key0 = page_start + j0;
            bool loaded = false;  // the chunk's key tiles and value tiles
            float key_scale[kChunk], value_scale[kChunk];  // (an int8 chunk's)
            for (int64_t b = 0; b < vectors; ++b) {
              if (sees_none(tile, b, key0, n)) continue;
              if (!loaded) {
                if constexpr (widen_pages) {
                  int8_key_tiles<kD>(kp + j0 * kv_stride, kv_stride, n, buf.kb.data(),
                                     key_scale);
                  int8_value_tiles<kD>(vp + j0 * kv_stride, kv_stride, n, buf.vb.data(),
                                       value_scale);
                } else {
                  load_key_tiles<kD>(kp + j0 * kv_stride, kv_stride);
                  value_tiles<kD>(vp + j0 * kv_stride, kv_stride, n, buf.vb.data());
                }
                loaded = true;
              }
              v16f s[kChunk];
              tile_chunk_scores<kD>(buf.qb.data() + b * kD / 32 * 256, buf.c.data(), s);
              if constexpr (widen_pages) {
                for (int64_t j = 0; j < kChunk; ++j) s[j] *= key_scale[j];
              }
              RowStats& st = buf.stats;
              const v16f correction = chunk_softmax(s, n, key0, st.row_pos[b], st.row_lo[b],
                                                    st.row_max[b], st.row_sum[b], fcap);
              if constexpr (widen_pages) {
                for (int64_t j = 0; j < kChunk; ++j) s[j] *= value_scale[j];
              }
              tile_chunk_values<kD>(buf.acc.data() + b * 16 * kD, correction, s,
                                    buf.vb.data(), buf.pt.data(), buf.c.data());
            }
          }
        }
        for (int64_t b = 0; b < vectors; ++b) {  // each row's output
          const v16f inv = 1.0f / buf.stats.row_sum[b];
          for (int64_t l = 0; l < 16 && b * 16 + l < rows; ++l) {
            const int64_t r = b * 16 + l, i = r / group, h = g * group + r % group;
            store_row(buf.acc.data() + (b * 16 + l) * kD, inv[l], kD,
                      out_ptr + ((tile.start + i) * heads + h) * d);
          }
        }
      }
    }
  };
#endif

  // Units taken one at a time as the threads go: a prompt's last tiles read many more keys
  // than its first. The vector loop's buffers are the thread's own from call to call (work
  // fills what it reads): fresh zeroed ones had cost a decode's every layer ~100 KB of memset
  // a thread. The matrix forms' are made when a thread first takes one of their tiles.
  const int64_t num_units = static_cast<int64_t>(units.size());
  llm_cpu_work::parallel_queue(num_units, 1, llm_cpu_work::Order::kShared,
                               [&](llm_cpu_work::WorkQueue& queue, int64_t w) {
    const int64_t rows = tile_len * heads;
    const int64_t score_floats = std::max<int64_t>(group, 1) * (block_size + kScorePad);
    const int64_t page_floats = std::is_same_v<C, float> ? 0 : 2 * block_size * d;
    thread_local std::vector<float> scratch;
    const int64_t scratch_floats = rows * d + 2 * rows + score_floats + page_floats;
    if (static_cast<int64_t>(scratch.size()) < scratch_floats) scratch.resize(scratch_floats);
    float* acc = scratch.data();
    float* row_max = acc + rows * d;
    float* row_sum = row_max + rows;
    float* scores = row_sum + rows;
    float* page_kv = scores + score_floats;
    int tiles_config = kNoTiles;  // how this thread's tiles are configured
    std::unique_ptr<RowBuffers> buf;
#if LLM_CPU_AMX
    std::unique_ptr<TileRows> tile_buf;
#endif
    for (int64_t first, last; queue.take(w, first, last);) {
      const Unit& u = units[first];
      if (u.matrix) {
#if LLM_CPU_AMX
        if (amx_rows) {
          if (!tile_buf) {
            tile_buf.reset(new TileRows{std::vector<uint32_t>(max_vectors * d / 32 * 256),
                                        std::vector<float>(max_vectors * 16 * d),
                                        std::vector<uint32_t>(d / 16 * 128),
                                        std::vector<float>(256),
                                        std::vector<c10::BFloat16>(256),
                                        std::vector<c10::BFloat16>(widen_pages ? kChunk * d : 0),
                                        make_stats()});
          }
          work_rows_amx(tiles[u.tile], *tile_buf, tiles_config);
          continue;
        }
#endif
        if (!buf) {
          buf.reset(new RowBuffers{std::vector<float>(max_vectors * d * 16),
                                   std::vector<float>(max_vectors * d * 16),
                                   std::vector<float>(kChunk * d), std::vector<float>(kChunk * d),
                                   make_stats()});
        }
        work_rows(tiles[u.tile], *buf);
      } else {
        work(u, acc, row_max, row_sum, scores, page_kv, tiles_config);
      }
    }
#if LLM_CPU_AMX
    if (tiles_config != kNoTiles) _tile_release();  // as found, for oneDNN's and our products
#endif
  });
}

template <typename F>
void dispatch_float_types(at::ScalarType type, const char* name, F&& f) {
  switch (type) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, name, ": float32, bfloat16 or float16, not ", type);
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor& kv_cache, const at::Tensor& block_table,
                           const at::Tensor& token_slots, const at::Tensor& positions,
                           const at::Tensor& cos_table, const at::Tensor& sin_table,
                           double scale, int64_t window, double softcap,
                           const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(softcap >= 0.0, "paged_attention: softcap must be positive (0: none)");
  const bool has_sinks = sinks.has_value() && sinks->defined();
  TORCH_CHECK(!has_sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                             sinks->dim() == 1 && sinks->size(0) == q.size(1)),
              "sinks: contiguous float32 [heads]");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v: [tokens, heads, dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(),
              "kv_cache: contiguous [2, blocks, block_size, kv_heads, row]");
  const int64_t d = q.size(2), kv_heads = k.size(1);
  // The cache's format (kv_formats.h): q's dtype, or an 8-bit one whose rows carry its extra
  // bytes.
  const at::ScalarType cache_type = kv_cache.scalar_type();
  TORCH_CHECK(cache_type == q.scalar_type() || cache_type == at::kChar ||
                  cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2,
              "kv_cache: the model's dtype, int8, float8_e4m3fn or float8_e5m2, not ",
              cache_type);
  const int64_t row = d + (cache_type == at::kChar ? llm_cpu_kv::Int8Rows::kExtra : 0);
  TORCH_CHECK(k.size(2) == d && v.size(2) == d && v.size(1) == kv_heads &&
                  kv_cache.size(3) == kv_heads && kv_cache.size(4) == row && d % 2 == 0,
              "q, k, v and kv_cache disagree on heads or head size (an int8 cache's rows: "
              "head size + 2)");
  TORCH_CHECK(kv_heads > 0 && q.size(1) % kv_heads == 0,
              "query heads must be a multiple of KV heads");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) &&
                  token_slots.numel() == q.size(0) && positions.numel() == q.size(0),
              "q, k, v, token_slots and positions disagree on the number of tokens");
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == d, "q, k, v: each token's heads contiguous");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "q, k, v: one dtype");
  }
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1,
              "block_table: int32 rows");
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  token_slots.is_contiguous() && positions.is_contiguous(),
              "token_slots, positions: contiguous int64");
  TORCH_CHECK(cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat &&
                  cos_table.is_contiguous() && sin_table.is_contiguous() &&
                  cos_table.dim() == 2 && cos_table.sizes() == sin_table.sizes() &&
                  cos_table.size(-1) == d && sin_table.size(-1) == d,
              "cos, sin: contiguous float32 [max_len, dim]");
  at::Tensor out = at::empty({q.size(0), q.size(1), d}, q.options());
  if (q.size(0) == 0) return out;
  dispatch_float_types(q.scalar_type(), "paged_attention", [&](auto tag) {
    using T = decltype(tag);
    auto with_format = [&](auto format) {
      using F = decltype(format);
      auto run = [&](auto head_size) {
        attention_kernel<T, F, decltype(head_size)::value>(
            q, k, v, kv_cache, block_table, token_slots, positions, cos_table, sin_table, scale,
            window, softcap, has_sinks ? sinks->data_ptr<float>() : nullptr, out);
      };
      if (d == 64) {
        run(std::integral_constant<int64_t, 64>{});
      } else if (d == 128) {
        run(std::integral_constant<int64_t, 128>{});
      } else {
        run(std::integral_constant<int64_t, 0>{});
      }
    };
    switch (cache_type) {
      case at::kChar: with_format(llm_cpu_kv::Int8Rows{}); break;
      case at::kFloat8_e4m3fn: with_format(llm_cpu_kv::E4M3Rows{}); break;
      case at::kFloat8_e5m2: with_format(llm_cpu_kv::E5M2Rows{}); break;
      default: with_format(T{});
    }
  });
  return out;
}

// ---------------------------------------------------------------- elementwise

// out = weight * (x / rms(x)), the statistics in float32 (Hugging Face's RMSNorm). With
// `residual`: x += residual first, in place, and the norm is of the sum. Offset (Gemma's
// norm, weights stored as w - 1): out = (x / rms(x)) * (1 + w) in float32, rounded once.
template <typename T, bool Offset = false>
void rms_norm_kernel(T* x, const T* residual, const T* weight, T* out, int64_t rows,
                     int64_t width, float eps) {
  llm_cpu_work::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(width);
    const int64_t whole = width / 16 * 16;  // 16 lanes at a time (the rounding too), then one
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * width;
      v16f squares16 = {};
      if (residual != nullptr) {
        const T* rr = residual + r * width;
        for (int64_t e = 0; e < whole; e += 16) {
          const v16f sum = round16<T>(load16(xr + e) + load16(rr + e));  // rounded as x + y
          store16(xr + e, sum);
          store16(row.data() + e, sum);
          squares16 += sum * sum;
        }
        for (int64_t e = whole; e < width; ++e) {
          const T sum = from_float<T>(to_float(xr[e]) + to_float(rr[e]));
          xr[e] = sum;
          row[e] = to_float(sum);
        }
      } else {
        for (int64_t e = 0; e < whole; e += 16) {
          const v16f v = load16(xr + e);
          store16(row.data() + e, v);
          squares16 += v * v;
        }
        for (int64_t e = whole; e < width; ++e) row[e] = to_float(xr[e]);
      }
      float squares = 0.0f;
      for (int l = 0; l < 16; ++l) squares += squares16[l];
      for (int64_t e = whole; e < width; ++e) squares += row[e] * row[e];
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(width) + eps);
      T* o = out + r * width;
      if constexpr (Offset) {  // (x * inv) * (1 + w) in float32, rounded once
        for (int64_t e = 0; e < whole; e += 16) {
          store16(o + e, (load16(row.data() + e) * inv) * (load16(weight + e) + 1.0f));
        }
        for (int64_t e = whole; e < width; ++e) {
          o[e] = from_float<T>((row[e] * inv) * (to_float(weight[e]) + 1.0f));
        }
      } else {  // x.to(dtype) first, then the product in the dtype, as Hugging Face rounds
        for (int64_t e = 0; e < whole; e += 16) {
          store16(o + e, load16(weight + e) * round16<T>(load16(row.data() + e) * inv));
        }
        for (int64_t e = whole; e < width; ++e) {
          o[e] = from_float<T>(to_float(weight[e]) * to_float(from_float<T>(row[e] * inv)));
        }
      }
    }
  });
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.dim() == 2 &&
                  weight.dim() == 1 && weight.size(0) == x.size(1),
              "rms_norm: contiguous x [rows, width] and weight [width]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight of one dtype");
}

template <bool Offset>
at::Tensor rms_norm_of(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  at::Tensor out = at::empty_like(x);
  dispatch_float_types(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_kernel<T, Offset>(x.data_ptr<T>(), nullptr, weight.data_ptr<T>(),
                               out.data_ptr<T>(), x.size(0), x.size(1),
                               static_cast<float>(eps));
  });
  return out;
}

template <bool Offset>
at::Tensor add_rms_norm_of(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                           double eps) {
  check_norm(x, weight);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual of x's shape and dtype, contiguous");
  at::Tensor out = at::empty_like(x);
  dispatch_float_types(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_kernel<T, Offset>(x.data_ptr<T>(), residual.data_ptr<T>(), weight.data_ptr<T>(),
                               out.data_ptr<T>(), x.size(0), x.size(1),
                               static_cast<float>(eps));
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_of<false>(x, weight, eps);
}

at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  return add_rms_norm_of<false>(x, residual, weight, eps);
}

at::Tensor rms_norm_offset(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_of<true>(x, weight, eps);
}

at::Tensor add_rms_norm_offset(at::Tensor& x, const at::Tensor& residual,
                               const at::Tensor& weight, double eps) {
  return add_rms_norm_of<true>(x, residual, weight, eps);
}

// The gated MLPs' activations, on 16 lanes and on one (a row's tail), in float32: one exp
// each (exp_clamped is exp16's polynomial on one lane: the same bits).
struct Silu {
  static v16f lanes(v16f x) { return x / (1.0f + exp16(v16f{} - x)); }
  static float one(float x) { return x / (1.0f + exp_clamped(-x)); }
};
// gelu with tanh's approximation (gelu_pytorch_tanh: Gemma's), 0.5 x (1 + tanh(u)) with
// u = sqrt(2 / pi) (x + 0.044715 x^3), written as its equal x / (1 + exp(-2u)): SiLU's exp,
// and no cancellation in 1 + tanh(u) where u is negative.
struct GeluTanh {
  static constexpr float kMinus2Beta = -2.0f * 0.7978845608028654f, kKappa = 0.044715f;
  static v16f lanes(v16f x) {
    return x / (1.0f + exp16((x + kKappa * x * x * x) * kMinus2Beta));
  }
  static float one(float x) {
    return x / (1.0f + exp_clamped((x + kKappa * x * x * x) * kMinus2Beta));
  }
};

// [rows, 2 * width] (gate, then up) -> act(gate) * up, [rows, width]; rounded as
// F.silu(gate) * up (F.gelu(gate, approximate="tanh") * up) rounds: the activation to the
// dtype, then the product.
// interleaved: a row's gate and up columns come 16 of each in turn (amx.py
// interleave_gate_up's order, as a fused gate/up product writes them without its activation).
template <typename Act>
at::Tensor act_and_mul(const at::Tensor& x, const char* name, bool interleaved = false) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              name, ": contiguous [rows, 2 * width]");
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  TORCH_CHECK(!interleaved || width % 16 == 0, name, ": interleaved gate and up columns come "
              "16 at a time; ", width, " is not a multiple of 16");
  at::Tensor out = at::empty({rows, width}, x.options());
  dispatch_float_types(x.scalar_type(), name, [&](auto tag) {
    using T = decltype(tag);
    const T* in = x.data_ptr<T>();
    T* o = out.data_ptr<T>();
    llm_cpu_work::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* g = in + r * 2 * width;
        const T* u = g + width;
        T* orow = o + r * width;
        if (interleaved) {
          for (int64_t e = 0; e < width; e += 16) {
            store16(orow + e, round16<T>(Act::lanes(load16(g + 2 * e))) * load16(g + 2 * e + 16));
          }
          continue;
        }
        int64_t e = 0;
        for (; e + 16 <= width; e += 16) {  // exp and both roundings on 16 lanes
          store16(orow + e, round16<T>(Act::lanes(load16(g + e))) * load16(u + e));
        }
        for (; e < width; ++e) {
          const float gate = Act::one(to_float(g[e]));
          orow[e] = from_float<T>(to_float(from_float<T>(gate)) * to_float(u[e]));
        }
      }
    });
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x, bool interleaved) {
  return act_and_mul<Silu>(x, "silu_and_mul", interleaved);
}

at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  return act_and_mul<GeluTanh>(x, "gelu_tanh_and_mul");
}


// ---------------------------------------------------------------- greedy sampling

// The index of each row's largest value, as torch.argmax gives it (the first of equal
// maxima; a NaN counts as larger than any number, the first NaN wins), read from bf16 or
// fp16 rows as they are: a greedy step needs no float32 copy of its logits.
struct Best {
  float value;
  int64_t index;
  bool nan;
};

// The best of x[begin, end) (begin < end): 16 lanes keep their running maximum and where it
// was first seen; the lanes' winner is the largest, the first of equal ones.
template <typename T>
Best best_of(const T* x, int64_t begin, int64_t end) {
  const v16i lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  Best best{to_float(x[begin]), begin, false};
  int64_t e = begin + 1;
  if (end - begin >= 32) {
    v16f top = load16(x + begin);
    v16i at = lanes + static_cast<int32_t>(begin);
    v16i nan = top != top;
    for (e = begin + 16; e + 16 <= end; e += 16) {
      const v16f v = load16(x + e);
      const v16i larger = v > top;
      top = larger ? v : top;
      at = larger ? lanes + static_cast<int32_t>(e) : at;
      nan |= v != v;
    }
    bool any_nan = false;
    for (int l = 0; l < 16; ++l) any_nan |= nan[l] != 0;
    if (any_nan) e = begin;  // the scalar loop below finds the first
    best = {top[0], at[0], false};
    for (int l = 1; l < 16; ++l) {
      if (top[l] > best.value || (top[l] == best.value && at[l] < best.index)) {
        best = {top[l], at[l], false};
      }
    }
  }
  if (best.value != best.value) return {best.value, best.index, true};  // (x[begin])
  for (; e < end; ++e) {
    const float f = to_float(x[e]);
    if (f != f) return {f, e, true};
    if (f > best.value) best = {f, e, false};
  }
  return best;
}

// ---------------------------------------------------------------- draws

// lowbias32 (sampler.py's hash32), on a uint32_t or on vector lanes of them.
template <typename V>
inline V hash32(V x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x5BD1E995u;
  return x ^ (x >> 16);
}

// Each row's draw from softmax(x / temperature) by the exponential race (sampler.py): the
// token maximising x_t / T - log(E_t), E_t = -log(u_t) the Exp(1) noise of seeded_exponential,
// u_t from hash32(key ^ hashed_vocab[t]) with the row's key from (seed, position). The same
// noise and the same race as sampler.py's float path, in one pass over the logits, 16 lanes
// at a time: no softmax (the race needs none in log form) and no [X, V] temporaries, whose
// fresh pages and torch's Exp(1) generator took ~80 ms a step at 64 rows of 49,152.
// Rows are independent of each other (the pool shares them out).
at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& temperature,
                       const at::Tensor& seeds, const at::Tensor& positions,
                       const at::Tensor& hashed_vocab) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "sample_rows: rows of logits, contiguous");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && seeds.scalar_type() == at::kLong &&
                  positions.scalar_type() == at::kLong && hashed_vocab.scalar_type() == at::kInt,
              "sample_rows: float temperatures, int64 seeds and positions, the hashed "
              "vocabulary's 32 bits as int32");
  TORCH_CHECK(temperature.numel() == rows && seeds.numel() == rows && positions.numel() == rows &&
                  hashed_vocab.numel() >= n, "sample_rows: one temperature, seed and position "
              "a row, a hashed id a token");
  const at::Tensor t = temperature.contiguous(), sd = seeds.contiguous(),
                   ps = positions.contiguous();
  const at::Tensor hv = hashed_vocab.contiguous();
  const float* t_ptr = t.data_ptr<float>();
  const int64_t* sd_ptr = sd.data_ptr<int64_t>();
  const int64_t* ps_ptr = ps.data_ptr<int64_t>();
  const uint32_t* hv_ptr = reinterpret_cast<const uint32_t*>(hv.data_ptr<int32_t>());
  at::Tensor out = at::empty({rows}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  typedef uint32_t v16u __attribute__((vector_size(64)));
  dispatch_float_types(x.scalar_type(), "sample_rows", [&](auto tag) {
    using T = decltype(tag);
    const T* data = x.data_ptr<T>();
    llm_cpu_work::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const uint64_t seed = static_cast<uint64_t>(sd_ptr[r]);
        const uint32_t lo = static_cast<uint32_t>(seed), hi = static_cast<uint32_t>(seed >> 32);
        const uint32_t key = hash32<uint32_t>(
            lo ^ hash32<uint32_t>(hi ^ hash32<uint32_t>(static_cast<uint32_t>(ps_ptr[r]))));
        const float inv_t = 1.0f / std::max(t_ptr[r], 1e-6f);
        const T* row = data + r * stride;
        auto score = [&](float logit, uint32_t hashed) {  // one token, as the lanes below
          const uint32_t bits = hash32<uint32_t>(key ^ hashed);
          const float u = (static_cast<float>(bits >> 8) + 0.5f) * (1.0f / 16777216.0f);
          return logit * inv_t - std::log(-std::log(u));
        };
        float best = -std::numeric_limits<float>::infinity();
        int64_t at = 0;
        int64_t e = 0;
        if (n >= 16) {
          const v16i lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
          const v16f scale = v16f{} + inv_t;
          v16f top = v16f{} - std::numeric_limits<float>::infinity();
          v16i where = {};
          for (; e + 16 <= n; e += 16) {
            v16u h;
            std::memcpy(&h, hv_ptr + e, sizeof h);
            const v16u bits = hash32<v16u>(h ^ key);
            const v16f u = (__builtin_convertvector(bits >> 8, v16f) + 0.5f) *
                           (1.0f / 16777216.0f);
            const v16f noise = llm_cpu_vec::log_lanes<v16f, v16i>(
                v16f{} - llm_cpu_vec::log_lanes<v16f, v16i>(u));  // log E
            const v16f s = load16(row + e) * scale - noise;
            const v16i larger = s > top;
            top = larger ? s : top;
            where = larger ? lanes + static_cast<int32_t>(e) : where;
          }
          for (int l = 0; l < 16; ++l) {
            if (top[l] > best || (top[l] == best && where[l] < at)) {
              best = top[l];
              at = where[l];
            }
          }
        }
        for (; e < n; ++e) {
          const float s = score(to_float(row[e]), hv_ptr[e]);
          if (s > best) {
            best = s;
            at = e;
          }
        }
        o[r] = at;
      }
    });
  });
  return out;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: [rows, n > 0] with contiguous rows");
  TORCH_CHECK(x.size(1) < (int64_t{1} << 31), "argmax_rows: rows of fewer than 2^31 values");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  if (rows == 0) return out;
  // A row in parts (multiples of 16 values) when there are fewer rows than threads.
  const int64_t threads = at::get_num_threads();
  const int64_t parts = rows >= threads ? 1 : std::min((threads + rows - 1) / rows,
                                                       std::max<int64_t>(1, n / 4096));
  const int64_t span = (n / parts + 15) / 16 * 16;
  std::vector<Best> found(rows * parts, Best{0.0f, -1, false});
  dispatch_float_types(x.scalar_type(), "argmax_rows", [&](auto tag) {
    using T = decltype(tag);
    const T* data = x.data_ptr<T>();
    llm_cpu_work::parallel_for(0, rows * parts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t r = t / parts, lo = (t % parts) * span, hi = std::min(n, lo + span);
        if (lo < hi) found[t] = best_of(data + r * stride, lo, hi);
      }
    });
  });
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    Best best = found[r * parts];
    for (int64_t p = 1; p < parts && !best.nan; ++p) {
      const Best& b = found[r * parts + p];
      if (b.index >= 0 && (b.nan || b.value > best.value)) best = b;
    }
    o[r] = best.index;
  }
  return out;
}

// The chunks a WorkQueue (work_queue.h) of n units in `runs` runs hands out, taken one after
// another by the threads of runs `selves` (one take each): [len(selves), 2] int64 of
// (begin, end), (-1, -1) where none was left. For the queue's tests.
at::Tensor work_queue_takes(int64_t n, int64_t grain, int64_t runs, c10::IntArrayRef selves) {
  llm_cpu_work::WorkQueue queue(n, grain, runs);
  at::Tensor out = at::empty({static_cast<int64_t>(selves.size()), 2}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (size_t i = 0; i < selves.size(); ++i) {
    int64_t begin = -1, end = -1;
    if (!queue.take(selves[i], begin, end)) begin = end = -1;
    o[2 * i] = begin;
    o[2 * i + 1] = end;
  }
  return out;
}

// How many times llm_cpu_work::parallel_for (work_pool.h) visited each of n units in chunks of at
// least `grain`, over `repeats` calls one after another, and which pool threads took part: int64
// [n + 1], the counts, then the number of calls a helper (not the caller) took a chunk in. A unit
// whose index is `fail_at` raises in whichever thread takes it. With `wait_for_helper`, the
// caller holds each call open in unit 0 (if it takes it) until a helper has taken a chunk, or
// for 20 s. For the pool's tests.
at::Tensor work_pool_visits(int64_t n, int64_t grain, int64_t repeats, int64_t fail_at,
                            bool wait_for_helper) {
  std::vector<std::atomic<int64_t>> counts(n);
  std::atomic<int64_t> helped{0};
  const auto caller = std::this_thread::get_id();
  for (int64_t r = 0; r < repeats; ++r) {
    std::atomic<bool> by_helper{false};
    llm_cpu_work::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      if (std::this_thread::get_id() != caller) by_helper = true;
      if (wait_for_helper && begin == 0 && std::this_thread::get_id() == caller) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (!by_helper.load() && std::chrono::steady_clock::now() < until)
          std::this_thread::yield();
      }
      for (int64_t u = begin; u < end; ++u) {
        TORCH_CHECK(u != fail_at, "unit ", u, " failed");
        for (volatile int spin = 0; spin < 1000; spin = spin + 1) {
        }  // (a unit's work: ~1 us, long enough for a helper to come)
        counts[u].fetch_add(1, std::memory_order_relaxed);
      }
    });
    helped += by_helper.load();
  }
  at::Tensor out = at::empty({n + 1}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t u = 0; u < n; ++u) o[u] = counts[u].load();
  o[n] = helped.load();
  return out;
}

}  // namespace

TORCH_LIBRARY(llm_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor block_table, "
        "Tensor token_slots, Tensor positions, Tensor cos, Tensor sin, float scale, "
        "int window, float softcap=0.0, Tensor? sinks=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor residual, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_offset(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_offset(Tensor(a!) x, Tensor residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x, bool interleaved=False) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("sample_rows(Tensor x, Tensor temperature, Tensor seeds, Tensor positions, "
        "Tensor hashed_vocab) -> Tensor");
  m.def("work_queue_takes(int n, int grain, int runs, int[] selves) -> Tensor",
        &work_queue_takes);
  m.def("work_pool_visits(int n, int grain, int repeats, int fail_at, bool wait_for_helper) "
        "-> Tensor",
        &work_pool_visits);
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) {
  m.impl("paged_attention", TORCH_FN(paged_attention));
  m.impl("rms_norm", TORCH_FN(rms_norm));
  m.impl("add_rms_norm", TORCH_FN(add_rms_norm));
  m.impl("rms_norm_offset", TORCH_FN(rms_norm_offset));
  m.impl("add_rms_norm_offset", TORCH_FN(add_rms_norm_offset));
  m.impl("silu_and_mul", TORCH_FN(silu_and_mul));
  m.impl("gelu_tanh_and_mul", TORCH_FN(gelu_tanh_and_mul));
  m.impl("argmax_rows", TORCH_FN(argmax_rows));
  m.impl("sample_rows", TORCH_FN(sample_rows));
}
