// result_reporter.h: the check program's side of the results channel (see
// grader/driver/result_channel.h): it sends the grade driver one line per GoogleTest event,
// and the driver scores those lines only.
//
// Lab code runs in the check program, so the channel must be out of its reach. A check
// program takes the channel before any of its code runs: `DP_TAKE_RESULT_CHANNEL_AT_START()`,
// written once at file scope in the file that defines main(), puts
// `take_result_channel_at_start` into the program's .preinit_array, which the loader runs
// before every constructor. It reads and deletes the token file, removes the channel's
// variable and opens this process's FIFO, keeping the descriptor and the token in this
// file's own storage: no function returns them. What authenticates a line to the driver is
// that it arrived through that descriptor, and writing to a descriptor takes a call the lab
// audit refuses lab code (grader/audit/base.rules: write, dup2, syscall, ...); the token
// only tells the driver's lines from any other writer's. main() then starts reporting:
//
//   DP_TAKE_RESULT_CHANNEL_AT_START();
//
//   int main(int argc, char** argv) {
//     ::testing::InitGoogleTest(&argc, argv);
//     dp::grading::report_results_to_driver();
//     return RUN_ALL_TESTS();
//   }
//
// Started without the channel (by hand, or by ctest) it reports nothing and the program
// behaves as any GoogleTest program.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace dp::grading {

/// Takes the channel the driver passed: the directory from $DPLAB_RESULT_CHANNEL, which it
/// removes from the environment (and from /proc/self/environ); the token from the file of
/// this process's rank (from Open MPI's environment; 0 otherwise), which it deletes and
/// keeps masked; and the rank's FIFO, opened for writing on a high descriptor closed on
/// exec. It takes the grading variables out of the environment too (`grading_variable`). It uses C
/// library calls only, as it runs before the program's constructors. Later calls do nothing. The
/// arguments are those the loader passes (argc, argv, envp), unused but for envp.
void take_result_channel_at_start(int argc, char** argv, char** envp);

/// True when `take_result_channel_at_start` found the driver's channel (the program was
/// started by `dplab grade`), whether or not its FIFO could be opened.
bool started_by_the_driver();

/// The value the driver (or whoever started the program) gave the grading variable `name`
/// (DPLAB_GRADE_SEED, DPLAB_TEST_BACKEND, DPLAB_TEST_DEVICE, DPLAB_CALIBRATION_DRAWS), which
/// `take_result_channel_at_start` took out of the environment before any of the program's
/// code ran, lab code included, so that lab code cannot learn the run's seed; nullptr when
/// it was not set. In a program without the check programs' main(), the environment's. The
/// values are kept masked; each call returns a fresh copy (wipe a secret one after use).
std::optional<std::string> grading_variable(std::string_view name);

/// Appends a GoogleTest listener that sends every test's start and end (result, failure
/// messages, the `dp::grading::note_measured` notes, seconds) and the program's end on the
/// channel taken at start, each line opening with the token. Does nothing and returns true
/// when the program was not started by the driver; prints why and returns false when the
/// channel could not be opened (the driver then scores every check as not reported). Call it
/// once, before RUN_ALL_TESTS.
bool report_results_to_driver();

}  // namespace dp::grading

/// Puts `dp::grading::take_result_channel_at_start` into this program's .preinit_array, so
/// that it runs before any constructor of the program. Write it once, at file scope, in the
/// file that defines main() (its object comes first on the link line, so its entry comes
/// before any the lab's code could add).
#define DP_TAKE_RESULT_CHANNEL_AT_START()                                                    \
  [[gnu::section(".preinit_array"), gnu::used]] static void (*const dp_take_result_channel)( \
      int, char**, char**) = &dp::grading::take_result_channel_at_start
