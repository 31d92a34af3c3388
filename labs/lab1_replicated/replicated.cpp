// Lab skeleton, generated from the reference by tools/make-skeletons: your code goes where
// dp::NotImplemented is thrown.
// replicated.cpp: lab 1's broadcast of the initial weights and the training loop with no
// synchronisation. Your part: both function bodies.
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <span>

#include "dp/error.h"
#include "lab1.h"

namespace dp::lab1 {

void broadcast_initial_weights(Model& model, Communicator& comm) {
  (void)model;
  (void)comm;
  throw NotImplemented("lab1::broadcast_initial_weights");
}

std::vector<float> train_replicated(Model& model, Optimizer& optimizer, const Dataset& data,
                                    Communicator& comm, const ReplicatedOptions& options) {
  if (options.local_batch <= 0)
    throw Error(
        fmt::format("train_replicated: local_batch must be positive, got {}", options.local_batch));
  (void)model;
  (void)optimizer;
  (void)data;
  (void)comm;
  throw NotImplemented("lab1::train_replicated");
}

}  // namespace dp::lab1
