#include "dp/clock.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

#include "dp/error.h"

namespace dp {

// --- Presets -------------------------------------------------------------------------------
//
// Bandwidth is per direction of one link (full duplex): the line rate / 8 for the
// networks, the vendor's per-GPU figure halved for NVLink (it is quoted bidirectional).
// Latency (alpha) is the order of magnitude of a small-message ping-pong half round trip
// through the usual software stack (MPI or NCCL over the fabric, TCP over Ethernet), as
// OSU's osu_latency and nccl-tests report it; real values vary with NICs, switches and
// settings, which is why --alpha and --bandwidth exist.
//
//   nvlink  NVLink 4 (NVIDIA H100 SXM datasheet: 900 GB/s per GPU bidirectional -> 450 GB/s
//           per direction); ~1 us between GPUs of one node.
//   ib-ndr  InfiniBand NDR, 400 Gb/s per port (IBTA; NVIDIA ConnectX-7 and Quantum-2
//           datasheets) -> 50 GB/s; ~2 us end to end with MPI or NCCL.
//   100gbe  100 Gigabit Ethernet (IEEE 802.3) -> 12.5 GB/s; ~10 us through a TCP stack.
//   10gbe   10 Gigabit Ethernet (IEEE 802.3ae) -> 1.25 GB/s; ~30 us through a TCP stack.
//
// Devices (float32 without tensor cores; memory bandwidth; ~4 us per CUDA kernel launch):
//
//   a100  NVIDIA A100 SXM4 40 GB datasheet: 19.5 TFLOP/s, 1555 GB/s.
//   h100  NVIDIA H100 SXM5 datasheet: 67 TFLOP/s, 3350 GB/s.
//   cpu   one laptop core: AVX2, 2 FMA units at ~3 GHz give ~100 GFLOP/s peak, ~50 in
//         practice; ~20 GB/s of memory bandwidth; ~1 us per op (a function call and
//         a pass over small buffers).

namespace {

struct NetworkPreset {
  const char* name;
  double alpha_seconds;
  double bytes_per_second;
};

constexpr NetworkPreset kNetworks[] = {
    {"nvlink", 1e-6, 450e9},
    {"ib-ndr", 2e-6, 50e9},
    {"100gbe", 10e-6, 12.5e9},
    {"10gbe", 30e-6, 1.25e9},
};

struct DevicePreset {
  const char* name;
  double flops_per_second;
  double bytes_per_second;
  double launch_seconds;
};

constexpr DevicePreset kDevices[] = {
    {"a100", 19.5e12, 1555e9, 4e-6},
    {"h100", 67e12, 3350e9, 4e-6},
    {"cpu", 50e9, 20e9, 1e-6},
};

thread_local Clock* t_clock = nullptr;

std::string describe_link(const LinkModel& link) {
  return fmt::format("alpha {:g} us, {:g} GB/s", link.alpha_seconds * 1e6,
                     link.bytes_per_second / 1e9);
}

}  // namespace

double DeviceModel::time_of(const OpCost& cost) const {
  return std::max(cost.flops / flops_per_second, cost.bytes / bytes_per_second) + launch_seconds;
}

DeviceModel DeviceModel::preset(std::string_view name) {
  for (const DevicePreset& preset : kDevices) {
    if (name == preset.name)
      return {preset.name, preset.flops_per_second, preset.bytes_per_second, preset.launch_seconds};
  }
  throw Error(fmt::format("unknown device '{}': expected one of {}", name,
                          fmt::join(preset_names(), ", ")));
}

std::vector<std::string> DeviceModel::preset_names() {
  std::vector<std::string> names;
  for (const DevicePreset& preset : kDevices) names.emplace_back(preset.name);
  return names;
}

bool NetworkModel::crosses_nodes(int a, int b) const {
  return ranks_per_node > 0 && a / ranks_per_node != b / ranks_per_node;
}

int NetworkModel::effective_nics_per_node() const {
  return nics_per_node > 0 ? nics_per_node : ranks_per_node;
}

int NetworkModel::nic_of(int rank) const {
  DP_CHECK(ranks_per_node > 0, "nic_of({}) on a flat network", rank);
  const int nics = effective_nics_per_node();
  return rank / ranks_per_node * nics + rank % ranks_per_node % nics;
}

void NetworkModel::validate() const {
  for (const auto& [which, link] :
       {std::pair{"fabric", &fabric}, std::pair{"inter-node", &inter_node}})
    if (!(link->alpha_seconds >= 0) || !(link->bytes_per_second > 0))
      throw Error(fmt::format(
          "simulated network: expected alpha >= 0 and bandwidth > 0 on the {} link, got alpha "
          "{} s and {} B/s",
          which, link->alpha_seconds, link->bytes_per_second));
  if (ranks_per_node < 0)
    throw Error(
        fmt::format("simulated network: ranks per node must be >= 0, got {}", ranks_per_node));
  if (nics_per_node < 0)
    throw Error(fmt::format(
        "simulated network: NICs per node must be >= 0 (0: one per rank), got {}", nics_per_node));
  if (nics_per_node > 0 && ranks_per_node == 0)
    throw Error(fmt::format(
        "simulated network: {} NICs per node on a flat network: NICs per node need two levels "
        "(ranks per node > 0)",
        nics_per_node));
  if (nics_per_node > 0 && ranks_per_node % nics_per_node != 0)
    throw Error(fmt::format(
        "simulated network: NICs per node must divide the ranks per node, got {} NICs for {} "
        "ranks per node",
        nics_per_node, ranks_per_node));
}

const LinkModel& NetworkModel::link_between(int a, int b) const {
  return crosses_nodes(a, b) ? inter_node : fabric;
}

const LinkModel& NetworkModel::slowest_link(int world_size) const {
  return ranks_per_node > 0 && world_size > ranks_per_node ? inter_node : fabric;
}

namespace {

/// The messages of one step or round of a native collective, as (from, to) ranks of the
/// network, timed as "Native collectives" in dp/clock.h says: the step lasts as long as its
/// slowest message, where j messages that leave (or enter) through one port take
/// j bytes / bandwidth + alpha.
double busiest_port_seconds(const NetworkModel& network,
                            std::span<const std::pair<int, int>> messages, double bytes) {
  // A port: a rank's own (its rank) or, across nodes, a NIC (-1 - its number).
  const auto port = [&](int rank, bool across) {
    return across ? -1 - network.nic_of(rank) : rank;
  };
  std::map<int, int> leaving;
  std::map<int, int> entering;
  for (const auto& [from, to] : messages) {
    const bool across = network.crosses_nodes(from, to);
    ++leaving[port(from, across)];
    ++entering[port(to, across)];
  }
  double seconds = 0;
  for (const auto& [from, to] : messages) {
    const bool across = network.crosses_nodes(from, to);
    const LinkModel& link = network.link_between(from, to);
    const int queued = std::max(leaving[port(from, across)], entering[port(to, across)]);
    seconds = std::max(seconds, link.alpha_seconds + queued * bytes / link.bytes_per_second);
  }
  return seconds;
}

}  // namespace

double NetworkModel::ring_step_seconds(std::span<const int> ring, double chunk_bytes) const {
  const std::size_t p = ring.size();
  if (p < 2) return 0.0;
  std::vector<std::pair<int, int>> hops;
  for (std::size_t i = 0; i < p; ++i) hops.emplace_back(ring[i], ring[(i + 1) % p]);
  return busiest_port_seconds(*this, hops, chunk_bytes);
}

double NetworkModel::broadcast_seconds(std::span<const int> ranks, int root, double bytes) const {
  const int p = static_cast<int>(ranks.size());
  if (root < 0 || root >= p)
    throw Error(fmt::format("broadcast_seconds: root {} is out of range: expected 0 <= root < {}",
                            root, p));
  int top = 1;  // the largest power of two below p (the first round's distance)
  while (2 * top < p) top *= 2;
  double seconds = 0;
  for (int distance = top; p > 1 && distance >= 1; distance /= 2) {
    // Relative ranks (from the root) that are multiples of 2 distance hold the data and
    // send to the rank `distance` further on.
    std::vector<std::pair<int, int>> round;
    for (int from = 0; from + distance < p; from += 2 * distance)
      round.emplace_back(ranks[static_cast<std::size_t>((root + from) % p)],
                         ranks[static_cast<std::size_t>((root + from + distance) % p)]);
    seconds += busiest_port_seconds(*this, round, bytes);
  }
  return seconds;
}

double NetworkModel::barrier_seconds(std::span<const int> ranks) const {
  // ready[i]: when rank i (of `ranks`) enters the next round: its send to i + d and its
  // receive from i - d both done.
  const std::size_t p = ranks.size();
  std::vector<double> ready(p, 0.0);
  for (std::size_t distance = 1; distance < p; distance *= 2) {
    std::vector<double> next(p);
    for (std::size_t i = 0; i < p; ++i) {
      const std::size_t to = (i + distance) % p;
      const std::size_t from = (i + p - distance) % p;
      next[i] = std::max(ready[i] + link_between(ranks[i], ranks[to]).alpha_seconds,
                         ready[from] + link_between(ranks[from], ranks[i]).alpha_seconds);
    }
    ready.swap(next);
  }
  return p == 0 ? 0.0 : *std::max_element(ready.begin(), ready.end());
}

NetworkModel NetworkModel::preset(std::string_view name) {
  for (const NetworkPreset& preset : kNetworks) {
    if (name == preset.name) {
      NetworkModel model;
      model.name = preset.name;
      model.fabric = {preset.alpha_seconds, preset.bytes_per_second};
      model.inter_node = model.fabric;
      return model;
    }
  }
  throw Error(fmt::format("unknown network '{}': expected one of {}", name,
                          fmt::join(preset_names(), ", ")));
}

std::vector<std::string> NetworkModel::preset_names() {
  std::vector<std::string> names;
  for (const NetworkPreset& preset : kNetworks) names.emplace_back(preset.name);
  return names;
}

std::string NetworkModel::describe() const {
  if (ranks_per_node > 0)
    return fmt::format("{} ranks per node on {}, nodes on {} ({}, {} NICs per node)",
                       ranks_per_node, describe_link(fabric), name, describe_link(inter_node),
                       effective_nics_per_node());
  return fmt::format("{} ({})", name, describe_link(fabric));
}

SimulationOptions SimulationOptions::preset(std::string_view network) {
  SimulationOptions options;
  options.enabled = true;
  options.network = NetworkModel::preset(network);
  return options;
}

std::string SimulationOptions::describe() const {
  return fmt::format("{}; device {} ({:g} TFLOP/s, {:g} GB/s, launch {:g} us); {}",
                     network.describe(), device.name, device.flops_per_second / 1e12,
                     device.bytes_per_second / 1e9, device.launch_seconds * 1e6,
                     compute == ComputeModel::kRoofline ? "roofline compute"
                                                        : "measured compute (thread CPU time)");
}

// --- Thread binding ------------------------------------------------------------------------

Clock* this_thread_clock() {
  return t_clock;
}

ScopedClock::ScopedClock(Clock* clock) : previous_(t_clock) {
  t_clock = clock;
}

ScopedClock::~ScopedClock() {
  t_clock = previous_;
}

// --- WallClock -----------------------------------------------------------------------------

namespace {
double seconds_between(std::chrono::steady_clock::time_point from,
                       std::chrono::steady_clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}
}  // namespace

WallClock::WallClock(int rank, bool record_trace)
    : epoch_(std::chrono::steady_clock::now()), record_(record_trace) {
  trace_.rank = rank;
  trace_.simulated = false;
  trace_.clock_description = "wall clock";
}

double WallClock::now() const {
  return seconds_between(epoch_, std::chrono::steady_clock::now());
}

ComputeStart WallClock::start_compute() const {
  return {std::chrono::steady_clock::now(), 0};
}

void WallClock::finish_compute(const ComputeStart& start, std::string_view name,
                               std::string_view phase, const OpCost& cost) {
  if (!record_) return;
  const auto end = std::chrono::steady_clock::now();
  TraceEvent event;
  event.name = phase.empty() ? std::string(name) : fmt::format("{} {}", name, phase);
  event.lane = TraceLane::kCompute;
  event.start = event.wall_start = seconds_between(epoch_, start.wall);
  event.duration = event.wall_duration = seconds_between(start.wall, end);
  event.flops = cost.flops;
  event.bytes = static_cast<std::uint64_t>(cost.bytes);
  trace_.events.push_back(std::move(event));
}

void WallClock::compute(std::string_view name, double seconds) {
  if (!record_) return;
  TraceEvent event;
  event.name = std::string(name);
  event.start = event.wall_start = now();
  event.duration = event.wall_duration = seconds;
  trace_.events.push_back(std::move(event));
}

void WallClock::mark_step() {
  trace_.step_marks.push_back(now());
}

RankTrace WallClock::trace() const {
  return trace_;
}

}  // namespace dp
