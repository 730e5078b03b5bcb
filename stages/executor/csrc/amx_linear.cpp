// bf16 linear layers on AMX tiles: y = x W^T (+ b), x bf16 [M, K], W in the tile-major layout
// below, products in float32 (TDPBF16PS), y rounded to bf16 once. Registered as
// torch.ops.llm_cpu.amx_linear; built with cpu_kernels.cpp by kernels.py.
//
// Why not oneDNN's packed product (stages/executor/linear/onednn.py), which runs on the same
// tiles: a decode step's products stream every weight from memory once, and at 1-64 tokens
// oneDNN's reads its weights at 8-16 GB/s on the 2-core test machine (a sweep over the
// default model's 121 products: 19-20 ms a step at one token, 25-29 ms at 64) where the
// memory gives ~19. Here each thread streams one contiguous run of the weights, the next
// panel prefetched into L2 while a panel's tiles are computed: 14-15 ms at one token (the
// memory's speed), 22-24 ms at 64.
//
// What bounds it beyond one row pair: on that machine a tile load (1 KB) takes ~16 ns even
// from L1, three times a product (~5.6 ns), and a 2 x 2 block of result tiles (the most that
// 8 tiles allow with two x and two W tiles) needs one load per product. 64 rows are two row
// pairs, 8 loads a chunk; those and the stream from memory do not fully overlap. Prompts
// (thousands of rows) reach 1.5-2.4 TFLOP/s, about oneDNN's at 512 rows and 10-20% below it
// at 2048.
//
// Layout: K a multiple of 32; N padded to a multiple of 32 (zero columns, never stored).
// Panels of 32 output columns, n0..n0+31; a panel is K / 32 chunks of 2 KB, one per 32 values
// of K, and a chunk is two B tiles (the panel's columns n0..n0+15, then n0+16..n0+31), each
// 16 rows of K-pairs x 16 columns x 2 bf16 (AMX's pair layout: row p holds W[n][k0 + 2p],
// W[n][k0 + 2p + 1] for its 16 n):
//     packed[panel][chunk][half][pair][column][2]
// (stages/executor/linear/amx.py makes it with one permute). A run of panels is then one
// contiguous stream.
//
// Work: torch's threads take the panels a chunk at a time (work_queue.h): a decode step's
// chunks in turn from one queue (each about a quarter of a thread's share), a prompt's each
// thread from its own share (chunks that fit L2), then from the back of another's. A decode
// step (at most 32 rows: one row pair) goes panel by panel, K chunk by chunk, x from L1. More
// rows go in slabs whose x fits in L2, copied tile-major (a tile 1 KB in one piece); a slab's
// row pairs each run over a group of panels that fits L2, their W tiles loaded with the hint
// that keeps them out of L1 (where the row pair's x tiles stay).
//
// Gated (an MLP's gate/up weight, its rows interleaved 16 gate then 16 up by amx.py): a
// panel's two result tiles are a block of gate and the matching block of up, and the kernel
// writes silu(gate) * up from them, half the columns, in place of the product.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "bf16_vector.h"
#include "vector_math.h"
#include "work_queue.h"

namespace {

constexpr int64_t kPanel = 32;          // output columns a panel
constexpr int64_t kChunkK = 32;         // K values a chunk
constexpr int64_t kChunkBytes = 2048;   // two 1 KB B tiles
constexpr int64_t kSlabBytes = 1 << 19; // x rows of one slab (prompts): 512 KB, inside L2
constexpr int64_t kGroupBytes = 1 << 19; // panels a prompt's row pair runs over from L2

// Quantized panels (amx_quantized_linear): a chunk of a panel, 32 outputs by one block of 32
// inputs, holds the codes in the order of the two B tiles they widen into, then the blocks'
// d and mn (fp16, the panel's 32 outputs in order): per half (16 outputs), per pair row p of
// the tile, the 32 values W[n][2p], W[n][2p + 1] for its 16 n, as codes: 8 bits a byte (32
// bytes a row); 4 bits, 16 bytes a row, byte i holding value i in its low nibble and value
// i + 16 in its high one; 5 bits, the 4-bit rows and then a 32-bit word a row (bit i: value
// i's fifth bit). w = d code + mn, widened to bf16 (rounded once, from one fused multiply-add
// in float32) into a 2 KB chunk of amx_linear's layout.
constexpr int64_t quantized_chunk_bytes(int64_t bits) {
  return (bits == 8 ? 1024 : 512) + (bits == 5 ? 128 : 0) + 128;
}

#if LLM_CPU_AMX

// The kernel's tile palette: tiles 0-3 results (rows block 0: columns lo, hi; block 1: lo,
// hi), 4 and 5 x's two row blocks, 6 and 7 the chunk's two B tiles.
using llm_cpu_amx::request_tiles;
using llm_cpu_amx::TileConfig;
using llm_cpu_work::grain_for;
using llm_cpu_work::Order;
using llm_cpu_work::parallel_queue;
using llm_cpu_work::WorkQueue;

void configure(int64_t rows0, int64_t rows1) {
  TileConfig config;
  const uint8_t r0 = static_cast<uint8_t>(rows0);
  const uint8_t r1 = static_cast<uint8_t>(std::max<int64_t>(rows1, 1));  // (1: tiles unused)
  const uint8_t rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = rows[t];
    config.colsb[t] = 64;
  }
  llm_cpu_amx::load_config(config);
}

