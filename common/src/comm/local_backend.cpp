// local_backend.cpp: the local backend as a rank sees it: its Communicator and Work handles,
// and run_local, which starts the ranks' threads for `dp::launch` and reports the root
// cause of a failure. How the backend works: local_world.h.
#include "comm/backends.h"
#include "comm/local_world.h"

namespace dp::detail {
namespace local {

// --- LocalWork and LocalCommunicator ------------------------------------------------------

LocalWork::~LocalWork() {
  // An exception is leaving the rank's function while this call is in flight: end the
  // other ranks' calls now instead of letting them wait for a rank that is gone.
  if (std::uncaught_exceptions() > 0 && !world_.is_ready(*operation_))
    world_.abort(fmt::format(
        "dplab: aborted because rank {} failed (an exception left its function while {} was "
        "in flight)",
        operation_->rank, operation_->record.describe()));
  world_.wait_quietly(*operation_);
  world_.close_log(*operation_);  // if wait() threw before it did
  operation_->slot.reset();       // the call and its slot refer to each other (see CollectiveSlot)
}

void LocalWork::wait() {
  world_.wait(*operation_);
}

bool LocalWork::test() {
  return world_.test(*operation_);
}

std::shared_ptr<Operation> LocalCommunicator::make_operation(CommOp op) const {
  auto operation = std::make_shared<Operation>();
  operation->op = op;
  operation->rank = launch_rank();
  operation->group = &group_;
  operation->member = rank_;
  operation->record.op = op;
  operation->record.communicator = group_.id;
  return operation;
}

std::unique_ptr<Work> LocalCommunicator::isend(ConstBuffer data, int peer, int tag) {
  require_peer_in_range(peer, size(), "isend");
  require_device_memory(data, "isend");
  auto operation = make_operation(CommOp::kSend);
  operation->input = data;
  operation->gate = DeviceGate::at_issue(data, {});
  operation->record.count = data.count;
  operation->record.type = data.type;
  operation->record.device = data.device;
  operation->record.peer = peer;
  operation->record.tag = tag;
  return std::make_unique<LocalWork>(world_, world_.post_point_to_point(operation, peer, tag));
}

std::unique_ptr<Work> LocalCommunicator::irecv(MutableBuffer data, int peer, int tag) {
  require_peer_in_range(peer, size(), "irecv");
  require_device_memory(data, "irecv");
  auto operation = make_operation(CommOp::kRecv);
  operation->output = data;
  operation->gate = DeviceGate::at_issue({}, data);
  operation->record.count = data.count;
  operation->record.type = data.type;
  operation->record.device = data.device;
  operation->record.peer = peer;
  operation->record.tag = tag;
  return std::make_unique<LocalWork>(world_, world_.post_point_to_point(operation, peer, tag));
}

std::unique_ptr<Work> LocalCommunicator::allreduce(MutableBuffer data, ReduceOp op) {
  require_reducible(data, "allreduce");
  require_device_memory(data, "allreduce");
  auto operation = make_operation(CommOp::kAllReduce);
  operation->input = data;
  operation->output = data;
  operation->gate = DeviceGate::at_issue(data, data);
  operation->reduce = op;
  operation->record.count = data.count;
  operation->record.type = data.type;
  operation->record.device = data.device;
  operation->record.reduce = op;
  return std::make_unique<LocalWork>(world_, world_.post_collective(operation));
}

std::unique_ptr<Work> LocalCommunicator::reduce_scatter(ConstBuffer in, MutableBuffer out,
                                                        ReduceOp op) {
  require_reducible(in, "reduce_scatter");
  require_same_device(in, out, "reduce_scatter");
  require_reduce_scatter_sizes(in, out, size());
  require_device_memory(in, "reduce_scatter");
  require_device_memory(out, "reduce_scatter");
  auto operation = make_operation(CommOp::kReduceScatter);
  operation->input = in;
  operation->output = out;
  operation->gate = DeviceGate::at_issue(in, out);
  operation->reduce = op;
  operation->record.count = in.count;
  operation->record.type = in.type;
  operation->record.device = in.device;
  operation->record.reduce = op;
  return std::make_unique<LocalWork>(world_, world_.post_collective(operation));
}

std::unique_ptr<Work> LocalCommunicator::allgather(ConstBuffer in, MutableBuffer out) {
  require_same_device(in, out, "allgather");
  require_allgather_sizes(in, out, size());
  require_device_memory(in, "allgather");
  require_device_memory(out, "allgather");
  auto operation = make_operation(CommOp::kAllGather);
  operation->input = in;
  operation->output = out;
  operation->gate = DeviceGate::at_issue(in, out);
  operation->record.count = in.count;
  operation->record.type = in.type;
  operation->record.device = in.device;
  return std::make_unique<LocalWork>(world_, world_.post_collective(operation));
}

std::unique_ptr<Work> LocalCommunicator::broadcast(MutableBuffer data, int root) {
  require_peer_in_range(root, size(), "broadcast root");
  require_device_memory(data, "broadcast");
  auto operation = make_operation(CommOp::kBroadcast);
  operation->input = data;
  operation->output = data;
  operation->gate = DeviceGate::at_issue(data, data);
  operation->root = root;
  operation->record.count = data.count;
  operation->record.type = data.type;
  operation->record.device = data.device;
  operation->record.peer = root;
  return std::make_unique<LocalWork>(world_, world_.post_collective(operation));
}

void LocalCommunicator::barrier() {
  LocalWork work(world_, world_.post_collective(make_operation(CommOp::kBarrier)));
  work.wait();
}

std::unique_ptr<Communicator> LocalCommunicator::split(int color, int key) {
  require_split_color(color);
  auto operation = make_operation(CommOp::kSplit);
  operation->record.color = color;
  operation->record.key = key;
  {
    LocalWork work(world_, world_.post_collective(operation));
    work.wait();
  }
  if (!operation->split_into) return nullptr;
  const dp::detail::UncountedHeapAllocations runtime_state;  // the backend's, not the lab's
  return std::make_unique<LocalCommunicator>(world_, *operation->split_into, operation->split_rank);
}

CommCounters LocalCommunicator::counters() const {
  return world_.counters(group_, rank_);
}

Clock& LocalCommunicator::clock() {
  return world_.clock(launch_rank());
}

}  // namespace local

namespace {

/// True when `error` is another rank's failure echoed by the abort it caused.
bool is_abort_of_another_rank(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const CommError& e) {
    return std::string_view(e.what()).starts_with("dplab: aborted because rank");
  } catch (...) {
    return false;
  }
}

}  // namespace

