#include "grading.h"

#include <cxxabi.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <typeinfo>
#include <utility>

#include "dp/error.h"
#include "dp/host_collectives.h"
#include "dp/tensor.h"
#include "result_reporter.h"

namespace dp::grading {
namespace {

/// FNV-1a: a check's name as a 64-bit stream number, the same on every machine.
std::uint64_t hash_name(std::string_view name) {
  std::uint64_t hash = 0xcbf29ce484222325ULL;
  for (const char c : name) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 0x100000001b3ULL;
  }
  return hash;
}

std::mutex measured_mutex;
std::vector<std::string> measured_notes;

}  // namespace

Backend check_backend() {
  const std::optional<std::string> name = grading_variable("DPLAB_TEST_BACKEND");
  return !name || name->empty() ? Backend::kLocal : parse_backend(*name);
}

namespace {

/// $DPLAB_TEST_DEVICE, "host" when unset.
std::string check_device_name() {
  const std::optional<std::string> name = grading_variable("DPLAB_TEST_DEVICE");
  const std::string device = !name || name->empty() ? "host" : *name;
  if (device != "host" && device != "cuda" && device != "emulated")
    throw Error(
        fmt::format("DPLAB_TEST_DEVICE is '{}': expected 'host', 'cuda' or 'emulated'", device));
  return device;
}

}  // namespace

Device check_device() {
  return check_device_name() == "host" ? Device::kHost : Device::kCuda;
}

void use_check_device() {
  set_cuda_device_emulated(check_device_name() == "emulated");
}

std::uint64_t grade_seed() {
  std::optional<std::string> text = grading_variable("DPLAB_GRADE_SEED");
  if (!text || text->empty()) return 1;
  char* end = nullptr;
  errno = 0;
  const unsigned long long seed = std::strtoull(text->c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || text->front() == '-')
    throw Error(fmt::format(
        "DPLAB_GRADE_SEED must be a non-negative decimal integer below 2^64, got '{}'", *text));
  std::fill(text->begin(), text->end(), '\0');  // no copy of the digits left in memory
  return seed;
}

int calibration_draws(int full) {
  const std::optional<std::string> text = grading_variable("DPLAB_CALIBRATION_DRAWS");
  if (!text || text->empty()) return full;
  char* end = nullptr;
  errno = 0;
  const long draws = std::strtol(text->c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || draws < 1 || draws > 1000000)
    throw Error(fmt::format(
        "DPLAB_CALIBRATION_DRAWS must be a whole number from 1 to 1000000, got '{}'", *text));
  return static_cast<int>(draws);
}

void note_measured(std::string sentence) {
  std::lock_guard lock(measured_mutex);
  measured_notes.push_back(std::move(sentence));
}

std::vector<std::string> take_measured_notes() {
  std::lock_guard lock(measured_mutex);
  return std::exchange(measured_notes, {});
}

// --- draws --------------------------------------------------------------------------------

Draws::Draws(std::string_view check_name)
    : rng_(grade_seed(), hash_name(check_name)),
      completion_seed_(grade_seed() ^ (hash_name(check_name) >> 1)) {}

std::int64_t Draws::integer(std::string_view name, std::int64_t low, std::int64_t high) {
  DP_CHECK(low <= high, "draw {} from the empty range [{}, {}]", name, low, high);
  const auto span = static_cast<std::uint64_t>(high - low) + 1;
  const std::int64_t value = low + static_cast<std::int64_t>(rng_.below(span));
  record(name, std::to_string(value));
  return value;
}

float Draws::uniform(std::string_view name, float low, float high) {
  const float value = rng_.uniform(low, high);
  record(name, fmt::format("{:.4g}", value));
  return value;
}

bool Draws::coin(std::string_view name) {
  const bool value = (rng_.next_u32() & 1U) != 0;
  record(name, value ? "true" : "false");
  return value;
}

std::uint64_t Draws::seed(std::string_view name) {
  const std::uint64_t value = rng_.next_u32() % 1'000'000;  // short, to read and retype
  record(name, std::to_string(value));
  return value;
}

