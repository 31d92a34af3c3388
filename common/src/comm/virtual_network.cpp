// The simulated interconnect and clocks of the local backend (see virtual_network.h).
#include "comm/virtual_network.h"

#include <fmt/format.h>
#include <time.h>

#include <algorithm>
#include <limits>
#include <tuple>

#include "dp/error.h"

namespace dp::detail {
namespace {

std::int64_t thread_cpu_ns() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<std::int64_t>(now.tv_sec) * 1'000'000'000 + now.tv_nsec;
}

}  // namespace

// --- SimClock ------------------------------------------------------------------------------

SimClock::SimClock(int rank, const SimulationOptions& options, std::mutex& mutex,
                   const VirtualNetwork& network, Steady::time_point epoch)
    : rank_(rank), options_(options), mutex_(mutex), network_(network), epoch_(epoch) {}

double SimClock::link_free() const {
  std::lock_guard lock(mutex_);
  return network_.link_free(rank_);
}

double SimClock::wall_seconds(Steady::time_point time) const {
  return std::chrono::duration<double>(time - epoch_).count();
}

ComputeStart SimClock::start_compute() const {
  ComputeStart start;
  start.wall = Steady::now();
  if (options_.compute == ComputeModel::kMeasured) start.cpu_ns = thread_cpu_ns();
  return start;
}

void SimClock::finish_compute(const ComputeStart& start, std::string_view name,
                              std::string_view phase, const OpCost& cost) {
  const double seconds = options_.compute == ComputeModel::kMeasured
                             ? static_cast<double>(thread_cpu_ns() - start.cpu_ns) * 1e-9
                             : options_.device.time_of(cost);
  {
    // Kept even without a trace: the step summaries are made of them (then folded).
    TraceEvent event;
    event.name = phase.empty() ? std::string(name) : fmt::format("{} {}", name, phase);
    event.lane = TraceLane::kCompute;
    event.start = now_;
    event.duration = seconds;
    event.wall_start = wall_seconds(start.wall);
    event.wall_duration = std::chrono::duration<double>(Steady::now() - start.wall).count();
    event.flops = cost.flops;
    event.bytes = static_cast<std::uint64_t>(cost.bytes);
    compute_events_.push_back(std::move(event));
  }
  now_ += seconds;
}

void SimClock::compute(std::string_view name, double seconds) {
  if (!(seconds >= 0))
    throw Error(fmt::format("Clock::compute(\"{}\", {}): expected seconds >= 0", name, seconds));
  {
    TraceEvent event;
    event.name = std::string(name);
    event.lane = TraceLane::kCompute;
    event.start = now_;
    event.duration = seconds;
    event.wall_start = wall_seconds(Steady::now());
    compute_events_.push_back(std::move(event));
  }
  now_ += seconds;
}

void SimClock::mark_step() {
  step_marks_.push_back(now_);
  if (options_.record_trace) return;
  std::lock_guard lock(mutex_);
  fold_finished_steps();
}

void SimClock::call_finished(std::optional<TraceEvent> event) {
  --calls_in_flight_;
  if (event) communication_events_.push_back(std::move(*event));
}

void SimClock::fold_finished_steps() {
  // Exact only when every event of the closed steps is here: no call of this rank is still
  // on its way, and nothing recorded reaches past the last mark. Otherwise try again at the
  // next mark (memory then grows only while calls stay in flight across steps).
  if (calls_in_flight_ > 0 || step_marks_.size() < 2) return;
  const double last_mark = step_marks_.back();
  for (const std::vector<TraceEvent>* events : {&compute_events_, &communication_events_})
    for (const TraceEvent& event : *events)
      if (event.start + event.duration > last_mark) return;
  RankTrace closed;
  closed.step_marks = step_marks_;
  closed.events = compute_events_;
  closed.events.insert(closed.events.end(), communication_events_.begin(),
                       communication_events_.end());
  for (const StepSummary& step : summarize_steps(closed)) add_step(folded_, step);
  compute_events_.clear();
  communication_events_.clear();
  step_marks_.assign(1, last_mark);
}

RankTrace SimClock::trace() const {
  RankTrace trace;
  trace.rank = rank_;
  trace.simulated = true;
  trace.clock_description = "simulated: " + options_.describe();
  trace.step_marks = step_marks_;
  trace.events = compute_events_;
  {
    std::lock_guard lock(mutex_);
    trace.events.insert(trace.events.end(), communication_events_.begin(),
                        communication_events_.end());
    trace.folded = folded_;
  }
  // Communication events are recorded when their data has moved, in wall-clock order: sort
  // by virtual time (ties by what they are) so that the same run gives the same list.
  std::stable_sort(trace.events.begin(), trace.events.end(),
                   [](const TraceEvent& a, const TraceEvent& b) {
                     return std::tie(a.start, a.lane, a.duration, a.peer, a.name) <
                            std::tie(b.start, b.lane, b.duration, b.peer, b.name);
                   });
  return trace;
}

