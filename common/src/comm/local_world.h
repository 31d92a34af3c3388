// local_world.h (internal): the local backend, every rank a thread of this process.
//
// Ranks share one address space, so a collective needs no messages: a thread reads and
// writes every rank's buffer directly. An all-reduce is a reduce-scatter and an
// all-gather fused into one pass: each element is summed over the ranks' buffers in rank
// order 0, 1, ..., p-1 and the sum stored into every rank's buffer. That reads n and
// writes n bytes per rank, the least any all-reduce can move (on a memory-bound machine,
// traffic is time). Nothing is copied beyond that: no staging buffers.
//
// Each element is reduced exactly once, so every rank ends with the same bits, and the
// fixed order makes the result independent of thread timing and of which thread did the
// work. The counters record the bytes a ring all-reduce moves between ranks,
// 2 (p-1)/p n per rank, whatever the threads did.
//
// Without the simulation, the ranks meet for a collective without a lock: the n-th
// collective of every rank meets in slot n mod kFastSlots of a ring allocated with the
// world (`FastSlot`). A rank publishes its call there and counts itself in with one
// atomic increment; the last to arrive checks that the calls match and, for a small
// collective (at most kEagerBytes), does the whole reduction itself and marks every
// rank's call finished, while the others spin briefly before they sleep. When the peers
// are ready, a small all-reduce thus costs no lock, no allocation beyond the call's own
// handle, no system call and no thread switch: only the reduction and a few cache lines
// that move between cores (on a virtual machine each such move costs ~0.1-0.2 us, and
// they, not the arithmetic, decide a 4 KiB all-reduce's time). A larger collective is
// cut into pieces once every rank has issued it; the communication threads and the
// ranks waiting for it claim pieces until none is left (`CollectiveSlot`), so every
// core works on it whichever threads the scheduler runs.
//
// With the simulation, the ranks meet under the mutex and each rank's communication
// thread reduces chunk i = rank of every buffer (`execute_collective`), in phases.
//
// Everything else sits behind one mutex (`mutex_`), which keeps the deadlock detector
// exact: a deadlock is declared when every rank waits on a call, no communication
// thread can make progress and no transfer is in flight. A rank only sleeps (and so
// only counts as blocked) under the mutex, and whoever finishes a call lock-free takes
// the mutex to wake it (see `sleepers_`), so the detector never sees a rank blocked on a
// call that is already finished. Data is moved outside the lock.
//
// A rank that waits longer than the hang timeout aborts every rank with a report. A rank
// stuck in its own code cannot be stopped (threads cannot be killed), so `launch` waits
// a short grace for the ranks to return and otherwise prints the report and ends the
// process: a hang never lasts much longer than the timeout.
//
// Device buffers (comm/local_device.h) take the same paths: the same thread moves the data,
// with copies and a reduction kernel on its own CUDA stream instead of memcpy and a loop,
// and drains that stream before it marks the call complete. A large collective on a
// device is one piece (one kernel does it all; the GPU, not the cores, is what works).
//
// With `LaunchOptions::simulation` enabled, a `VirtualNetwork` (virtual_network.h) keeps
// each call's virtual times beside the data movement: a call is complete for `wait()` once
// its data has moved and its virtual completion time is known, and `wait()` then moves
// the rank's simulated clock to that time. Data moves as without the simulation, except
// that a send posted before its receive is copied aside and completes at once (eager), as
// its virtual time says it does: with rendezvous sends, a sender blocked until the
// receiver posts would hold back the virtual clock of a receiver that posts only after
// waiting for the clock (a bounded-staleness parameter server does exactly this).
//
// Communicators split from the launch's (`Communicator::split`) live in the same world: a
// `CommGroup` lists its ranks (as ranks of the launch) and keeps what is per communicator:
// each member's counters and collective sequence, the slots where its collectives meet
// (the FastSlot ring, or the simulation's open slots) and, through its id in the mailbox
// key, its own messages. Everything per rank of the launch stays per rank: its thread, its
// communication thread (which runs the collectives of all its communicators in the order
// the rank issued them), its call log, what it waits for, its clock. So the deadlock
// detector and the hang report see every communicator at once, and on the simulated
// network a communicator's messages and collectives run between the ranks' places in the
// launch. A split is a collective of the communicator split: the last rank to arrive makes
// the new communicators, under the mutex, and each call takes its own back.
//
// The files of the local backend:
//   local_world.h          this overview, and the state the files below share
//   local_reduce.cpp       the arithmetic: every element summed in rank order
//   local_world.cpp        the ranks' lifecycle, waiting, aborts, deadlock and hang reports
//   local_point_to_point.cpp  isend/irecv: matching a send with its receive, the copy
//   local_collectives.cpp  collectives: where the ranks meet, who runs which piece
//   local_backend.cpp      the Communicator and Work a rank sees, and run_local (launch)
#pragma once

