// Tests of safetensors checkpoints: round trips, the exact bytes on disk, and the errors
// for malformed files, which are written byte by byte here.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "dp/checkpoint.h"
#include "dp/error.h"
#include "dp/float16.h"
#include "dp/tensor.h"
#include "test_support.h"

namespace {

namespace fs = std::filesystem;

using dp::testing::test_directory;

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

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

// A tensor of `shape` holding 0.5, 1.5, 2.5, ... so that every element differs.
dp::Tensor counting_tensor(std::vector<std::int64_t> shape) {
  dp::Tensor tensor(std::move(shape));
  for (std::size_t i = 0; i < tensor.size(); ++i) tensor[i] = static_cast<float>(i) + 0.5f;
  return tensor;
}

std::string little_endian_u64(std::uint64_t value) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(value >> (8 * i));
  return bytes;
}

std::string float_bytes(std::initializer_list<float> values) {
  std::string bytes;
  for (float value : values) {
    char raw[4];
    std::memcpy(raw, &value, 4);  // the test machine is little-endian, like the format
    bytes.append(raw, 4);
  }
  return bytes;
}

// Writes a safetensors file by hand: length field, `header` as given, then `data`.
fs::path write_raw(const fs::path& path, const std::string& header, const std::string& data) {
  std::ofstream out(path, std::ios::binary);
  out << little_endian_u64(header.size()) << header << data;
  return path;
}

TEST(Safetensors, RoundTripsShapesBytesAndMetadata) {
  const fs::path path = test_directory() / "model.safetensors";
  const dp::Tensor weight = counting_tensor({3, 4});
  const dp::Tensor bias = counting_tensor({4});
  const dp::Tensor scalar = counting_tensor({});
  const dp::Tensor no_rows = counting_tensor({0, 5});
  dp::Tensor special({4});
  special[0] = -0.0f;
  special[1] = 1e-40f;  // subnormal
  special[2] = std::numeric_limits<float>::infinity();
  special[3] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<dp::NamedTensor> tensors = {{"fc.weight", &weight},
                                                {"fc.bias", &bias},
                                                {"step_scale", &scalar},
                                                {"empty", &no_rows},
                                                {"special", &special}};
  dp::save_safetensors(path, tensors, {{"step", "100"}, {"format", "pt"}});
  EXPECT_FALSE(fs::exists(path.string() + ".tmp"));

  const dp::Checkpoint loaded = dp::load_safetensors(path);
  ASSERT_EQ(loaded.tensors.size(), tensors.size());
  for (const dp::NamedTensor& saved : tensors) {
    SCOPED_TRACE(saved.name);
    ASSERT_EQ(loaded.tensors.count(saved.name), 1u);
    const dp::Tensor& tensor = loaded.tensors.at(saved.name);
    EXPECT_EQ(tensor.shape(), saved.tensor->shape());
    ASSERT_EQ(tensor.size(), saved.tensor->size());
    EXPECT_EQ(tensor.category(), dp::MemoryCategory::kOther);
    if (!tensor.empty()) {
      EXPECT_EQ(std::memcmp(tensor.data(), saved.tensor->data(), tensor.bytes()), 0);
    }
  }
  EXPECT_EQ(loaded.tensors.at("step_scale").size(), 1u);
  EXPECT_EQ(loaded.metadata,
            (std::map<std::string, std::string>{{"step", "100"}, {"format", "pt"}}));

  const dp::Checkpoint as_parameters = dp::load_safetensors(path, dp::MemoryCategory::kParameters);
  EXPECT_EQ(as_parameters.tensors.at("fc.weight").category(), dp::MemoryCategory::kParameters);
}

