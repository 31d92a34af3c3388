// Lab 7's graded checks. The unit plan must follow lab7.h's rule; training through
// ZeroThreeOptimizer (SGD and AdamW, drawn models and world sizes, units that pad) must give
// every rank's shard of the parameters and the loss of every forward bitwise lab 2's flat
// arithmetic; clipping must follow the contract's arithmetic bit for bit; the MemoryTracker
// must show only the shard of the parameters plus the unit in use, no value between units,
// the shard of the gradient plus one unit's gradients, the contract's three buffers and an
// optimizer over the shard, and a step must allocate nothing but the values materialised
// and the gradients backward makes; a recording communicator, layer hooks of the grader's
// and the backend's counters must show each unit's all-gather prefetched while the unit
// before it computes, into the one gather buffer only once the unit before it was
// materialised from it, at most two units alive, the reduce-scatters during backward and
// nothing but the norm in step(), 1.5x DDP's volume plus the padding; on the simulated
// clock the prefetch must hide at least half of the all-gather time; the design question's
// prediction must equal the tracker's peak. Every check draws its configuration from the
// grading seed and runs in the adversarial completion mode. rubric.json gives the points,
// the ranges drawn and why the comparisons are bitwise.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "checkpoint_check.h"
#include "compare.h"
#include "dp/clock.h"
#include "dp/data.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/memory.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/tensor_ops.h"
#include "dp/trace.h"
#include "dp/trainer.h"
#include "grading.h"
#include "ground_truth.h"
#include "heap_use.h"
#include "lab7.h"
#include "memory_check.h"
#include "recording.h"
#include "sharded.h"

