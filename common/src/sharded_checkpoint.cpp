// Sharded checkpoints: layouts, their checks, the index, saving, re-sharding and
// consolidation (see sharded_checkpoint.h).
#include "dp/sharded_checkpoint.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <string_view>

#include "data/file_io.h"
#include "device_dispatch.h"
#include "dp/error.h"
#include "dp/output_file.h"
#include "parsers.h"

namespace dp {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kFormat = "dplab-sharded-checkpoint";
// Version 2 shard files record checksums (dp/checkpoint.h) and say "version": "2" in their
// metadata, which makes the checksums required when they are read; version 1 checkpoints,
// written before, have neither and are still read.
constexpr int kVersion = 2;
constexpr int kOldestVersion = 1;
constexpr const char* kIndexFile = "index.json";
// Keys of a shard file's metadata that the runtime writes; the caller's may not use them.
constexpr std::string_view kReservedKeys[] = {"format", "version", "rank", "world_size", "layout"};

/// "[first, end)" of a half-open range, for messages.
std::string span_text(std::size_t first, std::size_t count) {
  return fmt::format("[{}, {})", first, first + count);
}

/// The range at `index` of a layout, for messages.
std::string range_text(const ShardRange& range, std::size_t index) {
  return fmt::format("range {} (parameter '{}' elements {} at shard elements {})", index,
                     range.parameter, span_text(range.parameter_offset, range.count),
                     span_text(range.shard_offset, range.count));
}

/// Parameter sizes by name.
std::map<std::string, std::size_t> sizes_by_name(std::span<const CheckpointParameter> parameters) {
  std::map<std::string, std::size_t> sizes;
  for (const CheckpointParameter& parameter : parameters) sizes[parameter.name] = parameter.size();
  return sizes;
}

// --- JSON: the layout, as the index and every shard file hold it ---------------------------

nlohmann::ordered_json layout_to_json(const ShardLayout& layout) {
  nlohmann::ordered_json ranges = nlohmann::ordered_json::array();
  for (const ShardRange& range : layout.ranges)
    ranges.push_back({{"parameter", range.parameter},
                      {"parameter_offset", range.parameter_offset},
                      {"count", range.count},
                      {"shard_offset", range.shard_offset}});
  return {{"shard_elements", layout.shard_elements}, {"ranges", std::move(ranges)}};
}

/// The field `key` of the object `value`; `where` says what `value` is, for the message.
const nlohmann::json& field(const nlohmann::json& value, const char* key,
                            const std::string& where) {
  if (!value.is_object())
    throw Error(fmt::format("{} is {}, expected a JSON object", where, value.dump()));
  const auto it = value.find(key);
  if (it == value.end()) throw Error(fmt::format("{} has no \"{}\" field", where, key));
  return *it;
}

/// The whole number `key` of `value`. Numbers are capped at half of size_t's range so that
/// sums of two offsets and counts, as the checks form them, cannot wrap around.
std::size_t unsigned_field(const nlohmann::json& value, const char* key, const std::string& where) {
  constexpr std::size_t kLargest = std::numeric_limits<std::size_t>::max() / 2;
  const nlohmann::json& number = field(value, key, where);
  if (!number.is_number_unsigned())
    throw Error(
        fmt::format("{} has \"{}\": {}, expected a whole number >= 0", where, key, number.dump()));
  if (number.get<std::uint64_t>() > kLargest)
    throw Error(
        fmt::format("{} has \"{}\": {}, expected at most {}", where, key, number.dump(), kLargest));
  return number.get<std::size_t>();
}

std::string string_field(const nlohmann::json& value, const char* key, const std::string& where) {
  const nlohmann::json& text = field(value, key, where);
  if (!text.is_string())
    throw Error(fmt::format("{} has \"{}\": {}, expected a string", where, key, text.dump()));
  return text.get<std::string>();
}

const nlohmann::json& array_field(const nlohmann::json& value, const char* key,
                                  const std::string& where) {
  const nlohmann::json& array = field(value, key, where);
  if (!array.is_array())
    throw Error(fmt::format("{} has \"{}\": {}, expected an array", where, key, array.dump()));
  return array;
}

ShardLayout layout_from_json(const nlohmann::json& value, const std::string& where) {
  ShardLayout layout;
  layout.shard_elements = unsigned_field(value, "shard_elements", where);
  const nlohmann::json& ranges = array_field(value, "ranges", where);
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    const std::string range_where = fmt::format("{}, range {}", where, i);
    layout.ranges.push_back({string_field(ranges[i], "parameter", range_where),
                             unsigned_field(ranges[i], "parameter_offset", range_where),
                             unsigned_field(ranges[i], "count", range_where),
                             unsigned_field(ranges[i], "shard_offset", range_where)});
  }
  return layout;
}

