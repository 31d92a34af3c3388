// The nccl backend: one rank per GPU, the collectives and messages through NCCL.
//
// Bootstrap. NCCL joins ranks that share a `ncclUniqueId`, made by one rank and handed to
// the others before `ncclCommInitRank`. Under mpirun process 0 makes it and MPI_Bcast hands
// it on, and each process drives GPU (its rank on its node) mod (the GPUs it sees); without MPI,
// `launch` starts one thread per GPU of this process, thread r on GPU r, and hands them the id it
// made. NCCL refuses two ranks on one GPU: several ranks on one GPU is the local backend's job.
//
// Streams. Every call is asynchronous on the communicator's own stream, gated by the
// caller's compute stream (`cuda::compute_stream()`, cuda/device_ops.h): an event
// recorded there at the call, waited for by the communication stream, so NCCL reads the
// buffers after the kernels that wrote them. `Work::wait()` makes the compute stream wait
// for an event recorded on the communication stream after the call: it does not block the
// host, as in PyTorch's ProcessGroupNCCL; whatever the rank computes next on its compute
// stream sees the results, and a copy to the host waits for them. `Work::test()` asks the
// event. `barrier()` blocks the host until every rank got there.
//
// Messages. NCCL's send waits for the matching receive on the peer's stream, so a ring of
// isend/irecv, each on one stream in issue order, would deadlock. The calls are therefore
// held back and launched together in one ncclGroupStart/End when the rank next waits,
// tests, issues a collective or drops a handle: the exchange a lab writes between two waits
// runs as one group, whatever the order of its calls. NCCL matches a pair of ranks' messages
// in the order they were posted and knows no tags, so a group is posted sorted by tag (issue
// order within a tag): the messages of an exchange are matched by tag, as the local and mpi
// backends match them, when both ranks' exchanges hold the same tags. Like the local
// backend's, a send is a rendezvous: waiting for a send before posting the receive its peer
// waits for hangs.
//
// Counters record what a ring moves, the formulas of the local and mpi backends
// (comm/ring_counts.h); point-to-point calls count their message sizes.
//
// What differs from the other backends, and why:
//   - buffers must be device memory on this rank's GPU (host buffers: a dp::Error);
//   - collectives are not validated across ranks (that would cost an exchange per call on
//     the host, which is what NCCL avoids): mismatched sizes or orders hang, and the hang
//     report says which call of which rank is waiting;
//   - a float sum over three or more ranks adds in NCCL's ring order, not in rank order, so
//     it may differ from the local backend's in the last bits (two ranks: a + b == b + a);
//     an average is that sum divided afterwards, on the communication stream (bfloat16 and
//     float16: NCCL's kernels round each partial sum to the type, comm.h's rule at
//     `ReduceOp`, and the divide rounds once; NCCL's own ncclAvg would pre-multiply by a
//     rounded 1/p instead). A maximum on a GPU of compute capability 8.0 or later uses
//     __hmax for these types, which returns the other operand where one is a NaN (the
//     other backends keep the value combined first);
//   - under Completion::kAdversarial the decorator (comm/adversarial.cpp) stages device
//     buffers on the device and copies them on the caller's compute stream (cuda::copy_bytes),
//     after its kernels and after the calls `wait()` ordered that stream behind.
//
// One thread at a time on a communicator (NCCL's rule): the rank's thread makes its NCCL
// calls, and the watchdog polls and aborts, under one lock (`with_comm`). The communicator
// is non-blocking (ncclConfig_t::blocking = 0), so no call holds the lock while it waits for
// a peer: a call still in progress returns at once and is polled with the lock released, so
// an abort never frees the communicator under a call and can still end one that waits.
//
// Split. `split` is ncclCommSplit on the rank's thread (every rank of the communicator calls
// it; NCCL blocks until they have, polled here as the communicators are non-blocking). The
// new communicator inherits the parent's configuration and has a stream, a watchdog and a
// group of its own; a failure of either group ends both. NCCL does not tell a rank which
// ranks joined it, so for the counters' link classes (dp/comm.h) the new communicator
// all-gathers its ranks' ranks in the parent once, on a stream of its own (not counted).
//
// Hangs. A watchdog thread per rank polls the pending calls' events and
// ncclCommGetAsyncError. A call pending longer than the hang timeout, or an asynchronous
// NCCL error, aborts the communicator (ncclCommAbort, which ends its kernels), prints a
// report naming which rank waits on which call (all ranks' calls when they are threads of
// this process) and makes every later call and wait of the rank throw dp::CommError. Other
// ranks of this process are aborted with it; under mpirun the job ends (MPI_Abort).
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/argument_checks.h"
#include "comm/backends.h"
#include "comm/call_log.h"
#include "comm/reduce_element.h"
#include "comm/ring_counts.h"
#include "cuda/comm_device.h"
#include "cuda/device_ops.h"
#include "dp/clock.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/tensor.h"

