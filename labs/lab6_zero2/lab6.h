// lab6.h: lab 6, ZeRO-2: the gradients sharded over the data-parallel ranks too, reduced
// bucket by bucket during backward. The contract between your code and the grader: the
// interfaces you implement, the invariants they must keep, and how each is checked.
//
// Lab 5 sharded the optimizer state, but every rank still held the whole gradient (4 Psi
// bytes) until the reduce-scatter, plus a flat copy of it. ZeRO stage 2 (Rajbhandari et al.,
// SC20) keeps only the rank's shard of the averaged gradient: as backward makes a bucket's
// gradients final (lab 4's buckets), they are copied into a communication buffer and
// released at once, and the bucket is reduce-scattered while backward computes the rest.
// Each bucket is cut into N equal chunks; rank r owns chunk r of every bucket, and its shard
// is the concatenation of its chunks. How many buffers carry the buckets, how they are laid
// out, when each call is waited on, are your design: this header states the interfaces, the
// bucket rule that fixes the layout, the arithmetic that fixes the bits, and the budgets of
// memory, communication and time your design must meet. README.md beside this file poses
// the problem; its Hints section, at the end, helps if you are stuck. Do not change this
// header: the grader is compiled against it.
//
// What every check holds you to:
//   * Exact arithmetic. Every element's averaged gradient is lab 2's:
//     (g_0 + g_1 + ... + g_{N-1}) / N, the sum as `ReduceOp::kSum` adds it (rank order
//     on the local and mpi backends; NCCL at 3 or more ranks adds in an order that
//     depends on the chunk, see "Which backends promise an order" in docs/reference.md,
//     so grading on nccl takes at most 2 ranks), then a division by N (not a multiplication by
//     1/N). The optimizer's update is element-wise, so the grader compares every rank's parameters
//     bitwise with an emulation of lab 2 after every step. With gradient accumulation over M
//     micro-batches, `ZeroTwoOptimizer` states the order of the sums for each strategy,
//     then one division by N M, and the grader emulates each.
//   * Asynchrony done right. Every check runs in the adversarial completion mode
//     (`dp::Completion::kAdversarial`): a call's result reaches its buffer only when that
//     call's own `Work` is waited on.
//   * Counters you cannot change: the communicator's `CommCounters`, a recording
//     communicator and a gradient-ready hook of the grader's registered before yours, the
//     rank's `MemoryTracker`, its simulated clock and the heap use of the rank's thread.
//   * Arithmetic with the runtime's operations (dp/tensor_ops.h) on `Tensor`s.
//   * No mutable globals: ranks are threads of one process.
//
// Example (one data-parallel step):
//
//   dp::lab6::ZeroTwoOptimizer zero(model, comm, [](std::size_t shard) {
//     return std::make_unique<dp::AdamW>(shard, dp::AdamWOptions{.lr = 1e-3f});
//   }, /*bucket_cap_bytes=*/64 << 10, /*max_norm=*/1.0f);
//   model.backward(model.forward(batch.inputs), batch.labels);  // buckets reduce-scatter
//   std::optional<float> norm = zero.step();                    // every rank: updated model
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "dp/comm.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/tensor.h"

namespace dp::lab6 {

/// One bucket: which gradients travel together in one reduce-scatter, and which part of
/// it each rank owns.
struct Bucket {
  /// Indices into `Model::parameters()`, in the order they fill the bucket: reverse
  /// definition order (the order backward makes them ready).
  std::vector<std::size_t> parameters;
  /// E: the sum of the parameters' sizes. The bucket's flat range is its parameters one
  /// after another (each in its own element order), then N C - E zero padding elements.
  std::size_t elements = 0;
  /// C = ceil(E / N): every rank's chunk of the bucket, padding included. Rank r owns
  /// elements [r C, (r + 1) C) of the bucket's flat range.
  std::size_t chunk_elements = 0;
  /// Where this bucket's chunk starts in every rank's shard: the sum of the chunks of the
  /// buckets before it.
  std::size_t shard_offset = 0;

