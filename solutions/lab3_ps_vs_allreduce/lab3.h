// lab3.h: lab 3, parameter server against all-reduce, from point-to-point messages. The
// contract between your code and the grader: the interfaces you implement, the invariants
// they must keep, and how each is checked.
//
// Lab 2 averaged gradients with the runtime's native all-reduce. Here you build the ways
// of averaging that came before it and the ones that replaced it, from `isend` and `irecv`
// alone: a parameter server, a ring all-reduce and a latency-optimal all-reduce, and you
// measure on the simulated network why the ring won, where it loses, and what a server
// still offers. README.md beside this file poses the problem; its Hints section, at the
// end, helps if you are stuck. Do not change this header: the grader is compiled against
// it.
//
// What every check holds you to:
//   * Point-to-point messages only. Your code communicates with `Communicator::isend` and
//     `irecv` and no other call (the grader reads the communicator's own counters).
//   * Arithmetic with the runtime's operations. Sums, divisions and copies of gradients,
//     parameters and buffers go through tensor views and dp/tensor_ops.h (`add`, `divide`,
//     `copy`, ...), not loops over raw memory: the same code then runs on a GPU, and the
//     simulated clock sees its cost.
//   * Asynchrony done right. Every check runs in the adversarial completion mode
//     (`dp::Completion::kAdversarial`): a message reaches your buffer only when its own
//     `Work` is waited on, and a send's buffer must stay unchanged until then. Nor may your
//     code assume that a send moves while it waits for something else: on nccl the messages
//     a rank issues between two waits go out as one group at the second, and complete only
//     together, once every peer has posted the matching calls, so post an exchange's
//     receives before its first wait (README.md, "Deadlocks"). An exchange is what the
//     ranks issue without waiting for one another first (a ring step, a doubling round, the
//     pushes and the server's receives of them); a receive whose sender sends only after
//     waiting for messages of its own is a reply and belongs to the next exchange (a
//     server's new version: a co-located server posts its receives after the wait on its
//     push receives, never in one group with them). One more exception: a receive into
//     memory that a send of yours still reads (recursive doubling's folded rank gets the
//     sum back into the buffer it sent) is posted only after that send's wait. Its peer
//     must then not wait for anything of yours that comes after that send before it has
//     received it. The server checks run by these rules on the local backend too
//     (`CommOptions::point_to_point_in_groups`): such a hang is a deadlock there, reported
//     at once with the call each rank waits on.
//   * Every size. N = 1 rank, buffers of 0 and 1 element, fewer elements than ranks and
//     sizes N does not divide are drawn as often as the easy cases.
//   * Exact arithmetic where this header fixes the order of additions (the ring, the
//     server): the grader emulates it in one process and compares bitwise.
//
// Example (one ring all-reduce, then training through a parameter server):
//
//   dp::lab3::ring_allreduce(buffer.view(), comm);        // every rank: the sum, same bits
//
//   dp::lab3::ParameterServer server(model, {.servers = 2}, make_sgd, comm);
//   for (int step = 0; step < steps; ++step) {
//     model.zero_grad();
//     model.backward(model.forward(batch.inputs), batch.labels);
//     server.step(model, comm);                            // push gradients, pull parameters
//   }
//   server.finish(model, comm);                            // every rank: the final parameters
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <span>

#include "dp/clock.h"
#include "dp/comm.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/tensor.h"

namespace dp::lab3 {

/// Elements [offset, offset + count) of a flat buffer: one chunk of the ring, or one
/// server's shard of the parameters.
struct Range {
  std::size_t offset = 0;  ///< the first element
  std::size_t count = 0;   ///< how many elements

