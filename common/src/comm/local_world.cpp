// local_world.cpp: the ranks of one local launch: their lifecycle and clocks, the
// simulation's bookkeeping, waiting for a call, aborts, and the deadlock and hang reports
// (see local_world.h).
#include "comm/local_world.h"

namespace dp::detail::local {

LocalWorld::LocalWorld(int size, CommOptions options, const SimulationOptions& simulation)
    : size_(size),
      options_(options),
      ranks_per_node_(simulation.network.ranks_per_node),
      ranks_(static_cast<std::size_t>(size)),
      spin_policy_(size <= usable_cores() ? kSpinOnOwnCores : kSpinOnSharedCores) {
  if (simulation.enabled) {
    network_ = std::make_unique<VirtualNetwork>(size, simulation, mutex_);
  } else {
    for (int r = 0; r < size_; ++r) wall_clocks_.push_back(std::make_unique<WallClock>(r, false));
  }
  std::vector<int> everyone(static_cast<std::size_t>(size));
  for (int r = 0; r < size_; ++r) everyone[static_cast<std::size_t>(r)] = r;
  CommGroup& launch = *make_group(std::move(everyone), "");
  for (int r = 0; r < size_; ++r)
    ranks_[r].communicator = std::make_unique<LocalCommunicator>(*this, launch, r);
  for (int r = 0; r < size_; ++r)
    ranks_[r].comm_thread = std::thread([this, r] { run_comm_thread(r); });
}

std::shared_ptr<CommGroup> LocalWorld::make_group(std::vector<int> members, std::string name) {
  auto group = std::make_shared<CommGroup>();
  group->id = groups_.size();
  group->name = std::move(name);
  group->members = std::move(members);
  group->layout.launch_ranks = group->members;
  group->layout.ranks_per_node = ranks_per_node_;
  const auto p = group->members.size();
  group->counters.resize(p);
  for (CommCounters& counters : group->counters) {
    counters.bytes_sent_to.assign(p, 0);
    counters.bytes_received_from.assign(p, 0);
  }
  group->next_sequence.assign(p, 0);
  if (!network_) {
    group->fast_slots = std::make_unique<FastSlot[]>(kFastSlots);
    // Each slot's members start a cache line of their own (8 pointers), so that
    // consecutive collectives do not share one.
    const std::size_t stride = (p + 7) / 8 * 8;
    group->fast_slot_members = std::make_unique<std::atomic<Operation*>[]>(kFastSlots * stride);
    for (std::uint64_t i = 0; i < kFastSlots; ++i) {
      FastSlot& slot = group->fast_slots[i];
      slot.sequence.store(i, std::memory_order_relaxed);
      slot.members = &group->fast_slot_members[i * stride];
      for (std::size_t r = 0; r < p; ++r) slot.members[r].store(nullptr, std::memory_order_relaxed);
    }
  }
  groups_.push_back(group);
  return group;
}

void LocalWorld::make_split(std::span<Operation* const> members) {
  // Caller holds mutex_. Every member's call is here and they match.
  const CommGroup& parent = *members.front()->group;
  std::vector<int> colors;
  std::vector<int> keys;
  for (const Operation* member : members) {
    colors.push_back(member->record.color);
    keys.push_back(member->record.key);
  }
  const dp::detail::UncountedHeapAllocations runtime_state;  // the backend's, not the lab's
  for (const std::vector<int>& ranks : split_groups(colors, keys)) {
    std::vector<int> launch_ranks;
    for (int r : ranks) launch_ranks.push_back(parent.members[static_cast<std::size_t>(r)]);
    const std::string name =
        fmt::format("communicator {} (ranks {} of the launch, split from {})", groups_.size(),
                    fmt::join(launch_ranks, ", "),
                    parent.name.empty() ? std::string("the launch's") : parent.name);
    const std::shared_ptr<CommGroup> made = make_group(std::move(launch_ranks), name);
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      Operation& call = *members[static_cast<std::size_t>(ranks[i])];
      call.split_into = made;
      call.split_rank = static_cast<int>(i);
    }
  }
}