// Results of rows [m0, m0 + rows) and the panel's 16 columns from n0, float, into y (bf16),
// bias added.
inline void store_rows(const float* tile, int64_t rows, int64_t m0, int64_t n0, int64_t n,
                       const float* bias, c10::BFloat16* y) {
  const int64_t cols = std::min<int64_t>(16, n - n0);
  if (cols <= 0) return;
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(tile + r * 16), b);
    _mm256_mask_storeu_epi16(y + (m0 + r) * n + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// Gated results (an MLP's gate/up product packed with gate and up columns interleaved 16 by
// 16, see amx.py): rows [m0, m0 + rows) of a panel's gate tile and up tile, biases added, as
// silu(gate) * up, into the 16 columns from c0 of y (the MLP's activations, width wide): the
// gate/up product never goes to memory, nor does the separate silu_and_mul pass read it.
inline void store_gated(const float* gate, const float* up, int64_t rows, int64_t m0,
                        int64_t c0, int64_t width, const float* bias_gate, const float* bias_up,
                        c10::BFloat16* y) {
  const __m512 bg = bias_gate ? _mm512_loadu_ps(bias_gate) : _mm512_setzero_ps();
  const __m512 bu = bias_up ? _mm512_loadu_ps(bias_up) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 g = _mm512_add_ps(_mm512_loadu_ps(gate + r * 16), bg);
    const __m512 u = _mm512_add_ps(_mm512_loadu_ps(up + r * 16), bu);
    v16f gv;
    std::memcpy(&gv, &g, sizeof gv);
    const v16f silu = gv / (1.0f + llm_cpu_vec::exp_lanes<v16f, v16i>(v16f{} - gv));
    __m512 h;
    std::memcpy(&h, &silu, sizeof h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + r) * width + c0),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(h, u)));
  }
}

// The results of one row pair by one panel, stored from their tiles and written to y (bias
// added, rounded to bf16) during the next block's products: a tile's store waits for its
// products, but the writes need only AVX-512 ports, which the tiles leave free. (Without the
// writes a prompt's products at K = 576 ran 10-25% faster; deferred, the largest, gate/up
// at 2048 tokens, ran at 1.03-1.04x oneDNN's time against 1.16x written at once, on a noisy
// host.) Two sets of tiles alternate.
struct Results {
  alignas(64) float tiles[2][1024];
  int set = 0;
  bool pending = false;
  int64_t rows0 = 0, rows1 = 0, m0 = 0, n0 = 0;

  template <bool kTwo>
  void store(int64_t block_rows0, int64_t block_rows1, int64_t block_m0, int64_t block_n0) {
    float* t = tiles[set];
    _tile_stored(0, t, 64);
    _tile_stored(1, t + 256, 64);
    if constexpr (kTwo) {
      _tile_stored(2, t + 512, 64);
      _tile_stored(3, t + 768, 64);
    }
    rows0 = block_rows0;
    rows1 = kTwo ? block_rows1 : 0;
    m0 = block_m0;
    n0 = block_n0;
    pending = true;
    set ^= 1;
  }

  // The stored set not yet written, if any: y [M, n], or gated, y [M, n / 2].
  void write(int64_t n, const float* bias, bool gated, c10::BFloat16* y) {
    if (!pending) return;
    const float* t = tiles[set ^ 1];
    if (gated) {
      const float* bg = bias ? bias + n0 : nullptr;
      const float* bu = bias ? bias + n0 + 16 : nullptr;
      store_gated(t, t + 256, rows0, m0, n0 / 2, n / 2, bg, bu, y);
      store_gated(t + 512, t + 768, rows1, m0 + 16, n0 / 2, n / 2, bg, bu, y);
    } else {
      store_rows(t, rows0, m0, n0, n, bias, y);
      store_rows(t + 256, rows0, m0, n0 + 16, n, bias, y);
      store_rows(t + 512, rows1, m0 + 16, n0, n, bias, y);
      store_rows(t + 768, rows1, m0 + 16, n0 + 16, n, bias, y);
    }
    pending = false;
  }
};

