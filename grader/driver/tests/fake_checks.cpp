// fake_checks: a stand-in for a lab's check program, for the grade driver's tests. It
// reports on the driver's results channel with the same code as a real check program
// (grader/support/result_reporter.h), and misbehaves on request (fake_thief.cpp plays a lab
// that got hold of the channel and its token).
//
// FAKE_CHECKS_MODE picks the behaviour: unset or "normal" runs the tests below (some pass,
// one fails with a message, one is skipped, one notes what it measured, two are
// parameterised). The other modes act in FakeOrder.Second, between a test that passes and
// one that would: "crash" dies of SIGSEGV, "abort" calls abort(), "exit" calls exit(0),
// "hang" sleeps forever, "print_forever" prints without end, and "orphan" starts a
// grandchild in its own session that sleeps (its argv[0] is $FAKE_CHECKS_MARKER) and then
// passes, "stubborn" ignores SIGTERM, starts a child and a daemon in its own session that
// ignore it too (their argv[0] is $FAKE_CHECKS_MARKER) and hangs, "race" lets two threads increment
// one int (a data race for ThreadSanitizer, in the fake_checks_tsan build), "tsan_report" prints
// what ThreadSanitizer prints then, and "forged_then_abort", "forged_then_exit" and
// "forged_without_end_then_abort" play the forgers adversarial students wrote: with the stolen
// token they send "passed" for this test and every later one (and the program's end, but for the
// last), in the protocol's order, then abort() or _Exit(0) before the real reporter can send
// anything else. Some modes act before any test: "no_report" exits 3; "forged" sends nothing on the
// channel but writes a GoogleTest JSON report that says every test passed (to the file of
// --gtest_output) and prints gtest's "[       OK ]" lines, then exits 0; "untokened" first
// writes lines without the run's token (and one malformed line with it) to the channel.
// It reports as rank $FAKE_CHECKS_RANK, else $OMPI_COMM_WORLD_RANK (under mpirun), else 0.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include "grading.h"
#include "result_channel.h"
#include "result_reporter.h"

/// What a lab that got past the check program's defences would know: the channel's
/// directory and the token (fake_thief.cpp copies them before the reporter takes them).
extern char stolen_directory[4096];
extern char stolen_token[dp::grader::channel::kMaxTokenBytes + 1];
/// The rank this fake reports as: $FAKE_CHECKS_RANK, else $OMPI_COMM_WORLD_RANK, else 0, read
/// from `envp` (fake_thief.cpp, which needs it before getenv works).
int fake_rank_in(char** envp);

