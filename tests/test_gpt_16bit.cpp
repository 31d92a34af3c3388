// The GPT's layers in bfloat16 and float16 (mixed precision, issue 30): each follows the
// 16-bit rule of dp/layers/linear.h, checked bit for bit. A leaf layer (LayerNorm, GELU,
// Embedding) is compared with its float32 twin run on the widened inputs and parameters:
// every output and the input gradient must be the float32 result rounded once, every
// parameter gradient round(widen(g0) + the float32 gradient) from a nonzero g0. A composite
// layer (the attention, the block, the head) is compared with the same arithmetic spelled out
// here from separate 16-bit sublayers, float32 products and explicit roundings, so that a
// missing or an extra rounding between its operations shows. Last, a 16-bit GPT starts as
// its float32 twin rounded, and trains on the host and the emulated device alike.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "dp/float16.h"
#include "dp/layers/attention.h"
#include "dp/layers/embedding.h"
#include "dp/layers/gelu.h"
#include "dp/layers/layer_norm.h"
#include "dp/layers/linear.h"
#include "dp/layers/lm_head.h"
#include "dp/layers/transformer_block.h"
#include "dp/model.h"
#include "dp/ops.h"
#include "dp/rng.h"
#include "dp/tensor.h"
#include "precision.h"

namespace {

using dp::DataType;
using dp::Tensor;

constexpr DataType kNarrowTypes[] = {DataType::kBFloat16, DataType::kFloat16};

// Uniform values in [-bound, bound) from stream `stream` of seed 23, as a float32 tensor.
Tensor uniform(const std::vector<std::int64_t>& shape, std::uint64_t stream, float bound = 1.0f) {
  Tensor values(shape, dp::MemoryCategory::kOther);
  dp::CounterRng rng(23, stream);
  for (float& value : values.span()) value = rng.uniform(-bound, bound);
  return values;
}

// The same values rounded to `type`.
Tensor narrow_uniform(const std::vector<std::int64_t>& shape, DataType type, std::uint64_t stream,
                      float bound = 1.0f) {
  return uniform(shape, stream, bound).to(type);
}

Tensor wide(const Tensor& tensor) {
  return tensor.to(DataType::kFloat32);
}

std::vector<float> floats(const Tensor& tensor) {
  const Tensor values = wide(tensor);
  const std::span<const float> span = values.span();
  return {span.begin(), span.end()};
}

// The bits of a 16-bit host tensor.
std::vector<std::uint16_t> bits(const Tensor& tensor) {
  EXPECT_NE(tensor.dtype(), DataType::kFloat32);
  std::vector<std::uint16_t> out(tensor.size());
  std::memcpy(out.data(), tensor.view().raw_data(), 2 * tensor.size());
  return out;
}

// Expects `narrow` to hold `expected` bit for bit (both 16-bit), naming the first mismatch.
void expect_bitwise(const Tensor& narrow, const Tensor& expected, const std::string& what) {
  ASSERT_EQ(narrow.dtype(), expected.dtype()) << what;
  ASSERT_EQ(narrow.size(), expected.size()) << what;
  const std::vector<std::uint16_t> a = bits(narrow);
  const std::vector<std::uint16_t> b = bits(expected);
  const auto mismatch = std::mismatch(a.begin(), a.end(), b.begin());
  EXPECT_TRUE(mismatch.first == a.end())
      << what << ": element " << (mismatch.first - a.begin()) << " has bits " << std::hex
      << *mismatch.first << ", expected " << *mismatch.second;
}

// round(widen(g0) + contribution): what a 16-bit gradient g0 must become.
Tensor accumulated(const Tensor& g0, const Tensor& contribution, DataType type) {
  std::vector<float> sum = floats(g0);
  const std::vector<float> add = floats(contribution);
  for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += add[i];
  return Tensor::from(sum).to(type);
}

// Gives `narrow` random 16-bit parameters and nonzero 16-bit gradients, and `wide` (float32,
// same layout) the same values widened and zero gradients; returns the narrow g0s.
std::vector<Tensor> twin_parameters(dp::Layer& narrow, dp::Layer& wide_layer, DataType type) {
  const std::vector<dp::Parameter*> a = narrow.parameters();
  const std::vector<dp::Parameter*> b = wide_layer.parameters();
  EXPECT_EQ(a.size(), b.size());
  std::vector<Tensor> g0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const Tensor value = narrow_uniform(a[i]->value.shape(), type, 100 + i, 0.5f);
    dp::detail::convert_uncharged(value.view(), a[i]->value.view());
    dp::detail::convert_uncharged(value.view(), b[i]->value.view());
    const Tensor grad = narrow_uniform(a[i]->value.shape(), type, 200 + i, 0.25f);
    dp::detail::convert_uncharged(grad.view(), a[i]->grad.view());
    b[i]->grad.fill(0.0f);
    g0.push_back(grad.clone(dp::MemoryCategory::kOther));
  }
  return g0;
}