  /// Two buckets are equal when every field is.
  bool operator==(const Bucket&) const = default;
};

/// The bucket rule, lab 4's with one cap. Walk the parameters in reverse definition order.
/// A parameter joins the open bucket unless the bucket already holds a parameter and
/// adding this one would take it past `bucket_cap_bytes` (bytes = elements x 4); then the
/// open bucket closes and the parameter opens the next one. So a parameter larger than the
/// cap has a bucket to itself, a cap of 0 gives one bucket per parameter, and a cap at
/// least the model's size gives one bucket. Then each bucket gets its chunk and its shard
/// offset for `world_size` ranks, as `Bucket` describes.
///
/// Throws `dp::Error` when `world_size < 1` or a parameter is frozen. Checked for drawn
/// models, caps (0, drawn, above the model's size) and world sizes up to 16, chunks of
/// padding only included, against the grader's copy of the rule.
std::vector<Bucket> plan_buckets(const Model& model, int world_size, std::size_t bucket_cap_bytes);

/// S: the elements of every rank's shard, the sum of the buckets' chunks.
std::size_t shard_elements(const std::vector<Bucket>& buckets);

/// Builds the inner optimizer of one rank over its shard: called once, by the constructor
/// of `ZeroTwoOptimizer`, with S; the optimizer keeps state for S elements on the
/// model's device.
using OptimizerFactory = std::function<std::unique_ptr<Optimizer>(std::size_t shard_elements)>;

/// Where the gradient waits between the micro-batches of one optimizer step (gradient
/// accumulation). Both give every rank the same parameters; they trade gradient memory
/// against bytes on the network (README.md, "Gradient accumulation").
enum class Accumulation {
  /// Every micro-batch's buckets are reduce-scattered during its own backward, and the
  /// results are summed into the shard of the gradient: the gradient memory stays the
  /// shard's, each micro-batch pays its reduce-scatters.
  kReduceEveryMicroBatch,
  /// The whole local gradient stays in `Parameter::grad`, where each backward adds into
  /// it, until the last micro-batch, whose backward reduce-scatters it once: one set of
  /// reduce-scatters per step, the whole gradient held between the micro-batches.
  kReduceOnce,
};

/// Gradient accumulation: how many backwards make one optimizer step, and where the
/// gradient waits between them.
struct AccumulationOptions {
  /// M >= 1: the micro-batches (one `Model::backward` each) of every `step()`. With 1 both
  /// strategies are the same step, the one without accumulation.
  int micro_batches = 1;
  /// The strategy (irrelevant when `micro_batches` is 1).
  Accumulation accumulation = Accumulation::kReduceEveryMicroBatch;
};

/// ZeRO stage 2 with buckets reduce-scattered during backward.
///
/// The constructor plans the buckets (`plan_buckets(model, comm.size(), bucket_cap_bytes)`),
/// makes the inner optimizer with `make_inner(S)` (once), allocates every buffer the steps
/// need, copies this rank's shard of the (identical) initial parameters, releases every
/// `Parameter::grad` (an empty tensor), and registers a gradient-ready hook on `model`.
/// The object must outlive every backward of `model`; `model` and `comm` must outlive it.
///
/// A step is one `Model::backward` on the rank's local batch, then one `step()`. A second
/// backward before `step()` throws `dp::Error` from your hook (its gradients would
/// otherwise overwrite the first's in the shard, and half a step would be lost silently).
/// With gradient accumulation (`AccumulationOptions`, M micro-batches) a step is M
/// backwards, each of one micro-batch with `loss_scale` 1 (the caller scales nothing),
/// then one `step()`; backward M + 1 before `step()` throws `dp::Error` from your hook, and
/// `step()` after fewer than M throws. Such a `step()` discards the partial step before it
/// throws: no call is left in flight, the backwards since the last step no longer count
/// (the next step is again M backwards, after the caller's `Model::zero_grad()`), and the
/// parameters, their shard and the inner optimizer are as before it. Everything below is
/// for M = 1 unless it names M;
/// "Gradient accumulation" after the budgets states what changes with M > 1.
///
/// What a step must do, in whatever order and with whatever buffers you design:
///   * Each gradient leaves `Parameter::grad` as soon as backward has made it: your hook
///     copies it into a communication buffer, to its place in its bucket's flat range, and
///     releases `Parameter::grad` (an empty tensor) before the next gradient is computed.
///   * Once a bucket is complete, its flat range with its padding [E, N C) zero at issue is
///     reduce-scattered, `reduce_scatter(buffer [N C elements], ReduceOp::kSum)`, into
///     elements [shard_offset, shard_offset + C) of `shard_gradients()`, launched in the
///     hook of the gradient that completes the bucket (not at a later gradient's hook, nor
///     after backward). Every rank must issue its collectives in the same order.
///   * A call's buffers are neither written (inputs) nor read or written (outputs) by you
///     while the call is in flight: wait for it first (the adversarial completion mode
///     reports such a buffer at the call's wait, naming the call).
///
/// `step()` then waits for the reduce-scatters still running, divides the shard of the
/// gradient by N, clips it (when `max_norm > 0`), updates the shard of the parameters with
/// the inner optimizer, and all-gathers each bucket's chunk of the updated parameters
/// (`allgather(shard_parameters() [shard_offset, +C) -> N C elements)`) into a buffer of
/// yours and writes every parameter's value from it. Every rank then holds the same
/// parameters: bitwise lab 2's.
///
/// Budgets, per step (one backward, one `step()`) and rank, each checked; B is the number
/// of buckets, S the shard's elements, L the elements of the largest layer's parameters,
/// P = max_k N C_k the largest bucket with its padding:
///   * Communication: each bucket's gradients reduce-scattered exactly once (B
///     reduce-scatters, each launched during backward, none in `step()`), with clipping one
///     `allreduce` (kSum) of one float in `step()`, and each bucket's chunk of the
///     parameters all-gathered exactly once in `step()` (B all-gathers); nothing else. The
///     backend's bytes sent are then exactly those of one reduce-scatter and one all-gather
///     per bucket: DDP's all-reduce volume, plus the padding.
///   * Memory, from the `MemoryTracker` (bytes, float32):
///       - `kGradients`: the shard of the gradient, 4 S, at all times, plus the gradients
///         backward has made and your hook has not yet released: at the peak at most
///         4 S + 4 L (a layer computes all its gradients before their hooks fire). The
///         whole gradient (4 Psi) never exists after the constructor.
///       - `kCommunication`: your buffers (allocated in the constructor) and, with
///         clipping, one float for the norm: at most 2 x 4 P bytes (+ 4 with clipping),
///         what two buffers of the largest padded bucket hold. How many buffers, of which
///         sizes and how you place the buckets in them is yours within that. Checked on
///         the drawn MLPs and on an MLP of many equal hidden layers with a cap of one layer
///         (rubric.json gives the widths), where a buffer per bucket is far above it.
///       - `kParameters`: the model's parameters and the shard of the parameters, 4 S.
///       - `kOptimizerState`: the inner optimizer's, for S elements (AdamW 8 S), at its
///         peak too. `kOther`: nothing; `kActivations`: only what the model's forward and
///         backward make.
///       - After the constructor no tensor is allocated but the gradients backward
///         allocates again after your hook released them; `step()` allocates none. Every
///         buffer is a `Tensor`: the constructor, your hooks and `step()` take no block of
///         1 KiB or more from the heap (no staging copy in a `std::vector`). Between steps
///         every category but the activations holds what it held after the constructor.
///   * Time, on the simulated clock (4 to 8 ranks on 10 GbE, a CPU-class device, an MLP of 8
///     to 14 equal hidden layers whose per-layer backward takes about as long as its bucket's
///     reduce-scatter, a bucket cap of one hidden layer): the waits on the reduce-scatters
///     (`wait()`, `test()`, or destroying the `Work`) block for at most half of the
///     reduce-scatters' time on the link, and at least half of that time overlaps the
///     model's own backward (compute your code adds, its copies included, hides nothing).
///
/// Gradient accumulation, M > 1 micro-batches per step (g_{r,m}: rank r's gradient of its
/// micro-batch m, as one backward with `loss_scale` 1 makes it on a released gradient):
///   * Exact arithmetic, which the grader emulates in one process, bit for bit, per
///     strategy:
///       - `kReduceEveryMicroBatch`: s_m = g_{0,m} + ... + g_{N-1,m} (`kSum`, rank order);
///         the shard sums them in micro-batch order, ((s_0 + s_1) + s_2) + ... in float;
///       - `kReduceOnce`: a_r = ((g_{r,0} + g_{r,1}) + g_{r,2}) + ..., the order in which
///         `Model::backward` adds each micro-batch into `Parameter::grad`; then
///         a_0 + ... + a_{N-1} (`kSum`, rank order);
///     then one division by the float N M (not by N, not by M twice) before clipping and the
///     update. M = 1 is the step above in both.
///   * Communication per step and rank (clipping adds its one float, as above):
///       - `kReduceEveryMicroBatch`: each bucket reduce-scattered exactly once during each
///         micro-batch's backward (M B reduce-scatters of N C_k -> C_k elements, `kSum`),
///         each bucket's chunk all-gathered once in `step()`: the bytes of M reduce-scatters
///         and one all-gather per bucket;
///       - `kReduceOnce`: no call during the first M - 1 backwards; each bucket reduce-
///         scattered exactly once, during the last backward; one all-gather per bucket in
///         `step()`: the bytes of one reduce-scatter and one all-gather per bucket, as with
///         M = 1.
///   * Memory at the peak over the M backwards and `step()` (C_max = max_k C_k):
///       - `kReduceEveryMicroBatch`: `kGradients` at most 4 S + 4 L, as with M = 1;
///         `kCommunication` at most 2 x 4 (P + C_max) (+ 4 with clipping): two buffers
///         of the largest padded bucket, each with room for one chunk more. That room is
///         for M > 1 only: with M = 1 (the default options too) both strategies are held
///         to M = 1's 2 x 4 P;
///       - `kReduceOnce`: `kGradients` at most 4 S + 4 Psi (the whole local gradient
///         between the micro-batches); `kCommunication` at most 2 x 4 P (+ 4 with
///         clipping), as with M = 1.
///     The other categories as with M = 1. Allocations per step: only the gradients the
///     M backwards make after your hook released them (`kReduceEveryMicroBatch`: M per
///     parameter; `kReduceOnce`: one per parameter), none in `step()`, no heap block of
///     1 KiB or more; between steps every category but the activations holds what it held
///     after the constructor. As every backward that reduces returns (each one with
///     `kReduceEveryMicroBatch`, the last one with `kReduceOnce`), every `Parameter::grad`
///     is released and `kGradients` holds the shard's 4 S alone: your hook releases each
///     gradient once it is in a buffer, as with M = 1, not `step()`. Nothing is kept on the
///     heap either, in blocks of any size: the constructor takes at most 640 bytes a
///     parameter + 2048 from it, the M forwards and backwards with your hooks at most what
///     they take without them + 256 bytes a call beyond what one call and its wait take +
///     2048, `step()` the same per call.
///   * Launches and time: every backward that reduces launches each bucket in the hook of
///     the gradient that completes it, as with M = 1. On the simulated clock of the time
///     budget above, one step of M = 3 or 4 micro-batches: the waits on the reduce-scatters
///     block for at most half of their time on the link, and the compute your code adds to
///     the step (its time minus the model's compute and the waits) is at most 1.5 x what
///     the copies and adds the arithmetic needs take on that device: each gradient copied
///     into a buffer once per backward that reduces, the later micro-batches' chunks added
///     into the shard (`kReduceEveryMicroBatch`), the division, the inner update and the
///     copies out of the all-gathers (a copy of the whole gradient in every backward that
///     does not reduce is above it).
class ZeroTwoOptimizer {
 public:
  /// Sets up ZeRO-2 for `model` on `comm` with buckets of at most `bucket_cap_bytes`
  /// (lab 4's rule); `max_norm > 0` turns clipping by global norm on; `accumulation` sets
  /// the micro-batches per step and the strategy (default: one, no accumulation).
  ///
  /// Throws `dp::Error` when a parameter of `model` is frozen, when `max_norm` is negative
  /// or not finite, when `make_inner` is empty, returns nullptr, or returns an optimizer
  /// whose `state_size()` is not S or whose state lives on another device than the model's
  /// (`Optimizer::device()`, `Model::device()`; the message names both devices), or when
  /// `accumulation.micro_batches` is below 1 (the message names the value).
  ZeroTwoOptimizer(Model& model, Communicator& comm, OptimizerFactory make_inner,
                   std::size_t bucket_cap_bytes, float max_norm = 0.0f,
                   AccumulationOptions accumulation = {});
  /// Waits for any call still running (a `Work` must not outlive its buffer).
  ~ZeroTwoOptimizer();
  ZeroTwoOptimizer(const ZeroTwoOptimizer&) = delete;
  ZeroTwoOptimizer& operator=(const ZeroTwoOptimizer&) = delete;

