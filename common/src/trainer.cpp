#include "dp/trainer.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <span>
#include <utility>

#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/checkpoint.h"
#include "dp/clock.h"
#include "dp/error.h"
#include "dp/host_collectives.h"
#include "dp/launch.h"
#include "dp/loss_scaler.h"
#include "dp/rng.h"
#include "dp/tensor_ops.h"
#include "precision.h"

namespace dp {
namespace {

using SteadyClock = std::chrono::steady_clock;

/// Throws naming the first NaN or infinity among the gradients (in parameter order) if any.
void throw_if_not_finite(Model& model, int rank, int step, const char* when) {
  for (Parameter* parameter : model.parameters()) {
    if (parameter->frozen) continue;
    const Tensor host_grad =
        detail::widened(parameter->grad, MemoryCategory::kOther).to(Device::kHost);
    const std::span<const float> grad = host_grad.span();
    for (std::size_t i = 0; i < grad.size(); ++i) {
      if (!std::isfinite(grad[i]))
        throw Error(fmt::format(
            "step {}: the gradient of {} holds {} at element {} on rank {} ({}); expected "
            "finite values: lower the learning rate or check the input data",
            step, parameter->name, grad[i], i, rank, when));
    }
  }
}

/// The trainer's reads of the gradients: whether they are finite, and the largest |g| seen
/// over the run (for the equivalence tolerance). Each `scan` is one pass over all the
/// gradients at once. On a GPU that is one launch (cuda::fold_max_abs_bits) into a small
/// device result; a check reads it back (one synchronisation), while the running maximum
/// stays on the device until `running_max`, at the end of the run. So a step costs one
/// synchronisation, not an allocation, a launch and a synchronisation per parameter for each
/// of the two reads. On the host and the emulated device the same pass is a loop, and the
/// results are those of the GPU bit for bit: the largest |g| does not depend on the order,
/// and a non-finite element is one whose |g| has the bits 0x7f800000 or more.
class GradientWatch {
 public:
  /// Watches gradients that live on `device`.
  explicit GradientWatch(Device device) : device_(device) {
    if (detail::on_gpu(device_)) {
      bits_ = static_cast<unsigned int*>(cuda::allocate(2 * sizeof(unsigned int)));
      detail::copy_memory(bits_, device_, std::array<unsigned int, 2>{}.data(), Device::kHost,
                          2 * sizeof(unsigned int));
    }
  }
  ~GradientWatch() {
    if (bits_ != nullptr) cuda::deallocate(bits_);
  }
  GradientWatch(const GradientWatch&) = delete;
  GradientWatch& operator=(const GradientWatch&) = delete;

  /// One pass over the gradients of `model`: with `check`, throws naming the first
  /// non-finite element of a non-frozen gradient (step, parameter, element, rank, `when`);
  /// with `track`, folds the largest |g| of every gradient into the running maximum.
  void scan(Model& model, bool check, bool track, int rank, int step, const char* when) {
    arrays_.clear();
    sizes_.clear();
    views_.clear();
    std::size_t elements = 0;
    // Every gradient, frozen ones too: the maximum counts them (they hold zeros), and a
    // non-finite frozen one makes throw_if_not_finite look and find nothing to report.
    for (Parameter* parameter : model.parameters()) {
      const ConstTensorView grad = std::as_const(parameter->grad).view();
      views_.push_back(grad);
      elements += grad.size();
      if (!detail::on_gpu(device_)) continue;  // 16-bit models train on the host or emulated
      arrays_.push_back(grad.data());
      sizes_.push_back(grad.size());
    }
    // On a device the scan is work of its own (on the host it never was charged).
    const bool charged = device_ != Device::kHost;
    const OpCost cost{.flops = static_cast<double>(elements),
                      .bytes = static_cast<double>(elements) * sizeof(float)};
    unsigned int scanned = 0;
    const auto pass = [&] {
      if (detail::on_gpu(device_)) {
        cuda::fold_max_abs_bits(arrays_.data(), sizes_.data(), arrays_.size(),
                                check ? &bits_[0] : nullptr, track ? &bits_[1] : nullptr);
        if (check) detail::copy_memory(&scanned, Device::kHost, &bits_[0], device_, sizeof scanned);
        return;
      }
      // Host memory or the emulated device's; 16-bit elements widened exactly.
      for (const ConstTensorView& view : views_) {
        if (view.dtype() == DataType::kFloat32) {
          const float* values = view.data();
          for (std::size_t i = 0; i < view.size(); ++i)
            scanned = std::max(scanned, magnitude_bits(values[i]));
        } else if (view.dtype() == DataType::kBFloat16) {
          const auto* values = static_cast<const BFloat16*>(view.raw_data());
          for (std::size_t i = 0; i < view.size(); ++i)
            scanned = std::max(scanned, magnitude_bits(to_float(values[i])));
        } else {
          const auto* values = static_cast<const Float16*>(view.raw_data());
          for (std::size_t i = 0; i < view.size(); ++i)
            scanned = std::max(scanned, magnitude_bits(to_float(values[i])));
        }
      }
      host_running_ = track ? std::max(host_running_, scanned) : host_running_;
    };
    if (charged) {
      timed_compute("gradient scan", "", cost, pass);
    } else {
      pass();
    }
    if (check && scanned >= kInfinityBits) throw_if_not_finite(model, rank, step, when);
  }

  /// The largest |g| folded in by the scans so far (on a GPU a read that waits for them).
  float running_max() const {
    unsigned int bits = host_running_;
    if (detail::on_gpu(device_))
      detail::copy_memory(&bits, Device::kHost, &bits_[1], device_, sizeof bits);
    float largest = 0;
    static_assert(sizeof largest == sizeof bits);
    std::memcpy(&largest, &bits, sizeof largest);
    return largest;
  }

 private:
  static constexpr unsigned int kInfinityBits = 0x7f800000u;  // |g| bits of +inf; NaN above

  // The bits of |x|, which order as unsigned integers for non-negative floats.
  static unsigned int magnitude_bits(float x) {
    const float magnitude = std::abs(x);
    unsigned int bits = 0;
    std::memcpy(&bits, &magnitude, sizeof bits);
    return bits;
  }

