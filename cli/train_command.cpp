// dplab train: trains a model data-parallel on the local or the mpi backend, prints
// progress, checks that the replicas agree, and saves a checkpoint. With --net the local
// backend simulates the interconnect and the clock: it then prints the simulated step time,
// the exposed communication and the overlap fraction, and --trace writes every rank's ops
// as a Chrome trace (open it in https://ui.perfetto.dev). With --device cuda the model, its
// gradients and the optimizer state live on the GPU, and the ranks exchange device buffers
// (local: threads sharing the GPU; nccl: one rank per GPU). --device emulated runs the same
// code on the CUDA device emulated in host memory.
//
// Checkpoints hold the whole state of the run (parameters, optimizer state, step), so
//
//   dplab train --steps 1000 --checkpoint-every 100     # stopped at step 730
//   dplab train --steps 1000 --resume dplab-train.safetensors
//
// continues from step 700 and ends with bitwise the parameters of an uninterrupted run.
// Every number is checked and every output path is tried before the data is loaded.
//
// A GPT trains on text, a character per token (dp/text_data.h):
//
//   dplab train --model gpt:layers=4,dim=128,heads=4,context=64 --dataset fortunes
//   dplab sample dplab-train.safetensors                # text from the trained model
//
// its vocabulary comes from the data and is stored in the checkpoint.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "dp/checkpoint.h"
#include "dp/clock.h"
#include "dp/error.h"
#include "dp/host_collectives.h"
#include "dp/launch.h"
#include "dp/memory.h"
#include "dp/output_file.h"
#include "dp/trace.h"
#include "dp/trainer.h"
#include "mpirun.h"
#include "option_checks.h"
#include "simulation_options.h"

namespace dp::cli {
namespace {

struct TrainArguments {
  TrainOptions options;
  std::optional<int> world_size;  // not given: 1 on local, every process under mpi
  std::string backend = "local";
  std::string checkpoint = "dplab-train.safetensors";
  int checkpoint_every = 0;  // 0: only at the end
  std::string resume;
  bool save_non_finite = false;
  bool verify = false;
  double hang_timeout_seconds = 60;
  std::string memory_budget;  // empty: none
  SimulationArguments simulation;
  std::string trace;
  std::string device = "host";     // where the tensors live: host, cuda or emulated
  std::string precision = "fp32";  // fp32, bf16 or fp16
  std::string reduce_dtype;        // empty: the precision's
};

/// The element type of a --precision or --reduce-dtype name.
DataType parse_precision(const std::string& name, std::string_view option) {
  if (name == "fp32") return DataType::kFloat32;
  if (name == "bf16") return DataType::kBFloat16;
  if (name == "fp16") return DataType::kFloat16;
  throw Error(fmt::format("{} {}: expected fp32, bf16 or fp16", option, name));
}

/// The short name of a precision, as --precision takes it.
std::string_view precision_name(DataType type) {
  switch (type) {
    case DataType::kBFloat16: return "bf16";
    case DataType::kFloat16: return "fp16";
    default: return "fp32";
  }
}

/// True when every rank holds bitwise the same parameters as rank 0.
bool replicas_identical(const Model& model, Communicator& comm) {
  const std::vector<float> mine = model.flat_parameters();
  std::vector<float> rank0 = mine;
  broadcast_host_values(std::span(rank0), 0, comm);
  std::array<std::int32_t, 1> differing = {
      std::memcmp(mine.data(), rank0.data(), mine.size() * sizeof(float)) != 0 ? 1 : 0};
  allreduce_host_values(std::span<std::int32_t>(differing), ReduceOp::kSum, comm);
  return differing[0] == 0;
}

/// Saves the run's state after `step` steps to --checkpoint (rank 0 only).
void save_checkpoint(const TrainArguments& args, const Dataset& data, const Model& model,
                     Optimizer& optimizer, const DynamicLossScaler* loss_scaler, int step,
                     int world_size) {
  TrainingCheckpointInfo info;
  info.loss_scaler = loss_scaler;
  info.world_size = world_size;
  info.backend = args.backend;
  info.allow_non_finite = args.save_non_finite;
  info.tokenizer = data.tokenizer;
  save_training_checkpoint(args.checkpoint, args.options, model, optimizer, step, data.size(),
                           info);
  fmt::print("checkpoint: {} (step {}: {} parameters and {} optimizer state tensors)\n",
             args.checkpoint, step, model.parameters().size(), optimizer.state().size());
}

/// The largest |a - b| over the elements, where it is, and how many elements differ at all.
struct ParameterDifference {
  float largest = 0;
  std::size_t where = 0;
  std::size_t differing = 0;
};

ParameterDifference difference_of(const std::vector<float>& a, const std::vector<float>& b) {
  ParameterDifference difference;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) == 0) continue;
    ++difference.differing;
    const float gap = std::abs(a[i] - b[i]);
    if (gap > difference.largest || std::isnan(gap)) {
      difference.largest = gap;
      difference.where = i;
    }
  }
  return difference;
}