LocalWorld::~LocalWorld() {
  {
    std::lock_guard lock(mutex_);
    shutting_down_ = true;
  }
  comm_changed_.notify_all();
  for (auto& rank : ranks_) rank.comm_thread.join();
}

void LocalWorld::throw_if_aborted() const {
  if (abort_reason_) std::rethrow_exception(abort_error());
}

std::exception_ptr LocalWorld::abort_error() const {
  return abort_is_hang_ ? std::make_exception_ptr(HangError(*abort_reason_))
                        : std::make_exception_ptr(CommError(*abort_reason_));
}

void LocalWorld::abort(const std::string& reason) {
  std::lock_guard lock(mutex_);
  abort_locked(reason);
}

void LocalWorld::abort_locked(const std::string& reason,
                              std::optional<std::chrono::milliseconds> grace, bool hang) {
  if (abort_reason_) return;  // the first reason is the root cause
  abort_reason_ = reason;
  abort_is_hang_ = hang;
  aborted_.store(true, std::memory_order_release);
  // A rank that failed may leave its peers in the middle of long computations: they get a
  // hang timeout to come back. After a hang every rank inside dplab returns at once.
  abort_deadline_ = WallTime::now() + grace.value_or(options_.hang_timeout);
  if (network_) network_->clear();  // no more virtual times: every pending call will fail
  // Unmatched messages and collectives some rank never issued will never complete
  // now; the communication threads end their own collectives.
  const auto error = abort_error();
  for (auto& [key, mailbox] : mailboxes_) {
    for (auto& operation : mailbox.sends)
      if (!operation->done) complete(*operation, error);  // not an eager send
    for (auto& operation : mailbox.receives) complete(*operation, error);
  }
  mailboxes_.clear();
  // Collectives some rank never issued will never complete either. A slot whose ranks
  // all arrived is running (its last rank finishes it); the others are closed, and the
  // calls in them end here, each taken out so that no one else ends it too.
  for (const std::shared_ptr<CommGroup>& group : groups_) {
    if (!group->fast_slots) continue;
    const int p = group->size();
    for (std::uint64_t i = 0; i < kFastSlots; ++i) {
      FastSlot& slot = group->fast_slots[i];
      const std::uint32_t arrived =
          slot.arrivals.fetch_or(FastSlot::kClosed, std::memory_order_acq_rel);
      if ((arrived & ~FastSlot::kClosed) == static_cast<std::uint32_t>(p)) continue;
      for (int r = 0; r < p; ++r)
        if (Operation* member = slot.members[r].exchange(nullptr, std::memory_order_acq_rel))
          complete(*member, error);
    }
  }
  changed_.notify_all();
  comm_changed_.notify_all();
  finished_changed_.notify_all();
}

std::string LocalWorld::abort_reason() const {
  std::lock_guard lock(mutex_);
  return abort_reason_.value_or("");
}

std::vector<int> LocalWorld::wait_for_ranks() {
  std::unique_lock lock(mutex_);
  const auto all_returned = [&] {
    return std::all_of(ranks_.begin(), ranks_.end(),
                       [](const Rank& rank) { return rank.finished; });
  };
  while (!all_returned()) {
    if (!abort_reason_) {
      finished_changed_.wait(lock);
    } else if (finished_changed_.wait_until(lock, abort_deadline_) == std::cv_status::timeout &&
               !all_returned()) {
      break;
    }
  }
  std::vector<int> running;
  for (int r = 0; r < size_; ++r)
    if (!ranks_[r].finished) running.push_back(r);
  return running;
}

void LocalWorld::mark_finished(int rank) {
  std::lock_guard lock(mutex_);
  ranks_[rank].finished = true;
  finished_changed_.notify_all();
  if (network_) {
    network_->finish(rank);
    settle();
  }
  check_for_deadlock();
}