  /// Equal offsets and counts.
  bool operator==(const Range&) const = default;
};

/// Chunk `index` of a buffer of `elements` elements cut into `parts` contiguous chunks, in
/// order, as equal as possible: with q = elements / parts and r = elements % parts, chunks
/// 0 .. r-1 hold q + 1 elements and chunks r .. parts-1 hold q (so some chunks are empty
/// when elements < parts). The ring's chunks and the servers' shards both follow this rule.
///
/// Checked for drawn sizes and part counts. Throws `dp::Error` unless parts >= 1 and
/// 0 <= index < parts.
Range chunk_of(std::size_t elements, int parts, int index);

/// Ring all-reduce: replaces `data` on every rank by the element-wise sum over all ranks,
/// as a reduce-scatter followed by an all-gather around the ring 0 -> 1 -> ... -> N-1 -> 0.
///
/// Invariants (N = comm.size(), n = data.size(), chunk c = `chunk_of(n, N, c)`):
///   * The order of additions. Every element of chunk c is summed in ring order starting at
///     rank c: (((x_c + x_{c+1}) + x_{c+2}) + ...) + x_{c-1}, rank indices mod N. Each chunk
///     is summed once, on one rank, and sent on from there, so every rank ends with the
///     same bits. The grader compares bitwise with an emulation of this order (not with
///     the native all-reduce, which adds in rank order 0, 1, ..., N-1).
///   * The traffic. Messages go from rank r to rank r+1 (mod N) only. In each of the two
///     phases rank r sends every chunk but one, exactly once: (n - |chunk r+1|) +
///     (n - |chunk r+2|) elements in all, 2(N-1)/N of the buffer when N divides n. Checked
///     to the byte, per peer, from the communicator's counters, and message by message:
///     each one chunk's sum in the order above (partial in the reduce-scatter, complete in
///     the all-gather); only an empty chunk's message may be empty.
///   * The memory. A step receives one chunk, so a call allocates at most one tensor, of
///     at most one chunk (ceil(n/N) floats, 4 ceil(n/N) bytes at the peak), charged to
///     `MemoryCategory::kCommunication` (it holds messages), and no other category grows
///     during the call. Checked on every call of every check from the rank's MemoryTracker
///     (the peak of each category, `allocations_total`).
///   * The time. On the simulated network (dp/clock.h) with free compute, 8 ranks and
///     1 to 4 MiB: within 2% of 2(N-1) (alpha + n/N / bandwidth).
///   * The compute. The same call with compute priced by a simulated device (a drawn
///     preset, dp/clock.h's DeviceModel): the compute ops a rank runs during the call take
///     at most 1.5x its N - 1 additions of a received chunk (the reduce-scatter's sums, one
///     `add` per chunk but its own, timed by the grader on the same device): no further
///     pass over the data, such as a received chunk copied out of a scratch buffer.
void ring_allreduce(TensorView data, Communicator& comm);

/// An all-reduce for small messages in O(lg N) rounds, recursive doubling or a binomial
/// tree (your choice, for every N, powers of two or not): replaces `data` on every rank by
/// the element-wise sum over all ranks. The name is recursive doubling's: lg N rounds for a
/// power of two, the fewest possible; a binomial tree (reduce, then broadcast, whole
/// buffers without pipelining) takes 2 lg N and is accepted too.
///
/// Invariants: every rank ends with the same bits; with values whose sums are exact in
/// float32 the result is the exact sum; otherwise the order of additions is yours, and the
/// result must be within the tolerance of rubric.json of the rank-order sum. Only `isend`
/// and `irecv`, and no rank sends or receives more than ceil(lg N) messages, what the
/// busiest rank of recursive doubling (with the fold and unfold when N is not a power of
/// two) or of a binomial tree needs, each a whole buffer of n elements holding a sum of
/// values that had reached its sender. A round receives one buffer, so a call allocates at
/// most one tensor, of at most n floats (4n bytes at the peak), charged to
/// `MemoryCategory::kCommunication`, and no other category grows during the call (checked
/// on every call, as for the ring). On the simulated network, ib-ndr preset, 1 to 4 KiB on
/// 8 ranks and on a drawn N of 5 to 7: faster than a ring all-reduce, 2(N-1) (alpha + n/N /
/// bandwidth). The compute: the same call on 8 ranks with compute priced by a simulated
/// device (a drawn preset) runs at most 1.5x one `add` of the n-float buffer per message the
/// rank receives (timed by the grader on the same device): each received sum added once into
/// the buffer, no further pass over the data, such as a sum made in the scratch buffer and
/// copied back.
void latency_optimal_allreduce(TensorView data, Communicator& comm);

/// Where a parameter server's servers run, how many there are, and how far its workers may
/// run ahead.
struct ServerOptions {
  /// S: ranks 0 .. S-1 are the servers; server j holds shard j = `chunk_of(P, S, j)` of the
  /// model's flat parameter space (P = `Model::num_parameters()`, the order of
  /// `Model::flat_parameters()`).
  int servers = 1;
  /// false: every rank is a worker, and the servers are workers too (co-located, W = N).
  /// true: the servers only serve; the workers are ranks S .. N-1 (W = N - S).
  bool dedicated = false;
  /// s >= 0: bounded staleness. A worker computes the gradient of step t (0-based) on the
  /// parameters of version max(0, t - s), where version k means "after k updates" (0: the
  /// initial parameters). s = 0 is the synchronous server.
  int staleness = 0;
};

/// Makes the optimizer a server applies to its shard: called once per server with the
/// shard's number of elements, so that the optimizer's state (MemoryCategory::kOptimizerState)
/// is the shard's.
using OptimizerFactory = std::function<std::unique_ptr<Optimizer>(std::size_t elements)>;

/// One line of a worker's staleness log: the step whose gradient it pushed, and the version
/// of the parameters that gradient was computed on.
struct StalenessRecord {
  int step = 0;     ///< t, 0-based
  int version = 0;  ///< the parameters' version: 0 initial, k after k updates

