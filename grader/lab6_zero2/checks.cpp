// Lab 6's graded checks. The bucket plan must follow lab6.h's rule; training through
// ZeroTwoOptimizer (SGD and AdamW, drawn models, caps and world sizes, buckets that pad)
// must be lab 2's flat arithmetic bitwise after every step on every rank; clipping must
// follow the contract's arithmetic bit for bit. The rest are budgets, which any design
// (how many buffers, how the buckets lie in them, where the waits go) meets or not: the
// MemoryTracker must show at most the shard of the gradient plus one layer's gradients,
// at most two buffers' worth of the largest padded bucket and an optimizer over the shard,
// and a step must allocate nothing but the gradients backward makes; the recording
// communicator, a gradient-ready hook of the grader's and the backend's counters must show
// each bucket reduce-scattered exactly once during backward and all-gathered exactly once
// in step(), DDP's volume plus the padding; on the simulated clock the waits on the
// reduce-scatters must hide at least half of their time behind the model's own backward;
// the design question's prediction must equal the tracker's peak of the student's own
// design. Every check draws its configuration from the grading seed and runs in the
// adversarial completion mode. rubric.json gives the points, the ranges drawn and why the
// comparisons are bitwise.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <stdlib.h>  // mkdtemp

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "checkpoint_check.h"
#include "compare.h"
#include "dp/clock.h"
#include "dp/data.h"
#include "dp/error.h"
#include "dp/host_collectives.h"
#include "dp/launch.h"
#include "dp/memory.h"
#include "dp/model.h"
#include "dp/ops.h"
#include "dp/optimizer.h"
#include "dp/sharded_checkpoint.h"
#include "dp/tensor_ops.h"
#include "dp/trace.h"
#include "dp/trainer.h"
#include "grading.h"
#include "ground_truth.h"
#include "heap_use.h"
#include "lab6.h"
#include "memory_check.h"
#include "misuse_check.h"
#include "recording.h"
#include "sharded.h"
#include "speed_workload.h"
#include "step_allocations.h"
#include "wait_timer.h"

namespace dp::lab6 {
namespace {

using grading::Draws;
using grading::run_on_ranks;
using grading::Trajectory;
using grading::Verdict;

// --- the contract's rules, as the grader computes them ------------------------------------

/// lab6.h's bucket rule: the grader's own copy.
std::vector<Bucket> contract_buckets(const Model& model, int world, std::size_t cap_bytes) {
  std::vector<Bucket> buckets;
  Bucket open;
  const auto parameters = model.parameters();
  for (std::size_t i = parameters.size(); i-- > 0;) {
    const std::size_t size = parameters[i]->value.size();
    if (!open.parameters.empty() && (open.elements + size) * 4 > cap_bytes) {
      buckets.push_back(std::move(open));
      open = Bucket{};
    }
    open.parameters.push_back(i);
    open.elements += size;
  }
  if (!open.parameters.empty()) buckets.push_back(std::move(open));
  std::size_t offset = 0;
  const auto n = static_cast<std::size_t>(world);
  for (Bucket& bucket : buckets) {
    bucket.chunk_elements = (bucket.elements + n - 1) / n;
    bucket.shard_offset = offset;
    offset += bucket.chunk_elements;
  }
  return buckets;
}

std::size_t contract_shard(const std::vector<Bucket>& buckets) {
  std::size_t total = 0;
  for (const Bucket& bucket : buckets) total += bucket.chunk_elements;
  return total;
}

std::string describe(const Bucket& b) {
  return fmt::format("{{parameters [{}], E {}, C {}, shard offset {}}}",
                     fmt::join(b.parameters, ", "), b.elements, b.chunk_elements, b.shard_offset);
}

std::string describe(const std::vector<Bucket>& buckets) {
  std::vector<std::string> parts;
  for (const Bucket& b : buckets) parts.push_back(describe(b));
  return fmt::format("[{}]", fmt::join(parts, ", "));
}

/// A cap that falls exactly on a bucket boundary: the bytes of the last `j` parameters
/// (backward order), j drawn in [2, count - 1]. The rule keeps all j in the first bucket (a
/// bucket closes when the next parameter would exceed the cap); closing a bucket once it
/// reaches the cap (>=) puts only j - 1 there, which drawn caps almost never show.
std::size_t cap_on_a_boundary(const Model& model, Draws& draws) {
  const auto parameters = model.parameters();
  const auto count = static_cast<std::int64_t>(parameters.size());
  const auto j = static_cast<std::size_t>(
      draws.integer("parameters up to the boundary", 2, std::max<std::int64_t>(2, count - 1)));
  std::size_t bytes = 0;
  for (std::size_t k = 0; k < j; ++k)
    bytes += 4 * parameters[parameters.size() - 1 - k]->value.size();
  return bytes;
}

/// Rank `rank`'s shard as flat indices of the model's parameter space, in shard order; a
/// padding element is `kPadding`.
constexpr std::size_t kPadding = std::numeric_limits<std::size_t>::max();

std::vector<std::size_t> shard_indices(const Model& model, const std::vector<Bucket>& buckets,
                                       int rank) {
  std::vector<std::size_t> indices;
  for (const Bucket& bucket : buckets) {
    std::vector<std::size_t> flat;  // the bucket's flat range, as model indices
    for (const std::size_t p : bucket.parameters) {
      const Parameter& parameter = *model.parameters()[p];
      for (std::size_t i = 0; i < parameter.value.size(); ++i) flat.push_back(parameter.offset + i);
    }
    const std::size_t begin = static_cast<std::size_t>(rank) * bucket.chunk_elements;
    for (std::size_t i = begin; i < begin + bucket.chunk_elements; ++i)
      indices.push_back(i < flat.size() ? flat[i] : kPadding);
  }
  return indices;
}

/// The elements of the largest layer's parameters.
std::size_t largest_layer(Model& model) {
  std::size_t largest = 0;
  for (Layer* layer : model.layers()) {
    std::size_t elements = 0;
    for (const Parameter* parameter : layer->parameters()) elements += parameter->value.size();
    largest = std::max(largest, elements);
  }
  return largest;
}

/// P = max_k N C_k: the largest bucket with its padding, in elements.
std::size_t largest_padded_bucket(const std::vector<Bucket>& buckets, int world) {
  std::size_t largest = 0;
  for (const Bucket& b : buckets)
    largest = std::max(largest, static_cast<std::size_t>(world) * b.chunk_elements);
  return largest;
}

/// The communication budget for the buffers: what two buffers of the largest padded bucket
/// hold, 2 x 4 P bytes. Any number of buffers, of any sizes and packing, fits if it stays
/// within it.
std::size_t buffer_budget_bytes(const std::vector<Bucket>& buckets, int world) {
  return 2 * 4 * largest_padded_bucket(buckets, world);
}

// --- drawn training ------------------------------------------------------------------------

/// One drawn training set-up (grading::draw_sharded_training) and a bucket cap of 0 to
/// h1 x h2 elements (so that there are several buckets, most of which pad).
struct Training : grading::ShardedTraining {
  std::size_t cap_bytes = 0;
};

Training draw_training(Draws& draws, const std::string& optimizer) {
  Training training{grading::draw_sharded_training(draws, optimizer)};
  training.cap_bytes = 4 * static_cast<std::size_t>(draws.integer(
                               "cap elements", 0, training.hidden1 * training.hidden2));
  return training;
}

/// A tiny GPT (grading::draw_sharded_gpt_training) and a bucket cap of 0 to 4 dim^2
/// elements, the largest weight of a block: several buckets, some cut inside a block.
Training draw_gpt_training(Draws& draws, const std::string& optimizer) {
  Training training{grading::draw_sharded_gpt_training(draws, optimizer)};
  training.cap_bytes = 4 * static_cast<std::size_t>(draws.integer(
                               "cap elements", 0, 4 * training.hidden1 * training.hidden2));
  return training;
}

OptimizerFactory factory_for(const TrainOptions& options) {
  return grading::shard_optimizer_factory(options);
}

/// "" when `shard` is this rank's chunks of `model`'s parameters, padding zero.
std::string check_shard(const Model& model, const std::vector<std::size_t>& indices,
                        const Tensor& shard) {
  if (shard.size() != indices.size())
    return fmt::format("shard_parameters() holds {} elements; expected S = {}", shard.size(),
                       indices.size());
  const std::vector<float> all = model.flat_parameters();
  const std::vector<float> values = grading::host_values(shard);
  for (std::size_t i = 0; i < indices.size(); ++i) {
    const float expected = indices[i] == kPadding ? 0.0f : all[indices[i]];
    if (std::memcmp(&values[i], &expected, sizeof(float)) != 0)
      return indices[i] == kPadding
                 ? fmt::format("shard_parameters()[{}] is padding and holds {}; expected 0", i,
                               values[i])
                 : fmt::format(
                       "shard_parameters()[{}] holds {}; expected {}, flat parameter element {} "
                       "(the shard is this rank's chunk of every bucket, in bucket order)",
                       i, values[i], expected, indices[i]);
  }
  return "";
}

/// "" when every Parameter::grad of `model` is released (an empty tensor).
std::string check_released(const Model& model) {
  std::vector<std::string> kept;
  for (const Parameter* parameter : model.parameters())
    if (!parameter->grad.empty()) kept.push_back(parameter->name);
  if (kept.empty()) return "";
  return fmt::format("Parameter::grad of [{}] still allocated; expected every gradient released",
                     fmt::join(kept, ", "));
}

/// Runs this rank's `micro` backwards of step `step` (1-based) of `options` on `model`, the
/// gradients zeroed once before the first (they accumulate across the micro-batches, as a
/// training loop with accumulation does). Calls `between(m)` after backward m.
void accumulate_step(Model& model, const Training& training, const TrainOptions& options, int step,
                     int micro, int rank, int world,
                     const std::function<void(int)>& between = nullptr) {
  std::vector<Batch> batches =
      grading::micro_batches(*training.data, options, step - 1, rank, world, micro);
  model.zero_grad();
  for (int m = 0; m < micro; ++m) {
    const Batch batch = grading::on_check_device(std::move(batches[static_cast<std::size_t>(m)]));
    model.backward(grading::forward(model, batch), batch.labels);
    if (between) between(m);
  }
}

/// How train_and_compare trains a rank, and what it tells about a step that differs.
struct ComparedRun {
  TrainOptions options = {};              ///< the drawn training on this world size
  float max_norm = 0.0f;                  ///< clipping's max_norm (0: none)
  std::vector<float> norms = {};          ///< with clipping, the norm step() must return
  std::string norm_arithmetic = {};       ///< how those norms were computed, for messages
  AccumulationOptions accumulation = {};  ///< micro-batches per step and the strategy
  std::string what = {};                  ///< the run, for messages
  std::string order = {};  ///< the contract's order of the sums, after a mismatch ("": none)
};

/// Trains this rank with the student's optimizer as `run` says, comparing every step with
/// `exact` bitwise, and then its shard and the released gradients.
void train_and_compare(const Training& training, Communicator& comm, Verdict& verdict,
                       const Trajectory& exact, const ComparedRun& run) {
  const int world = comm.size();
  Model model = training.model();
  const std::vector<std::size_t> indices =
      shard_indices(model, contract_buckets(model, world, training.cap_bytes), comm.rank());
  ZeroTwoOptimizer zero(model, comm, factory_for(run.options), training.cap_bytes, run.max_norm,
                        run.accumulation);
  // Every rank runs every step whatever it found, so that no rank waits for a peer that
  // stopped: a failure is recorded once, and the later steps are not judged.
  for (int step = 1; step <= run.options.steps; ++step) {
    const std::vector<float> before = model.flat_parameters();
    accumulate_step(model, training, run.options, step, run.accumulation.micro_batches, comm.rank(),
                    world);
    const std::optional<float> norm = zero.step();
    if (!verdict.passed()) continue;
    const std::string finding =
        grading::compare_sharded_step({.model = model,
                                       .world = world,
                                       .step = step,
                                       .before = before,
                                       .exact = exact,
                                       .norm = norm,
                                       .max_norm = run.max_norm,
                                       .expected_norms = run.norms,
                                       .norm_arithmetic = run.norm_arithmetic});
    if (!finding.empty()) {
      verdict.fail(run.order.empty() ? fmt::format("{}: {}", run.what, finding)
                                     : fmt::format("{}: {} ({})", run.what, finding, run.order));
      continue;
    }
    verdict.expect_empty(check_shard(model, indices, zero.shard_parameters()),
                         fmt::format("{}: after step {}", run.what, step));
    verdict.expect_empty(check_released(model), fmt::format("{}: after step {}", run.what, step));
  }
}

/// train_and_compare with one micro-batch per step.
void train_and_compare(const Training& training, Communicator& comm, Verdict& verdict,
                       const Trajectory& exact, float max_norm, const std::vector<float>& norms,
                       const std::string& what) {
  train_and_compare(training, comm, verdict, exact,
                    {.options = training.for_world(comm.size()),
                     .max_norm = max_norm,
                     .norms = norms,
                     .norm_arithmetic = "over the averaged shards",
                     .what = what});
}

// --- Lab6Buckets ---------------------------------------------------------------------------

TEST(Lab6Buckets, FollowTheRule) {
  Draws draws("Lab6Buckets.FollowTheRule");
  // Drawn models, caps and world sizes up to 16; a cap of 0, one above the model's size,
  // and a bucket of one small bias on many ranks (chunks of padding only).
  for (int i = 0; i < 4; ++i) {
    TrainOptions o;
    o.model = fmt::format("64-{}-{}-10", draws.integer("h1", 8, 96), draws.integer("h2", 8, 64));
    o.layer_norm = draws.coin("layer norm");
    const Model model = grading::make_check_model(o);
    const int world = static_cast<int>(draws.integer("N", 1, 16));
    const std::size_t psi = model.num_parameters();
    const std::array<std::size_t, 4> caps = {
        i == 0 ? std::size_t{0} : 4 * static_cast<std::size_t>(draws.integer("cap", 1, psi / 2)),
        4 * psi + 4, 4 * static_cast<std::size_t>(draws.integer("cap", 1, 2000)),
        cap_on_a_boundary(model, draws)};
    for (const std::size_t cap : caps) {
      const std::vector<Bucket> expected = contract_buckets(model, world, cap);
      std::vector<Bucket> seen;
      try {
        seen = plan_buckets(model, world, cap);
      } catch (const NotImplemented&) {
        throw;
      } catch (const std::exception& error) {
        ADD_FAILURE() << fmt::format("plan_buckets({}, N {}, cap {}) threw {}: {}\n  drawn: {}",
                                     o.model, world, cap, grading::type_name(error), error.what(),
                                     draws.describe());
        continue;
      }
      if (seen != expected)
        ADD_FAILURE() << fmt::format(
            "plan_buckets({}{}, N {}, cap {} bytes) = {}; expected {}\n  drawn: {}", o.model,
            o.layer_norm ? " with LayerNorm" : "", world, cap, describe(seen), describe(expected),
            draws.describe());
      else if (shard_elements(seen) != contract_shard(expected))
        ADD_FAILURE() << fmt::format("shard_elements = {}; expected the sum of the chunks, {}",
                                     shard_elements(seen), contract_shard(expected));
    }
  }
  {
    TrainOptions o;
    o.model = "64-16-10";
    Model model = grading::make_check_model(o);
    const auto expect_error = [&](const std::string& what, const auto& call) {
      try {
        call();
        ADD_FAILURE() << fmt::format("{}: plan_buckets returned; expected dp::Error", what);
      } catch (const NotImplemented&) {
        throw;
      } catch (const Error&) {
      }
    };
    expect_error("world size 0", [&] { (void)plan_buckets(model, 0, 1024); });
    model.freeze(model.parameters().front()->name);
    expect_error("a frozen parameter", [&] { (void)plan_buckets(model, 2, 1024); });
  }
  // The optimizer's own buckets, initial shard and released gradients, on drawn world sizes.
  const std::vector<int> worlds = draws.world_sizes(6);
  const Training training = draw_training(draws, "sgd");
  for (int world : worlds) {
    run_on_ranks(
        world,
        [&](Communicator& comm, Verdict& verdict) {
          Model model = training.model();
          const std::vector<Bucket> expected = contract_buckets(model, world, training.cap_bytes);
          ZeroTwoOptimizer zero(model, comm, factory_for(training.for_world(world)),
                                training.cap_bytes);
          if (zero.buckets() != expected)
            verdict.fail(fmt::format("ZeroTwoOptimizer::buckets() = {}; expected {}",
                                     describe(zero.buckets()), describe(expected)));
          else
            verdict.expect_empty(check_shard(model, shard_indices(model, expected, comm.rank()),
                                             zero.shard_parameters()),
                                 "after the constructor");
          verdict.expect_empty(check_released(model), "after the constructor");
        },
        draws);
  }
  if (!HasFailure())
    grading::note_measured(fmt::format(
        "drawn models, caps (0, drawn, above the model, on a bucket boundary) and N up to 16 "
        "follow the rule; the "
        "optimizer's buckets, initial shard and released gradients on world sizes {}",
        fmt::join(worlds, ", ")));
}

// --- Lab6Contract --------------------------------------------------------------------------

TEST(Lab6Contract, ErrorsOnMisuseAndOneInnerOptimizer) {
  Draws draws("Lab6Contract.ErrorsOnMisuseAndOneInnerOptimizer");
  const std::vector<int> worlds = draws.world_sizes(6);
  const Training training = draw_training(draws, "adamw");
  for (int world : worlds) {
    run_on_ranks(
        world,
        [&](Communicator& comm, Verdict& verdict) {
          const TrainOptions options = training.for_world(world);
          const std::size_t cap = training.cap_bytes;
          const std::size_t shard = contract_shard(contract_buckets(training.model(), world, cap));
          Model model = training.model();
          grading::expect_constructor_refuses_misuse(
              verdict,
              {.training = training,
               .model = model,
               .factory = factory_for(options),
               .shard = shard,
               .frozen = grading::FrozenParameter::kLast},
              [&](Model& zero_model, const OptimizerFactory& factory, float max_norm) {
                ZeroTwoOptimizer zero(zero_model, comm, factory, cap, max_norm);
              });
          if (!verdict.passed()) return;
          Model fresh = training.model();
          std::vector<std::size_t> asked;
          grading::UpdateRecorder* made = nullptr;
          ZeroTwoOptimizer zero(
              fresh, comm,
              [&](std::size_t s) {
                asked.push_back(s);
                auto optimizer = std::make_unique<grading::UpdateRecorder>(factory_for(options)(s));
                made = optimizer.get();
                return optimizer;
              },
              cap);
          if (asked != std::vector<std::size_t>{shard})
            verdict.fail(fmt::format(
                "the factory was called with [{}]; expected once, with the shard's S = {}",
                fmt::join(asked, ", "), shard));
          else if (&zero.inner() != made)
            verdict.fail("inner() is not the optimizer the factory made");
          if (!verdict.passed()) return;
          grading::expect_dp_error(verdict, "step() without a backward",
                                   [&] { (void)zero.step(); });
          const std::int64_t steps_before = made->step_count();
          const Batch batch = grading::on_check_device(
              grading::local_batch(*training.data, options, 0, comm.rank(), world));
          fresh.zero_grad();
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
                "elements) over the whole shard, on every rank (chunks of padding only too)",
                fmt::join(seen, ", "), shard));
          }
          // A second backward before step() would reduce-scatter over the first one's
          // shard: the contract asks for dp::Error from the hook. Every rank throws at its
          // first hook, before it launches anything, so the ranks stay in step.
          fresh.backward(grading::forward(fresh, batch), batch.labels);
          grading::expect_dp_error(verdict, "a second backward before step()", [&] {
            fresh.backward(grading::forward(fresh, batch), batch.labels);
          });
          // Destroyed after a backward, before step(): its reduce-scatters are in flight, and
          // its destructor must wait for them before their buffers go (lab6.h). Memory freed
          // under a call in flight is reported by the runtime at the rank's next call (here
          // the barrier), naming the tensor and the call.
          {
            Model model_in_flight = training.model();
            ZeroTwoOptimizer in_flight(model_in_flight, comm, factory_for(options), cap);
            model_in_flight.backward(grading::forward(model_in_flight, batch), batch.labels);
          }
          try {
            comm.barrier();
          } catch (const Error& error) {
            verdict.fail(fmt::format(
                "destroying the optimizer after a backward, before step() (its reduce-scatters "
                "in flight): {}",
                error.what()));
          }
          if (verdict.passed())
            verdict.note(
                "a frozen parameter, a negative, NaN or infinite max_norm, an empty factory, one "
                "returning nullptr or an optimizer of the wrong size or on another device than the "
                "model's (the message naming both) throw dp::Error, and so do "
                "a step without a backward and a second backward before step(); the factory is "
                "called once with S; a step is one begin_step and one update over the whole "
                "shard; destroyed with its reduce-scatters in flight, it waits for them before "
                "it frees their buffers");
        },
        draws);
  }
}