#include <sched.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "comm/argument_checks.h"
#include "comm/call_log.h"
#include "comm/local_device.h"
#include "comm/ring_counts.h"
#include "comm/virtual_network.h"
#include "dp/clock.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/memory.h"

namespace dp::detail::local {

using WallTime = std::chrono::steady_clock;

/// Collectives up to this size run eagerly on the ranks' own threads (see the top): the
/// last rank to issue one does all of it. Splitting the work between the ranks was not
/// faster up to here (measured on 2 ranks, 64 KiB: 9.0 us for one rank alone, 9.5 us in
/// 16 KiB pieces that both ranks claimed, 18.6 us in 2 KiB pieces): claiming pieces moves
/// cache lines between cores.
constexpr std::size_t kEagerBytes = std::size_t{256} << 10;
/// The pieces a large collective is cut into (see CollectiveSlot): claiming one costs
/// ~0.1 us, moving it ~10 us.
constexpr std::size_t kPieceBytes = std::size_t{256} << 10;
/// Above this size a rank waiting for a collective sleeps at once: 2 ranks take ~90 us
/// for 1 MiB, about what a waiting rank spins and yields for (SpinPolicy).
constexpr std::size_t kSpinBytes = std::size_t{1} << 20;
/// Collectives a rank may have issued ahead of the slowest rank before it waits for a
/// slot of the ring (see `FastSlot`); far more than any lab keeps in flight.
constexpr std::uint64_t kFastSlots = 1024;
/// A first-in first-out queue on storage made up front: a rank's large collectives for its
/// communication thread. The last rank to arrive at a collective queues it for every
/// member, so a queue that allocated as it grew (a std::deque takes a block every 32
/// entries) charged that rank's heap, by arrival order, for its peers' bookkeeping: once
/// in 32 calls, N blocks. Grows (doubling) only when more calls are queued than it holds,
/// far more than any lab keeps in flight.
template <typename T>
class PreallocatedQueue {
 public:
  /// A queue with room for `capacity` entries (at least 1) before it must grow.
  explicit PreallocatedQueue(std::size_t capacity = 256)
      : items_(std::max<std::size_t>(1, capacity)) {}
  /// Whether nothing is queued.
  bool empty() const { return size_ == 0; }
  /// The oldest entry; the queue must not be empty.
  T& front() { return items_[head_]; }
  /// Appends `item` after the newest entry.
  void push_back(T item) {
    if (size_ == items_.size()) grow();
    items_[(head_ + size_) % items_.size()] = std::move(item);
    ++size_;
  }
  /// Removes the oldest entry (releasing what it held); the queue must not be empty.
  void pop_front() {
    items_[head_] = T();
    head_ = (head_ + 1) % items_.size();
    --size_;
  }

 private:
  void grow() {
    std::vector<T> larger(2 * items_.size());
    for (std::size_t i = 0; i < size_; ++i)
      larger[i] = std::move(items_[(head_ + i) % items_.size()]);
    items_.swap(larger);
    head_ = 0;
  }

