// checkpoint_check.h: the sharded-checkpoint check that labs 5, 6 and 7 share.
//
// Each of the three ZeRO optimizers saves its sharded state with `save_checkpoint` and
// loads it at any world size with `load_checkpoint`. The check, the same in every lab but
// for the lab's layout (the segments its shard is cut from) and for what the model holds
// after a load:
//
//   1. trains k steps on 4 ranks and saves into a fresh directory;
//   2. reads the checkpoint itself: the index's layouts must be the contract's
//      (`chunked_layouts` over the lab's segments, so a lost padding offset is named by its
//      first wrong range), its step k, and the consolidated parameters and optimizer state
//      bitwise the emulation's after k steps (lab 2's arithmetic, one optimizer over the
//      whole flat space: the update is element-wise, so sharding does not change a bit);
//   3. loads it with fresh optimizers on 2, 3 and 4 ranks and trains the remaining steps:
//      every rank's shard (and the model, where the contract keeps it whole) bitwise the
//      emulation that ran k steps on 4 ranks and the rest on M;
//      Lab 6 also loads on 4 ranks with another bucket cap (other buckets, another layout
//      at the same world size);
//   4. misuse: a checkpoint of another model's shapes (one with an extent one larger, one
//      with a weight's extents swapped: the same element count), and one without the
//      optimizer's state, must make `load_checkpoint` throw `dp::Error` whose message names
//      the parameter (or state tensor) that differs, and must change nothing: after each
//      throw the rank's parameter shard, every inner-optimizer state tensor, the step count
//      and (labs 5 and 6) every parameter's value are bitwise what they were before the call.
//
// Under mpi with 4 processes the save runs on the job's ranks (rank 0 makes the directory
// and broadcasts its name); the loads run as local threads in every process. Any other mpi
// job runs the save as local threads too: the check never skips.
//
// Example (lab 5's check):
//
//   grading::CheckpointLab lab;
//   lab.segments = [](const Model& model, int) { return {all parameter indices}; };
//   lab.make = [](Model& m, Communicator& c, const TrainOptions& o) {
//     return std::make_unique<grading::ZeroCheckpointSubject<ZeroOneOptimizer>>(
//         m, c, factory_for(o));
//   };
//   grading::check_sharded_checkpoint(draws, training, lab);
#pragma once

#include <cstddef>
#include <filesystem>
#include <functional>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "dp/comm.h"
#include "dp/data.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/tensor.h"
#include "dp/trainer.h"
#include "grading.h"
#include "sharded.h"

namespace dp::grading {

/// One rank's ZeRO optimizer as the checkpoint check drives it: each lab wraps its own.
class CheckpointSubject {
 public:
  virtual ~CheckpointSubject() = default;
  /// One training step on this rank's `batch`: forward, backward, the optimizer's step.
  virtual void train_step(const Batch& batch) = 0;
  /// The lab's `save_checkpoint(directory)`.
  virtual void save(const std::filesystem::path& directory) = 0;
  /// The lab's `load_checkpoint(directory)`.
  virtual void load(const std::filesystem::path& directory) = 0;
  /// The lab's `shard_parameters()`.
  virtual const Tensor& shard_parameters() = 0;
  /// The lab's `inner()`.
  virtual Optimizer& inner() = 0;
};

/// The CheckpointSubject of a lab's ZeRO optimizer class (ZeroOneOptimizer,
/// ZeroTwoOptimizer, ZeroThreeOptimizer: each has step, save_checkpoint, load_checkpoint,
/// shard_parameters and inner): every call passed on as it is. A lab whose contract adds a
/// rule to a call derives from it and overrides that call.
template <typename ZeroOptimizer>
class ZeroCheckpointSubject : public CheckpointSubject {
 public:
  /// Constructs `ZeroOptimizer(model, arguments...)`, the lab's optimizer over `model`.
  template <typename... Arguments>
  explicit ZeroCheckpointSubject(Model& model, Arguments&&... arguments)
      : model_(model), zero_(model, std::forward<Arguments>(arguments)...) {}
  /// zero_grad, forward, backward and step() on `batch`.
  void train_step(const Batch& batch) override {
    model_.zero_grad();
    model_.backward(forward(model_, batch), batch.labels);
    (void)zero_.step();
  }
  void save(const std::filesystem::path& directory) override { zero_.save_checkpoint(directory); }
  void load(const std::filesystem::path& directory) override { zero_.load_checkpoint(directory); }
  const Tensor& shard_parameters() override { return zero_.shard_parameters(); }
  Optimizer& inner() override { return zero_.inner(); }

 protected:
  /// The model the optimizer works on.
  Model& model() { return model_; }
  /// The lab's optimizer.
  ZeroOptimizer& zero() { return zero_; }

 private:
  Model& model_;
  ZeroOptimizer zero_;
};

/// What the check needs to know of a lab.
struct CheckpointLab {
  /// The contract's segments for `model` (parameter indices, each segment's flat range in
  /// the listed order), the grader's own copy of the lab's rule: lab 5 one segment of every
  /// parameter, lab 6 the buckets, lab 7 the units.
  std::function<std::vector<std::vector<std::size_t>>(const Model& model)> segments;
  /// Builds the student's optimizer over `model` on `comm` for `options`.
  std::function<std::unique_ptr<CheckpointSubject>(Model& model, Communicator& comm,
                                                   const TrainOptions& options)>
      make;
  /// Labs 5 and 6: every `Parameter::value` holds the parameters after a step and after a
  /// load. Lab 7: every value stays released (empty) after them.
  bool values_replicated = true;
  /// How the lab calls its segments in messages ("the buckets", "the units").
  std::string segments_name = "one segment of every parameter";
  /// Lab 6: other segments of the same model (another bucket cap) and the optimizer that
  /// uses them. When set, the check also loads at the saved world size with these: a load
  /// must cut the shard for the optimizer's own layout, never reuse the saved one because
  /// the world size matches. Unset: no such load.
  std::function<std::vector<std::vector<std::size_t>>(const Model& model)> other_segments;
  /// Builds the optimizer over `other_segments` (see there).
  std::function<std::unique_ptr<CheckpointSubject>(Model& model, Communicator& comm,
                                                   const TrainOptions& options)>
      make_other;
  /// How the lab calls `other_segments` in messages ("the buckets of cap 0 bytes").
  std::string other_segments_name;
};

/// A fresh directory of its own under the system's temporary directory, named
/// `<prefix>-XXXXXX` (mkdtemp); throws dp::Error naming it and the system's reason when it
/// cannot be made. The caller removes it.
std::filesystem::path make_temporary_directory(std::string_view prefix);

/// The same, made by rank 0 alone and named to the other ranks (processes under mpi) through
/// `comm`: a collective, which every rank of `comm` calls, each getting the same path.
std::filesystem::path shared_temporary_directory(Communicator& comm, std::string_view prefix);

/// The whole check (see the top of this file), on `training` (AdamW or SGD with momentum: an
/// optimizer with state) drawn by the caller
/// from `draws`: reports through GoogleTest failures, and on a pass what it measured.
void check_sharded_checkpoint(Draws& draws, const ShardedTraining& training,
                              const CheckpointLab& lab);

}  // namespace dp::grading