// --- VirtualNetwork ------------------------------------------------------------------------

VirtualNetwork::VirtualNetwork(int size, SimulationOptions options, std::mutex& mutex)
    : size_(size),
      options_(std::move(options)),
      floor_(static_cast<std::size_t>(size), 0.0),
      counter_(static_cast<std::size_t>(size), 0),
      all_ranks_(static_cast<std::size_t>(size)),
      blocked_(static_cast<std::size_t>(size), nullptr),
      finished_(static_cast<std::size_t>(size), false),
      network_(options_.network) {
  network_.validate();
  for (int r = 0; r < size_; ++r) all_ranks_[static_cast<std::size_t>(r)] = r;
  // Ports [0, size): each rank's port on the fabric; then the NICs, node by node.
  const int nodes = network_.ranks_per_node > 0
                        ? (size_ + network_.ranks_per_node - 1) / network_.ranks_per_node
                        : 0;
  const auto ports = static_cast<std::size_t>(size_ + nodes * network_.effective_nics_per_node());
  send_timeline_.resize(ports);
  receive_timeline_.resize(ports);
  const DeviceModel& device = options_.device;
  if (!(device.flops_per_second > 0) || !(device.bytes_per_second > 0) ||
      !(device.launch_seconds >= 0))
    throw Error(fmt::format("simulated device {}: expected positive rates and a launch cost >= 0",
                            device.name));
  const auto epoch = Steady::now();
  for (int r = 0; r < size_; ++r)
    clocks_.push_back(std::make_unique<SimClock>(r, options_, mutex, *this, epoch));
}

VirtualNetwork::~VirtualNetwork() = default;

VirtualNetwork::Key VirtualNetwork::next_key(int rank, double issue) {
  return {issue, rank, counter_[static_cast<std::size_t>(rank)]++};
}

void VirtualNetwork::publish(int rank) {
  double& floor = floor_[static_cast<std::size_t>(rank)];
  floor = std::max(floor, clock(rank).now());
}

void VirtualNetwork::issue_send(VirtualCall& send) {
  publish(send.rank);
  send.issue = clock(send.rank).now();
  const Key key = next_key(send.rank, send.issue);
  send.counter = std::get<2>(key);
  send.pending = true;
  queue_[key] = Item{&send, {0, 0}};
}

void VirtualNetwork::issue_receive(VirtualCall& receive) {
  publish(receive.rank);
  receive.issue = clock(receive.rank).now();
}

void VirtualNetwork::match(VirtualCall& send, VirtualCall& receive) {
  send.match = &receive;
  receive.match = &send;
  if (send.committed) determine_receive(receive, send);
}

void VirtualNetwork::issue_collective(VirtualCall& call) {
  publish(call.rank);
  call.issue = clock(call.rank).now();
  const Key key = next_key(call.rank, call.issue);
  call.counter = std::get<2>(key);
  call.group = collective_index_[{call.communicator, call.rank}]++;
  const GroupKey group_key{call.communicator, call.group};
  Group& group = groups_[group_key];
  const std::size_t p = members_of(call).size();
  if (group.members.empty()) group.members.assign(p, nullptr);
  group.members[static_cast<std::size_t>(call.member)] = &call;
  group.latest = std::max(group.latest, key);
  if (++group.issued == static_cast<int>(p)) queue_[group.latest] = Item{nullptr, group_key};
}

void VirtualNetwork::block(int rank, VirtualCall* call) {
  blocked_[static_cast<std::size_t>(rank)] = call;
  if (call != nullptr && call->determined) {
    double& floor = floor_[static_cast<std::size_t>(rank)];
    floor = std::max(floor, call->completion);
  }
}

void VirtualNetwork::finish(int rank) {
  finished_[static_cast<std::size_t>(rank)] = true;
}

void VirtualNetwork::forget(VirtualCall& call) {
  if (cleared_) return;  // nothing refers to calls any more; their matches may be gone
  if (call.pending) {
    queue_.erase(Key{call.issue, call.rank, call.counter});
    call.pending = false;
  }
  if (call.match != nullptr) {
    call.match->match = nullptr;
    call.match = nullptr;
  }
  if (is_collective(call.op)) {
    auto group = groups_.find({call.communicator, call.group});
    if (group != groups_.end() &&
        group->second.members[static_cast<std::size_t>(call.member)] == &call)
      group->second.members[static_cast<std::size_t>(call.member)] = nullptr;
  }
  VirtualCall*& blocked = blocked_[static_cast<std::size_t>(call.rank)];
  if (blocked == &call) blocked = nullptr;
  determined_.erase(std::remove(determined_.begin(), determined_.end(), &call), determined_.end());
}

