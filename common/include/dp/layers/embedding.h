// embedding.h: a GPT's input layer, token embedding plus learned position embedding.
//
// For token ids x (B, T) and position t of each sequence:
//
//   y[b, t, :] = wte[x[b, t], :] + wpe[t, :]            (B, T, C)
//   dwte[v, :] += sum over (b, t) with x[b, t] = v of dy[b, t, :]
//   dwpe[t, :] += sum over b of dy[b, t, :]
//
// How the ids arrive: the runtime's tensors are float32, so the ids are stored as floats
// (B, T). A float holds every integer below 2^24 exactly, far beyond any vocabulary here;
// forward checks that each id is an integer in [0, V) and names the first one that is not
// (its position and value), so a label, a byte or a rounded value is refused rather than
// truncated. The ids have no gradient: backward returns an empty tensor, which is why this
// layer comes first in a model.
//
// The parameters are named as GPT-2 names them, "wte.weight" (V, C) and "wpe.weight"
// (context, C), whatever the layer's name, so that a checkpoint reads in other tools (the
// layout of torch.nn.Embedding: one row per token, one per position).
//
// It runs where its tensors live. On a CUDA device the ids are copied to the host to be
// checked (B T floats); kernels gather the rows, and add the gradients with each token's
// positions in the host loop's order (grouped on the host), bitwise the host.
//
// Example:
//
//   dp::Embedding embed("embed", /*vocab=*/65, /*context=*/64, /*dim=*/128);
//   dp::Tensor h = embed.forward(ids);       // ids: (B, T) floats, T <= 64 -> h: (B, T, 128)
//   embed.backward(dh);                       // dh: (B, T, 128); wte.weight.grad += ...
//
// Precision: the tables, the output and its gradient are of the type given at construction,
// float32 by default or bfloat16 / float16 (mixed-precision training); the ids stay float32
// whatever the type (a 16-bit float holds integers exactly only up to 256 or 2048). The
// 16-bit rule, as dp::Linear's: the table rows (and in backward dy) are widened to float32
// exactly, the float32 arithmetic above runs on them, and each result is rounded once to
// nearest even: y = round(wte[x] + wpe[t]), and each table's gradient is added as
// grad = round(widen(grad) + this batch's float32 sums). The widened tables are float32
// temporaries charged as activations while a call runs. It runs on the host and the emulated
// device only (16-bit tables on a GPU throw).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dp/layer.h"

namespace dp {

/// y[b, t] = wte[x[b, t]] + wpe[t]: token and position embeddings of (B, T) token ids.
class Embedding final : public Layer {
 public:
  /// A layer `name` over a vocabulary of `vocab` tokens and sequences of at most `context`
  /// tokens, embedding each in `dim` features; parameters zero-filled (`initialize` draws
  /// them). Throws `dp::Error` unless all three are positive and `vocab` is at most 2^24
  /// (every id a float can hold exactly), and `dtype` a tensor type (see the top of this
  /// file).
  Embedding(std::string name, std::int64_t vocab, std::int64_t context, std::int64_t dim,
            DataType dtype = DataType::kFloat32);

  /// "embedding".
  std::string kind() const override { return "embedding"; }
  /// ids: (B, T) floats holding integers in [0, vocab), 1 <= T <= context -> (B, T, dim).
  /// Keeps a copy of the ids for backward. Throws `dp::Error` naming the layer on another
  /// shape, naming the first bad id (position and value) on one that is not such an
  /// integer.
  Tensor forward(const Tensor& input) override;
  /// grad_output: (B, T, dim) -> an empty tensor (ids have no gradient); adds into the
  /// gradients of wte and wpe.
  Tensor backward(const Tensor& grad_output) override;
  /// Drops what the last forward saved (see `Layer::discard_saved`).
  void discard_saved() override;
  /// {wte.weight, wpe.weight}.
  std::vector<Parameter*> parameters() override { return {&token_weight_, &position_weight_}; }
  /// Normal with mean 0 and standard deviation 0.02 for both, as GPT-2.
  void initialize(Parameter& parameter, CounterRng& rng) override;
  /// `batch` sequences of `context` tokens: two reads and an addition per output element.
  OpCost forward_cost(std::int64_t batch) const override;
  /// `batch` sequences of `context` tokens: one addition per element into each gradient.
  OpCost backward_cost(std::int64_t batch) const override;

  /// Number of tokens in the vocabulary (V).
  std::int64_t vocab() const { return vocab_; }
  /// The longest sequence (the number of positions of wpe).
  std::int64_t context() const { return context_; }
  /// Number of features per token (C).
  std::int64_t dim() const { return dim_; }
  /// The token embedding wte, (vocab, dim).
  Parameter& token_weight() { return token_weight_; }
  /// The position embedding wpe, (context, dim).
  Parameter& position_weight() { return position_weight_; }

 private:
  std::int64_t vocab_;
  std::int64_t context_;
  std::int64_t dim_;
  Parameter token_weight_;
  Parameter position_weight_;
  Tensor saved_ids_;  // (B, T), the ids of the last forward
};

}  // namespace dp
