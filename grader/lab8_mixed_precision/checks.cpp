// Lab 8's graded checks: mixed precision and ZeRO. The lab code writes a master-weight
// optimizer (16-bit parameters, float32 masters and inner state), a loss scaler with
// GradScaler's rule whose overflow decision every rank shares through one all-reduce, ZeRO-1
// over mixed precision (the 12 bytes per parameter of masters and moments sharded), and a
// prediction of the bytes per parameter of DDP and ZeRO-1/2/3 and of the largest model a
// budget holds. Each check compares with the contract's arithmetic emulated here, in one
// process, with the grader's own code (never the lab's): bitwise, since lab8.h fixes every
// rounding. rubric.json gives the points and the draws.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "compare.h"
#include "dp/error.h"
#include "dp/float16.h"
#include "dp/memory.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/rng.h"
#include "dp/tensor_ops.h"
#include "grading.h"
#include "heap_use.h"
#include "lab8.h"
#include "memory_check.h"
#include "recording.h"

namespace dp {
namespace {

using grading::Draws;
using grading::run_on_ranks;
using grading::Verdict;
using lab8::MasterWeightOptimizer;
using lab8::MixedZeroOne;
using lab8::ScalerSettings;
using lab8::Strategy;

// ---------------------------------------------------------------------------------------
// The grader's own 16-bit arithmetic (dp/float16.h's conversions, round to nearest even).

/// `bits` of `type` (bfloat16 or float16) widened exactly to float32.
float widen(DataType type, std::uint16_t bits) {
  return type == DataType::kBFloat16 ? to_float(BFloat16{bits}) : to_float(Float16{bits});
}

/// `value` rounded to `type`, nearest even.
std::uint16_t narrow(DataType type, float value) {
  return type == DataType::kBFloat16 ? to_bfloat16(value).bits : to_float16(value).bits;
}

/// The bit patterns of a 16-bit host tensor.
std::vector<std::uint16_t> bits_of(const Tensor& tensor) {
  std::vector<std::uint16_t> bits;
  bits.reserve(tensor.size());
  if (tensor.dtype() == DataType::kBFloat16) {
    for (const BFloat16 value : tensor.span<BFloat16>()) bits.push_back(value.bits);
  } else {
    for (const Float16 value : tensor.span<Float16>()) bits.push_back(value.bits);
  }
  return bits;
}

/// A host copy of any float32 tensor (on the host or a device).
std::vector<float> host_floats(const Tensor& tensor) {
  std::vector<float> values(tensor.size());
  copy(tensor.view(), TensorView(std::span<float>(values)));
  return values;
}

/// "" when `seen` and `expected` are bitwise equal, else the first difference.
std::string compare_bits(std::span<const float> seen, std::span<const float> expected,
                         std::string_view what) {
  if (seen.size() != expected.size())
    return fmt::format("{}: {} elements, expected {}", what, seen.size(), expected.size());
  for (std::size_t i = 0; i < seen.size(); ++i)
    if (std::bit_cast<std::uint32_t>(seen[i]) != std::bit_cast<std::uint32_t>(expected[i]))
      return fmt::format("{} differs first at element {} (seen {:.9g}, expected {:.9g})", what, i,
                         seen[i], expected[i]);
  return "";
}

/// GradScaler's rule, the grader's own: the scale, the tracker and the skipped steps.
struct EmulatedScaler {
  ScalerSettings settings;
  float scale = 0;
  int tracker = 0;
  std::int64_t skipped = 0;

  explicit EmulatedScaler(ScalerSettings s) : settings(s), scale(s.initial_scale) {}
  float inverse() const { return static_cast<float>(1.0 / static_cast<double>(scale)); }
  void update(bool overflow) {
    if (overflow) {
      scale = scale * settings.backoff_factor;
      tracker = 0;
      ++skipped;
      return;
    }
    ++tracker;
    if (tracker == settings.growth_interval) {
      const float grown = scale * settings.growth_factor;
      if (std::isfinite(grown)) scale = grown;
      tracker = 0;
    }
  }
};

/// The inner optimizer a training draws.
struct InnerSettings {
  bool adamw = true;
  float lr = 1e-3f;
  float momentum = 0;
  float weight_decay = 0;

