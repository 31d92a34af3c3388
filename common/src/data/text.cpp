// Text data sets: windows of byte tokens, from a file or from Debian's fortunes.
#include <array>
#include <cstdlib>
#include <utility>

#include "data/file_io.h"
#include "dp/error.h"
#include "dp/memory.h"
#include "dp/text_data.h"
#include "dp/tokenizer.h"

namespace dp {

std::size_t text_window_count(std::size_t tokens, std::int64_t context) {
  if (context < 1)
    throw Error(fmt::format(
        "a text is cut into windows of a GPT's context: expected a context of at least 1 "
        "token, got {}",
        context));
  if (tokens == 0) return 0;
  return (tokens - 1) / static_cast<std::size_t>(context);
}

Dataset make_text_dataset(std::string_view corpus, std::int64_t context, std::string name) {
  const std::size_t windows = text_window_count(corpus.size(), context);
  const std::string what = fmt::format("the text '{}'", name);
  CharTokenizer tokenizer = CharTokenizer::from_corpus(corpus, what);
  if (windows == 0)
    throw Error(fmt::format(
        "{} has {} tokens (bytes), fewer than one window of context + 1 = {} tokens: expected "
        "a longer text or a GPT with a context below {}",
        what, corpus.size(), context + 1, corpus.size()));
  const std::vector<int> ids = tokenizer.encode(corpus, what);
  const auto length = static_cast<std::size_t>(context);
  Dataset data;
  data.name = std::move(name);
  data.num_classes = static_cast<int>(tokenizer.size());
  data.labels_per_sample = context;
  data.features =
      Tensor::uninitialized({static_cast<std::int64_t>(windows), context}, MemoryCategory::kOther);
  data.labels.resize(windows * length);
  float* features = data.features.data();
  for (std::size_t window = 0; window < windows; ++window) {
    const std::size_t start = window * length;
    for (std::size_t t = 0; t < length; ++t) {
      features[start + t] = static_cast<float>(ids[start + t]);
      data.labels[start + t] = ids[start + t + 1];
    }
  }
  data.tokenizer = std::move(tokenizer);
  return data;
}

Dataset load_text(const std::filesystem::path& path, std::int64_t context) {
  // The context first: a bad one must not cost reading a large file.
  text_window_count(0, context);
  const std::string corpus = detail::read_whole_file(path, "text file");
  return make_text_dataset(corpus, context, "text:" + path.string());
}

std::filesystem::path fortunes_directory() {
  if (const char* override_dir = std::getenv("DPLAB_FORTUNES");
      override_dir != nullptr && *override_dir != '\0')
    return override_dir;
  return "/usr/share/games/fortunes";
}

namespace {

// dpkg -L fortunes fortunes-min (1:1.99.1-7.3, Debian 12), the files of fortunes without
// their .dat indexes and .u8 links, in name order. A fixed list, not the directory's
// contents: other packages (fortunes-bofh-excuses, ...) add files there, and the default
// corpus must be the same text on every machine.
constexpr auto kFortuneFiles = std::to_array<std::string_view>(
    {"art",           "ascii-art",  "computers", "cookie",       "debian",   "definitions",
     "disclaimer",    "drugs",      "education", "ethnic",       "food",     "fortunes",
     "goedel",        "humorists",  "kids",      "knghtbrd",     "law",      "linux",
     "linuxcookie",   "literature", "love",      "magic",        "medicine", "men-women",
     "miscellaneous", "news",       "paradoxum", "people",       "perl",     "pets",
     "platitudes",    "politics",   "pratchett", "riddles",      "science",  "songs-poems",
     "sports",        "startrek",   "tao",       "translate-me", "wisdom",   "work",
     "zippy"});

// The package that installs `name` (fortunes-min has the three classics).
std::string_view package_of(std::string_view name) {
  return name == "fortunes" || name == "literature" || name == "riddles" ? "fortunes-min"
                                                                         : "fortunes";
}

}  // namespace

std::span<const std::string_view> fortune_file_names() {
  return kFortuneFiles;
}

std::vector<std::filesystem::path> fortune_files(const std::filesystem::path& directory) {
  std::vector<std::filesystem::path> paths;
  paths.reserve(kFortuneFiles.size());
  for (const std::string_view name : kFortuneFiles) paths.push_back(directory / name);
  return paths;
}

std::string read_fortunes(const std::filesystem::path& directory) {
  std::string corpus;
  for (const std::string_view name : kFortuneFiles) {
    const std::filesystem::path path = directory / name;
    std::error_code error;
    if (!std::filesystem::exists(path, error))
      throw Error(fmt::format(
          "the default corpus 'fortunes' needs '{}', which does not exist: expected the {} "
          "files of Debian's fortunes packages in {} (install them with tools/install-deps, "
          "or `apt-get install {}`), or the directory named by DPLAB_FORTUNES",
          path.string(), kFortuneFiles.size(), directory.string(), package_of(name)));
    corpus += detail::read_whole_file(path, "fortune file");
  }
  return corpus;
}

Dataset load_fortunes(std::int64_t context, const std::filesystem::path& directory) {
  text_window_count(0, context);
  return make_text_dataset(read_fortunes(directory), context, "fortunes");
}

}  // namespace dp