// One product's operands, as the threads share them.
struct Product {
  const uint8_t* w;     // the packed weight, or the quantized panels (widened as they run)
  int64_t chunks;       // K / 32
  int64_t panels;
  int64_t n;
  const float* bias;
  bool gated;
  c10::BFloat16* y;
  int64_t chunk_bytes;  // bytes of one chunk of a panel in w: 2048, or a quantized chunk's

  const uint8_t* panel(int64_t i) const { return w + i * chunks * chunk_bytes; }
};

// Lanes i of a half's 16 scales, per value of a tile row: value i (0..15) is output i / 2 of
// the half (`high`: values 16..31, outputs 8 + i / 2).
inline __m512 value_lanes(__m512 scales, bool high) {
  alignas(64) int32_t index[16];
  for (int i = 0; i < 16; ++i) index[i] = (high ? 8 : 0) + i / 2;
  return _mm512_permutexvar_ps(_mm512_load_si512(index), scales);
}

// Quantized chunk q (kBits codes, the layout above) widened into out: two 1 KB bf16 B tiles.
template <int kBits>
void widen_chunk(const uint8_t* q, uint8_t* out) {
  constexpr int64_t kRowBytes = kBits == 8 ? 32 : 16;
  const uint8_t* fifth = q + 32 * kRowBytes;  // (5 bits)
  const uint8_t* scales = fifth + (kBits == 5 ? 128 : 0);
  const __m512i nibble = _mm512_set1_epi32(0x0F), sixteen = _mm512_set1_epi32(16);
  for (int64_t half = 0; half < 2; ++half) {
    const __m512 d = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32 * half)));
    const __m512 mn = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 64 + 32 * half)));
    const __m512 d0 = value_lanes(d, false), d1 = value_lanes(d, true);
    const __m512 m0 = value_lanes(mn, false), m1 = value_lanes(mn, true);
    // (5 bits) the half's 16 rows' fifth bits, read at once: read a word a row inside the
    // loop, the function's calls were dropped by GCC 12 at -O2 as if they had no effect.
    alignas(64) uint32_t words[16];
    if constexpr (kBits == 5) _mm512_store_si512(words, _mm512_loadu_si512(fifth + 64 * half));
    for (int64_t p = 0; p < 16; ++p) {
      const int64_t row = half * 16 + p;
      const uint8_t* codes = q + row * kRowBytes;
      const __m512i v =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
      __m512i v0, v1;
      if constexpr (kBits == 8) {
        v0 = v;
        v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16)));
      } else {
        v0 = _mm512_and_si512(v, nibble);
        v1 = _mm512_srli_epi32(v, 4);
        if constexpr (kBits == 5) {
          const uint32_t bits = words[p];
          v0 = _mm512_mask_add_epi32(v0, static_cast<__mmask16>(bits), v0, sixteen);
          v1 = _mm512_mask_add_epi32(v1, static_cast<__mmask16>(bits >> 16), v1, sixteen);
        }
      }
      const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v0), d0, m0);
      const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v1), d1, m1);
      _mm512_store_si512(out + row * 64, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
    }
  }
}

template <int kBits>
void widen_panels(const Product& p, int64_t begin, int64_t end, uint8_t* out) {
  for (int64_t panel = begin; panel < end; ++panel) {
    const uint8_t* q = p.panel(panel);
    for (int64_t c = 0; c < p.chunks; ++c, q += p.chunk_bytes, out += kChunkBytes)
      widen_chunk<kBits>(q, out);
  }
}

// A thread's part: its tiles configured for the current row pair's rows (reloaded only when
// they change) and its results not yet written.
class Worker {
 public:
  explicit Worker(const Product& product) : p_(product) {}

  ~Worker() {
    results_.write(p_.n, p_.bias, p_.gated, p_.y);
    _tile_release();  // leave the tiles as found for oneDNN and torch's own AMX code
  }

