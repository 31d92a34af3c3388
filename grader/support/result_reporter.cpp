// result_reporter.cpp: sends GoogleTest's events to the grade driver, one bounded line each.
#include "result_reporter.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string_view>
#include <utility>
#include <vector>

#include "grading.h"
#include "result_channel.h"

namespace dp::grading {
namespace {

using nlohmann::json;
namespace channel = dp::grader::channel;

/// The channel's descriptor is moved at least this high: a lab that closes or reuses the low
/// descriptors (0 to 2 and the next few) does not cut the check program off from the driver.
constexpr int kLowestChannelFd = 512;
/// First budgets of an end line's parts; halved until the line fits in kMaxLineBytes.
constexpr std::size_t kFailureBudget = 8 * 1024;
constexpr std::size_t kNoteBudget = 1024;
constexpr std::size_t kMaxNotes = 8;

// What take_result_channel_at_start takes: plain zero-initialised storage of this file,
// written before any constructor of the program runs, and reachable from nowhere else.
bool channel_found = false;
int channel_fd = -1;
char taken_token[channel::kMaxTokenBytes + 1];
char open_error[4096 + 256];  // room for the FIFO's path and the reason

/// The value of `name` in `envp` (the environment as the loader passes it), or nullptr.
/// Before the program's constructors, getenv may not see the environment yet; `envp` is it.
char* find_variable(char** envp, std::string_view name, char*** entry = nullptr) {
  for (char** variable = envp; variable != nullptr && *variable != nullptr; ++variable) {
    const std::string_view text(*variable);
    if (text.size() > name.size() && text.starts_with(name) && text[name.size()] == '=') {
      if (entry != nullptr) *entry = variable;
      return *variable + name.size() + 1;
    }
  }
  return nullptr;
}

/// This process's rank as the launcher announces it in `envp` (0 without one).
int rank_from_environment(char** envp) {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"})
    if (const char* value = find_variable(envp, name); value != nullptr) return std::atoi(value);
  return 0;
}

/// `text` cut to at most `budget` bytes, with a note saying how much was left out.
std::string shortened(const std::string& text, std::size_t budget) {
  if (text.size() <= budget) return text;
  return fmt::format("{}\n[... {} bytes left out ...]", text.substr(0, budget),
                     text.size() - budget);
}

/// "file:line\nmessage", as GoogleTest's own reports write a failure.
std::string describe_part(const ::testing::TestPartResult& part) {
  if (part.file_name() == nullptr) return fmt::format("unknown file\n{}", part.message());
  if (part.line_number() < 0) return fmt::format("{}\n{}", part.file_name(), part.message());
  return fmt::format("{}:{}\n{}", part.file_name(), part.line_number(), part.message());
}

std::string full_name(const ::testing::TestInfo& test) {
  return std::string(test.test_suite_name()) + "." + test.name();
}

/// The listener: one line per event on the FIFO `fd`.
class ChannelReporter : public ::testing::EmptyTestEventListener {
 public:
  ChannelReporter(int fd, std::string token) : fd_(fd), token_(std::move(token)) {}
  ~ChannelReporter() override {
    if (fd_ >= 0) close(fd_);
  }
  ChannelReporter(const ChannelReporter&) = delete;
  ChannelReporter& operator=(const ChannelReporter&) = delete;

  void OnTestProgramStart(const ::testing::UnitTest& unit) override {
    // Every test of the program, so that the driver can tell a rubric check the program does
    // not have (a misspelt name) from one it never reached.
    for (int s = 0; s < unit.total_test_suite_count(); ++s) {
      const ::testing::TestSuite& suite = *unit.GetTestSuite(s);
      for (int t = 0; t < suite.total_test_count(); ++t) {
        const ::testing::TestInfo& test = *suite.GetTestInfo(t);
        send({{"event", "registered"}, {"test", full_name(test)}, {"runs", test.should_run()}});
      }
    }
  }

  void OnTestStart(const ::testing::TestInfo& test) override {
    take_measured_notes();  // notes recorded between tests belong to none of them
    send({{"event", "start"}, {"test", full_name(test)}});
  }

