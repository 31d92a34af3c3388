// lab7.h: lab 7, ZeRO-3: the parameters sharded over the data-parallel ranks too, gathered
// unit by unit just before they are used and freed just after. The contract between your
// code and the grader: the interfaces you implement, the invariants they must keep, and
// how each is checked.
//
// Lab 6 sharded the optimizer state and the gradients, but every rank still held the whole
// model (4 Psi bytes of parameters). ZeRO stage 3 (Rajbhandari et al., SC20), PyTorch
// FSDP's FULL_SHARD, keeps only the rank's shard of the parameters too: each layer with
// parameters is a unit whose parameters are all-gathered when its layer needs them and
// freed when it no longer does, and whose gradients are reduce-scattered into the shard of
// the gradient once its backward has made them. Like FSDP2, each unit's chunk is copied out
// of the all-gather's buffer into the parameters' own tensors. How many buffers you keep,
// when each all-gather is issued (and how far ahead), when each call is waited on, are your
// design: this header states the interfaces, the arithmetic that fixes the bits, and the
// budgets of memory, communication and time your design must meet. README.md beside this
// file poses the problem; its Hints section, at the end, helps if you are stuck. Do not
// change this header: the grader is compiled against it.
//
// What every check holds you to:
//   * Exact arithmetic. Every element's averaged gradient is lab 2's:
//     (g_0 + g_1 + ... + g_{N-1}) / N, the sum as `ReduceOp::kSum` adds it (rank order
//     on the local and mpi backends; NCCL at 3 or more ranks adds in an order that
//     depends on the chunk, see "Which backends promise an order" in docs/reference.md,
//     so grading on nccl takes at most 2 ranks), then a division by N (not a multiplication by
//     1/N). All-gathers copy bits, so every forward computes with exactly lab 2's parameters: the
//     grader compares the loss of every forward and every rank's shard of the parameters bitwise
//     with an emulation of lab 2 after every step.
//   * Asynchrony done right. Every check runs in the adversarial completion mode
//     (`dp::Completion::kAdversarial`): a call's result reaches its buffer only when that
//     call's own `Work` is waited on.
//   * Counters you cannot change: the communicator's `CommCounters`, a recording
//     communicator, layer hooks of the grader's registered before yours, the rank's
//     `MemoryTracker`, its simulated clock and the heap use of the rank's thread.
//   * Arithmetic with the runtime's operations (dp/tensor_ops.h) on `Tensor`s.
//   * No mutable globals: ranks are threads of one process.
//
// Example (one data-parallel step):
//
//   dp::lab7::ZeroThreeOptimizer zero(model, comm, [](std::size_t shard) {
//     return std::make_unique<dp::AdamW>(shard, dp::AdamWOptions{.lr = 1e-3f});
//   }, /*max_norm=*/1.0f);                           // the model's values are released now
//   dp::Tensor logits = model.forward(batch.inputs);  // units gathered and freed in turn
//   model.backward(logits, batch.labels);             // again, and reduce-scattered
//   std::optional<float> norm = zero.step();          // updates this rank's shard only
#pragma once

#include <cstddef>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "dp/comm.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/tensor.h"

namespace dp::lab7 {

/// One unit: the parameters of one layer, gathered, freed and reduce-scattered together.
struct Unit {
  /// The layer's index in `Model::layers()`.
  std::size_t layer = 0;
  /// Indices into `Model::parameters()` of the layer's parameters, in definition order
  /// (weight, then bias).
  std::vector<std::size_t> parameters;
  /// E: the sum of the parameters' sizes. The unit's flat range is its parameters one after
  /// another in definition order (each in its own element order), then N C - E zero
  /// padding elements.
  std::size_t elements = 0;
  /// C = ceil(E / N): every rank's chunk of the unit, padding included. Rank r owns
  /// elements [r C, (r + 1) C) of the unit's flat range.
  std::size_t chunk_elements = 0;
  /// Where this unit's chunk starts in every rank's shard: the sum of the chunks of the
  /// units before it.
  std::size_t shard_offset = 0;