/// Parses `text` as JSON; a syntax error names `file` and what the parser saw.
nlohmann::json parse_json(std::string_view text, const std::string& file) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& error) {
    throw Error(fmt::format("{}: not valid JSON: {}", file, error.what()));
  }
}

// --- the index ----------------------------------------------------------------------------

std::string index_text(const ShardedCheckpointPlan& plan) {
  const int world_size = static_cast<int>(plan.layouts.size());
  nlohmann::ordered_json index;
  index["format"] = kFormat;
  index["version"] = kVersion;
  index["world_size"] = world_size;
  index["tensors"] = plan.tensors;
  nlohmann::ordered_json parameters = nlohmann::ordered_json::array();
  for (const CheckpointParameter& parameter : plan.parameters)
    parameters.push_back({{"name", parameter.name}, {"shape", parameter.shape}});
  index["parameters"] = std::move(parameters);
  nlohmann::ordered_json shards = nlohmann::ordered_json::array();
  for (int rank = 0; rank < world_size; ++rank) {
    nlohmann::ordered_json shard;
    shard["rank"] = rank;
    shard["file"] = shard_file_name(rank, world_size);
    const nlohmann::ordered_json layout = layout_to_json(plan.layouts[rank]);
    shard["shard_elements"] = layout["shard_elements"];
    shard["ranges"] = layout["ranges"];
    shards.push_back(std::move(shard));
  }
  index["shards"] = std::move(shards);
  index["metadata"] = plan.metadata;
  return index.dump(2) + "\n";
}

ShardedCheckpointPlan plan_from_index(const nlohmann::json& index, const std::string& file) {
  const std::string format = string_field(index, "format", file);
  if (format != kFormat)
    throw Error(fmt::format("{}: \"format\" is \"{}\", expected \"{}\"", file, format, kFormat));
  const std::size_t version = unsigned_field(index, "version", file);
  if (version < kOldestVersion || version > kVersion)
    throw Error(fmt::format("{}: \"version\" is {}, this dplab reads versions {} to {}", file,
                            version, kOldestVersion, kVersion));
  const std::size_t world_size = unsigned_field(index, "world_size", file);
  ShardedCheckpointPlan plan;
  for (const nlohmann::json& name : array_field(index, "tensors", file)) {
    if (!name.is_string())
      throw Error(fmt::format("{}: \"tensors\" holds {}, expected names", file, name.dump()));
    plan.tensors.push_back(name.get<std::string>());
  }
  const nlohmann::json& parameters = array_field(index, "parameters", file);
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    const std::string where = fmt::format("{}: parameter {}", file, i);
    CheckpointParameter parameter;
    parameter.name = string_field(parameters[i], "name", where);
    for (const nlohmann::json& extent : array_field(parameters[i], "shape", where)) {
      if (!extent.is_number_unsigned() ||
          extent.get<std::uint64_t>() > std::numeric_limits<std::uint32_t>::max())
        throw Error(fmt::format("{} has shape extent {}, expected a whole number >= 0", where,
                                extent.dump()));
      parameter.shape.push_back(extent.get<std::int64_t>());
    }
    plan.parameters.push_back(std::move(parameter));
  }
  const nlohmann::json& shards = array_field(index, "shards", file);
  if (shards.size() != world_size)
    throw Error(fmt::format("{}: \"world_size\" is {} but \"shards\" describes {} shards", file,
                            world_size, shards.size()));
  for (std::size_t rank = 0; rank < shards.size(); ++rank) {
    const std::string where = fmt::format("{}: shard {}", file, rank);
    const std::size_t saved_rank = unsigned_field(shards[rank], "rank", where);
    const std::string shard_file = string_field(shards[rank], "file", where);
    const std::string expected =
        shard_file_name(static_cast<int>(rank), static_cast<int>(world_size));
    if (saved_rank != rank || shard_file != expected)
      throw Error(fmt::format("{} is rank {} in file '{}', expected rank {} in '{}'", where,
                              saved_rank, shard_file, rank, expected));
    plan.layouts.push_back(layout_from_json(shards[rank], where));
  }
  const nlohmann::json& metadata = field(index, "metadata", file);
  if (!metadata.is_object())
    throw Error(fmt::format("{}: \"metadata\" is {}, expected an object of strings", file,
                            metadata.dump()));
  for (const auto& [key, value] : metadata.items()) {
    if (!value.is_string())
      throw Error(
          fmt::format("{}: metadata '{}' is {}, expected a string", file, key, value.dump()));
    plan.metadata[key] = value.get<std::string>();
  }
  return plan;
}

