// checkpoint.h: saving and loading named tensors as safetensors files.
//
// safetensors (https://github.com/huggingface/safetensors) is the checkpoint format of
// the Hugging Face ecosystem: an 8-byte little-endian header length, a JSON header that
// maps each tensor name to its dtype, shape and byte range, then the raw data. It holds
// no code, so loading a checkpoint cannot run anything, and other tools (Python's
// `safetensors`, `numpy`) read dplab's checkpoints directly. dplab writes and reads F32.
//
// Example:
//
//   std::vector<dp::NamedTensor> state = {{"fc1.weight", &w1}, {"fc1.bias", &b1}};
//   dp::save_safetensors("step100.safetensors", state, {{"step", "100"}});
//   dp::Checkpoint loaded = dp::load_safetensors("step100.safetensors");
//   const dp::Tensor& w = loaded.tensors.at("fc1.weight");  // same shape and bytes as w1
//   loaded.metadata.at("step");                             // "100"
#pragma once

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

/// Writes `tensors` and `metadata` to a safetensors file at `path`: an 8-byte
/// little-endian header length, a JSON header {name: {"dtype": "F32", "shape": [...],
/// "data_offsets": [begin, end]}, "__metadata__": {key: value}} padded with spaces to a
/// multiple of 8 bytes, then each tensor's float32 data in the order given. The metadata
/// entry is left out when `metadata` is empty. The file is written as dp/output_file.h
/// describes: `path` must be a regular file or absent, and a unique temporary file is
/// flushed and renamed onto it, so a crash never leaves a half-written checkpoint at
/// `path`. Throws `dp::Error` on a duplicate or reserved name, a null or empty tensor, a
/// target that is not a regular file, or an I/O failure (with the system's reason).
void save_safetensors(const std::filesystem::path& path, std::span<const NamedTensor> tensors,
                      const std::map<std::string, std::string>& metadata = {});

/// What a safetensors file holds.
struct Checkpoint {
  /// The tensors by name.
  std::map<std::string, Tensor> tensors;
  /// The string pairs of the header's "__metadata__" entry (empty if it has none).
  std::map<std::string, std::string> metadata;
};

/// Reads a safetensors file written by any tool. Only F32 tensors are supported; another
/// dtype throws `dp::Error` naming the tensor and the dtype. Validates the header length
/// against the file size, the JSON (a syntax error names its byte offset), each entry's
/// fields, that each tensor's byte range lies in the data section and holds shape x 4
/// bytes, and that the ranges tile the data section without gaps or overlaps. Every error
/// names the file and a byte offset. Loaded tensors are charged under `category`.
Checkpoint load_safetensors(const std::filesystem::path& path,
                            MemoryCategory category = MemoryCategory::kOther);

}  // namespace dp
