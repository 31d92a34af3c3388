#include "dp/layers/lm_head.h"

#include "dp/error.h"
#include "dp/ops.h"
#include "precision.h"

namespace dp {
namespace {

// GPT-2's standard deviation for its linear weights.
constexpr float kHeadWeightStd = 0.02f;

// `dim` once the sizes of head `name` are checked: runs before ln_f is built, so a bad size
// is reported as the head's, not as ln_f's.
std::int64_t checked_head_dim(const std::string& name, std::int64_t dim, std::int64_t vocab,
                              std::int64_t context) {
  if (dim <= 0 || vocab <= 0 || context <= 0)
    throw Error(fmt::format(
        "language model head {} needs positive sizes, got dim = {}, vocab = {}, context = {}", name,
        dim, vocab, context));
  return dim;
}

}  // namespace

LanguageModelHead::LanguageModelHead(std::string name, std::int64_t dim, std::int64_t vocab,
                                     std::int64_t context, DataType dtype)
    : Layer(std::move(name)),
      dim_(checked_head_dim(this->name(), dim, vocab, context)),
      vocab_(vocab),
      context_(context),
      // GPT-2's names, not "<layer>.<role>": a checkpoint then reads in other tools.
      ln_f_("ln_f", dim, kLayerNormEps, dtype),
      weight_(Parameter::zeros("lm_head.weight", {vocab, dim}, dtype)) {}

std::vector<Parameter*> LanguageModelHead::parameters() {
  return {&ln_f_.weight(), &ln_f_.bias(), &weight_};
}

void LanguageModelHead::initialize(Parameter& parameter, CounterRng& rng) {
  if (&parameter == &ln_f_.weight() || &parameter == &ln_f_.bias()) {
    ln_f_.initialize(parameter, rng);
    return;
  }
  DP_CHECK(&parameter == &weight_, "{} is not a parameter of {}", parameter.name, name());
  // 16-bit: the float32 draws rounded, so a 16-bit head starts from its float32 twin rounded.
  detail::fill_drawn(parameter.value, [&] { return kHeadWeightStd * rng.normal(); });
}

Tensor LanguageModelHead::forward(const Tensor& input) {
  if (input.rank() != 3 || input.dim(1) < 1 || input.dim(1) > context_ || input.dim(2) != dim_)
    throw Error(fmt::format("{} expects input of shape (B, T, {}) with 1 <= T <= {}, got {}",
                            name(), dim_, context_, input.shape_string()));
  require_value(weight_, {vocab_, dim_});
  require_same_device(input, "the input", weight_.value, weight_.name);
  const std::int64_t batch = input.dim(0);
  const std::int64_t time = input.dim(1);

  Tensor rows = input.clone(MemoryCategory::kActivations);  // (B T, C): ln_f works on rows
  rows.reshape({batch * time, dim_});
  saved_normalized_ = ln_f_.forward(rows);  // h: (B T, C)
  saved_time_ = time;
  const DataType type = weight_.value.dtype();
  if (type != DataType::kFloat32) {
    // 16-bit: h and W widened exactly, the float32 product, the logits rounded once.
    detail::require_16bit_off_gpu(name(), saved_normalized_);
    return detail::rounded(matmul(detail::widened(saved_normalized_), Transpose::kNo,
                                  detail::widened(weight_.value), Transpose::kYes),
                           type);
  }
  // logits: (B T, V) = (B T, C) (V, C)^T
  return matmul(saved_normalized_, Transpose::kNo, weight_.value, Transpose::kYes);
}

Tensor LanguageModelHead::backward(const Tensor& grad_output) {
  if (saved_normalized_.rank() == 0)
    throw Error(
        fmt::format("{}: backward called without a forward before it (each forward "
                    "allows one backward)",
                    name()));
  const std::int64_t rows = saved_normalized_.dim(0);
  require_grad_output(grad_output, rows, vocab_);
  require_value(weight_, {vocab_, dim_});
  require_same_device(grad_output, "the output gradient", weight_.value, weight_.name);
  const DataType type = weight_.value.dtype();
  if (grad_output.dtype() != type)
    throw Error(fmt::format("{}: the output gradient holds {} elements but the weight is {}",
                            name(), to_string(grad_output.dtype()), to_string(type)));
  if (type != DataType::kFloat32) {
    // 16-bit: dlogits, h and W widened exactly, the float32 products, dW added as
    // grad = round(widen(grad) + dlogits^T h) and dh rounded once (lm_head.h).
    detail::require_16bit_off_gpu(name(), grad_output);
    const Tensor dy = detail::widened(grad_output);
    if (!weight_.frozen) {
      const Tensor h = detail::widened(saved_normalized_);
      Tensor contribution =
          Tensor::uninitialized({vocab_, dim_}, MemoryCategory::kActivations, grad_output.device());
      matmul_into(dy, Transpose::kYes, h, Transpose::kNo, contribution, 1.0f, 0.0f);
      detail::accumulate_rounded(contribution.view(), grad_for_accumulation(weight_).view());
    }
    const Tensor grad_normalized = detail::rounded(
        matmul(dy, Transpose::kNo, detail::widened(weight_.value), Transpose::kNo), type);
    saved_normalized_ = Tensor();
    Tensor grad_input = ln_f_.backward(grad_normalized);  // (B T, C)
    grad_input.reshape({rows / saved_time_, saved_time_, dim_});
    return grad_input;
  }

  if (!weight_.frozen) {
    // dW: (V, C) += (B T, V)^T (B T, C)
    matmul_into(grad_output, Transpose::kYes, saved_normalized_, Transpose::kNo,
                grad_for_accumulation(weight_), 1.0f, 1.0f);
  }
  // dh: (B T, C) = (B T, V) (V, C)
  const Tensor grad_normalized = matmul(grad_output, Transpose::kNo, weight_.value, Transpose::kNo);
  saved_normalized_ = Tensor();
  Tensor grad_input = ln_f_.backward(grad_normalized);  // (B T, C)
  grad_input.reshape({rows / saved_time_, saved_time_, dim_});
  return grad_input;
}

void LanguageModelHead::discard_saved() {
  saved_normalized_ = Tensor();
  saved_time_ = 0;
  ln_f_.discard_saved();
}

OpCost LanguageModelHead::forward_cost(std::int64_t batch) const {
  const std::int64_t rows = batch * context_;
  const double r = static_cast<double>(rows);
  const double c = static_cast<double>(dim_);
  const double v = static_cast<double>(vocab_);
  OpCost cost = ln_f_.forward_cost(rows);
  // The copy into rows; the product reads h and W and writes the logits.
  cost += {.flops = 2 * r * c * v, .bytes = sizeof(float) * (2 * r * c + r * c + v * c + r * v)};
  return cost;
}

OpCost LanguageModelHead::backward_cost(std::int64_t batch) const {
  const std::int64_t rows = batch * context_;
  const double r = static_cast<double>(rows);
  const double c = static_cast<double>(dim_);
  const double v = static_cast<double>(vocab_);
  OpCost cost = ln_f_.backward_cost(rows);
  // dW and dh, each a (B T, C, V) product: read dlogits, h and W, read and write dW, write dh.
  cost += {.flops = 4 * r * c * v,
           .bytes = sizeof(float) * (r * v + r * c + v * c + 2 * v * c + r * c)};
  return cost;
}

}  // namespace dp
