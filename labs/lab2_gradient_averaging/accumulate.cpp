// Lab skeleton, generated from the reference by tools/make-skeletons: your code goes where
// dp::NotImplemented is thrown.
// accumulate.cpp: lab 2's gradient accumulation over k micro-batches, with one
// synchronisation per optimizer step. Your part: the body of accumulation_step.
#include <fmt/format.h>

#include "dp/error.h"
#include "lab2.h"

namespace dp::lab2 {

float accumulation_step(Model& model, Optimizer& optimizer, std::span<const Batch> micro_batches,
                        Communicator& comm) {
  if (micro_batches.empty())
    throw Error("accumulation_step: expected at least one micro-batch, got none");
  (void)model;
  (void)optimizer;
  (void)comm;
  throw NotImplemented("lab2::accumulation_step");
}

}  // namespace dp::lab2
