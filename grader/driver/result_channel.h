// result_channel.h: the results channel between the grade driver and a check program, the
// one place both sides take its names and limits from.
//
// Student code runs inside the check program, so the driver does not trust what the program
// prints or the files it writes. Before it starts a check program it makes a private
// directory with one FIFO per process (rank), opens their read ends, and passes the check
// program two environment variables: `kChannelVariable` (the directory; rank r writes to
// `fifo_path(directory, r)`) and `kTokenVariable` (a fresh random token). The check
// program's main() (grader/support/check_main.cpp) removes both from its environment before
// any test runs and sends one line per GoogleTest event:
//
//   <token> {"event": "registered", "test": "Suite.Name", "runs": true}
//   <token> {"event": "start", "test": "Suite.Name"}
//   <token> {"event": "end", "test": "Suite.Name", "result": "passed", "failure": "",
//            "notes": ["measured ..."], "seconds": 0.25}
//   <token> {"event": "program_end"}
//
// (each on one line; "result" is "passed", "failed" or "skipped"). The driver ignores a
// line without this run's token, and a check whose "end" line never arrives has failed.
//
// Example (the check side; the driver's side is `run_check_program` in runner.h):
//
//   const char* directory = std::getenv(dp::grader::channel::kChannelVariable);
//   const std::string fifo = dp::grader::channel::fifo_path(directory, rank);
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace dp::grader::channel {

/// The environment variable that names the channel's directory.
inline constexpr const char* kChannelVariable = "DPLAB_RESULT_CHANNEL";
/// The environment variable that holds the run's token: 32 lower-case hex digits.
inline constexpr const char* kTokenVariable = "DPLAB_RESULT_TOKEN";
/// The environment variable that holds the run's grading seed (decimal), which the checks
/// draw their parameters from (`dp::grading::grade_seed()`).
inline constexpr const char* kSeedVariable = "DPLAB_GRADE_SEED";

/// The longest line the check program sends; it shortens failure messages and notes to fit.
inline constexpr std::size_t kMaxLineBytes = 16 * 1024;
/// The longest line the driver accepts (more than `kMaxLineBytes`, so an honest line always
/// fits); a longer one is ignored.
inline constexpr std::size_t kMaxAcceptedLineBytes = 64 * 1024;
/// The most the driver accepts from one run, every rank together; the rest is ignored.
inline constexpr std::size_t kMaxResultBytes = 1024 * 1024;

/// The FIFO that rank `rank` writes its lines to, inside the channel directory.
inline std::string fifo_path(std::string_view directory, int rank) {
  return std::string(directory) + "/rank" + std::to_string(rank);
}

}  // namespace dp::grader::channel
