// parsers.h (private to library dp): the file parsers behind the loaders, on data in memory.
//
// `load_safetensors`, `load_csv`, `load_idx` and `load_checkpoint_index` open their files
// and hand the contents to these functions; the fuzz targets (tests/fuzz/) hand them
// arbitrary bytes. `file` is only the name that error messages show.
//
// Example:
//
//   std::istringstream text("1,2,0\n3,4,1\n");
//   dp::Dataset data = dp::detail::parse_csv(text, "inline.csv", 1.0f, "inline");
#pragma once

#include <istream>
#include <string>
#include <string_view>

#include "dp/checkpoint.h"
#include "dp/data.h"
#include "dp/sharded_checkpoint.h"

namespace dp::detail {

/// The safetensors file `bytes` (see `load_safetensors`).
Checkpoint parse_safetensors(std::string_view bytes, const std::string& file,
                             MemoryCategory category, LoadTypes types = LoadTypes::kFloat32);

/// The CSV text of `in` (see `load_csv`), read twice in blocks, never whole: the first pass
/// validates and counts, the second fills the features, so memory peaks at the data set
/// itself. `in` must be seekable.
Dataset parse_csv(std::istream& in, const std::string& file, float feature_scale, std::string name);

/// The IDX image and label files `image_bytes` and `label_bytes` (see `load_idx`).
Dataset parse_idx(std::string_view image_bytes, std::string_view label_bytes,
                  const std::string& image_file, const std::string& label_file);

/// The plan that a sharded checkpoint's index.json holds: `text` parsed, every field
/// checked and the plan validated (`validate_plan`); errors name `file`.
ShardedCheckpointPlan parse_checkpoint_index(std::string_view text, const std::string& file);

}  // namespace dp::detail
