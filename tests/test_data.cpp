// Tests of the data sets: the synthetic generator, batches and splits, the digits set,
// the CSV and IDX loaders (and their error messages), and the CLI's data set names.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "dp/data.h"
#include "dp/error.h"
#include "test_support.h"

namespace {

namespace fs = std::filesystem;

using dp::testing::test_directory;

fs::path write_file(const fs::path& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary);
  out << contents;
  return path;
}

// Runs `action`, expecting a dp::Error whose message contains every one of `parts`.
void expect_error(const std::function<void()>& action, std::initializer_list<std::string> parts) {
  try {
    action();
    ADD_FAILURE() << "expected a dp::Error, nothing was thrown";
  } catch (const dp::Error& error) {
    const std::string message = error.what();
    for (const std::string& part : parts)
      EXPECT_NE(message.find(part), std::string::npos)
          << "message: " << message << "\nshould contain: " << part;
  }
}

bool same_bytes(const dp::Tensor& a, const dp::Tensor& b) {
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

// --- synthetic ---------------------------------------------------------------------------

TEST(Synthetic, HasTheRequestedShapeAndLabels) {
  dp::SyntheticOptions options;
  options.samples = 500;
  options.features = 12;
  options.classes = 4;
  const dp::Dataset data = dp::make_synthetic_classification(options);
  EXPECT_EQ(data.size(), 500u);
  EXPECT_EQ(data.feature_dim(), 12);
  EXPECT_EQ(data.features.shape(), (std::vector<std::int64_t>{500, 12}));
  EXPECT_EQ(data.features.category(), dp::MemoryCategory::kOther);
  EXPECT_EQ(data.num_classes, 4);
  EXPECT_EQ(data.name, "synthetic:500");
  std::vector<int> per_class(4);
  for (int label : data.labels) {
    ASSERT_GE(label, 0);
    ASSERT_LT(label, 4);
    ++per_class[label];
  }
  for (int count : per_class) EXPECT_GT(count, 80) << "labels should be drawn uniformly";
  for (float value : data.features.span()) ASSERT_TRUE(std::isfinite(value));
}

TEST(Synthetic, DefaultsAre4096By64With10Classes) {
  const dp::Dataset data = dp::make_synthetic_classification({});
  EXPECT_EQ(data.size(), 4096u);
  EXPECT_EQ(data.feature_dim(), 64);
  EXPECT_EQ(data.num_classes, 10);
}

TEST(Synthetic, SameOptionsGiveBitwiseEqualData) {
  dp::SyntheticOptions options;
  options.samples = 300;
  options.seed = 11;
  const dp::Dataset a = dp::make_synthetic_classification(options);
  const dp::Dataset b = dp::make_synthetic_classification(options);
  EXPECT_TRUE(same_bytes(a.features, b.features));
  EXPECT_EQ(a.labels, b.labels);

  options.seed = 12;
  const dp::Dataset other = dp::make_synthetic_classification(options);
  EXPECT_FALSE(same_bytes(a.features, other.features));
}

TEST(Synthetic, FirstSamplesDoNotDependOnTheSampleCount) {
  dp::SyntheticOptions options;
  options.samples = 1000;
  const dp::Dataset large = dp::make_synthetic_classification(options);
  options.samples = 37;
  const dp::Dataset small = dp::make_synthetic_classification(options);
  EXPECT_EQ(std::memcmp(small.features.data(), large.features.data(), small.features.bytes()), 0);
  EXPECT_TRUE(std::equal(small.labels.begin(), small.labels.end(), large.labels.begin()));
}

TEST(Synthetic, IsLearnableByANearestCentreClassifier) {
  // Class means estimated on the first half classify the second half far above chance
  // (10%); without class structure they would not.
  dp::SyntheticOptions options;
  options.samples = 2000;
  options.noise = 2.0f;
  const dp::Dataset data = dp::make_synthetic_classification(options);
  const std::int64_t dim = data.feature_dim();
  const std::size_t half = data.size() / 2;
  std::vector<double> means(static_cast<std::size_t>(data.num_classes * dim));
  std::vector<int> counts(static_cast<std::size_t>(data.num_classes));
  for (std::size_t i = 0; i < half; ++i) {
    ++counts[data.labels[i]];
    for (std::int64_t d = 0; d < dim; ++d)
      means[data.labels[i] * dim + d] += data.features.at(static_cast<std::int64_t>(i), d);
  }
  for (int c = 0; c < data.num_classes; ++c)
    for (std::int64_t d = 0; d < dim; ++d) means[c * dim + d] /= counts[c];

  int correct = 0;
  for (std::size_t i = half; i < data.size(); ++i) {
    int best = -1;
    double best_distance = 0;
    for (int c = 0; c < data.num_classes; ++c) {
      double distance = 0;
      for (std::int64_t d = 0; d < dim; ++d) {
        const double diff = data.features.at(static_cast<std::int64_t>(i), d) - means[c * dim + d];
        distance += diff * diff;
      }
      if (best < 0 || distance < best_distance) {
        best = c;
        best_distance = distance;
      }
    }
    if (best == data.labels[i]) ++correct;
  }
  const double accuracy = double(correct) / double(data.size() - half);
  EXPECT_GT(accuracy, 0.8);
}

TEST(Synthetic, RejectsUnusableOptions) {
  dp::SyntheticOptions options;
  options.samples = 0;
  expect_error([&] { dp::make_synthetic_classification(options); }, {"at least 1 sample"});
  options = {};
  options.features = 0;
  expect_error([&] { dp::make_synthetic_classification(options); }, {"feature count", "0"});
  options = {};
  options.classes = 1;
  expect_error([&] { dp::make_synthetic_classification(options); }, {"at least 2 classes"});
  options = {};
  options.noise = -1.0f;
  expect_error([&] { dp::make_synthetic_classification(options); }, {"noise", "-1"});
}

// --- batches and splits ------------------------------------------------------------------

TEST(GatherBatch, CopiesTheRequestedRowsInOrder) {
  dp::SyntheticOptions options;
  options.samples = 20;
  options.features = 5;
  const dp::Dataset data = dp::make_synthetic_classification(options);
  const std::vector<std::size_t> rows = {7, 0, 19, 7};
  const dp::Batch batch = dp::gather_batch(data, rows);
  EXPECT_EQ(batch.inputs.shape(), (std::vector<std::int64_t>{4, 5}));
  EXPECT_EQ(batch.inputs.category(), dp::MemoryCategory::kActivations);
  ASSERT_EQ(batch.labels.size(), 4u);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    EXPECT_EQ(batch.labels[r], data.labels[rows[r]]);
    for (std::int64_t d = 0; d < 5; ++d)
      EXPECT_EQ(batch.inputs.at(static_cast<std::int64_t>(r), d),
                data.features.at(static_cast<std::int64_t>(rows[r]), d));
  }
}

