#include "grading.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <typeinfo>
#include <utility>

#include "dp/error.h"
#include "dp/optimizer.h"

namespace dp::grading {

Backend check_backend() {
  const char* name = std::getenv("DPLAB_TEST_BACKEND");
  return name == nullptr || *name == '\0' ? Backend::kLocal : parse_backend(name);
}

std::uint64_t grade_seed() {
  const char* text = std::getenv("DPLAB_GRADE_SEED");
  if (text == nullptr || *text == '\0') return 1;
  char* end = nullptr;
  errno = 0;
  const unsigned long long seed = std::strtoull(text, &end, 10);
  if (errno != 0 || *end != '\0' || *text == '-')
    throw Error(fmt::format(
        "DPLAB_GRADE_SEED must be a non-negative decimal integer below 2^64, got '{}'", text));
  return seed;
}

namespace {
std::mutex measured_mutex;
std::vector<std::string> measured_notes;
}  // namespace

void note_measured(std::string sentence) {
  std::lock_guard lock(measured_mutex);
  measured_notes.push_back(std::move(sentence));
}

std::vector<std::string> take_measured_notes() {
  std::lock_guard lock(measured_mutex);
  return std::exchange(measured_notes, {});
}

std::vector<int> world_sizes(int largest) {
  const int ranks =
      check_backend() == Backend::kMpi ? std::min(largest, mpi_world_size()) : largest;
  std::vector<int> sizes;
  for (int world = 1; world <= ranks; ++world) sizes.push_back(world);
  return sizes;
}

void Verdict::expect_empty(const std::string& finding, std::string_view context) {
  if (!finding.empty()) fail(fmt::format("{}: {}", context, finding));
}

bool run_on_ranks(int world_size, const RankCheck& check, std::chrono::milliseconds hang_timeout) {
  LaunchOptions options;
  options.world_size = world_size;
  options.backend = check_backend();
  options.comm.hang_timeout = hang_timeout;

  // One slot per rank; under mpi only this process's rank fills its slot.
  std::vector<Verdict> verdicts(static_cast<std::size_t>(world_size));
  std::vector<char> ran(static_cast<std::size_t>(world_size), 0);
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
    ADD_FAILURE() << fmt::format("world size {}: a rank failed with {}: {}", world_size,
                                 typeid(error).name(), error.what());
    return false;
  }

  bool passed = true;
  for (int rank = 0; rank < world_size; ++rank) {
    if (ran[static_cast<std::size_t>(rank)] == 0) continue;
    for (const std::string& failure : verdicts[static_cast<std::size_t>(rank)].failures()) {
      ADD_FAILURE() << fmt::format("world size {}, rank {}: {}", world_size, rank, failure);
      passed = false;
    }
  }
  return passed;
}

std::string position_in(const std::vector<std::int64_t>& shape, std::size_t index) {
  std::vector<std::int64_t> position(shape.size());
  auto remaining = static_cast<std::int64_t>(index);
  for (std::size_t d = shape.size(); d-- > 0;) {
    position[d] = shape[d] > 0 ? remaining % shape[d] : 0;
    remaining = shape[d] > 0 ? remaining / shape[d] : 0;
  }
  return fmt::format("[{}]", fmt::join(position, ", "));
}

