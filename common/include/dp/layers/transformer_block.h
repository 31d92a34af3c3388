// transformer_block.h: a pre-LayerNorm transformer block, as in GPT-2, as one layer.
//
// For x (B, T, C):
//
//   x = x + attn(ln_1(x))                        causal self-attention (dp/layers/attention.h)
//   x = x + mlp(ln_2(x)),  mlp(h) = c_proj(gelu(c_fc(h)))      C -> 4C -> C, tanh GELU
//
// Backward runs the same in reverse: the gradient of each residual sum reaches both the
// branch and the skip connection, so dx = g + ln_1'(attn'(g)) with g = dy + ln_2'(mlp'(dy)).
// It is made of dp::LayerNorm, dp::CausalSelfAttention, dp::Linear and dp::GELU, which save
// what their backward needs (each LayerNorm's xhat, each Linear's input, the attention's
// [q | k | v] and P, the GELU's input), all charged to `MemoryCategory::kActivations`.
//
// A block is one Layer so that a model's hooks see it whole: ZeRO-3 gathers a block's
// parameters before its forward and frees them after, as FSDP wraps one block per unit.
//
// Activation checkpointing (`set_activation_checkpointing`, `dplab train
// --activation-checkpointing`) trades compute for memory: forward keeps only a copy of the
// block's input, (B, T, C), and drops what the sublayers saved; backward first runs the
// forward again from that copy, then the ordinary backward. The second forward does the same
// arithmetic on the same values, so the gradients are bitwise those of a block that kept
// everything; what it costs is one more forward per block in each backward
// (`backward_cost` counts it, so the simulated clock charges it).
//
// Its parameters, in this order, for a block named "h.N" (the name a model gives block N),
// named as GPT-2 names them, torch.nn.Linear's layout (out, in) as nanoGPT stores them:
//
//   h.N.ln_1.weight        (C)        h.N.ln_1.bias         (C)
//   h.N.attn.c_attn.weight (3C, C)    h.N.attn.c_attn.bias  (3C)
//   h.N.attn.c_proj.weight (C, C)     h.N.attn.c_proj.bias  (C)
//   h.N.ln_2.weight        (C)        h.N.ln_2.bias         (C)
//   h.N.mlp.c_fc.weight    (4C, C)    h.N.mlp.c_fc.bias     (4C)
//   h.N.mlp.c_proj.weight  (C, 4C)    h.N.mlp.c_proj.bias   (C)
//
// Initialisation as GPT-2: LayerNorm weight 1 and bias 0; linear biases 0; linear weights
// normal with standard deviation 0.02, the two that end a residual branch (attn.c_proj and
// mlp.c_proj) with 0.02 / sqrt(2 layers), so that the residual stream's variance does not
// grow with depth.
//
// It runs where its tensors live, as its sublayers do (the residual sums with cuda::add on a
// GPU).
//
// Precision: the parameters, the input, the output and the gradients are of the type given
// at construction, float32 by default or bfloat16 / float16 (mixed-precision training). The
// 16-bit rule, as dp::Linear's, for each operation: every sublayer is 16-bit and follows it
// (operands widened to float32 exactly, float32 arithmetic, each result rounded once to
// nearest even), and so does each residual sum, x = round(widen(x) + widen(branch)), in
// forward and in backward. The 16-bit draws are the float32 draws rounded. It runs on the
// host and the emulated device only (a 16-bit block on a GPU throws).
//
// Example:
//
//   dp::TransformerBlock block("h.0", /*dim=*/128, /*heads=*/4, /*context=*/64, /*layers=*/4);
//   dp::Tensor y = block.forward(x);      // x: (B, T, 128), T <= 64 -> y: (B, T, 128)
//   dp::Tensor dx = block.backward(dy);   // dy: (B, T, 128) -> dx: (B, T, 128)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dp/layer.h"
#include "dp/layers/attention.h"
#include "dp/layers/gelu.h"
#include "dp/layers/layer_norm.h"
#include "dp/layers/linear.h"