TEST(GatherBatch, RejectsAnIndexPastTheEnd) {
  dp::SyntheticOptions options;
  options.samples = 20;
  const dp::Dataset data = dp::make_synthetic_classification(options);
  const std::vector<std::size_t> rows = {3, 20};
  expect_error([&] { dp::gather_batch(data, rows); }, {"index 20", "20 samples", "position 1"});
}

TEST(SplitForEvaluation, HoldsOutTheLastFraction) {
  dp::SyntheticOptions options;
  options.samples = 103;
  options.features = 3;
  const dp::Dataset data = dp::make_synthetic_classification(options);
  const dp::DatasetSplit split = dp::split_for_evaluation(data, 0.2);
  ASSERT_EQ(split.eval.size(), 20u);
  ASSERT_EQ(split.train.size(), 83u);
  EXPECT_EQ(split.train.num_classes, data.num_classes);
  EXPECT_EQ(split.eval.features.shape(), (std::vector<std::int64_t>{20, 3}));
  EXPECT_EQ(split.eval.labels[0], data.labels[83]);
  EXPECT_EQ(split.eval.features.at(19, 2), data.features.at(102, 2));
  EXPECT_EQ(split.train.features.at(82, 1), data.features.at(82, 1));
  expect_error([&] { dp::split_for_evaluation(data, 1.0); }, {"[0, 1)", "1"});
}

