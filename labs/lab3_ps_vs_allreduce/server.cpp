// Lab skeleton, generated from the reference by tools/make-skeletons: your code goes where
// dp::NotImplemented is thrown.
// server.cpp: lab 3's parameter server, synchronous (staleness 0) and with bounded
// staleness. Your part: the State a rank keeps between steps, and the bodies of the
// constructor, step, finish and staleness_log.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dp/error.h"
#include "dp/tensor_ops.h"
#include "lab3.h"

namespace dp::lab3 {

struct ParameterServer::State {
  // Whatever a rank keeps between steps: yours to design.
};

ParameterServer::ParameterServer(const Model& model, const ServerOptions& options,
                                 OptimizerFactory make_optimizer, const Communicator& comm) {
  (void)model;
  (void)options;
  (void)make_optimizer;
  (void)comm;
  throw NotImplemented("lab3::ParameterServer::ParameterServer");
}

ParameterServer::~ParameterServer() = default;

void ParameterServer::step(Model& model, Communicator& comm) {
  (void)model;
  (void)comm;
  throw NotImplemented("lab3::ParameterServer::step");
}

void ParameterServer::finish(Model& model, Communicator& comm) {
  (void)model;
  (void)comm;
  throw NotImplemented("lab3::ParameterServer::finish");
}

std::span<const StalenessRecord> ParameterServer::staleness_log() const {
  throw NotImplemented("lab3::ParameterServer::staleness_log");
}

}  // namespace dp::lab3
