// checkpoint.h: saving and loading named tensors as safetensors files.
//
// safetensors (https://github.com/huggingface/safetensors) is the checkpoint format of
// the Hugging Face ecosystem: an 8-byte little-endian header length, a JSON header that
// maps each tensor name to its dtype, shape and byte range, then the raw data. It holds
// no code, so loading a checkpoint cannot run anything, and other tools (Python's
// `safetensors`, `numpy`) read dplab's checkpoints directly. dplab writes each tensor with the
// dtype of its element type (dp/tensor.h): "F32", "BF16" or "F16". It reads F32, and BF16 and
// F16 too where the caller asks for them (`LoadTypes::kAll`): the loaders of training state
// read their tensors as floats, and a 16-bit file is refused there with its dtype named.
//
// Integrity: with `Checksums::kWrite`, the file also records CRC-32 checksums in the
// metadata entry "dplab.crc32" (see `kChecksumKey`): one of the header and one of each
// tensor's data, so that a flipped bit anywhere (a step count, a weight) is refused on load
// with the part that changed named, instead of being trained on. Files without the entry
// (older dplab files, other tools' files) are read as before; a loader that needs the
// guarantee checks `Checkpoint::checksummed`.
//
// Example:
//
//   std::vector<dp::NamedTensor> state = {{"fc1.weight", &w1}, {"fc1.bias", &b1}};
//   dp::save_safetensors("step100.safetensors", state, {{"step", "100"}});
//   dp::Checkpoint loaded = dp::load_safetensors("step100.safetensors");
//   const dp::Tensor& w = loaded.tensors.at("fc1.weight");  // same shape and bytes as w1
//   loaded.metadata.at("step");                             // "100"
//
//   const dp::Tensor h = w1.to(dp::DataType::kBFloat16);
//   std::vector<dp::NamedTensor> halves = {{"fc1.weight", &h}};
//   dp::save_safetensors("bf16.safetensors", halves);        // dtype "BF16", 2 bytes each
//   dp::load_safetensors("bf16.safetensors", dp::MemoryCategory::kOther, dp::LoadTypes::kAll)
//       .tensors.at("fc1.weight").dtype();                   // DataType::kBFloat16
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>

#include "dp/memory.h"
#include "dp/tensor.h"

namespace dp {

/// A tensor to save, under the name it will have in the file.
struct NamedTensor {
  /// The key in the file's header, e.g. "fc1.weight"; must be unique and not "__metadata__".
  std::string name;
  /// The tensor to save (not owned; must outlive the call).
  const Tensor* tensor = nullptr;
};

/// Whether `save_safetensors` records checksums (see the top of this file).
enum class Checksums {
  kNone,   ///< a plain safetensors file
  kWrite,  ///< the header's and every tensor's CRC-32 in the metadata
};

/// The metadata key of the checksums: a JSON object {"header": "<8 hex digits>", "data":
/// {tensor name: "<8 hex digits>"}}. "header" is the CRC-32 (the polynomial of zlib and
/// PNG) of the header as compact JSON with sorted keys and without this entry; each "data"
/// value is the CRC-32 of that tensor's bytes. Reserved: a caller's metadata may not use it.
inline constexpr const char* kChecksumKey = "dplab.crc32";

/// The CRC-32 of `bytes` (the polynomial 0xEDB88320 of zlib, PNG and Ethernet), continuing
/// from `crc` (0 for a new sum): what the checksums of a checkpoint are.
std::uint32_t crc32(const void* bytes, std::size_t count, std::uint32_t crc = 0);

/// Writes `tensors` and `metadata` to a safetensors file at `path`: an 8-byte
/// little-endian header length, a JSON header {name: {"dtype": "F32", "shape": [...],
/// "data_offsets": [begin, end]}, "__metadata__": {key: value}} padded with spaces to a
/// multiple of 8 bytes, then each tensor's data in the order given, as it lies in memory (the
/// dtype "F32", "BF16" or "F16" after the tensor's element type, 4 or 2 bytes per element). The
/// metadata entry is left out when `metadata` is empty and no checksums are asked for. With
/// `Checksums::kWrite` the metadata also holds the checksums (`kChecksumKey`). The file is written
/// as dp/output_file.h describes: `path` must be a regular file or absent, and a unique temporary
/// file is flushed and renamed onto it, so a crash never leaves a half-written checkpoint at
/// `path`. Throws `dp::Error` on a duplicate or reserved name or metadata key, a null or empty
/// tensor, a target that is not a regular file, or an I/O failure (with the system's reason).
void save_safetensors(const std::filesystem::path& path, std::span<const NamedTensor> tensors,
                      const std::map<std::string, std::string>& metadata = {},
                      Checksums checksums = Checksums::kNone);

/// What a safetensors file holds.
struct Checkpoint {
  /// The tensors by name.
  std::map<std::string, Tensor> tensors;
  /// The string pairs of the header's "__metadata__" entry (empty if it has none), without
  /// the checksums' entry.
  std::map<std::string, std::string> metadata;
  /// True when the file recorded checksums and every one matched (a mismatch throws).
  bool checksummed = false;
};

/// Which dtypes `load_safetensors` reads.
enum class LoadTypes {
  kFloat32,  ///< "F32" only (the default): for callers that read the tensors as floats
  kAll,      ///< "F32", "BF16" and "F16", each loaded as a tensor of its type (dp/tensor.h)
};

/// Reads a safetensors file written by any tool. F32 tensors are read, and BF16 and F16
/// ones with `LoadTypes::kAll`; another dtype throws `dp::Error` naming the tensor and the
/// dtype. Validates the header length against the file size, the JSON (a syntax error names
/// its byte offset), each entry's fields, that each tensor's byte range lies in the data
/// section and holds shape x its element size (4 or 2) bytes, and that the ranges tile the
/// data section without gaps or overlaps. Every error
/// names the file and a byte offset. When the file records checksums (`kChecksumKey`), the
/// header's and every tensor's are verified: a mismatch throws `dp::Error` naming the header
/// or the tensor whose bytes changed since the file was written. Loaded tensors are charged under
/// `category`.
Checkpoint load_safetensors(const std::filesystem::path& path,
                            MemoryCategory category = MemoryCategory::kOther,
                            LoadTypes types = LoadTypes::kFloat32);

/// Throws `dp::Error` unless `values`, elements [first_element, first_element + size) of the
/// loaded tensor `name` of checkpoint `file`, can be a training run's state: finite, and not
/// negative where `name` is AdamW's running mean of squared gradients ("exp_avg_sq", or a
/// name ending in ".exp_avg_sq"). The message names the file, the tensor, the first value
/// refused and its element. Loaders of a run's state call it so that a damaged or diverged
/// checkpoint is refused on load, not blamed on the learning rate after the training.
void check_state_values(const std::string& file, const std::string& name,
                        std::span<const float> values, std::size_t first_element = 0);

}  // namespace dp