std::vector<int> Draws::world_sizes(int largest) {
  std::vector<int> sizes;
  // Processes that mpirun started (mpi, or nccl under mpirun): the world is theirs.
  if (check_backend() == Backend::kMpi || (check_backend() == Backend::kNccl && started_by_mpi())) {
    for (int world = 1; world <= std::min(largest, mpi_world_size()); ++world)
      sizes.push_back(world);
  } else if (check_backend() == Backend::kNccl) {
    // Threads of this process driving its GPUs, one rank per GPU (NCCL refuses two ranks on
    // one GPU; the emulated device stands for kEmulatedGpuCount GPUs), at most 2: NCCL adds
    // the floats of 3 or more ranks in its ring's order, not in the rank order the checks
    // compare bit for bit (a + b is b + a, so 2 ranks agree).
    for (int world = 1; world <= std::min({largest, nccl_gpu_count(), 2}); ++world)
      sizes.push_back(world);
  } else {
    sizes.push_back(1);
    std::vector<int> not_powers_of_two;
    for (int world : {3, 5, 6})
      if (world <= largest) not_powers_of_two.push_back(world);
    if (!not_powers_of_two.empty())
      sizes.push_back(not_powers_of_two[rng_.below(not_powers_of_two.size())]);
    std::vector<int> others;
    for (int world = 2; world <= largest; ++world)
      if (std::find(sizes.begin(), sizes.end(), world) == sizes.end()) others.push_back(world);
    if (!others.empty()) sizes.push_back(others[rng_.below(others.size())]);
    std::sort(sizes.begin(), sizes.end());
  }
  record("world sizes", fmt::format("{}", fmt::join(sizes, ",")));
  return sizes;
}

std::string Draws::describe() const {
  return fmt::format("grading seed {}: {}", grade_seed(), fmt::join(drawn_, " "));
}

void Draws::section(std::string_view title) {
  drawn_.push_back(fmt::format("[{}]", title));
}

void Draws::overrule(std::string_view name, const std::string& text) {
  const std::string prefix = fmt::format("{}=", name);
  for (auto it = drawn_.rbegin(); it != drawn_.rend(); ++it)
    if (it->starts_with(prefix)) {
      *it = text;
      return;
    }
  throw Error(fmt::format("Draws::overrule: nothing was drawn as '{}'", name));
}

void Draws::record(std::string_view name, const std::string& value) {
  drawn_.push_back(fmt::format("{}={}", name, value));
}

// --- verdicts and ranks -------------------------------------------------------------------

void Verdict::expect_empty(const std::string& finding, std::string_view context) {
  if (!finding.empty()) fail(fmt::format("{}: {}", context, finding));
}

std::string type_name(const std::exception& error) {
  const char* mangled = typeid(error).name();
  int status = 0;
  const std::unique_ptr<char, void (*)(void*)> demangled(
      abi::__cxa_demangle(mangled, nullptr, nullptr, &status), std::free);
  return status == 0 && demangled != nullptr ? std::string(demangled.get()) : mangled;
}

bool run_on_ranks(int world_size, const RankCheck& check, const Draws& draws,
                  std::chrono::milliseconds hang_timeout, Backend backend) {
  LaunchOptions options;
  options.world_size = world_size;
  options.backend = backend;
  options.comm.hang_timeout = hang_timeout;
  options.comm.completion = Completion::kAdversarial;
  options.comm.completion_seed = draws.completion_seed() + static_cast<std::uint64_t>(world_size);
  options.comm.point_to_point_in_groups = draws.point_to_point_in_groups();

  // One slot per rank; under mpi only this process's rank fills its slot.
  std::vector<Verdict> verdicts(static_cast<std::size_t>(world_size));
  std::vector<char> ran(static_cast<std::size_t>(world_size), 0);
  const std::string drawn = draws.describe();
  try {
    launch(options, [&](Communicator& comm) {
      const auto rank = static_cast<std::size_t>(comm.rank());
      ran[rank] = 1;
      check(comm, verdicts[rank]);
    });
  } catch (const NotImplemented& error) {
    ADD_FAILURE() << fmt::format("world size {}: {}", world_size, error.what());
    return false;
  } catch (const std::exception& error) {
    ADD_FAILURE() << fmt::format("world size {}: a rank failed with {}: {}\n({})", world_size,
                                 type_name(error), error.what(), drawn);
    return false;
  }

  bool passed = true;
  for (int rank = 0; rank < world_size; ++rank) {
    const Verdict& verdict = verdicts[static_cast<std::size_t>(rank)];
    if (ran[static_cast<std::size_t>(rank)] == 0) continue;
    for (const std::string& failure : verdict.failures()) {
      ADD_FAILURE() << fmt::format("world size {}, rank {}: {}\n({})", world_size, rank, failure,
                                   drawn);
      passed = false;
    }
    if (rank == 0)
      for (const std::string& sentence : verdict.notes())
        note_measured(fmt::format("world size {}: {}", world_size, sentence));
  }
  return passed;
}

std::uint64_t allreduce_bytes_sent(Communicator& comm,
                                   std::span<const std::size_t> element_counts) {
  const CommCounters before = comm.counters();
  for (std::size_t count : element_counts) {
    std::vector<float> scratch(count, 0.0f);
    allreduce_host_values(std::span<float>(scratch), ReduceOp::kSum, comm);
  }
  return comm.counters().since(before).total_bytes_sent();
}

}  // namespace dp::grading
