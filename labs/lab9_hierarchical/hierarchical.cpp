// Lab skeleton, generated from the reference by tools/make-skeletons: your code goes where
// dp::NotImplemented is thrown.
// hierarchical.cpp: lab 9, two levels of network. Your part: the split, the hierarchical
// all-reduce, the members of HsdpOptimizer::State and the bodies below.
#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "dp/error.h"
#include "dp/memory.h"
#include "dp/tensor_ops.h"
#include "lab9.h"

namespace dp::lab9 {

Levels split_levels(Communicator& comm, int ranks_per_node) {
  (void)comm;
  (void)ranks_per_node;
  throw NotImplemented("lab9::split_levels");
}

void hierarchical_allreduce(TensorView data, const Levels& levels) {
  (void)data;
  (void)levels;
  throw NotImplemented("lab9::hierarchical_allreduce");
}

/// Everything an HsdpOptimizer keeps between steps.
struct HsdpOptimizer::State {
  // Your members.
};

HsdpOptimizer::HsdpOptimizer(Model& model, Communicator& comm, int ranks_per_node,
                             OptimizerFactory make_inner) {
  (void)model;
  (void)comm;
  (void)ranks_per_node;
  (void)make_inner;
  throw NotImplemented("lab9::HsdpOptimizer::HsdpOptimizer");
}

HsdpOptimizer::~HsdpOptimizer() = default;

void HsdpOptimizer::step() {
  throw NotImplemented("lab9::HsdpOptimizer::step");
}

std::size_t HsdpOptimizer::shard_elements() const {
  throw NotImplemented("lab9::HsdpOptimizer::shard_elements");
}

const Tensor& HsdpOptimizer::shard_parameters() const {
  throw NotImplemented("lab9::HsdpOptimizer::shard_parameters");
}

Optimizer& HsdpOptimizer::inner() {
  throw NotImplemented("lab9::HsdpOptimizer::inner");
}

}  // namespace dp::lab9
