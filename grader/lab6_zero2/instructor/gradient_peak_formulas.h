// gradient_peak_formulas.h: the answer to lab 6's first design question
// (predicted_gradient_peak_bytes) for the reference design, and its plausible wrong answers,
// for grader/lab6_zero2/checks.cpp (instructors only: the student release leaves this folder
// out, since the answer is the formula the question asks for and each wrong answer is it
// with one term changed).
//
// The check compares a prediction with the peaks the student's own optimizer reached; these
// name the mistake when a prediction that misses equals one of them, and the check fails as
// a grader bug when its draws never tell one of them from the answer. Included by checks.cpp
// after WrongFormula and the contract's helpers, in its anonymous namespace;
// accumulation_near_misses.h uses reference_buffer_bytes too.
#pragma once

/// The reference design in words, for the feedback on a prediction that matches a mistake.
constexpr std::string_view kReferenceDesignInWords =
    "two buffers of the largest padded bucket, one with a single bucket";

/// The reference design's buffers (two, or one with a single bucket).
constexpr std::size_t kReferenceBucketBuffers = 2;

/// The bytes of the reference design's buffers.
std::size_t reference_buffer_bytes(const std::vector<Bucket>& buckets, int world) {
  return 4 * std::min(kReferenceBucketBuffers, buckets.size()) *
         largest_padded_bucket(buckets, world);
}

/// The design question's answer for the reference design (the shard, the largest layer's
/// gradients, min(2, B) buffers of the largest padded bucket) and the plausible wrong
/// formulas for it, for `model` on `world` ranks with a cap of `cap` bytes. The check
/// compares each prediction with the student's own optimizer's peaks; these tell whether
/// the draws can catch a wrong formula, and name the one a wrong prediction matches. Each
/// wrong formula is named by its mistake alone: the failure message must not say what the
/// right term is.
std::pair<std::size_t, std::vector<WrongFormula>> design_formulas(Model& model, int world,
                                                                  std::size_t cap) {
  const std::vector<Bucket> buckets = contract_buckets(model, world, cap);
  const auto n = static_cast<std::size_t>(world);
  const std::size_t shard = 4 * contract_shard(buckets);
  const std::size_t layer = 4 * largest_layer(model);
  const std::size_t buffers = reference_buffer_bytes(buckets, world);
  std::size_t largest_bucket = 0;  // E, not N C
  std::size_t largest_parameter = 0;
  for (const Bucket& bucket : buckets) largest_bucket = std::max(largest_bucket, bucket.elements);
  for (const Parameter* parameter : model.parameters())
    largest_parameter = std::max(largest_parameter, parameter->value.size());
  const std::size_t psi = model.num_parameters();
  const std::size_t count = std::min(kReferenceBucketBuffers, buckets.size());
  return {shard + layer + buffers,
          {
              {"two bucket buffers whatever the number of buckets",
               shard + layer + 4 * kReferenceBucketBuffers * (buffers / (4 * count))},
              {"one buffer per bucket", shard + layer + buckets.size() * (buffers / count)},
              {"lab 5's shard, 4 ceil(Psi / N)", 4 * ((psi + n - 1) / n) + layer + buffers},
              {"bucket buffers of max_k E_k elements, without padding",
               shard + layer + 4 * count * largest_bucket},
              {"one bucket's gradients held during backward", shard + 4 * largest_bucket + buffers},
              {"the largest parameter's gradient held during backward",
               shard + 4 * largest_parameter + buffers},
          }};
}
