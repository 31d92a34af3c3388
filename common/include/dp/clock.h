// clock.h: each rank's clock, and the cost model of the simulated interconnect.
//
// Wall-clock speedups mean nothing when four ranks share two cores, so the local backend
// can simulate time. Each rank then has a virtual clock with two timelines:
//
//   compute        advanced by each compute op: on the roofline model of a `DeviceModel`,
//                  time = max(flops / rate, bytes / bandwidth) + launch cost, or by the
//                  op's measured thread CPU time (`ComputeModel::kMeasured`)
//   communication  the rank's link (one port, full duplex, each direction serialised):
//                  a message of n bytes holds it for n / bandwidth and arrives alpha
//                  later (`LinkModel`): alone, it costs alpha + n / bandwidth (on two
//                  levels a rank has a port per fabric; see "Two levels" below)
//
// An asynchronous call is issued at the rank's current compute time onto the link;
// `Work::wait()` moves the compute time to the call's completion. A message from s to d
// holds s's send direction and d's receive direction for its transfer, n / bandwidth, in
// the earliest interval from its issue time on in which both are free (so a message
// waiting for a busy receiver does not hold back its sender's messages to idle ones), and
// arrives alpha after the transfer ends; both sides complete at the arrival (a receive
// posted later, when it is posted).
// The latency is paid by every message but does not hold the link, so messages that share
// a link overlap their latencies and queue only for the bandwidth, as on a real network:
//
//   incast    p-1 ranks send n bytes each to one rank: the last arrives at
//             (p-1) n / bandwidth + alpha (a parameter server's push)
//   outcast   one rank sends n bytes to each of p-1 ranks: the same (its pull)
//   tree      a binomial-tree broadcast over p = 2^k ranks: k (alpha + n / bandwidth)
//
// Why serialised (one transfer at a time per direction, placed in issue order) rather than
// shared fairly: messages are placed once, in a fixed order (virtual_network.h), and their
// times never change after that, which is what makes the clock deterministic; under fair
// sharing a later message would slow down one already placed. Both rules finish a batch
// of equal messages through one link at the same time (the link is never idle while bytes
// wait), so incast, outcast, rings and trees complete as under fair sharing; only the
// order in which the messages of a batch arrive differs (one after another instead of all
// at the end). Where many links are busy at once (all-to-all), placing whole messages can
// leave a gap slightly too short for the next one: a skew of a few microseconds between
// senders can then cost a transfer time that fair sharing would not.
//
// A native collective starts when every rank has issued it and every link it uses is free
// (on one fabric: every link), holds those links for all of its time, and is charged by
// its algorithm (on two levels, by where its ranks are: "Native collectives" below): ring
// all-reduce 2(p-1) (alpha + n/p / bandwidth), ring reduce-scatter and all-gather
// (p-1) (alpha + n/p / bandwidth) with n the whole array, binomial-tree broadcast
// ceil(lg p) (alpha + n / bandwidth), dissemination barrier ceil(lg p) alpha.
// Reductions are not charged (gamma = 0).
//
// Two levels (`NetworkModel::ranks_per_node` = k > 0): ranks [k i, k (i+1)) form node i.
//
//   inside a node   a message between two ranks of one node crosses `fabric` (NVLink):
//                   alpha + n / bandwidth of `fabric`, through the two ranks' own intra-node
//                   ports (each rank has one, full duplex, as above).
//   across nodes    a message between ranks of two nodes crosses `inter_node`: alpha +
//                   n / bandwidth of `inter_node`, through the sender's NIC and the
//                   receiver's NIC. A node has `nics_per_node` = m NICs (default k: one per
//                   rank, as on a DGX); rank r uses NIC (r mod k) mod m of its node, so with
//                   m < k the ranks r, r+m, r+2m... of a node share one NIC. Each NIC is a
//                   port like a rank's: one transfer per direction at a time, so j ranks
//                   sending n bytes each across nodes at once through one NIC finish at
//                   j n / bandwidth + alpha, through j NICs at n / bandwidth + alpha.
//                   A node's inter-node bandwidth is m times `inter_node`'s, shared by its
//                   ranks only through the NICs they have in common.
//   both at once    the two ports are independent: a rank can send inside its node and
//                   across nodes at the same time, each at its fabric's full bandwidth.
//
// There is no switch or core contention: any number of NICs talk at once at full speed.
// A message's two ends are placed as on one fabric (the earliest interval in which the
// sender's port and the receiver's are both free), so a NIC's queue orders the messages
// of its ranks by issue time, then rank: the i-th of them arrives at i n / bandwidth +
// alpha.
//
// Native collectives are charged by the layout of their ranks: which fabric each of their
// algorithm's messages crosses is the layout's (`link_between`), which of those is slowest
// is the fabrics' speed (for the message size). On one fabric this is the flat formula
// above; on two levels, for a communicator whose ranks r_0 .. r_{p-1} lie anywhere on the
// network (the launch's ranks, or a communicator split from them, `Communicator::split`):
//
//   ring (all-reduce 2(p-1) steps, reduce-scatter and all-gather p-1 steps of n/p bytes)
//                   each step lasts as long as its slowest hop r_i -> r_{i+1} (r_{p-1} ->
//                   r_0): alpha + n/p / bandwidth of the fabric that hop crosses, or, where
//                   j hops of a step leave or enter through one port (ranks of a node that
//                   share a NIC), j n/p / bandwidth + alpha (`ring_step_seconds`). Exact
//                   against a ring built from messages: its steps wait for each other and
//                   the rank before the slowest hop takes that hop's time every step.
//   broadcast       the binomial tree: ceil(lg p) rounds, the root's distance halving from
//                   the largest power of two below p; each round lasts as long as its
//                   busiest port, as a ring step (`broadcast_seconds`). On N nodes of k ranks
//                   (powers of two) from a node's first rank: lg N (alpha_i + n / bw_i) +
//                   lg k (alpha_f + n / bw_f), exact against the tree of messages (each rank
//                   forwards to its children largest subtree first; a node's inter-node
//                   messages leave through its first rank only). Elsewhere the rounds are
//                   charged as if they waited for each other: an upper bound.
//   barrier         dissemination: in round i each rank sends an empty message to the rank
//                   2^i after it and waits for that send and for its own round-i message;
//                   it ends with the longest chain of latencies (`barrier_seconds`), exact
//                   against the barrier of messages. Over nodes with the inter-node alpha the
//                   larger: ceil(lg p) alpha_i once it spans nodes (a rank last in its node
//                   sends across nodes in every round).
//
// A native collective holds, for all of its time, both directions of every port its
// messages use (a rank's intra-node port for a hop inside a node, its NIC for a hop across
// nodes) and starts once they are free: on one fabric that is every rank's port, so
// collectives of one communicator run one after another and messages wait for them, while
// a collective inside one node leaves the NICs to the collectives between nodes (the
// phases of a hierarchical all-reduce of different ranks overlap). Two collectives that
// share a NIC run one after the other.