TEST(Safetensors, WritesTheDocumentedLayout) {
  const fs::path path = test_directory() / "layout.safetensors";
  const dp::Tensor b = counting_tensor({3});
  const dp::Tensor a = counting_tensor({2, 2});
  const std::vector<dp::NamedTensor> tensors = {{"b", &b}, {"a", &a}};
  dp::save_safetensors(path, tensors, {{"step", "7"}});

  const std::string bytes = read_bytes(path);
  ASSERT_GE(bytes.size(), 8u);
  std::uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i)
    header_length = (header_length << 8) | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ(header_length % 8, 0u) << "the header is padded to a multiple of 8 bytes";
  ASSERT_EQ(bytes.size(), 8 + header_length + 7 * 4);

  // Metadata first, then the tensors in the order given, their data back to back.
  const std::string expected_json = R"({"__metadata__":{"step":"7"},)"
                                    R"("b":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},)"
                                    R"("a":{"dtype":"F32","shape":[2,2],"data_offsets":[12,28]}})";
  const std::string header = bytes.substr(8, header_length);
  EXPECT_EQ(header.substr(0, expected_json.size()), expected_json);
  EXPECT_EQ(header.substr(expected_json.size()),
            std::string(header_length - expected_json.size(), ' '));
  EXPECT_LT(header_length - expected_json.size(), 8u);

  EXPECT_EQ(bytes.substr(8 + header_length),
            float_bytes({0.5f, 1.5f, 2.5f}) + float_bytes({0.5f, 1.5f, 2.5f, 3.5f}));
}

TEST(Safetensors, LeavesOutEmptyMetadataAndOverwrites) {
  const fs::path path = test_directory() / "plain.safetensors";
  const dp::Tensor first = counting_tensor({1});
  dp::save_safetensors(path, std::vector<dp::NamedTensor>{{"x", &first}}, {{"k", "v"}});
  const dp::Tensor second = counting_tensor({2});
  dp::save_safetensors(path, std::vector<dp::NamedTensor>{{"y", &second}});
  const std::string bytes = read_bytes(path);
  EXPECT_EQ(bytes.find("__metadata__"), std::string::npos);
  const dp::Checkpoint loaded = dp::load_safetensors(path);
  EXPECT_TRUE(loaded.metadata.empty());
  ASSERT_EQ(loaded.tensors.size(), 1u);
  EXPECT_EQ(loaded.tensors.at("y").size(), 2u);
}

TEST(Safetensors, Crc32IsTheStandardOne) {
  // The check value of CRC-32 (zlib, PNG): the sum of the nine digits "123456789".
  EXPECT_EQ(dp::crc32("123456789", 9), 0xCBF43926u);
  EXPECT_EQ(dp::crc32("6789", 4, dp::crc32("12345", 5)), 0xCBF43926u) << "continued in pieces";
}

// Replaces the first `from` in the file at `path` by `to`, of the same length.
void replace_bytes(const fs::path& path, const std::string& from, const std::string& to) {
  std::string bytes = read_bytes(path);
  const std::size_t at = bytes.find(from);
  ASSERT_NE(at, std::string::npos) << from;
  ASSERT_EQ(from.size(), to.size());
  bytes.replace(at, from.size(), to);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

TEST(Safetensors, ChecksumsRefuseAFlippedByteNamingWhatChanged) {
  const fs::path dir = test_directory();  // emptied anew on every call
  const fs::path path = dir / "checksummed.safetensors";
  const dp::Tensor b = counting_tensor({3});
  const dp::Tensor a = counting_tensor({2, 2});
  const std::vector<dp::NamedTensor> tensors = {{"b", &b}, {"a", &a}};
  dp::save_safetensors(path, tensors, {{"step", "17"}}, dp::Checksums::kWrite);
  const dp::Checkpoint loaded = dp::load_safetensors(path);
  EXPECT_TRUE(loaded.checksummed);
  EXPECT_EQ(loaded.metadata, (std::map<std::string, std::string>{{"step", "17"}}))
      << "the checksums' entry is not the caller's metadata";
  EXPECT_FALSE(dp::load_safetensors(write_raw(dir / "plain_crc.safetensors",
                                              R"({"w":{"dtype":"F32","shape":[1],)"
                                              R"("data_offsets":[0,4]}})",
                                              float_bytes({1.0f})))
                   .checksummed);

  // A step count changed in the header: "17" becomes "97".
  const std::string original = read_bytes(path);
  replace_bytes(path, R"("step":"17")", R"("step":"97")");
  expect_error([&] { dp::load_safetensors(path); },
               {"checksummed.safetensors", "the header", "step counts", "changed or damaged"});

  // One bit of tensor a's last element (3.5f: its lowest mantissa bit).
  std::string bytes = original;
  bytes[bytes.size() - 4] ^= 1;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  expect_error([&] { dp::load_safetensors(path); },
               {"the data of tensor 'a'", "changed or damaged"});

  // The recorded sum of tensor b's data changed.
  std::ofstream(path, std::ios::binary | std::ios::trunc) << original;
  const std::string b_sum =
      fmt::format("{:08x}", dp::crc32(float_bytes({0.5f, 1.5f, 2.5f}).data(), 12));
  replace_bytes(path, b_sum, std::string(8, '0'));
  expect_error([&] { dp::load_safetensors(path); }, {"the data of tensor 'b'", "00000000"});

  // The key is reserved: a caller cannot write a checksum of its own.
  expect_error(
      [&] {
        dp::save_safetensors(path, tensors, {{dp::kChecksumKey, "x"}});
      },
      {"reserved for checksums"});
}

TEST(Safetensors, ReadsAFileWrittenByAnotherTool) {
  // Keys out of data order, blanks in the JSON, no padding, metadata last.
  const std::string header = R"({ "w": {"dtype": "F32", "shape": [1, 2], "data_offsets": [4, 12]},)"
                             R"( "s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},)"
                             R"( "__metadata__": {"format": "pt"} })";
  const fs::path path =
      write_raw(test_directory() / "other.safetensors", header, float_bytes({9.0f, 1.0f, -2.0f}));
  const dp::Checkpoint loaded = dp::load_safetensors(path);
  EXPECT_EQ(loaded.tensors.at("s").shape(), std::vector<std::int64_t>{});
  EXPECT_EQ(loaded.tensors.at("s")[0], 9.0f);
  EXPECT_EQ(loaded.tensors.at("w").shape(), (std::vector<std::int64_t>{1, 2}));
  EXPECT_EQ(loaded.tensors.at("w")[1], -2.0f);
  EXPECT_EQ(loaded.metadata.at("format"), "pt");
}

