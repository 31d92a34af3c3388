// Lab 9's graded checks. The lab code splits the communicator it is given into a node's
// communicator and the one across nodes (nodes of k consecutive ranks), all-reduces
// hierarchically (reduce-scatter inside the node, all-reduce of the shard across, all-gather
// inside) and trains with HSDP (optimizer state sharded inside the node, replicated across).
// The checks hand it a communicator of the grader's whose `split` hands out communicators
// the grader watches, so that the bytes of every one are counted by link class
// (`dp::sum_counters`), and compare:
//   * every rank's result bitwise with the contract's sum order emulated in one process
//     (each node's sum in rank order, then the node sums in node order), on drawn layouts;
//   * the bytes each rank sends inside its node and across nodes with their closed forms;
//   * HSDP's parameters after every step bitwise with that arithmetic emulated (divided by
//     p, the optimizer's update element-wise), and its memory per category and bytes per
//     link class with DDP's (k = 1), full sharding's (k = p) and HSDP's formulas;
//   * on the simulated two-level network, the hierarchical all-reduce's time with the closed
//     form of dp/clock.h, so faster than the flat ring by the predicted factor;
//   * the design question's predictions (flat ring, hierarchical, full sharding and HSDP
//     steps) with the simulated clock within 1%, on fabrics drawn so that plausible wrong
//     formulas part from the right ones by 3% or more.
// Every check runs in the adversarial completion mode. rubric.json gives points and draws.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "compare.h"
#include "dp/clock.h"
#include "dp/comm.h"
#include "dp/data.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/memory.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/tensor_ops.h"
#include "grading.h"
#include "ground_truth.h"
#include "heap_use.h"
#include "lab9.h"
#include "memory_check.h"
#include "sharded.h"

namespace dp::lab9 {
namespace {

using grading::Draws;
using grading::Verdict;

// --- layouts and launches --------------------------------------------------------------------

/// p ranks as nodes of k.
struct Layout {
  int world = 1;  ///< p
  int k = 1;      ///< ranks per node
  int nodes() const { return world / k; }
};

std::string describe(const Layout& layout) {
  return fmt::format("{} ranks as {} node(s) of {}", layout.world, layout.nodes(), layout.k);
}

/// The layouts a check grades. On the local backend: 4 ranks as 2 nodes of 2, 6 as nodes of 2
/// or 3, 8 as nodes of 2 or 4 (drawn), one node of all (full sharding) and nodes of one rank
/// (DDP). Under mpi (and nccl) every divisor of every world size the processes allow: with 4
/// processes, 4 ranks as 2 nodes of 2 among them.
std::vector<Layout> drawn_layouts(Draws& draws) {
  std::vector<Layout> layouts;
  if (grading::check_backend() != Backend::kLocal) {
    for (int world : draws.world_sizes(4))
      for (int k = 1; k <= world; ++k)
        if (world % k == 0) layouts.push_back({world, k});
    return layouts;
  }
  layouts.push_back({4, 2});
  layouts.push_back({6, static_cast<int>(draws.pick<int>("nodes of (6 ranks)", {2, 3}))});
  layouts.push_back({8, static_cast<int>(draws.pick<int>("nodes of (8 ranks)", {2, 4}))});
  const int one_node = static_cast<int>(draws.integer("one node of", 2, 5));
  layouts.push_back({one_node, one_node});
  layouts.push_back({3, 1});
  return layouts;
}

/// The launch of `layout` on the check backend (or the local one, simulated, when
/// `network` is given), the node layout set so that the counters classify every byte.
LaunchOptions launch_options(const Layout& layout, const Draws& draws,
                             const std::optional<NetworkModel>& network = std::nullopt) {
  LaunchOptions options;
  options.world_size = layout.world;
  options.backend = network ? Backend::kLocal : grading::check_backend();
  options.comm.hang_timeout = std::chrono::seconds(30);
  options.comm.completion = Completion::kAdversarial;
  options.comm.completion_seed =
      draws.completion_seed() + static_cast<std::uint64_t>(layout.world * 16 + layout.k);
  if (network) {
    options.simulation.enabled = true;
    options.simulation.network = *network;
    options.simulation.record_trace = false;
    DeviceModel free;  // the network alone is timed: compute costs nothing
    free.name = "free";
    free.flops_per_second = std::numeric_limits<double>::infinity();
    free.bytes_per_second = std::numeric_limits<double>::infinity();
    free.launch_seconds = 0;
    options.simulation.device = free;
  } else {
    options.simulation.network.ranks_per_node = layout.k;
  }
  return options;
}

/// `check` on every rank of `layout` (as grading::run_on_ranks, with the node layout set).
bool run_on_nodes(const Layout& layout, const grading::RankCheck& check, const Draws& draws) {
  const LaunchOptions options = launch_options(layout, draws);
  std::vector<Verdict> verdicts(static_cast<std::size_t>(layout.world));
  std::vector<char> ran(static_cast<std::size_t>(layout.world), 0);
  const std::string drawn = draws.describe();
  try {
    launch(options, [&](Communicator& comm) {
      const auto rank = static_cast<std::size_t>(comm.rank());
      ran[rank] = 1;
      check(comm, verdicts[rank]);
    });
  } catch (const NotImplemented& error) {
    ADD_FAILURE() << fmt::format("{}: {}", describe(layout), error.what());
    return false;
  } catch (const std::exception& error) {
    ADD_FAILURE() << fmt::format("{}: a rank failed with {}: {}\n({})", describe(layout),
                                 grading::type_name(error), error.what(), drawn);
    return false;
  }
  bool passed = true;
  for (int rank = 0; rank < layout.world; ++rank) {
    const Verdict& verdict = verdicts[static_cast<std::size_t>(rank)];
    if (ran[static_cast<std::size_t>(rank)] == 0) continue;
    for (const std::string& failure : verdict.failures()) {
      ADD_FAILURE() << fmt::format("{}, rank {}: {}\n({})", describe(layout), rank, failure, drawn);
      passed = false;
    }
    if (rank == 0)
      for (const std::string& sentence : verdict.notes())
        grading::note_measured(fmt::format("{}: {}", describe(layout), sentence));
  }
  return passed;
}

// --- a communicator whose splits the grader watches ------------------------------------------

/// The counters of every communicator split from a `Watched` one (and from those), live or
/// destroyed: what one rank moved over all of them together.
struct Watch {
  std::vector<const Communicator*> live;
  std::vector<CommCounters> finished;