namespace dp::detail {
namespace {

using WallTime = std::chrono::steady_clock;

/// How often the watchdog looks at the pending calls.
constexpr std::chrono::milliseconds kWatchdogPoll{2};
/// How long `barrier()` sleeps between looks at its call.
constexpr std::chrono::microseconds kBarrierPoll{50};
/// How long a rank's thread sleeps between looks at an NCCL call still in progress.
constexpr std::chrono::microseconds kProgressPoll{50};

void check_cuda(cudaError_t status, std::string_view what) {
  if (status != cudaSuccess)
    throw Error(fmt::format("CUDA: {} failed: {} ({})", what, cudaGetErrorString(status),
                            cudaGetErrorName(status)));
}

void check_nccl(ncclResult_t status, std::string_view what) {
  if (status != ncclSuccess && status != ncclInProgress)
    throw CommError(fmt::format("NCCL: {} failed: {}", what, ncclGetErrorString(status)));
}

ncclDataType_t nccl_type(DataType type) {
  switch (type) {
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kInt32: return ncclInt32;
    case DataType::kUInt8: return ncclUint8;
    case DataType::kBFloat16: return ncclBfloat16;
    case DataType::kFloat16: return ncclFloat16;
  }
  return ncclFloat32;
}

/// The NCCL operation of `op`; an average is a sum here, divided afterwards.
ncclRedOp_t nccl_op(ReduceOp op) {
  return op == ReduceOp::kMax ? ncclMax : ncclSum;
}

/// This rank's rank in `comm`.
int user_rank(ncclComm_t comm) {
  int rank = 0;
  check_nccl(ncclCommUserRank(comm, &rank), "ncclCommUserRank");
  return rank;
}

/// Every rank's `value` on `comm`, a communicator just made by ncclCommSplit on `device`, in
/// its rank order: an in-place all-gather of one int on a stream of its own, waited for on
/// the host (at most `timeout` for the non-blocking communicator to take it).
std::vector<int> all_gather_ints(ncclComm_t comm, int device, int value,
                                 std::chrono::milliseconds timeout) {
  const int rank = user_rank(comm);
  int size = 0;
  check_nccl(ncclCommCount(comm, &size), "ncclCommCount");
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
             "cudaStreamCreateWithFlags (split layout)");
  int* values = nullptr;
  check_cuda(cudaMalloc(&values, sizeof(int) * static_cast<std::size_t>(size)),
             "cudaMalloc (split layout)");
  check_cuda(cudaMemcpy(values + rank, &value, sizeof(int), cudaMemcpyHostToDevice),
             "cudaMemcpy (split layout)");
  ncclResult_t status = ncclAllGather(values + rank, values, 1, ncclInt32, comm, stream);
  const WallTime::time_point started = WallTime::now();
  while (status == ncclInProgress) {
    if (WallTime::now() - started > timeout)
      throw CommError(fmt::format(
          "rank {} (nccl, GPU {}): the new communicator's layout was not gathered within the "
          "hang timeout ({} ms)",
          rank, device, timeout.count()));
    std::this_thread::sleep_for(kProgressPoll);
    (void)ncclCommGetAsyncError(comm, &status);
  }
  check_nccl(status, "ncclAllGather (split layout)");
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (split layout)");
  std::vector<int> all(static_cast<std::size_t>(size));
  check_cuda(cudaMemcpy(all.data(), values, sizeof(int) * all.size(), cudaMemcpyDeviceToHost),
             "cudaMemcpy (split layout)");
  (void)cudaFree(values);
  (void)cudaStreamDestroy(stream);
  return all;
}

/// What the ranks of one launch share: the abort of any of them stops the others.
class NcclGroup;

/// One call of one rank: its record and the event that marks its end on the stream.
struct NcclCall {
  CallRecord record;
  WallTime::time_point issued = WallTime::now();
  cudaEvent_t done = nullptr;  // recorded on the communication stream after the call
  std::atomic<bool> complete{false};
  NcclCall() = default;
  NcclCall(const NcclCall&) = delete;
  NcclCall& operator=(const NcclCall&) = delete;
  ~NcclCall() {
    if (done != nullptr) (void)cudaEventDestroy(done);
  }
};

/// A point-to-point call held back until the rank's next flush (see the top).
struct HeldMessage {
  std::shared_ptr<NcclCall> call;
  void* data = nullptr;
  std::size_t count = 0;
  DataType type = DataType::kFloat32;
  int peer = 0;
  int tag = 0;
  bool send = true;
};

class NcclCommunicator;

class NcclGroup {
 public:
  /// The group of `local_ranks` threads of this process; `parent`, when not null, is the
  /// group of the communicator this one's was split from: a failure in either ends both.
  explicit NcclGroup(int local_ranks, NcclGroup* parent = nullptr)
      : members_(static_cast<std::size_t>(local_ranks), nullptr), parent_(parent) {}
  void join(int slot, NcclCommunicator* member) {
    const std::lock_guard lock(mutex_);
    members_[static_cast<std::size_t>(slot)] = member;
  }
  void leave(int slot) {
    const std::lock_guard lock(mutex_);
    members_[static_cast<std::size_t>(slot)] = nullptr;
  }
  /// Records the first failure; every member's watchdog aborts its communicator on it.
  void fail(const std::string& reason) {
    if (parent_ != nullptr) parent_->fail(reason);
    const std::lock_guard lock(mutex_);
    if (!reason_.empty()) return;
    reason_ = reason;
    failed_.store(true, std::memory_order_release);
  }
  bool failed() const {
    return failed_.load(std::memory_order_acquire) || (parent_ != nullptr && parent_->failed());
  }
  std::string reason() const {
    {
      const std::lock_guard lock(mutex_);
      if (!reason_.empty()) return reason_;
    }
    return parent_ != nullptr ? parent_->reason() : std::string();
  }
  /// Every member's call state, for a hang report.
  std::vector<RankCallState> states() const;

