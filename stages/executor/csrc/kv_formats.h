// The KV cache's 8-bit formats (stages/executor/kv_pool.py owns them on the Python side): how a
// head's key or value is written into the cache, and how a page's rows are widened to float
// inside the attention kernel (cpu_kernels.cpp), into the thread's own buffer (a page, or 16
// keys of a prompt tile, at a time).
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
// int8 pages are widened into the thread's buffer (or, for a decode on VNNI, read in place:
// cpu_kernels.cpp, int8_group_keys); fp8 elements are read in place as bf16's are, widened in
// registers (cpu_kernels.cpp, widen_lanes: through fp16 where the CPU has F16C and AVX-512,
// else fp8_lanes here: integer work on the lanes, with no lookup table and no float multiply
// of a subnormal, which costs x86 a microcode assist a lane unless denormals are flushed).
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <immintrin.h>

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

// 16 int8 codes widened to floats, times their row's scale. (GCC 12 compiles the one-step
// __builtin_convertvector from 8-bit lanes to floats as 16 scalar conversions, vcvtsi2ss and
// inserts: a fifth of an int8 prompt's attention. Through 32-bit lanes it is two instructions.)
#if defined(__AVX512F__)
inline __m512 int8_codes16(const uint8_t* p) {  // (the codes as floats, unscaled)
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif
inline v16f widen16(const uint8_t* p, float scale) {
#if defined(__AVX512F__)
  const __m512 f = int8_codes16(p);
  v16f out;
  std::memcpy(&out, &f, sizeof out);
  return out * scale;
#else
  v16i8 codes;
  std::memcpy(&codes, p, sizeof codes);
  return __builtin_convertvector(__builtin_convertvector(codes, v16i), v16f) * scale;
#endif
}

// fp8 codes (in the lanes of b, one a lane) as floats, VF's lanes at a time. kMantissa: the
// format's mantissa bits (e4m3: 3, e5m2: 2); kRebase: 127 less its exponent bias (120, 112).
// A normal code's magnitude bits moved into a float's place and its exponent rebased; a
// subnormal one (exponent 0) is its mantissa times the least subnormal, exactly, from an
// integer; the sign bit moved to a float's.
template <typename VF, typename VU32, int kMantissa, uint32_t kRebase>
inline VF fp8_lanes(VU32 b) {
  const VU32 mag = b & 0x7Fu, sign = (b & 0x80u) << 24;
  const VU32 normal_bits = (mag << (23 - kMantissa)) + (kRebase << 23);
  VF normal;
  std::memcpy(&normal, &normal_bits, sizeof normal);
  // (the least subnormal: 2^(1 - bias - mantissa bits), bias = 127 - kRebase)
  constexpr float unit = 1.0f / static_cast<float>(1u << (127 - kRebase + kMantissa - 1));
  const VF sub = __builtin_convertvector(mag & ((1u << kMantissa) - 1), VF) * unit;
  const VF value = (mag >> kMantissa) != 0u ? normal : sub;
  VU32 bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits |= sign;
  VF out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
// N fp8 codes (N: VF's lanes) widened.
template <typename VF, typename VU32, int kMantissa, uint32_t kRebase>
inline VF widen_fp8(const uint8_t* p) {
  constexpr int n = sizeof(VF) / sizeof(float);
  typedef uint8_t VU8 __attribute__((vector_size(n)));
  VU8 codes;
  std::memcpy(&codes, p, sizeof codes);
  return fp8_lanes<VF, VU32, kMantissa, kRebase>(__builtin_convertvector(codes, VU32));
}

// One int8 code widened (a head size that is not a multiple of 16: its tail).
inline float widen1(uint8_t code, float scale) {
  return static_cast<float>(static_cast<int8_t>(code)) * scale;
}

// An int8 row's scale: the fp16 after its D codes.
inline float row_scale(const uint8_t* row, int64_t d) {
  uint16_t bits;
  std::memcpy(&bits, row + d, sizeof bits);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// rows x d values of int8 rows `stride` bytes apart, as contiguous float rows in dst.
inline void widen_int8_rows(const uint8_t* src, int64_t stride, int64_t d, int64_t rows,
                            float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* from = src + r * stride;
    const float scale = row_scale(from, d);
    float* to = dst + r * d;
    int64_t e = 0;
    for (; e + 16 <= d; e += 16) {
      const v16f v = widen16(from + e, scale);
      std::memcpy(to + e, &v, sizeof v);
    }
    for (; e < d; ++e) to[e] = widen1(from[e], scale);
  }
}

// x [d] (float) written as a row of the format at dst.
inline void quantize_row(const float* x, int64_t d, uint8_t* dst, Int8Rows) {
  float amax = 0.0f;
  int64_t e0 = 0;
#if defined(__AVX512F__)
  __m512 top = _mm512_setzero_ps();
  for (; e0 + 16 <= d; e0 += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(x + e0)));
  amax = _mm512_reduce_max_ps(top);
#endif
  for (int64_t e = e0; e < d; ++e) amax = std::max(amax, std::fabs(x[e]));
  const float wanted = amax / 127.0f;
  c10::Half scale(std::min(wanted, 65504.0f));
  if (static_cast<float>(scale) < wanted && scale.x != 0x7BFF) ++scale.x;  // (rounded up)
  const float s = static_cast<float>(scale);
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
  int64_t e = 0;
#if defined(__AVX512F__)
  // (rounded to nearest even, as nearbyint; |x| * inv <= 127 by the scale's rounding up, and
  // the saturating narrowing makes sure of it)
  for (; e + 16 <= d; e += 16) {
    const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + e),
                                                           _mm512_set1_ps(inv)));
    const __m512i kept = _mm512_max_epi32(codes, _mm512_set1_epi32(-127));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + e), _mm512_cvtsepi32_epi8(kept));
  }
#endif
  for (; e < d; ++e) {
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
