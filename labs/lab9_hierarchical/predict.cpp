// Lab skeleton, generated from the reference by tools/make-skeletons: your code goes where
// dp::NotImplemented is thrown.
// predict.cpp: lab 9's design questions: the simulated time of the flat ring, of the
// hierarchical all-reduce and of a sharded step's communication on two levels of network.
// Your part: the three bodies.
#include <algorithm>
#include <cstddef>

#include "lab9.h"

namespace dp::lab9 {

namespace {
// Helpers of your own, if you want them.
}  // namespace

double predicted_flat_allreduce_seconds(std::size_t bytes, const TwoLevelFabric& fabric) {
  (void)bytes;
  (void)fabric;
  throw NotImplemented("lab9::predicted_flat_allreduce_seconds");
}

double predicted_hierarchical_allreduce_seconds(std::size_t bytes, const TwoLevelFabric& fabric) {
  (void)bytes;
  (void)fabric;
  throw NotImplemented("lab9::predicted_hierarchical_allreduce_seconds");
}

double predicted_sharded_step_seconds(std::size_t num_parameters, const TwoLevelFabric& fabric,
                                      bool hybrid) {
  (void)num_parameters;
  (void)fabric;
  (void)hybrid;
  throw NotImplemented("lab9::predicted_sharded_step_seconds");
}

}  // namespace dp::lab9