// The simulation only accounts time: results are bitwise those of an unsimulated run, and
// the virtual times never depend on thread timing, so two runs give the same clocks on
// any machine.
//
// On the mpi backend (and with the simulation off) `Communicator::clock()` is a wall clock.
//
// Example:
//
//   dp::LaunchOptions options{.world_size = 8};
//   options.simulation = dp::SimulationOptions::preset("ib-ndr");
//   dp::launch(options, [](dp::Communicator& comm) {
//     std::vector<float> grad(1 << 20, 1.0f);
//     auto work = comm.allreduce(std::span(grad), dp::ReduceOp::kAvg);
//     comm.clock().compute("backward", 0.005);      // 5 ms of compute hide the all-reduce
//     work->wait();
//     double seconds = comm.clock().now();           // 0.005: no exposed communication
//   });
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "dp/layer.h"
#include "dp/trace.h"

namespace dp {

/// Speed of one compute device, for the roofline model.
struct DeviceModel {
  std::string name = "a100";           ///< preset name, or "custom"
  double flops_per_second = 19.5e12;   ///< peak float32 rate
  double bytes_per_second = 1.555e12;  ///< memory bandwidth
  double launch_seconds = 4e-6;        ///< fixed cost of every op (a kernel launch)

  /// max(cost.flops / flops_per_second, cost.bytes / bytes_per_second) + launch_seconds.
  double time_of(const OpCost& cost) const;
  /// A preset by name: "a100", "h100" or "cpu"; throws `dp::Error` listing them otherwise.
  static DeviceModel preset(std::string_view name);
  /// The preset names.
  static std::vector<std::string> preset_names();
};

/// One fabric: latency and bandwidth of each message.
struct LinkModel {
  double alpha_seconds = 1e-6;     ///< latency per message (it does not hold the link)
  double bytes_per_second = 50e9;  ///< bandwidth of each direction of a link (1/beta)

