// safetensors files: writing and strictly validating reading.
//
// Layout (https://github.com/huggingface/safetensors, "Format"):
//
//   bytes [0, 8)          N, the header length, unsigned 64-bit little-endian
//   bytes [8, 8 + N)      JSON header, UTF-8, may end in spaces
//   bytes [8 + N, end)    data section; "data_offsets" are relative to its start
#include "dp/checkpoint.h"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string_view>
#include <vector>

#include "data/file_io.h"
#include "dp/error.h"
#include "dp/output_file.h"
#include "parsers.h"

namespace dp {

// Tensors are copied to and from the file as they lie in memory, which is the
// little-endian layout the format prescribes only on a little-endian machine.
static_assert(std::endian::native == std::endian::little,
              "safetensors I/O assumes a little-endian machine");

namespace {

constexpr std::string_view kMetadataKey = "__metadata__";
constexpr std::size_t kLengthBytes = 8;  // the header length field
constexpr std::size_t kHeaderAlignment = 8;

/// The safetensors dtype of a tensor's element type.
std::string_view dtype_name(DataType type) {
  switch (type) {
    case DataType::kBFloat16: return "BF16";
    case DataType::kFloat16: return "F16";
    default: return "F32";
  }
}

// One tensor entry of a header, checked against the data section.
struct Entry {
  std::string name;
  DataType type = DataType::kFloat32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  // data_offsets, relative to the data section
  std::uint64_t end = 0;
};

// Parses and checks the header entry `name`; `data_start` and `data_size` locate the data
// section in the file so that errors can name file byte offsets.
Entry parse_entry(const std::string& file, const std::string& name, const nlohmann::json& value,
                  std::uint64_t data_start, std::uint64_t data_size, LoadTypes types) {
  const std::uint64_t header_end = data_start;
  const auto fail = [&](std::string_view problem) {
    return Error(
        fmt::format("safetensors file '{}': header (byte offsets {} to {}): tensor "
                    "'{}' {}",
                    file, kLengthBytes, header_end, name, problem));
  };
  if (!value.is_object())
    throw fail(fmt::format("is described by {}, expected an object", value.dump()));
  const auto field = [&](const char* key) -> const nlohmann::json& {
    const auto it = value.find(key);
    if (it == value.end()) throw fail(fmt::format("has no \"{}\" field", key));
    return *it;
  };

  const nlohmann::json& dtype = field("dtype");
  if (!dtype.is_string())
    throw fail(fmt::format("has \"dtype\": {}, expected a string", dtype.dump()));
  Entry entry;
  entry.name = name;
  const std::string dtype_text = dtype.get<std::string>();
  if (dtype_text == "BF16" && types == LoadTypes::kAll)
    entry.type = DataType::kBFloat16;
  else if (dtype_text == "F16" && types == LoadTypes::kAll)
    entry.type = DataType::kFloat16;
  else if (dtype_text != "F32")
    throw fail(fmt::format("has dtype {}: {}", dtype.dump(),
                           types == LoadTypes::kAll
                               ? "dplab reads \"F32\", \"BF16\" and \"F16\""
                               : "expected \"F32\" (float32), the only dtype read here"));
  const nlohmann::json& shape = field("shape");
  if (!shape.is_array())
    throw fail(fmt::format("has \"shape\": {}, expected an array of extents", shape.dump()));
  std::uint64_t elements = 1;
  bool elements_overflow = false;
  for (const nlohmann::json& extent : shape) {
    if (!extent.is_number_unsigned() ||
        extent.get<std::uint64_t>() >
            static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      throw fail(fmt::format("has \"shape\": {}, expected non-negative integers", shape.dump()));
    const auto n = extent.get<std::uint64_t>();
    if (n != 0 && elements > std::numeric_limits<std::uint64_t>::max() / n)
      elements_overflow = true;
    elements *= n;
    entry.shape.push_back(static_cast<std::int64_t>(n));
  }
  if (std::find(entry.shape.begin(), entry.shape.end(), 0) != entry.shape.end())
    elements_overflow = false;  // a zero extent makes the product 0 whatever came before

  const nlohmann::json& offsets = field("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned())
    throw fail(fmt::format("has \"data_offsets\": {}, expected [begin, end]", offsets.dump()));
  entry.begin = offsets[0].get<std::uint64_t>();
  entry.end = offsets[1].get<std::uint64_t>();
  if (entry.begin > entry.end)
    throw fail(
        fmt::format("has \"data_offsets\" [{}, {}]: begin after end", entry.begin, entry.end));
  if (entry.end > data_size)
    throw fail(
        fmt::format("has \"data_offsets\" [{}, {}] (file byte offsets {} to {}) past "
                    "the end of the {}-byte data section, which ends at byte offset {}",
                    entry.begin, entry.end, data_start + entry.begin, data_start + entry.end,
                    data_size, data_start + data_size));
  // Compare elements, not bytes: elements * 4 could wrap around for a corrupt shape.
  const std::uint64_t span_bytes = entry.end - entry.begin;
  const std::size_t element_bytes = element_size(entry.type);
  if (elements_overflow || span_bytes % element_bytes != 0 ||
      elements != span_bytes / element_bytes)
    throw fail(fmt::format(
        "has shape {} ({} {} elements) but \"data_offsets\" [{}, {}] "
        "span {} bytes (from byte offset {}), expected {} per element",
        shape.dump(), elements_overflow ? "more than 2^64" : std::to_string(elements), dtype_text,
        entry.begin, entry.end, span_bytes, data_start + entry.begin, element_bytes));
  return entry;
}

std::string hex32(std::uint32_t value) {
  return fmt::format("{:08x}", value);
}

/// The header as its checksum covers it: compact JSON, keys sorted (nlohmann::json's map
/// sorts them), without the checksums' entry, so that the writer and a reader that parsed
/// the file produce the same text whatever the spacing and key order in the file.
std::string canonical_header(nlohmann::json header) {
  const auto metadata = header.find(kMetadataKey);
  if (metadata != header.end() && metadata->is_object()) {
    metadata->erase(kChecksumKey);
    if (metadata->empty()) header.erase(metadata);
  }
  return header.dump();
}

/// Checks the checksums of a parsed file, if it records them; returns whether it did.
/// `header` is the whole parsed header; `data` the tensors' bytes by name.
bool verify_checksums(const std::string& file, const nlohmann::json& header,
                      const std::map<std::string, std::string_view>& data) {
  const auto metadata = header.find(kMetadataKey);
  if (metadata == header.end() || !metadata->contains(kChecksumKey)) return false;
  const auto fail = [&](std::string_view problem) {
    return Error(fmt::format(
        "safetensors file '{}': {}: the file was changed or damaged after it was written "
        "(refusing to load it)",
        file, problem));
  };
  nlohmann::json sums;
  try {
    sums = nlohmann::json::parse(metadata->at(kChecksumKey).get<std::string>());
  } catch (const nlohmann::json::exception&) {
    throw fail(fmt::format("its metadata \"{}\" is not the JSON of checksums", kChecksumKey));
  }
  if (!sums.is_object() || !sums.contains("header") || !sums["header"].is_string() ||
      !sums.contains("data") || !sums["data"].is_object())
    throw fail(
        fmt::format("its metadata \"{}\" is {}, expected {{\"header\": ..., \"data\": "
                    "{{...}}}}",
                    kChecksumKey, sums.dump()));
  const std::string canonical = canonical_header(header);
  const std::string header_sum = hex32(crc32(canonical.data(), canonical.size()));
  if (sums["header"] != header_sum)
    throw fail(fmt::format(
        "the header (the tensors' names, shapes and offsets, and the metadata such as the step "
        "counts) has checksum {}, but {} was recorded",
        header_sum, sums["header"].dump()));
  for (const auto& [name, bytes] : data) {
    const auto recorded = sums["data"].find(name);
    if (recorded == sums["data"].end())
      throw fail(fmt::format("tensor '{}' has no recorded checksum", name));
    const std::string sum = hex32(crc32(bytes.data(), bytes.size()));
    if (*recorded != sum)
      throw fail(fmt::format("the data of tensor '{}' has checksum {}, but {} was recorded", name,
                             sum, recorded->dump()));
  }
  for (const auto& [name, sum] : sums["data"].items())
    if (!data.contains(name))
      throw fail(fmt::format("a checksum is recorded for tensor '{}', which the file does not hold",
                             name));
  return true;
}

}  // namespace

std::uint32_t crc32(const void* bytes, std::size_t count, std::uint32_t crc) {
  // zlib's CRC-32; crc32_z takes a 64-bit length, so one call covers a tensor of any size.
  if (count == 0) return crc;
  return static_cast<std::uint32_t>(
      ::crc32_z(crc, static_cast<const Bytef*>(bytes), static_cast<z_size_t>(count)));
}

void save_safetensors(const std::filesystem::path& path, std::span<const NamedTensor> tensors,
                      const std::map<std::string, std::string>& metadata, Checksums checksums) {
  const std::string file = path.string();
  // ordered_json keeps the entries in the order of the data, which makes the header
  // easy to read next to the bytes.
  if (metadata.contains(kChecksumKey))
    throw Error(
        fmt::format("save_safetensors '{}': the metadata key '{}' is reserved for checksums", file,
                    kChecksumKey));
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty() || checksums == Checksums::kWrite)
    header[std::string(kMetadataKey)] = metadata;
  std::uint64_t offset = 0;
  for (const NamedTensor& named : tensors) {
    if (named.tensor == nullptr)
      throw Error(
          fmt::format("save_safetensors '{}': tensor '{}' is a null pointer", file, named.name));
    if (named.name == kMetadataKey)
      throw Error(fmt::format("save_safetensors '{}': the name '{}' is reserved for metadata", file,
                              kMetadataKey));
    if (header.contains(named.name))
      throw Error(
          fmt::format("save_safetensors '{}': tensor name '{}' appears twice", file, named.name));
    // A default-constructed tensor has no shape and no elements; shape [] would mean a
    // scalar of one element, so it cannot be written faithfully.
    if (named.tensor->rank() == 0 && named.tensor->empty())
      throw Error(fmt::format("save_safetensors '{}': tensor '{}' is empty (it has no shape)", file,
                              named.name));
    const std::uint64_t bytes = named.tensor->bytes();
    header[named.name] = {{"dtype", dtype_name(named.tensor->dtype())},
                          {"shape", named.tensor->shape()},
                          {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }

  std::string header_text;
  try {
    if (checksums == Checksums::kWrite) {
      // The data's sums first (a device tensor is copied one at a time, so that no more
      // than one extra tensor is held), then the header's without the entry itself.
      nlohmann::ordered_json data_sums = nlohmann::ordered_json::object();
      for (const NamedTensor& named : tensors) {
        std::uint32_t sum = 0;
        if (named.tensor->empty()) {
          sum = crc32(nullptr, 0);
        } else if (named.tensor->device() == Device::kHost) {
          sum = crc32(named.tensor->view().raw_data(), named.tensor->bytes());
        } else {
          const Tensor host_copy = named.tensor->to(Device::kHost);
          sum = crc32(host_copy.view().raw_data(), host_copy.bytes());
        }
        data_sums[named.name] = hex32(sum);
      }
      const std::string canonical = canonical_header(nlohmann::json(header));
      const nlohmann::ordered_json sums = {
          {"header", hex32(crc32(canonical.data(), canonical.size()))},
          {"data", std::move(data_sums)}};
      header[std::string(kMetadataKey)][kChecksumKey] = sums.dump();
    }
    header_text = header.dump();
  } catch (const nlohmann::json::exception& error) {
    throw Error(
        fmt::format("save_safetensors '{}': a name or metadata string is not valid "
                    "UTF-8 ({})",
                    file, error.what()));
  }
  // Padding keeps the data section 8-byte aligned in the file, as the format recommends.
  header_text.append((kHeaderAlignment - header_text.size() % kHeaderAlignment) % kHeaderAlignment,
                     ' ');

  // A unique temporary file, fsync and rename: see dp/output_file.h.
  AtomicFile out(path);
  const std::uint64_t header_length = header_text.size();  // little-endian: see above
  out.write(&header_length, sizeof header_length);
  out.write(header_text);
  for (const NamedTensor& named : tensors) {
    if (named.tensor->empty()) continue;
    if (named.tensor->device() == Device::kHost) {
      out.write(named.tensor->view().raw_data(), named.tensor->bytes());
    } else {
      const Tensor host_copy = named.tensor->to(Device::kHost);  // device memory: via the host
      out.write(host_copy.view().raw_data(), host_copy.bytes());
    }
  }
  out.commit();
}

Checkpoint load_safetensors(const std::filesystem::path& path, MemoryCategory category,
                            LoadTypes types) {
  return detail::parse_safetensors(detail::read_whole_file(path, "safetensors file"), path.string(),
                                   category, types);
}

namespace detail {

Checkpoint parse_safetensors(std::string_view bytes, const std::string& file,
                             MemoryCategory category, LoadTypes types) {
  if (bytes.size() < kLengthBytes)
    throw Error(
        fmt::format("safetensors file '{}' is {} bytes long: expected at least the "
                    "8-byte header length at byte offset 0",
                    file, bytes.size()));
  std::uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), sizeof header_length);
  if (header_length > bytes.size() - kLengthBytes)
    throw Error(
        fmt::format("safetensors file '{}': the header length at byte offset 0 is {}, "
                    "but only {} bytes follow it (file size {})",
                    file, header_length, bytes.size() - kLengthBytes, bytes.size()));
  const std::uint64_t data_start = kLengthBytes + header_length;
  const std::uint64_t data_size = bytes.size() - data_start;

  nlohmann::json header;
  // JSON lets a key appear twice and the parser keeps the last value; in a checkpoint that
  // would hide a tensor, so the keys of the top-level object are collected as they are read.
  std::set<std::string> keys;
  std::optional<std::string> duplicate;
  const auto find_duplicate = [&](int depth, nlohmann::json::parse_event_t event,
                                  nlohmann::json& parsed) {
    if (depth == 1 && event == nlohmann::json::parse_event_t::key && !duplicate &&
        !keys.insert(parsed.get<std::string>()).second)
      duplicate = parsed.get<std::string>();
    return true;
  };
  try {
    header = nlohmann::json::parse(bytes.begin() + kLengthBytes,
                                   bytes.begin() + static_cast<std::ptrdiff_t>(data_start),
                                   find_duplicate);
  } catch (const nlohmann::json::parse_error& error) {
    // `error.byte` counts from 1 within the parsed text. The message after the first
    // ": " says what was wrong; the line and column before it count within the header,
    // which would be confusing next to a file offset.
    const std::uint64_t at = kLengthBytes + (error.byte > 0 ? error.byte - 1 : 0);
    std::string_view problem = error.what();
    if (const std::size_t colon = problem.find(": "); colon != std::string_view::npos)
      problem.remove_prefix(colon + 2);
    throw Error(
        fmt::format("safetensors file '{}': the header is not valid JSON at byte "
                    "offset {}: {}",
                    file, at, problem));
  } catch (const nlohmann::json::exception& error) {
    // Valid syntax the parser still refuses, e.g. a number beyond any double (found by
    // tests/fuzz/fuzz_safetensors).
    std::string_view problem = error.what();
    if (const std::size_t bracket = problem.find("] "); bracket != std::string_view::npos)
      problem.remove_prefix(bracket + 2);
    throw Error(fmt::format(
        "safetensors file '{}': the header (byte offsets {} to {}) is not valid JSON: {}", file,
        kLengthBytes, data_start, problem));
  }
  if (!header.is_object())
    throw Error(
        fmt::format("safetensors file '{}': the header at byte offset {} is a JSON {}, "
                    "expected an object",
                    file, kLengthBytes, header.type_name()));
  if (duplicate)
    throw Error(fmt::format(
        "safetensors file '{}': header (byte offsets {} to {}): the name '{}' appears twice, "
        "expected each tensor name (and \"__metadata__\") once",
        file, kLengthBytes, data_start, *duplicate));

  Checkpoint checkpoint;
  std::vector<Entry> entries;
  for (const auto& [key, value] : header.items()) {
    if (key == kMetadataKey) {
      if (!value.is_object())
        throw Error(
            fmt::format("safetensors file '{}': header (byte offsets {} to {}): "
                        "\"__metadata__\" is a JSON {}, expected an object of strings",
                        file, kLengthBytes, data_start, value.type_name()));
      for (const auto& [meta_key, meta_value] : value.items()) {
        if (!meta_value.is_string())
          throw Error(
              fmt::format("safetensors file '{}': header (byte offsets {} to {}): "
                          "metadata '{}' is {}, expected a string",
                          file, kLengthBytes, data_start, meta_key, meta_value.dump()));
        if (meta_key != kChecksumKey) checkpoint.metadata[meta_key] = meta_value.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(file, key, value, data_start, data_size, types));
  }

  // The byte ranges, in file order, must cover the data section exactly once: anything
  // else is a corrupt or hand-edited file.
  std::vector<const Entry*> by_offset;
  for (const Entry& entry : entries) by_offset.push_back(&entry);
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  std::uint64_t expected_begin = 0;
  for (const Entry* entry : by_offset) {
    if (entry->begin != expected_begin)
      throw Error(fmt::format(
          "safetensors file '{}': tensor '{}' starts at data offset {} (byte offset {}), "
          "expected {}: the tensors' byte ranges {} there",
          file, entry->name, entry->begin, data_start + entry->begin, expected_begin,
          entry->begin < expected_begin ? "overlap" : "leave a gap"));
    expected_begin = entry->end;
  }
  if (expected_begin != data_size)
    throw Error(
        fmt::format("safetensors file '{}': {} bytes after the last tensor, from byte "
                    "offset {}, belong to no tensor",
                    file, data_size - expected_begin, data_start + expected_begin));

  // Checked before anything is allocated for the tensors: a damaged file costs no memory.
  std::map<std::string, std::string_view> data;
  for (const Entry& entry : entries)
    data[entry.name] = bytes.substr(data_start + entry.begin, entry.end - entry.begin);
  checkpoint.checksummed = verify_checksums(file, header, data);

  for (const Entry& entry : entries) {
    Tensor tensor = Tensor::uninitialized(entry.shape, entry.type, category);
    if (!tensor.empty())  // memcpy needs valid pointers even for 0 bytes
      std::memcpy(tensor.view().raw_data(), bytes.data() + data_start + entry.begin,
                  tensor.bytes());
    checkpoint.tensors.emplace(entry.name, std::move(tensor));
  }
  return checkpoint;
}

}  // namespace detail

void check_state_values(const std::string& file, const std::string& name,
                        std::span<const float> values, std::size_t first_element) {
  const bool squares = name == "exp_avg_sq" || name.ends_with(".exp_avg_sq");
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i]))
      throw Error(fmt::format(
          "cannot load '{}': tensor '{}' holds {} at element {}, expected finite values (the "
          "run that saved it diverged, or the file was damaged)",
          file, name, values[i], first_element + i));
    if (squares && values[i] < 0)
      throw Error(fmt::format(
          "cannot load '{}': tensor '{}' holds {} at element {}, expected values >= 0 (AdamW's "
          "running mean of squared gradients)",
          file, name, values[i], first_element + i));
  }
}

}  // namespace dp
