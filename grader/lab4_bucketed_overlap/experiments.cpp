// lab4_experiments: the measurements lab 4's handout asks for, run with your code on the
// simulated clock (local ranks as threads; the simulation is the local backend's).
//
//   lab4_experiments timeline                  # rank 0's ops in one step, flat and bucketed
//   lab4_experiments sweep                     # step time against the bucket cap, and your
//                                              # predicted cap
//   lab4_experiments sweep --alpha-us 80 --gbps 1.25   # the same on a fitted fabric
//
// Both print CSV (the handout's figures are drawn from that of the reference build,
// lab4_experiments_reference, by tools/lab4-figures). Times are simulated: the same on every
// machine. The defaults are the grader's speed configuration: device cpu, network 10gbe,
// 4 ranks, the MLP 64-640-...-640-10 (8 hidden layers), 48 rows per rank.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dp/clock.h"
#include "dp/data.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/tensor_ops.h"
#include "dp/trace.h"
#include "dp/trainer.h"
#include "ground_truth.h"
#include "lab4.h"

namespace dp::lab4 {
namespace {

/// What every command shares.
struct Setup {
  std::string net = "10gbe";
  double alpha_us = 0;  // with gbps: a fabric of this latency instead of `net`'s
  double gbps = 0;
  std::string device = "cpu";
  std::string model = "64-640-640-640-640-640-640-640-640-10";
  std::int64_t rows = 48;
  int ranks = 4;
  int steps = 2;
};

/// The simulated network and device of `setup`: the preset `net`, or with `alpha_us` and
/// `gbps` set, a fabric of that latency and bandwidth (as lab 0 fits one).
SimulationOptions simulation_of(const Setup& setup) {
  SimulationOptions simulation = SimulationOptions::preset(setup.net);
  if (setup.alpha_us > 0 && setup.gbps > 0) {
    simulation.network.name = "fitted";
    simulation.network.fabric.alpha_seconds = setup.alpha_us * 1e-6;
    simulation.network.fabric.bytes_per_second = setup.gbps * 1e9;
  }
  simulation.device = DeviceModel::preset(setup.device);
  return simulation;
}

/// How gradients are averaged: lab 2's flat buffer after backward, or buckets.
struct Strategy {
  bool bucketed = false;
  BucketOptions caps;
};

/// Runs `setup` with `strategy` and returns rank 0's trace (every step marked).
RankTrace run(const Setup& setup, const Strategy& strategy) {
  TrainOptions options;
  options.model = setup.model;
  options.global_batch = setup.rows * setup.ranks;
  options.dataset = fmt::format("synthetic:{}", options.global_batch);
  options.lr = 0.01f;
  const Dataset data = load_dataset(options.dataset, 1);
  LaunchOptions launch_options;
  launch_options.world_size = setup.ranks;
  launch_options.simulation = simulation_of(setup);
  RankTrace trace;
  launch(launch_options, [&](Communicator& comm) {
    Model model = make_model(options);
    const auto optimizer = make_optimizer("sgd", model.num_parameters(), options.lr, 0.0f, 0.0f);
    std::optional<BucketedDDP> ddp;
    Tensor flat;
    if (strategy.bucketed)
      ddp.emplace(model, comm, strategy.caps);
    else
      flat = Tensor({static_cast<std::int64_t>(model.num_parameters())},
                    MemoryCategory::kCommunication);
    comm.clock().mark_step();
    for (int step = 0; step < setup.steps; ++step) {
      const auto first = static_cast<std::size_t>(comm.rank() * setup.rows);
      std::vector<std::size_t> rows;
      for (std::size_t i = 0; i < static_cast<std::size_t>(setup.rows); ++i)
        rows.push_back(first + i);
      const Batch batch = gather_batch(data, rows);
      model.zero_grad();
      model.backward(model.forward(batch.inputs), batch.labels);
      if (ddp) {
        ddp->finish_gradient_sync();
      } else {  // lab 2's FlatGradientAverager
        grading::average_gradients_flat(model, comm, flat);
      }
      optimizer->step(model);
      comm.clock().mark_step();
    }
    if (comm.rank() == 0) trace = comm.clock().trace();
  });
  return trace;
}

/// The last step of `trace`, as CSV rows "strategy,lane,name,start_us,end_us" with times
/// from the step's start.
void print_last_step(const std::string& strategy, const RankTrace& trace) {
  const double begin = trace.step_marks[trace.step_marks.size() - 2];
  const double end = trace.step_marks.back();
  for (const TraceEvent& event : trace.events) {
    if (event.start < begin || event.start >= end) continue;
    const char* lane = event.lane == TraceLane::kCompute ? "compute" : "network";
    fmt::print("{},{},{},{:.3f},{:.3f}\n", strategy, lane, event.name, (event.start - begin) * 1e6,
               (event.start + event.duration - begin) * 1e6);
  }
}

void timeline(const Setup& setup, std::size_t cap) {
  fmt::print("strategy,lane,name,start_us,end_us\n");
  print_last_step("flat (lab 2)", run(setup, {}));
  print_last_step("bucketed", run(setup, {true, {cap, cap}}));
}

/// The profile of one backward, as the grader measures it.
BackwardProfile profile(const Setup& setup) {
  TrainOptions options;
  options.model = setup.model;
  options.global_batch = setup.rows;
  options.dataset = fmt::format("synthetic:{}", setup.rows);
  const Dataset data = load_dataset(options.dataset, 1);
  LaunchOptions launch_options;
  launch_options.simulation = simulation_of(setup);
  BackwardProfile result;
  launch(launch_options, [&](Communicator& comm) {
    Model model = make_model(options);
    double start = 0;
    model.on_gradient_ready([&](Parameter& parameter) {
      result.gradients.push_back({parameter.grad.bytes(), comm.clock().now() - start});
    });
    std::vector<std::size_t> rows;
    for (std::size_t i = 0; i < static_cast<std::size_t>(setup.rows); ++i) rows.push_back(i);
    const Batch batch = gather_batch(data, rows);
    const Tensor logits = model.forward(batch.inputs);
    start = comm.clock().now();
    model.backward(logits, batch.labels);
    result.backward_seconds = comm.clock().now() - start;
  });
  return result;
}

/// Prints the step time against the bucket cap, from `smallest_cap` up by doubling to the
/// whole gradient, then the predicted cap and the flat step (CSV, the header when `header`).
void sweep(const Setup& setup, std::size_t smallest_cap, bool header) {
  const BackwardProfile measured = profile(setup);
  std::size_t total = 0;
  for (const GradientReady& gradient : measured.gradients) total += gradient.bytes;
  const std::size_t predicted =
      predicted_best_bucket_cap_bytes(measured, setup.ranks, simulation_of(setup).network.fabric);
  const double flat_us = summarize_steps(run(setup, {})).back().total * 1e6;
  const SimulationOptions simulation = simulation_of(setup);
  const std::string fabric =
      fmt::format("alpha {:.3g} us / {:.3g} GB/s", simulation.network.fabric.alpha_seconds * 1e6,
                  simulation.network.fabric.bytes_per_second / 1e9);
  // Each row also divides the step by the flat buffer's, so that sweeps over fabrics of very
  // different speeds share one axis.
  const auto row = [&](const char* series, std::size_t cap, double step_us) {
    fmt::print("{},{},{},{:.3f},{:.4f}\n", fabric, series, cap, step_us, step_us / flat_us);
  };
  if (header) fmt::print("fabric,series,cap_bytes,step_us,per_flat\n");
  double lowest = 0;
  double highest = 0;
  for (std::size_t cap = smallest_cap;; cap *= 2) {
    const std::vector<StepSummary> steps = summarize_steps(run(setup, {true, {cap, cap}}));
    const double step_us = steps.back().total * 1e6;
    lowest = lowest == 0 ? step_us : std::min(lowest, step_us);
    highest = std::max(highest, step_us);
    row("simulated step", cap, step_us);
    if (cap >= total) break;
  }
  // The prediction as a vertical line from below the lowest step to above the highest.
  row("predicted cap", predicted, lowest * 0.98);
  row("predicted cap", predicted, std::max(highest, flat_us));
  row("flat (lab 2)", smallest_cap, flat_us);
  row("flat (lab 2)", total, flat_us);
}

}  // namespace
}  // namespace dp::lab4

