// dplab run: starts a dplab command on N ranks, the way torchrun starts workers.
//
//   dplab run -n 4 --backend mpi -- train --steps 50
//
// becomes
//
//   mpirun -n 4 --oversubscribe --mca btl_vader_single_copy_mechanism none
//          -x MALLOC_MMAP_MAX_=0 -x MALLOC_TRIM_THRESHOLD_=1073741824
//          /path/to/dplab train --steps 50 --backend mpi
//
// with --allow-run-as-root added when run as root (containers). --hostfile passes a host
// file to mpirun for several machines.
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "commands.h"
#include "dp/error.h"

namespace dp::cli {
namespace {

struct RunArguments {
  int ranks = 1;
  std::string backend = "mpi";
  std::string hostfile;
  std::string mpirun = "mpirun";
  std::vector<std::string> mpirun_args;
  bool dry_run = false;
  std::vector<std::string> command;
};

std::string this_executable() {
  std::error_code error;
  const auto path = std::filesystem::read_symlink("/proc/self/exe", error);
  if (error) throw Error(fmt::format("cannot find the dplab executable: {}", error.message()));
  return path.string();
}

std::vector<std::string> mpirun_command(const RunArguments& args) {
  std::vector<std::string> argv = {args.mpirun, "-n", std::to_string(args.ranks)};
  if (geteuid() == 0) argv.push_back("--allow-run-as-root");  // containers run as root
  // More ranks than cores is fine for labs (and the only way on a laptop).
  argv.push_back("--oversubscribe");
  // Containers forbid the ptrace-based single-copy transfers of the vader shared-memory
  // transport; without this Open MPI prints an error for every large message.
  for (const char* arg : {"--mca", "btl_vader_single_copy_mechanism", "none"}) argv.push_back(arg);
  // Keep freed memory mapped in every rank: an MPI_Allreduce of 64 MiB drops from 3.4 to
  // 0.17 GB/s when its temporaries are fresh mmap memory (measured on 2 vCPUs).
  for (const char* arg : {"-x", "MALLOC_MMAP_MAX_=0", "-x", "MALLOC_TRIM_THRESHOLD_=1073741824"})
    argv.push_back(arg);
  if (!args.hostfile.empty()) {
    argv.push_back("--hostfile");
    argv.push_back(args.hostfile);
  }
  argv.insert(argv.end(), args.mpirun_args.begin(), args.mpirun_args.end());
  argv.push_back(this_executable());
  argv.insert(argv.end(), args.command.begin(), args.command.end());
  argv.push_back("--backend");
  argv.push_back("mpi");
  return argv;
}

[[noreturn]] void exec(const std::vector<std::string>& argv) {
  std::vector<char*> pointers;
  for (const auto& arg : argv) pointers.push_back(const_cast<char*>(arg.c_str()));
  pointers.push_back(nullptr);
  execvp(pointers[0], pointers.data());
  throw Error(
      fmt::format("cannot start {}: {} (is Open MPI installed? tools/install-deps "
                  "installs it)",
                  argv[0], std::strerror(errno)));
}

void run(const RunArguments& args) {
  if (args.ranks < 1) throw Error(fmt::format("-n must be at least 1, got {}", args.ranks));
  if (args.command.empty())
    throw Error(
        "nothing to run: give a dplab command after --, e.g. "
        "`dplab run -n 4 --backend mpi -- train`");
  std::vector<std::string> argv;
  if (args.backend == "mpi") {
    argv = mpirun_command(args);
  } else if (args.backend == "local") {
    // Local ranks are threads of one process: the command itself starts them.
    argv = {this_executable()};
    argv.insert(argv.end(), args.command.begin(), args.command.end());
    for (const char* arg : {"--backend", "local", "-n"}) argv.push_back(arg);
    argv.push_back(std::to_string(args.ranks));
  } else {
    throw Error(fmt::format("unknown backend '{}': expected 'local' or 'mpi'", args.backend));
  }
  if (args.dry_run) {
    fmt::print("{}\n", fmt::join(argv, " "));
    return;
  }
  exec(argv);
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto args = std::make_shared<RunArguments>();
  CLI::App* run_app =
      app.add_subcommand("run", "Start a dplab command on N ranks (mpirun for --backend mpi)");
  run_app->add_option("-n,--ranks", args->ranks, "Number of ranks")->capture_default_str();
  run_app->add_option("--backend", args->backend, "mpi or local")->capture_default_str();
  run_app->add_option("--hostfile", args->hostfile, "mpirun host file, for several machines");
  run_app->add_option("--mpirun", args->mpirun, "The mpirun program")->capture_default_str();
  run_app->add_option("--mpirun-arg", args->mpirun_args, "An extra argument for mpirun");
  run_app->add_flag("--dry-run", args->dry_run, "Print the command instead of running it");
  run_app->add_option("command", args->command, "The dplab command and its arguments, after --")
      ->required();
  run_app->callback([args] { run(*args); });
}

}  // namespace dp::cli