// --- Lab6Equivalence -----------------------------------------------------------------------

TEST(Lab6Equivalence, BitwiseLab2AfterEveryStep) {
  Draws draws("Lab6Equivalence.BitwiseLab2AfterEveryStep");
  const std::vector<int> worlds = draws.world_sizes(6);
  // SGD and AdamW on drawn MLPs, then a tiny GPT (its optimizer and cap drawn) on the
  // grader's text: a block's 12 gradients become ready together, in one layer's backward.
  std::vector<Training> trainings;
  for (const std::string optimizer : {"sgd", "adamw"}) {
    Training training = draw_training(draws, optimizer);
    // AdamW with a cap of 0: one bucket per parameter, so that small buckets give some ranks
    // a chunk of padding only (a bias of 10 on N = 6), and every buffer is reused.
    if (optimizer == "adamw") training.cap_bytes = 0;
    trainings.push_back(std::move(training));
  }
  draws.section("then a GPT:");
  trainings.push_back(draw_gpt_training(draws, draws.coin("gpt: adamw") ? "adamw" : "sgd"));
  for (const Training& training : trainings) {
    const std::string& optimizer = training.options.optimizer;
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
                              fmt::format("ZeroTwoOptimizer with {}, cap {} bytes", optimizer,
                                          training.cap_bytes));
            if (verdict.passed()) {
              const std::vector<Bucket> b =
                  contract_buckets(training.model(), world, training.cap_bytes);
              std::size_t padding = 0;
              for (const Bucket& bucket : b)
                padding +=
                    static_cast<std::size_t>(world) * bucket.chunk_elements - bucket.elements;
              verdict.note(fmt::format(
                  "SGD and AdamW on MLPs and a GPT: every rank bitwise lab 2's flat arithmetic "
                  "after every step (here {} on {}, N = {}: {} buckets, S = {}, {} padding "
                  "elements stayed 0); one process on the global batch differs by {:.1e} after "
                  "{} steps",
                  optimizer, training.model_name(), world, b.size(), contract_shard(b), padding,
                  from_one, options.steps));
            }
          },
          draws);
    }
  }
}

// --- Lab6Clipping --------------------------------------------------------------------------

/// Whether the partial squared norms taken over the summed shard before the division by N,
/// then divided by N^2 in double (the same number in exact arithmetic: a plausible wrong
/// arithmetic a student trial wrote), give another float norm than the contract's on some
/// step of the contract's trajectory: a solution computing them fails there.
bool norm_before_division_differs(const TrainOptions& options, const Dataset& data, int world,
                                  const std::vector<std::vector<std::size_t>>& real_by_rank,
                                  float max_norm) {
  std::vector<float> summed;
  grading::Emulation how;
  how.sum = [&summed](const std::vector<std::vector<float>>& local) {
    summed = grading::sum_in_rank_order(local);
    return summed;
  };
  bool differs = false;
  how.before_step = [&](int, std::vector<float>& averaged) {
    const double n_squared = static_cast<double>(world) * world;
    float wrong = 0;
    for (std::size_t r = 0; r < real_by_rank.size(); ++r) {
      double squares = 0;
      for (const std::size_t i : real_by_rank[r])
        squares += static_cast<double>(summed[i]) * static_cast<double>(summed[i]);
      const auto partial = static_cast<float>(squares / n_squared);
      wrong = r == 0 ? partial : wrong + partial;
    }
    // The contract's norm, clipping `averaged` as the contract does (the trajectory).
    const float right = grading::clip_by_sharded_norm(averaged, real_by_rank, max_norm);
    differs = differs || std::sqrt(wrong) != right;
  };
  (void)grading::emulate_data_parallel(options, data, world, how);
  return differs;
}

/// A clipping case of `training` on `world` ranks: max_norm `fraction` of the first step's
/// global gradient norm, and each rank's real elements in shard order (its padding adds
/// nothing to the norm).
struct ClippingCase {
  TrainOptions options = {};
  float max_norm = 0.0f;
  std::vector<std::vector<std::size_t>> real_by_rank = {};
};

/// Each rank's real elements of `training`'s model on `world` ranks, as flat indices in
/// shard order (its padding adds nothing to the norm).
std::vector<std::vector<std::size_t>> real_elements_by_rank(const Training& training, int world) {
  const Model layout = training.model();
  const std::vector<Bucket> buckets = contract_buckets(layout, world, training.cap_bytes);
  std::vector<std::vector<std::size_t>> real_by_rank;
  for (int r = 0; r < world; ++r) {
    real_by_rank.emplace_back();
    for (const std::size_t i : shard_indices(layout, buckets, r))
      if (i != kPadding) real_by_rank.back().push_back(i);
  }
  return real_by_rank;
}

ClippingCase clipping_case(const Training& training, int world, float fraction) {
  ClippingCase clipping{.options = training.for_world(world)};
  const Trajectory plain = grading::emulate_data_parallel(clipping.options, *training.data, world);
  double first = 0;
  for (const float g : plain.gradients_of_step[0]) first += static_cast<double>(g) * g;
  clipping.max_norm = static_cast<float>(std::sqrt(first)) * fraction;
  clipping.real_by_rank = real_elements_by_rank(training, world);
  return clipping;
}

/// SGD cases with clipping on a world size that is not a power of two (where the division
/// by N is exact, and so both arithmetics agree), drawn until the norm taken before the
/// division differs from the contract's on one of them, and that case run: the check's
/// other draws tell it apart on some seeds only. A grader bug if no case does.
void tell_the_norm_before_the_division(Draws& draws, const std::vector<int>& worlds) {
  const auto not_power_of_two = [](int n) { return (n & (n - 1)) != 0; };
  const auto found = std::find_if(worlds.begin(), worlds.end(), not_power_of_two);
  if (found == worlds.end()) {
    grading::note_measured(fmt::format(
        "world sizes {} are powers of two: a norm before the division is the same float there",
        fmt::join(worlds, ", ")));
    return;
  }
  const int world = *found;
  // Each costs an emulation only. About one case in ten tells (1 to 17 on the grading seeds
  // 1-12 and the CI's large ones); 400 leave a grader bug no real chance.
  constexpr int kMostCases = 400;
  for (int attempt = 1; attempt <= kMostCases; ++attempt) {
    const Training training = draw_training(draws, "sgd");
    const float fraction = draws.uniform("before the division: max_norm / first norm", 0.2f, 0.7f);
    const ClippingCase set_up = clipping_case(training, world, fraction);
    const TrainOptions& options = set_up.options;
    const float max_norm = set_up.max_norm;
    const std::vector<std::vector<std::size_t>>& real_by_rank = set_up.real_by_rank;
    if (!norm_before_division_differs(options, *training.data, world, real_by_rank, max_norm))
      continue;
    const grading::ClippedTrajectory clipping =
        grading::emulate_clipped(options, *training.data, world, real_by_rank, max_norm);
    run_on_ranks(
        world,
        [&](Communicator& comm, Verdict& verdict) {
          train_and_compare(training, comm, verdict, clipping.exact, max_norm, clipping.norms,
                            fmt::format("ZeroTwoOptimizer with sgd and max_norm {:.4g} (a case "
                                        "where squares taken before the division by N give "
                                        "another norm)",
                                        max_norm));
          if (verdict.passed())
            verdict.note(fmt::format(
                "case {} drawn tells the norm taken before the division (squares of the sum / "
                "N^2) from the contract's on N = {}: norms and parameters bitwise the contract's",
                attempt, world));
        },
        draws);
    return;
  }
  ADD_FAILURE() << fmt::format(
      "grader bug: in {} drawn cases on N = {} the norm taken before the division never differed "
      "from the contract's; the check cannot tell that arithmetic apart\n  drawn: {}",
      kMostCases, world, draws.describe());
}

TEST(Lab6Clipping, GlobalNormOverTheShards) {
  Draws draws("Lab6Clipping.GlobalNormOverTheShards");
  const std::vector<int> worlds = draws.world_sizes(6);
  // First (so that its note shows): a case where the norm before the division differs.
  tell_the_norm_before_the_division(draws, worlds);
  struct Case {
    std::string optimizer;
    float low;
    float high;
  };
  for (const Case& drawn :
       {Case{"sgd", 0.2f, 0.7f}, Case{"adamw", 0.2f, 0.7f}, Case{"sgd", 2.0f, 4.0f}}) {
    const std::string label = drawn.optimizer + (drawn.low > 1 ? " above the norm" : "");
    const Training training = draw_training(draws, drawn.optimizer);
    const float fraction = draws.uniform(label + " max_norm / first norm", drawn.low, drawn.high);
    for (int world : worlds) {
      const ClippingCase set_up = clipping_case(training, world, fraction);
      const TrainOptions& options = set_up.options;
      const float max_norm = set_up.max_norm;
      const std::vector<std::vector<std::size_t>>& real_by_rank = set_up.real_by_rank;
      const grading::ClippedTrajectory clipping =
          grading::emulate_clipped(options, *training.data, world, real_by_rank, max_norm);
      const Trajectory& exact = clipping.exact;
      const std::vector<float>& norms = clipping.norms;
      const double worst_relative = clipping.worst_relative;
      const int clipped = clipping.clipped_steps;
      run_on_ranks(
          world,
          [&](Communicator& comm, Verdict& verdict) {
            train_and_compare(training, comm, verdict, exact, max_norm, norms,
                              fmt::format("ZeroTwoOptimizer with {} and max_norm {:.4g}",
                                          drawn.optimizer, max_norm));
            if (verdict.passed())
              verdict.note(fmt::format(
                  "{} with max_norm {:.2g}x the first norm: norms and parameters bitwise the "
                  "contract's arithmetic ({} of {} steps clipped here, N = {}); the norms "
                  "within {:.1e} of the unsharded double-precision norm",
                  drawn.optimizer, fraction, clipped, options.steps, world, worst_relative));
          },
          draws);
    }
  }
}

// --- Lab6Memory ----------------------------------------------------------------------------

/// The steps a memory check runs (two: the peaks of a step and what the next keeps).
constexpr int kMeasuredSteps = 2;

/// The contract's parameters after the memory check's two steps of `options` (`training`'s
/// on `world` ranks, or an allocation check's set-up of it), clipping at `max_norm` when it
/// is positive (lab 2's arithmetic, emulated once in one process). The memory checks compare
/// every rank's parameters with them bitwise: they read the tracker, and a design could
/// otherwise give up the arithmetic on the models or set-ups that only they build (the speed
/// checks' cheat, where only the memory is measured).
Trajectory measured_steps(const Training& training, TrainOptions options, int world,
                          float max_norm) {
  options.steps = kMeasuredSteps;
  if (max_norm <= 0) return grading::emulate_data_parallel(options, *training.data, world);
  return grading::emulate_clipped(options, *training.data, world,
                                  real_elements_by_rank(training, world), max_norm)
      .exact;
}

/// measured_steps of `training` itself on `world` ranks.
Trajectory measured_steps(const Training& training, int world, float max_norm) {
  return measured_steps(training, training.for_world(world), world, max_norm);
}

/// "" when `model`'s parameters after step `step` of `run` (a memory check's by default)
/// are `exact`'s bitwise, else the finding, which names `arithmetic`, what `exact` emulates.
std::string compare_measured_step(const Model& model, const Trajectory& exact, int step,
                                  std::string_view arithmetic,
                                  std::string_view run = "the memory check") {
  const std::string finding = grading::compare_parameters(
      model, exact.parameters_after_step[static_cast<std::size_t>(step - 1)], 0.0f);
  if (finding.empty()) return "";
  return fmt::format(
      "after step {} of {}: {} (expected {} bitwise, emulated in one process: a design must be "
      "right on every model it runs, measured or not)",
      step, run, finding, arithmetic);
}

