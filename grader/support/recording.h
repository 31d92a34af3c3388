// recording.h: a communicator that records every call lab code makes before passing it on
// to the real one. The check hands the student's code this one, so what it records cannot
// be changed by lab code: which calls, in which order, with which sizes, what their inputs
// held at issue, and when their handles were waited on.
//
// Example (one rank of a check):
//
//   grading::RecordingCommunicator recorder(comm);
//   std::vector<bool> issued_in_backward;
//   recorder.set_issue_callback([&](std::size_t, const grading::RecordedCall&, ConstBuffer,
//                                   MutableBuffer) {
//     issued_in_backward.push_back(recorder.in_backward());
//   });
//   Student student(model, recorder);
//   recorder.set_in_backward(true);
//   model.backward(logits, labels);
//   recorder.set_in_backward(false);
//   // recorder.calls(): e.g. {reduce_scatter(1024 -> 256, sum), allgather(256 -> 1024)}
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dp/comm.h"

namespace dp::grading {

/// One communicator call as it was issued: what it is and its sizes, in elements.
struct RecordedCall {
  CommOp op = CommOp::kBarrier;      ///< the kind of call
  std::size_t in = 0;                ///< input elements (0 for a receive or a barrier)
  std::size_t out = 0;               ///< output elements (0 for a send or a barrier)
  ReduceOp reduce = ReduceOp::kSum;  ///< the reduction (kSum where there is none)

  /// Two calls are equal when kind, sizes and reduction are.
  bool operator==(const RecordedCall&) const = default;
};

/// "reduce_scatter(1024 -> 256, sum)", "allgather(256 -> 1024)", "allreduce(1, sum)", ...
std::string describe(const RecordedCall& call);
/// A sequence of calls, "[reduce_scatter(1024 -> 256, sum), allgather(256 -> 1024)]": what a
/// check prints as seen against expected.
std::string describe(const std::vector<RecordedCall>& calls);
/// True when `calls` holds an all-reduce of more than one element: in a sharded lab, an
/// all-reduce of the gradients where a reduce-scatter belongs (DDP's traffic and memory).
bool allreduces_a_buffer(const std::vector<RecordedCall>& calls);

/// The index of the first element of `data` (float32) at or after `from` that is not
/// +0.0 or -0.0, or nullopt: padding that must be zero when a call is issued.
std::optional<std::size_t> first_nonzero(ConstBuffer data, std::size_t from);

/// Records every call and passes it on to `inner`; its counters and clock are `inner`'s.
class RecordingCommunicator final : public Communicator {
 public:
  /// Records the calls made through it and passes each on to `inner`.
  explicit RecordingCommunicator(Communicator& inner) : inner_(inner) {}

  /// The callback `set_issue_callback` takes: the call's index in `calls()`, the call, its
  /// input and its output (empty where the call has none).
  using IssueCallback = std::function<void(std::size_t index, const RecordedCall& call,
                                           ConstBuffer in, MutableBuffer out)>;
  /// The callback `set_wait_callback` takes: the index of the call whose handle was waited
  /// on or tested.
  using WaitCallback = std::function<void(std::size_t index)>;

  /// Every call, in issue order.
  const std::vector<RecordedCall>& calls() const { return calls_; }
  /// Forgets the calls recorded so far (a check that looks at one step at a time); the
  /// indices of later calls start again at 0.
  void forget_calls() { calls_.clear(); }
  /// Whether the check has said that a backward is running (its callbacks read it).
  bool in_backward() const { return in_backward_; }
  /// Set by the check around `Model::backward`.
  void set_in_backward(bool in_backward) { in_backward_ = in_backward; }
  /// Runs `callback` at each call's issue, before the call is passed on (so it sees the
  /// input before any transport may).
  void set_issue_callback(IssueCallback callback) { on_issue_ = std::move(callback); }
  /// Runs `callback` at each `wait()` or `test()` of a call's handle, with the call's index,
  /// and at each barrier (which waits).
  void set_wait_callback(WaitCallback callback) { on_wait_ = std::move(callback); }

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string_view backend() const override { return inner_.backend(); }
  std::unique_ptr<Work> isend(ConstBuffer data, int peer, int tag) override;
  std::unique_ptr<Work> irecv(MutableBuffer data, int peer, int tag) override;
  std::unique_ptr<Work> allreduce(MutableBuffer data, ReduceOp op) override;
  std::unique_ptr<Work> reduce_scatter(ConstBuffer in, MutableBuffer out, ReduceOp op) override;
  std::unique_ptr<Work> allgather(ConstBuffer in, MutableBuffer out) override;
  std::unique_ptr<Work> broadcast(MutableBuffer data, int root) override;
  void barrier() override;
  CommCounters counters() const override { return inner_.counters(); }
  Clock& clock() override { return inner_.clock(); }

 private:
  /// Appends `call` to `calls()`, runs the issue callback, and returns its index.
  std::size_t record(const RecordedCall& call, ConstBuffer in, MutableBuffer out);
  /// `work`, wrapped so that its waits and tests run the wait callback with `index`.
  std::unique_ptr<Work> watched(std::size_t index, std::unique_ptr<Work> work);

  Communicator& inner_;
  // Private, so that lab code handed this communicator as a `Communicator&` has nothing to
  // change even where it could name the type (the lab audit refuses it that anyway).
  std::vector<RecordedCall> calls_;
  bool in_backward_ = false;
  IssueCallback on_issue_;
  WaitCallback on_wait_;
};

/// Sets `recorder`'s issue callback so that `misplaced` becomes the description of the first
/// call (since it was last cleared) whose input or output is not on `device`, the model's.
/// The buffers' devices are read from the calls themselves, which lab code cannot change: a
/// view has its tensor's device, and one of host memory (a std::vector's) says host (the
/// audit refuses views built from pointers). Labs 2 and 8 watch their calls with it.
void watch_buffer_devices(RecordingCommunicator& recorder, Device device, std::string& misplaced);

}  // namespace dp::grading
