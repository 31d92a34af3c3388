// dplab run: starts a dplab command on N ranks, the way torchrun starts workers.
//
//   dplab run -n 4 --backend mpi -- train --steps 50
//
// becomes
//
//   mpirun --oversubscribe --mca btl_vader_single_copy_mechanism none
//          -n 4 -x MALLOC_MMAP_MAX_=0 -x MALLOC_TRIM_THRESHOLD_=1073741824
//          /path/to/dplab train --steps 50 --backend mpi
//
// with --allow-run-as-root added when run as root (containers); mpirun.h builds it, the
// same way for `dplab grade`. --hostfile passes a host file to mpirun for several machines.
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "commands.h"
#include "dp/error.h"
#include "mpirun.h"

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

std::vector<std::string> mpi_command_line(const RunArguments& args) {
  MpirunOptions options;
  options.ranks = args.ranks;
  options.mpirun = args.mpirun;
  options.hostfile = args.hostfile;
  options.extra_args = args.mpirun_args;
  std::vector<std::string> program = {this_executable()};
  program.insert(program.end(), args.command.begin(), args.command.end());
  program.push_back("--backend");
  program.push_back("mpi");
  return mpirun_command(options, program);
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
    argv = mpi_command_line(args);
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
  // One value per --mpirun-arg (repeat it for more), so that it never swallows the `--`.
  run_app->add_option("--mpirun-arg", args->mpirun_args, "An extra argument for mpirun")
      ->expected(1)
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  run_app->add_flag("--dry-run", args->dry_run, "Print the command instead of running it");
  run_app->add_option("command", args->command, "The dplab command and its arguments, after --")
      ->required();
  run_app->callback([args] { run(*args); });
}

}  // namespace dp::cli