  /// One optimizer step after one backward; on return every parameter's value is updated,
  /// every `Parameter::grad` is released and every call it made is complete. Calls
  /// `begin_step()` of the inner optimizer once, and `update` once over the whole shard
  /// (also on a rank whose chunks are all padding).
  ///
  /// Clipping, when on, has this exact arithmetic (so the grader compares bitwise): rank r
  /// computes p_r = (float) dp::dot(g, g) over its whole averaged shard g (S elements; the
  /// padding is zero and adds nothing); an all-reduce (`kSum`, rank order) gives
  /// s = p_0 + ... + p_{N-1} in float; the norm is std::sqrt(s) in float; when
  /// c = max_norm / (norm + 1e-6f) is below 1, the shard is scaled by c (`dp::scale`)
  /// before the update. p_r is a square over the averaged shard, after the division by
  /// N: squares taken before it and divided by N^2 are another float, which the check's
  /// draws tell apart. Another order of the double-precision sum (per bucket, or
  /// `dp::norm` squared) rounds to the same float except with vanishing probability, so the
  /// check cannot tell it from `dp::dot` and does not try.
  ///
  /// Returns the global norm before clipping when clipping is on (the same on every rank),
  /// std::nullopt when it is off. Throws `dp::Error`, naming the bucket, when a bucket was
  /// not launched since the last step (no backward, or one that did not reach it), and
  /// when fewer than M backwards ran since the last step.
  std::optional<float> step();

