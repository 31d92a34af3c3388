// The synthetic classification set: Gaussian blobs around random class centres.
#include <cmath>

#include "dp/data.h"
#include "dp/error.h"
#include "dp/rng.h"

namespace dp {

namespace {

// Sample i draws from stream i; class centres draw from streams far above any sample
// index, so no two draws share a stream and sample i never depends on the sample count.
constexpr std::uint64_t kCentreStreamBase = std::uint64_t{1} << 63;

}  // namespace

Dataset make_synthetic_classification(const SyntheticOptions& options) {
  if (options.samples == 0) throw Error("synthetic data set: expected at least 1 sample, got 0");
  if (options.features <= 0)
    throw Error(fmt::format("synthetic data set: expected a positive feature count, got {}",
                            options.features));
  if (options.classes < 2)
    throw Error(
        fmt::format("synthetic data set: expected at least 2 classes, got {}", options.classes));
  if (!(options.noise >= 0.0f) || !std::isfinite(options.noise))
    throw Error(
        fmt::format("synthetic data set: expected a finite noise >= 0, got {}", options.noise));

  const auto dim = static_cast<std::size_t>(options.features);
  std::vector<float> centres(static_cast<std::size_t>(options.classes) * dim);
  for (int label = 0; label < options.classes; ++label) {
    CounterRng rng(options.seed, kCentreStreamBase + static_cast<std::uint64_t>(label));
    for (std::size_t d = 0; d < dim; ++d)
      centres[static_cast<std::size_t>(label) * dim + d] = rng.normal();
  }

  Dataset data;
  data.name = fmt::format("synthetic:{}", options.samples);
  data.num_classes = options.classes;
  data.labels.resize(options.samples);
  data.features = Tensor::uninitialized(
      {static_cast<std::int64_t>(options.samples), options.features}, MemoryCategory::kOther);
  for (std::size_t sample = 0; sample < options.samples; ++sample) {
    CounterRng rng(options.seed, sample);
    const auto label = static_cast<int>(rng.below(static_cast<std::uint64_t>(options.classes)));
    data.labels[sample] = label;
    const float* centre = centres.data() + static_cast<std::size_t>(label) * dim;
    float* row = data.features.data() + sample * dim;
    for (std::size_t d = 0; d < dim; ++d) row[d] = centre[d] + options.noise * rng.normal();
  }
  return data;
}

}  // namespace dp