 private:
  mutable std::mutex mutex_;
  std::vector<NcclCommunicator*> members_;  // threads of this process, by slot
  NcclGroup* parent_;                       // the group split from, or null
  std::string reason_;
  std::atomic<bool> failed_{false};
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const ncclUniqueId& id, int rank, int size, int device, int slot,
                   NcclGroup& group, CommOptions options, NodeLayout layout);
  /// A communicator split from another (`comm`, set up by ncclCommSplit): it owns `group`,
  /// a group of its own for this thread whose failures reach its parent's; `layout` says
  /// where its ranks are.
  NcclCommunicator(ncclComm_t comm, int device, std::unique_ptr<NcclGroup> group,
                   CommOptions options, NodeLayout layout);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "nccl"; }
  std::unique_ptr<Work> isend(ConstBuffer data, int peer, int tag) override;
  std::unique_ptr<Work> irecv(MutableBuffer data, int peer, int tag) override;
  std::unique_ptr<Work> allreduce(MutableBuffer data, ReduceOp op) override;
  std::unique_ptr<Work> reduce_scatter(ConstBuffer in, MutableBuffer out, ReduceOp op) override;
  std::unique_ptr<Work> allgather(ConstBuffer in, MutableBuffer out) override;
  std::unique_ptr<Work> broadcast(MutableBuffer data, int root) override;
  void barrier() override;
  /// ncclCommSplit on this communicator (blocking the host, as NCCL's own split does); the
  /// new communicator inherits this one's configuration and gets a stream of its own.
  std::unique_ptr<Communicator> split(int color, int key) override;
  CommCounters counters() const override {
    const std::lock_guard lock(mutex_);
    return counters_;
  }
  Clock& clock() override { return clock_; }

  /// Throws dp::CommError when this rank's communicator was aborted.
  void throw_if_failed() const;
  /// Launches the held messages as one group (see the top).
  void flush();
  /// `Work::wait()`: the compute stream waits for `call`.
  void wait(NcclCall& call);
  /// `Work::test()`.
  bool test(NcclCall& call);
  /// This rank's state for a hang report.
  RankCallState state() const { return log_.snapshot(rank_, std::nullopt, false); }

 private:
  /// Checks `data` is device memory of this rank; names `call` otherwise.
  void check_buffer(ConstBuffer data, std::string_view call) const;
  /// After a sum on the stream: the average comm.h promises, the sum divided by size().
  void divide_if_average(MutableBuffer result, ReduceOp op);
  /// isend (op kSend) or irecv (kRecv): checks, counts and holds the message (see the top).
  std::unique_ptr<Work> hold_message(CommOp op, MutableBuffer data, int peer, int tag);
  /// Records `record` in the log and the counters and returns its call.
  std::shared_ptr<NcclCall> begin(CallRecord record);
  /// What both constructors do once comm_ is set up: the counters, the stream, the scratch,
  /// the group and the watchdog.
  void start();
  /// Gates the communication stream on the compute stream, runs `enqueue` (NCCL calls on
  /// stream_), records the call's end event and hands the call to the watchdog.
  template <typename Enqueue>
  std::unique_ptr<Work> collective(CallRecord record, Enqueue&& enqueue);
  /// Records `call`'s end event on the stream and hands it to the watchdog.
  void end(const std::shared_ptr<NcclCall>& call);
  void gate_on_compute_stream();
  void run_watchdog();
  /// Aborts the communicator once, prints `report` and remembers it for later calls.
  void abort_with(const std::string& report);
  /// Runs `calls` (NCCL calls on comm_ that return the last one's result) with the
  /// communicator to this thread, then polls while NCCL says the work is in progress, the
  /// lock released between looks (see the top); throws dp::CommError naming `what` when
  /// NCCL fails or the communicator was aborted.
  template <typename Calls>
  void with_comm(std::string_view what, Calls&& calls);

  int rank_;
  int size_;
  int device_;
  int slot_;
  std::unique_ptr<NcclGroup> owned_group_;  // a split communicator's group, or null
  NcclGroup& group_;
  CommOptions options_;
  NodeLayout layout_;  // the ranks' nodes, for the counters' link classes
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int* barrier_scratch_ = nullptr;  // one int on the device for barrier()
  WallClock clock_;
  CallLog log_;

  std::mutex comm_mutex_;     // comm_: one thread at a time, the abort included
  mutable std::mutex mutex_;  // counters_, pending_, held_, failure_, stop_
  std::condition_variable changed_;
  CommCounters counters_;
  std::deque<std::shared_ptr<NcclCall>> pending_;  // on the stream, issue order
  std::vector<HeldMessage> held_;
  std::string failure_;
  std::atomic<bool> aborted_{false};
  bool stop_ = false;
  std::thread watchdog_;
};

