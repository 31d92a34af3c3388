// error.h: the two tiers of failure in dplab.
//
// Recoverable errors are exceptions derived from `dp::Error`: bad input, a
// malformed file, mismatched collective calls, a deadlock or a timeout. Their
// message says what was expected and what was seen, so a student can act on
// it. Broken invariants of the runtime itself are reported with `DP_CHECK`,
// which names the file and line: those are bugs in dplab, not in a lab.
//
// Example:
//
//   if (batch_size <= 0)
//     throw dp::Error(fmt::format("batch size must be positive, got {}", batch_size));
//   DP_CHECK(offset + count <= size_, "span [{}, {}) past the end {}", offset, offset + count,
//            size_);
#pragma once

#include <fmt/format.h>

#include <memory>
#include <stdexcept>
#include <string>

namespace dp {

/// Base of every recoverable error thrown by dplab: the message is meant for the user.
///
/// An error raised on a rank inside `dp::launch` is rethrown by `launch` naming that rank:
/// `what()` then reads "rank 2: <message>" and `rank()` is 2 (a `CommError` names the ranks
/// it concerns itself and is left as it is).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
  /// The message, after "rank R: " when the rank is known.
  const char* what() const noexcept override;
  /// The rank the error was raised on, or -1 when not known (outside `dp::launch`).
  int rank() const noexcept { return rank_; }
  /// Records the rank the error was raised on (the first one recorded stays).
  void set_rank(int rank);

 private:
  int rank_ = -1;
  std::shared_ptr<const std::string> ranked_message_;  // shared: copying must not throw
};

/// A communication failure: mismatched collectives, a deadlock, a timeout, or an abort
/// caused by another rank's failure.
class CommError : public Error {
 public:
  using Error::Error;
};

/// A hang: a rank waited past the hang timeout, or every rank waits and nothing can move (a
/// deadlock). The message is the hang report, which says which rank waits on which call.
/// `dplab` exits with status 3 on it.
class HangError : public CommError {
 public:
  using CommError::CommError;
};

/// The work was done but a result could not be written (a full disk, a file size limit, a
/// closed output). `dplab` exits with status 4 on it, so that a result not written never
/// reads as a result that was bad.
class OutputError : public Error {
 public:
  using Error::Error;
};

/// Thrown by lab skeletons where the student has not written code yet.
class NotImplemented : public Error {
 public:
  /// `where` names the lab and the function, e.g. "lab2::average_gradients".
  explicit NotImplemented(const std::string& where)
      : Error("not implemented yet: " + where + " (this is your part of the lab)") {}
};

/// A broken internal invariant of the runtime (a bug in dplab); names file and line.
class InvariantError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

namespace detail {
[[noreturn]] void fail_check(const char* file, int line, const char* condition,
                             const std::string& message);
}  // namespace detail

}  // namespace dp

/// Checks an internal invariant; on failure throws `dp::InvariantError` naming file, line,
/// the condition and a formatted message.
#define DP_CHECK(condition, ...)                                                            \
  do {                                                                                      \
    if (!(condition)) [[unlikely]]                                                          \
      ::dp::detail::fail_check(__FILE__, __LINE__, #condition, ::fmt::format(__VA_ARGS__)); \
  } while (false)