  void OnTestEnd(const ::testing::TestInfo& test) override {
    const ::testing::TestResult& result = *test.result();
    std::vector<std::string> messages;
    for (int i = 0; i < result.total_part_count(); ++i) {
      const ::testing::TestPartResult& part = result.GetTestPartResult(i);
      if (part.failed() || part.skipped()) messages.push_back(describe_part(part));
    }
    const std::string failure = fmt::format("{}", fmt::join(messages, "\n"));
    // Taken at every end, so that no note leaks into the next test's report.
    const std::vector<std::string> notes = take_measured_notes();
    const char* verdict = result.Failed() ? "failed" : result.Skipped() ? "skipped" : "passed";
    const double seconds = static_cast<double>(result.elapsed_time()) / 1000.0;

    // Shrink the failure text and the notes until the line fits.
    for (std::size_t scale = 1;; scale *= 2) {
      json shown_notes = json::array();
      for (std::size_t i = 0; i < notes.size() && i < kMaxNotes; ++i)
        shown_notes.push_back(shortened(notes[i], kNoteBudget / scale));
      if (notes.size() > kMaxNotes)
        shown_notes.push_back(
            fmt::format("[... {} more notes left out ...]", notes.size() - kMaxNotes));
      const json event = {
          {"event", "end"},       {"test", shortened(full_name(test), channel::kMaxLineBytes / 4)},
          {"result", verdict},    {"failure", shortened(failure, kFailureBudget / scale)},
          {"notes", shown_notes}, {"seconds", seconds}};
      if (send(event) || kNoteBudget / scale == 0) return;
    }
  }

  void OnTestProgramEnd(const ::testing::UnitTest&) override { send({{"event", "program_end"}}); }

 private:
  /// Writes "<token> <event>\n"; returns false, sending nothing, when the line would be
  /// longer than the driver reads. A write error (the driver has gone) ends the reporting.
  bool send(const json& event) {
    const std::string line =
        token_ + " " + event.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
    if (line.size() > channel::kMaxLineBytes) return false;
    std::string_view rest = line;
    while (fd_ >= 0 && !rest.empty()) {
      const ssize_t written = write(fd_, rest.data(), rest.size());
      if (written < 0 && errno == EINTR) continue;
      if (written <= 0) {
        std::fprintf(stderr, "check program: lost the grade driver's results channel: %s\n",
                     std::strerror(errno));
        close(fd_);
        fd_ = -1;
        break;
      }
      rest.remove_prefix(static_cast<std::size_t>(written));
    }
    return true;
  }

  int fd_;
  std::string token_;
};

}  // namespace

void take_result_channel_at_start(int /*argc*/, char** /*argv*/, char** envp) {
  char** entry = nullptr;
  char* found = find_variable(envp, channel::kChannelVariable, &entry);
  if (found == nullptr || channel_found) return;
  char directory[4096];
  const std::size_t length = std::strlen(found);
  if (length + 32 >= sizeof directory) return;
  std::memcpy(directory, found, length + 1);
  // Remove the variable: overwrite its bytes (what /proc/self/environ shows) and take its
  // entry out of the list (what getenv searches), as unsetenv would.
  std::memset(found, 0, length);
  for (char** next = entry; *next != nullptr; ++next) *next = *(next + 1);
  channel_found = true;

  // "<directory>/rank<r>.token" and "<directory>/rank<r>", as channel::token_path and
  // channel::fifo_path make them, with C calls only.
  const int rank = rank_from_environment(envp);
  char token_file[sizeof directory + 32];
  char fifo[sizeof directory + 32];
  const int token_length =
      std::snprintf(token_file, sizeof token_file, "%s/rank%d.token", directory, rank);
  const int fifo_length = std::snprintf(fifo, sizeof fifo, "%s/rank%d", directory, rank);
  if (token_length <= 0 || fifo_length <= 0) return;
  if (const int fd = open(token_file, O_RDONLY | O_CLOEXEC); fd >= 0) {
    const ssize_t got = read(fd, taken_token, channel::kMaxTokenBytes);
    close(fd);
    taken_token[got > 0 ? got : 0] = '\0';
  }
  unlink(token_file);  // read once: nobody else in this process can read it after this
  // O_NONBLOCK makes the open fail (ENXIO) instead of waiting forever when no driver reads
  // the FIFO; the writes that follow block as usual. The descriptor is moved high, so that a
  // lab that closed or reused the low ones could not cut the program off from the driver.
  int fd = open(fifo, O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    std::snprintf(open_error, sizeof open_error, "cannot open the results channel %s: %s", fifo,
                  std::strerror(errno));
    return;
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  if (const int high = fcntl(fd, F_DUPFD_CLOEXEC, kLowestChannelFd); high >= 0) {
    close(fd);
    fd = high;
  }
  channel_fd = fd;
}

bool started_by_the_driver() {
  return channel_found;
}

bool report_results_to_driver() {
  if (!channel_found) return true;
  if (channel_fd < 0 || taken_token[0] == '\0') {
    std::fprintf(stderr, "check program: %s\n",
                 open_error[0] != '\0' ? open_error : "the results channel has no token");
    return false;
  }
  ::testing::UnitTest::GetInstance()->listeners().Append(
      new ChannelReporter(std::exchange(channel_fd, -1), taken_token));
  return true;
}

}  // namespace dp::grading