namespace dp::lab7 {
namespace {

using grading::Draws;
using grading::RecordedCall;
using grading::run_on_ranks;
using grading::Trajectory;
using grading::Verdict;

constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();

// --- the contract's rules, as the grader computes them ------------------------------------

/// lab7.h's unit rule: the grader's own copy.
std::vector<Unit> contract_units(Model& model, int world) {
  std::vector<Unit> units;
  const std::span<Layer* const> layers = model.layers();
  for (std::size_t l = 0; l < layers.size(); ++l) {
    Unit unit;
    unit.layer = l;
    for (const Parameter* parameter : layers[l]->parameters()) {
      unit.parameters.push_back(parameter->index);
      unit.elements += parameter->value.size();
    }
    if (!unit.parameters.empty()) units.push_back(std::move(unit));
  }
  std::size_t offset = 0;
  const auto n = static_cast<std::size_t>(world);
  for (Unit& unit : units) {
    unit.chunk_elements = (unit.elements + n - 1) / n;
    unit.shard_offset = offset;
    offset += unit.chunk_elements;
  }
  return units;
}

std::size_t contract_shard(const std::vector<Unit>& units) {
  std::size_t total = 0;
  for (const Unit& unit : units) total += unit.chunk_elements;
  return total;
}

std::string describe(const Unit& u) {
  return fmt::format("{{layer {}, parameters [{}], E {}, C {}, shard offset {}}}", u.layer,
                     fmt::join(u.parameters, ", "), u.elements, u.chunk_elements, u.shard_offset);
}

std::string describe(const std::vector<Unit>& units) {
  std::vector<std::string> parts;
  for (const Unit& u : units) parts.push_back(describe(u));
  return fmt::format("[{}]", fmt::join(parts, ", "));
}

/// A padding element of a shard.
constexpr std::size_t kPadding = kNone;

/// Rank `rank`'s shard as flat indices of the model's parameter space, in shard order.
std::vector<std::size_t> shard_indices(Model& model, const std::vector<Unit>& units, int rank) {
  std::vector<std::size_t> indices;
  for (const Unit& unit : units) {
    std::vector<std::size_t> flat;
    for (const std::size_t p : unit.parameters) {
      const Parameter& parameter = *model.parameters()[p];
      for (std::size_t i = 0; i < parameter.value.size(); ++i) flat.push_back(parameter.offset + i);
    }
    const std::size_t begin = static_cast<std::size_t>(rank) * unit.chunk_elements;
    for (std::size_t i = begin; i < begin + unit.chunk_elements; ++i)
      indices.push_back(i < flat.size() ? flat[i] : kPadding);
  }
  return indices;
}

std::size_t largest_unit(const std::vector<Unit>& units) {
  std::size_t largest = 0;
  for (const Unit& u : units) largest = std::max(largest, u.elements);
  return largest;
}

/// At most this many units alive at once: one materialised, one arriving (FSDP's
/// limit_all_gathers).
constexpr std::size_t kMaxGatheredUnits = 2;

/// Bytes of the contract's buffers: one gather buffer and min(2, U) gradient buffers of
/// 4 max_u N C_u bytes each.
std::size_t contract_buffer_bytes(const std::vector<Unit>& units, int world) {
  std::size_t largest = 0;
  for (const Unit& u : units)
    largest = std::max(largest, static_cast<std::size_t>(world) * u.chunk_elements);
  return (kGatherBuffers + std::min(kGradientBuffers, units.size())) * 4 * largest;
}

/// The names of the parameters of `model` whose value (or gradient) is allocated.
std::vector<std::string> allocated(const Model& model, bool gradients) {
  std::vector<std::string> names;
  for (const Parameter* p : model.parameters())
    if (!(gradients ? p->grad : p->value).empty()) names.push_back(p->name);
  return names;
}

/// "" when every value and gradient of `model` is released.
std::string check_released(const Model& model) {
  const std::vector<std::string> values = allocated(model, false);
  const std::vector<std::string> grads = allocated(model, true);
  if (!values.empty())
    return fmt::format(
        "Parameter::value of [{}] still allocated; expected every value released (only the "
        "shard stays between units)",
        fmt::join(values, ", "));
  if (!grads.empty())
    return fmt::format("Parameter::grad of [{}] still allocated; expected every gradient released",
                       fmt::join(grads, ", "));
  return "";
}

// --- drawn training ------------------------------------------------------------------------

using Training = grading::ShardedTraining;

OptimizerFactory factory_for(const TrainOptions& options) {
  return grading::shard_optimizer_factory(options);
}

/// "" when `shard` holds, element by element, `flat` at `indices` (padding zero); else the
/// first difference, with a hint from the change since `before` when there is one.
std::string check_shard(const Model& layout, const std::vector<std::size_t>& indices,
                        const Tensor& shard, std::span<const float> flat,
                        std::span<const float> before, int world) {
  if (shard.size() != indices.size())
    return fmt::format("shard_parameters() holds {} elements; expected S = {}", shard.size(),
                       indices.size());
  const std::vector<float> values = grading::host_values(shard);
  for (std::size_t i = 0; i < indices.size(); ++i) {
    const float expected = indices[i] == kPadding ? 0.0f : flat[indices[i]];
    if (std::memcmp(&values[i], &expected, sizeof(float)) == 0) continue;
    if (indices[i] == kPadding)
      return fmt::format("shard_parameters()[{}] is padding and holds {}; expected 0", i,
                         values[i]);
    std::string where;
    for (const Parameter* p : layout.parameters())
      if (indices[i] >= p->offset && indices[i] < p->offset + p->value.size())
        where = fmt::format("{} element {}", p->name, indices[i] - p->offset);
    std::string hint;
    if (!before.empty()) {
      std::vector<float> seen_change;
      std::vector<float> expected_change;
      for (std::size_t j = 0; j < indices.size(); ++j) {
        if (indices[j] == kPadding) continue;
        seen_change.push_back(values[j] - before[indices[j]]);
        expected_change.push_back(flat[indices[j]] - before[indices[j]]);
      }
      hint = grading::scale_hint(seen_change, expected_change, grading::division_suspects(world));
    }
    return fmt::format(
        "shard_parameters()[{}] ({}) holds {}; expected {} (the shard is this "
        "rank's chunk of every unit, in unit order){}{}",
        i, where, values[i], expected, hint.empty() ? "" : "; ", hint);
  }
  return "";
}

/// Trains this rank with the student's ZeroThreeOptimizer for `training`'s steps, comparing
/// the loss of every forward and the shard after every step with `exact` bitwise (and the
/// norms with `norms` when clipping).
void train_and_compare(const Training& training, Communicator& comm, Verdict& verdict,
                       const Trajectory& exact, float max_norm, const std::vector<float>& norms,
                       const std::string& what) {
  const int world = comm.size();
  const TrainOptions options = training.for_world(world);
  Model model = training.model();
  const std::vector<std::size_t> indices =
      shard_indices(model, contract_units(model, world), comm.rank());
  std::vector<float> before = model.flat_parameters();
  const Model layout = training.model();
  ZeroThreeOptimizer zero(model, comm, factory_for(options), max_norm);
  // Every rank runs every step whatever it found, so that no rank waits for a peer that
  // stopped: a failure is recorded once, and the later steps are not judged.
  for (int step = 1; step <= options.steps; ++step) {
    const Batch batch = grading::on_check_device(
        grading::local_batch(*training.data, options, step - 1, comm.rank(), world));
    const float loss = model.backward(grading::forward(model, batch), batch.labels);
    const std::optional<float> norm = zero.step();
    if (!verdict.passed()) continue;
    const float expected_loss =
        exact
            .rank_losses[static_cast<std::size_t>(step - 1)][static_cast<std::size_t>(comm.rank())];
    if (std::memcmp(&loss, &expected_loss, sizeof(float)) != 0) {
      verdict.fail(fmt::format(
          "{}: the loss of step {}'s forward is {}; expected {} bitwise (the forward computes "
          "with the gathered parameters, which must be lab 2's after {} steps)",
          what, step, loss, expected_loss, step - 1));
      continue;
    }
    if (max_norm == 0 && norm.has_value()) {
      verdict.fail(
          fmt::format("{}: step {} returned a norm ({}) with clipping off; expected "
                      "std::nullopt",
                      what, step, *norm));
      continue;
    }
    if (max_norm > 0) {
      const float expected = norms[static_cast<std::size_t>(step - 1)];
      if (!norm.has_value() || std::memcmp(&*norm, &expected, sizeof(float)) != 0) {
        const std::string hint =
            norm.has_value() && expected > 0 &&
                    std::abs(*norm / expected - std::sqrt(static_cast<float>(world))) < 1e-3f
                ? " (sqrt(N) times: the norm of the sum, not of the average?)"
                : "";
        verdict.fail(fmt::format(
            "{}: step {} returned norm {}; expected {} bitwise (partial squared norms over each "
            "rank's averaged shard, one all-reduce, sqrt){}",
            what, step, norm.has_value() ? fmt::format("{}", *norm) : "std::nullopt", expected,
            hint));
        continue;
      }
    }
    const std::vector<float>& flat =
        exact.parameters_after_step[static_cast<std::size_t>(step - 1)];
    verdict.expect_empty(check_shard(layout, indices, zero.shard_parameters(), flat, before, world),
                         fmt::format("{}: after step {}", what, step));
    verdict.expect_empty(check_released(model), fmt::format("{}: after step {}", what, step));
    before = flat;
  }
}

// --- Lab7Units -----------------------------------------------------------------------------

TEST(Lab7Units, FollowTheRule) {
  Draws draws("Lab7Units.FollowTheRule");
  for (int i = 0; i < 6; ++i) {
    TrainOptions o;
    o.model = fmt::format("64-{}-{}-10", draws.integer("h1", 8, 96), draws.integer("h2", 8, 64));
    o.layer_norm = draws.coin("layer norm");
    Model model = grading::make_check_model(o);
    const int world = static_cast<int>(draws.integer("N", 1, 16));
    const std::vector<Unit> expected = contract_units(model, world);
    std::vector<Unit> seen;
    try {
      seen = plan_units(model, world);
    } catch (const NotImplemented&) {
      throw;
    } catch (const std::exception& error) {
      ADD_FAILURE() << fmt::format("plan_units({}, N {}) threw {}: {}\n  drawn: {}", o.model, world,
                                   grading::type_name(error), error.what(), draws.describe());
      continue;
    }
    if (seen != expected)
      ADD_FAILURE() << fmt::format("plan_units({}{}, N {}) = {}; expected {}\n  drawn: {}", o.model,
                                   o.layer_norm ? " with LayerNorm" : "", world, describe(seen),
                                   describe(expected), draws.describe());
    else if (shard_elements(seen) != contract_shard(expected))
      ADD_FAILURE() << fmt::format("shard_elements = {}; expected the sum of the chunks, {}",
                                   shard_elements(seen), contract_shard(expected));
  }
  {
    TrainOptions o;
    o.model = "64-16-10";
    Model model = grading::make_check_model(o);
    const auto expect_error = [&](const std::string& what, const auto& call) {
      try {
        call();
        ADD_FAILURE() << fmt::format("{}: plan_units returned; expected dp::Error", what);
      } catch (const NotImplemented&) {
        throw;
      } catch (const Error&) {
      }
    };
    expect_error("world size 0", [&] { (void)plan_units(model, 0); });
    model.freeze(model.parameters().front()->name);
    expect_error("a frozen parameter", [&] { (void)plan_units(model, 2); });
  }
  // The optimizer's own units, initial shard and released values, on drawn world sizes.
  const std::vector<int> worlds = draws.world_sizes(6);
  const Training training = grading::draw_sharded_training(draws, "sgd");
  for (int world : worlds) {
    run_on_ranks(
        world,
        [&](Communicator& comm, Verdict& verdict) {
          Model model = training.model();
          const Model layout = training.model();
          const std::vector<Unit> expected = contract_units(model, world);
          const std::vector<std::size_t> indices = shard_indices(model, expected, comm.rank());
          const std::vector<float> initial = model.flat_parameters();
          ZeroThreeOptimizer zero(model, comm, factory_for(training.for_world(world)));
          if (zero.units() != expected)
            verdict.fail(fmt::format("ZeroThreeOptimizer::units() = {}; expected {}",
                                     describe(zero.units()), describe(expected)));
          else
            verdict.expect_empty(
                check_shard(layout, indices, zero.shard_parameters(), initial, {}, world),
                "after the constructor");
          verdict.expect_empty(check_released(model), "after the constructor");
        },
        draws);
  }
  if (!HasFailure())
    grading::note_measured(fmt::format(
        "drawn models and N up to 16 follow the rule; the optimizer's units, initial shard and "
        "released values and gradients on world sizes {}",
        fmt::join(worlds, ", ")));
}

// --- Lab7Contract --------------------------------------------------------------------------

TEST(Lab7Contract, ErrorsOnMisuseAndOneInnerOptimizer) {
  Draws draws("Lab7Contract.ErrorsOnMisuseAndOneInnerOptimizer");
  const std::vector<int> worlds = draws.world_sizes(6);
  const Training training = grading::draw_sharded_training(draws, "adamw");
  for (int world : worlds) {
    run_on_ranks(
        world,
        [&](Communicator& comm, Verdict& verdict) {
          const TrainOptions options = training.for_world(world);
          Model layout = training.model();
          const std::size_t shard = contract_shard(contract_units(layout, world));
          const auto expect_error = [&](const std::string& what, const auto& make) {
            try {
              make();
              verdict.fail(fmt::format("{}: the call returned; expected dp::Error", what));
            } catch (const NotImplemented&) {
              throw;
            } catch (const Error&) {
            }
          };
          {
            Model model = training.model();
            const std::string& name = model.parameters().back()->name;
            model.freeze(name);
            expect_error(fmt::format("a frozen parameter ({})", name),
                         [&] { ZeroThreeOptimizer zero(model, comm, factory_for(options)); });
          }
          Model model = training.model();
          expect_error("max_norm -1",
                       [&] { ZeroThreeOptimizer zero(model, comm, factory_for(options), -1.0f); });
          expect_error("max_norm NaN", [&] {
            ZeroThreeOptimizer zero(model, comm, factory_for(options),
                                    std::numeric_limits<float>::quiet_NaN());
          });
          expect_error("max_norm infinity", [&] {
            ZeroThreeOptimizer zero(model, comm, factory_for(options),
                                    std::numeric_limits<float>::infinity());
          });
          expect_error("an empty factory",
                       [&] { ZeroThreeOptimizer zero(model, comm, OptimizerFactory{}); });
          expect_error("a factory that returns nullptr", [&] {
            ZeroThreeOptimizer zero(model, comm,
                                    [](std::size_t) { return std::unique_ptr<Optimizer>{}; });
          });
          expect_error(fmt::format("a factory whose optimizer keeps state for S + 1 = {} elements",
                                   shard + 1),
                       [&] {
                         ZeroThreeOptimizer zero(model, comm, [](std::size_t s) {
                           return std::make_unique<Sgd>(s + 1, SgdOptions{},
                                                        grading::check_device());
                         });
                       });
          {
            // A second optimizer on a model whose values the first released: it would shard
            // empty values. Its own model, never run: a second set of hooks stays on it.
            Model released = training.model();
            ZeroThreeOptimizer first(released, comm, factory_for(options));
            expect_error("a second ZeroThreeOptimizer on a model whose values the first released",
                         [&] { ZeroThreeOptimizer second(released, comm, factory_for(options)); });
          }
          if (!verdict.passed()) return;
          Model fresh = training.model();
          std::vector<std::size_t> asked;
          grading::UpdateRecorder* made = nullptr;
          ZeroThreeOptimizer zero(fresh, comm, [&](std::size_t s) {
            asked.push_back(s);
            auto optimizer = std::make_unique<grading::UpdateRecorder>(factory_for(options)(s));
            made = optimizer.get();
            return optimizer;
          });
          if (asked != std::vector<std::size_t>{shard})
            verdict.fail(fmt::format(
                "the factory was called with [{}]; expected once, with the shard's S = {}",
                fmt::join(asked, ", "), shard));
          else if (&zero.inner() != made)
            verdict.fail("inner() is not the optimizer the factory made");
          if (!verdict.passed()) return;
          expect_error("step() without a forward and backward", [&] { (void)zero.step(); });
          const std::int64_t steps_before = made->step_count();
          const Batch batch = grading::on_check_device(
              grading::local_batch(*training.data, options, 0, comm.rank(), world));
          fresh.backward(grading::forward(fresh, batch), batch.labels);
          (void)zero.step();
          if (verdict.passed() && made->step_count() != steps_before + 1)
            verdict.fail(fmt::format(
                "one step() began {} steps of the inner optimizer; expected 1 (begin_step once)",
                made->step_count() - steps_before));
          const std::vector<std::pair<std::size_t, std::size_t>> whole_shard = {{0, shard}};
          if (verdict.passed() && made->last_updates() != whole_shard) {
            std::vector<std::string> seen;
            for (const auto& [offset, elements] : made->last_updates())
              seen.push_back(fmt::format("update({}, {} elements)", offset, elements));
            verdict.fail(fmt::format(
                "one step() called [{}] on the inner optimizer; expected one update(0, {} "
                "elements) over the whole shard, on every rank",
                fmt::join(seen, ", "), shard));
          }
          if (!verdict.passed()) return;
          // A forward alone (evaluation) is allowed, also between steps: forward, forward,
          // backward, step.
          try {
            (void)grading::forward(fresh, batch);
            fresh.backward(grading::forward(fresh, batch), batch.labels);
            (void)zero.step();
          } catch (const NotImplemented&) {
            throw;
          } catch (const std::exception& error) {
            verdict.fail(fmt::format(
                "a forward alone (evaluation) before forward, backward and step() threw {}: {}; "
                "expected the step to work (a forward without a backward is allowed)",
                grading::type_name(error), error.what()));
            return;
          }
          // A second backward before step() would reduce-scatter over the first one's shard:
          // the contract asks for dp::Error from the hook. Every rank runs the same calls and
          // throws at the same hook, so the ranks stay in step.
          fresh.backward(grading::forward(fresh, batch), batch.labels);
          expect_error("a second backward before step()",
                       [&] { fresh.backward(grading::forward(fresh, batch), batch.labels); });
          if (!verdict.passed()) return;
          // A backward that stops before unit 0 (the grader's hook throws there, on every
          // rank): every other unit was reduce-scattered, unit 0 was not, and step() must say
          // so rather than update with half a gradient.
          {
            struct StopBackward {};
            Model partial = training.model();
            Layer* const first_unit = partial.layers()[contract_units(partial, world)[0].layer];
            ZeroThreeOptimizer stopped(partial, comm, factory_for(options));
            partial.on_pre_backward([first_unit](Layer& layer) {
              if (&layer == first_unit) throw StopBackward{};
            });
            try {
              partial.backward(grading::forward(partial, batch), batch.labels);
            } catch (const StopBackward&) {
            }
            expect_error("step() after a backward that stopped before unit 0",
                         [&] { (void)stopped.step(); });
          }
          if (verdict.passed())
            verdict.note(
                "a frozen parameter, a released value, a negative, NaN or infinite max_norm, an "
                "empty factory, one returning nullptr or an optimizer of the wrong size throw "
                "dp::Error, and so do a step without a backward, a step after a backward that "
                "stopped before unit 0 and a second backward before step(); a forward alone "
                "between steps works; the factory is called once with S; a step is one "
                "begin_step and one update over the whole shard");
        },
        draws);
  }
}

// --- Lab7Equivalence -----------------------------------------------------------------------

TEST(Lab7Equivalence, BitwiseLab2AfterEveryStep) {
  Draws draws("Lab7Equivalence.BitwiseLab2AfterEveryStep");
  const std::vector<int> worlds = draws.world_sizes(6);
  // SGD and AdamW on drawn models, then AdamW on a model whose second hidden layer has 2
  // units with a LayerNorm (a unit of 4 elements: on N >= 3 some ranks own only padding of
  // it, and still join its calls and update their whole shard).
  for (const auto& drawn : std::vector<std::pair<std::string, bool>>{
           {"sgd", false}, {"adamw", false}, {"adamw", true}}) {
    // Plain names: clang before 16 cannot capture a structured binding in a lambda.
    const std::string& optimizer = drawn.first;
    const bool narrow = drawn.second;
    Training training = grading::draw_sharded_training(draws, optimizer);
    if (narrow) {
      training.options.model = fmt::format("64-{}-2-10", training.hidden1);
      training.options.layer_norm = true;
    }
    for (int world : worlds) {
      const TrainOptions options = training.for_world(world);
      const Trajectory exact = grading::emulate_data_parallel(options, *training.data, world);
      const Trajectory one = grading::single_process_trajectory(options, *training.data);
      const double from_one = grading::max_abs_difference(exact.parameters_after_step.back(),
                                                          one.parameters_after_step.back());
      run_on_ranks(
          world,
          [&](Communicator& comm, Verdict& verdict) {
            train_and_compare(training, comm, verdict, exact, 0.0f, {},
                              fmt::format("ZeroThreeOptimizer with {}", optimizer));
            if (verdict.passed()) {
              Model layout = training.model();
              const std::vector<Unit> u = contract_units(layout, world);
              std::size_t padding = 0;
              std::size_t padding_only = 0;  // (unit, rank) chunks of padding only
              for (const Unit& unit : u) {
                padding += static_cast<std::size_t>(world) * unit.chunk_elements - unit.elements;
                for (int r = 0; r < world; ++r)
                  if (static_cast<std::size_t>(r) * unit.chunk_elements >= unit.elements)
                    ++padding_only;
              }
              verdict.note(fmt::format(
                  "SGD and AdamW: every forward's loss and every rank's shard bitwise lab 2's "
                  "flat arithmetic after every step (here {} on {}, N = {}: {} units, S = {}, {} "
                  "padding elements stayed 0, {} chunks of padding only); one process on the "
                  "global batch differs by {:.1e} after {} steps",
                  optimizer, options.model, world, u.size(), contract_shard(u), padding,
                  padding_only, from_one, options.steps));
            }
          },
          draws);
    }
  }
}

// --- Lab7Clipping --------------------------------------------------------------------------

TEST(Lab7Clipping, GlobalNormOverTheShards) {
  Draws draws("Lab7Clipping.GlobalNormOverTheShards");
  const std::vector<int> worlds = draws.world_sizes(6);
  struct Case {
    std::string optimizer;
    float low;
    float high;
  };
  for (const Case& drawn :
       {Case{"sgd", 0.2f, 0.7f}, Case{"adamw", 0.2f, 0.7f}, Case{"sgd", 2.0f, 4.0f}}) {
    const std::string label = drawn.optimizer + (drawn.low > 1 ? " above the norm" : "");
    const Training training = grading::draw_sharded_training(draws, drawn.optimizer);
    const float fraction = draws.uniform(label + " max_norm / first norm", drawn.low, drawn.high);
    for (int world : worlds) {
      const TrainOptions options = training.for_world(world);
      const Trajectory plain = grading::emulate_data_parallel(options, *training.data, world);
      double first = 0;
      for (const float g : plain.gradients_of_step[0]) first += static_cast<double>(g) * g;
      const auto max_norm = static_cast<float>(std::sqrt(first)) * fraction;
      Model layout = training.model();
      const std::vector<Unit> units = contract_units(layout, world);
      std::vector<std::vector<std::size_t>> real_by_rank;
      for (int r = 0; r < world; ++r) {
        real_by_rank.emplace_back();
        for (const std::size_t i : shard_indices(layout, units, r))
          if (i != kPadding) real_by_rank.back().push_back(i);
      }
      const grading::ClippedTrajectory clipping =
          grading::emulate_clipped(options, *training.data, world, real_by_rank, max_norm);
      run_on_ranks(
          world,
          [&](Communicator& comm, Verdict& verdict) {
            train_and_compare(training, comm, verdict, clipping.exact, max_norm, clipping.norms,
                              fmt::format("ZeroThreeOptimizer with {} and max_norm {:.4g}",
                                          drawn.optimizer, max_norm));
            if (verdict.passed())
              verdict.note(fmt::format(
                  "{} with max_norm {:.2g}x the first norm: norms and shards bitwise the "
                  "contract's arithmetic ({} of {} steps clipped here, N = {}); the norms "
                  "within {:.1e} of the unsharded double-precision norm",
                  drawn.optimizer, fraction, clipping.clipped_steps, options.steps, world,
                  clipping.worst_relative));
          },
          draws);
    }
  }
}

// --- Lab7Memory ----------------------------------------------------------------------------

TEST(Lab7Memory, ParametersAreOneShardPlusOneUnit) {
  Draws draws("Lab7Memory.ParametersAreOneShardPlusOneUnit");
  const std::vector<int> worlds = draws.world_sizes(6);
  const Training training =
      grading::draw_sharded_training(draws, draws.coin("adamw") ? "adamw" : "sgd");
  for (std::size_t w = 0; w < worlds.size(); ++w) {
    const int world = worlds[w];
    const float max_norm = w % 2 == 0 ? 1.0f : 0.0f;
    run_on_ranks(
        world,
        [&](Communicator& comm, Verdict& verdict) {
          const TrainOptions options = training.for_world(world);
          MemoryTracker& tracker = this_rank_memory().tracker();
          // A twin without ZeRO-3: the activation bytes of a plain forward and backward.
          Model twin = training.model();
          const std::size_t activation_base = tracker.current(MemoryCategory::kActivations);
          tracker.reset_peaks();
          {
            const Batch batch = grading::on_check_device(
                grading::local_batch(*training.data, options, 0, comm.rank(), world));
            twin.backward(grading::forward(twin, batch), batch.labels);
          }
          const std::size_t plain_activations =
              tracker.peak(MemoryCategory::kActivations) - activation_base;
          const std::size_t model_activation_base = tracker.current(MemoryCategory::kActivations);
          const std::size_t param_base = tracker.current(MemoryCategory::kParameters);
          const std::size_t grad_base = tracker.current(MemoryCategory::kGradients);
          const std::size_t comm_base = tracker.current(MemoryCategory::kCommunication);
          const std::size_t other_base = tracker.current(MemoryCategory::kOther);
          Model model = training.model();
          const std::size_t psi = model.num_parameters();
          const std::vector<Unit> units = contract_units(model, world);
          const std::size_t shard = 4 * contract_shard(units);
          const std::size_t unit_bytes = 4 * largest_unit(units);
          const std::size_t buffers =
              contract_buffer_bytes(units, world) + (max_norm > 0 ? sizeof(float) : 0);
          // The grader's hooks, registered before the student's: at every pre-hook no value
          // may exist (the last unit's released, this one's not yet gathered); at every
          // post-hook of a unit, exactly the shard and this unit's values.
          std::string hook_finding;
          std::vector<std::size_t> unit_of_layer(model.layers().size(), kNone);
          for (std::size_t u = 0; u < units.size(); ++u) unit_of_layer[units[u].layer] = u;
          const auto layer_index = [&](const Layer& layer) {
            const std::span<Layer* const> layers = model.layers();
            for (std::size_t l = 0; l < layers.size(); ++l)
              if (layers[l] == &layer) return l;
            return kNone;
          };
          bool watching = false;
          const auto pre = [&](const char* phase) {
            return [&, phase](Layer& layer) {
              if (!watching || !hook_finding.empty()) return;
              const std::vector<std::string> kept = allocated(model, false);
              if (!kept.empty())
                hook_finding = fmt::format(
                    "before {}'s {}, Parameter::value of [{}] is allocated; expected no value "
                    "outside its unit's forward or backward (release each unit's values in its "
                    "post-hook)",
                    layer.name(), phase, fmt::join(kept, ", "));
            };
          };
          const auto post = [&](const char* phase) {
            return [&, phase](Layer& layer) {
              if (!watching || !hook_finding.empty()) return;
              const std::size_t u = unit_of_layer[layer_index(layer)];
              if (u == kNone) return;
              const std::size_t seen = tracker.current(MemoryCategory::kParameters) - param_base;
              const std::size_t expected = shard + 4 * units[u].elements;
              if (seen != expected)
                hook_finding = fmt::format(
                    "after {}'s {} (unit {}), {} bytes of parameters; expected the shard's 4 S "
                    "= {} plus this unit's 4 E = {}: {}{}",
                    layer.name(), phase, u, seen, shard, 4 * units[u].elements, expected,
                    seen >= shard + 4 * psi ? " (the whole model is there)"
                    : seen > expected       ? " (another unit's values are still allocated)"
                                            : "");
            };
          };
          model.on_pre_forward(pre("forward"));
          model.on_post_forward(post("forward"));
          model.on_pre_backward(pre("backward"));
          model.on_post_backward(post("backward"));
          tracker.reset_peaks();
          const grading::CategoryBytes before_constructor = grading::current_bytes(tracker);
          ZeroThreeOptimizer zero(model, comm, factory_for(options), max_norm);
          // Every category, what the constructor changed: the shards of the parameters and of
          // the gradient in, the model's values and gradients (4 Psi each) released, the
          // buffers, the inner optimizer's state, nothing else.
          grading::CategoryBytes expected_change;
          const std::int64_t shard_in_model_out =
              static_cast<std::int64_t>(shard) - static_cast<std::int64_t>(4 * psi);
          expected_change[MemoryCategory::kParameters] = shard_in_model_out;
          expected_change[MemoryCategory::kGradients] = shard_in_model_out;
          expected_change[MemoryCategory::kCommunication] = static_cast<std::int64_t>(buffers);
          expected_change[MemoryCategory::kOptimizerState] = grading::state_bytes(zero.inner());
          const std::string constructor_differs = grading::category_differences(
              grading::current_bytes(tracker) - before_constructor, expected_change);
          if (!constructor_differs.empty())
            verdict.fail(fmt::format(
                "what the constructor changed: {}; the contract: 4 S - 4 Psi = {} of parameters "
                "and of gradients (the shards in, every value and gradient released), + {} of "
                "communication (one gather buffer and min(2, U) = {} gradient buffer(s) of 4 "
                "max_u(N C_u){}), the inner optimizer's state, nothing else",
                constructor_differs, shard_in_model_out, buffers,
                std::min(kGradientBuffers, units.size()),
                max_norm > 0 ? " and the norm's float" : ""));
          verdict.expect_empty(check_released(model), "after the constructor");
          const grading::CategoryBytes constructed = grading::current_bytes(tracker);
          tracker.reset_peaks();
          std::size_t backward_grad_peak = 0;
          watching = true;
          for (int step = 1; step <= 2 && verdict.passed(); ++step) {
            const Batch batch = grading::on_check_device(
                grading::local_batch(*training.data, options, step - 1, comm.rank(), world));
            model.backward(grading::forward(model, batch), batch.labels);
            backward_grad_peak =
                std::max(backward_grad_peak, tracker.peak(MemoryCategory::kGradients) - grad_base);
            verdict.expect_empty(check_released(model),
                                 fmt::format("step {}, right after backward", step));
            (void)zero.step();
          }
          watching = false;
          if (!hook_finding.empty()) verdict.fail(hook_finding);
          // Between steps every category but the activations (what the model's loss keeps)
          // holds what it held after the constructor: the contract's "at all times".
          grading::CategoryBytes kept = grading::current_bytes(tracker) - constructed;
          kept[MemoryCategory::kActivations] = 0;
          const std::string changed = grading::category_differences(kept, {});
          if (verdict.passed() && !changed.empty())
            verdict.fail(fmt::format(
                "after two steps, against just after the constructor: {}; expected every "
                "category as it was (the shards and buffers stay, every value and gradient is "
                "released)",
                changed));
          const std::size_t param_peak = tracker.peak(MemoryCategory::kParameters) - param_base;
          const std::size_t grad_peak = tracker.peak(MemoryCategory::kGradients) - grad_base;
          const std::size_t comm_peak = tracker.peak(MemoryCategory::kCommunication) - comm_base;
          const std::size_t other_peak = tracker.peak(MemoryCategory::kOther) - other_base;
          const std::size_t activations =
              tracker.peak(MemoryCategory::kActivations) - model_activation_base;
          if (!verdict.passed()) return;
          if (activations > plain_activations)
            verdict.fail(fmt::format(
                "{} activation bytes at the peak of the steps, {} for the same forward and "
                "backward without ZeRO-3; expected no more (values under kParameters, buffers "
                "under kCommunication)",
                activations, plain_activations));
          else if (other_peak != 0)
            verdict.fail(fmt::format(
                "{} bytes under MemoryCategory::kOther at the peak of the steps; expected none",
                other_peak));
          else if (param_peak != shard + unit_bytes)
            verdict.fail(fmt::format(
                "parameter bytes at the peak of the steps {}; expected 4 S + 4 max_u E_u = {} + "
                "{} = {} (Psi = {}, N = {})",
                param_peak, shard, unit_bytes, shard + unit_bytes, psi, world));
          else if (backward_grad_peak != shard + unit_bytes || grad_peak != shard + unit_bytes)
            verdict.fail(fmt::format(
                "gradient bytes at the peak during backward {} (during the steps {}); expected "
                "4 S + 4 x the largest unit = {} + {} = {}{}",
                backward_grad_peak, grad_peak, shard, unit_bytes, shard + unit_bytes,
                backward_grad_peak > shard + unit_bytes
                    ? ": gradients stayed past their unit's backward (release them once copied)"
                    : ""));
          else if (comm_peak != buffers)
            verdict.fail(fmt::format(
                "communication bytes at the peak {}; expected (1 + min(2, U)) x 4 max_u(N C_u){} "
                "= {} ({} units: one gather and two gradient buffers){}",
                comm_peak, max_norm > 0 ? " + 4 for the norm (clipping on)" : "", buffers,
                units.size(),
                comm_peak < buffers   ? ": fewer buffers than the contract's three"
                : comm_peak > buffers ? ": more than the contract's three buffers (one gather "
                                        "buffer is enough if the unit is copied out before the "
                                        "prefetch; a buffer allocated again in every backward "
                                        "adds up too)"
                                      : ""));
          else
            verdict.note(fmt::format(
                "N = {}, Psi = {}: parameter peak {} bytes (4 S = {} plus the largest unit's {}), "
                "gradient peak the same, {} bytes of buffers{}, against lab 6's 4 Psi = {} of "
                "parameters on every rank",
                world, psi, shard + unit_bytes, shard, unit_bytes, buffers,
                max_norm > 0 ? " and the norm's float" : "", 4 * psi));
        },
        draws);
  }
}

TEST(Lab7Memory, ShardedStateAndNoAllocation) {
  Draws draws("Lab7Memory.ShardedStateAndNoAllocation");
  const std::vector<int> worlds = draws.world_sizes(6);
  const Training training = grading::draw_sharded_training(draws, "adamw");
  for (int world : worlds) {
    run_on_ranks(
        world,
        [&](Communicator& comm, Verdict& verdict) {
          for (const auto& [kind, floats, max_norm] :
               std::vector<std::tuple<std::string, std::size_t, float>>{
                   {"adamw", 2, 0.0f}, {"sgd", 1, 0.0f}, {"adamw", 2, 1.0f}, {"sgd", 1, 1.0f}}) {
            const std::string label = kind + (max_norm > 0 ? " with clipping" : "");
            TrainOptions options = training.for_world(world);
            options.optimizer = kind;
            if (kind == "sgd") options.momentum = 0.9f;
            MemoryTracker& tracker = this_rank_memory().tracker();
            const std::size_t base = tracker.current(MemoryCategory::kOptimizerState);
            tracker.reset_peaks();
            Model model = training.model();
            const std::size_t shard = contract_shard(contract_units(model, world));
            const std::size_t expected = 4 * floats * shard;
            Model twin = training.model();
            const grading::HeapUse before_constructor = grading::heap_use_of_this_thread();
            ZeroThreeOptimizer zero(model, comm, factory_for(options), max_norm);
            const grading::HeapUse constructor =
                grading::heap_use_of_this_thread().since(before_constructor);
            if (verdict.passed() && constructor.large_bytes != 0)
              verdict.fail(fmt::format(
                  "{}: the constructor took {} bytes in heap blocks of {} bytes or more; expected "
                  "none (every buffer is a Tensor, charged to its category)",
                  label, constructor.large_bytes, grading::kLargeAllocationBytes));
            for (int step = 1; step <= 2; ++step) {
              const Batch batch = grading::on_check_device(
                  grading::local_batch(*training.data, options, step - 1, comm.rank(), world));
              std::array<std::size_t, kNumMemoryCategories> before{};
              for (std::size_t c = 0; c < kNumMemoryCategories; ++c)
                before[c] = tracker.allocations(static_cast<MemoryCategory>(c));
              const std::size_t twin_activations_before =
                  tracker.allocations(MemoryCategory::kActivations);
              const grading::HeapUse plain_before = grading::heap_use_of_this_thread();
              twin.zero_grad();
              twin.backward(grading::forward(twin, batch), batch.labels);
              const grading::HeapUse plain = grading::heap_use_of_this_thread().since(plain_before);
              const std::size_t activations_before =
                  tracker.allocations(MemoryCategory::kActivations);
              const std::size_t plain_activations = activations_before - twin_activations_before;
              const std::size_t twin_grads =
                  tracker.allocations(MemoryCategory::kGradients) -
                  before[static_cast<std::size_t>(MemoryCategory::kGradients)];
              const grading::HeapUse hooked_before = grading::heap_use_of_this_thread();
              model.backward(grading::forward(model, batch), batch.labels);
              const grading::HeapUse hooked =
                  grading::heap_use_of_this_thread().since(hooked_before);
              const std::size_t tensors = tracker.allocations_total();
              const grading::HeapUse heap = grading::heap_use_of_this_thread();
              (void)zero.step();
              const grading::HeapUse used = grading::heap_use_of_this_thread().since(heap);
              const std::size_t in_step = tracker.allocations_total() - tensors;
              const auto made = [&](MemoryCategory c) {
                return tracker.allocations(c) - before[static_cast<std::size_t>(c)];
              };
              if (!verdict.passed()) continue;
              const std::size_t count = model.parameters().size();
              const std::size_t grads = made(MemoryCategory::kGradients) - twin_grads;
              const std::size_t values = made(MemoryCategory::kParameters);
              const std::size_t others =
                  made(MemoryCategory::kCommunication) + made(MemoryCategory::kOptimizerState);
              const std::size_t hooked_activations =
                  tracker.allocations(MemoryCategory::kActivations) - activations_before;
              if (hooked_activations > plain_activations)
                verdict.fail(fmt::format(
                    "{}, step {}: forward, backward and step() allocated {} activation tensors, "
                    "the same forward and backward without ZeRO-3 {}; expected no more",
                    label, step, hooked_activations, plain_activations));
              else if (hooked.large_bytes > plain.large_bytes)
                verdict.fail(fmt::format(
                    "{}, step {}: forward and backward with your hooks took {} bytes in heap "
                    "blocks of {} bytes or more, the same without them {}; expected no more "
                    "(no staging copies in the hooks)",
                    label, step, hooked.large_bytes, grading::kLargeAllocationBytes,
                    plain.large_bytes));
              else if (in_step != 0 || used.large_bytes != 0)
                verdict.fail(fmt::format(
                    "{}, step {}: step() allocated {} tensor(s) and {} bytes in blocks of {} "
                    "bytes or more from the heap; expected none",
                    label, step, in_step, used.large_bytes, grading::kLargeAllocationBytes));
              else if (grads != count || values != 2 * count || others != 0)
                verdict.fail(fmt::format(
                    "{}, step {}: forward, backward and step() allocated {} gradient tensor(s), "
                    "{} parameter tensor(s) and {} communication or optimizer-state tensor(s); "
                    "expected the {} gradients backward makes, each value materialised twice "
                    "(forward and backward: {}), and nothing else",
                    label, step, grads, values, others, count, 2 * count));
            }
            const std::size_t current = tracker.current(MemoryCategory::kOptimizerState) - base;
            const std::size_t peak = tracker.peak(MemoryCategory::kOptimizerState) - base;
            if (!verdict.passed()) continue;
            if (current != expected || peak != expected)
              verdict.fail(fmt::format(
                  "{} on N = {} (S = {}): optimizer-state bytes {} after two steps, peak {}; "
                  "expected {} x 4 x S = {}{}",
                  label, world, shard, current, peak, floats, expected,
                  peak >= 4 * floats * model.num_parameters()
                      ? " (an optimizer over the whole model existed)"
                      : ""));
            else if (kind == "adamw")
              verdict.note(fmt::format(
                  "AdamW state 8 S = {} bytes per rank on N = {}, at its peak too; steps allocate "
                  "only the values materialised and the gradients backward makes{}",
                  expected, world, max_norm > 0 ? " (with clipping)" : ""));
          }
        },
        draws);
  }
}

/// Sets this rank's memory budget to `bytes` more than it holds now, and lifts it again.
class ScopedBudget {
 public:
  explicit ScopedBudget(std::size_t bytes) : tracker_(this_rank_memory().tracker()) {
    tracker_.set_budget(tracker_.current_total() + bytes);
  }
  ~ScopedBudget() { tracker_.set_budget(std::nullopt); }
  ScopedBudget(const ScopedBudget&) = delete;
  ScopedBudget& operator=(const ScopedBudget&) = delete;

