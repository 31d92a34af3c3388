// result_reporter.h: the check program's side of the results channel (see
// grader/driver/result_channel.h): it sends the grade driver one line per GoogleTest event,
// and the driver scores those lines only.
//
// Student code runs in the check program. So that it cannot read the run's token, a check
// program takes the channel before any of its code runs: `DP_TAKE_RESULT_CHANNEL_AT_START()`,
// written once at file scope in the file that defines main(), puts
// `take_result_channel_at_start` into the program's .preinit_array, which the loader runs
// before every constructor (a lab's static objects included). It reads and deletes the
// token file and removes the channel's variable; main() then connects once it knows its
// rank:
//
//   DP_TAKE_RESULT_CHANNEL_AT_START();
//
//   int main(int argc, char** argv) {
//     const dp::grading::ResultChannel channel = dp::grading::taken_result_channel();
//     ::testing::InitGoogleTest(&argc, argv);
//     dp::grading::report_results_to_driver(channel, /*rank=*/0);
//     return RUN_ALL_TESTS();
//   }
//
// Started without the channel (by hand, or by ctest) it reports nothing and the program
// behaves as any GoogleTest program.
#pragma once

#include <string>

namespace dp::grading {

/// Where to send results and the token that makes the driver accept them.
struct ResultChannel {
  std::string directory;  ///< the directory with one FIFO per rank ($DPLAB_RESULT_CHANNEL)
  std::string token;      ///< starts every line (read from the rank's token file)

  /// True when the driver passed a channel and its token was read.
  bool present() const { return !directory.empty() && !token.empty(); }
};

/// Takes the channel the driver passed: the directory from $DPLAB_RESULT_CHANNEL, which it
/// removes from the environment (and from /proc/self/environ), and the token from the file
/// of this process's rank (from Open MPI's environment; 0 otherwise), which it deletes. It
/// uses C library calls only, as it runs before the program's constructors. Later calls do
/// nothing. The arguments are those the loader passes (argc, argv, envp), unused.
void take_result_channel_at_start(int argc, char** argv, char** envp);

/// What `take_result_channel_at_start` took (empty when it found no channel).
ResultChannel taken_result_channel();

/// Opens rank `rank`'s FIFO of `channel` and appends a GoogleTest listener that sends every
/// test's start and end (result, failure messages, the `dp::grading::note_measured` notes,
/// seconds) and the program's end, each line opening with the token. Does nothing and returns
/// true when `channel` is not present; prints why and returns false when the FIFO cannot be
/// opened (the driver then scores every check as not reported). Call it before RUN_ALL_TESTS.
bool report_results_to_driver(const ResultChannel& channel, int rank);

}  // namespace dp::grading

/// Puts `dp::grading::take_result_channel_at_start` into this program's .preinit_array, so
/// that it runs before any constructor of the program. Write it once, at file scope, in the
/// file that defines main() (its object comes first on the link line, so its entry comes
/// before any the lab's code could add).
#define DP_TAKE_RESULT_CHANNEL_AT_START()                                                    \
  [[gnu::section(".preinit_array"), gnu::used]] static void (*const dp_take_result_channel)( \
      int, char**, char**) = &dp::grading::take_result_channel_at_start