std::string compare_parameters(const Model& model, std::span<const float> expected_flat,
                               float tolerance) {
  if (expected_flat.size() != model.num_parameters())
    return fmt::format("the model has {} parameter elements, the baseline {}",
                       model.num_parameters(), expected_flat.size());
  // The parameter whose largest difference is largest: that is where to look first. A
  // NaN counts as an infinite difference.
  const Parameter* worst = nullptr;
  std::size_t worst_index = 0;
  float worst_diff = -1;
  for (const Parameter* parameter : model.parameters()) {
    const std::span<const float> seen = parameter->value.span();
    if (parameter->offset + seen.size() > expected_flat.size())
      return fmt::format("parameter {} has an unexpected size {}", parameter->name, seen.size());
    for (std::size_t i = 0; i < seen.size(); ++i) {
      float diff = std::abs(seen[i] - expected_flat[parameter->offset + i]);
      if (std::isnan(diff)) diff = INFINITY;
      const bool differs =
          tolerance == 0 ? seen[i] != expected_flat[parameter->offset + i] || std::isnan(seen[i])
                         : diff > tolerance;
      if (differs && diff > worst_diff) {
        worst = parameter;
        worst_index = i;
        worst_diff = diff;
      }
    }
  }
  if (worst == nullptr) return "";
  const float seen = worst->value[worst_index];
  const float expected = expected_flat[worst->offset + worst_index];
  return fmt::format(
      "parameter {} differs: max abs diff {:.2e} at {} (seen {:.9g}, expected {:.9g}); "
      "expected {}",
      worst->name, worst_diff, position_in(worst->value.shape(), worst_index), seen, expected,
      tolerance == 0 ? std::string("bitwise equality") : fmt::format("<= {:.2e}", tolerance));
}

std::string compare_with_rank0(const Model& model, Communicator& comm) {
  std::vector<float> mine = model.flat_parameters();
  std::vector<float> rank0 = mine;
  comm.broadcast(std::span<float>(rank0), 0)->wait();
  for (const Parameter* parameter : model.parameters()) {
    for (std::size_t i = 0; i < parameter->value.size(); ++i) {
      const std::size_t flat = parameter->offset + i;
      // Bitwise: two NaNs with equal bits are equal replicas, 0.0 and -0.0 are not.
      if (std::memcmp(&mine[flat], &rank0[flat], sizeof(float)) != 0)
        return fmt::format(
            "parameter {} at {} is {:.9g} here but {:.9g} on rank 0; expected the replicas to be "
            "bitwise identical",
            parameter->name, position_in(parameter->value.shape(), i), mine[flat], rank0[flat]);
    }
  }
  return "";
}

Trajectory single_process_trajectory(const TrainOptions& options, const Dataset& data,
                                     std::span<const std::string> frozen) {
  Model model = make_model(options);
  for (const std::string& name : frozen) model.freeze(name);
  std::unique_ptr<Optimizer> optimizer =
      make_optimizer(options.optimizer, model.num_parameters(), options.lr, options.momentum,
                     options.weight_decay);
  Trajectory trajectory;
  for (int step = 0; step < options.steps; ++step) {
    const Batch batch = local_batch(data, options, step, /*rank=*/0, /*world_size=*/1);
    model.zero_grad();
    const Tensor logits = model.forward(batch.inputs);
    model.backward(logits, batch.labels);
    for (const Parameter* parameter : model.parameters())
      for (float g : parameter->grad.span())
        trajectory.max_abs_gradient = std::max(trajectory.max_abs_gradient, std::abs(g));
    optimizer->step(model);
    trajectory.parameters_after_step.push_back(model.flat_parameters());
  }
  return trajectory;
}

Batch local_batch(const Dataset& data, const TrainOptions& options, int step, int rank,
                  int world_size) {
  DP_CHECK(world_size > 0 && options.global_batch % world_size == 0,
           "global batch {} is not a multiple of the world size {}", options.global_batch,
           world_size);
  const std::vector<std::size_t> global =
      global_batch_indices(data.size(), options.global_batch, step, options.seed);
  const auto local = static_cast<std::size_t>(options.global_batch / world_size);
  return gather_batch(data,
                      std::span(global).subspan(static_cast<std::size_t>(rank) * local, local));
}

std::uint64_t allreduce_bytes_sent(Communicator& comm,
                                   std::span<const std::size_t> element_counts) {
  const CommCounters before = comm.counters();
  for (std::size_t count : element_counts) {
    std::vector<float> scratch(count, 0.0f);
    comm.allreduce(std::span<float>(scratch), ReduceOp::kSum)->wait();
  }
  return comm.counters().since(before).total_bytes_sent();
}

}  // namespace dp::grading