  /// Equal steps and versions.
  bool operator==(const StalenessRecord&) const = default;
};

/// A parameter server: workers push gradients to the servers, each server averages its
/// shard, applies the optimizer and sends the shard's new version back.
///
/// Construct it on every rank, with the same initial `model` everywhere; then, once per
/// training step, call `step` on every rank (after backward on a worker), and after the
/// last step `finish`. Worker w (w = rank when co-located, rank - S when dedicated) trains
/// on rows [w B/W, (w+1) B/W) of each global batch (the grader feeds it). A co-located
/// server is a worker like any other: with staleness s, its model holds version
/// max(0, t - s) of every shard at step t, its own shard included, although it already
/// computed newer versions of that shard.
///
/// Invariants (checked bitwise against an emulation, SGD and AdamW, for drawn N, S, s and
/// both placements):
///   * The update of step t on shard j: the W workers' gradients of shard j added in worker
///     order, ((g_0 + g_1) + g_2) + ... + g_{W-1}, divided by W (a division), then one step
///     of an optimizer made with `make_optimizer(|shard j|)`. With s = 0 this is lab 2's
///     arithmetic on W ranks, bit for bit.
///   * The traffic of a step: each worker sends each server (other than itself) that
///     server's shard of its gradients, each server sends each worker (other than itself)
///     the shard's new version, and nothing else moves. The one-server link therefore
///     carries (N-1) models each way per step when co-located; S servers divide it by S.
///     Checked to the byte, per peer, from the communicator's counters, and message by
///     message: a push is one message holding shard j of the gradients the worker holds
///     when the step begins, a pull one message holding the shard's next version (1, 2,
///     ..., T in order), each sent once; no other message, no empty one.
///   * The optimizer state. Server j keeps the state of one optimizer made by
///     `make_optimizer(|shard j|)`, called once, in the constructor (and never on a rank
///     that serves no shard), and nothing more: S servers divide the state a single
///     server keeps by S, as they divide its link. A rank that serves no shard keeps no
///     optimizer state. Checked exactly, per rank, from the rank's MemoryTracker
///     (`MemoryCategory::kOptimizerState`) after the constructor, after the steps and at its
///     peak, with AdamW (8 bytes per element) and SGD with momentum (4).
///   * The memory. What the constructor, `step` and `finish` hold on a rank at their peak,
///     per `MemoryCategory`, stays within the budget of its roles (P parameters, |shard j|
///     elements, W workers, staleness s; 4 bytes a float): a worker (s + 2) P floats of
///     `kCommunication` (its packed gradient and s + 1 pulled versions); server j
///     (W + 2) |shard j| floats of `kCommunication` (a receive buffer per worker at most,
///     the average, one more shard, e.g. a version on its way) and |shard j| floats of
///     `kParameters`, besides its optimizer's `kOptimizerState`; a co-located server the
///     sum of both. The `kParameters` are the server's master copy of its shard: the
///     newest version, the memory its optimizer updates. A master copy holds parameters
///     whatever else it serves for (the new versions may be sent from it), so it is charged
///     to `kParameters` on a co-located server as on a dedicated one; only a server whose
///     optimizer updates `model`'s own parameters in place keeps none (a dedicated server
///     may: its model holds the newest version of its shard). Nothing is charged to any
///     other category. Buffers are made once: from step s + 1 (0-based) on, no `step` and
///     no `finish` allocates a tensor (the first s + 1 steps may make what the first pulled
///     versions need). Checked on every rank, both placements, staleness 0 to 2, from the
///     rank's MemoryTracker (each call's peaks, `allocations_total`), and a server whose
///     optimizer updates anything but `model`'s parameters must hold its master's |shard j|
///     floats of `kParameters`; one receive buffer or one per worker, a master or none (an
///     update in place in the model), are all within it, while buffers of the whole model on
///     a server, a master of the whole model, or a master charged to another category are
///     not.
class ParameterServer {
 public:
  /// Sets up this rank's part; no communication. Throws `dp::Error` unless 1 <= S <= N
  /// (co-located) or 1 <= S <= N-1 (dedicated), staleness >= 0, and no parameter of
  /// `model` is frozen.
  ParameterServer(const Model& model, const ServerOptions& options, OptimizerFactory make_optimizer,
                  const Communicator& comm);
  ~ParameterServer();
  ParameterServer(const ParameterServer&) = delete;
  ParameterServer& operator=(const ParameterServer&) = delete;

