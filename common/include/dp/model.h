// model.h: an ordered list of layers with explicit forward and backward, and hooks.
//
// A `Model` owns its layers and knows their parameters in definition order. `forward`
// runs the layers in order; `backward` computes the softmax cross-entropy of the logits
// and runs the layers in reverse. Hooks let a data-parallel strategy act at the right
// moment without touching the layers:
//
//   on_pre_forward / on_post_forward     around each layer's forward (ZeRO-3 gathers and
//                                        frees a layer's parameters here)
//   on_pre_backward / on_post_backward   around each layer's backward, in reverse order
//   on_gradient_ready                    once per non-frozen parameter, as soon as its
//                                        gradient is final for this backward, in reverse
//                                        definition order (bucketed all-reduce, lab 4)
//
// For each layer, backward fires: pre-backward, the layer's backward, gradient-ready for
// its parameters (bias before weight), post-backward.
//
// Two families are built from a spec: `Model::mlp` ("64-256-256-10", rows of features in,
// a row of logits per example out) and `Model::gpt` ("gpt:layers=4,dim=128,heads=4,
// context=64", token ids (B, T) in, a row of logits per token out, the GPT-2 layers of
// dp/layers/: embedding, transformer blocks, head).
//
// Parameters also live in one flat index space: parameter i covers elements
// [offset, offset + size) in definition order, frozen parameters included. Optimizers and
// ZeRO shards address parameters by these offsets.
//
// A model lives where its parameters live: `Model::to(Device::kCuda)` (or
// `MlpOptions::device`) moves every value and gradient to the GPU, and then forward and
// backward run there on inputs that live there too; the loss comes back to the host as a
// float, and the hooks fire as on the host. A layer given tensors on two devices throws
// `dp::Error` naming itself.
//
// Example:
//
//   dp::Model model = dp::Model::mlp("64-256-256-10", {.seed = 42});
//   model.on_gradient_ready([](dp::Parameter& p) { fmt::print("{} ready\n", p.name); });
//   dp::Tensor logits = model.forward(x);             // x: (B, 64) -> logits: (B, 10)
//   float loss = model.backward(logits, labels);      // fc3.bias ready, fc3.weight ready, ...
//   optimizer.step(model);
//   model.zero_grad();
//
//   dp::Model on_gpu = dp::Model::mlp("64-256-256-10", {.seed = 42, .device = dp::Device::kCuda});
//   float gpu_loss = on_gpu.backward(on_gpu.forward(x.to(dp::Device::kCuda)), labels);
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dp/layer.h"
#include "dp/layers/attention.h"
#include "dp/layers/cross_entropy.h"
#include "dp/layers/embedding.h"
#include "dp/layers/gelu.h"
#include "dp/layers/layer_norm.h"
#include "dp/layers/linear.h"
#include "dp/layers/lm_head.h"
#include "dp/layers/relu.h"
#include "dp/layers/transformer_block.h"
#include "dp/tensor.h"

namespace dp {

/// How `Model::mlp` builds its layers.
struct MlpOptions {
  std::string activation = "relu";  ///< "relu" or "gelu", after every hidden Linear
  bool layer_norm = false;          ///< a LayerNorm lnK before the K-th activation
  std::uint64_t seed = 0;           ///< seed of `init_parameters`
  Device device = Device::kHost;    ///< where the parameters live (drawn on the host, moved)
  /// The element type of the parameters, activations and gradients: float32, or bfloat16 or
  /// float16 for mixed-precision training (each Linear computes in float32 and rounds, see
  /// dp/layers/linear.h, as LayerNorm, ReLU and GELU do; the data is rounded to it as it
  /// enters).
  DataType dtype = DataType::kFloat32;
};

/// Parses an MLP spec such as "64-256-256-10" into its widths {64, 256, 256, 10}.
/// Throws `dp::Error` quoting the spec unless it is two or more positive integers joined
/// by '-'.
std::vector<std::int64_t> parse_mlp_spec(std::string_view spec);

/// The sizes of a GPT (`Model::gpt`); the defaults are dplab's default GPT.
struct GptSpec {
  std::int64_t layers = 4;    ///< transformer blocks
  std::int64_t dim = 128;     ///< features per token (C)
  std::int64_t heads = 4;     ///< attention heads, dividing dim
  std::int64_t context = 64;  ///< the longest sequence (T)
};

/// True when `spec` names a GPT: "gpt" or "gpt:..." (anything else is an MLP spec).
bool is_gpt_spec(std::string_view spec);

/// Parses a GPT spec "gpt:layers=4,dim=128,heads=4,context=64": each key at most once, in
/// any order, a missing one at its `GptSpec` default ("gpt" alone is the default GPT). The
/// vocabulary is not part of it: it comes from the data. Throws `dp::Error` quoting the
/// spec on a missing "gpt" prefix, an unknown or repeated key, a value that is not a
/// positive integer, heads that do not divide dim, or parameters past 2^60 elements.
GptSpec parse_gpt_spec(std::string_view spec);

/// How `Model::gpt` builds its layers.
struct GptOptions {
  std::uint64_t seed = 0;         ///< seed of `init_parameters`
  Device device = Device::kHost;  ///< where the parameters live (drawn on the host, moved)
  /// Every block keeps only its input in forward and recomputes the rest in backward
  /// (`TransformerBlock::set_activation_checkpointing`): the same gradients, bit for bit.
  bool activation_checkpointing = false;
  /// The element type of the parameters, activations and gradients: float32, or bfloat16 or
  /// float16 for mixed-precision training (each layer widens its operands to float32, computes
  /// and rounds each result once: the top of each dp/layers/ header). The token ids stay
  /// float32. The 16-bit draws are the float32 draws rounded.
  DataType dtype = DataType::kFloat32;
};

/// An ordered list of layers ending in softmax cross-entropy; move-only.
class Model {
 public:
  /// Called with a parameter whose gradient is final for the current backward.
  using GradientHook = std::function<void(Parameter&)>;
  /// Called with a layer before or after its forward or backward.
  using LayerHook = std::function<void(Layer&)>;