  /// The buckets, as `plan_buckets` made them.
  const std::vector<Bucket>& buckets() const;
  /// This rank's shard of the averaged gradient after `step()`: (S), chunk by chunk in
  /// bucket order, its padding zero (after clipping, as the update used it).
  const Tensor& shard_gradients() const;
  /// This rank's shard of the parameters: (S), laid out as `shard_gradients()`, its padding
  /// zero. The inner optimizer updates it in place.
  const Tensor& shard_parameters() const;
  /// The optimizer `make_inner` made.
  Optimizer& inner();

  /// Saves a sharded checkpoint into `directory` (which must exist; dp/sharded_checkpoint.h
  /// describes the files). Collective: every rank calls it, between steps. Each rank writes
  /// its own shard with `dp::save_checkpoint_shard`, without gathering anything: tensor
  /// "params" is `shard_parameters()`, and every state tensor of the inner optimizer
  /// (`Optimizer::state()`) is saved under its own name; metadata "step" is the inner
  /// optimizer's `step_count()` in decimal ("3"). The layout is `dp::chunked_layouts` with one
  /// segment per bucket (its parameters in bucket order): each bucket's chunk, its padding
  /// included, at its shard offset. Returns when the checkpoint is complete on every rank (a
  /// barrier on the communicator). `const`: it changes nothing of the training state; the barrier
  /// is a collective on the communicator the optimizer refers to, not part of its state.
  ///
  /// Checked: the grader reads the index and the consolidated checkpoint itself (the
  /// layouts must be the contract's, the values and state bitwise the emulation's).
  /// Throws `dp::Error` when a file cannot be written.
  void save_checkpoint(const std::filesystem::path& directory) const;

