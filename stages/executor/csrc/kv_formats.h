// The KV cache's 8-bit formats (stages/executor/kv_pool.py owns them on the Python side): how a
// head's key or value is written into the cache, and how a page's rows are widened to float
// inside the attention kernel (cpu_kernels.cpp), into the thread's own buffer, a page at a time.
//
// A cache in the model's dtype holds each head's key or value as D elements of that dtype. The
// 8-bit formats hold it as bytes (the cache tensor's dtype says which):
//   int8 (torch.int8, rows of D + 2): D codes, then the row's scale as fp16 (its two bytes);
//     value = code * scale, scale = max|x| / 127 rounded up to fp16 (so no code passes 127);
//     llama.cpp's q8_0 keeps an fp16 scale per 32 elements, vLLM has none for int8. (Keys
//     are rotated before they are quantized: cpu_kernels.cpp, `rotate_keys`.)
//   fp8_e4m3 (torch.float8_e4m3fn) and fp8_e5m2 (torch.float8_e5m2), rows of D: the code's own
//     value, with no scale (1.0: vLLM's when a checkpoint carries no calibrated one); a value
//     past the format's largest finite one (448, 57344) is stored as that one, as vLLM's
//     saturating conversion does.
// Widening is integer work on vector lanes: no lookup table, and no float multiply of a
// subnormal (which costs x86 a microcode assist a lane unless denormals are flushed).
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace llm_cpu_kv {

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef int8_t v16i8 __attribute__((vector_size(16)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));

// The formats, as tags: extra bytes a row carries past its D codes.
struct Int8Rows {
  static constexpr int64_t kExtra = 2;
};
struct E4M3Rows {
  static constexpr int64_t kExtra = 0;
};
struct E5M2Rows {
  static constexpr int64_t kExtra = 0;
};

inline v16f as_floats(v16u32 bits) {
  v16f f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// 16 codes widened to floats.
inline v16f widen16(const uint8_t* p, float scale, Int8Rows) {
  v16i8 codes;
  std::memcpy(&codes, p, sizeof codes);
  return __builtin_convertvector(codes, v16f) * scale;
}
// e4m3: sign, 4 exponent bits (bias 7), 3 mantissa bits. A normal code's magnitude bits moved
// into a float's place and its exponent rebased by 127 - 7; a subnormal one (exponent 0) is
// its mantissa * 2^-9, exactly, from an integer.
inline v16f widen16(const uint8_t* p, float, E4M3Rows) {
  v16u8 codes;
  std::memcpy(&codes, p, sizeof codes);
  const v16u32 b = __builtin_convertvector(codes, v16u32);
  const v16u32 mag = b & 0x7Fu, sign = (b & 0x80u) << 24;
  const v16f normal = as_floats((mag << 20) + (120u << 23));
  const v16f sub = __builtin_convertvector(mag & 7u, v16f) * (1.0f / 512.0f);
  const v16f value = (mag >> 3) != 0u ? normal : sub;
  v16u32 bits;
  std::memcpy(&bits, &value, sizeof bits);
  return as_floats(bits | sign);
}
// e5m2: sign, 5 exponent bits (bias 15), 2 mantissa bits (fp16's upper byte); as e4m3.
inline v16f widen16(const uint8_t* p, float, E5M2Rows) {
  v16u8 codes;
  std::memcpy(&codes, p, sizeof codes);
  const v16u32 b = __builtin_convertvector(codes, v16u32);
  const v16u32 mag = b & 0x7Fu, sign = (b & 0x80u) << 24;
  const v16f normal = as_floats((mag << 21) + (112u << 23));
  const v16f sub = __builtin_convertvector(mag & 3u, v16f) * (1.0f / 65536.0f);
  const v16f value = (mag >> 2) != 0u ? normal : sub;
  v16u32 bits;
  std::memcpy(&bits, &value, sizeof bits);
  return as_floats(bits | sign);
}

// One code widened (a head size that is not a multiple of 16: its tail).
inline float widen1(uint8_t code, float scale, Int8Rows) {
  return static_cast<float>(static_cast<int8_t>(code)) * scale;
}
inline float widen1(uint8_t code, float, E4M3Rows) {
  return static_cast<float>(c10::Float8_e4m3fn(code, c10::Float8_e4m3fn::from_bits()));
}
inline float widen1(uint8_t code, float, E5M2Rows) {
  return static_cast<float>(c10::Float8_e5m2(code, c10::Float8_e5m2::from_bits()));
}

// A row's scale: the fp16 after its D codes (int8), or none.
inline float row_scale(const uint8_t* row, int64_t d, Int8Rows) {
  c10::Half h;
  std::memcpy(&h.x, row + d, sizeof h.x);
  return static_cast<float>(h);
}
inline float row_scale(const uint8_t*, int64_t, E4M3Rows) { return 1.0f; }
inline float row_scale(const uint8_t*, int64_t, E5M2Rows) { return 1.0f; }

// rows x d values of rows `stride` bytes apart, as contiguous float rows in dst.
template <typename F>
inline void widen_rows(const uint8_t* src, int64_t stride, int64_t d, int64_t rows, float* dst,
                       F format) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* from = src + r * stride;
    const float scale = row_scale(from, d, format);
    float* to = dst + r * d;
    int64_t e = 0;
    for (; e + 16 <= d; e += 16) {
      const v16f v = widen16(from + e, scale, format);
      std::memcpy(to + e, &v, sizeof v);
    }
    for (; e < d; ++e) to[e] = widen1(from[e], scale, format);
  }
}

// x [d] (float) written as a row of the format at dst.
inline void quantize_row(const float* x, int64_t d, uint8_t* dst, Int8Rows) {
  float amax = 0.0f;
  for (int64_t e = 0; e < d; ++e) amax = std::max(amax, std::fabs(x[e]));
  const float wanted = amax / 127.0f;
  c10::Half scale(std::min(wanted, 65504.0f));
  if (static_cast<float>(scale) < wanted && scale.x != 0x7BFF) ++scale.x;  // (rounded up)
  const float s = static_cast<float>(scale);
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
  for (int64_t e = 0; e < d; ++e) {
    const float code = std::nearbyint(x[e] * inv);
    dst[e] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(code, -127.0f, 127.0f)));
  }
  std::memcpy(dst + d, &scale.x, sizeof scale.x);
}
inline void quantize_row(const float* x, int64_t d, uint8_t* dst, E4M3Rows) {
  for (int64_t e = 0; e < d; ++e) dst[e] = c10::Float8_e4m3fn(std::clamp(x[e], -448.0f, 448.0f)).x;
}
inline void quantize_row(const float* x, int64_t d, uint8_t* dst, E5M2Rows) {
  for (int64_t e = 0; e < d; ++e) {
    dst[e] = c10::Float8_e5m2(std::clamp(x[e], -57344.0f, 57344.0f)).x;
  }
}

}  // namespace llm_cpu_kv
