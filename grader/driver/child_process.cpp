// child_process.cpp: posix_spawn with an output pipe, and the descendant sweep through /proc.
#include "child_process.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "dp/error.h"

namespace dp::grader {
namespace {

/// One line of the process table.
struct ProcessEntry {
  int pid = 0;
  int parent = 0;
  char state = '?';  ///< 'Z' for a zombie, which cannot be killed, only reaped
};

/// Reads pid, state and parent pid from /proc/<pid>/stat: "pid (name) S ppid ...". The
/// name may hold spaces and parentheses, so the fields are found after its last ')'.
bool read_stat(int pid, ProcessEntry& entry) {
  std::ifstream file(fmt::format("/proc/{}/stat", pid));
  std::string text;
  if (!std::getline(file, text)) return false;  // it has just ended
  const std::size_t name_end = text.rfind(')');
  if (name_end == std::string::npos) return false;
  std::istringstream fields(text.substr(name_end + 1));
  entry.pid = pid;
  return static_cast<bool>(fields >> entry.state >> entry.parent);
}

std::vector<ProcessEntry> process_table() {
  std::vector<ProcessEntry> table;
  std::error_code error;
  for (const auto& directory : std::filesystem::directory_iterator("/proc", error)) {
    const std::string name = directory.path().filename().string();
    int pid = 0;
    const auto [end, status] = std::from_chars(name.data(), name.data() + name.size(), pid);
    if (status != std::errc() || end != name.data() + name.size()) continue;
    ProcessEntry entry;
    if (read_stat(pid, entry)) table.push_back(entry);
  }
  return table;
}

/// Every descendant of this process, leaving out the `spared` children and their subtrees.
std::vector<ProcessEntry> descendants(const std::set<int>& spared) {
  std::multimap<int, ProcessEntry> by_parent;
  for (const ProcessEntry& entry : process_table()) by_parent.emplace(entry.parent, entry);
  const int self = getpid();
  std::vector<ProcessEntry> found;
  std::vector<int> frontier = {self};
  while (!frontier.empty()) {
    const int parent = frontier.back();
    frontier.pop_back();
    const auto [first, last] = by_parent.equal_range(parent);
    for (auto it = first; it != last; ++it) {
      if (parent == self && spared.contains(it->second.pid)) continue;
      found.push_back(it->second);
      frontier.push_back(it->second.pid);
    }
  }
  return found;
}

std::vector<char*> pointers_to(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  for (std::string& text : strings) pointers.push_back(text.data());
  pointers.push_back(nullptr);
  return pointers;
}

}  // namespace

SpawnedChild spawn_child(const std::vector<std::string>& argv,
                         const std::vector<std::string>& environment,
                         const std::string& working_directory) {
  SpawnedChild child;
  int output[2];
  // O_CLOEXEC: the child gets the write end only as its stdout and stderr (dup2 clears the
  // flag there), so that no other copy keeps the pipe open.
  if (pipe2(output, O_CLOEXEC) != 0) {
    child.error =
        fmt::format("cannot make a pipe for {}'s output: {}", argv.at(0), std::strerror(errno));
    return child;
  }
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attributes;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_init(&attributes);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, output[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, output[1], STDERR_FILENO);
  if (!working_directory.empty())
    posix_spawn_file_actions_addchdir_np(&actions, working_directory.c_str());
  // Its own process group (pgid = its pid), so that a time-out reaches the program and
  // what it started (mpirun's ranks) with one signal.
  posix_spawnattr_setpgroup(&attributes, 0);
  // With no signal blocked, whatever the caller holds (SignalForwarding), and the default
  // action for the termination signals even where the grader was started ignoring them
  // (nohup): the child must die of the SIGTERM a time-out or a forward sends it.
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attributes, &none);
  sigset_t terminating;
  sigemptyset(&terminating);
  for (const int signal : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) sigaddset(&terminating, signal);
  posix_spawnattr_setsigdefault(&attributes, &terminating);
  posix_spawnattr_setflags(&attributes,
                           POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  std::vector<std::string> args = argv;
  std::vector<std::string> env = environment;
  std::vector<char*> arg_pointers = pointers_to(args);
  std::vector<char*> env_pointers = pointers_to(env);
  pid_t pid = -1;
  // posix_spawnp: a launcher such as "mpirun" is found on PATH.
  const int status = posix_spawnp(&pid, arg_pointers[0], &actions, &attributes, arg_pointers.data(),
                                  env_pointers.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attributes);
  close(output[1]);
  if (status != 0) {
    close(output[0]);
    child.error = fmt::format("cannot start {}: {}", argv.at(0), std::strerror(status));
    return child;
  }
  fcntl(output[0], F_SETFL, fcntl(output[0], F_GETFL) | O_NONBLOCK);
  child.pid = pid;
  child.output_fd = output[0];
  return child;
}

// --- forwarding termination signals -------------------------------------------------------

namespace {

constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP};
// The group the handler forwards to: 0 while none. An atomic of a lock-free type is what a
// signal handler may read.
std::atomic<int> forwarded_group{0};
std::atomic<bool> forwarding_exists{false};
// The first forwarded signal received since the last SignalForwarding was made; 0: none.
std::atomic<int> received_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);