/// The memory budgets of one rank training `training` on `world` ranks with `max_norm`:
/// what the constructor changes (every category but communication exactly), the gradient
/// and communication peaks over two steps within their budgets, and every category as after
/// the constructor between steps; and the parameters after each step bitwise `exact`'s
/// (measured_steps).
void check_gradient_memory(const Training& training, int world, float max_norm,
                           const Trajectory& exact, Communicator& comm, Verdict& verdict) {
  const TrainOptions options = training.for_world(world);
  MemoryTracker& tracker = this_rank_memory().tracker();
  // A twin without ZeRO-2: the activation bytes of a plain forward and backward.
  const grading::PlainTwin twin = grading::plain_twin(training, world, comm);
  const std::size_t plain_activations = twin.activation_bytes;
  // The twin keeps what its loss saved (one row of logits per sample): count from here.
  const std::size_t model_activation_base = tracker.current(MemoryCategory::kActivations);
  const std::size_t grad_base = tracker.current(MemoryCategory::kGradients);
  const std::size_t comm_base = tracker.current(MemoryCategory::kCommunication);
  Model model = training.model();
  const std::size_t psi = model.num_parameters();
  const std::vector<Bucket> buckets = contract_buckets(model, world, training.cap_bytes);
  const std::size_t shard = 4 * contract_shard(buckets);
  const std::size_t layer = 4 * largest_layer(model);
  const std::size_t buffers =
      buffer_budget_bytes(buckets, world) + (max_norm > 0 ? sizeof(float) : 0);
  const std::size_t other_base = tracker.current(MemoryCategory::kOther);
  tracker.reset_peaks();
  const grading::CategoryBytes before_constructor = grading::current_bytes(tracker);
  ZeroTwoOptimizer zero(model, comm, factory_for(options), training.cap_bytes, max_norm);
  // Every category but communication, what the constructor changed: the shards of
  // the parameters and of the gradient added, the model's gradients (4 Psi) released,
  // the inner optimizer's state, nothing else. Communication holds the buffers of
  // the student's design, which the budget below bounds.
  grading::CategoryBytes changed_by_constructor =
      grading::current_bytes(tracker) - before_constructor;
  const std::int64_t constructor_buffers = changed_by_constructor[MemoryCategory::kCommunication];
  changed_by_constructor[MemoryCategory::kCommunication] = 0;
  grading::CategoryBytes expected_change;
  expected_change[MemoryCategory::kParameters] = static_cast<std::int64_t>(shard);
  expected_change[MemoryCategory::kGradients] =
      static_cast<std::int64_t>(shard) - static_cast<std::int64_t>(4 * psi);
  expected_change[MemoryCategory::kOptimizerState] = grading::state_bytes(zero.inner());
  const std::string constructor_differs =
      grading::category_differences(changed_by_constructor, expected_change);
  if (!constructor_differs.empty())
    verdict.fail(
        fmt::format("what the constructor changed: {}; the contract: + 4 S = {} of parameters (the "
                    "shard), 4 S - 4 Psi = {} of gradients (the shard in, every Parameter::grad "
                    "released), your buffers under communication, the inner optimizer's state, "
                    "nothing else",
                    constructor_differs, shard, expected_change[MemoryCategory::kGradients]));
  else if (constructor_buffers > static_cast<std::int64_t>(buffers))
    verdict.fail(
        fmt::format("the constructor allocated {} bytes of communication buffers; the budget is "
                    "two buffers of the largest padded bucket, 2 x 4 max_k(N C_k){} = {} ({} "
                    "buckets){}",
                    constructor_buffers, max_norm > 0 ? " + 4 for the norm (clipping on)" : "",
                    buffers, buckets.size(),
                    constructor_buffers >= static_cast<std::int64_t>(4 * psi)
                        ? ": as much as the whole gradient (a buffer per bucket?)"
                        : ""));
  const grading::CategoryBytes constructed = grading::current_bytes(tracker);
  tracker.reset_peaks();
  std::size_t backward_peak = 0;
  std::string numbers;  // the first step whose parameters differ from the contract's
  for (int step = 1; step <= kMeasuredSteps && verdict.passed(); ++step) {
    const Batch batch = grading::on_check_device(
        grading::local_batch(*training.data, options, step - 1, comm.rank(), world));
    model.zero_grad();
    model.backward(grading::forward(model, batch), batch.labels);
    backward_peak = std::max(backward_peak, tracker.peak(MemoryCategory::kGradients) - grad_base);
    verdict.expect_empty(check_released(model), fmt::format("step {}, right after backward", step));
    (void)zero.step();
    // Read from the host copy of the values (no tensor, no tracker account): the peaks stay.
    if (numbers.empty()) numbers = compare_measured_step(model, exact, step, "lab 2's arithmetic");
  }
  if (verdict.passed() && !numbers.empty()) {
    verdict.fail(numbers);
    return;
  }
  // Between steps every category but the activations (what the model's loss keeps)
  // holds what it held after the constructor: the contract's "at all times".
  grading::CategoryBytes kept = grading::current_bytes(tracker) - constructed;
  kept[MemoryCategory::kActivations] = 0;
  const std::string changed = grading::category_differences(kept, {});
  const std::size_t grad_peak = tracker.peak(MemoryCategory::kGradients) - grad_base;
  const std::size_t comm_peak = tracker.peak(MemoryCategory::kCommunication) - comm_base;
  const std::size_t other_peak = tracker.peak(MemoryCategory::kOther) - other_base;
  const std::size_t activations =
      tracker.peak(MemoryCategory::kActivations) - model_activation_base;
  if (!verdict.passed()) return;
  if (!changed.empty()) {
    verdict.fail(
        fmt::format("after two steps, against just after the constructor: {}; expected every "
                    "category as it was (the shards and buffers stay, every gradient is released)",
                    changed));
    return;
  }
  if (activations > plain_activations) {
    verdict.fail(fmt::format(
        "{} activation bytes at the peak of the steps, {} for the same two forwards and "
        "backwards without ZeRO-2; expected no more (gradients under kGradients, buffers "
        "under kCommunication)",
        activations, plain_activations));
    return;
  }
  if (other_peak != 0) {
    verdict.fail(
        fmt::format("{} bytes under MemoryCategory::kOther at the peak of the steps; expected none "
                    "(gradients under kGradients, buffers under kCommunication)",
                    other_peak));
    return;
  }
  const std::size_t expected = shard + layer;
  if (backward_peak > expected || grad_peak > expected)
    verdict.fail(
        fmt::format("gradient bytes at the peak during backward {} (during the steps {}); expected "
                    "at most 4 S + 4 x the largest layer = {} + {} = {} (Psi = {}, N = {}){}",
                    backward_peak, grad_peak, shard, layer, expected, psi, world,
                    backward_peak >= shard + 4 * psi
                        ? ": the whole gradient existed at once; release each gradient in its hook"
                    : backward_peak > expected
                        ? ": gradients stayed longer than their hook (released per bucket, "
                          "or a copy under kGradients?)"
                        : ""));
  else if (comm_peak > buffers)
    verdict.fail(fmt::format(
        "communication bytes at the peak {}; the budget is two buffers of the largest "
        "padded bucket, 2 x 4 max_k(N C_k){} = {} ({} buckets){}",
        comm_peak, max_norm > 0 ? " + 4 for the norm (clipping on)" : "", buffers, buckets.size(),
        comm_peak >= 4 * psi ? ": a buffer as large as the whole gradient" : ""));
  else
    verdict.note(fmt::format(
        "{}, N = {}, Psi = {}: gradient peak {} bytes (budget 4 S = {} plus the largest "
        "layer's {}) and {} bytes of communication at the peak (budget {}{}), against "
        "DDP's 4 Psi = {} of gradients plus lab 4's 4 Psi of buckets",
        training.model_name(), world, psi, grad_peak, shard, layer, comm_peak, buffers,
        max_norm > 0 ? " with the norm's float" : "", 4 * psi));
}

TEST(Lab6Memory, GradientsAreOneShardPlusOneLayer) {
  Draws draws("Lab6Memory.GradientsAreOneShardPlusOneLayer");
  const std::vector<int> worlds = draws.world_sizes(6);
  const Training training = draw_training(draws, draws.coin("adamw") ? "adamw" : "sgd");
  for (std::size_t w = 0; w < worlds.size(); ++w) {
    const int world = worlds[w];
    // Every other world size with clipping: its one float is a kCommunication tensor too.
    const float max_norm = w % 2 == 0 ? 1.0f : 0.0f;
    const Trajectory exact = measured_steps(training, world, max_norm);
    run_on_ranks(
        world,
        [&](Communicator& comm, Verdict& verdict) {
          check_gradient_memory(training, world, max_norm, exact, comm, verdict);
        },
        draws);
  }
  // The lesson's workload: an MLP of many equal hidden layers and a cap of one layer, so
  // many buckets of about the same size. On the drawn MLPs above the first layer holds most
  // of the parameters, and buffers sized to their own buckets (a region per bucket, the
  // whole gradient again) can fit two buffers of the largest; here they cannot. Local
  // threads on every backend, so that N = 4 and 8 are there under mpi too (the tracker's
  // counts are the same).
  Training blocks = training;
  const std::int64_t hidden = draws.integer("equal blocks: width", 64, 96);
  const std::int64_t layers = draws.integer("equal blocks: hidden layers", 8, 12);
  std::string spec = "64";
  for (std::int64_t l = 0; l < layers; ++l) spec += fmt::format("-{}", hidden);
  blocks.options.model = spec + "-10";
  blocks.options.layer_norm = false;
  blocks.options.activation = "relu";
  blocks.hidden1 = hidden;
  blocks.hidden2 = hidden;
  blocks.cap_bytes = 4 * static_cast<std::size_t>(hidden * hidden + hidden);
  for (const int world : {4, 8}) {
    // The workload must make the point: every bucket padded is far above the budget.
    Model model = blocks.model();
    const std::vector<Bucket> buckets = contract_buckets(model, world, blocks.cap_bytes);
    std::size_t every_bucket = 0;
    for (const Bucket& b : buckets)
      every_bucket += 4 * static_cast<std::size_t>(world) * b.chunk_elements;
    ASSERT_GT(every_bucket, 2 * buffer_budget_bytes(buckets, world)) << fmt::format(
        "the check's workload is wrong: on {} with N = {} and a cap of {} bytes, a buffer per "
        "bucket ({} bytes) is not well above the budget of two largest buckets ({} bytes)",
        blocks.options.model, world, blocks.cap_bytes, every_bucket,
        buffer_budget_bytes(buckets, world));
    const float max_norm = world == 4 ? 1.0f : 0.0f;
    const Trajectory exact = measured_steps(blocks, world, max_norm);
    run_on_ranks(
        world,
        [&](Communicator& comm, Verdict& verdict) {
          check_gradient_memory(blocks, world, max_norm, exact, comm, verdict);
        },
        draws, std::chrono::seconds(30), Backend::kLocal);
  }
  // Then a tiny GPT: a transformer block is one layer, so its 12 gradients may coexist (the
  // largest layer is a block), and the activations are the twin's, attention included.
  draws.section("then a GPT:");
  const Training gpt = draw_gpt_training(draws, draws.coin("gpt: adamw") ? "adamw" : "sgd");
  for (std::size_t w = 0; w < worlds.size(); ++w) {
    const int world = worlds[w];
    const float max_norm = w % 2 == 1 ? 1.0f : 0.0f;  // the other world sizes clip here
    const Trajectory exact = measured_steps(gpt, world, max_norm);
    run_on_ranks(
        world,
        [&](Communicator& comm, Verdict& verdict) {
          check_gradient_memory(gpt, world, max_norm, exact, comm, verdict);
        },
        draws);
  }
}

TEST(Lab6Memory, ShardedStateAndNoAllocation) {
  Draws draws("Lab6Memory.ShardedStateAndNoAllocation");
  const std::vector<int> worlds = draws.world_sizes(6);
  const Training training = draw_training(draws, "adamw");
  const std::vector<grading::StateSetUp> set_ups = grading::state_set_ups();
  for (int world : worlds) {
    // Each set-up's parameters after its two steps, emulated once in one process: the check
    // reads the tracker and the heap, and a design could otherwise give up the arithmetic
    // on the set-ups only it builds (the speed checks' cheat, where only memory is measured).
    std::vector<Trajectory> exact;
    for (const grading::StateSetUp& set_up : set_ups)
      exact.push_back(measured_steps(training, set_up.applied_to(training.for_world(world)), world,
                                     set_up.max_norm));
    run_on_ranks(
        world,
        [&](Communicator& comm, Verdict& verdict) {
          for (std::size_t u = 0; u < set_ups.size(); ++u) {
            const grading::StateSetUp& set_up = set_ups[u];
            const auto& [kind, floats, max_norm] = set_up;
            const std::string label = set_up.label();
            const TrainOptions options = set_up.applied_to(training.for_world(world));
            MemoryTracker& tracker = this_rank_memory().tracker();
            const std::size_t base = tracker.current(MemoryCategory::kOptimizerState);
            tracker.reset_peaks();
            Model model = training.model();
            const std::size_t shard =
                contract_shard(contract_buckets(model, world, training.cap_bytes));
            const std::size_t expected = 4 * floats * shard;
            // A twin without ZeRO-2: the heap its plain backward takes is the runtime's own.
            Model twin = training.model();
            const grading::HeapUse before_constructor = grading::heap_use_of_this_thread();
            ZeroTwoOptimizer zero(model, comm, factory_for(options), training.cap_bytes, max_norm);
            const grading::HeapUse constructor =
                grading::heap_use_of_this_thread().since(before_constructor);
            if (verdict.passed() && constructor.large_bytes != 0)
              verdict.fail(fmt::format(
                  "{}: the constructor took {} bytes in heap blocks of {} bytes or more; expected "
                  "none (every buffer of gradients or parameters is a Tensor, charged to its "
                  "category)",
                  label, constructor.large_bytes, grading::kLargeAllocationBytes));
            std::string numbers;  // the first step whose parameters differ from the contract's
            for (int step = 1; step <= kMeasuredSteps; ++step) {
              const Batch batch = grading::on_check_device(
                  grading::local_batch(*training.data, options, step - 1, comm.rank(), world));
              model.zero_grad();
              const grading::StepAllocations a = grading::measure_step_allocations(
                  model, twin, batch, comm, [&] { (void)zero.step(); });
              // Read from the host copy of the values (no tensor, no tracker account), after
              // the step's measurements.
              if (numbers.empty())
                numbers = compare_measured_step(model, exact[u], step, "lab 2's arithmetic");
              if (!verdict.passed()) continue;
              const std::size_t grads = a.made(MemoryCategory::kGradients);
              const std::size_t others = a.made(MemoryCategory::kCommunication) +
                                         a.made(MemoryCategory::kParameters) +
                                         a.made(MemoryCategory::kOptimizerState);
              if (a.hooked_activation_tensors > a.plain_activation_tensors)
                verdict.fail(fmt::format(
                    "{}, step {}: forward, backward and step() allocated {} activation tensors, "
                    "the same forward and backward without ZeRO-2 {}; expected no more (no "
                    "staging tensors)",
                    label, step, a.hooked_activation_tensors, a.plain_activation_tensors));
              else if (a.hooked_heap.large_bytes > a.plain_heap.large_bytes)
                verdict.fail(fmt::format(
                    "{}, step {}: forward and backward with your hooks took {} bytes in heap "
                    "blocks of {} bytes or more, the same without them {}; expected no more "
                    "(no staging copies in the hooks)",
                    label, step, a.hooked_heap.large_bytes, grading::kLargeAllocationBytes,
                    a.plain_heap.large_bytes));
              else if (a.step_tensors != 0 || a.step_heap.large_bytes != 0)
                verdict.fail(fmt::format(
                    "{}, step {}: step() allocated {} tensor(s) and {} bytes in blocks of {} "
                    "bytes or more from the heap; expected none",
                    label, step, a.step_tensors, a.step_heap.large_bytes,
                    grading::kLargeAllocationBytes));
              else if (grads != model.parameters().size() || others != 0)
                verdict.fail(fmt::format(
                    "{}, step {}: forward, backward and step() allocated {} gradient tensor(s) "
                    "and {} parameter, optimizer-state or communication tensor(s); expected the "
                    "{} gradients backward makes again after your hook released them, and "
                    "nothing else",
                    label, step, grads, others, model.parameters().size()));
            }
            const std::string state =
                grading::state_bytes_finding({.label = label,
                                              .world = world,
                                              .shard = shard,
                                              .floats_per_element = floats,
                                              .base = base,
                                              .num_parameters = model.num_parameters()});
            if (!verdict.passed()) continue;
            if (!state.empty())
              verdict.fail(state);
            else if (!numbers.empty())
              verdict.fail(fmt::format("{}: {}", label, numbers));
            else if (kind == "adamw")
              verdict.note(fmt::format(
                  "AdamW state 8 S = {} bytes per rank on N = {}, at its peak too; steps allocate "
                  "only the gradients backward makes again{}",
                  expected, world, max_norm > 0 ? " (with clipping)" : ""));
          }
        },
        draws);
  }
}

// --- Lab6Communication ---------------------------------------------------------------------

using grading::RecordedCall;

/// What the grader sees of every call through a recording communicator: when it was issued
/// (how many gradients the grader's hook, registered before the student's, had seen, and
/// whether backward was running), its buffers, and a reduce-scatter's padding at issue.
struct CallLog {
  /// One call at its issue.
  struct Issue {
    std::size_t ready = 0;                       ///< gradients ready then
    bool in_backward = false;                    ///< issued inside Model::backward
    const void* in = nullptr;                    ///< its input
    const void* out = nullptr;                   ///< its output
    std::optional<std::size_t> nonzero_padding;  ///< a reduce-scatter's first non-zero padding
  };

  /// Gradients made ready so far in this backward (the grader's hook counts them).
  std::size_t ready = 0;
  /// Every call, in issue order (the recorder's `calls()` has the same indices).
  std::vector<Issue> issues;

  /// Records through `recorder`; a reduce-scatter that writes bucket k's chunk of the shard
  /// of the gradient (`shard_gradients`, set once the optimizer exists) has its padding
  /// read from bucket k's E.
  void attach(grading::RecordingCommunicator& recorder, const std::vector<Bucket>& buckets) {
    recorder.set_issue_callback([this, &recorder, &buckets](std::size_t index,
                                                            const RecordedCall& call,
                                                            ConstBuffer in, MutableBuffer out) {
      issues.resize(index + 1);
      Issue& issue = issues[index];
      issue = {ready, recorder.in_backward(), in.data, out.data, std::nullopt};
      if (call.op != CommOp::kReduceScatter || shard_gradients == nullptr) return;
      // Read at issue, before any transport may.
      for (const Bucket& bucket : buckets)
        if (out.data == shard_gradients + bucket.shard_offset)
          issue.nonzero_padding = grading::first_nonzero(in, bucket.elements);
    });
  }

  /// Forgets the last step (with `recorder.forget_calls()`).
  void reset(grading::RecordingCommunicator& recorder) {
    recorder.forget_calls();
    issues.clear();
    ready = 0;
  }

  /// The first element of the student's shard of the gradient: compared, never read.
  const float* shard_gradients = nullptr;
};

/// The bytes this rank sends for one reduce-scatter and for one all-gather of every bucket
/// of the contract's sizes on `comm`, measured on scratch buffers (the backend's own count).
std::pair<std::uint64_t, std::uint64_t> bucket_collective_bytes(
    Communicator& comm, const std::vector<Bucket>& buckets) {
  const CommCounters before = comm.counters();
  const auto n = static_cast<std::size_t>(comm.size());
  for (const Bucket& b : buckets) {
    Tensor full({static_cast<std::int64_t>(n * b.chunk_elements)}, MemoryCategory::kOther,
                grading::check_device());
    Tensor chunk({static_cast<std::int64_t>(b.chunk_elements)}, MemoryCategory::kOther,
                 grading::check_device());
    comm.reduce_scatter(std::as_const(full).view(), chunk.view(), ReduceOp::kSum)->wait();
    comm.allgather(std::as_const(chunk).view(), full.view())->wait();
  }
  const CommCounters used = comm.counters().since(before);
  return {used.of(CommOp::kReduceScatter).bytes_sent, used.of(CommOp::kAllGather).bytes_sent};
}

/// The bytes this rank sends for reduce-scatters and all-gathers of the contract's bucket
/// sizes on `comm`, measured on scratch buffers (the backend's own count).
std::uint64_t contract_bytes_sent(Communicator& comm, const std::vector<Bucket>& buckets) {
  const auto [scatter_bytes, gather_bytes] = bucket_collective_bytes(comm, buckets);
  return scatter_bytes + gather_bytes;
}

