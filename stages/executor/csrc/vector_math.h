// Vector math shared by the CPU kernels (cpu_kernels.cpp, amx_linear.cpp, lora_products.cpp),
// on GCC vector extension types: AVX-512 registers where the CPU has them, narrower ones
// otherwise.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstring>

namespace llm_cpu_vec {

// N bf16 values widened to a vector of N floats (VF; VU16, VU32: N lanes of 16 and 32 bits):
// their bits shifted into place.
template <typename VF, typename VU16, typename VU32>
inline VF widen_lanes(const c10::BFloat16* p) {
  VU16 raw;
  std::memcpy(&raw, p, sizeof raw);
  const VU32 bits = __builtin_convertvector(raw, VU32) << 16;
  VF v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// exp on N lanes (VF: N floats, VI: N int32): Cephes' single-precision polynomial, written
// with vector operations (a loop over std::exp does not vectorize). Relative error ~1e-7;
// arguments are clamped to [-87, 88]; n rounded to the nearest integer by adding and
// subtracting 1.5 * 2^23.
template <typename VF, typename VI>
inline VF exp_lanes(VF x) {
  x = x < -87.0f ? VF{} - 87.0f : x;
  x = x > 88.0f ? VF{} + 88.0f : x;
  const VF n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  VF r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  VF y = VF{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  VF scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// log on N lanes of positive, finite floats (VF: N floats, VI: N int32): Cephes' logf, the
// exponent taken from the bits and the mantissa's log a polynomial. Relative error ~1e-7.
template <typename VF, typename VI>
inline VF log_lanes(VF x) {
  VI bits;
  std::memcpy(&bits, &x, sizeof bits);
  VI e = ((bits >> 23) & 0xff) - 126;
  const VI mbits = (bits & 0x007fffff) | 0x3f000000;  // the mantissa in [0.5, 1)
  VF m;
  std::memcpy(&m, &mbits, sizeof m);
  const VI low = m < 0.707106781186547524f;  // below sqrt(1/2): one exponent less, m doubled
  e = e + low;  // (a true lane is -1)
  m = (low ? m + m : m) - 1.0f;
  const VF z = m * m;
  VF y = VF{} + 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  const VF ef = __builtin_convertvector(e, VF);
  y = y - 2.12194440e-4f * ef;
  y = y - 0.5f * z;
  return m + y + 0.693359375f * ef;
}

}  // namespace llm_cpu_vec