  Device device_;
  unsigned int* bits_ = nullptr;   // on a GPU: {the last check's scan, the running maximum}
  unsigned int host_running_ = 0;  // elsewhere: the running maximum
  std::vector<const float*> arrays_;
  std::vector<std::size_t> sizes_;
  std::vector<ConstTensorView> views_;
};

/// `options` with a GPT's vocabulary taken from `data` when it is not set.
TrainOptions with_vocabulary_of(const TrainOptions& options, const Dataset& data) {
  TrainOptions resolved = options;
  if (is_gpt_spec(options.model) && resolved.vocab == 0) resolved.vocab = data.num_classes;
  return resolved;
}

std::unique_ptr<Optimizer> make_optimizer_for(const TrainOptions& options, const Model& model) {
  std::unique_ptr<Optimizer> optimizer =
      make_optimizer(options.optimizer, model.num_parameters(), options.lr, options.momentum,
                     options.weight_decay, options.device);
  if (options.precision == DataType::kFloat32) return optimizer;
  auto mixed = std::make_unique<MixedPrecisionOptimizer>(std::move(optimizer), options.precision);
  mixed->load_master_weights(model);
  return mixed;
}

/// The type the gradients are all-reduced in.
DataType reduce_type_of(const TrainOptions& options) {
  return options.reduce_dtype.value_or(options.precision);
}

/// destination = the elements of host tensor `source`, wherever destination lives (not
/// dp::copy: restoring a run is not part of a step, so the simulated clock is not charged).
void copy_from_host(const Tensor& source, Tensor& destination) {
  DP_CHECK(source.dtype() == destination.dtype() && source.size() == destination.size(),
           "restoring {} elements of {} into {} of {}", source.size(), to_string(source.dtype()),
           destination.size(), to_string(destination.dtype()));
  detail::copy_memory(destination.view().raw_data(), destination.device(), source.view().raw_data(),
                      Device::kHost, source.bytes());
}

/// Restores the parameters and the optimizer of a run from `checkpoint` (checked against the
/// options by `load_training_checkpoint`).
///
/// A float32 run given a mixed-precision checkpoint (compare_with_float32 continuing a
/// resumed run in float32) starts from its float32 masters and the inner optimizer's state.
void restore(const TrainingCheckpoint& checkpoint, Model& model, Optimizer& optimizer) {
  auto* mixed = dynamic_cast<MixedPrecisionOptimizer*>(&optimizer);
  const auto masters = checkpoint.tensors.find("optimizer.master_weights");
  const bool from_masters = mixed == nullptr && masters != checkpoint.tensors.end();
  for (Parameter* parameter : model.parameters()) {
    if (from_masters) {
      DP_CHECK(parameter->value.dtype() == DataType::kFloat32 &&
                   parameter->offset + parameter->value.size() <= masters->second.size(),
               "restoring {} from master weights of {} elements", parameter->name,
               masters->second.size());
      detail::copy_memory(parameter->value.view().raw_data(), parameter->value.device(),
                          masters->second.data() + parameter->offset, Device::kHost,
                          parameter->value.bytes());
      continue;
    }
    copy_from_host(checkpoint.tensors.at(parameter->name), parameter->value);
  }
  for (const OptimizerState& state : optimizer.state())
    copy_from_host(checkpoint.tensors.at("optimizer." + state.name), *state.tensor);
  optimizer.set_step_count(checkpoint.optimizer_steps);
  // The inner optimizer counts its own steps (AdamW's bias correction reads them).
  if (mixed != nullptr) mixed->inner().set_step_count(checkpoint.optimizer_steps);
}

/// One process in the place of `world` ranks (train_emulating_data_parallel): each rank's
/// gradient on its slice of the global batch, added in rank order, ((g_0 + g_1) + g_2) + ...,
/// and divided by the rank count, as the local and mpi backends' kAvg all-reduce does, left
/// in the model's gradients; `metrics` gets the sums over the global batch.
///
/// In mixed precision the sums are those of the reduce type, as the backends add it: float32
/// sums of the widened gradients, rounded once into them at the end, or 16-bit sums rounded
/// after every addition and a quotient rounded once (reduce_arithmetic.h's rule). `loss_scale`
/// multiplies the loss's gradient (fp16), and `check` says whether a non-finite gradient is an
/// error (not under fp16 loss scaling, where it is an overflow that skips the step).
void emulate_ranks_step(Model& model, const Dataset& data, std::span<const std::size_t> batch,
                        int world, std::int64_t local_batch, Device device, int step,
                        std::vector<Tensor>& sums, std::array<float, 2>& metrics,
                        GradientWatch& watch, DataType reduce_type, float loss_scale, bool check) {
  const std::span<Parameter* const> parameters = model.parameters();
  const bool wide_sums = reduce_type == DataType::kFloat32;
  if (sums.empty())
    for (Parameter* parameter : parameters)
      sums.emplace_back(parameter->grad.shape(), reduce_type, MemoryCategory::kGradients, device);
  // 16-bit sums are added in float32 in this tensor and rounded back after each addition.
  std::vector<Tensor> wide;
  if (!wide_sums)
    for (Parameter* parameter : parameters)
      wide.emplace_back(parameter->grad.shape(), MemoryCategory::kGradients, device);
  metrics = {0.0f, 0.0f};
  for (int rank = 0; rank < world; ++rank) {
    const Batch slice =
        gather_batch(data, batch.subspan(static_cast<std::size_t>(rank * local_batch),
                                         static_cast<std::size_t>(local_batch)));
    model.zero_grad();
    const Tensor device_inputs = device != Device::kHost ? slice.inputs.to(device) : Tensor();
    const Tensor logits = model.forward(device != Device::kHost ? device_inputs : slice.inputs);
    const float loss = model.backward(logits, slice.labels, loss_scale);
    watch.scan(model, check, /*track=*/false, rank, step, "before averaging");
    // The order of the ranks' metrics sum, as the metrics all-reduce adds them.
    metrics[0] += loss * static_cast<float>(local_batch);
    metrics[1] += accuracy(logits, slice.labels) * static_cast<float>(local_batch);
    for (std::size_t i = 0; i < parameters.size(); ++i) {
      if (parameters[i]->frozen) continue;
      if (rank == 0) {
        convert(parameters[i]->grad.view(), sums[i].view());  // a copy, or widened exactly
      } else if (wide_sums) {
        add(parameters[i]->grad.view(), sums[i].view());  // sum + g_rank, in float32
      } else {
        convert(sums[i].view(), wide[i].view());  // round(widen(sum) + widen(g_rank))
        add(parameters[i]->grad.view(), wide[i].view());
        convert(wide[i].view(), sums[i].view());
      }
    }
  }
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    if (parameters[i]->frozen) continue;
    if (wide_sums) {
      divide(sums[i].view(), static_cast<float>(world));
      convert(sums[i].view(), parameters[i]->grad.view());  // a copy, or rounded once
    } else {
      convert(sums[i].view(), wide[i].view());  // round(widen(sum) / N)
      divide(wide[i].view(), static_cast<float>(world));
      convert(wide[i].view(), parameters[i]->grad.view());
    }
  }
}

/// The training loop shared by the entry points; `comm` is null for a single process, which
/// emulates `emulated_world` ranks when that is above 1.
TrainResult train(const TrainOptions& given_options, const Dataset& data, Communicator* comm,
                  const ReportCallback& on_report, const TrainCheckpointing& checkpointing,
                  int emulated_world = 1) {
  const TrainOptions options = with_vocabulary_of(given_options, data);
  const int world = comm != nullptr ? comm->size() : emulated_world;
  const int rank = comm != nullptr ? comm->rank() : 0;
  check_train_options(options);
  check_train_device(options.device);
  if (options.global_batch % world != 0)
    throw Error(fmt::format(
        "the global batch must be a positive multiple of the world size {} so that every "
        "rank gets an equal slice, got {}",
        world, options.global_batch));
  if (static_cast<std::size_t>(options.global_batch) > data.size())
    throw Error(fmt::format("the global batch {} is larger than the data set '{}' ({} samples)",
                            options.global_batch, data.name, data.size()));
  check_data_fits_model(options, data);
  if (checkpointing.every < 0)
    throw Error(
        fmt::format("checkpoints every {} steps: expected 0 (never) or more", checkpointing.every));

  const bool mixed = options.precision != DataType::kFloat32;
  if (mixed && detail::on_gpu(options.device))
    throw Error(fmt::format(
        "{} training on a GPU: the 16-bit layers run on the host and the emulated device only "
        "(--device host or emulated)",
        to_string(options.precision)));
  const DataType reduce_type = reduce_type_of(options);
  // fp16 scales its loss; bfloat16 has float32's range and needs no scaling.
  std::optional<DynamicLossScaler> scaler;
  if (options.precision == DataType::kFloat16) scaler.emplace(options.loss_scaling);
  if (scaler && checkpointing.resume_from != nullptr) {
    // The scale, growth tracker and skipped count as they were: the next steps scale as the
    // saved run's would have.
    if (!checkpointing.resume_from->loss_scaler)
      throw Error(
          "resuming float16 training from a checkpoint without the loss scaler's state: "
          "expected one read by load_training_checkpoint with the run's options");
    scaler = *checkpointing.resume_from->loss_scaler;
  }

  TrainResult result{make_model(options), nullptr, {}, 0.0f};
  Model& model = result.model;
  result.optimizer = make_optimizer_for(options, model);
  Optimizer& optimizer = *result.optimizer;
  auto* master_weights = dynamic_cast<MixedPrecisionOptimizer*>(&optimizer);
  const int first_step = checkpointing.resume_from != nullptr ? checkpointing.resume_from->step : 0;
  if (checkpointing.resume_from != nullptr) restore(*checkpointing.resume_from, model, optimizer);
  // On a device the parameters and gradients are exchanged where they live (the local and
  // nccl backends take device buffers; mpi refuses them at the first call, saying so); the
  // two metrics are host floats.
  const bool on_device = options.device != Device::kHost;
  const bool replicated = comm != nullptr;
  if (replicated) {
    // As DDP does at construction: every replica starts from rank 0's weights.
    for (Parameter* parameter : model.parameters())
      comm->broadcast(parameter->value.view(), 0)->wait();
    // The masters are the parameters every replica now holds; a resumed run's were restored
    // (rounding them to 16 bits and back would lose what the masters hold beyond the 16-bit
    // parameters, and the run would not continue as the saved one).
    if (master_weights != nullptr && checkpointing.resume_from == nullptr)
      master_weights->load_master_weights(model);
  }
  // A reduce type other than the gradients': a float32 buffer per parameter, which the
  // 16-bit gradient is widened into, averaged in, and rounded back from.
  std::vector<Tensor> reduce_buffers;
  if (replicated && mixed && reduce_type != options.precision)
    for (Parameter* parameter : model.parameters())
      reduce_buffers.emplace_back(parameter->grad.shape(), reduce_type,
                                  MemoryCategory::kCommunication, options.device);
  std::vector<std::unique_ptr<Work>> pending;
  const auto start_allreduce = [&](Parameter& parameter) {
    if (reduce_buffers.empty()) {
      pending.push_back(comm->allreduce(parameter.grad.view(), ReduceOp::kAvg));
      return;
    }
    const TensorView buffer = reduce_buffers[parameter.index].view();
    convert(parameter.grad.view(), buffer);
    pending.push_back(comm->allreduce(buffer, ReduceOp::kAvg));
  };
  // With overlap, each gradient's all-reduce starts the moment backward has finished it.
  const bool overlap = replicated && options.overlap;
  if (overlap) model.on_gradient_ready(start_allreduce);
  if (comm != nullptr) detail::charging_clock(*comm).mark_step();
  double last_report_clock = comm != nullptr ? comm->clock().now() : 0.0;

  const std::int64_t local_batch = options.global_batch / world;
  GlobalBatches batches(data.size(), options.global_batch, options.seed);
  auto last_report_time = SteadyClock::now();
  int last_report_step = first_step;
  // After step `done`'s update: the checkpoint and the report that fall on it.
  const auto finish_step = [&](int done, const std::array<float, 2>& metrics) {
    if (checkpointing.every > 0 && done % checkpointing.every == 0 && done < options.steps &&
        checkpointing.save && rank == 0)
      checkpointing.save(done, model, optimizer, scaler ? &*scaler : nullptr);
    if (done % options.log_every != 0 && done != options.steps) return;
    const auto now = SteadyClock::now();
    const double seconds = std::chrono::duration<double>(now - last_report_time).count();
    StepReport report;
    report.step = done;
    report.loss = metrics[0] / static_cast<float>(options.global_batch);
    report.accuracy = metrics[1] / static_cast<float>(options.global_batch);
    report.samples_per_second =
        seconds > 0
            ? static_cast<double>((done - last_report_step) * options.global_batch) / seconds
            : 0.0;
    if (comm != nullptr) {
      const double clock_now = comm->clock().now();
      report.clock_seconds_per_step =
          (clock_now - last_report_clock) / static_cast<double>(done - last_report_step);
      last_report_clock = clock_now;
    }
    result.reports.push_back(report);
    if (on_report && rank == 0) on_report(report);
    last_report_time = now;
    last_report_step = done;
  };
  std::vector<Tensor> emulated_sums;  // the all-reduce's sums, when emulating ranks
  GradientWatch watch(options.device);
  // Under fp16 loss scaling a non-finite gradient is an overflow that skips the step, not an
  // error, and the largest |g| of scaled gradients means nothing: neither is watched.
  const bool watch_gradients = !scaler.has_value();
  // After the gradients are averaged: the optimizer's step, unless fp16's scaled gradients
  // overflowed on some rank (one all-reduce decides, so every rank skips the same steps).
  const auto optimizer_step = [&](int step_number) {
    bool overflow = false;
    if (scaler) {
      std::vector<ConstTensorView> gradients;
      for (const Parameter* parameter : std::as_const(model).parameters())
        if (!parameter->frozen) gradients.push_back(parameter->grad.view());
      overflow = comm != nullptr ? scaler->check_overflow(*comm, gradients, options.device)
                                 : DynamicLossScaler::found_overflow(gradients);
      if (!overflow) master_weights->set_gradient_scale(scaler->inverse_scale());
    }
    // A float32 run replaying a float16 run's skips (compare_with_float32).
    const bool replayed_skip =
        std::ranges::find(options.steps_to_skip, step_number) != options.steps_to_skip.end();
    if (!overflow && !replayed_skip) optimizer.step(model);
    if (overflow) result.skipped_step_numbers.push_back(step_number);
    if (scaler) scaler->update(overflow);
  };
  for (int step = first_step; step < options.steps; ++step) {
    std::array<float, 2> metrics{};
    const float loss_scale = scaler ? scaler->scale() : 1.0f;
    if (comm == nullptr && world > 1) {
      emulate_ranks_step(model, data, batches.of_step(step), world, local_batch, options.device,
                         step + 1, emulated_sums, metrics, watch, reduce_type, loss_scale,
                         watch_gradients);
      if (watch_gradients) watch.scan(model, /*check=*/false, /*track=*/true, rank, step + 1, "");
      optimizer_step(step + 1);
      finish_step(step + 1, metrics);
      continue;
    }
    const Batch batch = gather_batch(
        data, batches.of_step(step).subspan(static_cast<std::size_t>(rank * local_batch),
                                            static_cast<std::size_t>(local_batch)));

    model.zero_grad();
    const Tensor device_inputs = on_device ? batch.inputs.to(options.device) : Tensor();
    const Tensor logits = model.forward(on_device ? device_inputs : batch.inputs);  // (B/N, C)
    const float loss = model.backward(logits, batch.labels, loss_scale);
    // (With overlap the all-reduces are already writing the gradients: checked after.)
    if (!overlap && watch_gradients)
      watch.scan(model, /*check=*/true, /*track=*/false, rank, step + 1, "before averaging");

    // metrics: (sum of losses, correct predictions) over the local batch
    metrics = {loss * static_cast<float>(local_batch),
               accuracy(logits, batch.labels) * static_cast<float>(local_batch)};
    if (comm != nullptr) {
      if (replicated && !overlap)
        for (Parameter* parameter : model.parameters())
          if (!parameter->frozen) start_allreduce(*parameter);
      // Host values: on nccl (device buffers only) through a device copy, so it waits.
      allreduce_host_values(std::span<float>(metrics), ReduceOp::kSum, *comm);
      for (auto& work : pending) work->wait();
      pending.clear();
      // The float32 averages rounded once into the 16-bit gradients.
      if (!reduce_buffers.empty())
        for (Parameter* parameter : model.parameters())
          if (!parameter->frozen)
            convert(reduce_buffers[parameter->index].view(), parameter->grad.view());
    }
    // With overlap the check comes after averaging, in the pass that tracks the maximum.
    if (watch_gradients)
      watch.scan(model, /*check=*/overlap, /*track=*/true, rank, step + 1, "after averaging");
    optimizer_step(step + 1);
    if (comm != nullptr) detail::charging_clock(*comm).mark_step();

    finish_step(step + 1, metrics);
  }
  if (overlap) model.clear_hooks();  // the hook refers to this function's locals
  result.max_abs_gradient = watch.running_max();
  if (scaler) {
    result.skipped_steps = scaler->skipped_steps();
    result.loss_scale = scaler->scale();
    result.loss_scaler = scaler;
  }
  return result;
}

// --- training checkpoints ----------------------------------------------------------------

// Version 2 records checksums (dp/checkpoint.h) and requires them on load; version 1 files,
// written before, have none and are still read.
constexpr const char* kCheckpointFormat = "dplab-train-2";
constexpr const char* kCheckpointFormatWithoutChecksums = "dplab-train-1";

/// The options that decide a run's trajectory, as the text a checkpoint stores: floats in
/// their shortest exact form, so that reading them back gives the same bits.
std::map<std::string, std::string> trajectory_options(const TrainOptions& options,
                                                      std::size_t dataset_size) {
  std::map<std::string, std::string> entries = {
      {"model", options.model},
      {"activation", options.activation},
      {"layer_norm", options.layer_norm ? "true" : "false"},
      {"dataset", options.dataset},
      {"dataset_samples", std::to_string(dataset_size)},
      {"global_batch", std::to_string(options.global_batch)},
      {"seed", std::to_string(options.seed)},
      {"optimizer", options.optimizer},
      {"lr", fmt::format("{}", options.lr)},
      {"momentum", fmt::format("{}", options.momentum)},
      {"weight_decay", fmt::format("{}", options.weight_decay)}};
  // A GPT's vocabulary too (an MLP's checkpoints stay as they were).
  if (is_gpt_spec(options.model)) entries["vocab"] = std::to_string(options.vocab);
  // Mixed precision's options ("precision" itself is checked first, on its own: a float32
  // checkpoint has none, load_training_checkpoint).
  if (options.precision != DataType::kFloat32)
    entries["reduce_dtype"] = to_string(reduce_type_of(options));
  if (options.precision == DataType::kFloat16) {
    const LossScalerOptions& scaling = options.loss_scaling;
    entries["loss_scaling.initial_scale"] = fmt::format("{}", scaling.initial_scale);
    entries["loss_scaling.growth_factor"] = fmt::format("{}", scaling.growth_factor);
    entries["loss_scaling.backoff_factor"] = fmt::format("{}", scaling.backoff_factor);
    entries["loss_scaling.growth_interval"] = std::to_string(scaling.growth_interval);
  }
  return entries;
}

/// The values of host `tensor` as floats: 16-bit ones widened exactly, into memory no rank's
/// account is charged for (checking a checkpoint must not raise the run's peaks).
std::vector<float> values_of(const Tensor& tensor) {
  switch (tensor.dtype()) {
    case DataType::kBFloat16: {
      const std::span<const BFloat16> values = tensor.span<BFloat16>();
      std::vector<float> widened(values.size());
      std::ranges::transform(values, widened.begin(), [](BFloat16 v) { return to_float(v); });
      return widened;
    }
    case DataType::kFloat16: {
      const std::span<const Float16> values = tensor.span<Float16>();
      std::vector<float> widened(values.size());
      std::ranges::transform(values, widened.begin(), [](Float16 v) { return to_float(v); });
      return widened;
    }
    default: return {tensor.span().begin(), tensor.span().end()};
  }
}

/// Throws unless every value of `tensor` is finite, naming the first that is not.
void check_finite(const std::filesystem::path& path, const std::string& name, const Tensor& tensor,
                  int step) {
  const std::vector<float> widened =
      tensor.dtype() == DataType::kFloat32 ? std::vector<float>() : values_of(tensor);
  const std::span<const float> values =
      tensor.dtype() == DataType::kFloat32 ? tensor.span() : std::span<const float>(widened);
  for (std::size_t i = 0; i < values.size(); ++i)
    if (!std::isfinite(values[i]))
      throw Error(fmt::format(
          "refusing to save '{}': {} holds {} at element {} after step {}; the training "
          "diverged (try a lower learning rate), or save it anyway with --save-non-finite",
          path.string(), name, values[i], i, step));
}

/// The integer metadata entry `key` of checkpoint `file`.
std::int64_t integer_entry(const std::map<std::string, std::string>& metadata,
                           const std::string& key, const std::string& file) {
  const auto it = metadata.find(key);
  std::int64_t value = 0;
  if (it != metadata.end()) {
    const std::string& text = it->second;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (error == std::errc() && end == text.data() + text.size() && value >= 0) return value;
  }
  throw Error(fmt::format(
      "'{}' is not a training checkpoint of dplab: its metadata has no non-negative integer "
      "\"{}\"{}",
      file, key, it == metadata.end() ? "" : fmt::format(" (it has \"{}\")", it->second)));
}

}  // namespace