  std::vector<T> items_;  // a ring: the entries are items_[(head_ + i) % size()], i < size_
  std::size_t head_ = 0;
  std::size_t size_ = 0;
};

/// How a waiting rank spends its time before it sleeps: it spins on the CPU for
/// `spin_only`, then keeps checking between yields of its core until `before_sleep`.
struct SpinPolicy {
  std::chrono::microseconds spin_only;
  std::chrono::microseconds before_sleep;
};
/// When every rank has a core of its own: a small collective takes a few microseconds, and
/// on a virtual machine one yield costs about as much (measured: a 4 KiB all-reduce on 2
/// ranks took 17.6 us when the waiter yielded after 5 us, 5.3 us with this policy).
constexpr SpinPolicy kSpinOnOwnCores{std::chrono::microseconds{50}, std::chrono::microseconds{200}};
/// With more ranks than cores the peer a rank waits for may need its core: yield early.
constexpr SpinPolicy kSpinOnSharedCores{std::chrono::microseconds{5},
                                        std::chrono::microseconds{50}};

/// The cores this process may run on.
inline int usable_cores() {
  cpu_set_t cores;
  if (sched_getaffinity(0, sizeof(cores), &cores) == 0) return CPU_COUNT(&cores);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}
/// How long `launch` waits for the ranks after a hang or deadlock abort before it ends
/// the process: every rank inside dplab returns at once; one that does not is stuck.
constexpr std::chrono::seconds kStuckRankGrace{2};
/// The exit status of a process ended because a rank never returned.
constexpr int kStuckRankExitStatus = 3;

/// Tells the CPU this is a spin loop (cheaper for the sibling hyper-thread).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

/// Takes `lock`, spinning briefly first: the lock is held for well under a microsecond,
/// and sleeping on it would cost a system call on both sides.
inline void lock_spinning(std::unique_lock<std::mutex>& lock) {
  for (int attempt = 0; attempt < 200; ++attempt) {
    if (lock.try_lock()) return;
    cpu_relax();
  }
  lock.lock();
}

struct Operation;

/// One collective as all ranks see it: the n-th collective of every member of a communicator.
struct CollectiveSlot {
  // By rank in the communicator, as they issue it. A call refers to its slot until its Work handle
  // goes, which breaks the cycle: the last handle of a collective frees the slot and its calls.
  std::vector<std::shared_ptr<Operation>> members;
  int arrived = 0;                      // ranks that issued it (simulated: see CommGroup)
  std::optional<std::string> mismatch;  // set once every rank issued it
  // The communication threads' path with the simulation.
  int threads_arrived = 0;
  std::array<int, 3> phase_arrivals{};
  // Without the simulation, a large collective: pieces of the index space [0, elements),
  // claimed by whichever thread is free to work on it (communication threads, ranks
  // waiting for it), so that every core works whatever the scheduler runs.
  std::size_t elements = 0;
  std::size_t piece_elements = 0;
  std::size_t pieces = 0;
  std::vector<ConstBuffer> inputs;  // by rank
  std::vector<MutableBuffer> outputs;
  alignas(64) std::atomic<std::size_t> next_piece{0};
  alignas(64) std::atomic<std::size_t> pieces_done{0};
};

/// Where the ranks meet for one collective without the simulation, lock-free (see the
/// top). Slot i of the ring serves collectives i, i + kFastSlots, i + 2 kFastSlots, ...
/// in turn: `sequence` says which one it serves now.
struct alignas(64) FastSlot {
  /// Set in `arrivals` once the ranks were aborted: a rank that arrives later fails.
  static constexpr std::uint32_t kClosed = 1u << 31;
  /// The collective this slot serves; advanced (release) by the rank that empties it.
  std::atomic<std::uint64_t> sequence{0};
  /// Ranks that issued it, plus kClosed. Each rank stores its call into `members` and
  /// then increments this (acq_rel): the increment that completes the count therefore
  /// sees every rank's call, as does an abort that closes the slot.
  std::atomic<std::uint32_t> arrivals{0};
  /// By rank: the call, while it waits here. Whoever takes a call out (exchange) ends it:
  /// the last rank to arrive, an abort that closes the slot, or the rank itself when it
  /// arrives at a closed slot, exactly one of them.
  std::atomic<Operation*>* members = nullptr;  // one per member, in CommGroup::fast_slot_members
};

/// One communicator of a launch: the launch's own (id 0, every rank in order) or one split
/// from another. Calls and communicators refer to it; the world keeps it until it ends.
struct CommGroup {
  std::uint64_t id = 0;
  std::vector<int> members;  // ranks of the launch, by rank in this communicator
  NodeLayout layout;         // the members' nodes, for the counters' link classes
  std::string name;          // for messages: "" for the launch's, else "communicator 3 (...)"
  // By rank in this communicator. A member's counters and sequence: only its own thread
  // writes them (and reads its counters, through counters()).
  std::vector<CommCounters> counters;
  std::vector<std::uint64_t> next_sequence;
  // Simulated: collectives some but not all members have issued, oldest first: the one with
  // sequence number first_open_sequence + i at index i. Every member issues collective n
  // before n + 1, so slots open in sequence order and the oldest is the first to fill.
  std::deque<std::shared_ptr<CollectiveSlot>> open_slots;
  std::uint64_t first_open_sequence = 0;
  // Without the simulation: the ring where collective n meets, in slot n % kFastSlots.
  std::unique_ptr<FastSlot[]> fast_slots;
  std::unique_ptr<std::atomic<Operation*>[]> fast_slot_members;  // the slots' members

