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
// with --allow-run-as-root added when run as root (containers) and --mca mpi_yield_when_idle 1
// when the ranks outnumber this machine's cores; mpirun.h builds it, the
// same way for `dplab grade`. --hostfile passes a host file to mpirun for several machines.
// --backend nccl starts the same mpirun with `--backend nccl`: one process per GPU, NCCL
// bootstrapped through MPI.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "dp/error.h"
#include "mpirun.h"
#include "option_checks.h"

namespace dp::cli {
namespace {

struct RunArguments {
  std::optional<int> ranks;  // not given: the command's own -n, or 1
  std::string backend = "mpi";
  std::string hostfile;
  std::string mpirun = "mpirun";
  std::vector<std::string> mpirun_args;
  bool dry_run = false;
  std::vector<std::string> command;
};

/// The value of the command's own -n / --world-size (in any of CLI11's spellings), if any.
std::optional<std::string> inner_world_size(const std::vector<std::string>& command) {
  for (std::size_t i = 0; i < command.size(); ++i) {
    const std::string& argument = command[i];
    if ((argument == "-n" || argument == "--world-size") && i + 1 < command.size())
      return command[i + 1];
    if (argument.starts_with("--world-size=")) return argument.substr(13);
    if (argument.starts_with("-n") && argument.size() > 2 && argument[2] != '-')
      return argument.substr(argument[2] == '=' ? 3 : 2);
  }
  return std::nullopt;
}

/// The value of the command's own --backend, if any (`--backend X` or `--backend=X`).
std::optional<std::string> inner_backend(const std::vector<std::string>& command) {
  for (std::size_t i = 0; i < command.size(); ++i) {
    if (command[i] == "--backend" && i + 1 < command.size()) return command[i + 1];
    if (command[i].starts_with("--backend=")) return command[i].substr(10);
  }
  return std::nullopt;
}

/// The number of ranks: `dplab run -n`, else the command's own -n (`dplab run -- train -n 2`
/// means 2 ranks), else 1. Both given must agree.
int ranks_of(const RunArguments& args) {
  const std::optional<std::string> inner = inner_world_size(args.command);
  if (!inner) return args.ranks.value_or(1);
  int inner_ranks = 0;
  const auto [end, error] =
      std::from_chars(inner->data(), inner->data() + inner->size(), inner_ranks);
  if (error != std::errc() || end != inner->data() + inner->size() || inner_ranks < 1)
    throw Error(fmt::format("the command's -n {} is not a number of ranks (1 or more)", *inner));
  if (args.ranks && *args.ranks != inner_ranks)
    throw Error(fmt::format(
        "dplab run -n {} and the command's -n {} disagree: give the number of ranks once, "
        "to dplab run (`dplab run -n {} -- {} ...`)",
        *args.ranks, inner_ranks, *args.ranks, args.command.front()));
  return inner_ranks;
}

/// `argument` as a POSIX shell reads it back: quoted when empty or when it holds anything
/// but letters, digits and -_./=:,+@%.
std::string shell_quoted(const std::string& argument) {
  const bool plain = !argument.empty() && std::all_of(argument.begin(), argument.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("-_./=:,+@%", c) != nullptr;
  });
  if (plain) return argument;
  std::string quoted = "'";
  for (char c : argument) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

/// mpirun starting `ranks` processes of the command with `--backend <args.backend>`.
std::vector<std::string> mpi_command_line(const RunArguments& args, int ranks) {
  MpirunOptions options;
  options.ranks = ranks;
  options.mpirun = args.mpirun;
  options.hostfile = args.hostfile;
  options.extra_args = args.mpirun_args;
  std::vector<std::string> program = {this_executable()};
  program.insert(program.end(), args.command.begin(), args.command.end());
  program.push_back("--backend");
  program.push_back(args.backend);
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
  if (args.command.empty())
    throw Error(
        "nothing to run: give a dplab command after --, e.g. "
        "`dplab run -n 4 --backend mpi -- train`");
  const int ranks = ranks_of(args);
  const bool inner_ranks = inner_world_size(args.command).has_value();
  // dplab run gives the command its backend; a second --backend of the command's own made
  // CLI11 say "At Most 1 required but received 2", which names neither.
  if (const std::optional<std::string> backend = inner_backend(args.command))
    throw Error(fmt::format(
        "the command has its own --backend {}, but dplab run gives it --backend {}: give the "
        "backend once, to dplab run (`dplab run --backend {} -- {} ...`)",
        *backend, args.backend, *backend, args.command.front()));
  std::vector<std::string> argv;
  if (args.backend == "mpi" || args.backend == "nccl") {
    argv = mpi_command_line(args, ranks);
  } else if (args.backend == "local") {
    // Local ranks are threads of one process: the command itself starts them.
    argv = {this_executable()};
    argv.insert(argv.end(), args.command.begin(), args.command.end());
    for (const char* arg : {"--backend", "local"}) argv.push_back(arg);
    if (!inner_ranks) {
      argv.push_back("-n");
      argv.push_back(std::to_string(ranks));
    }
  } else {
    throw Error(
        fmt::format("unknown backend '{}': expected 'local', 'mpi' or 'nccl'", args.backend));
  }
  if (args.dry_run) {
    std::vector<std::string> quoted;
    for (const std::string& argument : argv) quoted.push_back(shell_quoted(argument));
    fmt::print("{}\n", fmt::join(quoted, " "));
    return;
  }
  exec(argv);
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto args = std::make_shared<RunArguments>();
  CLI::App* run_app =
      app.add_subcommand("run", "Start a dplab command on N ranks (mpirun for --backend mpi)");
  run_app
      ->add_option("-n,--ranks", args->ranks,
                   "Number of ranks (default: the command's own -n, else 1)")
      ->check(world_size_range());
  run_app
      ->add_option("--backend", args->backend, "mpi, nccl (mpirun, one process per GPU) or local")
      ->capture_default_str();
  run_app->add_option("--hostfile", args->hostfile, "mpirun host file, for several machines")
      ->check(non_empty_path());
  run_app->add_option("--mpirun", args->mpirun, "The mpirun program")
      ->capture_default_str()
      ->check(non_empty_path());
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
