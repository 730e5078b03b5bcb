// Quantized linear layers of the CPU forward: y = x W^T (+ b) with W kept in blocks of 32
// along K, each block an unsigned code per weight and two fp16 numbers, d and mn:
//     w = d * code + mn
// with codes of 8, 5 or 4 bits, which holds llama.cpp's Q8_0 (code = q + 128, mn = -128 d),
// Q5_0 (mn = -16 d), Q5_1 and Q4_1 (mn = m), Q4_0 (mn = -8 d) and, a sub-block each, Q4_K and
// Q5_K exactly (stages/executor/linear/gguf_blocks.py), and the int8/int4 weights quantized at
// load (stages/executor/linear/quantized.py). Registered as
// torch.ops.llm_cpu.quantized_linear; built with cpu_kernels.cpp by kernels.py.
//
// The activations are quantized on the fly per block of 32, in two int8 parts with one float
// scale dx = amax / 127: x = dx (hi + lo / 256), hi = round(x / dx), lo the rounded remainder
// in 256ths. One int8 part alone (llama.cpp's Q8_1) measured a mean |delta log-prob| of 0.055
// on the default model from the activations alone; with the second part the activations are
// good to about 16 bits and what is left is the weights' own rounding. Each block's products
// are integer dot products (AVX512-VNNI's vpdpbusd: unsigned weight code times signed
// activation, four at a time into int32), the hi part's shifted by 8 bits before the lo
// part's are added (no overflow: |4 * 255 * 127| << 8 < 2^31):
//     y[m, n] = sum_b  d[n,b] dx[m,b] / 256 sum_i code[n,b,i] (256 hi + lo)[m,b,i]
//               + mn[n,b] sx[m,b]
// where sx = the block's sum of x (for the offset term).
//
// Layout: K is padded to a multiple of 64 (a pair of blocks; padded blocks have d = mn = 0).
// Within each pair the 64 values are interleaved four at a time: b0[0:4], b1[0:4], b0[4:8],
// b1[4:8], ... so that the 16 int32 lanes of one pair's dot product (four values each)
// alternate b0, b1, b0, b1: the pair's two fp16 scales, broadcast, are its lanes' scales.
// int8 codes are 64 bytes in that order; int4 codes are 32 bytes, positions 0..31 in the low
// nibbles and 32..63 in the high ones (a mask and a shift unpack them); 5-bit codes are int4's
// low four bits plus their fifth bits, a bit a position (a mask register adds 16 where set).
//
// The weight is one buffer in the order the kernel reads it ("tile-major"): tiles of 4 output
// rows (N padded to a multiple of 4 with zero rows), and in each tile, pair after pair, a
// chunk of the 4 rows' codes (4 x 64 or 4 x 32 bytes), at 5 bits their fifth bits (per pair
// of rows 2v, 2v + 1: a 64-bit mask of positions 0..31 of both rows, row 2v in the low 32
// bits, then one of positions 32..63), their d (4 rows x 2 blocks, fp16) and their mn (the
// same): 288 bytes a pair in int8, 192 at 5 bits, 160 in int4. A run of tiles is then one
// contiguous stream (the rows' separate streams of a row-major layout measured ~13 GB/s at one
// token, against oneDNN's ~20 on its own packed layout), and the offset term is summed in the
// same pass.
//
// Work: tiles of 4 output rows by up to 4 tokens; each of torch's threads runs its own share
// of the tiles a chunk at a time, then chunks from the back of another's (work_queue.h). A
// weight byte is read once per 4 tokens; at one token (decode) the loop streams the weights,
// and is bound by the memory's bandwidth (see tile: the prefetch distance, and int4's two
// rows a vector).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LLM_CPU_QUANT 1
#include <immintrin.h>
#else
#define LLM_CPU_QUANT 0
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "moe_routes.h"
#include "vector_math.h"
#include "work_queue.h"

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPair = 64;
constexpr int64_t kRows = 4;  // output rows per tile

using llm_cpu_work::grain_for;
using llm_cpu_work::Order;
using llm_cpu_work::parallel_queue;
using llm_cpu_work::WorkQueue;