  /// Loads a checkpoint saved by `save_checkpoint` on any world size, with any bucket cap.
  /// Collective, between steps. Fills this rank's shard of the parameters and of every
  /// inner optimizer state tensor for the current world size and buckets
  /// (`dp::load_checkpoint_shard`: copied by parameter name and offset, padding zero), sets
  /// the inner optimizer's step count to the checkpoint's "step", and writes every
  /// parameter's value (all-gather each bucket's chunks, as a step does): afterwards the
  /// ranks hold what a run that never stopped would hold, and the next backward and
  /// `step()` continue it bitwise.
  ///
  /// Throws `dp::Error` when the checkpoint's parameters (names and shapes, in order: a
  /// shape with the same element count but other extents differs too) are not this
  /// model's, when its tensors are not "params" and the inner optimizer's state names
  /// (compared as a set: the order they were saved in is free), or when its metadata
  /// "step" is not a step count in decimal. The message names what differs: the first
  /// differing parameter, with the shape expected and the shape seen, the tensors
  /// expected and seen, or the "step" seen. A bad checkpoint throws before anything
  /// changes: this rank's shards, the inner optimizer's state and step count and every
  /// parameter's value are then as they were (check everything, "step" included, before
  /// writing anything). Checked: a checkpoint saved on 4 ranks, loaded on 2, 3 and 4 (and
  /// on 4 with another bucket cap), must continue the training bitwise; each bad checkpoint
  /// (other shapes, no optimizer state, a "step" that is not a count) must throw, name what
  /// differs, and change nothing.
  void load_checkpoint(const std::filesystem::path& directory);