TEST(Safetensors, NamesATensorThatAppearsTwiceInTheHeader) {
  // Before: JSON kept the second entry silently and the error spoke of overlapping ranges.
  const std::string header = R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
                             R"( "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})";
  const fs::path path =
      write_raw(test_directory() / "twice.safetensors", header, float_bytes({1.0f, 2.0f}));
  expect_error([&] { dp::load_safetensors(path); }, {"twice.safetensors", "'w' appears twice"});
}

TEST(Safetensors, RejectsAFileTooShortForTheLength) {
  const fs::path path = test_directory() / "short.safetensors";
  std::ofstream(path, std::ios::binary) << std::string("\x10\x00\x00", 3);
  expect_error([&] { dp::load_safetensors(path); },
               {"short.safetensors", "3 bytes long", "byte offset 0"});
}

TEST(Safetensors, RejectsAHeaderLengthPastTheEnd) {
  const fs::path path = test_directory() / "long.safetensors";
  std::ofstream(path, std::ios::binary) << little_endian_u64(1000) << R"({"a":1})";
  expect_error([&] { dp::load_safetensors(path); },
               {"long.safetensors", "header length at byte offset 0 is 1000", "only 7 bytes"});
}

TEST(Safetensors, RejectsATruncatedHeader) {
  // The length is right for the bytes present, but the JSON stops midway.
  const fs::path path =
      write_raw(test_directory() / "cut.safetensors", R"({"a":{"dtype":"F32")", "");
  expect_error([&] { dp::load_safetensors(path); },
               {"cut.safetensors", "not valid JSON at byte offset"});
}

TEST(Safetensors, NamesTheByteOffsetOfBadJson) {
  // The stray 'x' is the 6th byte of the header: file byte offset 8 + 5 = 13.
  const fs::path path = write_raw(test_directory() / "bad.safetensors", R"({"a":x})", "");
  expect_error([&] { dp::load_safetensors(path); },
               {"bad.safetensors", "not valid JSON at byte offset 13"});
}

TEST(Safetensors, RejectsANumberBeyondAnyDouble) {
  // Found by tests/fuzz/fuzz_safetensors: nlohmann's out_of_range escaped as an internal error.
  const fs::path path = write_raw(test_directory() / "huge.safetensors", R"({"a": 4e60149})", "");
  expect_error([&] { dp::load_safetensors(path); },
               {"huge.safetensors", "is not valid JSON", "number overflow"});
}

TEST(Safetensors, RejectsAHeaderThatIsNotAnObject) {
  const fs::path path = write_raw(test_directory() / "array.safetensors", "[1, 2]  ", "");
  expect_error([&] { dp::load_safetensors(path); }, {"array.safetensors", "array", "object"});
}