/// --verify. The check: one process doing the ranks' arithmetic (each rank's gradient on its
/// slice, summed in rank order, divided by N: `train_emulating_data_parallel`) must give
/// bitwise the ranks' parameters, however long the run and whatever the optimizer and data,
/// where the backend sums in rank order (local, mpi, nccl at 1 or 2 ranks). Comparing with
/// one process on the global batch cannot be a check over long runs: its sums of B terms
/// are added in another order, and float32 reordering grows through the steps (through
/// AdamW's normalised step it can grow chaotically: 4.4e-5 after 50 steps where a derivation
/// for few steps allows 7.6e-6, as an independent PyTorch DDP run also shows). It is printed
/// for the lesson, with that bound, and never fails a run.
void verify_against_single_process(const TrainArguments& args, const Dataset& data,
                                   const TrainResult& distributed, int world_size,
                                   const TrainCheckpointing& checkpointing) {
  const std::vector<float> actual = distributed.model.flat_parameters();
  const bool rank_order = args.backend != "nccl" || world_size <= 2;
  const bool mixed = args.options.precision != DataType::kFloat32;
  // Mixed precision is also compared in loss with float32, step by step: every step reported.
  TrainOptions emulated_options = args.options;
  if (mixed) emulated_options.log_every = 1;
  const TrainResult emulated =
      train_emulating_data_parallel(emulated_options, data, world_size, checkpointing);
  const ParameterDifference from_emulation =
      difference_of(emulated.model.flat_parameters(), actual);
  const float tolerance = equivalence_tolerance(
      args.options, std::max(emulated.max_abs_gradient, distributed.max_abs_gradient));
  // nccl's ring order at 3 or more ranks: no tolerance is derived for 16-bit sums, so a
  // mixed-precision run there is compared for information only.
  const bool agrees =
      rank_order ? from_emulation.differing == 0 : mixed || from_emulation.largest <= tolerance;
  if (rank_order) {
    fmt::print(
        "verify: {} ranks against one process doing their arithmetic (each rank's gradient, "
        "summed in rank order, divided by {}): {} -> {}\n",
        world_size, world_size,
        agrees ? "bitwise identical"
               : fmt::format("{} of {} elements differ, the most ({:.3g}) at element {}",
                             from_emulation.differing, actual.size(), from_emulation.largest,
                             from_emulation.where),
        agrees ? "OK" : "FAILED");
  } else {
    if (mixed) {
      fmt::print(
          "verify: {} ranks against one process doing their arithmetic in rank order: max "
          "difference {:.3g} at element {}; nccl adds 3 or more ranks in its ring's order, "
          "and no tolerance is derived for 16-bit sums: not checked\n",
          world_size, from_emulation.largest, from_emulation.where);
    } else {
      fmt::print(
          "verify: {} ranks against one process doing their arithmetic in rank order: max "
          "difference {:.3g} at element {}; nccl adds 3 or more ranks in its ring's order, so "
          "not bitwise: tolerance {:.3g} -> {}\n",
          world_size, from_emulation.largest, from_emulation.where, tolerance,
          agrees ? "OK" : "FAILED");
    }
  }
  // For the lesson: the same training on one process and the global batch.
  TrainCheckpointing resume_only;  // continues a resumed run as the ranks did; saves nothing
  resume_only.resume_from = checkpointing.resume_from;
  const TrainResult single = train_single_process(args.options, data, {}, resume_only);
  const ParameterDifference from_single = difference_of(single.model.flat_parameters(), actual);
  if (mixed) {
    fmt::print(
        "        one process on the global batch: max difference {:.3g} ({} arithmetic in "
        "another order, for which no bound is derived: not checked)\n",
        from_single.largest, to_string(args.options.precision));
  } else {
    fmt::print(
        "        one process on the global batch: max difference {:.3g} (float32 sums of {} "
        "terms in another order; the bound for a short run is {:.3g}, and over long runs, with "
        "AdamW above all, the gap can outgrow it without any error: not checked)\n",
        from_single.largest, args.options.global_batch * data.labels_per_sample, tolerance);
  }
  bool close_to_float32 = true;
  if (mixed) {
    // The same run in float32, compared in loss (trainer.h: Float32Comparison, and
    // mixed_precision_loss_tolerance derives the tolerance); the parameters' distance is
    // printed for the lesson, not checked.
    const Float32Comparison comparison =
        compare_with_float32(args.options, data, world_size, emulated, resume_only);
    close_to_float32 = comparison.close();
    fmt::print(
        "        the same run in float32{}: mean loss over the last {} steps {:.6g} against "
        "{:.6g}, relative gap {:.3g}; tolerance {:.3g} = {:.2f} (u + s), u = {:.3g} ({}'s "
        "rounding), s = {:.3g} (float32's loss moved that much at lr (1 + u)) -> {}\n"
        "        (the parameter vectors part by {:.3g} relative, as training trajectories do: "
        "not checked)\n",
        emulated.skipped_step_numbers.empty() ? "" : ", skipping the same steps",
        comparison.steps_compared, comparison.mixed_loss, comparison.float32_loss,
        comparison.relative_gap, comparison.tolerance,
        comparison.tolerance / (comparison.unit_roundoff + comparison.sensitivity),
        comparison.unit_roundoff, to_string(args.options.precision), comparison.sensitivity,
        close_to_float32 ? "OK" : "FAILED", comparison.parameter_distance);
  }
  if (!close_to_float32)
    throw CheckFailed(fmt::format(
        "mixed-precision training ended farther from the same run in float32 than the "
        "tolerance allows: the master weights, the loss scaling or the 16-bit arithmetic "
        "loses more than rounding to {} explains",
        to_string(args.options.precision)));
  if (!agrees)
    throw CheckFailed(fmt::format(
        "data-parallel training is not the arithmetic of {} ranks: the all-reduce's average, "
        "the slicing of the global batch or the update differs from one process doing it",
        world_size));
}

