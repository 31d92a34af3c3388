#include "dp/layers/attention.h"

#include <algorithm>
#include <cmath>

#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/error.h"
#include "dp/ops.h"
#include "precision.h"

namespace dp {
namespace {

// GPT-2's standard deviation for its linear weights.
constexpr float kAttentionWeightStd = 0.02f;

// C = alpha op(A) op(B) + beta C on row-major matrices with row strides, where `device` says
// the pointers live: dp::gemm's contract, through cuBLAS on a GPU. The heads are strided
// column blocks of [q | k | v], which dp::matmul (whole tensors) cannot name.
void strided_gemm(Device device, Transpose transpose_a, Transpose transpose_b, std::int64_t m,
                  std::int64_t n, std::int64_t k, float alpha, const float* a, std::int64_t lda,
                  const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (detail::on_gpu(device)) {
    cuda::gemm(transpose_a == Transpose::kYes, transpose_b == Transpose::kYes, m, n, k, alpha, a,
               lda, b, ldb, beta, c, ldc);
  } else {
    gemm(transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

// The causal softmax in place on the (time, time) scores of one head: row i keeps j <= i.
// Subtracting the row's maximum keeps exp() from overflowing; the sum is taken in double.
void causal_softmax_on_host(float* scores, std::int64_t time) {
  for (std::int64_t i = 0; i < time; ++i) {
    float* row = scores + i * time;
    const float row_max = *std::max_element(row, row + i + 1);
    double sum = 0.0;
    for (std::int64_t j = 0; j <= i; ++j) {
      row[j] = std::exp(row[j] - row_max);
      sum += row[j];
    }
    const float inverse_sum = static_cast<float>(1.0 / sum);
    for (std::int64_t j = 0; j <= i; ++j) row[j] *= inverse_sum;
    std::fill(row + i + 1, row + time, 0.0f);  // the future: weight 0
  }
}

// The softmax's backward in place on one head: `grad` holds dP and becomes
// dS = P * (dP - sum_j dP P). The masked entries are set to 0 (P is 0 there, but dP is not),
// so the products after it see no future position.
void causal_softmax_backward_on_host(const float* probabilities, float* grad, std::int64_t time) {
  for (std::int64_t i = 0; i < time; ++i) {
    const float* p_row = probabilities + i * time;
    float* ds_row = grad + i * time;
    double weighted = 0.0;
    for (std::int64_t j = 0; j <= i; ++j) weighted += double{ds_row[j]} * p_row[j];
    for (std::int64_t j = 0; j <= i; ++j)
      ds_row[j] = p_row[j] * (ds_row[j] - static_cast<float>(weighted));
    std::fill(ds_row + i + 1, ds_row + time, 0.0f);
  }
}

// `dim` once the sizes of attention `name` are checked: runs before the projections are
// built, so a bad size is reported as the attention's, not as a Linear's.
std::int64_t checked_dim(const std::string& name, std::int64_t dim, std::int64_t heads,
                         std::int64_t context) {
  if (dim <= 0 || heads <= 0 || context <= 0)
    throw Error(
        fmt::format("attention {} needs positive sizes, got dim = {}, heads = {}, context = {}",
                    name, dim, heads, context));
  if (dim % heads != 0)
    throw Error(fmt::format("attention {}: {} heads do not divide dim = {} into equal heads", name,
                            heads, dim));
  return dim;
}

}  // namespace

CausalSelfAttention::CausalSelfAttention(std::string name, std::int64_t dim, std::int64_t heads,
                                         std::int64_t context, DataType dtype)
    : Layer(std::move(name)),
      dim_(checked_dim(this->name(), dim, heads, context)),
      heads_(heads),
      context_(context),
      qkv_projection_(this->name() + ".c_attn", dim, 3 * dim, dtype),
      output_projection_(this->name() + ".c_proj", dim, dim, dtype) {}

std::vector<Parameter*> CausalSelfAttention::parameters() {
  return {&qkv_projection_.weight(), &qkv_projection_.bias(), &output_projection_.weight(),
          &output_projection_.bias()};
}

void CausalSelfAttention::initialize(Parameter& parameter, CounterRng& rng) {
  const bool weight =
      &parameter == &qkv_projection_.weight() || &parameter == &output_projection_.weight();
  const bool bias =
      &parameter == &qkv_projection_.bias() || &parameter == &output_projection_.bias();
  DP_CHECK(weight || bias, "{} is not a parameter of {}", parameter.name, name());
  if (bias) {
    parameter.value.fill(0.0f);
    return;
  }
  // 16-bit: the float32 draws rounded, so a 16-bit model starts from its float32 twin rounded.
  detail::fill_drawn(parameter.value, [&] { return kAttentionWeightStd * rng.normal(); });
}

Tensor CausalSelfAttention::forward(const Tensor& input) {
  if (input.rank() != 3 || input.dim(1) < 1 || input.dim(1) > context_ || input.dim(2) != dim_)
    throw Error(fmt::format("{} expects input of shape (B, T, {}) with 1 <= T <= {}, got {}",
                            name(), dim_, context_, input.shape_string()));
  const std::int64_t batch = input.dim(0);
  const std::int64_t time = input.dim(1);
  Tensor rows = input.clone(MemoryCategory::kActivations);
  rows.reshape({batch * time, dim_});
  Tensor output = forward_rows(rows, time);
  output.reshape({batch, time, dim_});
  return output;
}

Tensor CausalSelfAttention::backward(const Tensor& grad_output) {
  if (saved_qkv_.rank() == 0)
    throw Error(
        fmt::format("{}: backward called without a forward before it (each forward "
                    "allows one backward)",
                    name()));
  const std::int64_t time = saved_time_;
  const std::int64_t batch = saved_qkv_.dim(0) / time;
  if (grad_output.shape() != std::vector<std::int64_t>{batch, time, dim_})
    throw Error(fmt::format(
        "{} backward expects a gradient of shape ({}, {}, {}) like its last output, got {}", name(),
        batch, time, dim_, grad_output.shape_string()));
  Tensor grad_rows = grad_output.clone(MemoryCategory::kActivations);
  grad_rows.reshape({batch * time, dim_});
  Tensor grad_input = backward_rows(grad_rows);
  grad_input.reshape({batch, time, dim_});
  return grad_input;
}

Tensor CausalSelfAttention::forward_rows(const Tensor& rows, std::int64_t time) {
  if (time < 1 || time > context_ || rows.rank() != 2 || rows.dim(0) % time != 0 ||
      rows.dim(1) != dim_)
    throw Error(fmt::format(
        "{} expects the rows of B sequences of T tokens, (B T, {}) with 1 <= T <= {}; got {} "
        "for T = {}",
        name(), dim_, context_, rows.shape_string(), time));
  const std::int64_t batch = rows.dim(0) / time;
  const std::int64_t width = dim_;
  const std::int64_t head_dim = dim_ / heads_;
  const std::int64_t qkv_stride = 3 * width;  // a row of [q | k | v]
  const Device device = rows.device();
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));

  saved_qkv_ = qkv_projection_.forward(rows);  // (B T, 3C)
  // 16-bit: the core widens [q | k | v] exactly, runs in float32 and rounds y once
  // (attention.h).
  const DataType type = saved_qkv_.dtype();
  const bool narrow = type != DataType::kFloat32;
  if (narrow) detail::require_16bit_off_gpu(name(), saved_qkv_);
  const Tensor wide_qkv = narrow ? detail::widened(saved_qkv_) : Tensor();
  saved_probabilities_ = Tensor::uninitialized({batch, heads_, time, time},
                                               MemoryCategory::kActivations, device);  // P
  Tensor heads_output =
      Tensor::uninitialized({batch * time, width}, MemoryCategory::kActivations, device);  // y
  const float* qkv = (narrow ? wide_qkv : saved_qkv_).view().data();
  float* y = heads_output.view().data();
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t h = 0; h < heads_; ++h) {
      const float* q = qkv + b * time * qkv_stride + h * head_dim;  // (T, d), stride 3C
      const float* k = q + width;
      const float* v = q + 2 * width;
      float* p = saved_probabilities_.view().data() + (b * heads_ + h) * time * time;  // (T, T)
      // S = q k^T / sqrt(d), every (i, j): the mask is applied by the softmax below.
      strided_gemm(device, Transpose::kNo, Transpose::kYes, time, time, head_dim, scale, q,
                   qkv_stride, k, qkv_stride, 0.0f, p, time);
      if (detail::on_gpu(device))
        cuda::causal_softmax_forward(p, time, time);
      else
        causal_softmax_on_host(p, time);
      // y_h = P v_h: (T, d) = (T, T) (T, d), into the head's columns of y.
      strided_gemm(device, Transpose::kNo, Transpose::kNo, time, head_dim, time, 1.0f, p, time, v,
                   qkv_stride, 0.0f, y + b * time * width + h * head_dim, width);
    }
  }
  saved_time_ = time;
  if (narrow) return output_projection_.forward(detail::rounded(heads_output, type));
  return output_projection_.forward(heads_output);  // (B T, C)
}