/// Checks that shard file `file` is rank `rank`'s of `plan` and holds every tensor at the
/// shard's size.
void check_shard(const Checkpoint& shard, const ShardedCheckpointPlan& plan, int rank,
                 const std::string& file) {
  const int world_size = static_cast<int>(plan.layouts.size());
  const auto meta = [&](const char* key) -> std::string {
    const auto it = shard.metadata.find(key);
    if (it == shard.metadata.end())
      throw Error(
          fmt::format("shard file '{}' has no metadata \"{}\": it is not a shard of a "
                      "dplab sharded checkpoint",
                      file, key));
    return it->second;
  };
  if (meta("format") != kFormat)
    throw Error(fmt::format("shard file '{}' has format \"{}\", expected \"{}\"", file,
                            meta("format"), kFormat));
  // Version 1 files have no "version" and no checksums; from version 2 on the checksums
  // must be there (load_safetensors verified them if they were).
  const auto version = shard.metadata.find("version");
  if (version != shard.metadata.end() && version->second != std::to_string(kVersion))
    throw Error(fmt::format("shard file '{}' has version \"{}\", this dplab reads \"{}\" (or none)",
                            file, version->second, kVersion));
  if (version != shard.metadata.end() && !shard.checksummed)
    throw Error(fmt::format(
        "shard file '{}' has version {} but no checksums (metadata \"{}\"): the file was "
        "changed or damaged after it was written",
        file, kVersion, kChecksumKey));
  if (meta("world_size") != std::to_string(world_size))
    throw Error(
        fmt::format("shard file '{}' was saved with world size {}, but the index says {}: "
                    "it belongs to another checkpoint",
                    file, meta("world_size"), world_size));
  if (meta("rank") != std::to_string(rank))
    throw Error(
        fmt::format("shard file '{}' holds rank {}, expected rank {}", file, meta("rank"), rank));
  const ShardLayout saved =
      layout_from_json(parse_json(meta("layout"), "shard file '" + file + "' metadata \"layout\""),
                       "shard file '" + file + "' layout");
  if (saved != plan.layouts[rank])
    throw Error(fmt::format(
        "shard file '{}' was saved with layout {}, but the index gives rank {} "
        "the layout {}",
        file, layout_to_json(saved).dump(), rank, layout_to_json(plan.layouts[rank]).dump()));
  const std::size_t elements = plan.layouts[rank].shard_elements;
  for (const std::string& name : plan.tensors) {
    const auto it = shard.tensors.find(name);
    if (it == shard.tensors.end())
      throw Error(
          fmt::format("shard file '{}' has no tensor '{}', which the index names", file, name));
    if (it->second.size() != elements)
      throw Error(
          fmt::format("shard file '{}': tensor '{}' has {} elements, expected the shard's {}", file,
                      name, it->second.size(), elements));
  }
  for (const auto& [name, tensor] : shard.tensors)
    if (std::find(plan.tensors.begin(), plan.tensors.end(), name) == plan.tensors.end())
      throw Error(fmt::format("shard file '{}' has a tensor '{}' that the index does not name",
                              file, name));
}

/// One rank's layout of the whole flat space in order: what consolidation loads.
ShardLayout whole_layout(std::span<const CheckpointParameter> parameters) {
  ShardLayout layout;
  for (const CheckpointParameter& parameter : parameters) {
    if (parameter.size() > 0)
      layout.ranges.push_back({parameter.name, 0, parameter.size(), layout.shard_elements});
    layout.shard_elements += parameter.size();
  }
  return layout;
}

}  // namespace

std::size_t CheckpointParameter::size() const {
  std::size_t elements = 1;
  for (const std::int64_t extent : shape) elements *= static_cast<std::size_t>(extent);
  return elements;
}

