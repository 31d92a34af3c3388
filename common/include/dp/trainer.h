// trainer.h: the runtime's own training loop, single-process and data-parallel.
//
// This is the ground truth the labs are measured against: `train_single_process` trains
// on the global batch in one process, and `train_data_parallel` trains the same model on
// N ranks, each on its 1/N slice of every global batch, averaging gradients with the
// communicator's native all-reduce. With equal local batches the averaged gradient is
// the global batch's mean gradient, so both produce the same parameters up to float32
// rounding (see `equivalence_tolerance`). `dplab train` is a thin shell around these.
//
// Example:
//
//   dp::TrainOptions options;                       // 64-256-256-10 on synthetic data
//   dp::Dataset data = dp::load_dataset(options.dataset, options.seed);
//   dp::TrainResult single = dp::train_single_process(options, data);
//   dp::launch({.world_size = 4}, [&](dp::Communicator& comm) {
//     dp::TrainResult replica = dp::train_data_parallel(options, data, comm);
//   });
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "dp/comm.h"
#include "dp/data.h"
#include "dp/model.h"
#include "dp/optimizer.h"

namespace dp {

/// What to train and how.
struct TrainOptions {
  std::string model = "64-256-256-10";  ///< MLP spec: layer widths, input first
  std::string activation = "relu";      ///< "relu" or "gelu"
  bool layer_norm = false;              ///< a LayerNorm before each activation
  std::string dataset = "synthetic";    ///< a `load_dataset` spec
  std::int64_t global_batch = 64;       ///< samples per step over all ranks
  int steps = 100;                      ///< optimizer steps
  std::string optimizer = "sgd";        ///< "sgd" or "adamw"
  float lr = 0.1f;                      ///< learning rate
  float momentum = 0.0f;                ///< SGD momentum
  float weight_decay = 0.0f;            ///< decoupled for AdamW, L2 for SGD
  std::uint64_t seed = 0;               ///< initial weights and data order
  int log_every = 10;                   ///< report every this many steps (and the last)
  /// Data-parallel: issue each gradient's all-reduce from its gradient-ready hook, during
  /// backward, so that communication overlaps the rest of backward (the same all-reduces,
  /// so the same bits, in reverse parameter order); otherwise all after backward.
  bool overlap = false;
};

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
  Model model;                      ///< the trained model
  std::vector<StepReport> reports;  ///< every report, in order
  float max_abs_gradient = 0;       ///< largest |averaged gradient| seen (for tolerances)
};

/// Called with each report, on rank 0 only when data-parallel.
using ReportCallback = std::function<void(const StepReport&)>;

/// The indices of the global batch of `step` (0-based): epoch e is a permutation of the
/// data set shuffled with CounterRng(seed, e); batches walk through it, dropping the last
/// incomplete one. The same on every rank.
std::vector<std::size_t> global_batch_indices(std::size_t dataset_size, std::int64_t global_batch,
                                              int step, std::uint64_t seed);

/// Builds the model `options` describe, with the initial weights of `options.seed`.
Model make_model(const TrainOptions& options);

/// Trains in one process on the whole global batch.
TrainResult train_single_process(const TrainOptions& options, const Dataset& data,
                                 const ReportCallback& on_report = {});

/// Trains on every rank of `comm`: rank r takes rows [r B/N, (r+1) B/N) of each global
/// batch, gradients are averaged with one all-reduce per parameter, and rank 0's initial
/// weights are broadcast first. `global_batch` must be a multiple of the world size.
/// `comm.clock().mark_step()` is called after the broadcast and after every step, so
/// `summarize_steps(comm.clock().trace())` gives one summary per step.
/// A NaN or infinite gradient throws `dp::Error` naming the parameter, element, rank
/// and step.
TrainResult train_data_parallel(const TrainOptions& options, const Dataset& data,
                                Communicator& comm, const ReportCallback& on_report = {});

/// An absolute tolerance for comparing data-parallel with single-process parameters.
///
/// Data-parallel training computes each gradient element as an average of N partial
/// means instead of one mean over B samples: the same terms, added in another order. A
/// float32 sum of B terms reordered differs by at most about B u sum|t| (u = 2^-24,
/// Higham, "Accuracy and Stability of Numerical Algorithms", 2002, sec. 4.2), so one
/// step's update differs by at most lr_eff B u max|g|, where lr_eff is the learning
/// rate (divided by 1 - momentum for SGD with momentum; AdamW's normalised step is at
/// most lr per element, and we bound its change by lr B u / eps_rel with eps_rel the
/// Adam epsilon scale). Over K steps the errors add: K lr_eff B u max|g|, doubled for
/// safety. `max_abs_gradient` comes from the run being checked.
float equivalence_tolerance(const TrainOptions& options, float max_abs_gradient);

}  // namespace dp