/// The handler: SIGTERM to the child's group (mpirun ends its ranks on it), and the signal
/// recorded for the grader, which then sweeps every descendant, removes its directories and
/// ends as the signal asks (`end_by_signal`): neither may be done here, where only
/// async-signal-safe calls are allowed.
void forward_and_record(int signal) {
  const int group = forwarded_group.load();
  if (group > 0) kill(-group, SIGTERM);
  int none = 0;
  received_signal.compare_exchange_strong(none, signal);
}

}  // namespace

struct SignalForwarding::Saved {
  struct sigaction actions[std::size(kForwardedSignals)];
  sigset_t mask;
};

SignalForwarding::SignalForwarding() : saved_(std::make_unique<Saved>()) {
  if (forwarding_exists.exchange(true))
    throw Error("SignalForwarding: one already exists (one child is run at a time)");
  received_signal.store(0);
  sigset_t held;
  sigemptyset(&held);
  for (const int signal : kForwardedSignals) sigaddset(&held, signal);
  pthread_sigmask(SIG_BLOCK, &held, &saved_->mask);
  struct sigaction action = {};
  action.sa_handler = forward_and_record;
  sigemptyset(&action.sa_mask);
  for (std::size_t i = 0; i < std::size(kForwardedSignals); ++i)
    sigaction(kForwardedSignals[i], &action, &saved_->actions[i]);
}

void SignalForwarding::forward_to(int group) {
  forwarded_group.store(group > 0 ? group : 0);
  pthread_sigmask(SIG_SETMASK, &saved_->mask, nullptr);
}

SignalForwarding::~SignalForwarding() {
  // Handlers first, then the mask: a signal held until now meets the previous handler.
  for (std::size_t i = 0; i < std::size(kForwardedSignals); ++i)
    sigaction(kForwardedSignals[i], &saved_->actions[i], nullptr);
  forwarded_group.store(0);
  pthread_sigmask(SIG_SETMASK, &saved_->mask, nullptr);
  forwarding_exists.store(false);
}

int received_termination_signal() {
  return received_signal.load();
}

void end_by_signal(int signal) {
  struct sigaction default_action = {};
  default_action.sa_handler = SIG_DFL;
  sigemptyset(&default_action.sa_mask);
  sigaction(signal, &default_action, nullptr);
  sigset_t just_this;
  sigemptyset(&just_this);
  sigaddset(&just_this, signal);
  pthread_sigmask(SIG_UNBLOCK, &just_this, nullptr);
  raise(signal);
  _exit(128 + signal);  // not reached: the default action of the signals forwarded ends us
}

void become_child_subreaper() {
  if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0)
    throw Error(fmt::format(
        "cannot make the grader a child subreaper (needed to end every process a lab starts): "
        "{}",
        std::strerror(errno)));
}

std::set<int> child_pids() {
  std::set<int> pids;
  const int self = getpid();
  for (const ProcessEntry& entry : process_table())
    if (entry.parent == self) pids.insert(entry.pid);
  return pids;
}

std::vector<int> kill_descendants(const std::set<int>& spared) {
  using SteadyClock = std::chrono::steady_clock;
  const int self = getpid();
  const SteadyClock::time_point deadline = SteadyClock::now() + std::chrono::seconds(1);
  while (true) {
    const std::vector<ProcessEntry> found = descendants(spared);
    if (found.empty()) return {};
    // A killed process's children become ours (we are their subreaper), so every round
    // reaches one generation further until nothing is left.
    for (const ProcessEntry& entry : found)
      if (entry.state != 'Z') kill(entry.pid, SIGKILL);
    for (const ProcessEntry& entry : found)
      if (entry.parent == self) waitpid(entry.pid, nullptr, WNOHANG);
    if (SteadyClock::now() >= deadline) {
      std::vector<int> left;
      for (const ProcessEntry& entry : descendants(spared)) left.push_back(entry.pid);
      return left;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

}  // namespace dp::grader