/// "" when one step's calls (`calls`, `log`) are within the communication budget: each
/// bucket's reduce-scatter exactly once, launched during backward once its bucket is
/// complete, into its chunk of the shard of the gradient, padding zero; with clipping one
/// all-reduce of one float in step(); each bucket's chunk of the parameters all-gathered
/// exactly once in step(); nothing else. Which buffers carry them and in which order they
/// are waited on is the student's design.
std::string judge_calls(const std::vector<RecordedCall>& calls, const CallLog& log,
                        const std::vector<Bucket>& buckets, int world, bool clipping,
                        const float* shard_gradients, const float* shard_parameters) {
  const auto n = static_cast<std::size_t>(world);
  std::size_t total = 0;  // gradients ready when bucket k is complete: its parameters and earlier
  std::vector<std::size_t> complete_at;
  for (const Bucket& b : buckets) complete_at.push_back(total += b.parameters.size());
  std::vector<std::size_t> scattered(buckets.size(), 0);
  std::vector<std::size_t> gathered(buckets.size(), 0);
  std::size_t norms = 0;
  const auto unexpected = [&](std::size_t i, const std::string& why) {
    return fmt::format(
        "call {} of the step, {}, {}; expected per bucket one reduce-scatter (N C_k -> C_k, "
        "sum) during backward and one all-gather (C_k -> N C_k) in step(){}, nothing else "
        "(all the calls: {}){}",
        i, grading::describe(calls[i]), why,
        clipping ? ", and one all-reduce of one float in step()" : "", grading::describe(calls),
        grading::allreduces_a_buffer(calls)
            ? ": an all-reduce of gradients keeps the whole gradient on every rank; "
              "reduce-scatter each bucket into the shard"
            : "");
  };
  for (std::size_t i = 0; i < calls.size(); ++i) {
    const RecordedCall& call = calls[i];
    const CallLog::Issue& issue = log.issues.at(i);
    if (call.op == CommOp::kReduceScatter) {
      std::optional<std::size_t> bucket;
      for (std::size_t k = 0; k < buckets.size(); ++k)
        if (issue.out == shard_gradients + buckets[k].shard_offset) bucket = k;
      if (!bucket || call.in != n * buckets[*bucket].chunk_elements ||
          call.out != buckets[*bucket].chunk_elements || call.reduce != ReduceOp::kSum)
        return unexpected(i,
                          "which writes no bucket's chunk of shard_gradients() (at its shard "
                          "offset, N C_k -> C_k, sum)");
      const std::size_t k = *bucket;
      if (++scattered[k] > 1)
        return fmt::format(
            "bucket {}'s gradients were reduce-scattered twice in one step; "
            "expected exactly once",
            k);
      if (!issue.in_backward)
        return fmt::format(
            "bucket {}'s reduce-scatter was launched after backward returned; expected it "
            "launched during backward, once its bucket is complete, so that it travels while "
            "backward computes the rest",
            k);
      if (issue.ready < complete_at[k])
        return fmt::format(
            "bucket {}'s reduce-scatter was launched after gradient {} of {}; its bucket is "
            "complete only after gradient {} (launch a bucket once all its gradients are in)",
            k, issue.ready, total, complete_at[k]);
      if (issue.ready > complete_at[k])
        return fmt::format(
            "bucket {}'s reduce-scatter was launched after gradient {} of {}; its bucket was "
            "complete at gradient {}: launch it in the hook of its last gradient, so that it "
            "travels while the next layers' backward computes",
            k, issue.ready, total, complete_at[k]);
      if (issue.nonzero_padding)
        return fmt::format(
            "bucket {}'s reduce-scatter input has a non-zero padding element at issue (index "
            "{}, E = {}); expected the padding zero",
            k, *issue.nonzero_padding, buckets[k].elements);
    } else if (call.op == CommOp::kAllGather) {
      std::optional<std::size_t> bucket;
      for (std::size_t k = 0; k < buckets.size(); ++k)
        if (issue.in == shard_parameters + buckets[k].shard_offset) bucket = k;
      if (!bucket || call.in != buckets[*bucket].chunk_elements ||
          call.out != n * buckets[*bucket].chunk_elements)
        return unexpected(i,
                          "which reads no bucket's chunk of shard_parameters() (at its shard "
                          "offset, C_k -> N C_k)");
      if (++gathered[*bucket] > 1)
        return fmt::format(
            "bucket {}'s chunk of the parameters was all-gathered twice in one "
            "step; expected exactly once",
            *bucket);
      if (issue.in_backward) return unexpected(i, "issued during backward, before the update");
    } else if (call.op == CommOp::kAllReduce && clipping && call.in == 1 && call.out == 1 &&
               call.reduce == ReduceOp::kSum && !issue.in_backward) {
      if (++norms > 1) return unexpected(i, "a second all-reduce of the norm");
    } else {
      return unexpected(i, "which the budget has no room for");
    }
  }
  for (std::size_t k = 0; k < buckets.size(); ++k) {
    if (scattered[k] == 0)
      return fmt::format(
          "bucket {} of {} was never reduce-scattered; expected exactly once "
          "per step (all the calls: {})",
          k, buckets.size(), grading::describe(calls));
    if (gathered[k] == 0)
      return fmt::format(
          "bucket {} of {}'s chunk of the parameters was never all-gathered; "
          "expected exactly once per step (all the calls: {})",
          k, buckets.size(), grading::describe(calls));
  }
  if (clipping && norms == 0)
    return fmt::format(
        "no all-reduce of the norm's one float in step() with clipping on (all "
        "the calls: {})",
        grading::describe(calls));
  return "";
}

TEST(Lab6Communication, CallsAndBytesWithinBudget) {
  Draws draws("Lab6Communication.CallsAndBytesWithinBudget");
  const std::vector<int> worlds = draws.world_sizes(6);
  // A drawn MLP, then a tiny GPT, whose blocks' 12 gradients become ready together.
  std::vector<Training> trainings{draw_training(draws, draws.coin("adamw") ? "adamw" : "sgd")};
  draws.section("then a GPT:");
  trainings.push_back(draw_gpt_training(draws, draws.coin("gpt: adamw") ? "adamw" : "sgd"));
  for (const Training& training : trainings)
    for (int world : worlds) {
      run_on_ranks(
          world,
          [&](Communicator& comm, Verdict& verdict) {
            const TrainOptions options = training.for_world(world);
            const std::vector<Bucket> buckets =
                contract_buckets(training.model(), world, training.cap_bytes);
            const std::uint64_t expected_bytes = contract_bytes_sent(comm, buckets);
            const std::uint64_t ddp_bytes = grading::allreduce_bytes_sent(
                comm, std::vector<std::size_t>{training.model().num_parameters()});
            const std::uint64_t scalar_bytes =
                grading::allreduce_bytes_sent(comm, std::vector<std::size_t>{1});
            double ratio = 0;
            for (const float max_norm : {0.0f, 1.0f}) {
              Model model = training.model();
              grading::RecordingCommunicator recorder(comm);
              CallLog log;
              log.attach(recorder, buckets);
              model.on_gradient_ready([&](Parameter&) { ++log.ready; });  // before theirs
              ZeroTwoOptimizer zero(model, recorder, factory_for(options), training.cap_bytes,
                                    max_norm);
              // Compared, never read.
              const float* shard_gradients = zero.shard_gradients().view().data();
              const float* shard_parameters = zero.shard_parameters().view().data();
              log.shard_gradients = shard_gradients;
              const std::string label = max_norm > 0 ? "with clipping, " : "";
              for (int step = 1; step <= 2; ++step) {
                const Batch batch = grading::on_check_device(
                    grading::local_batch(*training.data, options, step - 1, comm.rank(), world));
                model.zero_grad();
                log.reset(recorder);
                const CommCounters before = comm.counters();
                recorder.set_in_backward(true);
                model.backward(grading::forward(model, batch), batch.labels);
                recorder.set_in_backward(false);
                (void)zero.step();
                const CommCounters used = comm.counters().since(before);
                if (!verdict.passed()) continue;
                const std::string finding =
                    judge_calls(recorder.calls(), log, buckets, world, max_norm > 0,
                                shard_gradients, shard_parameters);
                if (!finding.empty()) {
                  verdict.fail(fmt::format("{}step {} ({} buckets): {}", label, step,
                                           buckets.size(), finding));
                  continue;
                }
                const std::uint64_t grad_bytes = used.of(CommOp::kReduceScatter).bytes_sent +
                                                 used.of(CommOp::kAllGather).bytes_sent;
                if (grad_bytes != expected_bytes ||
                    used.of(CommOp::kAllReduce).bytes_sent != (max_norm > 0 ? scalar_bytes : 0))
                  verdict.fail(fmt::format(
                      "{}step {}: the backend counted {} bytes sent by reduce-scatters and "
                      "all-gathers and {} by all-reduce; expected {} for the buckets' calls{}",
                      label, step, grad_bytes, used.of(CommOp::kAllReduce).bytes_sent,
                      expected_bytes,
                      max_norm > 0 ? fmt::format(" and {} for the norm's one float", scalar_bytes)
                                   : " and none by all-reduce"));
                if (ddp_bytes > 0)
                  ratio = static_cast<double>(grad_bytes) / static_cast<double>(ddp_bytes);
              }
            }
            if (verdict.passed())
              verdict.note(fmt::format(
                  "{}: {} reduce-scatters launched during backward, then {} all-gathers; on N = "
                  "{} they sent {:.4f}x DDP's all-reduce bytes (the padding)",
                  training.model_name(), buckets.size(), buckets.size(), world,
                  world > 1 ? ratio : 1.0));
          },
          draws);
    }
}

// --- Lab6Speed -----------------------------------------------------------------------------

/// Seconds of the reduce-scatters' time on the link (rank `trace`'s) that overlap the
/// model's own backward: each layer's and the loss's backward, counted once (the first
/// event of its name). Compute the lab adds (copies into buffers, anything it runs to pass
/// the time) hides nothing.
double behind_model_backward(const RankTrace& trace) {
  std::vector<std::pair<double, double>> model;  // (start, end) of the model's own backward
  std::vector<std::string> seen;
  for (const TraceEvent& event : trace.events) {
    if (event.lane != TraceLane::kCompute || !event.name.ends_with(" backward")) continue;
    if (std::find(seen.begin(), seen.end(), event.name) != seen.end()) continue;
    seen.push_back(event.name);
    model.emplace_back(event.start, event.start + event.duration);
  }
  double overlap = 0;
  for (const TraceEvent& event : trace.events) {
    if (event.name != "reduce_scatter" || event.lane == TraceLane::kCompute) continue;
    for (const auto& [start, end] : model)  // compute ops of one rank never overlap each other
      overlap +=
          std::max(0.0, std::min(end, event.start + event.duration) - std::max(start, event.start));
  }
  return overlap;
}

/// The time budget: at least this fraction of the reduce-scatters' time on the link hidden
/// (their waits block for at most the rest) and overlapping the model's own backward.
constexpr double kHiddenFraction = 0.5;

/// Runs one step of `depth` hidden layers of `hidden` on `world` simulated ranks (10 GbE, a
/// CPU-class device), `rows` rows per rank, and fails unless the student's optimizer hides
/// kHiddenFraction of its reduce-scatters behind the model's own backward, and leaves lab
/// 2's parameters bitwise on every rank (emulated in one process, compared once the step's
/// timing is read). `prefix` names the shape's own draws.
void judge_hidden_reduce_scatters(Draws& draws, int world, std::int64_t hidden, std::int64_t depth,
                                  std::int64_t rows, const std::string& prefix) {
  const TrainOptions options =
      grading::equal_layers_sgd_step(draws, hidden, depth, rows, world, prefix);
  const std::size_t cap_bytes = 4 * static_cast<std::size_t>(hidden * hidden + hidden);
  const Dataset data = load_dataset(options.dataset, 1);
  const LaunchOptions launch_options = grading::simulated_launch(draws, world, "10gbe", "cpu");
  grading::TimedRunNumbers numbers(grading::speed_workload_parameters(options, data, world, 1));
  std::size_t scatters = 0;
  double on_link = 0;
  double exposed = 0;
  double behind_model = 0;
  double step_seconds = 0;
  std::size_t buckets = 0;
  try {
    launch(launch_options, [&](Communicator& comm) {
      Model model = grading::make_check_model(options);
      grading::WaitTimer timer(comm);
      ZeroTwoOptimizer zero(model, timer, factory_for(options), cap_bytes);
      const Batch batch =
          grading::on_check_device(grading::local_batch(data, options, 0, comm.rank(), world));
      detail::charging_clock(comm).mark_step();
      model.backward(grading::forward(model, batch), batch.labels);
      (void)zero.step();
      detail::charging_clock(comm).mark_step();
      if (comm.rank() == 0) {
        const RankTrace trace = comm.clock().trace();
        for (const TraceEvent& event : trace.events)
          if (event.lane != TraceLane::kCompute && event.name == "reduce_scatter")
            on_link += event.duration;
        scatters = timer.scatters;
        exposed = timer.scatters_exposed;
        behind_model = behind_model_backward(trace);
        step_seconds = summarize_steps(trace).back().total;
        buckets = zero.buckets().size();
      }
      numbers.compare_parameters(fmt::format("ZeroTwoOptimizer, a cap of {} bytes", cap_bytes),
                                 comm.rank(), model, 1);
    });
  } catch (const NotImplemented&) {
    throw;
  } catch (const std::exception& error) {
    FAIL() << fmt::format("on {} simulated ranks a rank failed with {}: {}\n  drawn: {}", world,
                          grading::type_name(error), error.what(), draws.describe());
  }
  if (!numbers.report(
          fmt::format("on {} ranks (10gbe, cpu), {}, {} rows per rank", world, options.model, rows),
          draws))
    return;
  ASSERT_GT(on_link, 0.0) << "no reduce-scatter reached the simulated clock";
  // A wait can block longer than its call's time on the link: it also waits for the other
  // ranks to issue theirs. Then nothing was hidden.
  const double hidden_fraction = std::max(0.0, 1.0 - exposed / on_link);
  const double behind_fraction = behind_model / on_link;
  if (hidden_fraction < kHiddenFraction)
    ADD_FAILURE() << fmt::format(
        "on {} ranks (10gbe, cpu), {} with a cap of {} bytes ({} buckets): {} reduce-scatters "
        "took {:.3f} ms on the link and the waits on them (wait(), test() or destroying the "
        "Work) blocked {:.3f} ms: {:.0f}% hidden; expected at least {:.0f}% (wait for a "
        "reduce-scatter only when its buffer is needed again or in step(), so that it travels "
        "while the next layers' backward computes)\n  drawn: {}",
        world, options.model, cap_bytes, buckets, scatters, on_link * 1e3, exposed * 1e3,
        100 * hidden_fraction, 100 * kHiddenFraction, draws.describe());
  else if (behind_fraction < kHiddenFraction)
    ADD_FAILURE() << fmt::format(
        "on {} ranks (10gbe, cpu), {} with a cap of {} bytes ({} buckets): the waits on {} "
        "reduce-scatters blocked {:.3f} ms of their {:.3f} ms on the link, but only {:.3f} ms "
        "({:.0f}%) of that time overlapped the model's own backward; expected at least "
        "{:.0f}%. Compute your code adds (copies, work to pass the time) makes the step longer "
        "and hides nothing: launch each bucket while backward still has layers to compute\n"
        "  drawn: {}",
        world, options.model, cap_bytes, buckets, scatters, exposed * 1e3, on_link * 1e3,
        behind_model * 1e3, 100 * behind_fraction, 100 * kHiddenFraction, draws.describe());
  else
    grading::note_measured(fmt::format(
        "{} ranks on 10gbe, {}, {} buckets: {} reduce-scatters, {:.3f} ms on the link, {:.3f} "
        "ms exposed: {:.0f}% hidden, {:.0f}% behind the model's own backward (step {:.3f} ms)",
        world, options.model, buckets, scatters, on_link * 1e3, exposed * 1e3,
        100 * hidden_fraction, 100 * behind_fraction, step_seconds * 1e3));
}

TEST(Lab6Speed, HidesHalfTheReduceScatters) {
  Draws draws("Lab6Speed.HidesHalfTheReduceScatters");
  // 4 to 8 ranks on 10 GbE, a CPU-class device, an MLP of 10 to 14 hidden layers 64-h-...-h-10
  // (h in [512, 768]), 48 to 64 rows per rank and a cap of one hidden layer (h^2 + h elements): a
  // bucket is about one layer, and its ring reduce-scatter on 8 ranks (7 (alpha + h^2 / 2
  // bytes at 1.25 GB/s)) takes about as long as a hidden layer's backward (4 rows h^2 FLOPs
  // at 50 GFLOP/s) and several times a copy of its gradient into a buffer (8 h^2 bytes at
  // 20 GB/s). So only reduce-scatters left to travel while the next layers' backward
  // computes hide themselves, and they must: on a fabric fast enough to finish during the
  // copies, no design would have anything to hide.
  // The world size and the depth are drawn, and a second shape differs from the first in
  // both, so that a design that recognises one shape of this check fails on the other: a
  // student trial double-buffered only on 8 ranks and 26 parameters or more, and passed on
  // the draws of 8 ranks and 12 hidden layers or more (about 9% of seeds) when the check
  // judged one shape. At least 10 layers: with 8, the last buckets' reduce-scatters, which
  // nothing is left to hide, took half the time on the link, and correct designs other than
  // the reference's (one_ring_of_two_buckets, reduce_scatters_into_a_landing) hid 48-50%
  // behind the model's backward.
  const auto world = static_cast<int>(draws.integer("ranks", 4, 8));
  const std::int64_t hidden = draws.integer("hidden", 512, 768);
  const std::int64_t depth = draws.integer("hidden layers", 10, 14);
  const std::int64_t rows = draws.integer("rows per rank", 48, 64);
  judge_hidden_reduce_scatters(draws, world, hidden, depth, rows, "");
  // The second shape's, drawn after the first's: one of the other values in each range.
  auto other_world = static_cast<int>(draws.integer("second shape: ranks", 4, 7));
  std::int64_t other_depth = draws.integer("second shape: hidden layers", 10, 13);
  if (other_world >= world) ++other_world;
  if (other_depth >= depth) ++other_depth;
  draws.overrule("second shape: ranks", fmt::format("second shape: ranks={}", other_world));
  draws.overrule("second shape: hidden layers",
                 fmt::format("second shape: hidden layers={}", other_depth));
  judge_hidden_reduce_scatters(draws, other_world, hidden, other_depth, rows, "second shape: ");
}

// --- Lab6Design ----------------------------------------------------------------------------

/// A plausible wrong answer to the design question, and what it predicts.
struct WrongFormula {
  std::string what;
  std::size_t bytes = 0;
};

// The design question's answer for the reference design and the plausible wrong formulas
// name a near miss in the feedback, and the check fails as a grader bug where its draws do
// not tell one from the answer. Each is the answer with one term changed, so reading them
// gives it away: they live in instructor/gradient_peak_formulas.h, which the student release
// leaves out. There the check grades the same (against the MemoryTracker's peaks, which are
// the answer, on the same drawn layouts) and names no near miss.
#if __has_include("instructor/gradient_peak_formulas.h")
#include "instructor/gradient_peak_formulas.h"
#else
std::pair<std::size_t, std::vector<WrongFormula>> design_formulas(Model&, int, std::size_t) {
  return {};
}
constexpr std::string_view kReferenceDesignInWords;
#endif