  int size() const { return static_cast<int>(members.size()); }
};

/// The shared state of one call, referred to by its `Work` handle.
struct Operation : std::enable_shared_from_this<Operation> {
  CommOp op = CommOp::kBarrier;
  int rank = 0;                  // the rank of the launch that issued it
  CommGroup* group = nullptr;    // the communicator it was issued on
  int member = 0;                // the issuing rank's rank in `group`
  std::uint64_t call_index = 0;  // in that rank's CallLog
  CallRecord record;
  ConstBuffer input;     // what peers read: send data, collective input
  MutableBuffer output;  // where results go: recv data, collective output
  ReduceOp reduce = ReduceOp::kSum;
  int root = -1;  // broadcast: rank in `group`
  // Split: the new communicator this rank joins (null for Communicator::kNoColor) and its
  // rank there, set by whoever makes them before the call finishes.
  std::shared_ptr<CommGroup> split_into;
  int split_rank = -1;
  DeviceGate gate;  // device buffers: the caller's event, waited for before any data moves
  bool done = false;
  // Whether wait() spins before it sleeps: not for a collective above kSpinBytes (it
  // takes longer than any spin, and the communication threads that run it need the
  // cores a spinning rank holds).
  bool spin = true;
  // Finished lock-free: the rank's CallLog still lists it as pending (with a pointer to
  // `finished`, so that reports leave it out) until the rank's own thread, which alone
  // reads and writes this, records the completion (LocalWorld::close_log).
  bool log_open = false;
  std::exception_ptr error;
  // Simulated sends posted before their receive: a copy of the input (malloc'd, outside the
  // grader's count of what lab code allocates: dp::detail::UncountedHeapAllocations).
  std::unique_ptr<unsigned char, decltype(&std::free)> eager_copy{nullptr, &std::free};
  VirtualCall timing;  // simulated times (when the simulation is on)
  bool ready = false;  // done and, when simulated, its completion time known
  // A large collective's pieces (set, release, once every rank issued it): its rank
  // helps with them when it waits.
  std::atomic<CollectiveSlot*> pieces{nullptr};
  // `ready`, readable without the mutex. A collective that met in a FastSlot is finished
  // lock-free by the last rank to arrive, which sets only this (not done, not ready).
  std::atomic<bool> finished{false};
  std::shared_ptr<CollectiveSlot> slot;  // collectives: where the ranks meet
};

/// Element range [begin, end) of chunk `index` when `count` elements are split `parts` ways.
struct Chunk {
  std::size_t begin;
  std::size_t end;
  std::size_t size() const { return end - begin; }
};

/// The `index`-th of `parts` near-equal chunks of `count` elements.
Chunk chunk_of(std::size_t count, int parts, int index);
/// Reduces elements [src_offset, src_offset + count) of every source into elements
/// [dst_offset, dst_offset + count) of every destination, in rank order (local_reduce.cpp).
void reduce_chunk(std::span<const MutableBuffer> destinations, std::size_t dst_offset,
                  std::span<const ConstBuffer> sources, std::size_t src_offset, std::size_t count,
                  ReduceOp op);
/// Copies `count` elements of `src` from `src_offset` to `dst` at `dst_offset` (host or device).
void copy_elements(MutableBuffer dst, std::size_t dst_offset, ConstBuffer src,
                   std::size_t src_offset, std::size_t count);

/// Runs a small collective whose calls (by rank) match, on the calling thread.
void execute_eager(std::span<Operation* const> members);
/// Runs piece `piece` of a large collective (see CollectiveSlot).
void execute_piece(const CollectiveSlot& slot, std::size_t piece);

class LocalWorld;

/// The `Communicator` of one rank of a `LocalWorld`, on one of its communicators.
class LocalCommunicator final : public Communicator {
 public:
  /// Rank `rank` of `group`.
  LocalCommunicator(LocalWorld& world, CommGroup& group, int rank)
      : world_(world), group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_.size(); }
  std::string_view backend() const override { return "local"; }
  std::unique_ptr<Work> isend(ConstBuffer data, int peer, int tag) override;
  std::unique_ptr<Work> irecv(MutableBuffer data, int peer, int tag) override;
  std::unique_ptr<Work> allreduce(MutableBuffer data, ReduceOp op) override;
  std::unique_ptr<Work> reduce_scatter(ConstBuffer in, MutableBuffer out, ReduceOp op) override;
  std::unique_ptr<Work> allgather(ConstBuffer in, MutableBuffer out) override;
  std::unique_ptr<Work> broadcast(MutableBuffer data, int root) override;
  void barrier() override;
  std::unique_ptr<Communicator> split(int color, int key) override;
  CommCounters counters() const override;
  Clock& clock() override;

