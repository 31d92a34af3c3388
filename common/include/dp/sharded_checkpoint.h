// sharded_checkpoint.h: checkpoints of sharded training state (ZeRO), saved by every rank,
// loaded at any world size, consolidated into one file.
//
// Under ZeRO no rank holds the whole model: rank r keeps a flat shard, a 1-D buffer whose
// elements are pieces of parameters one after another, with zero padding where the
// partition rounds up. A sharded checkpoint saves each rank's shard as it lies in memory
// (no gather, no rank holding more than its own), and describes in an index which element of
// which parameter each shard element is. That description is what makes a checkpoint saved
// at N ranks loadable at M ranks with another padding: the loader copies element ranges by
// parameter name and offset, never by position in a shard.
//
// The layout of one rank (`ShardLayout`) is a list of ranges {parameter, first element
// within the parameter, count, offset within the shard} and the shard's size; padding is
// what no range covers. Every ZeRO stage says its layout this way: lab 5 cuts the whole
// flat space into N equal chunks, labs 6 and 7 cut each bucket or unit into N chunks and
// put rank r's chunks one after another (`chunked_layouts` builds both).
//
// On disk, in one directory:
//
//   shard-<r>-of-<N>.safetensors   rank r's flat shard tensors ("params", "exp_avg", ...),
//                                  each of the shard's size, and metadata: the format and
//                                  version, the rank, the world size, the rank's layout, the
//                                  caller's metadata (step, ...), and checksums of the header
//                                  and of every tensor (dp/checkpoint.h)
//   index.json                     written by rank 0: the format and version, the world size,
//                                  the shard files, each parameter's name and shape, each
//                                  rank's ranges and shard size, the tensor names, the
//                                  caller's metadata
//
// Version 2 (this one) added the shard files' "version" entry and checksums, required when a
// shard says version 2; version 1 checkpoints (no checksums) are still read.
//
// Every file is written as dp/output_file.h describes (a temporary file, fsync, rename; only
// regular files are replaced). Loading checks everything against the index and names what
// was expected and what was seen. Values are copied bit for bit; NaN and infinities are not
// checked here (a caller that must not save a diverged model checks before saving).
//
// Example (rank `rank` of `world_size`, lab 5's layout, AdamW state):
//
//   dp::ShardedCheckpointPlan plan;
//   plan.parameters = dp::checkpoint_parameters(model);
//   std::vector<std::vector<std::size_t>> segments = {dp::all_parameters(plan.parameters)};
//   plan.layouts = dp::chunked_layouts(plan.parameters, segments, world_size);
//   plan.tensors = {"params", "exp_avg", "exp_avg_sq"};
//   plan.metadata = {{"step", "100"}};
//   std::vector<dp::NamedTensor> mine = {{"params", &shard}, {"exp_avg", &m}, {"exp_avg_sq", &v}};
//   dp::save_checkpoint_shard("ckpt", plan, rank, mine);   // rank 0 writes index.json too
//   comm.barrier();                                        // the checkpoint is complete
//
//   // Later, at another world size: this rank's layout there, then its tensors.
//   auto layouts = dp::chunked_layouts(plan.parameters, segments, new_size);
//   std::map<std::string, dp::Tensor> state = dp::load_checkpoint_shard("ckpt", layouts[rank]);
//   state.at("params");                                    // (S'), its padding zero
//
//   dp::consolidate_checkpoint("ckpt", "full.safetensors");  // or `dplab consolidate`
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "dp/checkpoint.h"
#include "dp/memory.h"
#include "dp/model.h"
#include "dp/tensor.h"

