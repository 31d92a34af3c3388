#include "dp/model.h"

#include <algorithm>
#include <charconv>
#include <iterator>
#include <utility>

#include "device_dispatch.h"
#include "dp/clock.h"
#include "dp/error.h"
#include "precision.h"

namespace dp {

// --- MLP specs ---------------------------------------------------------------------------

std::vector<std::int64_t> parse_mlp_spec(std::string_view spec) {
  const auto invalid = [spec](const std::string& why) {
    return Error(
        fmt::format("MLP spec \"{}\" is invalid: {}; expected two or more positive "
                    "layer widths joined by '-', e.g. \"64-256-10\"",
                    spec, why));
  };
  std::vector<std::int64_t> widths;
  std::size_t start = 0;
  while (true) {
    const std::size_t dash = spec.find('-', start);
    const std::string_view field =
        spec.substr(start, dash == std::string_view::npos ? std::string_view::npos : dash - start);
    const std::size_t position = widths.size() + 1;
    if (field.empty()) throw invalid(fmt::format("width {} is empty", position));
    std::int64_t width = 0;
    const auto [end, status] = std::from_chars(field.data(), field.data() + field.size(), width);
    if (status != std::errc() || end != field.data() + field.size())
      throw invalid(fmt::format("width {} is \"{}\", not a whole number", position, field));
    if (width <= 0) throw invalid(fmt::format("width {} is {}, not positive", position, width));
    widths.push_back(width);
    if (dash == std::string_view::npos) break;
    start = dash + 1;
  }
  if (widths.size() < 2)
    throw invalid(
        fmt::format("it has {} width, but an input and an output are needed", widths.size()));
  // The parameters live in one flat buffer: their total must be a tensor size. Each layer
  // has in x out weights and out biases, checked before each operation so none can wrap.
  std::size_t total = 0;
  for (std::size_t i = 0; i + 1 < widths.size(); ++i) {
    const auto in = static_cast<std::size_t>(widths[i]);
    const auto out = static_cast<std::size_t>(widths[i + 1]);
    const std::size_t room = kMaxTensorElements - total;
    if (out > room / (in + 1))
      throw invalid(fmt::format(
          "layer {} ({} -> {}) brings the parameters to more than {} (2^60), more than any "
          "memory holds",
          i + 1, in, out, kMaxTensorElements));
    total += out * (in + 1);
  }
  return widths;
}

// --- GPT specs ---------------------------------------------------------------------------

bool is_gpt_spec(std::string_view spec) {
  return spec == "gpt" || spec.starts_with("gpt:");
}

namespace {

// Elements of a GPT's parameters, in double (an estimate that cannot wrap): the embeddings,
// 12 C^2 + 13 C per block, ln_f and the head.
double gpt_parameter_count(const GptSpec& spec, double vocab) {
  const double c = static_cast<double>(spec.dim);
  return vocab * c + static_cast<double>(spec.context) * c +
         static_cast<double>(spec.layers) * (12 * c * c + 13 * c) + 2 * c + vocab * c;
}

}  // namespace

GptSpec parse_gpt_spec(std::string_view spec) {
  const auto invalid = [spec](const std::string& why) {
    return Error(
        fmt::format("GPT spec \"{}\" is invalid: {}; expected \"gpt\" or \"gpt:\" followed by "
                    "key=value pairs joined by ',' with keys layers, dim, heads, context, e.g. "
                    "\"gpt:layers=4,dim=128,heads=4,context=64\"",
                    spec, why));
  };
  if (!is_gpt_spec(spec)) throw invalid("it does not start with \"gpt:\"");
  GptSpec result;
  if (spec == "gpt") return result;
  const std::string_view pairs = spec.substr(4);
  std::vector<std::string_view> seen;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = pairs.find(',', start);
    const std::string_view pair = pairs.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    const std::size_t equals = pair.find('=');
    if (equals == std::string_view::npos)
      throw invalid(fmt::format("\"{}\" is not key=value", pair));
    const std::string_view key = pair.substr(0, equals);
    const std::string_view text = pair.substr(equals + 1);
    std::int64_t* field = key == "layers"    ? &result.layers
                          : key == "dim"     ? &result.dim
                          : key == "heads"   ? &result.heads
                          : key == "context" ? &result.context
                                             : nullptr;
    if (field == nullptr) throw invalid(fmt::format("unknown key \"{}\"", key));
    if (std::find(seen.begin(), seen.end(), key) != seen.end())
      throw invalid(fmt::format("key \"{}\" is given twice", key));
    seen.push_back(key);
    std::int64_t value = 0;
    const auto [end, status] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (text.empty() || status != std::errc() || end != text.data() + text.size())
      throw invalid(fmt::format("{} is \"{}\", not a whole number", key, text));
    if (value <= 0) throw invalid(fmt::format("{} is {}, not positive", key, value));
    *field = value;
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  if (result.dim % result.heads != 0)
    throw invalid(
        fmt::format("{} heads do not divide dim = {} into equal heads", result.heads, result.dim));
  // The parameters live in one flat buffer: without the vocabulary's share, they must
  // already fit a tensor (Model::gpt checks again with it).
  if (gpt_parameter_count(result, 0.0) > static_cast<double>(kMaxTensorElements))
    throw invalid(
        fmt::format("its parameters come to more than {} (2^60) elements, more than "
                    "any memory holds",
                    kMaxTensorElements));
  return result;
}

// --- Model -------------------------------------------------------------------------------

Model::Model() = default;
Model::Model(Model&& other) noexcept = default;
Model& Model::operator=(Model&& other) noexcept = default;
Model::~Model() = default;

Model Model::mlp(std::string_view spec, const MlpOptions& options) {
  const std::vector<std::int64_t> widths = parse_mlp_spec(spec);
  if (options.activation != "relu" && options.activation != "gelu")
    throw Error(fmt::format("unknown activation \"{}\"; expected \"relu\" or \"gelu\"",
                            options.activation));
  detail::check_tensor_type("Model::mlp", options.dtype);
  Model model;
  const std::size_t num_linear = widths.size() - 1;
  for (std::size_t i = 0; i < num_linear; ++i) {
    const std::string suffix = std::to_string(i + 1);
    const std::int64_t out = widths[i + 1];
    model.add(std::make_unique<Linear>("fc" + suffix, widths[i], out, options.dtype));
    if (i + 1 == num_linear) break;  // the last Linear produces the logits
    if (options.layer_norm)
      model.add(std::make_unique<LayerNorm>("ln" + suffix, out, kLayerNormEps, options.dtype));
    if (options.activation == "relu")
      model.add(std::make_unique<ReLU>("relu" + suffix, out));
    else
      model.add(std::make_unique<GELU>("gelu" + suffix, out));
  }
  model.init_parameters(options.seed);
  if (options.device != Device::kHost) model.to(options.device);
  return model;
}

Model Model::gpt(const GptSpec& spec, std::int64_t vocab, const GptOptions& options) {
  // The spec as text, so that a bad size is refused with parse_gpt_spec's message.
  parse_gpt_spec(fmt::format("gpt:layers={},dim={},heads={},context={}", spec.layers, spec.dim,
                             spec.heads, spec.context));
  if (vocab <= 0)
    throw Error(fmt::format("a GPT needs a vocabulary of at least one token, got {}", vocab));
  if (gpt_parameter_count(spec, static_cast<double>(vocab)) >
      static_cast<double>(kMaxTensorElements))
    throw Error(fmt::format(
        "a GPT of vocabulary {} and {} blocks of dim {} has more than {} (2^60) parameters", vocab,
        spec.layers, spec.dim, kMaxTensorElements));
  detail::check_tensor_type("Model::gpt", options.dtype);
  Model model;
  model.add(std::make_unique<Embedding>("embed", vocab, spec.context, spec.dim, options.dtype));
  for (std::int64_t block = 0; block < spec.layers; ++block) {
    auto transformer_block = std::make_unique<TransformerBlock>(
        fmt::format("h.{}", block), spec.dim, spec.heads, spec.context, spec.layers, options.dtype);
    transformer_block->set_activation_checkpointing(options.activation_checkpointing);
    model.add(std::move(transformer_block));
  }
  model.add(
      std::make_unique<LanguageModelHead>("head", spec.dim, vocab, spec.context, options.dtype));
  model.init_parameters(options.seed);
  if (options.device != Device::kHost) model.to(options.device);
  return model;
}

void Model::add(std::unique_ptr<Layer> layer) {
  if (layer == nullptr) throw Error("Model::add got a null layer");
  for (const Layer* existing : layers_) {
    if (existing->name() == layer->name())
      throw Error(fmt::format("the model already has a layer called \"{}\"", layer->name()));
  }
  const std::vector<Parameter*> new_parameters = layer->parameters();
  for (const Parameter* candidate : new_parameters) {
    for (const Parameter* existing : parameters_) {
      if (existing->name == candidate->name)
        throw Error(
            fmt::format("the model already has a parameter called \"{}\"", candidate->name));
    }
  }
  for (Parameter* parameter : new_parameters) {
    parameter->index = parameters_.size();
    parameter->offset = num_parameters_;
    num_parameters_ += parameter->value.size();
    parameters_.push_back(parameter);
    const_parameters_.push_back(parameter);
    parameter_layers_.push_back(layer.get());
  }
  layers_.push_back(layer.get());
  owned_layers_.push_back(std::move(layer));
}

Parameter* Model::find_parameter(std::string_view name) const {
  for (Parameter* candidate : parameters_) {
    if (candidate->name == name) return candidate;
  }
  std::vector<std::string_view> names;
  for (const Parameter* candidate : parameters_) names.push_back(candidate->name);
  throw Error(fmt::format("no parameter called \"{}\"; the model has: {}", name,
                          names.empty() ? "(none)" : fmt::format("{}", fmt::join(names, ", "))));
}

Parameter& Model::parameter(std::string_view name) {
  return *find_parameter(name);
}

const Parameter& Model::parameter(std::string_view name) const {
  return *find_parameter(name);
}

std::vector<std::size_t> Model::parameter_counts_per_layer() const {
  std::vector<std::size_t> counts;
  counts.reserve(layers_.size());
  for (Layer* layer : layers_) counts.push_back(layer->parameters().size());
  return counts;
}

std::size_t Model::num_trainable_parameters() const {
  std::size_t count = 0;
  for (const Parameter* parameter : parameters_) {
    if (!parameter->frozen) count += parameter->value.size();
  }
  return count;
}

void Model::init_parameters(std::uint64_t seed) {
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    // One stream per parameter: its values do not depend on the other parameters' sizes.
    CounterRng rng(seed, parameters_[i]->index);
    parameter_layers_[i]->initialize(*parameters_[i], rng);
  }
}

