// result_reporter.cpp: sends GoogleTest's events to the grade driver, one bounded line each.
#include "result_reporter.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
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
bool taken_at_start = false;
bool channel_found = false;
int channel_fd = -1;
char open_error[4096 + 256];  // room for the FIFO's path and the reason
// The token, kept masked: a byte-wise XOR with a random pad of its own, so that no copy of
// it lies in memory as 32 hex digits for a scan of the process's memory to find.
unsigned char masked_token[channel::kMaxTokenBytes + 1];
unsigned char token_pad[channel::kMaxTokenBytes + 1];
std::size_t token_length = 0;

/// The grading variables, taken out of the environment with the channel: the draws of a run
/// derive from the seed, and lab code must not learn it (from getenv, /proc/self/environ or
/// the strings on the main thread's stack).
constexpr std::array<std::string_view, 4> kGradingVariables = {
    channel::kSeedVariable, "DPLAB_TEST_BACKEND", "DPLAB_TEST_DEVICE", "DPLAB_CALIBRATION_DRAWS"};
// Kept masked like the token (a scan for the seed's digits next to "local" found it when
// they were kept as they are), each value with a random pad of its own.
constexpr std::size_t kMaxGradingValue = 256;
unsigned char masked_values[kGradingVariables.size()][kMaxGradingValue];
unsigned char value_pads[kGradingVariables.size()][kMaxGradingValue];
std::size_t value_lengths[kGradingVariables.size()];
bool grading_present[kGradingVariables.size()];

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
  explicit ChannelReporter(int fd) : fd_(fd) {}
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
    const std::string body = event.dump(-1, ' ', false, json::error_handler_t::replace);
    if (token_length + 1 + body.size() + 1 > channel::kMaxLineBytes) return false;
    // The line with the token unmasked into it, wiped as soon as it is written.
    std::string line(token_length, '\0');
    for (std::size_t i = 0; i < token_length; ++i)
      line[i] = static_cast<char>(masked_token[i] ^ token_pad[i]);
    line.append(" ").append(body).append("\n");
    write_line(line);
    volatile char* wipe = line.data();
    for (std::size_t i = 0; i < token_length; ++i) wipe[i] = 0;
    return true;
  }

  /// Writes `line` whole; a write error (the driver has gone) ends the reporting.
  void write_line(std::string_view rest) {
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
  }

  int fd_;
};

/// Removes the variable whose value is `value` and whose entry is `entry` from the
/// environment: overwrites its bytes (what /proc/self/environ and the main thread's stack
/// show) and takes its entry out of the list (what getenv searches), as unsetenv would.
void erase_variable(char** entry, char* value) {
  std::memset(*entry, 0, static_cast<std::size_t>(value - *entry) + std::strlen(value));
  for (char** next = entry; *next != nullptr; ++next) *next = *(next + 1);
}

/// `size` random bytes from the kernel (before any constructor: no <random> yet); on a
/// failure, whatever the stack held, which still differs from the token.
void random_bytes(unsigned char* out, std::size_t size) {
  const int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  for (std::size_t got = 0; got < size;) {
    const ssize_t n = read(fd, out + got, size - got);
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  close(fd);
}

}  // namespace

void take_result_channel_at_start(int /*argc*/, char** /*argv*/, char** envp) {
  if (taken_at_start) return;
  taken_at_start = true;
  for (std::size_t v = 0; v < kGradingVariables.size(); ++v) {
    char** entry = nullptr;
    if (char* value = find_variable(envp, kGradingVariables[v], &entry); value != nullptr) {
      value_lengths[v] = std::min(std::strlen(value), kMaxGradingValue);
      random_bytes(value_pads[v], value_lengths[v]);
      for (std::size_t i = 0; i < value_lengths[v]; ++i)
        masked_values[v][i] = static_cast<unsigned char>(value[i]) ^ value_pads[v][i];
      grading_present[v] = true;
      erase_variable(entry, value);
    }
  }
  char** entry = nullptr;
  char* found = find_variable(envp, channel::kChannelVariable, &entry);
  if (found == nullptr) return;
  char directory[4096];
  const std::size_t length = std::strlen(found);
  if (length + 32 >= sizeof directory) return;
  std::memcpy(directory, found, length + 1);
  erase_variable(entry, found);
  channel_found = true;

  // "<directory>/rank<r>.token" and "<directory>/rank<r>", as channel::token_path and
  // channel::fifo_path make them, with C calls only.
  const int rank = rank_from_environment(envp);
  char token_file[sizeof directory + 32];
  char fifo[sizeof directory + 32];
  const int token_file_length =
      std::snprintf(token_file, sizeof token_file, "%s/rank%d.token", directory, rank);
  const int fifo_length = std::snprintf(fifo, sizeof fifo, "%s/rank%d", directory, rank);
  if (token_file_length <= 0 || fifo_length <= 0) return;
  if (const int fd = open(token_file, O_RDONLY | O_CLOEXEC); fd >= 0) {
    unsigned char token[channel::kMaxTokenBytes];
    const ssize_t got = read(fd, token, sizeof token);
    close(fd);
    token_length = got > 0 ? static_cast<std::size_t>(got) : 0;
    random_bytes(token_pad, token_length);
    for (std::size_t i = 0; i < token_length; ++i) masked_token[i] = token[i] ^ token_pad[i];
    volatile unsigned char* wipe = token;  // not optimised away: the stack keeps no copy
    for (std::size_t i = 0; i < sizeof token; ++i) wipe[i] = 0;
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
  if (channel_fd < 0 || token_length == 0) {
    std::fprintf(stderr, "check program: %s\n",
                 open_error[0] != '\0' ? open_error : "the results channel has no token");
    return false;
  }
  ::testing::UnitTest::GetInstance()->listeners().Append(
      new ChannelReporter(std::exchange(channel_fd, -1)));
  return true;
}

std::optional<std::string> grading_variable(std::string_view name) {
  if (!taken_at_start) {
    // A program without the check programs' main() (a lab's experiments, say): nothing was
    // taken, so the environment still has it.
    const std::string variable(name);
    const char* value = std::getenv(variable.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  }
  for (std::size_t v = 0; v < kGradingVariables.size(); ++v) {
    if (kGradingVariables[v] != name) continue;
    if (!grading_present[v]) return std::nullopt;
    std::string value(value_lengths[v], '\0');
    for (std::size_t i = 0; i < value_lengths[v]; ++i)
      value[i] = static_cast<char>(masked_values[v][i] ^ value_pads[v][i]);
    return value;
  }
  return std::nullopt;
}

}  // namespace dp::grading