void check_train_device(Device device) {
  if (device == Device::kHost || cuda_device_emulated()) return;
  if (!cuda_compiled())
    throw Error(
        "training on a CUDA device: this build has no CUDA (configure with a CUDA compiler "
        "and DP_CUDA on), so train on the host (--device host)");
  if (cuda_device_count() == 0)
    throw Error(
        "training on a CUDA device: this process sees no CUDA device (no GPU, no driver, or "
        "CUDA_VISIBLE_DEVICES hides them), so train on the host (--device host)");
}

void check_train_options(const TrainOptions& options) {
  for (const int step : options.steps_to_skip)
    if (step < 1 || step > options.steps)
      throw Error(fmt::format("steps_to_skip: step {} is not a step of the run; expected 1 to {}",
                              step, options.steps));
  if (is_gpt_spec(options.model)) {
    parse_gpt_spec(options.model);  // a bad spec's own message first
    if (!is_text_dataset_spec(options.dataset))
      throw Error(fmt::format(
          "model {} is a GPT, which trains on text, but the data set '{}' is not: expected "
          "--dataset text:FILE or --dataset fortunes",
          options.model, options.dataset));
    if (options.layer_norm || options.activation != "relu")
      throw Error(fmt::format(
          "model {} is a GPT: --layer-norm and --activation shape an MLP (a GPT's blocks have "
          "their LayerNorms and GELU built in); expected neither",
          options.model));
    if (options.vocab < 0)
      throw Error(fmt::format("a GPT's vocabulary must be 0 (from the data) or more, got {}",
                              options.vocab));
  } else {
    parse_mlp_spec(options.model);
    if (options.activation_checkpointing)
      throw Error(fmt::format(
          "activation checkpointing recomputes a GPT's transformer blocks, and the model {} is "
          "an MLP: expected --model gpt or gpt:layers=L,dim=C,heads=H,context=T",
          options.model));
    if (is_text_dataset_spec(options.dataset))
      throw Error(fmt::format(
          "the data set '{}' is text, which a GPT trains on, but the model {} is an MLP: "
          "expected --model gpt or gpt:layers=L,dim=C,heads=H,context=T",
          options.dataset, options.model));
  }
  if (options.activation != "relu" && options.activation != "gelu")
    throw Error(
        fmt::format("unknown activation '{}': expected 'relu' or 'gelu'", options.activation));
  if (options.optimizer != "sgd" && options.optimizer != "adamw")
    throw Error(
        fmt::format("unknown optimizer '{}': expected 'sgd' or 'adamw'", options.optimizer));
  if (options.global_batch < 1)
    throw Error(fmt::format("the global batch must be at least 1, got {}", options.global_batch));
  if (options.steps < 0) throw Error(fmt::format("steps must be >= 0, got {}", options.steps));
  if (!std::isfinite(options.lr) || options.lr < 0)
    throw Error(fmt::format("the learning rate must be a finite number >= 0, got {}", options.lr));
  if (!(options.momentum >= 0 && options.momentum < 1))
    throw Error(fmt::format("momentum must be in [0, 1), got {}", options.momentum));
  if (!std::isfinite(options.weight_decay) || options.weight_decay < 0)
    throw Error(
        fmt::format("weight decay must be a finite number >= 0, got {}", options.weight_decay));
  if (options.log_every < 1)
    throw Error(fmt::format("log_every must be at least 1 (a report every that many steps), got {}",
                            options.log_every));
  detail::check_tensor_type("the training precision", options.precision);
  if (options.reduce_dtype && *options.reduce_dtype != DataType::kFloat32 &&
      *options.reduce_dtype != options.precision)
    throw Error(fmt::format(
        "the gradient all-reduce of {} gradients in {}: expected the gradients' own type or "
        "float32",
        to_string(options.precision), to_string(*options.reduce_dtype)));
}

