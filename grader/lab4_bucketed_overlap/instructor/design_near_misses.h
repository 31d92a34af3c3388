// design_near_misses.h: plausible wrong answers to lab 4's design question, for
// grader/lab4_bucketed_overlap/checks.cpp (instructors only: the student release leaves this
// folder out, since each rule here is a shortcut a student could copy, and the last ones are
// the right model with one term changed).
//
// The check fails as a grader bug when none of its drawn cases tells one of these rules
// from the right answer (a rule every case accepts would score full marks). The selftests'
// planted bugs design_is_a_constant, design_is_a_table_of_alpha_bands,
// design_is_alpha_times_bandwidth and design_ignores_latency are members of these families,
// and predict_default_first_cap, predict_pytorch_rule and predict_forgot_divide_by_N (the lab 4
// re-trial's slips) are the last three rules exactly: the check's witness case
// (draw_near_miss_witness) parts them on every run.
// Included by checks.cpp after WrongCapRule, in its anonymous namespace.
#pragma once

/// A variant of the contract's cost model, for `best_cap_by_model`: the right one with one
/// term or rule changed.
struct CapModel {
  /// A bucket's all-reduce of `bytes`, in seconds.
  std::function<double(double)> allreduce_seconds = nullptr;
  /// Whether each all-reduce waits for the previous one's end (the link is shared: the
  /// contract's) or starts as soon as its bucket is complete.
  bool link_queues = true;
  /// Bucket 0's cap when it differs from the cap swept (the contract's is
  /// BucketOptions{cap, cap}: none).
  std::optional<std::size_t> first_bucket_cap = std::nullopt;
  /// PyTorch's reducer rule: append the gradient, then close the bucket once it reaches its
  /// cap (buckets overshoot), instead of the contract's close before it would overflow.
  bool append_then_close = false;
  /// The smallest cap swept (the check's sweep starts at 64 KiB).
  std::size_t smallest_cap = 1024;
  /// The largest cap whose step is within this share of the fastest is chosen.
  double tie_share = 0.005;
};

/// The best cap by a variant of the contract's cost model: the bucket rule replayed on
/// `profile` with caps of `smallest_cap`, twice that, ... until one bucket holds
/// everything, each bucket's all-reduce taking `allreduce_seconds(bytes)` from the later of
/// its last gradient and (when `link_queues`) the previous all-reduce's end; the largest
/// cap whose step is within `tie_share` of the fastest.
inline std::size_t best_cap_by_model(const BackwardProfile& profile, const CapModel& variant) {
  const auto modelled_end = [&](std::size_t cap) {
    double end = 0;
    double open_bytes = 0;
    double open_ready = 0;
    bool open_empty = true;
    bool first_bucket = true;
    const auto close = [&] {
      end = variant.link_queues ? std::max(end, open_ready) + variant.allreduce_seconds(open_bytes)
                                : std::max(end, open_ready + variant.allreduce_seconds(open_bytes));
      open_bytes = 0;
      open_empty = true;
      first_bucket = false;
    };
    for (const GradientReady& gradient : profile.gradients) {
      const auto bucket_cap = static_cast<double>(
          first_bucket && variant.first_bucket_cap ? *variant.first_bucket_cap : cap);
      if (!variant.append_then_close && !open_empty &&
          open_bytes + static_cast<double>(gradient.bytes) > bucket_cap)
        close();
      open_bytes += static_cast<double>(gradient.bytes);
      open_ready = gradient.seconds;
      open_empty = false;
      if (variant.append_then_close && open_bytes >= bucket_cap) close();
    }
    if (!open_empty) close();
    return std::max(profile.backward_seconds, end);
  };
  std::size_t total = 0;
  for (const GradientReady& gradient : profile.gradients) total += gradient.bytes;
  std::vector<std::pair<std::size_t, double>> candidates;
  double best = std::numeric_limits<double>::infinity();
  for (std::size_t cap = variant.smallest_cap;; cap *= 2) {
    candidates.emplace_back(cap, modelled_end(cap));
    best = std::min(best, candidates.back().second);
    if (cap >= total) break;
  }
  std::size_t chosen = candidates.front().first;
  for (const auto& [cap, end] : candidates)
    if (end <= best * (1 + variant.tie_share)) chosen = cap;
  return chosen;
}

/// The contract's all-reduce of `bytes` on `world` ranks of `link`, 2 (N-1) (alpha + n / (N
/// bandwidth)), for the near misses that change something else.
inline std::function<double(double)> ring_allreduce(int world, const LinkModel& link) {
  const double n = world;
  return [n, link](double bytes) {
    return 2 * (n - 1) * (link.alpha_seconds + bytes / n / link.bytes_per_second);
  };
}

