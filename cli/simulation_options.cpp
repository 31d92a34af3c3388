#include "simulation_options.h"

#include <fmt/format.h>

#include <cmath>

#include "dp/error.h"
#include "option_checks.h"

namespace dp::cli {

void add_simulation_options(CLI::App& command, SimulationArguments& args) {
  const std::string nets = fmt::format("{}", fmt::join(NetworkModel::preset_names(), ", "));
  command
      .add_option("--net", args.net,
                  fmt::format("Simulate time on this network (local backend): {}", nets))
      ->group("Simulated clock");
  // Checked as they are parsed: before, --alpha -5 was ignored and --bandwidth nan accepted.
  command
      .add_option("--alpha", args.alpha_us,
                  "Simulated latency per message in microseconds (overrides --net's)")
      ->check(finite_in(0, 1e9))
      ->group("Simulated clock");
  command
      .add_option("--bandwidth", args.bandwidth_gbps,
                  "Simulated link bandwidth per direction in GB/s (overrides --net's)")
      ->check(positive_finite(1e9))
      ->group("Simulated clock");
  command
      .add_option("--ranks-per-node", args.ranks_per_node,
                  "Two levels: this many ranks per node on --intra-net, nodes on --net")
      ->check(whole_number_at_least(0))
      ->group("Simulated clock");
  command
      .add_option("--nics-per-node", args.nics_per_node,
                  "Two levels: inter-node ports per node, shared by its ranks (rank r of a node "
                  "uses NIC r mod this); must divide --ranks-per-node [default: one per rank]")
      ->check(whole_number_at_least(1))
      ->group("Simulated clock");
  command.add_option("--intra-net", args.intra_net, "The network inside a node (two levels)")
      ->capture_default_str()
      ->group("Simulated clock");
  command
      .add_option("--sim-device", args.device,
                  fmt::format("Simulated device: {}", fmt::join(DeviceModel::preset_names(), ", ")))
      ->capture_default_str()
      ->group("Simulated clock");
  command
      .add_option("--compute", args.compute,
                  "roofline (deterministic) or measured (thread CPU time)")
      ->capture_default_str()
      ->group("Simulated clock");
}

SimulationOptions simulation_options(const SimulationArguments& args) {
  SimulationOptions options;
  const bool custom = args.alpha_us.has_value() || args.bandwidth_gbps.has_value();
  options.enabled = !args.net.empty() || custom;
  if (!options.enabled) return options;
  if (!args.net.empty()) options.network = NetworkModel::preset(args.net);
  if (custom) options.network.name = args.net.empty() ? "custom" : args.net + " (modified)";
  // The same ranges as the options' checks, for callers that fill the arguments in code.
  if (args.alpha_us) {
    if (!(std::isfinite(*args.alpha_us) && *args.alpha_us >= 0))
      throw Error(fmt::format("--alpha must be a finite number >= 0, got {}", *args.alpha_us));
    options.network.fabric.alpha_seconds = *args.alpha_us * 1e-6;
  }
  if (args.bandwidth_gbps) {
    if (!(std::isfinite(*args.bandwidth_gbps) && *args.bandwidth_gbps > 0))
      throw Error(
          fmt::format("--bandwidth must be a finite number above 0, got {}", *args.bandwidth_gbps));
    options.network.fabric.bytes_per_second = *args.bandwidth_gbps * 1e9;
  }
  if (args.ranks_per_node < 0)
    throw Error(fmt::format("--ranks-per-node must be >= 0, got {}", args.ranks_per_node));
  if (args.nics_per_node < 0)
    throw Error(fmt::format("--nics-per-node must be >= 1, got {}", args.nics_per_node));
  if (args.nics_per_node > 0 && args.ranks_per_node == 0)
    throw Error(fmt::format(
        "--nics-per-node {} needs two levels: add --ranks-per-node (the NICs are shared by the "
        "ranks of a node)",
        args.nics_per_node));
  if (args.nics_per_node > 0 && args.ranks_per_node % args.nics_per_node != 0)
    throw Error(fmt::format(
        "--nics-per-node must divide --ranks-per-node: got {} NICs for {} ranks per node",
        args.nics_per_node, args.ranks_per_node));
  if (args.ranks_per_node > 0) {
    // Nodes talk over --net (with its overrides); ranks of a node over --intra-net.
    options.network.inter_node = options.network.fabric;
    options.network.fabric = NetworkModel::preset(args.intra_net).fabric;
    options.network.ranks_per_node = args.ranks_per_node;
    options.network.nics_per_node = args.nics_per_node;
  }
  options.device = DeviceModel::preset(args.device);
  if (args.compute == "roofline")
    options.compute = ComputeModel::kRoofline;
  else if (args.compute == "measured")
    options.compute = ComputeModel::kMeasured;
  else
    throw Error(
        fmt::format("unknown --compute '{}': expected 'roofline' or 'measured'", args.compute));
  return options;
}

}  // namespace dp::cli
