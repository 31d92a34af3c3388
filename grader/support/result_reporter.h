// result_reporter.h: the check program's side of the results channel (see
// grader/driver/result_channel.h): it sends the grade driver one line per GoogleTest event,
// and the driver scores those lines only.
//
// A check program's main() takes the channel from the environment first thing, so that the
// token is gone before any check runs student code, then connects once it knows its rank:
//
//   int main(int argc, char** argv) {
//     const dp::grading::ResultChannel channel = dp::grading::take_result_channel();
//     ::testing::InitGoogleTest(&argc, argv);
//     dp::grading::report_results_to_driver(channel, /*rank=*/0);
//     return RUN_ALL_TESTS();
//   }
//
// Started without the channel's variables (by hand, or by ctest) it reports nothing and the
// program behaves as any GoogleTest program.
#pragma once

#include <string>

namespace dp::grading {

/// Where to send results and the token that makes the driver accept them.
struct ResultChannel {
  std::string directory;  ///< $DPLAB_RESULT_CHANNEL: the directory with one FIFO per rank
  std::string token;      ///< $DPLAB_RESULT_TOKEN: starts every line

  /// True when the driver passed both variables.
  bool present() const { return !directory.empty() && !token.empty(); }
};

/// Reads $DPLAB_RESULT_CHANNEL and $DPLAB_RESULT_TOKEN and removes them from this process's
/// environment (and from /proc/self/environ), so that code run later cannot read the token
/// there. Call it first in main(), before any test runs.
ResultChannel take_result_channel();

/// Opens rank `rank`'s FIFO of `channel` and appends a GoogleTest listener that sends every
/// test's start and end (result, failure messages, the `dp::grading::note_measured` notes,
/// seconds) and the program's end, each line opening with the token. Does nothing and returns
/// true when `channel` is not present; prints why and returns false when the FIFO cannot be
/// opened (the driver then scores every check as not reported). Call it before RUN_ALL_TESTS.
bool report_results_to_driver(const ResultChannel& channel, int rank);

}  // namespace dp::grading
