// attention.h: causal multi-head self-attention, as in GPT-2 (Vaswani et al., 2017;
// Radford et al., 2019).
//
// For x (B, T, C), H heads of d = C / H features each:
//
//   [q | k | v] = x W_attn^T + b_attn           c_attn: (B, T, 3C), head h at [h d, (h+1) d)
//   S = q_h k_h^T / sqrt(d)                      (B, H, T, T)
//   P = softmax over each row of S, keeping only j <= i (the causal mask: a token sees
//       itself and the tokens before it, never one after)
//   y_h = P v_h                                  (B, T, C), the heads side by side
//   out = y W_proj^T + b_proj                    c_proj: (B, T, C)
//
// Backward, per sequence and head, with dY_h the gradient of y_h:
//
//   dP = dY_h v_h^T,  dv_h = P^T dY_h
//   dS = P * (dP - rowsum(dP * P)) / sqrt(d)    (0 where the mask is: P is 0 there)
//   dq_h = dS k_h,  dk_h = dS^T q_h
//
// The softmax subtracts each row's maximum (over j <= i) before exp(), so large scores do not
// overflow, and sums in double. Every matrix product goes through dp/ops.h (the projections
// in dp::Linear); the products with S compute all T x T scores and mask afterwards, so the
// cost counts the full square.
//
// Parameters, named "<name>.c_attn.weight" (3C, C), "<name>.c_attn.bias" (3C),
// "<name>.c_proj.weight" (C, C), "<name>.c_proj.bias" (C): torch.nn.Linear's layout (out,
// in), as nanoGPT stores them (Hugging Face's GPT-2 stores its Conv1D weights transposed).
// Saved for backward: the input of each projection (in dp::Linear), [q | k | v] and P.
//
// It runs where its tensors live: on a CUDA device the per-head products go through cuBLAS
// and the masked softmax and its backward through kernels of cuda/layer_kernels.cu (one block
// per row, the sums in double as a tree), within a few float ulps of the host loops;
// tests/gpu compares the layer with the host.
//
// Example:
//
//   dp::CausalSelfAttention attn("attn", /*dim=*/128, /*heads=*/4, /*context=*/64);
//   dp::Tensor y = attn.forward(x);       // x: (B, T, 128), T <= 64 -> y: (B, T, 128)
//   dp::Tensor dx = attn.backward(dy);    // dy: (B, T, 128) -> dx: (B, T, 128)
//
// Precision: the parameters, the input, the output and the gradients are of the type given
// at construction, float32 by default or bfloat16 / float16 (mixed-precision training). The
// 16-bit rule, as dp::Linear's, for each of its three operations: the two projections are
// 16-bit dp::Linear layers (operands widened, float32 products, results rounded once), and
// the core between them (the scores, the masked softmax and P v) widens [q | k | v] (and in
// backward dy) to float32 exactly, runs the float32 arithmetic above and rounds its result
// once: y = round(core(widen(qkv))) and d[q | k | v] = round(core'(...)). [q | k | v] is
// saved in 16 bits, P in float32 (4 bytes, charged as activations), so backward is the float32
// core's on the same values. It runs on the host and the emulated device only (a 16-bit
// attention on a GPU throws).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dp/layer.h"
#include "dp/layers/linear.h"

namespace dp {

/// Multi-head self-attention under a causal mask, with a fused QKV projection and an
/// output projection, both with bias.
class CausalSelfAttention final : public Layer {
 public:
  /// A layer `name` over `dim` features split into `heads` heads, for sequences of at most
  /// `context` tokens (the length its costs assume); parameters zero-filled. Throws
  /// `dp::Error` unless all three are positive and `heads` divides `dim`, and `dtype` is a
  /// tensor type (see the top of this file).
  CausalSelfAttention(std::string name, std::int64_t dim, std::int64_t heads, std::int64_t context,
                      DataType dtype = DataType::kFloat32);

  /// "attention".
  std::string kind() const override { return "attention"; }
  /// input: (B, T, dim) with 1 <= T <= context -> (B, T, dim). Throws `dp::Error` naming
  /// the layer on another shape.
  Tensor forward(const Tensor& input) override;
  /// grad_output: (B, T, dim) -> (B, T, dim); adds into the projections' gradients.
  Tensor backward(const Tensor& grad_output) override;
  /// Drops what the last forward saved (see `Layer::discard_saved`).
  void discard_saved() override;
  /// The same on the rows of B sequences of `time` tokens, (B time, dim) -> (B time, dim),
  /// without the copy that reshaping a caller's tensor takes (what TransformerBlock calls).
  Tensor forward_rows(const Tensor& rows, std::int64_t time);
  /// The backward of `forward_rows`: (B time, dim) -> (B time, dim).
  Tensor backward_rows(const Tensor& grad_rows);
  /// {c_attn.weight, c_attn.bias, c_proj.weight, c_proj.bias}.
  std::vector<Parameter*> parameters() override;
  /// GPT-2's initialisation: weights normal with mean 0 and standard deviation 0.02, biases 0
  /// (TransformerBlock scales c_proj's further, by its depth).
  void initialize(Parameter& parameter, CounterRng& rng) override;
  /// `batch` sequences of `context` tokens: the two projections, the two (T, T, d)
  /// products per head and the softmax.
  OpCost forward_cost(std::int64_t batch) const override;
  /// `batch` sequences of `context` tokens: the projections' backward, four (T, T, d)
  /// products per head and the softmax's backward.
  OpCost backward_cost(std::int64_t batch) const override;

  /// Number of features (C).
  std::int64_t dim() const { return dim_; }
  /// Number of heads (H).
  std::int64_t heads() const { return heads_; }
  /// The longest sequence, the length the costs assume.
  std::int64_t context() const { return context_; }
  /// The fused QKV projection c_attn, dim -> 3 dim.
  Linear& qkv_projection() { return qkv_projection_; }
  /// The output projection c_proj, dim -> dim.
  Linear& output_projection() { return output_projection_; }

 private:
  // Flops and bytes of the attention proper (scores, softmax, weighted sum) on `batch`
  // sequences of `context_` tokens, forward or backward.
  OpCost core_cost(std::int64_t batch, bool backward) const;

  std::int64_t dim_;
  std::int64_t heads_;
  std::int64_t context_;
  Linear qkv_projection_;     // c_attn
  Linear output_projection_;  // c_proj
  std::int64_t saved_time_ = 0;
  Tensor saved_qkv_;            // (B T, 3C), [q | k | v] of the last forward
  Tensor saved_probabilities_;  // (B, H, T, T), P of the last forward (0 above the diagonal)
};

}  // namespace dp
