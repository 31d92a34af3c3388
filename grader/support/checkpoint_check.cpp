#include "checkpoint_check.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <stdlib.h>  // mkdtemp

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include "dp/error.h"
#include "dp/host_collectives.h"
#include "dp/launch.h"
#include "dp/sharded_checkpoint.h"
#include "ground_truth.h"

namespace dp::grading {
namespace {

/// How long a rank may block before the check reports a hang. A rank waits at the save's
/// barrier while its peers write and fsync their files, which on a busy machine's disk can
/// take seconds: with the other checks' 30 s, one 4-process mpi run in about fifteen failed
/// after 30 s with rank 0 still writing index.json.
constexpr std::chrono::milliseconds kFileHangTimeout = std::chrono::seconds(240);

/// The name of the check's checkpoint directories: <prefix>-XXXXXX.
constexpr std::string_view kDirectoryPrefix = "dplab-checkpoint";

/// The world size the checkpoint is saved on, and those it is loaded on.
constexpr int kSavedWorld = 4;
const std::vector<int> kLoadWorlds = {2, 3, 4};

std::string describe(const ShardRange& range) {
  return fmt::format("{{{} elements [{}, {}) at shard offset {}}}", range.parameter,
                     range.parameter_offset, range.parameter_offset + range.count,
                     range.shard_offset);
}

/// "" when `seen` is `expected`, else the first difference: a lost padding offset shows as
/// the first range whose shard offset is wrong.
std::string compare_layout(const ShardLayout& seen, const ShardLayout& expected) {
  for (std::size_t i = 0; i < std::min(seen.ranges.size(), expected.ranges.size()); ++i)
    if (!(seen.ranges[i] == expected.ranges[i]))
      return fmt::format("range {} is {}; expected {}", i, describe(seen.ranges[i]),
                         describe(expected.ranges[i]));
  if (seen.ranges.size() != expected.ranges.size())
    return fmt::format("{} ranges; expected {}", seen.ranges.size(), expected.ranges.size());
  if (seen.shard_elements != expected.shard_elements)
    return fmt::format("a shard of {} elements; expected {} (padding included)",
                       seen.shard_elements, expected.shard_elements);
  return "";
}

/// The flat offset of every parameter, by name: where its elements sit in the emulation's
/// flat vectors (parameters and optimizer state alike).
using Offsets = std::map<std::string, std::size_t>;

/// The shard `layout` cuts from the flat `values`: its padding zero.
std::vector<float> shard_of(const ShardLayout& layout, const Offsets& offsets,
                            std::span<const float> values) {
  std::vector<float> shard(layout.shard_elements, 0.0f);
  for (const ShardRange& range : layout.ranges)
    std::copy_n(values.begin() + static_cast<std::ptrdiff_t>(offsets.at(range.parameter) +
                                                             range.parameter_offset),
                range.count, shard.begin() + static_cast<std::ptrdiff_t>(range.shard_offset));
  return shard;
}

/// "" when `seen` is bitwise `expected`, else the first differing element, named by the
/// parameter element it holds (or as padding).
std::string compare_shard(std::span<const float> seen, const std::vector<float>& expected,
                          const ShardLayout& layout, const std::string& what) {
  if (seen.size() != expected.size())
    return fmt::format("{} holds {} elements; expected the layout's {}", what, seen.size(),
                       expected.size());
  for (std::size_t i = 0; i < seen.size(); ++i) {
    if (std::memcmp(&seen[i], &expected[i], sizeof(float)) == 0) continue;
    std::string holds = "padding";
    for (const ShardRange& range : layout.ranges)
      if (i >= range.shard_offset && i < range.shard_offset + range.count)
        holds = fmt::format("{} element {}", range.parameter,
                            range.parameter_offset + i - range.shard_offset);
    return fmt::format("{}[{}] ({}) holds {}; expected {}", what, i, holds, seen[i], expected[i]);
  }
  return "";
}

/// "" when `seen` is bitwise `expected` (flat, the model's order), else the first
/// differing element by parameter.
std::string compare_values(std::span<const float> seen, std::span<const float> expected,
                           const Offsets& offsets, const std::string& what) {
  if (seen.size() != expected.size())
    return fmt::format("{}: {} elements; expected {}", what, seen.size(), expected.size());
  for (std::size_t i = 0; i < seen.size(); ++i) {
    if (std::memcmp(&seen[i], &expected[i], sizeof(float)) == 0) continue;
    std::string name;
    std::size_t first = 0;
    for (const auto& [parameter, offset] : offsets)
      if (offset <= i && offset >= first) {
        name = parameter;
        first = offset;
      }
    return fmt::format("{}: flat element {} ({} element {}) holds {}; expected {}", what, i, name,
                       i - first, seen[i], expected[i]);
  }
  return "";
}

/// What the check expects, computed once in the grader's own process.
struct Expected {
  int saved_after = 0;                              ///< k
  std::vector<CheckpointParameter> parameters;      ///< the model's, in order
  Offsets offsets;                                  ///< flat offsets by name
  std::vector<std::vector<std::size_t>> segments;   ///< the lab's
  std::map<std::string, std::vector<float>> state;  ///< after k steps, flat
  std::map<int, Trajectory> resumed;                ///< by load world size M
  std::map<int, std::vector<ShardLayout>> layouts;  ///< by world size
  std::vector<ShardLayout> other_layouts;           ///< lab 6: another cap, at 4 ranks
  std::vector<float> parameters_at_save() const {   ///< after k steps
    return resumed.begin()->second.parameters_after_step[static_cast<std::size_t>(saved_after - 1)];
  }
};

/// Reads the checkpoint as the grader: "" when it is the contract's, else the first finding.
/// "fc1.weight [32, 64], fc1.bias [32], ...": parameters as a message lists them. (A loop, not
/// views::transform: clang rejects libstdc++ 12's ranges in the sanitize build.)
std::string names_and_shapes(const std::vector<CheckpointParameter>& parameters) {
  std::vector<std::string> described;
  for (const CheckpointParameter& parameter : parameters)
    described.push_back(fmt::format("{} [{}]", parameter.name, fmt::join(parameter.shape, ", ")));
  return fmt::format("{}", fmt::join(described, ", "));
}

std::string read_back(const std::filesystem::path& directory, const Expected& expected,
                      const std::string& segments_name) {
  ShardedCheckpointPlan plan;
  try {
    plan = load_checkpoint_index(directory);
  } catch (const Error& error) {
    return fmt::format("the grader could not read the checkpoint's index: {}", error.what());
  }
  if (plan.parameters != expected.parameters)
    return fmt::format(
        "index.json lists {} parameters ({}); expected the model's {} ({}), names and shapes",
        plan.parameters.size(), names_and_shapes(plan.parameters), expected.parameters.size(),
        names_and_shapes(expected.parameters));
  const std::vector<ShardLayout>& layouts = expected.layouts.at(kSavedWorld);
  if (plan.layouts.size() != layouts.size())
    return fmt::format("index.json has {} ranks; expected the {} it was saved on",
                       plan.layouts.size(), layouts.size());
  for (std::size_t r = 0; r < layouts.size(); ++r) {
    const std::string finding = compare_layout(plan.layouts[r], layouts[r]);
    if (!finding.empty())
      return fmt::format(
          "index.json: rank {}'s layout: {} (the contract's layout is chunked_layouts over {}: "
          "each segment cut into N chunks of C = ceil(E / N), rank r's chunks one after "
          "another, padding included)",
          r, finding, segments_name);
  }
  const auto step = plan.metadata.find("step");
  const std::string k = std::to_string(expected.saved_after);
  if (step == plan.metadata.end() || step->second != k)
    return fmt::format(
        "index.json's metadata \"step\" is {}; expected the inner optimizer's "
        "step count, {}",
        step == plan.metadata.end() ? "missing" : '"' + step->second + '"', k);
  std::vector<std::string> names = {kShardParameters};
  for (const auto& [name, values] : expected.state) names.push_back(name);
  std::vector<std::string> seen_names = plan.tensors;
  std::sort(names.begin(), names.end());
  std::sort(seen_names.begin(), seen_names.end());
  if (seen_names != names)
    return fmt::format(
        "the checkpoint holds the tensors [{}]; expected [{}] (the parameters and "
        "every state tensor of the inner optimizer, by its name)",
        fmt::join(seen_names, ", "), fmt::join(names, ", "));
  const Checkpoint full = consolidated_checkpoint(directory);
  const std::vector<float> at_save = expected.parameters_at_save();
  for (const CheckpointParameter& parameter : expected.parameters) {
    const std::size_t offset = expected.offsets.at(parameter.name);
    const std::string finding =
        compare_values(full.tensors.at(parameter.name).span(),
                       std::span(at_save).subspan(offset, parameter.size()), {{parameter.name, 0}},
                       "the consolidated parameters");
    if (!finding.empty())
      return fmt::format("{} (the emulation's after step {}, bitwise)", finding, k);
  }
  for (const auto& [name, values] : expected.state) {
    const std::string finding = compare_values(full.tensors.at("optimizer." + name).span(), values,
                                               expected.offsets, "the consolidated " + name);
    if (!finding.empty())
      return fmt::format("{} (the emulation's optimizer state after step {}, bitwise)", finding, k);
  }
  return "";
}

/// Saves a checkpoint the way a one-rank run of another set-up would: the grader's own
/// file, to show that `load_checkpoint` checks what it loads.
void save_foreign_checkpoint(const std::filesystem::path& directory,
                             std::vector<CheckpointParameter> parameters,
                             std::vector<std::string> tensors, const std::string& step = "7") {
  ShardedCheckpointPlan plan;
  plan.parameters = std::move(parameters);
  const std::vector<std::vector<std::size_t>> segments = {all_parameters(plan.parameters)};
  plan.layouts = chunked_layouts(plan.parameters, segments, 1);
  plan.tensors = std::move(tensors);
  // A step count and values no run of the check has: a load that writes any shows.
  plan.metadata = {{"step", step}};
  std::vector<Tensor> values;
  for (std::size_t i = 0; i < plan.tensors.size(); ++i) {
    values.emplace_back(
        std::vector<std::int64_t>{static_cast<std::int64_t>(plan.layouts.front().shard_elements)});
    values.back().fill(0.25f + static_cast<float>(i));
  }
  std::vector<NamedTensor> named;
  for (std::size_t i = 0; i < plan.tensors.size(); ++i)
    named.push_back({plan.tensors[i], &values[i]});
  save_checkpoint_shard(directory, plan, 0, named);
}

}  // namespace

std::filesystem::path make_temporary_directory(std::string_view prefix) {
  std::string name =
      (std::filesystem::temp_directory_path() / fmt::format("{}-XXXXXX", prefix)).string();
  if (mkdtemp(name.data()) == nullptr)
    throw Error(fmt::format("cannot make a directory {}: {}", name, std::strerror(errno)));
  return name;
}

std::filesystem::path shared_temporary_directory(Communicator& comm, std::string_view prefix) {
  std::vector<std::uint8_t> name(4096, 0);
  if (comm.rank() == 0) {
    const std::string made = make_temporary_directory(prefix).string();
    DP_CHECK(made.size() < name.size(), "temporary directory name too long: {}", made);
    std::copy(made.begin(), made.end(), name.begin());
  }
  broadcast_host_values(std::span<std::uint8_t>(name), 0, comm);
  return std::string(reinterpret_cast<const char*>(name.data()));
}

void check_sharded_checkpoint(Draws& draws, const ShardedTraining& training,
                              const CheckpointLab& lab) {
  const int steps = training.options.steps;
  Expected expected;
  expected.saved_after = static_cast<int>(draws.integer("steps before the save", 1, steps - 1));
  const int k = expected.saved_after;
  {
    const Model model = training.model();
    expected.parameters = checkpoint_parameters(model);
    for (const Parameter* parameter : model.parameters())
      expected.offsets[parameter->name] = parameter->offset;
    expected.segments = lab.segments(model);
    if (lab.other_segments)
      expected.other_layouts =
          chunked_layouts(expected.parameters, lab.other_segments(model), kSavedWorld);
  }
  for (int world : {2, 3, 4})
    expected.layouts[world] = chunked_layouts(expected.parameters, expected.segments, world);
  for (int world : kLoadWorlds) {
    Emulation how;
    how.resume_step = k;
    how.resume_world = world;
    how.resume_global_batch = training.rows_per_rank * world;
    how.after_step = [&](int step, Optimizer& optimizer) {
      if (step != k - 1) return;
      for (const OptimizerState& state : optimizer.state())
        expected.state[state.name] = host_values(*state.tensor);
    };
    expected.resumed[world] =
        emulate_data_parallel(training.for_world(kSavedWorld), *training.data, kSavedWorld, how);
  }

  // 1. k steps on 4 ranks, then the save: on the job's ranks under a 4-process mpi job.
  const bool on_mpi_ranks = check_backend() == Backend::kMpi && mpi_world_size() == kSavedWorld;
  std::filesystem::path directory;
  if (!on_mpi_ranks) directory = make_temporary_directory(kDirectoryPrefix);
  const auto save = [&](Communicator& comm, Verdict& verdict) {
    if (on_mpi_ranks) directory = shared_temporary_directory(comm, kDirectoryPrefix);
    const TrainOptions options = training.for_world(kSavedWorld);
    Model model = training.model();
    const std::unique_ptr<CheckpointSubject> subject = lab.make(model, comm, options);
    for (int step = 0; step < k; ++step)
      subject->train_step(
          on_check_device(local_batch(*training.data, options, step, comm.rank(), kSavedWorld)));
    subject->save(directory);
    // Complete on return, on every rank: this rank's shard and rank 0's index are there.
    // Every rank's shard, not only this rank's: a save that returns before its peers wrote
    // theirs (no barrier after the writes) shows here on the ranks that finished first.
    for (int rank = 0; rank < kSavedWorld; ++rank) {
      const std::string file = shard_file_name(rank, kSavedWorld);
      if (!std::filesystem::exists(directory / file)) {
        verdict.fail(fmt::format(
            "rank {}'s shard file {} does not exist after save_checkpoint returned on rank {}; "
            "expected every rank to write its own shard, and the checkpoint complete when "
            "save returns (a barrier after the writes)",
            rank, file, comm.rank()));
        return;
      }
    }
    if (!std::filesystem::exists(directory / "index.json"))
      verdict.fail(fmt::format(
          "index.json does not exist after save_checkpoint returned on rank {}; expected rank "
          "0 to write it (dp::save_checkpoint_shard does), and the checkpoint complete when "
          "save returns (a barrier after the writes)",
          comm.rank()));
  };
  bool passed = run_on_ranks(kSavedWorld, save, draws, kFileHangTimeout,
                             on_mpi_ranks ? Backend::kMpi : Backend::kLocal);

  // Phases 2 to 4 run in this process only; whatever they throw, every process must still
  // reach the clean-up's barrier under mpi, so an exception becomes a failure here.
  try {
    // 2. The grader reads the checkpoint.
    if (passed) {
      const std::string finding = read_back(directory, expected, lab.segments_name);
      if (!finding.empty()) {
        ADD_FAILURE() << fmt::format("saved on 4 ranks after step {} of {}: {}\n  drawn: {}", k,
                                     steps, finding, draws.describe());
        passed = false;
      }
    }

    // 3. Loaded on 2, 3 and 4 ranks (local threads), then the remaining steps; lab 6 also
    // on 4 ranks with other buckets (another layout at the saved world size).
    struct Load {
      int world;
      const std::vector<ShardLayout>* layouts;
      const std::function<std::unique_ptr<CheckpointSubject>(Model&, Communicator&,
                                                             const TrainOptions&)>* make;
      std::string how;
    };
    std::vector<Load> loads;
    for (int world : kLoadWorlds)
      loads.push_back({world, &expected.layouts.at(world), &lab.make, ""});
    if (lab.other_segments)
      loads.push_back({kSavedWorld, &expected.other_layouts, &lab.make_other,
                       fmt::format(" with {} (another layout at the saved world size: the shard "
                                   "is cut for the optimizer's own layout)",
                                   lab.other_segments_name)});
    for (const Load& load : loads) {
      if (!passed) break;
      const int world = load.world;
      const Trajectory& exact = expected.resumed.at(world);
      const std::vector<float> at_save = expected.parameters_at_save();
      passed = run_on_ranks(
          world,
          [&](Communicator& comm, Verdict& verdict) {
            const TrainOptions options = training.for_world(world);
            Model model = training.model();
            const std::unique_ptr<CheckpointSubject> subject = (*load.make)(model, comm, options);
            // What the load holds beyond the optimizer it fills: a sharded load reads the
            // saved pieces of its own shard, never the whole model (lab 7's trial loaded the
            // whole checkpoint on every rank and kept full marks).
            MemoryTracker& tracker = this_rank_memory().tracker();
            const std::size_t held_before = tracker.current_total();
            tracker.reset_peaks();
            subject->load(directory);
            const std::size_t load_extra = tracker.peak_total() - held_before;
            const ShardLayout& layout = (*load.layouts)[static_cast<std::size_t>(comm.rank())];
            const std::string what =
                fmt::format("saved on 4 ranks after step {}, loaded on {}{}", k, world, load.how);
            // Each state of the shard (its parameters and each optimizer state) once for the
            // shard being filled and once for the saved piece being read, and 4 KiB for small
            // tensors: about half of what a whole model's state takes on 2 ranks, a third on 4.
            const std::size_t states = 1 + subject->inner().state().size();
            std::size_t saved_shard = 0;
            for (const ShardLayout& saved : expected.layouts.at(kSavedWorld))
              saved_shard = std::max(saved_shard, saved.shard_elements);
            const std::size_t own_shard = subject->shard_parameters().size();
            const std::size_t load_budget =
                states * (own_shard + saved_shard) * sizeof(float) + 4096;
            // (Lab 6's load with other buckets at the saved world size is left out: its
            // reference reads whole tensors there, which the contract does not forbid.)
            if (load.how.empty() && load_extra > load_budget)
              verdict.fail(fmt::format(
                  "{}: load_checkpoint held {} bytes beyond the optimizer at its peak; expected "
                  "at most {} x ({} + {}) elements x 4 bytes + 4 KiB = {} bytes (the {} states "
                  "of the shard it fills and of one saved piece it reads at a time), not the "
                  "whole model's",
                  what, load_extra, states, own_shard, saved_shard, load_budget, states));

            if (subject->inner().step_count() != k)
              verdict.fail(fmt::format(
                  "{}: the inner optimizer's step count is {}; expected the checkpoint's {} "
                  "(AdamW's "
                  "bias correction divides by 1 - beta^t: a lost step count changes every update)",
                  what, subject->inner().step_count(), k));
            verdict.expect_empty(compare_shard(host_values(subject->shard_parameters()),
                                               shard_of(layout, expected.offsets, at_save), layout,
                                               "shard_parameters()"),
                                 what);
            for (const OptimizerState& state : subject->inner().state()) {
              const auto saved = expected.state.find(state.name);
              if (saved == expected.state.end()) continue;  // read_back named the tensors
              verdict.expect_empty(compare_shard(host_values(*state.tensor),
                                                 shard_of(layout, expected.offsets, saved->second),
                                                 layout, "the inner optimizer's " + state.name),
                                   what);
            }
            const auto check_values = [&](std::span<const float> flat, const std::string& when) {
              if (lab.values_replicated) {
                verdict.expect_empty(compare_values(model.flat_parameters(), flat, expected.offsets,
                                                    "the model's parameters"),
                                     when + " (every Parameter::value must hold the parameters)");
                return;
              }
              for (const Parameter* parameter : model.parameters())
                if (parameter->value.size() != 0) {
                  verdict.fail(
                      fmt::format("{}: {}'s value holds {} elements; expected it released "
                                  "(only the shard stays)",
                                  when, parameter->name, parameter->value.size()));
                  return;
                }
            };
            if (verdict.passed()) check_values(at_save, what);
            // Every rank runs every step whatever it found, so that no rank waits for a peer
            // that stopped; a failure is recorded once.
            for (int step = k; step < steps; ++step) {
              subject->train_step(
                  on_check_device(local_batch(*training.data, options, step, comm.rank(), world)));
              if (!verdict.passed()) continue;
              const std::vector<float>& after =
                  exact.parameters_after_step[static_cast<std::size_t>(step)];
              const std::string when = fmt::format("{}, then step {}", what, step + 1);
              verdict.expect_empty(compare_shard(host_values(subject->shard_parameters()),
                                                 shard_of(layout, expected.offsets, after), layout,
                                                 "shard_parameters()"),
                                   when + " (the emulation: k steps on 4 ranks, the rest on " +
                                       std::to_string(world) + ")");
              if (verdict.passed()) check_values(after, when);
            }
          },
          draws, kFileHangTimeout, Backend::kLocal);
    }

    // 4. Misuse: checkpoints of another model and without the optimizer's state. Each must
    // throw, name what differs, and change nothing.
    if (passed) {
      std::vector<std::string> state_names = {kShardParameters};
      for (const auto& [name, values] : expected.state) state_names.push_back(name);
      struct Foreign {
        std::string what;
        std::string names;  ///< the message must contain it
        std::function<void(const std::filesystem::path&)> write;
      };
      std::vector<Foreign> foreign;
      std::vector<CheckpointParameter> larger = expected.parameters;
      larger.back().shape.back() += 1;
      foreign.push_back({fmt::format("a checkpoint whose {} has shape [{}] (this model's [{}])",
                                     larger.back().name, fmt::join(larger.back().shape, ", "),
                                     fmt::join(expected.parameters.back().shape, ", ")),
                         larger.back().name, [&, larger](const std::filesystem::path& where) {
                           save_foreign_checkpoint(where, larger, state_names);
                         }});
      // The same element count, another shape: a load that compares sizes only takes it.
      std::vector<CheckpointParameter> swapped = expected.parameters;
      const auto matrix = std::find_if(swapped.begin(), swapped.end(), [](const auto& p) {
        return p.shape.size() == 2 && p.shape[0] != p.shape[1];
      });
      if (matrix != swapped.end()) {
        const CheckpointParameter original = *matrix;
        std::swap(matrix->shape[0], matrix->shape[1]);
        foreign.push_back(
            {fmt::format("a checkpoint whose {} has shape [{}] (this model's [{}]: the same "
                         "element count, another shape)",
                         matrix->name, fmt::join(matrix->shape, ", "),
                         fmt::join(original.shape, ", ")),
             matrix->name, [&, swapped](const std::filesystem::path& where) {
               save_foreign_checkpoint(where, swapped, state_names);
             }});
      }
      foreign.push_back({"a checkpoint of the parameters without the optimizer's state",
                         state_names.size() > 1 ? state_names[1] : std::string(kShardParameters),
                         [&](const std::filesystem::path& where) {
                           save_foreign_checkpoint(where, expected.parameters, {kShardParameters});
                         }});
      // This model's parameters and every tensor the load needs, its only defect a "step"
      // that is not a count: a load that reads the step only after writing the shards (a
      // student trial's) throws with the training state half loaded. "12x" also fails a
      // parse that stops at the first non-digit; "-1" one that takes a sign.
      for (const std::string step : {"12x", "-1"})
        foreign.push_back(
            {fmt::format("a checkpoint of this model and its optimizer state whose \"step\" is "
                         "\"{}\"",
                         step),
             step, [&, step](const std::filesystem::path& where) {
               save_foreign_checkpoint(where, expected.parameters, state_names, step);
             }});
      for (const Foreign& bad : foreign) {
        // A directory of this process's own: under mpi every process runs this part.
        const std::filesystem::path where = make_temporary_directory(kDirectoryPrefix);
        bad.write(where);
        passed = run_on_ranks(
            2,
            [&](Communicator& comm, Verdict& verdict) {
              Model model = training.model();
              const TrainOptions options = training.for_world(2);
              const std::unique_ptr<CheckpointSubject> subject = lab.make(model, comm, options);
              // One step first, so that the state is not all zeros and the step count 1.
              subject->train_step(
                  on_check_device(local_batch(*training.data, options, 0, comm.rank(), 2)));
              const std::vector<float> shard = host_values(subject->shard_parameters());
              std::map<std::string, std::vector<float>> state;
              for (const OptimizerState& s : subject->inner().state())
                state[s.name] = host_values(*s.tensor);
              const std::int64_t step_count = subject->inner().step_count();
              const std::vector<float> values =
                  lab.values_replicated ? model.flat_parameters() : std::vector<float>{};
              try {
                subject->load(where);
                verdict.fail(
                    fmt::format("load_checkpoint of {} returned; expected dp::Error saying "
                                "what was expected and what was seen",
                                bad.what));
                return;
              } catch (const NotImplemented&) {
                throw;
              } catch (const Error& error) {
                if (std::string_view(error.what()).find(bad.names) == std::string_view::npos)
                  verdict.fail(fmt::format(
                      "load_checkpoint of {} threw dp::Error \"{}\"; expected the message to "
                      "name {} (what was expected and what was seen)",
                      bad.what, error.what(), bad.names));
              }
              const std::string after = fmt::format(
                  "after load_checkpoint of {} threw (a bad checkpoint must change nothing: "
                  "check it whole before writing anything)",
                  bad.what);
              const auto same = [&](std::span<const float> seen, const std::vector<float>& was,
                                    const std::string& what) {
                if (seen.size() != was.size() ||
                    std::memcmp(seen.data(), was.data(), was.size() * sizeof(float)) != 0)
                  verdict.fail(fmt::format("{}: {} changed", after, what));
              };
              same(host_values(subject->shard_parameters()), shard, "shard_parameters()");
              for (const OptimizerState& s : subject->inner().state()) {
                const auto was = state.find(s.name);
                if (was != state.end())
                  same(host_values(*s.tensor), was->second, "the inner optimizer's " + s.name);
              }
              if (subject->inner().step_count() != step_count)
                verdict.fail(fmt::format("{}: the inner optimizer's step count is {}; it was {}",
                                         after, subject->inner().step_count(), step_count));
              if (lab.values_replicated)
                same(model.flat_parameters(), values, "the model's parameter values");
            },
            draws, kFileHangTimeout, Backend::kLocal);
        std::error_code ignored;
        std::filesystem::remove_all(where, ignored);
        if (!passed) break;
      }
    }

    if (passed)
      note_measured(fmt::format(
          "{}: saved on 4 ranks after step {} of {} (shards of {} elements, padding included); the "
          "index's layouts and the consolidated parameters and optimizer state are the emulation's "
          "bitwise; loaded on 2, 3 and 4 ranks (shards of {}, {} and {}){} it trained on bitwise; "
          "a "
          "checkpoint of other shapes (one of the same element count), without optimizer "
          "state or whose \"step\" is not a count throws dp::Error naming what differs and "
          "changes nothing",
          training.options.optimizer, k, steps, expected.layouts.at(4).front().shard_elements,
          expected.layouts.at(2).front().shard_elements,
          expected.layouts.at(3).front().shard_elements,
          expected.layouts.at(4).front().shard_elements,
          lab.other_segments ? fmt::format(" and on 4 with {}", lab.other_segments_name) : ""));

  } catch (const std::exception& error) {
    ADD_FAILURE() << fmt::format("the checkpoint check failed with {}: {}\n  drawn: {}",
                                 type_name(error), error.what(), draws.describe());
  }

  // The directory goes; under mpi once every process has read it.
  if (on_mpi_ranks) {
    run_on_ranks(
        kSavedWorld,
        [&](Communicator& comm, Verdict&) {
          comm.barrier();
          std::error_code ignored;
          if (comm.rank() == 0) std::filesystem::remove_all(directory, ignored);
        },
        draws, kFileHangTimeout, Backend::kMpi);
  } else {
    std::error_code ignored;
    std::filesystem::remove_all(directory, ignored);
  }
}

}  // namespace dp::grading
