// hierarchical_allreduce_figure: the simulated time of a flat ring all-reduce against a
// hierarchical one on two levels of network, as the nodes grow (issue 31, the figure beside
// "Two levels" in dp/clock.h), with their closed forms.
//
//   hierarchical_allreduce_figure                   # a table: 2-16 nodes of 8, 16 MiB per rank
//   hierarchical_allreduce_figure --csv             # the same numbers as CSV
//   hierarchical_allreduce_figure --nodes 2,4 --ranks-per-node 4 --elements 65536 --net 10gbe
//
// Each run is a launch of nodes x k local ranks on the simulated network: NVLink inside a
// node, the --net preset between nodes, a NIC per rank (a DGX). The flat ring is the native
// `allreduce` of the launch's communicator; the hierarchical all-reduce is a reduce-scatter
// on the node's communicator, an all-reduce of the shard on the communicator of the ranks
// with one index in every node, an all-gather on the node's (`Communicator::split`). Each is
// timed from a common start (the splits, charged as barriers, come first) to its last rank's
// end. Beside each the closed form of dp/clock.h, "Native collectives", with
// m(b, link) = alpha + b / bandwidth:
//   flat          2 (p-1) max(m(n/p, nvlink), m(n/p, net))       (the ring steps at its
//                                                                 slowest hop)
//   hierarchical  2 (k-1) m(n/k, nvlink) + 2 (N-1) m(n/(kN), net)
// The program exits 1 if a simulated time is off its closed form by more than 1e-9
// relatively: the figure is drawn only from times the formulas explain. Everything is
// deterministic (simulated clock): the same numbers on every machine.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "dp/clock.h"
#include "dp/comm.h"
#include "dp/launch.h"

namespace {

/// `nodes` x `k` ranks: NVLink inside a node, `net` between nodes, a NIC per rank.
dp::LaunchOptions two_levels(int nodes, int k, const std::string& net) {
  dp::LaunchOptions options;
  options.world_size = nodes * k;
  options.simulation = dp::SimulationOptions::preset(net);
  options.simulation.network.fabric = dp::NetworkModel::preset("nvlink").fabric;
  options.simulation.network.ranks_per_node = k;
  options.simulation.record_trace = false;
  return options;
}

/// The last rank's seconds from a common start to the end of `run` (every rank calls it).
template <typename Run>
double simulated_seconds(const dp::LaunchOptions& options, std::size_t elements, Run run) {
  std::vector<double> took(static_cast<std::size_t>(options.world_size));
  dp::launch(options, [&](dp::Communicator& comm) {
    const int k = options.simulation.network.ranks_per_node;
    const std::unique_ptr<dp::Communicator> node = comm.split(comm.rank() / k, comm.rank());
    const std::unique_ptr<dp::Communicator> across = comm.split(comm.rank() % k, comm.rank());
    std::vector<float> data(elements, 1.0f);
    const double start = comm.clock().now();
    run(comm, *node, *across, data);
    took[static_cast<std::size_t>(comm.rank())] = comm.clock().now() - start;
  });
  return *std::max_element(took.begin(), took.end());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The flat ring against the hierarchical all-reduce on two levels of network"};
  std::vector<int> nodes = {2, 4, 8, 16};
  int k = 8;
  std::size_t elements = std::size_t{1} << 22;  // 16 MiB of float32 per rank
  std::vector<std::string> nets = {"ib-ndr", "100gbe"};
  bool csv = false;
  app.add_option("--nodes", nodes, "the node counts N")->delimiter(',');
  app.add_option("--ranks-per-node", k, "ranks per node k (on NVLink)");
  app.add_option("--elements", elements, "float32 elements per rank (a multiple of k)");
  app.add_option("--net", nets, "the networks between nodes")->delimiter(',');
  app.add_flag("--csv", csv, "CSV instead of a table");
  CLI11_PARSE(app, argc, argv);
  if (k < 1 || elements % static_cast<std::size_t>(k) != 0) {
    fmt::print(stderr, "--elements must be a multiple of --ranks-per-node\n");
    return 2;
  }

  const double n = static_cast<double>(elements * sizeof(float));
  const dp::LinkModel nvlink = dp::NetworkModel::preset("nvlink").fabric;
  if (csv)
    fmt::print("net,nodes,ranks,bytes,algorithm,simulated_ms,formula_ms\n");
  else
    fmt::print("{:>8}  {:>5}  {:>5}  {:>12}  {:>13}  {:>13}  {:>6}\n", "net", "N", "p", "algorithm",
               "simulated ms", "formula ms", "ratio");
  bool explained = true;
  for (const std::string& net : nets) {
    const dp::LinkModel between = dp::NetworkModel::preset(net).fabric;
    for (int N : nodes) {
      const int p = N * k;
      const dp::LaunchOptions options = two_levels(N, k, net);
      const double flat =
          simulated_seconds(options, elements,
                            [](dp::Communicator& comm, dp::Communicator&, dp::Communicator&,
                               std::vector<float>& data) {
                              comm.allreduce(std::span(data), dp::ReduceOp::kSum)->wait();
                            });
      const double hierarchical = simulated_seconds(
          options, elements,
          [&](dp::Communicator&, dp::Communicator& node, dp::Communicator& across,
              std::vector<float>& data) {
            std::vector<float> shard(elements / static_cast<std::size_t>(k));
            node.reduce_scatter(std::span<const float>(data), std::span(shard), dp::ReduceOp::kSum)
                ->wait();
            across.allreduce(std::span(shard), dp::ReduceOp::kSum)->wait();
            node.allgather(std::span<const float>(shard), std::span(data))->wait();
          });
      const double flat_formula =
          2.0 * (p - 1) * std::max(nvlink.time_of(n / p), between.time_of(n / p));
      const double hierarchical_formula =
          2.0 * (k - 1) * nvlink.time_of(n / k) + 2.0 * (N - 1) * between.time_of(n / (k * N));
      for (const auto& [name, simulated, formula] :
           {std::tuple{"flat ring", flat, flat_formula},
            std::tuple{"hierarchical", hierarchical, hierarchical_formula}}) {
        if (std::abs(simulated - formula) > 1e-9 * formula) {
          fmt::print(stderr, "{} on {} nodes of {} over {}: simulated {} s, formula {} s\n", name,
                     N, k, net, simulated, formula);
          explained = false;
        }
        if (csv)
          fmt::print("nvlink+{},{},{},{},{},{:.4f},{:.4f}\n", net, N, p, elements * sizeof(float),
                     name, simulated * 1e3, formula * 1e3);
        else
          fmt::print("{:>8}  {:>5}  {:>5}  {:>12}  {:>13.4f}  {:>13.4f}  {:>6.2f}\n", net, N, p,
                     name, simulated * 1e3, formula * 1e3, flat / hierarchical);
      }
    }
  }
  return explained ? 0 : 1;
}
