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
// then zero, with the sign kept. Converting to float32 is exact. The arithmetic works on bit
// patterns, in dp/float16_bits.h, which CUDA's kernels share (so a device conversion is the
// host's bit for bit).
//
// Example:
//
//   dp::BFloat16 b = dp::to_bfloat16(3.14159f);   // bits 0x4049: 3.140625
//   float back = dp::to_float(b);                 // 3.140625f, exactly
//   dp::Float16 h = dp::to_float16(1e5f);         // +infinity: past float16's range
#pragma once

#include <bit>
#include <cstdint>

#include "dp/float16_bits.h"

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
  return {detail::bfloat16_bits_from_float_bits(std::bit_cast<std::uint32_t>(value))};
}

/// The float32 of `value`: exact.
constexpr float to_float(BFloat16 value) {
  return std::bit_cast<float>(detail::float_bits_from_bfloat16_bits(value.bits));
}

/// `value` rounded to the nearest float16, ties to even: past the largest finite value
/// (65504, and the tie at 65520) infinity, below 2^-14 a subnormal, below 2^-25 zero (2^-25
/// itself is the tie between 0 and 2^-24 and goes to 0, the even one), the sign kept; a
/// NaN gives a quiet NaN with the same sign and the top of its payload.
constexpr Float16 to_float16(float value) {
  return {detail::float16_bits_from_float_bits(std::bit_cast<std::uint32_t>(value))};
}

/// The float32 of `value`: exact (every float16 is a float32).
constexpr float to_float(Float16 value) {
  return std::bit_cast<float>(detail::float_bits_from_float16_bits(value.bits));
}

}  // namespace dp
