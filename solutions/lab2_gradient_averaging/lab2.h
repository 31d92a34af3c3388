// lab2.h: lab 2, gradient averaging. The contract between your code and the grader: the
// interfaces you implement, the arithmetic that fixes the bits, and the budgets a design
// must meet. How it meets them (the order of issues and waits, where the division happens,
// the layout of a buffer, what the averager keeps) is your design: the grader measures
// what your code achieves, never the steps it takes.
//
// Each rank computes the gradient of the mean loss over its own B/N samples of the global
// batch. Averaging those N gradients makes every replica take the step one process would
// take on all B samples, up to float32 rounding. README.md beside this file poses the
// problem; its Hints section, at the end, helps if you are stuck. Do not change this
// header: the grader is compiled against it.
//
// What every check holds you to:
//   * The arithmetic. The averaged gradient of every trainable element is
//     (g_0 + g_1 + ... + g_{N-1}) / N: the ranks' gradients added as `ReduceOp::kSum` adds
//     them, then divided by N: a division, rounded once, not a multiplication by 1/N. The
//     grader emulates exactly this in one process and compares bitwise after every step,
//     for drawn world sizes, models, batches and steps, with SGD and AdamW. Every replica
//     therefore holds the same bits.
//   * The lesson. The result matches one process trained on the global batch within a
//     float32 tolerance derived from measured reordering error (rubric.json).
//   * Asynchrony done right. Every check runs in the adversarial completion mode
//     (`dp::Completion::kAdversarial`): a call's result reaches your buffer only when its
//     own `Work` is waited on, and a buffer changed while its call is in flight is reported.
//   * The same code on a device. The checks run on the host and on an emulated device,
//     whose memory the host accessors (`.span()`, `.data()`) refuse: work on gradients and
//     buffers through tensor views, `dp/tensor_ops.h` and the communicator. Every buffer
//     you hand the communicator lives where the model lives (`model.device()`): the
//     checks that count calls read the device of each call's buffers.
//
// The budgets below use: N ranks; P_t trainable parameters (frozen ones excluded) of n_1 ...
// n_{P_t} elements, T = n_1 + ... + n_{P_t} in all; ring(b) = 2 (N-1)/N b, the bytes a ring
// all-reduce of b bytes sends from each rank (as the communicator counts it; 0 when N = 1).
// Calls and bytes are read from the communicator's own counters, memory from the rank's
// `MemoryTracker` category by category, heap blocks from a count of operator new (and the
// malloc family) on the calling thread. Lab code can change none of them. A budget says
// which of them it counts: "no tensor" is the `MemoryTracker`, "heap" is operator new.
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
#include <memory>
#include <span>

#include "dp/clock.h"
#include "dp/comm.h"
#include "dp/data.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/tensor.h"

namespace dp::lab2 {

/// Replaces every trainable gradient of `model` by its average over all ranks (the
/// arithmetic above), in place in `Parameter::grad`: the baseline the flat buffer is
/// measured against.
///
/// Budget of one call, on every rank: P_t all-reduces, one per trainable parameter, of
/// ring(4 n_i) bytes each, and no other call; frozen parameters are not sent and keep their
/// gradients; no tensor made, every category of the `MemoryTracker` as it was. The heap is
/// not counted here: holding the `Work` of every call in flight (a std::vector of them)
/// is fine.
void average_gradients(Model& model, Communicator& comm);

/// Averages every trainable gradient with a single collective call per step, through
/// memory made once, at construction: many small all-reduces each pay the network's
/// latency, one pays it once. Freeze parameters before constructing it: an averager is
/// for the parameters that were trainable when it was made. The checks never change which
/// parameters are frozen afterwards; what `average` does if they do is yours to choose
/// (throwing `dp::Error` that says to make a new averager is the friendliest).
///
/// Budgets, on every rank:
///   * Memory: the constructor leaves exactly 4 T bytes of communication memory
///     (`MemoryCategory::kCommunication`) on `model.device()` and nothing in any other
///     category, and takes at most 512 P + 2048 bytes from the heap (operator new and the
///     malloc family), P = `model.parameters().size()` (frozen ones included): room for
///     bookkeeping, not for a buffer (T floats on the heap exceed it on every graded
///     model). `average` leaves every category as it found it and allocates nothing: no
///     tensor, and no heap block beyond what one communicator call and its wait take.
///   * Communication per `average`: one call, an all-reduce of ring(4 T) bytes (every
///     trainable element once, nothing of frozen parameters) of memory on
///     `model.device()`, and nothing else.
class FlatGradientAverager {
 public:
  /// Prepares the averaging of `model`'s trainable gradients (within the memory budget).
  explicit FlatGradientAverager(const Model& model);
  /// Releases what the constructor made.
  ~FlatGradientAverager();
  FlatGradientAverager(const FlatGradientAverager&) = delete;
  FlatGradientAverager& operator=(const FlatGradientAverager&) = delete;