void VirtualNetwork::clear() {
  cleared_ = true;
  queue_.clear();
  groups_.clear();
  determined_.clear();
  std::fill(blocked_.begin(), blocked_.end(), nullptr);
}

bool VirtualNetwork::committable(const Key& key) const {
  for (int q = 0; q < size_; ++q) {
    const auto index = static_cast<std::size_t>(q);
    if (finished_[index]) continue;
    // Blocked on a call whose time is unknown: it issues nothing before that call is
    // committed, which is after this item.
    if (blocked_[index] != nullptr && !blocked_[index]->determined) continue;
    if (Key{floor_[index], q, counter_[index]} > key) continue;
    return false;
  }
  return true;
}

void VirtualNetwork::advance() {
  if (cleared_) return;
  while (!queue_.empty()) {
    auto first = queue_.begin();
    if (!committable(first->first)) break;
    const Item item = first->second;
    queue_.erase(first);
    if (item.send != nullptr)
      commit_send(*item.send);
    else
      commit_collective(item.group);
  }
  prune();
}

double VirtualNetwork::earliest_common_gap(double earliest, double duration, const Timeline& a,
                                           const Timeline& b) {
  // Move t past every interval that overlaps [t, t + duration), on either timeline, until
  // none does; the intervals are sorted, so each is passed at most once.
  double t = earliest;
  std::size_t i = 0;
  std::size_t j = 0;
  for (bool moved = true; moved;) {
    moved = false;
    for (auto [timeline, index] : {std::pair{&a, &i}, std::pair{&b, &j}}) {
      const auto& busy = timeline->busy;
      while (*index < busy.size() && busy[*index].second <= t) ++*index;
      if (*index < busy.size() && busy[*index].first < t + duration) {
        t = busy[*index].second;
        moved = true;
      }
    }
  }
  return t;
}

void VirtualNetwork::reserve(Timeline& timeline, double start, double end) {
  timeline.free_after = std::max(timeline.free_after, end);
  if (end <= start) return;  // an empty message holds nothing
  const auto place =
      std::lower_bound(timeline.busy.begin(), timeline.busy.end(), std::pair{start, end});
  timeline.busy.insert(place, {start, end});
}

void VirtualNetwork::prune() {
  // No message can start before the horizon: every rank issues at its floor or later, and
  // the queue's first item is its earliest.
  double horizon =
      queue_.empty() ? std::numeric_limits<double>::infinity() : std::get<0>(queue_.begin()->first);
  for (int q = 0; q < size_; ++q)
    if (!finished_[static_cast<std::size_t>(q)])
      horizon = std::min(horizon, floor_[static_cast<std::size_t>(q)]);
  for (auto* timelines : {&send_timeline_, &receive_timeline_})
    for (Timeline& timeline : *timelines) {
      auto& busy = timeline.busy;
      const auto kept = std::find_if(busy.begin(), busy.end(), [&](const auto& interval) {
        return interval.second > horizon;
      });
      busy.erase(busy.begin(), kept);
    }
}

std::size_t VirtualNetwork::port_of(int rank, bool across_nodes) const {
  return static_cast<std::size_t>(across_nodes ? size_ + network_.nic_of(rank) : rank);
}

void VirtualNetwork::commit_send(VirtualCall& send) {
  const int s = send.rank;
  const int d = send.peer;
  const bool across = network_.crosses_nodes(s, d);
  const LinkModel& link = network_.link_between(s, d);
  Timeline& sender = send_timeline_[port_of(s, across)];
  Timeline& receiver = receive_timeline_[port_of(d, across)];
  // Only the transfer holds the two directions; the latency follows it off the link.
  const double transfer = static_cast<double>(send.bytes) / link.bytes_per_second;
  send.start = earliest_common_gap(send.issue, transfer, sender, receiver);
  send.end = send.start + transfer;
  send.arrival = send.end + link.alpha_seconds;
  reserve(sender, send.start, send.end);
  reserve(receiver, send.start, send.end);
  send.completion = send.arrival;
  send.pending = false;
  send.committed = true;
  determine(send);
  if (send.match != nullptr) determine_receive(*send.match, send);
}

void VirtualNetwork::determine_receive(VirtualCall& receive, VirtualCall& send) {
  receive.start = send.start;
  receive.end = send.end;
  receive.arrival = send.arrival;
  receive.completion = std::max(send.arrival, receive.issue);
  determine(receive);
  // Both times are final: neither needs the other again (and may outlive it).
  receive.match = nullptr;
  send.match = nullptr;
}

