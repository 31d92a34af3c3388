// The IDX loader (the format MNIST and its look-alikes ship in).
//
// An IDX file is a 4-byte magic number (two zero bytes, a type code, the number of
// dimensions), one big-endian uint32 per dimension, then the elements row-major. MNIST
// uses type 0x08 (unsigned byte): images have 3 dimensions (count, rows, columns),
// labels 1 (count).

#include "data/file_io.h"
#include "dp/data.h"
#include "dp/error.h"
#include "parsers.h"

namespace dp {

namespace {

constexpr std::uint32_t kImageMagic = 0x00000803;  // uint8, 3 dimensions
constexpr std::uint32_t kLabelMagic = 0x00000801;  // uint8, 1 dimension
constexpr int kClasses = 10;

// The big-endian uint32 at `offset` of `bytes`; the caller has checked the length.
std::uint32_t read_big_endian_u32(std::string_view bytes, std::size_t offset) {
  std::uint32_t value = 0;
  for (std::size_t i = 0; i < 4; ++i)
    value = (value << 8) | static_cast<unsigned char>(bytes[offset + i]);
  return value;
}

// Checks the magic number and reads the `dims` dimensions that follow it.
std::vector<std::uint32_t> read_idx_header(std::string_view bytes, const std::string& file,
                                           std::uint32_t magic, std::string_view what) {
  const std::size_t dims = magic & 0xFF;
  const std::size_t header_bytes = 4 + 4 * dims;
  const auto truncated = [&] {
    return Error(
        fmt::format("{} '{}' is truncated: the header needs {} bytes, the file ends "
                    "at byte offset {}",
                    what, file, header_bytes, bytes.size()));
  };
  // The magic number first: a wrong kind of file is a clearer error than a short one.
  if (bytes.size() < 4) throw truncated();
  const std::uint32_t seen = read_big_endian_u32(bytes, 0);
  if (seen != magic)
    throw Error(
        fmt::format("{} '{}' has a bad magic number at byte offset 0: expected "
                    "0x{:08X}, found 0x{:08X}",
                    what, file, magic, seen));
  if (bytes.size() < header_bytes) throw truncated();
  std::vector<std::uint32_t> extents(dims);
  for (std::size_t d = 0; d < dims; ++d) extents[d] = read_big_endian_u32(bytes, 4 + 4 * d);
  return extents;
}

// Checks that exactly `count` elements of `element_bytes` bytes follow the header.
void check_payload_size(std::string_view bytes, const std::string& file, std::string_view what,
                        std::size_t header_bytes, std::uint64_t count,
                        std::uint64_t element_bytes) {
  const std::uint64_t available = bytes.size() - header_bytes;
  // Compare by division: count * element_bytes can exceed 64 bits in a corrupt header.
  if (count > available / element_bytes)
    throw Error(
        fmt::format("{} '{}' is truncated: {} elements of {} bytes should follow the "
                    "header from byte offset {}, the file ends at byte offset {}",
                    what, file, count, element_bytes, header_bytes, bytes.size()));
  if (available != count * element_bytes)
    throw Error(fmt::format(
        "{} '{}' has {} unexpected bytes after the data, from byte offset "
        "{}",
        what, file, available - count * element_bytes, header_bytes + count * element_bytes));
}

}  // namespace

namespace detail {

Dataset parse_idx(std::string_view image_bytes, std::string_view label_bytes,
                  const std::string& image_file, const std::string& label_file) {
  const std::vector<std::uint32_t> image_dims =
      read_idx_header(image_bytes, image_file, kImageMagic, "IDX image file");
  const std::uint32_t image_count = image_dims[0];
  const std::uint64_t pixels_per_image = std::uint64_t{image_dims[1]} * image_dims[2];
  if (pixels_per_image == 0)
    throw Error(
        fmt::format("IDX image file '{}' declares empty images of {} x {} pixels at "
                    "byte offset 8",
                    image_file, image_dims[1], image_dims[2]));
  constexpr std::size_t kImageHeaderBytes = 16;
  check_payload_size(image_bytes, image_file, "IDX image file", kImageHeaderBytes, image_count,
                     pixels_per_image);

  const std::vector<std::uint32_t> label_dims =
      read_idx_header(label_bytes, label_file, kLabelMagic, "IDX label file");
  const std::uint32_t label_count = label_dims[0];
  if (label_count != image_count)
    throw Error(
        fmt::format("IDX label file '{}' holds {} labels (count at byte offset 4), but "
                    "image file '{}' holds {} images: expected one label per image",
                    label_file, label_count, image_file, image_count));
  constexpr std::size_t kLabelHeaderBytes = 8;
  check_payload_size(label_bytes, label_file, "IDX label file", kLabelHeaderBytes, label_count, 1);

  Dataset data;
  data.num_classes = kClasses;
  data.labels.resize(label_count);
  for (std::size_t i = 0; i < label_count; ++i) {
    const int label = static_cast<unsigned char>(label_bytes[kLabelHeaderBytes + i]);
    if (label >= kClasses)
      throw Error(
          fmt::format("IDX label file '{}' has label {} at byte offset {}: expected "
                      "0..{}",
                      label_file, label, kLabelHeaderBytes + i, kClasses - 1));
    data.labels[i] = label;
  }

  data.features = Tensor::uninitialized(
      {static_cast<std::int64_t>(image_count), static_cast<std::int64_t>(pixels_per_image)},
      MemoryCategory::kOther);
  const auto* pixels =
      reinterpret_cast<const unsigned char*>(image_bytes.data()) + kImageHeaderBytes;
  for (std::size_t i = 0; i < data.features.size(); ++i)
    data.features[i] = static_cast<float>(pixels[i]) / 255.0f;
  return data;
}

}  // namespace detail

Dataset load_idx(const std::filesystem::path& images, const std::filesystem::path& labels) {
  const std::string image_bytes = detail::read_whole_file(images, "IDX image file");
  const std::string label_bytes = detail::read_whole_file(labels, "IDX label file");
  Dataset data = detail::parse_idx(image_bytes, label_bytes, images.string(), labels.string());
  data.name = images.stem().string();
  return data;
}

}  // namespace dp