  /// A model with no layers.
  Model();
  /// Takes over `other`'s layers, parameters and hooks.
  Model(Model&& other) noexcept;
  /// Takes over `other`'s layers, parameters and hooks.
  Model& operator=(Model&& other) noexcept;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;
  ~Model();

  /// Builds an MLP from a spec "64-256-256-10": Linear fc1 (64 -> 256), activation, Linear
  /// fc2 (256 -> 256), activation, Linear fc3 (256 -> 10); with `layer_norm` a LayerNorm
  /// lnK comes before the K-th activation. Activations are named "reluK" or "geluK".
  /// Parameters are drawn by `init_parameters(options.seed)` on the host, then moved to
  /// `options.device`, so a model has the same values on every device. Throws `dp::Error`
  /// on a bad spec (quoting it and saying what is expected) or an unknown activation.
  static Model mlp(std::string_view spec, const MlpOptions& options = {});

  /// Builds a GPT-2-style language model over `vocab` tokens (Radford et al., 2019):
  ///
  ///   layer "embed"  dp::Embedding         ids (B, T) -> (B, T, C)   wte.weight (V, C),
  ///                                                                  wpe.weight (context, C)
  ///   layer "h.N"    dp::TransformerBlock  (B, T, C) -> (B, T, C)    h.N.ln_1.weight, ...
  ///                  for N = 0 .. layers - 1 (dp/layers/transformer_block.h lists the 12)
  ///   layer "head"   dp::LanguageModelHead (B, T, C) -> (B T, V)     ln_f.weight (C),
  ///                                                                  ln_f.bias (C),
  ///                                                                  lm_head.weight (V, C)
  ///
  /// Parameters in that order, named as GPT-2 names them (torch.nn.Linear's layout for the
  /// projections, as nanoGPT), drawn as GPT-2 draws them by `init_parameters(options.seed)`
  /// on the host, then moved to `options.device`. `forward` takes token ids stored as floats
  /// (B, T), T <= context, and returns one row of logits per token; `backward` takes the
  /// B T next-token labels (row b T + t: the token after position t of sequence b), so the
  /// loss is the mean cross-entropy over every predicted token. Costs count batches of
  /// sequences of `context` tokens.
  /// Throws `dp::Error` unless `vocab` is positive and at most 2^24, and on a `spec` that
  /// `parse_gpt_spec` would refuse.
  static Model gpt(const GptSpec& spec, std::int64_t vocab, const GptOptions& options = {});

  /// Appends `layer` and registers its parameters after those already present. Throws
  /// `dp::Error` on a null layer or a layer or parameter name already in use.
  void add(std::unique_ptr<Layer> layer);

  /// The parameters in definition order.
  std::span<Parameter* const> parameters() { return parameters_; }
  /// The parameters in definition order (read-only).
  std::span<const Parameter* const> parameters() const { return const_parameters_; }
  /// The parameter called `name`, e.g. "fc1.weight"; throws `dp::Error` listing the valid
  /// names if there is none.
  Parameter& parameter(std::string_view name);
  /// The parameter called `name` (read-only); throws like the non-const overload.
  const Parameter& parameter(std::string_view name) const;
  /// The layers in order.
  std::span<Layer* const> layers() { return layers_; }
  /// How many parameters each layer holds, in layer order: the layers own the parameters in
  /// definition order, so layer l's are the next `counts[l]` of `parameters()`.
  std::vector<std::size_t> parameter_counts_per_layer() const;

  /// Total elements of all parameters, frozen included: the size of the flat index space.
  std::size_t num_parameters() const { return num_parameters_; }
  /// Elements of the parameters that are not frozen.
  std::size_t num_trainable_parameters() const;