// Bytes of one row's codes in a pair's chunk: 64 at 8 bits, 32 (the low four bits) at 4 and 5.
constexpr int64_t code_bytes(int bits) { return bits == 8 ? kPair : kPair / 2; }
// Bytes of 5-bit codes' fifth bits in a chunk: per pair of rows, two 64-bit masks.
constexpr int64_t fifth_bytes(int bits) { return bits == 5 ? 32 : 0; }
// Bytes of one pair's chunk of a tile: the 4 rows' codes, at 5 bits their fifth bits, then
// their d and mn (fp16 x 2 x 4).
constexpr int64_t chunk_bytes(int bits) {
  return kRows * code_bytes(bits) + fifth_bytes(bits) + 32;
}

#if LLM_CPU_QUANT
constexpr int64_t kTokens = 4;  // tokens per tile

inline float load_float(float x) { return x; }
inline float load_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Position of element i (0..31) of block `half` (0 or 1) inside its pair.
inline int64_t pair_offset(int64_t half, int64_t i) {
  return 8 * (i / 4) + 4 * half + (i & 3);
}

// x [M, K] quantized per block: hi and lo [M, Kp] (pair order), lanes [M, P, 16] (each
// pair's two scales dx / 256 spread over the int32 lanes its dot product fills), sx
// [M, Kp / 32].
struct Activations {
  int64_t kp, pairs;
  std::vector<int8_t> hi, lo;
  std::vector<float> lanes, sx;
};

template <typename T>
Activations quantize_activations(const T* x, int64_t m_rows, int64_t k, int64_t kp) {
  Activations a{kp, kp / kPair, std::vector<int8_t>(m_rows * kp), std::vector<int8_t>(m_rows * kp),
                std::vector<float>(m_rows * (kp / kPair) * 16),
                std::vector<float>(m_rows * (kp / kBlock))};
  const int64_t blocks = kp / kBlock;
  llm_cpu_work::parallel_for(0, m_rows, 16, [&](int64_t begin, int64_t end) {
    float v[kBlock];
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        float amax = 0.f;
        for (int64_t i = 0; i < kBlock; ++i) {
          const int64_t col = b * kBlock + i;
          v[i] = col < k ? load_float(x[m * k + col]) : 0.f;
          amax = std::max(amax, std::fabs(v[i]));
        }
        const float d = amax / 127.f;
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int8_t* hi = a.hi.data() + m * kp + (b / 2) * kPair;
        int8_t* lo = a.lo.data() + m * kp + (b / 2) * kPair;
        float sum = 0.f;
        for (int64_t i = 0; i < kBlock; ++i) {
          const float scaled = v[i] * inv;
          const float h = std::nearbyint(scaled);
          const float l = std::clamp(std::nearbyint((scaled - h) * 256.f), -127.f, 127.f);
          hi[pair_offset(b & 1, i)] = static_cast<int8_t>(h);
          lo[pair_offset(b & 1, i)] = static_cast<int8_t>(l);
          sum += v[i];
        }
        a.sx[m * blocks + b] = sum;
        float* lanes = a.lanes.data() + (m * a.pairs + b / 2) * 16;
        for (int lane = 0; lane < 16; ++lane) {
          if ((lane & 1) == (b & 1)) lanes[lane] = d / 256.f;
        }
      }
    }
  });
  return a;
}

// Where a chunk's scales go in a vector of the kernel's: d of the chunk's 4 rows (r0 b0, r0 b1,
// r1 b0, ..., fp16) widened once to 8 floats, then each vector's lanes take their row's pair
// b0, b1, b0, b1, ...: int8 has one row a vector; int4 rows 2v and 2v + 1 in the low and high
// 8 lanes of vector v (see tile).
template <int kBits>
inline __m512i scale_lanes(int64_t vector) {
  alignas(64) int32_t index[16];
  for (int lane = 0; lane < 16; ++lane) {
    const int64_t row = kBits == 8 ? vector : 2 * vector + lane / 8;
    index[lane] = static_cast<int32_t>(2 * row + (lane & 1));
  }
  return _mm512_load_si512(index);
}

struct Weights {
  const uint8_t* tiles;  // [ceil(N / 4), pairs * chunk_bytes]
  int64_t n, pairs;
};

