// layer.h: the base class of every layer, and the trainable parameter.
//
// A layer has an explicit forward and backward: forward saves what backward needs, and
// backward returns the gradient of the input and adds the gradients of its parameters
// into `Parameter::grad`; `backward_parameters_only` adds the same gradients without
// computing the input's (what `Model::backward` calls on its first layer). Adding (not
// overwriting) is what makes gradient accumulation over micro-batches work;
// `Model::zero_grad()` resets the sums. A frozen parameter's gradient is never computed.
//
// Layers read `Parameter::value` at the moment they run, so a hook may replace a
// parameter's tensor between calls (ZeRO-3 gathers it before forward and frees it after).
// A gradient that a hook released (an empty tensor, ZeRO-2) is allocated again, zeroed,
// before backward adds to it.
//
// Each layer runs where its tensors live: its .cpp file holds the host loop, the readable
// definition, and hands device tensors to the CUDA kernels of common/src/cuda/. The input,
// the parameters and the gradients of a layer must live on one device, else forward or
// backward throws `dp::Error` naming the layer and both devices.
//
// Example:
//
//   dp::Linear fc("fc1", 64, 256);
//   dp::Tensor y = fc.forward(x);            // x: (B, 64) -> y: (B, 256)
//   dp::Tensor dx = fc.backward(dy);         // dy: (B, 256) -> dx: (B, 64); fc1.weight.grad += ...
//   for (dp::Parameter* p : fc.parameters()) fmt::print("{}\n", p->name);
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dp/rng.h"
#include "dp/tensor.h"

namespace dp {

/// Cost of one op, for the simulated clock: the inputs of a roofline model.
struct OpCost {
  double flops = 0;  ///< floating-point operations
  double bytes = 0;  ///< bytes read from and written to memory

  /// The cost of doing this op and then `other`.
  OpCost& operator+=(const OpCost& other) {
    flops += other.flops;
    bytes += other.bytes;
    return *this;
  }
};

/// A trainable tensor with its gradient.
struct Parameter {
  /// Full name, "<layer>.<role>", e.g. "fc1.weight".
  std::string name;
  /// The current value, charged under `MemoryCategory::kParameters`.
  Tensor value;
  /// The accumulated gradient, same shape, charged under `MemoryCategory::kGradients`.
  Tensor grad;
  /// A frozen parameter gets no gradient, no gradient-ready hook and no optimizer update.
  bool frozen = false;
  /// Position in the model's definition order (set by `Model::add`).
  std::size_t index = 0;
  /// First element in the model's flat parameter index space: definition order, frozen
  /// parameters included (set by `Model::add`).
  std::size_t offset = 0;

  /// A parameter called `name` of `shape`: value charged as parameters, grad as gradients,
  /// both zero-filled, of element type `dtype` (float32, or 16-bit in mixed precision).
  static Parameter zeros(std::string name, const std::vector<std::int64_t>& shape,
                         DataType dtype = DataType::kFloat32);
};

/// The base of every layer in a `Model`.
class Layer {
 public:
  virtual ~Layer();
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  /// The layer's name in its model, e.g. "fc1", "relu1", "ln1".
  const std::string& name() const { return name_; }
  /// What the layer computes, e.g. "linear", "relu".
  virtual std::string kind() const = 0;

  /// Computes the output for `input` (B, in) -> (B, out) and saves what backward needs.
  /// Throws `dp::Error` naming the layer when the input shape is wrong.
  virtual Tensor forward(const Tensor& input) = 0;
  /// Returns the gradient of the input of the last forward, given the gradient of its
  /// output; adds (+=) this batch's gradient into every non-frozen parameter's grad.
  /// It releases what forward saved, so each forward allows one backward.
  virtual Tensor backward(const Tensor& grad_output) = 0;
  /// As `backward`, for a layer whose input gradient nobody reads (a model's first layer:
  /// its input is data, not a parameter's output): adds the same parameter gradients, bit
  /// for bit, releases what forward saved, and returns an empty tensor. The default runs
  /// `backward` and drops the input gradient; a layer whose input gradient costs work of its
  /// own overrides it (Linear skips a product as large as its weight gradient's).
  virtual Tensor backward_parameters_only(const Tensor& grad_output);
  /// Drops what the last forward saved for backward, so that its memory is free before
  /// backward comes; backward then refuses to run until the next forward. Activation
  /// checkpointing calls it after a block's forward and runs that forward again in backward.
  /// The default does nothing, which is right for a layer that saves nothing.
  virtual void discard_saved();
  /// The layer's parameters in definition order (weight, then bias); empty for activations.
  virtual std::vector<Parameter*> parameters();
  /// Sets the initial value of `parameter` (one of `parameters()`), drawing from `rng`.
  /// The default throws: a layer with parameters must override it.
  virtual void initialize(Parameter& parameter, CounterRng& rng);

  /// Flops and bytes of `forward` on a batch of `batch` rows.
  virtual OpCost forward_cost(std::int64_t batch) const = 0;
  /// Flops and bytes of `backward` on a batch of `batch` rows.
  virtual OpCost backward_cost(std::int64_t batch) const = 0;
  /// Flops and bytes of `backward_parameters_only` on a batch of `batch` rows; the default
  /// is `backward_cost`, as the default `backward_parameters_only` does all of backward.
  virtual OpCost backward_parameters_only_cost(std::int64_t batch) const;

 protected:
  /// A layer called `name`.
  explicit Layer(std::string name) : name_(std::move(name)) {}
  /// Throws `dp::Error` unless `input` is (B, features) for some B >= 0.
  void require_input(const Tensor& input, std::int64_t features) const;
  /// Throws `dp::Error` unless `grad_output` is (batch, features), the last output's shape.
  void require_grad_output(const Tensor& grad_output, std::int64_t batch,
                           std::int64_t features) const;
  /// Throws `dp::Error` naming this layer unless `tensor` (called `what`) lives on the
  /// device of `reference` (called `reference_what`), e.g. the input and the weight.
  void require_same_device(const Tensor& tensor, std::string_view what, const Tensor& reference,
                           std::string_view reference_what) const;
  /// Throws `dp::Error` unless `parameter.value` is `shape` (a hook may have freed it).
  static void require_value(const Parameter& parameter, const std::vector<std::int64_t>& shape);
  /// `parameter.grad`, allocated again (zero-filled, on the value's device, of its type) if
  /// a hook released it; throws `dp::Error` when it lives on another device than the value.
  static Tensor& grad_for_accumulation(Parameter& parameter);

 private:
  std::string name_;
};

}  // namespace dp
