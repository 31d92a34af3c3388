// step_allocations.h: what one training step of a sharded optimizer allocates on its rank,
// measured beside a plain twin of the model (no optimizer, no hooks) on the same batch, and
// the optimizer state it keeps. Labs 6 and 7 demand that their hooks and step() add no
// tensors and no heap copies beyond what the twin's own forward and backward take; each lab
// judges the measurements with its own budget and words.
//
// Example (one rank, inside a lab's allocation check):
//
//   Model twin = training.model();
//   ZeroTwoOptimizer zero(model, comm, factory, cap);
//   const grading::StepAllocations a = grading::measure_step_allocations(
//       model, twin, batch, comm, [&] { (void)zero.step(); });
//   if (a.step_tensors != 0) verdict.fail("step() allocated a tensor");
//   const std::string state = grading::state_bytes_finding(
//       {.label = "adamw", .world = world, .shard = shard, .floats_per_element = 2,
//        .base = base, .num_parameters = model.num_parameters()});
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dp/comm.h"
#include "dp/data.h"
#include "dp/memory.h"
#include "dp/model.h"
#include "dp/trainer.h"
#include "heap_use.h"

namespace dp::grading {

/// One optimizer set-up of the allocation checks (see state_set_ups).
struct StateSetUp {
  std::string kind;                    ///< TrainOptions::optimizer: "adamw" or "sgd"
  std::size_t floats_per_element = 1;  ///< its state floats per element (AdamW 2, momentum 1)
  float max_norm = 0;                  ///< clipping when above 0

  /// The set-up in messages: "adamw", "sgd with clipping".
  std::string label() const { return kind + (max_norm > 0 ? " with clipping" : ""); }
  /// `options` with this optimizer (SGD with momentum 0.9, state under another name).
  TrainOptions applied_to(TrainOptions options) const {
    options.optimizer = kind;
    if (kind == "sgd") options.momentum = 0.9f;
    return options;
  }
};

/// AdamW and SGD with momentum, each without and with clipping (max_norm 1): the state must
/// be the shard's in every one, and the norm's buffer must not be allocated per step either.
inline std::vector<StateSetUp> state_set_ups() {
  return {{"adamw", 2, 0.0f}, {"sgd", 1, 0.0f}, {"adamw", 2, 1.0f}, {"sgd", 1, 1.0f}};
}

/// What `measure_step_allocations` saw: tensors counted by the rank's MemoryTracker, heap
/// use of the calling thread (heap_use.h), and communicator calls.
struct StepAllocations {
  /// Tensors allocated per category from just before the twin's forward to just after
  /// step(): the twin's forward and backward, the model's, and the step's.
  std::array<std::size_t, kNumMemoryCategories> tensors_made{};
  std::size_t plain_activation_tensors = 0;   ///< activation tensors of the twin's passes
  std::size_t hooked_activation_tensors = 0;  ///< the model's passes and step()'s
  std::size_t twin_gradient_tensors = 0;      ///< gradient tensors the twin's passes made
  std::size_t plain_tensors = 0;              ///< every tensor of the twin's passes
  std::size_t hooked_tensors = 0;             ///< every tensor of the model's passes
  std::size_t step_tensors = 0;               ///< every tensor step() allocated
  HeapUse plain_heap;                         ///< the twin's forward and backward
  HeapUse hooked_heap;                        ///< the model's forward and backward (hooks on)
  HeapUse step_heap;                          ///< step()
  std::uint64_t hook_calls = 0;               ///< communicator calls of the model's passes
  std::uint64_t step_calls = 0;               ///< communicator calls of step()

  /// The tensors made under `category` (see tensors_made).
  std::size_t made(MemoryCategory category) const {
    return tensors_made[static_cast<std::size_t>(category)];
  }
};

/// Runs `twin` (zero_grad, forward, backward) and then `model` (forward, backward: its
/// optimizer's hooks run) on `batch`, then `step` (the lab's step()), and measures each part
/// on this rank's tracker, this thread's heap and `comm`'s counters. The caller zeroes
/// `model`'s gradients first where its lab asks for it. The snapshot of the counters that
/// step()'s calls are counted from is taken inside step()'s heap window (a few bytes of
/// small blocks, never a large one).
StepAllocations measure_step_allocations(Model& model, Model& twin, const Batch& batch,
                                         Communicator& comm, const std::function<void()>& step);

/// What one all-gather of one float per rank and its wait take from this thread's heap (the
/// Work, the backend's bookkeeping): a lab's hooks may take that much per call they make.
HeapUse heap_of_one_collective_call(Communicator& comm);

/// The optimizer state a rank holds after steps of a sharded optimizer (see
/// state_bytes_finding).
struct HeldState {
  std::string label;                   ///< the set-up in messages ("adamw with clipping")
  int world = 1;                       ///< N
  std::size_t shard = 0;               ///< S, the contract's shard in elements
  std::size_t floats_per_element = 1;  ///< state floats per element (AdamW 2, momentum 1)
  std::size_t base = 0;  ///< optimizer-state bytes of the rank before the optimizer existed
  std::size_t num_parameters = 0;  ///< Psi, to name an optimizer over the whole model
};

/// "" when this rank's optimizer-state bytes, now and at their peak since the last
/// reset_peaks, are exactly floats_per_element x 4 x S above `base`; else the sentence a
/// check fails with.
std::string state_bytes_finding(const HeldState& held);

}  // namespace dp::grading