 private:
  MemoryTracker& tracker_;
};

TEST(Lab7Memory, TrainsAModelDdpCannotFit) {
  Draws draws("Lab7Memory.TrainsAModelDdpCannotFit");
  // An MLP of eight equal hidden layers, AdamW, a budget of 19 Psi bytes per rank on top of
  // what the rank holds: replicated training needs 16 Psi (parameters, gradients, AdamW
  // state) plus lab 2's flat buffer of 4 Psi, and fails; ZeRO-3 needs the model as built
  // (8 Psi: values and zero gradients, before the constructor releases them) plus, if the
  // constructor allocates everything before it releases them, 16 Psi / N of shards and three
  // buffers of one unit (about 1.7 Psi): under 18 Psi on 2 ranks, 12 Psi on 8.
  TrainOptions options;
  const std::int64_t hidden = draws.integer("hidden", 256, 384);
  options.model = fmt::format("64-{0}-{0}-{0}-{0}-{0}-{0}-{0}-{0}-10", hidden);
  options.activation = "relu";
  options.optimizer = "adamw";
  options.lr = draws.uniform("lr", 5e-4f, 3e-3f);
  options.weight_decay = 0.01f;
  options.steps = 2;
  options.seed = draws.seed("seed");
  // Eight ranks locally; under mpi, every process. A one-process mpi job runs the eight
  // ranks as local threads: on one rank ZeRO-3 shards nothing, and the lesson is lost.
  const bool local = grading::check_backend() == Backend::kLocal || mpi_world_size() < 2;
  const int world = local ? 8 : mpi_world_size();
  const std::int64_t rows = draws.integer("rows per rank", 2, 4);
  options.global_batch = rows * world;
  options.dataset = fmt::format("synthetic:{}", 4 * options.global_batch);
  const auto data = std::make_shared<const Dataset>(load_dataset(options.dataset, 1));
  const std::size_t psi = make_model(options).num_parameters();
  const std::size_t budget = 19 * psi;
  const Trajectory exact = grading::emulate_data_parallel(options, *data, world);
  run_on_ranks(
      world,
      [&](Communicator& comm, Verdict& verdict) {
        // The grader's replicated training (lab 2's flat averaging) under the budget.
        std::string ddp_error;
        try {
          const ScopedBudget scoped(budget);
          Model model = grading::make_check_model(options);
          const auto optimizer = grading::optimizer_for(options, model.num_parameters());
          Tensor flat({static_cast<std::int64_t>(psi)}, MemoryCategory::kCommunication,
                      grading::check_device());
          const Batch batch =
              grading::on_check_device(grading::local_batch(*data, options, 0, comm.rank(), world));
          model.backward(grading::forward(model, batch), batch.labels);
          grading::average_gradients_flat(model, comm, flat);
          optimizer->step(model);
        } catch (const OutOfMemory& error) {
          ddp_error = error.what();
        }
        if (ddp_error.empty()) {
          verdict.fail(
              fmt::format("the grader's replicated training fit in {} bytes (Psi = {}); "
                          "the check's budget is wrong",
                          budget, psi));
          return;
        }
        // The student's ZeRO-3 under the same budget.
        const std::vector<std::size_t> indices = [&] {
          Model layout = make_model(options);
          return shard_indices(layout, contract_units(layout, world), comm.rank());
        }();
        const Model layout = make_model(options);
        std::size_t peak = 0;
        std::size_t training_peak = 0;
        try {
          const ScopedBudget scoped(budget);
          MemoryTracker& tracker = this_rank_memory().tracker();
          const std::size_t base = tracker.current_total();
          tracker.reset_peaks();
          Model model = grading::make_check_model(options);
          std::vector<float> before = model.flat_parameters();
          ZeroThreeOptimizer zero(model, comm, factory_for(options));
          peak = tracker.peak_total() - base;
          tracker.reset_peaks();
          for (int step = 1; step <= options.steps; ++step) {
            const Batch batch = grading::on_check_device(
                grading::local_batch(*data, options, step - 1, comm.rank(), world));
            model.backward(grading::forward(model, batch), batch.labels);
            (void)zero.step();
            const std::vector<float>& flat =
                exact.parameters_after_step[static_cast<std::size_t>(step - 1)];
            if (verdict.passed())
              verdict.expect_empty(
                  check_shard(layout, indices, zero.shard_parameters(), flat, before, world),
                  fmt::format("under a budget of {} bytes, after step {}", budget, step));
            before = flat;
          }
          training_peak = tracker.peak_total() - base;
        } catch (const OutOfMemory& error) {
          verdict.fail(fmt::format(
              "ZeroThreeOptimizer on N = {} ran out of a budget of 19 Psi = {} bytes per rank "
              "(Psi = {}): {}; expected it to fit (16 Psi / N of shards, one unit's values and "
              "gradients, three buffers of one unit)",
              world, budget, psi, error.what()));
          return;
        }
        if (verdict.passed())
          verdict.note(fmt::format(
              "Psi = {}, budget 19 Psi = {} bytes per rank: replicated training ran out ({}); "
              "ZeRO-3 on N = {} trained bitwise lab 2's: peak {} bytes ({:.1f} Psi) while the "
              "whole model still existed in the constructor, {} bytes ({:.1f} Psi) while training",
              psi, budget, ddp_error.substr(0, ddp_error.find('\n')), world, peak,
              static_cast<double>(peak) / static_cast<double>(psi), training_peak,
              static_cast<double>(training_peak) / static_cast<double>(psi)));
      },
      draws, std::chrono::seconds(30), local ? Backend::kLocal : grading::check_backend());
}

// --- Lab7Communication ---------------------------------------------------------------------

/// What the grader sees through a recording communicator and its own layer hooks
/// (registered before the student's): each call with its phase, the unit whose hooks were
/// running when it was issued, its buffers, whether the gather before it had been waited
/// on, whether the window unit's values had been copied out of the gather buffer, how many
/// gathered units were alive, and the waits of reduce-scatters during backward.
struct CallLog {
  enum Phase { kForward, kBackward, kStep };
  struct Call {
    RecordedCall call;
    Phase phase = kStep;
    std::size_t window = kNone;  ///< the unit whose pre-hook fired last in this phase
    bool after_compute = false;  ///< issued after the window unit's layer ran
    const void* in = nullptr;
    const void* out = nullptr;
    std::size_t alive = 0;               ///< gathers alive at issue, this one included
    bool previous_gather_waited = true;  ///< the phase's gather before it was waited
    /// All-gathers: "" when every parameter of the window unit held a value, bitwise the
    /// output buffer's elements at its place in the unit, when the call was issued (the unit
    /// was materialised from the buffer before this gather could overwrite it); else what
    /// was missing.
    std::string window_not_materialised;
    std::optional<std::size_t> nonzero_padding;  ///< reduce-scatters: at issue
  };
  Phase phase = kStep;
  std::size_t window = kNone;
  bool window_computed = false;  ///< the grader's post-hook of the window unit has fired
  /// The window unit's layer has made a gradient in this backward (the grader's
  /// gradient-ready hook, which fires before the student's, has seen one).
  bool window_gradients_made = false;
  std::size_t gathers_issued = 0;  ///< in this phase
  std::size_t units_done = 0;      ///< unit post-hooks seen in this phase
  std::vector<Call> calls;
  std::vector<bool> waited;              ///< per call index
  std::vector<std::string> early_waits;  ///< descriptions of reduce-scatter waits too early
  std::vector<std::size_t> unit_of_layer;
  std::vector<std::size_t> rs_unit_of_call;  ///< per call index: its unit (reduce-scatters)
  const std::vector<Unit>* units = nullptr;
  std::size_t last_gather = kNone;  ///< call index of the phase's last gather