void Model::to(Device device) {
  for (Parameter* parameter : parameters_) {
    if (parameter->value.device() != device) parameter->value = parameter->value.to(device);
    if (!parameter->grad.empty() && parameter->grad.device() != device)
      parameter->grad = parameter->grad.to(device);
  }
}

Device Model::device() const {
  return parameters_.empty() ? Device::kHost : parameters_.front()->value.device();
}

DataType Model::dtype() const {
  return parameters_.empty() ? DataType::kFloat32 : parameters_.front()->value.dtype();
}

void Model::freeze(std::string_view parameter_name) {
  parameter(parameter_name).frozen = true;
}

void Model::unfreeze(std::string_view parameter_name) {
  parameter(parameter_name).frozen = false;
}

Tensor Model::forward(const Tensor& input) {
  if (layers_.empty()) throw Error("forward called on a model with no layers");
  Tensor output;
  const Tensor* current = &input;
  forward_batch_ = input.rank() >= 1 ? input.dim(0) : 0;
  // A 16-bit model takes float32 data rounded to its type: the activations are 16-bit. Not
  // token ids: a 16-bit GPT's embedding reads them as float32 and outputs 16 bits.
  Tensor rounded_input;
  if (dtype() != DataType::kFloat32 && input.dtype() == DataType::kFloat32 &&
      layers_.front()->kind() != "embedding") {
    rounded_input = input.to(dtype());
    current = &rounded_input;
  }
  for (Layer* layer : layers_) {
    for (const LayerHook& hook : pre_forward_hooks_) hook(*layer);
    const std::int64_t rows = current->rank() >= 1 ? current->dim(0) : 0;
    output = timed_compute(layer->name(), "forward", layer->forward_cost(rows),
                           [&] { return layer->forward(*current); });
    current = &output;
    for (const LayerHook& hook : post_forward_hooks_) hook(*layer);
  }
  return output;
}

