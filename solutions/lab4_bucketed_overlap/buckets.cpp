// buckets.cpp: lab 4's bucket rule and the design question. Your part: the bodies of
// assign_buckets and predicted_best_bucket_cap_bytes.
#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "dp/error.h"
#include "lab4.h"

namespace dp::lab4 {

std::vector<Bucket> assign_buckets(const Model& model, const BucketOptions& options) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)options;
  // SKELETON: throw NotImplemented("lab4::assign_buckets");
  std::vector<Bucket> buckets;
  Bucket open;
  const std::span<const Parameter* const> parameters = model.parameters();
  // Reverse definition order: the order backward makes the gradients ready.
  for (std::size_t i = parameters.size(); i-- > 0;) {
    const Parameter& parameter = *parameters[i];
    if (parameter.frozen) continue;
    const std::size_t cap =
        buckets.empty() ? options.first_bucket_cap_bytes : options.bucket_cap_bytes;
    const std::size_t bytes_after = (open.elements + parameter.grad.size()) * sizeof(float);
    // Close the open bucket only when it already holds something: a parameter larger than
    // the cap still needs a bucket, and gets one to itself.
    if (!open.parameters.empty() && bytes_after > cap) {
      buckets.push_back(std::move(open));
      open = Bucket{};
    }
    open.parameters.push_back(i);
    open.elements += parameter.grad.size();
  }
  if (!open.parameters.empty()) buckets.push_back(std::move(open));
  return buckets;
  // END SOLUTION
}

std::size_t predicted_best_bucket_cap_bytes(const BackwardProfile& profile, int world_size,
                                            const LinkModel& link) {
  if (world_size < 1) throw Error(fmt::format("world size {}; expected at least 1", world_size));
  // BEGIN SOLUTION
  // SKELETON: (void)profile;
  // SKELETON: (void)link;
  // SKELETON: throw NotImplemented("lab4::predicted_best_bucket_cap_bytes");
  const double ranks = world_size;
  // A native ring all-reduce of `bytes` (dp/clock.h); nothing to do on one rank.
  const auto allreduce_seconds = [&](double bytes) {
    return 2.0 * (ranks - 1) * (link.alpha_seconds + bytes / ranks / link.bytes_per_second);
  };
  // The step's end with one cap: replay the bucket rule on the gradients as they arrive;
  // a bucket's all-reduce starts when its last gradient is ready and the previous
  // all-reduce is done (they share every link, one at a time).
  const auto modelled_end = [&](std::size_t cap) {
    double link_free = 0;
    std::size_t open_bytes = 0;
    double open_ready = 0;
    bool open_empty = true;
    for (const GradientReady& gradient : profile.gradients) {
      if (!open_empty && open_bytes + gradient.bytes > cap) {
        link_free = std::max(link_free, open_ready) + allreduce_seconds(double(open_bytes));
        open_bytes = 0;
        open_empty = true;
      }
      open_bytes += gradient.bytes;
      open_ready = gradient.seconds;
      open_empty = false;
    }
    if (!open_empty)
      link_free = std::max(link_free, open_ready) + allreduce_seconds(double(open_bytes));
    return std::max(profile.backward_seconds, link_free);
  };
  std::size_t total_bytes = 0;
  for (const GradientReady& gradient : profile.gradients) total_bytes += gradient.bytes;
  // Candidates: the caps the grader sweeps, powers of two from 64 KiB until one bucket
  // holds everything (a smaller cap can be a little faster still, but is not swept).
  std::vector<std::pair<std::size_t, double>> candidates;  // (cap, modelled end)
  double best_end = std::numeric_limits<double>::infinity();
  for (std::size_t cap = std::size_t{64} << 10;; cap *= 2) {
    candidates.emplace_back(cap, modelled_end(cap));
    best_end = std::min(best_end, candidates.back().second);
    if (cap >= total_bytes) break;
  }
  // Where backward hides the communication, many caps end together (a plateau): then the
  // largest of those within 0.5% of the best wins, since every bucket also costs what the
  // model leaves out (packing, a call's bookkeeping).
  std::size_t best_cap = candidates.front().first;
  for (const auto& [cap, end] : candidates)
    if (end <= best_end * 1.005) best_cap = cap;
  return best_cap;
  // END SOLUTION
}

}  // namespace dp::lab4
