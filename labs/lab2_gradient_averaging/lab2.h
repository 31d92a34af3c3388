// lab2.h: lab 2, gradient averaging. The contract between your code and the grader: the
// interfaces you implement, the invariants they must keep, and how each is checked.
//
// Each rank computes the gradient of the mean loss over its own B/N samples of the global
// batch. Averaging those N gradients makes every replica take the step one process would
// take on all B samples, up to float32 rounding. README.md beside this file poses the
// problem; its Hints section, at the end, helps if you are stuck. Do not change this
// header: the grader is compiled against it.
//
// What every check holds you to:
//   * Exact arithmetic. The averaged gradient of every trainable element is
//     (g_0 + g_1 + ... + g_{N-1}) / N: the ranks' gradients added as `ReduceOp::kSum` adds
//     them (in rank order), then divided by N: a division, rounded once, not a
//     multiplication by 1/N. The grader emulates exactly this in one process and compares
//     bitwise after every step, for drawn world sizes, models, batches and steps, with SGD
//     and AdamW. Every replica therefore holds the same bits.
//   * The lesson. The result matches one process trained on the global batch within a
//     float32 tolerance derived from measured reordering error (rubric.json).
//   * Asynchrony done right. Every check runs in the adversarial completion mode
//     (`dp::Completion::kAdversarial`): a call's result reaches your buffer only when its
//     own `Work` is waited on.
//   * Arithmetic with the runtime's operations (a rule, not graded here). Work on
//     gradients and buffers through tensor views and dp/tensor_ops.h (copy, divide, ...),
//     not loops over raw memory: the simulated clock then sees the work's cost, and the same
//     code will run on a GPU, where a loop over a device tensor's memory cannot.
//
// Example (one data-parallel step):
//
//   model.zero_grad();
//   dp::Tensor logits = model.forward(batch.inputs);   // (B/N, classes)
//   model.backward(logits, batch.labels);               // local mean-loss gradients
//   dp::lab2::average_gradients(model, comm);            // now the global batch's gradients
//   optimizer.step(model);                               // the same step on every rank
#pragma once

#include <cstddef>
#include <span>

#include "dp/clock.h"
#include "dp/comm.h"
#include "dp/data.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/tensor.h"

namespace dp::lab2 {

/// Replaces every trainable gradient of `model` by its average over all ranks (the exact
/// arithmetic above), with one all-reduce per trainable parameter.
///
/// Also checked: frozen parameters are not communicated and keep their gradients; exactly
/// one all-reduce per trainable parameter per call, of that parameter's elements (the
/// communicator's own counters, which lab code cannot change).
void average_gradients(Model& model, Communicator& comm);

/// Averages every trainable gradient with a single all-reduce over one flat buffer.
///
/// Many small all-reduces each pay the network's latency; one large one pays it once.
class FlatGradientAverager {
 public:
  /// Allocates the flat buffer for `model`'s trainable parameters (frozen ones excluded):
  /// one element per trainable element, charged as communication memory
  /// (`MemoryCategory::kCommunication`). Checked category by category on the rank's
  /// `MemoryTracker`: the constructor adds 4 bytes per trainable element of communication
  /// memory and nothing in any other category.
  explicit FlatGradientAverager(const Model& model);

  /// Replaces every trainable gradient by its average over all ranks (the exact arithmetic
  /// above), through the buffer: afterwards `buffer()` holds the averaged trainable
  /// gradients, one after another in definition order. Checked besides: exactly one
  /// collective call per call, an all-reduce of every trainable element and nothing else;
  /// and no allocation at all once constructed: no tensor (the rank's `MemoryTracker`) and
  /// no heap memory (a count of operator new on the calling thread), whatever the step.
  void average(Model& model, Communicator& comm);

  /// The flat buffer: (number of trainable parameter elements).
  const Tensor& buffer() const { return buffer_; }

 private:
  Tensor buffer_;
};

/// One optimizer step with gradient accumulation over k = `micro_batches.size()`
/// micro-batches (this rank's share of the global batch, cut in k equal parts), as
/// PyTorch's `no_sync()` does it.
///
/// Checked, for drawn k from 1 to 6: `optimizer` steps exactly once, from gradients that
/// are bitwise what `average_gradients` makes of each rank's G_r, where G_r is what
/// `Model::backward` accumulates from zeroed gradients over the k micro-batches in order,
/// each with `loss_scale` = 1.0f / k; the step communicates exactly what one
/// `average_gradients` does, whatever k; the return value is the mean of the k losses
/// `Model::backward` returned (within 1e-6, relative). Throws `dp::Error` when there are
/// no micro-batches.
float accumulation_step(Model& model, Optimizer& optimizer, std::span<const Batch> micro_batches,
                        Communicator& comm);

/// Design question, graded against the simulated network: the seconds of communication
/// that `FlatGradientAverager` saves per step against `average_gradients`, for trainable
/// gradients of `parameter_bytes` bytes each (one entry per parameter) on `world_size`
/// ranks over a network whose every link is `link` (latency `alpha_seconds`, bandwidth
/// `bytes_per_second` per direction).
///
/// Derive it from the cost model of the simulated network (dp/clock.h: each native
/// collective, in the order issued, occupies every link for its algorithm's time). The
/// grader draws world sizes, parameter sizes and networks, times both ways of averaging
/// with native all-reduces on the simulated clock, and expects your prediction within
/// 1e-6 relative (or 1e-12 s); it also asks about networks of up to 65536 ranks, too
/// large to simulate, and compares with the cost model itself. The simulated networks
/// always include 1 rank, 2 ranks, 5 to 7 ranks and a single parameter, where the near
/// misses (N for N - 1, one round trip or a tree's latency per call, P calls saved for
/// P - 1) give other answers.
double predicted_flat_saving_seconds(std::span<const std::size_t> parameter_bytes, int world_size,
                                     const LinkModel& link);

}  // namespace dp::lab2
