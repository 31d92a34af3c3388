// The memory tracker counts current and peak bytes per category and rank; the caching
// allocator reuses freed blocks; tensors charge the rank that made them.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "dp/comm.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/memory.h"
#include "dp/tensor.h"

namespace dp {

/// The tracker's accounting entry points are private (only tensors charge it); its tests
/// reach them through this fixture, which memory.h names a friend in the unit tests' build
/// only (DP_MEMORY_TRACKER_TESTS, tests/CMakeLists.txt): elsewhere any code could define a
/// class of that name.
class MemoryTrackerTest : public ::testing::Test {
 protected:
  static void allocate(MemoryTracker& tracker, MemoryCategory category, std::size_t bytes) {
    tracker.on_allocate(category, bytes);
  }
  static void release(MemoryTracker& tracker, MemoryCategory category, std::size_t bytes) {
    tracker.on_release(category, bytes);
  }
};

namespace {

TEST_F(MemoryTrackerTest, CurrentAndPeakPerCategory) {
  MemoryTracker tracker;
  allocate(tracker, MemoryCategory::kParameters, 100);
  allocate(tracker, MemoryCategory::kGradients, 50);
  release(tracker, MemoryCategory::kParameters, 100);
  allocate(tracker, MemoryCategory::kParameters, 30);
  EXPECT_EQ(tracker.current(MemoryCategory::kParameters), 30u);
  EXPECT_EQ(tracker.peak(MemoryCategory::kParameters), 100u);
  EXPECT_EQ(tracker.current_total(), 80u);
  EXPECT_EQ(tracker.peak_total(), 150u);
  tracker.reset_peaks();
  EXPECT_EQ(tracker.peak(MemoryCategory::kParameters), 30u);
  EXPECT_EQ(tracker.peak_total(), 80u);
  EXPECT_THROW(release(tracker, MemoryCategory::kGradients, 51), InvariantError);
}

TEST_F(MemoryTrackerTest, CountsAllocationsPerCategoryAndNeverForgetsThem) {
  MemoryTracker tracker;
  allocate(tracker, MemoryCategory::kCommunication, 64);
  release(tracker, MemoryCategory::kCommunication, 64);
  allocate(tracker, MemoryCategory::kCommunication, 64);
  allocate(tracker, MemoryCategory::kGradients, 8);
  // A buffer freed and made again counts twice: reuse means no allocation at all.
  EXPECT_EQ(tracker.allocations(MemoryCategory::kCommunication), 2u);
  EXPECT_EQ(tracker.allocations(MemoryCategory::kGradients), 1u);
  EXPECT_EQ(tracker.allocations(MemoryCategory::kParameters), 0u);
  EXPECT_EQ(tracker.allocations_total(), 3u);
  tracker.reset_peaks();
  EXPECT_EQ(tracker.allocations_total(), 3u);
}

TEST(CachingAllocator, ReusesBlocksOfTheSameSizeClass) {
  CachingAllocator allocator;
  void* first = allocator.allocate(10'000);
  allocator.deallocate(first, 10'000);
  EXPECT_EQ(allocator.cached_bytes(), CachingAllocator::size_class(10'000));
  void* second = allocator.allocate(9'000);  // same class: the cached block comes back
  EXPECT_EQ(second, first);
  EXPECT_EQ(allocator.cached_bytes(), 0u);
  allocator.deallocate(second, 9'000);
  allocator.release_cached();
  EXPECT_EQ(allocator.cached_bytes(), 0u);
  EXPECT_EQ(allocator.allocate(0), nullptr);
}

TEST(CachingAllocator, SizeClassesWasteAtMostAQuarter) {
  for (std::size_t bytes : {1ul, 4096ul, 4097ul, 100'000ul, 1ul << 20, (1ul << 26) + 3}) {
    const std::size_t size = CachingAllocator::size_class(bytes);
    EXPECT_GE(size, bytes);
    EXPECT_LE(size, std::max<std::size_t>(4096, bytes + bytes / 4 + 1)) << bytes;
  }
}

TEST(Tensor, ChargesItsCategoryAndReleasesOnDestruction) {
  auto memory = std::make_shared<RankMemory>();
  ScopedRankMemory bind(memory);
  {
    Tensor weights({256, 64}, MemoryCategory::kParameters);
    EXPECT_EQ(memory->tracker().current(MemoryCategory::kParameters), 256u * 64 * 4);
    Tensor moved = std::move(weights);
    EXPECT_EQ(memory->tracker().current(MemoryCategory::kParameters), 256u * 64 * 4);
    Tensor copy = moved.clone(MemoryCategory::kOptimizerState);
    EXPECT_EQ(memory->tracker().current(MemoryCategory::kOptimizerState), 256u * 64 * 4);
  }
  EXPECT_EQ(memory->tracker().current_total(), 0u);
  EXPECT_EQ(memory->tracker().peak_total(), 2u * 256 * 64 * 4);
}

TEST(Tensor, ShapeAccessAndErrors) {
  Tensor x({3, 4});
  EXPECT_EQ(x.size(), 12u);
  EXPECT_EQ(x.shape_string(), "(3, 4)");
  x.at(2, 1) = 5.0f;
  EXPECT_EQ(x[9], 5.0f);
  x.reshape({4, 3});
  EXPECT_EQ(x.dim(0), 4);
  EXPECT_THROW(x.reshape({5, 3}), Error);
  EXPECT_THROW(x.dim(2), Error);
  EXPECT_THROW(Tensor({-1, 3}), Error);
  Tensor empty;
  EXPECT_TRUE(empty.empty());
}

TEST(RankMemory, EveryLocalRankHasItsOwnAccounts) {
  std::vector<std::size_t> seen(3);
  launch({.world_size = 3}, [&](Communicator& comm) {
    Tensor mine({static_cast<std::int64_t>(1000 * (comm.rank() + 1))}, MemoryCategory::kGradients);
    comm.barrier();
    seen[comm.rank()] = this_rank_memory().tracker().current(MemoryCategory::kGradients);
  });
  EXPECT_EQ(seen, (std::vector<std::size_t>{4000, 8000, 12000}));
}

TEST_F(MemoryTrackerTest, ABudgetRefusesAnAllocationPastItAndChargesNothing) {
  MemoryTracker tracker;
  tracker.set_budget(1000);
  allocate(tracker, MemoryCategory::kParameters, 600);
  allocate(tracker, MemoryCategory::kGradients, 400);  // exactly the budget: fine
  release(tracker, MemoryCategory::kGradients, 400);
  try {
    allocate(tracker, MemoryCategory::kOptimizerState, 401);
    FAIL() << "an allocation past the budget was accepted";
  } catch (const OutOfMemory& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("401 B of optimizer_state"), std::string::npos) << message;
    EXPECT_NE(message.find("budget of 1000 B"), std::string::npos) << message;
    EXPECT_NE(message.find("peaks so far are: parameters 600 B, gradients 400 B"),
              std::string::npos)
        << message;
  }
  EXPECT_EQ(tracker.current_total(), 600u);
  EXPECT_EQ(tracker.allocations(MemoryCategory::kOptimizerState), 0u);
  EXPECT_THROW(tracker.set_budget(599), Error);  // less than what is live
  tracker.set_budget(std::nullopt);
  allocate(tracker, MemoryCategory::kOptimizerState, 1 << 20);
}

TEST(MemoryBudget, LaunchGivesEveryRankTheBudgetAndTheErrorNamesTheRank) {
  LaunchOptions options{.world_size = 2, .memory_budget_bytes = 64 << 10};
  try {
    launch(options, [&](Communicator& comm) {
      EXPECT_EQ(this_rank_memory().tracker().budget(), std::size_t{64} << 10);
      Tensor fits({8 << 10}, MemoryCategory::kParameters);  // 32 KiB
      comm.barrier();
      if (comm.rank() == 1) Tensor too_much({9 << 10}, MemoryCategory::kActivations);
      comm.barrier();
    });
    FAIL() << "rank 1 went past its budget unnoticed";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.rank(), 1);
    EXPECT_NE(std::string(error.what())
                  .find("rank 1: out of memory: allocating 36.00 KiB of "
                        "activations"),
              std::string::npos)
        << error.what();
  }
  options.memory_budget_bytes = 0;
  EXPECT_THROW(launch(options, [](Communicator&) {}), Error);
}

}  // namespace
}  // namespace dp
