// design_formulas.h: plausible wrong answers to lab 8's design question, for
// grader/lab8_mixed_precision/checks.cpp (instructors only: the student release leaves this
// folder out, since each is the right formula with one term changed). The check fails as a
// grader bug when its draws never tell one of them from the right one (the selftests' planted
// bug prediction_with_float32_accounting is the first). Included by checks.cpp in its
// anonymous namespace, after contract_bytes and largest_fitting.
#pragma once

#include <functional>

/// A wrong formula: its bytes per rank, and optionally its own largest model (else the
/// largest Psi its bytes admit).
struct NearMiss {
  std::string name;
  std::function<std::size_t(Strategy, std::size_t, int)> bytes;
  std::function<std::size_t(Strategy, int, std::size_t)> largest;
};

inline std::vector<NearMiss> near_misses() {
  const auto shard = [](std::size_t psi, int world) {
    const auto n = static_cast<std::size_t>(world);
    return (psi + n - 1) / n;
  };
  std::vector<NearMiss> misses;
  misses.push_back({"float32 training's 4 + 4 + 8 (no 16-bit copies, no masters)",
                    [=](Strategy s, std::size_t psi, int world) -> std::size_t {
                      const std::size_t sh = shard(psi, world);
                      switch (s) {
                        case Strategy::kDdp: return 16 * psi;
                        case Strategy::kZero1: return 8 * psi + 8 * sh;
                        case Strategy::kZero2: return 4 * psi + 12 * sh;
                        case Strategy::kZero3: return 16 * sh;
                      }
                      return 0;
                    },
                    nullptr});
  misses.push_back({"no padding: Psi / N rounded down for a shard",
                    [=](Strategy s, std::size_t psi, int world) {
                      const std::size_t sh = psi / static_cast<std::size_t>(world);
                      return s == Strategy::kDdp     ? 16 * psi
                             : s == Strategy::kZero1 ? 4 * psi + 12 * sh
                             : s == Strategy::kZero2 ? 2 * psi + 14 * sh
                                                     : 16 * sh;
                    },
                    nullptr});
  misses.push_back(
      {"the largest model as floor(budget / bytes per parameter), no padding",
       [=](Strategy s, std::size_t psi, int world) { return contract_bytes(s, psi, world); },
       [](Strategy s, int world, std::size_t budget) {
         const double n = world;
         const double per = s == Strategy::kDdp     ? 16.0
                            : s == Strategy::kZero1 ? 4.0 + 12.0 / n
                            : s == Strategy::kZero2 ? 2.0 + 14.0 / n
                                                    : 16.0 / n;
         return static_cast<std::size_t>(std::floor(static_cast<double>(budget) / per));
       }});
  misses.push_back({"masters forgotten: 2 + 2 + 8 (moments only sharded)",
                    [=](Strategy s, std::size_t psi, int world) {
                      const std::size_t sh = shard(psi, world);
                      return s == Strategy::kDdp     ? 12 * psi
                             : s == Strategy::kZero1 ? 4 * psi + 8 * sh
                             : s == Strategy::kZero2 ? 2 * psi + 10 * sh
                                                     : 12 * sh;
                    },
                    nullptr});
  misses.push_back({"ZeRO-2 with the gradients replicated (ZeRO-1's count)",
                    [=](Strategy s, std::size_t psi, int world) {
                      return contract_bytes(s == Strategy::kZero2 ? Strategy::kZero1 : s, psi,
                                            world);
                    },
                    nullptr});
  misses.push_back({"ZeRO-3 with the parameters replicated (ZeRO-2's count)",
                    [=](Strategy s, std::size_t psi, int world) {
                      return contract_bytes(s == Strategy::kZero3 ? Strategy::kZero2 : s, psi,
                                            world);
                    },
                    nullptr});
  return misses;
}
