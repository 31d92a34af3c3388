// call_log.h (internal): each rank's record of its communication calls, and the hang
// report built from every rank's record. Shared by the local and mpi backends.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "dp/comm.h"

namespace dp::detail {

/// One communicator call as the hang report shows it.
struct CallRecord {
  std::uint64_t index = 0;             ///< position in this rank's sequence of calls
  std::uint64_t collective_index = 0;  ///< position among this rank's collectives on its
                                       ///< communicator
  /// Local backend: which communicator of the launch it was issued on (0: the launch's own;
  /// others were split from it), when one rank's log holds the calls of several.
  std::uint64_t communicator = 0;
  CommOp op = CommOp::kBarrier;
  std::size_t count = 0;  ///< elements (the input's, for reduce_scatter)
  DataType type = DataType::kFloat32;
  Device device = Device::kHost;     ///< where the buffers live (ranks must agree on it)
  ReduceOp reduce = ReduceOp::kSum;  ///< for reductions
  int peer = -1;                     ///< peer of send/recv, root of broadcast
  int tag = 0;                       ///< tag of send/recv
  int color = 0;                     ///< split: this rank's color (ranks may differ)
  int key = 0;                       ///< split: this rank's key (ranks may differ)
  bool done = false;
  /// Local backend: the call's flag that says it finished, set by another rank's thread
  /// before the owner records the completion here (see CallLog::snapshot); the owner
  /// calls complete() before the flag goes away. Null when not used.
  const std::atomic<bool>* finished = nullptr;

  /// E.g. "allreduce(count=1024 float32, op=sum) #7" or "recv(from=2, tag=0, count=16)".
  std::string describe() const;
  /// The part collectives must agree on across ranks, e.g. "allreduce(1024 float32, sum)".
  std::string signature() const;
};

/// True when `a` and `b` are the same collective call as far as the ranks must agree (what
/// `CallRecord::signature` shows, without formatting it: no allocation).
bool same_signature(const CallRecord& a, const CallRecord& b);

/// What one rank was doing when a hang or deadlock was diagnosed.
struct RankCallState {
  int rank = 0;
  bool finished = false;                 ///< returned from its function: it will issue nothing more
  bool responded = true;                 ///< false when the rank could not be asked (mpi)
  std::optional<CallRecord> blocked_on;  ///< the call whose completion the rank waits for
  std::vector<CallRecord> pending;       ///< issued and not complete
  std::vector<CallRecord> collectives;   ///< most recent collectives, oldest first
};

/// A rank's sequence of calls. Keeps every pending call and the most recent collectives
/// (enough to locate where ranks' sequences diverge). Thread-safe.
class CallLog {
 public:
  /// How many completed collectives are kept for the divergence search.
  static constexpr std::size_t kKeptCollectives = 256;

  /// Appends a call and returns its index.
  std::uint64_t record(CallRecord call);
  /// Marks call `index` complete.
  void complete(std::uint64_t index);
  /// The call with `index`, if still kept.
  std::optional<CallRecord> find(std::uint64_t index) const;
  /// This rank's state for a report; `blocked_on` is the call being waited for, if any.
  /// A pending call whose `finished` flag is set is left out: it has completed.
  RankCallState snapshot(int rank, std::optional<std::uint64_t> blocked_on, bool finished) const;

 private:
  mutable std::mutex mutex_;
  std::uint64_t next_index_ = 0;
  std::map<std::uint64_t, std::uint64_t> next_collective_;  // by communicator
  std::deque<CallRecord> pending_;                          // in issue order
  std::deque<CallRecord> collectives_;                      // last kKeptCollectives, oldest first
};

/// The report printed on a deadlock or a timeout: a headline, every rank's blocking and
/// pending calls, and the first position where the ranks' collective sequences differ.
std::string format_hang_report(const std::string& headline,
                               const std::vector<RankCallState>& ranks);

/// Of the launch's own communicator (`CallRecord::communicator` 0; the ranks of a split one
/// are a subset, whose sequences need not agree with the others'): the first collective
/// index at which the ranks' sequences are known to differ (two calls
/// there differ, or a rank that has returned has none), with a sentence that says how. When
/// none is known but a rank still running has not issued a collective that others have, the
/// first such index, said to be no known mismatch (a slow rank under a short hang timeout
/// gives it too). nullopt when the kept sequences agree.
std::optional<std::string> describe_first_divergence(const std::vector<RankCallState>& states);

}  // namespace dp::detail