  /// Training step t (the t-th call, from 0). On a worker: pushes the gradients in `model`
  /// (computed on the parameters it holds, of version max(0, t - s)), and returns with
  /// `model` holding the parameters of version max(0, t + 1 - s), the ones step t + 1 is
  /// computed on. On a server: applies the update of step t to its shard. On a dedicated
  /// server, `model`'s gradients are not read and its shard of `model`'s parameters holds
  /// the shard's newest version, t + 1, on return. Checked after every step of every run,
  /// the timed runs of the speed checks too (whose gradients are the grader's, not computed
  /// on the parameters: a model brought up to date only in `finish` fails there as well).
  void step(Model& model, Communicator& comm);

  /// After the last step: completes every message in flight, the server's sends and the
  /// worker's receives alike: when it returns, every `Work` this rank's server got from the
  /// communicator has been waited for (or found complete by `test()`), and none is left to
  /// a destructor (on nccl a send never waited for may never leave). Then every worker's
  /// `model` holds the final parameters (version T after T steps), and a dedicated server's
  /// holds its shard of them. Checked after every server run of every check.
  void finish(Model& model, Communicator& comm);

  /// On a worker, one record per step so far, in order: {t, max(0, t - s)}, the version its
  /// gradient was computed on (0 <= t - version <= s). Empty on a dedicated server.
  std::span<const StalenessRecord> staleness_log() const;

 private:
  struct State;  // yours: define it in server.cpp
  std::unique_ptr<State> state_;
};

/// Design question, graded against the simulated network: the message size in bytes below
/// which your `latency_optimal_allreduce` is faster than your `ring_allreduce`, on
/// `world_size` ranks of a network whose every link is `link` (latency `alpha_seconds`,
/// `bytes_per_second` per direction), with free compute.
///
/// Derive it from the cost model of the simulated network (dp/clock.h) for the algorithms
/// you wrote, message by message: a message's latency does not hold a link, but two
/// messages that reach one rank at once share its receiving link, one transfer after the
/// other (two issued at the same simulated time in the order of their senders' ranks, the
/// lowest first: README.md, "The simulated network"). The grader draws networks on 3 ranks,
/// on 4, on 5 to 8, on 10, 12 or 14, on 17 to 32 and on 33 to 64: powers of two, odd world
/// sizes and even ones that are not powers of two on every run (the small world sizes are
/// where N steps and N - 1, or 2 buffers and 2(N-1)/N, part; the large ones where lg N
/// rounds against 2(N - 1) steps), finds the crossover by timing both of your all-reduces
/// on the simulated clock (to 1/500 of the size), and expects your prediction within 3% of
/// it: the clock is exact, and a formula that models your algorithms misses only by
/// rounding (the ring's chunks of ceil(n/N) elements, whole elements), by at most 1.4% on
/// the networks drawn.
double predicted_crossover_bytes(int world_size, const LinkModel& link);

}  // namespace dp::lab3