 private:
  /// A call of this rank on this communicator, not yet issued.
  std::shared_ptr<Operation> make_operation(CommOp op) const;
  /// This rank's rank in the launch.
  int launch_rank() const { return group_.members[static_cast<std::size_t>(rank_)]; }

  LocalWorld& world_;
  CommGroup& group_;
  int rank_;
};

/// A handle on one `Operation`.
class LocalWork final : public Work {
 public:
  LocalWork(LocalWorld& world, std::shared_ptr<Operation> operation)
      : world_(world), operation_(std::move(operation)) {}
  ~LocalWork() override;
  void wait() override;
  bool test() override;

 private:
  LocalWorld& world_;
  std::shared_ptr<Operation> operation_;
};

/// The ranks of one `launch`, their communication threads and everything they share.
class LocalWorld {
 public:
  LocalWorld(int size, CommOptions options, const SimulationOptions& simulation);
  ~LocalWorld();

  int size() const { return size_; }
  Communicator& communicator(int rank) { return *ranks_[rank].communicator; }
  /// The launch's own communicator (id 0).
  CommGroup& launch_group() { return *groups_.front(); }
  /// The rank's clock: simulated when the simulation is on, else a wall clock.
  Clock& clock(int rank);
  /// The rank's simulated clock, or nullptr without simulation.
  Clock* simulated_clock(int rank);

  /// Issues a point-to-point call to or from `peer` (a rank of the call's communicator);
  /// matches it with the peer's if that one is waiting.
  std::shared_ptr<Operation> post_point_to_point(std::shared_ptr<Operation> operation, int peer,
                                                 int tag);
  /// Issues a collective: queued for the rank's communication thread.
  std::shared_ptr<Operation> post_collective(std::shared_ptr<Operation> operation);
  /// Blocks the calling rank until `operation` completes; throws its error.
  void wait(Operation& operation);
  /// `Work::test()`: true once `operation` completed (simulated: by the rank's clock).
  bool test(Operation& operation);
  /// Records in the rank's log that `operation`, finished, completed (see
  /// Operation::log_open); the rank's own thread calls it before the call goes away.
  void close_log(Operation& operation);
  /// True once `operation` completed (simulated: its completion time is known).
  bool is_ready(const Operation& operation);
  /// Waits for `operation` without throwing (for destructors).
  void wait_quietly(Operation& operation);

  /// The counters of rank `member` of `group` (that rank's own thread only).
  CommCounters counters(const CommGroup& group, int member) const;

  /// Ends every rank's pending and future calls with `reason`.
  void abort(const std::string& reason);
  /// Rank `rank` has returned (or thrown) from its function.
  void mark_finished(int rank);
  /// Waits until every rank has returned from its function; after an abort, for at most
  /// the abort's grace. Returns the ranks still running then (empty when all returned).
  std::vector<int> wait_for_ranks();
  /// Why the ranks were aborted ("" if they were not).
  std::string abort_reason() const;

 private:
  struct Rank {
    std::unique_ptr<LocalCommunicator> communicator;  // on the launch's communicator
    CallLog log;
    std::deque<std::shared_ptr<Operation>> collective_queue;  // for the comm thread
    // Without the simulation: large collectives whose pieces the comm thread works on.
    PreallocatedQueue<std::shared_ptr<CollectiveSlot>> piece_queue;
    std::thread comm_thread;
    bool comm_thread_waiting_for_peers = false;
    std::optional<std::uint64_t> blocked_on;  // call the rank's own thread waits for
    bool finished = false;
  };

  /// Point-to-point calls waiting for their match, per (communicator, source, destination,
  /// tag), the ranks those of the launch.
  struct Mailbox {
    std::deque<std::shared_ptr<Operation>> sends;
    std::deque<std::shared_ptr<Operation>> receives;
  };