/// A handle on one call; dropping it unwaited still orders the compute stream after it, so
/// memory freed on the compute stream afterwards is not reused while NCCL uses it.
class NcclWork final : public Work {
 public:
  NcclWork(NcclCommunicator& owner, std::shared_ptr<NcclCall> call)
      : owner_(owner), call_(std::move(call)) {}
  ~NcclWork() override {
    if (waited_) return;
    try {
      owner_.wait(*call_);
    } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor cannot report it
    }
  }
  NcclWork(const NcclWork&) = delete;
  NcclWork& operator=(const NcclWork&) = delete;
  void wait() override {
    if (waited_) return;
    owner_.wait(*call_);
    waited_ = true;
  }
  bool test() override { return owner_.test(*call_); }

 private:
  NcclCommunicator& owner_;
  std::shared_ptr<NcclCall> call_;
  bool waited_ = false;
};

std::vector<RankCallState> NcclGroup::states() const {
  const std::lock_guard lock(mutex_);
  std::vector<RankCallState> states;
  for (const NcclCommunicator* member : members_)
    if (member != nullptr) states.push_back(member->state());
  return states;
}

NcclCommunicator::NcclCommunicator(const ncclUniqueId& id, int rank, int size, int device, int slot,
                                   NcclGroup& group, CommOptions options, NodeLayout layout)
    : rank_(rank),
      size_(size),
      device_(device),
      slot_(slot),
      group_(group),
      options_(options),
      layout_(std::move(layout)),
      clock_(rank, false) {
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclResult_t status = ncclCommInitRankConfig(&comm_, size, id, rank, &config);
  // Non-blocking: the ranks meet while this polls, for at most the hang timeout.
  const WallTime::time_point started = WallTime::now();
  while (status == ncclInProgress) {
    if (WallTime::now() - started > options_.hang_timeout)
      throw CommError(fmt::format(
          "rank {} (nccl, GPU {}): the communicator was not set up within the hang timeout "
          "({} ms): a rank of the launch did not start or could not be reached",
          rank, device, options_.hang_timeout.count()));
    std::this_thread::sleep_for(kProgressPoll);
    (void)ncclCommGetAsyncError(comm_, &status);
  }
  check_nccl(status, "ncclCommInitRankConfig");
  start();
}

NcclCommunicator::NcclCommunicator(ncclComm_t comm, int device, std::unique_ptr<NcclGroup> group,
                                   CommOptions options, NodeLayout layout)
    : device_(device),
      slot_(0),
      owned_group_(std::move(group)),
      group_(*owned_group_),
      options_(options),
      layout_(std::move(layout)),
      comm_(comm),
      clock_(user_rank(comm), false) {
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  rank_ = user_rank(comm_);
  check_nccl(ncclCommCount(comm_, &size_), "ncclCommCount");
  start();
}

