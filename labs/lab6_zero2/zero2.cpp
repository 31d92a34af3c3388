// Lab skeleton, generated from the reference by tools/make-skeletons: your code goes where
// dp::NotImplemented is thrown.
// zero2.cpp: lab 6, ZeRO-2. Your part: the bucket rule, the members of
// ZeroTwoOptimizer::State and the bodies below.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dp/error.h"
#include "dp/memory.h"
#include "dp/sharded_checkpoint.h"
#include "dp/tensor_ops.h"
#include "lab6.h"

namespace dp::lab6 {

// Your constants, if any.

std::vector<Bucket> plan_buckets(const Model& model, int world_size, std::size_t bucket_cap_bytes) {
  (void)model;
  (void)world_size;
  (void)bucket_cap_bytes;
  throw NotImplemented("lab6::plan_buckets");
}

std::size_t shard_elements(const std::vector<Bucket>& buckets) {
  (void)buckets;
  throw NotImplemented("lab6::shard_elements");
}

/// Everything a ZeroTwoOptimizer keeps between hooks and steps.
struct ZeroTwoOptimizer::State {
  // Your members.
};

ZeroTwoOptimizer::ZeroTwoOptimizer(Model& model, Communicator& comm, OptimizerFactory make_inner,
                                   std::size_t bucket_cap_bytes, float max_norm,
                                   AccumulationOptions accumulation) {
  (void)model;
  (void)comm;
  (void)make_inner;
  (void)bucket_cap_bytes;
  (void)max_norm;
  (void)accumulation;
  throw NotImplemented("lab6::ZeroTwoOptimizer::ZeroTwoOptimizer");
}

ZeroTwoOptimizer::~ZeroTwoOptimizer() = default;  // each pending Work waits as it is destroyed

std::optional<float> ZeroTwoOptimizer::step() {
  throw NotImplemented("lab6::ZeroTwoOptimizer::step");
}

const std::vector<Bucket>& ZeroTwoOptimizer::buckets() const {
  throw NotImplemented("lab6::ZeroTwoOptimizer::buckets");
}

const Tensor& ZeroTwoOptimizer::shard_gradients() const {
  throw NotImplemented("lab6::ZeroTwoOptimizer::shard_gradients");
}

const Tensor& ZeroTwoOptimizer::shard_parameters() const {
  throw NotImplemented("lab6::ZeroTwoOptimizer::shard_parameters");
}

Optimizer& ZeroTwoOptimizer::inner() {
  throw NotImplemented("lab6::ZeroTwoOptimizer::inner");
}

// Your helpers for the checkpoints, if any.

void ZeroTwoOptimizer::save_checkpoint(const std::filesystem::path& directory) const {
  (void)directory;
  throw NotImplemented("lab6::ZeroTwoOptimizer::save_checkpoint");
}

void ZeroTwoOptimizer::load_checkpoint(const std::filesystem::path& directory) {
  (void)directory;
  throw NotImplemented("lab6::ZeroTwoOptimizer::load_checkpoint");
}

std::size_t predicted_gradient_peak_bytes(Model& model, int world_size,
                                          std::size_t bucket_cap_bytes) {
  (void)model;
  (void)world_size;
  (void)bucket_cap_bytes;
  throw NotImplemented("lab6::predicted_gradient_peak_bytes");
}

AccumulationCost predicted_accumulation_cost(Model& model, int world_size,
                                             std::size_t bucket_cap_bytes,
                                             AccumulationOptions accumulation) {
  (void)model;
  (void)world_size;
  (void)bucket_cap_bytes;
  (void)accumulation;
  throw NotImplemented("lab6::predicted_accumulation_cost");
}

}  // namespace dp::lab6