/// The per-step summary of the slowest rank (mean over steps) and each step's spread.
void print_simulated_time(const SimulationOptions& simulation,
                          const std::vector<RankTrace>& traces) {
  StepSummary slowest;
  int slowest_rank = 0;
  for (const RankTrace& trace : traces) {
    const StepSummary mean = mean_step(trace);
    if (trace.rank == 0 || mean.total > slowest.total) {
      slowest = mean;
      slowest_rank = trace.rank;
    }
  }
  fmt::print("simulated clock: {}\n", simulation.describe());
  fmt::print(
      "simulated step (mean of {} steps, slowest rank {}): {:.3f} us; compute {:.3f} us, "
      "communication {:.3f} us, exposed communication {:.3f} us, overlap fraction {:.4f}, "
      "{} per link\n",
      slowest.step, slowest_rank, slowest.total * 1e6, slowest.compute * 1e6,
      slowest.communication * 1e6, slowest.exposed_communication * 1e6, slowest.overlap_fraction,
      format_bytes(static_cast<std::size_t>(slowest.link_bytes)));
}

/// What activation checkpointing saves and costs on one rank's share of a batch, measured.
void print_activation_checkpointing(const TrainOptions& options, const Dataset& data,
                                    int world_size) {
  const std::int64_t rows = options.global_batch / world_size;
  const ActivationCheckpointingEffect effect =
      measure_activation_checkpointing(options, data, rows);
  fmt::print(
      "activation checkpointing: a rank's forward and backward of {} windows peaks at {} of "
      "activations instead of {} ({:.0f}% less) for {:.0f}% more flops (each block's forward "
      "runs again in backward); gradients bitwise the same\n",
      rows, format_bytes(effect.activations_with), format_bytes(effect.activations_without),
      100.0 * (1.0 - static_cast<double>(effect.activations_with) /
                         static_cast<double>(effect.activations_without)),
      100.0 * (effect.flops_with / effect.flops_without - 1.0));
}