Clock& LocalWorld::clock(int rank) {
  if (network_) return network_->clock(rank);
  return *wall_clocks_[static_cast<std::size_t>(rank)];
}

Clock* LocalWorld::simulated_clock(int rank) {
  return network_ ? &network_->clock(rank) : nullptr;
}

void LocalWorld::issue_virtual(Operation& operation, std::uint64_t link_bytes) {
  // Caller holds mutex_ and runs on the issuing rank's thread.
  VirtualCall& timing = operation.timing;
  timing.owner = &operation;
  timing.rank = operation.rank;
  timing.op = operation.op;
  timing.link_bytes = link_bytes;
  timing.wall_issue = WallTime::now();
  timing.communicator = operation.group->id;
  timing.member = operation.member;
  if (operation.group->id != 0) timing.members = operation.group->members;
  timing.root = std::max(operation.root, 0);
  network_->clock(operation.rank).call_issued();
  switch (operation.op) {
    case CommOp::kSend:
      timing.bytes = operation.input.bytes();
      network_->issue_send(timing);
      return;
    case CommOp::kRecv:
      timing.bytes = operation.output.bytes();
      network_->issue_receive(timing);
      return;
    case CommOp::kReduceScatter: timing.bytes = operation.input.bytes(); break;
    default: timing.bytes = operation.output.bytes(); break;  // the whole array
  }
  network_->issue_collective(timing);
}

void LocalWorld::settle() {
  // Caller holds mutex_: commit what can be committed, then finish the calls whose data
  // had already moved.
  network_->advance();
  for (VirtualCall* call : network_->take_determined())
    mark_ready_if_complete(*static_cast<Operation*>(call->owner));
}

void LocalWorld::mark_ready_if_complete(Operation& operation) {
  // Caller holds mutex_.
  if (operation.ready || !operation.done) return;
  if (network_ && !operation.error && !operation.timing.determined) return;
  operation.ready = true;
  operation.finished.store(true, std::memory_order_release);
  Rank& owner = ranks_[operation.rank];
  if (network_ && operation.error) {
    network_->forget(operation.timing);
    network_->clock(operation.rank).call_finished(std::nullopt);
  }
  if (network_ && !operation.error) {
    const VirtualCall& timing = operation.timing;
    SimClock& clock = network_->clock(operation.rank);
    TraceEvent event;
    switch (operation.op) {
      case CommOp::kSend: event.name = fmt::format("send to {}", timing.peer); break;
      case CommOp::kRecv: event.name = fmt::format("recv from {}", timing.peer); break;
      default: event.name = std::string(to_string(operation.op)); break;
    }
    const bool point_to_point = operation.op == CommOp::kSend || operation.op == CommOp::kRecv;
    const bool across =
        point_to_point && network_->options().network.crosses_nodes(operation.rank, timing.peer);
    if (operation.op == CommOp::kRecv)
      event.lane = across ? TraceLane::kInterNodeReceive : TraceLane::kReceive;
    else
      event.lane = across ? TraceLane::kInterNodeSend : TraceLane::kSend;
    event.start = timing.start;
    event.duration = timing.end - timing.start;
    event.wall_start = clock.wall_seconds(timing.wall_issue);
    event.wall_duration =
        std::chrono::duration<double>(WallTime::now() - timing.wall_issue).count();
    event.bytes = timing.link_bytes;
    event.peer = timing.peer;
    clock.call_finished(std::move(event));
  }
  if (owner.blocked_on == operation.call_index) owner.blocked_on.reset();
  changed_.notify_all();
}

CommCounters LocalWorld::counters(const CommGroup& group, int member) const {
  std::lock_guard lock(mutex_);
  return group.counters[static_cast<std::size_t>(member)];
}

