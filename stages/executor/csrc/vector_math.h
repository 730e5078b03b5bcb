// Vector math shared by the CPU kernels (cpu_kernels.cpp, amx_linear.cpp), on GCC vector
// extension types: AVX-512 registers where the CPU has them, narrower ones otherwise.
#pragma once

#include <cstring>

namespace llm_cpu_vec {

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

}  // namespace llm_cpu_vec