  /// Replaces every trainable gradient of `model` (the model it was made for) by its
  /// average over all ranks (the arithmetic above), within the budgets.
  void average(Model& model, Communicator& comm);

 private:
  struct State;  // yours: defined in average.cpp
  std::unique_ptr<State> state_;
};

/// One optimizer step with gradient accumulation over k = `micro_batches.size()`
/// micro-batches (this rank's share of the global batch, cut in k equal parts), as
/// PyTorch's `no_sync()` does it.
///
/// The arithmetic (checked bitwise, for drawn k from 1 to 6): `optimizer` steps exactly
/// once, from gradients that are bitwise what `average_gradients` makes of each rank's
/// G_r, where G_r is what `Model::backward` accumulates from zeroed gradients over the k
/// micro-batches in order, each with `loss_scale` = 1.0f / k. Zeroing them is this
/// function's job: the caller does not, so the previous step's averaged gradients are
/// still in `Parameter::grad` when it is called. Returns the mean of the k losses
/// `Model::backward` returned (within 1e-6, relative). Throws `dp::Error` when there are
/// no micro-batches.
///
/// Budgets of one call, on every rank, whatever k:
///   * Communication: what one `average_gradients` sends (P_t all-reduces of ring(4 n_i)
///     bytes each, of memory on `model.device()`) and no other call.
///   * Activations, the point of accumulating: the peak of the rank's activation memory
///     (`MemoryCategory::kActivations`) during the call, above what it held when called,
///     is at most what one forward and backward of one micro-batch (its input copied to
///     `model.device()`) takes on a fresh model of the same architecture, measured by the
///     check, + 256 bytes. The micro-batches go through the model one at a time.
float accumulation_step(Model& model, Optimizer& optimizer, std::span<const Batch> micro_batches,
                        Communicator& comm);

/// Design question 1, graded against the simulated clock: the seconds of communication
/// that one all-reduce over all trainable gradients saves per step against one all-reduce
/// per gradient, for trainable gradients of `parameter_bytes` bytes each (one entry per
/// parameter) on `world_size` ranks over a network whose every link is `link` (latency
/// `alpha_seconds`, bandwidth `bytes_per_second` per direction).
///
/// Derive it from the cost model of the simulated network (dp/clock.h). The grader draws
/// world sizes, gradient sizes and networks, times both with native all-reduces on the
/// simulated clock, and expects your prediction within 1e-6 relative (or 1e-12 s); it
/// also asks about networks of up to 65536 ranks, too large to simulate, and compares with
/// the cost model itself.
double predicted_flat_saving_seconds(std::span<const std::size_t> parameter_bytes, int world_size,
                                     const LinkModel& link);

/// Design question 2, graded against the simulated clock: the total size S, in bytes, of
/// `parameters` trainable gradients above which the flat buffer's copies cost more than
/// the latency it saves, on `world_size` ranks over a network whose every link is `link`,
/// with devices that compute as `device` (dp/clock.h). The two ways compared, each timed
/// on every rank from the same instant until every result is in the gradients:
///   one call per gradient   the gradients all-reduced (`ReduceOp::kSum`) in place, one
///                           call each, all issued, then all waited on;
///   flat                    each gradient copied into one buffer of S bytes (one
///                           `dp::copy` per gradient), one all-reduce of the buffer, waited
///                           on, then each gradient copied back (one `dp::copy` each).
/// Neither divides. A `dp::copy` of n floats is one op of n flops and 8 n bytes (it reads
/// and writes each float), timed by `DeviceModel::time_of`. Returns 0 when the flat buffer
/// is faster at no size at all.
///
/// The grader draws world sizes, numbers of gradients, fabrics (the presets and others) and
/// devices, times both ways on the simulated clock at several sizes, finds where the flat
/// buffer's time crosses the other's, and expects your size within 1e-6 relative (or 1
/// byte).
double flat_buffer_break_even_bytes(std::size_t parameters, int world_size, const LinkModel& link,
                                    const DeviceModel& device);

}  // namespace dp::lab2