float Model::backward(const Tensor& logits, std::span<const int> labels, float loss_scale) {
  if (layers_.empty()) throw Error("backward called on a model with no layers");
  const std::int64_t rows = logits.rank() == 2 ? logits.dim(0) : 0;
  const std::int64_t classes = logits.rank() == 2 ? logits.dim(1) : 0;
  // 16-bit logits: the loss in float32 on their widened values, and the gradient of the
  // logits (scaled by `loss_scale` first, as fp16 loss scaling needs) rounded once.
  const DataType type = logits.dtype();
  const float loss =
      timed_compute("loss", "forward", SoftmaxCrossEntropy::forward_cost(rows, classes), [&] {
        return type == DataType::kFloat32 ? loss_.forward(logits, labels)
                                          : loss_.forward(detail::widened(logits), labels);
      });
  Tensor grad =
      timed_compute("loss", "backward", SoftmaxCrossEntropy::backward_cost(rows, classes), [&] {
        return type == DataType::kFloat32 ? loss_.backward(loss_scale)
                                          : detail::rounded(loss_.backward(loss_scale), type);
      });  // (B, classes)
  for (auto layer_it = layers_.rbegin(); layer_it != layers_.rend(); ++layer_it) {
    Layer& layer = **layer_it;
    for (const LayerHook& hook : pre_backward_hooks_) hook(layer);
    // The batch of the last forward (a GPT's gradient has a row per token below its head);
    // the gradient's rows before any forward.
    const std::int64_t grad_rows =
        forward_batch_ > 0 ? forward_batch_ : (grad.rank() >= 1 ? grad.dim(0) : 0);
    // The first layer's input is the data: nobody reads its gradient, so it is not computed.
    if (std::next(layer_it) == layers_.rend()) {
      grad = timed_compute(layer.name(), "backward", layer.backward_parameters_only_cost(grad_rows),
                           [&] { return layer.backward_parameters_only(grad); });
    } else {
      grad = timed_compute(layer.name(), "backward", layer.backward_cost(grad_rows),
                           [&] { return layer.backward(grad); });
    }
    // The layer has added this batch's contribution: its gradients are final now.
    const std::vector<Parameter*> layer_parameters = layer.parameters();
    for (auto it = layer_parameters.rbegin(); it != layer_parameters.rend(); ++it) {
      if ((*it)->frozen) continue;
      for (const GradientHook& hook : gradient_ready_hooks_) hook(**it);
    }
    for (const LayerHook& hook : post_backward_hooks_) hook(layer);
  }
  return loss;
}