  // Rows [m0, m0 + rows) (at most 32) by panel `panel`, whose chunks are at w (kBits 0:
  // packed bf16; 8, 5, 4: quantized, widened a chunk at a time); a0, a1 their two row blocks'
  // first tiles, `a_step` bf16 values from one chunk's tile to the next, `a_stride` bytes
  // between rows (x itself: 32 and 2K; tile-major: 512 and 64); `ahead`: a panel (in w's
  // form) to prefetch.
  template <bool kStream, int kBits>
  void row_pair(const c10::BFloat16* a0, const c10::BFloat16* a1, int64_t a_step,
                int64_t a_stride, int64_t m0, int64_t rows, int64_t panel, const uint8_t* w,
                const uint8_t* ahead) {
    const int64_t rows0 = std::min<int64_t>(16, rows), rows1 = rows - rows0;
    if (rows0 != rows0_ || rows1 != rows1_) {
      configure(rows0, rows1);
      rows0_ = rows0;
      rows1_ = rows1;
    }
    if (rows1 > 0) {
      panel_rows<true, kStream, kBits>(a0, a1, a_step, a_stride, m0, panel, w, ahead);
    } else {
      panel_rows<false, kStream, kBits>(a0, a1, a_step, a_stride, m0, panel, w, ahead);
    }
  }

  const uint8_t* panel_at(int64_t panel) const { return p_.panel(panel); }

 private:
  // The row pair over every chunk of K: 2 (or, kTwo false, 1) x 2 result tiles; the previous
  // block's results are written once this one's first products are under way.
  template <bool kTwo, bool kStream, int kBits>
  void panel_rows(const c10::BFloat16* a0, const c10::BFloat16* a1, int64_t a_step,
                  int64_t a_stride, int64_t m0, int64_t panel, const uint8_t* w,
                  const uint8_t* ahead) {
    const int64_t step = kBits == 0 ? kChunkBytes : quantized_chunk_bytes(kBits);
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (kTwo) {
      _tile_zero(2);
      _tile_zero(3);
    }
    // Quantized: chunk c + 1 is widened once chunk c's tiles are loaded from the other
    // buffer, so that a tile load never waits on the stores just made.
    if constexpr (kBits != 0) widen_chunk<kBits>(w, widened_[0]);
    for (int64_t c = 0; c < p_.chunks; ++c) {
      const uint8_t* chunk = kBits == 0 ? w + c * step : widened_[c & 1];
      if (ahead != nullptr) {  // the next panel's chunk into L2 while this one computes
        for (int64_t line = 0; line < step; line += 64) {
          _mm_prefetch(ahead + c * step + line, _MM_HINT_T1);
        }
      }
      if constexpr (kStream) {  // (a hint: kept in L2, not L1, where x's tiles are)
        _tile_stream_loadd(6, chunk, 64);
        _tile_stream_loadd(7, chunk + 1024, 64);
      } else {
        _tile_loadd(6, chunk, 64);
        _tile_loadd(7, chunk + 1024, 64);
      }
      _tile_loadd(4, a0 + c * a_step, a_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (kTwo) {
        _tile_loadd(5, a1 + c * a_step, a_stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      if constexpr (kBits != 0) {
        if (c + 1 < p_.chunks) widen_chunk<kBits>(w + (c + 1) * step, widened_[(c + 1) & 1]);
      }
      if (c == 0) results_.write(p_.n, p_.bias, p_.gated, p_.y);
    }
    results_.store<kTwo>(rows0_, rows1_, m0, panel * kPanel);
  }

  const Product& p_;
  Results results_;
  int64_t rows0_ = -1, rows1_ = -1;
  alignas(64) uint8_t widened_[2][kChunkBytes];
};

// A decode step (m <= 32 rows: one row pair) over panels [begin, end), panel by panel, x in
// L1 throughout; quantized panels (kBits) widened a chunk at a time as they run.
template <int kBits>
void run_panels(Worker& worker, const c10::BFloat16* x, int64_t k, int64_t m, int64_t begin,
                int64_t end) {
  for (int64_t panel = begin; panel < end; ++panel) {
    // (not past the chunk: the next one may be another thread's)
    const uint8_t* next = panel + 1 < end ? worker.panel_at(panel + 1) : nullptr;
    worker.row_pair<false, kBits>(x, x + 16 * k, kChunkK, k * 2, 0, m, panel,
                                  worker.panel_at(panel), next);
  }
}

// A slab's rows of x as tiles, one after another: xt[block][chunk][16 rows][32] (rows past
// the end zero), so that a tile is 1 KB in one piece.
void tile_rows(const c10::BFloat16* x, int64_t k, int64_t m_begin, int64_t m_end,
               c10::BFloat16* xt) {
  const int64_t chunks = k / kChunkK, blocks = (m_end - m_begin + 15) / 16;
  llm_cpu_work::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t m = m_begin + b * 16 + r;
        for (int64_t c = 0; c < chunks; ++c) {
          c10::BFloat16* to = xt + ((b * chunks + c) * 16 + r) * kChunkK;
          if (m < m_end) {
            std::memcpy(to, x + m * k + c * kChunkK, kChunkK * 2);
          } else {
            std::memset(to, 0, kChunkK * 2);
          }
        }
      }
    }
  });
}

