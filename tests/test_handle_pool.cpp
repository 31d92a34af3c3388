// Unit tests of the pool of library handles (common/src/cuda/handle_pool.h) that keeps the
// cuBLAS handles of rank threads from one launch to the next. The pool is generic, so its
// bookkeeping is tested here with integers for handles, on machines without a GPU.
#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "cuda/handle_pool.h"

namespace {

using Pool = dp::cuda::HandlePool<int>;

/// Hands out handles 1, 2, 3, ... in creation order.
struct FakeLibrary {
  std::atomic<int> next{1};
};

TEST(HandlePool, AGivenBackHandleIsReusedInsteadOfMakingANewOne) {
  FakeLibrary library;
  Pool pool([&](int) { return library.next.fetch_add(1); }, [](int) {});
  const int first = pool.acquire(0);
  pool.release(0, first);
  EXPECT_EQ(pool.acquire(0), first);  // the next "launch" reuses it
  EXPECT_EQ(pool.created(), 1u);
  // While it is leased, another thread on the device gets a handle of its own.
  const int second = pool.acquire(0);
  EXPECT_NE(second, first);
  EXPECT_EQ(pool.created(), 2u);
}

TEST(HandlePool, HandlesAreKeptPerDevice) {
  FakeLibrary library;
  std::vector<int> devices_created;
  Pool pool(
      [&](int device) {
        devices_created.push_back(device);
        return library.next.fetch_add(1);
      },
      [](int) {});
  const int on_zero = pool.acquire(0);
  pool.release(0, on_zero);
  const int on_one = pool.acquire(1);  // device 0's idle handle is not device 1's
  EXPECT_NE(on_one, on_zero);
  EXPECT_EQ(devices_created, (std::vector<int>{0, 1}));
  EXPECT_EQ(pool.idle(0), 1u);
  EXPECT_EQ(pool.idle(1), 0u);
}

TEST(HandlePool, DestroysEveryIdleHandleOnceWhenItEnds) {
  std::vector<int> destroyed;
  {
    int next = 1;
    Pool pool([&](int) { return next++; }, [&](int handle) { destroyed.push_back(handle); });
    const int a = pool.acquire(0);
    const int b = pool.acquire(0);
    const int c = pool.acquire(1);
    pool.release(0, a);
    pool.release(0, b);
    pool.release(1, c);
    EXPECT_TRUE(destroyed.empty()) << "a handle was destroyed while the pool lives";
  }
  std::multiset<int> once(destroyed.begin(), destroyed.end());
  EXPECT_EQ(once, (std::multiset<int>{1, 2, 3}));
}

TEST(HandlePool, AFailedCreationTakesNothing) {
  bool fail = true;
  Pool pool(
      [&](int) {
        if (fail) throw std::runtime_error("no device");
        return 7;
      },
      [](int) {});
  EXPECT_THROW((void)pool.acquire(0), std::runtime_error);
  EXPECT_EQ(pool.created(), 0u);
  fail = false;
  EXPECT_EQ(pool.acquire(0), 7);
  EXPECT_EQ(pool.created(), 1u);
}

TEST(HandlePool, ThreadsNeverShareAHandleAndMakeNoMoreThanRunAtOnce) {
  constexpr int kThreads = 8;
  constexpr int kRounds = 200;  // "launches" per thread
  std::atomic<int> next{0};
  Pool pool([&](int) { return next.fetch_add(1); }, [](int) {});
  std::vector<std::atomic<int>> users(kThreads);  // handles are 0 .. kThreads - 1 at most
  std::atomic<int> shared{0};
  std::atomic<int> out_of_range{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      for (int round = 0; round < kRounds; ++round) {
        const int handle = pool.acquire(0);
        if (handle < 0 || handle >= kThreads) {
          ++out_of_range;
          continue;
        }
        if (users[static_cast<std::size_t>(handle)].fetch_add(1) != 0) ++shared;
        std::this_thread::yield();
        users[static_cast<std::size_t>(handle)].fetch_sub(1);
        pool.release(0, handle);
      }
    });
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(shared.load(), 0) << "two threads held one handle at once";
  EXPECT_EQ(out_of_range.load(), 0) << "more handles than threads were made";
  EXPECT_LE(pool.created(), static_cast<std::size_t>(kThreads));
  EXPECT_EQ(pool.idle(0), pool.created());  // every one given back
}

}  // namespace
