// Tests of sharded checkpoints: the layouts of the ZeRO stages, round trips, re-sharding from
// N to M ranks bit for bit, consolidation, every validation error and the safe writes.
//
// The values are random bit patterns (NaN payloads, denormals and -0 included), so a
// comparison with memcmp shows that every element travels as it is, and the saved padding
// is a NaN sentinel, so a loader that reads padding or leaves it unzeroed is caught.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "dp/checkpoint.h"
#include "dp/comm.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/model.h"
#include "dp/output_file.h"
#include "dp/sharded_checkpoint.h"
#include "test_support.h"

namespace {

namespace fs = std::filesystem;

using dp::testing::message_of;
using dp::testing::test_directory;

const std::vector<std::string> kTensors = {"params", "exp_avg", "exp_avg_sq"};

/// A small MLP's parameters: 44 elements, so that every N below pads differently.
std::vector<dp::CheckpointParameter> parameters() {
  return {{"fc1.weight", {7, 3}}, {"fc1.bias", {7}}, {"fc2.weight", {2, 7}}, {"fc2.bias", {2}}};
}

/// The flat offset of each parameter in definition order.
std::map<std::string, std::size_t> flat_offsets() {
  std::map<std::string, std::size_t> offsets;
  std::size_t offset = 0;
  for (const dp::CheckpointParameter& parameter : parameters()) {
    offsets[parameter.name] = offset;
    offset += parameter.size();
  }
  return offsets;
}

/// The full flat value of tensor `t` (0 params, 1 exp_avg, ...): distinct random bit patterns.
std::vector<float> full_values(std::size_t t) {
  std::vector<float> values(44);
  std::uint32_t state = 0x9E3779B9u * static_cast<std::uint32_t>(t + 1);
  for (float& value : values) {
    state = state * 1664525u + 1013904223u;
    value = std::bit_cast<float>(state ^ (state >> 13));
  }
  return values;
}

const float kPaddingSentinel = std::bit_cast<float>(0x7FC0DEADu);

/// The layouts of lab 5 (one flat segment), lab 6 (buckets in reverse order) and lab 7
/// (one unit per layer) on `world_size` ranks.
std::vector<dp::ShardLayout> layouts_of(const std::string& kind, int world_size) {
  const std::vector<dp::CheckpointParameter> params = parameters();
  std::vector<std::vector<std::size_t>> segments;
  if (kind == "flat") segments = {dp::all_parameters(params)};
  if (kind == "buckets") segments = {{3, 2}, {1, 0}};
  if (kind == "units") segments = {{0, 1}, {2, 3}};
  return dp::chunked_layouts(params, segments, world_size);
}

/// Rank shard of tensor `t` for `layout`: the full values where the ranges say, `padding`
/// elsewhere.
dp::Tensor shard_of(const dp::ShardLayout& layout, std::size_t t, float padding) {
  const std::vector<float> full = full_values(t);
  const std::map<std::string, std::size_t> offsets = flat_offsets();
  dp::Tensor shard({static_cast<std::int64_t>(layout.shard_elements)});
  shard.fill(padding);
  for (const dp::ShardRange& range : layout.ranges)
    std::memcpy(shard.data() + range.shard_offset,
                full.data() + offsets.at(range.parameter) + range.parameter_offset,
                range.count * sizeof(float));
  return shard;
}

dp::ShardedCheckpointPlan plan_of(const std::string& kind, int world_size) {
  dp::ShardedCheckpointPlan plan;
  plan.parameters = parameters();
  plan.layouts = layouts_of(kind, world_size);
  plan.tensors = kTensors;
  plan.metadata = {{"step", "7"}};
  return plan;
}

/// Saves every rank's shard of `plan`, padding set to the sentinel, one rank after another.
void save_all(const fs::path& dir, const dp::ShardedCheckpointPlan& plan) {
  for (std::size_t rank = 0; rank < plan.layouts.size(); ++rank) {
    std::vector<dp::Tensor> shards;
    for (std::size_t t = 0; t < kTensors.size(); ++t)
      shards.push_back(shard_of(plan.layouts[rank], t, kPaddingSentinel));
    std::vector<dp::NamedTensor> named;
    for (std::size_t t = 0; t < kTensors.size(); ++t) named.push_back({kTensors[t], &shards[t]});
    dp::save_checkpoint_shard(dir, plan, static_cast<int>(rank), named);
  }
}

bool bitwise_equal(const dp::Tensor& a, const dp::Tensor& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

/// Loads every rank of `layouts` from `dir` and checks it against the expected shard, its
/// padding zero, bit for bit.
void expect_loads(const fs::path& dir, const std::vector<dp::ShardLayout>& layouts,
                  const std::string& what) {
  for (std::size_t rank = 0; rank < layouts.size(); ++rank) {
    std::map<std::string, dp::Tensor> loaded = dp::load_checkpoint_shard(dir, layouts[rank]);
    ASSERT_EQ(loaded.size(), kTensors.size());
    for (std::size_t t = 0; t < kTensors.size(); ++t)
      EXPECT_TRUE(bitwise_equal(loaded.at(kTensors[t]), shard_of(layouts[rank], t, 0.0f)))
          << what << ", rank " << rank << ", tensor " << kTensors[t];
  }
}

TEST(ShardedCheckpointLayout, ChunkedLayoutsFollowTheZeroRules) {
  // Lab 5 on 3 ranks: 44 elements, S = 15; rank 1 holds flat [15, 30), rank 2 flat [30, 44)
  // and one padding element.
  const std::vector<dp::ShardLayout> flat = layouts_of("flat", 3);
  ASSERT_EQ(flat.size(), 3u);
  EXPECT_EQ(flat[1],
            (dp::ShardLayout{
                {{"fc1.weight", 15, 6, 0}, {"fc1.bias", 0, 7, 6}, {"fc2.weight", 0, 2, 13}}, 15}));
  EXPECT_EQ(flat[2], (dp::ShardLayout{{{"fc2.weight", 2, 12, 0}, {"fc2.bias", 0, 2, 12}}, 15}));
  // Lab 7 on 2 ranks: unit fc1 (28 elements, C = 14), unit fc2 (16, C = 8).
  const std::vector<dp::ShardLayout> units = layouts_of("units", 2);
  EXPECT_EQ(units[1], (dp::ShardLayout{{{"fc1.weight", 14, 7, 0},
                                        {"fc1.bias", 0, 7, 7},
                                        {"fc2.weight", 8, 6, 14},
                                        {"fc2.bias", 0, 2, 20}},
                                       22}));
  // A rank whose chunk is all padding has no ranges but its size.
  const std::vector<dp::ShardLayout> many = layouts_of("buckets", 40);
  EXPECT_TRUE(many[39].ranges.empty());
  EXPECT_EQ(many[39].shard_elements, 2u);  // ceil(16 / 40) + ceil(28 / 40)
  EXPECT_NE(message_of<dp::Error>([] { layouts_of("flat", 0); }).find("world size 0"),
            std::string::npos);
}

TEST(ShardedCheckpoint, RoundTripAtTheSameWorldSizeIsBitwise) {
  for (const std::string kind : {"flat", "buckets", "units"})
    for (int n : {1, 2, 3, 4}) {
      const fs::path dir = test_directory() / (kind + std::to_string(n));
      fs::create_directories(dir);
      save_all(dir, plan_of(kind, n));
      EXPECT_TRUE(fs::is_regular_file(dir / "index.json"));
      EXPECT_TRUE(fs::is_regular_file(dir / dp::shard_file_name(n - 1, n)));
      expect_loads(dir, layouts_of(kind, n), kind + " " + std::to_string(n) + " -> same");
      EXPECT_EQ(dp::load_checkpoint_index(dir).metadata.at("step"), "7");
    }
}

TEST(ShardedCheckpoint, ReshardsFromNToMRanksBitwise) {
  const std::vector<std::pair<int, int>> pairs = {{4, 3}, {3, 2}, {2, 5}, {1, 4}, {5, 1}, {4, 2}};
  const std::vector<std::string> kinds = {"flat", "buckets", "units"};
  for (const auto& [n, m] : pairs)
    for (const std::string& saved : kinds) {
      const fs::path dir = test_directory() / (saved + std::to_string(n));
      fs::create_directories(dir);
      save_all(dir, plan_of(saved, n));
      // Loaded with the same stage's layout and with the others' (ZeRO-1 -> ZeRO-3, ...).
      for (const std::string& loaded : kinds)
        expect_loads(dir, layouts_of(loaded, m),
                     fmt::format("{} at {} -> {} at {}", saved, n, loaded, m));
    }
}

TEST(ShardedCheckpoint, LoadFillsTheCallersTensorsInPlace) {
  const fs::path dir = test_directory();
  save_all(dir, plan_of("units", 3));
  const dp::ShardLayout layout = layouts_of("flat", 2)[1];
  dp::Tensor params({static_cast<std::int64_t>(layout.shard_elements)});
  params.fill(kPaddingSentinel);
  const float* before = params.data();
  const std::vector<dp::ShardTarget> targets = {{"params", &params}};  // a subset is allowed
  dp::load_checkpoint_shard(dir, layout, targets);
  EXPECT_EQ(params.data(), before);
  EXPECT_TRUE(bitwise_equal(params, shard_of(layout, 0, 0.0f)));
}

TEST(ShardedCheckpoint, ConsolidateGivesEveryParameterWholeAndTheFlatState) {
  const fs::path dir = test_directory();
  save_all(dir, plan_of("buckets", 3));
  const fs::path output = dir / "full.safetensors";
  dp::consolidate_checkpoint(dir, output);
  std::vector<dp::Checkpoint> both;
  both.push_back(dp::consolidated_checkpoint(dir));
  both.push_back(dp::load_safetensors(output));
  for (const dp::Checkpoint& full : both) {
    const std::vector<float> values = full_values(0);
    const std::map<std::string, std::size_t> offsets = flat_offsets();
    for (const dp::CheckpointParameter& parameter : parameters()) {
      const dp::Tensor& tensor = full.tensors.at(parameter.name);
      EXPECT_EQ(tensor.shape(), parameter.shape);
      EXPECT_EQ(
          std::memcmp(tensor.data(), values.data() + offsets.at(parameter.name), tensor.bytes()), 0)
          << parameter.name;
    }
    for (std::size_t t = 1; t < kTensors.size(); ++t) {
      const dp::Tensor& state = full.tensors.at("optimizer." + kTensors[t]);
      const std::vector<float> expected = full_values(t);
      ASSERT_EQ(state.size(), expected.size());
      EXPECT_EQ(std::memcmp(state.data(), expected.data(), state.bytes()), 0) << kTensors[t];
    }
    EXPECT_EQ(full.tensors.size(), parameters().size() + 2);
    EXPECT_EQ(full.metadata.at("step"), "7");
    EXPECT_EQ(full.metadata.at("sharded_world_size"), "3");
  }
}

TEST(ShardedCheckpoint, TheIndexDescribesShardsRangesAndPadding) {
  const fs::path dir = test_directory();
  save_all(dir, plan_of("flat", 3));
  std::ifstream in(dir / "index.json");
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  for (const char* part :
       {"\"format\": \"dplab-sharded-checkpoint\"", "\"world_size\": 3",
        "\"file\": \"shard-2-of-3.safetensors\"", "\"shard_elements\": 15",
        "\"parameter\": \"fc2.bias\"", "\"shard_offset\": 12", "\"tensors\": [\n    \"params\""})
    EXPECT_NE(text.find(part), std::string::npos) << part << "\nin:\n" << text;
  const dp::Checkpoint shard = dp::load_safetensors(dir / "shard-1-of-3.safetensors");
  EXPECT_EQ(shard.metadata.at("rank"), "1");
  EXPECT_EQ(shard.metadata.at("world_size"), "3");
  EXPECT_EQ(shard.metadata.at("step"), "7");
  EXPECT_EQ(shard.tensors.at("exp_avg").size(), 15u);
}

TEST(ShardedCheckpoint, RanksSaveConcurrentlyWithoutACollective) {
  const fs::path dir = test_directory();
  const dp::ShardedCheckpointPlan plan = plan_of("units", 3);
  dp::launch({.world_size = 3}, [&](dp::Communicator& comm) {
    const dp::ShardLayout& layout = plan.layouts[static_cast<std::size_t>(comm.rank())];
    std::vector<dp::Tensor> shards;
    for (std::size_t t = 0; t < kTensors.size(); ++t)
      shards.push_back(shard_of(layout, t, kPaddingSentinel));
    std::vector<dp::NamedTensor> named;
    for (std::size_t t = 0; t < kTensors.size(); ++t) named.push_back({kTensors[t], &shards[t]});
    dp::save_checkpoint_shard(dir, plan, comm.rank(), named);
    comm.barrier();  // the checkpoint is complete on every rank after this
    const std::vector<dp::ShardLayout> two = layouts_of("flat", 2);
    if (comm.rank() < 2) {
      std::map<std::string, dp::Tensor> loaded =
          dp::load_checkpoint_shard(dir, two[static_cast<std::size_t>(comm.rank())]);
      EXPECT_TRUE(bitwise_equal(loaded.at("exp_avg_sq"),
                                shard_of(two[static_cast<std::size_t>(comm.rank())], 2, 0.0f)));
    }
  });
}

// --- validation ---------------------------------------------------------------------------

void expect_error(const std::function<void()>& action, std::initializer_list<std::string> parts) {
  const std::string message = message_of<dp::Error>(action);
  for (const std::string& part : parts)
    EXPECT_NE(message.find(part), std::string::npos)
        << "message: " << message << "\nshould contain: " << part;
}

TEST(ShardedCheckpointErrors, PlansWhoseRangesOverlapLeaveGapsOrRunPastTheEnd) {
  dp::ShardedCheckpointPlan plan = plan_of("flat", 2);  // S = 22; rank 1: fc1.weight 22..
  // Rank 1 also saves fc1.weight element 21, which rank 0 saves.
  dp::ShardedCheckpointPlan twice = plan;
  twice.layouts[1].ranges.push_back({"fc1.weight", 20, 1, 22});
  twice.layouts[1].shard_elements = 23;
  expect_error([&] { dp::validate_plan(twice); },
               {"parameter 'fc1.weight' elements [20, 21) are saved twice", "rank 0 range 0",
                "rank 1 range"});
  dp::ShardedCheckpointPlan gap = plan;
  gap.layouts[1].ranges.pop_back();  // fc2.bias
  expect_error([&] { dp::validate_plan(gap); },
               {"parameter 'fc2.bias' elements [0, 2) are in no rank's shard"});
  dp::ShardedCheckpointPlan in_shard = plan;
  in_shard.layouts[0].ranges.push_back({"fc2.bias", 0, 1, 3});
  expect_error([&] { dp::validate_plan(in_shard); }, {"rank 0's layout", "overlap in the shard"});
  dp::ShardedCheckpointPlan past_parameter = plan;
  past_parameter.layouts[1].ranges.back().count = 3;
  expect_error([&] { dp::validate_plan(past_parameter); },
               {"rank 1's layout", "parameter 'fc2.bias' elements [0, 3)",
                "runs past the end of the parameter, which has 2 elements"});
  dp::ShardedCheckpointPlan past_shard = plan;
  past_shard.layouts[1].shard_elements = 21;
  expect_error([&] { dp::validate_plan(past_shard); },
               {"rank 1's layout", "runs past the end of the shard, which has 21 elements"});
  dp::ShardedCheckpointPlan unknown = plan;
  unknown.layouts[0].ranges[0].parameter = "fc9.weight";
  expect_error([&] { dp::validate_plan(unknown); },
               {"names parameter 'fc9.weight', which the model does not have"});
  dp::ShardedCheckpointPlan huge = plan;
  huge.parameters[3].shape = {std::int64_t{1} << 40, std::int64_t{1} << 40};
  expect_error([&] { dp::validate_plan(huge); },
               {"parameter 'fc2.bias' has shape [1099511627776, 1099511627776]: more elements"});
  dp::ShardedCheckpointPlan reserved = plan;
  reserved.metadata["world_size"] = "2";
  expect_error([&] { dp::validate_plan(reserved); }, {"metadata key 'world_size' is reserved"});
  // A layout to load is checked the same way.
  const fs::path dir = test_directory();
  save_all(dir, plan);
  dp::ShardLayout bad = layouts_of("flat", 3)[0];
  bad.ranges.push_back({"fc1.weight", 0, 1, 14});
  expect_error([&] { dp::load_checkpoint_shard(dir, bad); },
               {"the layout to load", "overlap in the shard"});
}

TEST(ShardedCheckpointErrors, SavingChecksTheRankAndEveryTensor) {
  const fs::path dir = test_directory();
  const dp::ShardedCheckpointPlan plan = plan_of("flat", 3);
  dp::Tensor right({15});
  dp::Tensor wrong({14});
  const std::vector<dp::NamedTensor> short_one = {
      {"params", &right}, {"exp_avg", &wrong}, {"exp_avg_sq", &right}};
  expect_error([&] { dp::save_checkpoint_shard(dir, plan, 0, short_one); },
               {"tensor 'exp_avg' has 14 elements, expected rank 0's shard size 15"});
  const std::vector<dp::NamedTensor> missing = {{"params", &right}, {"exp_avg", &right}};
  expect_error([&] { dp::save_checkpoint_shard(dir, plan, 0, missing); },
               {"no tensor 'exp_avg_sq', which the plan names"});
  const std::vector<dp::NamedTensor> extra = {
      {"params", &right}, {"exp_avg", &right}, {"exp_avg_sq", &right}, {"momentum", &right}};
  expect_error([&] { dp::save_checkpoint_shard(dir, plan, 0, extra); },
               {"tensor 'momentum'", "not one of the plan's tensors"});
  const std::vector<dp::NamedTensor> good = {
      {"params", &right}, {"exp_avg", &right}, {"exp_avg_sq", &right}};
  expect_error([&] { dp::save_checkpoint_shard(dir, plan, 3, good); }, {"rank 3, expected 0 to 2"});
  dp::ShardedCheckpointPlan not_utf8 = plan;
  not_utf8.metadata["note"] = "\xff";
  expect_error([&] { dp::save_checkpoint_shard(dir, not_utf8, 0, good); }, {"not valid UTF-8"});
  EXPECT_TRUE(fs::is_empty(dir));  // nothing written by a failed save
}

TEST(ShardedCheckpointErrors, LoadingChecksTheFilesAgainstTheIndex) {
  const fs::path base = test_directory();
  const fs::path dir = base / "three";
  const fs::path other = base / "two";
  fs::create_directories(dir);
  fs::create_directories(other);
  save_all(dir, plan_of("flat", 3));
  save_all(other, plan_of("flat", 2));
  const dp::ShardLayout layout = layouts_of("flat", 1)[0];

  // (The shard files below are rewritten with checksums: intact files of the wrong kind.)
  // A shard of another world size in its place.
  fs::copy_file(dir / "shard-0-of-3.safetensors", dir / "keep",
                fs::copy_options::overwrite_existing);
  fs::copy_file(other / "shard-0-of-2.safetensors", dir / "shard-0-of-3.safetensors",
                fs::copy_options::overwrite_existing);
  expect_error([&] { dp::load_checkpoint_shard(dir, layout); },
               {"shard-0-of-3.safetensors' was saved with world size 2, but the index says 3"});
  fs::rename(dir / "keep", dir / "shard-0-of-3.safetensors");

  // Another rank's shard in its place.
  fs::copy_file(dir / "shard-2-of-3.safetensors", dir / "keep");
  dp::Checkpoint shard1 = dp::load_safetensors(dir / "shard-1-of-3.safetensors");
  std::vector<dp::NamedTensor> named;
  for (auto& [name, tensor] : shard1.tensors) named.push_back({name, &tensor});
  dp::save_safetensors(dir / "shard-2-of-3.safetensors", named, shard1.metadata,
                       dp::Checksums::kWrite);
  expect_error([&] { dp::load_checkpoint_shard(dir, layout); },
               {"shard-2-of-3.safetensors' holds rank 1, expected rank 2"});

  // A tensor of the wrong size, the metadata right.
  dp::Checkpoint shard2 = dp::load_safetensors(dir / "keep");
  dp::Tensor small({14});
  named.clear();
  for (auto& [name, tensor] : shard2.tensors)
    named.push_back({name, name == "exp_avg" ? &small : &tensor});
  dp::save_safetensors(dir / "shard-2-of-3.safetensors", named, shard2.metadata,
                       dp::Checksums::kWrite);
  expect_error([&] { dp::load_checkpoint_shard(dir, layout); },
               {"tensor 'exp_avg' has 14 elements, expected the shard's 15"});

  // A layout in the file that is not the index's.
  std::map<std::string, std::string> metadata = shard2.metadata;
  metadata["layout"] = R"({"shard_elements": 15, "ranges": []})";
  named.clear();
  for (auto& [name, tensor] : shard2.tensors) named.push_back({name, &tensor});
  dp::save_safetensors(dir / "shard-2-of-3.safetensors", named, metadata, dp::Checksums::kWrite);
  expect_error([&] { dp::load_checkpoint_shard(dir, layout); },
               {"shard-2-of-3.safetensors' was saved with layout", "but the index gives rank 2"});

  // A missing shard file.
  fs::remove(dir / "shard-2-of-3.safetensors");
  expect_error([&] { dp::load_checkpoint_index(dir); },
               {"the shard file of rank 2", "shard-2-of-3.safetensors', is missing",
                "the index names 3 shards"});
  fs::rename(dir / "keep", dir / "shard-2-of-3.safetensors");
  expect_loads(dir, {layout}, "repaired");

  // Targets: unknown names and wrong sizes.
  dp::Tensor wrong({43});
  const std::vector<dp::ShardTarget> wrong_size = {{"params", &wrong}};
  expect_error([&] { dp::load_checkpoint_shard(dir, layout, wrong_size); },
               {"the tensor to fill for 'params' has 43 elements, expected the layout's shard "
                "size 44"});
  const std::vector<dp::ShardTarget> unknown = {{"momentum_buffer", &wrong}};
  expect_error([&] { dp::load_checkpoint_shard(dir, layout, unknown); },
               {"no tensor 'momentum_buffer' (it has params, exp_avg, exp_avg_sq)"});
}

TEST(ShardedCheckpointErrors, AChangedByteInAShardIsRefusedAndVersionOneStillLoads) {
  const fs::path base = test_directory();  // emptied anew on every call
  const fs::path dir = base / "damaged";
  fs::create_directories(dir);
  save_all(dir, plan_of("flat", 3));
  const dp::ShardLayout layout = layouts_of("flat", 1)[0];
  const fs::path shard = dir / "shard-1-of-3.safetensors";
  const std::string original = [&] {
    std::ifstream in(shard, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }();
  const auto write = [&](const std::string& bytes) {
    std::ofstream(shard, std::ios::binary | std::ios::trunc) << bytes;
  };

  // One bit of the last tensor's data, then the step count in the header.
  std::string bytes = original;
  bytes[bytes.size() - 2] ^= 0x01;
  write(bytes);
  expect_error([&] { dp::load_checkpoint_shard(dir, layout); },
               {"shard-1-of-3.safetensors", "the data of tensor '", "changed or damaged"});
  expect_error([&] { dp::consolidate_checkpoint(dir, base / "damaged.safetensors"); },
               {"shard-1-of-3.safetensors", "the data of tensor '"});
  bytes = original;
  const std::size_t rank = bytes.find(R"("rank":"1")");
  ASSERT_NE(rank, std::string::npos);
  bytes[rank + 8] = '2';
  write(bytes);
  expect_error([&] { dp::load_checkpoint_shard(dir, layout); },
               {"shard-1-of-3.safetensors", "the header", "changed or damaged"});

  // The checksums' key renamed: a version 2 shard must have them.
  bytes = original;
  const std::size_t key = bytes.find("dplab.crc32");
  ASSERT_NE(key, std::string::npos);
  bytes[key + 10] = 'x';
  write(bytes);
  expect_error([&] { dp::load_checkpoint_shard(dir, layout); },
               {"shard-1-of-3.safetensors' has version 2 but no checksums"});

  // A version 1 shard, written before checksums (no "version", no checksums), still loads.
  write(original);
  dp::Checkpoint saved = dp::load_safetensors(shard);
  EXPECT_TRUE(saved.checksummed);
  saved.metadata.erase("version");
  std::vector<dp::NamedTensor> named;
  for (auto& [name, tensor] : saved.tensors) named.push_back({name, &tensor});
  dp::save_safetensors(shard, named, saved.metadata);
  expect_loads(dir, {layout}, "version 1 shard");
}

TEST(ShardedCheckpointErrors, AFailedTargetCheckChangesNoTarget) {
  const fs::path dir = test_directory();
  save_all(dir, plan_of("flat", 2));
  const dp::ShardLayout layout = layouts_of("flat", 3)[1];
  // The first targets are good, the last is missing from the checkpoint or of the wrong
  // size: every target is checked before any is written, so none changes.
  dp::Tensor params({static_cast<std::int64_t>(layout.shard_elements)});
  dp::Tensor exp_avg({static_cast<std::int64_t>(layout.shard_elements)});
  dp::Tensor other({static_cast<std::int64_t>(layout.shard_elements)});
  dp::Tensor small({static_cast<std::int64_t>(layout.shard_elements - 1)});
  params.fill(kPaddingSentinel);
  exp_avg.fill(2.5f);
  other.fill(-1.0f);
  small.fill(-1.0f);
  const dp::Tensor params_before = params.clone();
  const dp::Tensor exp_avg_before = exp_avg.clone();
  const std::vector<dp::ShardTarget> missing = {
      {"params", &params}, {"exp_avg", &exp_avg}, {"momentum_buffer", &other}};
  expect_error([&] { dp::load_checkpoint_shard(dir, layout, missing); },
               {"no tensor 'momentum_buffer'"});
  EXPECT_TRUE(bitwise_equal(params, params_before)) << "a missing tensor changed 'params'";
  EXPECT_TRUE(bitwise_equal(exp_avg, exp_avg_before)) << "a missing tensor changed 'exp_avg'";
  const std::vector<dp::ShardTarget> wrong_size = {
      {"params", &params}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &small}};
  expect_error([&] { dp::load_checkpoint_shard(dir, layout, wrong_size); },
               {"the tensor to fill for 'exp_avg_sq'"});
  EXPECT_TRUE(bitwise_equal(params, params_before)) << "a wrong size changed 'params'";
  EXPECT_TRUE(bitwise_equal(exp_avg, exp_avg_before)) << "a wrong size changed 'exp_avg'";
}

TEST(ShardedCheckpointErrors, CompatibilityNamesWhatDiffers) {
  // Another world size and another layout are compatible: that is re-sharding.
  const dp::ShardedCheckpointPlan expected = plan_of("buckets", 3);
  EXPECT_NO_THROW(dp::check_checkpoint_compatible(plan_of("flat", 2), expected));
  dp::ShardedCheckpointPlan reordered = plan_of("flat", 2);
  std::reverse(reordered.tensors.begin(), reordered.tensors.end());
  EXPECT_NO_THROW(dp::check_checkpoint_compatible(reordered, expected))
      << "the tensors are a set: the order they were saved in must not matter";

  dp::ShardedCheckpointPlan swapped = plan_of("flat", 2);
  std::swap(swapped.parameters[0].shape[0], swapped.parameters[0].shape[1]);
  expect_error([&] { dp::check_checkpoint_compatible(swapped, expected); },
               {"parameter 0 is " + swapped.parameters[0].name, "expected this model's"});
  dp::ShardedCheckpointPlan fewer = plan_of("flat", 2);
  fewer.parameters.pop_back();
  expect_error([&] { dp::check_checkpoint_compatible(fewer, expected); },
               {"parameter 3 is missing"});
  dp::ShardedCheckpointPlan no_state = plan_of("flat", 2);
  no_state.tensors = {"params"};
  expect_error([&] { dp::check_checkpoint_compatible(no_state, expected); },
               {"holds the tensors [params]", "exp_avg"});
  dp::ShardedCheckpointPlan no_step = plan_of("flat", 2);
  no_step.metadata.clear();
  expect_error([&] { dp::check_checkpoint_compatible(no_step, expected); },
               {"metadata has no \"step\""});
}

TEST(ShardedCheckpointErrors, ACountIsAWholeDecimalNumber) {
  dp::ShardedCheckpointPlan saved = plan_of("flat", 2);
  EXPECT_EQ(dp::checkpoint_count(saved, "step"), 7);
  saved.metadata["step"] = "0";
  EXPECT_EQ(dp::checkpoint_count(saved, "step"), 0);
  for (const std::string bad : {"", "-1", "+3", "7 ", "0x10", "1e3", "99999999999999999999"}) {
    saved.metadata["step"] = bad;
    expect_error([&] { (void)dp::checkpoint_count(saved, "step"); },
                 {"\"step\" is \"" + bad + "\"", "expected a count"});
  }
  expect_error([&] { (void)dp::checkpoint_count(saved, "epoch"); }, {"\"epoch\" is missing"});
}

TEST(ShardedCheckpointErrors, ACorruptOrForeignIndex) {
  const fs::path dir = test_directory();
  expect_error([&] { dp::load_checkpoint_index(dir); },
               {"is not a sharded checkpoint: it has no index.json"});
  dp::write_file_atomically(dir / "index.json", "{\"format\": ");
  expect_error([&] { dp::load_checkpoint_index(dir); }, {"index.json", "not valid JSON"});
  dp::write_file_atomically(dir / "index.json", R"({"format": "something-else"})");
  expect_error([&] { dp::load_checkpoint_index(dir); },
               {"\"format\" is \"something-else\", expected \"dplab-sharded-checkpoint\""});
  save_all(dir, plan_of("flat", 2));
  std::ifstream in(dir / "index.json");
  std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  text.replace(text.find("\"world_size\": 2"), 15, "\"world_size\": 3");
  dp::write_file_atomically(dir / "index.json", text);
  expect_error([&] { dp::load_checkpoint_index(dir); },
               {"\"world_size\" is 3 but \"shards\" describes 2 shards"});
}

// The fuzz target's seed corpus (tests/fuzz/corpus/checkpoint_index): the valid index loads
// as the plan it states, and each near miss is refused with its reason. A seed that stopped
// meaning what its name says would make the fuzzer start from the wrong place.
TEST(ShardedCheckpointErrors, TheFuzzSeedsLoadOrFailForTheirReason) {
  const fs::path corpus = fs::path(DP_FUZZ_CORPUS_DIR) / "checkpoint_index";
  const auto load = [&](const std::string& seed) {
    const fs::path dir = test_directory();
    fs::copy_file(corpus / seed, dir / "index.json");
    for (int rank = 0; rank < 2; ++rank)
      dp::write_file_atomically(dir / dp::shard_file_name(rank, 2), "");
    return dp::load_checkpoint_index(dir);
  };
  const dp::ShardedCheckpointPlan plan = load("two_ranks_padded.json");
  ASSERT_EQ(plan.layouts.size(), 2u);
  EXPECT_EQ(plan.layouts[1].shard_elements, 5u);  // 4 elements and 1 of padding
  EXPECT_EQ(plan.metadata.at("step"), "3");
  expect_error([&] { load("overlap.json"); }, {"'fc.weight' elements [4, 5) are saved twice"});
  expect_error([&] { load("uncovered.json"); }, {"'fc.bias' elements [0, 3) are in no rank"});
  expect_error([&] { load("huge_shape.json"); }, {"more elements than memory can hold"});
  expect_error([&] { load("world_size_mismatch.json"); },
               {"\"world_size\" is 3 but \"shards\" describes 2 shards"});
  expect_error([&] { load("count_overflow.json"); },
               {"\"count\": 18446744073709551615, expected at most 9223372036854775807"});
}

// --- safe writes --------------------------------------------------------------------------

TEST(ShardedCheckpointFiles, WritesOnlyRegularFilesAndLeavesNoTemporaryFile) {
  const fs::path dir = test_directory();
  const dp::ShardedCheckpointPlan plan = plan_of("flat", 2);
  fs::create_directories(dir / "shard-1-of-2.safetensors");
  expect_error([&] { save_all(dir, plan); },
               {"refusing to write '", "shard-1-of-2.safetensors': it is a directory"});
  fs::remove(dir / "shard-1-of-2.safetensors");
  fs::remove(dir / "index.json");  // rank 0 wrote it before rank 1 failed
  fs::create_directories(dir / "index.json");
  expect_error([&] { save_all(dir, plan); }, {"index.json': it is a directory"});
  fs::remove(dir / "index.json");
  save_all(dir, plan);
  // The output of consolidation may not be a file of the checkpoint, nor a directory.
  expect_error([&] { dp::consolidate_checkpoint(dir, dir / "shard-0-of-2.safetensors"); },
               {"which this run reads"});
  expect_error([&] { dp::consolidate_checkpoint(dir, dir); }, {"it is a directory"});
  expect_error([&] { save_all(dir / "absent", plan); }, {"does not exist"});
  for (const fs::directory_entry& entry : fs::directory_iterator(dir))
    EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos) << entry.path();
  expect_loads(dir, layouts_of("flat", 2), "after the refusals");
}

}  // namespace