void check_checkpoint_compatible(const ShardedCheckpointPlan& saved,
                                 const ShardedCheckpointPlan& expected) {
  const auto describe = [](const std::vector<CheckpointParameter>& parameters, std::size_t i,
                           const char* absent) {
    if (i >= parameters.size()) return std::string(absent);
    return fmt::format("{} [{}]", parameters[i].name, fmt::join(parameters[i].shape, ", "));
  };
  // The first parameter that differs, by name and shape, in order.
  const std::size_t count = std::max(saved.parameters.size(), expected.parameters.size());
  for (std::size_t i = 0; i < count; ++i) {
    if (i < saved.parameters.size() && i < expected.parameters.size() &&
        saved.parameters[i] == expected.parameters[i])
      continue;
    throw Error(fmt::format(
        "load_checkpoint: the checkpoint's parameter {} is {}; expected this model's {}", i,
        describe(saved.parameters, i, "missing"), describe(expected.parameters, i, "none")));
  }
  // The tensors as a set: the order they were saved in does not matter.
  std::vector<std::string> seen = saved.tensors;
  std::vector<std::string> wanted = expected.tensors;
  std::sort(seen.begin(), seen.end());
  std::sort(wanted.begin(), wanted.end());
  if (seen != wanted)
    throw Error(fmt::format(
        "load_checkpoint: the checkpoint holds the tensors [{}]; expected [{}] (the parameters "
        "and the inner optimizer's state)",
        fmt::join(saved.tensors, ", "), fmt::join(expected.tensors, ", ")));
  for (const auto& [key, value] : expected.metadata)
    if (!saved.metadata.contains(key))
      throw Error(fmt::format("load_checkpoint: the checkpoint's metadata has no \"{}\"", key));
}

std::int64_t checkpoint_count(const ShardedCheckpointPlan& saved, const std::string& key) {
  const auto entry = saved.metadata.find(key);
  if (entry != saved.metadata.end()) {
    const std::string& text = entry->second;
    std::int64_t value = 0;
    // from_chars accepts a leading '-' and nothing else that is not a digit.
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (!text.empty() && text[0] != '-' && error == std::errc() && end == text.data() + text.size())
      return value;
  }
  throw Error(fmt::format(
      "load_checkpoint: the checkpoint's \"{}\" is {}; expected a count (a whole number >= 0, "
      "in decimal)",
      key, entry == saved.metadata.end() ? "missing" : '"' + entry->second + '"'));
}

std::vector<CheckpointParameter> checkpoint_parameters(const Model& model) {
  std::vector<CheckpointParameter> parameters;
  for (const Parameter* parameter : model.parameters())
    parameters.push_back({parameter->name, parameter->value.shape()});
  return parameters;
}

std::vector<std::size_t> all_parameters(std::span<const CheckpointParameter> parameters) {
  std::vector<std::size_t> indices(parameters.size());
  std::iota(indices.begin(), indices.end(), std::size_t{0});
  return indices;
}

std::vector<ShardLayout> chunked_layouts(std::span<const CheckpointParameter> parameters,
                                         std::span<const std::vector<std::size_t>> segments,
                                         int world_size) {
  if (world_size < 1)
    throw Error(fmt::format("chunked_layouts: world size {}, expected 1 or more", world_size));
  const auto n = static_cast<std::size_t>(world_size);
  std::vector<ShardLayout> layouts(n);
  for (std::size_t s = 0; s < segments.size(); ++s) {
    std::size_t elements = 0;  // E
    for (const std::size_t index : segments[s]) {
      if (index >= parameters.size())
        throw Error(
            fmt::format("chunked_layouts: segment {} names parameter {}, expected one "
                        "of the {} parameters",
                        s, index, parameters.size()));
      elements += parameters[index].size();
    }
    const std::size_t chunk = (elements + n - 1) / n;  // C = ceil(E / N)
    for (std::size_t rank = 0; rank < n; ++rank) {
      // Rank r's chunk is [r C, (r + 1) C) of the segment; intersect it with each parameter.
      const std::size_t chunk_begin = rank * chunk;
      const std::size_t chunk_end = chunk_begin + chunk;
      ShardLayout& layout = layouts[rank];
      std::size_t start = 0;  // the parameter's first element in the segment
      for (const std::size_t index : segments[s]) {
        const std::size_t end = start + parameters[index].size();
        const std::size_t first = std::max(start, chunk_begin);
        const std::size_t last = std::min(end, chunk_end);
        if (first < last)
          layout.ranges.push_back({parameters[index].name, first - start, last - first,
                                   layout.shard_elements + (first - chunk_begin)});
        start = end;
      }
      layout.shard_elements += chunk;
    }
  }
  return layouts;
}