void NcclCommunicator::start() {
  counters_.bytes_sent_to.assign(static_cast<std::size_t>(size_), 0);
  counters_.bytes_received_from.assign(static_cast<std::size_t>(size_), 0);
  check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
             "cudaStreamCreateWithFlags (nccl stream)");
  check_cuda(cudaMalloc(&barrier_scratch_, sizeof(int)), "cudaMalloc (barrier scratch)");
  group_.join(slot_, this);
  watchdog_ = std::thread([this] { run_watchdog(); });
}

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key) {
  require_split_color(color);
  flush();  // messages issued before go first, as before a collective
  // Counted and logged as a collective; ncclCommSplit itself blocks this thread (polled:
  // the communicators are non-blocking) until every rank of this communicator called it.
  std::shared_ptr<NcclCall> call =
      begin({.op = CommOp::kSplit, .device = Device::kCuda, .color = color, .key = key});
  check_cuda(cudaSetDevice(device_), "cudaSetDevice");
  ncclComm_t child = nullptr;
  with_comm("ncclCommSplit", [&] {
    return ncclCommSplit(comm_, color == kNoColor ? NCCL_SPLIT_NOCOLOR : color, key, &child,
                         nullptr);  // null: the parent's configuration (non-blocking)
  });
  // A non-blocking split returns before the new communicator is ready: poll it.
  ncclResult_t status = ncclInProgress;
  const WallTime::time_point started = WallTime::now();
  while (child != nullptr && status == ncclInProgress) {
    if (const ncclResult_t query = ncclCommGetAsyncError(child, &status); query != ncclSuccess)
      status = query;
    if (status != ncclInProgress) break;
    if (WallTime::now() - started > options_.hang_timeout)
      throw CommError(fmt::format(
          "rank {} (nccl, GPU {}): ncclCommSplit did not finish within the hang timeout ({} ms): "
          "a rank of the communicator did not call split",
          rank_, device_, options_.hang_timeout.count()));
    std::this_thread::sleep_for(kProgressPoll);
  }
  if (child != nullptr) check_nccl(status, "ncclCommSplit (the new communicator)");
  // The split ends on the host: mark its call complete at once (an event recorded now).
  end(call);
  if (child == nullptr) return nullptr;
  // NCCL does not say which ranks joined: each tells the others its rank here, and this
  // communicator's layout says where that is in the launch.
  const std::vector<int> members = all_gather_ints(child, device_, rank_, options_.hang_timeout);
  return std::make_unique<NcclCommunicator>(child, device_, std::make_unique<NcclGroup>(1, &group_),
                                            options_, layout_.of_members(members));
}

NcclCommunicator::~NcclCommunicator() {
  {
    const std::lock_guard lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  watchdog_.join();
  group_.leave(slot_);
  // Nothing can be reported from here. ncclCommAbort freed an aborted communicator. When
  // another rank of the launch failed, a call of this rank may wait for it forever: abort
  // rather than wait for the stream.
  if (!aborted_ && group_.failed()) {
    (void)ncclCommAbort(comm_);
  } else if (!aborted_) {
    (void)cudaStreamSynchronize(stream_);
    (void)ncclCommDestroy(comm_);
  }
  (void)cudaFree(barrier_scratch_);
  (void)cudaStreamDestroy(stream_);
}

void NcclCommunicator::throw_if_failed() const {
  const std::lock_guard lock(mutex_);
  if (!failure_.empty()) throw CommError(failure_);
  if (group_.failed())
    throw CommError(fmt::format("rank {} (nccl): aborted: {}", rank_, group_.reason()));
}

void NcclCommunicator::check_buffer(ConstBuffer data, std::string_view call) const {
  require_device(data.device, Device::kCuda, "nccl", call);
  if (data.count == 0) return;
  const int device = cuda::device_of(data.data);
  if (device != device_)
    throw Error(
        fmt::format("{} on the nccl backend: expected a buffer on this rank's GPU {}, "
                    "got one on GPU {}",
                    call, device_, device));
}

std::shared_ptr<NcclCall> NcclCommunicator::begin(CallRecord record) {
  throw_if_failed();
  auto call = std::make_shared<NcclCall>();
  check_cuda(cudaEventCreateWithFlags(&call->done, cudaEventDisableTiming),
             "cudaEventCreateWithFlags");
  record.index = log_.record(record);
  call->record = record;
  const std::lock_guard lock(mutex_);
  if (is_collective(record.op)) {
    count_ring_collective(counters_, record, rank_, layout_);
  } else {
    count_point_to_point(counters_, record.op, rank_, record.peer,
                         record.count * element_size(record.type), layout_);
  }
  return call;
}

template <typename Calls>
void NcclCommunicator::with_comm(std::string_view what, Calls&& calls) {
  std::unique_lock lock(comm_mutex_);
  throw_if_failed();  // after an abort comm_ is gone
  ncclResult_t status = calls();
  while (status == ncclInProgress) {
    lock.unlock();  // where the watchdog may abort
    std::this_thread::sleep_for(kProgressPoll);
    lock.lock();
    throw_if_failed();
    if (const ncclResult_t query = ncclCommGetAsyncError(comm_, &status); query != ncclSuccess)
      status = query;
  }
  check_nccl(status, what);
}

void NcclCommunicator::gate_on_compute_stream() {
  cuda::ReadyEvent ready = cuda::ReadyEvent::record_on_compute_stream();
  check_cuda(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(ready.handle()), 0),
             "cudaStreamWaitEvent (nccl stream)");
}