// Panels a prompt's row pair runs over from L2 (as bf16).
int64_t panel_group(const Product& p) {
  return std::max<int64_t>(1, kGroupBytes / (p.chunks * kChunkBytes));
}

// A prompt's slab (tile-major rows xt, rows [m_begin, m_end)) over panels [begin, end): row
// pairs outer, each over a group of panels that fits L2, so a row pair's tiles stay in L1
// while the panels stream from L2. Quantized panels (kBits) are widened a group at a time
// into `widened` (a group's bf16 panels), once for all the slab's row pairs.
template <int kBits>
void run_slab(Worker& worker, const Product& p, const c10::BFloat16* xt, int64_t m_begin,
              int64_t m_end, int64_t begin, int64_t end, uint8_t* widened) {
  const int64_t group = panel_group(p);
  const int64_t tile = 16 * kChunkK;  // bf16 values of one tile
  for (int64_t g0 = begin; g0 < end; g0 += group) {
    const int64_t g1 = std::min(end, g0 + group);
    if constexpr (kBits != 0) widen_panels<kBits>(p, g0, g1, widened);
    for (int64_t m0 = m_begin; m0 < m_end; m0 += 32) {
      const c10::BFloat16* a0 = xt + (m0 - m_begin) / 16 * p.chunks * tile;
      for (int64_t panel = g0; panel < g1; ++panel) {
        const uint8_t* w = kBits == 0 ? worker.panel_at(panel)
                                      : widened + (panel - g0) * p.chunks * kChunkBytes;
        // The group's next panel while this one computes, on the first row pair only (a
        // widened group is in L2 already).
        const uint8_t* ahead = kBits == 0 && m0 == m_begin && panel + 1 < g1
                                   ? worker.panel_at(panel + 1) : nullptr;
        worker.row_pair<true, 0>(a0, a0 + p.chunks * tile, tile, 64, m0,
                                 std::min<int64_t>(32, m_end - m0), panel, w, ahead);
      }
    }
  }
}

#endif  // LLM_CPU_AMX

bool amx_linear_available() {
#if LLM_CPU_AMX
  return request_tiles();
#else
  return false;
#endif
}

#if LLM_CPU_AMX
// y = x W^T (+ b) for x bf16 [m, k] and the weight p.w (kBits 0: packed bf16; else quantized
// panels of kBits).
template <int kBits>
void run_product(const Product& p, const c10::BFloat16* xp, int64_t k, int64_t m,
                 const at::TensorOptions& options) {
  const int64_t panels = p.panels;
  if (m <= 32) {  // a decode step
    // (at least 2 panels a chunk: within one, the next panel is prefetched)
    const int64_t grain = grain_for(panels, 4, 2);
    parallel_queue(panels, grain, Order::kShared, [&](WorkQueue& queue, int64_t w) {
      Worker worker(p);
      for (int64_t begin, end; queue.take(w, begin, end);)
        run_panels<kBits>(worker, xp, k, m, begin, end);
    });
    return;
  }
  // Slabs of rows whose x stays in L2 (whole multiples of 32 rows), tile-major.
  const int64_t slab = std::max<int64_t>(32, kSlabBytes / (k * 2) / 32 * 32);
  at::Tensor tiles = at::empty({(std::min(m, slab) + 15) / 16 * 16 * k}, options);
  auto* xt = tiles.mutable_data_ptr<c10::BFloat16>();
  // Chunks of a group that fits L2, or a thread's whole share where that is less: each
  // chunk re-reads the slab's rows from L2 (chunks of a quarter share measured the small
  // products 6-12% slower); a product of several groups a thread can still pass them on.
  const int64_t threads = at::get_num_threads();
  const int64_t share = (panels + threads - 1) / threads;
  const int64_t grain = std::min(panel_group(p), share);
  // each thread's widened group (quantized panels)
  at::Tensor widened = at::empty({kBits == 0 ? 0 : threads * grain * p.chunks * kChunkBytes},
                                 options.dtype(at::kByte));
  for (int64_t m_begin = 0; m_begin < m; m_begin += slab) {
    const int64_t m_end = std::min(m, m_begin + slab);
    tile_rows(xp, k, m_begin, m_end, xt);
    parallel_queue(panels, grain, Order::kOwnRuns, [&](WorkQueue& queue, int64_t w) {
      Worker worker(p);
      uint8_t* mine = kBits == 0 ? nullptr
                                 : widened.mutable_data_ptr<uint8_t>() +
                                       w * grain * p.chunks * kChunkBytes;
      for (int64_t begin, end; queue.take(w, begin, end);)
        run_slab<kBits>(worker, p, xt, m_begin, m_end, begin, end, mine);
    });
  }
}
#endif  // LLM_CPU_AMX