void rethrow_naming_rank(const std::exception_ptr& error, int rank) {
  try {
    std::rethrow_exception(error);
  } catch (CommError&) {
    throw;  // it names the ranks involved already (all of them, for a mismatch)
  } catch (Error& raised) {
    raised.set_rank(rank);
    throw;
  }
}

void run_local(const LaunchOptions& options, const std::function<void(Communicator&)>& rank_main) {
  const int size = options.world_size;
  local::LocalWorld world(size, options.comm, options.simulation);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(size));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      ScopedClock bind_clock(world.simulated_clock(r));
      try {
        rank_main(world.communicator(r));
      } catch (const std::exception& e) {
        errors[r] = std::current_exception();
        world.abort(fmt::format("dplab: aborted because rank {} failed: {}", r, e.what()));
      } catch (...) {
        errors[r] = std::current_exception();
        world.abort(fmt::format("dplab: aborted because rank {} failed", r));
      }
      world.mark_finished(r);
    });
  }
  const std::vector<int> stuck = world.wait_for_ranks();
  if (!stuck.empty()) {
    // A thread cannot be stopped, and returning would destroy what it still uses: report
    // and end the process, as the mpi backend ends the job.
    std::fprintf(stderr,
                 "%s\ndplab: rank%s %s did not return from its function after the abort (stuck "
                 "in its own code, outside dplab); ending the process\n",
                 world.abort_reason().c_str(), stuck.size() > 1 ? "s" : "",
                 fmt::format("{}", fmt::join(stuck, ", ")).c_str());
    std::fflush(stderr);
    std::_Exit(local::kStuckRankExitStatus);
  }
  for (auto& thread : threads) thread.join();

  // Rethrow the root cause: the lowest rank's error that is not an echo of another's,
  // naming its rank.
  std::exception_ptr first_echo;
  int first_echo_rank = 0;
  for (int r = 0; r < size; ++r) {
    const std::exception_ptr& error = errors[static_cast<std::size_t>(r)];
    if (!error) continue;
    if (!is_abort_of_another_rank(error)) rethrow_naming_rank(error, r);
    if (!first_echo) {
      first_echo = error;
      first_echo_rank = r;
    }
  }
  if (first_echo) rethrow_naming_rank(first_echo, first_echo_rank);
}

}  // namespace dp::detail
