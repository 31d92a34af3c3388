// trainer.h: the runtime's own training loop, single-process and data-parallel.
//
// This is the ground truth the labs are measured against: `train_single_process` trains
// on the global batch in one process, and `train_data_parallel` trains the same model on
// N ranks, each on its 1/N slice of every global batch, averaging gradients with the
// communicator's native all-reduce. With equal local batches the averaged gradient is
// the global batch's mean gradient, so both produce the same parameters up to float32
// rounding (see `equivalence_tolerance`). `dplab train` is a thin shell around these.
//
// The model is an MLP on a classification set, or a GPT on a text set (options.model
// "gpt:...", options.dataset "text:PATH" or "fortunes", dp/text_data.h): a sample is then a
// window of `context` tokens with a label per token, batched and sliced between ranks the
// same way, and the GPT's vocabulary is the data's.
//
// Example:
//
//   dp::TrainOptions options;                       // 64-256-256-10 on synthetic data
//   dp::Dataset data = dp::load_dataset(options.dataset, options.seed);
//   dp::TrainResult single = dp::train_single_process(options, data);
//   dp::launch({.world_size = 4}, [&](dp::Communicator& comm) {
//     dp::TrainResult replica = dp::train_data_parallel(options, data, comm);
//   });
//
// A run can save its whole state every K steps and a later run can continue from it, bit
// for bit as if it had never stopped (`save_training_checkpoint`, `TrainCheckpointing`):
//
//   dp::TrainCheckpointing checkpointing;
//   checkpointing.every = 50;
//   checkpointing.save = [&](int step, const dp::Model& model, dp::Optimizer& optimizer,
//                            const dp::DynamicLossScaler* loss_scaler) {
//     dp::save_training_checkpoint("run.safetensors", options, model, optimizer, step,
//                                  data.size(), {.world_size = 4, .loss_scaler = loss_scaler});
//   };
//   ...                                   // later, in a new run with the same options:
//   dp::TrainingCheckpoint start =
//       dp::load_training_checkpoint("run.safetensors", options, data.size());
//   checkpointing.resume_from = &start;   // continues at step start.step
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dp/checkpoint.h"
#include "dp/comm.h"
#include "dp/data.h"
#include "dp/loss_scaler.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/tokenizer.h"

