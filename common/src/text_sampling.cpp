// Text from a trained GPT: its checkpoint read back, and tokens drawn one at a time.
#include "dp/text_sampling.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "dp/checkpoint.h"
#include "dp/error.h"
#include "dp/rng.h"

namespace dp {

TrainedGpt load_trained_gpt(const std::filesystem::path& path) {
  const std::string file = path.string();
  // Every dtype: a mixed-precision run saves its 16-bit parameters as they are ("BF16", "F16").
  Checkpoint contents = load_safetensors(path, MemoryCategory::kOther, LoadTypes::kAll);
  const auto model = contents.metadata.find("model");
  if (model == contents.metadata.end() || !is_gpt_spec(model->second))
    throw Error(fmt::format(
        "'{}' is not the checkpoint of a GPT: its metadata \"model\" is {}, expected a GPT "
        "spec (\"gpt:...\") as `dplab train --model gpt:...` records",
        file, model == contents.metadata.end() ? "missing" : "\"" + model->second + "\""));
  const GptSpec spec = parse_gpt_spec(model->second);
  CharTokenizer tokenizer = CharTokenizer::from_metadata(contents.metadata, file);
  Model gpt = Model::gpt(spec, tokenizer.size());
  for (Parameter* parameter : gpt.parameters()) {
    const auto saved = contents.tensors.find(parameter->name);
    if (saved == contents.tensors.end())
      throw Error(fmt::format("'{}' has no tensor '{}', a parameter of the GPT {} over {} tokens",
                              file, parameter->name, model->second, tokenizer.size()));
    if (saved->second.shape() != parameter->value.shape())
      throw Error(
          fmt::format("'{}': tensor '{}' has shape {}, expected {} for the GPT {} over {} tokens",
                      file, parameter->name, saved->second.shape_string(),
                      parameter->value.shape_string(), model->second, tokenizer.size()));
    // 16-bit parameters are widened exactly: the model samples in float32 from the very
    // values the mixed-precision run trained (its arithmetic, not its 16-bit rounding).
    const Tensor widened = saved->second.dtype() == DataType::kFloat32
                               ? Tensor()
                               : saved->second.to(DataType::kFloat32);
    const Tensor& values = saved->second.dtype() == DataType::kFloat32 ? saved->second : widened;
    check_state_values(file, parameter->name, values.span());
    std::copy_n(values.data(), values.size(), parameter->value.data());
  }
  return {spec, std::move(gpt), std::move(tokenizer)};
}

namespace {

// The token drawn from softmax(logits / temperature) with the uniform number `u` in [0, 1):
// the first token whose cumulative probability passes u. In double, so that the sums of a
// vocabulary of a few hundred tokens lose nothing that matters.
int draw_token(std::span<const float> logits, float temperature, double u) {
  const auto largest = std::max_element(logits.begin(), logits.end());
  if (temperature == 0.0f) return static_cast<int>(largest - logits.begin());
  std::vector<double> weights(logits.size());
  double total = 0.0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    weights[i] = std::exp((static_cast<double>(logits[i]) - *largest) / temperature);
    total += weights[i];
  }
  const double target = u * total;
  double cumulative = 0.0;
  for (std::size_t i = 0; i < weights.size(); ++i) {
    cumulative += weights[i];
    if (target < cumulative) return static_cast<int>(i);
  }
  return static_cast<int>(largest - logits.begin());  // u * total rounded up to the total
}

}  // namespace

std::string sample_text(Model& model, const CharTokenizer& tokenizer, std::string_view prompt,
                        const SampleOptions& options) {
  if (options.length < 0)
    throw Error(
        fmt::format("the length to sample must be 0 or more tokens, got {}", options.length));
  if (!std::isfinite(options.temperature) || options.temperature < 0.0f)
    throw Error(fmt::format(
        "the temperature must be a finite number >= 0 (0: the most likely token), got {}",
        options.temperature));
  std::vector<int> tokens = tokenizer.encode(prompt, "the prompt");
  // Without a prompt the model starts as after the end of a line (of a fortune's '%').
  const bool seeded_by_newline = tokens.empty();
  if (seeded_by_newline) tokens.push_back(tokenizer.contains('\n') ? tokenizer.encode("\n")[0] : 0);
  // The longest sequence the model reads: its position embedding's rows.
  const auto context = static_cast<std::size_t>(model.parameter("wpe.weight").value.shape()[0]);
  const std::size_t vocab = static_cast<std::size_t>(tokenizer.size());
  CounterRng rng(options.seed, 0);
  for (std::int64_t generated = 0; generated < options.length; ++generated) {
    const std::size_t window = std::min(tokens.size(), context);
    Tensor ids({1, static_cast<std::int64_t>(window)});
    for (std::size_t t = 0; t < window; ++t)
      ids.data()[t] = static_cast<float>(tokens[tokens.size() - window + t]);
    const Tensor logits = model.forward(ids);  // (window, vocab)
    const std::span<const float> last =
        std::span<const float>(logits.data(), logits.size()).subspan((window - 1) * vocab, vocab);
    tokens.push_back(draw_token(last, options.temperature, rng.uniform()));
  }
  const std::string text = tokenizer.decode(tokens);
  return seeded_by_newline ? text.substr(1) : text;
}

}  // namespace dp