void validate_layout(std::span<const CheckpointParameter> parameters, const ShardLayout& layout,
                     const std::string& what) {
  const std::map<std::string, std::size_t> sizes = sizes_by_name(parameters);
  for (std::size_t i = 0; i < layout.ranges.size(); ++i) {
    const ShardRange& range = layout.ranges[i];
    const auto size = sizes.find(range.parameter);
    if (size == sizes.end())
      throw Error(fmt::format("{}: range {} names parameter '{}', which the model does not have",
                              what, i, range.parameter));
    if (range.count == 0)
      throw Error(
          fmt::format("{}: {} has no elements, expected at least 1", what, range_text(range, i)));
    if (range.parameter_offset > size->second ||
        range.count > size->second - range.parameter_offset)
      throw Error(fmt::format("{}: {} runs past the end of the parameter, which has {} elements",
                              what, range_text(range, i), size->second));
    if (range.shard_offset > layout.shard_elements ||
        range.count > layout.shard_elements - range.shard_offset)
      throw Error(fmt::format("{}: {} runs past the end of the shard, which has {} elements", what,
                              range_text(range, i), layout.shard_elements));
  }
  // Overlaps: sorted by where they start, a range must begin at or after the previous end.
  std::vector<std::size_t> order(layout.ranges.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  const auto check_sorted = [&](auto start, auto key, std::string_view space) {
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return std::pair(key(a), start(a)) < std::pair(key(b), start(b));
    });
    for (std::size_t k = 1; k < order.size(); ++k) {
      const std::size_t a = order[k - 1];
      const std::size_t b = order[k];
      if (key(a) == key(b) && start(a) + layout.ranges[a].count > start(b))
        throw Error(fmt::format("{}: {} and {} overlap in the {}", what,
                                range_text(layout.ranges[a], a), range_text(layout.ranges[b], b),
                                space));
    }
  };
  check_sorted([&](std::size_t i) { return layout.ranges[i].shard_offset; },
               [](std::size_t) { return std::string(); }, "shard");
  check_sorted([&](std::size_t i) { return layout.ranges[i].parameter_offset; },
               [&](std::size_t i) { return layout.ranges[i].parameter; }, "parameter");
}