  void begin(Phase p) {
    phase = p;
    window = kNone;
    window_computed = false;
    gathers_issued = 0;
    units_done = 0;
    last_gather = kNone;
  }

  void attach(grading::RecordingCommunicator& recorder, Model& model,
              const std::vector<Unit>& all_units) {
    units = &all_units;
    unit_of_layer.assign(model.layers().size(), kNone);
    for (std::size_t u = 0; u < all_units.size(); ++u) unit_of_layer[all_units[u].layer] = u;
    const auto unit_of = [this, &model](const Layer& layer) {
      const std::span<Layer* const> layers = model.layers();
      for (std::size_t l = 0; l < layers.size(); ++l)
        if (layers[l] == &layer) return unit_of_layer[l];
      return kNone;
    };
    const auto pre = [this, unit_of](Layer& layer) {
      if (const std::size_t u = unit_of(layer); u != kNone) {
        window = u;
        window_computed = false;
        window_gradients_made = false;
      }
    };
    model.on_pre_forward(pre);
    model.on_pre_backward(pre);
    // A gradient is ready only once its layer's backward has run: from then on the window
    // unit's gradients may go into their buffer (and the wait for it may come).
    model.on_gradient_ready([this](Parameter&) { window_gradients_made = true; });
    // The grader's post-hook runs before the student's: a call issued after it was issued
    // after the layer ran.
    const auto post = [this, unit_of](Layer& layer) {
      if (unit_of(layer) == kNone) return;
      ++units_done;
      window_computed = true;
    };
    model.on_post_forward(post);
    model.on_post_backward(post);
    recorder.set_issue_callback([this, &model](std::size_t index, const RecordedCall& call,
                                               ConstBuffer in, MutableBuffer out) {
      Call c;
      c.call = call;
      c.phase = phase;
      c.window = window;
      c.after_compute = window_computed;
      c.in = in.data;
      c.out = out.data;
      waited.resize(index + 1, false);
      rs_unit_of_call.resize(index + 1, kNone);
      if (call.op == CommOp::kAllGather) {
        ++gathers_issued;
        c.alive = gathers_issued - std::min(gathers_issued, units_done);
        c.previous_gather_waited = last_gather == kNone || waited[last_gather];
        last_gather = index;
        // Seen before the call is passed on: the output still holds what was gathered last.
        if (window != kNone) c.window_not_materialised = check_materialised(model, window, out);
      }
      if (call.op == CommOp::kReduceScatter && phase == kBackward && window != kNone) {
        const Unit& unit = (*units)[window];
        c.nonzero_padding = grading::first_nonzero(in, unit.elements);
        rs_unit_of_call[index] = window;
      }
      calls.push_back(c);
    });
    recorder.set_wait_callback([this](std::size_t index) {
      if (index >= waited.size()) return;
      if (phase == kBackward && rs_unit_of_call[index] != kNone && !waited[index]) {
        const std::size_t u = rs_unit_of_call[index];
        // Unit u's gradient buffer is needed again by unit u - 2, once that unit's layer has
        // made its gradients: a wait before (in its pre-backward, say) would stop the
        // reduce-scatter from travelling while the layer computes.
        if (window == kNone || u < 2 || window > u - 2)
          early_waits.push_back(fmt::format(
              "unit {}'s reduce-scatter was waited on (or tested) during backward in unit {}'s "
              "hooks; expected no wait before unit {} needs its buffer{}",
              u, window == kNone ? std::string("no") : fmt::format("{}", window),
              u >= 2 ? fmt::format("{}", u - 2) : std::string("-"),
              u < 2 ? " (no later unit needs it: wait in step())" : ""));
        else if (window == u - 2 && !window_gradients_made)
          early_waits.push_back(fmt::format(
              "unit {}'s reduce-scatter was waited on (or tested) in unit {}'s hooks before its "
              "layer's backward ran; expected the wait once unit {}'s gradients are made, just "
              "before they go into the buffer, so that the reduce-scatter travels while the "
              "layer computes",
              u, window, window));
      }
      waited[index] = true;
    });
  }