// Sum of lanes [8 half, 8 half + 8) of v.
inline float reduce_half(__m512 v, int half) {
  const __m256 h = half == 0 ? _mm512_castps512_ps256(v)
                              : _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 s = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// out[t][r] = y[m0 + t, 4 tile + r] without the bias, for T tokens (`first`: the tile's first
// pass over the tokens, which prefetches).
//
// int8: a row's 64 codes of a pair are one vector, dotted with the pair's 64 activations.
// int4 and 5 bits: the 64 bytes of rows 2v and 2v + 1 are one load; their low nibbles are both rows'
// positions 0..31 (row 2v in the low 32 bytes), their high nibbles positions 32..63. Dotted
// with the activations' positions 0..31 and 32..63 each broadcast to both halves, the two
// products sum into one vector whose low 8 lanes are row 2v's and high 8 lanes row 2v + 1's:
// no shuffle to unpack, and one float rescale for two rows (the 30 layers and head at one
// token: 4.0 -> 3.6 ms against a row a vector).
template <int kBits, int T>
void tile(const Weights& w, const Activations& a, int64_t tile_index, int64_t m0, bool first,
          float* out) {
  constexpr int64_t kChunk = chunk_bytes(kBits);
  constexpr int64_t kCodes = code_bytes(kBits);
  constexpr int64_t kScales = kRows * kCodes + fifth_bytes(kBits);  // where d and mn start
  constexpr int64_t kVectors = kBits == 8 ? kRows : kRows / 2;
  // Bytes prefetched ahead into L2 on a tile's first pass over its tokens (the stream runs on
  // past the tile's end; later passes find the tile in cache). Six chunks ahead into L1 (1.0 KB
  // at 4 bits) was too near for DRAM's latency: at one token, 8 KB into L2 took int4's 30
  // layers and head from 5.2 to 4.0 ms and int8's by ~10%, a stream then within ~10% of a
  // loop that only loads the same bytes.
  constexpr int64_t kAhead = 8192;
  const uint8_t* chunk = w.tiles + tile_index * w.pairs * kChunk;
  __m512 acc[T][kVectors];
  __m256 offset[T];
  for (int t = 0; t < T; ++t) {
    for (int64_t v = 0; v < kVectors; ++v) acc[t][v] = _mm512_setzero_ps();
    offset[t] = _mm256_setzero_ps();
  }
  __m512i lanes[kVectors];
  for (int64_t v = 0; v < kVectors; ++v) lanes[v] = scale_lanes<kBits>(v);
  const __m512i zero = _mm512_setzero_si512();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i sixteen = _mm512_set1_epi8(0x10);
  for (int64_t p = 0; p < a.pairs; ++p, chunk += kChunk) {
    for (int64_t line = 0; first && line < kChunk; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(chunk + kAhead + line), _MM_HINT_T1);
    const __m512 d = _mm512_castps256_ps512(_mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + kScales))));
    __m512i low[kVectors], high[kVectors];  // 4, 5 bits: positions 0..31 and 32..63; 8: low
    __m512 scales[kVectors];
    for (int64_t v = 0; v < kVectors; ++v) {
      const __m512i codes = _mm512_loadu_si512(chunk + 64 * v);
      if constexpr (kBits == 8) {
        low[v] = codes;
      } else {
        low[v] = _mm512_and_si512(codes, nibble);
        high[v] = _mm512_and_si512(_mm512_srli_epi16(codes, 4), nibble);
        if constexpr (kBits == 5) {  // + 16 where the fifth bit is set
          uint64_t fifth[2];
          std::memcpy(fifth, chunk + kRows * kCodes + 16 * v, sizeof fifth);
          low[v] = _mm512_mask_add_epi8(low[v], _cvtu64_mask64(fifth[0]), low[v], sixteen);
          high[v] = _mm512_mask_add_epi8(high[v], _cvtu64_mask64(fifth[1]), high[v], sixteen);
        }
      }
      scales[v] = _mm512_permutexvar_ps(lanes[v], d);
    }
    // mn of the 4 rows (r0 b0, r0 b1, r1 b0, ...) times the blocks' sums of x
    const __m256 mins = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + kScales + 16)));
    for (int t = 0; t < T; ++t) {
      const int64_t at = (m0 + t) * a.kp + p * kPair;
      const int8_t* xh = a.hi.data() + at;
      const int8_t* xl = a.lo.data() + at;
      const __m512 xs = _mm512_loadu_ps(a.lanes.data() + ((m0 + t) * a.pairs + p) * 16);
      for (int64_t v = 0; v < kVectors; ++v) {
        __m512i dot;
        if constexpr (kBits == 8) {
          const __m512i h = _mm512_dpbusd_epi32(zero, low[v], _mm512_loadu_si512(xh));
          dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(h, 8), low[v], _mm512_loadu_si512(xl));
        } else {
          const auto half = [](const int8_t* x) {
            return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
          };
          __m512i h = _mm512_dpbusd_epi32(zero, low[v], half(xh));
          h = _mm512_dpbusd_epi32(h, high[v], half(xh + 32));
          dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(h, 8), low[v], half(xl));
          dot = _mm512_dpbusd_epi32(dot, high[v], half(xl + 32));
        }
        acc[t][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scales[v], xs),
                                    acc[t][v]);
      }
      const float* sx = a.sx.data() + (m0 + t) * a.pairs * 2 + 2 * p;
      const __m256 sums = _mm256_castpd_ps(_mm256_set1_pd(*reinterpret_cast<const double*>(sx)));
      offset[t] = _mm256_fmadd_ps(mins, sums, offset[t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    alignas(32) float off[8];
    _mm256_store_ps(off, offset[t]);
    for (int64_t r = 0; r < kRows; ++r) {
      const float dot = kBits == 8 ? _mm512_reduce_add_ps(acc[t][r])
                                   : reduce_half(acc[t][r / 2], static_cast<int>(r & 1));
      out[t * kRows + r] = dot + off[2 * r] + off[2 * r + 1];
    }
  }
}

