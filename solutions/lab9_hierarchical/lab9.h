// lab9.h: lab 9, two levels of network: a hierarchical all-reduce and hybrid sharding
// (HSDP). The contract between your code and the grader: the interfaces you implement, the
// arithmetic that fixes the bits, and the budgets each is checked against.
//
// A cluster has two networks: a fast one inside a node (NVLink, hundreds of GB/s per GPU)
// and a slower one between nodes (InfiniBand or Ethernet). A flat ring over all p = N k
// ranks (N nodes of k ranks) runs at the pace of its slowest hop, the one between nodes, and
// pays 2 (p - 1) latencies. A hierarchical all-reduce reduce-scatters inside each node, so
// that each rank holds the node's sum of one k-th of the buffer, all-reduces that shard
// across the nodes (between the ranks with the same index in every node), and all-gathers
// inside the node: only 1/k of the bytes cross the slow network, in 2 (N - 1) steps. HSDP
// (PyTorch FSDP's HYBRID_SHARD, ZeRO++'s hierarchical partitioning) applies the same idea to
// sharded training: the optimizer state is sharded over the k ranks of a node and
// replicated across nodes. Which calls you make on which communicator, what you keep and
// when you wait are your design within the budgets below. README.md beside this file poses
// the problem and derives the formulas. Do not change this header: the grader is compiled
// against it.
//
// The node layout. Ranks of a node are consecutive: rank r of the communicator you are given
// is on node r / k and has index r mod k inside it (k = ranks_per_node), as
// `NetworkModel::ranks_per_node` places them (dp/clock.h, "Two levels"), so that the
// grader's counters and the simulated network see your node communicator inside a node.
//
// What every check holds you to:
//   * Exact arithmetic (the contract's sum order, below): the grader emulates it in one
//     process and compares bitwise.
//   * Asynchrony done right: every check runs in the adversarial completion mode.
//   * Counters you cannot change: the grader hands you a communicator of its own whose
//     `split` hands out communicators it watches, and reads every one's `CommCounters`
//     (bytes per link class: intra-node, inter-node) and the rank's `MemoryTracker`.
//   * Arithmetic with the runtime's operations (dp/tensor_ops.h) on `Tensor`s, buffers on
//     the device of the data or the model.
//
// Example:
//
//   dp::lab9::Levels levels = dp::lab9::split_levels(comm, /*ranks_per_node=*/8);
//   dp::lab9::hierarchical_allreduce(grad.view(), levels);     // the sum over all ranks
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

#include "dp/clock.h"
#include "dp/comm.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/tensor.h"