void LocalWorld::complete(Operation& operation, std::exception_ptr error) {
  // Caller holds mutex_.
  operation.done = true;
  operation.error = std::move(error);
  ranks_[operation.rank].log.complete(operation.call_index);
  mark_ready_if_complete(operation);  // notifies the waiters when the call is ready
  // Simulated, the data can move before the call's time is known: then only the wait
  // after an abort (for the data, see wait()) needs to hear of it.
  if (!operation.ready && abort_reason_) changed_.notify_all();
}

std::optional<std::string> LocalWorld::find_mismatch(
    const CommGroup& group, std::uint64_t sequence,
    std::span<const Operation* const> members) const {
  // The usual case, checked on every collective: all match, and no text is made.
  const CallRecord& first = members[0]->record;
  if (std::all_of(members.begin(), members.end(),
                  [&](const Operation* member) { return same_signature(member->record, first); }))
    return std::nullopt;
  std::map<std::string, std::vector<int>> ranks_by_signature;
  for (std::size_t r = 0; r < members.size(); ++r)
    ranks_by_signature[members[r]->record.signature()].push_back(static_cast<int>(r));
  if (ranks_by_signature.size() == 1) return std::nullopt;
  std::vector<std::string> parts;
  for (const auto& [signature, ranks] : ranks_by_signature)
    parts.push_back(fmt::format("rank{} {} called {}", ranks.size() > 1 ? "s" : "",
                                fmt::join(ranks, ", "), signature));
  return fmt::format("collective #{}{} does not match across ranks: {}", sequence,
                     group.name.empty() ? "" : " of " + group.name, fmt::join(parts, "; "));
}

void LocalWorld::check_for_deadlock() {
  // Caller holds mutex_. Progress is possible while any transfer runs, any communication
  // thread has work it is not blocked on, or any rank's own thread is running.
  if (abort_reason_ || transfers_in_flight_ > 0) return;
  for (const Rank& rank : ranks_) {
    if (!rank.blocked_on && !rank.finished) return;
    if (!rank.collective_queue.empty() && !rank.comm_thread_waiting_for_peers) return;
    if (!rank.piece_queue.empty()) return;
  }
  bool anyone_waits = false;
  for (const Rank& rank : ranks_) anyone_waits = anyone_waits || rank.blocked_on.has_value();
  if (!anyone_waits) return;  // everyone has finished: that is the end, not a deadlock
  abort_locked(
      hang_report("dplab: deadlock: every rank is waiting and no communication can make progress"),
      kStuckRankGrace, /*hang=*/true);
}

std::string LocalWorld::hang_report(const std::string& headline) const {
  std::vector<RankCallState> states;
  for (int r = 0; r < size_; ++r)
    states.push_back(ranks_[r].log.snapshot(r, ranks_[r].blocked_on, ranks_[r].finished));
  return format_hang_report(headline, states);
}

bool LocalWorld::spin_until_ready(Operation& operation) {
  const auto start = WallTime::now();
  bool yielding = false;
  for (unsigned round = 1;; ++round) {
    if (operation.finished.load(std::memory_order_acquire)) return true;
    if (aborted_.load(std::memory_order_acquire)) return false;
    if (yielding) {
      std::this_thread::yield();
    } else {
      cpu_relax();
    }
    if (yielding || round % 64 == 0) {
      const auto waited = WallTime::now() - start;
      if (waited > spin_policy_.before_sleep) return false;
      yielding = waited > spin_policy_.spin_only;
    }
  }
}