std::span<const int> VirtualNetwork::members_of(const VirtualCall& call) const {
  return call.members.empty() ? std::span<const int>(all_ranks_) : call.members;
}

double VirtualNetwork::collective_seconds(const VirtualCall& call) const {
  const std::span<const int> members = members_of(call);
  const int p = static_cast<int>(members.size());
  if (p == 1) return 0.0;
  const double n = static_cast<double>(call.bytes);
  const double steps = p - 1;
  switch (call.op) {
    case CommOp::kAllReduce: return 2 * steps * network_.ring_step_seconds(members, n / p);
    case CommOp::kReduceScatter:
    case CommOp::kAllGather: return steps * network_.ring_step_seconds(members, n / p);
    case CommOp::kBroadcast: return network_.broadcast_seconds(members, call.root, n);
    case CommOp::kBarrier:
    case CommOp::kSplit: return network_.barrier_seconds(members);  // a split meets as one
    default: break;
  }
  DP_CHECK(false, "{} is not a collective", to_string(call.op));
  return 0.0;
}

std::vector<std::size_t> VirtualNetwork::ports_of_collective(const VirtualCall& call) const {
  const std::span<const int> members = members_of(call);
  const std::size_t p = members.size();
  std::vector<std::size_t> ports;
  const auto add_message = [&](int from, int to) {
    const bool across = network_.crosses_nodes(from, to);
    ports.push_back(port_of(from, across));
    ports.push_back(port_of(to, across));
  };
  if (p == 1) {
    ports.push_back(port_of(members[0], false));
    if (network_.ranks_per_node > 0) ports.push_back(port_of(members[0], true));
  } else if (call.op == CommOp::kBroadcast) {
    // The tree's messages: relative rank r (from the root) receives from r - lowbit(r).
    for (std::size_t relative = 1; relative < p; ++relative) {
      const std::size_t parent = relative - (relative & (~relative + 1));
      add_message(members[(static_cast<std::size_t>(call.root) + parent) % p],
                  members[(static_cast<std::size_t>(call.root) + relative) % p]);
    }
  } else if (call.op == CommOp::kBarrier || call.op == CommOp::kSplit) {
    for (std::size_t distance = 1; distance < p; distance *= 2)
      for (std::size_t i = 0; i < p; ++i) add_message(members[i], members[(i + distance) % p]);
  } else {
    for (std::size_t i = 0; i < p; ++i) add_message(members[i], members[(i + 1) % p]);  // ring
  }
  std::sort(ports.begin(), ports.end());
  ports.erase(std::unique(ports.begin(), ports.end()), ports.end());
  return ports;
}

void VirtualNetwork::commit_collective(const GroupKey& key) {
  auto found = groups_.find(key);
  if (found == groups_.end()) return;
  Group group = std::move(found->second);
  groups_.erase(found);
  double start = 0;
  const VirtualCall* first = nullptr;
  for (const VirtualCall* member : group.members) {
    if (member == nullptr) continue;
    start = std::max(start, member->issue);
    if (first == nullptr) first = member;
  }
  if (first == nullptr) return;  // every member failed
  const std::vector<std::size_t> ports = ports_of_collective(*first);
  for (std::size_t port : ports)
    start = std::max({start, send_timeline_[port].free_after, receive_timeline_[port].free_after});
  const double end = start + collective_seconds(*first);
  for (std::size_t port : ports) {
    reserve(send_timeline_[port], start, end);
    reserve(receive_timeline_[port], start, end);
  }
  for (VirtualCall* member : group.members) {
    if (member == nullptr) continue;
    member->start = start;
    member->end = end;
    member->completion = end;
    determine(*member);
  }
}

void VirtualNetwork::determine(VirtualCall& call) {
  call.determined = true;
  determined_.push_back(&call);
  const auto rank = static_cast<std::size_t>(call.rank);
  if (blocked_[rank] == &call) floor_[rank] = std::max(floor_[rank], call.completion);
}

std::vector<VirtualCall*> VirtualNetwork::take_determined() {
  std::vector<VirtualCall*> calls;
  calls.swap(determined_);
  return calls;
}

double VirtualNetwork::link_free(int rank) const {
  double free = 0;
  for (bool across : {false, true}) {
    if (across && network_.ranks_per_node == 0) break;  // a flat network has no NICs
    const std::size_t port = port_of(rank, across);
    free = std::max({free, send_timeline_[port].free_after, receive_timeline_[port].free_after});
  }
  return free;
}

}  // namespace dp::detail
