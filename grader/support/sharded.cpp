// sharded.cpp: see sharded.h.
#include "sharded.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "dp/error.h"
#include "dp/tensor_ops.h"
#include "dp/text_data.h"

namespace dp::grading {

TrainOptions ShardedTraining::for_world(int world) const {
  TrainOptions concrete = options;
  concrete.global_batch = rows_per_rank * world;
  return concrete;
}

Model ShardedTraining::model() const {
  return make_check_model(options);
}

std::string ShardedTraining::model_name() const {
  if (!is_gpt()) return options.model;
  return fmt::format("{} (vocab {})", options.model, options.vocab);
}

ShardedTraining draw_sharded_gpt_training(Draws& draws, const std::string& optimizer) {
  ShardedTraining training;
  TrainOptions& o = training.options;
  GptSpec spec;
  spec.layers = draws.integer("gpt layers", 1, 2);
  spec.heads = 2;
  spec.dim = 2 * draws.integer("gpt head dim", 8, 16);
  spec.context = draws.integer("gpt context", 8, 16);
  o.model = fmt::format("gpt:layers={},dim={},heads={},context={}", spec.layers, spec.dim,
                        spec.heads, spec.context);
  training.hidden1 = spec.dim;
  training.hidden2 = spec.dim;
  const std::string_view text = grader_text();
  const auto characters =
      static_cast<std::size_t>(draws.integer("text characters", 900, std::ssize(text)));
  o.dataset = fmt::format("the grader's text ({} characters)", characters);
  o.seed = draws.seed("seed");
  o.steps = static_cast<int>(draws.integer("steps", 3, 5));
  draw_optimizer(draws, optimizer, o);
  training.rows_per_rank = draws.integer("windows per rank", 2, 4);
  training.data = std::make_shared<const Dataset>(
      make_text_dataset(text.substr(0, characters), spec.context, o.dataset));
  o.vocab = training.data->num_classes;
  draws.section(fmt::format("model {}, vocab {}, {} windows of {} tokens", o.model, o.vocab,
                            training.data->size(), spec.context));
  return training;
}

ShardedTraining draw_sharded_training(Draws& draws, const std::string& optimizer) {
  ShardedTraining training;
  TrainOptions& o = training.options;
  training.hidden1 = draws.integer("hidden1", 24, 72);
  training.hidden2 = draws.integer("hidden2", 12, 40);
  o.activation = "gelu";
  o.layer_norm = draws.coin("layer norm");
  o.model = fmt::format("64-{}-{}-10", training.hidden1, training.hidden2);
  o.dataset = fmt::format("synthetic:{}", draws.integer("samples", 200, 400));
  o.seed = draws.seed("seed");
  o.steps = static_cast<int>(draws.integer("steps", 3, 5));
  draw_optimizer(draws, optimizer, o);
  training.rows_per_rank = draws.integer("rows per rank", 2, 6);
  training.data = std::make_shared<const Dataset>(load_dataset(o.dataset, o.seed));
  return training;
}

TrainOptions design_training(const std::string& spec, bool layer_norm, int world) {
  TrainOptions options;
  options.model = spec;
  options.activation = "relu";
  options.layer_norm = layer_norm;
  options.seed = 3;
  options.optimizer = "adamw";
  options.lr = 0.01f;
  options.weight_decay = 0.0f;
  options.steps = 1;
  options.dataset = "synthetic:128";
  options.global_batch = 4 * static_cast<std::int64_t>(world);
  return options;
}

const Dataset& design_data() {
  static const Dataset data = load_dataset("synthetic:128", 5);
  return data;
}

ShardedTraining sgd_with_momentum_on_the_same_model(Draws& draws, const ShardedTraining& first) {
  ShardedTraining sgd = draw_sharded_training(draws, "sgd");
  sgd.options.momentum = 0.9f;
  sgd.options.model = first.options.model;
  sgd.options.layer_norm = first.options.layer_norm;
  sgd.hidden1 = first.hidden1;
  sgd.hidden2 = first.hidden2;
  draws.overrule("hidden1", fmt::format("hidden1={} (the AdamW model's)", sgd.hidden1));
  draws.overrule("hidden2", fmt::format("hidden2={} (the AdamW model's)", sgd.hidden2));
  draws.overrule("layer norm",
                 fmt::format("layer norm={} (the AdamW model's)", sgd.options.layer_norm));
  draws.overrule("momentum 0.9", "momentum=0.9 (set by the check)");
  return sgd;
}

float clip_by_sharded_norm(std::vector<float>& g,
                           const std::vector<std::vector<std::size_t>>& real_by_rank,
                           float max_norm) {
  float sum = 0;
  for (std::size_t r = 0; r < real_by_rank.size(); ++r) {
    double partial = 0;  // dp::dot: double, index order
    for (const std::size_t i : real_by_rank[r])
      partial += static_cast<double>(g[i]) * static_cast<double>(g[i]);
    sum = r == 0 ? static_cast<float>(partial) : sum + static_cast<float>(partial);
  }
  const float norm = std::sqrt(sum);
  const float coefficient = max_norm / (norm + 1e-6f);
  if (coefficient < 1.0f)
    for (float& value : g) value = coefficient * value;
  return norm;
}

ClippedTrajectory emulate_clipped(const TrainOptions& options, const Dataset& data, int world,
                                  const std::vector<std::vector<std::size_t>>& real_by_rank,
                                  float max_norm) {
  ClippedTrajectory result;
  Emulation how;
  how.before_step = [&](int, std::vector<float>& g) {
    double exact = 0;
    for (const float value : g) exact += static_cast<double>(value) * value;
    result.norms.push_back(clip_by_sharded_norm(g, real_by_rank, max_norm));
    result.clipped_steps += result.norms.back() + 1e-6f > max_norm;
    result.worst_relative = std::max(
        result.worst_relative, std::abs(result.norms.back() - std::sqrt(exact)) / std::sqrt(exact));
  };
  result.exact = emulate_data_parallel(options, data, world, how);
  return result;
}

PlainTwin plain_twin(const ShardedTraining& training, int world, const Communicator& comm) {
  const TrainOptions options = training.for_world(world);
  MemoryTracker& tracker = this_rank_memory().tracker();
  PlainTwin twin{training.model(), 0};
  const std::size_t activation_base = tracker.current(MemoryCategory::kActivations);
  tracker.reset_peaks();
  // Two steps, as the memory checks run them: in the second forward the loss still keeps
  // the first step's rows (a GPT's B T x vocab probabilities outweigh what the first
  // backward's temporaries add, an MLP's B x 10 do not).
  for (int step = 0; step < 2; ++step) {
    const Batch batch =
        on_check_device(local_batch(*training.data, options, step, comm.rank(), world));
    twin.model.backward(forward(twin.model, batch), batch.labels);
  }
  twin.activation_bytes = tracker.peak(MemoryCategory::kActivations) - activation_base;
  return twin;
}

std::function<std::unique_ptr<Optimizer>(std::size_t)> shard_optimizer_factory(
    const TrainOptions& options) {
  return [options](std::size_t shard) { return optimizer_for(options, shard); };
}

namespace {

/// Plain SGD over `shard` elements with its state on `device` (no state tensor, so any
/// device will do, even one this machine lacks: only its `device()` says where).
std::unique_ptr<Optimizer> plain_sgd_on(std::size_t shard, Device device) {
  return std::make_unique<Sgd>(shard, SgdOptions{}, device);
}

/// "" when `message` names both devices (as dp::to_string spells their names, "host" and
/// "cuda", in any case); else what it lacks.
std::string device_mismatch_finding(std::string_view message, Device model, Device inner) {
  std::string lower(message);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  // "cuda (emulated)" names the device "cuda": the first word is the name.
  const auto name = [](Device device) { return device == Device::kHost ? "host" : "cuda"; };
  std::vector<std::string> missing;
  for (const Device device : {inner, model})
    if (lower.find(name(device)) == std::string::npos)
      missing.push_back(fmt::format("\"{}\" ({})", name(device),
                                    device == inner ? "the optimizer's" : "the model's"));
  if (missing.empty()) return "";
  return fmt::format("the message \"{}\" does not name {}; expected it to name both devices",
                     message, fmt::join(missing, " or "));
}

}  // namespace

void expect_inner_optimizer_elsewhere_refused(
    Verdict& verdict, Device model_device,
    const std::function<void(const std::function<std::unique_ptr<Optimizer>(std::size_t)>&)>&
        construct) {
  const Device other = model_device == Device::kHost ? Device::kCuda : Device::kHost;
  const std::string what =
      fmt::format("a factory whose optimizer keeps its state in {} memory (the model's is {})",
                  to_string(other), to_string(model_device));
  try {
    construct([other](std::size_t shard) { return plain_sgd_on(shard, other); });
    verdict.fail(fmt::format("{}: the constructor returned; expected dp::Error", what));
  } catch (const NotImplemented&) {
    throw;
  } catch (const Error& error) {
    verdict.expect_empty(device_mismatch_finding(error.what(), model_device, other), what);
  }
}

UpdateRecorder::UpdateRecorder(std::unique_ptr<Optimizer> inner)
    : Optimizer(inner->state_size(), inner->device()), inner_(std::move(inner)) {}

void UpdateRecorder::begin_step() {
  Optimizer::begin_step();
  inner_->begin_step();
  last_updates_.clear();
}

void UpdateRecorder::update(std::size_t offset, std::span<float> params,
                            std::span<const float> grads) {
  last_updates_.emplace_back(offset, grads.size());
  inner_->update(offset, params, grads);
}

void UpdateRecorder::update_on_device(std::size_t offset, float* params, const float* grads,
                                      std::size_t n) {
  last_updates_.emplace_back(offset, n);
  inner_->update(offset, TensorView(params, n, device()), ConstTensorView(grads, n, device()));
}

Batch on_check_device(Batch batch) {
  if (batch.inputs.device() != check_device()) batch.inputs = batch.inputs.to(check_device());
  return batch;
}

Tensor forward(Model& model, const Batch& batch) {
  // The check device, not model.device(): lab 7 releases the values it asks.
  if (batch.inputs.device() == check_device()) return model.forward(batch.inputs);
  return model.forward(batch.inputs.to(check_device()));
}

std::vector<float> host_values(ConstTensorView elements) {
  // A plain vector, not a Tensor: the copy is the grader's, and no MemoryTracker account
  // of the rank should see it.
  std::vector<float> values(elements.size());
  copy(elements, TensorView(values.data(), values.size()));
  return values;
}

std::vector<float> host_values(const Tensor& tensor) {
  return host_values(tensor.view());
}

std::vector<Suspect> division_suspects(int world) {
  const double n = world;
  return {{n, fmt::format("a missing division by N = {}", world)},
          {1.0 / n, fmt::format("the division by N = {} applied twice", world)}};
}

std::string compare_sharded_step(const ShardedStep& s) {
  if (s.max_norm == 0 && s.norm.has_value())
    return fmt::format("step {} returned a norm ({}) with clipping off; expected std::nullopt",
                       s.step, *s.norm);
  if (s.max_norm > 0) {
    const float expected = s.expected_norms[static_cast<std::size_t>(s.step - 1)];
    if (!s.norm.has_value())
      return fmt::format("step {} returned no norm with clipping on (max_norm {})", s.step,
                         s.max_norm);
    // Bitwise: the contract fixes the norm's arithmetic.
    if (std::memcmp(&*s.norm, &expected, sizeof(float)) != 0)
      return fmt::format(
          "step {} returned the norm {:.9g}; expected {:.9g}, the contract's arithmetic {} "
          "(ratio {:.6g}{})",
          s.step, *s.norm, expected, s.norm_arithmetic, *s.norm / expected,
          s.world > 1 && std::abs(*s.norm / expected - static_cast<float>(s.world)) < 1e-3f
              ? ": the norm of the sum, before the division by N?"
              : "");
  }
  const std::vector<float>& expected =
      s.exact.parameters_after_step[static_cast<std::size_t>(s.step - 1)];
  const std::string finding = compare_parameters(s.model, expected, 0.0f);
  if (finding.empty()) return "";
  const std::vector<float> seen = s.model.flat_parameters();
  const std::string hint = scale_hint(difference(seen, s.before), difference(expected, s.before),
                                      division_suspects(s.world));
  return fmt::format("first differing step {}: {}; {}{}", s.step, finding,
                     per_parameter_summary(s.model, seen, expected),
                     hint.empty() ? "" : "; " + hint);
}

}  // namespace dp::grading