// Copies `source`'s parameter values and gradients into `target`'s (same layout and type).
void copy_parameters(std::vector<dp::Parameter*> source, std::vector<dp::Parameter*> target) {
  ASSERT_EQ(source.size(), target.size());
  for (std::size_t i = 0; i < source.size(); ++i) {
    dp::detail::convert_uncharged(source[i]->value.view(), target[i]->value.view());
    dp::detail::convert_uncharged(source[i]->grad.view(), target[i]->grad.view());
  }
}

// Expects every gradient of 16-bit `narrow` to be round(widen(g0) + the float32 twin's).
void expect_gradients(dp::Layer& narrow, dp::Layer& wide_layer, const std::vector<Tensor>& g0,
                      DataType type) {
  const std::vector<dp::Parameter*> a = narrow.parameters();
  const std::vector<dp::Parameter*> b = wide_layer.parameters();
  for (std::size_t i = 0; i < a.size(); ++i)
    expect_bitwise(a[i]->grad, accumulated(g0[i], b[i]->grad, type), a[i]->name + ".grad");
}

// Expects the same gradients in two 16-bit layers of the same layout.
void expect_same_gradients(dp::Layer& layer, std::vector<dp::Parameter*> reference) {
  const std::vector<dp::Parameter*> a = layer.parameters();
  ASSERT_EQ(a.size(), reference.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    expect_bitwise(a[i]->grad, reference[i]->grad, a[i]->name + ".grad");
}

// ---- Leaf layers: the float32 twin on the widened values, rounded once --------------------

TEST(Gpt16Bit, LayerNormIsTheFloat32LayerRounded) {
  for (const DataType type : kNarrowTypes) {
    SCOPED_TRACE(dp::to_string(type));
    dp::LayerNorm narrow("ln", 24, dp::kLayerNormEps, type);
    dp::LayerNorm wide_layer("ln", 24);
    const std::vector<Tensor> g0 = twin_parameters(narrow, wide_layer, type);
    const Tensor x = narrow_uniform({6, 24}, type, 1, 2.0f);
    const Tensor y = narrow.forward(x);
    EXPECT_EQ(y.dtype(), type);
    expect_bitwise(y, wide_layer.forward(wide(x)).to(type), "y");
    const Tensor dy = narrow_uniform({6, 24}, type, 2);
    expect_bitwise(narrow.backward(dy), wide_layer.backward(wide(dy)).to(type), "dx");
    expect_gradients(narrow, wide_layer, g0, type);
  }
}

TEST(Gpt16Bit, GeluIsTheFloat32LayerRounded) {
  for (const DataType type : kNarrowTypes) {
    SCOPED_TRACE(dp::to_string(type));
    dp::GELU narrow("gelu", 40);
    dp::GELU wide_layer("gelu", 40);
    const Tensor x = narrow_uniform({5, 40}, type, 3, 4.0f);
    const Tensor y = narrow.forward(x);
    expect_bitwise(y, wide_layer.forward(wide(x)).to(type), "y");
    const Tensor dy = narrow_uniform({5, 40}, type, 4);
    expect_bitwise(narrow.backward(dy), wide_layer.backward(wide(dy)).to(type), "dx");
  }
}

TEST(Gpt16Bit, EmbeddingIsTheFloat32LayerRounded) {
  for (const DataType type : kNarrowTypes) {
    SCOPED_TRACE(dp::to_string(type));
    dp::Embedding narrow("embed", 11, 8, 16, type);
    dp::Embedding wide_layer("embed", 11, 8, 16);
    const std::vector<Tensor> g0 = twin_parameters(narrow, wide_layer, type);
    // Ids past 256 would not survive a 16-bit float; these repeat, so rows are summed.
    std::vector<float> id_values(3 * 6);
    for (std::size_t i = 0; i < id_values.size(); ++i)
      id_values[i] = static_cast<float>(i * 7 % 11);
    Tensor ids = Tensor::from(id_values);
    ids.reshape({3, 6});
    const Tensor y = narrow.forward(ids);
    EXPECT_EQ(y.dtype(), type);
    expect_bitwise(y, wide_layer.forward(ids).to(type), "y");
    const Tensor dy = narrow_uniform({3, 6, 16}, type, 5);
    EXPECT_TRUE(narrow.backward(dy).empty());
    (void)wide_layer.backward(wide(dy));
    expect_gradients(narrow, wide_layer, g0, type);
  }
}

// ---- Composite layers: spelled out from 16-bit sublayers and explicit roundings -----------

// The attention's core in float32 on [q | k | v] (B T, 3C) for one head of `head_dim`
// features: dp::CausalSelfAttention's loops (attention.cpp), restated.
struct CoreResult {
  std::vector<float> y;  // (B T, C)
  std::vector<float> p;  // (B, H, T, T)
};
CoreResult attention_core(const std::vector<float>& qkv, std::int64_t batch, std::int64_t time,
                          std::int64_t dim, std::int64_t heads) {
  const std::int64_t d = dim / heads;
  const std::int64_t stride = 3 * dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  CoreResult r{std::vector<float>(static_cast<std::size_t>(batch * time * dim)),
               std::vector<float>(static_cast<std::size_t>(batch * heads * time * time))};
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t h = 0; h < heads; ++h) {
      const float* q = qkv.data() + b * time * stride + h * d;
      float* p = r.p.data() + (b * heads + h) * time * time;
      dp::gemm(dp::Transpose::kNo, dp::Transpose::kYes, time, time, d, scale, q, stride, q + dim,
               stride, 0.0f, p, time);
      for (std::int64_t i = 0; i < time; ++i) {
        float* row = p + i * time;
        const float row_max = *std::max_element(row, row + i + 1);
        double sum = 0.0;
        for (std::int64_t j = 0; j <= i; ++j) {
          row[j] = std::exp(row[j] - row_max);
          sum += row[j];
        }
        const float inverse_sum = static_cast<float>(1.0 / sum);
        for (std::int64_t j = 0; j <= i; ++j) row[j] *= inverse_sum;
        std::fill(row + i + 1, row + time, 0.0f);
      }
      dp::gemm(dp::Transpose::kNo, dp::Transpose::kNo, time, d, time, 1.0f, p, time, q + 2 * dim,
               stride, 0.0f, r.y.data() + b * time * dim + h * d, dim);
    }
  }
  return r;
}