void validate_plan(const ShardedCheckpointPlan& plan) {
  std::set<std::string> names;
  for (const CheckpointParameter& parameter : plan.parameters) {
    if (parameter.name.empty()) throw Error("sharded checkpoint: a parameter has an empty name");
    if (!names.insert(parameter.name).second)
      throw Error(
          fmt::format("sharded checkpoint: parameter name '{}' appears twice", parameter.name));
    // Extents are checked one by one so that the product in `size()` cannot wrap around
    // (a hand-edited index could hold any numbers).
    std::size_t elements = 1;
    for (const std::int64_t extent : parameter.shape) {
      if (extent < 0)
        throw Error(fmt::format("sharded checkpoint: parameter '{}' has a negative extent {}",
                                parameter.name, extent));
      const auto n = static_cast<std::size_t>(extent);
      if (n != 0 && elements > (std::numeric_limits<std::size_t>::max() / 8) / n)
        throw Error(
            fmt::format("sharded checkpoint: parameter '{}' has shape [{}]: more elements "
                        "than memory can hold",
                        parameter.name, fmt::join(parameter.shape, ", ")));
      elements *= n;
    }
  }
  if (plan.layouts.empty())
    throw Error("sharded checkpoint: no layouts, expected one per rank (world size >= 1)");
  for (std::size_t rank = 0; rank < plan.layouts.size(); ++rank)
    validate_layout(plan.parameters, plan.layouts[rank], fmt::format("rank {}'s layout", rank));

  // Coverage: every element of every parameter in exactly one range of one rank.
  struct Piece {
    std::size_t first, count, rank, range;
  };
  std::map<std::string, std::vector<Piece>> pieces;
  for (std::size_t rank = 0; rank < plan.layouts.size(); ++rank)
    for (std::size_t i = 0; i < plan.layouts[rank].ranges.size(); ++i) {
      const ShardRange& range = plan.layouts[rank].ranges[i];
      pieces[range.parameter].push_back({range.parameter_offset, range.count, rank, i});
    }
  for (const CheckpointParameter& parameter : plan.parameters) {
    std::vector<Piece>& list = pieces[parameter.name];
    std::sort(list.begin(), list.end(),
              [](const Piece& a, const Piece& b) { return a.first < b.first; });
    std::size_t covered = 0;  // elements [0, covered) are covered
    const Piece* previous = nullptr;
    for (const Piece& piece : list) {
      if (piece.first < covered)
        throw Error(fmt::format(
            "sharded checkpoint: parameter '{}' elements {} are saved twice: by rank {} range {} "
            "and rank {} range {}; expected each element in exactly one rank's shard",
            parameter.name, span_text(piece.first, covered - piece.first), previous->rank,
            previous->range, piece.rank, piece.range));
      if (piece.first > covered) break;
      covered = piece.first + piece.count;
      previous = &piece;
    }
    if (covered != parameter.size()) {
      std::size_t end = parameter.size();
      for (const Piece& piece : list)
        if (piece.first > covered) end = std::min(end, piece.first);
      throw Error(fmt::format(
          "sharded checkpoint: parameter '{}' elements {} are in no rank's shard; expected "
          "every element of its {} in exactly one",
          parameter.name, span_text(covered, end - covered), parameter.size()));
    }
  }

  std::set<std::string> tensors;
  for (const std::string& name : plan.tensors) {
    if (name.empty() || name == "__metadata__")
      throw Error(fmt::format("sharded checkpoint: '{}' is not a valid tensor name", name));
    if (!tensors.insert(name).second)
      throw Error(fmt::format("sharded checkpoint: tensor name '{}' appears twice", name));
  }
  for (const std::string_view key : kReservedKeys)
    if (plan.metadata.contains(std::string(key)))
      throw Error(fmt::format(
          "sharded checkpoint: metadata key '{}' is reserved for the runtime's own entry", key));
}

std::string shard_file_name(int rank, int world_size) {
  return fmt::format("shard-{}-of-{}.safetensors", rank, world_size);
}

void save_checkpoint_shard(const fs::path& directory, const ShardedCheckpointPlan& plan, int rank,
                           std::span<const NamedTensor> tensors) {
  validate_plan(plan);
  const int world_size = static_cast<int>(plan.layouts.size());
  if (rank < 0 || rank >= world_size)
    throw Error(
        fmt::format("save_checkpoint_shard: rank {}, expected 0 to {} (the plan has {} "
                    "layouts)",
                    rank, world_size - 1, world_size));
  const ShardLayout& layout = plan.layouts[static_cast<std::size_t>(rank)];
  const fs::path file = directory / shard_file_name(rank, world_size);

  // The tensors in the plan's order, each exactly once and of the shard's size.
  std::vector<NamedTensor> ordered;
  for (const std::string& name : plan.tensors) {
    const auto it = std::find_if(tensors.begin(), tensors.end(),
                                 [&](const NamedTensor& t) { return t.name == name; });
    if (it == tensors.end())
      throw Error(fmt::format("save_checkpoint_shard '{}': no tensor '{}', which the plan names",
                              file.string(), name));
    if (it->tensor == nullptr)
      throw Error(fmt::format("save_checkpoint_shard '{}': tensor '{}' is a null pointer",
                              file.string(), name));
    if (it->tensor->size() != layout.shard_elements)
      throw Error(fmt::format(
          "save_checkpoint_shard '{}': tensor '{}' has {} elements, expected rank {}'s shard "
          "size {}",
          file.string(), name, it->tensor->size(), rank, layout.shard_elements));
    ordered.push_back(*it);
  }
  for (const NamedTensor& named : tensors)
    if (std::count_if(tensors.begin(), tensors.end(),
                      [&](const NamedTensor& t) { return t.name == named.name; }) != 1 ||
        std::find(plan.tensors.begin(), plan.tensors.end(), named.name) == plan.tensors.end())
      throw Error(fmt::format(
          "save_checkpoint_shard '{}': tensor '{}' is given twice or is not one of the plan's "
          "tensors",
          file.string(), named.name));

  std::map<std::string, std::string> metadata = plan.metadata;
  metadata["format"] = kFormat;
  metadata["version"] = std::to_string(kVersion);
  metadata["rank"] = std::to_string(rank);
  metadata["world_size"] = std::to_string(world_size);
  std::string index;
  try {
    metadata["layout"] = layout_to_json(layout).dump();
    if (rank == 0) index = index_text(plan);
  } catch (const nlohmann::json::exception& error) {
    throw Error(
        fmt::format("save_checkpoint_shard '{}': a parameter name, tensor name or "
                    "metadata string is not valid UTF-8 ({})",
                    file.string(), error.what()));
  }
  save_safetensors(file, ordered, metadata, Checksums::kWrite);
  // The index after the shard: a rank 0 that fails to save its shard leaves no index.
  if (rank == 0) write_file_atomically(directory / kIndexFile, index);
}