namespace {

/// check_data_fits_model for a GPT: windows of its context, labels in the vocabulary.
void check_text_fits_gpt(const TrainOptions& options, const Dataset& data) {
  const GptSpec spec = parse_gpt_spec(options.model);
  if (!data.tokenizer || data.labels_per_sample != spec.context ||
      data.feature_dim() != spec.context)
    throw Error(fmt::format(
        "the data set '{}' is not windows of {} tokens, the context of model {}: it has {} "
        "features and {} labels per sample{}; expected a text data set cut for this context "
        "(dp::load_dataset(spec, seed, {}))",
        data.name, spec.context, options.model, data.feature_dim(), data.labels_per_sample,
        data.tokenizer ? "" : " and no tokenizer", spec.context));
  const std::int64_t vocab = options.vocab != 0 ? options.vocab : data.num_classes;
  if (vocab != data.num_classes)
    throw Error(fmt::format(
        "model {} has a vocabulary of {} tokens, but the data set '{}' has {}: expected equal",
        options.model, vocab, data.name, data.num_classes));
  for (std::size_t i = 0; i < data.labels.size(); ++i)
    if (data.labels[i] < 0 || data.labels[i] >= vocab)
      throw Error(fmt::format(
          "window {} of the data set '{}' has the label {} at position {}: expected a token "
          "id from 0 to {}",
          i / static_cast<std::size_t>(data.labels_per_sample), data.name, data.labels[i],
          i % static_cast<std::size_t>(data.labels_per_sample), vocab - 1));
}

}  // namespace