int main(int argc, char** argv) {
  using namespace dp::lab4;
  CLI::App app{"lab4_experiments: lab 4's measurements with your code on the simulated clock"};
  app.require_subcommand(1);
  Setup setup;
  std::size_t cap = std::size_t{1} << 20;
  const auto add_common = [&](CLI::App* command) {
    command->add_option("--net", setup.net, "Network preset: nvlink, ib-ndr, 100gbe, 10gbe")
        ->capture_default_str();
    command->add_option("--device", setup.device, "Device preset: a100, h100, cpu")
        ->capture_default_str();
    command->add_option("--model", setup.model, "MLP spec")->capture_default_str();
    command->add_option("--rows", setup.rows, "Rows of the batch per rank")->capture_default_str();
    command->add_option("-n,--ranks", setup.ranks, "Ranks")->capture_default_str();
  };
  CLI::App* timeline_command =
      app.add_subcommand("timeline", "Rank 0's ops in one step: flat, then bucketed (CSV)");
  add_common(timeline_command);
  timeline_command->add_option("--cap", cap, "Bucket cap in bytes (every bucket)")
      ->capture_default_str();
  CLI::App* sweep_command =
      app.add_subcommand("sweep", "Step time against the bucket cap, and your prediction (CSV)");
  add_common(sweep_command);
  std::size_t smallest_cap = std::size_t{4} << 10;
  bool no_header = false;
  sweep_command->add_option("--from", smallest_cap, "Smallest cap in bytes")->capture_default_str();
  sweep_command->add_option("--alpha-us", setup.alpha_us,
                            "Latency of a fitted fabric (with --gbps)");
  sweep_command->add_option("--gbps", setup.gbps, "Bandwidth of a fitted fabric in GB/s");
  sweep_command->add_flag("--no-header", no_header, "Leave out the CSV header line");
  try {
    app.parse(argc, argv);
    if (timeline_command->parsed()) timeline(setup, cap);
    if (sweep_command->parsed()) sweep(setup, smallest_cap, !no_header);
  } catch (const CLI::ParseError& error) {
    return app.exit(error);
  } catch (const std::exception& error) {
    fmt::print(stderr, "lab4_experiments: error: {}\n", error.what());
    return 1;
  }
  return 0;
}
