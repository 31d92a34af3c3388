// dplab grade: runs each lab's checks in its own process and prints the score table.
//
//   dplab grade                      # every lab, local backend, host and emulated device
//   dplab grade --lab 2              # one lab
//   dplab grade --backend mpi -n 4   # the check programs under mpirun, 4 processes
//   dplab grade --device host        # only with the lab code's tensors in host memory
//   dplab grade --device emulated    # only on the emulated CUDA device
//   dplab grade --device cuda --backend nccl   # on this machine's GPUs (1 or 2 ranks)
//   dplab grade --json results.json --junit grades.xml   # Gradescope and CI reports
//   dplab grade --seed 1234          # repeat a run: the checks draw from the same seed
//   dplab grade --sanitize thread    # the ThreadSanitizer builds (cmake -DDP_GRADE_TSAN=ON)
//   dplab grade --lab 3 --check Lab3Ring.EqualsTheEmulation   # one check (others score 0)
//
// Before a lab's check program starts, the lab audit (grader/audit/lab_audit.h) checks the
// lab's sources and compiled objects: code that uses anything the rules do not allow (files,
// processes, the grader's internals, ...) scores 0 without any of it running.
//
// Every run has a grading seed, printed at the top of the score table: the checks draw
// their world sizes, batch sizes, ... from it, so a hard-coded answer fails, and --seed
// repeats a run exactly. The check programs send their results on a channel the driver
// opens (grader/driver/runner.h); what they print is only shown, never scored.
//
// `dplab` grades your code (labs/, check programs grade_lab<N>); `dplab-reference`, the
// same sources built with DP_REFERENCE_BUILD=1, grades the reference solutions
// (grade_lab<N>_reference). The check programs sit next to the dplab executable; the
// rubrics are read from the source tree's grader/ (or $DPLAB_GRADER_DIR).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "commands.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/output_file.h"
#include "dp/tensor.h"
#include "lab_audit.h"
#include "mpirun.h"
#include "option_checks.h"
#include "report.h"
#include "result_channel.h"
#include "rubric.h"
#include "runner.h"

#ifndef DP_GRADER_DIR
#error "DP_GRADER_DIR must name the source tree's grader/ directory (cli/CMakeLists.txt sets it)"
#endif

