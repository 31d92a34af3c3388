// The CSV loader, and the digits set that ships as CSV.
#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <limits>
#include <optional>

#include "data/file_io.h"
#include "dp/data.h"
#include "dp/error.h"
#include "parsers.h"

namespace dp {

namespace {

bool is_blank(char c) {
  return c == ' ' || c == '\t';
}

// The field as a finite number, or nothing if it is not one (empty, text, nan, inf).
std::optional<float> parse_number(std::string_view text) {
  if (text.starts_with('+')) text.remove_prefix(1);  // from_chars rejects a leading '+'
  float value = 0.0f;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size() ||
      !std::isfinite(value))
    return std::nullopt;
  return value;
}

// One comma-separated field, without surrounding blanks.
struct Field {
  std::string text;        // at most kKeptCharacters of it
  bool truncated = false;  // the field is longer than `text`
  std::size_t line = 0;    // 1-based
  std::size_t column = 0;  // 1-based column of its first non-blank character
  bool ends_line = false;  // the last field of its line
  std::string shown() const { return truncated ? text + "..." : text; }
};

// A number is never this long; a longer field is kept only to quote its start.
constexpr std::size_t kKeptCharacters = 512;

// Reads the fields of a CSV stream one by one from a block buffer: no line is ever held
// whole, so a file of one enormous line costs no more memory than one of many short ones.
class FieldReader {
 public:
  explicit FieldReader(std::istream& in) : in_(in) {}

  // The next field; false at the end of the input. A final newline ends the last line
  // without starting another; "\r\n" ends a line as "\n" does.
  bool next(Field& field) {
    if (line_done_) {
      if (peek() == kEnd) return false;
      ++line_;
      column_ = 1;
      line_done_ = false;
    }
    field.text.clear();
    field.truncated = false;
    field.line = line_;
    field.column = 0;
    for (;;) {
      const int c = get();
      if (c == kEnd || c == '\n') {
        field.ends_line = true;
        line_done_ = true;
        break;
      }
      const std::size_t column = column_++;
      if (c == ',') {
        field.ends_line = false;
        break;
      }
      if (field.column == 0) {
        if (is_blank(static_cast<char>(c))) continue;  // a leading blank
        field.column = column;
      }
      if (field.text.size() < kKeptCharacters) {
        field.text.push_back(static_cast<char>(c));
      } else {
        field.truncated = true;
      }
    }
    if (field.column == 0) field.column = column_;  // empty: the column of its end
    // A carriage return before the newline belongs to the line ending (Windows files).
    if (field.ends_line && !field.truncated && field.text.ends_with('\r')) field.text.pop_back();
    while (!field.truncated && !field.text.empty() && is_blank(field.text.back()))
      field.text.pop_back();
    return true;
  }

 private:
  static constexpr int kEnd = -1;

  int peek() {
    if (position_ == filled_ && !refill()) return kEnd;
    return static_cast<unsigned char>(buffer_[position_]);
  }
  int get() {
    const int c = peek();
    if (c != kEnd) ++position_;
    return c;
  }
  bool refill() {
    in_.read(buffer_.data(), static_cast<std::streamsize>(buffer_.size()));
    filled_ = static_cast<std::size_t>(in_.gcount());
    position_ = 0;
    return filled_ > 0;
  }

