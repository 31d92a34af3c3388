// design_near_misses.h: the answer to lab 3's design question and its plausible wrong
// answers, for grader/lab3_ps_vs_allreduce/checks.cpp (instructors only: the student release
// leaves this folder out, since the right formula is the answer and each wrong one is the
// right one with one term changed).
//
// The check uses them twice: the reference's prediction starts the bisection that measures
// the crossover, and the check fails as a grader bug when its draws never tell one of the
// wrong formulas from the right one (the selftests' planted bugs design_* are these
// formulas). Included by checks.cpp after WrongCrossover and DesignFormulas, in its
// anonymous namespace.
#pragma once

/// The crossover, in bytes, of an all-reduce of `rounds` latencies and `transfers` whole
/// buffers against a ring of `ring_latencies` latencies that moves `ring_buffers` buffers:
/// alpha B (ring_latencies - rounds) / (transfers - ring_buffers); infinite when the ring
/// never catches up, 0 when it is never slower.
inline double crossover_of(double ring_latencies, double ring_buffers, double rounds,
                           double transfers, const LinkModel& link) {
  if (ring_latencies <= rounds) return 0;
  if (transfers <= ring_buffers) return std::numeric_limits<double>::infinity();
  return link.alpha_seconds * link.bytes_per_second * (ring_latencies - rounds) /
         (transfers - ring_buffers);
}

/// Recursive doubling's crossover against the ring on `ranks` ranks of `link`, from the cost
/// model of dp/clock.h (the reference's answer): R = floor(lg N) rounds, + 2 for the fold and
/// unfold when N is not a power of two, and s = 1 more transfer when N - p' is odd (a folded
/// rank receives its fold and its first partner's message at once), against the ring's
/// 2(N-1) latencies and 2(N-1)/N buffers; and the plausible wrong formulas (rubric.json says
/// how far each misses where).
inline std::optional<DesignFormulas> design_formulas(int ranks, const LinkModel& link) {
  int power = 1;
  int doubling = 0;
  for (; power * 2 <= ranks; power *= 2) ++doubling;
  int ceil_lg = 0;
  while ((1 << ceil_lg) < ranks) ++ceil_lg;
  const bool folds = power != ranks;
  const double n = ranks;
  const double rounds = doubling + (folds ? 2 : 0);
  const double shared = (ranks - power) % 2 == 1 ? 1 : 0;
  const double ring_latencies = 2 * (n - 1);
  const double ring_buffers = 2 * (n - 1) / n;
  DesignFormulas formulas;
  formulas.right_bytes = crossover_of(ring_latencies, ring_buffers, rounds, rounds + shared, link);
  formulas.wrong = {
      {"the rounds without the transfer the fold and the first exchange share (s = 0)",
       crossover_of(ring_latencies, ring_buffers, rounds, rounds, link)},
      {"the shared transfer whenever N is not a power of two (s = 1 where N - p' is even too)",
       crossover_of(ring_latencies, ring_buffers, rounds, rounds + (folds ? 1 : 0), link)},
      {"a ring of 2N latencies", crossover_of(2 * n, ring_buffers, rounds, rounds + shared, link)},
      {"a ring that moves 2 buffers",
       crossover_of(ring_latencies, 2, rounds, rounds + shared, link)},
      {"ceil(lg N) rounds, no fold or unfold",
       crossover_of(ring_latencies, ring_buffers, ceil_lg, ceil_lg, link)},
      {"floor(lg N) rounds, no fold or unfold",
       crossover_of(ring_latencies, ring_buffers, doubling, doubling, link)},
      {"a binomial tree's 2 ceil(lg N) rounds",
       crossover_of(ring_latencies, ring_buffers, 2 * ceil_lg, 2 * ceil_lg, link)},
  };
  return formulas;
}
