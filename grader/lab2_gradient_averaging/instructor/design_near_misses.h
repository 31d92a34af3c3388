// design_near_misses.h: the plausible wrong answers to lab 2's design questions, for
// grader/lab2_gradient_averaging/checks.cpp (instructors only: the student release leaves
// this folder out, since each formula is the right one with one term changed).
//
// The checks use them twice: a prediction that misses the simulated clock but meets one of
// them is told which mistake it makes, and each check fails as a grader bug when its draws
// never tell one of them from the right answer (the selftests' planted bugs design_* are
// these formulas). Included by checks.cpp after WrongFormula, BreakEvenNetwork and
// break_even_of, in its anonymous namespace.
#pragma once

/// The plausible wrong formulas for what the flat buffer saves, for P parameters on `world`
/// ranks with latency `alpha`; the right one is the simulated clock's.
std::vector<WrongFormula> wrong_formulas(std::size_t parameters, int world, double alpha) {
  const double p = static_cast<double>(parameters);
  const double n = static_cast<double>(world);
  const double tree = 2.0 * std::ceil(std::log2(n));
  return {
      {"P calls saved instead of P - 1 (the flat call pays its latencies too)",
       2.0 * (n - 1) * p * alpha},
      {"one round trip, 2 alpha, per all-reduce instead of a ring's 2 (N-1) latencies",
       2.0 * (p - 1) * alpha},
      {"2 N latencies per all-reduce instead of 2 (N-1)", 2.0 * n * (p - 1) * alpha},
      {"a tree's 2 ceil(log2 N) latencies per all-reduce instead of a ring's 2 (N-1)",
       tree * (p - 1) * alpha},
      {"N - 1 latencies per all-reduce (the reduce-scatter half only)", (n - 1) * (p - 1) * alpha},
  };
}

/// The plausible wrong answers to design question 2 on `net`, for the feedback of a near
/// miss; the right one is where the two ways' times cross on the simulated clock.
std::vector<WrongFormula> wrong_break_even_formulas(const BreakEvenNetwork& net) {
  const double p = static_cast<double>(net.parameters);
  const double n = static_cast<double>(net.world);
  const double alpha = net.link.alpha_seconds;
  const double launch = net.device.launch_seconds;
  const double rate = net.device.flops_per_second;
  const double bandwidth = net.device.bytes_per_second;
  const double per_float = std::max(1.0 / rate, 8.0 / bandwidth);
  const double right_per_byte = 2.0 * per_float / 4.0;
  const double saved = 2.0 * (n - 1) * (p - 1) * alpha;
  return {
      {"2 N latencies saved per call instead of the ring's 2 (N-1)",
       break_even_of(2 * p * launch - 2.0 * n * (p - 1) * alpha, right_per_byte)},
      {"P calls saved instead of P - 1 (the flat call pays its latencies too)",
       break_even_of(2 * p * launch - 2.0 * (n - 1) * p * alpha, right_per_byte)},
      {"the copies counted once instead of twice (into the buffer and back out)",
       break_even_of(p * launch - saved, per_float / 4.0)},
      {"a copy moving 4 bytes per float instead of 8 (it reads and writes each)",
       break_even_of(2 * p * launch - saved, 2.0 * std::max(1.0 / rate, 4.0 / bandwidth) / 4.0)},
      {"the copies' launch costs left out", break_even_of(-saved, right_per_byte)},
      {"the roofline's two terms added instead of their maximum",
       break_even_of(2 * p * launch - saved, 2.0 * (1.0 / rate + 8.0 / bandwidth) / 4.0)},
  };
}
