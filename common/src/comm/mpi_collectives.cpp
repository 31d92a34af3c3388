// mpi_collectives.cpp: the mpi backend's collectives. The rank's thread posts them to a
// queue; the progress thread runs them one at a time in issue order, after checking that
// every rank called the same collective, with MPI's own blocking collectives (float32 sums
// over 3 or more ranks and every bfloat16 or float16 reduction: mpi_rank_order.cpp), and
// keeps MPI moving while point-to-point transfers are outstanding. Overview: mpi_world.h.
#include "comm/mpi_world.h"

namespace dp::detail::mpi {
namespace {

template <typename T>
void divide_elements(void* data, std::size_t count, int divisor) {
  T* values = static_cast<T*>(data);
  const T by = static_cast<T>(divisor);
  for (std::size_t k = 0; k < count; ++k) values[k] /= by;
}

/// data[k] /= divisor, the second half of kAvg after MPI's own sum (float32 on 1 or 2 ranks,
/// int32; the 16-bit floats never reach it: mpi_rank_order.cpp divides them).
void divide_by(MutableBuffer data, int divisor) {
  switch (data.type) {
    case DataType::kFloat32: return divide_elements<float>(data.data, data.count, divisor);
    case DataType::kInt32: return divide_elements<std::int32_t>(data.data, data.count, divisor);
    case DataType::kBFloat16:
    case DataType::kFloat16:
    case DataType::kUInt8: break;
  }
  DP_CHECK(false, "an average of {} reached MPI's own sum", to_string(data.type));
}

bool overlaps(ConstBuffer in, MutableBuffer out) {
  const auto* in_begin = static_cast<const char*>(in.data);
  const auto* out_begin = static_cast<const char*>(out.data);
  return in.bytes() > 0 && out.bytes() > 0 && in_begin < out_begin + out.bytes() &&
         out_begin < in_begin + in.bytes();
}

}  // namespace

// --- Collectives -------------------------------------------------------------------------

std::unique_ptr<Work> MpiCommunicator::allreduce(MutableBuffer data, ReduceOp op) {
  require_device(data.device, Device::kHost, "mpi", "allreduce");
  require_reducible(data, "allreduce");
  mpi_count(data.count, "allreduce");
  CallRecord record{.op = CommOp::kAllReduce, .count = data.count, .type = data.type, .reduce = op};
  return std::make_unique<CollectiveWork>(*this, post(record, data, data));
}

std::unique_ptr<Work> MpiCommunicator::reduce_scatter(ConstBuffer in, MutableBuffer out,
                                                      ReduceOp op) {
  require_device(in.device, Device::kHost, "mpi", "reduce_scatter");
  require_device(out.device, Device::kHost, "mpi", "reduce_scatter");
  require_reducible(in, "reduce_scatter");
  require_reduce_scatter_sizes(in, out, size_);
  mpi_count(out.count, "reduce_scatter");
  CallRecord record{.op = CommOp::kReduceScatter, .count = in.count, .type = in.type, .reduce = op};
  return std::make_unique<CollectiveWork>(*this, post(record, in, out));
}

std::unique_ptr<Work> MpiCommunicator::allgather(ConstBuffer in, MutableBuffer out) {
  require_device(in.device, Device::kHost, "mpi", "allgather");
  require_device(out.device, Device::kHost, "mpi", "allgather");
  require_allgather_sizes(in, out, size_);
  mpi_count(in.count, "allgather");
  CallRecord record{.op = CommOp::kAllGather, .count = in.count, .type = in.type};
  return std::make_unique<CollectiveWork>(*this, post(record, in, out));
}

std::unique_ptr<Work> MpiCommunicator::broadcast(MutableBuffer data, int root) {
  require_device(data.device, Device::kHost, "mpi", "broadcast");
  require_peer_in_range(root, size_, "broadcast root");
  mpi_count(data.count, "broadcast");
  CallRecord record{.op = CommOp::kBroadcast, .count = data.count, .type = data.type, .peer = root};
  return std::make_unique<CollectiveWork>(*this, post(record, data, data));
}

void MpiCommunicator::barrier() {
  CollectiveWork work(*this, post(CallRecord{.op = CommOp::kBarrier}, {}, {}));
  work.wait();
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) {
  require_split_color(color);
  std::shared_ptr<Collective> call =
      post(CallRecord{.op = CommOp::kSplit, .color = color, .key = key}, {}, {});
  {
    CollectiveWork work(*this, call);
    work.wait();
  }
  if (call->split_result == MPI_COMM_NULL) return nullptr;
  // Its ranks by their ranks here (MPI_Group_translate_ranks is local: no messages), and
  // through this communicator's layout where they are in the launch.
  MPI_Group mine = MPI_GROUP_NULL;
  MPI_Group theirs = MPI_GROUP_NULL;
  check_mpi(MPI_Comm_group(collectives_, &mine), "MPI_Comm_group");
  check_mpi(MPI_Comm_group(call->split_result, &theirs), "MPI_Comm_group");
  int size = 0;
  check_mpi(MPI_Group_size(theirs, &size), "MPI_Group_size");
  std::vector<int> ranks(static_cast<std::size_t>(size));
  std::vector<int> members(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) ranks[static_cast<std::size_t>(r)] = r;
  check_mpi(MPI_Group_translate_ranks(theirs, size, ranks.data(), mine, members.data()),
            "MPI_Group_translate_ranks");
  MPI_Group_free(&theirs);
  MPI_Group_free(&mine);
  return std::make_unique<MpiCommunicator>(call->split_result, options_,
                                           layout_.of_members(members));
}

std::shared_ptr<Collective> MpiCommunicator::post(CallRecord record, ConstBuffer input,
                                                  MutableBuffer output) {
  auto call = std::make_shared<Collective>();
  call->input = input;
  call->output = output;
  {
    std::lock_guard lock(mutex_);
    // The log numbers collectives the same way: both count them in issue order.
    record.collective_index = next_collective_++;
    record.index = log_.record(record);
    call->record = record;
    count_collective(*call);
    queue_.push_back(call);
  }
  changed_.notify_all();
  return call;
}

void MpiCommunicator::count_collective(const Collective& call) {
  // Caller holds mutex_. The formulas are those at the top of mpi_world.h.
  count_ring_collective(counters_, call.record, rank_, layout_);
}

void MpiCommunicator::wait(Collective& call) {
  std::unique_lock lock(mutex_);
  if (!call.done) {
    blocked_on_ = call.record.index;
    if (!changed_.wait_for(lock, options_.hang_timeout, [&] { return call.done; })) {
      lock.unlock();
      report_hang_and_abort(timeout_headline(call.record));
    }
    blocked_on_.reset();
  }
  if (call.error) std::rethrow_exception(call.error);
}

bool MpiCommunicator::test(const Collective& call) const {
  std::lock_guard lock(mutex_);
  return call.done;
}

void MpiCommunicator::run_progress_thread() {
  std::unique_lock lock(mutex_);
  while (true) {
    if (!queue_.empty()) {
      std::shared_ptr<Collective> call = queue_.front();
      lock.unlock();
      std::exception_ptr error;
      try {
        execute(*call);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      queue_.pop_front();
      call->error = error;
      call->done = true;
      log_.complete(call->record.index);
      changed_.notify_all();
      continue;
    }
    if (stopping_) return;
    if (outstanding_p2p_ > 0 && !caller_drives_progress_) {
      // Any call into MPI runs its progress engine; a probe on a communicator that carries
      // no point-to-point messages is the cheapest such call. The short sleep keeps this
      // thread from taking a core away from the rank's computation.
      lock.unlock();
      int flag = 0;
      MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, validation_, &flag, MPI_STATUS_IGNORE);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      lock.lock();
      continue;
    }
    changed_.wait(lock);
  }
}

void MpiCommunicator::execute(Collective& call) {
  // Progress thread. Once a collective failed to match, the ranks' sequences are out of
  // step: running any later collective could pair unrelated calls.
  if (failed_collective_) throw CommError(*failed_collective_);
  if (options_.validate_collectives) validate(call);

  const CallRecord& record = call.record;
  const MPI_Datatype type = mpi_type(record.type);
  MutableBuffer out = call.output;
  switch (record.op) {
    case CommOp::kAllReduce:
      if (needs_rank_order(record, size_)) {
        rank_order_allreduce(out, record.reduce, collectives_, rank_, size_);
        return;
      }
      check_mpi(MPI_Allreduce(MPI_IN_PLACE, out.data, static_cast<int>(out.count), type,
                              mpi_op(record.reduce), collectives_),
                "allreduce");
      if (record.reduce == ReduceOp::kAvg) divide_by(out, size_);
      return;
    case CommOp::kReduceScatter: {
      if (needs_rank_order(record, size_)) {
        rank_order_reduce_scatter(call.input, out, record.reduce, collectives_, size_);
        return;
      }
      // MPI forbids aliased buffers; an overlapping input is copied first.
      std::vector<char> copy;
      const void* in = call.input.data;
      if (overlaps(call.input, out)) {
        copy.assign(static_cast<const char*>(in),
                    static_cast<const char*>(in) + call.input.bytes());
        in = copy.data();
      }
      check_mpi(MPI_Reduce_scatter_block(in, out.data, static_cast<int>(out.count), type,
                                         mpi_op(record.reduce), collectives_),
                "reduce_scatter");
      if (record.reduce == ReduceOp::kAvg) divide_by(out, size_);
      return;
    }
    case CommOp::kAllGather: {
      const std::size_t shard_bytes = call.input.bytes();
      const void* in = call.input.data;
      std::vector<char> copy;
      if (in == static_cast<char*>(out.data) + shard_bytes * static_cast<std::size_t>(rank_)) {
        in = MPI_IN_PLACE;  // the input already sits in this rank's slot of the output
      } else if (overlaps(call.input, out)) {
        copy.assign(static_cast<const char*>(in), static_cast<const char*>(in) + shard_bytes);
        in = copy.data();
      }
      const int count = static_cast<int>(call.input.count);
      check_mpi(MPI_Allgather(in, count, type, out.data, count, type, collectives_), "allgather");
      return;
    }
    case CommOp::kBroadcast:
      check_mpi(MPI_Bcast(out.data, static_cast<int>(out.count), type, record.peer, collectives_),
                "broadcast");
      return;
    case CommOp::kBarrier: check_mpi(MPI_Barrier(collectives_), "barrier"); return;
    case CommOp::kSplit:
      check_mpi(
          MPI_Comm_split(collectives_, record.color == kNoColor ? MPI_UNDEFINED : record.color,
                         record.key, &call.split_result),
          "split (MPI_Comm_split)");
      return;
    default: DP_CHECK(false, "{} is not a collective", to_string(record.op));
  }
}

void MpiCommunicator::validate(const Collective& call) {
  // Progress thread. Every rank contributes what its signature depends on; every rank sees
  // all of them, so every rank reaches the same verdict and throws the same error.
  constexpr int kFields = 5;
  const CallRecord& record = call.record;
  const std::int64_t mine[kFields] = {static_cast<std::int64_t>(record.op),
                                      static_cast<std::int64_t>(record.count),
                                      static_cast<std::int64_t>(record.type),
                                      static_cast<std::int64_t>(record.reduce), record.peer};
  std::vector<std::int64_t> all(static_cast<std::size_t>(kFields * size_));
  check_mpi(
      MPI_Allgather(mine, kFields, MPI_INT64_T, all.data(), kFields, MPI_INT64_T, validation_),
      "the collective validation");
  std::map<std::string, std::vector<int>> ranks_by_signature;
  for (int r = 0; r < size_; ++r) {
    const std::int64_t* fields = &all[static_cast<std::size_t>(kFields * r)];
    CallRecord theirs{.op = static_cast<CommOp>(fields[0]),
                      .count = static_cast<std::size_t>(fields[1]),
                      .type = static_cast<DataType>(fields[2]),
                      .reduce = static_cast<ReduceOp>(fields[3]),
                      .peer = static_cast<int>(fields[4])};
    ranks_by_signature[theirs.signature()].push_back(r);
  }
  if (ranks_by_signature.size() == 1) return;
  std::vector<std::string> parts;
  for (const auto& [signature, members] : ranks_by_signature)
    parts.push_back(fmt::format("rank{} {} called {}", members.size() > 1 ? "s" : "",
                                fmt::join(members, ", "), signature));
  const std::string message = fmt::format("collective #{} does not match across ranks: {}",
                                          record.collective_index, fmt::join(parts, "; "));
  failed_collective_ = "dplab: collective not run because an earlier one failed: " + message;
  throw CommError(message);
}

// --- Work handles ------------------------------------------------------------------------

CollectiveWork::~CollectiveWork() {
  try {
    comm_.wait(*call_);
  } catch (const std::exception&) {
    // The error was, or will be, reported through wait() or the end of the launch.
  }
}

void CollectiveWork::wait() {
  comm_.wait(*call_);
}

bool CollectiveWork::test() {
  return comm_.test(*call_);
}

}  // namespace dp::detail::mpi
