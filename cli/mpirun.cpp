// mpirun.cpp: builds the mpirun command lines of `dplab run` and `dplab grade`.
#include "mpirun.h"

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <system_error>

#include "dp/error.h"

namespace dp::cli {
namespace {

/// Options for the whole job: they come before the first program.
std::vector<std::string> job_options(const MpirunOptions& options) {
  std::vector<std::string> argv = {options.mpirun};
  if (geteuid() == 0) argv.push_back("--allow-run-as-root");  // containers run as root
  // More ranks than cores is fine for labs (and the only way on a laptop).
  argv.push_back("--oversubscribe");
  // Containers forbid the ptrace-based single-copy transfers of the vader shared-memory
  // transport; without this Open MPI prints an error for every large message.
  for (const char* arg : {"--mca", "btl_vader_single_copy_mechanism", "none"}) argv.push_back(arg);
  if (!options.hostfile.empty()) {
    argv.push_back("--hostfile");
    argv.push_back(options.hostfile);
  }
  argv.insert(argv.end(), options.extra_args.begin(), options.extra_args.end());
  return argv;
}

/// Options of one group of processes ("app context"): Open MPI applies -x per context, so
/// in the per-rank form every context repeats them.
void append_context(std::vector<std::string>& argv, const MpirunOptions& options, int ranks,
                    const std::vector<std::string>& program) {
  if (program.empty()) throw Error("mpirun: no program to start (expected a command line)");
  argv.push_back("-n");
  argv.push_back(std::to_string(ranks));
  // Keep freed memory mapped in every rank: an MPI_Allreduce of 64 MiB drops from 3.4 to
  // 0.17 GB/s when its temporaries are fresh mmap memory (measured on 2 vCPUs).
  for (const char* arg : {"-x", "MALLOC_MMAP_MAX_=0", "-x", "MALLOC_TRIM_THRESHOLD_=1073741824"})
    argv.push_back(arg);
  for (const std::string& variable : options.environment) {
    argv.push_back("-x");
    argv.push_back(variable);
  }
  argv.insert(argv.end(), program.begin(), program.end());
}

}  // namespace

std::vector<std::string> mpirun_command(const MpirunOptions& options,
                                        const std::vector<std::string>& program) {
  if (options.ranks < 1) throw Error(fmt::format("-n must be at least 1, got {}", options.ranks));
  std::vector<std::string> argv = job_options(options);
  append_context(argv, options, options.ranks, program);
  return argv;
}

std::vector<std::string> mpirun_command_per_rank(
    const MpirunOptions& options, const std::vector<std::vector<std::string>>& per_rank) {
  if (per_rank.empty()) throw Error("mpirun: expected at least one rank's command line, got none");
  std::vector<std::string> argv = job_options(options);
  for (std::size_t rank = 0; rank < per_rank.size(); ++rank) {
    if (rank > 0) argv.push_back(":");  // Open MPI's separator between app contexts
    append_context(argv, options, 1, per_rank[rank]);
  }
  return argv;
}

std::string this_executable() {
  std::error_code error;
  const auto path = std::filesystem::read_symlink("/proc/self/exe", error);
  if (error) throw Error(fmt::format("cannot find the dplab executable: {}", error.message()));
  return path.string();
}

}  // namespace dp::cli