namespace dp {

/// x + attn(ln_1(x)), then x + mlp(ln_2(x)): one pre-LayerNorm GPT block.
class TransformerBlock final : public Layer {
 public:
  /// A block `name` (a model names block N "h.N") over `dim` features in `heads` heads, for
  /// sequences of at most `context` tokens, in a model of `layers` blocks (which scales the
  /// initialisation of the branches' output projections); parameters zero-filled. Throws
  /// `dp::Error` unless all are positive and `heads` divides `dim`, and `dtype` is a tensor
  /// type (see above).
  TransformerBlock(std::string name, std::int64_t dim, std::int64_t heads, std::int64_t context,
                   std::int64_t layers, DataType dtype = DataType::kFloat32);

  /// "transformer_block".
  std::string kind() const override { return "transformer_block"; }
  /// input: (B, T, dim) with 1 <= T <= context -> (B, T, dim). Throws `dp::Error` naming
  /// the block on another shape.
  Tensor forward(const Tensor& input) override;
  /// grad_output: (B, T, dim) -> (B, T, dim); adds into every parameter's gradient. With
  /// activation checkpointing it runs the forward again first.
  Tensor backward(const Tensor& grad_output) override;
  /// Drops what the last forward saved, the sublayers' state and the input copy (see
  /// `Layer::discard_saved`).
  void discard_saved() override;
  /// Keeps only the input in forward and recomputes the rest in backward (on), or keeps what
  /// every sublayer saves (off, the default). Takes effect at the next forward.
  void set_activation_checkpointing(bool on) { activation_checkpointing_ = on; }
  /// Whether forward keeps only its input (see `set_activation_checkpointing`).
  bool activation_checkpointing() const { return activation_checkpointing_; }
  /// The twelve parameters in the order of the table above.
  std::vector<Parameter*> parameters() override;
  /// GPT-2's initialisation (see above); `rng` is the parameter's own stream.
  void initialize(Parameter& parameter, CounterRng& rng) override;
  /// `batch` sequences of `context` tokens: the sublayers' costs and the two residual sums.
  OpCost forward_cost(std::int64_t batch) const override;
  /// `batch` sequences of `context` tokens: the sublayers' costs and the two gradient sums,
  /// plus `forward_cost(batch)` with activation checkpointing (the forward run again).
  OpCost backward_cost(std::int64_t batch) const override;

  /// Number of features (C).
  std::int64_t dim() const { return dim_; }
  /// The longest sequence, the length the costs assume.
  std::int64_t context() const { return context_; }
  /// Number of blocks of the model it was built for.
  std::int64_t layers() const { return layers_; }
  /// ln_1, before the attention.
  LayerNorm& ln_1() { return ln_1_; }
  /// The causal self-attention.
  CausalSelfAttention& attention() { return attention_; }
  /// ln_2, before the MLP.
  LayerNorm& ln_2() { return ln_2_; }
  /// The MLP's first projection c_fc, dim -> 4 dim.
  Linear& mlp_fc() { return mlp_fc_; }
  /// The MLP's second projection c_proj, 4 dim -> dim.
  Linear& mlp_proj() { return mlp_proj_; }

 private:
  // The forward's arithmetic, input (B, T, C) already checked: saves what every sublayer's
  // backward needs and returns the output (B, T, C).
  Tensor forward_saving_everything(const Tensor& input);
  // Drops what ln_1, the attention, ln_2 and the MLP saved.
  void discard_saved_by_sublayers();

  std::int64_t dim_;
  std::int64_t context_;
  std::int64_t layers_;
  LayerNorm ln_1_;
  CausalSelfAttention attention_;
  LayerNorm ln_2_;
  Linear mlp_fc_;
  GELU mlp_gelu_;
  Linear mlp_proj_;
  std::int64_t saved_batch_ = 0;  // B of the last forward (0: none to run backward on)
  std::int64_t saved_time_ = 0;   // T of the last forward
  bool activation_checkpointing_ = false;
  Tensor saved_input_;  // (B, T, C): with activation checkpointing, the last forward's input
};

}  // namespace dp