/// The peak of each category of the calling rank's memory over the run, as the labs grade it.
void print_memory_peaks(int rank) {
  const MemoryTracker& tracker = this_rank_memory().tracker();
  std::vector<std::string> peaks;
  for (std::size_t k = 0; k < kNumMemoryCategories; ++k) {
    const auto category = static_cast<MemoryCategory>(k);
    if (tracker.peak(category) > 0)
      peaks.push_back(
          fmt::format("{} {}", to_string(category), format_bytes(tracker.peak(category))));
  }
  fmt::print("memory of rank {}, the peak of each category: {}; all together {}\n", rank,
             fmt::join(peaks, ", "), format_bytes(tracker.peak_total()));
}

/// The memory the training state holds per parameter, by category, as ZeRO counts it (read
/// after training, while the model and optimizer are alive: the activations and
/// communication buffers of a step are gone). Mixed precision with AdamW: 2 + 2 + 12 = 16.
void print_memory_per_parameter(const TrainOptions& options, const TrainResult& result) {
  const MemoryTracker& tracker = this_rank_memory().tracker();
  const auto psi = static_cast<double>(result.model.num_parameters());
  const bool mixed = options.precision != DataType::kFloat32;
  fmt::print("memory per parameter ({} parameters, {} with {}; held by rank 0 after training):\n",
             result.model.num_parameters(), precision_name(options.precision), options.optimizer);
  double total = 0;
  for (const MemoryCategory category :
       {MemoryCategory::kParameters, MemoryCategory::kGradients, MemoryCategory::kOptimizerState}) {
    const std::size_t bytes = tracker.current(category);
    const double per_parameter = static_cast<double>(bytes) / psi;
    total += per_parameter;
    std::string note;
    if (category == MemoryCategory::kOptimizerState && mixed) {
      const std::size_t masters = result.model.num_parameters() * sizeof(float);
      note = fmt::format("  (float32 master weights {:g} + {} state {:g})",
                         static_cast<double>(masters) / psi, options.optimizer,
                         static_cast<double>(bytes - masters) / psi);
    }
    fmt::print("  {:<16} {:>12}  {:5.2f} bytes per parameter{}\n", to_string(category),
               format_bytes(bytes), per_parameter, note);
  }
  fmt::print(
      "  {:<16} {:>12}  {:5.2f} bytes per parameter{}\n", "total", "", total,
      mixed && options.optimizer == "adamw" ? " (ZeRO's 2 + 2 + 12 of mixed precision)" : "");
}