void Model::zero_grad() {
  for (Parameter* parameter : parameters_) parameter->grad.fill(0.0f);
}

void Model::on_gradient_ready(GradientHook hook) {
  gradient_ready_hooks_.push_back(std::move(hook));
}
void Model::on_pre_forward(LayerHook hook) {
  pre_forward_hooks_.push_back(std::move(hook));
}
void Model::on_post_forward(LayerHook hook) {
  post_forward_hooks_.push_back(std::move(hook));
}
void Model::on_pre_backward(LayerHook hook) {
  pre_backward_hooks_.push_back(std::move(hook));
}
void Model::on_post_backward(LayerHook hook) {
  post_backward_hooks_.push_back(std::move(hook));
}

void Model::clear_hooks() {
  gradient_ready_hooks_.clear();
  pre_forward_hooks_.clear();
  post_forward_hooks_.clear();
  pre_backward_hooks_.clear();
  post_backward_hooks_.clear();
}

namespace {

// Copies `count` floats from host memory into a tensor's memory, wherever that lives. Not
// dp::copy: reading or setting the whole state is not part of a step, so it is not charged
// to the simulated clock.
// A 16-bit destination gets the values rounded to nearest even.
void copy_from_host(const float* source, std::size_t count, Tensor& destination) {
  if (destination.dtype() != DataType::kFloat32) {
    Tensor wide({static_cast<std::int64_t>(count)}, MemoryCategory::kOther, destination.device());
    copy_from_host(source, count, wide);
    detail::convert_uncharged(wide.view(), destination.view());
    return;
  }
  detail::copy_memory(destination.view().data(), destination.device(), source, Device::kHost,
                      count * sizeof(float));
}
// The same from a tensor's memory into host memory (16-bit elements widened exactly).
void copy_to_host(const Tensor& source, std::size_t count, float* destination) {
  if (source.dtype() != DataType::kFloat32) {
    copy_to_host(detail::widened(source, MemoryCategory::kOther), count, destination);
    return;
  }
  detail::copy_memory(destination, Device::kHost, source.view().data(), source.device(),
                      count * sizeof(float));
}

// Elements of parameter i in the flat index space.
std::size_t flat_size(std::span<const Parameter* const> parameters, std::size_t i,
                      std::size_t total) {
  const std::size_t end = i + 1 < parameters.size() ? parameters[i + 1]->offset : total;
  return end - parameters[i]->offset;
}

}  // namespace

