#include "dp/layers/transformer_block.h"

#include <cmath>

#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/error.h"
#include "dp/float16.h"
#include "element_types.h"
#include "precision.h"

namespace dp {
namespace {

// GPT-2's standard deviation for its linear weights.
constexpr float kBlockWeightStd = 0.02f;

// `dim` once the sizes of block `name` are checked: runs before the sublayers are built, so a
// bad size is reported as the block's, not as a sublayer's.
std::int64_t checked_block_dim(const std::string& name, std::int64_t dim, std::int64_t heads,
                               std::int64_t context, std::int64_t layers) {
  if (dim <= 0 || heads <= 0 || context <= 0 || layers <= 0)
    throw Error(fmt::format(
        "transformer block {} needs positive sizes, got dim = {}, heads = {}, context = {}, "
        "layers = {}",
        name, dim, heads, context, layers));
  if (dim % heads != 0)
    throw Error(
        fmt::format("transformer block {}: {} heads do not divide dim = {} into equal heads", name,
                    heads, dim));
  return dim;
}

// y += x, element by element, where the two live. Not dp::add: that charges the simulated
// clock an op of its own, and the block's cost already counts its residual sums. 16-bit:
// y = round(widen(y) + widen(x)), one rounding per element (transformer_block.h).
void add_residual(const Tensor& x, Tensor& y) {
  DP_CHECK(x.size() == y.size() && x.device() == y.device() && x.dtype() == y.dtype(),
           "residual sum of {} elements into {}", x.size(), y.size());
  if (y.dtype() != DataType::kFloat32) {
    detail::require_16bit_off_gpu("a transformer block's residual sum", y);
    // The emulated device's memory is the host's: the loop reads it.
    detail::with_element_type(y.dtype(), [&]<typename T>(T) {
      const T* source = static_cast<const T*>(x.view().raw_data());
      T* target = static_cast<T*>(y.view().raw_data());
      for (std::size_t i = 0; i < y.size(); ++i)
        target[i] = detail::narrow<T>(detail::widen(target[i]) + detail::widen(source[i]));
    });
    return;
  }
  if (detail::on_gpu(y.device())) {
    cuda::add(x.view().data(), y.view().data(), y.size());
    return;
  }
  const float* source = x.view().data();
  float* target = y.view().data();
  for (std::size_t i = 0; i < y.size(); ++i) target[i] += source[i];
}

}  // namespace

TransformerBlock::TransformerBlock(std::string name, std::int64_t dim, std::int64_t heads,
                                   std::int64_t context, std::int64_t layers, DataType dtype)
    : Layer(std::move(name)),
      dim_(checked_block_dim(this->name(), dim, heads, context, layers)),
      context_(context),
      layers_(layers),
      ln_1_(this->name() + ".ln_1", dim, kLayerNormEps, dtype),
      attention_(this->name() + ".attn", dim, heads, context, dtype),
      ln_2_(this->name() + ".ln_2", dim, kLayerNormEps, dtype),
      mlp_fc_(this->name() + ".mlp.c_fc", dim, 4 * dim, dtype),
      mlp_gelu_(this->name() + ".mlp.gelu", 4 * dim),
      mlp_proj_(this->name() + ".mlp.c_proj", 4 * dim, dim, dtype) {}

std::vector<Parameter*> TransformerBlock::parameters() {
  std::vector<Parameter*> all = {&ln_1_.weight(), &ln_1_.bias()};
  for (Parameter* parameter : attention_.parameters()) all.push_back(parameter);
  for (Parameter* parameter : {&ln_2_.weight(), &ln_2_.bias(), &mlp_fc_.weight(), &mlp_fc_.bias(),
                               &mlp_proj_.weight(), &mlp_proj_.bias()})
    all.push_back(parameter);
  return all;
}

void TransformerBlock::initialize(Parameter& parameter, CounterRng& rng) {
  Parameter* const p = &parameter;
  if (p == &ln_1_.weight() || p == &ln_2_.weight()) {
    parameter.value.fill(1.0f);
  } else if (p == &ln_1_.bias() || p == &ln_2_.bias() || p == &attention_.qkv_projection().bias() ||
             p == &attention_.output_projection().bias() || p == &mlp_fc_.bias() ||
             p == &mlp_proj_.bias()) {
    parameter.value.fill(0.0f);
  } else if (p == &attention_.qkv_projection().weight() || p == &mlp_fc_.weight()) {
    // 16-bit: the float32 draws rounded, so a 16-bit block starts from its float32 twin rounded.
    detail::fill_drawn(parameter.value, [&] { return kBlockWeightStd * rng.normal(); });
  } else if (p == &attention_.output_projection().weight() || p == &mlp_proj_.weight()) {
    // Each block adds two branch outputs to the residual stream: 2 layers sums in all.
    const float std = kBlockWeightStd / std::sqrt(2.0f * static_cast<float>(layers_));
    detail::fill_drawn(parameter.value, [&] { return std * rng.normal(); });
  } else {
    DP_CHECK(false, "{} is not a parameter of {}", parameter.name, name());
  }
}

Tensor TransformerBlock::forward(const Tensor& input) {
  if (input.rank() != 3 || input.dim(1) < 1 || input.dim(1) > context_ || input.dim(2) != dim_)
    throw Error(fmt::format("{} expects input of shape (B, T, {}) with 1 <= T <= {}, got {}",
                            name(), dim_, context_, input.shape_string()));
  Tensor output = forward_saving_everything(input);
  saved_input_ = Tensor();
  if (activation_checkpointing_) {
    // Keep x alone; backward recomputes the rest from it.
    discard_saved_by_sublayers();
    saved_input_ = input.clone(MemoryCategory::kActivations);
  }
  return output;
}

Tensor TransformerBlock::forward_saving_everything(const Tensor& input) {
  const std::int64_t batch = input.dim(0);
  const std::int64_t time = input.dim(1);

  // The residual stream, as rows (B T, C): a copy of x that each branch adds into.
  Tensor residual = input.clone(MemoryCategory::kActivations);
  residual.reshape({batch * time, dim_});
  {
    const Tensor normalized = ln_1_.forward(residual);                  // (B T, C)
    const Tensor attended = attention_.forward_rows(normalized, time);  // (B T, C)
    add_residual(attended, residual);                                   // x + attn(ln_1(x))
  }
  {
    const Tensor normalized = ln_2_.forward(residual);                     // (B T, C)
    const Tensor hidden = mlp_gelu_.forward(mlp_fc_.forward(normalized));  // (B T, 4C)
    const Tensor projected = mlp_proj_.forward(hidden);                    // (B T, C)
    add_residual(projected, residual);                                     // x + mlp(ln_2(x))
  }
  residual.reshape({batch, time, dim_});
  saved_batch_ = batch;
  saved_time_ = time;
  return residual;
}

Tensor TransformerBlock::backward(const Tensor& grad_output) {
  if (saved_batch_ == 0)
    throw Error(
        fmt::format("{}: backward called without a forward before it (each forward "
                    "allows one backward)",
                    name()));
  const std::int64_t batch = saved_batch_;
  const std::int64_t time = saved_time_;
  if (grad_output.shape() != std::vector<std::int64_t>{batch, time, dim_})
    throw Error(fmt::format(
        "{} backward expects a gradient of shape ({}, {}, {}) like its last output, got {}", name(),
        batch, time, dim_, grad_output.shape_string()));

  if (activation_checkpointing_) {
    // The same forward again, so that every sublayer has what its backward needs; its output
    // is the one already returned, bit for bit, and is not needed.
    (void)forward_saving_everything(saved_input_);
    saved_input_ = Tensor();
  }

  // The gradient of the residual stream, (B T, C): dy, plus what each branch sends back.
  Tensor grad = grad_output.clone(MemoryCategory::kActivations);
  grad.reshape({batch * time, dim_});
  {
    const Tensor hidden = mlp_gelu_.backward(mlp_proj_.backward(grad));  // (B T, 4C)
    const Tensor normalized = mlp_fc_.backward(hidden);                  // (B T, C)
    add_residual(ln_2_.backward(normalized), grad);
  }
  {
    const Tensor normalized = attention_.backward_rows(grad);  // (B T, C)
    add_residual(ln_1_.backward(normalized), grad);
  }
  grad.reshape({batch, time, dim_});
  saved_batch_ = 0;
  saved_time_ = 0;
  return grad;
}

void TransformerBlock::discard_saved() {
  saved_input_ = Tensor();
  saved_batch_ = 0;
  saved_time_ = 0;
  discard_saved_by_sublayers();
}

void TransformerBlock::discard_saved_by_sublayers() {
  ln_1_.discard_saved();
  attention_.discard_saved();
  ln_2_.discard_saved();
  mlp_fc_.discard_saved();
  mlp_gelu_.discard_saved();
  mlp_proj_.discard_saved();
}

OpCost TransformerBlock::forward_cost(std::int64_t batch) const {
  const std::int64_t rows = batch * context_;
  const double elements = static_cast<double>(rows) * static_cast<double>(dim_);
  OpCost cost = ln_1_.forward_cost(rows);
  cost += attention_.forward_cost(batch);
  cost += ln_2_.forward_cost(rows);
  cost += mlp_fc_.forward_cost(rows);
  cost += mlp_gelu_.forward_cost(rows);
  cost += mlp_proj_.forward_cost(rows);
  // The copy of x into the residual stream and the two residual sums (read two, write one).
  cost += {.flops = 2 * elements, .bytes = sizeof(float) * (2 * elements + 2 * 3 * elements)};
  return cost;
}

OpCost TransformerBlock::backward_cost(std::int64_t batch) const {
  const std::int64_t rows = batch * context_;
  const double elements = static_cast<double>(rows) * static_cast<double>(dim_);
  OpCost cost = activation_checkpointing_ ? forward_cost(batch) : OpCost{};
  cost += mlp_proj_.backward_cost(rows);
  cost += mlp_gelu_.backward_cost(rows);
  cost += mlp_fc_.backward_cost(rows);
  cost += ln_2_.backward_cost(rows);
  cost += attention_.backward_cost(batch);
  cost += ln_1_.backward_cost(rows);
  // The copy of dy and the two gradient sums.
  cost += {.flops = 2 * elements, .bytes = sizeof(float) * (2 * elements + 2 * 3 * elements)};
  return cost;
}

}  // namespace dp