namespace dp {

/// The name of the shard tensor that holds the parameters' values: `consolidate_checkpoint`
/// splits it into one tensor per parameter (the other tensors stay flat).
inline constexpr const char* kShardParameters = "params";

/// A parameter as a checkpoint records it: its name and shape.
struct CheckpointParameter {
  /// The parameter's name, e.g. "fc1.weight"; unique in a checkpoint.
  std::string name;
  /// Its shape; the parameter has the product of the extents elements.
  std::vector<std::int64_t> shape;
  /// The number of elements: the product of `shape`.
  std::size_t size() const;
  /// Two parameters are equal when name and shape are.
  bool operator==(const CheckpointParameter&) const = default;
};

/// One piece of a flat shard: `count` elements of parameter `parameter`, its elements
/// [parameter_offset, parameter_offset + count) in the parameter's row-major order, stored
/// at shard elements [shard_offset, shard_offset + count).
struct ShardRange {
  std::string parameter;             ///< the parameter's name
  std::size_t parameter_offset = 0;  ///< first element within the parameter
  std::size_t count = 0;             ///< elements; at least 1
  std::size_t shard_offset = 0;      ///< where the piece starts in the shard
  /// Two ranges are equal when every field is.
  bool operator==(const ShardRange&) const = default;
};

/// Which elements of which parameters one rank's flat shard holds. Shard elements no range
/// covers are padding: saved as they are, ignored when loading, zero in a loaded shard.
struct ShardLayout {
  /// The pieces, in any order; they must not overlap in the shard or in a parameter.
  std::vector<ShardRange> ranges;
  /// The shard's elements, padding included: every shard tensor has this many.
  std::size_t shard_elements = 0;
  /// Two layouts are equal when every field is.
  bool operator==(const ShardLayout&) const = default;
};

/// Everything that describes a sharded checkpoint but the values: the same on every rank.
struct ShardedCheckpointPlan {
  /// The model's parameters in its flat order (definition order): the order of the
  /// consolidated state tensors.
  std::vector<CheckpointParameter> parameters;
  /// One layout per rank; the world size is their number. Together they must cover every
  /// element of every parameter exactly once.
  std::vector<ShardLayout> layouts;
  /// The names of the shard tensors every rank saves, e.g. {"params", "exp_avg",
  /// "exp_avg_sq"}: each laid out as the parameter shard.
  std::vector<std::string> tensors;
  /// The caller's string pairs (step, optimizer counter, options), saved in the index and in
  /// every shard file. Keys "format", "version", "rank", "world_size", "layout" and
  /// "dplab.crc32" are reserved.
  std::map<std::string, std::string> metadata;
};

/// The name and shape of every parameter of `model`, in definition order. Call it while the
/// values exist (before ZeRO-3 releases them).
std::vector<CheckpointParameter> checkpoint_parameters(const Model& model);

/// The indices 0 .. parameters.size() - 1: one segment of the whole model in order (lab 5).
std::vector<std::size_t> all_parameters(std::span<const CheckpointParameter> parameters);

/// The layouts of ZeRO's chunked partitions, one per rank. Each segment lists parameter
/// indices; its flat range is those parameters one after another (E elements), cut into
/// `world_size` chunks of C = ceil(E / N), the last ones padded. Rank r's shard is its
/// chunk of segment 0, then its chunk of segment 1, and so on: shard size the sum of the
/// chunks. Lab 5: one segment of all parameters; lab 6: the buckets; lab 7: the units.
/// Throws `dp::Error` when `world_size < 1` or an index is out of range.
std::vector<ShardLayout> chunked_layouts(std::span<const CheckpointParameter> parameters,
                                         std::span<const std::vector<std::size_t>> segments,
                                         int world_size);

/// Checks one rank's layout against `parameters`: every range names a parameter, has at
/// least one element, lies within its parameter and within the shard, and no two ranges
/// overlap in the shard or in a parameter. Throws `dp::Error` naming the range (by its
/// position in `layout.ranges`) and what is wrong; `what` opens the message ("rank 2").
void validate_layout(std::span<const CheckpointParameter> parameters, const ShardLayout& layout,
                     const std::string& what = "layout");

/// Checks a whole plan: unique parameter names, at least one rank, every layout valid, every
/// parameter element covered by exactly one range of one rank (overlaps and uncovered
/// elements are named), unique tensor names, no reserved metadata key. Throws `dp::Error`.
void validate_plan(const ShardedCheckpointPlan& plan);

/// The file name of rank `rank`'s shard: "shard-<rank>-of-<world_size>.safetensors".
std::string shard_file_name(int rank, int world_size);

/// Saves rank `rank`'s shard of a checkpoint into `directory` (which must exist):
/// `tensors` are the plan's tensors, each by its name, each with the rank's shard size
/// (any shape: saved with it; loading checks only the element count). Rank 0 then also writes
/// `index.json`, so that one call per rank and no collective make a checkpoint; it is complete when
/// every rank has returned (a barrier). Only rank 0 writes the index because the index is the same
/// for every rank: N copies would cost N fsyncs for one file. Validates the plan first (every rank
/// does: an invalid plan fails before any file is written). Throws `dp::Error` on an invalid plan,
/// a rank out of range, a missing, extra or wrongly sized tensor, or a write failure.
void save_checkpoint_shard(const std::filesystem::path& directory,
                           const ShardedCheckpointPlan& plan, int rank,
                           std::span<const NamedTensor> tensors);

/// Reads and checks `<directory>/index.json`: its JSON, every field, and the plan it holds
/// (`validate_plan`); each shard file must exist. Throws `dp::Error` naming the file.
ShardedCheckpointPlan load_checkpoint_index(const std::filesystem::path& directory);

/// Throws `dp::Error` unless a checkpoint whose index is `saved` can be loaded into a run
/// planned as `expected` (this run's model and optimizer): the same parameters, names and
/// shapes, in the same order; the same shard tensors, compared as a set (the order they were
/// saved in does not matter); and every metadata key of `expected`. The world sizes and
/// layouts may differ: that is what re-sharding is for. The message names the first
/// parameter, the tensors or the key that differ. A loader calls it before it changes
/// anything, so that a foreign checkpoint leaves the run as it was.
void check_checkpoint_compatible(const ShardedCheckpointPlan& saved,
                                 const ShardedCheckpointPlan& expected);

/// The metadata entry `key` of `saved` as a count: a whole number >= 0 in decimal, such as a
/// ZeRO optimizer's "step". Throws `dp::Error` naming the key and what it holds otherwise.
std::int64_t checkpoint_count(const ShardedCheckpointPlan& saved, const std::string& key);

/// A shard tensor to fill when loading: `tensor` must already have the layout's shard size.
struct ShardTarget {
  std::string name;          ///< a tensor of the checkpoint, e.g. "exp_avg"
  Tensor* tensor = nullptr;  ///< filled in place (not owned)
};

/// Fills `targets` with this rank's shard for `layout`, a layout of any world size over the
/// checkpoint's parameters (`validate_layout`): every range's elements are copied, bit for
/// bit, from the saved shards that hold them, and the padding is set to zero. Reads only
/// the shard files that hold some of the layout's elements, and checks each against the
/// index (rank, world size, layout, every tensor present with the shard's size). Throws
/// `dp::Error` on a missing file or tensor, a mismatch, or a target of the wrong size. It
/// checks every target first (its name against the index's tensors, its size against the
/// layout's): a failure before copying changes no target; a shard file that proves corrupt
/// midway can leave targets partly filled.
void load_checkpoint_shard(const std::filesystem::path& directory, const ShardLayout& layout,
                           std::span<const ShardTarget> targets);

/// The same, allocating every tensor of the checkpoint as a 1-D tensor of the layout's
/// shard size under `category`.
std::map<std::string, Tensor> load_checkpoint_shard(
    const std::filesystem::path& directory, const ShardLayout& layout,
    MemoryCategory category = MemoryCategory::kOther);

/// The whole checkpoint in one piece, loaded through a one-rank layout of the flat order:
/// every parameter whole under its name and shape (from the "params" tensor), every other
/// tensor T as "optimizer.T", flat over all parameters in their order (the layout of
/// `save_training_checkpoint`), and the index's metadata plus "sharded_world_size".
Checkpoint consolidated_checkpoint(const std::filesystem::path& directory,
                                   MemoryCategory category = MemoryCategory::kOther);

/// Writes `consolidated_checkpoint(directory)` to `output` as safetensors (safely; `output`
/// may not be a file of the checkpoint). Throws `dp::Error`.
void consolidate_checkpoint(const std::filesystem::path& directory,
                            const std::filesystem::path& output);

}  // namespace dp
