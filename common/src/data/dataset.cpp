// Batches, splits, the data set names the CLI takes, and the shared file reader.
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <stdexcept>

#include "data/file_io.h"
#include "dp/data.h"
#include "dp/error.h"
#include "dp/memory.h"
#include "dp/text_data.h"

namespace dp {

namespace detail {

std::ifstream open_input_file(const std::filesystem::path& path, std::string_view what) {
  // stat follows a symbolic link: a link to a data file is a fine input.
  struct stat status {};
  if (::stat(path.c_str(), &status) != 0) {
    const int error = errno;
    throw Error(fmt::format("cannot open {} '{}': {}", what, path.string(), std::strerror(error)));
  }
  if (S_ISDIR(status.st_mode))
    throw Error(fmt::format("cannot read {} '{}': it is a directory, expected a file", what,
                            path.string()));
  if (!S_ISREG(status.st_mode))
    throw Error(fmt::format("cannot read {} '{}': it is not a regular file (a FIFO or a device?)",
                            what, path.string()));
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    const int error = errno;
    throw Error(fmt::format("cannot open {} '{}': {}", what, path.string(), std::strerror(error)));
  }
  return file;
}

std::string read_whole_file(const std::filesystem::path& path, std::string_view what) {
  std::ifstream file = open_input_file(path, what);
  // One allocation of the file's size: no doubling buffer, no copy.
  file.seekg(0, std::ios::end);
  const std::streamoff size = file.tellg();
  file.seekg(0, std::ios::beg);
  const auto bytes = static_cast<std::size_t>(std::max<std::streamoff>(size, 0));
  std::string contents;
  // A file larger than memory (or than a string can be) is the input's fault: say so.
  try {
    contents.assign(bytes, '\0');
  } catch (const std::bad_alloc&) {
    throw machine_out_of_memory(fmt::format("the {} '{}'", what, path.string()), bytes);
  } catch (const std::length_error&) {
    throw machine_out_of_memory(fmt::format("the {} '{}'", what, path.string()), bytes);
  }
  file.read(contents.data(), static_cast<std::streamsize>(contents.size()));
  if (!file || file.gcount() != static_cast<std::streamsize>(contents.size()))
    throw Error(fmt::format("cannot read {} '{}': {}", what, path.string(),
                            file.bad() ? std::strerror(errno) : "it changed while being read"));
  return contents;
}

}  // namespace detail

namespace {

// Copies samples [begin, end) of `data` into a new data set with the same classes.
Dataset copy_rows(const Dataset& data, std::size_t begin, std::size_t end, std::string name) {
  const std::int64_t dim = data.feature_dim();
  const auto per_sample = static_cast<std::size_t>(data.labels_per_sample);
  Dataset part;
  part.name = std::move(name);
  part.num_classes = data.num_classes;
  part.labels_per_sample = data.labels_per_sample;
  part.tokenizer = data.tokenizer;
  part.labels.assign(data.labels.begin() + static_cast<std::ptrdiff_t>(begin * per_sample),
                     data.labels.begin() + static_cast<std::ptrdiff_t>(end * per_sample));
  part.features =
      Tensor::uninitialized({static_cast<std::int64_t>(end - begin), dim}, MemoryCategory::kOther);
  const std::size_t row_floats = static_cast<std::size_t>(dim);
  std::copy_n(data.features.data() + begin * row_floats, (end - begin) * row_floats,
              part.features.data());
  return part;
}

}  // namespace

Batch gather_batch(const Dataset& data, std::span<const std::size_t> indices) {
  const std::int64_t dim = data.feature_dim();
  const std::size_t row_floats = static_cast<std::size_t>(dim);
  const auto per_sample = static_cast<std::size_t>(data.labels_per_sample);
  Batch batch;
  batch.inputs = Tensor::uninitialized({static_cast<std::int64_t>(indices.size()), dim},
                                       MemoryCategory::kActivations);
  batch.labels.reserve(indices.size() * per_sample);
  for (std::size_t row = 0; row < indices.size(); ++row) {
    const std::size_t sample = indices[row];
    if (sample >= data.size())
      throw Error(fmt::format(
          "gather_batch: index {} (position {} of the batch) is out of range for data set "
          "'{}' of {} samples: expected an index below {}",
          sample, row, data.name, data.size(), data.size()));
    std::copy_n(data.features.data() + sample * row_floats, row_floats,
                batch.inputs.data() + row * row_floats);
    const auto first_label = data.labels.begin() + static_cast<std::ptrdiff_t>(sample * per_sample);
    batch.labels.insert(batch.labels.end(), first_label,
                        first_label + static_cast<std::ptrdiff_t>(per_sample));
  }
  return batch;
}

