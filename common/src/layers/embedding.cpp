#include "dp/layers/embedding.h"

#include <algorithm>
#include <cmath>

#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/error.h"
#include "precision.h"

namespace dp {
namespace {

// The largest vocabulary whose every id a float holds exactly: 2^24.
constexpr std::int64_t kLargestExactVocab = std::int64_t{1} << 24;

// GPT-2's standard deviation for its embeddings (and its linear weights).
constexpr float kEmbeddingInitStd = 0.02f;

// The ids of `tensor` (floats), wherever it lives, as a host vector.
std::vector<float> ids_on_host(const Tensor& tensor) {
  std::vector<float> values(tensor.size());
  detail::copy_memory(values.data(), Device::kHost, tensor.view().data(), tensor.device(),
                      tensor.bytes());
  return values;
}

}  // namespace

Embedding::Embedding(std::string name, std::int64_t vocab, std::int64_t context, std::int64_t dim,
                     DataType dtype)
    : Layer(std::move(name)), vocab_(vocab), context_(context), dim_(dim) {
  if (vocab <= 0 || context <= 0 || dim <= 0)
    throw Error(
        fmt::format("embedding {} needs positive sizes, got vocab = {}, context = {}, dim = {}",
                    this->name(), vocab, context, dim));
  if (vocab > kLargestExactVocab)
    throw Error(fmt::format(
        "embedding {}: a vocabulary of {} tokens is more than a float32 id holds exactly "
        "(at most 2^24 = {})",
        this->name(), vocab, kLargestExactVocab));
  // GPT-2's names, not "<layer>.<role>": a checkpoint then reads in other tools.
  detail::check_tensor_type("Embedding", dtype);
  token_weight_ = Parameter::zeros("wte.weight", {vocab, dim}, dtype);
  position_weight_ = Parameter::zeros("wpe.weight", {context, dim}, dtype);
}

Tensor Embedding::forward(const Tensor& input) {
  if (input.rank() != 2 || input.dim(1) < 1 || input.dim(1) > context_)
    throw Error(
        fmt::format("{} expects token ids of shape (B, T) with 1 <= T <= {} (its context), got {}",
                    name(), context_, input.shape_string()));
  require_value(token_weight_, {vocab_, dim_});
  require_value(position_weight_, {context_, dim_});
  require_same_device(input, "the input", token_weight_.value, token_weight_.name);
  require_same_device(position_weight_.value, position_weight_.name, token_weight_.value,
                      token_weight_.name);
  if (input.dtype() != DataType::kFloat32)
    throw Error(
        fmt::format("{}: the token ids are {}, expected float32 (a 16-bit float does not "
                    "hold every id exactly)",
                    name(), to_string(input.dtype())));
  const std::int64_t batch = input.dim(0);
  const std::int64_t time = input.dim(1);
  const bool gpu = detail::on_gpu(input.device());
  // 16-bit: the tables widened to float32 exactly, the float32 sums below, y rounded once
  // (embedding.h).
  const DataType type = token_weight_.value.dtype();
  const bool narrow = type != DataType::kFloat32;
  if (narrow) detail::require_16bit_off_gpu(name(), token_weight_.value);
  const Tensor wide_tokens = narrow ? detail::widened(token_weight_.value) : Tensor();
  const Tensor wide_positions = narrow ? detail::widened(position_weight_.value) : Tensor();

  // The ids are checked on the host: a GPU's come over first ((B, T) floats, small).
  std::vector<float> copied_ids;
  if (gpu) copied_ids = ids_on_host(input);
  const float* ids = gpu ? copied_ids.data() : input.view().data();
  for (std::int64_t i = 0; i < batch * time; ++i) {
    const float id = ids[i];
    // The negation catches NaN, which fails every comparison.
    if (!(id >= 0.0f && id < static_cast<float>(vocab_) && std::floor(id) == id))
      throw Error(fmt::format(
          "{}: the token id at (b = {}, t = {}) is {}, expected an integer in [0, {}) stored "
          "as a float",
          name(), i / time, i % time, id, vocab_));
  }

  // (B, T, C)
  Tensor output =
      Tensor::uninitialized({batch, time, dim_}, MemoryCategory::kActivations, input.device());
  const float* wte = (narrow ? wide_tokens : token_weight_.value).view().data();
  const float* wpe = (narrow ? wide_positions : position_weight_.value).view().data();
  float* y = output.view().data();
  if (gpu) {
    cuda::embedding_forward(input.view().data(), wte, wpe, batch, time, dim_, y);
  } else {
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t t = 0; t < time; ++t) {
        const std::int64_t row = b * time + t;
        const float* token = wte + static_cast<std::int64_t>(ids[row]) * dim_;
        const float* position = wpe + t * dim_;
        for (std::int64_t c = 0; c < dim_; ++c) y[row * dim_ + c] = token[c] + position[c];
      }
    }
  }
  saved_ids_ = input.clone(MemoryCategory::kActivations);
  return narrow ? detail::rounded(output, type) : std::move(output);
}