// --- digits ------------------------------------------------------------------------------

void expect_digits(const dp::Dataset& digits) {
  EXPECT_EQ(digits.name, "digits");
  ASSERT_EQ(digits.size(), 1797u);
  ASSERT_EQ(digits.feature_dim(), 64);
  EXPECT_EQ(digits.num_classes, 10);
  std::vector<int> per_class(10);
  for (int label : digits.labels) {
    ASSERT_GE(label, 0);
    ASSERT_LE(label, 9);
    ++per_class[label];
  }
  for (int count : per_class) EXPECT_GT(count, 150);
  for (float pixel : digits.features.span()) {
    ASSERT_GE(pixel, 0.0f);
    ASSERT_LE(pixel, 1.0f);
  }
  // The first line of digits.csv: a zero.
  const std::vector<int> first_row = {0, 0, 5,  13, 9,  1,  0, 0, 0, 0, 13, 15, 10, 15, 5, 0,
                                      0, 3, 15, 2,  0,  11, 8, 0, 0, 4, 12, 0,  0,  8,  8, 0,
                                      0, 5, 8,  0,  0,  9,  8, 0, 0, 4, 11, 0,  1,  12, 7, 0,
                                      0, 2, 14, 5,  10, 12, 0, 0, 0, 0, 6,  13, 10, 0,  0, 0};
  for (std::int64_t d = 0; d < 64; ++d)
    EXPECT_EQ(digits.features.at(0, d), static_cast<float>(first_row[d]) / 16.0f) << "pixel " << d;
  EXPECT_EQ(digits.labels[0], 0);
  EXPECT_EQ(digits.labels[1], 1);
  EXPECT_EQ(digits.labels[1796], 8);
}

TEST(Digits, LoadsTheShippedSet) {
  expect_digits(dp::load_digits());
}

TEST(Digits, LoadsByPathAndByName) {
  expect_digits(dp::load_digits(fs::path(DP_DATASETS_DIR) / "digits" / "digits.csv"));
  expect_digits(dp::load_dataset("digits"));
}

// Sets an environment variable for one scope and restores its previous state after.
class ScopedEnvironment {
 public:
  ScopedEnvironment(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) previous_ = old;
    if (value != nullptr)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnvironment() {
    if (previous_)
      setenv(name_, previous_->c_str(), 1);
    else
      unsetenv(name_);
  }
  ScopedEnvironment(const ScopedEnvironment&) = delete;
  ScopedEnvironment& operator=(const ScopedEnvironment&) = delete;

 private:
  const char* name_;
  std::optional<std::string> previous_;
};

TEST(Digits, DatasetsDirectoryCanBeOverriddenByTheEnvironment) {
  const fs::path dir = test_directory();
  fs::create_directories(dir / "digits");
  std::string row;
  for (int pixel = 0; pixel < 64; ++pixel) row += std::to_string(pixel % 17) + ",";
  write_file(dir / "digits" / "digits.csv", row + "3\n" + row + "9\n");
  {
    const ScopedEnvironment override_dir("DPLAB_DATASETS", dir.c_str());
    EXPECT_EQ(dp::datasets_directory(), dir);
    const dp::Dataset digits = dp::load_digits();
    EXPECT_EQ(digits.size(), 2u);
    EXPECT_EQ(digits.labels, (std::vector<int>{3, 9}));
    EXPECT_EQ(digits.features.at(1, 16), 16.0f / 16.0f);
  }
  const ScopedEnvironment unset("DPLAB_DATASETS", nullptr);
  EXPECT_EQ(dp::datasets_directory(), fs::path(DP_DATASETS_DIR));
}

TEST(Digits, RejectsAFileOfTheWrongShape) {
  const fs::path csv = write_file(test_directory() / "wrong.csv", "1,2,3,4\n");
  expect_error([&] { dp::load_digits(csv); }, {"wrong.csv", "64 pixel columns", "found 4"});
}