TEST(Safetensors, RejectsOffsetsPastTheData) {
  const fs::path path =
      write_raw(test_directory() / "range.safetensors",
                R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", float_bytes({1, 2}));
  // A 55-byte header: the data starts at byte offset 63 and ends at 71.
  expect_error([&] { dp::load_safetensors(path); },
               {"range.safetensors", "'w'", "[0, 16]", "63 to 79", "8-byte data section",
                "ends at byte offset 71"});
}

TEST(Safetensors, RejectsAnotherDtype) {
  // 16-bit tensors only where the caller asks for them: the default reads floats.
  const fs::path path =
      write_raw(test_directory() / "half.safetensors",
                R"({"h":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})", std::string(4, '\0'));
  expect_error([&] { dp::load_safetensors(path); },
               {"half.safetensors", "'h'", "\"F16\"", "expected \"F32\" (float32)"});
  const fs::path doubles =
      write_raw(test_directory() / "double.safetensors",
                R"({"d":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", std::string(8, '\0'));
  expect_error(
      [&] { dp::load_safetensors(doubles, dp::MemoryCategory::kOther, dp::LoadTypes::kAll); },
      {"'d'", "\"F64\"", "dplab reads \"F32\", \"BF16\" and \"F16\""});
}

TEST(Safetensors, RoundTripsBfloat16AndFloat16TensorsWithTheirDtypes) {
  const dp::Tensor f32 = counting_tensor({2, 3});
  const dp::Tensor bf16 = f32.to(dp::DataType::kBFloat16);
  dp::Tensor f16 = counting_tensor({5}).to(dp::DataType::kFloat16);
  f16.span<dp::Float16>()[4] = dp::Float16{0x7e01};  // a NaN's payload travels unchanged
  const std::vector<dp::NamedTensor> tensors = {{"b", &bf16}, {"h", &f16}, {"f", &f32}};
  const fs::path path = test_directory() / "mixed.safetensors";
  dp::save_safetensors(path, tensors, {{"step", "3"}}, dp::Checksums::kWrite);

  // On disk: the dtype strings, 2 bytes per 16-bit element, the data as it lies in memory.
  const std::string bytes = read_bytes(path);
  std::uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), 8);
  const std::string header = bytes.substr(8, header_length);
  EXPECT_NE(header.find(R"("b":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]})"),
            std::string::npos)
      << header;
  EXPECT_NE(header.find(R"("h":{"dtype":"F16","shape":[5],"data_offsets":[12,22]})"),
            std::string::npos)
      << header;
  EXPECT_NE(header.find(R"("f":{"dtype":"F32","shape":[2,3],"data_offsets":[22,46]})"),
            std::string::npos)
      << header;
  EXPECT_EQ(bytes.size(), 8 + header_length + 46);
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + header_length, bf16.span<dp::BFloat16>().data(), 12), 0);

  const dp::Checkpoint loaded =
      dp::load_safetensors(path, dp::MemoryCategory::kParameters, dp::LoadTypes::kAll);
  EXPECT_TRUE(loaded.checksummed);
  const dp::Tensor& b = loaded.tensors.at("b");
  const dp::Tensor& h = loaded.tensors.at("h");
  EXPECT_EQ(b.dtype(), dp::DataType::kBFloat16);
  EXPECT_EQ(b.shape(), bf16.shape());
  EXPECT_EQ(b.category(), dp::MemoryCategory::kParameters);
  EXPECT_EQ(h.dtype(), dp::DataType::kFloat16);
  EXPECT_EQ(loaded.tensors.at("f").dtype(), dp::DataType::kFloat32);
  for (std::size_t i = 0; i < b.size(); ++i)
    EXPECT_EQ(b.span<dp::BFloat16>()[i], bf16.span<dp::BFloat16>()[i]) << i;
  for (std::size_t i = 0; i < h.size(); ++i)
    EXPECT_EQ(h.span<dp::Float16>()[i], f16.span<dp::Float16>()[i]) << i;
  for (std::size_t i = 0; i < f32.size(); ++i) EXPECT_EQ(loaded.tensors.at("f")[i], f32[i]);

  // A loader of floats refuses the file, naming the 16-bit tensor's dtype.
  expect_error([&] { dp::load_safetensors(path); }, {"mixed.safetensors", "\"BF16\""});
}

