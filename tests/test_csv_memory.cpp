// The CSV loader's peak memory: at most twice the file, whatever its size.
//
// A program of its own, because it replaces the global operator new to keep the peak of
// the heap bytes in use; tensors come from the rank's caching allocator and are counted by
// its MemoryTracker. The peak of the two together bounds what loading really took. (Before
// the loader streamed, a 300 MB file took 6.6 GB: the text, a vector of lines, a growing
// vector of floats and the tensor, all at once.)
#include <gtest/gtest.h>
#include <malloc.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <new>
#include <string>

#include "dp/data.h"
#include "dp/memory.h"

namespace {

std::atomic<std::size_t> heap_in_use{0};
std::atomic<std::size_t> heap_peak{0};

void* counted_allocation(std::size_t bytes, std::size_t alignment) {
  void* block =
      alignment <= alignof(std::max_align_t)
          ? std::malloc(bytes == 0 ? 1 : bytes)
          : std::aligned_alloc(alignment, (bytes + alignment - 1) / alignment * alignment);
  if (block == nullptr) throw std::bad_alloc();
  const std::size_t now = heap_in_use += malloc_usable_size(block);
  std::size_t peak = heap_peak.load();
  while (now > peak && !heap_peak.compare_exchange_weak(peak, now)) {
  }
  return block;
}

void counted_release(void* block) {
  if (block == nullptr) return;
  heap_in_use -= malloc_usable_size(block);
  std::free(block);
}

}  // namespace

void* operator new(std::size_t bytes) {
  return counted_allocation(bytes, 0);
}
void* operator new[](std::size_t bytes) {
  return counted_allocation(bytes, 0);
}
void* operator new(std::size_t bytes, std::align_val_t alignment) {
  return counted_allocation(bytes, static_cast<std::size_t>(alignment));
}
void* operator new[](std::size_t bytes, std::align_val_t alignment) {
  return counted_allocation(bytes, static_cast<std::size_t>(alignment));
}
void operator delete(void* block) noexcept {
  counted_release(block);
}
void operator delete[](void* block) noexcept {
  counted_release(block);
}
void operator delete(void* block, std::size_t) noexcept {
  counted_release(block);
}
void operator delete[](void* block, std::size_t) noexcept {
  counted_release(block);
}
void operator delete(void* block, std::align_val_t) noexcept {
  counted_release(block);
}
void operator delete[](void* block, std::align_val_t) noexcept {
  counted_release(block);
}
void operator delete(void* block, std::size_t, std::align_val_t) noexcept {
  counted_release(block);
}
void operator delete[](void* block, std::size_t, std::align_val_t) noexcept {
  counted_release(block);
}

namespace {

TEST(CsvMemory, PeaksAtMostAtTwiceTheFileSize) {
  // 64 features of "0.5"-like values and a label per line: about as many bytes of text
  // as of float32 data, as in real data sets with a few digits per value.
  const std::filesystem::path path =
      std::filesystem::path(::testing::TempDir()) / "dplab_csv_memory.csv";
  {
    std::ofstream out(path, std::ios::binary);
    std::string line;
    for (int f = 0; f < 64; ++f) line += std::to_string(f % 10) + ".5,";
    for (int sample = 0; sample < 40000; ++sample) out << line << sample % 10 << "\n";
  }
  const std::size_t file_bytes = std::filesystem::file_size(path);

  auto memory = std::make_shared<dp::RankMemory>();
  const std::size_t heap_before = heap_in_use.load();
  heap_peak = heap_before;
  std::size_t tensor_peak = 0;
  std::size_t samples = 0;
  {
    dp::ScopedRankMemory bind(memory);
    const dp::Dataset data = dp::load_csv(path);
    samples = data.size();
    tensor_peak = memory->tracker().peak_total();
  }
  const std::size_t heap_growth = heap_peak.load() - heap_before;
  std::filesystem::remove(path);

  EXPECT_EQ(samples, 40000u);
  const double ratio =
      static_cast<double>(heap_growth + tensor_peak) / static_cast<double>(file_bytes);
  EXPECT_LE(ratio, 2.0) << "file " << file_bytes << " bytes; peak heap growth " << heap_growth
                        << " bytes plus tensors " << tensor_peak << " bytes";
  std::printf("CSV of %zu bytes: peak heap growth %zu bytes + tensors %zu bytes = %.2fx\n",
              file_bytes, heap_growth, tensor_peak, ratio);
}

}  // namespace