  /// Two units are equal when every field is.
  bool operator==(const Unit&) const = default;
};

/// The unit rule: every layer of `model` with parameters is one unit, in layer order
/// (u = 0 .. U-1), holding its parameters in definition order; then each unit gets its
/// chunk and its shard offset for `world_size` ranks, as `Unit` describes. Reads only the
/// parameters' sizes, so call it before the values are released.
///
/// Throws `dp::Error` when `world_size < 1` or a parameter is frozen. Checked for drawn
/// models and world sizes up to 16, chunks of padding only included, against the
/// grader's copy of the rule.
std::vector<Unit> plan_units(const Model& model, int world_size);

/// S: the elements of every rank's shard, the sum of the units' chunks.
std::size_t shard_elements(const std::vector<Unit>& units);

/// Builds the inner optimizer of one rank over its shard: called once, by the constructor
/// of `ZeroThreeOptimizer`, with S; the optimizer keeps state for S elements on the
/// model's device.
using OptimizerFactory = std::function<std::unique_ptr<Optimizer>(std::size_t shard_elements)>;

/// ZeRO stage 3: parameters, gradients and optimizer state sharded; parameters gathered
/// unit by unit with prefetch, gradients reduce-scattered unit by unit during backward.
///
/// The constructor plans the units (`plan_units(model, comm.size())`), makes the inner
/// optimizer with `make_inner(S)` (once), allocates every buffer the steps need, copies
/// this rank's shard of the (identical) initial parameters, then releases every
/// `Parameter::value` and every `Parameter::grad` (empty tensors: only the shard of the
/// parameters stays), and registers its layer hooks on `model`. The object must outlive
/// every forward and backward of `model`; `model` and `comm` must outlive it.
///
/// A step is one `Model::forward` and one `Model::backward` on the rank's local batch, then
/// one `step()`. A forward alone (evaluation) is allowed too, also between steps: "between
/// steps" means after the constructor or a `step()` and before the next training forward
/// (whatever such a forward leaves in flight must not reach the next step's units; checked
/// with an evaluation forward before every step). A forward between a backward and its
/// `step()` is outside the contract. A second backward before `step()` throws `dp::Error`
/// from your hook (its gradients would otherwise overwrite the first's in the shard, and
/// half a step would be lost silently).
///
/// What a step must do, in whatever order and with whatever buffers you design:
///   * Before a unit's layer runs its forward or its backward, every parameter of the unit
///     holds its value (allocated under `kParameters`, its shape as at construction),
///     copied from the unit's all-gather: `allgather(shard_parameters() [shard_offset, +C)
///     -> N C elements)`, the unit's flat range with its padding. Values exist only where a
///     layer needs them (the memory budget below counts them).
///   * Once a unit's layer has made its gradients in backward, they go to their places in a
///     buffer of N C elements, its padding [E, N C) zero, which is reduce-scattered
///     (`reduce_scatter(buffer [N C elements], ReduceOp::kSum)`) into elements
///     [shard_offset, shard_offset + C) of `shard_gradients()`; each `Parameter::grad` is
///     released once copied.
///   * A call's buffers are neither written (inputs) nor read or written (outputs) by you
///     while the call is in flight: wait for it first (the adversarial completion mode
///     reports such a buffer at the call's wait, naming the call).
///
/// `step()` then waits for the reduce-scatters still running, divides the shard of the
/// gradient by N, clips it (when `max_norm > 0`) and updates the shard of the parameters
/// with the inner optimizer. The parameters stay sharded until the next forward gathers
/// them.
///
/// Budgets, per step (one forward, one backward, one `step()`) and rank, each checked;
/// U is the number of units, S the shard's elements, E_(1) and E_(2) the elements of the
/// two largest units (E_(2) = 0 when U = 1), P = max_u N C_u the largest unit padded:
///   * Communication: each unit all-gathered at most twice (2 U all-gathers at most: once
///     for its forward, once for its backward, fewer if you keep a unit's values), each
///     unit's gradients reduce-scattered exactly once, and with clipping one
///     `allreduce` (kSum) of one float in `step()`; nothing else. The backend's bytes sent
///     are then at most those of two all-gathers and one reduce-scatter per unit: 1.5 times
///     DDP's volume (each half of an all-reduce), plus the padding. The bytes are checked
///     in every check that trains, not only where the calls are.
///   * Memory, from the `MemoryTracker` (bytes, float32):
///       - `kParameters`: the shard of the parameters, 4 S, at all times, plus the values
///         allocated at that moment, and nothing else: at the peak at most the shard and two
///         units' values, 4 S + 4 (E_(1) + E_(2)).
///       - `kGradients`: the shard of the gradient, 4 S, at all times, plus the gradients
///         backward made that you have not released yet: at most 4 S + 4 (E_(1) + E_(2)).
///       - `kCommunication`: your buffers (allocated in the constructor) and, with clipping,
///         one float for the norm. With the parameters, peak(`kParameters`) +
///         peak(`kCommunication`) <= 4 S + 4 x 4 P (+ 4 with clipping): the shard plus two
///         units and their buffers, each unit a gathered copy (a buffer or its values) and a
///         gradient buffer, each counted as the largest padded unit. On an MLP of many equal
///         hidden layers on 4 and 8 ranks (rubric.json gives the widths) that budget is well
///         below lab 6's replicated parameters, 4 Psi, and there your peak must be below
///         4 Psi too: a design that keeps every unit gathered (in values or in buffers) fails.
///       - `kOptimizerState`: the inner optimizer's, for S elements (AdamW 8 S), at its peak
///         too. `kOther`: nothing; `kActivations`: only what the model's forward and backward
///         make.
///       - After the constructor no tensor is allocated but the values you materialise (at
///         most two per parameter and step: one per all-gather) and the gradients backward
///         makes; `step()` allocates none. Every buffer is a `Tensor`: the constructor, your
///         hooks and `step()` take no block of 1 KiB or more from the heap, and in all no
///         more than bookkeeping needs:
///           . the constructor: 640 bytes per parameter + 2 KiB;
///           . the hooks, per step: what a plain forward and backward take, + per call what
///             one call and its wait take + 256 bytes, + 128 bytes per tensor beyond those
///             of the plain pass, + 2 KiB;
///           . `step()`: per call what one call and its wait take + 256 bytes, + 2 KiB.
///         Between steps every category holds what it held after the constructor.
///       - Under a memory budget of 19 Psi bytes per rank (`MemoryTracker::set_budget`), in
///         which replicated training (16 Psi of parameters, gradients and AdamW state plus
///         lab 2's 4 Psi flat buffer) throws `dp::OutOfMemory`, your ZeRO-3 trains an MLP of
///         eight equal hidden layers with AdamW, bitwise lab 2's.
///   * Time, on the simulated clock (8 and 4 ranks on ib-ndr, a CPU-class device, an MLP of
///     eight equal hidden layers whose per-layer compute is comparable to its all-gather),
///     in each of two steps:
///       - the waits on all-gathers block for at most half of the all-gathers' time on the
///         link, and at least half of that time overlaps the model's own forward and
///         backward;
///       - the waits on reduce-scatters block for at most half of their time on the link;
///       - compute your code adds hides nothing, so it is bounded:
///         added = step time - the model's own forward and backward - the time the waits
///         on all-gathers and reduce-scatters blocked, and added <= 1.5 x floor, where
///         floor is what the copies and the update a ZeRO-3 step must make take on the same
///         simulated device, measured by the grader: each parameter copied twice out of an
///         all-gather buffer and once into a gradient buffer (one copy op each), one divide
///         of the shard and the inner optimizer's update over the shard.
///
/// Reshard after forward (`reshard_after_forward`, PyTorch FSDP's option of that name): with
/// `true`, the default, every unit is freed after its forward and gathered again for its
/// backward, as above. With `false`, each unit stays gathered (its values, or a buffer
/// holding its all-gather: your design) from its forward until its backward has used it,
/// and backward issues no all-gather; everything else (the bits, the reduce-scatters, the
/// waits, `step()`, the checkpoints) is as above. A forward that no backward follows may
/// keep its units until the next forward, which gathers them again. Budgets per step (one
/// forward, one backward, one `step()`) and rank with `false`:
///   * Time, as above on 8 ranks (the CPU-class device, two steps): the waits on
///     all-gathers block for at most half of their time on the link, and at least half of
///     that time overlaps the model's own forward and backward (every all-gather is issued
///     in forward: a prefetch in forward hides them).
///   * Communication: exactly one all-gather per unit (U in all, every one of them before
///     backward starts), each unit's gradients reduce-scattered exactly once, the norm's
///     float with clipping; the bytes sent at most those of one all-gather and one
///     reduce-scatter per unit.
///   * Memory: `kParameters` at most 4 S + 4 Psi (every unit's values at once, no more), the
///     gradients as above, and peak(`kParameters`) + peak(`kCommunication`) <= 4 S +
///     4 sum_u N C_u + 4 x 4 P (+ 4 with clipping): the default's budget plus every unit
///     kept gathered, each counted padded. Between steps every category holds what it held
///     after the constructor, as above.
/// Memory against time: keeping the units saves the backward's all-gathers (U of the 2 U)
/// and costs memory; what it costs your design is the design question
/// `predicted_keep_gathered_extra_bytes` below, and README.md asks when it saves time.
class ZeroThreeOptimizer {
 public:
  /// Sets up ZeRO-3 for `model` on `comm`; `max_norm > 0` turns clipping by global norm on.
  ///
  /// Throws `dp::Error` when a parameter of `model` is frozen or already released, when
  /// `max_norm` is negative or not finite, when `make_inner` is empty, returns nullptr,
  /// or returns an optimizer whose `state_size()` is not S or whose state lives on another
  /// device than the model's (`Optimizer::device()`, `Model::device()`; the message names
  /// both devices).
  ///
  /// `reshard_after_forward`: `false` keeps each unit gathered from its forward to its
  /// backward (no all-gather in backward; the class comment gives its budgets).
  ZeroThreeOptimizer(Model& model, Communicator& comm, OptimizerFactory make_inner,
                     float max_norm = 0.0f, bool reshard_after_forward = true);
  /// Waits for any call still running (a `Work` must not outlive its buffer).
  ~ZeroThreeOptimizer();
  ZeroThreeOptimizer(const ZeroThreeOptimizer&) = delete;
  ZeroThreeOptimizer& operator=(const ZeroThreeOptimizer&) = delete;