  std::istream& in_;
  std::array<char, 1 << 16> buffer_{};
  std::size_t filled_ = 0;
  std::size_t position_ = 0;
  std::size_t line_ = 1;
  std::size_t column_ = 1;
  bool line_done_ = false;
};

// What the first pass learns about a file.
struct CsvShape {
  std::size_t samples = 0;
  std::size_t fields = 0;       // per line: the features, then the label
  std::size_t header_line = 0;  // 0 when there is no header
  int max_label = 0;
};

// The first pass: validates every line and counts the samples, keeping nothing per sample.
CsvShape validate_csv(std::istream& in, const std::string& file) {
  CsvShape shape;
  std::size_t fields_line = 0;  // the line that fixed shape.fields
  bool first_line = true;
  // The current line: its field count, numbers, first non-number and last field.
  std::size_t count = 0;
  std::size_t numbers = 0;
  std::optional<std::pair<std::size_t, Field>> first_bad;  // (1-based index, field)
  Field field;
  FieldReader reader(in);
  while (reader.next(field)) {
    ++count;
    const std::optional<float> value = parse_number(field.truncated ? "" : field.text);
    if (value) {
      ++numbers;
    } else if (!first_bad) {
      first_bad.emplace(count, field);
    }
    if (!field.ends_line) continue;

    const std::size_t line = field.line;
    const std::size_t fields = count;
    const std::size_t numeric = numbers;
    const auto bad = std::move(first_bad);
    count = 0;
    numbers = 0;
    first_bad.reset();
    if (fields == 1 && field.text.empty() && !field.truncated) continue;  // a blank line

    if (first_line) {
      first_line = false;
      if (numeric == 0) {  // a header such as "pixel0,...,label"
        shape.fields = fields;
        shape.header_line = line;
        fields_line = line;
        continue;
      }
    }
    if (shape.fields == 0) {
      shape.fields = fields;
      fields_line = line;
    }
    if (fields != shape.fields)
      throw Error(fmt::format("{}:{}: expected {} fields as on line {}, found {}", file, line,
                              shape.fields, fields_line, fields));
    if (fields < 2)
      throw Error(
          fmt::format("{}:{}: expected at least 2 fields (features, then the label), found {}",
                      file, line, fields));
    if (bad && bad->first < fields)
      throw Error(fmt::format("{}:{}:{}: expected a number in field {}, found '{}'", file, line,
                              bad->second.column, bad->first, bad->second.shown()));
    const std::optional<float> label = parse_number(field.truncated ? "" : field.text);
    if (!label || *label < 0.0f || *label != std::floor(*label) ||
        *label >= static_cast<float>(std::numeric_limits<int>::max()))
      throw Error(fmt::format(
          "{}:{}:{}: expected a non-negative integer label in the last field, found '{}'", file,
          line, field.column, field.shown()));
    shape.max_label = std::max(shape.max_label, static_cast<int>(*label));
    ++shape.samples;
  }
  if (in.bad()) throw Error(fmt::format("{}: cannot read the file", file));
  return shape;
}

// The second pass over a validated file: every sample straight into its row.
void fill_csv(std::istream& in, const std::string& file, const CsvShape& shape, float feature_scale,
              Dataset& data) {
  const std::size_t dim = shape.fields - 1;
  float* features = data.features.data();
  std::size_t row = 0;
  std::size_t column = 0;  // index of the field within its line
  float first_value = 0;   // held until the line shows it is not blank
  Field field;
  FieldReader reader(in);
  while (reader.next(field)) {
    const std::size_t index = column++;
    if (field.ends_line) column = 0;
    if (field.line == shape.header_line) continue;
    if (index == 0 && field.ends_line) continue;  // a blank line (validated: no 1-field line)
    const float value = parse_number(field.text).value_or(0.0f);
    if (index == 0) {
      first_value = value;
      continue;
    }
    if (index == 1) features[row * dim] = first_value * feature_scale;
    if (index < dim) {
      features[row * dim + index] = value * feature_scale;
    } else {
      data.labels[row++] = static_cast<int>(value);
    }
  }
  if (in.bad() || row != shape.samples)
    throw Error(fmt::format("{}: the file changed while it was read ({} samples, then {})", file,
                            shape.samples, row));
}

}  // namespace

namespace detail {

Dataset parse_csv(std::istream& in, const std::string& file, float feature_scale,
                  std::string name) {
  const CsvShape shape = validate_csv(in, file);
  if (shape.samples == 0)
    throw Error(fmt::format(
        "{}: no samples found: expected lines of comma-separated numbers, the label last", file));
  Dataset data;
  data.name = std::move(name);
  data.num_classes = shape.max_label + 1;
  // The features first: the larger allocation, which names its size if memory refuses it.
  data.features = Tensor::uninitialized(
      {static_cast<std::int64_t>(shape.samples), static_cast<std::int64_t>(shape.fields - 1)},
      MemoryCategory::kOther);
  data.labels.resize(shape.samples);
  in.clear();
  in.seekg(0);
  if (!in) throw Error(fmt::format("{}: cannot read the file a second time (not seekable)", file));
  fill_csv(in, file, shape, feature_scale, data);
  return data;
}

}  // namespace detail

Dataset load_csv(const std::filesystem::path& path, float feature_scale, std::string name) {
  std::ifstream in = detail::open_input_file(path, "CSV file");
  return detail::parse_csv(in, path.string(), feature_scale,
                           name.empty() ? path.stem().string() : std::move(name));
}

Dataset load_digits() {
  return load_digits(datasets_directory() / "digits" / "digits.csv");
}

Dataset load_digits(const std::filesystem::path& csv_path) {
  constexpr int kPixels = 64;         // 8 x 8 images
  constexpr float kMaxPixel = 16.0f;  // each pixel counts set bits in a 4 x 4 block
  Dataset data = load_csv(csv_path, 1.0f / kMaxPixel, "digits");
  if (data.feature_dim() != kPixels)
    throw Error(fmt::format("{}: expected {} pixel columns and a label per line, found {} columns",
                            csv_path.string(), kPixels, data.feature_dim() + 1));
  for (std::size_t sample = 0; sample < data.size(); ++sample) {
    if (data.labels[sample] > 9)
      throw Error(fmt::format("{}: sample {} has label {}, expected a digit 0..9",
                              csv_path.string(), sample, data.labels[sample]));
  }
  for (std::size_t i = 0; i < data.features.size(); ++i) {
    const float pixel = data.features[i];
    if (pixel < 0.0f || pixel > 1.0f)
      throw Error(fmt::format("{}: sample {} has pixel value {}, expected 0..16", csv_path.string(),
                              i / kPixels, pixel * kMaxPixel));
  }
  data.num_classes = 10;
  return data;
}

}  // namespace dp