// --- CSV ---------------------------------------------------------------------------------

TEST(Csv, ReadsFeaturesAndTheLabelInTheLastColumn) {
  const fs::path csv = write_file(test_directory() / "tiny.csv",
                                  "x1, x2 ,label\r\n"  // header, Windows line ends
                                  "1.5,-2,0\r\n"
                                  "\n"
                                  " 3e1 ,+4,2\r\n"
                                  "5,6,1");  // no final newline
  const dp::Dataset data = dp::load_csv(csv, 0.5f);
  EXPECT_EQ(data.name, "tiny");
  ASSERT_EQ(data.size(), 3u);
  EXPECT_EQ(data.feature_dim(), 2);
  EXPECT_EQ(data.labels, (std::vector<int>{0, 2, 1}));
  EXPECT_EQ(data.num_classes, 3);
  const std::vector<float> expected = {0.75f, -1.0f, 15.0f, 2.0f, 2.5f, 3.0f};
  EXPECT_EQ(std::vector<float>(data.features.span().begin(), data.features.span().end()), expected);
  EXPECT_EQ(dp::load_csv(csv, 1.0f, "renamed").name, "renamed");
}

TEST(Csv, NamesTheLineAndColumnOfANonNumber) {
  const fs::path csv = write_file(test_directory() / "bad.csv", "1,2,0\n3, abc,1\n");
  expect_error([&] { dp::load_csv(csv); }, {"bad.csv:2:4", "field 2", "'abc'"});
}

TEST(Csv, NamesARaggedRow) {
  const fs::path csv = write_file(test_directory() / "ragged.csv", "1,2,0\n3,1\n");
  expect_error([&] { dp::load_csv(csv); },
               {"ragged.csv:2", "expected 3 fields as on line 1", "found 2"});
}

TEST(Csv, RejectsAnEmptyFileOrAHeaderAlone) {
  const fs::path dir = test_directory();
  const fs::path empty = write_file(dir / "empty.csv", "");
  expect_error([&] { dp::load_csv(empty); }, {"empty.csv", "no samples"});
  const fs::path header_only = write_file(dir / "header.csv", "a,b,label\n\n");
  expect_error([&] { dp::load_csv(header_only); }, {"header.csv", "no samples"});
}

TEST(Csv, RejectsALabelThatIsNotANonNegativeInteger) {
  const fs::path dir = test_directory();
  const fs::path fractional = write_file(dir / "fractional.csv", "1,2,0\n1,2,2.5\n");
  expect_error([&] { dp::load_csv(fractional); }, {"fractional.csv:2:5", "label", "'2.5'"});
  const fs::path negative = write_file(dir / "negative.csv", "1,2,-1\n");
  expect_error([&] { dp::load_csv(negative); }, {"negative.csv:1:5", "'-1'"});
}

TEST(Csv, RejectsASingleColumn) {
  const fs::path csv = write_file(test_directory() / "one.csv", "1\n2\n");
  expect_error([&] { dp::load_csv(csv); }, {"one.csv:1", "at least 2 fields"});
}

TEST(Csv, RejectsAMissingFile) {
  expect_error([&] { dp::load_csv(test_directory() / "absent.csv"); },
               {"cannot open", "absent.csv"});
}

TEST(Csv, RejectsADirectoryInsteadOfReadingItAsEmpty) {
  // Before: a directory opened fine and read as a file of no samples.
  const fs::path dir = test_directory();
  fs::create_directory(dir / "data.csv");
  expect_error([&] { dp::load_csv(dir / "data.csv"); }, {"data.csv", "is a directory"});
  expect_error([&] { dp::load_dataset("csv:" + (dir / "data.csv").string()); }, {"is a directory"});
  expect_error([&] { dp::load_idx(dir / "data.csv", dir / "data.csv"); }, {"is a directory"});
}