namespace dp::cli {
namespace {

/// The longest --timeout: a day per lab.
constexpr std::chrono::milliseconds kMaxGradeTimeout{24LL * 3600 * 1000};

#if DP_REFERENCE_BUILD
constexpr bool kReferenceBuild = true;
#else
constexpr bool kReferenceBuild = false;
#endif

struct GradeArguments {
  int lab = -1;  // -1: every lab (lab 0 is the first lab)
  std::string backend = "local";
  // Where the checks put the lab code's tensors; "" (the default): on the local backend both
  // "host" and "emulated", one run each, a check passing only when it passes in both.
  std::string device;
  int ranks = -1;  // -1: not given (2 under mpi); local checks pick their own world sizes
  std::string json_file;
  std::string junit_file;
  double timeout_seconds = 300;
  std::string variant;  // e.g. "bug_no_divide": grade grade_lab<N>_bug_no_divide
  std::string mpirun = "mpirun";
  std::uint64_t seed = 0;
  bool seed_given = false;          // false: draw a fresh seed
  std::string sanitize;             // "thread": grade the ThreadSanitizer builds, grade_lab<N>_tsan
  std::vector<std::string> checks;  // --check: run only these checks of the lab (gtest names)
};

/// A lab the grader knows: a folder grader/lab<N>_<name>/ with a rubric.json.
struct LabEntry {
  int number = 0;
  std::filesystem::path rubric;
};

std::filesystem::path grader_dir() {
  const char* overridden = std::getenv("DPLAB_GRADER_DIR");
  return overridden != nullptr && *overridden != '\0' ? overridden : DP_GRADER_DIR;
}

std::vector<LabEntry> find_labs(const std::filesystem::path& dir) {
  if (!std::filesystem::is_directory(dir))
    throw Error(fmt::format(
        "the grader directory {} does not exist (set DPLAB_GRADER_DIR to the grader/ folder "
        "of the source tree)",
        dir.string()));
  static const std::regex lab_folder(R"(lab([0-9]+)_[A-Za-z0-9_]+)");
  std::vector<LabEntry> labs;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    std::smatch match;
    if (!entry.is_directory() || !std::regex_match(name, match, lab_folder)) continue;
    if (!std::filesystem::exists(entry.path() / "rubric.json")) continue;
    labs.push_back({std::stoi(match[1].str()), entry.path() / "rubric.json"});
  }
  std::sort(labs.begin(), labs.end(),
            [](const LabEntry& a, const LabEntry& b) { return a.number < b.number; });
  return labs;
}

/// The check program's file name: grade_lab<N>, grade_lab<N>_reference or a variant, with
/// "_tsan" for the ThreadSanitizer build.
std::string check_program_name(int lab, const GradeArguments& args) {
  if (!args.variant.empty()) return fmt::format("grade_lab{}_{}", lab, args.variant);
  return fmt::format("grade_lab{}{}{}", lab, kReferenceBuild ? "_reference" : "",
                     args.sanitize == "thread" ? "_tsan" : "");
}

/// A fresh 64-bit seed from the operating system's entropy.
std::uint64_t random_seed() {
  std::random_device device;
  return (static_cast<std::uint64_t>(device()) << 32) | device();
}

/// True when the check programs run under mpirun: always on mpi; on nccl when -n gives the
/// number of processes (one per GPU). Without -n, nccl runs each check program as one
/// process whose threads drive its GPUs.
bool under_mpirun(const GradeArguments& args) {
  return args.backend == "mpi" || (args.backend == "nccl" && args.ranks != -1);
}

/// Processes under mpirun: -n, or 2 on mpi (the smallest job that communicates).
int mpi_processes(const GradeArguments& args) {
  return args.ranks != -1 ? args.ranks : 2;
}

grader::RunRequest make_request(const GradeArguments& args, const LabEntry& lab,
                                const std::filesystem::path& bin, std::uint64_t seed,
                                const std::string& device) {
  grader::RunRequest request;
  request.program = bin / check_program_name(lab.number, args);
  request.backend = args.backend;
  request.environment[grader::channel::kSeedVariable] = std::to_string(seed);
  request.environment["DPLAB_TEST_DEVICE"] = device;
  request.time_limit = timeout_milliseconds(args.timeout_seconds, "--timeout", kMaxGradeTimeout);
  if (!args.checks.empty())
    request.arguments.push_back(fmt::format("--gtest_filter={}", fmt::join(args.checks, ":")));
  if (under_mpirun(args)) {
    request.processes = mpi_processes(args);
    const std::string mpirun = args.mpirun;
    request.launcher = [mpirun](const std::vector<std::string>& command, int processes,
                                const std::vector<std::string>& variables) {
      MpirunOptions options;
      options.mpirun = mpirun;
      options.ranks = processes;
      // By name: every rank gets mpirun's value, and no value is on the command line,
      // where any user's `ps` would show it (the channel's token is not passed at all: each
      // rank reads it from a file of the channel directory).
      options.environment = variables;
      return mpirun_command(options, command);
    };
  }
  return request;
}

/// The lab audit of the code `program` was built from (grader/audit/lab_audit.h), done
/// before any of it runs, from the lab's objects and the manifest beside where the program
/// is (the program itself need not exist yet): nothing when the audit passes (or there is
/// neither manifest nor program, which the runner reports), else a run that never started,
/// saying what was refused.
std::optional<grader::RunResult> refused_by_audit(const std::filesystem::path& program,
                                                  const LabEntry& lab,
                                                  const std::filesystem::path& grader_directory,
                                                  const std::string& variant) {
  if (!std::filesystem::exists(program) &&
      !std::filesystem::exists(grader::audit::LabCode::manifest_of(program)))
    return std::nullopt;
  grader::RunResult refused;
  refused.program = program.string();
  try {
    const std::filesystem::path manifest = grader::audit::LabCode::manifest_of(program);
    if (!std::filesystem::exists(manifest))
      throw Error(
          fmt::format("{} has no lab manifest {} beside it (rebuild it: cmake --build "
                      "<build dir>)",
                      program.filename().string(), manifest.string()));
    grader::audit::AuditOptions options;
    options.cache_dir = manifest.parent_path() / "lab-audit-cache";
    // The reference's planted bugs (course staff's code, each the reference with one change)
    // skip the compiler's reading: it would cost the selftests minutes and show nothing.
    options.read_semantics = !(kReferenceBuild && variant.starts_with("bug_"));
    const grader::audit::AuditReport report = grader::audit::audit_lab_code(
        grader::audit::LabCode::load(manifest), lab.rubric.parent_path(),
        grader_directory / "audit", options);
    if (report.passed()) return std::nullopt;
    refused.status = grader::RunStatus::kRefused;
    refused.start_error = report.summary();
  } catch (const Error& error) {
    refused.status = grader::RunStatus::kFailedToStart;
    refused.start_error =
        fmt::format("the lab audit could not be done, so the lab was not run: {}", error.what());
  }
  return refused;
}

/// The devices each lab is graded on: --device, or by default the host and the emulated
/// CUDA device on the local backend (the second run shows that lab code never reads a device
/// tensor's memory on the host, which a GPU would not survive), the host under mpi (which
/// takes host buffers only).
std::vector<std::string> devices_to_grade(const GradeArguments& args) {
  if (!args.device.empty()) return {args.device};
  if (args.backend == "local") return {"host", "emulated"};
  return {"host"};
}

/// How a device is named where a check's feedback says which run failed.
std::string device_run_name(const std::string& device) {
  if (device == "host") return "on the host";
  if (device == "emulated") return "on the emulated CUDA device (your tensors on a device)";
  return "on the device " + device;
}

void grade(const GradeArguments& args) {
  if (args.backend != "local" && args.backend != "mpi" && args.backend != "nccl")
    throw Error(
        fmt::format("unknown backend '{}': expected 'local', 'mpi' or 'nccl'", args.backend));
  // On the emulated device NCCL is emulated (its contract on the local backend's threads),
  // in every build.
  if (args.backend == "nccl" && !nccl_built() && args.device != "emulated")
    throw Error(
        "--backend nccl: this dplab was built without CUDA and NCCL (configure with a CUDA "
        "compiler, DP_CUDA on and NCCL installed); grade on --backend local, or on NCCL "
        "emulated with --device emulated");
  if (!args.device.empty()) select_device(args.device);  // a known name, and a GPU for "cuda"
  if (!args.device.empty() && args.device != "host" && args.backend == "mpi")
    throw Error(fmt::format(
        "--device {} with --backend mpi: the mpi backend takes host buffers only; grade on a "
        "device with --backend local (ranks as threads sharing the GPU) or nccl",
        args.device));
  if (args.backend == "nccl" && args.device != "cuda" && args.device != "emulated")
    throw Error(
        "--backend nccl takes device buffers only: give --device cuda (the GPUs) or --device "
        "emulated (NCCL emulated on the CUDA device emulated in host memory) as well");
  if (args.backend == "nccl" && args.device == "emulated" && args.ranks != -1)
    throw Error(fmt::format(
        "--backend nccl --device emulated -n {}: the emulated NCCL runs its ranks as threads "
        "of one process, not under mpirun; leave -n out (each check runs 1 and 2 ranks, as on "
        "2 GPUs)",
        args.ranks));
  if (args.backend == "nccl" && args.ranks >= 3)
    throw Error(fmt::format(
        "--backend nccl -n {}: grading on nccl takes at most 2 processes: NCCL adds the floats "
        "of 3 or more ranks in its ring's order, not in the rank order the checks compare bit "
        "for bit; grade on the GPU with --backend local --device cuda (ranks as threads "
        "sharing it), which adds in rank order",
        args.ranks));
  if (args.backend == "local" && args.ranks != -1)
    throw Error(fmt::format(
        "-n {} applies to --backend mpi and nccl only: on the local backend each check picks "
        "its own world sizes",
        args.ranks));
  if (under_mpirun(args) && args.ranks != -1 && (args.ranks < 1 || args.ranks > kMaxWorldSize))
    throw Error(
        fmt::format("-n must be between 1 and {} processes, got {}", kMaxWorldSize, args.ranks));
  timeout_milliseconds(args.timeout_seconds, "--timeout", kMaxGradeTimeout);
  if (!args.variant.empty() && args.lab < 0)
    throw Error("--variant names one lab's build: give --lab N too");
  if (!args.variant.empty() && !args.sanitize.empty())
    throw Error("--sanitize has no planted-bug builds: give --variant or --sanitize, not both");
  if (!args.sanitize.empty() && args.backend != "local")
    throw Error(fmt::format(
        "--sanitize thread needs --backend local, got '{}': ranks are threads only on the "
        "local backend (where they can race); under mpi, Open MPI's own locking trips "
        "ThreadSanitizer",
        args.backend));

  const std::filesystem::path dir = grader_dir();
  std::vector<LabEntry> labs = find_labs(dir);
  if (labs.empty()) throw Error(fmt::format("no lab rubric found under {}", dir.string()));
  if (args.lab >= 0) {
    std::vector<std::string> known;
    for (const LabEntry& lab : labs) known.push_back(std::to_string(lab.number));
    std::erase_if(labs, [&](const LabEntry& lab) { return lab.number != args.lab; });
    if (labs.empty())
      throw Error(fmt::format("no lab {} under {}: the labs are {}", args.lab, dir.string(),
                              fmt::join(known, ", ")));
  }

  // Read every rubric first: a malformed one is an error before anything runs.
  std::vector<grader::Rubric> rubrics;
  for (const LabEntry& lab : labs) {
    rubrics.push_back(grader::load_rubric(lab.rubric));
    if (rubrics.back().lab != lab.number)
      throw Error(fmt::format("malformed rubric {}: \"lab\" is {} but the folder is lab {}",
                              lab.rubric.string(), rubrics.back().lab, lab.number));
  }
  // --check names checks of the rubric, exactly: a misspelt name must not grade nothing.
  if (!args.checks.empty()) {
    if (args.lab < 0) throw Error("--check names one lab's checks: give --lab N too");
    std::vector<std::string> known;
    for (const grader::RubricCheck& check : rubrics.front().checks) known.push_back(check.test);
    for (const std::string& check : args.checks)
      if (std::find(known.begin(), known.end(), check) == known.end())
        throw Error(fmt::format("--check {}: lab {} has no such check; its checks are {}", check,
                                args.lab, fmt::join(known, ", ")));
  }
  // The reports are written after grading: a bad path must fail before it, and so must one
  // that would replace what grading reads (a rubric, dplab itself, a check program beside
  // it) or the other report.
  const std::filesystem::path bin = std::filesystem::path(this_executable()).parent_path();
  std::vector<std::filesystem::path> read_files;
  for (const LabEntry& lab : find_labs(dir)) read_files.push_back(lab.rubric);
  std::error_code listing_error;
  for (const auto& entry : std::filesystem::directory_iterator(bin, listing_error))
    if (entry.is_regular_file()) read_files.push_back(entry.path());
  const std::vector<NamedOutput> outputs = {{"--json", args.json_file},
                                            {"--junit", args.junit_file}};
  check_distinct_outputs(outputs);
  for (const NamedOutput& output : outputs)
    if (!output.path.empty()) check_output_path(output.path, read_files);

  if (args.sanitize == "thread")
    for (const LabEntry& lab : labs)
      if (const auto program = bin / check_program_name(lab.number, args);
          !std::filesystem::exists(program))
        throw Error(fmt::format(
            "--sanitize thread needs {}, which is not built: configure with -DDP_GRADE_TSAN=ON "
            "and build it (cmake --build <build dir> --target {})",
            program.string(), program.filename().string()));
  const std::uint64_t seed = args.seed_given ? args.seed : random_seed();
  grader::GradeReport report;
  report.seed = seed;
  report.implementation =
      kReferenceBuild ? "reference solutions (solutions/)" : "your code (labs/)";
  if (!args.variant.empty()) report.implementation += ", variant " + args.variant;
  if (args.sanitize == "thread") report.implementation += ", built with ThreadSanitizer";
  if (!args.checks.empty())
    report.implementation += fmt::format(", only {} (--check)", fmt::join(args.checks, ", "));
  if (under_mpirun(args))
    report.backend = fmt::format("{} ({} processes)", args.backend, mpi_processes(args));
  else if (args.backend == "nccl")
    report.backend = args.device == "emulated" ? "nccl (emulated, a thread per emulated GPU)"
                                               : "nccl (a thread per GPU)";
  else
    report.backend = "local";
  const std::vector<std::string> devices = devices_to_grade(args);
  if (devices.size() > 1)
    report.devices = "on the host and on the emulated CUDA device";
  else if (devices.front() != "host")
    report.devices = fmt::format("device {}", devices.front());
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < labs.size(); ++i) {
    fmt::print(stderr, "grading lab {} ({})...\n", labs[i].number, rubrics[i].title);
    const std::filesystem::path program = bin / check_program_name(labs[i].number, args);
    if (const std::optional<grader::RunResult> refused =
            refused_by_audit(program, labs[i], dir, args.variant)) {
      report.labs.push_back(grader::score_lab(rubrics[i], *refused));
      continue;
    }
    std::vector<std::pair<std::string, grader::LabResult>> runs;
    std::vector<std::string> checks = args.checks;
    if (checks.empty())
      for (const grader::RubricCheck& check : rubrics[i].checks) checks.push_back(check.test);
    for (const std::string& device : devices) {
      const grader::RunResult run =
          grader::run_checks(make_request(args, labs[i], bin, seed, device), checks);
      grader::LabResult scored = grader::score_lab(rubrics[i], run);
      grader::refuse_an_incomplete_rubric(scored, run);
      runs.emplace_back(device_run_name(device), std::move(scored));
    }
    report.labs.push_back(grader::combine_runs(runs));
  }
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  fmt::print("{}", grader::format_table(report));
  if (!args.json_file.empty())
    grader::write_text_file(args.json_file, grader::to_gradescope_json(report));
  if (!args.junit_file.empty())
    grader::write_text_file(args.junit_file, grader::to_junit_xml(report));
  // Exit code 0 only at full marks, so scripts and CI can use it.
  if (!report.full_marks()) throw CLI::RuntimeError(1);
}

}  // namespace