void NcclCommunicator::end(const std::shared_ptr<NcclCall>& call) {
  check_cuda(cudaEventRecord(call->done, stream_), "cudaEventRecord (nccl stream)");
  {
    const std::lock_guard lock(mutex_);
    pending_.push_back(call);
  }
  changed_.notify_all();
}

void NcclCommunicator::flush() {
  std::vector<HeldMessage> held;
  {
    const std::lock_guard lock(mutex_);
    held.swap(held_);
  }
  if (held.empty()) return;
  // Matched by tag as on the other backends (see the top).
  std::stable_sort(held.begin(), held.end(),
                   [](const HeldMessage& a, const HeldMessage& b) { return a.tag < b.tag; });
  try {
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    gate_on_compute_stream();
    with_comm("ncclGroupEnd (messages)", [&] {
      ncclResult_t status = ncclGroupStart();
      for (const HeldMessage& message : held) {
        if (status != ncclSuccess) break;
        status = message.send ? ncclSend(message.data, message.count, nccl_type(message.type),
                                         message.peer, comm_, stream_)
                              : ncclRecv(message.data, message.count, nccl_type(message.type),
                                         message.peer, comm_, stream_);
      }
      const ncclResult_t ended = ncclGroupEnd();
      return status != ncclSuccess ? status : ended;
    });
    for (const HeldMessage& message : held) end(message.call);
  } catch (const std::exception& error) {
    // The messages left the queue unlaunched: their end events will never be recorded, and
    // a wait on an event never recorded returns at once, as if they had arrived. Fail the
    // communicator instead, so that every later wait and test throws.
    abort_with(fmt::format("rank {} (nccl, GPU {}): {} held message{} could not be launched: {}",
                           rank_, device_, held.size(), held.size() == 1 ? "" : "s", error.what()));
    throw;
  }
}

template <typename Enqueue>
std::unique_ptr<Work> NcclCommunicator::collective(CallRecord record, Enqueue&& enqueue) {
  flush();  // messages issued before keep their place before this collective
  std::shared_ptr<NcclCall> call = begin(record);
  check_cuda(cudaSetDevice(device_), "cudaSetDevice");
  gate_on_compute_stream();
  enqueue();
  end(call);
  return std::make_unique<NcclWork>(*this, std::move(call));
}

void NcclCommunicator::wait(NcclCall& call) {
  flush();
  throw_if_failed();
  check_cuda(cudaStreamWaitEvent(static_cast<cudaStream_t>(cuda::compute_stream()), call.done, 0),
             "cudaStreamWaitEvent (compute stream)");
}

bool NcclCommunicator::test(NcclCall& call) {
  flush();
  throw_if_failed();
  if (call.complete.load(std::memory_order_acquire)) return true;
  const cudaError_t status = cudaEventQuery(call.done);
  if (status == cudaErrorNotReady) return false;
  check_cuda(status, "cudaEventQuery");
  return true;
}

std::unique_ptr<Work> NcclCommunicator::hold_message(CommOp op, MutableBuffer data, int peer,
                                                     int tag) {
  const bool send = op == CommOp::kSend;
  const std::string_view name = send ? "isend" : "irecv";
  check_buffer(data, name);
  require_peer_in_range(peer, size_, name);
  auto call = begin({.op = op,
                     .count = data.count,
                     .type = data.type,
                     .device = data.device,
                     .peer = peer,
                     .tag = tag});
  {
    const std::lock_guard lock(mutex_);
    held_.push_back({call, data.data, data.count, data.type, peer, tag, send});
  }
  return std::make_unique<NcclWork>(*this, std::move(call));
}

std::unique_ptr<Work> NcclCommunicator::isend(ConstBuffer data, int peer, int tag) {
  // NCCL only reads a send buffer; the cast lets sends and receives share one queue.
  return hold_message(
      CommOp::kSend, {const_cast<void*>(data.data), data.count, data.type, data.device}, peer, tag);
}

std::unique_ptr<Work> NcclCommunicator::irecv(MutableBuffer data, int peer, int tag) {
  return hold_message(CommOp::kRecv, data, peer, tag);
}

void NcclCommunicator::divide_if_average(MutableBuffer result, ReduceOp op) {
  if (op != ReduceOp::kAvg) return;
  cuda::comm_divide_on(stream_, result.data, result.count,
                       device_reduce_element(result.type, "nccl: an average"), size_);
}

std::unique_ptr<Work> NcclCommunicator::allreduce(MutableBuffer data, ReduceOp op) {
  check_buffer(data, "allreduce");
  require_reducible(data, "allreduce");
  const CallRecord record{.op = CommOp::kAllReduce,
                          .count = data.count,
                          .type = data.type,
                          .device = data.device,
                          .reduce = op};
  return collective(record, [&] {
    with_comm("ncclAllReduce", [&] {
      return ncclAllReduce(data.data, data.data, data.count, nccl_type(data.type), nccl_op(op),
                           comm_, stream_);
    });
    divide_if_average(data, op);
  });
}