/// Whether `model` on one of `worlds` ranks with a cap of `cap` bytes has the layout where
/// the plausible wrong formulas part from the rule: three buckets or more on some N, a
/// shard S other than ceil(Psi / N) on some N, and a largest bucket that pads on some N.
/// From the contract's quantities alone, so that the draws are the same with or without the
/// instructors' formulas.
bool parts_the_formulas(Model& model, const std::vector<int>& worlds, std::size_t cap) {
  bool several_buckets = false;
  bool shard_of_its_own = false;
  bool largest_pads = false;
  for (int world : worlds) {
    const std::vector<Bucket> buckets = contract_buckets(model, world, cap);
    const auto n = static_cast<std::size_t>(world);
    std::size_t largest = 0;
    for (const Bucket& bucket : buckets) largest = std::max(largest, bucket.elements);
    several_buckets = several_buckets || buckets.size() > 2;
    shard_of_its_own =
        shard_of_its_own || contract_shard(buckets) != (model.num_parameters() + n - 1) / n;
    largest_pads = largest_pads || largest != largest_padded_bucket(buckets, world);
  }
  return several_buckets && shard_of_its_own && largest_pads;
}

TEST(Lab6Design, PredictsGradientPeakBytes) {
  Draws draws("Lab6Design.PredictsGradientPeakBytes");
  const std::vector<int> worlds = draws.world_sizes(8);
  // Which wrong formulas some layout below tells from the right one (the draws make sure
  // every one is, where more than one rank is drawn: a grader bug otherwise).
  Model smallest = Model::mlp("64-8-8-10", {});
  std::vector<bool> separated(design_formulas(smallest, 1, 0).second.size(), false);
  for (int m = 0; m < 2; ++m) {
    std::int64_t h1 = draws.integer("h1", 8, 96);
    std::int64_t h2 = draws.integer("h2", 8, 64);
    const bool layer_norm = draws.coin("layer norm");
    const auto layout = [&] {
      return Model::mlp(fmt::format("64-{}-{}-10", h1, h2),
                        {.activation = "relu", .layer_norm = layer_norm, .seed = 3});
    };
    // The first model has three buckets or more (a cap below h1 x h2 elements), where one
    // buffer per bucket is one too many, the second one bucket (a cap above its size), where
    // two buffers are one too many and a bucket's gradients are not a layer's.
    std::size_t cap = 0;
    const auto separates = [&](std::vector<bool>& seen) {
      Model model = layout();
      for (int world : worlds) {
        const auto [right, wrong] = design_formulas(model, world, cap);
        for (std::size_t f = 0; f < wrong.size(); ++f)
          if (wrong[f].bytes != right) seen[f] = true;
      }
    };
    if (m == 0) {
      const std::int64_t cap_elements = draws.integer("cap elements", 0, h1 * h2);
      cap = 4 * static_cast<std::size_t>(cap_elements);
      // Three buckets or more, and padding where lab 5's shard and the unpadded buffers part
      // from the rule: the next widths in order, h2 first, until some drawn N shows all
      // three (as drawn on most seeds).
      const std::int64_t drawn1 = h1;
      const std::int64_t drawn2 = h2;
      const auto shows_all = [&] {
        Model model = layout();
        return parts_the_formulas(model, worlds, cap);
      };
      for (int tries = 0; worlds.back() > 1 && !shows_all() && tries < 89 * 57; ++tries) {
        h2 = h2 < 64 ? h2 + 1 : 8;
        if (h2 == drawn2) h1 = h1 < 96 ? h1 + 1 : 8;
      }
      if (h1 != drawn1)
        draws.overrule("h1", fmt::format("h1={} (drawn {}; set by the check)", h1, drawn1));
      if (h2 != drawn2)
        draws.overrule("h2", fmt::format("h2={} (drawn {}; set by the check)", h2, drawn2));
    } else {
      cap = 4 * (layout().num_parameters() +
                 static_cast<std::size_t>(draws.integer("cap above the model", 0, 1000)));
    }
    separates(separated);
    const std::string spec = fmt::format("64-{}-{}-10", h1, h2);
    for (int world : worlds) {
      const TrainOptions options = grading::design_training(spec, layer_norm, world);
      const Trajectory exact =
          grading::emulate_data_parallel(options, grading::design_data(), world);
      run_on_ranks(
          world,
          [&](Communicator& comm, Verdict& verdict) {
            MemoryTracker& tracker = this_rank_memory().tracker();
            const std::size_t grad_base = tracker.current(MemoryCategory::kGradients);
            const std::size_t comm_base = tracker.current(MemoryCategory::kCommunication);
            Model model = grading::make_check_model(options);
            const std::size_t psi = model.num_parameters();
            const std::size_t buckets = contract_buckets(model, world, cap).size();
            const auto [reference, wrong] = design_formulas(model, world, cap);
            const std::size_t predicted = predicted_gradient_peak_bytes(model, world, cap);
            std::size_t bytes = 0;
            std::size_t gradient_peak = 0;
            std::size_t communication_peak = 0;
            std::string numbers;  // the parameters after the step, where they differ
            {
              const Batch batch = grading::on_check_device(
                  grading::local_batch(grading::design_data(), options, 0, comm.rank(), world));
              ZeroTwoOptimizer zero(model, comm, factory_for(options), cap);
              tracker.reset_peaks();
              model.backward(grading::forward(model, batch), batch.labels);
              (void)zero.step();
              gradient_peak = tracker.peak(MemoryCategory::kGradients) - grad_base;
              communication_peak = tracker.peak(MemoryCategory::kCommunication) - comm_base;
              bytes = gradient_peak + communication_peak;
              // Read from the host copy of the values, once the peaks are read.
              numbers = compare_measured_step(model, exact, 1, "lab 2's arithmetic",
                                              "the design check's run");
            }
            if (!verdict.passed()) return;
            // Every plausible mistake the prediction equals, by the mistake alone: on some
            // layouts several give the same number (at a small cap a bucket is one parameter),
            // and naming only the first would point at the wrong one.
            std::vector<std::string> mistakes;
            for (const WrongFormula& formula : wrong)
              if (predicted == formula.bytes && bytes != formula.bytes &&
                  formula.bytes != reference)
                mistakes.push_back(formula.what);
            std::string hint;
            if (mistakes.size() == 1)
              hint = fmt::format("; that is the reference design ({}) counted with {}",
                                 kReferenceDesignInWords, mistakes.front());
            else if (mistakes.size() > 1)
              hint = fmt::format(
                  "; that is the reference design ({}) counted with {} (on this layout they "
                  "coincide)",
                  kReferenceDesignInWords, fmt::join(mistakes, ", or with "));
            if (predicted != bytes)
              verdict.fail(fmt::format(
                  "{}{} on N = {}, cap {} bytes ({} bucket{}): predicted {} bytes; expected what "
                  "the MemoryTracker measured, the peak of kGradients ({} bytes) plus the peak "
                  "of kCommunication ({} bytes) over one backward and one step, each the "
                  "category's whole value from just after the constructor: {} ({:+} bytes){}",
                  spec, layer_norm ? " with LayerNorm" : "", world, cap, buckets,
                  buckets == 1 ? "" : "s", predicted, gradient_peak, communication_peak, bytes,
                  static_cast<std::int64_t>(predicted) - static_cast<std::int64_t>(bytes), hint));
            else if (!numbers.empty())
              verdict.fail(fmt::format("{}{} on N = {}, cap {} bytes: {}", spec,
                                       layer_norm ? " with LayerNorm" : "", world, cap, numbers));
            else
              verdict.note(fmt::format(
                  "Psi = {} on N = {}, {} bucket{}: gradient peak {} bytes per rank ({:.2f} "
                  "bytes per parameter) against lab 4's 8 Psi = {}, predicted exactly",
                  psi, world, buckets, buckets == 1 ? "" : "s", bytes,
                  static_cast<double>(bytes) / static_cast<double>(psi), 8 * psi));
          },
          draws);
    }
  }
  // With N = 1 and 2 only (mpi with 2 processes) an even largest bucket never pads, whatever
  // the widths; the local backend always draws N of 3, 5 or 6, and there every formula must
  // be told apart.
  if (std::any_of(worlds.begin(), worlds.end(), [](int n) { return n >= 3; })) {
    const std::vector<WrongFormula> wrong = design_formulas(smallest, 1, 0).second;
    for (std::size_t f = 0; f < wrong.size(); ++f)
      if (!separated[f])
        ADD_FAILURE() << fmt::format(
            "grader bug: no drawn layout tells the memory rule from {}\n({})", wrong[f].what,
            draws.describe());
  }
  if (!separated.empty())
    grading::note_measured(fmt::format(
        "the layouts (several buckets, one bucket) and world sizes tell the memory rule from {} "
        "plausible wrong formulas",
        separated.size()));
}

// --- Lab6Accumulation ----------------------------------------------------------------------

std::string_view strategy_name(Accumulation accumulation) {
  return accumulation == Accumulation::kReduceOnce ? "kReduceOnce" : "kReduceEveryMicroBatch";
}

constexpr std::array<Accumulation, 2> kStrategies = {Accumulation::kReduceEveryMicroBatch,
                                                     Accumulation::kReduceOnce};

/// `training` on `world` ranks with `micro` micro-batches per step, each micro-batch as many
/// rows per rank as a step has without accumulation.
TrainOptions accumulation_options(const Training& training, int world, int micro) {
  TrainOptions options = training.for_world(world);
  options.global_batch = training.rows_per_rank * world * micro;
  return options;
}

/// lab6.h's arithmetic of gradient accumulation, in one process: each rank's micro-batch
/// gradients from one backward each with loss scale 1 (`kReduceEveryMicroBatch`: summed over
/// the ranks in rank order per micro-batch, then over the micro-batches in order) or added
/// by `Model::backward` into the gradient, micro-batch after micro-batch (`kReduceOnce`:
/// then summed over the ranks in rank order); then one division by the float N M and the
/// optimizer's step over the whole flat space.
Trajectory emulate_accumulation(const TrainOptions& options, const Dataset& data, int world,
                                int micro, Accumulation strategy) {
  Model model = grading::make_check_model(options);
  const std::unique_ptr<Optimizer> optimizer =
      grading::optimizer_for(options, model.num_parameters());
  Model probe = grading::make_check_model(options);
  const auto backward = [&probe](const Batch& batch) {
    const Tensor logits = probe.forward(batch.inputs.to(probe.device()));
    probe.backward(logits, batch.labels);
  };
  Trajectory trajectory;
  for (int step = 0; step < options.steps; ++step) {
    probe.set_flat_parameters(model.flat_parameters());
    std::vector<std::vector<Batch>> batches;  // per rank, its micro-batches in order
    for (int rank = 0; rank < world; ++rank)
      batches.push_back(grading::micro_batches(data, options, step, rank, world, micro));
    std::vector<float> sum;
    if (strategy == Accumulation::kReduceOnce) {
      std::vector<std::vector<float>> local;
      for (int rank = 0; rank < world; ++rank) {
        probe.zero_grad();
        for (const Batch& batch : batches[static_cast<std::size_t>(rank)]) backward(batch);
        local.push_back(probe.flat_gradients());
      }
      sum = grading::sum_in_rank_order(local);
    } else {
      for (int m = 0; m < micro; ++m) {
        std::vector<std::vector<float>> local;
        for (int rank = 0; rank < world; ++rank) {
          probe.zero_grad();
          backward(batches[static_cast<std::size_t>(rank)][static_cast<std::size_t>(m)]);
          local.push_back(probe.flat_gradients());
        }
        std::vector<float> of_micro_batch = grading::sum_in_rank_order(local);
        if (m == 0) {
          sum = std::move(of_micro_batch);
        } else {
          for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += of_micro_batch[i];
        }
      }
    }
    const auto divisor = static_cast<float>(world * micro);
    for (float& value : sum) value = value / divisor;
    for (Parameter* parameter : model.parameters())
      copy(ConstTensorView(sum.data() + parameter->offset, parameter->grad.size()),
           parameter->grad.view());
    trajectory.gradients_of_step.push_back(std::move(sum));
    optimizer->step(model);
    trajectory.parameters_after_step.push_back(model.flat_parameters());
  }
  return trajectory;
}

/// Trains this rank with the student's optimizer, `micro` micro-batches per step with
/// `strategy`, comparing every step with `exact` bitwise.
void train_accumulating(const Training& training, int micro, Accumulation strategy,
                        Communicator& comm, Verdict& verdict, const Trajectory& exact) {
  const TrainOptions options = accumulation_options(training, comm.size(), micro);
  train_and_compare(
      training, comm, verdict, exact,
      {.options = options,
       .accumulation = {.micro_batches = micro, .accumulation = strategy},
       .what = fmt::format("{} with M = {} micro-batches, {}, cap {} bytes",
                           strategy_name(strategy), micro, options.optimizer, training.cap_bytes),
       .order = fmt::format(
           "lab6.h: {}, then one division by N M = {}",
           strategy == Accumulation::kReduceOnce
               ? "each rank's micro-batches added by backward in order, then summed over the "
                 "ranks in rank order"
               : "each micro-batch summed over the ranks in rank order, then the micro-batches "
                 "summed in order",
           comm.size() * micro)});
}

TEST(Lab6Accumulation, BitwiseEachStrategy) {
  Draws draws("Lab6Accumulation.BitwiseEachStrategy");
  const std::vector<int> worlds = draws.world_sizes(6);
  const Training training = draw_training(draws, draws.coin("adamw") ? "adamw" : "sgd");
  for (const Accumulation strategy : kStrategies) {
    for (const int micro : {1, 2, 3}) {
      for (const int world : worlds) {
        const TrainOptions options = accumulation_options(training, world, micro);
        const Trajectory exact =
            emulate_accumulation(options, *training.data, world, micro, strategy);
        run_on_ranks(
            world,
            [&](Communicator& comm, Verdict& verdict) {
              train_accumulating(training, micro, strategy, comm, verdict, exact);
            },
            draws);
      }
    }
  }
  // Misuse with M = 2: no micro-batch count below 1, no step() after one backward, no
  // third backward before step(). Every rank throws at the same point, so they stay in step.
  for (const int world : worlds) {
    run_on_ranks(
        world,
        [&](Communicator& comm, Verdict& verdict) {
          const TrainOptions options = accumulation_options(training, world, 2);
          const auto expect_error = [&](const std::string& what, const auto& call) {
            try {
              call();
              verdict.fail(fmt::format("{}: the call returned; expected dp::Error", what));
            } catch (const NotImplemented&) {
              throw;
            } catch (const Error&) {
            }
          };
          Model model = training.model();
          expect_error("AccumulationOptions{.micro_batches = 0}", [&] {
            ZeroTwoOptimizer zero(model, comm, factory_for(options), training.cap_bytes, 0.0f,
                                  {.micro_batches = 0});
          });
          // Every rank makes every call whatever it found, so that none waits for a peer
          // that stopped.
          for (const Accumulation strategy : kStrategies) {
            Model fresh = training.model();
            ZeroTwoOptimizer zero(fresh, comm, factory_for(options), training.cap_bytes, 0.0f,
                                  {.micro_batches = 2, .accumulation = strategy});
            accumulate_step(fresh, training, options, 1, 1, comm.rank(), world);
            expect_error(
                fmt::format("{}, M = 2: step() after one backward", strategy_name(strategy)),
                [&] { (void)zero.step(); });
            accumulate_step(fresh, training, options, 1, 2, comm.rank(), world);
            expect_error(
                fmt::format("{}, M = 2: a third backward before step()", strategy_name(strategy)),
                [&] { accumulate_step(fresh, training, options, 2, 1, comm.rank(), world); });
          }
        },
        draws);
  }
  if (!HasFailure())
    grading::note_measured(fmt::format(
        "M = 1, 2 and 3 micro-batches, both strategies, on world sizes {}: every rank bitwise "
        "the contract's arithmetic after every step (the two strategies add in different "
        "orders); M = 0, step() after too few backwards and one backward too many throw",
        fmt::join(worlds, ", ")));
}

/// The budgets of lab6.h for `micro` micro-batches with `strategy`: (kGradients,
/// kCommunication) at the peak, clipping off.
std::pair<std::size_t, std::size_t> accumulation_budgets(Model& model,
                                                         const std::vector<Bucket>& buckets,
                                                         int world, int micro,
                                                         Accumulation strategy) {
  const std::size_t shard = 4 * contract_shard(buckets);
  std::size_t chunk = 0;
  for (const Bucket& b : buckets) chunk = std::max(chunk, b.chunk_elements);
  if (micro > 1 && strategy == Accumulation::kReduceOnce)
    return {shard + 4 * model.num_parameters(), buffer_budget_bytes(buckets, world)};
  return {shard + 4 * largest_layer(model),
          buffer_budget_bytes(buckets, world) + (micro > 1 ? 2 * 4 * chunk : 0)};
}