namespace {

std::string mode() {
  const char* value = std::getenv("FAKE_CHECKS_MODE");
  return value == nullptr ? "normal" : value;
}

int rank() {
  return fake_rank_in(environ);
}

/// Starts `sleep 300`, named `marker`, as a daemon: the new session leaves the check
/// program's process group and the second fork leaves its parentage, so the grandchild is
/// an orphan that neither a group kill nor a wait reaches.
void start_orphaned_sleep(const char* marker) {
  const pid_t child = fork();
  if (child == 0) {
    setsid();
    if (fork() == 0) execlp("sleep", marker, "300", static_cast<char*>(nullptr));
    _exit(0);
  }
  waitpid(child, nullptr, 0);
}

TEST(FakeChecks, Passes) {
  EXPECT_EQ(2 + 2, 4);
}

TEST(FakeChecks, FailsWithFeedback) {
  ADD_FAILURE() << "rank 2 parameter fc1.weight differs from the 1-rank baseline after step 3: "
                   "max abs diff 4.1e-2 at [17, 3]; expected <= 2e-6";
}

TEST(FakeChecks, IsSkipped) {
  // A fixture, not a check of dplab: test_runner and test_report need a skipped test to
  // show that a skip earns no points.
  GTEST_SKIP() << "skipped on purpose: the grader must score a skipped check 0";
}

TEST(FakeChecks, NotesWhatItMeasured) {
  const std::optional<std::string> seed = dp::grading::grading_variable("DPLAB_GRADE_SEED");
  dp::grading::note_measured("saw DPLAB_GRADE_SEED=" + seed.value_or("(unset)"));
  dp::grading::note_measured("grade_seed() = " + std::to_string(dp::grading::grade_seed()));
}

TEST(FakeChecks, ReportsTheBackend) {
  // Taken out of the environment before main(), where lab code could have read it.
  EXPECT_EQ(std::getenv("DPLAB_TEST_BACKEND"), nullptr);
  const std::optional<std::string> backend = dp::grading::grading_variable("DPLAB_TEST_BACKEND");
  ASSERT_TRUE(backend.has_value());
  EXPECT_EQ(*backend, "local");
}

TEST(FakeChecks, SeesNoChannelVariables) {
  // Taken before main(): the variable is gone, its bytes too (/proc/self/environ shows the
  // environment the program started with), and the token file is deleted.
  EXPECT_EQ(std::getenv(dp::grader::channel::kChannelVariable), nullptr);
  std::ifstream file("/proc/self/environ", std::ios::binary);
  const std::string environ_text((std::istreambuf_iterator<char>(file)),
                                 std::istreambuf_iterator<char>());
  EXPECT_EQ(environ_text.find("dplab-results-"), std::string::npos)
      << "the channel's directory is still readable in /proc/self/environ";
  if (stolen_directory[0] != '\0') {
    std::ifstream token_file(dp::grader::channel::token_path(stolen_directory, rank()));
    EXPECT_FALSE(token_file.good()) << "the token file is still there";
  }
}

TEST(FakeChecks, FailsOnRankOne) {
  EXPECT_NE(rank(), 1) << "rank 1 disagrees";
}

TEST(FakeOrder, First) {
  SUCCEED();
}

/// Sends, with the stolen token and in the protocol's order, "passed" for the running test
/// and every later one, then the program's end: a forgery the channel's order cannot show.
void forge_the_rest_of_the_run(bool with_the_end) {
  const std::string fifo = dp::grader::channel::fifo_path(stolen_directory, rank());
  const int fd = open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
  if (fd < 0) return;
  std::string lines;
  auto line = [&](const std::string& event) {
    lines += std::string(stolen_token) + " " + event + "\n";
  };
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  const ::testing::TestInfo* running = unit.current_test_info();
  bool after = false;
  for (int s = 0; s < unit.total_test_suite_count(); ++s) {
    for (int t = 0; t < unit.GetTestSuite(s)->total_test_count(); ++t) {
      const ::testing::TestInfo* test = unit.GetTestSuite(s)->GetTestInfo(t);
      if (!test->should_run()) continue;
      const std::string name = std::string(test->test_suite_name()) + "." + test->name();
      if (test == running) {
        after = true;
      } else if (!after) {
        continue;
      } else {
        line("{\"event\": \"start\", \"test\": \"" + name + "\"}");
      }
      line("{\"event\": \"end\", \"test\": \"" + name +
           "\", \"result\": \"passed\", \"failure\": \"\", \"notes\": [], \"seconds\": 0}");
    }
  }
  if (with_the_end) line("{\"event\": \"program_end\"}");
  if (write(fd, lines.data(), lines.size()) != static_cast<ssize_t>(lines.size()))
    std::perror("fake_checks: write");
  close(fd);
}

TEST(FakeOrder, Second) {
  const std::string how = mode();
  if (how == "forged_then_abort" || how == "forged_then_exit" ||
      how == "forged_without_end_then_abort") {
    forge_the_rest_of_the_run(how != "forged_without_end_then_abort");
    std::fflush(stdout);
    if (how == "forged_then_exit") std::_Exit(0);
    std::abort();
  }
  if (how == "crash") {
    // Sanitizers catch SIGSEGV to print a report and exit with 1: restore the default
    // action so that the process dies of the signal, as a real crash does.
    std::signal(SIGSEGV, SIG_DFL);
    std::raise(SIGSEGV);
  }
  if (how == "abort") std::abort();
  if (how == "exit") std::exit(0);
  if (how == "hang")
    while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
  if (how == "print_forever")
    while (true) std::fputs("a lab that prints without end fills no disk and no memory\n", stdout);
  if (how == "race") {
    int counter = 0;
    auto increment = [&counter] {
      for (int i = 0; i < 1000; ++i) ++counter;  // no lock: the race ThreadSanitizer must see
    };
    std::thread first(increment), second(increment);
    first.join();
    second.join();
  }
  if (how == "tsan_report")
    std::fputs(
        "==================\nWARNING: ThreadSanitizer: data race (pid=1)\n"
        "  Write of size 4 at 0x7b0400000010 by thread T2:\n    #0 increment fake.cpp:12\n"
        "SUMMARY: ThreadSanitizer: data race fake.cpp:12 in increment\n==================\n",
        stderr);
  if (how == "orphan") {
    const char* marker = std::getenv("FAKE_CHECKS_MARKER");
    ASSERT_NE(marker, nullptr);
    start_orphaned_sleep(marker);
  }
  if (how == "stubborn") {
    // Ignores SIGTERM, and so do the two sleeps it starts (an ignored signal stays ignored
    // across fork and exec): a child, and a daemon in a session of its own. Then it hangs.
    const char* marker = std::getenv("FAKE_CHECKS_MARKER");
    ASSERT_NE(marker, nullptr);
    std::signal(SIGTERM, SIG_IGN);
    if (fork() == 0) {
      execlp("sleep", marker, "300", static_cast<char*>(nullptr));
      _exit(127);
    }
    start_orphaned_sleep(marker);
    std::puts("fake_checks: stubborn, with a child and a daemon that ignore SIGTERM");
    std::fflush(stdout);
    while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
}

TEST(FakeOrder, Third) {
  SUCCEED();
}

class FakeRanks : public ::testing::TestWithParam<int> {};
TEST_P(FakeRanks, EvenOnly) {
  EXPECT_EQ(GetParam() % 2, 0) << "odd world size " << GetParam();
}
INSTANTIATE_TEST_SUITE_P(WorldSizes, FakeRanks, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& instance) {
                           return "ranks" + std::to_string(instance.param);
                         });

/// What a program that bypasses the channel could do: a report file and console lines that
/// claim every test passed.
int forge_a_pass() {
  const std::string output = ::testing::GTEST_FLAG(output);
  if (output.starts_with("json:")) {
    if (FILE* file = std::fopen(output.substr(std::strlen("json:")).c_str(), "w")) {
      std::fputs(
          R"({"tests": 2, "failures": 0, "testsuites": [{"name": "FakeChecks", "testsuite": [)"
          R"({"name": "Passes", "classname": "FakeChecks", "status": "RUN", "result": "COMPLETED"},)"
          R"({"name": "FailsWithFeedback", "classname": "FakeChecks", "status": "RUN", "result": "COMPLETED"}]}]})",
          file);
      std::fclose(file);
    }
  }
  std::puts(
      "[       OK ] FakeChecks.Passes (0 ms)\n[       OK ] FakeChecks.FailsWithFeedback (0 ms)");
  std::puts("[  PASSED  ] 2 tests.");
  return 0;
}

/// Writes lines the driver must ignore to this rank's FIFO.
void send_lines_without_token() {
  const std::string fifo = dp::grader::channel::fifo_path(stolen_directory, rank());
  const int fd = open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
  if (fd < 0) return;
  const std::string lines =
      "FakeChecks.FailsWithFeedback passed\n"
      "0123456789abcdef0123456789abcdef {\"event\": \"end\", \"test\": "
      "\"FakeChecks.FailsWithFeedback\", \"result\": \"passed\"}\n"
      "[       OK ] FakeChecks.FailsWithFeedback (0 ms)\n" +
      std::string(stolen_token) + " this is not an event\n";
  if (write(fd, lines.data(), lines.size()) != static_cast<ssize_t>(lines.size()))
    std::perror("fake_checks: write");
  close(fd);
}

/// What a lab that got hold of the token would send: a pass for a check that fails, before
/// the check program's own reporter sends anything.
void send_a_forged_pass_with_the_token() {
  const std::string fifo = dp::grader::channel::fifo_path(stolen_directory, rank());
  const int fd = open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
  if (fd < 0) return;
  const std::string line = std::string(stolen_token) +
                           " {\"event\": \"end\", \"test\": \"FakeChecks.FailsWithFeedback\", "
                           "\"result\": \"passed\", \"failure\": \"\", \"seconds\": 0}\n";
  if (write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size()))
    std::perror("fake_checks: write");
  close(fd);
}

}  // namespace

DP_TAKE_RESULT_CHANNEL_AT_START();

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const std::string how = mode();
  std::printf("fake_checks: mode %s\n", how.c_str());
  std::fflush(stdout);
  if (how == "no_report") return 3;
  if (how == "forged") return forge_a_pass();
  if (how == "untokened") send_lines_without_token();
  if (how == "forged_with_token") send_a_forged_pass_with_the_token();
  dp::grading::report_results_to_driver();
  return RUN_ALL_TESTS();
}
