// dplab: train data-parallel, start ranks under MPI, and grade the labs.
//
//   dplab train -n 4                          # 4 local ranks, the default model and data
//   dplab run -n 4 --backend mpi -- train     # the same, 4 Open MPI processes
//   dplab grade --lab 1                       # the score table of lab 1
//   dplab train -n 8 --net ib-ndr --trace run.json   # simulated InfiniBand, Chrome trace
//   dplab bench-comm -n 8 --net ib-ndr        # algbw and busbw per message size
//   dplab consolidate ckpt/ -o full.safetensors   # one file from a sharded checkpoint
//
// dplab-reference is this program built with DP_REFERENCE_BUILD=1: its `grade` grades the
// reference solutions instead of labs/.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <exception>

#include "commands.h"
#include "dp/error.h"

int main(int argc, char** argv) {
  CLI::App app{"dplab: labs in data-parallel deep-learning training"};
  app.require_subcommand(1);
  dp::cli::add_train_command(app);
  dp::cli::add_bench_comm_command(app);
  dp::cli::add_run_command(app);
  dp::cli::add_grade_command(app);
  dp::cli::add_consolidate_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const dp::Error& e) {
    fmt::print(stderr, "dplab: error: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "dplab: internal error: {}\n", e.what());
    return 2;
  }
  return 0;
}