namespace dp::lab9 {

/// The two communicators of a two-level network, from one rank's point of view.
struct Levels {
  /// The k ranks of this rank's node, ranked by their rank in the communicator split:
  /// node rank r mod k is this rank's index in its node.
  std::unique_ptr<Communicator> node;
  /// The N ranks with this rank's index in every node, one per node, ranked by node.
  std::unique_ptr<Communicator> across;
};

/// Splits `comm` (p = N k ranks) into this rank's node communicator and its across
/// communicator, by the node layout above (`Communicator::split`). Collective: every rank
/// calls it. Throws `dp::Error` when `ranks_per_node < 1` or does not divide `comm.size()`.
/// Checked: the sizes and ranks of both (node: k ranks, this rank's index r mod k; across: N
/// ranks, this rank's node r / k).
Levels split_levels(Communicator& comm, int ranks_per_node);

/// Sums `data` over every rank of the communicator `levels` was split from, in place: every
/// rank gets the same result. The buffer's size must be a multiple of k (`levels.node`'s
/// size); otherwise throws `dp::Error` (on every rank alike, before any call).
///
/// The sum order, which the grader emulates bit for bit: element e of the result is
///
///   R[e] = ((s_0[e] + s_1[e]) + s_2[e]) + ... + s_{N-1}[e],
///   s_j[e] = ((x_{jk}[e] + x_{jk+1}[e]) + x_{jk+2}[e]) + ... + x_{jk+k-1}[e],
///
/// with x_r rank r's `data`: each node's sum in the order of its ranks, then the node sums in
/// node order. The native collectives of the local and mpi backends add in rank order
/// (`ReduceOp::kSum`), so a reduce-scatter on the node's communicator, an all-reduce of the
/// shard on the across communicator and an all-gather on the node's give exactly this.
///
/// Budgets, checked from the counters of every communicator (`dp::sum_counters`):
///   * Bytes per link class, per rank, for n float32 elements (4 n bytes), n a multiple of k N:
///     intra-node 2 (k-1)/k x 4 n sent (and received), inter-node 2 (N-1)/N x 4 n / k: only
///     one k-th of the buffer crosses the slow network. Nothing is sent on the communicator
///     `levels` was split from.
///   * On the simulated network (two levels: NVLink inside, a drawn fabric between nodes,
///     one NIC per rank): the time dp/clock.h's closed form gives the three phases, within
///     1%, so faster than the flat ring by the factor README.md derives.
void hierarchical_allreduce(TensorView data, const Levels& levels);

/// Builds the inner optimizer of one rank over its shard: called once, with S.
using OptimizerFactory = std::function<std::unique_ptr<Optimizer>(std::size_t shard_elements)>;

/// Hybrid sharding (HSDP), on the pattern of lab 5's ZeRO-1 optimizer: the optimizer state
/// sharded over the k ranks of a node and replicated across the N nodes.
///
/// The partition: Psi = `model.num_parameters()`, S = ceil(Psi / k), the flat index space
/// padded with zeros to k S; the rank with index i in its node owns elements
/// [i S, (i+1) S) of it (the same shard on every node). The constructor splits the levels
/// (`split_levels`), makes the inner optimizer with `make_inner(S)` (once) and allocates
/// every buffer. `model` and `comm` must outlive the object.
///
/// A step is one `Model::backward` on the rank's local batch, then one `step()`: the local
/// gradients are reduce-scattered inside the node (each rank gets its node's sum of its
/// shard), all-reduced across nodes (the sum over all p ranks, in the order of
/// `hierarchical_allreduce`), divided by p (`dp::divide`: not a multiplication by 1/p), the
/// shard updated by the inner optimizer, and the updated shards all-gathered inside the node
/// into every parameter's value. Every rank then holds the same parameters: bitwise the
/// emulation of that arithmetic (the sum order of `hierarchical_allreduce`, then / p, then
/// the optimizer's element-wise update over the whole model).
///
/// With k = 1 this is DDP (every rank keeps the whole state; the all-reduce is across nodes
/// of one rank); with k = p it is full sharding over all ranks (lab 5's ZeRO-1). Budgets,
/// checked for k = 1, k = p and k in between:
///   * Memory beyond the model's own, from the `MemoryTracker` (bytes, float32), after the
///     constructor and after every step: `kOptimizerState` exactly the inner optimizer's
///     state for S elements (AdamW: 8 S); `kCommunication` at most 4 k S (one padded flat
///     buffer); `kGradients` at most 4 S; `kParameters` at most 4 S; `kActivations` and
///     `kOther` nothing.
///   * Calls per step: one reduce-scatter (k S -> S) on the node's communicator, one
///     all-reduce (S) across, one all-gather (S -> k S) on the node's; nothing on `comm`.
///   * Bytes per link class per step, per rank: intra-node 2 (k-1) x 4 S sent, inter-node
///     what the ring all-reduce of S floats over N ranks sends (dp/comm.h): the model crosses
///     the slow network once per k ranks.
///
/// Parameters must be trainable (a frozen one throws `dp::Error`), as must `make_inner`
/// (empty, or returning nullptr or an optimizer whose `state_size()` is not S: `dp::Error`).
class HsdpOptimizer {
 public:
  /// Sets up HSDP for `model` on `comm` with nodes of `ranks_per_node` consecutive ranks.
  HsdpOptimizer(Model& model, Communicator& comm, int ranks_per_node, OptimizerFactory make_inner);
  /// Waits for any call still running.
  ~HsdpOptimizer();
  HsdpOptimizer(const HsdpOptimizer&) = delete;
  HsdpOptimizer& operator=(const HsdpOptimizer&) = delete;

  /// One optimizer step from the local gradients in `Parameter::grad` (left unchanged); on
  /// return every parameter's value is updated and every call is complete.
  void step();
  /// S = ceil(Psi / k).
  std::size_t shard_elements() const;
  /// This rank's shard of the parameters: (S), elements [i S, (i+1) S) of the flat index
  /// space, i = r mod k its index in its node (not its node's number), its padding zero.
  const Tensor& shard_parameters() const;
  /// The optimizer `make_inner` made.
  Optimizer& inner();

 private:
  struct State;  // yours: defined in hierarchical.cpp
  std::unique_ptr<State> state_;
};

/// A two-level fabric: N nodes of k ranks; `intra` between two ranks of a node, `inter`
/// between ranks of two nodes (a NIC per rank, dp/clock.h "Two levels").
struct TwoLevelFabric {
  int nodes = 1;           ///< N
  int ranks_per_node = 1;  ///< k
  LinkModel intra;         ///< inside a node (alpha, bandwidth per direction)
  LinkModel inter;         ///< between nodes
};

/// Design question: the simulated seconds of the native all-reduce of `bytes` (float32, a
/// multiple of 4 p) on the communicator of all p = N k ranks of `fabric` (the flat ring, in
/// rank order: dp/clock.h "Native collectives" says how each step is charged).
double predicted_flat_allreduce_seconds(std::size_t bytes, const TwoLevelFabric& fabric);

/// Design question: the simulated seconds of `hierarchical_allreduce` of `bytes` (float32, a
/// multiple of 4 k N) on `fabric`, each phase waited for before the next.
double predicted_hierarchical_allreduce_seconds(std::size_t bytes, const TwoLevelFabric& fabric);

/// Design question: the simulated seconds one step's communication takes (each call waited
/// for before the next, nothing computed between), for a model of `num_parameters` float32
/// elements on `fabric`: with `hybrid` false, full sharding over all p ranks (lab 5's
/// reduce-scatter and all-gather of the flat space padded to p ceil(Psi / p) elements, on the
/// communicator of all ranks); with `hybrid` true, `HsdpOptimizer`'s three calls (padded to
/// k ceil(Psi / k)). README.md asks where HSDP beats full sharding.
double predicted_sharded_step_seconds(std::size_t num_parameters, const TwoLevelFabric& fabric,
                                      bool hybrid);

}  // namespace dp::lab9
