// float16.h: the two 16-bit floating-point formats of mixed-precision training, bfloat16 and
// IEEE float16, as bit patterns, and their conversions to and from float32.
//
// Mixed precision keeps parameters, activations and gradients in 2 bytes and the optimizer's
// master weights in float32 (ZeRO's 2 + 2 + 12 bytes per parameter). The two formats trade
// range for precision:
//
//   format     sign  exponent  fraction  largest finite   smallest normal  epsilon
//   float32     1       8        23      3.4e38           1.2e-38          2^-23
//   bfloat16    1       8         7      3.4e38           1.2e-38          2^-7
//   float16     1       5        10      65504            6.1e-5           2^-10
//
// bfloat16 is float32 with its low 16 bits dropped: float32's range, so a gradient does not
// overflow, but 8 bits of precision, so a long sum loses its small terms. float16 has 11 bits
// of precision but overflows past 65504 and flushes below 2^-24, which is why fp16 training
// scales its loss.
//
// The conversions from float32 round to nearest, ties to even (IEEE 754's default, what
// PyTorch's `tensor.to(torch.bfloat16)` and CUDA's __float2bfloat16_rn and __float2half_rn
// do). Special cases: a NaN stays a NaN (quiet, its sign and its high payload bits kept); an
// infinity stays an infinity; float16 rounds a magnitude of 65520 or more to infinity (65520
// is the tie between 65504 and the next value the format would have, 65536, and rounds to
// the even one, which does not exist), and below 2^-14 gives subnormals down to 2^-24 and
// then zero, with the sign kept. Converting to float32 is exact.
//
// Example:
//
//   dp::BFloat16 b = dp::to_bfloat16(3.14159f);   // bits 0x4049: 3.140625
//   float back = dp::to_float(b);                 // 3.140625f, exactly
//   dp::Float16 h = dp::to_float16(1e5f);         // +infinity: past float16's range
#pragma once

#include <bit>
#include <cstdint>

namespace dp {

/// A bfloat16 value: the high 16 bits of a float32 (1 sign, 8 exponent, 7 fraction bits).
struct BFloat16 {
  std::uint16_t bits = 0;  ///< the bit pattern
  /// Bitwise equality (so +0 and -0 differ, and a NaN equals the same NaN).
  friend bool operator==(BFloat16, BFloat16) = default;
};

/// An IEEE 754 binary16 value (1 sign, 5 exponent, 10 fraction bits).
struct Float16 {
  std::uint16_t bits = 0;  ///< the bit pattern
  /// Bitwise equality (so +0 and -0 differ, and a NaN equals the same NaN).
  friend bool operator==(Float16, Float16) = default;
};

/// `value` rounded to the nearest bfloat16, ties to even; a NaN gives a quiet NaN with the
/// same sign and high payload bits.
constexpr BFloat16 to_bfloat16(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u)  // NaN: keep the top of the payload, set quiet
    return {static_cast<std::uint16_t>((bits >> 16) | 0x0040u)};
  // Add half an ulp of the result, less one when the kept part is even, then truncate: a
  // tie rounds up only from an odd value. An overflow carries into the exponent, which is
  // right (the largest finite values round up to infinity).
  const std::uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return {static_cast<std::uint16_t>((bits + rounding) >> 16)};
}

/// The float32 of `value`: exact.
constexpr float to_float(BFloat16 value) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(value.bits) << 16);
}

/// `value` rounded to the nearest float16, ties to even: past the largest finite value
/// (65504, and the tie at 65520) infinity, below 2^-14 a subnormal, below 2^-25 zero (2^-25
/// itself is the tie between 0 and 2^-24 and goes to 0, the even one), the sign kept; a
/// NaN gives a quiet NaN with the same sign and the top of its payload.
constexpr Float16 to_float16(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u)  // NaN
    return {static_cast<std::uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x03ffu))};
  if (magnitude >= 0x477ff000u)  // 65520 and above (infinity included): infinity
    return {static_cast<std::uint16_t>(sign | 0x7c00u)};
  if (magnitude >= 0x38800000u) {  // 2^-14 and above: a normal float16
    // Rebias the exponent (127 -> 15) in place, then round the 13 dropped bits as
    // to_bfloat16 does; a carry out of the fraction correctly bumps the exponent.
    const std::uint32_t rebiased = magnitude - ((127u - 15u) << 23);
    const std::uint32_t rounding = 0x0fffu + ((rebiased >> 13) & 1u);
    return {static_cast<std::uint16_t>(sign | ((rebiased + rounding) >> 13))};
  }
  // Below 2^-14: a subnormal m 2^-24 with m = round(|value| 2^24). The float's significand
  // with its implicit 1, shifted right so that its units are 2^-24, rounded to even.
  const std::uint32_t exponent = magnitude >> 23;
  if (exponent < 102) return {sign};  // below 2^-25: rounds to zero (2^-25 itself is 102)
  const std::uint32_t significand = (magnitude & 0x007fffffu) | 0x00800000u;
  const std::uint32_t shift = 126u - exponent;  // 14 to 24 (value = significand 2^(e-150))
  const std::uint32_t kept = significand >> shift;
  const std::uint32_t dropped = significand & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  const std::uint32_t rounded =
      kept + ((dropped > half || (dropped == half && (kept & 1u))) ? 1u : 0u);
  return {static_cast<std::uint16_t>(sign | rounded)};  // 1024 is 2^-14: the carry is right
}

/// The float32 of `value`: exact (every float16 is a float32).
constexpr float to_float(Float16 value) {
  const std::uint32_t sign = static_cast<std::uint32_t>(value.bits & 0x8000u) << 16;
  const std::uint32_t exponent = (value.bits >> 10) & 0x1fu;
  const std::uint32_t fraction = value.bits & 0x03ffu;
  if (exponent == 0x1fu)  // infinity or NaN: the fraction becomes the payload's top
    return std::bit_cast<float>(sign | 0x7f800000u | (fraction << 13));
  if (exponent != 0)  // normal: rebias 15 -> 127
    return std::bit_cast<float>(sign | ((exponent + 127u - 15u) << 23) | (fraction << 13));
  // Zero or subnormal: fraction 2^-24, exact in float32 (a product by a power of two).
  const float magnitude = static_cast<float>(fraction) * 0x1p-24f;
  return sign != 0 ? -magnitude : magnitude;
}

}  // namespace dp
