// mpirun.h: the mpirun command lines dplab builds, shared by `dplab run` and `dplab grade`.
//
// Both commands start ranks the way torchrun starts workers, so both pass mpirun the same
// options: what root and containers need, oversubscription, and the malloc settings every
// rank must get. Keeping the list in one place means a fix reaches both.
//
// Example:
//
//   MpirunOptions options;
//   options.ranks = 4;
//   auto argv = mpirun_command(options, {this_executable(), "train", "--backend", "mpi"});
//   // mpirun -n 4 [--allow-run-as-root] --oversubscribe --mca ... -x ... /path/dplab train ...
//
//   // One command line per rank (Open MPI's MPMD form, "a : b"), e.g. a file name per rank:
//   auto argv2 = mpirun_command_per_rank(options, {{"prog", "out0"}, {"prog", "out1"}});
#pragma once

#include <string>
#include <vector>

namespace dp::cli {

/// What varies between mpirun invocations; everything else is fixed by dplab.
struct MpirunOptions {
  int ranks = 1;                        ///< processes to start (-n)
  std::string mpirun = "mpirun";        ///< the mpirun program
  std::string hostfile;                 ///< an Open MPI host file; empty: this machine only
  std::vector<std::string> extra_args;  ///< more mpirun options, passed before the program
  /// More NAME=VALUE variables for every rank (exported with -x, so remote ranks get them).
  std::vector<std::string> environment;
};

/// The mpirun command line that starts `program` (the program and its arguments) on
/// `options.ranks` processes. Throws `dp::Error` for fewer than 1 rank or no program.
std::vector<std::string> mpirun_command(const MpirunOptions& options,
                                        const std::vector<std::string>& program);

/// The mpirun command line that starts one process per entry of `per_rank` (rank r runs
/// `per_rank[r]`), all in one MPI job; `options.ranks` is ignored. Throws `dp::Error` when
/// `per_rank` or one of its command lines is empty.
std::vector<std::string> mpirun_command_per_rank(
    const MpirunOptions& options, const std::vector<std::vector<std::string>>& per_rank);

/// The absolute path of the running dplab executable (from /proc/self/exe).
std::string this_executable();

}  // namespace dp::cli