 private:
  struct State;  // yours: defined in zero2.cpp
  std::unique_ptr<State> state_;
};

/// Design question, graded against the `MemoryTracker`: the gradient memory of one rank
/// at its peak, peak(`kGradients`) + peak(`kCommunication`) over one backward and one
/// `step()` of your own `ZeroTwoOptimizer` (clipping off), for `model` (read, not changed)
/// on `world_size` ranks with `bucket_cap_bytes`. Each peak is the category's whole value at
/// its highest, what the model and your optimizer hold in it, not its increase over the
/// value after the constructor: what the constructor allocated and still holds counts. The
/// peaks are taken from just after the constructor returns: what the constructor held
/// only for a moment does not count. Count the shard, what backward holds before your hook
/// releases it, and your buffers as your design sizes them; compare it with lab 4's DDP,
/// which holds 4 Psi of gradients and 4 Psi of buckets (README.md derives both).
///
/// The grader draws models, world sizes and caps (rubric.json lists the ranges), runs one
/// backward and one step of your optimizer on each rank, and expects your prediction
/// exactly. On every seed one layout has several buckets that pad on some drawn N and one
/// has a single bucket.
std::size_t predicted_gradient_peak_bytes(Model& model, int world_size,
                                          std::size_t bucket_cap_bytes);

/// What one optimizer step of M micro-batches costs one rank of your own design.
struct AccumulationCost {
  /// peak(`kGradients`) + peak(`kCommunication`) over the M backwards and `step()`, each
  /// the category's whole value taken from just after the constructor, as for
  /// `predicted_gradient_peak_bytes`.
  std::size_t gradient_peak_bytes = 0;
  /// The bytes this rank sends in the step for its reduce-scatters and all-gathers, as the
  /// local backend's `CommCounters` count them (see `dp::CommCounters`).
  std::uint64_t bytes_sent = 0;

  /// Two costs are equal when both fields are.
  bool operator==(const AccumulationCost&) const = default;
};

/// Design question, graded against the `MemoryTracker` and the backend's counters: the
/// cost of one step of M micro-batches (`accumulation`) of your own `ZeroTwoOptimizer`
/// (clipping off) for `model` (read, not changed) on `world_size` ranks with
/// `bucket_cap_bytes`. The two strategies trade one for the other; which costs less of
/// which, and by how much, depends on M, N and the buckets.
///
/// The grader draws models, world sizes, caps, M and the strategy (rubric.json lists the
/// ranges), runs M backwards and one step of your optimizer on each rank of the local
/// backend, and expects both numbers exactly.
AccumulationCost predicted_accumulation_cost(Model& model, int world_size,
                                             std::size_t bucket_cap_bytes,
                                             AccumulationOptions accumulation);

}  // namespace dp::lab6