template <int kBits>
void run_tile(const Weights& w, const Activations& a, int64_t tile_index, int64_t m0,
              int64_t tokens, bool first, float* out) {
  switch (tokens) {
    case 1: tile<kBits, 1>(w, a, tile_index, m0, first, out); break;
    case 2: tile<kBits, 2>(w, a, tile_index, m0, first, out); break;
    case 3: tile<kBits, 3>(w, a, tile_index, m0, first, out); break;
    default: tile<kBits, 4>(w, a, tile_index, m0, first, out); break;
  }
}

// Tiles [begin, end) for every token of x: y = x W^T + b into out [M, N].
template <typename T, int kBits>
void run_tiles(const Weights& w, const Activations& a, const float* b, int64_t m_rows,
               int64_t begin, int64_t end, T* out) {
  float part[kTokens * kRows];
  for (int64_t tile_index = begin; tile_index < end; ++tile_index) {
    const int64_t n0 = tile_index * kRows;
    const int64_t rows = std::min(kRows, w.n - n0);
    for (int64_t m0 = 0; m0 < m_rows; m0 += kTokens) {
      const int64_t tokens = std::min(kTokens, m_rows - m0);
      run_tile<kBits>(w, a, tile_index, m0, tokens, m0 == 0, part);
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t r = 0; r < rows; ++r) {
          const float v = part[t * kRows + r] + (b ? b[n0 + r] : 0.f);
          out[(m0 + t) * w.n + n0 + r] = static_cast<T>(v);
        }
    }
  }
}

template <typename T, int kBits>
void quantized_linear_kernel(const at::Tensor& x, const Weights& w, int64_t kp,
                             const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t m_rows = x.size(0), k = x.size(1);
  const Activations a = quantize_activations(x.const_data_ptr<T>(), m_rows, k, kp);
  const float* b = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  T* out = y.mutable_data_ptr<T>();
  const int64_t tiles = (w.n + kRows - 1) / kRows;
  // Each thread's own run of tiles, in chunks (work_queue.h): one stream that the tiles'
  // prefetches run ahead in (in the shared order, a chunk's first 8 KB went unprefetched).
  const int64_t grain = grain_for(tiles, 4);
  parallel_queue(tiles, grain, Order::kOwnRuns, [&](WorkQueue& queue, int64_t w_index) {
    for (int64_t begin, end; queue.take(w_index, begin, end);)
      run_tiles<T, kBits>(w, a, b, m_rows, begin, end, out);
  });
}