/// The memory budgets of one rank training `micro` micro-batches per step with `strategy`
/// for two steps: the peaks of kGradients and kCommunication, the tensors a step allocates,
/// step() allocating nothing, and every category but the activations as after the
/// constructor between steps; and the parameters after each step bitwise `exact`'s (the
/// strategy's arithmetic, emulate_accumulation). Returns the peaks (gradients +
/// communication) for the note.
std::size_t check_accumulation_memory(const Training& training, int micro, Accumulation strategy,
                                      const Trajectory& exact, Communicator& comm,
                                      Verdict& verdict) {
  const int world = comm.size();
  const TrainOptions options = accumulation_options(training, world, micro);
  MemoryTracker& tracker = this_rank_memory().tracker();
  const std::size_t grad_base = tracker.current(MemoryCategory::kGradients);
  const std::size_t comm_base = tracker.current(MemoryCategory::kCommunication);
  Model model = training.model();
  const std::vector<Bucket> buckets = contract_buckets(model, world, training.cap_bytes);
  const auto [grad_budget, comm_budget] =
      accumulation_budgets(model, buckets, world, micro, strategy);
  const std::string what =
      fmt::format("{} with M = {} on N = {}", strategy_name(strategy), micro, world);
  ZeroTwoOptimizer zero(model, comm, factory_for(options), training.cap_bytes, 0.0f,
                        {.micro_batches = micro, .accumulation = strategy});
  const grading::CategoryBytes constructed = grading::current_bytes(tracker);
  tracker.reset_peaks();
  const std::size_t parameters = model.parameters().size();
  const std::size_t expected_gradients = strategy == Accumulation::kReduceOnce
                                             ? parameters
                                             : static_cast<std::size_t>(micro) * parameters;
  // The first allocation found wrong, reported after the peaks (the lesson comes first).
  std::string allocations;
  std::string numbers;  // the first step whose parameters differ from the contract's
  // Every rank runs both steps whatever it found, so that none waits for a peer that stopped.
  for (int step = 1; step <= kMeasuredSteps; ++step) {
    std::array<std::size_t, kNumMemoryCategories> before{};
    for (std::size_t c = 0; c < kNumMemoryCategories; ++c)
      before[c] = tracker.allocations(static_cast<MemoryCategory>(c));
    accumulate_step(model, training, options, step, micro, comm.rank(), world);
    const std::size_t tensors = tracker.allocations_total();
    const grading::HeapUse heap = grading::heap_use_of_this_thread();
    (void)zero.step();
    const grading::HeapUse used = grading::heap_use_of_this_thread().since(heap);
    const std::size_t in_step = tracker.allocations_total() - tensors;
    // Read from the host copy of the values (no tensor, no tracker account), after the
    // heap of step() was read.
    if (numbers.empty())
      numbers = compare_measured_step(model, exact, step, "the strategy's arithmetic");
    const auto made = [&](MemoryCategory c) {
      return tracker.allocations(c) - before[static_cast<std::size_t>(c)];
    };
    if (!verdict.passed()) continue;
    const std::size_t grads = made(MemoryCategory::kGradients);
    const std::size_t others = made(MemoryCategory::kCommunication) +
                               made(MemoryCategory::kParameters) +
                               made(MemoryCategory::kOptimizerState);
    verdict.expect_empty(check_released(model), fmt::format("{}, after step {}", what, step));
    if (!allocations.empty()) continue;
    if (in_step != 0 || used.large_bytes != 0)
      allocations = fmt::format(
          "{}, step {}: step() allocated {} tensor(s) and {} bytes in blocks of {} bytes or more "
          "from the heap; expected none",
          what, step, in_step, used.large_bytes, grading::kLargeAllocationBytes);
    else if (grads != expected_gradients || others != 0)
      allocations = fmt::format(
          "{}, step {}: the {} backwards and step() allocated {} gradient tensor(s) and {} "
          "parameter, optimizer-state or communication tensor(s); expected {} ({} per parameter: "
          "{}) and nothing else",
          what, step, micro, grads, others, expected_gradients, expected_gradients / parameters,
          strategy == Accumulation::kReduceOnce
              ? "the gradients stay between the micro-batches, backward adds into them"
              : "each micro-batch's gradients released in their hooks and made again");
  }
  if (!verdict.passed()) return 0;
  grading::CategoryBytes kept = grading::current_bytes(tracker) - constructed;
  kept[MemoryCategory::kActivations] = 0;
  const std::string changed = grading::category_differences(kept, {});
  const std::size_t grad_peak = tracker.peak(MemoryCategory::kGradients) - grad_base;
  const std::size_t comm_peak = tracker.peak(MemoryCategory::kCommunication) - comm_base;
  const std::size_t psi = model.num_parameters();
  if (!changed.empty())
    verdict.fail(
        fmt::format("{}: after two steps, against just after the constructor: {}; "
                    "expected every category as it was",
                    what, changed));
  else if (grad_peak > grad_budget)
    verdict.fail(fmt::format(
        "{}: gradient bytes at the peak {}; the budget is {} = {} (S = {}, Psi = {}, largest "
        "layer {} elements){}",
        what, grad_peak,
        strategy == Accumulation::kReduceOnce && micro > 1 ? "4 S + 4 Psi" : "4 S + 4 L",
        grad_budget, contract_shard(buckets), psi, largest_layer(model),
        grad_peak >= 4 * contract_shard(buckets) + 4 * psi
            ? ": the whole gradient stayed between the micro-batches (release each gradient in "
              "its hook, and keep only the sum of the shard)"
            : ""));
  else if (comm_peak > comm_budget)
    verdict.fail(fmt::format(
        "{}: communication bytes at the peak {}; the budget is {} = {} ({} "
        "buckets){}",
        what, comm_peak,
        micro > 1 && strategy == Accumulation::kReduceEveryMicroBatch ? "2 x 4 (P + C_max)"
                                                                      : "2 x 4 P",
        comm_budget, buckets.size(),
        comm_peak >= 4 * psi ? ": as much as the whole gradient" : ""));
  else if (!allocations.empty())
    verdict.fail(allocations);
  else if (!numbers.empty())
    verdict.fail(fmt::format("{}: {}", what, numbers));
  return grad_peak + comm_peak;
}

TEST(Lab6Accumulation, MemoryWithinBudgetEachStrategy) {
  Draws draws("Lab6Accumulation.MemoryWithinBudgetEachStrategy");
  const std::vector<int> worlds = draws.world_sizes(6);
  const Training training = draw_training(draws, draws.coin("adamw") ? "adamw" : "sgd");
  const int micro = static_cast<int>(draws.integer("micro-batches", 2, 4));
  // The drawn MLPs, whose first layer holds most of the parameters (there the buffers of
  // the largest bucket cost about as much as the whole gradient), then the lesson's
  // workload, many equal hidden layers with a cap of one layer, on 4 and 8 local ranks.
  Training blocks = training;
  const std::int64_t hidden = draws.integer("equal blocks: width", 64, 96);
  const std::int64_t layers = draws.integer("equal blocks: hidden layers", 8, 12);
  std::string spec = "64";
  for (std::int64_t l = 0; l < layers; ++l) spec += fmt::format("-{}", hidden);
  blocks.options.model = spec + "-10";
  blocks.options.layer_norm = false;
  blocks.options.activation = "relu";
  blocks.cap_bytes = 4 * static_cast<std::size_t>(hidden * hidden + hidden);
  struct Case {
    const Training* training;
    int world;
    bool local;
  };
  std::vector<Case> cases;
  for (const int world : worlds) cases.push_back({&training, world, false});
  for (const int world : {4, 8}) cases.push_back({&blocks, world, true});
  for (const Case& run : cases) {
    std::array<std::size_t, 2> peaks{};
    for (std::size_t s = 0; s < kStrategies.size(); ++s) {
      TrainOptions options = accumulation_options(*run.training, run.world, micro);
      options.steps = kMeasuredSteps;
      const Trajectory exact =
          emulate_accumulation(options, *run.training->data, run.world, micro, kStrategies[s]);
      const auto check = [&](Communicator& comm, Verdict& verdict) {
        const std::size_t peak =
            check_accumulation_memory(*run.training, micro, kStrategies[s], exact, comm, verdict);
        if (comm.rank() == 0) peaks[s] = peak;
      };
      if (run.local)
        run_on_ranks(run.world, check, draws, std::chrono::seconds(30), Backend::kLocal);
      else
        run_on_ranks(run.world, check, draws);
    }
    if (!HasFailure())
      grading::note_measured(fmt::format(
          "{}, N = {}, M = {}, Psi = {}: gradient and communication bytes at the peak {} "
          "reducing every micro-batch, {} reducing once ({:.2f}x)",
          run.training->options.model, run.world, micro, run.training->model().num_parameters(),
          peaks[0], peaks[1],
          peaks[0] == 0 ? 0.0 : static_cast<double>(peaks[1]) / static_cast<double>(peaks[0])));
  }
}

/// "" when one step's calls are lab6.h's for `micro` micro-batches with `strategy`:
/// `per_backward[m]` holds the calls issued during backward m, `in_step` those of step().
std::string judge_accumulation_calls(const std::vector<std::vector<RecordedCall>>& per_backward,
                                     const std::vector<RecordedCall>& in_step,
                                     const std::vector<const void*>& gather_inputs,
                                     const std::vector<Bucket>& buckets, int world,
                                     Accumulation strategy, const float* shard_parameters) {
  const auto n = static_cast<std::size_t>(world);
  std::vector<std::pair<std::size_t, std::size_t>> expected;
  for (const Bucket& b : buckets) expected.emplace_back(n * b.chunk_elements, b.chunk_elements);
  std::ranges::sort(expected);
  const std::size_t micro = per_backward.size();
  for (std::size_t m = 0; m < micro; ++m) {
    const std::vector<RecordedCall>& calls = per_backward[m];
    const bool reduces = strategy == Accumulation::kReduceEveryMicroBatch || m + 1 == micro;
    std::vector<std::pair<std::size_t, std::size_t>> seen;
    for (const RecordedCall& call : calls) {
      if (call.op != CommOp::kReduceScatter || call.reduce != ReduceOp::kSum)
        return fmt::format(
            "backward {} of {} issued {}; expected only reduce-scatters (sum) "
            "during backward (all its calls: {})",
            m + 1, micro, grading::describe(call), grading::describe(calls));
      seen.emplace_back(call.in, call.out);
    }
    std::ranges::sort(seen);
    if (!reduces && !seen.empty())
      return fmt::format(
          "backward {} of {} issued {} reduce-scatter(s); expected none before the last "
          "micro-batch with kReduceOnce (the gradient stays local until then)",
          m + 1, micro, seen.size());
    if (reduces && seen != expected)
      return fmt::format(
          "backward {} of {} issued reduce-scatters of [{}] elements (in -> out); expected one "
          "per bucket during {}: [{}]",
          m + 1, micro,
          fmt::join(seen | std::views::transform([](const auto& p) {
                      return fmt::format("{} -> {}", p.first, p.second);
                    }),
                    ", "),
          strategy == Accumulation::kReduceOnce ? "the last backward" : "every backward",
          fmt::join(expected | std::views::transform([](const auto& p) {
                      return fmt::format("{} -> {}", p.first, p.second);
                    }),
                    ", "));
  }
  std::vector<std::size_t> gathered(buckets.size(), 0);
  for (std::size_t i = 0; i < in_step.size(); ++i) {
    const RecordedCall& call = in_step[i];
    std::optional<std::size_t> bucket;
    for (std::size_t k = 0; k < buckets.size(); ++k)
      if (gather_inputs[i] == shard_parameters + buckets[k].shard_offset) bucket = k;
    if (call.op != CommOp::kAllGather || !bucket || call.in != buckets[*bucket].chunk_elements ||
        call.out != n * buckets[*bucket].chunk_elements || ++gathered[*bucket] > 1)
      return fmt::format(
          "step() issued {}; expected in step() exactly one all-gather (C_k -> N C_k) of each "
          "bucket's chunk of shard_parameters() and nothing else (all its calls: {})",
          grading::describe(call), grading::describe(in_step));
  }
  for (std::size_t k = 0; k < buckets.size(); ++k)
    if (gathered[k] == 0)
      return fmt::format("bucket {}'s chunk of the parameters was never all-gathered in step()", k);
  return "";
}

TEST(Lab6Accumulation, CallsAndBytesEachStrategy) {
  Draws draws("Lab6Accumulation.CallsAndBytesEachStrategy");
  const std::vector<int> worlds = draws.world_sizes(6);
  const Training training = draw_training(draws, draws.coin("adamw") ? "adamw" : "sgd");
  const int micro = static_cast<int>(draws.integer("micro-batches", 2, 4));
  for (const int world : worlds) {
    std::array<std::uint64_t, 2> sent{};
    for (std::size_t s = 0; s < kStrategies.size(); ++s) {
      const Accumulation strategy = kStrategies[s];
      run_on_ranks(
          world,
          [&](Communicator& comm, Verdict& verdict) {
            const TrainOptions options = accumulation_options(training, world, micro);
            const std::vector<Bucket> buckets =
                contract_buckets(training.model(), world, training.cap_bytes);
            const auto [scatter_bytes, gather_bytes] = bucket_collective_bytes(comm, buckets);
            const std::uint64_t reduce_scatters =
                strategy == Accumulation::kReduceOnce ? 1 : static_cast<std::uint64_t>(micro);
            Model model = training.model();
            grading::RecordingCommunicator recorder(comm);
            std::vector<const void*> inputs;  // every call's input, compared, never read
            recorder.set_issue_callback(
                [&inputs](std::size_t index, const RecordedCall&, ConstBuffer in, MutableBuffer) {
                  inputs.resize(index + 1);
                  inputs[index] = in.data;
                });
            ZeroTwoOptimizer zero(model, recorder, factory_for(options), training.cap_bytes, 0.0f,
                                  {.micro_batches = micro, .accumulation = strategy});
            const float* shard_parameters = zero.shard_parameters().view().data();
            for (int step = 1; step <= 2; ++step) {
              recorder.forget_calls();
              inputs.clear();
              const CommCounters before = comm.counters();
              std::vector<std::size_t> boundaries;  // calls issued by the end of backward m
              recorder.set_in_backward(true);
              accumulate_step(model, training, options, step, micro, comm.rank(), world,
                              [&](int) { boundaries.push_back(recorder.calls().size()); });
              recorder.set_in_backward(false);
              (void)zero.step();
              const CommCounters used = comm.counters().since(before);
              // Every rank runs both steps whatever it found (no rank waits for one that
              // stopped); the first finding is the one reported.
              if (!verdict.passed()) continue;
              const std::vector<RecordedCall>& calls = recorder.calls();
              std::vector<std::vector<RecordedCall>> per_backward;
              std::size_t from = 0;
              for (const std::size_t to : boundaries) {
                per_backward.emplace_back(calls.begin() + static_cast<std::ptrdiff_t>(from),
                                          calls.begin() + static_cast<std::ptrdiff_t>(to));
                from = to;
              }
              const std::vector<RecordedCall> in_step(
                  calls.begin() + static_cast<std::ptrdiff_t>(from), calls.end());
              const std::vector<const void*> step_inputs(
                  inputs.begin() + static_cast<std::ptrdiff_t>(from), inputs.end());
              const std::string finding = judge_accumulation_calls(
                  per_backward, in_step, step_inputs, buckets, world, strategy, shard_parameters);
              const std::string label =
                  fmt::format("{} with M = {}, step {} ({} buckets)", strategy_name(strategy),
                              micro, step, buckets.size());
              if (!finding.empty()) {
                verdict.fail(fmt::format("{}: {}", label, finding));
                continue;
              }
              const std::uint64_t scattered = used.of(CommOp::kReduceScatter).bytes_sent;
              const std::uint64_t gathered = used.of(CommOp::kAllGather).bytes_sent;
              const std::uint64_t total = used.total_bytes_sent();
              if (scattered != reduce_scatters * scatter_bytes || gathered != gather_bytes ||
                  total != scattered + gathered) {
                verdict.fail(fmt::format(
                    "{}: the backend counted {} bytes sent by reduce-scatters, {} by all-gathers "
                    "and {} by everything else; expected {} x {} = {} (the buckets' "
                    "reduce-scatters {}), {} and none",
                    label, scattered, gathered, total - scattered - gathered, reduce_scatters,
                    scatter_bytes, reduce_scatters * scatter_bytes,
                    strategy == Accumulation::kReduceOnce ? "once per step"
                                                          : "once per micro-batch",
                    gather_bytes));
                continue;
              }
              if (comm.rank() == 0) sent[s] = total;
            }
          },
          draws);
    }
    if (!HasFailure())
      grading::note_measured(fmt::format(
          "N = {}, M = {}: {} bytes sent per step and rank reducing every micro-batch, {} "
          "reducing once",
          world, micro, sent[0], sent[1]));
  }
}

// --- Lab6Accumulation: what a backward that reduces leaves, where it launches, what it hides

/// Heap bytes (blocks of every size) the hooks and step() may take per call beyond what one
/// call and its wait took when measured (the runtime's bookkeeping varies with which rank
/// arrives first: heap_use.h), as in lab 7.
constexpr std::uint64_t kBookkeepingBytesPerCall = 256;
/// Heap bytes the backwards may take per tensor they make beyond the twin's (its record).
constexpr std::uint64_t kBookkeepingBytesPerTensor = 128;
/// Heap bytes (every block size) the constructor may take per parameter (a bucket's and a
/// slot's record, a Work handle, a hook, the inner optimizer's own): generous for any design,
/// and well below a copy of a parameter's gradient (4 bytes an element, hundreds of elements
/// a parameter in the graded models), as in lab 7.
constexpr std::uint64_t kConstructorBytesPerParameter = 640;
/// Heap bytes any part may take whatever it does (a vector's first growth, say).
constexpr std::uint64_t kHeapSlackBytes = 2048;