/// About how many bytes the checkpoint of a run of `options` takes: every parameter and
/// optimizer state tensor as float32. The header and layer norm's parameters are left out, so
/// that it is a lower bound and the free space check never refuses a checkpoint that fits.
/// No overflow: at most 2^60 parameters (parse_mlp_spec, parse_gpt_spec), 3 copies of 4
/// bytes, under 2^64. A GPT's vocabulary is not known before the data: its embedding and
/// head are left out too.
std::uintmax_t checkpoint_bytes(const TrainOptions& options) {
  std::uintmax_t parameters = 0;
  if (is_gpt_spec(options.model)) {
    const GptSpec spec = parse_gpt_spec(options.model);
    const auto dim = static_cast<std::uintmax_t>(spec.dim);
    // Per block: the QKV and output projections (4 C^2) and the MLP's two (8 C^2).
    parameters = static_cast<std::uintmax_t>(spec.layers) * 12 * dim * dim +
                 static_cast<std::uintmax_t>(spec.context) * dim;  // and the positions
  } else {
    const std::vector<std::int64_t> widths = parse_mlp_spec(options.model);
    for (std::size_t i = 0; i + 1 < widths.size(); ++i)
      parameters += static_cast<std::uintmax_t>(widths[i] + 1) *
                    static_cast<std::uintmax_t>(widths[i + 1]);  // weights and biases
  }
  // AdamW keeps two moments per parameter, SGD one momentum buffer unless momentum is 0.
  const std::uintmax_t states =
      options.optimizer == "adamw" ? 2 : (options.momentum != 0.0f ? 1 : 0);
  return parameters * (1 + states) * sizeof(float);
}

/// The data set of a run: a text set is cut into windows of the GPT's context.
Dataset load_training_data(const TrainOptions& options) {
  const std::int64_t context =
      is_gpt_spec(options.model) ? parse_gpt_spec(options.model).context : 0;
  return load_dataset(options.dataset, options.seed, context);
}

/// The run's first line: the model, the data and how they are trained.
void print_run_header(const TrainArguments& args, const Dataset& data, int world_size) {
  const std::string samples =
      data.tokenizer ? fmt::format("{} windows of {} tokens, a vocabulary of {} bytes", data.size(),
                                   data.labels_per_sample, data.tokenizer->size())
                     : fmt::format("{} samples", data.size());
  fmt::print(
      "dplab train: model {} on {} ({}), {} ranks on the {} backend, global batch {}, {} "
      "steps, {} lr {}\n",
      args.options.model, data.name, samples, world_size, args.backend, args.options.global_batch,
      args.options.steps, args.options.optimizer, args.options.lr);
  if (args.options.precision != DataType::kFloat32)
    fmt::print(
        "precision {}: parameters, activations and gradients in {}, float32 master weights in "
        "the optimizer, gradients all-reduced in {}{}\n",
        precision_name(args.options.precision), to_string(args.options.precision),
        to_string(args.options.reduce_dtype.value_or(args.options.precision)),
        args.options.precision == DataType::kFloat16
            ? ", dynamic loss scaling (initial scale 65536, growth 2 every 2000 steps, backoff "
              "0.5)"
            : "");
}