TEST(Safetensors, ChecksTheOffsetsOfA16BitTensorAgainstTwoBytesPerElement) {
  const fs::path path =
      write_raw(test_directory() / "short.safetensors",
                R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]}})", std::string(4, '\0'));
  expect_error([&] { dp::load_safetensors(path, dp::MemoryCategory::kOther, dp::LoadTypes::kAll); },
               {"'w'", "3 BF16 elements", "span 4 bytes", "expected 2 per element"});
}

TEST(Safetensors, RejectsAShapeThatDisagreesWithTheOffsets) {
  const fs::path path =
      write_raw(test_directory() / "shape.safetensors",
                R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", float_bytes({1, 2}));
  expect_error([&] { dp::load_safetensors(path); }, {"'w'", "3 F32 elements", "span 8 bytes"});
}

TEST(Safetensors, RejectsOverlapsGapsAndTrailingBytes) {
  const fs::path dir = test_directory();
  const fs::path overlap = write_raw(dir / "overlap.safetensors",
                                     R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                     R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                     float_bytes({1, 2, 3}));
  expect_error([&] { dp::load_safetensors(overlap); },
               {"overlap.safetensors", "'b'", "data offset 4", "expected 8", "overlap"});

  const fs::path gap = write_raw(dir / "gap.safetensors",
                                 R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                 R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                                 float_bytes({1, 2, 3}));
  expect_error([&] { dp::load_safetensors(gap); }, {"'b'", "expected 4", "gap"});

  const fs::path trailing =
      write_raw(dir / "trailing.safetensors",
                R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", float_bytes({1, 2}));
  expect_error([&] { dp::load_safetensors(trailing); },
               {"trailing.safetensors", "4 bytes after the last tensor"});
}

TEST(Safetensors, RejectsMalformedEntries) {
  const fs::path dir = test_directory();
  const auto expect_entry_error = [&](const std::string& header, const std::string& part) {
    SCOPED_TRACE(header);
    const fs::path path = write_raw(dir / "entry.safetensors", header, float_bytes({1}));
    expect_error([&] { dp::load_safetensors(path); }, {"entry.safetensors", part});
  };
  expect_entry_error(R"({"w":{"shape":[1],"data_offsets":[0,4]}})", R"(no "dtype")");
  expect_entry_error(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})",
                     "non-negative integers");
  expect_entry_error(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4]}})", "[begin, end]");
  expect_entry_error(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})",
                     "begin after end");
  expect_entry_error(R"({"w":[1]})", "expected an object");
  expect_entry_error(
      R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"__metadata__":{"step":7}})",
      "metadata 'step' is 7, expected a string");
  // 2^62 + 1 elements times 4 bytes wraps around to 4 in 64-bit arithmetic.
  expect_entry_error(R"({"w":{"dtype":"F32","shape":[4611686018427387905],"data_offsets":[0,4]}})",
                     "span 4 bytes");
}

TEST(Safetensors, RejectsUnsavableTensors) {
  const fs::path path = test_directory() / "out.safetensors";
  const dp::Tensor x = counting_tensor({2});
  const dp::Tensor nothing;
  expect_error(
      [&] {
        dp::save_safetensors(path, std::vector<dp::NamedTensor>{{"x", &x}, {"x", &x}});
      },
      {"'x' appears twice"});
  expect_error(
      [&] {
        dp::save_safetensors(path, std::vector<dp::NamedTensor>{{"__metadata__", &x}});
      },
      {"reserved"});
  expect_error(
      [&] {
        dp::save_safetensors(path, std::vector<dp::NamedTensor>{{"x", nullptr}});
      },
      {"'x'", "null"});
  expect_error(
      [&] {
        dp::save_safetensors(path, std::vector<dp::NamedTensor>{{"e", &nothing}});
      },
      {"'e'", "empty"});
  EXPECT_FALSE(fs::exists(path));
  expect_error(
      [&] {
        dp::save_safetensors(test_directory() / "no" / "such" / "dir.safetensors",
                             std::vector<dp::NamedTensor>{{"x", &x}});
      },
      {"dir.safetensors", "does not exist"});
}

TEST(Safetensors, RejectsAMissingFile) {
  expect_error([&] { dp::load_safetensors(test_directory() / "absent.safetensors"); },
               {"cannot open", "absent.safetensors"});
}

}  // namespace