void check_data_fits_model(const TrainOptions& options, const Dataset& data) {
  if (is_gpt_spec(options.model)) {
    check_text_fits_gpt(options, data);
    return;
  }
  if (data.labels_per_sample != 1)
    throw Error(fmt::format(
        "the data set '{}' has {} labels per sample (a text set, for a GPT), but the model {} "
        "is an MLP, which takes one: expected a classification data set",
        data.name, data.labels_per_sample, options.model));
  const std::vector<std::int64_t> widths = parse_mlp_spec(options.model);
  if (data.feature_dim() != widths.front())
    throw Error(fmt::format(
        "the data set '{}' has {} features per sample but the model {} takes {}: make the "
        "model's first width {}",
        data.name, data.feature_dim(), options.model, widths.front(), data.feature_dim()));
  const std::int64_t outputs = widths.back();
  for (std::size_t sample = 0; sample < data.size(); ++sample) {
    const int label = data.labels[sample];
    if (label < 0 || label >= outputs)
      throw Error(fmt::format(
          "sample {} of the data set '{}' has label {}, but the model {} has {} outputs "
          "(labels 0 to {}): make its last width at least {}",
          sample, data.name, label, options.model, outputs, outputs - 1,
          std::max(label + 1, data.num_classes)));
  }
}

GlobalBatches::GlobalBatches(std::size_t dataset_size, std::int64_t global_batch,
                             std::uint64_t seed)
    : batch_(static_cast<std::size_t>(global_batch)), seed_(seed) {
  if (global_batch < 1 || batch_ > dataset_size)
    throw Error(fmt::format("a global batch of {} cannot be drawn from {} samples", global_batch,
                            dataset_size));
  batches_per_epoch_ = dataset_size / batch_;  // drop_last
  order_.resize(dataset_size);
}