  /// Everything the children counted so far.
  CommCounters children() const {
    std::vector<CommCounters> parts = finished;
    for (const Communicator* child : live) parts.push_back(child->counters());
    return sum_counters(parts);
  }
};

/// Passes every call on to the communicator it wraps; the communicators `split` returns are
/// watched too, and their counters stay readable after lab code destroys them.
class Watched final : public Communicator {
 public:
  Watched(Communicator& inner, std::shared_ptr<Watch> watch)
      : inner_(&inner), watch_(std::move(watch)) {}
  Watched(std::unique_ptr<Communicator> owned, std::shared_ptr<Watch> watch)
      : inner_(owned.get()), owned_(std::move(owned)), watch_(std::move(watch)) {
    watch_->live.push_back(this);
  }
  ~Watched() override {
    if (!owned_) return;
    watch_->finished.push_back(owned_->counters());
    std::erase(watch_->live, this);
  }
  Watched(const Watched&) = delete;
  Watched& operator=(const Watched&) = delete;

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string_view backend() const override { return inner_->backend(); }
  std::unique_ptr<Work> isend(ConstBuffer data, int peer, int tag) override {
    return inner_->isend(data, peer, tag);
  }
  std::unique_ptr<Work> irecv(MutableBuffer data, int peer, int tag) override {
    return inner_->irecv(data, peer, tag);
  }
  std::unique_ptr<Work> allreduce(MutableBuffer data, ReduceOp op) override {
    return inner_->allreduce(data, op);
  }
  std::unique_ptr<Work> reduce_scatter(ConstBuffer in, MutableBuffer out, ReduceOp op) override {
    return inner_->reduce_scatter(in, out, op);
  }
  std::unique_ptr<Work> allgather(ConstBuffer in, MutableBuffer out) override {
    return inner_->allgather(in, out);
  }
  std::unique_ptr<Work> broadcast(MutableBuffer data, int root) override {
    return inner_->broadcast(data, root);
  }
  void barrier() override { inner_->barrier(); }
  std::unique_ptr<Communicator> split(int color, int key) override {
    std::unique_ptr<Communicator> child = inner_->split(color, key);
    if (!child) return nullptr;
    return std::make_unique<Watched>(std::move(child), watch_);
  }
  CommCounters counters() const override { return inner_->counters(); }
  Clock& clock() override { return inner_->clock(); }

