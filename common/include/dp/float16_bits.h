// float16_bits.h: the conversions of dp/float16.h on bit patterns, for the host and for CUDA.
//
// dp/float16.h states the rules (round to nearest, ties to even; NaNs quiet with their sign and
// the top of their payload; float16's overflow to infinity and its subnormals). Its functions
// take and return floats and bit_cast them (C++20). The arithmetic itself works on the bit
// patterns alone, here, in C++17 and marked for both compilers, so that CUDA's kernels
// (common/src/cuda/kernels.cu, whose nvcc compiles C++17) run the very code the host runs and
// the host's exhaustive tests (tests/test_float16.cpp) check: a device conversion is the host's
// bit for bit, NaN payloads included, where CUDA's own __float2bfloat16_rn and __float2half_rn
// choose their NaNs.
//
// Example (a kernel's body):
//
//   out[i] = dp::detail::bfloat16_bits_from_float_bits(__float_as_uint(in[i]));
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
/// Marks a function for the host and a CUDA device (nvcc); nothing for a host compiler.
#define DP_HOST_DEVICE __host__ __device__
#else
/// Marks a function for the host and a CUDA device (nvcc); nothing for a host compiler.
#define DP_HOST_DEVICE
#endif

namespace dp::detail {

/// The bfloat16 nearest to the float32 of bit pattern `bits`, ties to even, as a bit pattern;
/// a NaN gives a quiet NaN with the same sign and high payload bits.
DP_HOST_DEVICE constexpr std::uint16_t bfloat16_bits_from_float_bits(std::uint32_t bits) {
  if ((bits & 0x7fffffffu) > 0x7f800000u)  // NaN: keep the top of the payload, set quiet
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);
  // Add half an ulp of the result, less one when the kept part is even, then truncate: a
  // tie rounds up only from an odd value. An overflow carries into the exponent, which is
  // right (the largest finite values round up to infinity).
  const std::uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

/// The float32 bit pattern of the bfloat16 of bit pattern `bits`: exact.
DP_HOST_DEVICE constexpr std::uint32_t float_bits_from_bfloat16_bits(std::uint16_t bits) {
  return static_cast<std::uint32_t>(bits) << 16;
}

/// The float16 nearest to the float32 of bit pattern `bits`, ties to even, as a bit pattern:
/// past the largest finite value (65504, and the tie at 65520) infinity, below 2^-14 a
/// subnormal, below 2^-25 zero (2^-25 itself is the tie between 0 and 2^-24 and goes to 0, the
/// even one), the sign kept; a NaN gives a quiet NaN with the same sign and the top of its
/// payload.
DP_HOST_DEVICE constexpr std::uint16_t float16_bits_from_float_bits(std::uint32_t bits) {
  const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u)  // NaN
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x03ffu));
  if (magnitude >= 0x477ff000u)  // 65520 and above (infinity included): infinity
    return static_cast<std::uint16_t>(sign | 0x7c00u);
  if (magnitude >= 0x38800000u) {  // 2^-14 and above: a normal float16
    // Rebias the exponent (127 -> 15) in place, then round the 13 dropped bits as
    // bfloat16_bits_from_float_bits does; a carry out of the fraction correctly bumps the
    // exponent.
    const std::uint32_t rebiased = magnitude - ((127u - 15u) << 23);
    const std::uint32_t rounding = 0x0fffu + ((rebiased >> 13) & 1u);
    return static_cast<std::uint16_t>(sign | ((rebiased + rounding) >> 13));
  }
  // Below 2^-14: a subnormal m 2^-24 with m = round(|value| 2^24). The float's significand
  // with its implicit 1, shifted right so that its units are 2^-24, rounded to even.
  const std::uint32_t exponent = magnitude >> 23;
  if (exponent < 102) return sign;  // below 2^-25: rounds to zero (2^-25 itself is 102)
  const std::uint32_t significand = (magnitude & 0x007fffffu) | 0x00800000u;
  const std::uint32_t shift = 126u - exponent;  // 14 to 24 (value = significand 2^(e-150))
  const std::uint32_t kept = significand >> shift;
  const std::uint32_t dropped = significand & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  const std::uint32_t rounded =
      kept + ((dropped > half || (dropped == half && (kept & 1u))) ? 1u : 0u);
  return static_cast<std::uint16_t>(sign | rounded);  // 1024 is 2^-14: the carry is right
}

/// The float32 bit pattern of the float16 of bit pattern `bits`: exact (every float16 is a
/// float32).
DP_HOST_DEVICE constexpr std::uint32_t float_bits_from_float16_bits(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1fu;
  std::uint32_t fraction = bits & 0x03ffu;
  if (exponent == 0x1fu)  // infinity or NaN: the fraction becomes the payload's top
    return sign | 0x7f800000u | (fraction << 13);
  if (exponent != 0)  // normal: rebias 15 -> 127
    return sign | ((exponent + 127u - 15u) << 23) | (fraction << 13);
  if (fraction == 0) return sign;  // a signed zero
  // A subnormal, fraction 2^-24: shift the fraction up until its leading 1 is the implicit
  // bit of a normal number (bit 10), lowering the exponent by one per shift. Its exponent
  // starts as the smallest normal float16's, 2^-14, since fraction 2^-24 = (fraction 2^-10)
  // 2^-14.
  std::uint32_t biased = 127u - 14u;
  while ((fraction & 0x0400u) == 0) {
    fraction <<= 1;
    --biased;
  }
  return sign | (biased << 23) | ((fraction & 0x03ffu) << 13);
}

}  // namespace dp::detail
