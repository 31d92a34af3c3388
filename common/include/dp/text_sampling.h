// text_sampling.h: text from a trained GPT, a token at a time (what `dplab sample` prints).
//
// Generation is autoregressive: the model reads the last `context` tokens of the text so
// far, its logits at the last position, divided by the temperature, give a softmax over the
// vocabulary, and one token is drawn from it and appended. A temperature below 1 sharpens
// the distribution (towards the most likely byte), above 1 flattens it; 0 always takes the
// most likely one (greedy). The draws come from `CounterRng(seed, 0)`, one uniform number
// per token, so a seed gives the same text on every machine.
//
// Example:
//
//   dp::TrainedGpt gpt = dp::load_trained_gpt("dplab-train.safetensors");
//   std::string text = dp::sample_text(gpt.model, gpt.tokenizer, "A ",
//                                      {.length = 200, .temperature = 0.8f, .seed = 1});
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include "dp/model.h"
#include "dp/tokenizer.h"

namespace dp {

/// A GPT read back from a `dplab train` checkpoint, ready to generate.
struct TrainedGpt {
  /// The model spec it was trained with.
  GptSpec spec;
  /// The model, with the checkpoint's parameters, on the host.
  Model model;
  /// The tokenizer its data was encoded with (from the checkpoint's metadata).
  CharTokenizer tokenizer;
};

/// Reads the GPT of a checkpoint `dplab train` wrote: the model spec ("model") and the
/// tokenizer from the metadata, every parameter by its name. Throws `dp::Error` naming the
/// file when it cannot be read, is not a GPT's checkpoint, records no tokenizer or a
/// damaged one, or lacks a parameter or holds one of the wrong shape. A mixed-precision
/// run's 16-bit parameters ("BF16" or "F16") are widened exactly: the model is float32.
TrainedGpt load_trained_gpt(const std::filesystem::path& path);

/// How `sample_text` draws.
struct SampleOptions {
  std::int64_t length = 200;  ///< tokens (bytes) to generate after the prompt
  float temperature = 1.0f;   ///< divides the logits; 0: always the most likely token
  std::uint64_t seed = 0;     ///< selects the draws: equal seeds give equal text
};

/// The prompt followed by `options.length` tokens drawn from `model` (a GPT over
/// `tokenizer`'s vocabulary). An empty prompt starts after a newline, or after the
/// vocabulary's first byte when it has no newline (that byte is not printed). Throws
/// `dp::Error` when the prompt holds a byte outside the vocabulary (naming it and its
/// position), when the length is negative, or the temperature negative or not finite.
std::string sample_text(Model& model, const CharTokenizer& tokenizer, std::string_view prompt,
                        const SampleOptions& options);

}  // namespace dp
