#include "dp/layers/cross_entropy.h"

#include <algorithm>
#include <cmath>

#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/error.h"

namespace dp {

float SoftmaxCrossEntropy::forward(const Tensor& logits, std::span<const int> labels) {
  if (logits.rank() != 2)
    throw Error(fmt::format("cross-entropy expects logits of shape (B, classes), got {}",
                            logits.shape_string()));
  const std::int64_t batch = logits.dim(0);
  const std::int64_t classes = logits.dim(1);
  if (static_cast<std::int64_t>(labels.size()) != batch)
    throw Error(fmt::format("cross-entropy got {} labels for a batch of {} rows (logits {})",
                            labels.size(), batch, logits.shape_string()));
  if (batch == 0) throw Error("cross-entropy of an empty batch is undefined (mean over 0 rows)");
  for (std::size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] < 0 || labels[i] >= classes)
      throw Error(
          fmt::format("label {} is {}, expected a class in [0, {})", i, labels[i], classes));
  }

  // (B, C), where the logits live
  probabilities_ =
      Tensor::uninitialized({batch, classes}, MemoryCategory::kActivations, logits.device());
  labels_.assign(labels.begin(), labels.end());
  if (detail::on_gpu(logits.device())) {
    // The loss comes back to the host: reading it waits for the kernels before it.
    const double total = cuda::cross_entropy_forward(logits.view().data(), labels_.data(), batch,
                                                     classes, probabilities_.view().data());
    return static_cast<float>(total / static_cast<double>(batch));
  }
  double total_loss = 0.0;
  for (std::int64_t row = 0; row < batch; ++row) {
    const float* z = logits.view().data() + row * classes;
    float* p = probabilities_.view().data() + row * classes;
    // log-sum-exp with the maximum taken out: exp() of a large logit would overflow.
    const float max_logit = *std::max_element(z, z + classes);
    double sum_exp = 0.0;
    for (std::int64_t j = 0; j < classes; ++j) sum_exp += std::exp(double{z[j]} - max_logit);
    const double log_sum_exp = max_logit + std::log(sum_exp);
    for (std::int64_t j = 0; j < classes; ++j)
      p[j] = static_cast<float>(std::exp(double{z[j]} - log_sum_exp));
    total_loss += log_sum_exp - z[labels[static_cast<std::size_t>(row)]];
  }
  return static_cast<float>(total_loss / static_cast<double>(batch));
}

Tensor SoftmaxCrossEntropy::backward(float scale) {
  if (probabilities_.rank() == 0)
    throw Error("cross-entropy backward called without a forward before it");
  const std::int64_t batch = probabilities_.dim(0);
  const std::int64_t classes = probabilities_.dim(1);
  const float factor = scale / static_cast<float>(batch);  // mean reduction, times scale

  // (B, C)
  Tensor grad_logits = Tensor::uninitialized({batch, classes}, MemoryCategory::kActivations,
                                             probabilities_.device());
  if (detail::on_gpu(probabilities_.device())) {
    cuda::cross_entropy_backward(probabilities_.view().data(), labels_.data(), batch, classes,
                                 factor, grad_logits.view().data());
    return grad_logits;
  }
  for (std::int64_t row = 0; row < batch; ++row) {
    const float* p = probabilities_.view().data() + row * classes;
    float* dz = grad_logits.view().data() + row * classes;
    const int label = labels_[static_cast<std::size_t>(row)];
    for (std::int64_t j = 0; j < classes; ++j) dz[j] = factor * (j == label ? p[j] - 1.0f : p[j]);
  }
  return grad_logits;
}

OpCost SoftmaxCrossEntropy::forward_cost(std::int64_t batch, std::int64_t classes) {
  const double elements = static_cast<double>(batch) * static_cast<double>(classes);
  return {.flops = 4 * elements, .bytes = sizeof(float) * 2 * elements};
}

OpCost SoftmaxCrossEntropy::backward_cost(std::int64_t batch, std::int64_t classes) {
  const double elements = static_cast<double>(batch) * static_cast<double>(classes);
  return {.flops = 2 * elements, .bytes = sizeof(float) * 2 * elements};
}

}  // namespace dp