Tensor CausalSelfAttention::backward_rows(const Tensor& grad_rows) {
  if (saved_qkv_.rank() == 0)
    throw Error(
        fmt::format("{}: backward called without a forward before it (each forward "
                    "allows one backward)",
                    name()));
  const std::int64_t time = saved_time_;
  const std::int64_t batch = saved_qkv_.dim(0) / time;
  const std::int64_t width = dim_;
  const std::int64_t head_dim = dim_ / heads_;
  const std::int64_t qkv_stride = 3 * width;
  require_grad_output(grad_rows, batch * time, width);
  require_same_device(grad_rows, "the output gradient", saved_qkv_, "the saved [q | k | v]");
  const Device device = grad_rows.device();
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));

  const Tensor grad_heads = output_projection_.backward(grad_rows);  // dy: (B T, C)
  // 16-bit: [q | k | v] and dy widened exactly, the float32 core below, d[q | k | v] rounded
  // once (attention.h).
  const DataType type = saved_qkv_.dtype();
  const bool narrow = type != DataType::kFloat32;
  if (narrow) detail::require_16bit_off_gpu(name(), grad_heads);
  const Tensor wide_qkv = narrow ? detail::widened(saved_qkv_) : Tensor();
  const Tensor wide_grad_heads = narrow ? detail::widened(grad_heads) : Tensor();
  Tensor grad_qkv({batch * time, qkv_stride}, MemoryCategory::kActivations, device);  // (B T, 3C)
  Tensor grad_scores =
      Tensor::uninitialized({time, time}, MemoryCategory::kActivations, device);  // dP, then dS
  const float* qkv = (narrow ? wide_qkv : saved_qkv_).view().data();
  const float* dy = (narrow ? wide_grad_heads : grad_heads).view().data();
  float* ds = grad_scores.view().data();
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t h = 0; h < heads_; ++h) {
      const std::int64_t head_offset = b * time * qkv_stride + h * head_dim;
      const float* q = qkv + head_offset;
      const float* k = q + width;
      const float* v = q + 2 * width;
      float* dq = grad_qkv.view().data() + head_offset;
      float* dk = dq + width;
      float* dv = dq + 2 * width;
      const float* dy_h = dy + b * time * width + h * head_dim;  // (T, d), stride C
      const float* p = saved_probabilities_.view().data() + (b * heads_ + h) * time * time;
      // dP = dY_h v_h^T (T, T); dv_h = P^T dY_h (T, d).
      strided_gemm(device, Transpose::kNo, Transpose::kYes, time, time, head_dim, 1.0f, dy_h, width,
                   v, qkv_stride, 0.0f, ds, time);
      strided_gemm(device, Transpose::kYes, Transpose::kNo, time, head_dim, time, 1.0f, p, time,
                   dy_h, width, 0.0f, dv, qkv_stride);
      // dS = P * (dP - sum_j dP P), 0 where the mask is.
      if (detail::on_gpu(device))
        cuda::causal_softmax_backward(p, ds, time, time);
      else
        causal_softmax_backward_on_host(p, ds, time);
      // dq_h = dS k_h / sqrt(d); dk_h = dS^T q_h / sqrt(d).
      strided_gemm(device, Transpose::kNo, Transpose::kNo, time, head_dim, time, scale, ds, time, k,
                   qkv_stride, 0.0f, dq, qkv_stride);
      strided_gemm(device, Transpose::kYes, Transpose::kNo, time, head_dim, time, scale, ds, time,
                   q, qkv_stride, 0.0f, dk, qkv_stride);
    }
  }
  saved_qkv_ = Tensor();
  saved_probabilities_ = Tensor();
  if (narrow) return qkv_projection_.backward(detail::rounded(grad_qkv, type));
  return qkv_projection_.backward(grad_qkv);  // (B T, C)
}