  /// "" when every parameter of unit `u` holds a value equal, bitwise, to `buffer`'s
  /// elements at its place in the unit (over the part of the unit `buffer` covers).
  std::string check_materialised(const Model& model, std::size_t u, MutableBuffer buffer) const {
    // Host copies: the buffer and the values live on the check device.
    const std::vector<float> gathered = grading::host_values(
        ConstTensorView(static_cast<const float*>(buffer.data), buffer.count, buffer.device));
    std::size_t offset = 0;
    for (const std::size_t p : (*units)[u].parameters) {
      const Parameter& parameter = *model.parameters()[p];
      if (parameter.value.empty()) return fmt::format("{} had no value", parameter.name);
      const std::vector<float> value = grading::host_values(parameter.value);
      const std::size_t covered =
          offset >= buffer.count ? 0 : std::min(value.size(), buffer.count - offset);
      if (covered > 0 &&
          std::memcmp(value.data(), gathered.data() + offset, covered * sizeof(float)) != 0)
        return fmt::format("{}'s value did not hold the gathered elements", parameter.name);
      offset += value.size();
    }
    return "";
  }

  void reset(grading::RecordingCommunicator& recorder) {
    recorder.forget_calls();
    calls.clear();
    waited.clear();
    rs_unit_of_call.clear();
    early_waits.clear();
  }
};

/// The bytes this rank sends for the contract's calls of one step on `comm` (two
/// all-gathers and one reduce-scatter per unit), measured on scratch buffers.
std::uint64_t contract_bytes_sent(Communicator& comm, const std::vector<Unit>& units) {
  const CommCounters before = comm.counters();
  const auto n = static_cast<std::size_t>(comm.size());
  for (const Unit& u : units) {
    Tensor full({static_cast<std::int64_t>(n * u.chunk_elements)}, MemoryCategory::kOther,
                grading::check_device());
    Tensor chunk({static_cast<std::int64_t>(u.chunk_elements)}, MemoryCategory::kOther,
                 grading::check_device());
    comm.allgather(std::as_const(chunk).view(), full.view())->wait();
    comm.allgather(std::as_const(chunk).view(), full.view())->wait();
    comm.reduce_scatter(std::as_const(full).view(), chunk.view(), ReduceOp::kSum)->wait();
  }
  const CommCounters used = comm.counters().since(before);
  return used.of(CommOp::kReduceScatter).bytes_sent + used.of(CommOp::kAllGather).bytes_sent;
}

/// "" when the calls of one step follow the contract, else the first rule broken.
std::string judge_step(const CallLog& log, const std::vector<Unit>& units, int world,
                       const float* shard_grad, bool clipping) {
  const std::size_t count = units.size();
  const auto n = static_cast<std::size_t>(world);
  std::vector<const CallLog::Call*> forward_gathers, backward_gathers, scatters, in_step, others;
  for (const CallLog::Call& c : log.calls) {
    if (c.phase == CallLog::kStep) {
      in_step.push_back(&c);
    } else if (c.call.op == CommOp::kAllGather) {
      (c.phase == CallLog::kForward ? forward_gathers : backward_gathers).push_back(&c);
    } else if (c.call.op == CommOp::kReduceScatter && c.phase == CallLog::kBackward) {
      scatters.push_back(&c);
    } else {
      others.push_back(&c);
    }
  }
  if (!others.empty())
    return fmt::format(
        "{} called {}; expected only all-gathers in forward, and all-gathers and "
        "reduce-scatters in backward{}",
        others.front()->phase == CallLog::kForward ? "forward" : "backward",
        grading::describe(others.front()->call),
        others.front()->call.op == CommOp::kAllReduce && others.front()->call.in > 1
            ? " (an all-reduce of a unit's gradients makes every rank do the whole "
              "sum: reduce-scatter it into the shard)"
            : "");
  const auto gather_of = [&](std::size_t u) {
    return RecordedCall{CommOp::kAllGather, units[u].chunk_elements, n * units[u].chunk_elements,
                        ReduceOp::kSum};
  };
  // Forward: U gathers, unit order, each prefetched in its predecessor's pre-forward.
  if (forward_gathers.size() != count)
    return fmt::format("forward issued {} all-gathers; expected one per unit, {}{}",
                       forward_gathers.size(), count,
                       forward_gathers.size() > count ? "" : " (a unit's values kept instead?)");
  for (std::size_t u = 0; u < count; ++u) {
    const CallLog::Call& c = *forward_gathers[u];
    if (c.call != gather_of(u))
      return fmt::format("forward's all-gather {} is {}; expected unit {}'s {} (unit order)", u,
                         grading::describe(c.call), u, grading::describe(gather_of(u)));
    const std::size_t want = u == 0 ? 0 : u - 1;
    if (c.window != want)
      return u == 0 ? "unit 0's all-gather was issued before its pre-forward; expected in it"
                    : fmt::format(
                          "unit {}'s all-gather was issued {}; expected in unit {}'s pre-forward, "
                          "after its wait and before its layer runs (the prefetch that overlaps "
                          "unit {}'s compute){}",
                          u,
                          c.window == u       ? "in its own pre-forward"
                          : c.window == kNone ? "before the first unit's pre-forward"
                                              : fmt::format("in unit {}'s pre-forward", c.window),
                          u - 1, u - 1,
                          c.window == u ? " (no prefetch: every gather is exposed)" : "");
    if (u >= 1 && c.after_compute)
      return fmt::format(
          "unit {}'s all-gather was issued after unit {}'s forward ran (in its post-forward); "
          "expected in its pre-forward, so that the gather travels while unit {} computes",
          u, u - 1, u - 1);
    if (!c.previous_gather_waited)
      return fmt::format(
          "unit {}'s all-gather was issued before unit {}'s was waited on; expected the prefetch "
          "after the wait (at most two gathered units at once)",
          u, u - 1);
    if (c.alive > kMaxGatheredUnits)
      return fmt::format(
          "when unit {}'s all-gather was issued in forward, {} gathered units were "
          "alive; expected at most {} (FSDP's limit_all_gathers)",
          u, c.alive, kMaxGatheredUnits);
    if (u >= 1 && c.out != forward_gathers[0]->out)
      return fmt::format(
          "units 0 and {} are gathered into different buffers; expected every unit in the one "
          "gather buffer (copy a unit out before the next one's gather: one buffer is enough)",
          u);
    if (u >= 1 && !c.window_not_materialised.empty())
      return fmt::format(
          "unit {}'s all-gather was issued into the gather buffer before unit {}'s values were "
          "materialised from it ({}); expected wait, copy out, then prefetch (the buffer is "
          "free only once the unit before is copied out)",
          u, u - 1, c.window_not_materialised);
  }
  // Backward: U gathers in reverse unit order, each but U-1's prefetched; U reduce-scatters.
  if (backward_gathers.size() != count)
    return fmt::format(
        "backward issued {} all-gathers; expected one per unit, {} (gather each unit again "
        "before its backward, free it after){}",
        backward_gathers.size(), count,
        backward_gathers.empty() ? ": the forward's values were kept?" : "");
  for (std::size_t k = 0; k < count; ++k) {
    const std::size_t u = count - 1 - k;
    const CallLog::Call& c = *backward_gathers[k];
    if (c.call != gather_of(u))
      return fmt::format(
          "backward's all-gather {} is {}; expected unit {}'s {} (reverse unit "
          "order)",
          k, grading::describe(c.call), u, grading::describe(gather_of(u)));
    const std::size_t want = u == count - 1 ? u : u + 1;
    if (c.window != want)
      return fmt::format(
          "in backward, unit {}'s all-gather was issued {}; expected in unit {}'s "
          "pre-backward{}",
          u,
          c.window == kNone ? "before the first unit's pre-backward"
                            : fmt::format("in unit {}'s hooks", c.window),
          want, u == count - 1 ? "" : ", after its wait (backward prefetch)");
    if (u + 1 < count && c.after_compute)
      return fmt::format(
          "in backward, unit {}'s all-gather was issued after unit {}'s backward ran; expected "
          "in its pre-backward, so that the gather travels while unit {} computes",
          u, u + 1, u + 1);
    if (!c.previous_gather_waited)
      return fmt::format(
          "in backward, unit {}'s all-gather was issued before unit {}'s was "
          "waited on; expected the prefetch after the wait",
          u, u + 1);
    if (c.alive > kMaxGatheredUnits)
      return fmt::format(
          "when unit {}'s all-gather was issued in backward, {} gathered units "
          "were alive; expected at most {}",
          u, c.alive, kMaxGatheredUnits);
    if (c.out != forward_gathers[0]->out)
      return fmt::format(
          "in backward, unit {} is gathered into another buffer than in forward; "
          "expected the one gather buffer both times",
          u);
    if (u + 1 < count && !c.window_not_materialised.empty())
      return fmt::format(
          "in backward, unit {}'s all-gather was issued into the gather buffer before unit {}'s "
          "values were materialised from it ({}); expected wait, copy out, then prefetch",
          u, u + 1, c.window_not_materialised);
  }
  if (scatters.size() != count)
    return fmt::format("backward launched {} reduce-scatters; expected one per unit, {}{}",
                       scatters.size(), count,
                       scatters.empty() ? " (an all-reduce of gradients keeps the whole gradient: "
                                          "reduce-scatter each unit into the shard)"
                                        : "");
  for (std::size_t k = 0; k < count; ++k) {
    const std::size_t u = count - 1 - k;
    const CallLog::Call& c = *scatters[k];
    const RecordedCall want{CommOp::kReduceScatter, n * units[u].chunk_elements,
                            units[u].chunk_elements, ReduceOp::kSum};
    if (c.window != u)
      return fmt::format(
          "backward's reduce-scatter {} is {} launched in unit {}'s hooks; "
          "expected unit {}'s {} launched in its own backward",
          k, grading::describe(c.call),
          c.window == kNone ? std::string("no") : fmt::format("{}", c.window), u,
          grading::describe(want));
    if (c.call != want)
      return fmt::format("unit {}'s reduce-scatter is {}; expected {}{}", u,
                         grading::describe(c.call), grading::describe(want),
                         c.call.reduce != want.reduce
                             ? " (the contract's sum, then one division by N in step())"
                             : "");
    if (c.out != shard_grad + units[u].shard_offset)
      return fmt::format(
          "unit {}'s reduce-scatter writes elsewhere than shard_gradients() at its "
          "shard offset {}",
          u, units[u].shard_offset);
    for (const CallLog::Call* g : forward_gathers)
      if (g->out == c.in)
        return fmt::format(
            "unit {}'s reduce-scatter reads a gather buffer; expected its own "
            "gradient buffer (a gather in flight writes into that one)",
            u);
    if (k >= 2 && c.in != scatters[k - 2]->in)
      return fmt::format(
          "unit {}'s reduce-scatter reads another buffer than unit {}'s; expected "
          "gradient buffer u mod 2 (two buffers in turn)",
          u, u + 2);
    if (k >= 1 && c.in == scatters[k - 1]->in)
      return fmt::format(
          "units {} and {} reduce-scatter from the same buffer; expected gradient "
          "buffer u mod 2",
          u + 1, u);
    if (c.nonzero_padding)
      return fmt::format(
          "unit {}'s reduce-scatter input has a non-zero padding element at issue "
          "(index {}, E = {}); expected the padding zero",
          u, *c.nonzero_padding, units[u].elements);
  }
  if (!log.early_waits.empty()) return log.early_waits.front();
  const std::size_t expected_in_step = clipping ? 1 : 0;
  if (in_step.size() != expected_in_step ||
      (clipping &&
       in_step.front()->call != RecordedCall{CommOp::kAllReduce, 1, 1, ReduceOp::kSum})) {
    std::vector<std::string> seen;
    for (const CallLog::Call* c : in_step) seen.push_back(grading::describe(c->call));
    return fmt::format(
        "step() called [{}]; expected {} (the parameters stay sharded: no "
        "all-gather in step())",
        fmt::join(seen, ", "), clipping ? "only allreduce(1, sum) for the norm" : "nothing");
  }
  return "";
}

TEST(Lab7Communication, PrefetchAndReduceScatterPerUnit) {
  Draws draws("Lab7Communication.PrefetchAndReduceScatterPerUnit");
  const std::vector<int> worlds = draws.world_sizes(6);
  const Training training =
      grading::draw_sharded_training(draws, draws.coin("adamw") ? "adamw" : "sgd");
  for (int world : worlds) {
    run_on_ranks(
        world,
        [&](Communicator& comm, Verdict& verdict) {
          const TrainOptions options = training.for_world(world);
          Model layout = training.model();
          const std::vector<Unit> units = contract_units(layout, world);
          const std::uint64_t expected_bytes = contract_bytes_sent(comm, units);
          const std::uint64_t ddp_bytes = grading::allreduce_bytes_sent(
              comm, std::vector<std::size_t>{layout.num_parameters()});
          const std::uint64_t scalar_bytes =
              grading::allreduce_bytes_sent(comm, std::vector<std::size_t>{1});
          double ratio = 0;
          for (const float max_norm : {0.0f, 1.0f}) {
            Model model = training.model();
            grading::RecordingCommunicator recorder(comm);
            CallLog log;
            log.attach(recorder, model, units);  // the grader's hooks first
            ZeroThreeOptimizer zero(model, recorder, factory_for(options), max_norm);
            const std::string label = max_norm > 0 ? "with clipping, " : "";
            for (int step = 1; step <= 2; ++step) {
              const Batch batch = grading::on_check_device(
                  grading::local_batch(*training.data, options, step - 1, comm.rank(), world));
              log.reset(recorder);
              const CommCounters before = comm.counters();
              log.begin(CallLog::kForward);
              Tensor logits = grading::forward(model, batch);
              log.begin(CallLog::kBackward);
              recorder.set_in_backward(true);
              model.backward(logits, batch.labels);
              recorder.set_in_backward(false);
              log.begin(CallLog::kStep);
              (void)zero.step();
              const CommCounters used = comm.counters().since(before);
              if (!verdict.passed()) continue;
              const std::string finding =
                  judge_step(log, units, world, zero.shard_gradients().view().data(), max_norm > 0);
              if (!finding.empty()) {
                verdict.fail(fmt::format("{}step {}: {}", label, step, finding));
                continue;
              }
              const std::uint64_t bytes = used.of(CommOp::kReduceScatter).bytes_sent +
                                          used.of(CommOp::kAllGather).bytes_sent;
              if (bytes != expected_bytes ||
                  used.of(CommOp::kAllReduce).bytes_sent != (max_norm > 0 ? scalar_bytes : 0))
                verdict.fail(fmt::format(
                    "{}step {}: the backend counted {} bytes sent by reduce-scatters and "
                    "all-gathers and {} by all-reduce; expected {} for the units' calls{}",
                    label, step, bytes, used.of(CommOp::kAllReduce).bytes_sent, expected_bytes,
                    max_norm > 0 ? fmt::format(" and {} for the norm's one float", scalar_bytes)
                                 : " and none by all-reduce"));
              if (ddp_bytes > 0)
                ratio = static_cast<double>(bytes) / static_cast<double>(ddp_bytes);
            }
          }
          if (verdict.passed())
            verdict.note(fmt::format(
                "{} units: each all-gather prefetched in the unit before's hooks, into the one "
                "gather buffer once that unit was materialised, at most two alive, two gradient "
                "buffers in turn, {} reduce-scatters during backward, nothing but the norm in "
                "step(); {}",
                units.size(), units.size(),
                world > 1 ? fmt::format("on N = {} a step sent {:.4f}x DDP's all-reduce bytes "
                                        "(1.5x plus the padding)",
                                        world, ratio)
                          : std::string("on N = 1 nothing crosses a link")));
        },
        draws);
  }
}

// --- Lab7Speed -----------------------------------------------------------------------------

/// A communicator that passes every call on and measures, on the rank's clock, how long
/// the waits on all-gathers blocked: the gather time the prefetch did not hide.
class GatherWaitTimer final : public Communicator {
 public:
  explicit GatherWaitTimer(Communicator& inner) : inner_(inner) {}
  double exposed = 0;       ///< seconds spent in waits and tests of all-gathers
  std::size_t gathers = 0;  ///< all-gathers issued

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string_view backend() const override { return inner_.backend(); }
  std::unique_ptr<Work> isend(ConstBuffer d, int p, int t) override {
    return inner_.isend(d, p, t);
  }
  std::unique_ptr<Work> irecv(MutableBuffer d, int p, int t) override {
    return inner_.irecv(d, p, t);
  }
  std::unique_ptr<Work> allreduce(MutableBuffer d, ReduceOp op) override {
    return inner_.allreduce(d, op);
  }
  std::unique_ptr<Work> reduce_scatter(ConstBuffer in, MutableBuffer out, ReduceOp op) override {
    return inner_.reduce_scatter(in, out, op);
  }
  std::unique_ptr<Work> allgather(ConstBuffer in, MutableBuffer out) override {
    ++gathers;
    return std::make_unique<Timed>(inner_.allgather(in, out), *this);
  }
  std::unique_ptr<Work> broadcast(MutableBuffer d, int root) override {
    return inner_.broadcast(d, root);
  }
  void barrier() override { inner_.barrier(); }
  CommCounters counters() const override { return inner_.counters(); }
  Clock& clock() override { return inner_.clock(); }