void run_train(TrainArguments args) {
  // Everything that can be checked without the data is checked first: a bad number or an
  // unwritable path must not cost a training run.
  LaunchOptions launch_options;
  launch_options.backend = parse_backend(args.backend);
  launch_options.comm.hang_timeout =
      timeout_milliseconds(args.hang_timeout_seconds, "--hang-timeout", kMaxHangTimeout);
  check_train_options(args.options);
  int world_size = args.world_size.value_or(0);
  if (launch_options.backend == Backend::kMpi) {
    if (!started_by_mpi())
      throw Error(
          "--backend mpi runs one rank per MPI process; start them with "
          "`dplab run -n N --backend mpi -- train ...`");
    if (world_size == 0) world_size = mpi_world_size();
  }
  if (world_size == 0) world_size = 1;
  launch_options.world_size = world_size;
  check_train_device(args.options.device);
  if (args.options.device != Device::kHost && launch_options.backend == Backend::kMpi)
    throw Error(
        "--device with --backend mpi: the mpi backend takes host buffers only; train on a "
        "device with the local backend (ranks as threads sharing the GPU) or with --backend "
        "nccl (one rank per GPU)");
  if (args.options.device == Device::kHost && launch_options.backend == Backend::kNccl)
    throw Error(
        "--backend nccl takes device buffers only: add --device cuda (the GPUs) or --device "
        "emulated (NCCL emulated on the CUDA device emulated in host memory)");
  if (!args.memory_budget.empty())
    launch_options.memory_budget_bytes = parse_byte_size(args.memory_budget, "--memory-budget");
  launch_options.simulation = simulation_options(args.simulation);
  const bool simulated = launch_options.simulation.enabled;
  if (simulated && launch_options.backend != Backend::kLocal)
    throw Error(
        "--net simulates the interconnect of the local backend; on mpi the clock is "
        "the wall clock");
  if (!args.trace.empty() && !simulated)
    throw Error("--trace records the simulated clock: add --net (e.g. --net ib-ndr)");
  // Without --trace only the step summaries are kept, so memory does not grow per step.
  launch_options.simulation.record_trace = !args.trace.empty();
  if (args.checkpoint_every > 0 && args.checkpoint.empty())
    throw Error("--checkpoint-every saves to --checkpoint, which is empty: give a path");
  const bool prints = mpi_world_rank() == 0;
  const std::vector<std::filesystem::path> inputs = dataset_files(args.options.dataset);
  // Held for the whole run: a second run saving the same checkpoint is refused.
  std::optional<OutputLock> checkpoint_lock;
  if (prints) {
    // The resumed checkpoint may be replaced: it was read whole, and what replaces it is a
    // later state of the same run (that is what --checkpoint-every is for).
    const std::vector<NamedOutput> outputs = {{"--checkpoint", args.checkpoint},
                                              {"--trace", args.trace}};
    check_distinct_outputs(outputs);
    // Nothing may land on dplab itself; the trace not on the resumed checkpoint either.
    std::vector<std::filesystem::path> read_files = inputs;
    read_files.emplace_back(this_executable());
    if (!args.checkpoint.empty()) {
      check_output_path(args.checkpoint, read_files);
      check_free_space(args.checkpoint, checkpoint_bytes(args.options), "the checkpoint");
    }
    if (!args.resume.empty()) read_files.emplace_back(args.resume);
    if (!args.trace.empty()) check_output_path(args.trace, read_files);
    if (!args.checkpoint.empty()) checkpoint_lock.emplace(args.checkpoint);
    // What runs killed while saving left beside this run's outputs.
    for (const std::string& output : {args.checkpoint, args.trace})
      if (!output.empty())
        for (const std::filesystem::path& stale : remove_stale_temporaries(output))
          fmt::print("removed {}, a temporary file left by a run that was stopped while saving\n",
                     stale.string());
  }

  const Dataset data = load_training_data(args.options);
  check_data_fits_model(args.options, data);
  // A GPT's vocabulary is the data's: the checkpoint records it, and a resumed run's must match.
  if (is_gpt_spec(args.options.model)) args.options.vocab = data.num_classes;
  std::optional<TrainingCheckpoint> resumed;
  if (!args.resume.empty()) {
    resumed = load_training_checkpoint(args.resume, args.options, data.size());
    if (data.tokenizer &&
        CharTokenizer::from_metadata(resumed->info, args.resume) != *data.tokenizer)
      throw Error(fmt::format(
          "cannot resume from '{}': its vocabulary {} is not the data set's {} (the text "
          "changed since it was saved)",
          args.resume, CharTokenizer::from_metadata(resumed->info, args.resume).describe(),
          data.tokenizer->describe()));
  }
  if (prints) {
    print_run_header(args, data, world_size);
    if (resumed) {
      fmt::print("resuming from {} at step {}\n", args.resume, resumed->step);
      const auto saved_by = resumed->info.find("world_size");
      if (saved_by != resumed->info.end() && saved_by->second != std::to_string(world_size))
        fmt::print(
            "note: {} was saved by {} ranks and continues on {}: the sums of the gradient "
            "average change order, so the result differs from an uninterrupted run in "
            "float32 rounding\n",
            args.resume, saved_by->second, world_size);
    }
  }

  TrainCheckpointing checkpointing;
  if (resumed) checkpointing.resume_from = &*resumed;
  checkpointing.every = args.checkpoint_every;
  checkpointing.save = [&](int step, const Model& model, Optimizer& optimizer,
                           const DynamicLossScaler* loss_scaler) {
    save_checkpoint(args, data, model, optimizer, loss_scaler, step, world_size);
  };
  if (prints && args.options.activation_checkpointing)
    print_activation_checkpointing(args.options, data, world_size);
  std::vector<RankTrace> traces(static_cast<std::size_t>(world_size));
  // A GPT's samples are windows: its throughput is counted in tokens.
  const std::int64_t tokens_per_sample = data.tokenizer ? data.labels_per_sample : 0;
  launch(launch_options, [&](Communicator& comm) {
    const TrainResult result = train_data_parallel(
        args.options, data, comm,
        [simulated, tokens_per_sample](const StepReport& report) {
          if (tokens_per_sample > 0) {
            fmt::print("step {:5d}  loss {:.4f}  next-token accuracy {:.3f}  tokens/s {:.0f}",
                       report.step, report.loss, report.accuracy,
                       report.samples_per_second * static_cast<double>(tokens_per_sample));
          } else {
            fmt::print("step {:5d}  loss {:.4f}  accuracy {:.3f}  samples/s {:.0f}", report.step,
                       report.loss, report.accuracy, report.samples_per_second);
          }
          if (simulated)
            fmt::print("  simulated step {:.3f} us", report.clock_seconds_per_step * 1e6);
          fmt::print("\n");
        },
        checkpointing);
    if (simulated) traces[static_cast<std::size_t>(comm.rank())] = comm.clock().trace();
    const bool identical = replicas_identical(result.model, comm);
    if (comm.rank() != 0) return;
    fmt::print("replicas: {} ranks {}\n", comm.size(),
               identical ? "bitwise identical" : "DIFFER (a bug: all-reduce results must agree)");
    if (!identical) throw CheckFailed("the replicas' parameters differ after training");
    if (args.options.precision == DataType::kFloat16)
      fmt::print(
          "loss scaling: {} of {} steps skipped for an overflow (the same steps on every rank: "
          "one all-reduce of the overflow flag decides), loss scale {:g} after the last\n",
          result.skipped_steps, args.options.steps, result.loss_scale);
    print_memory_peaks(comm.rank());
    print_memory_per_parameter(args.options, result);
    // Saved before --verify: a failed comparison must not lose the training.
    if (!args.checkpoint.empty())
      save_checkpoint(args, data, result.model, *result.optimizer,
                      result.loss_scaler ? &*result.loss_scaler : nullptr, args.options.steps,
                      comm.size());
    if (args.verify) verify_against_single_process(args, data, result, comm.size(), checkpointing);
  });
  if (simulated) print_simulated_time(launch_options.simulation, traces);
  if (!args.trace.empty()) {
    write_chrome_trace(args.trace, traces);
    std::size_t events = 0;
    for (const RankTrace& trace : traces) events += trace.events.size();
    fmt::print("trace: {} ({} ranks, {} events; open it in https://ui.perfetto.dev)\n", args.trace,
               traces.size(), events);
  }
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto args = std::make_shared<TrainArguments>();
  TrainOptions& o = args->options;
  CLI::App* train = app.add_subcommand("train", "Train a model data-parallel");
  train
      ->add_option("--model", o.model,
                   "MLP layer widths, input first, or a GPT: gpt or "
                   "gpt:layers=L,dim=C,heads=H,context=T (trains on text)")
      ->capture_default_str();
  train->add_option("--activation", o.activation, "relu or gelu")->capture_default_str();
  train->add_flag("--layer-norm", o.layer_norm, "A LayerNorm before each activation");
  CLI::Option* dataset =
      train
          ->add_option("--dataset", o.dataset,
                       "synthetic[:N], digits, csv:PATH, idx:IMAGES,LABELS; for a GPT text:PATH "
                       "or fortunes (Debian's fortunes, a GPT's default)")
          ->capture_default_str();
  train->add_option("--batch", o.global_batch, "Global batch size (all ranks together)")
      ->capture_default_str()
      ->check(whole_number_at_least(1));
  train->add_option("--steps", o.steps, "Optimizer steps (in all, a resumed run included)")
      ->capture_default_str()
      ->check(whole_number_at_least(0));
  train->add_option("--optimizer", o.optimizer, "sgd or adamw")->capture_default_str();
  train->add_option("--lr", o.lr, "Learning rate")
      ->capture_default_str()
      ->check(finite_in(0, 1e6) & nonzero_in_float());
  train->add_option("--momentum", o.momentum, "SGD momentum, in [0, 1)")
      ->capture_default_str()
      ->check(finite_in(0, 0.999999) & nonzero_in_float());
  train->add_option("--weight-decay", o.weight_decay, "Weight decay")
      ->capture_default_str()
      ->check(finite_in(0, 1e6) & nonzero_in_float());
  train->add_option("--seed", o.seed, "Seed of the initial weights and data order")
      ->capture_default_str()
      ->check(seed_number());
  train->add_option("--log-every", o.log_every, "Print progress every N steps")
      ->capture_default_str()
      ->check(whole_number_at_least(1));
  train
      ->add_option("-n,--world-size", args->world_size,
                   "Ranks (default: 1 on local, every process under mpi)")
      ->check(world_size_range());
  train->add_option("--backend", args->backend, "local or mpi")->capture_default_str();
  train
      ->add_option("--checkpoint", args->checkpoint,
                   "safetensors file of the run's state, saved at the end ('' for none)")
      ->capture_default_str();
  train
      ->add_option("--checkpoint-every", args->checkpoint_every,
                   "Also save --checkpoint every K steps (0: only at the end)")
      ->capture_default_str()
      ->check(whole_number_at_least(0));
  train
      ->add_option("--resume", args->resume,
                   "Continue from this checkpoint: its step, parameters, optimizer state and "
                   "data position (the options must be those of the run that saved it)")
      ->check(non_empty_path());
  train->add_flag("--save-non-finite", args->save_non_finite,
                  "Save a checkpoint even if a weight is NaN or infinite");
  train->add_flag("--verify", args->verify,
                  "Also train one process doing the ranks' arithmetic and compare the "
                  "parameters bitwise (and, for information, one process on the global batch)");
  train
      ->add_option("--hang-timeout", args->hang_timeout_seconds,
                   "Seconds a rank may wait before the hang report")
      ->capture_default_str()
      ->check(positive_finite(std::chrono::duration<double>(kMaxHangTimeout).count()));
  train->add_option("--memory-budget", args->memory_budget,
                    "Bytes of tensors each rank may hold (K, M, G suffixes), as on an "
                    "accelerator; past it the run stops with the rank's peak per category");
  train->add_flag("--overlap", o.overlap,
                  "All-reduce each gradient from its gradient-ready hook, during backward");
  train->add_flag("--activation-checkpointing", o.activation_checkpointing,
                  "A GPT's blocks keep only their inputs in forward and recompute the rest in "
                  "backward: less activation memory, more compute, the same gradients");
  add_simulation_options(*train, args->simulation);
  train
      ->add_option("--trace", args->trace,
                   "Write every rank's ops on the simulated clock as a Chrome trace (JSON)")
      ->check(non_empty_path())
      ->group("Simulated clock");
  train
      ->add_option("--device", args->device,
                   "Where the model and optimizer state live: host, cuda, or emulated (the "
                   "CUDA device emulated in host memory)")
      ->capture_default_str();
  train
      ->add_option("--precision", args->precision,
                   "fp32, or mixed precision: bf16 or fp16 (16-bit parameters, activations and "
                   "gradients, float32 master weights; fp16 with dynamic loss scaling)")
      ->capture_default_str();
  train->add_option("--reduce-dtype", args->reduce_dtype,
                    "The gradient all-reduce's type: fp32, or the precision's (the default)");
  train->callback([args, dataset] {
    args->options.device = select_device(args->device);
    args->options.precision = parse_precision(args->precision, "--precision");
    if (!args->reduce_dtype.empty())
      args->options.reduce_dtype = parse_precision(args->reduce_dtype, "--reduce-dtype");
    // A GPT trains on text: without --dataset, on the default corpus.
    if (dataset->count() == 0 && is_gpt_spec(args->options.model))
      args->options.dataset = "fortunes";
    run_train(*args);
  });
}

}  // namespace dp::cli