OpCost CausalSelfAttention::core_cost(std::int64_t batch, bool backward) const {
  const double b = static_cast<double>(batch);
  const double t = static_cast<double>(context_);
  const double c = static_cast<double>(dim_);
  const double scores = b * static_cast<double>(heads_) * t * t;  // elements of S (and P)
  // Forward: S = q k^T and y = P v, each 2 T T d flops per head (2 B T T C in all); the
  // softmax about 5 flops per score. Backward: dP, dv, dq, dk, and about 4 flops per score.
  const double products = (backward ? 4 : 2) * 2 * b * t * t * c;
  const double flops = products + (backward ? 4 : 5) * scores;
  // Forward reads [q | k | v], writes S and P (and reads S back) and y. Backward reads
  // [q | k | v], dy and P, writes and reads dP / dS, writes d[q | k | v].
  const double rows = b * t;
  const double bytes = backward ? sizeof(float) * (2 * 3 * rows * c + rows * c + 3 * scores)
                                : sizeof(float) * (3 * rows * c + 3 * scores + rows * c);
  return {.flops = flops, .bytes = bytes};
}

void CausalSelfAttention::discard_saved() {
  saved_qkv_ = Tensor();
  saved_probabilities_ = Tensor();
  saved_time_ = 0;
  qkv_projection_.discard_saved();
  output_projection_.discard_saved();
}

OpCost CausalSelfAttention::forward_cost(std::int64_t batch) const {
  const std::int64_t rows = batch * context_;
  OpCost cost = qkv_projection_.forward_cost(rows);
  cost += core_cost(batch, false);
  cost += output_projection_.forward_cost(rows);
  return cost;
}

OpCost CausalSelfAttention::backward_cost(std::int64_t batch) const {
  const std::int64_t rows = batch * context_;
  OpCost cost = output_projection_.backward_cost(rows);
  cost += core_cost(batch, true);
  cost += qkv_projection_.backward_cost(rows);
  return cost;
}

}  // namespace dp
