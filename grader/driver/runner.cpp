// runner.cpp: starts a check program with posix_spawn, enforces the time limit on its
// process group, and reads its GoogleTest JSON reports.
#include "runner.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "dp/error.h"

extern char** environ;  // NOLINT: POSIX defines it, no header declares it

namespace dp::grader {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string read_file(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

/// gtest writes durations as "0.123s".
double parse_seconds(const json& value) {
  if (!value.is_string()) return 0;
  try {
    return std::stod(value.get<std::string>());
  } catch (const std::exception&) {
    return 0;
  }
}

/// This process's environment with DPLAB_TEST_BACKEND set to `backend`.
std::vector<std::string> child_environment(const std::string& backend) {
  const std::string key = "DPLAB_TEST_BACKEND=";
  std::vector<std::string> variables;
  for (char** entry = environ; *entry != nullptr; ++entry)
    if (std::string_view(*entry).substr(0, key.size()) != key) variables.emplace_back(*entry);
  variables.push_back(key + backend);
  return variables;
}

std::vector<char*> pointers_to(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  for (std::string& text : strings) pointers.push_back(text.data());
  pointers.push_back(nullptr);
  return pointers;
}

/// Starts `argv` in a new process group with stdin from /dev/null and stdout and stderr
/// into `output`. Returns the pid, or -1 with `error` set.
pid_t spawn(std::vector<std::string> argv, std::vector<std::string> environment,
            const std::filesystem::path& output, std::string& error) {
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attributes;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_init(&attributes);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, output.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  // Its own process group (pgid = its pid), so that a time-out kills the program and
  // everything it started (mpirun's ranks, threads' children) with one signal.
  posix_spawnattr_setpgroup(&attributes, 0);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETPGROUP);
  std::vector<char*> args = pointers_to(argv);
  std::vector<char*> env = pointers_to(environment);
  pid_t pid = -1;
  // posix_spawnp: a launcher such as "mpirun" is found on PATH.
  const int status = posix_spawnp(&pid, args[0], &actions, &attributes, args.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attributes);
  if (status != 0) {
    error = fmt::format("cannot start {}: {}", argv[0], std::strerror(status));
    return -1;
  }
  return pid;
}

/// Waits for `pid` until `deadline`; returns true with its wait status when it ended.
bool wait_until(pid_t pid, Clock::time_point deadline, int& wait_status) {
  while (true) {
    const pid_t done = waitpid(pid, &wait_status, WNOHANG);
    if (done == pid) return true;
    if (done < 0 && errno != EINTR) {
      wait_status = 0;
      return true;  // not our child any more; nothing left to wait for
    }
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::string signal_name(int signal) {
  const char* name = strsignal(signal);
  return name == nullptr ? std::to_string(signal) : fmt::format("{}: {}", signal, name);
}

}  // namespace

std::vector<TestOutcome> parse_gtest_report(std::string_view json_text, const std::string& source) {
  json document;
  try {
    document = json::parse(json_text);
  } catch (const json::parse_error& error) {
    throw Error(fmt::format("the check report {} is not valid JSON at byte {}: {}", source,
                            error.byte, error.what()));
  }
  const auto suites = document.find("testsuites");
  if (!document.is_object() || suites == document.end() || !suites->is_array())
    throw Error(fmt::format(
        "the check report {} is not a GoogleTest JSON report: expected an object with an "
        "array \"testsuites\"",
        source));
  std::vector<TestOutcome> outcomes;
  for (const json& suite : *suites) {
    const auto tests = suite.find("testsuite");
    if (tests == suite.end() || !tests->is_array()) continue;
    for (const json& test : *tests) {
      TestOutcome outcome;
      // gtest's "classname" is the suite name with its instantiation prefix
      // ("WorldSizes/Lab2Equivalence"); "name" carries the parameter ("Sgd/ranks3").
      outcome.name =
          test.value("classname", suite.value("name", "")) + "." + test.value("name", "");
      outcome.seconds = parse_seconds(test.value("time", json()));
      std::vector<std::string> messages;
      if (const auto failures = test.find("failures");
          failures != test.end() && failures->is_array())
        for (const json& failure : *failures) messages.push_back(failure.value("failure", ""));
      outcome.failure = fmt::format("{}", fmt::join(messages, "\n"));
      if (test.value("status", "RUN") != "RUN")
        outcome.state = TestState::kNotRun;
      else if (!messages.empty())
        outcome.state = TestState::kFailed;
      else if (test.value("result", "COMPLETED") == "SKIPPED")
        outcome.state = TestState::kSkipped;
      else
        outcome.state = TestState::kPassed;
      outcomes.push_back(std::move(outcome));
    }
  }
  return outcomes;
}

std::map<std::string, TestOutcome> merge_reports(
    const std::map<int, std::vector<TestOutcome>>& reports_by_rank) {
  std::map<std::string, TestOutcome> merged;
  for (const auto& [rank, report] : reports_by_rank) {
    for (const TestOutcome& outcome : report) {
      std::string failure = outcome.failure;
      if (rank > 0 && !failure.empty()) failure = fmt::format("[rank {}] {}", rank, failure);
      auto [it, inserted] = merged.try_emplace(outcome.name, outcome);
      TestOutcome& combined = it->second;
      if (inserted) {
        combined.failure = failure;
        continue;
      }
      // The worst state wins: failed > skipped > not run > passed.
      auto severity = [](TestState state) {
        switch (state) {
          case TestState::kFailed: return 3;
          case TestState::kSkipped: return 2;
          case TestState::kNotRun: return 1;
          case TestState::kPassed: return 0;
        }
        return 0;
      };
      if (severity(outcome.state) > severity(combined.state)) combined.state = outcome.state;
      if (!failure.empty())
        combined.failure = combined.failure.empty() ? failure : combined.failure + "\n" + failure;
      combined.seconds = std::max(combined.seconds, outcome.seconds);
    }
  }
  return merged;
}

std::string last_lines(std::string_view text, int max_lines, std::size_t max_chars) {
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.remove_suffix(1);
  // Walk back over `max_lines` line breaks; what follows the last one walked is the tail.
  std::size_t start = text.size();
  for (int line = 0; line < max_lines; ++line) {
    const std::size_t newline = start == 0 ? std::string_view::npos : text.rfind('\n', start - 1);
    if (newline == std::string_view::npos) {
      start = 0;
      break;
    }
    start = newline;
  }
  std::string_view tail = text.substr(start);
  if (!tail.empty() && tail.front() == '\n') tail.remove_prefix(1);
  if (tail.size() > max_chars) tail = tail.substr(tail.size() - max_chars);
  return std::string(tail);
}

std::string RunResult::summary() const {
  switch (status) {
    case RunStatus::kFinished: return "";
    case RunStatus::kMissing: return start_error;
    case RunStatus::kFailedToStart: return start_error;
    case RunStatus::kCrashed:
      return fmt::format("check program crashed (signal {})", signal_name(signal));
    case RunStatus::kTimedOut:
      return fmt::format("timed out after {:g} s (the check program was killed)",
                         time_limit_seconds);
    case RunStatus::kNoReport:
      return fmt::format("check program exited with code {} without writing its report", exit_code);
  }
  return "";
}

RunResult run_check_program(const RunRequest& request) {
  if (request.work_dir.empty() || !std::filesystem::is_directory(request.work_dir))
    throw Error(fmt::format("run_check_program: work_dir '{}' is not a directory",
                            request.work_dir.string()));
  if (request.processes < 1)
    throw Error(
        fmt::format("run_check_program: processes must be at least 1, got {}", request.processes));
  if (request.processes > 1 && !request.launcher)
    throw Error(fmt::format("run_check_program: {} processes need a launcher (e.g. mpirun)",
                            request.processes));

  RunResult result;
  result.program = request.program.string();
  result.time_limit_seconds = std::chrono::duration<double>(request.time_limit).count();
  if (access(request.program.c_str(), X_OK) != 0) {
    result.status = RunStatus::kMissing;
    result.start_error =
        fmt::format("check program {} not found (build it: cmake --build <build dir>)",
                    request.program.string());
    return result;
  }

  // One report file per process; the launcher puts each on its rank's command line.
  std::vector<std::filesystem::path> reports;
  std::vector<std::vector<std::string>> per_rank;
  for (int rank = 0; rank < request.processes; ++rank) {
    reports.push_back(request.work_dir / fmt::format("{}.rank{}.json", request.name, rank));
    std::filesystem::remove(reports.back());
    std::vector<std::string> argv = {request.program.string(),
                                     "--gtest_output=json:" + reports.back().string()};
    argv.insert(argv.end(), request.arguments.begin(), request.arguments.end());
    per_rank.push_back(std::move(argv));
  }
  const std::vector<std::string> command =
      request.launcher ? request.launcher(per_rank) : per_rank.front();
  const std::filesystem::path output = request.work_dir / (request.name + ".output.txt");

  const Clock::time_point start = Clock::now();
  const pid_t pid = spawn(command, child_environment(request.backend), output, result.start_error);
  if (pid < 0) {
    result.status = RunStatus::kFailedToStart;
    return result;
  }
  int wait_status = 0;
  bool ended = wait_until(pid, start + request.time_limit, wait_status);
  bool timed_out = false;
  if (!ended) {
    // SIGTERM first so that mpirun can take its ranks down; SIGKILL for whatever ignores it.
    timed_out = true;
    kill(-pid, SIGTERM);
    ended = wait_until(pid, Clock::now() + std::chrono::seconds(3), wait_status);
    if (!ended) {
      kill(-pid, SIGKILL);
      waitpid(pid, &wait_status, 0);
    }
  }
  kill(-pid, SIGKILL);  // anything the program left behind in its group
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  result.output_tail = last_lines(read_file(output), 40);
  if (WIFEXITED(wait_status)) result.exit_code = WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) result.signal = WTERMSIG(wait_status);

  if (timed_out) {
    result.status = RunStatus::kTimedOut;
    return result;
  }
  // Rank 0's report decides whether the run finished; other ranks add their failures.
  std::map<int, std::vector<TestOutcome>> parsed;
  for (int rank = 0; rank < static_cast<int>(reports.size()); ++rank) {
    if (!std::filesystem::exists(reports[rank])) {
      if (rank == 0) break;
      continue;
    }
    try {
      parsed[rank] = parse_gtest_report(read_file(reports[rank]), reports[rank].string());
    } catch (const Error& error) {
      if (rank == 0) {
        result.output_tail += fmt::format("\n(dplab grade: {})", error.what());
        break;
      }
    }
  }
  if (parsed.empty()) {
    result.status = result.signal != 0 ? RunStatus::kCrashed : RunStatus::kNoReport;
    return result;
  }
  result.status = RunStatus::kFinished;
  result.tests = merge_reports(parsed);
  return result;
}

}  // namespace dp::grader
