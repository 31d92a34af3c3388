// The guard over a rank's communicator and the registry of the buffers of calls in flight
// (see in_flight_buffers.h for why).
#include "comm/in_flight_buffers.h"

#include <fmt/format.h>

#include <atomic>
#include <exception>
#include <mutex>
#include <string_view>
#include <utility>
#include <vector>

#include "dp/error.h"
#include "dp/memory.h"

namespace dp::detail {
namespace {

/// One buffer of a call: its bytes and what the call does with them.
struct GuardedRange {
  const unsigned char* first = nullptr;
  std::size_t bytes = 0;
  std::string_view role;  // "input buffer", "output buffer", "buffer"
};

/// A call in flight, from its issue until its Work completes. Its Work owns it (allocated as
/// the runtime's heap, uncounted) and the registry links it into a list of its own, so
/// registering and unregistering allocate nothing.
struct InFlightCall {
  CommOp op = CommOp::kBarrier;
  std::uint64_t number = 0;  // the call's position among the rank's calls
  int rank = 0;
  std::size_t input_count = 0;
  std::size_t output_count = 0;
  DataType type = DataType::kFloat32;
  GuardedRange ranges[2];
  // Set under the registry's lock by whoever frees a buffer of the call.
  std::string report;
  std::vector<std::function<void()>> held_blocks;
  // The registry's list.
  InFlightCall* previous = nullptr;
  InFlightCall* next = nullptr;
  bool registered = false;

  /// "reduce_scatter (its call #4: 1024 float32 in, 256 out)", for messages.
  std::string description() const {
    return fmt::format("{} (its call #{}: {} {} in, {} out)", to_string(op), number, input_count,
                       to_string(type), output_count);
  }
};

/// Every call in flight in the process (the ranks of the local backend share it).
class InFlightRegistry {
 public:
  bool any() const { return count_.load(std::memory_order_acquire) != 0; }

  void add(InFlightCall& call) {
    const std::lock_guard lock(mutex_);
    DP_CHECK(!call.registered, "{} registered twice", call.description());
    call.previous = nullptr;
    call.next = head_;
    if (head_ != nullptr) head_->previous = &call;
    head_ = &call;
    call.registered = true;
    count_.fetch_add(1, std::memory_order_release);
  }

  /// Unlinks `call` if it is registered; returns the blocks held for it, to free outside the
  /// lock.
  std::vector<std::function<void()>> remove(InFlightCall& call) {
    const std::lock_guard lock(mutex_);
    if (!call.registered) return {};
    if (call.previous != nullptr) call.previous->next = call.next;
    if (call.next != nullptr) call.next->previous = call.previous;
    if (head_ == &call) head_ = call.next;
    call.previous = call.next = nullptr;
    call.registered = false;
    DP_CHECK(count_.load() > 0, "{} unregistered with no call registered", call.description());
    count_.fetch_sub(1, std::memory_order_release);
    return std::exchange(call.held_blocks, {});
  }

  /// The report of `call` (empty if none of its buffers was freed), taken out.
  std::string take_report(InFlightCall& call) {
    const std::lock_guard lock(mutex_);
    return std::exchange(call.report, {});
  }

  bool hold(const void* first, std::size_t bytes, const std::function<std::string()>& tensor,
            const std::function<std::function<void()>()>& make_free_block) {
    const auto* begin = static_cast<const unsigned char*>(first);
    const std::lock_guard lock(mutex_);
    for (InFlightCall* call = head_; call != nullptr; call = call->next) {
      for (const GuardedRange& range : call->ranges) {
        if (range.bytes == 0 || bytes == 0 || begin >= range.first + range.bytes ||
            range.first >= begin + bytes)
          continue;
        const UncountedHeapAllocations bookkeeping;  // the runtime's, not the lab's
        if (call->report.empty())
          call->report = fmt::format(
              "{}: the memory of its {} was freed while the call was in flight: {} was "
              "destroyed before the call's wait(). A transport reads and writes a call's "
              "buffers at any moment until then, and the memory would already belong to "
              "another tensor; expected every buffer to outlive its call: wait on the Work, "
              "or destroy it, before the tensor (members are destroyed in the reverse order "
              "of their declaration: declare the Works after the buffers they use)",
              call->description(), range.role, tensor());
        call->held_blocks.push_back(make_free_block());
        return true;
      }
    }
    return false;
  }

 private:
  std::mutex mutex_;
  InFlightCall* head_ = nullptr;
  std::atomic<std::size_t> count_{0};
};

InFlightRegistry& registry() {
  static InFlightRegistry instance;
  return instance;
}

/// Where a Work destroyed without wait() leaves the report it could not throw.
struct ReportOfDestroyedWork {
  std::string message;
};

Error freed_buffer_error(int rank, std::string message) {
  Error error(std::move(message));
  error.set_rank(rank);
  return error;
}

class GuardedWork final : public Work {
 public:
  GuardedWork(std::unique_ptr<Work> inner, std::unique_ptr<InFlightCall> call,
              std::shared_ptr<ReportOfDestroyedWork> deferred)
      : inner_(std::move(inner)), call_(std::move(call)), deferred_(std::move(deferred)) {
    registry().add(*call_);  // the backend accepted it: in flight from now on
  }

  ~GuardedWork() override {
    // Destroying the backend's Work waits for the call (or, while an exception unwinds,
    // lets the backend abort it): only then may the held blocks go back.
    inner_.reset();
    std::string report = complete();
    if (!report.empty() && std::uncaught_exceptions() == 0 && deferred_->message.empty())
      deferred_->message =
          std::move(report) +
          " (found when its Work was destroyed without wait(), and reported at the rank's "
          "next call or when its function returned)";
  }