ShardedCheckpointPlan detail::parse_checkpoint_index(std::string_view text,
                                                     const std::string& file) {
  ShardedCheckpointPlan plan = plan_from_index(parse_json(text, file), file);
  try {
    validate_plan(plan);
  } catch (const Error& error) {
    throw Error(fmt::format("{}: {}", file, error.what()));
  }
  return plan;
}

ShardedCheckpointPlan load_checkpoint_index(const fs::path& directory) {
  const fs::path path = directory / kIndexFile;
  const std::string file = "sharded checkpoint index '" + path.string() + "'";
  std::error_code ignored;
  if (!fs::exists(directory, ignored))
    throw Error(
        fmt::format("sharded checkpoint '{}': no such file or directory (expected the "
                    "directory that save_checkpoint_shard wrote)",
                    directory.string()));
  if (!fs::is_directory(directory, ignored))
    throw Error(
        fmt::format("sharded checkpoint '{}' is not a directory (expected the directory "
                    "that save_checkpoint_shard wrote)",
                    directory.string()));
  if (!fs::exists(path, ignored))
    throw Error(
        fmt::format("'{}' is not a sharded checkpoint: it has no {} (expected the "
                    "directory that save_checkpoint_shard wrote)",
                    directory.string(), kIndexFile));
  ShardedCheckpointPlan plan = detail::parse_checkpoint_index(
      detail::read_whole_file(path, "sharded checkpoint index"), file);
  const int world_size = static_cast<int>(plan.layouts.size());
  for (int rank = 0; rank < world_size; ++rank) {
    const fs::path shard = directory / shard_file_name(rank, world_size);
    std::error_code error;
    if (!fs::is_regular_file(shard, error))
      throw Error(
          fmt::format("sharded checkpoint '{}': the shard file of rank {}, '{}', is "
                      "missing; the index names {} shards",
                      directory.string(), rank, shard.string(), world_size));
  }
  return plan;
}

void load_checkpoint_shard(const fs::path& directory, const ShardLayout& layout,
                           std::span<const ShardTarget> targets) {
  const ShardedCheckpointPlan plan = load_checkpoint_index(directory);
  validate_layout(plan.parameters, layout, "the layout to load");
  std::set<std::string> seen;
  for (const ShardTarget& target : targets) {
    if (std::find(plan.tensors.begin(), plan.tensors.end(), target.name) == plan.tensors.end())
      throw Error(
          fmt::format("load_checkpoint_shard '{}': the checkpoint has no tensor '{}' "
                      "(it has {})",
                      directory.string(), target.name, fmt::join(plan.tensors, ", ")));
    if (!seen.insert(target.name).second)
      throw Error(
          fmt::format("load_checkpoint_shard: tensor '{}' is asked for twice", target.name));
    if (target.tensor == nullptr || target.tensor->size() != layout.shard_elements)
      throw Error(fmt::format(
          "load_checkpoint_shard: the tensor to fill for '{}' has {} elements, "
          "expected the layout's shard size {}",
          target.name, target.tensor ? target.tensor->size() : 0, layout.shard_elements));
  }
  // Every target checked before any is written: a missing tensor changes nothing.
  // Padding is zero in a loaded shard, whatever the saved shards held there.
  for (const ShardTarget& target : targets) target.tensor->fill(0.0f);

  const int world_size = static_cast<int>(plan.layouts.size());
  std::map<int, Checkpoint> shards;  // the saved shards read so far, by rank
  const auto shard_of = [&](int rank) -> const Checkpoint& {
    auto it = shards.find(rank);
    if (it == shards.end()) {
      const fs::path file = directory / shard_file_name(rank, world_size);
      Checkpoint shard = load_safetensors(file);
      check_shard(shard, plan, rank, file.string());
      it = shards.emplace(rank, std::move(shard)).first;
    }
    return it->second;
  };
  for (const ShardRange& wanted : layout.ranges) {
    // Every saved piece of the same parameter that intersects the wanted elements.
    for (int rank = 0; rank < world_size; ++rank)
      for (const ShardRange& saved : plan.layouts[static_cast<std::size_t>(rank)].ranges) {
        if (saved.parameter != wanted.parameter) continue;
        const std::size_t first = std::max(saved.parameter_offset, wanted.parameter_offset);
        const std::size_t last =
            std::min(saved.parameter_offset + saved.count, wanted.parameter_offset + wanted.count);
        if (first >= last) continue;
        const Checkpoint& shard = shard_of(rank);
        for (const ShardTarget& target : targets)  // the target may live on a device
          detail::copy_memory(target.tensor->view().data() + wanted.shard_offset +
                                  (first - wanted.parameter_offset),
                              target.tensor->device(),
                              shard.tensors.at(target.name).data() + saved.shard_offset +
                                  (first - saved.parameter_offset),
                              Device::kHost, (last - first) * sizeof(float));
      }
  }
}