Tensor Embedding::backward(const Tensor& grad_output) {
  if (saved_ids_.rank() == 0)
    throw Error(
        fmt::format("{}: backward called without a forward before it (each forward "
                    "allows one backward)",
                    name()));
  const std::int64_t batch = saved_ids_.dim(0);
  const std::int64_t time = saved_ids_.dim(1);
  if (grad_output.shape() != std::vector<std::int64_t>{batch, time, dim_})
    throw Error(fmt::format(
        "{} backward expects a gradient of shape ({}, {}, {}) like its last output, got {}", name(),
        batch, time, dim_, grad_output.shape_string()));
  require_same_device(grad_output, "the output gradient", saved_ids_, "the saved ids");
  // 16-bit: dy widened to float32 exactly, the float32 sums below, each gradient added as
  // grad = round(widen(grad) + sums) (embedding.h).
  const DataType type = token_weight_.value.dtype();
  const bool narrow = type != DataType::kFloat32;
  if (grad_output.dtype() != type)
    throw Error(fmt::format("{}: the output gradient holds {} elements but the tables are {}",
                            name(), to_string(grad_output.dtype()), to_string(type)));
  if (narrow) detail::require_16bit_off_gpu(name(), grad_output);
  const Tensor wide_grad_output = narrow ? detail::widened(grad_output) : Tensor();
  const float* dy = (narrow ? wide_grad_output : grad_output).view().data();
  if (detail::on_gpu(grad_output.device())) {
    // The positions of each token in increasing order, so that the kernel adds each token's
    // rows in the host loop's order (cuda/device_ops.h).
    const std::vector<float> ids = ids_on_host(saved_ids_);
    std::vector<std::int64_t> offsets(static_cast<std::size_t>(vocab_ + 1), 0);
    for (const float id : ids) ++offsets[static_cast<std::size_t>(id) + 1];
    for (std::size_t v = 0; v < static_cast<std::size_t>(vocab_); ++v) offsets[v + 1] += offsets[v];
    std::vector<std::int64_t> positions(ids.size());
    std::vector<std::int64_t> next(offsets.begin(), offsets.end() - 1);
    for (std::size_t row = 0; row < ids.size(); ++row)
      positions[static_cast<std::size_t>(next[static_cast<std::size_t>(ids[row])]++)] =
          static_cast<std::int64_t>(row);
    float* dwte =
        token_weight_.frozen ? nullptr : grad_for_accumulation(token_weight_).view().data();
    float* dwpe =
        position_weight_.frozen ? nullptr : grad_for_accumulation(position_weight_).view().data();
    cuda::embedding_backward(dy, offsets.data(), positions.data(), vocab_, batch, time, dim_, dwte,
                             dwpe);
    saved_ids_ = Tensor();
    return Tensor();
  }
  const float* ids = saved_ids_.view().data();
  // Each gradient receives one addition per element per backward (as `grad += batch_grad`
  // would): this batch's sums are formed first, in (b, t) order.
  if (!token_weight_.frozen) {
    Tensor batch_grad({vocab_, dim_}, MemoryCategory::kActivations,
                      grad_output.device());  // (V, C), zero-filled
    float* sums = batch_grad.view().data();
    for (std::int64_t row = 0; row < batch * time; ++row) {
      float* sum = sums + static_cast<std::int64_t>(ids[row]) * dim_;
      for (std::int64_t c = 0; c < dim_; ++c) sum[c] += dy[row * dim_ + c];
    }
    detail::accumulate_rounded(batch_grad.view(), grad_for_accumulation(token_weight_).view());
  }
  if (!position_weight_.frozen) {
    std::vector<float> sums(static_cast<std::size_t>(time * dim_), 0.0f);  // (T, C)
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t i = 0; i < time * dim_; ++i) sums[i] += dy[b * time * dim_ + i];
    // Positions past T got no gradient from this batch.
    // The emulated device's memory is the host's: accumulate_rounded's loop reads it.
    const TensorView grad = grad_for_accumulation(position_weight_).view();
    detail::accumulate_rounded(ConstTensorView(sums.data(), sums.size(), grad.device()),
                               grad.slice(0, sums.size()));
  }
  saved_ids_ = Tensor();
  return Tensor();
}

void Embedding::initialize(Parameter& parameter, CounterRng& rng) {
  DP_CHECK(&parameter == &token_weight_ || &parameter == &position_weight_,
           "{} is not a parameter of {}", parameter.name, name());
  // 16-bit: the float32 draws rounded, so a 16-bit model starts from its float32 twin rounded.
  detail::fill_drawn(parameter.value, [&] { return kEmbeddingInitStd * rng.normal(); });
}

void Embedding::discard_saved() {
  saved_ids_ = Tensor();
}

OpCost Embedding::forward_cost(std::int64_t batch) const {
  const double elements =
      static_cast<double>(batch) * static_cast<double>(context_) * static_cast<double>(dim_);
  // Read a row of wte and of wpe and write y per token; read the ids.
  return {.flops = elements,
          .bytes = sizeof(float) * (3 * elements + static_cast<double>(batch * context_))};
}

OpCost Embedding::backward_cost(std::int64_t batch) const {
  const double elements =
      static_cast<double>(batch) * static_cast<double>(context_) * static_cast<double>(dim_);
  const double table = static_cast<double>(vocab_ + context_) * static_cast<double>(dim_);
  // Two additions per dy element (into the token and position sums), one per table element;
  // read dy, read and write the sums and the gradients.
  return {.flops = 2 * elements + table, .bytes = sizeof(float) * (elements + 4 * table)};
}

}  // namespace dp