std::vector<float> Model::flat_parameters() const {
  std::vector<float> flat(num_parameters_);
  for (std::size_t i = 0; i < const_parameters_.size(); ++i) {
    const Parameter& parameter = *const_parameters_[i];
    const std::size_t size = flat_size(const_parameters_, i, num_parameters_);
    if (parameter.value.size() != size)
      throw Error(
          fmt::format("parameter {} holds {} elements, expected {} (was it released by "
                      "a hook?)",
                      parameter.name, parameter.value.size(), size));
    copy_to_host(parameter.value, size, flat.data() + parameter.offset);
  }
  return flat;
}

std::vector<float> Model::flat_gradients() const {
  std::vector<float> flat(num_parameters_, 0.0f);  // a released gradient stays zero
  for (std::size_t i = 0; i < const_parameters_.size(); ++i) {
    const Parameter& parameter = *const_parameters_[i];
    if (parameter.grad.empty()) continue;
    const std::size_t size = flat_size(const_parameters_, i, num_parameters_);
    DP_CHECK(parameter.grad.size() == size, "gradient of {} has {} elements, expected {}",
             parameter.name, parameter.grad.size(), size);
    copy_to_host(parameter.grad, size, flat.data() + parameter.offset);
  }
  return flat;
}

void Model::set_flat_parameters(std::span<const float> values) {
  if (values.size() != num_parameters_)
    throw Error(
        fmt::format("set_flat_parameters expects {} values (the model's parameter "
                    "count), got {}",
                    num_parameters_, values.size()));
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    Parameter& parameter = *parameters_[i];
    const std::size_t size = flat_size(const_parameters_, i, num_parameters_);
    if (parameter.value.size() != size)
      throw Error(
          fmt::format("parameter {} holds {} elements, expected {} (was it released by "
                      "a hook?)",
                      parameter.name, parameter.value.size(), size));
    copy_from_host(values.data() + parameter.offset, size, parameter.value);
  }
}

OpCost Model::forward_cost(std::int64_t batch) const {
  OpCost total;
  for (const Layer* layer : layers_) total += layer->forward_cost(batch);
  return total;
}

OpCost Model::backward_cost(std::int64_t batch) const {
  OpCost total;
  for (const Layer* layer : layers_)
    total += layer == layers_.front() ? layer->backward_parameters_only_cost(batch)
                                      : layer->backward_cost(batch);
  return total;
}

float accuracy(const Tensor& logits, std::span<const int> labels) {
  if (logits.rank() != 2)
    throw Error(fmt::format("accuracy expects logits of shape (B, classes), got {}",
                            logits.shape_string()));
  const std::int64_t batch = logits.dim(0);
  const std::int64_t classes = logits.dim(1);
  if (static_cast<std::int64_t>(labels.size()) != batch)
    throw Error(fmt::format("accuracy got {} labels for a batch of {} rows", labels.size(), batch));
  if (batch == 0) return 0.0f;
  if (logits.dtype() != DataType::kFloat32) return accuracy(detail::widened(logits), labels);
  if (logits.device() != Device::kHost) return accuracy(logits.to(Device::kHost), labels);
  std::int64_t correct = 0;
  for (std::int64_t row = 0; row < batch; ++row) {
    const float* z = logits.data() + row * classes;
    const std::int64_t predicted = std::max_element(z, z + classes) - z;  // first maximum
    if (predicted == labels[static_cast<std::size_t>(row)]) ++correct;
  }
  return static_cast<float>(correct) / static_cast<float>(batch);
}

}  // namespace dp
