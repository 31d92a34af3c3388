// per_parameter.cpp: lab 4's comparison, one all-reduce per gradient. Your part: the members
// of PerParameterDDP::State and the bodies below.
#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "dp/error.h"
#include "dp/tensor_ops.h"
#include "lab4.h"

namespace dp::lab4 {

/// Everything a PerParameterDDP keeps between hooks and steps.
struct PerParameterDDP::State {
  // BEGIN SOLUTION
  // SKELETON: // Your members.
  explicit State(Communicator& c) : comm(c) {}

  Communicator& comm;
  /// The gradients launched since the last finish_gradient_sync, in launch order.
  std::vector<std::pair<Parameter*, std::unique_ptr<Work>>> pending;
  // END SOLUTION
};

PerParameterDDP::PerParameterDDP(Model& model, Communicator& comm) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)comm;
  // SKELETON: throw NotImplemented("lab4::PerParameterDDP::PerParameterDDP");
  state_ = std::make_unique<State>(comm);
  state_->pending.reserve(model.parameters().size());
  // In place: the gradient itself is the buffer, and nothing writes it until the wait.
  model.on_gradient_ready([state = state_.get()](Parameter& parameter) {
    state->pending.emplace_back(&parameter,
                                state->comm.allreduce(parameter.grad.view(), ReduceOp::kSum));
  });
  // END SOLUTION
}

PerParameterDDP::~PerParameterDDP() = default;  // each pending Work waits as it is destroyed

void PerParameterDDP::finish_gradient_sync() {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab4::PerParameterDDP::finish_gradient_sync");
  const auto world = static_cast<float>(state_->comm.size());
  for (auto& [parameter, work] : state_->pending) {
    work->wait();
    divide(parameter->grad.view(), world);
  }
  state_->pending.clear();
  // END SOLUTION
}

}  // namespace dp::lab4