 private:
  class Timed final : public Work {
   public:
    Timed(std::unique_ptr<Work> inner, GatherWaitTimer& timer)
        : inner_(std::move(inner)), timer_(timer) {}
    void wait() override {
      const double start = timer_.clock().now();
      inner_->wait();
      timer_.exposed += timer_.clock().now() - start;
    }
    bool test() override {
      const double start = timer_.clock().now();
      const bool done = inner_->test();
      timer_.exposed += timer_.clock().now() - start;
      return done;
    }

   private:
    std::unique_ptr<Work> inner_;
    GatherWaitTimer& timer_;
  };

  Communicator& inner_;
};

/// Seconds of the all-gathers' time on the link (rank `trace`'s) that overlap the model's own
/// compute: the forward and backward of its layers and of the loss, each counted once (the
/// first event of its name). Compute the lab adds (copies, reductions, anything it runs to
/// pass the time) hides nothing: a prefetch hides a gather behind the layers that need the
/// unit before it.
double gathers_behind_model_compute(const RankTrace& trace) {
  std::vector<std::pair<double, double>> model;  // (start, end) of the model's own ops
  std::vector<std::string> seen;
  for (const TraceEvent& event : trace.events) {
    if (event.lane != TraceLane::kCompute) continue;
    const bool layer_op = event.name.ends_with(" forward") || event.name.ends_with(" backward");
    if (!layer_op || std::find(seen.begin(), seen.end(), event.name) != seen.end()) continue;
    seen.push_back(event.name);
    model.emplace_back(event.start, event.start + event.duration);
  }
  double overlap = 0;
  for (const TraceEvent& event : trace.events) {
    if (event.name != "allgather" || event.lane == TraceLane::kCompute) continue;
    for (const auto& [start, end] : model)  // compute ops of one rank never overlap each other
      overlap +=
          std::max(0.0, std::min(end, event.start + event.duration) - std::max(start, event.start));
  }
  return overlap;
}

TEST(Lab7Speed, PrefetchHidesHalfTheGathers) {
  Draws draws("Lab7Speed.PrefetchHidesHalfTheGathers");
  // 8 ranks on InfiniBand NDR, a CPU-class device, an MLP of 8 hidden layers 64-h-...-h-10
  // (h in [512, 768]) and 2 to 4 rows per rank: a hidden layer's forward (its weight read
  // once, 4 h^2 bytes at 20 GB/s) takes about as long as its ring all-gather on 8 ranks
  // (7 (alpha + h^2 / 2 bytes at 50 GB/s)), so only a prefetch hides the gathers.
  const int world = 8;
  std::string spec = "64";
  const std::int64_t hidden = draws.integer("hidden", 512, 768);
  for (int layer = 0; layer < 8; ++layer) spec += fmt::format("-{}", hidden);
  TrainOptions options;
  options.model = spec + "-10";
  options.activation = "relu";
  const std::int64_t rows = draws.integer("rows per rank", 2, 4);
  options.global_batch = rows * world;
  options.dataset = fmt::format("synthetic:{}", options.global_batch);
  options.seed = draws.seed("seed");
  options.steps = 1;
  options.optimizer = "sgd";
  options.lr = 0.01f;
  const Dataset data = load_dataset(options.dataset, 1);
  LaunchOptions launch_options;
  launch_options.world_size = world;
  launch_options.backend = Backend::kLocal;
  launch_options.comm.completion = Completion::kAdversarial;
  launch_options.comm.completion_seed = draws.completion_seed();
  launch_options.simulation.enabled = true;
  launch_options.simulation.network = NetworkModel::preset("ib-ndr");
  launch_options.simulation.device = DeviceModel::preset("cpu");
  double exposed = 0;
  double total = 0;
  double behind_model = 0;
  double step_seconds = 0;
  std::size_t gathers = 0;
  try {
    launch(launch_options, [&](Communicator& comm) {
      Model model = grading::make_check_model(options);
      GatherWaitTimer timer(comm);
      ZeroThreeOptimizer zero(model, timer, factory_for(options));
      const Batch batch =
          grading::on_check_device(grading::local_batch(data, options, 0, comm.rank(), world));
      detail::charging_clock(comm).mark_step();
      model.backward(grading::forward(model, batch), batch.labels);
      (void)zero.step();
      detail::charging_clock(comm).mark_step();
      if (comm.rank() != 0) return;
      const RankTrace trace = comm.clock().trace();
      for (const TraceEvent& event : trace.events)
        if (event.name == "allgather" && event.lane != TraceLane::kCompute) total += event.duration;
      exposed = timer.exposed;
      behind_model = gathers_behind_model_compute(trace);
      gathers = timer.gathers;
      step_seconds = summarize_steps(trace).back().total;
    });
  } catch (const NotImplemented&) {
    throw;
  } catch (const std::exception& error) {
    FAIL() << fmt::format("on 8 simulated ranks a rank failed with {}: {}\n  drawn: {}",
                          grading::type_name(error), error.what(), draws.describe());
  }
  ASSERT_GT(total, 0.0) << "no all-gather reached the simulated clock";
  // A wait can block longer than its gather's time on the link: it also waits for the other
  // ranks to issue theirs. Then nothing was hidden.
  const double hidden_fraction = std::max(0.0, 1.0 - exposed / total);
  const double behind_model_fraction = behind_model / total;
  if (hidden_fraction < 0.5)
    ADD_FAILURE() << fmt::format(
        "on 8 ranks (ib-ndr, cpu), {}: {} all-gathers took {:.3f} ms on the link and the waits "
        "on them blocked {:.3f} ms: {:.0f}% hidden; expected at least 50% (prefetch unit u + 1 "
        "in unit u's pre-forward, u - 1 in u's pre-backward, so that it travels while u "
        "computes)\n  drawn: {}",
        options.model, gathers, total * 1e3, exposed * 1e3, 100 * hidden_fraction,
        draws.describe());
  else if (behind_model_fraction < 0.5)
    ADD_FAILURE() << fmt::format(
        "on 8 ranks (ib-ndr, cpu), {}: the waits on {} all-gathers blocked {:.3f} ms of their "
        "{:.3f} ms on the link, but only {:.3f} ms ({:.0f}%) of that time overlapped the "
        "model's own forward and backward; expected at least 50%. Compute your code adds "
        "(copies, reductions, work to pass the time) makes the step longer and hides "
        "nothing: prefetch so that a unit travels while the layers before it compute\n"
        "  drawn: {}",
        options.model, gathers, exposed * 1e3, total * 1e3, behind_model * 1e3,
        100 * behind_model_fraction, draws.describe());
  else
    grading::note_measured(fmt::format(
        "8 ranks on ib-ndr, {}: {} all-gathers, {:.3f} ms on the link, {:.3f} ms exposed: "
        "{:.0f}% hidden by the prefetch, {:.0f}% behind the model's own compute (step {:.3f} "
        "ms)",
        options.model, gathers, total * 1e3, exposed * 1e3, 100 * hidden_fraction,
        100 * behind_model_fraction, step_seconds * 1e3));
}

// --- Lab7Design ----------------------------------------------------------------------------

/// A plausible wrong answer to the design question, and what it predicts.
struct WrongFormula {
  std::string what;
  std::size_t bytes = 0;
};

/// The design question's answer by the contract's memory rule, 4 S + 4 max_u E_u +
/// (1 + min(2, U)) x 4 max_u(N C_u), and the plausible wrong formulas, for `model` on
/// `world` ranks.
std::pair<std::size_t, std::vector<WrongFormula>> design_formulas(Model& model, int world) {
  const std::vector<Unit> units = contract_units(model, world);
  const auto n = static_cast<std::size_t>(world);
  const std::size_t shard = 4 * contract_shard(units);
  const std::size_t values = 4 * largest_unit(units);
  const std::size_t buffers = contract_buffer_bytes(units, world);
  const std::size_t count = kGatherBuffers + std::min(kGradientBuffers, units.size());
  const std::size_t buffer = buffers / count;  // 4 max_u N C_u
  const std::size_t psi = model.num_parameters();
  return {
      shard + values + buffers,
      {
          {"two gradient buffers whatever the number of units (one unit needs one)",
           shard + values + (kGatherBuffers + kGradientBuffers) * buffer},
          {"no gradient buffers", shard + values + kGatherBuffers * buffer},
          {"two gather buffers", shard + values + (count + 1) * buffer},
          {"lab 5's shard, ceil(Psi / N), instead of the sum of the units' chunks",
           4 * ((psi + n - 1) / n) + values + buffers},
          {"buffers of max_u E_u elements, without the padding to N C_u",
           shard + values + count * values},
          {"two units' values at once (the prefetched unit's too)", shard + 2 * values + buffers},
          {"without the shard", values + buffers},
      }};
}

TEST(Lab7Design, PredictsParameterPeakBytes) {
  Draws draws("Lab7Design.PredictsParameterPeakBytes");
  const std::vector<int> worlds = draws.world_sizes(8);
  // Which wrong formulas some model below tells from the right one (the draws make sure
  // every one is, where more than one rank is drawn: a grader bug otherwise).
  Model smallest = Model::mlp("64-10", {});
  std::vector<bool> separated(design_formulas(smallest, 1).second.size(), false);
  const auto separates = [&](const std::string& spec, bool layer_norm, std::vector<bool>& seen) {
    Model model = Model::mlp(spec, {.activation = "relu", .layer_norm = layer_norm, .seed = 3});
    for (int world : worlds) {
      const auto [right, wrong] = design_formulas(model, world);
      for (std::size_t f = 0; f < wrong.size(); ++f)
        if (wrong[f].bytes != right) seen[f] = true;
    }
  };
  for (int m = 0; m < 3; ++m) {
    // Two drawn MLPs, then one Linear layer: a single unit, so min(2, U) = 1 gradient buffer.
    std::string spec = "64-10";
    bool layer_norm = false;
    if (m < 2) {
      std::int64_t h1 = draws.integer("h1", 8, 96);
      std::int64_t h2 = draws.integer("h2", 8, 64);
      layer_norm = draws.coin("layer norm");
      // The first MLP pads where lab 5's shard and the unpadded buffers part from the rule:
      // the next widths in order, h2 first, until some drawn N shows both.
      if (m == 0) {
        const std::int64_t drawn1 = h1;
        const std::int64_t drawn2 = h2;
        const auto shows_padding = [&] {
          std::vector<bool> seen(separated.size(), false);
          separates(fmt::format("64-{}-{}-10", h1, h2), layer_norm, seen);
          return seen[3] && seen[4];
        };
        for (int tries = 0; worlds.back() > 1 && !shows_padding() && tries < 89 * 57; ++tries) {
          h2 = h2 < 64 ? h2 + 1 : 8;
          if (h2 == drawn2) h1 = h1 < 96 ? h1 + 1 : 8;
        }
        if (h1 != drawn1)
          draws.overrule("h1", fmt::format("h1={} (drawn {}; set by the check)", h1, drawn1));
        if (h2 != drawn2)
          draws.overrule("h2", fmt::format("h2={} (drawn {}; set by the check)", h2, drawn2));
      }
      spec = fmt::format("64-{}-{}-10", h1, h2);
    }
    separates(spec, layer_norm, separated);
    for (int world : worlds) {
      run_on_ranks(
          world,
          [&](Communicator& comm, Verdict& verdict) {
            MemoryTracker& tracker = this_rank_memory().tracker();
            const std::size_t param_base = tracker.current(MemoryCategory::kParameters);
            const std::size_t comm_base = tracker.current(MemoryCategory::kCommunication);
            Model model = Model::mlp(spec, {.activation = "relu",
                                            .layer_norm = layer_norm,
                                            .seed = 3,
                                            .device = grading::check_device()});
            const std::size_t psi = model.num_parameters();
            const std::size_t units = contract_units(model, world).size();
            const std::vector<WrongFormula> wrong = design_formulas(model, world).second;
            const std::size_t predicted = predicted_parameter_peak_bytes(model, world);
            std::size_t bytes = 0;
            {
              const Dataset data = load_dataset("synthetic:64", 5);
              std::vector<std::size_t> rows(4);
              for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = i;
              const Batch batch = grading::on_check_device(gather_batch(data, rows));
              ZeroThreeOptimizer zero(model, comm, [](std::size_t s) {
                return make_optimizer("adamw", s, 0.01f, 0.0f, 0.0f, grading::check_device());
              });
              tracker.reset_peaks();
              model.backward(grading::forward(model, batch), batch.labels);
              (void)zero.step();
              bytes = (tracker.peak(MemoryCategory::kParameters) - param_base) +
                      (tracker.peak(MemoryCategory::kCommunication) - comm_base);
            }
            if (!verdict.passed()) return;
            std::string wrong_one;
            for (const WrongFormula& formula : wrong)
              if (wrong_one.empty() && predicted == formula.bytes && bytes != formula.bytes)
                wrong_one = fmt::format("; that is the prediction of {}", formula.what);
            if (predicted != bytes)
              verdict.fail(fmt::format(
                  "{}{} on N = {} ({} unit{}): predicted {} bytes; the MemoryTracker's peaks of "
                  "parameters and communication add to {} ({:+} bytes){}",
                  spec, layer_norm ? " with LayerNorm" : "", world, units, units == 1 ? "" : "s",
                  predicted, bytes,
                  static_cast<std::int64_t>(predicted) - static_cast<std::int64_t>(bytes),
                  wrong_one));
            else
              verdict.note(fmt::format(
                  "Psi = {} on N = {}, {} unit{}: parameter peak {} bytes per rank ({:.2f} bytes "
                  "per parameter, buffers included) against lab 6's 4 Psi = {}, predicted "
                  "exactly",
                  psi, world, units, units == 1 ? "" : "s", bytes,
                  static_cast<double>(bytes) / static_cast<double>(psi), 4 * psi));
          },
          draws);
    }
  }
  // With N = 1 and 2 only (mpi with 2 processes) an even largest unit never pads, whatever
  // the widths; the local backend always draws N of 3, 5 or 6, and there every formula must
  // be told apart.
  if (std::any_of(worlds.begin(), worlds.end(), [](int n) { return n >= 3; })) {
    const std::vector<WrongFormula> wrong = design_formulas(smallest, 1).second;
    for (std::size_t f = 0; f < wrong.size(); ++f)
      if (!separated[f])
        ADD_FAILURE() << fmt::format(
            "grader bug: no drawn model tells the memory rule from {}\n({})", wrong[f].what,
            draws.describe());
  }
  grading::note_measured(fmt::format(
      "the models (two MLPs, one unit) and world sizes tell the memory rule from {} plausible "
      "wrong formulas",
      separated.size()));
}

// --- Lab7Checkpoint ----------------------------------------------------------------------------

/// The student's ZeroThreeOptimizer as the checkpoint check drives it.
class ZeroThreeSubject final : public grading::CheckpointSubject {
 public:
  ZeroThreeSubject(Model& model, Communicator& comm, const TrainOptions& options)
      : model_(model), zero_(model, comm, factory_for(options)) {}
  void train_step(const Batch& batch) override {
    model_.backward(grading::forward(model_, batch), batch.labels);
    (void)zero_.step();
  }
  void save(const std::filesystem::path& directory) override { zero_.save_checkpoint(directory); }
  void load(const std::filesystem::path& directory) override { zero_.load_checkpoint(directory); }
  const Tensor& shard_parameters() override { return zero_.shard_parameters(); }
  Optimizer& inner() override { return zero_.inner(); }

