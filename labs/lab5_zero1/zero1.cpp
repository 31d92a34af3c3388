// Lab skeleton, generated from the reference by tools/make-skeletons: your code goes where
// dp::NotImplemented is thrown.
// zero1.cpp: lab 5, ZeRO-1. Your part: the partition rule, the members of
// ZeroOneOptimizer::State and the bodies below.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dp/error.h"
#include "dp/memory.h"
#include "dp/sharded_checkpoint.h"
#include "dp/tensor_ops.h"
#include "lab5.h"

namespace dp::lab5 {

std::size_t Partition::shard_offset(int rank) const {
  (void)rank;
  throw NotImplemented("lab5::Partition::shard_offset");
}

std::size_t Partition::real_elements(int rank) const {
  (void)rank;
  throw NotImplemented("lab5::Partition::real_elements");
}

Partition partition(std::size_t num_parameters, int world_size) {
  (void)num_parameters;
  (void)world_size;
  throw NotImplemented("lab5::partition");
}

/// Everything a ZeroOneOptimizer keeps between steps.
struct ZeroOneOptimizer::State {
  // Your members.
};

ZeroOneOptimizer::ZeroOneOptimizer(Model& model, Communicator& comm, OptimizerFactory make_inner,
                                   float max_norm, bool overlap_allgather) {
  (void)model;
  (void)comm;
  (void)make_inner;
  (void)max_norm;
  (void)overlap_allgather;
  throw NotImplemented("lab5::ZeroOneOptimizer::ZeroOneOptimizer");
}

ZeroOneOptimizer::~ZeroOneOptimizer() {
  // Complete any call your design leaves in flight.
}

std::optional<float> ZeroOneOptimizer::step() {
  throw NotImplemented("lab5::ZeroOneOptimizer::step");
}

const Partition& ZeroOneOptimizer::partition() const {
  throw NotImplemented("lab5::ZeroOneOptimizer::partition");
}

const Tensor& ZeroOneOptimizer::shard_parameters() const {
  throw NotImplemented("lab5::ZeroOneOptimizer::shard_parameters");
}

const Tensor& ZeroOneOptimizer::flat_parameters() const {
  throw NotImplemented("lab5::ZeroOneOptimizer::flat_parameters");
}

Optimizer& ZeroOneOptimizer::inner() {
  throw NotImplemented("lab5::ZeroOneOptimizer::inner");
}

// Your helpers for the checkpoints, if any.

void ZeroOneOptimizer::save_checkpoint(const std::filesystem::path& directory) const {
  (void)directory;
  throw NotImplemented("lab5::ZeroOneOptimizer::save_checkpoint");
}

void ZeroOneOptimizer::load_checkpoint(const std::filesystem::path& directory) {
  (void)directory;
  throw NotImplemented("lab5::ZeroOneOptimizer::load_checkpoint");
}

std::size_t predicted_state_bytes_per_rank(std::size_t num_parameters, int world_size,
                                           std::size_t state_floats_per_element) {
  (void)num_parameters;
  (void)world_size;
  (void)state_floats_per_element;
  throw NotImplemented("lab5::predicted_state_bytes_per_rank");
}

double predicted_exposed_communication_seconds(std::size_t num_parameters, int world_size,
                                               const LinkModel& link) {
  (void)num_parameters;
  (void)world_size;
  (void)link;
  throw NotImplemented("lab5::predicted_exposed_communication_seconds");
}

}  // namespace dp::lab5
