// reduce_precision_figure: how much a gradient all-reduce in bfloat16 or float16 loses
// against float64, as the number of ranks grows (issue 30, the numerics lesson).
//
//   reduce_precision_figure                      # a table: the default sweep, N = 2 ... 64
//   reduce_precision_figure --csv                # the same numbers as CSV
//   reduce_precision_figure --ranks 2,8 --elements 4096 --seed 3
//
// Each of N local ranks (threads) holds float32 gradients g_r[k] = m[k] + s z_r[k]: a mean
// m[k] shared by every rank (the true gradient, N(0, 1e-3^2)) plus the rank's own noise
// (s = 1e-3, z standard normal), the magnitudes of a trained network's gradients. Each rank
// rounds its gradients to the 16-bit type and the local backend sums them with
// `allreduce(kSum)` in that type (each partial sum rounded: comm.h's rule at `ReduceOp`, as
// NCCL does it). The reference is the float64 sum of the float32 gradients. Reported per
// type, as a relative error in the 2-norm, ||sum - reference|| / ||reference||:
//   total       the 16-bit all-reduce against the reference: what training sees;
//   reduction   the 16-bit all-reduce against the float64 sum of the rounded inputs: what the
//               N - 1 rounded additions add to the rounding of the inputs;
// and the float32 all-reduce's total error, for scale. Everything is deterministic (seeded
// draws, the local backend's rank order): the same numbers on every machine.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dp/comm.h"
#include "dp/float16.h"
#include "dp/launch.h"
#include "dp/rng.h"

namespace {

/// Rank `rank`'s float32 gradients: the shared mean plus its own noise.
std::vector<float> gradients(int rank, std::size_t elements, std::uint64_t seed) {
  dp::CounterRng mean(seed, 0);
  dp::CounterRng noise(seed, 1 + static_cast<std::uint64_t>(rank));
  std::vector<float> values(elements);
  for (float& value : values) value = 1e-3f * mean.normal() + 1e-3f * noise.normal();
  return values;
}

/// ||a - b|| / ||b|| in float64.
double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  double difference = 0.0;
  double norm = 0.0;
  for (std::size_t k = 0; k < a.size(); ++k) {
    difference += (a[k] - b[k]) * (a[k] - b[k]);
    norm += b[k] * b[k];
  }
  return std::sqrt(difference / norm);
}

/// The errors of one type at one rank count.
struct Errors {
  double total = 0.0;
  double reduction = 0.0;
};

/// The all-reduce of N ranks' gradients rounded by `round` (the identity for float32),
/// against the float64 sums of the unrounded and of the rounded gradients.
template <typename H, typename Round, typename Widen>
Errors measure(int ranks, std::size_t elements, std::uint64_t seed, Round round, Widen widen) {
  std::vector<double> exact(elements, 0.0);
  std::vector<double> exact_of_rounded(elements, 0.0);
  for (int r = 0; r < ranks; ++r) {
    const std::vector<float> g = gradients(r, elements, seed);
    for (std::size_t k = 0; k < elements; ++k) {
      exact[k] += static_cast<double>(g[k]);
      exact_of_rounded[k] += static_cast<double>(widen(round(g[k])));
    }
  }
  std::vector<double> reduced(elements);
  dp::launch({.world_size = ranks}, [&](dp::Communicator& comm) {
    const std::vector<float> g = gradients(comm.rank(), elements, seed);
    std::vector<H> data(elements);
    for (std::size_t k = 0; k < elements; ++k) data[k] = round(g[k]);
    comm.allreduce(std::span(data), dp::ReduceOp::kSum)->wait();
    if (comm.rank() == 0)
      for (std::size_t k = 0; k < elements; ++k) reduced[k] = static_cast<double>(widen(data[k]));
  });
  return {relative_error(reduced, exact), relative_error(reduced, exact_of_rounded)};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The relative error of a bfloat16 and a float16 sum all-reduce against float64"};
  std::vector<int> ranks = {2, 4, 8, 16, 32, 64};
  std::size_t elements = 1 << 16;
  std::uint64_t seed = 1;
  bool csv = false;
  app.add_option("--ranks", ranks, "the rank counts N")->delimiter(',');
  app.add_option("--elements", elements, "gradients per rank");
  app.add_option("--seed", seed, "the draws' seed");
  app.add_flag("--csv", csv, "CSV instead of a table");
  CLI11_PARSE(app, argc, argv);

  const auto identity = [](float value) { return value; };
  const auto bf16 = [](float value) { return dp::to_bfloat16(value); };
  const auto fp16 = [](float value) { return dp::to_float16(value); };
  const auto widen_bf16 = [](dp::BFloat16 value) { return dp::to_float(value); };
  const auto widen_fp16 = [](dp::Float16 value) { return dp::to_float(value); };

  if (csv)
    fmt::print("ranks,bf16_total,bf16_reduction,fp16_total,fp16_reduction,fp32_total\n");
  else
    fmt::print("{:>5}  {:>11}  {:>11}  {:>11}  {:>11}  {:>11}\n", "N", "bf16 total", "bf16 reduce",
               "fp16 total", "fp16 reduce", "fp32 total");
  for (int n : ranks) {
    const Errors b = measure<dp::BFloat16>(n, elements, seed, bf16, widen_bf16);
    const Errors h = measure<dp::Float16>(n, elements, seed, fp16, widen_fp16);
    const Errors f = measure<float>(n, elements, seed, identity, identity);
    if (csv)
      fmt::print("{},{:.4e},{:.4e},{:.4e},{:.4e},{:.4e}\n", n, b.total, b.reduction, h.total,
                 h.reduction, f.total);
    else
      fmt::print("{:>5}  {:>11.3e}  {:>11.3e}  {:>11.3e}  {:>11.3e}  {:>11.3e}\n", n, b.total,
                 b.reduction, h.total, h.reduction, f.total);
  }
  return 0;
}