  /// A communicator of `members` (ranks of the launch, in order), registered in groups_
  /// (caller holds mutex_, or the constructor runs).
  std::shared_ptr<CommGroup> make_group(std::vector<int> members, std::string name);
  /// Makes the communicators of a split whose calls (by rank in the communicator split)
  /// all arrived and match, and hands each call its own (caller holds mutex_).
  void make_split(std::span<Operation* const> members);
  void run_comm_thread(int rank);
  void execute_collective(int rank, CollectiveSlot& slot, std::unique_lock<std::mutex>& lock);
  void phase_barrier(CollectiveSlot& slot, int phase, std::unique_lock<std::mutex>& lock);
  void transfer(const std::shared_ptr<Operation>& send, const std::shared_ptr<Operation>& receive,
                std::unique_lock<std::mutex>& lock);
  void complete(Operation& operation, std::exception_ptr error);
  // Counts a collective in the rank's counters; returns the bytes it moves over links.
  std::uint64_t count_collective(Operation& operation);
  // The lock-free rendezvous without the simulation (see FastSlot).
  std::shared_ptr<Operation> post_fast_collective(std::shared_ptr<Operation> operation);
  void wait_for_fast_slot(FastSlot& slot, std::uint64_t sequence, const Operation& operation);
  void run_full_slot(CommGroup& group, FastSlot& slot, std::uint64_t sequence);
  void finish_lock_free(std::span<Operation* const> members);
  // A large collective's pieces: claims and runs them until none is left.
  void run_pieces(CollectiveSlot& slot);
  // Spins until `operation` is ready; false if it is not after
  // spin_policy_.before_sleep or the ranks were aborted.
  bool spin_until_ready(Operation& operation);
  // Simulation: what follows a change of virtual state (caller holds mutex_).
  void issue_virtual(Operation& operation, std::uint64_t link_bytes);
  void settle();
  void mark_ready_if_complete(Operation& operation);
  std::optional<std::string> find_mismatch(const CommGroup& group, std::uint64_t sequence,
                                           std::span<const Operation* const> members) const;
  void check_for_deadlock();
  std::string hang_report(const std::string& headline) const;
  void abort_locked(const std::string& reason,
                    std::optional<std::chrono::milliseconds> grace = std::nullopt,
                    bool hang = false);
  /// The error every call of an aborted world ends with: HangError after a hang report,
  /// CommError otherwise.
  std::exception_ptr abort_error() const;
  void throw_if_aborted() const;

  const int size_;
  const CommOptions options_;
  const int ranks_per_node_;  // the launch's node layout (dp/comm.h, "Link classes")
  mutable std::mutex mutex_;
  std::unique_ptr<VirtualNetwork> network_;              // null without simulation
  std::vector<std::unique_ptr<WallClock>> wall_clocks_;  // without simulation
  std::condition_variable changed_;                      // a call became ready: for waiting ranks
  std::condition_variable comm_changed_;                 // work for the communication threads
  std::condition_variable finished_changed_;  // a rank returned, or the ranks were aborted
  std::vector<Rank> ranks_;
  // Every communicator of the launch, the launch's own first; new ones are added under
  // mutex_ (a split), and none goes before the world does.
  std::vector<std::shared_ptr<CommGroup>> groups_;
  // Ranks inside the sleeping part of wait() (under mutex_). Whoever finishes a call
  // lock-free reads it after marking the call finished, and takes the mutex to wake the
  // ranks only when it is not zero: both sides use seq_cst (a store, then a load of the
  // other's variable), so either the waiter sees the call finished before it sleeps or
  // the finisher sees the waiter and wakes it. No wake-up is lost and a rank that spins
  // costs its peers no system call.
  std::atomic<int> sleepers_{0};
  const SpinPolicy spin_policy_;  // by whether every rank has a core
  std::map<std::tuple<std::uint64_t, int, int, int>, Mailbox> mailboxes_;
  int transfers_in_flight_ = 0;  // copies and collective phases running outside the lock
  bool shutting_down_ = false;
  std::optional<std::string> abort_reason_;
  bool abort_is_hang_ = false;           // abort_reason_ is a hang report (HangError)
  std::atomic<bool> aborted_{false};     // abort_reason_ is set, readable without the mutex
  WallTime::time_point abort_deadline_;  // when `launch` stops waiting for the ranks
};

}  // namespace dp::detail::local