// The core's backward: d[q | k | v] (B T, 3C) from dy (B T, C), as attention.cpp.
std::vector<float> attention_core_backward(const std::vector<float>& qkv,
                                           const std::vector<float>& probabilities,
                                           const std::vector<float>& dy, std::int64_t batch,
                                           std::int64_t time, std::int64_t dim,
                                           std::int64_t heads) {
  const std::int64_t d = dim / heads;
  const std::int64_t stride = 3 * dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> dqkv(static_cast<std::size_t>(batch * time * stride), 0.0f);
  std::vector<float> ds(static_cast<std::size_t>(time * time));
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t h = 0; h < heads; ++h) {
      const std::int64_t offset = b * time * stride + h * d;
      const float* q = qkv.data() + offset;
      float* dq = dqkv.data() + offset;
      const float* dy_h = dy.data() + b * time * dim + h * d;
      const float* p = probabilities.data() + (b * heads + h) * time * time;
      dp::gemm(dp::Transpose::kNo, dp::Transpose::kYes, time, time, d, 1.0f, dy_h, dim, q + 2 * dim,
               stride, 0.0f, ds.data(), time);
      dp::gemm(dp::Transpose::kYes, dp::Transpose::kNo, time, d, time, 1.0f, p, time, dy_h, dim,
               0.0f, dq + 2 * dim, stride);
      for (std::int64_t i = 0; i < time; ++i) {
        const float* p_row = p + i * time;
        float* ds_row = ds.data() + i * time;
        double weighted = 0.0;
        for (std::int64_t j = 0; j <= i; ++j) weighted += double{ds_row[j]} * p_row[j];
        for (std::int64_t j = 0; j <= i; ++j)
          ds_row[j] = p_row[j] * (ds_row[j] - static_cast<float>(weighted));
        std::fill(ds_row + i + 1, ds_row + time, 0.0f);
      }
      dp::gemm(dp::Transpose::kNo, dp::Transpose::kNo, time, d, time, scale, ds.data(), time,
               q + dim, stride, 0.0f, dq, stride);
      dp::gemm(dp::Transpose::kYes, dp::Transpose::kNo, time, d, time, scale, ds.data(), time, q,
               stride, 0.0f, dq + dim, stride);
    }
  }
  return dqkv;
}