std::size_t GlobalBatches::epoch_of(int step) const {
  return static_cast<std::size_t>(step) / batches_per_epoch_;
}

std::span<const std::size_t> GlobalBatches::of_step(int step) {
  if (step < 0) throw Error(fmt::format("global batches: step {} is negative", step));
  const std::size_t epoch = epoch_of(step);
  if (epochs_drawn_ == 0 || epoch != epoch_) {
    // Fisher-Yates with the epoch's own stream: every rank computes the same order.
    std::iota(order_.begin(), order_.end(), std::size_t{0});
    CounterRng rng(seed_, 0x5EED0000 + epoch);
    for (std::size_t i = order_.size() - 1; i > 0; --i)
      std::swap(order_[i], order_[rng.below(i + 1)]);
    epoch_ = epoch;
    ++epochs_drawn_;
  }
  const std::size_t position = static_cast<std::size_t>(step) % batches_per_epoch_;
  return std::span<const std::size_t>(order_).subspan(position * batch_, batch_);
}

std::vector<std::size_t> global_batch_indices(std::size_t dataset_size, std::int64_t global_batch,
                                              int step, std::uint64_t seed) {
  GlobalBatches batches(dataset_size, global_batch, seed);
  const std::span<const std::size_t> batch = batches.of_step(step);
  return {batch.begin(), batch.end()};
}

void save_training_checkpoint(const std::filesystem::path& path, const TrainOptions& options,
                              const Model& model, Optimizer& optimizer, int step,
                              std::size_t dataset_size, const TrainingCheckpointInfo& info) {
  // A model on a device is saved from host copies (the file format is the same).
  std::vector<Tensor> host_copies;
  host_copies.reserve(model.parameters().size() + optimizer.state().size());
  const auto on_host = [&host_copies](const Tensor& tensor) -> const Tensor* {
    if (tensor.device() == Device::kHost) return &tensor;
    host_copies.push_back(tensor.to(Device::kHost));
    return &host_copies.back();
  };
  std::vector<NamedTensor> tensors;
  for (const Parameter* parameter : model.parameters())
    tensors.push_back({parameter->name, on_host(parameter->value)});
  for (const OptimizerState& state : optimizer.state())
    tensors.push_back({"optimizer." + state.name, on_host(*state.tensor)});
  if (!info.allow_non_finite)
    for (const NamedTensor& named : tensors) check_finite(path, named.name, *named.tensor, step);

  std::map<std::string, std::string> metadata = trajectory_options(options, dataset_size);
  if (info.tokenizer) info.tokenizer->add_to_metadata(metadata);
  const GlobalBatches position(dataset_size, options.global_batch, options.seed);
  metadata["format"] = kCheckpointFormat;
  metadata["producer"] = "dplab train";
  metadata["step"] = std::to_string(step);
  metadata["steps"] = std::to_string(options.steps);
  metadata["epoch"] = std::to_string(position.epoch_of(step));
  metadata["batch_in_epoch"] =
      std::to_string(static_cast<std::size_t>(step) % position.batches_per_epoch());
  metadata["optimizer_steps"] = std::to_string(optimizer.step_count());
  metadata["world_size"] = std::to_string(info.world_size);
  if (!info.backend.empty()) metadata["backend"] = info.backend;
  metadata["precision"] = to_string(options.precision);
  if ((info.loss_scaler != nullptr) != (options.precision == DataType::kFloat16))
    throw Error(fmt::format(
        "saving '{}': a {} run {} a loss scaler's state (TrainingCheckpointInfo::loss_scaler), "
        "which only float16 training has",
        path.string(), to_string(options.precision),
        info.loss_scaler != nullptr ? "was given" : "was not given"));
  if (info.loss_scaler != nullptr) {
    metadata["loss_scale"] = fmt::format("{}", info.loss_scaler->scale());
    metadata["loss_scale_growth_tracker"] = std::to_string(info.loss_scaler->growth_tracker());
    metadata["loss_scale_skipped_steps"] = std::to_string(info.loss_scaler->skipped_steps());
  }
  save_safetensors(path, tensors, metadata, Checksums::kWrite);
}