namespace dp {

/// What to train and how.
struct TrainOptions {
  /// An MLP spec (layer widths, input first) or a GPT spec ("gpt:layers=4,dim=128,heads=4,
  /// context=64", dp/model.h), which trains on a text data set (dp/text_data.h).
  std::string model = "64-256-256-10";
  std::string activation = "relu";    ///< "relu" or "gelu"
  bool layer_norm = false;            ///< a LayerNorm before each activation
  std::string dataset = "synthetic";  ///< a `load_dataset` spec
  std::int64_t global_batch = 64;     ///< samples per step over all ranks
  int steps = 100;                    ///< optimizer steps
  std::string optimizer = "sgd";      ///< "sgd" or "adamw"
  float lr = 0.1f;                    ///< learning rate
  float momentum = 0.0f;              ///< SGD momentum
  float weight_decay = 0.0f;          ///< decoupled for AdamW, L2 for SGD
  std::uint64_t seed = 0;             ///< initial weights and data order
  int log_every = 10;                 ///< report every this many steps (and the last), >= 1
  /// Data-parallel: issue each gradient's all-reduce from its gradient-ready hook, during
  /// backward, so that communication overlaps the rest of backward (the same all-reduces,
  /// so the same bits, in reverse parameter order); otherwise all after backward.
  bool overlap = false;
  /// A GPT: each block keeps only its input in forward and runs its forward again in
  /// backward (dp/layers/transformer_block.h). The same gradients, bit for bit, so it does
  /// not change the run; it trades compute for activation memory.
  bool activation_checkpointing = false;
  /// Where the model, its gradients and the optimizer state live. `Device::kCuda` trains on
  /// the GPU (or the emulated device, dp::set_cuda_device_emulated); the ranks then
  /// exchange device buffers, which the local and nccl backends take (see
  /// `check_train_device`).
  Device device = Device::kHost;
  /// A GPT's vocabulary (tokens): 0 takes it from the data set, which the trainers do;
  /// `make_model` and `load_training_checkpoint` need it set for a GPT.
  std::int64_t vocab = 0;
  /// The element type of the model's parameters, activations and gradients: float32, or
  /// bfloat16 or float16 for mixed-precision training (any model: each layer widens its
  /// operands, computes in float32 and rounds its results once, as dp/layers/linear.h
  /// states). In mixed precision the optimizer is wrapped
  /// in a `MixedPrecisionOptimizer` (float32 master weights: 2 + 2 + 12 bytes per parameter
  /// with AdamW), and float16 scales its loss with a `DynamicLossScaler` (PyTorch
  /// GradScaler's defaults): a step whose averaged gradients overflow is skipped on every
  /// rank, and the scale halved. Checkpoints hold the 16-bit parameters (safetensors "BF16"
  /// or "F16"), the float32 masters and the inner optimizer's state, and fp16's loss scale
  /// (`save_training_checkpoint`); a run resumes only in the precision it was saved in.
  DataType precision = DataType::kFloat32;
  /// The type of the gradient all-reduce: empty for the parameters' type (16-bit gradients
  /// averaged as the backends reduce 16-bit buffers, each partial sum rounded, dp/comm.h), or
  /// float32 (each 16-bit gradient widened into a float32 buffer charged as communication,
  /// averaged in float32, and rounded once back into the gradient).
  std::optional<DataType> reduce_dtype{};
  /// float16's dynamic loss scaling (PyTorch GradScaler's defaults; unused otherwise).
  LossScalerOptions loss_scaling{};
  /// Steps (1-based) whose optimizer step is left out, as a float16 run leaves out the steps
  /// whose gradients overflowed (`TrainResult::skipped_step_numbers`): a float32 run given
  /// them takes the same updates, which `compare_with_float32` needs. Empty for training.
  std::vector<int> steps_to_skip{};
};

/// Throws `dp::Error` unless training on `device` is possible in this build and process:
/// `Device::kCuda` needs a build with CUDA and a visible GPU, or the emulated device. The
/// trainers call it first; commands call it before they load data.
void check_train_device(Device device);

/// Throws `dp::Error` naming the first option of `options` that is out of range: a model
/// spec that does not parse, an unknown activation or optimizer, a global batch below 1,
/// negative steps, a learning rate or weight decay that is negative or not finite, a
/// momentum outside [0, 1), or `log_every` below 1; a GPT with a data set that is not text
/// (`is_text_dataset_spec`) or with an MLP's options (--layer-norm, --activation gelu), an
/// MLP with a text data set or with activation checkpointing; a precision that is not
/// float32, bfloat16 or float16, a 16-bit GPT or 16-bit MLP with LayerNorm or GELU (no 16-bit
/// path yet), a reduce type other than float32 or the precision. The trainers call it first;
/// commands call it before they load data.
void check_train_options(const TrainOptions& options);

/// Throws `dp::Error` unless the model `options` describes can train on `data`. An MLP:
/// its input width must equal the data's feature count, one label per sample, and every
/// label must be below its output width (the error names the first sample whose label is
/// not). A GPT: the data must be windows of its context (`labels_per_sample`), with a
/// tokenizer, and `options.vocab`, when set, the data's vocabulary. Checked before the first
/// step, so a bad label cannot hide until a batch happens to draw it.
void check_data_fits_model(const TrainOptions& options, const Dataset& data);

/// One line of training progress.
struct StepReport {
  int step = 0;                   ///< 1-based step number
  float loss = 0;                 ///< mean loss over the global batch
  float accuracy = 0;             ///< fraction of the global batch classified right
  double samples_per_second = 0;  ///< global samples per wall-clock second since the last report
  /// Data-parallel: mean seconds per step since the last report on `comm.clock()` (the
  /// simulated step time when the simulation is on); 0 in a single process.
  double clock_seconds_per_step = 0;
};

/// What a training run leaves behind.
struct TrainResult {
  Model model;                           ///< the trained model
  std::unique_ptr<Optimizer> optimizer;  ///< its optimizer, with its state after the last step
  std::vector<StepReport> reports;       ///< every report, in order
  float max_abs_gradient = 0;            ///< largest |averaged gradient| seen (for tolerances;
                                         ///< 0 under fp16 loss scaling)
  std::int64_t skipped_steps = 0;        ///< fp16: steps skipped for an overflow (all ranks alike)
  std::vector<int> skipped_step_numbers{};  ///< which steps (1-based) were skipped, in order
  float loss_scale = 0;                     ///< fp16: the loss scale after the last step (else 0)
  /// fp16: the loss scaler after the last step, whole (what a checkpoint of the run saves).
  std::optional<DynamicLossScaler> loss_scaler{};
};

/// Called with each report, on rank 0 only when data-parallel.
using ReportCallback = std::function<void(const StepReport&)>;

/// The global batches of a run, epoch after epoch. Epoch e is a permutation of the data set
/// shuffled (Fisher-Yates) with CounterRng(seed, 0x5EED0000 + e), drawn once, when the run
/// first needs it; batch b of an epoch is positions [b B, (b+1) B) of it, and the last
/// incomplete batch is dropped. The same on every rank.
///
/// Example:
///
///   dp::GlobalBatches batches(data.size(), options.global_batch, options.seed);
///   for (int step = 0; step < options.steps; ++step) {
///     std::span<const std::size_t> rows = batches.of_step(step);  // B indices
///   }
class GlobalBatches {
 public:
  /// Batches of `global_batch` samples of a data set of `dataset_size`; throws `dp::Error`
  /// unless 1 <= global_batch <= dataset_size.
  GlobalBatches(std::size_t dataset_size, std::int64_t global_batch, std::uint64_t seed);
  /// The indices of the global batch of `step` (0-based); valid until the next call.
  std::span<const std::size_t> of_step(int step);
  /// Batches in one epoch: the data set size divided by the batch, rounded down.
  std::size_t batches_per_epoch() const { return batches_per_epoch_; }
  /// The epoch `step` (0-based) belongs to.
  std::size_t epoch_of(int step) const;
  /// How many epoch orders were drawn so far: one per epoch entered, however many steps.
  std::size_t epochs_drawn() const { return epochs_drawn_; }