  /// One optimizer step after one forward and backward; on return this rank's shard of
  /// the parameters is updated, every `Parameter::value` and `Parameter::grad` is released
  /// and every call it made is complete. Calls `begin_step()` of the inner optimizer once,
  /// and `update` once over the whole shard (also on a rank whose chunks are all padding).
  ///
  /// Clipping, when on, has lab 6's exact arithmetic (so the grader compares bitwise):
  /// rank r computes p_r = (float) dp::dot(g, g) over its whole averaged shard g (S
  /// elements; the padding is zero and adds nothing); an all-reduce (`kSum`, rank order)
  /// gives s = p_0 + ... + p_{N-1} in float; the norm is std::sqrt(s) in float; when
  /// c = max_norm / (norm + 1e-6f) is below 1, the shard is scaled by c (`dp::scale`)
  /// before the update.
  ///
  /// Returns the global norm before clipping when clipping is on (the same on every rank),
  /// std::nullopt when it is off. Throws `dp::Error`, naming the unit ("unit 0", or its
  /// layer's name), when a unit's reduce-scatter was not launched since the last step (no
  /// backward, or one that did not reach it).
  std::optional<float> step();

  /// The units, as `plan_units` made them.
  const std::vector<Unit>& units() const;
  /// This rank's shard of the averaged gradient after `step()`: (S), chunk by chunk in
  /// unit order, its padding zero (after clipping, as the update used it).
  const Tensor& shard_gradients() const;
  /// This rank's shard of the parameters: (S), laid out as `shard_gradients()`, its padding
  /// zero. The inner optimizer updates it in place; it is the only copy of this rank's
  /// chunks.
  const Tensor& shard_parameters() const;
  /// The optimizer `make_inner` made.
  Optimizer& inner();