std::unique_ptr<Work> NcclCommunicator::reduce_scatter(ConstBuffer in, MutableBuffer out,
                                                       ReduceOp op) {
  check_buffer(in, "reduce_scatter");
  check_buffer(out, "reduce_scatter");
  require_reducible(in, "reduce_scatter");
  require_reduce_scatter_sizes(in, out, size_);
  const CallRecord record{.op = CommOp::kReduceScatter,
                          .count = in.count,
                          .type = in.type,
                          .device = in.device,
                          .reduce = op};
  return collective(record, [&] {
    with_comm("ncclReduceScatter", [&] {
      return ncclReduceScatter(in.data, out.data, out.count, nccl_type(in.type), nccl_op(op), comm_,
                               stream_);
    });
    divide_if_average(out, op);
  });
}

std::unique_ptr<Work> NcclCommunicator::allgather(ConstBuffer in, MutableBuffer out) {
  check_buffer(in, "allgather");
  check_buffer(out, "allgather");
  require_allgather_sizes(in, out, size_);
  const CallRecord record{
      .op = CommOp::kAllGather, .count = in.count, .type = in.type, .device = in.device};
  return collective(record, [&] {
    with_comm("ncclAllGather", [&] {
      return ncclAllGather(in.data, out.data, in.count, nccl_type(in.type), comm_, stream_);
    });
  });
}

std::unique_ptr<Work> NcclCommunicator::broadcast(MutableBuffer data, int root) {
  check_buffer(data, "broadcast");
  require_peer_in_range(root, size_, "broadcast root");
  const CallRecord record{.op = CommOp::kBroadcast,
                          .count = data.count,
                          .type = data.type,
                          .device = data.device,
                          .peer = root};
  return collective(record, [&] {
    with_comm("ncclBroadcast", [&] {
      return ncclBroadcast(data.data, data.data, data.count, nccl_type(data.type), root, comm_,
                           stream_);
    });
  });
}

void NcclCommunicator::barrier() {
  // An all-reduce of one int, waited for on the host: every rank must have got here.
  std::shared_ptr<NcclCall> call;
  {
    flush();
    call = begin({.op = CommOp::kBarrier, .device = Device::kCuda});
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    with_comm("ncclAllReduce (barrier)", [&] {
      return ncclAllReduce(barrier_scratch_, barrier_scratch_, 1, ncclInt32, ncclSum, comm_,
                           stream_);
    });
    end(call);
  }
  while (!test(*call)) std::this_thread::sleep_for(kBarrierPoll);
}

void NcclCommunicator::abort_with(const std::string& report) {
  {
    const std::lock_guard lock(mutex_);
    if (aborted_) return;
    aborted_ = true;
    failure_ = report;
  }
  group_.fail(report);
  // Ends NCCL's kernels of this communicator, so that streams waiting for them move on. Under
  // the communicator's lock, which a call never holds while it waits (see the top): every
  // call after it throws at throw_if_failed() before it reaches the freed communicator.
  const std::lock_guard calls(comm_mutex_);
  (void)ncclCommAbort(comm_);
}

void NcclCommunicator::run_watchdog() {
  // Only this thread completes calls in the log and aborts the communicator.
  if (cudaSetDevice(device_) != cudaSuccess) return;
  std::unique_lock lock(mutex_);
  while (!stop_) {
    changed_.wait_for(lock, kWatchdogPoll);
    if (aborted_) continue;
    while (!pending_.empty()) {
      const cudaError_t status = cudaEventQuery(pending_.front()->done);
      if (status == cudaErrorNotReady) break;
      pending_.front()->complete.store(true, std::memory_order_release);
      log_.complete(pending_.front()->record.index);
      pending_.pop_front();
    }
    std::string headline;
    ncclResult_t async_error = ncclSuccess;
    // The rank's thread may hold the communicator for a moment: look again next round.
    if (std::unique_lock calls(comm_mutex_, std::try_to_lock); calls.owns_lock())
      (void)ncclCommGetAsyncError(comm_, &async_error);
    if (async_error != ncclSuccess && async_error != ncclInProgress) {
      headline = fmt::format("rank {} (nccl, GPU {}): NCCL reported an asynchronous error: {}",
                             rank_, device_, ncclGetErrorString(async_error));
    } else if (group_.failed()) {
      headline = fmt::format(
          "rank {} (nccl): aborted because another rank of this process "
          "failed: {}",
          rank_, group_.reason());
    } else if (!pending_.empty() &&
               WallTime::now() - pending_.front()->issued > options_.hang_timeout) {
      const auto waited = std::chrono::duration_cast<std::chrono::seconds>(
          WallTime::now() - pending_.front()->issued);
      headline = fmt::format(
          "hang: rank {} (nccl, GPU {}) has waited {} s (hang timeout {} ms) for {}: a peer "
          "has not issued the matching call, or issued calls in another order or with "
          "other sizes (nccl does not validate them)",
          rank_, device_, waited.count(), options_.hang_timeout.count(),
          pending_.front()->record.describe());
    }
    if (headline.empty()) continue;
    lock.unlock();
    std::vector<RankCallState> states = group_.states();
    if (states.empty()) states.push_back(state());
    const std::string report = format_hang_report(headline, states);
    if (!group_.failed()) {
      std::fprintf(stderr, "%s\n", report.c_str());
      std::fflush(stderr);
    }
    abort_with(report);
    lock.lock();
  }
}

