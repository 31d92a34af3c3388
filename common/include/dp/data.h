// data.h: classification data sets held in memory, and how to make or load them.
//
// A `Dataset` is N samples of D float features and one integer label each (or, for a text
// set, a window of D token ids and the D tokens that follow them: dp/text_data.h). The
// labs never read files themselves: they ask `load_dataset` for a set by the name the CLI
// takes ("synthetic", "digits", "csv:PATH", "idx:IMAGES,LABELS", "text:PATH",
// "fortunes") and cut it into batches with `gather_batch`, which is what a
// `DistributedSampler`'s indices feed.
//
// The default set is synthetic: it is computed from a seed, so every rank of every run
// on every machine holds bitwise the same samples without a download or a broadcast.
//
// Example:
//
//   dp::Dataset data = dp::load_dataset("synthetic:1024", /*seed=*/7);
//   std::vector<std::size_t> rows = {0, 5, 9};       // e.g. from a sampler
//   dp::Batch batch = dp::gather_batch(data, rows);  // inputs (3, 64), 3 labels
//   dp::Dataset digits = dp::load_digits();          // 1797 x 64, labels 0..9
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dp/tensor.h"
#include "dp/tokenizer.h"

namespace dp {

/// A classification data set held in memory, or the windows of a tokenized text.
struct Dataset {
  /// A short name for logs and reports, e.g. "digits" or "synthetic:1024".
  std::string name;
  /// The samples, one per row: (N, D) float32, charged under `MemoryCategory::kOther`.
  Tensor features;
  /// `labels_per_sample` labels per sample, sample i's at [i L, (i + 1) L), each in
  /// [0, num_classes).
  std::vector<int> labels;
  /// The number of classes a model must tell apart (a text set's vocabulary size).
  int num_classes = 0;
  /// Labels per sample L: 1 for a classification set; a text set's context, the next token
  /// of each position of the window.
  std::int64_t labels_per_sample = 1;
  /// A text set's tokenizer (the ids of features and labels are its tokens); none for a
  /// classification set.
  std::optional<CharTokenizer> tokenizer;

  /// The number of samples N.
  std::size_t size() const { return labels.size() / static_cast<std::size_t>(labels_per_sample); }
  /// The number of features per sample D (0 for an empty data set).
  std::int64_t feature_dim() const { return features.rank() == 2 ? features.dim(1) : 0; }
};

/// One batch: inputs (B, D) charged under `MemoryCategory::kActivations`, and B L labels.
struct Batch {
  /// The gathered samples, one per row.
  Tensor inputs;
  /// The labels of each row of `inputs` (L per row, row after row).
  std::vector<int> labels;
};

/// Gathers rows `indices` of `data` into a batch, in the order given (repeats allowed).
/// An index past the end throws `dp::Error` naming the index and the data set size.
Batch gather_batch(const Dataset& data, std::span<const std::size_t> indices);

/// A training part and an evaluation part of one data set.
struct DatasetSplit {
  /// The first samples.
  Dataset train;
  /// The last samples, held out for evaluation.
  Dataset eval;
};

/// Copies `data` into a training part and an evaluation part made of the last
/// `eval_fraction` of the samples (rounded down); `eval_fraction` must lie in [0, 1).
DatasetSplit split_for_evaluation(const Dataset& data, double eval_fraction);

/// How `make_synthetic_classification` builds its data set.
struct SyntheticOptions {
  /// The number of samples N.
  std::size_t samples = 4096;
  /// The number of features per sample D.
  std::int64_t features = 64;
  /// The number of classes.
  int classes = 10;
  /// Selects the data set: equal seeds give bitwise equal data.
  std::uint64_t seed = 0;
  /// Standard deviation of the noise around each class centre; larger is harder. At 3 the
  /// default MLP needs a few hundred steps to pass 90% accuracy: learning is visible.
  float noise = 3.0f;
};

/// A deterministic, learnable classification set: each class has a centre of standard
/// normal features; sample i takes a uniformly drawn label and is its class centre plus
/// `noise` times standard normal noise. Everything is drawn with `CounterRng` from
/// (seed, sample index), so equal options give bitwise equal data on every machine and
/// rank, and the first k samples do not depend on `samples`.
Dataset make_synthetic_classification(const SyntheticOptions& options);

/// Reads a CSV file of numbers, one sample per line with the label (a non-negative
/// integer) in the last column, and multiplies every feature by `feature_scale`. A first
/// line in which no field is a number is a header and is skipped; blank lines are
/// ignored. `name` defaults to the file's stem. A malformed file throws `dp::Error`
/// with the file, line, column and the offending text.
Dataset load_csv(const std::filesystem::path& path, float feature_scale = 1.0f,
                 std::string name = "");

/// The directory holding the data sets that ship with dplab: the environment variable
/// DPLAB_DATASETS if set, otherwise the datasets/ folder of the source tree.
std::filesystem::path datasets_directory();

/// The UCI handwritten digits (8x8 images, 1797 samples, labels 0..9), pixels scaled from
/// 0..16 to [0, 1], read from `datasets_directory()/digits/digits.csv`.
Dataset load_digits();
/// The UCI handwritten digits read from `csv_path` (64 pixel columns, then the label).
Dataset load_digits(const std::filesystem::path& csv_path);

/// Reads an IDX image file (magic 0x00000803: uint8 pixels, big-endian dimensions
/// count, rows, columns) and an IDX label file (magic 0x00000801) as MNIST ships them,
/// uncompressed; pixels are scaled from 0..255 to [0, 1] and images flattened to rows.
/// A malformed file (bad magic, truncated, trailing bytes, label >= 10, counts that
/// differ between the two files) throws `dp::Error` naming the file and byte offset.
Dataset load_idx(const std::filesystem::path& images, const std::filesystem::path& labels);

/// The files a data set spec reads (see `load_dataset`): none for "synthetic", the shipped
/// CSV for "digits", PATH for "csv:PATH", both files for "idx:IMAGES,LABELS", PATH for
/// "text:PATH", the fortune files for "fortunes". Commands use it to refuse an output path
/// that would overwrite their own data. Throws `dp::Error` for a spec `load_dataset` would
/// reject.
std::vector<std::filesystem::path> dataset_files(std::string_view spec);

/// True when `spec` names a text data set, "text:PATH" or "fortunes": one a GPT trains on.
bool is_text_dataset_spec(std::string_view spec);

/// Makes or loads a data set by the name the CLI takes: "synthetic" (default options),
/// "synthetic:N" (N samples), "digits", "csv:PATH", "idx:IMAGES,LABELS", or a text set
/// cut into windows of `text_context` tokens (dp/text_data.h): "text:PATH" (a file) or
/// "fortunes" (the default corpus, Debian's fortunes). `seed` selects the synthetic set and
/// is ignored by the others; `text_context` is needed by the text sets (a GPT's context)
/// and ignored by the others. Any other spec throws `dp::Error` listing the accepted forms,
/// and so does a text spec with `text_context` below 1.
Dataset load_dataset(std::string_view spec, std::uint64_t seed = 0, std::int64_t text_context = 0);

}  // namespace dp
