// bench_simulation.cpp: what the simulated clock costs in wall time.
//
// The same work runs on the same local ranks with the simulation off (clock:off) and on
// (clock:simulated, ib-ndr, roofline compute, every op recorded for the trace); the ratio
// of the two wall times is the simulation's overhead (target: at most 1.3):
//
//   overhead/train_step/ranks:8/batch:64/clock:C
//       one data-parallel training step of the default model 64-256-256-10: forward,
//       backward, one all-reduce (average) per gradient, SGD; a step mark per step
//   overhead/p2p_ring_allreduce/ranks:8/bytes:B/clock:C
//       a ring all-reduce written from isend/irecv (2 (p-1) rounds of messages), the
//       simulation's worst case: many small messages and little work per message
//
// The reported time is the slowest rank's, from a common start (RankPool::run_timed).
//
//   bench_simulation --benchmark_out=simulation.json --benchmark_out_format=json
#include <benchmark/benchmark.h>

#include <exception>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "dp/clock.h"
#include "dp/comm.h"
#include "dp/data.h"
#include "dp/launch.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "rank_pool.h"

namespace dp::bench {
namespace {

constexpr int kRanks = 8;
constexpr std::size_t kBatch = 64;

LaunchOptions pool_options(bool simulated) {
  LaunchOptions options;
  options.world_size = kRanks;
  options.backend = Backend::kLocal;
  if (simulated) options.simulation = SimulationOptions::preset("ib-ndr");
  return options;
}

/// One pool per setting, kept while its benchmarks run.
RankPool& pool_for(bool simulated) {
  static std::unique_ptr<RankPool> current;
  static bool current_simulated = false;
  if (!current || current_simulated != simulated || !current->healthy()) {
    current.reset();
    current = std::make_unique<RankPool>(pool_options(simulated));
    current_simulated = simulated;
  }
  return *current;
}

const Dataset& dataset() {
  static const Dataset data =
      make_synthetic_classification({.samples = 512, .features = 64, .classes = 10, .seed = 1});
  return data;
}

struct Replica {
  Model model = Model::mlp("64-256-256-10", {.seed = 1});
  Sgd sgd{model.num_parameters(), {.lr = 0.1f}};
  Batch batch;

  explicit Replica(std::size_t first_row) {
    std::vector<std::size_t> rows(kBatch / kRanks);
    std::iota(rows.begin(), rows.end(), first_row);
    batch = gather_batch(dataset(), rows);
  }

  void step(Communicator& comm) {
    model.zero_grad();
    const Tensor logits = model.forward(batch.inputs);
    model.backward(logits, batch.labels);
    std::vector<std::unique_ptr<Work>> pending;
    for (Parameter* parameter : model.parameters())
      pending.push_back(comm.allreduce(parameter->grad.span(), ReduceOp::kAvg));
    for (auto& work : pending) work->wait();
    sgd.step(model);
    comm.clock().mark_step();
  }
};

void train_step(benchmark::State& state, bool simulated) {
  try {
    RankPool& pool = pool_for(simulated);
    std::vector<std::unique_ptr<Replica>> replicas(kRanks);
    pool.run([&](Communicator& comm) {
      const auto rank = static_cast<std::size_t>(comm.rank());
      replicas[rank] = std::make_unique<Replica>(rank * (kBatch / kRanks));
      replicas[rank]->step(comm);  // warm-up
    });
    for (auto _ : state)
      state.SetIterationTime(pool.run_timed([&](Communicator& comm) {
        replicas[static_cast<std::size_t>(comm.rank())]->step(comm);
      }));
    pool.run([&](Communicator& comm) { replicas[static_cast<std::size_t>(comm.rank())].reset(); });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void ring_allreduce(Communicator& comm, std::vector<float>& data, std::vector<float>& incoming) {
  const int p = comm.size();
  const int r = comm.rank();
  const std::size_t chunk = data.size() / static_cast<std::size_t>(p);
  const auto part = [&](int index) {
    return std::span<float>(data).subspan(static_cast<std::size_t>((index % p + p) % p) * chunk,
                                          chunk);
  };
  for (int step = 0; step < p - 1; ++step) {
    auto send = comm.isend(part(r - step), (r + 1) % p, 0);
    auto receive = comm.irecv(std::span(incoming), (r + p - 1) % p, 0);
    receive->wait();
    send->wait();
    const std::span<float> mine = part(r - step - 1);
    for (std::size_t k = 0; k < chunk; ++k) mine[k] += incoming[k];
  }
  for (int step = 0; step < p - 1; ++step) {
    auto send = comm.isend(part(r + 1 - step), (r + 1) % p, 1);
    auto receive = comm.irecv(part(r - step), (r + p - 1) % p, 1);
    receive->wait();
    send->wait();
  }
}

void p2p_ring(benchmark::State& state, bool simulated, std::size_t bytes) {
  try {
    RankPool& pool = pool_for(simulated);
    const std::size_t count = bytes / sizeof(float);
    std::vector<std::vector<float>> data(kRanks, std::vector<float>(count, 1.0f));
    std::vector<std::vector<float>> incoming(kRanks, std::vector<float>(count / kRanks));
    for (auto _ : state)
      state.SetIterationTime(pool.run_timed([&](Communicator& comm) {
        const auto rank = static_cast<std::size_t>(comm.rank());
        ring_allreduce(comm, data[rank], incoming[rank]);
      }));
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

}  // namespace

void register_benchmarks() {
  for (const bool simulated : {false, true}) {
    const std::string clock = simulated ? "simulated" : "off";
    benchmark::RegisterBenchmark(
        ("overhead/train_step/ranks:8/batch:64/clock:" + clock).c_str(),
        [simulated](benchmark::State& state) { train_step(state, simulated); })
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  }
  for (const std::size_t bytes : {std::size_t{64} << 10, std::size_t{4} << 20})
    for (const bool simulated : {false, true}) {
      const std::string clock = simulated ? "simulated" : "off";
      benchmark::RegisterBenchmark(
          ("overhead/p2p_ring_allreduce/ranks:8/bytes:" + std::to_string(bytes) + "/clock:" + clock)
              .c_str(),
          [simulated, bytes](benchmark::State& state) { p2p_ring(state, simulated, bytes); })
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
    }
}

}  // namespace dp::bench
