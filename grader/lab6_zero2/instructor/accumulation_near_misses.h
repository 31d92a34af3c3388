// accumulation_near_misses.h: the plausible wrong answers to lab 6's second design question
// (predicted_accumulation_cost), for grader/lab6_zero2/checks.cpp (instructors only: the
// student release leaves this folder out, since each is the reference design's answer with
// one term changed).
//
// The check compares a prediction with what the student's own optimizer measured; these
// name the mistake when a prediction that misses equals one of them, and the check fails as
// a grader bug when its draws never tell one of them from the reference's answer. Included
// by checks.cpp after AccumulationNearMiss, the contract's helpers and
// gradient_peak_formulas.h (reference_buffer_bytes), in its anonymous namespace.
#pragma once

/// The reference design's cost of one step (two bucket buffers, one with a single bucket;
/// reducing every micro-batch adds a landing of the largest chunk per buffer) and the
/// plausible wrong answers for it, for `model` on `world` ranks with a cap of `cap` bytes.
std::pair<AccumulationCost, std::vector<AccumulationNearMiss>> accumulation_costs(
    Model& model, int world, std::size_t cap, int micro, Accumulation strategy) {
  const std::vector<Bucket> buckets = contract_buckets(model, world, cap);
  const auto n = static_cast<std::size_t>(world);
  const auto m = static_cast<std::size_t>(micro);
  const bool once = strategy == Accumulation::kReduceOnce;
  const std::size_t count = std::min<std::size_t>(2, buckets.size());
  std::size_t chunk = 0;
  std::size_t unpadded = 0;  // what the collectives send without the padding, per call set
  for (const Bucket& b : buckets) {
    chunk = std::max(chunk, b.chunk_elements);
    unpadded += 4 * (n - 1) * b.elements / n;
  }
  const std::size_t shard = 4 * contract_shard(buckets);
  const std::size_t layer = 4 * largest_layer(model);
  const std::size_t psi = 4 * model.num_parameters();
  const std::size_t buffers = reference_buffer_bytes(buckets, world);
  const std::size_t landings = m > 1 && !once ? 4 * count * chunk : 0;
  const std::size_t held = m > 1 && once ? psi : layer;
  std::uint64_t per_call_set = 0;
  for (const Bucket& b : buckets) per_call_set += 4 * (n - 1) * b.chunk_elements;
  const std::uint64_t scatters = once ? 1 : m;
  const AccumulationCost right{shard + held + buffers + landings, (scatters + 1) * per_call_set};
  const auto with_peak = [&](std::size_t peak) { return AccumulationCost{peak, right.bytes_sent}; };
  const auto with_bytes = [&](std::uint64_t bytes) {
    return AccumulationCost{right.gradient_peak_bytes, bytes};
  };
  std::vector<AccumulationNearMiss> wrong;
  if (m > 1 && once) {
    wrong.push_back({"the whole gradient added to one layer's gradients instead of replacing them",
                     with_peak(right.gradient_peak_bytes + layer), true});
    wrong.push_back({"M reduce-scatters per step, as when reducing every micro-batch",
                     with_bytes((m + 1) * per_call_set), true});
  }
  if (m == 1 && once)
    wrong.push_back({"the whole gradient held between micro-batches, though M = 1 has none",
                     with_peak(shard + psi + buffers), true});
  if (m > 1 && !once) {
    wrong.push_back(
        {"no room for the earlier micro-batches' sum while a reduce-scatter "
         "overwrites the chunk",
         with_peak(right.gradient_peak_bytes - landings), true});
    wrong.push_back(
        {"one reduce-scatter per step, as when reducing once", with_bytes(2 * per_call_set), true});
  }
  wrong.push_back(
      {"the all-gathers left out of the bytes", with_bytes(scatters * per_call_set), world > 1});
  wrong.push_back(
      {"the collectives' bytes without the padding", with_bytes((scatters + 1) * unpadded), false});
  return {right, wrong};
}
