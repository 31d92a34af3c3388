// Communication buffers of bfloat16 and float16 (dp/float16.h): every collective and
// point-to-point call at world sizes 1 to 4 on the backend DPLAB_TEST_BACKEND names, compared
// bit for bit with an oracle of comm.h's rule at `ReduceOp` (each partial sum rounded to the
// 16-bit type, maxima exact, an average the rounded sum divided once). The oracle is written
// apart from the library's arithmetic: it adds in double, which is exact for these operands,
// and rounds by searching the format's ordered bit patterns, so it checks both the rule and
// comm.h's claim that converting to float32, adding and rounding is the correctly rounded
// 16-bit sum. Special values (NaN, infinities, float16's overflow, subnormals, -0), the byte
// counters (2 per element), the simulated clock, the adversarial completion, the emulated
// device and the emulated nccl come after.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "comm_test_support.h"
#include "dp/clock.h"
#include "dp/comm.h"
#include "dp/error.h"
#include "dp/float16.h"
#include "dp/launch.h"
#include "dp/rng.h"
#include "dp/tensor.h"
#include "test_support.h"

namespace dp {
namespace {

using testing::contains;
using testing::message_of;
using testing::test_backend;
using testing::test_launch;

// --- The oracle ----------------------------------------------------------------------------

/// What the oracle needs of a format: its largest finite bit pattern and its conversions.
template <typename H>
struct Format;
template <>
struct Format<BFloat16> {
  static constexpr std::uint16_t kMaxFinite = 0x7f7f;
  static constexpr std::uint16_t kInfinity = 0x7f80;
  static constexpr DataType kType = DataType::kBFloat16;
  static BFloat16 from(float value) { return to_bfloat16(value); }
};
template <>
struct Format<Float16> {
  static constexpr std::uint16_t kMaxFinite = 0x7bff;
  static constexpr std::uint16_t kInfinity = 0x7c00;
  static constexpr DataType kType = DataType::kFloat16;
  static Float16 from(float value) { return to_float16(value); }
};

template <typename H>
double value_of(std::uint16_t bits) {
  return static_cast<double>(to_float(H{bits}));  // exact (tests/test_float16.cpp)
}

template <typename H>
bool is_nan(H value) {
  return std::isnan(to_float(value));
}

/// `x` rounded to the nearest value of the format, ties to the even bit pattern; past the
/// largest finite value by half an ulp or more, an infinity. Found by bisecting the positive
/// bit patterns, which are ordered as their values, not by converting.
template <typename H>
H round_exactly(double x, bool negative_zero) {
  if (std::isnan(x)) return H{Format<H>::kInfinity | 0x0040};  // any NaN: compared as NaN
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double magnitude = std::fabs(x);
  if (magnitude == 0.0) return H{static_cast<std::uint16_t>(negative_zero ? 0x8000 : 0)};
  std::uint16_t bits = Format<H>::kInfinity;
  if (!std::isinf(magnitude)) {
    // The largest pattern whose value is <= magnitude.
    std::uint32_t low = 0;
    std::uint32_t high = Format<H>::kMaxFinite;
    while (low < high) {
      const std::uint32_t middle = (low + high + 1) / 2;
      if (value_of<H>(static_cast<std::uint16_t>(middle)) <= magnitude)
        low = middle;
      else
        high = middle - 1;
    }
    const double below = value_of<H>(static_cast<std::uint16_t>(low));
    // Above the largest finite value the next value would be its ulp further.
    const double above = low == Format<H>::kMaxFinite
                             ? below + (below - value_of<H>(static_cast<std::uint16_t>(low - 1)))
                             : value_of<H>(static_cast<std::uint16_t>(low + 1));
    const double down = magnitude - below;
    const double up = above - magnitude;
    const bool round_up = up < down || (up == down && (low & 1u) != 0);
    bits = static_cast<std::uint16_t>(round_up ? low + 1 : low);
    if (low == Format<H>::kMaxFinite && round_up) bits = Format<H>::kInfinity;
  }
  return H{static_cast<std::uint16_t>(sign | bits)};
}

/// a + b correctly rounded to the format (exact in double for the values tested here).
template <typename H>
H oracle_add(H a, H b) {
  const double x = static_cast<double>(to_float(a));
  const double y = static_cast<double>(to_float(b));
  const bool both_negative_zero = x == 0.0 && y == 0.0 && std::signbit(x) && std::signbit(y);
  return round_exactly<H>(x + y, both_negative_zero);
}

/// The rule of `ReduceOp` over `values` taken in the order given.
template <typename H>
H oracle_reduce(const std::vector<H>& values, ReduceOp op) {
  H running = values.front();
  for (std::size_t i = 1; i < values.size(); ++i) {
    if (op == ReduceOp::kMax) {
      if (to_float(running) < to_float(values[i])) running = values[i];
    } else {
      running = oracle_add(running, values[i]);
    }
  }
  if (op != ReduceOp::kAvg) return running;
  const double quotient =
      static_cast<double>(to_float(running)) / static_cast<double>(values.size());
  return round_exactly<H>(quotient, std::signbit(quotient));
}

/// Equal bits, or both NaN (the payload of a NaN made by an addition is the library's choice).
template <typename H>
bool same(H a, H b) {
  return a == b || (is_nan(a) && is_nan(b));
}

template <typename H>
std::string text(H value) {
  return std::to_string(to_float(value)) + " (bits " + std::to_string(value.bits) + ")";
}

// --- Values --------------------------------------------------------------------------------

/// Rank `rank`'s element k: mixed magnitudes (2^-8 to 2^8, both signs), so that the sums round
/// and depend on their order; float16 stays far from its overflow.
template <typename H>
std::vector<H> rank_values(int rank, std::size_t count, std::uint64_t seed = 7) {
  CounterRng rng(seed, static_cast<std::uint64_t>(rank));
  std::vector<H> values(count);
  for (H& value : values)
    value =
        Format<H>::from(std::ldexp(rng.uniform(-1.0f, 1.0f), static_cast<int>(rng.below(17)) - 8));
  return values;
}

/// Element k reduced over ranks 0..p-1 in rank order.
template <typename H>
H expected_element(const std::vector<std::vector<H>>& inputs, std::size_t k, ReduceOp op) {
  std::vector<H> column;
  for (const auto& input : inputs) column.push_back(input[k]);
  return oracle_reduce(column, op);
}

template <typename H>
std::vector<std::vector<H>> every_rank_values(int p, std::size_t count) {
  std::vector<std::vector<H>> inputs;
  for (int r = 0; r < p; ++r) inputs.push_back(rank_values<H>(r, count));
  return inputs;
}

// 0, 1, a prime, and sizes of several pieces of the local backend's eager calls.
const std::vector<std::size_t> kCounts = {0, 1, 1009, 70001};

const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax};

struct Case {
  int ranks;
  DataType type;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return std::string(to_string(info.param.type)) + "_ranks" + std::to_string(info.param.ranks);
}

class Collective16Test : public ::testing::TestWithParam<Case> {
 protected:
  /// Runs `body.template operator()<H>()` with H the parameter's format.
  template <typename Body>
  void with_format(Body&& body) {
    if (GetParam().type == DataType::kBFloat16)
      body.template operator()<BFloat16>();
    else
      body.template operator()<Float16>();
  }
};

TEST_P(Collective16Test, AllReduceOfEveryOpIsTheRuleBitwise) {
  const int p = GetParam().ranks;
  with_format([&]<typename H>() {
    for (std::size_t count : kCounts) {
      const auto inputs = every_rank_values<H>(p, count);
      for (ReduceOp op : kOps) {
        launch(test_launch(p), [&](Communicator& comm) {
          std::vector<H> data = inputs[static_cast<std::size_t>(comm.rank())];
          comm.allreduce(std::span(data), op)->wait();
          for (std::size_t k = 0; k < count; ++k) {
            const H expected = expected_element(inputs, k, op);
            ASSERT_TRUE(same(data[k], expected))
                << to_string(op) << " count " << count << " element " << k << ": got "
                << text(data[k]) << ", expected " << text(expected);
          }
        });
      }
    }
  });
}

TEST_P(Collective16Test, ReduceScatterOfEveryOpIsTheRuleBitwise) {
  const int p = GetParam().ranks;
  with_format([&]<typename H>() {
    for (std::size_t shard : kCounts) {
      const std::size_t total = shard * static_cast<std::size_t>(p);
      const auto inputs = every_rank_values<H>(p, total);
      for (ReduceOp op : kOps) {
        launch(test_launch(p), [&](Communicator& comm) {
          const std::vector<H>& in = inputs[static_cast<std::size_t>(comm.rank())];
          std::vector<H> out(shard, Format<H>::from(-1.0f));
          comm.reduce_scatter(std::span<const H>(in), std::span(out), op)->wait();
          for (std::size_t k = 0; k < shard; ++k) {
            const std::size_t global = static_cast<std::size_t>(comm.rank()) * shard + k;
            const H expected = expected_element(inputs, global, op);
            ASSERT_TRUE(same(out[k], expected))
                << to_string(op) << " element " << global << ": got " << text(out[k])
                << ", expected " << text(expected);
          }
        });
      }
    }
  });
}

/// Bit patterns a copy must keep: -0, a NaN with a payload, infinities, subnormals.
template <typename H>
std::vector<H> awkward_values(int rank, std::size_t count) {
  std::vector<H> values = rank_values<H>(rank, count, 11);
  const std::uint16_t specials[] = {0x8000,
                                    0x7fc1,
                                    0xffc3,
                                    Format<H>::kInfinity,
                                    static_cast<std::uint16_t>(0x8000 | Format<H>::kInfinity),
                                    0x0001,
                                    0x8003};
  for (std::size_t k = 0; k < count && k < std::size(specials); ++k)
    values[k] = H{specials[(k + static_cast<std::size_t>(rank)) % std::size(specials)]};
  return values;
}

TEST_P(Collective16Test, AllGatherBroadcastAndMessagesMoveTheBitsUnchanged) {
  const int p = GetParam().ranks;
  with_format([&]<typename H>() {
    for (std::size_t count : kCounts) {
      launch(test_launch(p), [&](Communicator& comm) {
        const auto mine = awkward_values<H>(comm.rank(), count);
        std::vector<H> all(count * static_cast<std::size_t>(p));
        comm.allgather(std::span<const H>(mine), std::span(all))->wait();
        for (int r = 0; r < p; ++r) {
          const auto theirs = awkward_values<H>(r, count);
          // Compared as vectors (bit patterns: H's == compares bits), not with memcmp, which
          // must not be handed the null data() of an empty block.
          const auto first =
              all.begin() + static_cast<std::ptrdiff_t>(r) * static_cast<std::ptrdiff_t>(count);
          ASSERT_TRUE(std::vector<H>(first, first + static_cast<std::ptrdiff_t>(count)) == theirs)
              << "allgather: rank " << r << "'s block, count " << count;
        }
        for (int root = 0; root < p; ++root) {
          std::vector<H> data = awkward_values<H>(comm.rank(), count);
          comm.broadcast(std::span(data), root)->wait();
          ASSERT_TRUE(data == awkward_values<H>(root, count)) << "broadcast from " << root;
        }
        if (p >= 2) {
          const int right = (comm.rank() + 1) % p;
          const int left = (comm.rank() + p - 1) % p;
          std::vector<H> incoming(count);
          auto send = comm.isend(std::span<const H>(mine), right, 3);
          comm.irecv(std::span(incoming), left, 3)->wait();
          send->wait();
          ASSERT_TRUE(incoming == awkward_values<H>(left, count)) << "message from " << left;
        }
      });
    }
  });
}

TEST_P(Collective16Test, CountersChargeTwoBytesPerElement) {
  const int p = GetParam().ranks;
  constexpr std::size_t kCount = 1009;  // prime: uneven chunks
  with_format([&]<typename H>() {
    launch(test_launch(p), [&](Communicator& comm) {
      const auto chunk = [&](int r) {
        return kCount * static_cast<std::size_t>(r + 1) / static_cast<std::size_t>(p) -
               kCount * static_cast<std::size_t>(r) / static_cast<std::size_t>(p);
      };
      const std::size_t mine = chunk(comm.rank());
      const std::size_t peers = static_cast<std::size_t>(p - 1);
      CommCounters before = comm.counters();
      std::vector<H> data(kCount, Format<H>::from(1.0f));
      comm.allreduce(std::span(data), ReduceOp::kSum)->wait();
      CommCounters c = comm.counters().since(before);
      const std::uint64_t allreduce_bytes = 2 * (peers * mine + (kCount - mine));
      EXPECT_EQ(c.of(CommOp::kAllReduce).bytes_sent, allreduce_bytes);
      EXPECT_EQ(c.of(CommOp::kAllReduce).bytes_received, allreduce_bytes);

      before = comm.counters();
      std::vector<H> shard(64), full(64 * static_cast<std::size_t>(p), Format<H>::from(1.0f));
      comm.reduce_scatter(std::span<const H>(full), std::span(shard), ReduceOp::kSum)->wait();
      comm.allgather(std::span<const H>(shard), std::span(full))->wait();
      comm.broadcast(std::span(shard), 0)->wait();
      c = comm.counters().since(before);
      EXPECT_EQ(c.of(CommOp::kReduceScatter).bytes_received, 2 * 64 * peers);
      EXPECT_EQ(c.of(CommOp::kAllGather).bytes_sent, 2 * 64 * peers);
      EXPECT_EQ(c.of(CommOp::kBroadcast).bytes_sent, comm.rank() == 0 ? 2 * 64 * peers : 0u);

      if (p >= 2) {
        before = comm.counters();
        std::vector<H> message(100), incoming(100);
        auto send = comm.isend(std::span<const H>(message), (comm.rank() + 1) % p, 0);
        comm.irecv(std::span(incoming), (comm.rank() + p - 1) % p, 0)->wait();
        send->wait();
        c = comm.counters().since(before);
        EXPECT_EQ(c.of(CommOp::kSend).bytes_sent, 200u);
        EXPECT_EQ(c.of(CommOp::kRecv).bytes_received, 200u);
      }
    });
  });
}

TEST_P(Collective16Test, AdversarialCompletionPoisonsAndDeliversThe16BitResult) {
  const int p = GetParam().ranks;
  with_format([&]<typename H>() {
    const auto inputs = every_rank_values<H>(p, 1009);
    LaunchOptions options = test_launch(p);
    options.comm.completion = Completion::kAdversarial;
    options.comm.completion_seed = 5;
    launch(options, [&](Communicator& comm) {
      std::vector<H> data = inputs[static_cast<std::size_t>(comm.rank())];
      auto work = comm.allreduce(std::span(data), ReduceOp::kSum);
      // Until the wait the buffer holds the poison: finite values in +-[1, 2).
      for (const H value : data) {
        const float magnitude = std::fabs(to_float(value));
        ASSERT_TRUE(magnitude >= 1.0f && magnitude < 2.0f) << text(value);
      }
      work->wait();
      for (std::size_t k = 0; k < data.size(); ++k)
        ASSERT_TRUE(same(data[k], expected_element(inputs, k, ReduceOp::kSum))) << "element " << k;

      // Writing the output before the wait is reported, naming the element.
      std::vector<H> touched(16, Format<H>::from(1.0f));
      auto early = comm.allreduce(std::span(touched), ReduceOp::kSum);
      touched[5] = Format<H>::from(0.0f);
      const std::string message = message_of<Error>([&] { early->wait(); });
      EXPECT_TRUE(contains(message, "element 5 of its buffer changed before its wait()"))
          << message;
    });
  });
}

std::vector<Case> cases() {
  std::vector<Case> all;
  for (DataType type : {DataType::kBFloat16, DataType::kFloat16})
    for (int ranks = 1; ranks <= 4; ++ranks) all.push_back({ranks, type});
  return all;
}

INSTANTIATE_TEST_SUITE_P(FormatsAndWorldSizes, Collective16Test, ::testing::ValuesIn(cases()),
                         case_name);

// --- Special values ------------------------------------------------------------------------

/// Each rank's column of special cases: element k of `columns[k]` is rank r's value r.
template <typename H>
void expect_special_columns(const std::vector<std::vector<float>>& columns, int p) {
  for (ReduceOp op : kOps) {
    launch(test_launch(p), [&](Communicator& comm) {
      std::vector<H> data;
      for (const auto& column : columns)
        data.push_back(Format<H>::from(column[static_cast<std::size_t>(comm.rank())]));
      comm.allreduce(std::span(data), op)->wait();
      for (std::size_t k = 0; k < columns.size(); ++k) {
        std::vector<H> column;
        for (int r = 0; r < p; ++r)
          column.push_back(Format<H>::from(columns[k][static_cast<std::size_t>(r)]));
        const H expected = oracle_reduce(column, op);
        ASSERT_TRUE(same(data[k], expected)) << to_string(op) << " special case " << k << ": got "
                                             << text(data[k]) << ", expected " << text(expected);
      }
    });
  }
}

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

TEST(Collective16Special, NaNInfinitiesAndSignedZerosFollowTheRule) {
  for (int p = 2; p <= 4; ++p) {
    std::vector<std::vector<float>> columns = {
        {kNaN, 1.0f, 2.0f, 3.0f},      // a NaN first: every op gives NaN
        {1.0f, kNaN, 2.0f, 3.0f},      // a NaN later: sums NaN, the maximum skips it
        {kInf, 1.0f, -5.0f, 2.0f},     // +inf stays
        {kInf, -kInf, 1.0f, 1.0f},     // inf - inf: NaN
        {-0.0f, -0.0f, -0.0f, -0.0f},  // -0 + -0 = -0; the maximum keeps rank 0's -0
        {-0.0f, 0.0f, -0.0f, 0.0f},    // +0 in a sum gives +0; the maximum keeps -0 (a tie)
        {0.0f, -0.0f, 0.0f, -0.0f},   {1.0f, -1.0f, 0.0f, 0.0f},  // an exact cancellation is +0
    };
    expect_special_columns<BFloat16>(columns, p);
    expect_special_columns<Float16>(columns, p);
  }
}

TEST(Collective16Special, Float16OverflowsToInfinityOnTheSumOfTwoLargeValues) {
  // 40000 + 40000 = 80000 > 65504: infinity, and it stays one; 65504 + 16 is the tie at
  // 65520, which rounds to infinity; 65504 + 8 rounds back to 65504; bfloat16 holds them.
  const std::vector<std::vector<float>> columns = {
      {40000.0f, 40000.0f, -40000.0f, -40000.0f},
      {65504.0f, 16.0f, 0.0f, 0.0f},
      {65504.0f, 8.0f, 0.0f, 0.0f},
      {-65504.0f, -65504.0f, 65504.0f, 65504.0f},
  };
  for (int p = 2; p <= 4; ++p) {
    expect_special_columns<Float16>(columns, p);
    expect_special_columns<BFloat16>(columns, p);
  }
  launch(test_launch(2), [](Communicator& comm) {
    std::vector<Float16> data = {to_float16(40000.0f), to_float16(65504.0f)};
    if (comm.rank() == 1) data = {to_float16(40000.0f), to_float16(16.0f)};
    comm.allreduce(std::span(data), ReduceOp::kSum)->wait();
    EXPECT_EQ(data[0].bits, 0x7c00) << "40000 + 40000 in float16";
    EXPECT_EQ(data[1].bits, 0x7c00) << "65504 + 16 in float16";
  });
}

TEST(Collective16Special, Float16SubnormalsAreKeptAndRounded) {
  const float tiny = 0x1p-24f;  // float16's smallest subnormal
  const std::vector<std::vector<float>> columns = {
      {tiny, tiny, tiny, tiny},        // 4 x 2^-24, exact
      {0x1p-14f, -tiny, tiny, -tiny},  // the smallest normal and back
      {3 * tiny, -tiny, 5 * tiny, 0.0f},
      {0x1.8p-20f, 0x1p-24f, 0x1p-10f, 0x1p-24f},  // a subnormal lost against 2^-10
      {-tiny, tiny, 0.0f, 0.0f},                   // cancels to +0
  };
  for (int p = 2; p <= 4; ++p) expect_special_columns<Float16>(columns, p);
  // An average rounds below the subnormals: 2^-24 / 2 is the tie between 0 and 2^-24, which
  // rounds to 0 (the even one).
  launch(test_launch(2), [&](Communicator& comm) {
    std::vector<Float16> data = {to_float16(comm.rank() == 0 ? tiny : 0.0f)};
    comm.allreduce(std::span(data), ReduceOp::kAvg)->wait();
    EXPECT_EQ(data[0].bits, 0x0000);
  });
}

TEST(Collective16Special, TheSumRoundsEachPartialSumNotTheTotal) {
  // bfloat16 has 8 bits of precision: 256 + 1 rounds to 256 (a tie, to even), and so does
  // every further + 1, while the float32 total 259 (a tie) would round to 260. A rule that
  // carried float32 across ranks would give 260.
  launch(test_launch(4), [](Communicator& comm) {
    std::vector<BFloat16> data = {to_bfloat16(comm.rank() == 0 ? 256.0f : 1.0f)};
    comm.allreduce(std::span(data), ReduceOp::kSum)->wait();
    EXPECT_EQ(to_float(data[0]), 256.0f);
  });
}

TEST(Collective16Special, ReductionsOfMixedTypesAreRefusedNamingThem) {
  launch(test_launch(2), [](Communicator& comm) {
    std::vector<BFloat16> in(4);
    std::vector<Float16> out(2);
    const std::string message = message_of<Error>([&] {
      comm.reduce_scatter(std::span<const BFloat16>(in), std::span(out), ReduceOp::kSum);
    });
    EXPECT_EQ(message,
              "reduce_scatter: expected the input to hold size() x output = 2 x 2 = 4 float16, "
              "got 4 bfloat16");
  });
  EXPECT_EQ(element_size(DataType::kBFloat16), 2u);
  EXPECT_EQ(element_size(DataType::kFloat16), 2u);
  EXPECT_EQ(to_string(DataType::kBFloat16), "bfloat16");
  EXPECT_EQ(to_string(DataType::kFloat16), "float16");
}

// --- The local backend only: the simulated clock, the emulated device and nccl --------------

TEST(Collective16Local, TheSimulatedClockChargesTwoBytesPerElement) {
  if (test_backend() != Backend::kLocal) GTEST_SKIP() << "the simulation is the local backend's";
  // n bfloat16 elements move in the time of n / 2 float32 elements: the same bytes.
  const auto time_of = [](auto&& rank_main) {
    LaunchOptions options;
    options.world_size = 4;
    options.simulation.enabled = true;
    options.simulation.network = NetworkModel::preset("ib-ndr");
    std::vector<double> ends(4);
    launch(options, [&](Communicator& comm) {
      rank_main(comm);
      ends[static_cast<std::size_t>(comm.rank())] = comm.clock().now();
    });
    return *std::max_element(ends.begin(), ends.end());
  };
  constexpr std::size_t kElements = 1 << 20;
  const double half = time_of([](Communicator& comm) {
    std::vector<BFloat16> data(kElements);
    comm.allreduce(std::span(data), ReduceOp::kSum)->wait();
    std::vector<Float16> message(kElements);
    if (comm.rank() == 0) comm.isend(std::span<const Float16>(message), 1, 0)->wait();
    if (comm.rank() == 1) comm.irecv(std::span(message), 0, 0)->wait();
  });
  const double full = time_of([](Communicator& comm) {
    std::vector<float> data(kElements / 2);
    comm.allreduce(std::span(data), ReduceOp::kSum)->wait();
    std::vector<float> message(kElements / 2);
    if (comm.rank() == 0) comm.isend(std::span<const float>(message), 1, 0)->wait();
    if (comm.rank() == 1) comm.irecv(std::span(message), 0, 0)->wait();
  });
  EXPECT_GT(half, 0.0);
  EXPECT_DOUBLE_EQ(half, full);
}

/// Emulated device memory holding `values` (a float32 tensor of the same bytes, rounded up).
template <typename H>
Tensor device_copy(const std::vector<H>& values) {
  std::vector<float> words((values.size() + 1) / 2, 0.0f);
  if (!values.empty()) std::memcpy(words.data(), values.data(), values.size() * sizeof(H));
  return Tensor::from(words, MemoryCategory::kCommunication, Device::kCuda);
}

template <typename H>
std::vector<H> host_values(const Tensor& tensor, std::size_t count) {
  const Tensor host = tensor.to(Device::kHost);
  std::vector<H> values(count);
  if (count > 0)
    std::memcpy(static_cast<void*>(values.data()), host.span().data(), count * sizeof(H));
  return values;
}

/// Every rank's all-reduce of 16-bit device buffers on `backend` over the emulated device.
template <typename H>
std::vector<std::vector<H>> emulated_device_allreduce(Backend backend, int p,
                                                      const std::vector<std::vector<H>>& inputs,
                                                      ReduceOp op) {
  std::vector<std::vector<H>> results(static_cast<std::size_t>(p));
  launch({.world_size = p, .backend = backend}, [&](Communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    Tensor data = device_copy(inputs[r]);
    comm.allreduce({data.view().data(), inputs[r].size(), Format<H>::kType, Device::kCuda}, op)
        ->wait();
    results[r] = host_values<H>(data, inputs[r].size());
  });
  return results;
}

class Collective16Emulated : public ::testing::Test {
 protected:
  void SetUp() override {
    if (test_backend() != Backend::kLocal) GTEST_SKIP() << "the emulated device is in-process";
    set_cuda_device_emulated(true);
  }
  void TearDown() override { set_cuda_device_emulated(false); }
};

template <typename H>
void expect_local_device_rule(int p) {
  const std::size_t n = 5003;
  const auto inputs = every_rank_values<H>(p, n);
  for (ReduceOp op : kOps) {
    const auto results = emulated_device_allreduce<H>(Backend::kLocal, p, inputs, op);
    for (int r = 0; r < p; ++r)
      for (std::size_t k = 0; k < n; ++k)
        ASSERT_TRUE(same(results[static_cast<std::size_t>(r)][k], expected_element(inputs, k, op)))
            << to_string(op) << " rank " << r << " element " << k;
  }
}

TEST_F(Collective16Emulated, LocalDeviceBuffersReduceByTheRule) {
  for (int p = 1; p <= 4; ++p) {
    expect_local_device_rule<BFloat16>(p);
    expect_local_device_rule<Float16>(p);
  }
}

/// Element k of chunk `chunk` as the emulated nccl combines it: rank chunk+1 first, round the
/// ring, rank `chunk` last (comm/emulated_nccl.cpp).
template <typename H>
void expect_nccl_ring_rule(int p) {
  const std::size_t n = 1009;
  const auto inputs = every_rank_values<H>(p, n);
  for (ReduceOp op : kOps) {
    const auto results = emulated_device_allreduce<H>(Backend::kNccl, p, inputs, op);
    for (int chunk = 0; chunk < p; ++chunk) {
      const std::size_t begin = n * static_cast<std::size_t>(chunk) / static_cast<std::size_t>(p);
      const std::size_t end = n * static_cast<std::size_t>(chunk + 1) / static_cast<std::size_t>(p);
      for (std::size_t k = begin; k < end; ++k) {
        std::vector<H> ring;
        for (int step = 1; step <= p; ++step)
          ring.push_back(inputs[static_cast<std::size_t>((chunk + step) % p)][k]);
        const H expected = oracle_reduce(ring, op);
        for (int r = 0; r < p; ++r)
          ASSERT_TRUE(same(results[static_cast<std::size_t>(r)][k], expected))
              << to_string(op) << " ranks " << p << " rank " << r << " element " << k;
      }
    }
  }
}

TEST_F(Collective16Emulated, EmulatedNcclReducesByTheRuleInItsRingOrder) {
  for (int p = 1; p <= 4; ++p) {
    expect_nccl_ring_rule<BFloat16>(p);
    expect_nccl_ring_rule<Float16>(p);
  }
}

}  // namespace
}  // namespace dp
