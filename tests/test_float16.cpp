// Unit tests of dp/float16.h: bfloat16 and float16 conversions against independent oracles.
//
// float16's oracle is the compiler's own _Float16 (GCC and Clang on x86-64 convert with
// IEEE round to nearest, ties to even, in libgcc or compiler-rt): every float16 value, every
// tie between two neighbours and a sweep of float32 are compared with it. bfloat16's oracle
// is written here from the definition, in double: of the two bfloat16 values around x, the
// nearer, and the even one on a tie (differences of floats are exact in double).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "dp/float16.h"

namespace {

bool is_nan_bits_bf16(std::uint16_t bits) {
  return (bits & 0x7f80u) == 0x7f80u && (bits & 0x007fu) != 0;
}

// The bfloat16 nearest to finite or infinite x, ties to even, from the definition.
std::uint16_t bfloat16_oracle(float x) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t sign = bits & 0x80000000u;
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) return static_cast<std::uint16_t>(bits >> 16);  // infinity
  const std::uint32_t below = magnitude & 0xffff0000u;  // the bfloat16 at or below |x|
  const std::uint32_t above = below + 0x10000u;         // the next one (maybe infinity)
  const double value = std::bit_cast<float>(magnitude);
  const double low = std::bit_cast<float>(below);
  // Past the largest finite bfloat16 the next value of the format would be 2^128.
  const double high = above == 0x7f800000u ? std::ldexp(1.0, 128)
                                           : static_cast<double>(std::bit_cast<float>(above));
  std::uint32_t nearest = below;
  if (value - low > high - value || (value - low == high - value && (below & 0x10000u) != 0))
    nearest = above;
  return static_cast<std::uint16_t>((sign | nearest) >> 16);
}

// _Float16 exists in GCC 12 and in Clang from 15 on x86-64 (not in Clang 14, the sanitize
// build's compiler, where these three comparisons are compiled out and the exact cases of
// Float16.RangeSubnormalsAndSpecialValues remain).
#if defined(__FLT16_MANT_DIG__)
bool is_nan_bits_f16(std::uint16_t bits) {
  return (bits & 0x7c00u) == 0x7c00u && (bits & 0x03ffu) != 0;
}
std::uint16_t float16_oracle(float x) {
  return std::bit_cast<std::uint16_t>(static_cast<_Float16>(x));
}
float float16_to_float_oracle(std::uint16_t bits) {
  return static_cast<float>(std::bit_cast<_Float16>(bits));
}
#endif

TEST(BFloat16, EveryValueConvertsToFloatExactlyAndBack) {
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const dp::BFloat16 value{static_cast<std::uint16_t>(bits)};
    const float widened = dp::to_float(value);
    EXPECT_EQ(std::bit_cast<std::uint32_t>(widened), bits << 16) << std::hex << bits;
    const dp::BFloat16 back = dp::to_bfloat16(widened);
    if (is_nan_bits_bf16(value.bits)) {
      // A NaN stays a NaN of the same sign and payload, made quiet.
      EXPECT_EQ(back.bits, value.bits | 0x0040u) << std::hex << bits;
    } else {
      EXPECT_EQ(back, value) << std::hex << bits;
    }
  }
}

TEST(BFloat16, EveryTieAndItsNeighboursRoundAsTheDefinitionSays) {
  // For every finite bfloat16 b: the float exactly halfway to the next one, and the floats
  // one ulp either side of it.
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    if ((bits & 0x7f80u) == 0x7f80u) continue;  // infinities and NaNs have no next value
    const std::uint32_t tie = (bits << 16) | 0x8000u;
    for (const std::uint32_t probe : {tie - 1, tie, tie + 1}) {
      const float x = std::bit_cast<float>(probe);
      ASSERT_EQ(dp::to_bfloat16(x).bits, bfloat16_oracle(x)) << std::hex << probe;
    }
    // The tie itself goes to the even one of the two.
    const std::uint16_t expected =
        (bits & 1u) == 0 ? static_cast<std::uint16_t>(bits) : static_cast<std::uint16_t>(bits + 1);
    EXPECT_EQ(dp::to_bfloat16(std::bit_cast<float>(tie)).bits, expected) << std::hex << bits;
  }
}

TEST(BFloat16, ASweepOfFloat32MatchesTheDefinition) {
  // Every 4099th float32 bit pattern (an odd stride: every low-bit pattern is visited).
  for (std::uint64_t probe = 0; probe <= 0xffffffffu; probe += 4099) {
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(probe));
    if (std::isnan(x)) continue;
    ASSERT_EQ(dp::to_bfloat16(x).bits, bfloat16_oracle(x)) << std::hex << probe;
  }
}

TEST(BFloat16, SpecialValues) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(dp::to_bfloat16(0.0f).bits, 0x0000u);
  EXPECT_EQ(dp::to_bfloat16(-0.0f).bits, 0x8000u);
  EXPECT_EQ(dp::to_bfloat16(kInf).bits, 0x7f80u);
  EXPECT_EQ(dp::to_bfloat16(-kInf).bits, 0xff80u);
  EXPECT_EQ(dp::to_bfloat16(1.0f).bits, 0x3f80u);
  EXPECT_EQ(dp::to_bfloat16(3.14159f).bits, 0x4049u);  // 3.140625
  // The largest float rounds past the largest bfloat16 (0x7f7f, 3.3895e38): infinity.
  EXPECT_EQ(dp::to_bfloat16(std::numeric_limits<float>::max()).bits, 0x7f80u);
  EXPECT_EQ(dp::to_bfloat16(std::bit_cast<float>(0x7f7f7fffu)).bits, 0x7f7fu);
  // A signalling NaN whose payload lies in the dropped bits stays a NaN (not infinity).
  EXPECT_EQ(dp::to_bfloat16(std::bit_cast<float>(0x7f800001u)).bits, 0x7fc0u);
  EXPECT_EQ(dp::to_bfloat16(std::bit_cast<float>(0xffc12345u)).bits, 0xffc1u);
  // Float32 subnormals round like any value: 2^-133 is bfloat16's subnormal 0x0001.
  EXPECT_EQ(dp::to_bfloat16(std::ldexp(1.0f, -133)).bits, 0x0001u);
  static_assert(dp::to_bfloat16(1.0f).bits == 0x3f80u, "usable in constant expressions");
}