TEST(Csv, QuotesTheStartOfAnEnormousField) {
  const std::string huge(100000, '7');
  const fs::path csv = write_file(test_directory() / "huge.csv", "1,2,0\n1," + huge + "x,1\n");
  try {
    dp::load_csv(csv);
    ADD_FAILURE() << "expected a dp::Error";
  } catch (const dp::Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("huge.csv:2:3: expected a number in field 2, found '777"),
              std::string::npos)
        << message.substr(0, 200);
    EXPECT_LT(message.size(), 1000u) << "the message quotes the start of the field only";
  }
}

TEST(Csv, ReadsLinesLongerThanTheReadBlock) {
  // 20000 features per line: each line spans several of the loader's 64 KiB blocks.
  std::string text;
  for (int line = 0; line < 3; ++line) {
    for (int f = 0; f < 20000; ++f) text += std::to_string((f + line) % 7) + ",";
    text += std::to_string(line) + "\n";
  }
  const dp::Dataset data = dp::load_csv(write_file(test_directory() / "wide.csv", text));
  ASSERT_EQ(data.size(), 3u);
  EXPECT_EQ(data.feature_dim(), 20000);
  EXPECT_EQ(data.labels, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(data.features[2 * 20000 + 19999], static_cast<float>((19999 + 2) % 7));
}

// --- IDX ---------------------------------------------------------------------------------

std::string big_endian(std::uint32_t value) {
  return {static_cast<char>(value >> 24), static_cast<char>(value >> 16),
          static_cast<char>(value >> 8), static_cast<char>(value)};
}

std::string idx_images(std::uint32_t count, std::uint32_t rows, std::uint32_t cols,
                       const std::vector<unsigned char>& pixels) {
  return big_endian(0x00000803) + big_endian(count) + big_endian(rows) + big_endian(cols) +
         std::string(pixels.begin(), pixels.end());
}

std::string idx_labels(const std::vector<unsigned char>& labels) {
  return big_endian(0x00000801) + big_endian(static_cast<std::uint32_t>(labels.size())) +
         std::string(labels.begin(), labels.end());
}

// Three 2 x 3 images whose pixel values count up from 0 to 255 in steps of 15.
std::vector<unsigned char> sample_pixels() {
  std::vector<unsigned char> pixels;
  for (int i = 0; i < 18; ++i) pixels.push_back(static_cast<unsigned char>(i * 15));
  return pixels;
}

TEST(Idx, ReadsImagesAndLabels) {
  const fs::path dir = test_directory();
  const fs::path images = write_file(dir / "train-images", idx_images(3, 2, 3, sample_pixels()));
  const fs::path labels = write_file(dir / "train-labels", idx_labels({7, 0, 9}));
  const dp::Dataset data = dp::load_idx(images, labels);
  EXPECT_EQ(data.name, "train-images");
  EXPECT_EQ(data.features.shape(), (std::vector<std::int64_t>{3, 6}));
  EXPECT_EQ(data.features.category(), dp::MemoryCategory::kOther);
  EXPECT_EQ(data.labels, (std::vector<int>{7, 0, 9}));
  EXPECT_EQ(data.num_classes, 10);
  for (std::size_t i = 0; i < 18; ++i)
    EXPECT_EQ(data.features[i], static_cast<float>(i * 15) / 255.0f) << "pixel " << i;
  EXPECT_EQ(data.features[17], 1.0f);

  const dp::Dataset by_name = dp::load_dataset("idx:" + images.string() + "," + labels.string());
  EXPECT_EQ(by_name.labels, data.labels);
}

TEST(Idx, RejectsABadMagicNumber) {
  const fs::path dir = test_directory();
  // An image file given as the label file: a classic mix-up.
  const fs::path images = write_file(dir / "images", idx_images(3, 2, 3, sample_pixels()));
  expect_error([&] { dp::load_idx(images, images); },
               {"label file", "bad magic number at byte offset 0", "0x00000801", "0x00000803"});
  const fs::path labels = write_file(dir / "labels", idx_labels({1, 2, 3}));
  expect_error([&] { dp::load_idx(labels, labels); },
               {"image file", "byte offset 0", "expected 0x00000803", "found 0x00000801"});
}

TEST(Idx, RejectsTruncatedFiles) {
  const fs::path dir = test_directory();
  std::vector<unsigned char> pixels = sample_pixels();
  pixels.pop_back();
  const fs::path images = write_file(dir / "short-images", idx_images(3, 2, 3, pixels));
  const fs::path labels = write_file(dir / "labels", idx_labels({1, 2, 3}));
  expect_error([&] { dp::load_idx(images, labels); },
               {"short-images", "truncated", "byte offset 16", "byte offset 33"});

  const fs::path header =
      write_file(dir / "header-only", big_endian(0x00000803) + std::string(2, '\0'));
  expect_error([&] { dp::load_idx(header, labels); },
               {"header-only", "truncated", "16 bytes", "byte offset 6"});

  const fs::path good_images = write_file(dir / "images", idx_images(3, 2, 3, sample_pixels()));
  const fs::path short_labels =
      write_file(dir / "short-labels", big_endian(0x00000801) + big_endian(3) + "\x01");
  expect_error([&] { dp::load_idx(good_images, short_labels); },
               {"short-labels", "truncated", "byte offset 8", "byte offset 9"});
}

TEST(Idx, RejectsTrailingBytes) {
  const fs::path dir = test_directory();
  const fs::path images = write_file(dir / "images", idx_images(3, 2, 3, sample_pixels()) + "xy");
  const fs::path labels = write_file(dir / "labels", idx_labels({1, 2, 3}));
  expect_error([&] { dp::load_idx(images, labels); },
               {"images", "2 unexpected bytes", "byte offset 34"});
}

TEST(Idx, RejectsCountsThatDiffer) {
  const fs::path dir = test_directory();
  const fs::path images = write_file(dir / "images", idx_images(3, 2, 3, sample_pixels()));
  const fs::path labels = write_file(dir / "labels", idx_labels({1, 2}));
  expect_error([&] { dp::load_idx(images, labels); },
               {"holds 2 labels", "byte offset 4", "holds 3 images"});
}

TEST(Idx, RejectsALabelOfTenOrMore) {
  const fs::path dir = test_directory();
  const fs::path images = write_file(dir / "images", idx_images(3, 2, 3, sample_pixels()));
  const fs::path labels = write_file(dir / "labels", idx_labels({1, 10, 3}));
  expect_error([&] { dp::load_idx(images, labels); },
               {"labels", "label 10 at byte offset 9", "0..9"});
}

// --- data set names ----------------------------------------------------------------------

TEST(LoadDataset, MakesSyntheticSetsBySpec) {
  const dp::Dataset defaults = dp::load_dataset("synthetic", 5);
  EXPECT_EQ(defaults.size(), 4096u);
  const dp::Dataset small = dp::load_dataset("synthetic:100", 5);
  EXPECT_EQ(small.size(), 100u);
  EXPECT_EQ(std::memcmp(small.features.data(), defaults.features.data(), small.features.bytes()),
            0);
  const dp::Dataset other_seed = dp::load_dataset("synthetic:100", 6);
  EXPECT_FALSE(same_bytes(small.features, other_seed.features));
}

TEST(LoadDataset, ReadsCsvBySpec) {
  const fs::path csv = write_file(test_directory() / "set.csv", "1,2,1\n3,4,0\n");
  const dp::Dataset data = dp::load_dataset("csv:" + csv.string());
  EXPECT_EQ(data.size(), 2u);
  EXPECT_EQ(data.labels, (std::vector<int>{1, 0}));
}

TEST(LoadDataset, ListsTheAcceptedFormsForAnUnknownSpec) {
  for (const char* spec : {"mnist", "synthetic:", "synthetic:12x", "synthetic:0",
                           "csv:", "idx:images-only", "idx:,labels", ""}) {
    SCOPED_TRACE(spec);
    expect_error([&] { dp::load_dataset(spec); },
                 {"synthetic:N", "digits", "csv:PATH", "idx:IMAGES,LABELS"});
  }
}

}  // namespace