  void wait() override {
    inner_->wait();
    if (std::string report = complete(); !report.empty())
      throw freed_buffer_error(call_->rank, std::move(report));
  }

  bool test() override {
    if (!inner_->test()) return false;
    wait();
    return true;
  }

 private:
  /// Unregisters the call (once), frees the blocks held for it and returns its report.
  std::string complete() {
    for (std::function<void()>& free_block : registry().remove(*call_)) free_block();
    return registry().take_report(*call_);
  }

  std::unique_ptr<Work> inner_;
  std::unique_ptr<InFlightCall> call_;
  std::shared_ptr<ReportOfDestroyedWork> deferred_;
};

class Guard final : public InFlightBufferGuard {
 public:
  explicit Guard(Communicator& inner) : Guard(nullptr, inner) {}

  Communicator& inner() override { return inner_; }
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string_view backend() const override { return inner_.backend(); }

  std::unique_ptr<Work> isend(ConstBuffer data, int peer, int tag) override {
    auto call = begin(CommOp::kSend, data, {});
    return guarded(inner_.isend(data, peer, tag), std::move(call));
  }
  std::unique_ptr<Work> irecv(MutableBuffer data, int peer, int tag) override {
    auto call = begin(CommOp::kRecv, {}, data);
    return guarded(inner_.irecv(data, peer, tag), std::move(call));
  }
  std::unique_ptr<Work> allreduce(MutableBuffer data, ReduceOp op) override {
    auto call = begin(CommOp::kAllReduce, data, {});
    call->ranges[0].role = "buffer";
    call->output_count = data.count;
    return guarded(inner_.allreduce(data, op), std::move(call));
  }
  std::unique_ptr<Work> reduce_scatter(ConstBuffer in, MutableBuffer out, ReduceOp op) override {
    auto call = begin(CommOp::kReduceScatter, in, out);
    return guarded(inner_.reduce_scatter(in, out, op), std::move(call));
  }
  std::unique_ptr<Work> allgather(ConstBuffer in, MutableBuffer out) override {
    auto call = begin(CommOp::kAllGather, in, out);
    return guarded(inner_.allgather(in, out), std::move(call));
  }
  std::unique_ptr<Work> broadcast(MutableBuffer data, int root) override {
    auto call = begin(CommOp::kBroadcast, data, {});
    call->ranges[0].role = "buffer";
    call->output_count = data.count;
    return guarded(inner_.broadcast(data, root), std::move(call));
  }
  void barrier() override {
    throw_report_of_freed_buffer();
    inner_.barrier();
  }
  std::unique_ptr<Communicator> split(int color, int key) override {
    throw_report_of_freed_buffer();
    std::unique_ptr<Communicator> inner = inner_.split(color, key);
    if (!inner) return nullptr;
    Communicator& backend = *inner;
    return std::unique_ptr<Communicator>(new Guard(std::move(inner), backend));
  }
  CommCounters counters() const override { return inner_.counters(); }
  Clock& clock() override { return inner_.clock(); }

  void throw_report_of_freed_buffer() override {
    if (deferred_->message.empty()) return;
    throw freed_buffer_error(rank(), std::exchange(deferred_->message, {}));
  }

 private:
  /// Guards `inner`, which `owned` owns when it is not null (a communicator split from a
  /// guarded one).
  Guard(std::unique_ptr<Communicator> owned, Communicator& inner)
      : owned_(std::move(owned)),
        inner_(inner),
        deferred_(std::make_shared<ReportOfDestroyedWork>()) {}

  /// The record of a call about to be issued (after the report of an earlier one, if any).
  std::unique_ptr<InFlightCall> begin(CommOp op, ConstBuffer in, ConstBuffer out) {
    throw_report_of_freed_buffer();
    const UncountedHeapAllocations bookkeeping;  // the runtime's, not the lab's
    auto call = std::make_unique<InFlightCall>();
    call->op = op;
    call->number = ++calls_;
    call->rank = inner_.rank();
    call->input_count = in.count;
    call->output_count = out.count;
    call->type = in.count > 0 ? in.type : out.type;
    call->ranges[0] = {static_cast<const unsigned char*>(in.data), in.bytes(), "input buffer"};
    call->ranges[1] = {static_cast<const unsigned char*>(out.data), out.bytes(), "output buffer"};
    return call;
  }

  /// The Work of a call the backend accepted (one that threw at issue was never in flight).
  std::unique_ptr<Work> guarded(std::unique_ptr<Work> inner, std::unique_ptr<InFlightCall> call) {
    const UncountedHeapAllocations bookkeeping;
    return std::make_unique<GuardedWork>(std::move(inner), std::move(call), deferred_);
  }

  std::unique_ptr<Communicator> owned_;  // a split's communicator, or null
  Communicator& inner_;
  std::shared_ptr<ReportOfDestroyedWork> deferred_;
  std::uint64_t calls_ = 0;
};

}  // namespace

std::unique_ptr<InFlightBufferGuard> make_in_flight_buffer_guard(Communicator& inner) {
  return std::make_unique<Guard>(inner);
}

bool any_call_in_flight() {
  return registry().any();
}

bool hold_block_under_call_in_flight(
    const void* first, std::size_t bytes, const std::function<std::string()>& tensor,
    const std::function<std::function<void()>()>& make_free_block) noexcept {
  try {
    return registry().hold(first, bytes, tensor, make_free_block);
  } catch (const std::exception&) {
    return false;  // no memory for the bookkeeping: the caller frees the block now
  }
}

}  // namespace dp::detail