  std::unique_ptr<Optimizer> make(std::size_t n, Device device) const {
    if (adamw)
      return std::make_unique<AdamW>(n, AdamWOptions{.lr = lr, .weight_decay = weight_decay},
                                     device);
    return std::make_unique<Sgd>(
        n, SgdOptions{.lr = lr, .momentum = momentum, .weight_decay = weight_decay}, device);
  }
  std::string describe() const {
    return adamw ? fmt::format("AdamW lr {:.3g} wd {:.3g}", lr, weight_decay)
                 : fmt::format("SGD lr {:.3g} momentum {:.3g}", lr, momentum);
  }
};

InnerSettings draw_inner(Draws& draws) {
  InnerSettings inner;
  inner.adamw = draws.coin("adamw");
  if (inner.adamw) {
    inner.lr = draws.uniform("lr", 5e-4f, 3e-3f);
    inner.weight_decay = 0.01f;
  } else {
    inner.lr = draws.uniform("lr", 0.02f, 0.1f);
    inner.momentum = draws.coin("momentum") ? 0.9f : 0.0f;
  }
  return inner;
}

// ---------------------------------------------------------------------------------------
// Training: a drawn 16-bit MLP, drawn batches per (step, rank), injected non-finite or huge
// gradients, and the contract's arithmetic emulated.

/// A value written into one element of one rank's local gradient before step().
struct Injection {
  int step = 0;
  int rank = 0;
  std::size_t parameter = 0;  ///< index into Model::parameters()
  std::size_t element = 0;    ///< within the parameter
  float value = 0;
};

struct Training {
  DataType type = DataType::kBFloat16;
  std::string spec;
  int features = 0;
  int classes = 0;
  std::uint64_t model_seed = 0;
  std::uint64_t data_seed = 0;
  int steps = 3;
  int rows = 4;
  InnerSettings inner;
  ScalerSettings scaler;
  std::vector<Injection> injections;
};

Training draw_training(Draws& draws, std::optional<DataType> type = std::nullopt) {
  Training t;
  t.type = type ? *type : (draws.coin("float16") ? DataType::kFloat16 : DataType::kBFloat16);
  t.features = static_cast<int>(draws.integer("features", 12, 24));
  const auto h1 = draws.integer("h1", 16, 40);
  const auto h2 = draws.integer("h2", 8, 24);
  t.classes = static_cast<int>(draws.integer("classes", 4, 10));
  t.spec = fmt::format("{}-{}-{}-{}", t.features, h1, h2, t.classes);
  t.model_seed = draws.seed("model seed");
  t.data_seed = draws.seed("data seed");
  t.steps = static_cast<int>(draws.integer("steps", 3, 5));
  t.rows = static_cast<int>(draws.integer("rows per rank", 2, 6));
  t.inner = draw_inner(draws);
  // float16 starts from a smaller scale than GradScaler's 2^16 here, so that most steps of a
  // short run update (an overflow is drawn on purpose in the scaling check). The scale is not a
  // power of two: a product by 1/S, a division by S and the order of 1/N and 1/S round alike
  // for every power of two, so only such a scale tells them apart.
  const float mantissa = draws.uniform("initial scale mantissa", 1.1f, 1.9f);
  t.scaler.initial_scale =
      t.type == DataType::kFloat16
          ? std::ldexp(mantissa, static_cast<int>(draws.integer("log2 initial scale", 6, 12)))
          : std::ldexp(mantissa, static_cast<int>(draws.integer("log2 initial scale", 0, 16)));
  return t;
}

std::string describe(const Training& t) {
  return fmt::format("{} MLP {}, {} steps, {} rows per rank, {}, initial scale {}",
                     to_string(t.type), t.spec, t.steps, t.rows, t.inner.describe(),
                     t.scaler.initial_scale);
}

Model make_model(const Training& t, Device device) {
  return Model::mlp(t.spec, {.seed = t.model_seed, .device = device, .dtype = t.type});
}

/// Rank `rank`'s batch at step `step`: float32 inputs (rounded by the model) and labels.
struct Batch16 {
  std::vector<float> inputs;
  std::vector<int> labels;
};

Batch16 batch_of(const Training& t, int step, int rank) {
  CounterRng rng(t.data_seed,
                 static_cast<std::uint64_t>(step) * 1024 + static_cast<std::uint64_t>(rank));
  Batch16 batch;
  for (int i = 0; i < t.rows * t.features; ++i) batch.inputs.push_back(rng.normal());
  for (int i = 0; i < t.rows; ++i)
    batch.labels.push_back(static_cast<int>(rng.below(static_cast<std::uint64_t>(t.classes))));
  return batch;
}

/// Forward and backward of `model` on rank `rank`'s batch of step `step` with `scale`, then
/// the injections of that step and rank.
void local_backward(Model& model, const Training& t, int step, int rank, float scale) {
  const Batch16 batch = batch_of(t, step, rank);
  Tensor inputs = Tensor::from(std::span<const float>(batch.inputs), MemoryCategory::kActivations,
                               model.device());
  inputs.reshape({t.rows, t.features});
  model.zero_grad();
  model.backward(model.forward(inputs), batch.labels, scale);
  for (const Injection& injection : t.injections)
    if (injection.step == step && injection.rank == rank)
      fill(model.parameters()[injection.parameter]->grad.view(injection.element, 1),
           injection.value);
}

/// What the contract's arithmetic gives after each step.
struct Expected {
  std::vector<std::vector<float>> parameters;  ///< after each step, widened
  std::vector<std::vector<float>> masters;     ///< the Psi masters after each step
  std::vector<bool> updated;
  std::vector<float> scale_before;  ///< S each step's backward uses
  std::vector<float> scale_after;
  std::vector<int> tracker_after;
  std::vector<std::int64_t> skipped_after;
};

/// The contract's arithmetic on `world` ranks, emulated in this process on the host.
Expected emulate(const Training& t, int world) {
  Model model = make_model(t, Device::kHost);
  const std::size_t psi = model.num_parameters();
  std::unique_ptr<Optimizer> inner = t.inner.make(psi, Device::kHost);
  std::vector<float> masters = model.flat_parameters();  // the 16-bit values widened
  EmulatedScaler scaler(t.scaler);
  Expected expected;
  for (int step = 0; step < t.steps; ++step) {
    expected.scale_before.push_back(scaler.scale);
    // The sum over ranks in the 16-bit type, rounded after every addition in rank order.
    std::vector<std::uint16_t> sum;
    for (int rank = 0; rank < world; ++rank) {
      local_backward(model, t, step, rank, scaler.scale);
      std::vector<std::uint16_t> local;
      for (const Parameter* parameter : model.parameters()) {
        const std::vector<std::uint16_t> bits = bits_of(parameter->grad);
        local.insert(local.end(), bits.begin(), bits.end());
      }
      if (rank == 0) {
        sum = local;
        continue;
      }
      for (std::size_t i = 0; i < psi; ++i)
        sum[i] = narrow(t.type, widen(t.type, sum[i]) + widen(t.type, local[i]));
    }
    const bool overflow =
        std::ranges::any_of(sum, [&](std::uint16_t b) { return !std::isfinite(widen(t.type, b)); });
    if (!overflow) {
      const float inverse = scaler.inverse();
      std::vector<float> gradient(psi);
      for (std::size_t i = 0; i < psi; ++i)
        gradient[i] = (widen(t.type, sum[i]) / static_cast<float>(world)) * inverse;
      inner->begin_step();
      inner->update(0, std::span<float>(masters), std::span<const float>(gradient));
      std::vector<float> rounded(psi);
      for (std::size_t i = 0; i < psi; ++i) rounded[i] = widen(t.type, narrow(t.type, masters[i]));
      model.set_flat_parameters(rounded);
    }
    scaler.update(overflow);
    expected.parameters.push_back(model.flat_parameters());
    expected.masters.push_back(masters);
    expected.updated.push_back(!overflow);
    expected.scale_after.push_back(scaler.scale);
    expected.tracker_after.push_back(scaler.tracker);
    expected.skipped_after.push_back(scaler.skipped);
  }
  return expected;
}

/// What a training check reads on each rank besides the parameters.
struct Watch {
  bool counters = false;  ///< the calls of every step, and the overflow all-reduce's bytes
};

/// Trains `t` with the lab's MixedZeroOne on every rank of `world` and compares every step
/// with `expected`. Returns the number of steps skipped, on rank 0.
void train_and_compare(const Training& t, int world, const Expected& expected, Watch watch,
                       const Draws& draws) {
  run_on_ranks(
      world,
      [&](Communicator& comm, Verdict& verdict) {
        const int rank = comm.rank();
        const Device device = grading::check_device();
        std::uint64_t one_float_bytes = 0;
        if (watch.counters) {
          const std::array<std::size_t, 1> one = {1};
          one_float_bytes = grading::allreduce_bytes_sent(comm, one);
        }
        Model model = make_model(t, device);
        const std::size_t psi = model.num_parameters();
        const auto n = static_cast<std::size_t>(world);
        const std::size_t shard = (psi + n - 1) / n;
        const InnerSettings inner = t.inner;
        // What one reduce-scatter of the padded 16-bit flat space and one all-gather of the
        // 16-bit shard send, the backend's own count: pieces that cover the shard once each
        // way send as much in all, a float32 or a fuller buffer more.
        std::uint64_t scatter_bytes = 0;
        std::uint64_t gather_bytes = 0;
        if (watch.counters) {
          const auto s = static_cast<std::int64_t>(shard);
          Tensor flat({s * world}, t.type, MemoryCategory::kOther, device);
          Tensor piece({s}, t.type, MemoryCategory::kOther, device);
          fill(flat.view(), 0.0f);
          CommCounters before = comm.counters();
          comm.reduce_scatter(std::as_const(flat).view(), piece.view(), ReduceOp::kSum)->wait();
          scatter_bytes = comm.counters().since(before).total_bytes_sent();
          before = comm.counters();
          comm.allgather(std::as_const(piece).view(), flat.view())->wait();
          gather_bytes = comm.counters().since(before).total_bytes_sent();
        }
        // Lab code gets a communicator that notes where each call's buffers live (lab 2's
        // watch, grading::watch_buffer_devices): the overflow flag's all-reduce must be in a
        // buffer on the model's device, which only a run on a device (--device emulated)
        // tells from a host buffer.
        grading::RecordingCommunicator recorder(comm);
        std::string misplaced;
        grading::watch_buffer_devices(recorder, device, misplaced);
        MixedZeroOne zero(
            model, recorder, [&](std::size_t s) { return inner.make(s, device); }, t.scaler);
        // The first difference of step `step` from the emulation, "" when there is none.
        const auto compare_step = [&](int step, bool updated,
                                      const CommCounters& calls) -> std::string {
          const auto k = static_cast<std::size_t>(step);
          if (updated != expected.updated[k]) {
            return (
                fmt::format("step() returned {}; expected {} (the sum over ranks of the 16-bit "
                            "gradients {} a value that is not finite)",
                            updated, static_cast<bool>(expected.updated[k]),
                            expected.updated[k] ? "holds no" : "holds"));
          }
          const std::string params = grading::compare_parameters(model, expected.parameters[k], 0);
          if (!params.empty()) {
            return fmt::format("({}): {}", updated ? "updated" : "skipped", params);
          }
          // This rank's masters: its shard of the emulation's Psi masters, padding zero.
          std::vector<float> my_masters(shard, 0.0f);
          for (std::size_t i = 0; i < shard; ++i)
            if (rank * shard + i < psi)
              my_masters[i] = expected.masters[k][static_cast<std::size_t>(rank) * shard + i];
          const std::string masters = compare_bits(host_floats(zero.shard_master_weights()),
                                                   my_masters, "shard_master_weights()");
          if (!masters.empty()) {
            return masters;
          }
          // A skipped step changes nothing of the inner optimizer, its step count neither
          // (AdamW's bias correction would move on).
          const auto updates =
              std::count(expected.updated.begin(), expected.updated.begin() + step + 1, true);
          if (zero.inner().step_count() != updates) {
            return (
                fmt::format("the inner optimizer's step_count() is {}; expected {}, the steps that "
                            "updated (a skipped step begins no step of it)",
                            zero.inner().step_count(), updates));
          }
          const lab8::LossScaler& scaler = zero.scaler();
          if (scaler.scale() != expected.scale_after[k] ||
              scaler.growth_tracker() != expected.tracker_after[k] ||
              scaler.skipped_steps() != expected.skipped_after[k]) {
            return (fmt::format(
                "the scaler holds scale {}, growth tracker {}, skipped steps {}; expected "
                "{}, {}, {}",
                scaler.scale(), scaler.growth_tracker(), scaler.skipped_steps(),
                expected.scale_after[k], expected.tracker_after[k], expected.skipped_after[k]));
          }
          if (watch.counters) {
            const std::uint64_t allreduces = calls.of(CommOp::kAllReduce).calls;
            const std::uint64_t scatters = calls.of(CommOp::kReduceScatter).calls;
            const std::uint64_t gathers = calls.of(CommOp::kAllGather).calls;
            const std::uint64_t others = calls.total_calls() - allreduces - scatters - gathers;
            std::vector<std::string> wrong;
            if (allreduces != 1)
              wrong.push_back(fmt::format(
                  "{} all-reduces; exactly one (of the overflow flag) decides for every rank",
                  allreduces));
            else if (calls.of(CommOp::kAllReduce).bytes_sent != one_float_bytes)
              wrong.push_back(fmt::format(
                  "the all-reduce sent {} bytes; one float32 element's all-reduce sends {}",
                  calls.of(CommOp::kAllReduce).bytes_sent, one_float_bytes));
            if (scatters < 1 || scatters > 4)
              wrong.push_back(fmt::format("{} reduce-scatters; expected 1 to 4", scatters));
            else if (calls.of(CommOp::kReduceScatter).bytes_sent != scatter_bytes)
              wrong.push_back(fmt::format(
                  "the reduce-scatters sent {} bytes; one of the padded {} flat space sends {}",
                  calls.of(CommOp::kReduceScatter).bytes_sent, to_string(t.type), scatter_bytes));
            if (updated && (gathers < 1 || gathers > 4))
              wrong.push_back(fmt::format("{} all-gathers; expected 1 to 4", gathers));
            else if (updated && calls.of(CommOp::kAllGather).bytes_sent != gather_bytes)
              wrong.push_back(fmt::format(
                  "the all-gathers sent {} bytes; one of the {} shard sends {}",
                  calls.of(CommOp::kAllGather).bytes_sent, to_string(t.type), gather_bytes));
            if (!updated && gathers != 0)
              wrong.push_back(fmt::format(
                  "{} all-gathers on a skipped step, whose parameters did not change", gathers));
            if (others != 0) wrong.push_back(fmt::format("{} other calls", others));
            if (!misplaced.empty()) wrong.push_back(misplaced);
            if (!wrong.empty()) return fmt::format("{}", fmt::join(wrong, "; "));
          }
          return "";
        };
        // A rank whose comparison fails records its first finding and goes on stepping: a rank
        // that returned early would leave the others waiting in the next collective, and the
        // report would be the hang instead of the first difference.
        bool failed = false;
        for (int step = 0; step < t.steps; ++step) {
          const auto k = static_cast<std::size_t>(step);
          const std::string at = fmt::format("step {}", step + 1);
          const float scale = zero.scaler().scale();
          if (!failed && scale != expected.scale_before[k]) {
            verdict.fail(fmt::format("{}: scaler().scale() is {} before backward; expected {}", at,
                                     scale, expected.scale_before[k]));
            failed = true;
          }
          local_backward(model, t, step, rank, scale);
          const CommCounters before = comm.counters();
          const bool updated = zero.step();
          const CommCounters calls = comm.counters().since(before);
          if (failed) continue;
          const std::string finding = compare_step(step, updated, calls);
          if (!finding.empty()) {
            verdict.fail(fmt::format("{}: {}", at, finding));
            failed = true;
          }
        }
        if (failed) return;
        verdict.note(fmt::format("{} steps, {} skipped, scale {} at the end", t.steps,
                                 expected.skipped_after.back(), expected.scale_after.back()));
      },
      draws);
}

// ---------------------------------------------------------------------------------------

TEST(Lab8MasterWeights, BitwiseTheContractArithmetic) {
  Draws draws("Lab8MasterWeights.BitwiseTheContractArithmetic");
  struct Case {
    DataType type;
    InnerSettings inner;
    std::size_t n;
    int steps;
    bool float32_gradients;
    std::uint64_t seed;
  };
  std::vector<Case> cases;
  for (const DataType type : {DataType::kBFloat16, DataType::kFloat16}) {
    draws.section(fmt::format("[{}:]", to_string(type)));
    Case c{type,
           draw_inner(draws),
           static_cast<std::size_t>(draws.integer("elements", 300, 3000)),
           static_cast<int>(draws.integer("steps", 3, 5)),
           draws.coin("float32 gradients"),
           draws.seed("values")};
    cases.push_back(c);
  }
  for (const Case& c : cases) {
    // The grader's emulation: masters widened, g = widen(grad) x factor, the inner update,
    // the parameters rounded.
    CounterRng rng(c.seed, 0);
    std::vector<std::uint16_t> initial(c.n);
    for (auto& b : initial) b = narrow(c.type, 0.5f * rng.normal());
    struct StepInput {
      std::vector<std::uint16_t> grads16;
      std::vector<float> grads32;
      float factor;
    };
    std::vector<StepInput> inputs;
    for (int step = 0; step < c.steps; ++step) {
      StepInput in;
      const int log2_scale = static_cast<int>(rng.below(12));
      const float scale = std::ldexp(1.0f, log2_scale);
      in.factor = static_cast<float>(1.0 / static_cast<double>(scale));
      for (std::size_t i = 0; i < c.n; ++i) {
        const float g = 0.05f * rng.normal() * scale;
        in.grads16.push_back(narrow(c.type, g));
        in.grads32.push_back(g);
      }
      inputs.push_back(std::move(in));
    }
    std::vector<float> masters(c.n);
    for (std::size_t i = 0; i < c.n; ++i) masters[i] = widen(c.type, initial[i]);
    std::unique_ptr<Optimizer> inner = c.inner.make(c.n, Device::kHost);
    std::vector<std::vector<float>> expected_params;
    std::vector<std::vector<float>> expected_masters;
    for (const StepInput& in : inputs) {
      std::vector<float> g(c.n);
      for (std::size_t i = 0; i < c.n; ++i)
        g[i] = (c.float32_gradients ? in.grads32[i] : widen(c.type, in.grads16[i])) * in.factor;
      inner->begin_step();
      inner->update(0, std::span<float>(masters), std::span<const float>(g));
      std::vector<float> params(c.n);
      for (std::size_t i = 0; i < c.n; ++i) params[i] = widen(c.type, narrow(c.type, masters[i]));
      expected_params.push_back(params);
      expected_masters.push_back(masters);
    }
    const std::string what =
        fmt::format("{} parameters, {} elements, {}, {} gradients", to_string(c.type), c.n,
                    c.inner.describe(), c.float32_gradients ? "float32" : "16-bit");
    run_on_ranks(
        1,
        [&](Communicator&, Verdict& verdict) {
          const Device device = grading::check_device();
          const auto to_tensor16 = [&](const std::vector<std::uint16_t>& bits) {
            std::vector<float> widened(bits.size());
            for (std::size_t i = 0; i < bits.size(); ++i) widened[i] = widen(c.type, bits[i]);
            return Tensor::from(std::span<const float>(widened), MemoryCategory::kParameters,
                                device)
                .to(c.type);  // exact: the values are 16-bit already
          };
          MemoryTracker& tracker = this_rank_memory().tracker();
          Tensor params = to_tensor16(initial);
          const grading::CategoryBytes before = grading::current_bytes(tracker);
          MasterWeightOptimizer optimizer(c.inner.make(c.n, device), c.type);
          grading::CategoryBytes expected;
          expected[MemoryCategory::kOptimizerState] = static_cast<std::int64_t>(
              4 * c.n + (c.inner.adamw ? 8 * c.n : (c.inner.momentum != 0 ? 4 * c.n : 0)));
          grading::CategoryBytes held = grading::current_bytes(tracker) - before;
          // A float32 gradient buffer is the design's choice: at most 4 bytes per element.
          if (held[MemoryCategory::kGradients] >= 0 &&
              held[MemoryCategory::kGradients] <= static_cast<std::int64_t>(4 * c.n))
            expected[MemoryCategory::kGradients] = held[MemoryCategory::kGradients];
          const std::string memory = grading::category_differences(held, expected);
          if (!memory.empty()) {
            verdict.fail(fmt::format("{}: after the constructor: {}", what, memory));
            return;
          }
          optimizer.load_master_weights(std::as_const(params).view());
          for (std::size_t k = 0; k < inputs.size(); ++k) {
            Tensor grads = c.float32_gradients
                               ? Tensor::from(std::span<const float>(inputs[k].grads32),
                                              MemoryCategory::kGradients, device)
                               : to_tensor16(inputs[k].grads16);
            optimizer.step(params.view(), std::as_const(grads).view(), inputs[k].factor);
            const std::vector<float> seen = host_floats(params.to(DataType::kFloat32));
            std::string finding = compare_bits(seen, expected_params[k], "the parameters");
            if (finding.empty())
              finding = compare_bits(host_floats(optimizer.master_weights()), expected_masters[k],
                                     "master_weights()");
            if (!finding.empty()) {
              verdict.fail(fmt::format("{}, step {} (factor {}): {}", what, k + 1, inputs[k].factor,
                                       finding));
              return;
            }
          }
          verdict.note(fmt::format("{}: bitwise after {} steps", what, inputs.size()));
        },
        draws);
  }
}

TEST(Lab8ZeroOne, BitwiseEmulationAfterEveryStep) {
  Draws draws("Lab8ZeroOne.BitwiseEmulationAfterEveryStep");
  const std::vector<int> worlds = draws.world_sizes(6);
  for (const DataType type : {DataType::kBFloat16, DataType::kFloat16}) {
    draws.section(fmt::format("[{}:]", to_string(type)));
    const Training t = draw_training(draws, type);
    for (const int world : worlds) {
      SCOPED_TRACE(describe(t));
      const Expected expected = emulate(t, world);
      train_and_compare(t, world, expected, {}, draws);
    }
  }
}

TEST(Lab8Scaling, SameStepsSkippedOnEveryRank) {
  Draws draws("Lab8Scaling.SameStepsSkippedOnEveryRank");
  // 1. The rule alone: GradScaler's defaults, then drawn settings and overflow sequences.
  {
    lab8::LossScaler defaults;
    std::vector<std::string> wrong;
    if (defaults.scale() != 65536.0f)
      wrong.push_back(fmt::format("initial scale {}, expected 65536", defaults.scale()));
    for (int i = 0; i < 1999; ++i) defaults.update(false);
    if (defaults.scale() != 65536.0f || defaults.growth_tracker() != 1999)
      wrong.push_back(
          fmt::format("after 1999 clean steps scale {} and tracker {}; expected 65536 and 1999",
                      defaults.scale(), defaults.growth_tracker()));
    defaults.update(false);
    if (defaults.scale() != 131072.0f || defaults.growth_tracker() != 0)
      wrong.push_back(fmt::format(
          "after 2000 clean steps scale {} and tracker {}; expected 131072 (growth factor 2 "
          "every 2000 clean steps) and 0",
          defaults.scale(), defaults.growth_tracker()));
    defaults.update(true);
    if (defaults.scale() != 65536.0f || defaults.skipped_steps() != 1)
      wrong.push_back(fmt::format(
          "after an overflow scale {} and skipped steps {}; expected 65536 (backoff 0.5) and 1",
          defaults.scale(), defaults.skipped_steps()));
    if (!wrong.empty())
      ADD_FAILURE() << "LossScaler with GradScaler's defaults: "
                    << fmt::format("{}", fmt::join(wrong, "; "));
  }
  for (int round = 0; round < 3; ++round) {
    draws.section(fmt::format("[rule {}:]", round + 1));
    ScalerSettings settings;
    // Round 2 starts in float's top binade, S in [2^127, 2^128), with a growth factor of 2 to 4
    // and its first 2 x growth_interval + 1 updates clean, so that on every seed a growth to
    // infinity is refused (and the tracker must still go back to 0) and the steps go on. The
    // product overflows float but not double: one computed in double and then rounded is inf.
    const bool top = round == 1;
    settings.initial_scale = top ? std::ldexp(draws.uniform("top scale mantissa", 1.0f, 1.9f), 127)
                                 : draws.uniform("initial scale", 1.0f, 70000.0f);  // not 2^k
    settings.growth_factor = draws.uniform("growth factor", top ? 2.0f : 1.5f, 4.0f);
    settings.backoff_factor = draws.uniform("backoff factor", 0.25f, 0.75f);
    settings.growth_interval = static_cast<int>(draws.integer("growth interval", 1, 4));
    const int updates = static_cast<int>(draws.integer("updates", 12, 24));
    lab8::LossScaler scaler(settings);
    EmulatedScaler emulated(settings);
    for (int u = 0; u < updates; ++u) {
      const bool overflow = top && u < 2 * settings.growth_interval + 1
                                ? false
                                : draws.integer("overflow one in four", 0, 3) == 0;
      const float inverse = scaler.inverse_scale();
      if (std::bit_cast<std::uint32_t>(inverse) !=
          std::bit_cast<std::uint32_t>(emulated.inverse())) {
        ADD_FAILURE() << fmt::format(
            "update {}: inverse_scale() {:.9g} for scale {}; expected "
            "(float)(1.0 / (double)S) = {:.9g}. Drawn: {}",
            u + 1, inverse, scaler.scale(), emulated.inverse(), draws.describe());
        break;
      }
      scaler.update(overflow);
      emulated.update(overflow);
      if (scaler.scale() != emulated.scale || scaler.growth_tracker() != emulated.tracker ||
          scaler.skipped_steps() != emulated.skipped) {
        ADD_FAILURE() << fmt::format(
            "after update {} ({}): scale {}, growth tracker {}, skipped steps {}; expected {}, "
            "{}, {}. Drawn: {}",
            u + 1, overflow ? "overflow" : "clean", scaler.scale(), scaler.growth_tracker(),
            scaler.skipped_steps(), emulated.scale, emulated.tracker, emulated.skipped,
            draws.describe());
        break;
      }
    }
  }
  // 2. Training with drawn overflow schedules: inf, -inf or NaN in one rank's gradient, and
  // finite values on two ranks whose 16-bit sum overflows (no rank sees it alone).
  const std::vector<int> worlds = draws.world_sizes(6);
  for (const int world : worlds) {
    draws.section(fmt::format("[{} ranks:]", world));
    Training t = draw_training(draws);
    t.steps = static_cast<int>(draws.integer("steps", 5, 7));
    t.scaler.growth_interval = static_cast<int>(draws.integer("growth interval", 1, 3));
    // Factors that are not powers of two either: every growth and backoff rounds.
    t.scaler.growth_factor = draws.uniform("growth factor", 1.5f, 3.0f);
    t.scaler.backoff_factor = draws.uniform("backoff factor", 0.3f, 0.7f);
    Model layout = make_model(t, Device::kHost);
    const auto parameters = static_cast<std::int64_t>(layout.parameters().size());
    // Two steps with events, the first of them never the last step.
    const int first = static_cast<int>(draws.integer("first overflow step", 0, t.steps - 3));
    const int second =
        static_cast<int>(draws.integer("second overflow step", first + 1, t.steps - 1));
    for (const int step : {first, second}) {
      const auto p = static_cast<std::size_t>(draws.integer("parameter", 0, parameters - 1));
      const auto element = static_cast<std::size_t>(draws.integer(
          "element", 0, static_cast<std::int64_t>(layout.parameters()[p]->value.size()) - 1));
      const bool summed = world >= 2 && (step == first || draws.coin("summed overflow"));
      if (summed) {
        // Each value finite in the type, their sum not: only the reduced shard shows it.
        const float huge = t.type == DataType::kFloat16 ? 40000.0f : 2.0e38f;
        const int a = static_cast<int>(draws.integer("rank a", 0, world - 2));
        const int b = static_cast<int>(draws.integer("rank b", a + 1, world - 1));
        t.injections.push_back({step, a, p, element, huge});
        t.injections.push_back({step, b, p, element, huge});
      } else {
        const int rank = static_cast<int>(draws.integer("rank", 0, world - 1));
        const float value = draws.pick<std::string>("value", {"inf", "-inf", "nan"}) == "nan"
                                ? std::numeric_limits<float>::quiet_NaN()
                                : std::numeric_limits<float>::infinity();
        t.injections.push_back({step, rank, p, element, value});
      }
    }
    SCOPED_TRACE(describe(t));
    const Expected expected = emulate(t, world);
    const auto skipped = std::ranges::count(expected.updated, false);
    if (skipped < 2)
      ADD_FAILURE() << fmt::format("grader bug: only {} steps overflow in the emulation. Drawn: {}",
                                   skipped, draws.describe());
    train_and_compare(t, world, expected, {.counters = true}, draws);
  }
}

/// What step() may take from its thread's heap beyond what each communicator call and its wait
/// take: the bookkeeping of a call (its Work, a view array) and a little to spare. Lab 5's
/// bounds (Lab5Memory.StepAllocatesNothing).
constexpr std::uint64_t kBookkeepingBytesPerCall = 256;
constexpr std::uint64_t kHeapSlackBytes = 2048;

TEST(Lab8Memory, EveryCategoryAgainstTheFormulas) {
  Draws draws("Lab8Memory.EveryCategoryAgainstTheFormulas");
  const std::vector<int> worlds = draws.world_sizes(6);
  Training t = draw_training(draws);
  t.inner.adamw = true;
  t.inner.weight_decay = 0.01f;
  draws.section("[AdamW, as the 2 + 2 + 12 accounting counts]");
  // Three steps, the middle one skipped on every rank (an infinity in rank 0's gradient): a
  // buffer that only an overflow step allocates is measured too.
  constexpr int kSteps = 3;
  constexpr int kOverflowStep = 1;
  t.injections.push_back({kOverflowStep, 0, 0, 0, std::numeric_limits<float>::infinity()});
  for (const int world : worlds) {
    run_on_ranks(
        world,
        [&](Communicator& comm, Verdict& verdict) {
          const Device device = grading::check_device();
          MemoryTracker& tracker = this_rank_memory().tracker();
          // What one collective call and its wait take from this thread's heap.
          const grading::HeapUse call_start = grading::heap_use_of_this_thread();
          {
            Tensor chunk({1}, MemoryCategory::kOther, device);
            Tensor full({world}, MemoryCategory::kOther, device);
            comm.allgather(std::as_const(chunk).view(), full.view())->wait();
          }
          const grading::HeapUse one_call = grading::heap_use_of_this_thread().since(call_start);
          const grading::CategoryBytes empty = grading::current_bytes(tracker);
          // The training checks' order: the model, the constructor (the gradients still
          // zero), then backward and step(), so that no code can tell this check from them.
          Model model = make_model(t, device);
          const std::size_t psi = model.num_parameters();
          const auto n = static_cast<std::size_t>(world);
          const auto s = static_cast<std::int64_t>((psi + n - 1) / n);
          const auto N = static_cast<std::int64_t>(n);
          // The model's own: 2 Psi of parameters and 2 Psi of gradients (the runtime's).
          const grading::CategoryBytes base = grading::current_bytes(tracker);
          const grading::CategoryBytes model_bytes = base - empty;
          const auto check = [&](const grading::CategoryBytes& held, std::string_view when) {
            grading::CategoryBytes expected;
            expected[MemoryCategory::kOptimizerState] = 12 * s;
            // The buffers of the design, each within its bound.
            const auto within = [&](MemoryCategory category, std::int64_t bound) {
              if (held[category] >= 0 && held[category] <= bound)
                expected[category] = held[category];
              else
                expected[category] = bound;  // named as over its bound
            };
            within(MemoryCategory::kCommunication, 2 * N * s + 4);
            within(MemoryCategory::kGradients, 6 * s);
            within(MemoryCategory::kParameters, 2 * s);
            const std::string differs = grading::category_differences(held, expected);
            if (!differs.empty())
              verdict.fail(fmt::format("{} (beyond the model's 2 Psi + 2 Psi, S = {}): {}", when, s,
                                       differs));
            return differs.empty();
          };
          tracker.reset_peaks();
          MixedZeroOne zero(
              model, comm, [&](std::size_t shard) { return t.inner.make(shard, device); },
              t.scaler);
          // The constructor's peak, a transient buffer too, within the same bounds.
          const grading::CategoryBytes constructor_peak = grading::peak_bytes(tracker) - base;
          if (!check(constructor_peak, "during the constructor")) return;
          if (!check(grading::current_bytes(tracker) - base, "after the constructor")) return;
          std::uint64_t most_heap = 0;
          for (int step = 0; step < kSteps; ++step) {
            local_backward(model, t, step, comm.rank(), zero.scaler().scale());
            const grading::CategoryBytes before = grading::current_bytes(tracker);
            tracker.reset_peaks();
            const CommCounters calls_before = comm.counters();
            const grading::HeapUse heap = grading::heap_use_of_this_thread();
            const bool updated = zero.step();
            const grading::HeapUse used = grading::heap_use_of_this_thread().since(heap);
            const std::uint64_t calls = comm.counters().since(calls_before).total_calls();
            const std::string which =
                fmt::format("step {} ({})", step + 1, updated ? "updated" : "skipped");
            // Peaks beyond what the model held as step() began, plus the constructor's.
            grading::CategoryBytes peak = grading::peak_bytes(tracker) - before;
            const grading::CategoryBytes since = before - base;
            for (std::size_t c = 0; c < kNumMemoryCategories; ++c)
              if (static_cast<MemoryCategory>(c) != MemoryCategory::kActivations)
                peak.bytes[c] += since.bytes[c];
            if (!check(peak, fmt::format("at the peak of {}", which))) return;
            // Memory the tracker cannot see (std::vector, new) counts too: lab 5's rule.
            const std::uint64_t allowed =
                calls * (one_call.bytes + kBookkeepingBytesPerCall) + kHeapSlackBytes;
            most_heap = std::max(most_heap, used.bytes);
            if (used.large_bytes > 0 || used.bytes > allowed) {
              verdict.fail(fmt::format(
                  "{}: step() took {} bytes from the heap ({} in blocks of {} bytes or more); "
                  "expected no block of {} bytes or more and at most {} in all (its {} calls "
                  "and their waits, {} bytes each, + {}, and {} to spare): every buffer is a "
                  "Tensor the constructor allocates, none a std::vector or new",
                  which, used.bytes, used.large_bytes, grading::kLargeAllocationBytes,
                  grading::kLargeAllocationBytes, allowed, calls, one_call.bytes,
                  kBookkeepingBytesPerCall, kHeapSlackBytes));
              return;
            }
          }
          verdict.note(fmt::format(
              "model {} + {} bytes (2 + 2 per parameter), optimizer state {} = 12 S, Psi {}, S {}; "
              "{} steps, one skipped, at most {} heap bytes per step()",
              model_bytes[MemoryCategory::kParameters], model_bytes[MemoryCategory::kGradients],
              12 * s, psi, s, kSteps, most_heap));
        },
        draws);
  }
}

/// The contract's bytes: replicated parts count Psi, sharded ones S = ceil(Psi / N).
std::size_t contract_bytes(Strategy strategy, std::size_t psi, int world) {
  const auto n = static_cast<std::size_t>(world);
  const std::size_t s = (psi + n - 1) / n;
  switch (strategy) {
    case Strategy::kDdp: return 2 * psi + 2 * psi + 12 * psi;
    case Strategy::kZero1: return 2 * psi + 2 * psi + 12 * s;
    case Strategy::kZero2: return 2 * psi + 2 * s + 12 * s;
    case Strategy::kZero3: return 2 * s + 2 * s + 12 * s;
  }
  return 0;
}

/// The largest Psi of `bytes(Psi) <= budget`, by bisection, for any nondecreasing `bytes`.
template <typename Bytes>
std::size_t largest_fitting(Bytes bytes, std::size_t budget, int world) {
  std::size_t low = 0;
  std::size_t high = (budget + 1) * static_cast<std::size_t>(world) + 1;
  while (high - low > 1) {
    const std::size_t middle = low + (high - low) / 2;
    if (bytes(middle) <= budget)
      low = middle;
    else
      high = middle;
  }
  return low;
}

// The design question's plausible wrong formulas live in instructor/design_formulas.h, which the
// student release leaves out (a right formula is the answer). Without it the check grades the same
// against the contract's formulas above, naming no near miss.
#if __has_include("instructor/design_formulas.h")
#include "instructor/design_formulas.h"
#endif

std::string_view name_of(Strategy strategy) {
  switch (strategy) {
    case Strategy::kDdp: return "DDP";
    case Strategy::kZero1: return "ZeRO-1";
    case Strategy::kZero2: return "ZeRO-2";
    case Strategy::kZero3: return "ZeRO-3";
  }
  return "?";
}

TEST(Lab8Design, PredictsBytesAndTheLargestModel) {
  Draws draws("Lab8Design.PredictsBytesAndTheLargestModel");
  const std::vector<Strategy> strategies = {Strategy::kDdp, Strategy::kZero1, Strategy::kZero2,
                                            Strategy::kZero3};
  // Cases: N = 1, N that leave a remainder of Psi, large N; budgets drawn log-uniformly, and a
  // budget of exactly bytes(Psi0) for Psi0 = k N + 1 (where a formula without the padding
  // answers more).
  struct Case {
    std::size_t psi;
    int world;
    std::size_t budget;
  };
  std::vector<Case> cases;
  for (int i = 0; i < 8; ++i) {
    draws.section(fmt::format("[case {}:]", i + 1));
    const int world = i == 0 ? 1 : static_cast<int>(draws.integer("N", 2, i < 4 ? 16 : 1024));
    auto psi = static_cast<std::size_t>(draws.integer("Psi", 1000, 4000000000));
    if (world > 1 && psi % static_cast<std::size_t>(world) == 0) ++psi;  // a remainder
    const double log_budget = draws.uniform("log10 budget", 6.0f, 12.0f);
    auto budget = static_cast<std::size_t>(std::pow(10.0, log_budget));
    if (i % 2 == 1) {
      // A budget that a padded shard fills exactly.
      const auto k = static_cast<std::size_t>(draws.integer("k", 1000, 100000000));
      budget =
          contract_bytes(draws.pick<std::string>("budget strategy", {"zero1", "zero3"}) == "zero1"
                             ? Strategy::kZero1
                             : Strategy::kZero3,
                         k * static_cast<std::size_t>(world) + 1, world);
    }
    cases.push_back({psi, world, budget});
  }
  std::vector<std::string> failures;
  for (const Case& c : cases)
    for (const Strategy strategy : strategies) {
      const std::string where = fmt::format("{} on {} ranks", name_of(strategy), c.world);
      const std::size_t bytes = lab8::model_state_bytes_per_rank(strategy, c.psi, c.world);
      const std::size_t right = contract_bytes(strategy, c.psi, c.world);
      if (bytes != right)
        failures.push_back(fmt::format("model_state_bytes_per_rank({}, Psi {}): {}, expected {}",
                                       where, c.psi, bytes, right));
      const double per = lab8::bytes_per_parameter(strategy, c.world);
      const double n = c.world;
      const double exact = strategy == Strategy::kDdp     ? 16.0
                           : strategy == Strategy::kZero1 ? 4.0 + 12.0 / n
                           : strategy == Strategy::kZero2 ? 2.0 + 14.0 / n
                                                          : 16.0 / n;
      if (!(std::abs(per - exact) <= 1e-12 * exact))
        failures.push_back(
            fmt::format("bytes_per_parameter({}): {:.12g}, expected {:.12g}", where, per, exact));
      const std::size_t largest = lab8::largest_model_that_fits(strategy, c.world, c.budget);
      const std::size_t right_largest = largest_fitting(
          [&](std::size_t p) { return contract_bytes(strategy, p, c.world); }, c.budget, c.world);
      if (largest != right_largest)
        failures.push_back(
            fmt::format("largest_model_that_fits({}, budget {} bytes): {}, expected {}", where,
                        c.budget, largest, right_largest));
    }
#if __has_include("instructor/design_formulas.h")
  // Every plausible wrong formula must be told from the right one by these draws.
  for (const NearMiss& miss : near_misses()) {
    bool parted = false;
    for (const Case& c : cases)
      for (const Strategy strategy : strategies) {
        if (miss.bytes(strategy, c.psi, c.world) != contract_bytes(strategy, c.psi, c.world))
          parted = true;
        const std::size_t wrong_largest =
            miss.largest
                ? miss.largest(strategy, c.world, c.budget)
                : largest_fitting([&](std::size_t p) { return miss.bytes(strategy, p, c.world); },
                                  c.budget, c.world);
        if (wrong_largest !=
            largest_fitting([&](std::size_t p) { return contract_bytes(strategy, p, c.world); },
                            c.budget, c.world))
          parted = true;
      }
    if (!parted)
      ADD_FAILURE() << fmt::format(
          "grader bug: no draw tells the near miss \"{}\" from the right "
          "formulas. Drawn: {}",
          miss.name, draws.describe());
  }
#endif
  if (!failures.empty()) {
    ADD_FAILURE() << fmt::format("{} of {} answers wrong, the first: {}. Drawn: {}",
                                 failures.size(), cases.size() * strategies.size() * 3,
                                 failures.front(), draws.describe());
    return;
  }
  grading::note_measured(fmt::format(
      "{} cases right; bytes per parameter on 8 ranks: DDP 16, ZeRO-1 {:.4g}, ZeRO-2 {:.4g}, "
      "ZeRO-3 {:.4g}",
      cases.size() * strategies.size(), 4.0 + 12.0 / 8, 2.0 + 14.0 / 8, 16.0 / 8));
}

}  // namespace
}  // namespace dp