// A mixture of experts' routed experts on quantized weights (quantized_moe below): the
// structure of moe_experts.cpp (its header says why one call) on this file's tiles.
//   1. x quantized once per token; each pair (token, expert), grouped by expert, takes its
//      token's row of the quantized activations.
//   2. gate/up: every routed expert's tiles are units of one queue: its rows' gate and up
//      outputs (the layer's first I rows gate, the next I up, as the per-expert layer has them).
//   3. h = silu(gate) * up, rounded to x's dtype as the per-expert layers round it, then
//      quantized per row.
//   4. down: each unit is a run of the output's tiles; it runs every routed expert's tiles
//      over that expert's rows and adds each row's result, times its routing weight, into its
//      token's float32 sums, experts in ascending order.
// A row's result does not depend on the step's other rows (each tile's per-token sums are
// its own), and every expert's weights stream once per step.

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// silu(gate) * up of a row of float32 [gate (width), up (width)] into h (width) as the
// per-expert layers round it: gate and up rounded to T (their product's output), silu(gate)
// rounded to T, then the product (silu_and_mul's exp, 16 lanes at a time).
template <typename T>
void silu_and_mul_row(const float* gu, int64_t width, T* h) {
  alignas(64) float g[16], s[16];
  for (int64_t e = 0; e < width; e += 16) {
    const int64_t n = std::min<int64_t>(16, width - e);
    for (int64_t i = 0; i < 16; ++i)
      g[i] = i < n ? static_cast<float>(static_cast<T>(gu[e + i])) : 0.f;
    v16f gv;
    std::memcpy(&gv, g, sizeof gv);
    const v16f silu = gv / (1.0f + llm_cpu_vec::exp_lanes<v16f, v16i>(v16f{} - gv));
    std::memcpy(s, &silu, sizeof s);
    for (int64_t i = 0; i < n; ++i) {
      const float u = static_cast<float>(static_cast<T>(gu[width + e + i]));
      h[e + i] = static_cast<T>(static_cast<float>(static_cast<T>(s[i])) * u);
    }
  }
}

// Rows `rows` of a (in that order) as activations of their own.
Activations gather_rows(const Activations& a, const std::vector<int64_t>& rows) {
  const int64_t n = static_cast<int64_t>(rows.size()), blocks = a.kp / kBlock;
  Activations g{a.kp, a.pairs, std::vector<int8_t>(n * a.kp), std::vector<int8_t>(n * a.kp),
                std::vector<float>(n * a.pairs * 16), std::vector<float>(n * blocks)};
  for (int64_t i = 0; i < n; ++i) {
    const int64_t m = rows[i];
    std::memcpy(g.hi.data() + i * a.kp, a.hi.data() + m * a.kp, a.kp);
    std::memcpy(g.lo.data() + i * a.kp, a.lo.data() + m * a.kp, a.kp);
    std::memcpy(g.lanes.data() + i * a.pairs * 16, a.lanes.data() + m * a.pairs * 16,
                a.pairs * 16 * sizeof(float));
    std::memcpy(g.sx.data() + i * blocks, a.sx.data() + m * blocks, blocks * sizeof(float));
  }
  return g;
}

struct ExpertTiles {
  const uint8_t* tiles;  // [E, tiles, bytes]
  int64_t per_expert;    // bytes an expert
  int64_t n, pairs;      // each expert's outputs and pairs of inputs
  const float* bias;     // [E, n] or null

  Weights of(int64_t e) const { return Weights{tiles + e * per_expert, n, pairs}; }
};

