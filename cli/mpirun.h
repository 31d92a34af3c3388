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
  /// More variables for every rank (exported with -x, so remote ranks get them): NAME=VALUE,
  /// or NAME alone for the value in mpirun's own environment (kept off the command line).
  std::vector<std::string> environment;
};

/// The mpirun command line that starts `program` (the program and its arguments) on
/// `options.ranks` processes. Throws `dp::Error` for fewer than 1 rank or no program.
std::vector<std::string> mpirun_command(const MpirunOptions& options,
                                        const std::vector<std::string>& program);

/// The absolute path of the running dplab executable (from /proc/self/exe).
std::string this_executable();

}  // namespace dp::cli