/// "" when `training` on this rank with `micro` micro-batches per step and `strategy`, over
/// two steps, keeps no gradient beyond the shard where a backward reduces and no copy on the
/// heap: at the end of every backward that reduces (every one with kReduceEveryMicroBatch,
/// the last with kReduceOnce) every Parameter::grad is released and the gradient bytes are
/// the shard's 4 S alone (a gradient freed once it is in a buffer, not by step()); and the
/// constructor, the M backwards with the hooks (against a twin's M plain backwards) and
/// step() take from the heap, in blocks of every size, no more than bookkeeping: the
/// 1 KiB rule of the other checks let a running sum hide in many small std::vectors.
std::string check_reducing_keeps_only_the_shard(const Training& training, int micro,
                                                Accumulation strategy, Communicator& comm) {
  const int world = comm.size();
  const TrainOptions options = accumulation_options(training, world, micro);
  MemoryTracker& tracker = this_rank_memory().tracker();
  const std::size_t grad_base = tracker.current(MemoryCategory::kGradients);
  Model model = training.model();
  Model twin = training.model();
  const std::vector<Bucket> buckets = contract_buckets(model, world, training.cap_bytes);
  const std::size_t shard = 4 * contract_shard(buckets);
  const std::size_t parameters = model.parameters().size();
  const std::string what =
      fmt::format("{} with M = {} on N = {}", strategy_name(strategy), micro, world);
  std::string finding;
  const auto first = [&finding](std::string found) {
    if (finding.empty()) finding = std::move(found);
  };
  const grading::HeapUse one_call = grading::heap_of_one_collective_call(comm);
  const grading::HeapUse before_constructor = grading::heap_use_of_this_thread();
  ZeroTwoOptimizer zero(model, comm, factory_for(options), training.cap_bytes, 0.0f,
                        {.micro_batches = micro, .accumulation = strategy});
  const grading::HeapUse constructor = grading::heap_use_of_this_thread().since(before_constructor);
  const std::uint64_t constructor_allowed =
      kConstructorBytesPerParameter * parameters + kHeapSlackBytes;
  if (constructor.bytes > constructor_allowed)
    first(fmt::format(
        "{}: the constructor took {} bytes from the heap (std::vector, new, blocks of every "
        "size); bookkeeping for {} parameters needs at most {} ({} a parameter + {}): every "
        "buffer is a Tensor, so that the memory budget sees it",
        what, constructor.bytes, parameters, constructor_allowed, kConstructorBytesPerParameter,
        kHeapSlackBytes));
  // Every rank runs both steps whatever it found, so that none waits for a peer that stopped.
  for (int step = 1; step <= 2; ++step) {
    std::vector<Batch> batches =
        grading::micro_batches(*training.data, options, step - 1, comm.rank(), world, micro);
    for (Batch& batch : batches) batch = grading::on_check_device(std::move(batch));
    const grading::HeapUse plain_start = grading::heap_use_of_this_thread();
    const std::size_t plain_tensors_start = tracker.allocations_total();
    twin.zero_grad();
    for (const Batch& batch : batches) twin.backward(grading::forward(twin, batch), batch.labels);
    const grading::HeapUse plain = grading::heap_use_of_this_thread().since(plain_start);
    const std::size_t plain_tensors = tracker.allocations_total() - plain_tensors_start;
    // Released, so that the gradient bytes read below are the optimizer's model's alone.
    for (Parameter* parameter : twin.parameters()) parameter->grad = Tensor();
    const std::uint64_t calls_start = comm.counters().collective_calls();
    const std::size_t hooked_tensors_start = tracker.allocations_total();
    const grading::HeapUse hooked_start = grading::heap_use_of_this_thread();
    model.zero_grad();
    for (int m = 0; m < micro; ++m) {
      const Batch& batch = batches[static_cast<std::size_t>(m)];
      model.backward(grading::forward(model, batch), batch.labels);
      const bool reduces = strategy == Accumulation::kReduceEveryMicroBatch || m + 1 == micro;
      if (!reduces || !finding.empty()) continue;
      const std::size_t gradients = tracker.current(MemoryCategory::kGradients) - grad_base;
      const std::string kept = check_released(model);
      if (!kept.empty() || gradients > shard)
        first(fmt::format(
            "{}, step {}: as backward {} of {} returned (it reduces), {} gradient bytes were "
            "held{}; expected every gradient released by its hook once copied into a buffer, "
            "so that only the shard of the gradient stays: 4 S = {} bytes",
            what, step, m + 1, micro, gradients, kept.empty() ? "" : fmt::format(" ({})", kept),
            shard));
    }
    const grading::HeapUse hooked = grading::heap_use_of_this_thread().since(hooked_start);
    const std::size_t hooked_tensors = tracker.allocations_total() - hooked_tensors_start;
    const std::uint64_t hook_calls = comm.counters().collective_calls() - calls_start;
    const grading::HeapUse step_start = grading::heap_use_of_this_thread();
    (void)zero.step();
    const grading::HeapUse in_step = grading::heap_use_of_this_thread().since(step_start);
    const std::uint64_t step_calls = comm.counters().collective_calls() - calls_start - hook_calls;
    const std::uint64_t per_call = one_call.bytes + kBookkeepingBytesPerCall;
    const std::uint64_t hooks_allowed =
        plain.bytes + hook_calls * per_call +
        (hooked_tensors - std::min(hooked_tensors, plain_tensors)) * kBookkeepingBytesPerTensor +
        kHeapSlackBytes;
    const std::uint64_t step_allowed = step_calls * per_call + kHeapSlackBytes;
    if (hooked.bytes > hooks_allowed)
      first(fmt::format(
          "{}, step {}: the {} forwards and backwards with your hooks took {} bytes from the "
          "heap (std::vector, new, blocks of every size), the same without them {}; expected "
          "at most {}: theirs, plus what each of your {} calls and its wait take ({} bytes, + "
          "{}), {} bytes for each tensor beyond theirs, and {} to spare. Memory held outside "
          "tensors escapes the memory budget: keep every buffer, and the micro-batches' sum, "
          "in a Tensor",
          what, step, micro, hooked.bytes, plain.bytes, hooks_allowed, hook_calls, one_call.bytes,
          kBookkeepingBytesPerCall, kBookkeepingBytesPerTensor, kHeapSlackBytes));
    if (in_step.bytes > step_allowed)
      first(fmt::format(
          "{}, step {}: step() took {} bytes from the heap (blocks of every size); expected at "
          "most {}: what each of its {} calls and its wait take ({} bytes, + {}) and {} to "
          "spare. Memory held outside tensors escapes the memory budget",
          what, step, in_step.bytes, step_allowed, step_calls, one_call.bytes,
          kBookkeepingBytesPerCall, kHeapSlackBytes));
  }
  return finding;
}

TEST(Lab6Accumulation, KeepsOnlyTheShardWhereItReduces) {
  Draws draws("Lab6Accumulation.KeepsOnlyTheShardWhereItReduces");
  const std::vector<int> worlds = draws.world_sizes(6);
  const Training training = draw_training(draws, draws.coin("adamw") ? "adamw" : "sgd");
  const int micro = static_cast<int>(draws.integer("micro-batches", 2, 4));
  for (const int world : worlds)
    for (const Accumulation strategy : kStrategies)
      run_on_ranks(
          world,
          [&](Communicator& comm, Verdict& verdict) {
            verdict.expect_empty(
                check_reducing_keeps_only_the_shard(training, micro, strategy, comm),
                "what a step keeps");
          },
          draws);
  if (!HasFailure())
    grading::note_measured(fmt::format(
        "M = {}, both strategies, on world sizes {}: every backward that reduces returned with "
        "every gradient released and 4 S gradient bytes; the constructor, the hooks and step() "
        "took only bookkeeping from the heap",
        micro, fmt::join(worlds, ", ")));
}

/// The speed budget of the compute the lab adds to an accumulation step (the step's time
/// minus the model's own forwards and backwards and minus the time the waits on its calls
/// blocked): at most this many times what the copies, adds and the update the contract's
/// arithmetic must make take on the same simulated device (`AccumulationTiming::floor_seconds`),
/// as in labs 4 and 7.
constexpr double kAddedComputeFactor = 1.5;

/// One accumulation step of the student's optimizer on simulated ranks, as rank 0 saw it.
struct AccumulationTiming {
  std::size_t scatters = 0;
  double on_link = 0;          ///< the reduce-scatters' seconds on the link
  double exposed = 0;          ///< seconds the waits on the reduce-scatters blocked
  double gathers_exposed = 0;  ///< seconds the waits on the all-gathers blocked
  double behind_model = 0;     ///< seconds of `on_link` that overlap the model's own compute
  double step_seconds = 0;     ///< the M forwards and backwards and step()
  double model_seconds = 0;    ///< the model's own forwards and backwards
  /// What the grader's own copies, adds, division and update of such a step take: each
  /// gradient copied into a buffer once per backward that reduces, the M - 1 later
  /// micro-batches' chunks added into the shard (reducing every micro-batch), the shard
  /// divided and updated, and each parameter copied out of its all-gather.
  double floor_seconds = 0;
  /// The compute the lab's code added.
  double added_seconds() const {
    return std::max(0.0, step_seconds - model_seconds - exposed - gathers_exposed);
  }
};

/// The model's own compute on rank `trace`'s clock in each window [windows[i], windows[i+1])
/// (a micro-batch's forward and backward): each layer's and the loss's forward and backward
/// counted once per window (the first event of its name there), as (start, end) intervals.
/// Compute the lab adds (copies, adds, anything run to pass the time) is not in it.
std::vector<std::pair<double, double>> model_compute_per_window(
    const RankTrace& trace, const std::vector<double>& windows) {
  std::vector<std::pair<double, double>> model;
  for (std::size_t w = 0; w + 1 < windows.size(); ++w) {
    std::vector<std::string> seen;
    for (const TraceEvent& event : trace.events) {
      if (event.lane != TraceLane::kCompute || event.start < windows[w] ||
          event.start >= windows[w + 1] ||
          !(event.name.ends_with(" forward") || event.name.ends_with(" backward")))
        continue;
      if (std::find(seen.begin(), seen.end(), event.name) != seen.end()) continue;
      seen.push_back(event.name);
      model.emplace_back(event.start, event.start + event.duration);
    }
  }
  return model;
}

/// "" when every reduce-scatter was launched in the hook that completes its bucket:
/// `launches[m]` holds, for backward m, the gradients the grader's hook (registered first)
/// had counted in that backward at each reduce-scatter's issue, `outside` the reduce-scatters
/// issued outside every backward. The backwards that reduce (every one, or the last with
/// kReduceOnce) launch each bucket exactly at its last gradient; the others launch nothing.
std::string judge_launch_points(const std::vector<std::vector<std::size_t>>& launches,
                                std::size_t outside, const std::vector<Bucket>& buckets,
                                Accumulation strategy) {
  std::vector<std::size_t> complete_at;
  std::size_t total = 0;
  for (const Bucket& b : buckets) complete_at.push_back(total += b.parameters.size());
  const std::size_t micro = launches.size();
  if (outside > 0)
    return fmt::format(
        "{} reduce-scatter(s) were launched outside backward; expected each bucket launched in "
        "the hook of its last gradient, so that it travels while backward computes the rest",
        outside);
  for (std::size_t m = 0; m < micro; ++m) {
    const bool reduces = strategy == Accumulation::kReduceEveryMicroBatch || m + 1 == micro;
    std::vector<std::size_t> seen = launches[m];
    std::ranges::sort(seen);
    if (!reduces) {
      if (!seen.empty())
        return fmt::format(
            "backward {} of {} launched {} reduce-scatter(s); expected none before the last "
            "backward with kReduceOnce",
            m + 1, micro, seen.size());
      continue;
    }
    for (std::size_t k = 0; k < buckets.size(); ++k) {
      if (std::ranges::find(seen, complete_at[k]) != seen.end()) continue;
      return fmt::format(
          "backward {} of {}: no reduce-scatter was launched in the hook of gradient {} of {}, "
          "which completes bucket {} (the grader's hook counted [{}] gradients at the "
          "launches); launch each bucket in the hook of its last gradient in every backward "
          "that reduces, so that it travels while the next layers' backward computes",
          m + 1, micro, complete_at[k], total, k, fmt::join(seen, ", "));
    }
    if (seen != complete_at)
      return fmt::format(
          "backward {} of {}: reduce-scatters launched after gradients [{}]; the buckets are "
          "complete at gradients [{}]: expected one launch at each",
          m + 1, micro, fmt::join(seen, ", "), fmt::join(complete_at, ", "));
  }
  return "";
}

/// Runs one step of `micro` micro-batches with `strategy` of the speed workload `options`
/// (a cap of `cap_bytes`) on `launch_options`' simulated ranks through a recording
/// communicator over a WaitTimer; returns rank 0's timing and, in `findings`, each rank's
/// first launch that broke the rule. Then times the grader's floor on the same clock, and
/// once that is read compares every rank's parameters in `numbers` (the contract's after
/// the step, `emulate_accumulation`'s).
AccumulationTiming simulate_accumulation_step(const LaunchOptions& launch_options,
                                              const TrainOptions& options, const Dataset& data,
                                              std::size_t cap_bytes, int micro,
                                              Accumulation strategy,
                                              std::vector<std::string>& findings,
                                              grading::TimedRunNumbers& numbers) {
  const int world = launch_options.world_size;
  AccumulationTiming timing;
  findings.assign(static_cast<std::size_t>(world), "");
  launch(launch_options, [&](Communicator& comm) {
    Model model = grading::make_check_model(options);
    const std::vector<Bucket> buckets = contract_buckets(model, world, cap_bytes);
    grading::WaitTimer timer(comm);
    grading::RecordingCommunicator recorder(timer);
    std::size_t ready = 0;  // gradients of the running backward, counted first
    int backward = -1;      // the running backward, -1 outside
    std::vector<std::vector<std::size_t>> launches(static_cast<std::size_t>(micro));
    std::size_t outside = 0;
    recorder.set_issue_callback(
        [&](std::size_t, const RecordedCall& call, ConstBuffer, MutableBuffer) {
          if (call.op != CommOp::kReduceScatter) return;
          if (backward < 0)
            ++outside;
          else
            launches[static_cast<std::size_t>(backward)].push_back(ready);
        });
    model.on_gradient_ready([&](Parameter&) { ++ready; });  // before theirs
    ZeroTwoOptimizer zero(model, recorder, factory_for(options), cap_bytes, 0.0f,
                          {.micro_batches = micro, .accumulation = strategy});
    std::vector<Batch> batches =
        grading::micro_batches(data, options, 0, comm.rank(), world, micro);
    for (Batch& batch : batches) batch = grading::on_check_device(std::move(batch));
    std::vector<double> windows;
    detail::charging_clock(comm).mark_step();
    for (int m = 0; m < micro; ++m) {
      windows.push_back(comm.clock().now());
      ready = 0;
      backward = m;
      model.backward(grading::forward(model, batches[static_cast<std::size_t>(m)]),
                     batches[static_cast<std::size_t>(m)].labels);
      backward = -1;
    }
    windows.push_back(comm.clock().now());
    (void)zero.step();
    detail::charging_clock(comm).mark_step();
    findings[static_cast<std::size_t>(comm.rank())] =
        judge_launch_points(launches, outside, buckets, strategy);
    // The floor, on scratch tensors of the same sizes on the same simulated device.
    const std::size_t shard = zero.shard_parameters().size();
    std::size_t largest = shard;
    std::vector<std::size_t> sizes;
    for (const Parameter* parameter : model.parameters()) {
      sizes.push_back(parameter->value.size());
      largest = std::max(largest, parameter->value.size());
    }
    const std::vector<std::int64_t> shape{static_cast<std::int64_t>(largest)};
    Tensor from(shape, MemoryCategory::kOther, grading::check_device());
    Tensor to(shape, MemoryCategory::kOther, grading::check_device());
    std::unique_ptr<Optimizer> inner = factory_for(options)(shard);
    const bool once = strategy == Accumulation::kReduceOnce;
    const double start = comm.clock().now();
    for (int m = 0; m < (once ? 1 : micro); ++m)
      for (const std::size_t size : sizes)
        copy(std::as_const(from).view(0, size), to.view(0, size));
    for (int m = 1; m < (once ? 1 : micro); ++m)
      add(std::as_const(from).view(0, shard), to.view(0, shard));
    divide(to.view(0, shard), static_cast<float>(world * micro));
    inner->begin_step();
    inner->update(0, from.view(0, shard), std::as_const(to).view(0, shard));
    for (const std::size_t size : sizes) copy(std::as_const(from).view(0, size), to.view(0, size));
    const double floor_seconds = comm.clock().now() - start;
    if (comm.rank() != 0) {
      numbers.compare_parameters(strategy_name(strategy), comm.rank(), model, 1);
      return;
    }
    const RankTrace trace = comm.clock().trace();
    const StepSummary summary = summarize_steps(trace).back();
    const double end = summary.start + summary.total;
    const std::vector<std::pair<double, double>> model_ops =
        model_compute_per_window(trace, windows);
    for (const auto& [first, last] : model_ops) timing.model_seconds += last - first;
    for (const TraceEvent& event : trace.events) {
      if (event.lane == TraceLane::kCompute || event.name != "reduce_scatter" ||
          event.start < summary.start || event.start >= end)
        continue;
      timing.on_link += event.duration;
      for (const auto& [first, last] : model_ops)  // compute ops of one rank never overlap
        timing.behind_model += std::max(
            0.0, std::min(last, event.start + event.duration) - std::max(first, event.start));
    }
    timing.scatters = timer.scatters;
    timing.exposed = timer.scatters_exposed;
    timing.gathers_exposed = timer.gathers_exposed;
    timing.step_seconds = summary.total;
    timing.floor_seconds = floor_seconds;
    numbers.compare_parameters(strategy_name(strategy), comm.rank(), model, 1);
  });
  return timing;
}