/// The plausible wrong rules: every constant cap, tables of caps by alpha band (the lab 4
/// trial's, and the bands and best caps the rubric once published), a cap proportional to
/// alpha x bandwidth for every factor, and the cost model without alpha, without the link's
/// queue, with PyTorch's 1 MiB first bucket, with PyTorch's bucket rule, and with an
/// all-reduce that forgets the division by N. (Taking the largest cap within 10% of the fastest
/// instead of 0.5% is not listed: it is a slip of the tie rule, inside the check's own 3% plateau
/// on most draws.)
inline std::vector<WrongCapRule> design_near_misses() {
  std::vector<WrongCapRule> rules;
  // Quarter octaves: any constant or factor lies within 2^(1/8) of one of them.
  for (int step = 0; step <= 4 * 16; ++step) {
    const auto cap = static_cast<std::size_t>(std::llround(16.0 * 1024 * std::exp2(step / 4.0)));
    rules.push_back({fmt::format("a constant cap of {} bytes", cap),
                     [cap](const BackwardProfile&, int, const LinkModel&) { return cap; }});
  }
  for (int step = -4 * 4; step <= 4 * 20; ++step) {
    const double factor = std::exp2(step / 4.0);
    rules.push_back({fmt::format("a cap of {:.4g} alpha x bandwidth", factor),
                     [factor](const BackwardProfile&, int, const LinkModel& link) {
                       return static_cast<std::size_t>(std::llround(
                           std::min(1e18, factor * link.alpha_seconds * link.bytes_per_second)));
                     }});
  }
  rules.push_back(
      {"a cap of 64 alpha x bandwidth rounded up to a power of two of at least 64 "
       "KiB, at most the model (the lab 4 trial's cheat)",
       [](const BackwardProfile& profile, int, const LinkModel& link) {
         std::size_t total = 0;
         for (const GradientReady& gradient : profile.gradients) total += gradient.bytes;
         const double cap = 64.0 * link.alpha_seconds * link.bytes_per_second;
         std::size_t power = std::size_t{64} << 10;
         while (static_cast<double>(power) < cap && power < total) power *= 2;
         return power;
       }});
  rules.push_back(
      {"512 KiB below alpha 30 us, 2 MiB below 300 us, one bucket above (the lab 4 "
       "trial's table of the rubric's alpha bands)",
       [](const BackwardProfile&, int, const LinkModel& link) {
         if (link.alpha_seconds < 30e-6) return std::size_t{512} << 10;
         if (link.alpha_seconds < 300e-6) return std::size_t{2} << 20;
         return std::numeric_limits<std::size_t>::max();
       }});
  rules.push_back(
      {"256 KiB below alpha 30 us, 2 MiB below 500 us, one bucket above (the "
       "bands and best caps the rubric once published)",
       [](const BackwardProfile&, int, const LinkModel& link) {
         if (link.alpha_seconds < 30e-6) return std::size_t{256} << 10;
         if (link.alpha_seconds < 500e-6) return std::size_t{2} << 20;
         return std::numeric_limits<std::size_t>::max();
       }});
  rules.push_back({"the cost model without alpha",
                   [](const BackwardProfile& profile, int world, const LinkModel& link) {
                     const double n = world;
                     return best_cap_by_model(profile, {.allreduce_seconds = [&](double bytes) {
                                                return 2 * (n - 1) * bytes / n /
                                                       link.bytes_per_second;
                                              }});
                   }});
  rules.push_back(
      {"the cost model without the link's queue (each all-reduce starting when its "
       "bucket is ready, e_k = max(e_{k-1}, r_k + T(n_k)))",
       [](const BackwardProfile& profile, int world, const LinkModel& link) {
         return best_cap_by_model(
             profile, {.allreduce_seconds = ring_allreduce(world, link), .link_queues = false});
       }});
  // The lab 4 re-trial's three slips, each scoring full marks on some seeds before the draws
  // looked for them. They sweep from 64 KiB, as the check does (and as a student who reads
  // the contract would); the sweep start is not what is wrong in them.
  rules.push_back(
      {"the cost model with PyTorch's 1 MiB first bucket (the contract's cap is every "
       "bucket's, BucketOptions{cap, cap})",
       [](const BackwardProfile& profile, int world, const LinkModel& link) {
         return best_cap_by_model(profile, {.allreduce_seconds = ring_allreduce(world, link),
                                            .first_bucket_cap = kDefaultFirstBucketCapBytes,
                                            .smallest_cap = std::size_t{64} << 10});
       }});
  rules.push_back(
      {"the cost model with PyTorch's bucket rule (append the gradient, then close the "
       "bucket once it reaches the cap: buckets overshoot)",
       [](const BackwardProfile& profile, int world, const LinkModel& link) {
         return best_cap_by_model(profile, {.allreduce_seconds = ring_allreduce(world, link),
                                            .append_then_close = true,
                                            .smallest_cap = std::size_t{64} << 10});
       }});
  rules.push_back(
      {"the cost model with an all-reduce that forgets the division by N (2 (N-1) (alpha + "
       "n / bandwidth): the bandwidth term N times too large)",
       [](const BackwardProfile& profile, int world, const LinkModel& link) {
         const double n = world;
         return best_cap_by_model(
             profile, {.allreduce_seconds =
                           [&](double bytes) {
                             return 2 * (n - 1) *
                                    (link.alpha_seconds + bytes / link.bytes_per_second);
                           },
                       .smallest_cap = std::size_t{64} << 10});
       }});
  return rules;
}