  /// Draws every parameter deterministically: parameter i from `CounterRng(seed, i)`.
  /// Linear weights and biases are uniform in (-1/sqrt(fan_in), 1/sqrt(fan_in)) (PyTorch's
  /// default), LayerNorm weight 1 and bias 0. The same seed gives bitwise identical values
  /// on every rank.
  void init_parameters(std::uint64_t seed);
  /// Moves every parameter's value and gradient to `device` (a copy each; a gradient a hook
  /// released stays released). Forward then expects its input on `device`. Throws
  /// `dp::Error` for `Device::kCuda` in a build without CUDA or without a GPU.
  void to(Device device);
  /// Where the parameters live: the device of the first one (the host for a model without
  /// parameters). Layers check that the rest agree when they run.
  Device device() const;
  /// The element type of the parameters: the first one's (float32 for a model without
  /// parameters); float32 unless built 16-bit (`MlpOptions::dtype`).
  DataType dtype() const;

  /// Freezes a parameter: no gradient, no gradient-ready hook, no optimizer update.
  /// Throws `dp::Error` if there is no such parameter.
  void freeze(std::string_view parameter_name);
  /// Makes a frozen parameter trainable again.
  void unfreeze(std::string_view parameter_name);

  /// Runs every layer in order, firing pre- and post-forward hooks around each; returns
  /// the logits (B, classes). A 16-bit model (`dtype()`) rounds a float32 input to its type
  /// first (not a GPT's token ids, which its embedding reads as float32) and returns 16-bit
  /// logits. Throws `dp::Error` on an empty model or a wrong input shape.
  Tensor forward(const Tensor& input);
  /// Cross-entropy (mean over the batch) of `logits` against `labels`, then backward
  /// through all layers in reverse. `loss_scale` multiplies the gradient (1/k for
  /// accumulation over k micro-batches). Gradients are added into `Parameter::grad`.
  /// Fires pre-backward hooks per layer (reverse order), a gradient-ready hook for each
  /// non-frozen parameter the moment its gradient is final (reverse definition order:
  /// fc3.bias, fc3.weight, fc2.bias, ...), and post-backward hooks per layer. The first
  /// layer runs `Layer::backward_parameters_only`: the input's gradient is never computed.
  /// 16-bit logits: the loss is computed on their widened values and the gradient of the
  /// logits, scaled by `loss_scale`, is rounded once to their type.
  /// Returns the unscaled mean loss.
  float backward(const Tensor& logits, std::span<const int> labels, float loss_scale = 1.0f);
  /// Sets every gradient to 0 (a gradient a hook released stays released).
  void zero_grad();

  /// Adds a hook fired for each non-frozen parameter whose gradient is final.
  void on_gradient_ready(GradientHook hook);
  /// Adds a hook fired before each layer's forward.
  void on_pre_forward(LayerHook hook);
  /// Adds a hook fired after each layer's forward.
  void on_post_forward(LayerHook hook);
  /// Adds a hook fired before each layer's backward.
  void on_pre_backward(LayerHook hook);
  /// Adds a hook fired after each layer's backward (after its gradient-ready hooks).
  void on_post_backward(LayerHook hook);
  /// Removes every hook.
  void clear_hooks();

  /// All parameter values concatenated in definition order (`num_parameters()` elements),
  /// copied to the host wherever they live (16-bit values widened exactly). Throws `dp::Error` if a
  /// hook released a value.
  std::vector<float> flat_parameters() const;
  /// All gradients concatenated in definition order, copied to the host; a released
  /// gradient reads as zeros.
  std::vector<float> flat_gradients() const;
  /// The inverse of `flat_parameters` (copied to where the parameters live, rounded to
  /// nearest even for a 16-bit model); throws
  /// `dp::Error` unless `values` has `num_parameters()` elements.
  void set_flat_parameters(std::span<const float> values);

  /// Sum of the layers' forward costs on a batch of `batch` rows (the loss not included); a
  /// row is a sequence of `context` tokens for a GPT.
  OpCost forward_cost(std::int64_t batch) const;
  /// Sum of the layers' backward costs on a batch of `batch` rows (the loss not included),
  /// the first layer's without its input gradient, as `backward` charges them.
  OpCost backward_cost(std::int64_t batch) const;

 private:
  // The parameter called `name`; throws `dp::Error` listing the valid names if missing.
  Parameter* find_parameter(std::string_view name) const;

  std::vector<std::unique_ptr<Layer>> owned_layers_;
  std::vector<Layer*> layers_;
  std::vector<Parameter*> parameters_;
  std::vector<const Parameter*> const_parameters_;
  std::vector<Layer*> parameter_layers_;  // the layer owning parameters_[i]
  std::size_t num_parameters_ = 0;
  SoftmaxCrossEntropy loss_;
  // dim(0) of the last forward's input: the batch `backward` charges every layer's cost on
  // (a GPT's logits have a row per token, not per sequence).
  std::int64_t forward_batch_ = 0;

  std::vector<GradientHook> gradient_ready_hooks_;
  std::vector<LayerHook> pre_forward_hooks_;
  std::vector<LayerHook> post_forward_hooks_;
  std::vector<LayerHook> pre_backward_hooks_;
  std::vector<LayerHook> post_backward_hooks_;
};

/// Fraction of rows of `logits` (B, classes) whose argmax equals the label (the first
/// maximum wins a tie); device logits are copied to the host first. Throws `dp::Error` when the
/// label count differs from B.
float accuracy(const Tensor& logits, std::span<const int> labels);

}  // namespace dp