std::map<std::string, Tensor> load_checkpoint_shard(const fs::path& directory,
                                                    const ShardLayout& layout,
                                                    MemoryCategory category) {
  const ShardedCheckpointPlan plan = load_checkpoint_index(directory);
  std::map<std::string, Tensor> tensors;
  std::vector<ShardTarget> targets;
  for (const std::string& name : plan.tensors) {
    Tensor& tensor =
        tensors
            .emplace(name, Tensor::uninitialized({static_cast<std::int64_t>(layout.shard_elements)},
                                                 category))
            .first->second;
    targets.push_back({name, &tensor});
  }
  load_checkpoint_shard(directory, layout, targets);
  return tensors;
}

Checkpoint consolidated_checkpoint(const fs::path& directory, MemoryCategory category) {
  const ShardedCheckpointPlan plan = load_checkpoint_index(directory);
  const ShardLayout layout = whole_layout(plan.parameters);
  std::map<std::string, Tensor> flat = load_checkpoint_shard(directory, layout, category);
  Checkpoint checkpoint;
  for (auto& [name, tensor] : flat) {
    if (name != kShardParameters) {
      checkpoint.tensors.emplace("optimizer." + name, std::move(tensor));
      continue;
    }
    std::size_t offset = 0;
    for (const CheckpointParameter& parameter : plan.parameters) {
      Tensor value = Tensor::uninitialized(parameter.shape, category);
      if (!value.empty()) std::memcpy(value.data(), tensor.data() + offset, value.bytes());
      offset += parameter.size();
      checkpoint.tensors.emplace(parameter.name, std::move(value));
    }
  }
  checkpoint.metadata = plan.metadata;
  checkpoint.metadata["sharded_world_size"] = std::to_string(plan.layouts.size());
  return checkpoint;
}

void consolidate_checkpoint(const fs::path& directory, const fs::path& output) {
  const ShardedCheckpointPlan plan = load_checkpoint_index(directory);
  // The output must not replace a file of the checkpoint it is made from.
  std::vector<fs::path> inputs = {directory / kIndexFile};
  for (std::size_t rank = 0; rank < plan.layouts.size(); ++rank)
    inputs.push_back(
        directory / shard_file_name(static_cast<int>(rank), static_cast<int>(plan.layouts.size())));
  check_output_path(output, inputs);
  const Checkpoint checkpoint = consolidated_checkpoint(directory);
  // Parameters in the model's order, then the state tensors in the plan's order.
  std::vector<NamedTensor> tensors;
  if (std::find(plan.tensors.begin(), plan.tensors.end(), kShardParameters) != plan.tensors.end())
    for (const CheckpointParameter& parameter : plan.parameters)
      tensors.push_back({parameter.name, &checkpoint.tensors.at(parameter.name)});
  for (const std::string& name : plan.tensors)
    if (name != kShardParameters)
      tensors.push_back({"optimizer." + name, &checkpoint.tensors.at("optimizer." + name)});
  save_safetensors(output, tensors, checkpoint.metadata, Checksums::kWrite);
}

}  // namespace dp
