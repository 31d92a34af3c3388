// tiny_gpt.h: the small GPTs the checks draw, and the text they train on.
//
// The labs' lessons must hold on a transformer as well as on an MLP: a GPT has parameters
// of very different sizes (LayerNorm weights and biases of C elements beside C x 4C
// matrices), token ids in and a label per token out, and the layers of dp/layers/. The
// checks draw one small enough to train in milliseconds: 1 or 2 blocks, C an even number in
// [16, 32], 2 heads, a context of 8 to 16 tokens, on the grader's own text held in memory
// (no file to read, nothing to install), cut into windows of context + 1 tokens as
// dp/text_data.h cuts any text.
//
// Example:
//
//   dp::TrainOptions options;
//   const auto data = draw_tiny_gpt(draws, options);  // options.model "gpt:layers=2,...",
//                                                    // options.vocab the text's
//   dp::Model model = make_check_model(options);      // a GPT over data->num_classes tokens
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "dp/data.h"
#include "dp/trainer.h"
#include "grading.h"

namespace dp::grading {

/// The text the checks' GPTs train on: about 1,800 characters of English prose written for
/// the grader (byte-level tokens, a vocabulary of 38), enough for 111 or more windows at
/// every drawn context (the checks' global batches take at most 24).
std::string_view grader_text();

/// Draws a small GPT and sets `options` to train it on `grader_text()`: `model` the spec
/// "gpt:layers=L,dim=C,heads=2,context=T" with L in [1, 2], C even in [16, 32] and T in
/// [8, 16]; `dataset` a name for the text; `vocab` its vocabulary. The description of
/// `draws` names the spec. Returns the text's windows of T tokens.
std::shared_ptr<const Dataset> draw_tiny_gpt(Draws& draws, TrainOptions& options);

}  // namespace dp::grading