 private:
  Model& model_;
  ZeroThreeOptimizer zero_;
};

TEST(Lab7Checkpoint, SavedAtFourLoadsAtTwoAndThree) {
  Draws draws("Lab7Checkpoint.SavedAtFourLoadsAtTwoAndThree");
  draws.section("AdamW:");
  const Training training = grading::draw_sharded_training(draws, "adamw");
  grading::CheckpointLab lab;
  // The units do not depend on the world size (only their chunks do).
  lab.segments = [&](const Model&) {
    Model model = training.model();
    std::vector<std::vector<std::size_t>> segments;
    for (const Unit& unit : contract_units(model, 1)) segments.push_back(unit.parameters);
    return segments;
  };
  lab.make = [](Model& model, Communicator& comm, const TrainOptions& options) {
    return std::make_unique<ZeroThreeSubject>(model, comm, options);
  };
  lab.values_replicated = false;  // the contract: values stay released, only the shard
  lab.segments_name = "the units, each its layer's parameters in definition order";
  grading::check_sharded_checkpoint(draws, training, lab);
  if (HasFailure()) return;
  // SGD's momentum buffer is state too, with another name; the same model (the same units).
  draws.section("then SGD with momentum 0.9 on the AdamW model:");
  const grading::ShardedTraining sgd =
      grading::sgd_with_momentum_on_the_same_model(draws, training);
  grading::check_sharded_checkpoint(draws, sgd, lab);
}

}  // namespace
}  // namespace dp::lab7
