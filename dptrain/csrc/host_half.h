// The CUDA spellings update.cu uses, for a host C++ compiler: the storage types __half and
// __nv_bfloat16 with their round-to-nearest-even conversions, and the __host__/__device__
// qualifiers as nothing. Included by update.cu when it is not compiled by NVRTC or nvcc
// (dptrain/kernels/native.py builds it with the system C++ compiler as the CPU update).
//
// The conversions give torch's CPU bits for every number: float -> bfloat16 rounds to nearest
// even (a NaN becomes the quiet NaN 0x7fc0, as c10::BFloat16's scalar conversion makes it; torch's
// vectorised cast can give another NaN payload), float -> half rounds to nearest even, with the
// F16C instruction where the compiler targets it, else in integer arithmetic here (the same bits
// as F16C for every fp32 input).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#define __host__
#define __device__
#define __forceinline__ inline __attribute__((always_inline))

struct __half {
  std::uint16_t x;
};
struct __nv_bfloat16 {
  std::uint16_t x;
};

namespace dpt_host {
inline std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
}  // namespace dpt_host

__forceinline__ float __bfloat162float(__nv_bfloat16 h) { return dpt_host::from_bits(std::uint32_t(h.x) << 16); }

__forceinline__ __nv_bfloat16 __float2bfloat16_rn(float f) {
  const std::uint32_t u = dpt_host::bits(f);
  if (f != f) return __nv_bfloat16{0x7fc0};
  return __nv_bfloat16{static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

#if defined(__F16C__)
__forceinline__ float __half2float(__half h) { return _cvtsh_ss(h.x); }
__forceinline__ __half __float2half_rn(float f) {
  return __half{static_cast<std::uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))};
}
#else
__forceinline__ float __half2float(__half h) {
  const std::uint32_t sign = std::uint32_t(h.x & 0x8000u) << 16;
  const std::uint32_t exp = (h.x >> 10) & 0x1fu, man = h.x & 0x3ffu;
  if (exp == 0x1f) return dpt_host::from_bits(sign | 0x7f800000u | (man << 13));  // inf, NaN
  if (exp != 0) return dpt_host::from_bits(sign | ((exp + 112u) << 23) | (man << 13));
  // zero or subnormal: man * 2^-24, exact in fp32
  const float mag = static_cast<float>(man) * 5.9604644775390625e-8f;
  return sign ? -mag : mag;
}
__forceinline__ __half __float2half_rn(float f) {
  const std::uint32_t u = dpt_host::bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return __half{static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu))};  // NaN
  if (a >= 0x477ff000u) return __half{static_cast<std::uint16_t>(sign | 0x7c00u)};  // rounds to inf (>= 65520)
  if (a >= 0x38800000u) {  // normal in fp16 (>= 2^-14): drop 13 bits, nearest even
    const std::uint32_t r = a - 0x38000000u;  // rebias the exponent by 127 - 15
    return __half{static_cast<std::uint16_t>(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13))};
  }
  if (a < 0x33000000u) return __half{sign};  // below half the smallest subnormal (2^-25): zero
  // subnormal in fp16: the value in units of 2^-24, rounded to nearest even
  const std::uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
  const std::uint32_t shift = 126u - e;  // 14..24 for e in [102, 112]
  std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return __half{static_cast<std::uint16_t>(sign | q)};
}
#endif