void add_grade_command(CLI::App& app) {
  auto args = std::make_shared<GradeArguments>();
  CLI::App* grade_app = app.add_subcommand(
      "grade", kReferenceBuild ? "Grade the reference solutions: the score table, check by check"
                               : "Grade your labs: the score table, check by check");
  grade_app->add_option("--lab", args->lab, "Grade only lab N (default: every lab)")
      ->check(whole_number_at_least(0));
  grade_app
      ->add_option("--backend", args->backend,
                   "local, mpi or nccl (mpirun, one process per GPU; the checks must keep their "
                   "tensors on the GPU)")
      ->capture_default_str();
  grade_app->add_option("--device", args->device,
                        "Where the checks put your models and tensors: host, cuda (the GPU), or "
                        "emulated (the CUDA device emulated in host memory: proves that your code "
                        "never reads a device tensor's memory on the host). Default: on the local "
                        "backend, a run on the host and one on the emulated device (a check passes "
                        "when it passes in both); under mpi, the host");
  grade_app->add_option("-n,--ranks", args->ranks,
                        "Processes under mpirun: for --backend mpi (default 2), or nccl (one per "
                        "GPU; without -n, one process drives the GPUs); local checks pick their "
                        "own world sizes");
  grade_app->add_option("--json", args->json_file, "Also write Gradescope results.json here")
      ->check(non_empty_path());
  grade_app->add_option("--junit", args->junit_file, "Also write JUnit XML here")
      ->check(non_empty_path());
  grade_app
      ->add_option("--timeout", args->timeout_seconds,
                   "Seconds each lab's check program may run before it is killed")
      ->capture_default_str();
  grade_app->add_option("--mpirun", args->mpirun, "The mpirun program")
      ->capture_default_str()
      ->check(non_empty_path());
  CLI::Option* seed = grade_app->add_option(
      "--seed", args->seed,
      "Grading seed (0 to 2^64-1) the checks draw their parameters from; repeats a run "
      "(default: a fresh random seed, printed)");
  seed->check(seed_number());
  grade_app
      ->add_option("--sanitize", args->sanitize,
                   "thread: grade the ThreadSanitizer builds (grade_lab<N>_tsan, configured "
                   "with -DDP_GRADE_TSAN=ON); a data race fails the lab")
      ->check(CLI::IsMember({"thread"}));
  grade_app->add_option("--check", args->checks,
                        "Run only this check of --lab N (its name in the score table, "
                        "Suite.Name; repeatable): the others are not run and score 0");
  // Hidden (empty group): the selftests grade planted-bug builds with it.
  grade_app->add_option("--variant", args->variant, "Grade grade_lab<N>_<NAME> instead")->group("");
  grade_app->callback([args, seed] {
    args->seed_given = seed->count() > 0;
    grade(*args);
  });
}

}  // namespace dp::cli