  /// Saves a sharded checkpoint into `directory` (which must exist; dp/sharded_checkpoint.h
  /// describes the files). Collective: every rank calls it, between steps. Each rank writes
  /// its own shard with `dp::save_checkpoint_shard`, without gathering anything (no rank
  /// ever holds the whole model): tensor "params" is `shard_parameters()`, and every state
  /// tensor of the inner optimizer (`Optimizer::state()`) is saved under its own name;
  /// metadata "step" is the inner optimizer's `step_count()` in decimal ("3"). The layout is
  /// `dp::chunked_layouts` with one segment per unit (its parameters in definition order):
  /// each unit's chunk, its padding included, at its shard offset. The parameters' names and
  /// shapes are those at construction (the values are released). Returns when the
  /// checkpoint is complete on every rank (a barrier on the communicator). Checked: no
  /// all-gather, no communication bytes beyond those held before the call, and no parameter
  /// bytes beyond those and one copy of the shard (the runtime may stage it through the
  /// host); the same for `load_checkpoint`. `const`: it changes nothing of the training
  /// state; the barrier is a collective on the communicator the optimizer refers to, not
  /// part of its state.
  ///
  /// Checked: the grader reads the index and the consolidated checkpoint itself (the
  /// layouts must be the contract's, the values and state bitwise the emulation's).
  /// Throws `dp::Error` when a file cannot be written.
  void save_checkpoint(const std::filesystem::path& directory) const;