template <typename T, int kBits13, int kBits2>
void quantized_moe_kernel(const T* x, int64_t tokens, int64_t hidden,
                          const llm_cpu_moe::Routes& routes, const ExpertTiles& w13,
                          const ExpertTiles& w2, T* y) {
  const int64_t inter = w13.n / 2, pairs = static_cast<int64_t>(routes.token.size());
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const Activations ax = gather_rows(
      quantize_activations(x, tokens, hidden, w13.pairs * kPair), routes.token);

  // 2. gate/up into gu [pairs, 2I] (float32)
  std::vector<float> gu(pairs * w13.n);
  const int64_t tiles13 = (w13.n + kRows - 1) / kRows;
  const int64_t group = std::max<int64_t>(
      1, static_cast<int64_t>(routes.used.size()) * tiles13 / (threads * 8));
  struct Unit {
    int64_t expert, begin, end;
  };
  std::vector<Unit> units;
  for (const int64_t e : routes.used)
    for (int64_t t = 0; t < tiles13; t += group) units.push_back({e, t, std::min(tiles13, t + group)});
  parallel_queue(static_cast<int64_t>(units.size()), 1, Order::kShared,
                 [&](WorkQueue& queue, int64_t w_index) {
    float part[kTokens * kRows];
    for (int64_t begin, end; queue.take(w_index, begin, end);) {
      const Unit& u = units[begin];
      const Weights w = w13.of(u.expert);
      const float* bias = w13.bias != nullptr ? w13.bias + u.expert * w13.n : nullptr;
      for (int64_t t = u.begin; t < u.end; ++t) {
        const int64_t n0 = t * kRows, rows = std::min(kRows, w.n - n0);
        for (int64_t m0 = routes.first[u.expert]; m0 < routes.first[u.expert + 1];
             m0 += kTokens) {
          const int64_t count = std::min(kTokens, routes.first[u.expert + 1] - m0);
          run_tile<kBits13>(w, ax, t, m0, count, m0 == routes.first[u.expert], part);
          for (int64_t i = 0; i < count; ++i)
            for (int64_t r = 0; r < rows; ++r)
              gu[(m0 + i) * w13.n + n0 + r] = part[i * kRows + r] + (bias ? bias[n0 + r] : 0.f);
        }
      }
    }
  });

  // 3. h = silu(gate) * up in x's dtype, quantized per row
  std::vector<T> h(pairs * inter);
  llm_cpu_work::parallel_for(0, pairs, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) silu_and_mul_row(gu.data() + p * w13.n, inter,
                                                           h.data() + p * inter);
  });
  const Activations ah = quantize_activations(h.data(), pairs, inter, w2.pairs * kPair);

  // 4. down: y[token, tiles] = sum over its experts (ascending) of weight * (h W_down^T + b)
  const int64_t tiles2 = (w2.n + kRows - 1) / kRows;
  parallel_queue(tiles2, grain_for(tiles2, 4), Order::kOwnRuns,
                 [&](WorkQueue& queue, int64_t w_index) {
    float part[kTokens * kRows];
    std::vector<float> acc;
    for (int64_t begin, end; queue.take(w_index, begin, end);) {
      const int64_t width = (end - begin) * kRows;
      acc.assign(tokens * width, 0.f);
      for (const int64_t e : routes.used) {
        const Weights w = w2.of(e);
        const float* bias = w2.bias != nullptr ? w2.bias + e * w2.n : nullptr;
        for (int64_t t = begin; t < end; ++t) {
          const int64_t n0 = t * kRows, rows = std::min(kRows, w.n - n0);
          for (int64_t m0 = routes.first[e]; m0 < routes.first[e + 1]; m0 += kTokens) {
            const int64_t count = std::min(kTokens, routes.first[e + 1] - m0);
            run_tile<kBits2>(w, ah, t, m0, count, m0 == routes.first[e], part);
            for (int64_t i = 0; i < count; ++i) {
              float* a = acc.data() + routes.token[m0 + i] * width + (t - begin) * kRows;
              const float weight = routes.weight[m0 + i];
              for (int64_t r = 0; r < rows; ++r)
                a[r] += weight * (part[i * kRows + r] + (bias ? bias[n0 + r] : 0.f));
            }
          }
        }
      }
      const int64_t n0 = begin * kRows, cols = std::min(width, w2.n - n0);
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t c = 0; c < cols; ++c) y[t * w2.n + n0 + c] = static_cast<T>(acc[t * width + c]);
    }
  });
}

