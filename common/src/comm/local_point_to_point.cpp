// local_point_to_point.cpp: isend and irecv on the local backend: a send meets its receive
// in the mailbox of (source, destination, tag), and one thread copies the data (see
// local_world.h).
#include "comm/local_world.h"

namespace dp::detail::local {

std::shared_ptr<Operation> LocalWorld::post_point_to_point(std::shared_ptr<Operation> operation,
                                                           int peer, int tag) {
  std::unique_lock lock(mutex_, std::defer_lock);
  lock_spinning(lock);
  throw_if_aborted();
  const bool is_send = operation->op == CommOp::kSend;
  Rank& self = ranks_[operation->rank];
  operation->call_index = self.log.record(operation->record);
  operation->record.index = operation->call_index;
  const std::uint64_t bytes = is_send ? operation->input.bytes() : operation->output.bytes();
  CommGroup& group = *operation->group;
  count_point_to_point(group.counters[static_cast<std::size_t>(operation->member)], operation->op,
                       operation->member, peer, bytes, group.layout);
  // From here on the peer is a rank of the launch: the message runs between their places.
  const int peer_in_launch = group.members[static_cast<std::size_t>(peer)];

  if (network_) {
    operation->timing.peer = peer_in_launch;
    issue_virtual(*operation, bytes);
  }

  const int source = is_send ? operation->rank : peer_in_launch;
  const int destination = is_send ? peer_in_launch : operation->rank;
  Mailbox& mailbox = mailboxes_[{group.id, source, destination, tag}];
  auto& waiting_matches = is_send ? mailbox.receives : mailbox.sends;
  if (waiting_matches.empty()) {
    (is_send ? mailbox.sends : mailbox.receives).push_back(operation);
    if (network_ && is_send && bytes > 0) {
      // Eager (see the top of this file): the receive copies from here later.
      {
        const dp::detail::UncountedHeapAllocations runtime_copy;  // the backend's, not the lab's
        operation->eager_copy.reset(static_cast<unsigned char*>(std::malloc(bytes)));
      }
      if (!operation->eager_copy) throw std::bad_alloc();
      if (on_device(operation->input)) {
        operation->gate.wait_for();
        copy_device_elements({operation->eager_copy.get(), bytes, DataType::kUInt8}, 0,
                             {operation->input.data, bytes, DataType::kUInt8, Device::kCuda}, 0,
                             bytes);
        finish_device_moves();
      } else {
        std::memcpy(operation->eager_copy.get(), operation->input.data, bytes);
      }
      operation->input.data = operation->eager_copy.get();
      operation->input.device = Device::kHost;
      complete(*operation, nullptr);
    }
    if (network_) settle();
    return operation;
  }
  std::shared_ptr<Operation> match = waiting_matches.front();
  waiting_matches.pop_front();
  if (network_) {
    if (is_send)
      network_->match(operation->timing, match->timing);
    else
      network_->match(match->timing, operation->timing);
    settle();
  }
  if (is_send) {
    transfer(operation, match, lock);
  } else {
    transfer(match, operation, lock);
  }
  return operation;
}

void LocalWorld::transfer(const std::shared_ptr<Operation>& send,
                          const std::shared_ptr<Operation>& receive,
                          std::unique_lock<std::mutex>& lock) {
  // Caller holds `lock`. A matched pair is one memcpy, done by whichever rank completed
  // the match: a rendezvous, so nothing is buffered.
  if (send->input.count != receive->output.count || send->input.type != receive->output.type) {
    const std::string& group = send->group->name;
    auto error = std::make_exception_ptr(CommError(fmt::format(
        "message size mismatch: rank {} sent {} {} with tag {} to rank {}, which posted a "
        "receive of {} {}{}",
        send->member, send->input.count, to_string(send->input.type), send->record.tag,
        receive->member, receive->output.count, to_string(receive->output.type),
        group.empty() ? "" : " (on " + group + ")")));
    if (!send->done) complete(*send, error);  // an eager send has completed already
    complete(*receive, error);
    return;
  }
  ++transfers_in_flight_;
  lock.unlock();
  send->gate.wait_for();
  receive->gate.wait_for();
  copy_elements(receive->output, 0, send->input, 0, send->input.count);
  finish_device_moves();
  lock.lock();
  --transfers_in_flight_;
  if (!send->done) complete(*send, nullptr);
  complete(*receive, nullptr);
}

}  // namespace dp::detail::local