Tensor shaped(const std::vector<float>& values, std::vector<std::int64_t> shape) {
  Tensor tensor = Tensor::from(values);
  tensor.reshape(std::move(shape));
  return tensor;
}

TEST(Gpt16Bit, AttentionRoundsEachOperationOnce) {
  constexpr std::int64_t kBatch = 2, kTime = 5, kDim = 16, kHeads = 2;
  for (const DataType type : kNarrowTypes) {
    SCOPED_TRACE(dp::to_string(type));
    dp::CausalSelfAttention attention("attn", kDim, kHeads, 8, type);
    dp::Linear c_attn("attn.c_attn", kDim, 3 * kDim, type);
    dp::Linear c_proj("attn.c_proj", kDim, kDim, type);
    dp::CausalSelfAttention unused("attn", kDim, kHeads, 8);
    (void)twin_parameters(attention, unused, type);
    copy_parameters(attention.parameters(),
                    {&c_attn.weight(), &c_attn.bias(), &c_proj.weight(), &c_proj.bias()});
    const Tensor x = narrow_uniform({kBatch, kTime, kDim}, type, 6, 2.0f);
    const Tensor y = attention.forward(x);
    // qkv rounded by c_attn, the core in float32 on it, its y rounded, c_proj.
    Tensor rows = x.clone(dp::MemoryCategory::kOther);
    rows.reshape({kBatch * kTime, kDim});
    const Tensor qkv = c_attn.forward(rows);
    const CoreResult core = attention_core(floats(qkv), kBatch, kTime, kDim, kHeads);
    Tensor expected = c_proj.forward(shaped(core.y, {kBatch * kTime, kDim}).to(type));
    expected.reshape({kBatch, kTime, kDim});
    expect_bitwise(y, expected, "y");

    const Tensor dy = narrow_uniform({kBatch, kTime, kDim}, type, 7);
    const Tensor dx = attention.backward(dy);
    Tensor dy_rows = dy.clone(dp::MemoryCategory::kOther);
    dy_rows.reshape({kBatch * kTime, kDim});
    const Tensor grad_heads = c_proj.backward(dy_rows);
    const std::vector<float> dqkv = attention_core_backward(floats(qkv), core.p, floats(grad_heads),
                                                            kBatch, kTime, kDim, kHeads);
    Tensor expected_dx = c_attn.backward(shaped(dqkv, {kBatch * kTime, 3 * kDim}).to(type));
    expected_dx.reshape({kBatch, kTime, kDim});
    expect_bitwise(dx, expected_dx, "dx");
    expect_same_gradients(attention,
                          {&c_attn.weight(), &c_attn.bias(), &c_proj.weight(), &c_proj.bias()});
  }
}

