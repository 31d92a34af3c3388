// Tests of dp::CounterRng and philox4x32: known answers, determinism, independence of
// streams, the ranges and moments of each distribution, unbiased `below`, and `seek`.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dp/error.h"
#include "dp/rng.h"

namespace {

// Random123's published known-answer vectors for Philox4x32-10 (kat_vectors).
TEST(Philox, MatchesKnownAnswerVectors) {
  EXPECT_EQ(dp::philox4x32({0, 0, 0, 0}, {0, 0}),
            (std::array<std::uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(
      dp::philox4x32({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
      (std::array<std::uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(
      dp::philox4x32({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
      (std::array<std::uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

std::vector<std::uint32_t> draw_u32(dp::CounterRng& rng, int count) {
  std::vector<std::uint32_t> values;
  for (int i = 0; i < count; ++i) values.push_back(rng.next_u32());
  return values;
}

TEST(CounterRng, SameSeedAndStreamGiveTheSameSequence) {
  dp::CounterRng a(42, 7);
  dp::CounterRng b(42, 7);
  EXPECT_EQ(draw_u32(a, 1000), draw_u32(b, 1000));
}

TEST(CounterRng, OutputsAreThePhiloxBlocksOfTheStream) {
  // Position i is output i % 4 of block i / 4, with counter (block, stream), key seed.
  const std::uint64_t seed = 0x0123456789abcdefULL;
  const std::uint64_t stream = 0xfedcba9876543210ULL;
  dp::CounterRng rng(seed, stream);
  rng.seek(4 * 5);  // block 5
  const auto block = dp::philox4x32({5, 0, 0x76543210, 0xfedcba98}, {0x89abcdef, 0x01234567});
  for (std::uint32_t expected : block) EXPECT_EQ(rng.next_u32(), expected);
}

TEST(CounterRng, DifferentStreamsAndSeedsAreUncorrelated) {
  // Pearson correlation of 20000 uniform pairs: about N(0, 1/sqrt(20000) = 0.007).
  const auto correlation = [](dp::CounterRng a, dp::CounterRng b) {
    constexpr int kCount = 20000;
    double sum_a = 0, sum_b = 0, sum_ab = 0, sum_aa = 0, sum_bb = 0;
    int equal = 0;
    for (int i = 0; i < kCount; ++i) {
      const double x = a.uniform();
      const double y = b.uniform();
      if (x == y) ++equal;
      sum_a += x;
      sum_b += y;
      sum_ab += x * y;
      sum_aa += x * x;
      sum_bb += y * y;
    }
    EXPECT_LT(equal, 10);
    const double cov = sum_ab / kCount - (sum_a / kCount) * (sum_b / kCount);
    const double var_a = sum_aa / kCount - (sum_a / kCount) * (sum_a / kCount);
    const double var_b = sum_bb / kCount - (sum_b / kCount) * (sum_b / kCount);
    return cov / std::sqrt(var_a * var_b);
  };
  EXPECT_LT(std::abs(correlation(dp::CounterRng(1, 0), dp::CounterRng(1, 1))), 0.04);
  EXPECT_LT(std::abs(correlation(dp::CounterRng(1, 0), dp::CounterRng(2, 0))), 0.04);
  // Adjacent streams and seeds must not be shifted copies of each other either.
  dp::CounterRng stream0(1, 0);
  dp::CounterRng stream1(1, 1);
  stream1.seek(1);
  EXPECT_NE(draw_u32(stream0, 100), draw_u32(stream1, 100));
}

TEST(CounterRng, UniformLiesInTheUnitIntervalWithMeanAndVarianceOfU01) {
  dp::CounterRng rng(3, 0);
  constexpr int kCount = 100000;
  double sum = 0, sum_squares = 0;
  float low = 1.0f, high = 0.0f;
  for (int i = 0; i < kCount; ++i) {
    const float u = rng.uniform();
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    low = std::min(low, u);
    high = std::max(high, u);
    sum += u;
    sum_squares += double{u} * u;
  }
  const double mean = sum / kCount;
  // Standard error of the mean: sqrt(1/12 / 1e5) = 0.0009; allow 5 of them.
  EXPECT_NEAR(mean, 0.5, 0.0046);
  EXPECT_NEAR(sum_squares / kCount - mean * mean, 1.0 / 12.0, 0.002);
  EXPECT_LT(low, 0.001f);
  EXPECT_GT(high, 0.999f);
}

TEST(CounterRng, UniformRangeStaysInsideTheBounds) {
  dp::CounterRng rng(4, 0);
  double sum = 0;
  for (int i = 0; i < 10000; ++i) {
    const float u = rng.uniform(-3.0f, 5.0f);
    ASSERT_GE(u, -3.0f);
    ASSERT_LT(u, 5.0f);
    sum += u;
  }
  EXPECT_NEAR(sum / 10000, 1.0, 0.12);  // 5 standard errors of 8 / sqrt(12 * 1e4)
}

TEST(CounterRng, NormalHasMeanZeroAndVarianceOne) {
  dp::CounterRng rng(5, 0);
  constexpr int kCount = 100000;
  double sum = 0, sum_squares = 0;
  int beyond_two_sigma = 0;
  for (int i = 0; i < kCount; ++i) {
    const double z = rng.normal();
    ASSERT_TRUE(std::isfinite(z));
    sum += z;
    sum_squares += z * z;
    if (std::abs(z) > 2.0) ++beyond_two_sigma;
  }
  EXPECT_NEAR(sum / kCount, 0.0, 0.016);          // 5 standard errors
  EXPECT_NEAR(sum_squares / kCount, 1.0, 0.025);  // 5 standard errors of sqrt(2 / 1e5)
  EXPECT_NEAR(double(beyond_two_sigma) / kCount, 0.0455, 0.004);
}

TEST(CounterRng, BelowStaysInRangeAndIsUniform) {
  dp::CounterRng rng(6, 0);
  constexpr std::uint64_t kBound = 7;
  constexpr int kCount = 70000;
  std::array<int, kBound> counts{};
  for (int i = 0; i < kCount; ++i) {
    const std::uint64_t value = rng.below(kBound);
    ASSERT_LT(value, kBound);
    ++counts[value];
  }
  // Chi-square with 6 degrees of freedom: P(> 22.5) = 0.001.
  double chi_square = 0;
  const double expected = double(kCount) / kBound;
  for (int count : counts) chi_square += (count - expected) * (count - expected) / expected;
  EXPECT_LT(chi_square, 22.5);
  EXPECT_EQ(rng.below(1), 0u);
}

TEST(CounterRng, BelowHasNoModuloBiasForHugeBounds) {
  // With bound = 2/3 of 2^64, `value % bound` on 64 random bits lands in the lower half
  // of the range with probability 2/3. Unbiased sampling gives 1/2.
  const std::uint64_t bound = 0xAAAAAAAAAAAAAAAAULL;
  dp::CounterRng rng(7, 0);
  constexpr int kCount = 20000;
  int lower_half = 0;
  for (int i = 0; i < kCount; ++i) {
    const std::uint64_t value = rng.below(bound);
    ASSERT_LT(value, bound);
    if (value < bound / 2) ++lower_half;
  }
  EXPECT_NEAR(double(lower_half) / kCount, 0.5, 0.018);  // 5 standard errors
}

TEST(CounterRng, BelowZeroThrows) {
  dp::CounterRng rng(8, 0);
  EXPECT_THROW(rng.below(0), dp::Error);
}

TEST(CounterRng, SeekJumpsToAnyPositionAndBack) {
  dp::CounterRng reference(9, 3);
  const std::vector<std::uint32_t> sequence = draw_u32(reference, 64);
  EXPECT_EQ(reference.position(), 64u);

  dp::CounterRng rng(9, 3);
  for (std::uint64_t position : {37u, 0u, 5u, 63u, 4u, 3u}) {
    rng.seek(position);
    EXPECT_EQ(rng.position(), position);
    EXPECT_EQ(rng.next_u32(), sequence[position]) << "after seek(" << position << ")";
    EXPECT_EQ(rng.position(), position + 1);
  }
  // Far positions are computed directly, not by drawing everything before them.
  dp::CounterRng far(9, 3);
  far.seek(std::uint64_t{1} << 40);
  const std::uint32_t at_far = far.next_u32();
  far.seek(std::uint64_t{1} << 40);
  EXPECT_EQ(far.next_u32(), at_far);
}

}  // namespace
