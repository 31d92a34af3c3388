// result_channel.h: the results channel between the grade driver and a check program, the
// one place both sides take its names and limits from.
//
// Student code runs inside the check program, so the driver does not trust what the program
// prints or the files it writes. Before it starts a check program it makes a private
// directory with, per process (rank) r, a FIFO `fifo_path(directory, r)` whose read end it
// opens, and a file `token_path(directory, r)` holding a fresh random token. It passes the
// directory in the environment variable `kChannelVariable`. The token is never in the
// environment: the check program's main() file (grader/support/check_main.cpp) reads and
// deletes the token file, and removes the variable, from its .preinit_array, which runs
// before any constructor of the program (a lab's static objects included); then it sends
// one line per GoogleTest event, in this order:
//
//   <token> {"event": "registered", "test": "Suite.Name", "runs": true}
//   <token> {"event": "start", "test": "Suite.Name"}
//   <token> {"event": "end", "test": "Suite.Name", "result": "passed", "failure": "",
//            "notes": ["measured ..."], "seconds": 0.25}
//   <token> {"event": "program_end"}
//
// (each on one line; "result" is "passed", "failed" or "skipped"). The driver ignores a
// line without this run's token, a check whose "end" line never arrives has failed, and a
// line with the token out of this order (a second result, a result without its start)
// fails every check of the run: something besides the reporter wrote to the channel.
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

/// The file that holds the token for rank `rank` (32 lower-case hex digits), inside the
/// channel directory; the check program deletes it once read.
inline std::string token_path(std::string_view directory, int rank) {
  return fifo_path(directory, rank) + ".token";
}

/// The longest token the check program reads from its token file.
inline constexpr std::size_t kMaxTokenBytes = 64;

}  // namespace dp::grader::channel