  /// alpha + bytes / bandwidth: one message alone on its link.
  double time_of(double bytes) const { return alpha_seconds + bytes / bytes_per_second; }
};

/// The interconnect: one fabric, or two levels (ranks of a node on a fast fabric, nodes on
/// a slower one; see "Two levels" at the top of this file).
struct NetworkModel {
  std::string name = "ib-ndr";  ///< preset name, or "custom"
  LinkModel fabric;             ///< between any two ranks (within a node when two-level)
  LinkModel inter_node;         ///< between nodes (used only when ranks_per_node > 0)
  int ranks_per_node = 0;       ///< 0: one flat fabric; k: ranks [k i, k (i+1)) form node i
  /// Two levels: the inter-node ports (NICs) of each node, which its ranks share; 0: one
  /// per rank (a DGX: one NIC per GPU). Must divide `ranks_per_node`.
  int nics_per_node = 0;

  /// True when ranks `a` and `b` talk over `inter_node`.
  bool crosses_nodes(int a, int b) const;
  /// The NIC that carries `rank`'s inter-node messages, numbered across the whole network:
  /// node * k + (rank mod ranks_per_node) mod k, with k the NICs per node (two levels only).
  int nic_of(int rank) const;
  /// The NICs per node in effect: `nics_per_node`, or `ranks_per_node` when that is 0.
  int effective_nics_per_node() const;
  /// Throws `dp::Error` naming the bad value unless the latencies are >= 0, the bandwidths
  /// > 0, `ranks_per_node` >= 0 and `nics_per_node` is 0 or a positive divisor of
  /// `ranks_per_node` (and 0 on one flat fabric).
  void validate() const;
  /// The fabric a message from `a` to `b` crosses.
  const LinkModel& link_between(int a, int b) const;
  /// The fabric a ring over `world_size` node-contiguous ranks crosses at its slowest by
  /// layout: `inter_node` once they span more than one node, `fabric` otherwise (which of the
  /// two paces a ring also depends on the chunk size: `ring_step_seconds`).
  const LinkModel& slowest_link(int world_size) const;
  /// One step of a ring over `ring` (ranks of this network in ring order, each sending
  /// `chunk_bytes` to the next, the last to the first, all at once): as long as its slowest
  /// hop, alpha + chunk / bandwidth of the fabric the hop crosses, or j chunk / bandwidth +
  /// alpha where j of the step's hops leave or enter through one port (a NIC that ranks of a
  /// node share). 0 for fewer than two ranks. See "Native collectives" at the top.
  double ring_step_seconds(std::span<const int> ring, double chunk_bytes) const;
  /// A binomial-tree broadcast of `bytes` from `ranks[root]` over `ranks`: ceil(lg p) rounds,
  /// each as long as its busiest port (as `ring_step_seconds`). Throws `dp::Error` for a
  /// root outside [0, p).
  double broadcast_seconds(std::span<const int> ranks, int root, double bytes) const;
  /// A dissemination barrier over `ranks`: the longest chain of latencies through its rounds
  /// (see "Native collectives" at the top); 0 for one rank.
  double barrier_seconds(std::span<const int> ranks) const;
  /// A preset by name: "nvlink", "ib-ndr", "100gbe" or "10gbe"; throws `dp::Error` listing
  /// them otherwise.
  static NetworkModel preset(std::string_view name);
  /// The preset names.
  static std::vector<std::string> preset_names();
  /// "ib-ndr (alpha 2 us, 50 GB/s)", with the inter-node fabric when two-level.
  std::string describe() const;
};

/// How the simulated clock charges compute.
enum class ComputeModel {
  kRoofline,  ///< deterministic: `DeviceModel::time_of` each op's flops and bytes
  kMeasured,  ///< the op's thread CPU time on this machine (not reproducible)
};

/// The simulated interconnect and clock of the local backend (ignored by mpi).
struct SimulationOptions {
  bool enabled = false;                            ///< simulate time (off: wall clock)
  NetworkModel network;                            ///< latency and bandwidth
  DeviceModel device;                              ///< compute speed (roofline)
  ComputeModel compute = ComputeModel::kRoofline;  ///< how compute is charged
  /// Keep every op as a `TraceEvent` (for a Chrome trace). Off, each step's events are
  /// summarized once the step is over and dropped (`RankTrace::folded`), so memory stays
  /// constant however long the run; the step summaries are the same.
  bool record_trace = true;

