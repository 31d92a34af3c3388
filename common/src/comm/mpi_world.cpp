// mpi_world.cpp: how a launch of the mpi backend ends, well or badly: the watchdog thread
// that answers other ranks' status requests with this rank's call log as JSON, the hang
// report a rank collects when it waits past the hang timeout, the single MPI_Abort that
// ends a failed job, and the agreement at the end of a launch (`finish`). Overview:
// mpi_world.h.
#include "comm/mpi_world.h"

#include <nlohmann/json.hpp>

namespace dp::detail::mpi {
namespace {

// --- RankCallState as JSON (the watchdog's reply) ----------------------------------------

nlohmann::json to_json(const CallRecord& call) {
  return {{"index", call.index},
          {"collective_index", call.collective_index},
          {"op", static_cast<int>(call.op)},
          {"count", call.count},
          {"type", static_cast<int>(call.type)},
          {"reduce", static_cast<int>(call.reduce)},
          {"peer", call.peer},
          {"tag", call.tag},
          {"color", call.color},
          {"key", call.key},
          {"done", call.done}};
}

CallRecord call_from_json(const nlohmann::json& json) {
  CallRecord call;
  call.index = json.at("index").get<std::uint64_t>();
  call.collective_index = json.at("collective_index").get<std::uint64_t>();
  call.op = static_cast<CommOp>(json.at("op").get<int>());
  call.count = json.at("count").get<std::size_t>();
  call.type = static_cast<DataType>(json.at("type").get<int>());
  call.reduce = static_cast<ReduceOp>(json.at("reduce").get<int>());
  call.peer = json.at("peer").get<int>();
  call.tag = json.at("tag").get<int>();
  call.color = json.at("color").get<int>();
  call.key = json.at("key").get<int>();
  call.done = json.at("done").get<bool>();
  return call;
}

std::string serialize(const RankCallState& state) {
  nlohmann::json json;
  json["rank"] = state.rank;
  json["finished"] = state.finished;
  json["blocked_on"] = state.blocked_on ? to_json(*state.blocked_on) : nlohmann::json(nullptr);
  json["pending"] = nlohmann::json::array();
  for (const auto& call : state.pending) json["pending"].push_back(to_json(call));
  json["collectives"] = nlohmann::json::array();
  for (const auto& call : state.collectives) json["collectives"].push_back(to_json(call));
  return json.dump();
}

RankCallState parse_state(const std::string& text) {
  const auto json = nlohmann::json::parse(text);
  RankCallState state;
  state.rank = json.at("rank").get<int>();
  state.finished = json.at("finished").get<bool>();
  if (!json.at("blocked_on").is_null()) state.blocked_on = call_from_json(json["blocked_on"]);
  for (const auto& call : json.at("pending")) state.pending.push_back(call_from_json(call));
  for (const auto& call : json.at("collectives")) state.collectives.push_back(call_from_json(call));
  return state;
}

std::string describe_exception(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception not derived from std::exception";
  }
}

}  // namespace

// --- Hang diagnosis ----------------------------------------------------------------------

RankCallState MpiCommunicator::snapshot() const {
  std::lock_guard lock(mutex_);
  return log_.snapshot(rank_, blocked_on_, finished_);
}

std::string MpiCommunicator::timeout_headline(const CallRecord& call) const {
  return fmt::format("dplab: timeout: rank {} waited {:.1f} s for {}", rank_,
                     std::chrono::duration<double>(options_.hang_timeout).count(), call.describe());
}

void MpiCommunicator::run_watchdog_thread() {
  int request = kSendYourState;
  MPI_Request pending;
  MPI_Irecv(&request, 1, MPI_INT, MPI_ANY_SOURCE, kStatusRequestTag, watchdog_, &pending);
  while (true) {
    int arrived = 0;
    MPI_Status status;
    MPI_Test(&pending, &arrived, &status);
    if (arrived) {
      int lowest = lowest_ending_peer_.load();
      while (status.MPI_SOURCE < lowest &&
             !lowest_ending_peer_.compare_exchange_weak(lowest, status.MPI_SOURCE)) {
      }
      if (request == kSendYourState) answer_status_request(status.MPI_SOURCE);
      MPI_Irecv(&request, 1, MPI_INT, MPI_ANY_SOURCE, kStatusRequestTag, watchdog_, &pending);
      continue;
    }
    if (watchdog_stopping_) break;
    std::this_thread::sleep_for(kSlowPoll);
  }
  MPI_Cancel(&pending);
  MPI_Wait(&pending, MPI_STATUS_IGNORE);
}

void MpiCommunicator::answer_status_request(int requester) {
  const std::string text = serialize(snapshot());
  MPI_Send(text.data(), static_cast<int>(text.size()), MPI_CHAR, requester, kStatusReplyTag,
           watchdog_);
}

void MpiCommunicator::announce_the_end(int kind) {
  // Caller thread. The payload must outlive the sends, which are never waited for.
  static const int kinds[2] = {kSendYourState, kOnlyAnnounceTheEnd};
  announced_the_end_ = true;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    MPI_Request sent;
    MPI_Isend(&kinds[kind], 1, MPI_INT, peer, kStatusRequestTag, watchdog_, &sent);
    MPI_Request_free(&sent);
  }
}

