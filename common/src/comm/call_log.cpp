#include "comm/call_log.h"

#include <algorithm>
#include <map>

#include "dp/error.h"

namespace dp::detail {

std::string CallRecord::describe() const {
  std::string text;
  switch (op) {
    case CommOp::kSend:
      text = fmt::format("send(to={}, tag={}, count={} {})", peer, tag, count, to_string(type));
      break;
    case CommOp::kRecv:
      text = fmt::format("recv(from={}, tag={}, count={} {})", peer, tag, count, to_string(type));
      break;
    case CommOp::kSplit: text = fmt::format("split(color={}, key={})", color, key); break;
    default: text = signature(); break;
  }
  if (communicator != 0)
    return fmt::format("call #{} {} on communicator {}", index, text, communicator);
  return fmt::format("call #{} {}", index, text);
}

std::string CallRecord::signature() const {
  // Host buffers are the usual case and say nothing more; a device is named, so that ranks
  // passing buffers on different devices show it in the mismatch report.
  const std::string elements =
      device == Device::kHost ? std::string(to_string(type))
                              : fmt::format("{} in {} memory", to_string(type), to_string(device));
  switch (op) {
    case CommOp::kAllReduce:
    case CommOp::kReduceScatter:
      return fmt::format("{}(count={} {}, op={})", to_string(op), count, elements,
                         to_string(reduce));
    case CommOp::kAllGather: return fmt::format("{}(count={} {})", to_string(op), count, elements);
    case CommOp::kBroadcast:
      return fmt::format("broadcast(count={} {}, root={})", count, elements, peer);
    case CommOp::kBarrier: return "barrier()";
    case CommOp::kSplit: return "split()";  // colors and keys differ between ranks
    case CommOp::kSend:
    case CommOp::kRecv: return fmt::format("{}(peer={}, tag={})", to_string(op), peer, tag);
  }
  return "unknown";
}

bool same_signature(const CallRecord& a, const CallRecord& b) {
  return a.op == b.op && a.count == b.count && a.type == b.type && a.reduce == b.reduce &&
         a.peer == b.peer && a.tag == b.tag && a.device == b.device;
}

std::uint64_t CallLog::record(CallRecord call) {
  std::lock_guard lock(mutex_);
  call.index = next_index_++;
  call.done = false;
  if (is_collective(call.op)) {
    call.collective_index = next_collective_[call.communicator]++;
    collectives_.push_back(call);
    collectives_.back().finished = nullptr;  // kept after the call and its flag are gone
    if (collectives_.size() > kKeptCollectives) collectives_.pop_front();
  }
  pending_.push_back(call);
  return call.index;
}

void CallLog::complete(std::uint64_t index) {
  std::lock_guard lock(mutex_);
  auto it = std::find_if(pending_.begin(), pending_.end(),
                         [&](const CallRecord& call) { return call.index == index; });
  if (it != pending_.end()) pending_.erase(it);
  // A completing collective is almost always among the newest: search from the back.
  for (auto call = collectives_.rbegin(); call != collectives_.rend(); ++call) {
    if (call->index == index) {
      call->done = true;
      break;
    }
  }
}

std::optional<CallRecord> CallLog::find(std::uint64_t index) const {
  std::lock_guard lock(mutex_);
  for (const auto& call : pending_)
    if (call.index == index) return call;
  for (const auto& call : collectives_)
    if (call.index == index) return call;
  return std::nullopt;
}

RankCallState CallLog::snapshot(int rank, std::optional<std::uint64_t> blocked_on,
                                bool finished) const {
  RankCallState state;
  state.rank = rank;
  state.finished = finished;
  {
    std::lock_guard lock(mutex_);
    for (const CallRecord& call : pending_)
      if (call.finished == nullptr || !call.finished->load(std::memory_order_acquire))
        state.pending.push_back(call);
    state.collectives.assign(collectives_.begin(), collectives_.end());
  }
  if (blocked_on) state.blocked_on = find(*blocked_on);
  return state;
}

std::optional<std::string> describe_first_divergence(const std::vector<RankCallState>& states) {
  // Only the launch's own communicator: every rank belongs to it.
  std::vector<RankCallState> ranks = states;
  for (RankCallState& state : ranks)
    std::erase_if(state.collectives, [](const CallRecord& call) { return call.communicator != 0; });
  // Collective index -> (rank -> signature), over the window every rank still keeps.
  std::uint64_t first_common = 0;
  std::uint64_t longest = 0;
  for (const auto& state : ranks) {
    if (!state.responded) continue;
    if (!state.collectives.empty())
      first_common = std::max(first_common, state.collectives.front().collective_index);
    const std::uint64_t issued =
        state.collectives.empty() ? 0 : state.collectives.back().collective_index + 1;
    longest = std::max(longest, issued);
  }
  // A rank that has returned issues no more calls, so where its sequence ends is known; a
  // rank still running that has not issued collective #k yet may issue it later (it is only
  // slower). Only calls that are known can differ; where the ranks are merely at different
  // collectives, the report says so and claims no mismatch.
  constexpr const char* kEnded = "(nothing: its sequence ends here)";
  std::optional<std::string> apart;
  for (std::uint64_t position = first_common; position < longest; ++position) {
    std::map<std::string, std::vector<int>> ranks_by_call;
    std::vector<int> not_yet;
    for (const auto& state : ranks) {
      if (!state.responded) continue;
      const auto record =
          std::find_if(state.collectives.begin(), state.collectives.end(),
                       [&](const CallRecord& call) { return call.collective_index == position; });
      if (record != state.collectives.end())
        ranks_by_call[record->signature()].push_back(state.rank);
      else if (state.finished)
        ranks_by_call[kEnded].push_back(state.rank);
      else
        not_yet.push_back(state.rank);
    }
    const auto listing = [&] {
      std::string text;
      for (const auto& [call, members] : ranks_by_call)
        text += fmt::format("\n    rank{} {}: {}", members.size() > 1 ? "s" : "",
                            fmt::join(members, ", "), call);
      if (!not_yet.empty())
        text +=
            fmt::format("\n    rank{} {}: (not issued yet: still running, it may issue it later)",
                        not_yet.size() > 1 ? "s" : "", fmt::join(not_yet, ", "));
      return text;
    };
    if (ranks_by_call.size() > 1)
      return fmt::format("the ranks' collective sequences first differ at collective #{}:{}",
                         position, listing());
    if (!not_yet.empty() && !apart)
      apart = fmt::format(
          "the ranks were at different collectives when the report was made, at collective "
          "#{}:{}\n  that is not known to be a mismatch: a rank that is only slow gives it too, "
          "when a hang timeout (--hang-timeout) is shorter than the work between its "
          "collectives",
          position, listing());
  }
  return apart;
}

std::string format_hang_report(const std::string& headline,
                               const std::vector<RankCallState>& ranks) {
  std::string report = headline;
  for (const auto& state : ranks) {
    report += fmt::format("\n  rank {}: ", state.rank);
    if (!state.responded) {
      report += "did not answer (it may have died or be stuck outside dplab)";
      continue;
    }
    if (state.blocked_on) {
      report += "waits for " + state.blocked_on->describe();
    } else if (state.finished) {
      report += "has returned from its function and will issue no more calls";
    } else {
      report += "is not waiting in dplab (computing, or stuck elsewhere)";
    }
    std::vector<std::string> others;
    for (const auto& call : state.pending)
      if (!state.blocked_on || call.index != state.blocked_on->index)
        others.push_back(call.describe());
    if (!others.empty()) report += fmt::format("; also pending: {}", fmt::join(others, "; "));
  }
  if (auto divergence = describe_first_divergence(ranks)) {
    report += "\n  " + *divergence;
  } else {
    report += "\n  the ranks' collective sequences agree; look at the point-to-point calls above";
  }
  return report;
}

}  // namespace dp::detail
