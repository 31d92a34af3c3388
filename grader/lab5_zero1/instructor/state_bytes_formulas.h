// state_bytes_formulas.h: the answer to lab 5's first design question
// (predicted_state_bytes_per_rank) and its plausible wrong answers, for
// grader/lab5_zero1/checks.cpp (instructors only: the student release leaves this folder out,
// since the right formula is the answer and each wrong one is the right one with one buffer
// or one rounding changed).
//
// The check compares a prediction with the bytes the MemoryTracker holds; these name the
// mistake when a prediction that misses equals one of them, and the check fails as a grader
// bug when its draws never tell one of them from the right one (the selftests' planted bugs
// design_* are these formulas). Included by checks.cpp after StateBytesFormulas, in its
// anonymous namespace.
#pragma once

/// The bytes one rank holds for Psi elements on N ranks with k floats of optimizer state per
/// element, by the contract's memory rule, 8 Psi + 4 N S + 8 S + 4 k S (the model's values
/// and gradients, the padded flat buffer, the shards of the gradient and the parameters, the
/// inner optimizer's state), and the plausible wrong formulas for it.
inline std::optional<StateBytesFormulas> state_bytes_formulas(std::size_t psi, int world,
                                                              std::size_t k) {
  const auto n = static_cast<std::size_t>(world);
  const std::size_t s = (psi + n - 1) / n;
  // Every buffer counted, with a shard of `shard` elements and a flat buffer of `flat`.
  const auto counted = [&](std::size_t shard, std::size_t flat) {
    return 8 * psi + 4 * flat + 8 * shard + 4 * k * shard;
  };
  StateBytesFormulas formulas;
  formulas.right_bytes = counted(s, n * s);
  formulas.wrong = {
      {"the paper's 8 Psi + 4 k Psi / N, without this implementation's buffers",
       8 * psi + 4 * k * psi / n},
      {"no flat buffer", 8 * psi + 8 * s + 4 * k * s},
      {"a flat buffer of Psi elements, not the padded N S", counted(s, psi)},
      {"S = floor(Psi / N), rounded down", counted(psi / n, n * (psi / n))},
      {"S = (Psi + N) / N, one too many when N divides Psi",
       counted((psi + n) / n, n * ((psi + n) / n))},
      {"two flat buffers (one for each collective)", counted(s, 2 * n * s)},
      {"no shard buffers (gradient and parameters)", 8 * psi + 4 * n * s + 4 * k * s},
  };
  return formulas;
}
