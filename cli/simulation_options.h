// simulation_options.h: the command-line options of the simulated interconnect and clock,
// shared by `dplab train` and `dplab bench-comm`.
//
//   --net ib-ndr                        simulate InfiniBand NDR between all ranks
//   --alpha 5 --bandwidth 25            a custom fabric: 5 us per message, 25 GB/s
//   --net 100gbe --ranks-per-node 4     two levels: 4 ranks per node on NVLink
//                                       (--intra-net), nodes on 100 GbE
//   --nics-per-node 1                   ... and the 4 ranks of a node share one NIC
//                                       (default: one NIC per rank)
//   --sim-device h100 --compute measured  the compute model (--sim-device, not --device:
//                                         --device says where tensors live, host or cuda)
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>

#include "dp/clock.h"

namespace dp::cli {

/// What the simulation options hold before they are turned into `SimulationOptions`.
struct SimulationArguments {
  std::string net;                       ///< network preset; empty: no simulation
  std::optional<double> alpha_us;        ///< custom latency in microseconds (the preset's if unset)
  std::optional<double> bandwidth_gbps;  ///< custom bandwidth in GB/s (the preset's if unset)
  int ranks_per_node = 0;                ///< two levels when > 0
  int nics_per_node = 0;                 ///< two levels: NICs per node; 0: one per rank
  std::string intra_net = "nvlink";      ///< the fabric inside a node (two levels)
  std::string device = "a100";           ///< device preset
  std::string compute = "roofline";      ///< roofline or measured
};

/// Adds --net, --alpha, --bandwidth, --ranks-per-node, --nics-per-node, --intra-net,
/// --sim-device and --compute.
void add_simulation_options(CLI::App& command, SimulationArguments& args);

/// The simulation the arguments ask for: enabled when --net, --alpha or --bandwidth is
/// given. Throws `dp::Error` on unknown names or values out of range.
SimulationOptions simulation_options(const SimulationArguments& args);

}  // namespace dp::cli
