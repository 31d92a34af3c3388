// runner.cpp: runs a check program with a results channel, a capped output pipe and a time
// limit, then ends everything it started and merges what its ranks reported.
#include "runner.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>

#include "child_process.h"
#include "dp/error.h"
#include "result_channel.h"
#include "result_collector.h"

extern char** environ;  // NOLINT: POSIX defines it, no header declares it

namespace dp::grader {
namespace {

using Clock = std::chrono::steady_clock;

/// Keeps the first and the last `half` bytes of a stream, however long it gets, and says
/// how much it left out between them.
class HeadAndTail {
 public:
  explicit HeadAndTail(std::size_t half) : half_(half) {}

  void append(std::string_view bytes) {
    total_ += bytes.size();
    const std::size_t to_head = std::min(bytes.size(), half_ - head_.size());
    head_.append(bytes.substr(0, to_head));
    tail_.append(bytes.substr(to_head));
    // Trim only once the tail is twice its size, so that appending stays linear.
    if (tail_.size() > 2 * half_) tail_.erase(0, tail_.size() - half_);
  }

  std::string text() const {
    const std::string_view tail =
        std::string_view(tail_).substr(tail_.size() > half_ ? tail_.size() - half_ : 0);
    const std::size_t left_out = total_ - head_.size() - tail.size();
    if (left_out == 0) return head_ + std::string(tail);
    return fmt::format("{}\n[... {} bytes left out ...]\n{}", head_, left_out, tail);
  }

