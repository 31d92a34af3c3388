// dplab: train data-parallel, start ranks under MPI, and grade the labs.
//
//   dplab train -n 4                          # 4 local ranks, the default model and data
//   dplab run -n 4 --backend mpi -- train     # the same, 4 Open MPI processes
//   dplab grade --lab 1                       # the score table of lab 1
//   dplab train -n 8 --net ib-ndr --trace run.json   # simulated InfiniBand, Chrome trace
//   dplab bench-comm -n 8 --net ib-ndr        # algbw and busbw per message size
//   dplab consolidate ckpt/ -o full.safetensors   # one file from a sharded checkpoint
//   dplab sample dplab-train.safetensors          # text from a trained GPT
//
// dplab-reference is this program built with DP_REFERENCE_BUILD=1: its `grade` grades the
// reference solutions instead of labs/.
// Exit status, the same for every command:
//   0  done (grade: full marks)
//   1  a check failed: grade below full marks, train --verify or its replica comparison
//   2  a usage or input error: a bad option, a malformed or refused file; nothing was done
//   3  a hang: a rank waited past the hang timeout (the report says which, and on what)
//   4  the work was done but a result could not be written (a full disk, a file size limit,
//      a closed standard output)
//   70 an internal error of dplab's (a bug: please report it)
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <exception>
#include <new>

#include "commands.h"
#include "dp/error.h"

namespace {

constexpr int kUsageOrInputError = 2;
constexpr int kHang = 3;
constexpr int kOutputLost = 4;
constexpr int kInternalError = 70;  // EX_SOFTWARE of sysexits.h

/// What could not be written to standard output (a closed pipe, a full disk) is an error
/// like any other output's, not a silent success.
int standard_output_status(int status) {
  if (std::fflush(stdout) == 0 && std::ferror(stdout) == 0) return status;
  std::fputs("dplab: error: could not write to standard output\n", stderr);
  return status == 0 ? kOutputLost : status;
}

}  // namespace

int main(int argc, char** argv) {
  // A write past the file size limit or into a closed pipe fails with an error code
  // (EFBIG, EPIPE) that the writer reports, instead of killing the process unexplained.
  std::signal(SIGXFSZ, SIG_IGN);
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"dplab: labs in data-parallel deep-learning training"};
  app.require_subcommand(1);
  dp::cli::add_train_command(app);
  dp::cli::add_bench_comm_command(app);
  dp::cli::add_run_command(app);
  dp::cli::add_grade_command(app);
  dp::cli::add_consolidate_command(app);
  dp::cli::add_sample_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::RuntimeError& e) {
    return standard_output_status(e.get_exit_code());  // grade: 1, not full marks
  } catch (const CLI::ParseError& e) {
    const int status = app.exit(e);  // prints the help, or the error and the usage hint
    return status == 0 ? standard_output_status(0) : kUsageOrInputError;
  } catch (const dp::cli::CheckFailed& e) {
    fmt::print(stderr, "dplab: check failed: {}\n", e.what());
    return 1;
  } catch (const dp::HangError& e) {
    fmt::print(stderr, "dplab: hang: {}\n", e.what());
    return kHang;
  } catch (const dp::OutputError& e) {
    fmt::print(stderr, "dplab: error: {}\n", e.what());
    return kOutputLost;
  } catch (const dp::Error& e) {
    fmt::print(stderr, "dplab: error: {}\n", e.what());
    return kUsageOrInputError;
  } catch (const std::bad_alloc& e) {
    // The large allocations (tensors, files read whole) name themselves (dp::OutOfMemory);
    // a small one refused means the machine's memory was already spent.
    fmt::print(stderr,
               "dplab: error: out of memory ({}): this machine's memory (or a limit such as "
               "ulimit -v) is spent; use a smaller model, data set or checkpoint\n",
               e.what());
    return kUsageOrInputError;
  } catch (const std::exception& e) {
    fmt::print(stderr, "dplab: internal error: {}\n", e.what());
    return kInternalError;
  }
  return standard_output_status(0);
}