// round(widen(y) + widen(x)) elementwise: a 16-bit residual sum.
Tensor rounded_sum(const Tensor& y, const Tensor& x, DataType type) {
  std::vector<float> sum = floats(y);
  const std::vector<float> add = floats(x);
  for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += add[i];
  return shaped(sum, y.shape()).to(type);
}

TEST(Gpt16Bit, TransformerBlockRoundsEachSublayerAndResidualSum) {
  constexpr std::int64_t kBatch = 2, kTime = 4, kDim = 16, kHeads = 2, kContext = 8;
  for (const DataType type : kNarrowTypes) {
    SCOPED_TRACE(dp::to_string(type));
    dp::TransformerBlock block("h.0", kDim, kHeads, kContext, 2, type);
    dp::TransformerBlock unused("h.0", kDim, kHeads, kContext, 2);
    (void)twin_parameters(block, unused, type);
    // The same block from separate 16-bit sublayers.
    dp::LayerNorm ln_1("h.0.ln_1", kDim, dp::kLayerNormEps, type);
    dp::CausalSelfAttention attention("h.0.attn", kDim, kHeads, kContext, type);
    dp::LayerNorm ln_2("h.0.ln_2", kDim, dp::kLayerNormEps, type);
    dp::Linear fc("h.0.mlp.c_fc", kDim, 4 * kDim, type);
    dp::GELU gelu("h.0.mlp.gelu", 4 * kDim);
    dp::Linear proj("h.0.mlp.c_proj", 4 * kDim, kDim, type);
    std::vector<dp::Parameter*> parts = {&ln_1.weight(), &ln_1.bias()};
    for (dp::Parameter* parameter : attention.parameters()) parts.push_back(parameter);
    for (dp::Parameter* parameter :
         {&ln_2.weight(), &ln_2.bias(), &fc.weight(), &fc.bias(), &proj.weight(), &proj.bias()})
      parts.push_back(parameter);
    copy_parameters(block.parameters(), parts);

    const Tensor x = narrow_uniform({kBatch, kTime, kDim}, type, 8, 2.0f);
    const Tensor y = block.forward(x);
    Tensor r = x.clone(dp::MemoryCategory::kOther);
    r.reshape({kBatch * kTime, kDim});
    r = rounded_sum(r, attention.forward_rows(ln_1.forward(r), kTime), type);
    r = rounded_sum(r, proj.forward(gelu.forward(fc.forward(ln_2.forward(r)))), type);
    r.reshape({kBatch, kTime, kDim});
    expect_bitwise(y, r, "y");

    const Tensor dy = narrow_uniform({kBatch, kTime, kDim}, type, 9);
    const Tensor dx = block.backward(dy);
    Tensor g = dy.clone(dp::MemoryCategory::kOther);
    g.reshape({kBatch * kTime, kDim});
    g = rounded_sum(g, ln_2.backward(fc.backward(gelu.backward(proj.backward(g)))), type);
    g = rounded_sum(g, ln_1.backward(attention.backward_rows(g)), type);
    g.reshape({kBatch, kTime, kDim});
    expect_bitwise(dx, g, "dx");
    expect_same_gradients(block, parts);
  }
}