#if defined(__FLT16_MANT_DIG__)

TEST(Float16, EveryValueMatchesTheCompilersFloat16BothWays) {
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const dp::Float16 value{static_cast<std::uint16_t>(bits)};
    const float widened = dp::to_float(value);
    if (is_nan_bits_f16(value.bits)) {
      EXPECT_TRUE(std::isnan(widened)) << std::hex << bits;
      EXPECT_EQ(std::signbit(widened), (bits & 0x8000u) != 0) << std::hex << bits;
      // Back: a NaN of the same sign and payload, made quiet.
      EXPECT_EQ(dp::to_float16(widened).bits, value.bits | 0x0200u) << std::hex << bits;
      continue;
    }
    EXPECT_EQ(std::bit_cast<std::uint32_t>(widened),
              std::bit_cast<std::uint32_t>(float16_to_float_oracle(value.bits)))
        << std::hex << bits;
    EXPECT_EQ(dp::to_float16(widened), value) << std::hex << bits;
  }
}

TEST(Float16, EveryTieAndItsNeighboursMatchTheCompilersFloat16) {
  // For each finite float16 below the largest, the float32 halfway to the next (exact: 12
  // bits of significand) and one float32 ulp either side: subnormals, the subnormal-normal
  // boundary and the overflow tie at 65520 among them.
  for (std::uint32_t bits = 0; bits < 0x7c00u; ++bits) {
    for (const std::uint32_t sign : {0x0000u, 0x8000u}) {
      const float low = dp::to_float(dp::Float16{static_cast<std::uint16_t>(sign | bits)});
      const float high =
          bits == 0x7bffu
              ? (sign ? -65536.0f : 65536.0f)
              : dp::to_float(dp::Float16{static_cast<std::uint16_t>(sign | (bits + 1))});
      const float tie = (low + high) / 2;  // exact
      for (const float x : {std::nextafter(tie, low), tie, std::nextafter(tie, high)})
        ASSERT_EQ(dp::to_float16(x).bits, float16_oracle(x))
            << std::hex << (sign | bits) << " probe " << std::bit_cast<std::uint32_t>(x);
    }
  }
}

TEST(Float16, ASweepOfFloat32MatchesTheCompilersFloat16) {
  for (std::uint64_t probe = 0; probe <= 0xffffffffu; probe += 4099) {
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(probe));
    if (std::isnan(x)) continue;
    ASSERT_EQ(dp::to_float16(x).bits, float16_oracle(x)) << std::hex << probe;
  }
}

#endif  // __FLT16_MANT_DIG__

TEST(Float16, RangeSubnormalsAndSpecialValues) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(dp::to_float16(65504.0f).bits, 0x7bffu);  // the largest finite float16
  EXPECT_EQ(dp::to_float16(std::nextafter(65520.0f, 0.0f)).bits, 0x7bffu);
  EXPECT_EQ(dp::to_float16(65520.0f).bits, 0x7c00u);  // the tie with 65536: infinity
  EXPECT_EQ(dp::to_float16(-1e6f).bits, 0xfc00u);
  EXPECT_EQ(dp::to_float16(kInf).bits, 0x7c00u);
  EXPECT_EQ(dp::to_float16(std::ldexp(1.0f, -14)).bits, 0x0400u);  // the smallest normal
  EXPECT_EQ(dp::to_float16(std::ldexp(1.0f, -24)).bits, 0x0001u);  // the smallest subnormal
  EXPECT_EQ(dp::to_float16(std::ldexp(1.0f, -25)).bits, 0x0000u);  // the tie with 0: even
  EXPECT_EQ(dp::to_float16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)).bits, 0x0001u);
  EXPECT_EQ(dp::to_float16(1.5f * std::ldexp(1.0f, -24)).bits, 0x0002u);  // tie 1|2: even
  EXPECT_EQ(dp::to_float16(-std::ldexp(1.0f, -30)).bits, 0x8000u);        // -0: the sign kept
  EXPECT_EQ(dp::to_float16(1.0f + std::ldexp(1.0f, -11)).bits, 0x3c00u);  // tie: even, 1
  EXPECT_EQ(dp::to_float16(1.0f + 3 * std::ldexp(1.0f, -11)).bits, 0x3c02u);
  EXPECT_EQ(dp::to_float16(std::bit_cast<float>(0x7f800001u)).bits, 0x7e00u);  // NaN, quiet
  EXPECT_EQ(dp::to_float(dp::Float16{0x0001u}), std::ldexp(1.0f, -24));
  EXPECT_EQ(dp::to_float(dp::Float16{0x7bffu}), 65504.0f);
  EXPECT_EQ(dp::to_float(dp::Float16{0xfc00u}), -kInf);
  static_assert(dp::to_float16(1.0f).bits == 0x3c00u, "usable in constant expressions");
}

}  // namespace
