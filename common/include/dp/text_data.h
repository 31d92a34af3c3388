// text_data.h: text as a data set for a GPT: windows of tokens and their next tokens.
//
// A text is tokenized a byte at a time (dp/tokenizer.h) into a stream t_0 .. t_{n-1} and cut
// into windows of context + 1 tokens at stride `context`: window i covers tokens
// [i C, i C + C], so consecutive windows share one token and every token but the first is
// predicted exactly once per epoch. The first C tokens of a window are the model's input,
// the last C its labels (each position's next token). There are floor((n - 1) / C)
// windows; the tokens after the last whole window are left out.
//
// The windows form an ordinary `dp::Dataset` (labels_per_sample = C), so they are batched,
// shuffled and split between ranks exactly as every other data set: each epoch the
// trainer's `GlobalBatches` permutes the window indices and rank r takes its slice of
// every global batch.
//
// Example:
//
//   dp::Dataset data = dp::make_text_dataset("hello world", /*context=*/4, "greeting");
//   // vocabulary " dehlorw" (8 tokens), windows "hello" and "o wor": 2 samples, features
//   // (2, 4) holding the ids of "hell" and "o wo", labels the ids of "ello" then " wor"
//   dp::Dataset fortunes = dp::load_fortunes(/*context=*/64);  // Debian's fortunes
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

#include "dp/data.h"

namespace dp {

/// The number of windows of context + 1 tokens at stride `context` in a text of `tokens`
/// tokens: floor((tokens - 1) / context), 0 when the text is shorter than one window.
/// Throws `dp::Error` unless context >= 1.
std::size_t text_window_count(std::size_t tokens, std::int64_t context);

/// The windows of `corpus` as a data set named `name`: its tokenizer is built from the
/// corpus (`CharTokenizer::from_corpus`), features (N, context) hold window i's first
/// `context` token ids as floats, labels its last `context`, and num_classes is the
/// vocabulary size. Throws `dp::Error` on an empty corpus, a context below 1 or one that
/// leaves no whole window (saying how many tokens the corpus has and how many are needed).
Dataset make_text_dataset(std::string_view corpus, std::int64_t context, std::string name);

/// `make_text_dataset` of the file at `path` read as bytes, named "text:PATH". Throws
/// `dp::Error` naming the file when it cannot be read, is empty or is too short.
Dataset load_text(const std::filesystem::path& path, std::int64_t context);

/// Where the fortunes are read from: the environment variable DPLAB_FORTUNES if set,
/// otherwise /usr/share/games/fortunes, where Debian's `fortunes` package installs them.
std::filesystem::path fortunes_directory();

/// The names of the fortune files of the default corpus, in the order they are joined:
/// the files Debian's `fortunes` and `fortunes-min` packages (version 1:1.99.1) install,
/// in name order, without their index (.dat) files.
std::span<const std::string_view> fortune_file_names();

/// The paths of the default corpus's files in `directory` (`fortune_file_names`).
std::vector<std::filesystem::path> fortune_files(
    const std::filesystem::path& directory = fortunes_directory());

/// The default corpus: every file of `fortune_files(directory)` read as bytes and joined in
/// that order, unchanged (the '%' lines between fortunes included). Throws `dp::Error`
/// naming the first missing file and the package that installs it.
std::string read_fortunes(const std::filesystem::path& directory = fortunes_directory());

/// `make_text_dataset` of `read_fortunes(directory)`, named "fortunes".
Dataset load_fortunes(std::int64_t context,
                      const std::filesystem::path& directory = fortunes_directory());

}  // namespace dp