// x bf16 [M, K], K a multiple of 32; packed uint8 [panels, K / 32 * 2048] (the layout above);
// bias float32 [N] or none; n the outputs. Returns y bf16 [M, N]; gated (a gate/up weight
// whose panels are 16 gate then 16 up columns): silu(gate) * up, bf16 [M, N / 2].
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias, int64_t n, bool gated) {
  llm_cpu_bf16::check_linear("amx_linear", x, packed, bias, n, gated);
  at::Tensor y = at::empty({x.size(0), gated ? n / 2 : n}, x.options());
#if LLM_CPU_AMX
  TORCH_CHECK(request_tiles(), "amx_linear: the kernel did not grant this process AMX tiles");
  const int64_t m = x.size(0), k = x.size(1);
  if (m == 0) return y;
  const Product p{packed.const_data_ptr<uint8_t>(), k / kChunkK, packed.size(0), n,
                  bias.has_value() ? bias->const_data_ptr<float>() : nullptr, gated,
                  y.mutable_data_ptr<c10::BFloat16>(), kChunkBytes};
  run_product<0>(p, x.const_data_ptr<c10::BFloat16>(), k, m, x.options());
  return y;
#else
  TORCH_CHECK(false, "amx_linear: these kernels were built for a CPU without AMX-BF16");
#endif
}

// As amx_linear, the weight quantized: panels uint8 [ceil(N / 32), K / 32 * chunk bytes]
// (the quantized panels' layout above; bits 8, 5 or 4), each chunk widened to bf16 as the
// product runs (a decode step: chunk by chunk; a prompt: a group of panels at a time). A
// row's result is the same whatever rows share the call, as amx_linear's.
at::Tensor amx_quantized_linear(const at::Tensor& x, const at::Tensor& panels,
                                const c10::optional<at::Tensor>& bias, int64_t bits, int64_t n,
                                bool gated) {
  TORCH_CHECK(bits == 8 || bits == 5 || bits == 4,
              "amx_quantized_linear: bits must be 8, 5 or 4, got ", bits);
  const int64_t chunk_bytes = quantized_chunk_bytes(bits);
  llm_cpu_bf16::check_linear("amx_quantized_linear", x, panels, bias, n, gated, chunk_bytes);
  at::Tensor y = at::empty({x.size(0), gated ? n / 2 : n}, x.options());
#if LLM_CPU_AMX
  TORCH_CHECK(request_tiles(),
              "amx_quantized_linear: the kernel did not grant this process AMX tiles");
  const int64_t m = x.size(0), k = x.size(1);
  if (m == 0) return y;
  const Product p{panels.const_data_ptr<uint8_t>(), k / kChunkK, panels.size(0), n,
                  bias.has_value() ? bias->const_data_ptr<float>() : nullptr, gated,
                  y.mutable_data_ptr<c10::BFloat16>(), chunk_bytes};
  const auto* xp = x.const_data_ptr<c10::BFloat16>();
  if (bits == 8) run_product<8>(p, xp, k, m, x.options());
  if (bits == 5) run_product<5>(p, xp, k, m, x.options());
  if (bits == 4) run_product<4>(p, xp, k, m, x.options());
  return y;
#else
  TORCH_CHECK(false, "amx_quantized_linear: these kernels were built for a CPU without AMX-BF16");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("amx_linear_available() -> bool", &amx_linear_available);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, int n, bool gated=False) -> Tensor");
  m.def("amx_quantized_linear(Tensor x, Tensor panels, Tensor? bias, int bits, int n, "
        "bool gated=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) {
  m.impl("amx_linear", TORCH_FN(amx_linear));
  m.impl("amx_quantized_linear", TORCH_FN(amx_quantized_linear));
}