DatasetSplit split_for_evaluation(const Dataset& data, double eval_fraction) {
  if (!(eval_fraction >= 0.0 && eval_fraction < 1.0))
    throw Error(
        fmt::format("split_for_evaluation: expected a fraction in [0, 1), got {}", eval_fraction));
  const auto eval_size = static_cast<std::size_t>(eval_fraction * static_cast<double>(data.size()));
  const std::size_t train_size = data.size() - eval_size;
  return {copy_rows(data, 0, train_size, data.name + "/train"),
          copy_rows(data, train_size, data.size(), data.name + "/eval")};
}

std::filesystem::path datasets_directory() {
  if (const char* override_dir = std::getenv("DPLAB_DATASETS");
      override_dir != nullptr && *override_dir != '\0')
    return override_dir;
  return DP_DATASETS_DIR;
}

namespace {

Error invalid_spec(std::string_view spec, std::string_view why) {
  return Error(fmt::format(
      "unknown data set '{}'{}: expected one of 'synthetic', 'synthetic:N' (N samples), "
      "'digits', 'csv:PATH', 'idx:IMAGES,LABELS', 'text:PATH', 'fortunes'",
      spec, why));
}

/// The two paths of "idx:IMAGES,LABELS" (`paths` is what follows "idx:").
std::pair<std::filesystem::path, std::filesystem::path> idx_paths(std::string_view spec,
                                                                  std::string_view paths) {
  const std::size_t comma = paths.find(',');
  if (comma == std::string_view::npos || comma == 0 || comma + 1 == paths.size())
    throw invalid_spec(spec, " (expected two paths separated by a comma after 'idx:')");
  return {std::filesystem::path(paths.substr(0, comma)),
          std::filesystem::path(paths.substr(comma + 1))};
}

}  // namespace

std::vector<std::filesystem::path> dataset_files(std::string_view spec) {
  if (spec == "digits") return {datasets_directory() / "digits" / "digits.csv"};
  if (spec.starts_with("csv:") && spec.size() > 4) return {std::filesystem::path(spec.substr(4))};
  if (spec.starts_with("idx:")) {
    auto [images, labels] = idx_paths(spec, spec.substr(4));
    return {std::move(images), std::move(labels)};
  }
  if (spec == "synthetic" || spec.starts_with("synthetic:")) return {};
  if (spec.starts_with("text:") && spec.size() > 5) return {std::filesystem::path(spec.substr(5))};
  if (spec == "fortunes") return fortune_files();
  throw invalid_spec(spec, "");
}

bool is_text_dataset_spec(std::string_view spec) {
  return spec.starts_with("text:") || spec == "fortunes";
}

Dataset load_dataset(std::string_view spec, std::uint64_t seed, std::int64_t text_context) {
  const auto starts_with = [&](std::string_view prefix) { return spec.starts_with(prefix); };
  const auto invalid = [&](std::string_view why) { return invalid_spec(spec, why); };

  if (spec == "synthetic") {
    SyntheticOptions options;
    options.seed = seed;
    return make_synthetic_classification(options);
  }
  if (starts_with("synthetic:")) {
    const std::string_view count = spec.substr(std::string_view("synthetic:").size());
    std::size_t samples = 0;
    const auto [end, error] = std::from_chars(count.data(), count.data() + count.size(), samples);
    if (error != std::errc() || end != count.data() + count.size() || samples == 0)
      throw invalid(fmt::format(" (the sample count '{}' is not a positive integer)", count));
    SyntheticOptions options;
    options.samples = samples;
    options.seed = seed;
    return make_synthetic_classification(options);
  }
  if (spec == "digits") return load_digits();
  if (starts_with("csv:")) {
    const std::string_view path = spec.substr(4);
    if (path.empty()) throw invalid(" (no path after 'csv:')");
    return load_csv(std::filesystem::path(path));
  }
  if (starts_with("idx:")) {
    const auto [images, labels] = idx_paths(spec, spec.substr(4));
    return load_idx(images, labels);
  }
  if (is_text_dataset_spec(spec) && text_context < 1)
    throw Error(fmt::format(
        "the text data set '{}' is cut into windows of a GPT's context: expected a context of "
        "at least 1 token, got {} (train a GPT on it: --model gpt:...,context=N)",
        spec, text_context));
  if (starts_with("text:")) {
    const std::string_view path = spec.substr(5);
    if (path.empty()) throw invalid(" (no path after 'text:')");
    return load_text(std::filesystem::path(path), text_context);
  }
  if (spec == "fortunes") return load_fortunes(text_context);
  throw invalid("");
}

}  // namespace dp
