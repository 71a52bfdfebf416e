// Storage types for the CPU kernels and their conversions to and from float (round to nearest even, the
// rounding torch uses), written out so that the kernels need neither torch nor compiler extensions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "../common/params.h"

namespace folio::cpu {

struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };

inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float to_float(float x) { return x; }
inline float to_float(BFloat16 x) { return bits_float(static_cast<uint32_t>(x.bits) << 16); }
inline float to_float(Half x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1fu;
  const uint32_t mantissa = x.bits & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf / nan
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

template <typename T> T from_float(float f);
template <> inline float from_float<float>(float f) { return f; }
template <> inline BFloat16 from_float<BFloat16>(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<uint16_t>((u >> 16) | 0x40u)};  // quiet nan
  return BFloat16{static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
template <> inline Half from_float<Half>(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return Half{static_cast<uint16_t>(sign | 0x7e00u)};  // nan
  if (magnitude >= 0x477ff000u) return Half{static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to inf
  if (magnitude < 0x38800000u) {  // below 2^-14: subnormal; scaling by 2^24 is exact, nearbyint rounds to even
    const float scaled = bits_float(magnitude) * 16777216.0f;
    return Half{static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(scaled)))};
  }
  magnitude += 0xfffu + ((magnitude >> 13) & 1u);  // round the 13 dropped bits to nearest even
  return Half{static_cast<uint16_t>(sign | ((magnitude - 0x38000000u) >> 13))};
}

// Calls fn(T{}) with T the storage type named by `type`.
template <typename Fn>
void dispatch_scalar(ScalarType type, Fn&& fn) {
  switch (type) {
    case ScalarType::kFloat32: fn(float{}); return;
    case ScalarType::kFloat16: fn(Half{}); return;
    case ScalarType::kBFloat16: fn(BFloat16{}); return;
  }
}

}  // namespace folio::cpu