/// The GPU of rank `rank` among this process's `devices`: under mpirun the process's rank
/// on its node (Open MPI, MPICH and Slurm say which), so that the ranks of a node spread
/// over its GPUs; threads of this process use GPU `rank`.
int device_for(int rank, int devices) {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
    if (const char* value = std::getenv(name); value != nullptr && started_by_mpi())
      return std::atoi(value) % devices;
  return rank % devices;
}

/// Runs one rank: makes its communicator, runs `rank_main`, and returns its exception.
std::exception_ptr run_rank(const ncclUniqueId& id, int rank, int size, int slot, NcclGroup& group,
                            const LaunchOptions& options,
                            const std::function<void(Communicator&)>& rank_main) {
  try {
    const int device = device_for(rank, cuda_device_count());
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    NcclCommunicator communicator(
        id, rank, size, device, slot, group, options.comm,
        NodeLayout::of_launch(size, options.simulation.network.ranks_per_node));
    try {
      rank_main(communicator);
    } catch (...) {
      group.fail(fmt::format("rank {} failed", rank));
      throw;
    }
    return nullptr;
  } catch (...) {
    return std::current_exception();
  }
}

}  // namespace

void run_nccl(const LaunchOptions& options, const std::function<void(Communicator&)>& rank_main) {
  const int devices = cuda_device_count();
  if (devices == 0)
    throw Error(
        "the nccl backend needs a CUDA device: this process sees none (no GPU, no driver, or "
        "CUDA_VISIBLE_DEVICES hides them); use the local backend");
  const int size = options.world_size;
#ifdef DP_HAVE_MPI
  if (started_by_mpi()) {
    // One rank per process; process 0 makes the id and MPI hands it to the others.
    if (size != mpi_size_of_world())
      throw Error(
          fmt::format("the nccl backend under mpirun runs one rank per process: expected "
                      "world_size = {} (the processes), got {}",
                      mpi_size_of_world(), size));
    const int rank = mpi_rank_of_world();
    ncclUniqueId id{};
    if (rank == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    mpi_broadcast_from_first(&id, sizeof(id));
    NcclGroup group(1);
    const std::exception_ptr error = run_rank(id, rank, size, 0, group, options, rank_main);
    // As the mpi backend: an error every rank raised is rethrown, one that only some
    // raised ends the job (the others may wait for this rank forever).
    const int failed = mpi_sum_over_processes(error ? 1 : 0);
    if (failed == 0) return;
    if (failed == size) rethrow_naming_rank(error, rank);
    if (error) {
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        mpi_end_job(fmt::format("rank {} (nccl) failed: {}", rank, e.what()));
      }
    }
    mpi_end_job(fmt::format("rank {} (nccl): another rank failed", rank));
  }
#endif
  if (size > devices)
    throw Error(fmt::format(
        "the nccl backend runs one rank per GPU: asked for {} ranks, this process sees {} CUDA "
        "device{}; run fewer ranks, or several ranks on one GPU with the local backend",
        size, devices, devices == 1 ? "" : "s"));
  ncclUniqueId id{};
  check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  NcclGroup group(size);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(size));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank)
    threads.emplace_back([&, rank] {
      errors[static_cast<std::size_t>(rank)] =
          run_rank(id, rank, size, rank, group, options, rank_main);
    });
  for (std::thread& thread : threads) thread.join();
  // The first rank's own error, not the "aborted because" of the ranks it stopped.
  for (int rank = 0; rank < size; ++rank) {
    const std::exception_ptr& error = errors[static_cast<std::size_t>(rank)];
    if (!error) continue;
    try {
      std::rethrow_exception(error);
    } catch (const CommError&) {
      continue;  // a rank stopped by another's failure
    } catch (...) {
      rethrow_naming_rank(error, rank);
    }
  }
  for (int rank = 0; rank < size; ++rank)
    if (errors[static_cast<std::size_t>(rank)])
      rethrow_naming_rank(errors[static_cast<std::size_t>(rank)], rank);
}

}  // namespace dp::detail
