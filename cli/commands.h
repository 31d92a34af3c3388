// commands.h: the subcommands of the dplab program; each file adds one to the app.
#pragma once

#include <CLI/CLI.hpp>

#include "dp/error.h"

namespace dp::cli {

/// A check the command ran failed on a run that itself went well (`train --verify`, the
/// replicas' comparison): exit status 1, as a grade below full marks.
class CheckFailed : public Error {
 public:
  using Error::Error;
};

/// Adds `dplab train`: trains a model data-parallel and reports progress.
void add_train_command(CLI::App& app);
/// Adds `dplab bench-comm`: sweeps message sizes over one communication op and prints
/// algbw and busbw like nccl-tests, on the simulated or the real clock (lab 0).
void add_bench_comm_command(CLI::App& app);
/// Adds `dplab run`: starts a dplab command on N ranks under mpirun, as torchrun would.
void add_run_command(CLI::App& app);
/// Adds `dplab grade`: runs each lab's check program and prints the score table (exit code
/// 0 only at full marks). In `dplab-reference` it grades the reference solutions.
void add_grade_command(CLI::App& app);
/// Adds `dplab consolidate`: writes one full checkpoint from a sharded checkpoint's
/// directory (dp/sharded_checkpoint.h).
void add_consolidate_command(CLI::App& app);

}  // namespace dp::cli
