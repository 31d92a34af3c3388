// lab3_experiments: the measurements lab 3's handout asks for, run with your code on the
// simulated network (local ranks as threads; the simulation is the local backend's).
//
//   lab3_experiments busbw                     # time and busbw per size: ring, latency-optimal,
//                                              # one-server parameter server (8 ranks, ib-ndr)
//   lab3_experiments scaling --net 10gbe       # training step time against N: ring, 1 server,
//                                              # N servers
//   lab3_experiments model-size                # step time against model size on 8 ranks
//   lab3_experiments staleness --straggler 4   # loss against simulated time, s = 0 and s = 2
//
// Every command prints a table, or CSV with --csv (the handout's figures are drawn from the
// CSV of the reference build, lab3_experiments_reference). Times are simulated, so they are
// the same on every machine; the busbw sweep charges no compute (the formulas' gamma = 0),
// the training commands charge each op on the roofline of --device.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "dp/clock.h"
#include "dp/data.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/tensor_ops.h"
#include "dp/trainer.h"
#include "lab3.h"

namespace dp::lab3 {
namespace {

/// What every command shares.
struct Common {
  std::string net = "ib-ndr";  // network preset
  std::string device = "a100";
  bool csv = false;
};

/// The simulation of `common` on `ranks` local threads; free compute when `free_compute`.
LaunchOptions simulated(int ranks, const Common& common, bool free_compute) {
  LaunchOptions options;
  options.world_size = ranks;
  options.simulation = SimulationOptions::preset(common.net);
  options.simulation.record_trace = false;
  options.simulation.device = DeviceModel::preset(common.device);
  if (free_compute) {
    options.simulation.device.name = "free";
    options.simulation.device.flops_per_second = std::numeric_limits<double>::infinity();
    options.simulation.device.bytes_per_second = std::numeric_limits<double>::infinity();
    options.simulation.device.launch_seconds = 0;
  }
  return options;
}

/// Prints rows as an aligned table or as CSV.
class Table {
 public:
  Table(std::vector<std::string> columns, bool csv) : columns_(std::move(columns)), csv_(csv) {}
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void print() const {
    if (csv_) {
      fmt::print("{}\n", fmt::join(columns_, ","));
      for (const auto& row : rows_) fmt::print("{}\n", fmt::join(row, ","));
      return;
    }
    std::vector<std::size_t> widths;
    for (const std::string& column : columns_) widths.push_back(column.size());
    for (const auto& row : rows_)
      for (std::size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
    const auto line = [&](const std::vector<std::string>& cells) {
      std::string text;
      for (std::size_t i = 0; i < cells.size(); ++i)
        text += fmt::format("{:>{}}  ", cells[i], widths[i]);
      fmt::print("{}\n", text);
    };
    line(columns_);
    for (const auto& row : rows_) line(row);
  }

 private:
  std::vector<std::string> columns_;
  std::vector<std::vector<std::string>> rows_;
  bool csv_;
};

/// A one-server all-reduce made of the parameter server: a model "1-m" (2m floats) whose
/// gradients are pushed, averaged and pulled with an optimizer that changes nothing.
void server_allreduce(std::size_t elements, int servers, Communicator& comm) {
  Model model = Model::mlp(fmt::format("1-{}", std::max<std::size_t>(1, elements / 2)));
  for (Parameter* parameter : model.parameters()) fill(parameter->grad.view(), 1.0f);
  ParameterServer server(
      model, {.servers = servers},
      [](std::size_t count) { return make_optimizer("sgd", count, 0.0f, 0, 0); }, comm);
  server.step(model, comm);
  server.finish(model, comm);
}

/// The largest clock over all ranks after `rank_main`.
double seconds_of(const LaunchOptions& options,
                  const std::function<void(Communicator&)>& rank_main) {
  std::vector<double> ends(static_cast<std::size_t>(options.world_size), 0.0);
  launch(options, [&](Communicator& comm) {
    rank_main(comm);
    ends[static_cast<std::size_t>(comm.rank())] = comm.clock().now();
  });
  return *std::max_element(ends.begin(), ends.end());
}

// --- busbw ----------------------------------------------------------------------------------

void busbw(const Common& common, int ranks, std::size_t min_bytes, std::size_t max_bytes) {
  Table table({"bytes", "algorithm", "time_us", "algbw_gbps", "busbw_gbps"}, common.csv);
  const LaunchOptions options = simulated(ranks, common, /*free_compute=*/true);
  for (std::size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
    const std::size_t elements = bytes / sizeof(float);
    const auto time = [&](const std::function<void(TensorView, Communicator&)>& allreduce) {
      return seconds_of(options, [&](Communicator& comm) {
        Tensor data({static_cast<std::int64_t>(elements)}, MemoryCategory::kCommunication);
        fill(data.view(), 1.0f);
        allreduce(data.view(), comm);
      });
    };
    const std::vector<std::pair<std::string, double>> results = {
        {"ring", time(ring_allreduce)},
        {"latency-optimal", time(latency_optimal_allreduce)},
        {"parameter server",
         seconds_of(options, [&](Communicator& comm) { server_allreduce(elements, 1, comm); })}};
    for (const auto& [name, seconds] : results) {
      const double algbw = static_cast<double>(bytes) / seconds / 1e9;
      table.add({std::to_string(bytes), name, fmt::format("{:.3f}", seconds * 1e6),
                 fmt::format("{:.4f}", algbw),
                 fmt::format("{:.4f}", algbw * 2.0 * (ranks - 1) / ranks)});
    }
  }
  table.print();
}

// --- training step time -----------------------------------------------------------------------

/// How a training run averages: a ring all-reduce of a flat buffer, or a parameter server.
struct Strategy {
  std::string name;
  int servers = 0;  // 0: the ring; S > 0: S co-located servers; -1: one per rank
};

/// The mean simulated step time of `steps` steps of `model` on `ranks` ranks with
/// `rows` rows per rank, averaged with `strategy` (the first step, which pays for set-up
/// latencies, is not counted).
double step_seconds(const Common& common, const std::string& model_spec, int ranks,
                    std::int64_t rows, const Strategy& strategy, int steps) {
  TrainOptions options;
  options.model = model_spec;
  options.global_batch = rows * ranks;
  options.steps = steps;
  const Dataset data = load_dataset(options.dataset, options.seed);
  std::vector<double> per_rank(static_cast<std::size_t>(ranks));
  launch(simulated(ranks, common, /*free_compute=*/false), [&](Communicator& comm) {
    Model model = make_model(options);
    const auto optimizer = [&](std::size_t count) {
      return make_optimizer("sgd", count, options.lr, 0, 0);
    };
    std::unique_ptr<ParameterServer> server;
    if (strategy.servers != 0)
      server = std::make_unique<ParameterServer>(
          model, ServerOptions{.servers = strategy.servers < 0 ? ranks : strategy.servers},
          optimizer, comm);
    const std::unique_ptr<Optimizer> local = optimizer(model.num_parameters());
    Tensor flat({static_cast<std::int64_t>(model.num_parameters())},
                MemoryCategory::kCommunication);
    double first = 0;
    for (int step = 0; step < steps; ++step) {
      const std::vector<std::size_t> global =
          global_batch_indices(data.size(), options.global_batch, step, options.seed);
      const Batch batch =
          gather_batch(data, std::span(global).subspan(static_cast<std::size_t>(comm.rank() * rows),
                                                       static_cast<std::size_t>(rows)));
      model.zero_grad();
      model.backward(model.forward(batch.inputs), batch.labels);
      if (server) {
        server->step(model, comm);
      } else {
        for (Parameter* parameter : model.parameters())
          copy(parameter->grad.view(), flat.view(parameter->offset, parameter->grad.size()));
        ring_allreduce(flat.view(), comm);
        divide(flat.view(), static_cast<float>(ranks));
        for (Parameter* parameter : model.parameters())
          copy(flat.view(parameter->offset, parameter->grad.size()), parameter->grad.view());
        local->step(model);
      }
      if (step == 0) first = comm.clock().now();
    }
    if (server) server->finish(model, comm);
    per_rank[static_cast<std::size_t>(comm.rank())] = (comm.clock().now() - first) / (steps - 1);
  });
  return *std::max_element(per_rank.begin(), per_rank.end());
}

const std::vector<Strategy> kStrategies = {
    {"ring", 0}, {"parameter server (1 server)", 1}, {"parameter server (N servers)", -1}};

void scaling(const Common& common, const std::string& model, std::int64_t rows,
             const std::vector<int>& world_sizes, int steps) {
  Table table({"net", "ranks", "strategy", "step_us", "model_bytes"}, common.csv);
  const std::size_t bytes = make_model({.model = model}).num_parameters() * sizeof(float);
  for (int ranks : world_sizes)
    for (const Strategy& strategy : kStrategies)
      table.add(
          {common.net, std::to_string(ranks), strategy.name,
           fmt::format("{:.3f}", step_seconds(common, model, ranks, rows, strategy, steps) * 1e6),
           std::to_string(bytes)});
  table.print();
}

void model_size(const Common& common, int ranks, std::int64_t rows, const std::vector<int>& widths,
                int steps) {
  Table table({"net", "hidden", "model_bytes", "strategy", "step_us"}, common.csv);
  for (int width : widths) {
    const std::string model = fmt::format("64-{}-{}-10", width, width);
    const std::size_t bytes = make_model({.model = model}).num_parameters() * sizeof(float);
    for (const Strategy& strategy : kStrategies)
      table.add(
          {common.net, std::to_string(width), std::to_string(bytes), strategy.name,
           fmt::format("{:.3f}", step_seconds(common, model, ranks, rows, strategy, steps) * 1e6)});
  }
  table.print();
}

// --- staleness -----------------------------------------------------------------------------

/// Trains with the parameter server at each staleness of `staleness_values`; in every step
/// one worker in turn (or always the last, with `fixed`) computes `slowdown` times as long.
/// Prints per step the simulated time by which every worker has finished it and the mean
/// of the workers' losses, computed on the parameters each worker held.
void staleness(const Common& common, int ranks, const std::vector<int>& staleness_values,
               double slowdown, bool fixed, int steps) {
  Table table({"staleness", "step", "time_ms", "loss"}, common.csv);
  TrainOptions options;
  options.model = "64-256-256-10";
  options.global_batch = 32 * ranks;
  options.steps = steps;
  options.lr = 0.05f;
  const Dataset data = load_dataset(options.dataset, options.seed);
  // A step's compute on the roofline is tiny next to its communication: charge a fixed
  // forward and backward time so that the straggler matters, 1 ms, as for a larger model.
  constexpr double kCompute = 1e-3;
  for (int s : staleness_values) {
    std::vector<std::vector<double>> times(static_cast<std::size_t>(steps),
                                           std::vector<double>(static_cast<std::size_t>(ranks)));
    std::vector<std::vector<float>> losses(static_cast<std::size_t>(steps),
                                           std::vector<float>(static_cast<std::size_t>(ranks)));
    launch(simulated(ranks, common, /*free_compute=*/false), [&](Communicator& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      Model model = make_model(options);
      ParameterServer server(
          model, {.servers = 1, .staleness = s},
          [&](std::size_t count) { return make_optimizer("sgd", count, options.lr, 0, 0); }, comm);
      for (int step = 0; step < steps; ++step) {
        const bool straggles = fixed ? comm.rank() == ranks - 1 : step % ranks == comm.rank();
        comm.clock().compute("forward and backward", kCompute * (straggles ? slowdown : 1.0));
        const std::vector<std::size_t> global =
            global_batch_indices(data.size(), options.global_batch, step, options.seed);
        const Batch batch = gather_batch(data, std::span(global).subspan(r * 32, 32));
        model.zero_grad();
        losses[static_cast<std::size_t>(step)][r] =
            model.backward(model.forward(batch.inputs), batch.labels);
        server.step(model, comm);
        times[static_cast<std::size_t>(step)][r] = comm.clock().now();
      }
      server.finish(model, comm);
    });
    for (int step = 0; step < steps; ++step) {
      const auto& at = times[static_cast<std::size_t>(step)];
      const auto& loss = losses[static_cast<std::size_t>(step)];
      double mean = 0;
      for (float value : loss) mean += value;
      table.add({std::to_string(s), std::to_string(step + 1),
                 fmt::format("{:.4f}", *std::max_element(at.begin(), at.end()) * 1e3),
                 fmt::format("{:.5f}", mean / ranks)});
    }
  }
  table.print();
}

/// Parses "2,4,8" or "2-8".
std::vector<int> parse_list(const std::string& text) {
  std::vector<int> values;
  if (const auto dash = text.find('-');
      dash != std::string::npos && text.find(',') == std::string::npos) {
    for (int value = std::stoi(text.substr(0, dash)); value <= std::stoi(text.substr(dash + 1));
         ++value)
      values.push_back(value);
    return values;
  }
  std::stringstream stream(text);
  for (std::string item; std::getline(stream, item, ',');) values.push_back(std::stoi(item));
  return values;
}

}  // namespace
}  // namespace dp::lab3

int main(int argc, char** argv) {
  using namespace dp::lab3;
  CLI::App app{"lab3_experiments: lab 3's measurements with your code on the simulated network"};
  app.require_subcommand(1);
  Common common;
  int ranks = 8;
  std::size_t min_bytes = 64;
  std::size_t max_bytes = std::size_t{16} << 20;
  std::string model = "64-1024-1024-10";
  std::int64_t rows = 32;
  std::string world_sizes = "2-8";
  std::string widths = "64,128,256,512,1024,2048";
  std::string staleness_values = "0,2";
  double slowdown = 4;
  bool fixed = false;
  int steps = 4;
  int stale_steps = 40;
  const auto add_common = [&](CLI::App* command) {
    command->add_option("--net", common.net, "Network preset: nvlink, ib-ndr, 100gbe, 10gbe")
        ->capture_default_str();
    command->add_flag("--csv", common.csv, "Print CSV instead of a table");
  };
  CLI::App* busbw_command = app.add_subcommand(
      "busbw",
      "Time and bus bandwidth per size: ring, latency-optimal, one-server parameter server");
  add_common(busbw_command);
  busbw_command->add_option("-n,--ranks", ranks, "Ranks")->capture_default_str();
  busbw_command->add_option("--min-bytes", min_bytes, "Smallest size (x4 each row)")
      ->capture_default_str();
  busbw_command->add_option("--max-bytes", max_bytes, "Largest size")->capture_default_str();
  CLI::App* scaling_command = app.add_subcommand(
      "scaling", "Training step time against the number of ranks (rows per rank fixed)");
  add_common(scaling_command);
  scaling_command->add_option("--model", model, "MLP spec")->capture_default_str();
  scaling_command->add_option("--ranks", world_sizes, "World sizes, \"2-8\" or \"2,4,8\"")
      ->capture_default_str();
  CLI::App* size_command =
      app.add_subcommand("model-size", "Training step time against the model's hidden width");
  add_common(size_command);
  size_command->add_option("-n,--ranks", ranks, "Ranks")->capture_default_str();
  size_command->add_option("--widths", widths, "Hidden widths of 64-h-h-10")->capture_default_str();
  for (CLI::App* command : {scaling_command, size_command}) {
    command->add_option("--rows", rows, "Rows of the batch per rank")->capture_default_str();
    command->add_option("--steps", steps, "Steps (the first is not timed)")->capture_default_str();
    command->add_option("--device", common.device, "Device preset: a100, h100, cpu")
        ->capture_default_str();
  }
  CLI::App* stale_command = app.add_subcommand(
      "staleness", "Loss against simulated time with a straggler, for each staleness");
  add_common(stale_command);
  stale_command->add_option("-n,--ranks", ranks, "Ranks (every one a worker, rank 0 the server)")
      ->capture_default_str();
  stale_command->add_option("--staleness", staleness_values, "Values of s, \"0,2\"")
      ->capture_default_str();
  stale_command->add_option("--straggler", slowdown, "How many times slower the straggler computes")
      ->capture_default_str();
  stale_command->add_flag("--fixed", fixed,
                          "The last rank straggles every step (default: in turn)");
  stale_command->add_option("--steps", stale_steps, "Steps")->capture_default_str();
  try {
    app.parse(argc, argv);
    if (steps < 2) throw dp::Error(fmt::format("--steps must be at least 2, got {}", steps));
    if (busbw_command->parsed()) busbw(common, ranks, min_bytes, max_bytes);
    if (scaling_command->parsed()) scaling(common, model, rows, parse_list(world_sizes), steps);
    if (size_command->parsed()) model_size(common, ranks, rows, parse_list(widths), steps);
    if (stale_command->parsed())
      staleness(common, ranks, parse_list(staleness_values), slowdown, fixed, stale_steps);
  } catch (const CLI::ParseError& error) {
    return app.exit(error);
  } catch (const std::exception& error) {
    fmt::print(stderr, "lab3_experiments: error: {}\n", error.what());
    return 1;
  }
  return 0;
}
