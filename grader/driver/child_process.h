// child_process.h: starting a check program and making sure nothing it started outlives
// its run.
//
// A lab can start processes that leave the check program's process group (`setsid`) or
// its parentage (a double fork). To find those, the grader makes itself a child subreaper:
// Linux then hands it every orphan among its descendants instead of giving them to init,
// so that walking the parent links in /proc from the grader's pid finds every process a
// run started, wherever it moved.
//
// Example:
//
//   become_child_subreaper();
//   const std::set<int> before = child_pids();  // the caller's own children are spared
//   SpawnedChild child = spawn_child({"grade_lab1"}, environment_strings);
//   ... read child.output_fd, waitpid(child.pid, ...) ...
//   kill_descendants(before);
#pragma once

#include <memory>
#include <set>
#include <string>
#include <vector>

namespace dp::grader {

/// A started process and the read end of the pipe its stdout and stderr go to.
struct SpawnedChild {
  int pid = -1;        ///< its pid, or -1 when it could not be started
  int output_fd = -1;  ///< non-blocking read end of its stdout+stderr pipe (the caller closes it)
  std::string error;   ///< why it could not be started, or ""
};

/// Starts `argv` (found on PATH) with exactly `environment` (NAME=VALUE strings) in a new
/// process group, stdin from /dev/null and stdout and stderr into one pipe, in
/// `working_directory` (the caller's when empty).
SpawnedChild spawn_child(const std::vector<std::string>& argv,
                         const std::vector<std::string>& environment,
                         const std::string& working_directory = {});

/// While it exists, SIGINT, SIGTERM and SIGHUP sent to this process reach the process group
/// of the child it forwards to (`forward_to`) as SIGTERM, and are recorded
/// (`received_termination_signal`) instead of ending this process at once: the caller then
/// sweeps what the child started (a process that ignores SIGTERM, a `setsid` daemon:
/// `kill_descendants`), removes its private directories, and ends as the signal asked
/// (`end_by_signal`). The child runs in a process group of its own, so that a time-out
/// reaches it and mpirun's ranks with one signal; a Ctrl-C at the terminal or a `timeout`
/// around `dplab grade` reaches only the grader's group, and without forwarding mpirun and
/// its ranks would run on, orphaned. One at a time: it throws `dp::Error` if another exists.
///
/// Example:
///
///   SignalForwarding forwarding;            // the signals are held until forward_to
///   SpawnedChild child = spawn_child(...);  // the child starts with them unblocked
///   forwarding.forward_to(child.pid);
class SignalForwarding {
 public:
  /// Installs the handlers and holds the three signals (blocked) until `forward_to`, so that
  /// none arrives between the spawn and knowing the child's group.
  SignalForwarding();
  /// Restores the previous handlers and signal mask; a held signal is then delivered.
  ~SignalForwarding();
  SignalForwarding(const SignalForwarding&) = delete;
  SignalForwarding& operator=(const SignalForwarding&) = delete;

  /// Forwards to process group `group` (the child's pid; < 1: to nobody) and stops holding
  /// the signals.
  void forward_to(int group);

 private:
  struct Saved;
  std::unique_ptr<Saved> saved_;
};

/// The first of SIGINT, SIGTERM and SIGHUP received while the latest `SignalForwarding`
/// existed, or 0 when none was.
int received_termination_signal();

/// Ends this process as `signal` does by default (the status a shell reports as killed by
/// it), whatever handler or mask was set: what a grader interrupted by `signal` does once it
/// has cleaned up.
[[noreturn]] void end_by_signal(int signal);

/// Makes this process a child subreaper (prctl PR_SET_CHILD_SUBREAPER): orphaned
/// descendants become its children. Throws `dp::Error` when the kernel refuses.
void become_child_subreaper();

/// The pids of this process's children now.
std::set<int> child_pids();

/// SIGKILLs every descendant of this process except `spared` children and their own
/// descendants, reaps those that become its children, and repeats until none is left or
/// about a second has passed. Returns the pids still alive then (expected: none).
std::vector<int> kill_descendants(const std::set<int>& spared);

}  // namespace dp::grader