  /// Enabled, on network preset `network`, with the default device.
  static SimulationOptions preset(std::string_view network);
  /// "ib-ndr (alpha 2 us, 50 GB/s); device a100 (19.5 TFLOP/s, 1555 GB/s, launch 4 us);
  /// roofline".
  std::string describe() const;
};

/// A reading taken when a compute op starts, handed back when it ends.
struct ComputeStart {
  std::chrono::steady_clock::time_point wall;  ///< wall time at the start
  std::int64_t cpu_ns = 0;                     ///< thread CPU time at the start (measured mode)
};

/// One rank's clock: simulated on the local backend, wall time otherwise.
class Clock {
 public:
  virtual ~Clock() = default;

  /// True for the simulated clock.
  virtual bool simulated() const = 0;
  /// The compute timeline: seconds since the launch began (virtual when simulated).
  virtual double now() const = 0;
  /// When the rank's link is next free, as far as the simulation has placed calls on it
  /// so far (simulated: this may grow as peers' calls are placed; else `now()`).
  virtual double link_free() const = 0;

  /// Reads the clocks a compute op needs at its start.
  virtual ComputeStart start_compute() const = 0;
  /// Ends a compute op started at `start`: charges it (simulated) and records it as
  /// "<name> <phase>" (e.g. "fc1 forward") when tracing.
  virtual void finish_compute(const ComputeStart& start, std::string_view name,
                              std::string_view phase, const OpCost& cost) = 0;
  /// Charges `seconds` of compute called `name` (simulated; a wall clock records it only).
  virtual void compute(std::string_view name, double seconds) = 0;
  /// Marks the end of a training step (and the start of the next) at `now()`.
  virtual void mark_step() = 0;
  /// A copy of what this clock recorded. Call it from the rank's own thread.
  virtual RankTrace trace() const = 0;
};

/// The clock bound to the calling thread (a rank's thread inside `dp::launch` when the
/// simulation is on), or nullptr: then compute is not charged.
Clock* this_thread_clock();

/// Binds a clock to the calling thread for the lifetime of this object.
class ScopedClock {
 public:
  /// Binds `clock` (may be nullptr) until destruction, then restores the previous binding.
  explicit ScopedClock(Clock* clock);
  ~ScopedClock();
  ScopedClock(const ScopedClock&) = delete;
  ScopedClock& operator=(const ScopedClock&) = delete;

 private:
  Clock* previous_;
};

/// Runs `op()` as one compute op "<name> <phase>" of `cost` on the calling thread's clock;
/// without a clock it just runs `op()`. Returns what `op()` returns.
template <typename Op>
decltype(auto) timed_compute(std::string_view name, std::string_view phase, const OpCost& cost,
                             Op&& op) {
  Clock* clock = this_thread_clock();
  if (clock == nullptr) return std::forward<Op>(op)();
  const ComputeStart start = clock->start_compute();
  if constexpr (std::is_void_v<decltype(std::forward<Op>(op)())>) {
    std::forward<Op>(op)();
    clock->finish_compute(start, name, phase, cost);
  } else {
    decltype(auto) result = std::forward<Op>(op)();
    clock->finish_compute(start, name, phase, cost);
    return result;
  }
}

/// A wall clock: `now()` is wall seconds since construction; compute is recorded, never
/// charged. The clock of the mpi backend and of the local backend without simulation.
class WallClock final : public Clock {
 public:
  /// A clock whose time 0 is now; records events only when `record_trace`.
  WallClock(int rank, bool record_trace);
  bool simulated() const override { return false; }
  double now() const override;
  double link_free() const override { return now(); }
  ComputeStart start_compute() const override;
  void finish_compute(const ComputeStart& start, std::string_view name, std::string_view phase,
                      const OpCost& cost) override;
  void compute(std::string_view name, double seconds) override;
  void mark_step() override;
  RankTrace trace() const override;

 private:
  std::chrono::steady_clock::time_point epoch_;
  bool record_;
  RankTrace trace_;
};

}  // namespace dp