  /// Loads a checkpoint saved by `save_checkpoint` on any world size. Collective, between
  /// steps. Fills this rank's shard of the parameters and of every inner optimizer state
  /// tensor for the current world size (`dp::load_checkpoint_shard`: copied by parameter
  /// name and offset, padding zero) and sets the inner optimizer's step count to the
  /// checkpoint's "step". Nothing is gathered: every `Parameter::value` stays released, and
  /// the next forward gathers the loaded shards. Reads only the saved shards that hold this
  /// rank's elements, into the tensors this rank already holds: no tensor of the whole
  /// model is ever allocated.
  ///
  /// Throws `dp::Error` when the checkpoint's parameters (names and shapes, in order: a
  /// shape with the same element count but other extents differs too) are not this
  /// model's, when its tensors are not "params" and the inner optimizer's state names
  /// (compared as a set: the order they were saved in is free), or when its metadata
  /// "step" is not a step count in decimal. The message names what differs: the first
  /// differing parameter, with the shape expected and the shape seen, the tensors
  /// expected and seen, or the "step" seen. A bad checkpoint throws before anything
  /// changes: this rank's shards, the inner optimizer's state and step count are then as
  /// they were (check everything, "step" included, before writing anything). Checked: a
  /// checkpoint saved on 4 ranks, loaded on 2, 3 and 4, must continue the training bitwise;
  /// each bad checkpoint (other shapes, no optimizer state, a "step" that is not a count)
  /// must throw, name what differs, and change nothing.
  void load_checkpoint(const std::filesystem::path& directory);

 private:
  struct State;  // yours: defined in zero3.cpp
  std::unique_ptr<State> state_;
};

/// Design question, graded against the `MemoryTracker`: the parameter memory of one rank
/// at its peak, peak(`kParameters`) + peak(`kCommunication`) over one forward, one backward
/// and one `step()` of your `ZeroThreeOptimizer` (clipping off), both measured from just
/// after its constructor and counting the shard, for `model` (read, not changed) on
/// `world_size` ranks. Count the shard, the values of the units you materialise, and your
/// buffers; compare it with lab 6, which holds the whole model (4 Psi) on every rank
/// (README.md derives both).
///
/// The grader draws models and world sizes (rubric.json lists the ranges), runs one
/// forward, backward and step on each rank, and expects your prediction exactly. On every
/// seed one model's units pad on some drawn N, and one model is a single unit.
std::size_t predicted_parameter_peak_bytes(const Model& model, int world_size);

/// Design question, the reshard-after-forward trade-off, graded against the
/// `MemoryTracker`: how many more bytes peak(`kParameters`) + peak(`kCommunication`) holds
/// (measured as for `predicted_parameter_peak_bytes`: one forward, one backward and one
/// `step()`, clipping off) when your `ZeroThreeOptimizer` keeps the units gathered
/// (`reshard_after_forward = false`) than when it reshards (`true`), for `model` (read, not
/// changed) on `world_size` ranks. Where in the step does each mode reach its peak?
///
/// The grader draws the models and world sizes (rubric.json lists the ranges), measures
/// both modes on each rank and expects your prediction exactly. On every seed some drawn
/// model's units pad on some drawn N, and one model is a single unit.
std::size_t predicted_keep_gathered_extra_bytes(const Model& model, int world_size);

}  // namespace dp::lab7