 private:
  std::size_t half_;
  std::string head_;
  std::string tail_;
  std::size_t total_ = 0;
};

/// A fresh random token: 128 bits as 32 hex digits.
std::string random_token() {
  std::random_device device;
  std::string token;
  for (int i = 0; i < 4; ++i) token += fmt::format("{:08x}", device());
  return token;
}

/// The directory for the run's private directories: $TMPDIR, else /tmp. A TMPDIR that is
/// not a directory is a usage error that names it (std::filesystem's own exception was
/// reported as an internal error).
std::filesystem::path temporary_directory() {
  std::error_code error;
  std::filesystem::path directory = std::filesystem::temp_directory_path(error);
  if (!error) return directory;
  const char* tmpdir = std::getenv("TMPDIR");
  throw Error(fmt::format(
      "no directory for temporary files: TMPDIR is '{}', which is not a directory ({}); set "
      "TMPDIR to an existing directory, or unset it for /tmp",
      tmpdir != nullptr ? tmpdir : "", error.message()));
}

/// The run's private channel directory (mode 0700) with one FIFO per rank, whose read ends
/// are open before anything starts, and one file per rank holding the token, which the check
/// program reads and deletes before any of its other code runs. The runner also holds a
/// write end of each FIFO, so that a FIFO never reports end-of-file: reading simply finds
/// nothing until a rank writes.
class ChannelDirectory {
 public:
  ChannelDirectory(int ranks, const std::string& token) {
    std::string pattern = (temporary_directory() / "dplab-results-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr)  // mkdtemp makes it with mode 0700
      throw Error(fmt::format("cannot make the results channel directory {}: {}", pattern,
                              std::strerror(errno)));
    path_ = pattern;
    try {
      for (int rank = 0; rank < ranks; ++rank) {
        open_fifo(channel::fifo_path(path_.string(), rank));
        write_token(channel::token_path(path_.string(), rank), token);
      }
    } catch (const Error&) {
      clean_up();  // no destructor runs for an object whose constructor threw
      throw;
    }
  }
  ~ChannelDirectory() { clean_up(); }
  ChannelDirectory(const ChannelDirectory&) = delete;
  ChannelDirectory& operator=(const ChannelDirectory&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const std::vector<int>& read_fds() const { return read_fds_; }

 private:
  void open_fifo(const std::string& fifo) {
    if (mkfifo(fifo.c_str(), 0600) != 0)
      throw Error(fmt::format("cannot make the results FIFO {}: {}", fifo, std::strerror(errno)));
    read_fds_.push_back(open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
    keep_open_fds_.push_back(open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC));
    if (read_fds_.back() < 0 || keep_open_fds_.back() < 0)
      throw Error(fmt::format("cannot open the results FIFO {}: {}", fifo, std::strerror(errno)));
  }

  static void write_token(const std::string& file, const std::string& token) {
    const int fd = open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    const bool written =
        fd >= 0 && write(fd, token.data(), token.size()) == static_cast<ssize_t>(token.size());
    if (fd >= 0) close(fd);
    if (!written)
      throw Error(fmt::format("cannot write the results token {}: {}", file, std::strerror(errno)));
  }

  void clean_up() {
    for (int fd : read_fds_)
      if (fd >= 0) close(fd);
    for (int fd : keep_open_fds_)
      if (fd >= 0) close(fd);
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }

  std::filesystem::path path_;
  std::vector<int> read_fds_;
  std::vector<int> keep_open_fds_;
};

/// An empty private directory (mode 0700) the check program runs in, removed afterwards:
/// files a lab writes with relative paths land there and go, instead of in the directory
/// the grader was started from.
class WorkingDirectory {
 public:
  WorkingDirectory() {
    std::string pattern = (temporary_directory() / "dplab-run-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr)
      throw Error(fmt::format("cannot make the check program's working directory {}: {}", pattern,
                              std::strerror(errno)));
    path_ = pattern;
  }
  ~WorkingDirectory() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  WorkingDirectory(const WorkingDirectory&) = delete;
  WorkingDirectory& operator=(const WorkingDirectory&) = delete;

  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

/// Everything the runner reads while the program runs: its output pipe and the FIFOs.
class Streams {
 public:
  Streams(int output_fd, const ChannelDirectory& channel, ResultCollector& collector)
      : output_fd_(output_fd), output_(kOutputCapBytes / 2), collector_(collector) {
    polled_.push_back({output_fd, POLLIN, 0});
    for (int fd : channel.read_fds()) polled_.push_back({fd, POLLIN, 0});
  }
  ~Streams() { close(output_fd_); }
  Streams(const Streams&) = delete;
  Streams& operator=(const Streams&) = delete;

  /// Waits up to `timeout` for input, then reads what is there (a bounded amount per
  /// stream, so that a program that prints without pause cannot keep the caller here).
  /// Returns the bytes read.
  std::size_t pump(std::chrono::milliseconds timeout) {
    if (poll(polled_.data(), polled_.size(), static_cast<int>(timeout.count())) <= 0) return 0;
    std::size_t total = 0;
    for (std::size_t i = 0; i < polled_.size(); ++i) {
      if (polled_[i].fd < 0 || polled_[i].revents == 0) continue;
      total += read_some(i);
    }
    return total;
  }

  /// Reads until nothing is left (the writers are gone), within about a second.
  void drain() {
    const Clock::time_point deadline = Clock::now() + std::chrono::seconds(1);
    while (pump(std::chrono::milliseconds(0)) > 0 && Clock::now() < deadline) {
    }
  }

  std::string output() const { return output_.text(); }

 private:
  std::size_t read_some(std::size_t index) {
    std::array<char, 64 * 1024> buffer;
    std::size_t total = 0;
    while (total < 4 * buffer.size()) {
      const ssize_t count = read(polled_[index].fd, buffer.data(), buffer.size());
      if (count < 0 && errno == EINTR) continue;
      if (count == 0) polled_[index].fd = -1;  // the pipe's writers are gone: poll it no more
      if (count <= 0) break;
      const std::string_view bytes(buffer.data(), static_cast<std::size_t>(count));
      if (index == 0)
        output_.append(bytes);
      else
        collector_.add(static_cast<int>(index - 1), bytes);
      total += bytes.size();
    }
    return total;
  }

  int output_fd_;
  std::vector<pollfd> polled_;  ///< [0]: the output pipe; [1 + r]: rank r's FIFO
  HeadAndTail output_;
  ResultCollector& collector_;
};

/// The program's environment: this process's, with `variables` set (replacing any of the
/// same name).
std::vector<std::string> child_environment(const std::map<std::string, std::string>& variables) {
  std::vector<std::string> environment;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string_view text = *entry;
    if (!variables.contains(std::string(text.substr(0, text.find('=')))))
      environment.emplace_back(text);
  }
  for (const auto& [name, value] : variables) environment.push_back(name + "=" + value);
  return environment;
}

/// Waits for `pid` until `deadline` while reading `streams`; true with its wait status when
/// it ended.
bool wait_reading(pid_t pid, Clock::time_point deadline, Streams& streams, int& wait_status) {
  while (true) {
    const pid_t done = waitpid(pid, &wait_status, WNOHANG);
    if (done == pid) return true;
    if (done < 0 && errno != EINTR) {
      wait_status = 0;
      return true;  // not our child any more; nothing left to wait for
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    streams.pump(std::min(left, std::chrono::milliseconds(20)));
  }
}

std::string signal_name(int signal) {
  const char* name = strsignal(signal);
  return name == nullptr ? std::to_string(signal) : fmt::format("{}: {}", signal, name);
}

/// The first ThreadSanitizer report in `output`, from its WARNING line to its SUMMARY line
/// (at most about 8 KiB), and how many there are.
std::string first_sanitizer_report(std::string_view output, std::size_t& count) {
  constexpr std::string_view kStart = "WARNING: ThreadSanitizer:";
  count = 0;
  for (std::size_t at = output.find(kStart); at != std::string_view::npos;
       at = output.find(kStart, at + 1))
    ++count;
  const std::size_t start = output.find(kStart);
  if (start == std::string_view::npos) return "";
  std::size_t end = output.find("SUMMARY: ThreadSanitizer", start);
  end = end == std::string_view::npos ? output.size() : output.find('\n', end);
  if (end == std::string_view::npos) end = output.size();
  return std::string(output.substr(start, std::min<std::size_t>(end - start, 8 * 1024)));
}

/// "crashed (signal 11: Segmentation fault)", "timed out", "exited (code 0)".
std::string how_it_ended(const RunResult& run) {
  if (run.status == RunStatus::kTimedOut) return "timed out";
  if (run.signal != 0) return fmt::format("crashed (signal {})", signal_name(run.signal));
  return fmt::format("exited (code {})", run.exit_code);
}

}  // namespace

std::string RunResult::missing_result(const std::string& test, int rank) const {
  static const RankReport silent;
  const RankReport& report = rank >= 0 && rank < static_cast<int>(ranks.size())
                                 ? ranks[static_cast<std::size_t>(rank)]
                                 : silent;
  if (!report.registered.empty()) {
    const auto it = report.registered.find(test);
    if (it == report.registered.end())
      return fmt::format(
          "\"{}\" not found in the check program {} (is the rubric's test name spelled as "
          "gtest prints it, Suite.Name?)",
          test, program);
    if (!it->second) return "not run: the check is disabled or filtered out of the program";
  }
  if (report.program_ended)
    return "did not report a result: the check program ended without running it";
  const std::string ended = how_it_ended(*this);
  if (report.running == test)
    return fmt::format("did not report a result: the check program {} while running it", ended);
  if (!report.running.empty())
    return fmt::format(
        "did not report a result: the check program {} while running {}, before "
        "this check",
        ended, report.running);
  return fmt::format("did not report a result: the check program {} before running it{}", ended,
                     report.heard_from() ? "" : " (it sent no result at all)");
}

std::string RunResult::missing_result(const std::string& test) const {
  const int count = std::max<int>(1, static_cast<int>(ranks.size()));
  std::vector<std::string> reasons;
  for (int rank = 0; rank < count; ++rank) reasons.push_back(missing_result(test, rank));
  if (std::all_of(reasons.begin(), reasons.end(),
                  [&](const std::string& reason) { return reason == reasons.front(); }))
    return reasons.front();
  for (int rank = 1; rank < count; ++rank)
    reasons[static_cast<std::size_t>(rank)].insert(0, fmt::format("[rank {}] ", rank));
  return fmt::format("{}", fmt::join(reasons, "\n"));
}

std::string RunResult::out_of_order() const {
  for (std::size_t rank = 0; rank < ranks.size(); ++rank)
    if (!ranks[rank].out_of_order.empty())
      return rank == 0 ? ranks[rank].out_of_order
                       : fmt::format("[rank {}] {}", rank, ranks[rank].out_of_order);
  return "";
}

std::vector<std::string> RunResult::notices() const {
  std::vector<std::string> sentences;
  if (lines_without_token > 0)
    sentences.push_back(fmt::format(
        "ignored {} line(s) on the results channel without this run's token", lines_without_token));
  if (malformed_lines > 0)
    sentences.push_back(
        fmt::format("ignored {} malformed line(s) on the results channel", malformed_lines));
  if (ignored_result_bytes > 0)
    sentences.push_back(fmt::format("ignored {} bytes on the results channel beyond its {} MiB cap",
                                    ignored_result_bytes,
                                    channel::kMaxResultBytes / (1024 * 1024)));
  if (!surviving_processes.empty())
    sentences.push_back(fmt::format("could not end {} process(es) the check program started: {}",
                                    surviving_processes.size(),
                                    fmt::join(surviving_processes, ", ")));
  return sentences;
}

RunResult run_checks(const RunRequest& request, const std::vector<std::string>& checks) {
  RunResult first = run_check_program(request);
  const bool broke = first.status == RunStatus::kCrashed || first.status == RunStatus::kTimedOut ||
                     first.status == RunStatus::kIncomplete;
  if (!broke || !first.out_of_order().empty() || !first.contradiction().empty()) return first;

  // The check the program was running when it broke, on any rank.
  std::string running;
  for (const RankReport& report : first.ranks)
    if (!report.running.empty()) running = report.running;

  RunResult combined = first;
  combined.tests.clear();
  combined.status = RunStatus::kFinished;
  combined.rerun_note = fmt::format(
      "{}{}: no result of that run counts; every other check ran again in a process of its own",
      first.summary(), running.empty() ? "" : " while running " + running);
  for (const std::string& check : checks) {
    TestOutcome outcome;
    outcome.name = check;
    outcome.state = TestState::kFailed;
    if (check == running) {
      outcome.failure = first.missing_result(check);
      combined.tests.emplace(check, std::move(outcome));
      continue;
    }
    RunRequest alone = request;
    std::erase_if(alone.arguments, [](const std::string& argument) {
      return argument.starts_with("--gtest_filter=");
    });
    alone.arguments.push_back("--gtest_filter=" + check);
    const RunResult one = run_check_program(alone);
    combined.seconds += one.seconds;
    const bool clean = one.status == RunStatus::kFinished && one.out_of_order().empty() &&
                       one.contradiction().empty();
    if (const auto it = one.tests.find(check); clean && it != one.tests.end()) {
      outcome = it->second;
    } else if (!clean && !one.out_of_order().empty()) {
      outcome.failure = fmt::format("ran on its own, its channel carried {}: it does not count",
                                    one.out_of_order());
    } else if (!clean && !one.contradiction().empty()) {
      outcome.failure = fmt::format("ran on its own, {}: it does not count", one.contradiction());
    } else {
      outcome.failure = fmt::format("ran on its own: {}", one.missing_result(check));
    }
    combined.tests.emplace(check, std::move(outcome));
  }
  return combined;
}

std::map<std::string, TestOutcome> merge_reports(const RunResult& run) {
  std::set<std::string> names;
  for (const RankReport& report : run.ranks)
    for (const auto& [name, outcome] : report.finished) names.insert(name);

  // The worst state wins: failed > skipped > passed.
  auto severity = [](TestState state) {
    switch (state) {
      case TestState::kFailed: return 2;
      case TestState::kSkipped: return 1;
      case TestState::kPassed: return 0;
    }
    return 0;
  };
  std::map<std::string, TestOutcome> merged;
  for (const std::string& name : names) {
    TestOutcome combined;
    combined.name = name;
    combined.state = TestState::kPassed;
    std::vector<std::string> failures;
    for (std::size_t rank = 0; rank < run.ranks.size(); ++rank) {
      const std::string prefix = rank > 0 ? fmt::format("[rank {}] ", rank) : "";
      const auto it = run.ranks[rank].finished.find(name);
      if (it == run.ranks[rank].finished.end()) {
        combined.state = TestState::kFailed;
        failures.push_back(prefix + run.missing_result(name, static_cast<int>(rank)));
        continue;
      }
      const TestOutcome& outcome = it->second;
      if (severity(outcome.state) > severity(combined.state)) combined.state = outcome.state;
      if (!outcome.failure.empty()) failures.push_back(prefix + outcome.failure);
      if (rank == 0) combined.notes = outcome.notes;
      combined.seconds = std::max(combined.seconds, outcome.seconds);
    }
    combined.failure = fmt::format("{}", fmt::join(failures, "\n"));
    merged.emplace(name, std::move(combined));
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
    case RunStatus::kRefused: return start_error;
    case RunStatus::kCrashed:
      return fmt::format("check program crashed (signal {})", signal_name(signal));
    case RunStatus::kTimedOut:
      return fmt::format("timed out after {:g} s (the check program was killed)",
                         time_limit_seconds);
    case RunStatus::kIncomplete:
      return fmt::format("check program exited with code {} before reporting every result",
                         exit_code);
  }
  return "";
}

std::string RunResult::contradiction() const {
  const bool every_rank_ended =
      !ranks.empty() && std::all_of(ranks.begin(), ranks.end(),
                                    [](const RankReport& report) { return report.program_ended; });
  if (!every_rank_ended) return "";
  if (status == RunStatus::kCrashed || status == RunStatus::kTimedOut)
    return fmt::format("the check program said that every check had run, and then {}", summary());
  const bool some_failed = std::any_of(tests.begin(), tests.end(), [](const auto& entry) {
    return entry.second.state == TestState::kFailed;
  });
  if (status == RunStatus::kFinished && exit_code != (some_failed ? 1 : 0))
    return fmt::format(
        "the check program reported {} and exited with status {}, which a run that reports "
        "that never does",
        some_failed ? "a failed check" : "that every check passed", exit_code);
  return "";
}

RunResult run_check_program(const RunRequest& request) {
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
    const int error = errno;
    result.status = RunStatus::kMissing;
    // Only a missing file is "not found": a file without its execute bit, or in a directory
    // this user cannot enter, needs another remedy than a build.
    result.start_error =
        error == ENOENT
            ? fmt::format("check program {} not found (build it: cmake --build <build dir>)",
                          request.program.string())
        : error == EACCES && access(request.program.c_str(), F_OK) == 0
            ? fmt::format(
                  "check program {} is not executable (no execute permission for this "
                  "user: chmod +x it, or rebuild it)",
                  request.program.string())
            : fmt::format("check program {} cannot be run: {}", request.program.string(),
                          std::strerror(error));
    return result;
  }

  become_child_subreaper();
  const std::set<int> callers_children = child_pids();  // not ours to kill
  const std::string token = random_token();
  const ChannelDirectory channel_dir(request.processes, token);
  std::map<std::string, std::string> variables = request.environment;
  variables["DPLAB_TEST_BACKEND"] = request.backend;
  variables[channel::kChannelVariable] = channel_dir.path().string();
  std::vector<std::string> variable_names;
  for (const auto& [name, value] : variables) variable_names.push_back(name);

  std::vector<std::string> command = {request.program.string()};
  command.insert(command.end(), request.arguments.begin(), request.arguments.end());
  if (request.launcher) command = request.launcher(command, request.processes, variable_names);

  const Clock::time_point start = Clock::now();
  // In the run's own directory: whatever files a lab writes (a forged report, say) land
  // there and go with it, not in the directory the grader was started from.
  const WorkingDirectory working_directory;
  SignalForwarding forwarding;  // a Ctrl-C or a kill of the grader ends the child's group too
  const SpawnedChild child =
      spawn_child(command, child_environment(variables), working_directory.path().string());
  forwarding.forward_to(child.pid);
  if (child.pid < 0) {
    result.status = RunStatus::kFailedToStart;
    result.start_error = child.error;
    return result;
  }
  ResultCollector collector(token, request.processes);
  Streams streams(child.output_fd, channel_dir, collector);
  int wait_status = 0;
  bool ended = wait_reading(child.pid, start + request.time_limit, streams, wait_status);
  const bool timed_out = !ended;
  if (!ended) {
    // SIGTERM first so that mpirun can take its ranks down; SIGKILL for whatever ignores it.
    kill(-child.pid, SIGTERM);
    ended = wait_reading(child.pid, Clock::now() + std::chrono::seconds(3), streams, wait_status);
    if (!ended) {
      kill(-child.pid, SIGKILL);
      wait_reading(child.pid, Clock::now() + std::chrono::seconds(5), streams, wait_status);
    }
  }
  // Whatever the program left behind: its process group (mpirun's ranks), then every
  // other descendant, wherever it moved.
  kill(-child.pid, SIGKILL);
  result.surviving_processes = kill_descendants(callers_children);
  streams.drain();
  collector.finish();
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();

  result.output = streams.output();
  result.output_tail = last_lines(result.output, 40);
  result.sanitizer_report = first_sanitizer_report(result.output, result.sanitizer_reports);
  if (WIFEXITED(wait_status)) result.exit_code = WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) result.signal = WTERMSIG(wait_status);
  result.ranks = collector.ranks();
  result.lines_without_token = collector.lines_without_token();
  result.malformed_lines = collector.malformed_lines();
  result.ignored_result_bytes = collector.ignored_bytes();
  const bool every_rank_ended =
      std::all_of(result.ranks.begin(), result.ranks.end(),
                  [](const RankReport& report) { return report.program_ended; });
  if (timed_out)
    result.status = RunStatus::kTimedOut;
  else if (result.signal != 0)
    result.status = RunStatus::kCrashed;
  else if (every_rank_ended)
    result.status = RunStatus::kFinished;
  else
    result.status = RunStatus::kIncomplete;
  result.tests = merge_reports(result);
  return result;
}

}  // namespace dp::grader