TEST(Gpt16Bit, LanguageModelHeadRoundsLayerNormAndProjection) {
  constexpr std::int64_t kBatch = 2, kTime = 3, kDim = 16, kVocab = 13;
  for (const DataType type : kNarrowTypes) {
    SCOPED_TRACE(dp::to_string(type));
    dp::LanguageModelHead head("head", kDim, kVocab, 8, type);
    dp::LanguageModelHead unused("head", kDim, kVocab, 8);
    const std::vector<Tensor> g0 = twin_parameters(head, unused, type);
    dp::LayerNorm ln_f("ln_f", kDim, dp::kLayerNormEps, type);
    copy_parameters({head.parameters()[0], head.parameters()[1]}, {&ln_f.weight(), &ln_f.bias()});
    const Tensor w = wide(head.parameters()[2]->value);

    const Tensor x = narrow_uniform({kBatch, kTime, kDim}, type, 10, 2.0f);
    const Tensor logits = head.forward(x);
    Tensor rows = x.clone(dp::MemoryCategory::kOther);
    rows.reshape({kBatch * kTime, kDim});
    const Tensor h = ln_f.forward(rows);
    expect_bitwise(logits, dp::matmul(wide(h), dp::Transpose::kNo, w, dp::Transpose::kYes).to(type),
                   "logits");

    const Tensor dlogits = narrow_uniform({kBatch * kTime, kVocab}, type, 11, 0.1f);
    const Tensor dx = head.backward(dlogits);
    const Tensor dw = dp::matmul(wide(dlogits), dp::Transpose::kYes, wide(h), dp::Transpose::kNo);
    expect_bitwise(head.parameters()[2]->grad, accumulated(g0[2], dw, type), "lm_head.weight.grad");
    Tensor expected_dx = ln_f.backward(
        dp::matmul(wide(dlogits), dp::Transpose::kNo, w, dp::Transpose::kNo).to(type));
    expected_dx.reshape({kBatch, kTime, kDim});
    expect_bitwise(dx, expected_dx, "dx");
    expect_bitwise(head.parameters()[0]->grad, ln_f.weight().grad, "ln_f.weight.grad");
    expect_bitwise(head.parameters()[1]->grad, ln_f.bias().grad, "ln_f.bias.grad");
  }
}

// ---- The model -----------------------------------------------------------------------------

TEST(Gpt16Bit, StartsAsItsFloat32TwinRounded) {
  const dp::GptSpec spec{.layers = 2, .dim = 16, .heads = 2, .context = 8};
  const dp::Model twin = dp::Model::gpt(spec, 29, {.seed = 4});
  const std::vector<float> wide_values = twin.flat_parameters();
  for (const DataType type : kNarrowTypes) {
    SCOPED_TRACE(dp::to_string(type));
    dp::Model model = dp::Model::gpt(spec, 29, {.seed = 4, .dtype = type});
    EXPECT_EQ(model.dtype(), type);
    for (const dp::Parameter* parameter : model.parameters())
      EXPECT_EQ(parameter->value.dtype(), type) << parameter->name;
    const std::vector<float> values = model.flat_parameters();
    ASSERT_EQ(values.size(), wide_values.size());
    std::size_t changed = 0;
    for (std::size_t i = 0; i < values.size(); ++i) {
      const float expected = type == DataType::kBFloat16
                                 ? dp::to_float(dp::to_bfloat16(wide_values[i]))
                                 : dp::to_float(dp::to_float16(wide_values[i]));
      ASSERT_EQ(values[i], expected) << "element " << i;
      if (values[i] != wide_values[i]) ++changed;
    }
    EXPECT_GT(changed, values.size() / 2);  // the draws were rounded, not drawn in 16 bits
    // Token ids stay float32 (ids above 256 would not survive bfloat16); the logits and the
    // gradients are 16-bit and finite.
    std::vector<float> id_values(2 * 8);
    for (std::size_t i = 0; i < id_values.size(); ++i) id_values[i] = static_cast<float>(28 - i);
    const Tensor ids = shaped(id_values, {2, 8});
    const Tensor logits = model.forward(ids);
    EXPECT_EQ(logits.dtype(), type);
    std::vector<int> labels(16);
    for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<int>(i);
    EXPECT_TRUE(std::isfinite(model.backward(logits, labels)));
    EXPECT_EQ(model.parameter("wte.weight").grad.dtype(), type);
  }
}

}  // namespace