TEST(Lab6Accumulation, LaunchesAndHidesEachStrategy) {
  Draws draws("Lab6Accumulation.LaunchesAndHidesEachStrategy");
  // Lab6Speed's workload (see there why each layer's reduce-scatter takes about as long as
  // its backward), one step of M micro-batches. M of 3 or 4: at M = 2 one wasted copy of
  // the whole gradient per step stays within kAddedComputeFactor of the floor.
  const auto world = static_cast<int>(draws.integer("ranks", 4, 8));
  const std::int64_t hidden = draws.integer("hidden", 512, 768);
  const std::int64_t depth = draws.integer("hidden layers", 8, 14);
  const std::int64_t rows = draws.integer("rows per micro-batch", 48, 64);
  const auto micro = static_cast<int>(draws.integer("micro-batches", 3, 4));
  const TrainOptions options =
      grading::equal_layers_sgd_step(draws, hidden, depth, rows * micro, world);
  const std::size_t cap_bytes = 4 * static_cast<std::size_t>(hidden * hidden + hidden);
  const Dataset data = load_dataset(options.dataset, 1);
  const LaunchOptions launch_options = grading::simulated_launch(draws, world, "10gbe", "cpu");
  for (const Accumulation strategy : kStrategies) {
    const std::string what =
        fmt::format("{} with M = {} on {} ranks (10gbe, cpu), {}, cap {} bytes",
                    strategy_name(strategy), micro, world, options.model, cap_bytes);
    std::vector<std::string> findings;
    AccumulationTiming m;
    // What the timed step must leave: lab6.h's arithmetic, emulated in one process (one
    // BLAS thread, as the ranks have: the products' bits depend on it).
    set_blas_threads(1);
    grading::TimedRunNumbers numbers(
        emulate_accumulation(options, data, world, micro, strategy).parameters_after_step);
    try {
      m = simulate_accumulation_step(launch_options, options, data, cap_bytes, micro, strategy,
                                     findings, numbers);
    } catch (const NotImplemented&) {
      throw;
    } catch (const std::exception& error) {
      ADD_FAILURE() << fmt::format("{}: a rank failed with {}: {}\n  drawn: {}", what,
                                   grading::type_name(error), error.what(), draws.describe());
      continue;
    }
    if (!numbers.report(what, draws)) continue;
    const auto broken =
        std::ranges::find_if(findings, [](const std::string& f) { return !f.empty(); });
    if (broken != findings.end()) {
      ADD_FAILURE() << fmt::format("{}, rank {}: {}\n  drawn: {}", what, broken - findings.begin(),
                                   *broken, draws.describe());
      continue;
    }
    if (m.on_link <= 0) {
      ADD_FAILURE() << fmt::format("{}: no reduce-scatter reached the simulated clock", what);
      continue;
    }
    const double hidden_fraction = std::max(0.0, 1.0 - m.exposed / m.on_link);
    const double behind_fraction = m.behind_model / m.on_link;
    if (hidden_fraction < kHiddenFraction)
      ADD_FAILURE() << fmt::format(
          "{}: {} reduce-scatters took {:.3f} ms on the link and the waits on them blocked "
          "{:.3f} ms: {:.0f}% hidden; expected at least {:.0f}% with accumulation too (wait "
          "for a reduce-scatter only when its buffer is needed again, at the next micro-batch "
          "or in step())\n  drawn: {}",
          what, m.scatters, m.on_link * 1e3, m.exposed * 1e3, 100 * hidden_fraction,
          100 * kHiddenFraction, draws.describe());
    // No bound on the time behind the model's own compute, as in lab 7's reduce-scatters:
    // the bound on the compute the lab adds below catches work burned to hide them, and the
    // last buckets of the step have only step() after them (a correct ring of two buckets
    // reducing once kept 48% of its time on the link behind the model on 8 layers).
    else if (m.added_seconds() > kAddedComputeFactor * m.floor_seconds)
      ADD_FAILURE() << fmt::format(
          "{}: the step took {:.3f} ms: the model's own compute {:.3f} ms, the waits {:.3f} ms, "
          "and {:.3f} ms of compute your code added; expected at most {} x {:.3f} ms = {:.3f} "
          "ms, what the copies into the buffers{}, the division, the update and the copies out "
          "of the all-gathers take on this device (no copy, fill or add the arithmetic does "
          "not need)\n  drawn: {}",
          what, m.step_seconds * 1e3, m.model_seconds * 1e3, (m.exposed + m.gathers_exposed) * 1e3,
          m.added_seconds() * 1e3, kAddedComputeFactor, m.floor_seconds * 1e3,
          kAddedComputeFactor * m.floor_seconds * 1e3,
          strategy == Accumulation::kReduceOnce
              ? " (in the last backward only)"
              : ", the later micro-batches' chunks added into the shard",
          draws.describe());
    else
      grading::note_measured(fmt::format(
          "{}: each bucket launched in its last gradient's hook; {} reduce-scatters, {:.3f} ms "
          "on the link, {:.0f}% hidden, {:.0f}% behind the model's compute; {:.3f} ms added "
          "({:.2f} x the floor {:.3f} ms)",
          what, m.scatters, m.on_link * 1e3, 100 * hidden_fraction, 100 * behind_fraction,
          m.added_seconds() * 1e3, m.added_seconds() / m.floor_seconds, m.floor_seconds * 1e3));
  }
}

/// A plausible wrong answer to design question 2, and what it predicts.
struct AccumulationNearMiss {
  std::string what;
  AccumulationCost cost;
  /// Whether every draw of the check tells it from the reference's answer (a grader bug
  /// otherwise); false for one that parts only where a bucket pads.
  bool always_separated = true;
};

// The plausible wrong answers name a near miss in the feedback, and the check fails as a
// grader bug where its draws do not tell one from the reference's answer. Each is the
// reference design's answer with one term changed, so reading them gives it away: they live
// in instructor/accumulation_near_misses.h, which the student release leaves out. There the
// check grades the same (against the tracker and the counters, which are the answer) and
// names no near miss.
#if __has_include("instructor/accumulation_near_misses.h")
#include "instructor/accumulation_near_misses.h"
#else
std::pair<AccumulationCost, std::vector<AccumulationNearMiss>> accumulation_costs(Model&, int,
                                                                                  std::size_t, int,
                                                                                  Accumulation) {
  return {};
}
#endif

/// The (strategy, M) cases design question 2 is asked on one world size: each strategy with
/// M drawn in [2, 4], and with `with_single` kReduceOnce at M = 1 too, where nothing stays
/// between micro-batches and the answer is M = 1's of kReduceEveryMicroBatch (a trial
/// predicted the whole gradient held there and scored full marks while it was never drawn).
std::vector<std::pair<Accumulation, int>> prediction_cases(Draws& draws, bool with_single) {
  std::vector<std::pair<Accumulation, int>> cases;
  for (const Accumulation strategy : kStrategies)
    cases.emplace_back(strategy, static_cast<int>(draws.integer(
                                     fmt::format("M ({})", strategy_name(strategy)), 2, 4)));
  if (with_single) cases.emplace_back(Accumulation::kReduceOnce, 1);
  return cases;
}

TEST(Lab6Accumulation, PredictsCostEachStrategy) {
  Draws draws("Lab6Accumulation.PredictsCostEachStrategy");
  // Local threads on every backend: the prediction counts the local backend's bytes. N of
  // 2 or more, where the bytes are not 0, one of them 3, 5 or 6 (buckets that pad).
  const std::vector<int> worlds = {draws.pick("N (pads)", std::vector<int>{3, 5, 6}),
                                   static_cast<int>(draws.integer("N", 2, 6))};
  const std::int64_t h1 = draws.integer("h1", 8, 96);
  const std::int64_t h2 = draws.integer("h2", 8, 64);
  const bool layer_norm = draws.coin("layer norm");
  const std::size_t cap = 4 * static_cast<std::size_t>(draws.integer("cap elements", 0, h1 * h2));
  const std::string spec = fmt::format("64-{}-{}-10", h1, h2);
  for (const int world : worlds) {
    for (const auto& [drawn_strategy, drawn_micro] :
         prediction_cases(draws, world == worlds.front())) {
      const Accumulation strategy = drawn_strategy;  // a lambda below captures them
      const int micro = drawn_micro;
      // The design questions' training, 4 rows per rank in each of the M micro-batches; its
      // step emulated once in one process with the strategy's arithmetic.
      TrainOptions options = grading::design_training(spec, layer_norm, world);
      options.global_batch *= micro;
      const Trajectory exact =
          emulate_accumulation(options, grading::design_data(), world, micro, strategy);
      run_on_ranks(
          world,
          [&](Communicator& comm, Verdict& verdict) {
            MemoryTracker& tracker = this_rank_memory().tracker();
            const std::size_t grad_base = tracker.current(MemoryCategory::kGradients);
            const std::size_t comm_base = tracker.current(MemoryCategory::kCommunication);
            Model model = grading::make_check_model(options);
            const AccumulationOptions accumulation{.micro_batches = micro,
                                                   .accumulation = strategy};
            const AccumulationCost predicted =
                predicted_accumulation_cost(model, world, cap, accumulation);
            const std::size_t buckets = contract_buckets(model, world, cap).size();
            AccumulationCost measured;
            std::size_t gradient_peak = 0;
            std::size_t communication_peak = 0;
            std::string numbers;  // the parameters after the step, where they differ
            {
              std::vector<Batch> batches = grading::micro_batches(grading::design_data(), options,
                                                                  0, comm.rank(), world, micro);
              ZeroTwoOptimizer zero(model, comm, factory_for(options), cap, 0.0f, accumulation);
              tracker.reset_peaks();
              const CommCounters before = comm.counters();
              for (int m = 0; m < micro; ++m) {
                const Batch batch =
                    grading::on_check_device(std::move(batches[static_cast<std::size_t>(m)]));
                model.backward(grading::forward(model, batch), batch.labels);
              }
              (void)zero.step();
              const CommCounters used = comm.counters().since(before);
              gradient_peak = tracker.peak(MemoryCategory::kGradients) - grad_base;
              communication_peak = tracker.peak(MemoryCategory::kCommunication) - comm_base;
              measured = {.gradient_peak_bytes = gradient_peak + communication_peak,
                          .bytes_sent = used.of(CommOp::kReduceScatter).bytes_sent +
                                        used.of(CommOp::kAllGather).bytes_sent};
              // Read from the host copy of the values, once the peaks and counters are read.
              numbers = compare_measured_step(model, exact, 1, "the strategy's arithmetic",
                                              "the design check's run");
            }
            if (!verdict.passed()) return;
            // The near misses the prediction equals where the measurement does not, by the
            // mistake alone (instructors' grader only).
            const auto [reference, wrong] = accumulation_costs(model, world, cap, micro, strategy);
            std::vector<std::string> mistakes;
            for (const AccumulationNearMiss& near : wrong) {
              if (near.always_separated && near.cost == reference)
                verdict.fail(
                    fmt::format("grader bug: the near miss \"{}\" equals the "
                                "reference design's answer here",
                                near.what));
              if (predicted == near.cost && !(measured == near.cost) && !(near.cost == reference))
                mistakes.push_back(near.what);
            }
            const std::string hint =
                mistakes.empty() ? ""
                                 : fmt::format(
                                       "; that is the reference design (two buffers of the largest "
                                       "padded bucket) counted with {}",
                                       fmt::join(mistakes, ", or with "));
            const std::string what =
                fmt::format("{}{}, N = {}, cap {} bytes ({} bucket{}), {} with M = {}", spec,
                            layer_norm ? " with LayerNorm" : "", world, cap, buckets,
                            buckets == 1 ? "" : "s", strategy_name(strategy), micro);
            if (predicted.gradient_peak_bytes != measured.gradient_peak_bytes)
              verdict.fail(fmt::format(
                  "{}: predicted gradient_peak_bytes {}; the MemoryTracker measured the peak of "
                  "kGradients ({}) plus the peak of kCommunication ({}) over the {} backwards "
                  "and step(): {} ({:+} bytes){}",
                  what, predicted.gradient_peak_bytes, gradient_peak, communication_peak, micro,
                  measured.gradient_peak_bytes,
                  static_cast<std::int64_t>(predicted.gradient_peak_bytes) -
                      static_cast<std::int64_t>(measured.gradient_peak_bytes),
                  hint));
            else if (predicted.bytes_sent != measured.bytes_sent)
              verdict.fail(fmt::format(
                  "{}: predicted bytes_sent {}; the backend counted {} bytes sent by the step's "
                  "reduce-scatters and all-gathers (predicted / measured = {:.3f}){}",
                  what, predicted.bytes_sent, measured.bytes_sent,
                  measured.bytes_sent == 0 ? 0.0
                                           : static_cast<double>(predicted.bytes_sent) /
                                                 static_cast<double>(measured.bytes_sent),
                  hint));
            else if (!numbers.empty())
              verdict.fail(fmt::format("{}: {}", what, numbers));
            else
              verdict.note(
                  fmt::format("{}: {} bytes at the gradient peak, {} bytes sent, "
                              "predicted exactly",
                              what, measured.gradient_peak_bytes, measured.bytes_sent));
          },
          draws, std::chrono::seconds(30), Backend::kLocal);
    }
  }
}

// --- Lab6Checkpoint ----------------------------------------------------------------------------

/// The student's ZeroTwoOptimizer as the checkpoint check drives it.
using ZeroTwoSubject = grading::ZeroCheckpointSubject<ZeroTwoOptimizer>;

TEST(Lab6Checkpoint, SavedAtFourLoadsAtTwoAndThree) {
  Draws draws("Lab6Checkpoint.SavedAtFourLoadsAtTwoAndThree");
  draws.section("AdamW:");
  const Training training = draw_training(draws, "adamw");
  grading::CheckpointLab lab;
  // The buckets do not depend on the world size (only their chunks do).
  lab.segments = [&](const Model& model) {
    std::vector<std::vector<std::size_t>> segments;
    for (const Bucket& bucket : contract_buckets(model, 1, training.cap_bytes))
      segments.push_back(bucket.parameters);
    return segments;
  };
  lab.make = [&](Model& model, Communicator& comm, const TrainOptions& options) {
    return std::make_unique<ZeroTwoSubject>(model, comm, factory_for(options), training.cap_bytes);
  };
  lab.values_replicated = true;
  lab.segments_name = fmt::format("the buckets (cap {} bytes), each its parameters in bucket order",
                                  training.cap_bytes);
  // The contract promises any cap: a load on 4 ranks with another cap (other buckets) must
  // cut the shard for its own buckets. One bucket of everything when the drawn cap makes
  // several, else a cap of 0 (a bucket per parameter).
  std::size_t other_cap = 0;
  {
    const Model model = training.model();
    if (contract_buckets(model, 1, training.cap_bytes).size() > 1)
      other_cap = 4 * model.flat_parameters().size();
  }
  lab.other_segments = [other_cap](const Model& model) {
    std::vector<std::vector<std::size_t>> segments;
    for (const Bucket& bucket : contract_buckets(model, 1, other_cap))
      segments.push_back(bucket.parameters);
    return segments;
  };
  lab.make_other = [other_cap](Model& model, Communicator& comm, const TrainOptions& options) {
    return std::make_unique<ZeroTwoSubject>(model, comm, factory_for(options), other_cap);
  };
  lab.other_segments_name = fmt::format("a bucket cap of {} bytes", other_cap);
  grading::check_sharded_checkpoint(draws, training, lab);
  if (HasFailure()) return;
  // SGD's momentum buffer is state too, with another name; the same buckets (the same cap).
  draws.section("then SGD with momentum 0.9 on the AdamW model and cap:");
  Training sgd{grading::sgd_with_momentum_on_the_same_model(draws, training)};
  sgd.cap_bytes = training.cap_bytes;
  grading::check_sharded_checkpoint(draws, sgd, lab);
}

/// A fresh directory under the system's temporary directory, made by rank 0 and named to
/// the other ranks (processes under mpi).
std::filesystem::path fresh_shared_directory(Communicator& comm) {
  std::vector<std::uint8_t> name(4096, 0);
  if (comm.rank() == 0) {
    std::string made =
        (std::filesystem::temp_directory_path() / "dplab-lab6-resave-XXXXXX").string();
    if (mkdtemp(made.data()) == nullptr)
      throw Error(fmt::format("cannot make a directory {}: {}", made, std::strerror(errno)));
    DP_CHECK(made.size() < name.size(), "temporary directory name too long: {}", made);
    std::copy(made.begin(), made.end(), name.begin());
  }
  broadcast_host_values(std::span<std::uint8_t>(name), 0, comm);
  return std::string(reinterpret_cast<const char*>(name.data()));
}

/// "" when the checkpoints in `first` and `second` hold the same "step" and bitwise the
/// same tensors; else the first difference.
std::string compare_checkpoints(const std::filesystem::path& first,
                                const std::filesystem::path& second) {
  const Checkpoint a = consolidated_checkpoint(first);
  const Checkpoint b = consolidated_checkpoint(second);
  const auto step_of = [](const Checkpoint& c) {
    const auto found = c.metadata.find("step");
    return found == c.metadata.end() ? std::string("missing") : '"' + found->second + '"';
  };
  if (step_of(a) != step_of(b))
    return fmt::format(
        "its \"step\" is {}; the checkpoint loaded holds {} (the step count "
        "load_checkpoint restored, not a count of the optimizer's own steps)",
        step_of(b), step_of(a));
  for (const auto& [name, tensor] : a.tensors) {
    const auto found = b.tensors.find(name);
    if (found == b.tensors.end()) return fmt::format("it lacks the tensor {}", name);
    const std::span<const float> x = tensor.span();
    const std::span<const float> y = found->second.span();
    if (x.size() != y.size())
      return fmt::format("its {} holds {} elements; the loaded one {}", name, y.size(), x.size());
    for (std::size_t i = 0; i < x.size(); ++i)
      if (std::bit_cast<std::uint32_t>(x[i]) != std::bit_cast<std::uint32_t>(y[i]))
        return fmt::format("its {}[{}] is {}; the loaded checkpoint holds {} (bitwise)", name, i,
                           y[i], x[i]);
  }
  if (b.tensors.size() != a.tensors.size())
    return fmt::format("it holds {} tensors; the loaded one {}", b.tensors.size(),
                       a.tensors.size());
  return "";
}

// A save right after a load writes what was loaded: the step count load_checkpoint restored
// (a count the optimizer keeps of its own steps, which no load restores, saves 0) and the
// same shards and optimizer state. The other checkpoint check never saves after a load (a
// student trial's "step" from its own counter passed it).
TEST(Lab6Checkpoint, SavesWhatItLoaded) {
  Draws draws("Lab6Checkpoint.SavesWhatItLoaded");
  const Training training = draw_training(draws, "adamw");
  const int world = 2;
  const auto saved_after = static_cast<int>(draws.integer("steps before the save", 1, 3));
  run_on_ranks(
      world,
      [&](Communicator& comm, Verdict& verdict) {
        const TrainOptions options = training.for_world(world);
        const std::filesystem::path trained = fresh_shared_directory(comm);
        const std::filesystem::path resaved = fresh_shared_directory(comm);
        {
          Model model = training.model();
          ZeroTwoOptimizer zero(model, comm, factory_for(options), training.cap_bytes);
          for (int step = 0; step < saved_after; ++step) {
            const Batch batch = grading::on_check_device(
                grading::local_batch(*training.data, options, step, comm.rank(), world));
            model.zero_grad();
            model.backward(grading::forward(model, batch), batch.labels);
            (void)zero.step();
          }
          zero.save_checkpoint(trained);
        }
        Model model = training.model();
        ZeroTwoOptimizer zero(model, comm, factory_for(options), training.cap_bytes);
        zero.load_checkpoint(trained);
        zero.save_checkpoint(resaved);
        if (comm.rank() == 0) {
          const std::string finding = compare_checkpoints(trained, resaved);
          if (!finding.empty())
            verdict.fail(fmt::format(
                "saved again right after loading a checkpoint of {} steps on {} ranks: {}",
                saved_after, world, finding));
          else
            verdict.note(fmt::format(
                "a save right after a load of {} steps on {} ranks: the same \"step\" and "
                "bitwise the same tensors",
                saved_after, world));
        }
        comm.barrier();
        if (comm.rank() == 0) {
          std::filesystem::remove_all(trained);
          std::filesystem::remove_all(resaved);
        }
      },
      // Local threads under mpi too (the directories are this process's); the files of a
      // loaded machine may take seconds, as in the other checkpoint check.
      draws, std::chrono::seconds(240), Backend::kLocal);
}

}  // namespace
}  // namespace dp::lab6
