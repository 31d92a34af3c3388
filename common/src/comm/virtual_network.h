// virtual_network.h (internal): the simulated interconnect and clocks of the local backend.
//
// The local backend moves data in wall-clock time, as it always does; this class keeps
// the virtual time beside it. Every call gets an issue time (its rank's compute time) and,
// once the simulation can place it on the links, a completion time.
//
// Determinism. Virtual times must not depend on thread scheduling, yet the ranks run
// freely. Every message and every collective is therefore an item with a key
// (issue time, rank, per-rank counter), and items are placed on the links strictly in key
// order, as a sequential discrete-event simulation would: an item is placed ("committed")
// only when no item with a smaller key can still appear. A rank can still issue items
// whose key is at least (floor, rank, next counter), where its floor is its compute time
// when it last issued or waited; a rank blocked in wait() on a call whose completion time
// is not known yet issues nothing before that call is committed, which happens after the
// current item, so it cannot hold the item back; a finished rank issues nothing. So the
// commit order, and with it every time, is the same in every run.
//
// Placement. A message of n bytes from s to d over a fabric (alpha, bandwidth) occupies
// s's send direction and d's receive direction for n / bandwidth, the transfer, in the
// earliest interval from its issue time on in which both are free; messages placed before
// keep their intervals. Its last byte arrives alpha after the transfer ends; the latency
// does not hold the link, so messages that share a link overlap their latencies and queue
// for the bandwidth alone (p-1 workers pushing n bytes each to one server: the last
// arrives at (p-1) n / bandwidth + alpha, not (p-1) (alpha + n / bandwidth)). Each
// direction carries one transfer at a time (see "Why serialised" in dp/clock.h), and a
// message that waits for a busy receiver does not hold back its sender's other messages:
// a later one that fits into the gap goes first, as on a real network. The send completes
// at the arrival and the receive at max(arrival, receive issue time). A collective starts
// when every rank issued it and every port its algorithm's messages use is free after
// everything placed before it (on one fabric: every port), lasts its algorithm's time on
// where its ranks are (dp/clock.h, "Native collectives") and occupies those ports, both
// directions, for all of it.
//
// Ports. On one flat fabric each rank has one port (a send and a receive direction). On
// two levels (see "Two levels" in dp/clock.h) each rank has its own port on the intra-node
// fabric, and each node has `nics_per_node` NICs on the inter-node fabric (one per rank by
// default), rank r using NIC (r mod ranks_per_node) mod nics_per_node of its node: a
// message inside a node holds the two ranks' fabric ports, one across nodes holds the
// sender's NIC's send direction and the receiver's NIC's receive direction. Ranks that
// share a NIC queue for it exactly as messages of one rank queue for its port; the two
// ports of a rank are independent (it can send inside and across nodes at once).
//
// Communicators. A collective of a communicator split from the launch's (`members`, the
// ranks of the network it spans) meets the same collective of its other members only, is
// charged by where those ranks are (dp/clock.h, "Native collectives") and holds only the
// ports its algorithm's messages use.
//
// Not thread-safe: the local backend calls it with its mutex held (the same mutex the
// clocks take to read what was recorded on them).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>
#include <tuple>
#include <vector>

#include "dp/clock.h"
#include "dp/comm.h"

namespace dp::detail {

using Steady = std::chrono::steady_clock;

/// The virtual-time state of one communicator call.
struct VirtualCall {
  void* owner = nullptr;  // the backend's record of the call
  int rank = 0;
  CommOp op = CommOp::kBarrier;
  int peer = -1;                 // point-to-point: the other rank
  std::uint64_t bytes = 0;       // message size; collectives: the whole array
  std::uint64_t link_bytes = 0;  // sent plus received on this rank's link (for the trace)
  double issue = 0;              // the rank's compute time when it issued the call
  Steady::time_point wall_issue;
  std::uint64_t counter = 0;       // key: (issue, rank, counter)
  std::uint64_t group = 0;         // collectives: the rank's collective index on its communicator
  std::uint64_t communicator = 0;  // collectives: which one (0: the launch's ranks)
  std::span<const int> members;    // collectives: its ranks on the network, by rank in it
                                   // (empty: the launch's ranks, in order)
  int member = 0;                  // collectives: this rank's rank in its communicator
  int root = 0;                    // broadcast: the root's rank in its communicator
  bool pending = false;            // a send waiting in the queue of items
  bool committed = false;          // a send placed on the links
  VirtualCall* match = nullptr;    // send <-> receive
  bool determined = false;         // the times below are final
  double start = 0;                // the link is busy [start, end): the transfer
  double end = 0;
  double arrival = 0;     // point-to-point: the last byte at the receiver, end + alpha
  double completion = 0;  // when wait() returns, on the compute timeline
};

class VirtualNetwork;

/// The simulated clock of one rank.
class SimClock final : public Clock {
 public:
  SimClock(int rank, const SimulationOptions& options, std::mutex& mutex,
           const VirtualNetwork& network, Steady::time_point epoch);
  bool simulated() const override { return true; }
  double now() const override { return now_; }
  double link_free() const override;
  ComputeStart start_compute() const override;
  void finish_compute(const ComputeStart& start, std::string_view name, std::string_view phase,
                      const OpCost& cost) override;
  void compute(std::string_view name, double seconds) override;
  void mark_step() override;
  RankTrace trace() const override;

