// recording.cpp: see recording.h.
#include "recording.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "dp/tensor.h"
#include "dp/tensor_ops.h"

namespace dp::grading {
namespace {

/// A call's handle that tells its recorder when lab code waits on it or tests it.
class RecordedWork final : public Work {
 public:
  RecordedWork(std::unique_ptr<Work> inner, std::function<void()> on_wait)
      : inner_(std::move(inner)), on_wait_(std::move(on_wait)) {}
  void wait() override {
    on_wait_();
    inner_->wait();
  }
  bool test() override {
    on_wait_();
    return inner_->test();
  }

 private:
  std::unique_ptr<Work> inner_;
  std::function<void()> on_wait_;
};

}  // namespace

std::string describe(const RecordedCall& call) {
  switch (call.op) {
    case CommOp::kReduceScatter:
      return fmt::format("reduce_scatter({} -> {}, {})", call.in, call.out, to_string(call.reduce));
    case CommOp::kAllGather: return fmt::format("allgather({} -> {})", call.in, call.out);
    case CommOp::kAllReduce:
      return fmt::format("allreduce({}, {})", call.in, to_string(call.reduce));
    case CommOp::kSend: return fmt::format("isend({})", call.in);
    case CommOp::kRecv: return fmt::format("irecv({})", call.out);
    case CommOp::kBroadcast: return fmt::format("broadcast({})", call.out);
    default: return std::string(to_string(call.op));
  }
}

std::string describe(const std::vector<RecordedCall>& calls) {
  std::vector<std::string> parts;
  for (const RecordedCall& call : calls) parts.push_back(describe(call));
  return fmt::format("[{}]", fmt::join(parts, ", "));
}

bool allreduces_a_buffer(const std::vector<RecordedCall>& calls) {
  return std::any_of(calls.begin(), calls.end(), [](const RecordedCall& call) {
    return call.op == CommOp::kAllReduce && call.in > 1;
  });
}

std::optional<std::size_t> first_nonzero(ConstBuffer data, std::size_t from) {
  if (data.type != DataType::kFloat32) return std::nullopt;
  const auto* values = static_cast<const float*>(data.data);
  // A GPU's memory is read through a copy on the host (the emulated device's is host
  // memory, and a copy would be one more op on the rank's simulated clock).
  std::vector<float> host_copy;
  if (data.device != Device::kHost && !cuda_device_emulated()) {
    host_copy.resize(data.count);
    copy(ConstTensorView(values, data.count, data.device),
         TensorView(host_copy.data(), host_copy.size()));
    values = host_copy.data();
  }
  for (std::size_t i = from; i < data.count; ++i)
    if (values[i] != 0.0f) return i;
  return std::nullopt;
}

std::size_t RecordingCommunicator::record(const RecordedCall& call, ConstBuffer in,
                                          MutableBuffer out) {
  calls_.push_back(call);
  const std::size_t index = calls_.size() - 1;
  if (on_issue_) on_issue_(index, call, in, out);
  return index;
}

std::unique_ptr<Work> RecordingCommunicator::watched(std::size_t index,
                                                     std::unique_ptr<Work> work) {
  return std::make_unique<RecordedWork>(std::move(work), [this, index] {
    if (on_wait_) on_wait_(index);
  });
}

std::unique_ptr<Work> RecordingCommunicator::isend(ConstBuffer data, int peer, int tag) {
  const std::size_t index = record({CommOp::kSend, data.count, 0, ReduceOp::kSum}, data, {});
  return watched(index, inner_.isend(data, peer, tag));
}

std::unique_ptr<Work> RecordingCommunicator::irecv(MutableBuffer data, int peer, int tag) {
  const std::size_t index = record({CommOp::kRecv, 0, data.count, ReduceOp::kSum}, {}, data);
  return watched(index, inner_.irecv(data, peer, tag));
}

std::unique_ptr<Work> RecordingCommunicator::allreduce(MutableBuffer data, ReduceOp op) {
  const std::size_t index =
      record({CommOp::kAllReduce, data.count, data.count, op}, ConstBuffer(data), data);
  return watched(index, inner_.allreduce(data, op));
}

std::unique_ptr<Work> RecordingCommunicator::reduce_scatter(ConstBuffer in, MutableBuffer out,
                                                            ReduceOp op) {
  const std::size_t index = record({CommOp::kReduceScatter, in.count, out.count, op}, in, out);
  return watched(index, inner_.reduce_scatter(in, out, op));
}

std::unique_ptr<Work> RecordingCommunicator::allgather(ConstBuffer in, MutableBuffer out) {
  const std::size_t index =
      record({CommOp::kAllGather, in.count, out.count, ReduceOp::kSum}, in, out);
  return watched(index, inner_.allgather(in, out));
}

std::unique_ptr<Work> RecordingCommunicator::broadcast(MutableBuffer data, int root) {
  const std::size_t index =
      record({CommOp::kBroadcast, data.count, data.count, ReduceOp::kSum}, ConstBuffer(data), data);
  return watched(index, inner_.broadcast(data, root));
}

void RecordingCommunicator::barrier() {
  const std::size_t index = record({CommOp::kBarrier, 0, 0, ReduceOp::kSum}, {}, {});
  if (on_wait_) on_wait_(index);
  inner_.barrier();
}

void watch_buffer_devices(RecordingCommunicator& recorder, Device device, std::string& misplaced) {
  recorder.set_issue_callback([device, &misplaced](std::size_t, const RecordedCall& call,
                                                   ConstBuffer in, MutableBuffer out) {
    if (!misplaced.empty()) return;
    const auto off_device = [&](std::size_t count, Device where, const char* which) {
      if (count == 0 || where == device) return false;
      misplaced = fmt::format("the {} of {} is {} memory, the model's on {}", which, describe(call),
                              to_string(where), to_string(device));
      return true;
    };
    if (!off_device(in.count, in.device, "input")) off_device(out.count, out.device, "output");
  });
}

}  // namespace dp::grading
