// bucketed.cpp: lab 4's BucketedDDP. Your part: the members of BucketedDDP::State and the
// bodies below.
#include <fmt/format.h>

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "dp/error.h"
#include "dp/tensor_ops.h"
#include "lab4.h"

namespace dp::lab4 {

/// Everything a BucketedDDP keeps between hooks and steps.
struct BucketedDDP::State {
  // BEGIN SOLUTION
  // SKELETON: // Your members.
  /// Where one gradient goes: its bucket and its first element in the bucket's buffer.
  struct Slot {
    std::size_t bucket = 0;
    std::size_t offset = 0;
  };

  State(Model& m, Communicator& c, std::vector<Bucket> assigned)
      : model(m), comm(c), buckets(std::move(assigned)) {}

  Model& model;
  Communicator& comm;
  std::vector<Bucket> buckets;
  std::vector<Tensor> buffers;                 ///< one per bucket, (elements), made once
  std::vector<Slot> slot_of;                   ///< indexed by parameter index
  std::vector<std::size_t> missing;            ///< per bucket: gradients not yet copied in
  std::vector<std::unique_ptr<Work>> pending;  ///< per bucket: its all-reduce, once launched
  std::size_t launched = 0;                    ///< buckets 0 .. launched-1 are on their way
  bool sync = true;

  /// Makes every bucket wait for all of its gradients again (after a step).
  void rearm() {
    for (std::size_t b = 0; b < buckets.size(); ++b) missing[b] = buckets[b].parameters.size();
    launched = 0;
  }

  /// The gradient-ready hook: copy in, then launch every bucket that is complete and
  /// whose predecessors are launched. Launching only in bucket order keeps the ranks'
  /// collectives in the same order even if gradients arrived in another order.
  void on_ready(Parameter& parameter) {
    if (!sync) return;
    const Slot slot = slot_of[parameter.index];
    if (missing[slot.bucket] == 0)
      throw Error(fmt::format(
          "BucketedDDP: the gradient of {} is ready a second time since the last "
          "finish_gradient_sync(); call it after every synchronised backward, or wrap the "
          "accumulating backwards in BucketedDDP::NoSync",
          parameter.name));
    copy(parameter.grad.view(), buffers[slot.bucket].view(slot.offset, parameter.grad.size()));
    --missing[slot.bucket];
    while (launched < buckets.size() && missing[launched] == 0) {
      pending[launched] = comm.allreduce(buffers[launched].view(), ReduceOp::kSum);
      ++launched;
    }
  }
  // END SOLUTION
};

BucketedDDP::BucketedDDP(Model& model, Communicator& comm, const BucketOptions& options) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)comm;
  // SKELETON: (void)options;
  // SKELETON: throw NotImplemented("lab4::BucketedDDP::BucketedDDP");
  state_ = std::make_unique<State>(model, comm, assign_buckets(model, options));
  State& s = *state_;
  s.slot_of.resize(model.parameters().size());
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    s.buffers.emplace_back(
        std::vector<std::int64_t>{static_cast<std::int64_t>(s.buckets[b].elements)},
        MemoryCategory::kCommunication, model.device());  // beside the gradients
    std::size_t offset = 0;
    for (const std::size_t index : s.buckets[b].parameters) {
      s.slot_of[index] = {b, offset};
      offset += model.parameters()[index]->grad.size();
    }
  }
  s.missing.resize(s.buckets.size());
  s.pending.resize(s.buckets.size());
  s.rearm();
  model.on_gradient_ready(
      [state = state_.get()](Parameter& parameter) { state->on_ready(parameter); });
  // END SOLUTION
}

BucketedDDP::~BucketedDDP() = default;  // each pending Work waits as it is destroyed

const std::vector<Bucket>& BucketedDDP::buckets() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab4::BucketedDDP::buckets");
  return state_->buckets;
  // END SOLUTION
}

void BucketedDDP::finish_gradient_sync() {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab4::BucketedDDP::finish_gradient_sync");
  State& s = *state_;
  if (!s.sync) return;
  if (s.launched < s.buckets.size()) {
    const std::size_t bucket = s.launched;
    s.rearm();  // the next backward starts afresh; the buckets launched still complete
    throw Error(fmt::format(
        "BucketedDDP::finish_gradient_sync: bucket {} of {} was never launched: {} of its "
        "gradients did not arrive since the last call (did backward run?)",
        bucket, s.buckets.size(), s.missing[bucket]));
  }
  const auto world = static_cast<float>(s.comm.size());
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    // A bucket's sum may be read only once its own call is complete.
    s.pending[b]->wait();
    s.pending[b].reset();
    divide(s.buffers[b].view(), world);  // a post-divide, as lab 2: the same bits
    for (const std::size_t index : s.buckets[b].parameters) {
      Parameter& parameter = *s.model.parameters()[index];
      copy(s.buffers[b].view(s.slot_of[index].offset, parameter.grad.size()),
           parameter.grad.view());
    }
  }
  s.rearm();
  // END SOLUTION
}

void BucketedDDP::set_gradient_sync(bool enabled) {
  // BEGIN SOLUTION
  // SKELETON: (void)enabled;
  // SKELETON: throw NotImplemented("lab4::BucketedDDP::set_gradient_sync");
  state_->sync = enabled;
  // END SOLUTION
}

}  // namespace dp::lab4
