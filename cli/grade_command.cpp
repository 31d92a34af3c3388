// dplab grade: runs each lab's checks in its own process and prints the score table.
//
//   dplab grade                      # every lab, local backend
//   dplab grade --lab 2              # one lab
//   dplab grade --backend mpi -n 4   # the check programs under mpirun, 4 processes
//   dplab grade --json results.json --junit grades.xml   # Gradescope and CI reports
//
// `dplab` grades your code (labs/, check programs grade_lab<N>); `dplab-reference`, the
// same sources built with DP_REFERENCE_BUILD=1, grades the reference solutions
// (grade_lab<N>_reference). The check programs sit next to the dplab executable; the
// rubrics are read from the source tree's grader/ (or $DPLAB_GRADER_DIR).
#include <fmt/format.h>
#include <stdlib.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "commands.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/output_file.h"
#include "mpirun.h"
#include "option_checks.h"
#include "report.h"
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
  int lab = 0;  // 0: every lab
  std::string backend = "local";
  int ranks = -1;  // -1: not given (2 under mpi); local checks pick their own world sizes
  std::string json_file;
  std::string junit_file;
  double timeout_seconds = 300;
  std::string variant;  // e.g. "bug_no_divide": grade grade_lab<N>_bug_no_divide
  std::string mpirun = "mpirun";
};

/// A lab the grader knows: a folder grader/lab<N>_<name>/ with a rubric.json.
struct LabEntry {
  int number = 0;
  std::string folder;  // e.g. "lab1_replicated"
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
    labs.push_back({std::stoi(match[1].str()), name, entry.path() / "rubric.json"});
  }
  std::sort(labs.begin(), labs.end(),
            [](const LabEntry& a, const LabEntry& b) { return a.number < b.number; });
  return labs;
}

/// The check program's file name: grade_lab<N>, grade_lab<N>_reference or a variant.
std::string check_program_name(int lab, const std::string& variant) {
  if (!variant.empty()) return fmt::format("grade_lab{}_{}", lab, variant);
  return fmt::format("grade_lab{}{}", lab, kReferenceBuild ? "_reference" : "");
}

/// A temporary directory for reports and output, removed when grading ends.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "dplab-grade-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr)
      throw Error(fmt::format("cannot create a temporary directory {}", pattern));
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

/// Processes under --backend mpi: -n, or 2 (the smallest job that communicates).
int mpi_processes(const GradeArguments& args) {
  return args.ranks == -1 ? 2 : args.ranks;
}

grader::RunRequest make_request(const GradeArguments& args, const LabEntry& lab,
                                const std::filesystem::path& bin, const ScratchDir& scratch) {
  grader::RunRequest request;
  request.program = bin / check_program_name(lab.number, args.variant);
  request.backend = args.backend;
  request.time_limit = timeout_milliseconds(args.timeout_seconds, "--timeout", kMaxGradeTimeout);
  request.work_dir = scratch.path();
  request.name = lab.folder;
  if (args.backend == "mpi") {
    MpirunOptions options;
    options.mpirun = args.mpirun;
    options.environment = {"DPLAB_TEST_BACKEND=mpi"};
    request.processes = mpi_processes(args);
    // One command line per rank, so that each rank writes its own report file.
    request.launcher = [options](const std::vector<std::vector<std::string>>& per_rank) {
      return mpirun_command_per_rank(options, per_rank);
    };
  }
  return request;
}

void grade(const GradeArguments& args) {
  if (args.backend != "local" && args.backend != "mpi")
    throw Error(fmt::format("unknown backend '{}': expected 'local' or 'mpi'", args.backend));
  if (args.backend == "local" && args.ranks != -1)
    throw Error(fmt::format(
        "-n {} applies to --backend mpi only: on the local backend each check picks its own "
        "world sizes",
        args.ranks));
  if (args.backend == "mpi" && args.ranks != -1 && (args.ranks < 1 || args.ranks > kMaxWorldSize))
    throw Error(
        fmt::format("-n must be between 1 and {} processes, got {}", kMaxWorldSize, args.ranks));
  timeout_milliseconds(args.timeout_seconds, "--timeout", kMaxGradeTimeout);
  if (!args.variant.empty() && args.lab == 0)
    throw Error("--variant names one lab's build: give --lab N too");

  const std::filesystem::path dir = grader_dir();
  std::vector<LabEntry> labs = find_labs(dir);
  if (labs.empty()) throw Error(fmt::format("no lab rubric found under {}", dir.string()));
  if (args.lab != 0) {
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
  // The reports are written after grading: a bad path (or a rubric's) must fail before it.
  std::vector<std::filesystem::path> rubric_files;
  for (const LabEntry& lab : find_labs(dir)) rubric_files.push_back(lab.rubric);
  for (const std::string& output : {args.json_file, args.junit_file})
    if (!output.empty()) check_output_path(output, rubric_files);

  const std::filesystem::path bin = std::filesystem::path(this_executable()).parent_path();
  const ScratchDir scratch;
  grader::GradeReport report;
  report.implementation =
      kReferenceBuild ? "reference solutions (solutions/)" : "your code (labs/)";
  if (!args.variant.empty()) report.implementation += ", variant " + args.variant;
  report.backend =
      args.backend == "mpi" ? fmt::format("mpi ({} processes)", mpi_processes(args)) : "local";
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < labs.size(); ++i) {
    fmt::print(stderr, "grading lab {} ({})...\n", labs[i].number, rubrics[i].title);
    const grader::RunResult run =
        grader::run_check_program(make_request(args, labs[i], bin, scratch));
    report.labs.push_back(grader::score_lab(rubrics[i], run));
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
  grade_app->add_option("--lab", args->lab, "Grade only lab N (default: every lab)");
  grade_app->add_option("--backend", args->backend, "local or mpi")->capture_default_str();
  grade_app->add_option("-n,--ranks", args->ranks,
                        "MPI processes for --backend mpi (default 2); local checks pick their own");
  grade_app->add_option("--json", args->json_file, "Also write Gradescope results.json here");
  grade_app->add_option("--junit", args->junit_file, "Also write JUnit XML here");
  grade_app
      ->add_option("--timeout", args->timeout_seconds,
                   "Seconds each lab's check program may run before it is killed")
      ->capture_default_str();
  grade_app->add_option("--mpirun", args->mpirun, "The mpirun program")->capture_default_str();
  // Hidden (empty group): the selftests grade planted-bug builds with it.
  grade_app->add_option("--variant", args->variant, "Grade grade_lab<N>_<NAME> instead")->group("");
  grade_app->callback([args] { grade(*args); });
}

}  // namespace dp::cli