 private:
  std::size_t batch_;
  std::size_t batches_per_epoch_;
  std::uint64_t seed_;
  std::vector<std::size_t> order_;  // the permutation of epoch `epoch_`
  std::size_t epoch_ = 0;
  std::size_t epochs_drawn_ = 0;
};

/// The indices of the global batch of `step` (0-based), as `GlobalBatches::of_step` gives
/// them (this draws the step's epoch order anew: a loop over steps should keep a
/// `GlobalBatches`).
std::vector<std::size_t> global_batch_indices(std::size_t dataset_size, std::int64_t global_batch,
                                              int step, std::uint64_t seed);

/// Builds the model `options` describe, with the initial weights of `options.seed`, on
/// `options.device`: `Model::mlp` or, for a GPT spec, `Model::gpt` over `options.vocab`
/// tokens (throws `dp::Error` when it is 0: the vocabulary comes from the data).
Model make_model(const TrainOptions& options);

/// What activation checkpointing saves and costs on one forward and backward of a GPT.
struct ActivationCheckpointingEffect {
  /// Peak bytes of activations (`MemoryCategory::kActivations`, the batch's inputs left out)
  /// when every block keeps what its sublayers save.
  std::size_t activations_without = 0;
  /// The same with activation checkpointing: each block keeps its input only.
  std::size_t activations_with = 0;
  /// Flops of the forward and backward without it (the layers' cost model).
  double flops_without = 0;
  /// The same with it: each block's forward runs again in its backward.
  double flops_with = 0;
};

/// Measures what activation checkpointing changes for the GPT `options` describe, on the
/// first `rows` samples of `data` (a rank's share of a batch): one forward and backward
/// without and one with it, each on a fresh model and a memory account of its own (the
/// caller's account is untouched). It also checks that the two give bitwise the same
/// gradients, which the recomputation promises (an invariant: a failure is a bug of dplab).
/// Throws `dp::Error` for an MLP or unless 1 <= rows <= the data set's size.
ActivationCheckpointingEffect measure_activation_checkpointing(const TrainOptions& options,
                                                               const Dataset& data,
                                                               std::int64_t rows);

/// A training run's saved state, read back by `load_training_checkpoint`.
struct TrainingCheckpoint {
  int step = 0;                             ///< optimizer steps the saved run had done
  std::int64_t optimizer_steps = 0;         ///< the optimizer's step counter
  std::map<std::string, Tensor> tensors;    ///< parameters by name, optimizer state as
                                            ///< "optimizer.<state name>"
  std::map<std::string, std::string> info;  ///< the file's metadata
  /// fp16: the loss scaler as it was (scale, growth tracker, skipped steps); else empty.
  std::optional<DynamicLossScaler> loss_scaler{};
};

/// Checkpoints of a run, and where it starts (all optional).
struct TrainCheckpointing {
  /// Continue from this state instead of from the initial weights: the parameters, the
  /// optimizer state and counter, and the data position (the step) are restored, so the
  /// run continues bitwise as the saved run would have, on the same world size.
  const TrainingCheckpoint* resume_from = nullptr;
  /// Call `save` after every step whose number is a multiple of this (0: never), except the
  /// last step (the caller has the final state in `TrainResult`).
  int every = 0;
  /// Saves a checkpoint after `step` steps; called on rank 0 only when data-parallel.
  /// `loss_scaler` is fp16's (null otherwise), for `TrainingCheckpointInfo::loss_scaler`.
  std::function<void(int step, const Model& model, Optimizer& optimizer,
                     const DynamicLossScaler* loss_scaler)>
      save;
};

/// What a training checkpoint records besides the options.
struct TrainingCheckpointInfo {
  int world_size = 1;             ///< ranks of the run that saved it
  std::string backend{};          ///< "local" or "mpi" (empty for a single process)
  bool allow_non_finite = false;  ///< save even if a value is NaN or infinite
  /// A text data set's tokenizer, recorded in the metadata (`CharTokenizer::add_to_metadata`)
  /// so that the model's text can be decoded (`dplab sample`).
  std::optional<CharTokenizer> tokenizer{};
  /// fp16's loss scaler, whose state is saved with the run (required when the options'
  /// precision is float16, refused otherwise).
  const DynamicLossScaler* loss_scaler = nullptr;
};

/// Saves the state of a run after `step` steps to `path` as safetensors (see
/// dp/checkpoint.h; written as dp/output_file.h describes): every parameter under its name,
/// every optimizer state tensor as "optimizer.<name>", and metadata: the format, the step
/// and data position (epoch and batch within it), the optimizer's counter, every option
/// that decides the trajectory (model, activation, layer_norm, dataset and its size, batch,
/// seed, optimizer, lr, momentum, weight_decay, exactly as text), the world size and
/// backend, a GPT's vocabulary size ("vocab") and a text set's tokenizer, and checksums of
/// the header and of every tensor (format "dplab-train-2";
/// "dplab-train-1", the format before checksums, is still read). Other tools read it as an
/// ordinary checkpoint of the parameters. The metadata "precision" names the parameters'
/// type ("float32", or in mixed precision "bfloat16" or "float16", whose parameters are
/// saved as "BF16" or "F16" and whose optimizer state begins with the float32
/// "optimizer.master_weights"); a mixed-precision run also records "reduce_dtype", and
/// float16 its loss scaling options and the scaler's state ("loss_scale",
/// "loss_scale_growth_tracker", "loss_scale_skipped_steps"). Throws
/// `dp::Error` when a value is NaN or infinite (naming it; a diverged run is not worth
/// resuming) unless `info.allow_non_finite`, or when the file cannot be written.
void save_training_checkpoint(const std::filesystem::path& path, const TrainOptions& options,
                              const Model& model, Optimizer& optimizer, int step,
                              std::size_t dataset_size, const TrainingCheckpointInfo& info);

/// Reads a checkpoint `save_training_checkpoint` wrote and checks that `options` continue
/// it: the same trajectory options (each difference is named, with both values), the same
/// data set size, a step not past `options.steps`, and a tensor of the right shape for
/// every parameter and optimizer state. It also checks that the file is as it was written
/// (the checksums, required in "dplab-train-2"), that the optimizer's step count is at most
/// the step, and that every value is finite and every `optimizer.exp_avg_sq` value >= 0.
/// The precision must be the run's (a checkpoint without "precision", older than mixed
/// precision, is float32): a bfloat16 checkpoint resumed in float32 or float16 is refused
/// naming both, and so are another reduce type or other loss scaling options.
/// Throws `dp::Error` naming the file and the tensor or entry otherwise.
TrainingCheckpoint load_training_checkpoint(const std::filesystem::path& path,
                                            const TrainOptions& options, std::size_t dataset_size);

/// Trains in one process on the whole global batch.
TrainResult train_single_process(const TrainOptions& options, const Dataset& data,
                                 const ReportCallback& on_report = {},
                                 const TrainCheckpointing& checkpointing = {});

/// Trains on every rank of `comm`: rank r takes rows [r B/N, (r+1) B/N) of each global
/// batch, gradients are averaged with one all-reduce per parameter, and rank 0's initial
/// weights are broadcast first. `global_batch` must be a multiple of the world size.
/// `comm.clock().mark_step()` is called after the broadcast and after every step, so
/// `summarize_steps(comm.clock().trace())` gives one summary per step.
/// A NaN or infinite gradient throws `dp::Error` naming the parameter, element, rank
/// and step.
TrainResult train_data_parallel(const TrainOptions& options, const Dataset& data,
                                Communicator& comm, const ReportCallback& on_report = {},
                                const TrainCheckpointing& checkpointing = {});

/// Trains in one process the way `world_size` ranks train on a backend that adds in rank
/// order (local, mpi, and nccl at 1 or 2 ranks): every step computes each rank's gradient on
/// its slice of the global batch, adds them in rank order, ((g_0 + g_1) + g_2) + ..., and
/// divides the sum by the rank count, then steps. In mixed precision it reduces as the
/// backends reduce the reduce type: 16-bit sums rounded after each addition and the quotient
/// rounded (dp/comm.h), or float32 sums of the widened gradients rounded once; under fp16 it
/// scales the loss and skips the steps whose averaged gradients overflow, as every rank does. Its
/// parameters are then bitwise those of `train_data_parallel` on `world_size` ranks, for any number
/// of steps, optimizer and data: the same arithmetic in the same order, with none of the
/// communication. `dplab train
/// --verify` compares with it. Continues from `checkpointing.resume_from` when set; saves
/// nothing.
TrainResult train_emulating_data_parallel(const TrainOptions& options, const Dataset& data,
                                          int world_size,
                                          const TrainCheckpointing& checkpointing = {});

/// An absolute tolerance for comparing data-parallel with single-process parameters.
///
/// Data-parallel training computes each gradient element as an average of N partial
/// means instead of one mean over B samples: the same terms, added in another order. A
/// float32 sum of B terms reordered differs by at most about B u sum|t| (u = 2^-24,
/// Higham, "Accuracy and Stability of Numerical Algorithms", 2002, sec. 4.2), so one
/// step's update differs by at most lr_eff B u max|g|, where lr_eff is the learning
/// rate (divided by 1 - momentum for SGD with momentum). Over K steps the errors add:
/// K lr_eff B u max|g|, doubled for safety. `max_abs_gradient` comes from the run being
/// checked.
///
/// AdamW divides each element's step by the running RMS of its gradient, so the same
/// reordering error reaches the step scaled by max|g| / RMS instead of 1, a ratio with no
/// a-priori bound. The tolerance takes it from measurement: on the default model with the
/// synthetic and digits sets, 2 to 8 ranks and lr 1e-3 to 1e-2, the first 100 steps differ
/// by 1.5 to 3.4 times the SGD form above, so AdamW gets 20 times it (6x headroom; the
/// README's digits example differs by 3.0e-6 against 4.6e-5). Over long runs with a large
/// learning rate the two can legitimately drift apart chaotically: an element whose
/// gradient is within float32 noise of zero can flip the sign of its normalised step (a
/// difference of 2 lr), and later steps amplify that. Check AdamW over short runs. `dplab
/// train --verify` therefore checks against `train_emulating_data_parallel`, bitwise, and
/// prints this comparison for information only.
float equivalence_tolerance(const TrainOptions& options, float max_abs_gradient);

/// How close a mixed-precision run ends to the same run in float32, in training loss.
///
/// The parameters of the two runs cannot be compared element by element: once a 16-bit
/// rounding changes an update, the data's noise and AdamW's normalised step carry the two
/// trajectories apart (after 100 steps of the default model the parameter vectors differ by
/// about 13 % in bfloat16) while both descend the same loss. What training promises is the
/// loss, so the comparison is of the mean training loss over the last quarter of the steps
/// (the same batches in both runs: the same seed), relative to float32's. The float32 run
/// skips the steps the float16 run skipped for an overflow (`TrainOptions::steps_to_skip`):
/// a skipped step is an update fewer, which is loss scaling's price, not rounding's.
struct Float32Comparison {
  int steps_compared = 0;    ///< the last quarter of the steps, at least one
  double mixed_loss = 0;     ///< the mixed-precision run's mean loss over them
  double float32_loss = 0;   ///< the float32 run's mean loss over them
  double relative_gap = 0;   ///< |mixed - float32| / float32 (NaN if either is not finite)
  double unit_roundoff = 0;  ///< u of the 16-bit format: 2^-8 bfloat16, 2^-11 float16
  double sensitivity = 0;    ///< the float32 run's relative loss change at lr (1 + u)
  double tolerance = 0;      ///< `mixed_precision_loss_tolerance` of the run
  /// |p_mixed - p_float32| / |p_float32| of the final parameter vectors (2-norms): how far the
  /// trajectories parted, for the lesson; not part of the check.
  double parameter_distance = 0;
  /// True when the relative gap is within the tolerance (false for a NaN or infinite loss).
  bool close() const { return relative_gap <= tolerance; }
};

/// The relative loss gap a mixed-precision run in `precision` (bfloat16 or float16) may have
/// from the same run in float32, given the run's `sensitivity`.
///
/// Derivation. A 16-bit format keeps p bits of significand (bfloat16 8, float16 11), so a
/// rounding to it moves a value by at most u = 2^-p of its size. Mixed precision rounds the
/// loss's inputs in every forward pass and every update's ingredients in every step, each by
/// a relative error of at most u. How far such errors carry a run depends on the run: a
/// steady descent forgets them, a run at the edge of stability (AdamW at a large learning
/// rate) amplifies them chaotically. So the run measures its own sensitivity: how far
/// float32's loss moves when every update is scaled by 1 + u (the learning rate times 1 + u),
/// one rounding's worth of error in every step; u itself is what rounding the loss's inputs
/// does to the loss. Mixed precision's gap is then of the order of u + sensitivity, times a
/// constant for the roundings in series (float16's also for its narrow range: a gradient
/// below 2^-14 / S keeps fewer bits than u counts), measured once per format
/// (`mixed_precision_worst_measured_ratio`); the tolerance is twice the worst measured:
/// 2 k (u + sensitivity). What it catches is gross: gradients summed but not averaged over
/// 8 ranks (SGD at 8 times its rate) ends 70 % from float32, an update left scaled by S
/// diverges; 4 ranks' sum (4 times the rate) ends only 3.6 % away, inside bfloat16's
/// tolerance. The bitwise comparison with `train_emulating_data_parallel` is the exact check.
double mixed_precision_loss_tolerance(DataType precision, double sensitivity);

/// The worst ratio k of gap to u + sensitivity measured for `precision` by
/// `MixedPrecisionTraining.DISABLED_LossGapCalibration` (run by name, and on fewer seeds by
/// ctest): over seeds 0-9 of the default MLP on its synthetic data, 100 steps of SGD (lr 0.1;
/// lr 0.05 with momentum 0.9) and AdamW (lr 0.003 and 0.01), 1 and 4 ranks, 16-bit and
/// float32 reduction, bfloat16 8.35 and float16 13.99. Throws `dp::Error` for float32.
double mixed_precision_worst_measured_ratio(DataType precision);

/// The unit roundoff u = 2^-p of a 16-bit format with p bits of significand: 2^-8 for
/// bfloat16, 2^-11 for float16; throws `dp::Error` for float32 (not a mixed precision).
double unit_roundoff_of(DataType precision);

/// Compares a mixed-precision run with the same options in float32: trains the float32 run
/// and the one at lr (1 + u) the way `train_emulating_data_parallel` trains `world_size`
/// ranks, each skipping the steps `mixed` skipped. `mixed` must report every step (`log_every`
/// 1): throws `dp::Error` if it does not.
Float32Comparison compare_with_float32(const TrainOptions& options, const Dataset& data,
                                       int world_size, const TrainResult& mixed,
                                       const TrainCheckpointing& checkpointing = {});

}  // namespace dp