void MpiCommunicator::end_job(const std::string& message, bool print_when_deferring) {
  // Ranks blocked on the same hang time out at about the same moment, and several ranks
  // may fail at once. Each announces the end; after a pause long enough for every
  // announcement already sent to arrive, the lowest announcing rank ends the job and the
  // others wait to be ended, so that MPI_Abort is called once (and one report printed).
  if (!announced_the_end_) announce_the_end(kOnlyAnnounceTheEnd);
  std::this_thread::sleep_for(kAnnouncementSettle);
  if (lowest_ending_peer_.load() < rank_) {
    if (print_when_deferring) {
      std::fprintf(stderr, "%s\n", message.c_str());
      std::fflush(stderr);
    }
    std::this_thread::sleep_for(kPeerReportGrace + kStatusReplyWait);
    abort_job(fmt::format("dplab: rank {} ends the job: rank {} was to end it and did not", rank_,
                          lowest_ending_peer_.load()));
  }
  abort_job(message);
}

void MpiCommunicator::report_hang_and_abort(const std::string& headline) {
  // A lower rank already reporting prints the same states: let it (see `end_job`).
  if (lowest_ending_peer_.load() < rank_) end_job(headline, /*print_when_deferring=*/false);

  std::vector<RankCallState> states(static_cast<std::size_t>(size_));
  states[rank_] = snapshot();
  std::vector<bool> answered(static_cast<std::size_t>(size_), false);
  answered[rank_] = true;
  announce_the_end(kSendYourState);
  // Peers that do not answer in time (stuck outside dplab, or gone) are reported as such.
  const auto deadline = SteadyClock::now() + kStatusReplyWait;
  while (std::count(answered.begin(), answered.end(), false) > 0 && SteadyClock::now() < deadline) {
    for (int peer = 0; peer < size_; ++peer) {
      if (answered[peer]) continue;
      int arrived = 0;
      MPI_Status status;
      MPI_Iprobe(peer, kStatusReplyTag, watchdog_, &arrived, &status);
      if (!arrived) continue;
      int length = 0;
      MPI_Get_count(&status, MPI_CHAR, &length);
      std::string text(static_cast<std::size_t>(length), '\0');
      MPI_Recv(text.data(), length, MPI_CHAR, peer, kStatusReplyTag, watchdog_, MPI_STATUS_IGNORE);
      try {
        states[peer] = parse_state(text);
        answered[peer] = true;
      } catch (const std::exception&) {
        break;  // a garbled reply counts as no answer
      }
    }
    std::this_thread::sleep_for(kSlowPoll);
  }
  for (int peer = 0; peer < size_; ++peer) {
    if (answered[peer]) continue;
    states[peer] = RankCallState{};
    states[peer].rank = peer;
    states[peer].responded = false;
  }
  end_job(format_hang_report(headline, states), /*print_when_deferring=*/false);
}

// --- The end of a launch -----------------------------------------------------------------

void MpiCommunicator::finish(std::exception_ptr error) {
  {
    std::lock_guard lock(mutex_);
    finished_ = true;
  }
  // One MAX reduction of (failed, -failed) tells every rank whether anyone failed and
  // whether everyone did.
  const int mine[2] = {error ? 1 : 0, error ? -1 : 0};
  int verdict[2] = {0, 0};
  MPI_Request request;
  check_mpi(MPI_Iallreduce(mine, verdict, 2, MPI_INT, MPI_MAX, finish_, &request),
            "the end-of-launch agreement");
  // A failed rank waits briefly: the others either fail as well (a mismatch all ranks see)
  // or never come, and then the job must end. A rank that returned waits long enough for a
  // hung peer's own, more precise, report to come first.
  const auto& timeout = options_.hang_timeout;
  const milliseconds patience = error ? std::min<milliseconds>(timeout / 2, kFailureAgreementWait)
                                      : 2 * timeout + kPeerReportGrace;
  if (!wait_sleeping(request, SteadyClock::now() + patience)) {
    const double seconds = std::chrono::duration<double>(patience).count();
    if (error)
      end_job(fmt::format("dplab: rank {} failed: {}\n(the other ranks did not fail within "
                          "{:.1f} s; ending the job)",
                          rank_, describe_exception(error), seconds),
              /*print_when_deferring=*/true);
    report_hang_and_abort(fmt::format(
        "dplab: timeout: rank {} returned from its function and waited {:.1f} s for the others",
        rank_, seconds));
  }
  const bool anyone_failed = verdict[0] == 1;
  const bool everyone_failed = verdict[1] == -1;
  if (!anyone_failed) return;
  if (everyone_failed) rethrow_naming_rank(error, rank_);
  if (error)
    end_job(fmt::format("dplab: rank {} failed: {}\n(the other ranks did not; ending the job)",
                        rank_, describe_exception(error)),
            /*print_when_deferring=*/true);
  // A rank that failed ends the job; this is only a fallback.
  std::this_thread::sleep_for(kAnnouncementSettle + kPeerReportGrace + kStatusReplyWait);
  end_job(fmt::format("dplab: rank {} ends the job because another rank failed", rank_),
          /*print_when_deferring=*/false);
}

}  // namespace dp::detail::mpi