 private:
  Communicator* inner_;
  std::unique_ptr<Communicator> owned_;
  std::shared_ptr<Watch> watch_;
};

/// Calls on `world` since `before` other than splits: lab code sends nothing there.
std::string world_calls(const CommCounters& since) {
  const std::uint64_t calls = since.total_calls() - since.of(CommOp::kSplit).calls;
  if (calls == 0 && since.total_bytes_sent() == 0) return "";
  return fmt::format(
      "{} call(s) and {} bytes sent on the communicator you were given; the contract's calls "
      "are on the node's and the across communicators only (a native all-reduce of all ranks "
      "is the flat ring this lab improves on)",
      calls, since.total_bytes_sent());
}

/// "" when the calls on the communicators split from the one given, `counted` since a step
/// began, are the contract's: one reduce-scatter and one all-gather inside the node and one
/// all-reduce across, every call counted (barriers and calls of zero bytes too).
std::string step_calls(const CommCounters& counted) {
  std::vector<std::string> wrong;
  for (std::size_t i = 0; i < kNumCommOps; ++i) {
    const auto op = static_cast<CommOp>(i);
    const std::uint64_t expected =
        op == CommOp::kReduceScatter || op == CommOp::kAllReduce || op == CommOp::kAllGather ? 1
                                                                                             : 0;
    if (counted.of(op).calls != expected)
      wrong.push_back(fmt::format("{} {}", counted.of(op).calls, to_string(op)));
  }
  if (wrong.empty()) return "";
  return fmt::format(
      "{} call(s) on the node's and the across communicators; expected exactly one "
      "reduce-scatter, one all-reduce and one all-gather per step, nothing else (no barrier, "
      "no call of zero bytes)",
      fmt::join(wrong, ", "));
}

/// "" when the bytes sent and received per link class are the expected ones.
std::string link_bytes(const CommCounters& counted, std::uint64_t intra, std::uint64_t inter) {
  std::vector<std::string> wrong;
  const auto compare = [&](std::string_view what, std::uint64_t seen, std::uint64_t expected) {
    if (seen != expected)
      wrong.push_back(fmt::format("{} {} bytes, expected {}", what, seen, expected));
  };
  compare("intra-node sent", counted.intra_node_bytes_sent(), intra);
  compare("intra-node received", counted.intra_node_bytes_received(), intra);
  compare("inter-node sent", counted.inter_node_bytes_sent(), inter);
  compare("inter-node received", counted.inter_node_bytes_received(), inter);
  if (wrong.empty()) return "";
  return fmt::format("{}", fmt::join(wrong, "; "));
}

// --- the contract's arithmetic -----------------------------------------------------------------

/// lab9.h's sum order: each node's k values in rank order, then the node sums in node order.
std::vector<float> hierarchical_sum(const std::vector<std::vector<float>>& local, int k) {
  const std::size_t n = local.front().size();
  const std::size_t nodes = local.size() / static_cast<std::size_t>(k);
  std::vector<float> total(n, 0.0f);
  for (std::size_t j = 0; j < nodes; ++j) {
    std::vector<float> node = local[j * static_cast<std::size_t>(k)];
    for (std::size_t i = 1; i < static_cast<std::size_t>(k); ++i)
      for (std::size_t e = 0; e < n; ++e) node[e] += local[j * static_cast<std::size_t>(k) + i][e];
    if (j == 0)
      total = node;
    else
      for (std::size_t e = 0; e < n; ++e) total[e] += node[e];
  }
  return total;
}

/// Rank `rank`'s drawn data: values of many magnitudes, so that another order of additions
/// gives other bits.
std::vector<float> rank_data(std::uint64_t seed, int rank, std::size_t n) {
  std::mt19937_64 rng(seed * 1000003 + static_cast<std::uint64_t>(rank));
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-12, 12);
  std::vector<float> values(n);
  for (float& v : values) v = std::ldexp(mantissa(rng), exponent(rng));
  return values;
}

/// A tensor on the check device holding `values`.
Tensor on_device(const std::vector<float>& values, MemoryCategory category) {
  Tensor t({static_cast<std::int64_t>(values.size())}, category, grading::check_device());
  copy(ConstTensorView(std::span<const float>(values)), t.view());
  return t;
}

/// The first element where `seen` and `expected` differ in their bits, "" if none.
std::string bitwise(std::span<const float> seen, std::span<const float> expected,
                    std::string_view what) {
  if (seen.size() != expected.size())
    return fmt::format("{} holds {} elements; expected {}", what, seen.size(), expected.size());
  for (std::size_t e = 0; e < seen.size(); ++e)
    if (std::memcmp(&seen[e], &expected[e], sizeof(float)) != 0)
      return fmt::format(
          "{} element {} is {:.9g}; expected {:.9g} (the contract's sum order: each "
          "node's sum in rank order, then the node sums in node order)",
          what, e, seen[e], expected[e]);
  return "";
}

// --- Lab9Hierarchical ---------------------------------------------------------------------------

TEST(Lab9Hierarchical, BitwiseTheContractsSumOrder) {
  Draws draws("Lab9Hierarchical.BitwiseTheContractsSumOrder");
  const std::vector<Layout> layouts = drawn_layouts(draws);
  const std::uint64_t seed = draws.seed("data");
  for (const Layout& layout : layouts) {
    const auto unit = static_cast<std::size_t>(layout.k);
    const std::size_t n = unit * static_cast<std::size_t>(draws.integer("elements / k", 1, 600));
    std::vector<std::vector<float>> local;
    for (int r = 0; r < layout.world; ++r) local.push_back(rank_data(seed, r, n));
    const std::vector<float> expected = hierarchical_sum(local, layout.k);
    // The lesson beside the bits: where the flat ring's order gives other bits.
    const std::vector<float> flat = grading::sum_in_rank_order(local);
    std::size_t differing = 0;
    for (std::size_t e = 0; e < n; ++e)
      if (std::memcmp(&flat[e], &expected[e], sizeof(float)) != 0) ++differing;
    run_on_nodes(
        layout,
        [&](Communicator& comm, Verdict& verdict) {
          auto watch = std::make_shared<Watch>();
          Watched world(comm, watch);
          const int rank = comm.rank();
          // The errors the contract promises, before anything is split.
          for (const int bad : {0, layout.world + 1}) {
            try {
              (void)split_levels(world, bad);
              verdict.fail(
                  fmt::format("split_levels(comm, {}) on {} ranks returned; expected "
                              "dp::Error",
                              bad, layout.world));
            } catch (const NotImplemented&) {
              throw;
            } catch (const Error&) {
            }
          }
          const Levels levels = split_levels(world, layout.k);
          if (!levels.node || !levels.across) {
            verdict.fail("split_levels returned a null communicator");
            return;
          }
          if (levels.node->size() != layout.k || levels.node->rank() != rank % layout.k)
            verdict.fail(
                fmt::format("the node communicator has rank {} of {}; expected rank {} "
                            "of {} (nodes of consecutive ranks)",
                            levels.node->rank(), levels.node->size(), rank % layout.k, layout.k));
          if (levels.across->size() != layout.nodes() || levels.across->rank() != rank / layout.k)
            verdict.fail(fmt::format(
                "the across communicator has rank {} of {}; expected rank "
                "{} of {} (one rank per node, in node order)",
                levels.across->rank(), levels.across->size(), rank / layout.k, layout.nodes()));
          if (layout.k > 1) {
            Tensor odd({static_cast<std::int64_t>(n + 1)}, MemoryCategory::kOther,
                       grading::check_device());
            try {
              hierarchical_allreduce(odd.view(), levels);
              verdict.fail(
                  fmt::format("hierarchical_allreduce of {} elements on nodes of {} "
                              "returned; expected dp::Error",
                              n + 1, layout.k));
            } catch (const NotImplemented&) {
              throw;
            } catch (const Error&) {
            }
          }
          Tensor data = on_device(local[static_cast<std::size_t>(rank)], MemoryCategory::kOther);
          hierarchical_allreduce(data.view(), levels);
          verdict.expect_empty(bitwise(grading::host_values(data), expected, "the result"),
                               "hierarchical_allreduce");
          if (verdict.passed())
            verdict.note(fmt::format(
                "{} elements bitwise the contract's order on every rank; the flat ring's order "
                "differs in {} of them",
                n, differing));
        },
        draws);
  }
}

TEST(Lab9Hierarchical, BytesPerLinkClass) {
  Draws draws("Lab9Hierarchical.BytesPerLinkClass");
  const std::vector<Layout> layouts = drawn_layouts(draws);
  const std::uint64_t seed = draws.seed("data");
  for (const Layout& layout : layouts) {
    const auto k = static_cast<std::uint64_t>(layout.k);
    const auto nodes = static_cast<std::uint64_t>(layout.nodes());
    const std::uint64_t n =
        k * nodes * static_cast<std::uint64_t>(draws.integer("elements / p", 1, 2000));
    // dp/comm.h's ring counts: 2 (k-1)/k x 4n inside the node, 2 (N-1)/N x 4n/k across.
    const std::uint64_t intra = 2 * (k - 1) * 4 * n / k;
    const std::uint64_t inter = 2 * (nodes - 1) * 4 * n / (k * nodes);
    run_on_nodes(
        layout,
        [&](Communicator& comm, Verdict& verdict) {
          auto watch = std::make_shared<Watch>();
          Watched world(comm, watch);
          const Levels levels = split_levels(world, layout.k);
          Tensor data = on_device(rank_data(seed, comm.rank(), static_cast<std::size_t>(n)),
                                  MemoryCategory::kOther);
          const CommCounters world_before = comm.counters();
          const CommCounters children_before = watch->children();
          hierarchical_allreduce(data.view(), levels);
          verdict.expect_empty(world_calls(comm.counters().since(world_before)),
                               "hierarchical_allreduce");
          const CommCounters moved = watch->children().since(children_before);
          verdict.expect_empty(link_bytes(moved, intra, inter),
                               fmt::format("hierarchical_allreduce of {} floats", n));
          if (verdict.passed())
            verdict.note(fmt::format(
                "{} floats: {} bytes sent inside the node and {} across, per rank; the flat "
                "ring sends {} across from each of the ranks at a node's edge",
                n, intra, inter, 2 * (k * nodes - 1) * 4 * n / (k * nodes)));
        },
        draws);
  }
}

// --- simulated two-level networks ------------------------------------------------------------

/// NVLink inside the nodes, `between` across, a NIC per rank.
NetworkModel two_levels(const LinkModel& intra, const LinkModel& between, int k) {
  NetworkModel network;
  network.name = "custom";
  network.fabric = intra;
  network.inter_node = between;
  network.ranks_per_node = k;
  return network;
}

/// The last rank's simulated seconds from a common start, just after the grader's own splits
/// (charged as barriers), to the end of `run` (every rank calls it).
double simulate(const Layout& layout, const NetworkModel& network, const Draws& draws,
                const std::function<void(Communicator&, Communicator&, Communicator&)>& run) {
  std::vector<double> took(static_cast<std::size_t>(layout.world));
  launch(launch_options(layout, draws, network), [&](Communicator& comm) {
    const std::unique_ptr<Communicator> node = comm.split(comm.rank() / layout.k, comm.rank());
    const std::unique_ptr<Communicator> across = comm.split(comm.rank() % layout.k, comm.rank());
    const double start = comm.clock().now();
    run(comm, *node, *across);
    took[static_cast<std::size_t>(comm.rank())] = comm.clock().now() - start;
  });
  return *std::max_element(took.begin(), took.end());
}

double step_on(const LinkModel& link, double chunk) {
  return link.alpha_seconds + chunk / link.bytes_per_second;
}

/// dp/clock.h's closed forms (the figure's, grader/figures/hierarchical_allreduce.cpp).
double flat_formula(double bytes, const TwoLevelFabric& f) {
  const int p = f.nodes * f.ranks_per_node;
  double step = step_on(f.intra, bytes / p);
  if (f.nodes > 1)
    step = f.ranks_per_node == 1 ? step_on(f.inter, bytes / p)
                                 : std::max(step, step_on(f.inter, bytes / p));
  return 2.0 * (p - 1) * step;
}

double hierarchical_formula(double bytes, const TwoLevelFabric& f) {
  const double k = f.ranks_per_node;
  const double n = f.nodes;
  return 2.0 * (k - 1) * step_on(f.intra, bytes / k) +
         2.0 * (n - 1) * step_on(f.inter, bytes / (k * n));
}

std::string describe(const LinkModel& link) {
  return fmt::format("alpha {:.3g} us, {:.4g} GB/s", link.alpha_seconds * 1e6,
                     link.bytes_per_second / 1e9);
}

std::string describe(const TwoLevelFabric& f) {
  return fmt::format("{} node(s) of {}, inside {}, across {}", f.nodes, f.ranks_per_node,
                     describe(f.intra), describe(f.inter));
}

TEST(Lab9Hierarchical, FasterThanTheFlatRingByThePredictedFactor) {
  Draws draws("Lab9Hierarchical.FasterThanTheFlatRingByThePredictedFactor");
  const std::vector<std::string> nets = {"ib-ndr", "100gbe", "10gbe"};
  const LinkModel nvlink = NetworkModel::preset("nvlink").fabric;
  double worst = 0;
  std::vector<std::string> seen;
  for (int topology = 0; topology < 2; ++topology) {
    draws.section(fmt::format("[topology {}:]", topology + 1));
    TwoLevelFabric f;
    f.nodes = static_cast<int>(draws.integer("nodes", 2, 4));
    f.ranks_per_node = draws.pick<int>("ranks per node", {2, 4});
    f.intra = nvlink;
    f.inter = NetworkModel::preset(draws.pick<std::string>("across", nets)).fabric;
    const Layout layout{f.nodes * f.ranks_per_node, f.ranks_per_node};
    const auto elements = static_cast<std::size_t>(layout.world) *
                          static_cast<std::size_t>(draws.integer("elements / p", 2048, 16384));
    const double bytes = 4.0 * static_cast<double>(elements);
    const NetworkModel network = two_levels(f.intra, f.inter, f.ranks_per_node);
    std::vector<std::string> failures;
    double lab = 0;
    try {
      std::vector<double> took(static_cast<std::size_t>(layout.world));
      std::vector<std::string> wrong(static_cast<std::size_t>(layout.world));
      launch(launch_options(layout, draws, network), [&](Communicator& comm) {
        auto watch = std::make_shared<Watch>();
        Watched world(comm, watch);
        const Levels levels = split_levels(world, layout.k);
        std::vector<float> ones(elements, static_cast<float>(comm.rank() + 1));
        Tensor data = on_device(ones, MemoryCategory::kOther);
        const double start = comm.clock().now();
        hierarchical_allreduce(data.view(), levels);
        took[static_cast<std::size_t>(comm.rank())] = comm.clock().now() - start;
        const float sum = static_cast<float>(layout.world * (layout.world + 1) / 2);
        const std::vector<float> result = grading::host_values(data);
        if (std::ranges::any_of(result, [&](float v) { return v != sum; }))
          wrong[static_cast<std::size_t>(comm.rank())] = fmt::format(
              "rank {}'s result is not the sum {} of the ranks' values", comm.rank(), sum);
      });
      lab = *std::max_element(took.begin(), took.end());
      for (const std::string& w : wrong)
        if (!w.empty()) failures.push_back(w);
    } catch (const NotImplemented& error) {
      ADD_FAILURE() << error.what();
      return;
    } catch (const std::exception& error) {
      ADD_FAILURE() << fmt::format("{}: a rank failed with {}: {} ({})", describe(f),
                                   grading::type_name(error), error.what(), draws.describe());
      continue;
    }
    const double flat =
        simulate(layout, network, draws, [&](Communicator& comm, Communicator&, Communicator&) {
          std::vector<float> data(elements, 1.0f);
          comm.allreduce(std::span(data), ReduceOp::kSum)->wait();
        });
    const double formula = hierarchical_formula(bytes, f);
    const double predicted_factor = flat_formula(bytes, f) / formula;
    const double factor = flat / lab;
    worst = std::max(worst, std::abs(lab - formula) / formula);
    if (!(std::abs(lab - formula) <= 0.01 * formula))
      failures.push_back(fmt::format(
          "hierarchical_allreduce took {:.4g} ms of simulated time; the three phases take {:.4g} "
          "ms (dp/clock.h), so {:.3g}x faster than the flat ring's {:.4g} ms; yours is {:.3g}x",
          lab * 1e3, formula * 1e3, predicted_factor, flat * 1e3, factor));
    if (!failures.empty()) {
      ADD_FAILURE() << fmt::format("{}, {} bytes per rank: {}. Drawn: {}", describe(f), bytes,
                                   fmt::join(failures, "; "), draws.describe());
      continue;
    }
    seen.push_back(fmt::format("{}x on {}", fmt::format("{:.2f}", factor), describe(f)));
  }
  grading::note_measured(
      fmt::format("faster than the flat ring by {} (largest deviation from the "
                  "closed form {:.2g}%)",
                  fmt::join(seen, ", "), worst * 100));
}

// --- Lab9Hsdp ------------------------------------------------------------------------------------

using Training = grading::ShardedTraining;

/// A drawn training (grading::draw_sharded_training), h1 moved up until the model's size
/// needs padding on every node size above 1 of `layouts`.
Training draw_training(Draws& draws, const std::string& optimizer,
                       const std::vector<Layout>& layouts) {
  Training training = grading::draw_sharded_training(draws, optimizer);
  TrainOptions& o = training.options;
  for (std::int64_t h1 = training.hidden1; h1 < training.hidden1 + 64; ++h1) {
    o.model = fmt::format("64-{}-{}-10", h1, training.hidden2);
    const std::size_t psi = make_model(o).num_parameters();
    if (std::ranges::all_of(layouts, [&](const Layout& l) {
          return l.k == 1 || psi % static_cast<std::size_t>(l.k) != 0;
        }))
      break;
  }
  return training;
}

/// The contract's HSDP arithmetic on `layout`: the hierarchical sum, / p, the update.
grading::Trajectory emulate_hsdp(const TrainOptions& options, const Dataset& data,
                                 const Layout& layout) {
  grading::Emulation how;
  const int k = layout.k;
  how.sum = [k](const std::vector<std::vector<float>>& local) {
    return hierarchical_sum(local, k);
  };
  return grading::emulate_data_parallel(options, data, layout.world, how);
}

/// "" when `shard` is this rank's slice [i S, (i+1) S) of `all`, padding zero.
std::string check_shard(std::span<const float> all, std::size_t shard_size, int index,
                        const Tensor& shard) {
  if (shard.size() != shard_size)
    return fmt::format("shard_parameters() holds {} elements; expected S = {}", shard.size(),
                       shard_size);
  const std::vector<float> values = grading::host_values(shard);
  const std::size_t begin = static_cast<std::size_t>(index) * shard_size;
  for (std::size_t i = 0; i < shard_size; ++i) {
    const float expected = begin + i < all.size() ? all[begin + i] : 0.0f;
    if (std::memcmp(&values[i], &expected, sizeof(float)) != 0)
      return fmt::format(
          "shard_parameters()[{}] (flat element {}) holds {}; expected {} (node "
          "index {} owns [{}, {}))",
          i, begin + i, values[i], expected, index, begin, begin + shard_size);
  }
  return "";
}

TEST(Lab9Hsdp, BitwiseTheContractsSumOrderAfterEveryStep) {
  Draws draws("Lab9Hsdp.BitwiseTheContractsSumOrderAfterEveryStep");
  std::vector<Layout> layouts = drawn_layouts(draws);
  // 3 nodes of 3: neither N nor k a power of two, so that dividing by N and then by k (an
  // average across, say) rounds differently from dividing by p once, as the contract says.
  if (grading::check_backend() == Backend::kLocal) layouts.push_back({9, 3});
  std::vector<Training> trainings;
  for (const std::string optimizer : {"sgd", "adamw"})
    trainings.push_back(draw_training(draws, optimizer, layouts));
  for (const Training& training : trainings)
    for (const Layout& layout : layouts) {
      const TrainOptions options = training.for_world(layout.world);
      const grading::Trajectory exact = emulate_hsdp(options, *training.data, layout);
      run_on_nodes(
          layout,
          [&](Communicator& comm, Verdict& verdict) {
            auto watch = std::make_shared<Watch>();
            Watched world(comm, watch);
            Model model = training.model();
            const std::size_t psi = model.num_parameters();
            const std::size_t shard =
                (psi + static_cast<std::size_t>(layout.k) - 1) / static_cast<std::size_t>(layout.k);
            // The constructor's errors (every rank alike, so that none waits for a peer).
            const std::vector<std::pair<std::string, OptimizerFactory>> bad_factories = {
                {"an empty factory", OptimizerFactory{}},
                {"a factory returning nullptr",
                 [](std::size_t) -> std::unique_ptr<Optimizer> { return nullptr; }},
                {"a factory whose optimizer keeps state for S + 1 elements",
                 [&](std::size_t s) { return grading::optimizer_for(options, s + 1); }}};
            for (const auto& [what, factory] : bad_factories) {
              try {
                HsdpOptimizer bad(model, world, layout.k, factory);
                verdict.fail(
                    fmt::format("HsdpOptimizer with {} was constructed; expected "
                                "dp::Error",
                                what));
              } catch (const NotImplemented&) {
                throw;
              } catch (const Error&) {
              }
            }
            HsdpOptimizer hsdp(model, world, layout.k, grading::shard_optimizer_factory(options));
            if (hsdp.shard_elements() != shard)
              verdict.fail(fmt::format("shard_elements() is {}; expected ceil(Psi / k) = {}",
                                       hsdp.shard_elements(), shard));
            for (int step = 1; step <= options.steps; ++step) {
              const Batch batch = grading::on_check_device(grading::local_batch(
                  *training.data, options, step - 1, comm.rank(), layout.world));
              model.zero_grad();
              model.backward(grading::forward(model, batch), batch.labels);
              const std::vector<float> local = model.flat_gradients();
              hsdp.step();
              if (!verdict.passed()) continue;
              const std::vector<float>& expected =
                  exact.parameters_after_step[static_cast<std::size_t>(step - 1)];
              const std::vector<float> seen = model.flat_parameters();
              const std::string finding =
                  grading::compare_flat(model, seen, expected, 0.0f, "parameter");
              if (!finding.empty()) {
                verdict.fail(
                    fmt::format("{}, after step {}: {} (the contract's sum order: each "
                                "node's sum in rank order, then the nodes', / p)",
                                options.optimizer, step, finding));
                continue;
              }
              if (model.flat_gradients() != local)
                verdict.fail(
                    fmt::format("step {} changed Parameter::grad; expected the local "
                                "gradients left as backward made them",
                                step));
              verdict.expect_empty(
                  check_shard(expected, shard, comm.rank() % layout.k, hsdp.shard_parameters()),
                  fmt::format("after step {}", step));
            }
            if (verdict.passed())
              verdict.note(
                  fmt::format("SGD and AdamW on {}: every rank bitwise the contract's "
                              "arithmetic after {} steps (Psi = {}, S = {})",
                              training.model_name(), options.steps, psi, shard));
          },
          draws);
    }
}

/// The bytes one rank sends in a ring all-reduce of `elements` floats over `ranks` ranks, as
/// rank `rank` (dp/comm.h's counts: chunk i is [n i / p, n (i+1) / p)).
std::uint64_t ring_allreduce_bytes(std::uint64_t elements, std::uint64_t ranks,
                                   std::uint64_t rank) {
  if (ranks < 2) return 0;
  const std::uint64_t chunk = elements * (rank + 1) / ranks - elements * rank / ranks;
  return 4 * ((ranks - 1) * chunk + (elements - chunk));
}

TEST(Lab9Hsdp, MemoryAndBytesPerRankDdpFsdpHsdp) {
  Draws draws("Lab9Hsdp.MemoryAndBytesPerRankDdpFsdpHsdp");
  const std::vector<Layout> layouts = drawn_layouts(draws);
  const Training training = draw_training(draws, "adamw", layouts);
  for (const Layout& layout : layouts) {
    const TrainOptions options = training.for_world(layout.world);
    run_on_nodes(
        layout,
        [&](Communicator& comm, Verdict& verdict) {
          auto watch = std::make_shared<Watch>();
          Watched world(comm, watch);
          Model model = training.model();
          const std::size_t psi = model.num_parameters();
          const auto k = static_cast<std::size_t>(layout.k);
          const std::size_t s = (psi + k - 1) / k;
          const auto bytes = [](std::size_t floats) {
            return static_cast<std::int64_t>(4 * floats);
          };
          MemoryTracker& tracker = this_rank_memory().tracker();
          const grading::CategoryBytes base = grading::current_bytes(tracker);
          tracker.reset_peaks();
          HsdpOptimizer hsdp(model, world, layout.k, grading::shard_optimizer_factory(options));
          const std::string name = layout.k == 1              ? "DDP (k = 1)"
                                   : layout.k == layout.world ? "full sharding (k = p)"
                                                              : "HSDP";
          // The formulas: optimizer state 2 x 4 S exactly (AdamW), at most one padded flat
          // buffer of communication, a shard of gradients, a shard of parameters.
          const auto judge = [&](const grading::CategoryBytes& held, std::string_view when,
                                 bool activations) {
            std::vector<std::string> over;
            if (held[MemoryCategory::kOptimizerState] != bytes(2 * s))
              over.push_back(fmt::format("optimizer state {} bytes, expected exactly 8 S = {}",
                                         held[MemoryCategory::kOptimizerState], bytes(2 * s)));
            const auto at_most = [&](MemoryCategory c, std::int64_t budget,
                                     std::string_view formula) {
              if (held[c] > budget)
                over.push_back(fmt::format("{} {} bytes, at most {} = {}", to_string(c), held[c],
                                           formula, budget));
            };
            at_most(MemoryCategory::kCommunication, bytes(k * s), "4 k S");
            at_most(MemoryCategory::kGradients, bytes(s), "4 S");
            at_most(MemoryCategory::kParameters, bytes(s), "4 S");
            at_most(MemoryCategory::kOther, 0, "0");
            if (activations) at_most(MemoryCategory::kActivations, 0, "0");
            if (!over.empty())
              verdict.fail(
                  fmt::format("{} {} (Psi = {}, k = {}, S = {}), beyond the model's own: {}", name,
                              when, psi, k, s, fmt::join(over, "; ")));
          };
          judge(grading::current_bytes(tracker) - base, "after the constructor", true);
          judge(grading::peak_bytes(tracker) - base, "at the constructor's peak", true);
          const std::uint64_t nodes = static_cast<std::uint64_t>(layout.nodes());
          const std::uint64_t intra = 2 * (k - 1) * 4 * s;
          const std::uint64_t inter =
              ring_allreduce_bytes(s, nodes, static_cast<std::uint64_t>(comm.rank() / layout.k));
          for (int step = 1; step <= 2; ++step) {
            const Batch batch = grading::on_check_device(
                grading::local_batch(*training.data, options, step - 1, comm.rank(), layout.world));
            model.zero_grad();
            model.backward(grading::forward(model, batch), batch.labels);
            const grading::CategoryBytes before = grading::current_bytes(tracker);
            const CommCounters world_before = comm.counters();
            const CommCounters children_before = watch->children();
            // The constructor allocates every buffer: step() makes no tensor and takes no
            // large block from the heap (a flat buffer made per step is both).
            const std::size_t tensors_before = tracker.allocations_total();
            const grading::HeapUse heap_before = grading::heap_use_of_this_thread();
            hsdp.step();
            const grading::HeapUse step_heap =
                grading::heap_use_of_this_thread().since(heap_before);
            const std::size_t step_tensors = tracker.allocations_total() - tensors_before;
            if (step_tensors != 0 || step_heap.large_bytes != 0)
              verdict.fail(fmt::format(
                  "step {} allocated {} tensor(s) and {} bytes in blocks of {} bytes or more "
                  "from the heap; expected none (the constructor allocates every buffer)",
                  step, step_tensors, step_heap.large_bytes, grading::kLargeAllocationBytes));
            // The model's forward keeps its activations: they are the model's, not the step's.
            judge(grading::current_bytes(tracker) - base, fmt::format("after step {}", step),
                  false);
            const grading::CategoryBytes added = grading::current_bytes(tracker) - before;
            if (added.total() != 0)
              verdict.fail(fmt::format("step {} left {} bytes more than before it ({})", step,
                                       added.total(), grading::describe_bytes(added)));
            verdict.expect_empty(world_calls(comm.counters().since(world_before)),
                                 fmt::format("step {}", step));
            const CommCounters moved = watch->children().since(children_before);
            verdict.expect_empty(step_calls(moved), fmt::format("step {}", step));
            verdict.expect_empty(link_bytes(moved, intra, inter),
                                 fmt::format("step {} ({}, S = {})", step, name, s));
          }
          if (verdict.passed())
            verdict.note(fmt::format(
                "{}: optimizer state {} bytes per rank (DDP's {}); per step {} bytes inside the "
                "node and {} across",
                name, 8 * s, 8 * psi, intra, inter));
        },
        draws);
  }
}

// --- Lab9Design ---------------------------------------------------------------------------------

/// One drawn design case.
struct DesignCase {
  TwoLevelFabric fabric;
  std::size_t allreduce_bytes = 0;  ///< a multiple of 4 p
  std::size_t num_parameters = 0;
  std::string why;
};

/// The seconds the simulated clock gives each schedule of a case.
struct DesignTruth {
  double flat = 0;
  double hierarchical = 0;
  double full_sharding = 0;
  double hsdp = 0;
};

DesignTruth simulate_case(const DesignCase& c, const Draws& draws) {
  const TwoLevelFabric& f = c.fabric;
  const Layout layout{f.nodes * f.ranks_per_node, f.ranks_per_node};
  const NetworkModel network = two_levels(f.intra, f.inter, f.ranks_per_node);
  const std::size_t n = c.allreduce_bytes / 4;
  const auto k = static_cast<std::size_t>(f.ranks_per_node);
  const auto p = static_cast<std::size_t>(layout.world);
  DesignTruth truth;
  truth.flat =
      simulate(layout, network, draws, [&](Communicator& comm, Communicator&, Communicator&) {
        std::vector<float> data(n, 1.0f);
        comm.allreduce(std::span(data), ReduceOp::kSum)->wait();
      });
  truth.hierarchical = simulate(
      layout, network, draws, [&](Communicator&, Communicator& node, Communicator& across) {
        std::vector<float> data(n, 1.0f);
        std::vector<float> shard(n / k);
        node.reduce_scatter(std::span<const float>(data), std::span(shard), ReduceOp::kSum)->wait();
        across.allreduce(std::span(shard), ReduceOp::kSum)->wait();
        node.allgather(std::span<const float>(shard), std::span(data))->wait();
      });
  const std::size_t full_shard = (c.num_parameters + p - 1) / p;
  truth.full_sharding =
      simulate(layout, network, draws, [&](Communicator& comm, Communicator&, Communicator&) {
        std::vector<float> flat(full_shard * p, 1.0f);
        std::vector<float> shard(full_shard);
        comm.reduce_scatter(std::span<const float>(flat), std::span(shard), ReduceOp::kSum)->wait();
        comm.allgather(std::span<const float>(shard), std::span(flat))->wait();
      });
  const std::size_t hsdp_shard = (c.num_parameters + k - 1) / k;
  truth.hsdp = simulate(
      layout, network, draws, [&](Communicator&, Communicator& node, Communicator& across) {
        std::vector<float> flat(hsdp_shard * k, 1.0f);
        std::vector<float> shard(hsdp_shard);
        node.reduce_scatter(std::span<const float>(flat), std::span(shard), ReduceOp::kSum)->wait();
        across.allreduce(std::span(shard), ReduceOp::kSum)->wait();
        node.allgather(std::span<const float>(shard), std::span(flat))->wait();
      });
  return truth;
}

/// A plausible wrong formula: the right one with one term changed. The draws must put each at
/// least 3% from the simulated clock on some case, or the check could not tell it.
struct NearMiss {
  std::string name;
  std::function<double(const DesignCase&)> value;
  std::function<double(const DesignTruth&)> truth;
};

// The plausible wrong formulas (each the right one with one term changed) name the answer:
// they live in instructor/near_misses.h, which the student release leaves out. There the check
// grades the same (against the simulated clock, which is the answer) and does not verify its
// draws against the near misses.
#if __has_include("instructor/near_misses.h")
#include "instructor/near_misses.h"
#else
std::vector<NearMiss> near_misses() {
  return {};
}
#endif

double log_uniform(Draws& draws, std::string_view name, double low, double high) {
  return low * std::pow(high / low, static_cast<double>(draws.uniform(name, 0.0f, 1.0f)));
}

/// A level's link drawn log-uniformly: alpha in [alpha_low, alpha_high] seconds and bandwidth
/// in [bandwidth_low, bandwidth_high] bytes per second, recorded as "alpha <where> (s)" and
/// "bandwidth <where>" (where: "inside" a node or "across" nodes).
LinkModel drawn_link(Draws& draws, std::string_view where, double alpha_low, double alpha_high,
                     double bandwidth_low, double bandwidth_high) {
  LinkModel link;
  link.alpha_seconds =
      log_uniform(draws, fmt::format("alpha {} (s)", where), alpha_low, alpha_high);
  link.bytes_per_second =
      log_uniform(draws, fmt::format("bandwidth {}", where), bandwidth_low, bandwidth_high);
  return link;
}

/// The cases: a bandwidth-bound one on NVLink and 10 GbE, a latency-bound one with slow
/// switches, a custom pair of fabrics, and InfiniBand between nodes of 4.
std::vector<DesignCase> draw_design_cases(Draws& draws) {
  std::vector<DesignCase> cases;
  const LinkModel nvlink = NetworkModel::preset("nvlink").fabric;
  // psi_per_rank > 0 sets Psi = p x psi_per_rank + 1: a model of a few parameters per rank,
  // whose padding is a large part of every shard.
  const auto add = [&](std::string why, int nodes, int k, LinkModel intra, LinkModel inter,
                       double bytes_low, double bytes_high, std::size_t psi_per_rank = 0) {
    DesignCase c;
    c.why = std::move(why);
    c.fabric = {nodes, k, intra, inter};
    const auto p = static_cast<std::size_t>(nodes * k);
    const auto per_rank = static_cast<std::size_t>(
        log_uniform(draws, "bytes", bytes_low, bytes_high) / (4.0 * static_cast<double>(p)));
    c.allreduce_bytes = 4 * p * std::max<std::size_t>(per_rank, 1);
    // Psi: not a multiple of k nor of p, so that both paddings show.
    c.num_parameters =
        psi_per_rank > 0
            ? p * psi_per_rank + 1
            : c.allreduce_bytes / 4 + static_cast<std::size_t>(draws.integer("Psi - n", 1, 3));
    while (c.num_parameters % static_cast<std::size_t>(k) == 0 || c.num_parameters % p == 0)
      ++c.num_parameters;
    cases.push_back(std::move(c));
  };
  draws.section("[bandwidth-bound, NVLink and 10 GbE:]");
  add("bandwidth-bound", static_cast<int>(draws.integer("nodes", 2, 4)),
      draws.pick<int>("k", {2, 4}), nvlink, NetworkModel::preset("10gbe").fabric, 1 << 20, 4 << 20);
  draws.section("[latency-bound:]");
  const LinkModel slow_switch = drawn_link(draws, "across", 20e-6, 80e-6, 10e9, 50e9);
  add("latency-bound", static_cast<int>(draws.integer("nodes", 2, 4)), draws.pick<int>("k", {2, 4}),
      nvlink, slow_switch, 8 << 10, 64 << 10);
  draws.section("[custom:]");
  const LinkModel intra = drawn_link(draws, "inside", 0.5e-6, 5e-6, 100e9, 400e9);
  const LinkModel inter = drawn_link(draws, "across", 2e-6, 50e-6, 1e9, 50e9);
  add("custom", static_cast<int>(draws.integer("nodes", 2, 3)), draws.pick<int>("k", {2, 3, 4}),
      intra, inter, 64 << 10, 2 << 20);
  draws.section("[InfiniBand:]");
  add("ib-ndr", 2, 4, nvlink, NetworkModel::preset("ib-ndr").fabric, 256 << 10, 2 << 20);
  // A node fabric slower than the network between nodes (GPUs on PCIe, a fast NIC each): the
  // flat ring's step is paced by its hop inside a node, not by the one across.
  draws.section("[PCIe inside, InfiniBand across:]");
  const LinkModel pcie = drawn_link(draws, "inside", 2e-6, 5e-6, 12e9, 25e9);
  add("PCIe inside", static_cast<int>(draws.integer("nodes", 2, 4)), draws.pick<int>("k", {2, 4}),
      pcie, NetworkModel::preset("ib-ndr").fabric, 4 << 20, 16 << 20);
  // The larger alpha on one level, the smaller bandwidth on the other (a switch of high latency
  // inside, slow NICs of low latency across), chunks where both terms weigh: a flat step is
  // the slower of the two hops, not the larger alpha plus the chunk at the smaller bandwidth.
  draws.section("[latency inside, bandwidth across:]");
  const LinkModel latent = drawn_link(draws, "inside", 10e-6, 20e-6, 100e9, 450e9);
  const LinkModel narrow = drawn_link(draws, "across", 1e-6, 2e-6, 2e9, 5e9);
  {
    const int nodes = static_cast<int>(draws.integer("nodes", 2, 4));
    const int k = draws.pick<int>("k", {2, 4});
    const double p = nodes * k;
    add("latency inside, bandwidth across", nodes, k, latent, narrow, p * (20 << 10),
        p * (100 << 10));
  }
  // A model of a few parameters per rank on links without latency: only bytes count, and the
  // shards' padding (Psi = p m + 1) is up to 3/8 of them.
  draws.section("[a few parameters per rank:]");
  LinkModel bare_intra = nvlink;
  bare_intra.alpha_seconds = 0;
  LinkModel bare_inter = NetworkModel::preset("10gbe").fabric;
  bare_inter.alpha_seconds = 0;
  add("a few parameters per rank", static_cast<int>(draws.integer("nodes", 2, 3)),
      draws.pick<int>("k", {2, 4}), bare_intra, bare_inter, 64 << 10, 256 << 10,
      static_cast<std::size_t>(draws.integer("Psi / p (rounded down)", 1, 3)));
  return cases;
}

std::string within(std::string_view what, double predicted, double simulated) {
  const double error = std::abs(predicted - simulated) / simulated;
  if (std::isfinite(predicted) && error <= 0.01) return "";
  return fmt::format(
      "{} predicted {:.6g} s, the simulated clock {:.6g} s (off by {:.3g}%, at most "
      "1%)",
      what, predicted, simulated, error * 100);
}

TEST(Lab9Design, PredictsFlatHierarchicalAndShardedTimes) {
  Draws draws("Lab9Design.PredictsFlatHierarchicalAndShardedTimes");
  const std::vector<DesignCase> cases = draw_design_cases(draws);
  const std::vector<NearMiss> misses = near_misses();
  std::vector<bool> parted(misses.size(), false);
  std::vector<std::string> notes;
  for (const DesignCase& c : cases) {
    const DesignTruth truth = simulate_case(c, draws);
    for (std::size_t m = 0; m < misses.size(); ++m) {
      const double right = misses[m].truth(truth);
      if (std::abs(misses[m].value(c) - right) >= 0.03 * right) parted[m] = true;
    }
    std::vector<std::string> findings;
    try {
      const auto add = [&](const std::string& finding) {
        if (!finding.empty()) findings.push_back(finding);
      };
      add(within("the flat ring:", predicted_flat_allreduce_seconds(c.allreduce_bytes, c.fabric),
                 truth.flat));
      add(within("the hierarchical all-reduce:",
                 predicted_hierarchical_allreduce_seconds(c.allreduce_bytes, c.fabric),
                 truth.hierarchical));
      add(within("full sharding's step:",
                 predicted_sharded_step_seconds(c.num_parameters, c.fabric, false),
                 truth.full_sharding));
      add(within("HSDP's step:", predicted_sharded_step_seconds(c.num_parameters, c.fabric, true),
                 truth.hsdp));
    } catch (const NotImplemented& error) {
      ADD_FAILURE() << error.what();
      return;
    }
    if (!findings.empty())
      ADD_FAILURE() << fmt::format("{} ({}), all-reduce of {} bytes, Psi = {}: {}. Drawn: {}",
                                   describe(c.fabric), c.why, c.allreduce_bytes, c.num_parameters,
                                   fmt::join(findings, "; "), draws.describe());
    notes.push_back(
        fmt::format("{}: hierarchical {:.2f}x the flat ring, HSDP {:.2f}x full sharding", c.why,
                    truth.flat / truth.hierarchical, truth.full_sharding / truth.hsdp));
  }
  for (std::size_t m = 0; m < misses.size(); ++m)
    if (!parted[m])
      ADD_FAILURE() << fmt::format(
          "grader bug: no drawn case puts the plausible wrong formula '{}' "
          "3% from the simulated clock. Drawn: {}",
          misses[m].name, draws.describe());
  grading::note_measured(fmt::format("{}", fmt::join(notes, "; ")));
}

}  // namespace
}  // namespace dp::lab9
