// The CSV loader, and the digits set that ships as CSV.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <optional>

#include "data/file_io.h"
#include "dp/data.h"
#include "dp/error.h"

namespace dp {

namespace {

// One comma-separated field of a line, without surrounding blanks.
struct Field {
  std::string_view text;
  std::size_t column = 0;  // 1-based character column of the field's first character
};

bool is_blank(char c) {
  return c == ' ' || c == '\t';
}

std::vector<Field> split_fields(std::string_view line) {
  std::vector<Field> fields;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = std::min(line.find(',', start), line.size());
    std::size_t begin = start;
    std::size_t end = comma;
    while (begin < end && is_blank(line[begin])) ++begin;
    while (end > begin && is_blank(line[end - 1])) --end;
    fields.push_back({line.substr(begin, end - begin), begin + 1});
    if (comma == line.size()) return fields;
    start = comma + 1;
  }
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

bool is_blank_line(std::string_view line) {
  return std::all_of(line.begin(), line.end(), is_blank);
}

}  // namespace

Dataset load_csv(const std::filesystem::path& path, float feature_scale, std::string name) {
  const std::string text = detail::read_whole_file(path, "CSV file");
  const std::string file = path.string();

  std::vector<float> features;
  std::vector<int> labels;
  std::size_t expected_fields = 0;  // fixed by the header or the first sample
  std::size_t fields_line = 0;      // the line that fixed it
  bool first_line = true;

  std::size_t line_number = 0;
  for (std::size_t line_start = 0; line_start < text.size();) {
    ++line_number;
    const std::size_t newline = std::min(text.find('\n', line_start), text.size());
    std::string_view line(text.data() + line_start, newline - line_start);
    line_start = newline + 1;
    if (line.ends_with('\r')) line.remove_suffix(1);  // files written on Windows
    if (is_blank_line(line)) continue;

    const std::vector<Field> fields = split_fields(line);
    if (first_line) {
      first_line = false;
      const bool any_number = std::any_of(fields.begin(), fields.end(), [](const Field& field) {
        return parse_number(field.text).has_value();
      });
      if (!any_number) {  // a header such as "pixel0,...,label"
        expected_fields = fields.size();
        fields_line = line_number;
        continue;
      }
    }
    if (expected_fields == 0) {
      expected_fields = fields.size();
      fields_line = line_number;
    }
    if (fields.size() != expected_fields)
      throw Error(fmt::format("{}:{}: expected {} fields as on line {}, found {}", file,
                              line_number, expected_fields, fields_line, fields.size()));
    if (fields.size() < 2)
      throw Error(
          fmt::format("{}:{}: expected at least 2 fields (features, then the label), found {}",
                      file, line_number, fields.size()));

    for (std::size_t f = 0; f + 1 < fields.size(); ++f) {
      const std::optional<float> value = parse_number(fields[f].text);
      if (!value)
        throw Error(fmt::format("{}:{}:{}: expected a number in field {}, found '{}'", file,
                                line_number, fields[f].column, f + 1, fields[f].text));
      features.push_back(*value * feature_scale);
    }
    const Field& label_field = fields.back();
    const std::optional<float> label = parse_number(label_field.text);
    if (!label || *label < 0.0f || *label != std::floor(*label) ||
        *label >= static_cast<float>(std::numeric_limits<int>::max()))
      throw Error(fmt::format(
          "{}:{}:{}: expected a non-negative integer label in the last field, found '{}'", file,
          line_number, label_field.column, label_field.text));
    labels.push_back(static_cast<int>(*label));
  }
  if (labels.empty())
    throw Error(fmt::format(
        "{}: no samples found: expected lines of comma-separated numbers, the label last", file));

  Dataset data;
  data.name = name.empty() ? path.stem().string() : std::move(name);
  data.num_classes = *std::max_element(labels.begin(), labels.end()) + 1;
  data.labels = std::move(labels);
  const auto dim = static_cast<std::int64_t>(expected_fields - 1);
  data.features = Tensor::uninitialized({static_cast<std::int64_t>(data.labels.size()), dim},
                                        MemoryCategory::kOther);
  std::copy(features.begin(), features.end(), data.features.data());
  return data;
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