template <typename T, int kBits13>
void quantized_moe_bits(int64_t bits2, const T* x, int64_t tokens, int64_t hidden,
                        const llm_cpu_moe::Routes& routes, const ExpertTiles& w13,
                        const ExpertTiles& w2, T* y) {
  if (bits2 == 8) quantized_moe_kernel<T, kBits13, 8>(x, tokens, hidden, routes, w13, w2, y);
  if (bits2 == 5) quantized_moe_kernel<T, kBits13, 5>(x, tokens, hidden, routes, w13, w2, y);
  if (bits2 == 4) quantized_moe_kernel<T, kBits13, 4>(x, tokens, hidden, routes, w13, w2, y);
}

template <typename T>
void quantized_moe_typed(int64_t bits13, int64_t bits2, const T* x, int64_t tokens,
                         int64_t hidden, const llm_cpu_moe::Routes& routes,
                         const ExpertTiles& w13, const ExpertTiles& w2, T* y) {
  if (bits13 == 8) quantized_moe_bits<T, 8>(bits2, x, tokens, hidden, routes, w13, w2, y);
  if (bits13 == 5) quantized_moe_bits<T, 5>(bits2, x, tokens, hidden, routes, w13, w2, y);
  if (bits13 == 4) quantized_moe_bits<T, 4>(bits2, x, tokens, hidden, routes, w13, w2, y);
}

#endif  // LLM_CPU_QUANT

// x [M, K] float32 or bfloat16; tiles uint8 [ceil(N / 4), pairs * chunk bytes] (the layout
// above; bits 8, 5 or 4); bias float32 [N] or none. Returns y [M, N] in x's dtype.
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& tiles,
                            const c10::optional<at::Tensor>& bias, int64_t bits, int64_t n) {
  TORCH_CHECK(bits == 8 || bits == 5 || bits == 4,
              "quantized_linear: bits must be 8, 5 or 4, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quantized_linear: x must be 2-D, contiguous");
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.dim() == 2 && tiles.is_contiguous(),
              "quantized_linear: the weight tiles must be a contiguous uint8 matrix");
  TORCH_CHECK(n > 0 && tiles.size(0) == (n + 3) / 4, "quantized_linear: ", tiles.size(0),
              " tiles of 4 rows for ", n, " outputs");
  const int64_t chunk = chunk_bytes(static_cast<int>(bits));
  TORCH_CHECK(tiles.size(1) % chunk == 0, "quantized_linear: a tile of ", tiles.size(1),
              " bytes is not a whole number of ", chunk, "-byte pairs");
  const int64_t pairs = tiles.size(1) / chunk, kp = pairs * kPair;
  TORCH_CHECK(x.size(1) <= kp && x.size(1) > kp - kPair, "quantized_linear: x has ", x.size(1),
              " columns, the weights ", kp, " (padded)");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                "quantized_linear: bias must be float32 [N]");
  }
#if LLM_CPU_QUANT
  const Weights w{tiles.const_data_ptr<uint8_t>(), n, pairs};
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.scalar_type() == at::kFloat) {
    if (bits == 8) quantized_linear_kernel<float, 8>(x, w, kp, bias, y);
    if (bits == 5) quantized_linear_kernel<float, 5>(x, w, kp, bias, y);
    if (bits == 4) quantized_linear_kernel<float, 4>(x, w, kp, bias, y);
  } else if (x.scalar_type() == at::kBFloat16) {
    if (bits == 8) quantized_linear_kernel<c10::BFloat16, 8>(x, w, kp, bias, y);
    if (bits == 5) quantized_linear_kernel<c10::BFloat16, 5>(x, w, kp, bias, y);
    if (bits == 4) quantized_linear_kernel<c10::BFloat16, 4>(x, w, kp, bias, y);
  } else {
    TORCH_CHECK(false, "quantized_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  }
  return y;
#else
  TORCH_CHECK(false, "quantized_linear: these kernels were built for a CPU without AVX512-VNNI");
#endif
}


// One projection of every expert, stacked: tiles uint8 [E, ceil(N / 4), pairs * chunk bytes]
// (quantized_linear's layout each) of `bits`; bias float32 [E, N] or none. Checked as
// quantized_linear checks one, naming `which`.
int64_t check_expert_tiles(const char* which, const at::Tensor& tiles, int64_t bits, int64_t n,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(bits == 8 || bits == 5 || bits == 4, "quantized_moe: ", which,
              " bits must be 8, 5 or 4, got ", bits);
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.dim() == 3 && tiles.is_contiguous() &&
                  tiles.size(1) == (n + 3) / 4 && tiles.size(2) % chunk_bytes(bits) == 0,
              "quantized_moe: ", which, " must be contiguous uint8 [E, ", (n + 3) / 4,
              " tiles, pairs * ", chunk_bytes(bits), " bytes]");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == tiles.size(0) * n,
                "quantized_moe: ", which, "'s bias must be float32 [E, ", n, "]");
  }
  return tiles.size(2) / chunk_bytes(bits);  // pairs
}