void LocalWorld::wait(Operation& operation) {
  // Without the simulation a ready call needs nothing under the lock: the fast path.
  if (!network_) {
    // A large collective: work on its pieces, if every rank has issued it already.
    if (CollectiveSlot* pieces = operation.pieces.load(std::memory_order_acquire))
      run_pieces(*pieces);
  }
  if (!network_ && (operation.spin ? spin_until_ready(operation) : is_ready(operation))) {
    close_log(operation);
    if (operation.error) std::rethrow_exception(operation.error);
    return;
  }
  std::unique_lock lock(mutex_, std::defer_lock);
  lock_spinning(lock);
  // From here on this rank may sleep: a call finished lock-free must wake it (see
  // sleepers_). The increment comes before every check of `finished` below.
  sleepers_.fetch_add(1, std::memory_order_seq_cst);
  struct LeaveSleepers {
    std::atomic<int>& count;
    ~LeaveSleepers() { count.fetch_sub(1, std::memory_order_relaxed); }
  } leave_sleepers{sleepers_};
  // `ready` or, for a call finished lock-free, `finished` alone: the same thing here.
  const auto ready = [&] { return operation.finished.load(std::memory_order_seq_cst); };
  // On the simulated clock, returning moves the rank's compute time to the completion.
  const auto finish = [&] {
    close_log(operation);
    if (operation.error) std::rethrow_exception(operation.error);
    if (network_) {
      network_->clock(operation.rank).advance_to(operation.timing.completion);
      network_->block(operation.rank, nullptr);
      network_->publish(operation.rank);
      settle();
    }
  };
  if (network_ && !ready()) {
    network_->publish(operation.rank);
    network_->block(operation.rank, &operation.timing);
    settle();
  }
  // The call usually needs only the peers' next few steps (a matching send, the last
  // rank of a collective, the simulation's commit): on a machine with fewer cores than
  // threads, yielding to them a few times is cheaper than sleeping and being woken.
  if (!ready()) {
    for (int i = 0; i < 8 && !ready() && !abort_reason_; ++i) {
      lock.unlock();
      std::this_thread::yield();
      lock.lock();
    }
  }
  if (ready()) return finish();
  Rank& self = ranks_[operation.rank];
  self.blocked_on = operation.call_index;
  check_for_deadlock();
  const auto deadline = WallTime::now() + options_.hang_timeout;
  const bool finished =
      changed_.wait_until(lock, deadline, [&] { return ready() || abort_reason_.has_value(); });
  self.blocked_on.reset();
  if (!finished) {
    const double seconds = std::chrono::duration<double>(options_.hang_timeout).count();
    // Report before clearing: the hung rank's own call is part of the report.
    self.blocked_on = operation.call_index;
    const std::string report =
        hang_report(fmt::format("dplab: timeout: rank {} waited {:.1f} s for {}", operation.rank,
                                seconds, operation.record.describe()));
    self.blocked_on.reset();
    abort_locked(report, kStuckRankGrace, /*hang=*/true);
  }
  // After an abort every call completes soon (with an error, unless its data was already
  // moving): waiting for that keeps a peer from reading a buffer this rank unwinds.
  changed_.wait(lock, [&] { return operation.done || ready(); });
  if (abort_reason_ && !ready()) {
    // Its data moved but it will never get a virtual time: report the abort.
    if (network_) network_->block(operation.rank, nullptr);
    if (!operation.error) std::rethrow_exception(abort_error());
  }
  finish();
}

void LocalWorld::wait_quietly(Operation& operation) {
  try {
    wait(operation);
  } catch (const std::exception&) {
    // The error was, or will be, reported through another call.
  }
}

bool LocalWorld::is_ready(const Operation& operation) {
  return operation.finished.load(std::memory_order_acquire);
}

void LocalWorld::close_log(Operation& operation) {
  if (!operation.log_open) return;
  operation.log_open = false;
  ranks_[operation.rank].log.complete(operation.call_index);
}

bool LocalWorld::test(Operation& operation) {
  if (!network_) {
    if (!operation.finished.load(std::memory_order_acquire)) return false;
    close_log(operation);
    return true;
  }
  std::lock_guard lock(mutex_);
  network_->publish(operation.rank);
  settle();
  return operation.ready &&
         (operation.error || operation.timing.completion <= network_->clock(operation.rank).now());
}

}  // namespace dp::detail::local