TrainingCheckpoint load_training_checkpoint(const std::filesystem::path& path,
                                            const TrainOptions& options, std::size_t dataset_size) {
  const std::string file = path.string();
  // Every dtype: a mixed-precision run's parameters are 16-bit (checked below against the run's).
  Checkpoint contents = load_safetensors(path, MemoryCategory::kOther, LoadTypes::kAll);
  const auto& metadata = contents.metadata;
  const auto format = metadata.find("format");
  if (format == metadata.end() ||
      (format->second != kCheckpointFormat && format->second != kCheckpointFormatWithoutChecksums))
    throw Error(fmt::format(
        "'{}' is not a training checkpoint of dplab (its metadata \"format\" is {}, expected "
        "\"{}\" or \"{}\"): only `dplab train --checkpoint` files can be resumed",
        file, format == metadata.end() ? "missing" : "\"" + format->second + "\"",
        kCheckpointFormat, kCheckpointFormatWithoutChecksums));
  if (format->second == kCheckpointFormat && !contents.checksummed)
    throw Error(fmt::format(
        "cannot resume from '{}': its format \"{}\" records checksums, but its metadata has no "
        "\"{}\" entry: the file was changed or damaged after it was written",
        file, kCheckpointFormat, kChecksumKey));
  // The precision first, on its own: a checkpoint older than mixed precision has none and is
  // float32.
  const auto saved_precision = metadata.find("precision");
  const std::string precision =
      saved_precision != metadata.end() ? saved_precision->second : "float32";
  if (precision != to_string(options.precision))
    throw Error(fmt::format(
        "cannot resume from '{}': it was saved by a {} run, this run trains in {}; a run "
        "resumes in the precision it was saved in (its parameters{} are kept as they were)",
        file, precision, to_string(options.precision),
        precision == "float32"   ? ""
        : precision == "float16" ? ", float32 master weights and loss scale"
                                 : " and float32 master weights"));
  for (const auto& [key, value] : trajectory_options(options, dataset_size)) {
    const auto saved = metadata.find(key);
    if (saved == metadata.end() || saved->second != value)
      throw Error(fmt::format(
          "cannot resume from '{}': it was saved with {} = {}, this run has {}; a resumed "
          "run must train with the same options as the one it continues",
          file, key, saved == metadata.end() ? "(nothing)" : saved->second, value));
  }

  TrainingCheckpoint checkpoint;
  checkpoint.step = static_cast<int>(std::min<std::int64_t>(integer_entry(metadata, "step", file),
                                                            std::numeric_limits<int>::max()));
  checkpoint.optimizer_steps = integer_entry(metadata, "optimizer_steps", file);
  if (checkpoint.step > options.steps)
    throw Error(
        fmt::format("cannot resume from '{}': it is at step {}, past the {} steps of this "
                    "run (raise --steps)",
                    file, checkpoint.step, options.steps));
  // A run takes at most one optimizer step per training step, so a larger counter is damage
  // (an AdamW counter near INT64_MAX would also overflow and wreck the bias correction).
  if (checkpoint.optimizer_steps > checkpoint.step)
    throw Error(fmt::format(
        "cannot resume from '{}': its optimizer step count (metadata \"optimizer_steps\") is "
        "{}, expected at most {}, the training step it was saved at",
        file, checkpoint.optimizer_steps, checkpoint.step));

  // Every tensor the model and optimizer have, with its shape, and nothing else.
  Model model = make_model(options);
  const std::unique_ptr<Optimizer> optimizer = make_optimizer_for(options, model);
  std::map<std::string, const Tensor*> expected;
  for (const Parameter* parameter : model.parameters())
    expected[parameter->name] = &parameter->value;
  for (const OptimizerState& state : optimizer->state())
    expected["optimizer." + state.name] = state.tensor;
  for (const auto& [name, like] : expected) {
    const auto it = contents.tensors.find(name);
    if (it == contents.tensors.end())
      throw Error(fmt::format("cannot resume from '{}': it has no tensor '{}'", file, name));
    if (it->second.shape() != like->shape())
      throw Error(fmt::format("cannot resume from '{}': tensor '{}' has shape {}, expected {}",
                              file, name, it->second.shape_string(), like->shape_string()));
    if (it->second.dtype() != like->dtype())
      throw Error(fmt::format("cannot resume from '{}': tensor '{}' holds {}, expected {}", file,
                              name, to_string(it->second.dtype()), to_string(like->dtype())));
  }
  for (const auto& [name, tensor] : contents.tensors)
    if (!expected.contains(name))
      throw Error(fmt::format(
          "cannot resume from '{}': its tensor '{}' belongs to no parameter or optimizer state "
          "of this run",
          file, name));
  // A run saved with --save-non-finite is refused here too: resuming it would train on NaN.
  // (16-bit parameters widened exactly for the check.)
  for (const auto& [name, tensor] : contents.tensors) {
    if (tensor.dtype() == DataType::kFloat32) {
      check_state_values(file, name, tensor.span());
    } else {
      check_state_values(file, name, values_of(tensor));
    }
  }
  if (options.precision == DataType::kFloat16) {
    const auto scale_entry = metadata.find("loss_scale");
    const std::string scale_text = scale_entry != metadata.end() ? scale_entry->second : "";
    char* end = nullptr;
    const float scale = std::strtof(scale_text.c_str(), &end);
    if (scale_text.empty() || end != scale_text.c_str() + scale_text.size())
      throw Error(fmt::format(
          "'{}' is not a float16 training checkpoint of dplab: its metadata has no number "
          "\"loss_scale\"{}",
          file, scale_entry == metadata.end() ? "" : fmt::format(" (it has \"{}\")", scale_text)));
    const std::int64_t tracker = integer_entry(metadata, "loss_scale_growth_tracker", file);
    const std::int64_t skipped = integer_entry(metadata, "loss_scale_skipped_steps", file);
    if (skipped > checkpoint.step)
      throw Error(fmt::format(
          "cannot resume from '{}': it records {} steps skipped for an overflow, more than the "
          "{} steps it was saved after",
          file, skipped, checkpoint.step));
    checkpoint.loss_scaler.emplace(options.loss_scaling);
    try {
      checkpoint.loss_scaler->restore(
          scale, static_cast<int>(std::min<std::int64_t>(tracker, std::numeric_limits<int>::max())),
          skipped);
    } catch (const Error& error) {
      throw Error(fmt::format("cannot resume from '{}': {}", file, error.what()));
    }
  }
  checkpoint.tensors = std::move(contents.tensors);
  checkpoint.info = std::move(contents.metadata);
  return checkpoint;
}

Model make_model(const TrainOptions& options) {
  if (is_gpt_spec(options.model)) {
    if (options.vocab == 0)
      throw Error(
          fmt::format("model {}: a GPT's vocabulary comes from its data, and none was given (set "
                      "TrainOptions::vocab to the data set's num_classes)",
                      options.model));
    return Model::gpt(parse_gpt_spec(options.model), options.vocab,
                      {.seed = options.seed,
                       .device = options.device,
                       .activation_checkpointing = options.activation_checkpointing,
                       .dtype = options.precision});
  }
  MlpOptions mlp;
  mlp.activation = options.activation;
  mlp.layer_norm = options.layer_norm;
  mlp.seed = options.seed;
  mlp.device = options.device;
  mlp.dtype = options.precision;
  return Model::mlp(options.model, mlp);
}

ActivationCheckpointingEffect measure_activation_checkpointing(const TrainOptions& options,
                                                               const Dataset& data,
                                                               std::int64_t rows) {
  if (!is_gpt_spec(options.model))
    throw Error(
        fmt::format("activation checkpointing recomputes a GPT's blocks; the model {} is an MLP",
                    options.model));
  if (rows < 1 || static_cast<std::size_t>(rows) > data.size())
    throw Error(
        fmt::format("measuring activation checkpointing on {} samples of '{}', which has "
                    "{}: expected 1 to {}",
                    rows, data.name, data.size(), data.size()));
  std::vector<std::size_t> indices(static_cast<std::size_t>(rows));
  std::iota(indices.begin(), indices.end(), std::size_t{0});

  ActivationCheckpointingEffect effect;
  std::array<std::vector<std::vector<float>>, 2> gradients;  // [without, with][parameter]
  for (const bool checkpointing : {false, true}) {
    // A memory account of its own: the run's peaks stay the run's.
    ScopedRankMemory probe(std::make_shared<RankMemory>());
    TrainOptions probed = with_vocabulary_of(options, data);
    probed.activation_checkpointing = checkpointing;
    Model model = make_model(probed);
    const Batch batch = gather_batch(data, indices);
    const Tensor device_inputs =
        probed.device != Device::kHost ? batch.inputs.to(probed.device) : Tensor();
    MemoryTracker& tracker = this_rank_memory().tracker();
    const std::size_t inputs = tracker.current(MemoryCategory::kActivations);
    tracker.reset_peaks();
    {
      const Tensor logits =
          model.forward(probed.device != Device::kHost ? device_inputs : batch.inputs);
      (void)model.backward(logits, batch.labels);
    }
    const std::size_t peak = tracker.peak(MemoryCategory::kActivations) - inputs;
    const double flops = model.forward_cost(rows).flops + model.backward_cost(rows).flops;
    (checkpointing ? effect.activations_with : effect.activations_without) = peak;
    (checkpointing ? effect.flops_with : effect.flops_without) = flops;
    for (const Parameter* parameter : model.parameters()) {
      // 16-bit gradients widened exactly: equal floats are equal bits.
      const Tensor host = parameter->grad.to(Device::kHost).to(DataType::kFloat32);
      gradients[checkpointing ? 1 : 0].emplace_back(host.span().begin(), host.span().end());
    }
  }
  for (std::size_t p = 0; p < gradients[0].size(); ++p)
    DP_CHECK(std::memcmp(gradients[0][p].data(), gradients[1][p].data(),
                         gradients[0][p].size() * sizeof(float)) == 0,
             "activation checkpointing changed the gradient of parameter {} of {}", p,
             options.model);
  return effect;
}