namespace {

// The example checkpoint `dplab consolidate` is tested on (cli/CMakeLists.txt): written to
// $DPLAB_SHARDED_CHECKPOINT_DIR when set, else to this test's directory.
TEST(ShardedCheckpointExample, LabSixLayoutAtFourRanks) {
  const char* target = std::getenv("DPLAB_SHARDED_CHECKPOINT_DIR");
  const fs::path dir = target != nullptr ? fs::path(target) : test_directory();
  fs::create_directories(dir);
  save_all(dir, plan_of("buckets", 4));
  EXPECT_EQ(dp::load_checkpoint_index(dir).layouts.size(), 4u);
}

}  // namespace

namespace {

// A real model's parameters, sharded as lab 7 shards them and consolidated: every parameter
// equals the model's, bit for bit, and its shape is the model's.
TEST(ShardedCheckpointModel, ConsolidatesAModelShardedByUnits) {
  const dp::Model model = dp::Model::mlp("5-7-3", {.seed = 3});
  const std::vector<dp::CheckpointParameter> params = dp::checkpoint_parameters(model);
  ASSERT_EQ(params.size(), 4u);
  EXPECT_EQ(params[0], (dp::CheckpointParameter{"fc1.weight", {7, 5}}));
  const std::vector<std::vector<std::size_t>> units = {{0, 1}, {2, 3}};
  dp::ShardedCheckpointPlan plan;
  plan.parameters = params;
  plan.layouts = dp::chunked_layouts(params, units, 3);
  plan.tensors = {dp::kShardParameters};
  const std::vector<float> flat = model.flat_parameters();
  std::vector<std::size_t> offsets;
  for (const dp::Parameter* parameter : model.parameters()) offsets.push_back(parameter->offset);
  const fs::path dir = test_directory();
  for (int rank = 0; rank < 3; ++rank) {
    const dp::ShardLayout& layout = plan.layouts[static_cast<std::size_t>(rank)];
    dp::Tensor shard({static_cast<std::int64_t>(layout.shard_elements)});
    for (const dp::ShardRange& range : layout.ranges) {
      const auto index =
          static_cast<std::size_t>(std::find_if(params.begin(), params.end(),
                                                [&](const dp::CheckpointParameter& p) {
                                                  return p.name == range.parameter;
                                                }) -
                                   params.begin());
      std::memcpy(shard.data() + range.shard_offset,
                  flat.data() + offsets[index] + range.parameter_offset,
                  range.count * sizeof(float));
    }
    const std::vector<dp::NamedTensor> named = {{dp::kShardParameters, &shard}};
    dp::save_checkpoint_shard(dir, plan, rank, named);
  }
  const dp::Checkpoint full = dp::consolidated_checkpoint(dir);
  EXPECT_EQ(full.tensors.size(), 4u);
  for (const dp::Parameter* parameter : model.parameters()) {
    const dp::Tensor& saved = full.tensors.at(parameter->name);
    EXPECT_EQ(saved.shape(), parameter->value.shape());
    EXPECT_TRUE(bitwise_equal(saved, parameter->value)) << parameter->name;
  }
}

}  // namespace