// x [T, H] float32 or bfloat16; experts int64 [T, k], weights [T, k]; w13: each expert's
// gate/up layer's tiles (2I outputs: gate, then up), w2 its down layer's (H outputs); their
// bits and biases. Returns y [T, H] in x's dtype: the routed experts' weighted sum.
at::Tensor quantized_moe(const at::Tensor& x, const at::Tensor& experts,
                         const at::Tensor& weights, const at::Tensor& w13,
                         const c10::optional<at::Tensor>& b13, int64_t bits13,
                         const at::Tensor& w2, const c10::optional<at::Tensor>& b2,
                         int64_t bits2, int64_t inter) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quantized_moe: x must be a contiguous float32 or bfloat16 matrix");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(inter > 0 && w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0),
              "quantized_moe: w13 and w2 must hold the same experts");
  const int64_t pairs13 = check_expert_tiles("w13", w13, bits13, 2 * inter, b13);
  const int64_t pairs2 = check_expert_tiles("w2", w2, bits2, hidden, b2);
  TORCH_CHECK(hidden <= pairs13 * kPair && hidden > (pairs13 - 1) * kPair &&
                  inter <= pairs2 * kPair && inter > (pairs2 - 1) * kPair,
              "quantized_moe: tiles of ", pairs13, " and ", pairs2, " pairs of inputs for ",
              hidden, " and ", inter);
  at::Tensor y = at::empty({tokens, hidden}, x.options());
#if LLM_CPU_QUANT
  const llm_cpu_moe::Routes routes =
      llm_cpu_moe::group_by_expert("quantized_moe", experts, weights, tokens, w13.size(0));
  if (tokens == 0) return y;
  const ExpertTiles t13{w13.const_data_ptr<uint8_t>(), w13.size(1) * w13.size(2), 2 * inter,
                        pairs13, b13.has_value() ? b13->const_data_ptr<float>() : nullptr};
  const ExpertTiles t2{w2.const_data_ptr<uint8_t>(), w2.size(1) * w2.size(2), hidden, pairs2,
                       b2.has_value() ? b2->const_data_ptr<float>() : nullptr};
  if (x.scalar_type() == at::kFloat) {
    quantized_moe_typed<float>(bits13, bits2, x.const_data_ptr<float>(), tokens, hidden, routes,
                               t13, t2, y.mutable_data_ptr<float>());
  } else {
    quantized_moe_typed<c10::BFloat16>(bits13, bits2, x.const_data_ptr<c10::BFloat16>(),
                                       tokens, hidden, routes, t13, t2,
                                       y.mutable_data_ptr<c10::BFloat16>());
  }
  return y;
#else
  TORCH_CHECK(false, "quantized_moe: these kernels were built for a CPU without AVX512-VNNI");
#endif
}
}  // namespace

// Whether quantized_linear runs here (the CPU has AVX512-VNNI, and the build targeted it).
bool quantized_linear_available() { return LLM_CPU_QUANT; }

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("quantized_linear_available() -> bool", &quantized_linear_available);
  m.def("quantized_linear(Tensor x, Tensor tiles, Tensor? bias, int bits, int n) -> Tensor");
  m.def("quantized_moe(Tensor x, Tensor experts, Tensor weights, Tensor w13, Tensor? b13, "
        "int bits13, Tensor w2, Tensor? b2, int bits2, int inter) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) {
  m.impl("quantized_linear", TORCH_FN(quantized_linear));
  m.impl("quantized_moe", TORCH_FN(quantized_moe));
}