  /// Moves the compute timeline to `time` if that is later (the rank's own thread).
  void advance_to(double time) {
    if (time > now_) now_ = time;
  }
  /// A call of this rank was issued; its event comes later (caller holds the mutex).
  void call_issued() { ++calls_in_flight_; }
  /// A call of this rank ended: `event` is what it did, or nothing when it failed (caller
  /// holds the backend's mutex).
  void call_finished(std::optional<TraceEvent> event);
  /// Wall seconds from the launch's start to `time`.
  double wall_seconds(Steady::time_point time) const;

 private:
  int rank_;
  const SimulationOptions& options_;
  std::mutex& mutex_;
  const VirtualNetwork& network_;
  Steady::time_point epoch_;
  // Without a trace, summarizes the steps before the last mark and drops their events, if
  // no event can still arrive for them (caller holds mutex_).
  void fold_finished_steps();

  double now_ = 0;
  std::vector<TraceEvent> compute_events_;        // the rank's thread only
  std::vector<TraceEvent> communication_events_;  // under mutex_
  std::vector<double> step_marks_;                // the rank's thread only
  int calls_in_flight_ = 0;                       // under mutex_
  StepSummary folded_;                            // under mutex_ (see RankTrace::folded)
};

/// The links, the queue of items and the clocks of every rank.
class VirtualNetwork {
 public:
  VirtualNetwork(int size, SimulationOptions options, std::mutex& mutex);
  ~VirtualNetwork();
  VirtualNetwork(const VirtualNetwork&) = delete;
  VirtualNetwork& operator=(const VirtualNetwork&) = delete;

  const SimulationOptions& options() const { return options_; }
  SimClock& clock(int rank) { return *clocks_[static_cast<std::size_t>(rank)]; }

  // Everything below: the caller holds the mutex. `issue_*` and `publish` are called from
  // the issuing rank's own thread.
  void issue_send(VirtualCall& send);
  void issue_receive(VirtualCall& receive);
  void match(VirtualCall& send, VirtualCall& receive);
  void issue_collective(VirtualCall& call);
  /// The rank's floor becomes its compute time, if that is later.
  void publish(int rank);
  /// The rank waits for `call` (nullptr: it stopped waiting).
  void block(int rank, VirtualCall* call);
  /// The rank has returned from its function: it issues nothing more.
  void finish(int rank);
  /// A call ended with an error: the simulation forgets it.
  void forget(VirtualCall& call);
  /// Forgets everything (the launch was aborted).
  void clear();
  /// Commits every item that can be committed.
  void advance();
  /// The calls whose times became final since the last call.
  std::vector<VirtualCall*> take_determined();
  /// When the rank's link is next free, as far as is known.
  double link_free(int rank) const;

 private:
  using Key = std::tuple<double, int, std::uint64_t>;
  /// A collective: (communicator, its index among that communicator's collectives).
  using GroupKey = std::pair<std::uint64_t, std::uint64_t>;
  struct Group {  // one collective: the n-th collective of every member of a communicator
    std::vector<VirtualCall*> members;  // by rank in the communicator
    int issued = 0;
    Key latest{0.0, -1, 0};
  };
  struct Item {
    VirtualCall* send = nullptr;  // a message, or
    GroupKey group{0, 0};         // a collective
  };

  Key next_key(int rank, double issue);
  bool committable(const Key& key) const;
  void commit_send(VirtualCall& send);
  void commit_collective(const GroupKey& key);
  void determine(VirtualCall& call);
  void determine_receive(VirtualCall& receive, VirtualCall& send);
  /// The ranks of the network a collective spans, by rank in its communicator.
  std::span<const int> members_of(const VirtualCall& call) const;
  /// The time of a collective on its members (dp/clock.h, "Native collectives").
  double collective_seconds(const VirtualCall& call) const;
  /// The ports a collective holds: those of its algorithm's messages (both directions),
  /// or its rank's own on a communicator of one rank.
  std::vector<std::size_t> ports_of_collective(const VirtualCall& call) const;

  const int size_;
  const SimulationOptions options_;
  std::vector<std::unique_ptr<SimClock>> clocks_;
  std::vector<double> floor_;
  std::vector<std::uint64_t> counter_;
  std::vector<int> all_ranks_;  // 0, 1, ..., size - 1: the launch's communicator
  std::map<std::pair<std::uint64_t, int>, std::uint64_t> collective_index_;  // (comm, rank)
  std::vector<VirtualCall*> blocked_;
  std::vector<bool> finished_;
  /// One direction of one port of one rank: the intervals in which it carries a transfer.
  struct Timeline {
    std::vector<std::pair<double, double>> busy;  // [start, end), sorted, disjoint
    double free_after = 0;                        // the end of the last interval ever placed
  };
  /// The earliest t >= `earliest` at which [t, t + duration) is free on both timelines.
  static double earliest_common_gap(double earliest, double duration, const Timeline& a,
                                    const Timeline& b);
  static void reserve(Timeline& timeline, double start, double end);
  /// Forgets the intervals that end before any rank can issue again.
  void prune();

  /// The port a rank's message uses: its own on the fabric, or its node's NIC across nodes.
  std::size_t port_of(int rank, bool across_nodes) const;

  const NetworkModel& network_;  // options_.network
  // [port]: ports [0, size) are the ranks' ports on the fabric (inside a node), then the
  // NICs (NetworkModel::nic_of), nics_per_node of them per node.
  std::vector<Timeline> send_timeline_;
  std::vector<Timeline> receive_timeline_;
  std::map<Key, Item> queue_;
  std::map<GroupKey, Group> groups_;
  std::vector<VirtualCall*> determined_;
  bool cleared_ = false;
};

}  // namespace dp::detail