TrainResult train_single_process(const TrainOptions& options, const Dataset& data,
                                 const ReportCallback& on_report,
                                 const TrainCheckpointing& checkpointing) {
  return train(options, data, nullptr, on_report, checkpointing);
}

TrainResult train_data_parallel(const TrainOptions& options, const Dataset& data,
                                Communicator& comm, const ReportCallback& on_report,
                                const TrainCheckpointing& checkpointing) {
  return train(options, data, &comm, on_report, checkpointing);
}

TrainResult train_emulating_data_parallel(const TrainOptions& options, const Dataset& data,
                                          int world_size, const TrainCheckpointing& checkpointing) {
  if (world_size < 1 || world_size > kMaxWorldSize)
    throw Error(fmt::format("emulating {} ranks: expected 1 to {}", world_size, kMaxWorldSize));
  TrainCheckpointing resume_only;  // nothing saved: the emulation only computes
  resume_only.resume_from = checkpointing.resume_from;
  return train(options, data, nullptr, {}, resume_only, world_size);
}

float equivalence_tolerance(const TrainOptions& options, float max_abs_gradient) {
  constexpr float kUnitRoundoff = 0x1.0p-24f;
  // Measured amplification of AdamW's normalised step, with headroom (see trainer.h).
  constexpr float kAdamWAmplification = 20.0f;
  float effective_lr = options.lr;
  if (options.optimizer == "sgd" && options.momentum > 0 && options.momentum < 1)
    effective_lr /= 1.0f - options.momentum;
  if (options.optimizer == "adamw") effective_lr *= kAdamWAmplification;
  // The terms of each gradient's sum: one per sample, or per predicted token of a GPT.
  const float terms =
      static_cast<float>(options.global_batch) *
      (is_gpt_spec(options.model) ? static_cast<float>(parse_gpt_spec(options.model).context)
                                  : 1.0f);
  const float per_step = effective_lr * terms * kUnitRoundoff * std::max(max_abs_gradient, 1.0f);
  return 2.0f * static_cast<float>(std::max(options.steps, 1)) * per_step;
}

}  // namespace dp

namespace dp {

double unit_roundoff_of(DataType precision) {
  if (precision == DataType::kBFloat16) return 0x1.0p-8;
  if (precision == DataType::kFloat16) return 0x1.0p-11;
  throw Error(
      fmt::format("unit_roundoff_of: expected bfloat16 or float16, got {} (not a mixed precision)",
                  to_string(precision)));
}

double mixed_precision_worst_measured_ratio(DataType precision) {
  // MixedPrecisionTraining.DISABLED_LossGapCalibration over seeds 0-9 (trainer.h): bfloat16's
  // worst was 8.35 (AdamW at lr 0.01, 1 rank, seed 7: a gap of 0.0585), float16's 13.99 (SGD
  // at lr 0.05 with momentum 0.9, 1 rank, seed 5: a gap of 0.0169).
  if (precision == DataType::kBFloat16) return 8.4;
  if (precision == DataType::kFloat16) return 14.0;
  throw Error(
      fmt::format("mixed_precision_worst_measured_ratio: expected bfloat16 or float16, "
                  "got {} (not a mixed precision)",
                  to_string(precision)));
}

double mixed_precision_loss_tolerance(DataType precision, double sensitivity) {
  constexpr double kHeadroom = 2.0;
  return kHeadroom * mixed_precision_worst_measured_ratio(precision) *
         (unit_roundoff_of(precision) + sensitivity);
}

namespace {

/// The mean loss over the last `count` reports.
double mean_of_last_losses(const std::vector<StepReport>& reports, std::size_t count) {
  double sum = 0;
  for (std::size_t i = reports.size() - count; i < reports.size(); ++i) sum += reports[i].loss;
  return sum / static_cast<double>(count);
}

/// |a - b| / |b|, NaN when either is not finite.
double relative_difference(double a, double b) {
  if (!std::isfinite(a) || !std::isfinite(b)) return std::numeric_limits<double>::quiet_NaN();
  return std::abs(a - b) / std::abs(b);
}

}  // namespace

Float32Comparison compare_with_float32(const TrainOptions& options, const Dataset& data,
                                       int world_size, const TrainResult& mixed,
                                       const TrainCheckpointing& checkpointing) {
  const std::vector<StepReport>& reports = mixed.reports;
  bool every_step = !reports.empty();
  for (std::size_t i = 0; every_step && i < reports.size(); ++i)
    every_step = reports[i].step == reports.front().step + static_cast<int>(i);
  if (!every_step)
    throw Error(
        fmt::format("compare_with_float32: expected the mixed-precision run to report every step "
                    "(log_every 1), got {} reports of steps {} to {}",
                    reports.size(), reports.empty() ? 0 : reports.front().step,
                    reports.empty() ? 0 : reports.back().step));
  TrainOptions float32 = options;
  float32.precision = DataType::kFloat32;
  float32.reduce_dtype.reset();
  float32.log_every = 1;
  float32.steps_to_skip = mixed.skipped_step_numbers;
  TrainOptions perturbed = float32;
  Float32Comparison comparison;
  comparison.unit_roundoff = unit_roundoff_of(options.precision);
  perturbed.lr = static_cast<float>(options.lr * (1.0 + comparison.unit_roundoff));
  const TrainResult reference =
      train_emulating_data_parallel(float32, data, world_size, checkpointing);
  const TrainResult nudged =
      train_emulating_data_parallel(perturbed, data, world_size, checkpointing);
  if (reference.reports.size() != reports.size())
    throw Error(
        fmt::format("compare_with_float32: the float32 run reported {} steps, the "
                    "mixed-precision run {}: expected the same options",
                    reference.reports.size(), reports.size()));
  const std::size_t compared = std::max<std::size_t>(1, reports.size() / 4);
  comparison.steps_compared = static_cast<int>(compared);
  comparison.mixed_loss = mean_of_last_losses(reports, compared);
  comparison.float32_loss = mean_of_last_losses(reference.reports, compared);
  comparison.relative_gap = relative_difference(comparison.mixed_loss, comparison.float32_loss);
  comparison.sensitivity =
      relative_difference(mean_of_last_losses(nudged.reports, compared), comparison.float32_loss);
  comparison.tolerance = mixed_precision_loss_tolerance(options.precision, comparison.sensitivity);
  const std::vector<float> mixed_parameters = mixed.model.flat_parameters();
  const std::vector<float> float32_parameters = reference.model.flat_parameters();
  double gap_squared = 0;
  double reference_squared = 0;
  for (std::size_t i = 0; i < float32_parameters.size(); ++i) {
    const double reference_value = float32_parameters[i];
    const double gap = static_cast<double>(mixed_parameters.at(i)) - reference_value;
    gap_squared += gap * gap;
    reference_squared += reference_value * reference_value;
  }
  comparison.parameter_distance = std::sqrt(gap_squared / reference_squared);
  return comparison;
}

}  // namespace dp
