// Lab 0's graded checks. The lab code measures a simulated fabric whose alpha and beta it is
// not told, from point-to-point messages (estimate_link) and from all-reduces
// (estimate_link_from_allreduce), and must return both within 5% of the fabric's. The
// fabrics are drawn from `dplab bench-comm --mystery`'s ranges (alpha 1 to 50 us, 1 to
// 400 GB/s) and, on every seed, where plausible wrong fits part from the right one: a knee
// alpha / beta of a few KB (a small message's n beta is not negligible next to alpha: alpha
// read off a small message's time misses) and one of several MB (a large message's alpha is
// not negligible next to its n beta: beta read as time / size misses). Time is the
// simulated clock's; a call may spend at most 100 ms of it (an exhaustive sweep may not), and
// each routine may issue only its own kind of call, read from the communicator's counters.
// How the code measures (sizes, repetitions, the fit) is its design: the selftests plant a
// least-squares sweep and a two-point fit that must score full marks. rubric.json gives the
// points and the draws.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "dp/clock.h"
#include "dp/comm.h"
#include "dp/launch.h"
#include "grading.h"
#include "lab0.h"
#include "speed_workload.h"

namespace dp {
namespace {

using grading::Draws;

/// The relative tolerance of every estimate: the contract's 5%.
constexpr double kTolerance = 0.05;
/// The simulated seconds one call may spend (lab0.h).
constexpr double kBudgetSeconds = 0.1;

/// A number drawn log-uniformly in [low, high], as `--mystery` draws, recorded as `name`
/// with its value in `unit` (a failure's "Drawn:" line shows the fabric, not the draw in
/// [0, 1) behind it).
double log_uniform(Draws& draws, std::string_view name, double low, double high,
                   std::string_view unit) {
  const double u = draws.uniform(name, 0.0f, 1.0f);
  const double value = low * std::pow(high / low, u);
  draws.overrule(name, fmt::format("{}={:.4g} {}", name, value, unit));
  return value;
}

/// One fabric to measure, and why it is drawn.
struct Fabric {
  LinkModel link;
  std::string why;
};

/// "alpha 3.2 us, 2.5 GB/s (knee 8 KB)".
std::string describe(const LinkModel& link) {
  return fmt::format("alpha {:.4g} us, {:.4g} GB/s (knee alpha/beta {:.3g} KB)",
                     link.alpha_seconds * 1e6, link.bytes_per_second / 1e9,
                     link.alpha_seconds * link.bytes_per_second / 1e3);
}

/// The fabrics of a check, on every seed: a small knee (alpha 1 to 5 us at 1 to 4 GB/s:
/// 1 to 20 KB), a large knee (alpha 20 to 50 us at 100 to 400 GB/s: 2 to 20 MB), a slow
/// fabric (1 to 3 GB/s, where the budget bites), then two drawn from --mystery's ranges.
std::vector<Fabric> drawn_fabrics(Draws& draws) {
  std::vector<Fabric> fabrics;
  const auto add = [&](double alpha_low, double alpha_high, double gbps_low, double gbps_high,
                       std::string why) {
    draws.section(fmt::format("{}:", why));
    LinkModel link;
    link.alpha_seconds = log_uniform(draws, "alpha", alpha_low, alpha_high, "us") * 1e-6;
    link.bytes_per_second = log_uniform(draws, "bandwidth", gbps_low, gbps_high, "GB/s") * 1e9;
    fabrics.push_back({link, std::move(why)});
  };
  add(1, 5, 1, 4, "small knee");
  add(20, 50, 100, 400, "large knee");
  add(1, 50, 1, 3, "slow fabric");
  add(1, 50, 1, 400, "mystery fabric");
  add(1, 50, 1, 400, "mystery fabric");
  return fabrics;
}

/// What one call of the lab code measured on a fabric.
struct Measured {
  lab0::LinkEstimate estimate;  ///< rank 0's
  double seconds = 0;           ///< the latest rank's clock on return minus its clock on call
  std::string misuse;           ///< a call of the wrong kind, "" if none
};

/// Which routine a check measures.
enum class Routine { kPointToPoint, kAllReduce };

/// Runs `routine` on `ranks` simulated ranks of `link`, with buffers on the check's device.
Measured measure(Routine routine, int ranks, const LinkModel& link, const Draws& draws) {
  LaunchOptions options;
  options.world_size = ranks;
  options.backend = Backend::kLocal;  // the simulation belongs to the local backend
  options.comm.completion = Completion::kAdversarial;
  options.comm.completion_seed = draws.completion_seed();
  options.simulation.enabled = true;
  options.simulation.network.name = "custom";
  options.simulation.network.fabric = link;
  options.simulation.device = grading::free_compute_device();
  options.simulation.record_trace = false;
  std::vector<double> spent(static_cast<std::size_t>(ranks), 0.0);
  std::vector<std::string> misuse(static_cast<std::size_t>(ranks));
  Measured measured;
  launch(options, [&](Communicator& comm) {
    const auto rank = static_cast<std::size_t>(comm.rank());
    const CommCounters before = comm.counters();
    const double start = comm.clock().now();
    const lab0::LinkEstimate estimate =
        routine == Routine::kPointToPoint
            ? lab0::estimate_link(comm, grading::check_device())
            : lab0::estimate_link_from_allreduce(comm, grading::check_device());
    spent[rank] = comm.clock().now() - start;
    if (rank == 0) measured.estimate = estimate;
    const CommCounters calls = comm.counters().since(before);
    if (routine == Routine::kPointToPoint && calls.collective_calls() != 0)
      misuse[rank] = fmt::format(
          "rank {} issued {} collective call(s): estimate_link measures with point-to-point "
          "messages only",
          rank, calls.collective_calls());
    if (routine == Routine::kAllReduce) {
      const std::uint64_t others = calls.total_calls() - calls.of(CommOp::kAllReduce).calls;
      if (others != 0)
        misuse[rank] = fmt::format(
            "rank {} issued {} call(s) other than all-reduce: estimate_link_from_allreduce "
            "measures with all-reduces only",
            rank, others);
    }
  });
  measured.seconds = *std::max_element(spent.begin(), spent.end());
  for (const std::string& finding : misuse)
    if (!finding.empty()) {
      measured.misuse = finding;
      break;
    }
  return measured;
}

/// "" when `estimate` is within the tolerance of `truth`, else what was wrong.
std::string within_tolerance(std::string_view what, double estimate, double truth) {
  const double error = std::abs(estimate - truth) / truth;
  if (std::isfinite(estimate) && error <= kTolerance) return "";
  return fmt::format("{} {:.6g}, the fabric's is {:.6g}: off by {:.3g}% (at most {:.0f}%)", what,
                     estimate, truth, error * 100, kTolerance * 100);
}

/// Which parts of an estimate a check grades.
struct Graded {
  bool alpha = false;   ///< alpha within the tolerance
  bool beta = false;    ///< beta within the tolerance
  bool budget = false;  ///< at most kBudgetSeconds of simulated time
  bool both = false;    ///< alpha and beta within the tolerance (the budget of a method)
};

/// Measures every drawn fabric with `routine` on the world sizes the routine is drawn with,
/// and fails the check for each estimate the check grades that misses.
void check_routine(std::string_view check, Routine routine, Graded graded) {
  Draws draws(check);
  const std::vector<Fabric> fabrics = drawn_fabrics(draws);
  draws.section("world sizes:");
  std::vector<int> worlds;
  for (std::size_t i = 0; i < fabrics.size(); ++i)
    worlds.push_back(i == 0 ? 2 : static_cast<int>(draws.integer("ranks", 2, 8)));
  int passed = 0;
  double most_spent = 0;
  double worst_alpha = 0;  // the largest relative errors over the fabrics, for the note
  double worst_beta = 0;
  for (std::size_t i = 0; i < fabrics.size(); ++i) {
    const Fabric& fabric = fabrics[i];
    const Measured measured = measure(routine, worlds[i], fabric.link, draws);
    most_spent = std::max(most_spent, measured.seconds);
    std::vector<std::string> findings;
    if (!measured.misuse.empty()) findings.push_back(measured.misuse);
    const double beta = 1.0 / fabric.link.bytes_per_second;
    worst_alpha = std::max(worst_alpha,
                           std::abs(measured.estimate.alpha_seconds - fabric.link.alpha_seconds) /
                               fabric.link.alpha_seconds);
    worst_beta =
        std::max(worst_beta, std::abs(measured.estimate.beta_seconds_per_byte - beta) / beta);
    const std::string alpha_finding =
        within_tolerance("alpha (s)", measured.estimate.alpha_seconds, fabric.link.alpha_seconds);
    const std::string beta_finding =
        within_tolerance("beta (s/B)", measured.estimate.beta_seconds_per_byte, beta);
    if (graded.alpha && !alpha_finding.empty()) findings.push_back(alpha_finding);
    if (graded.beta && !beta_finding.empty()) findings.push_back(beta_finding);
    // The budget counts for a measurement that works: returning at once is not a method.
    if (graded.both && (!alpha_finding.empty() || !beta_finding.empty()))
      findings.push_back("the estimate itself misses: " +
                         (alpha_finding.empty() ? beta_finding : alpha_finding));
    if (graded.budget && !(measured.seconds <= kBudgetSeconds))
      findings.push_back(
          fmt::format("the call spent {:.4g} ms of simulated time, the budget is {:.0f} ms",
                      measured.seconds * 1e3, kBudgetSeconds * 1e3));
    if (findings.empty()) {
      ++passed;
      continue;
    }
    ADD_FAILURE() << fmt::format("{} ranks, {} ({}): {}. Drawn: {}", worlds[i],
                                 describe(fabric.link), fabric.why, fmt::join(findings, "; "),
                                 draws.describe());
  }
  grading::note_measured(fmt::format(
      "{} of {} fabrics passed; largest error {:.2g}% on alpha, {:.2g}% on beta (at most {:.0f}%); "
      "at most {:.3g} ms of simulated time spent (budget {:.0f} ms)",
      passed, fabrics.size(), worst_alpha * 100, worst_beta * 100, kTolerance * 100,
      most_spent * 1e3, kBudgetSeconds * 1e3));
}

TEST(Lab0PointToPoint, RecoversAlphaWithin5Percent) {
  check_routine("Lab0PointToPoint.RecoversAlphaWithin5Percent", Routine::kPointToPoint,
                {.alpha = true});
}

TEST(Lab0PointToPoint, RecoversBetaWithin5Percent) {
  check_routine("Lab0PointToPoint.RecoversBetaWithin5Percent", Routine::kPointToPoint,
                {.beta = true});
}

TEST(Lab0PointToPoint, MeasuresWithinTheTimeBudget) {
  check_routine("Lab0PointToPoint.MeasuresWithinTheTimeBudget", Routine::kPointToPoint,
                {.budget = true, .both = true});
}

TEST(Lab0AllReduce, RecoversAlphaWithin5Percent) {
  check_routine("Lab0AllReduce.RecoversAlphaWithin5Percent", Routine::kAllReduce,
                {.alpha = true, .budget = true});
}

TEST(Lab0AllReduce, RecoversBetaWithin5Percent) {
  check_routine("Lab0AllReduce.RecoversBetaWithin5Percent", Routine::kAllReduce,
                {.beta = true, .budget = true});
}

}  // namespace
}  // namespace dp
