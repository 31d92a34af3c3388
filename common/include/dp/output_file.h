// output_file.h: writing output files so that no file is clobbered or left half-written.
//
// Every file dplab writes (checkpoints, Chrome traces, the grader's reports) goes through
// here, and every write follows the same rules:
//
//   - the target must be a regular file or absent: a directory, a FIFO, a device node, a
//     socket or a symbolic link is refused (renaming over a link would replace the link,
//     not write where it points, and writing into /dev/null as root would replace it);
//   - the target must not be a file the same run reads (`check_output_path`), so that a
//     checkpoint never lands on the data set it is trained on;
//   - the bytes go to a temporary file with a name of its own in the target's directory,
//     which is flushed to disk (fsync), renamed over the target, and then the directory is
//     flushed too. A crash leaves the old file or the new one, never a mix; two runs that
//     write the same path at once each write a whole file, and the last rename wins (a
//     command that must not share its output takes an `OutputLock`), and a killed run's
//     temporary file is removed by the next run (`remove_stale_temporaries`);
//   - a failure names the file and the system's reason (the errno of the failed call).
//
// Commands check their output paths before they start the work (`check_output_path`), so a
// typo in a directory name costs a second, not a training run.
//
// Example:
//
//   std::vector<std::filesystem::path> inputs = {"data.csv"};
//   dp::check_output_path("run.json", inputs);      // before the work: fails early
//   ... train ...
//   dp::write_file_atomically("run.json", text);     // a whole file or none
//
//   dp::AtomicFile out("model.safetensors");        // streaming, for large files
//   out.write(header.data(), header.size());
//   out.commit();                                    // without it, nothing is left behind
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dp {

/// Checks, before any work, that `path` can be written as an output: it is a regular file
/// or absent, it is none of `inputs` (compared as files, so another spelling or a hard link
/// of an input is caught), and its directory exists and accepts new files (tested by
/// creating and removing a temporary file there). Throws `dp::Error` naming the path and
/// what is wrong, with the system's reason where there is one.
void check_output_path(const std::filesystem::path& path,
                       std::span<const std::filesystem::path> inputs = {});

/// One output of a command: the option that names it and its path ("" when not given).
struct NamedOutput {
  std::string_view option;     ///< the option that names it, e.g. "--checkpoint"
  std::filesystem::path path;  ///< where it goes; empty when the option was not given
};

/// Checks, before any work, that no two of `outputs` are one file: the same path once made
/// absolute and normal, or one existing file under two names (a link). Two outputs on one
/// file would leave only the one written last. Outputs not given ("") are skipped. Throws
/// `dp::Error` naming both options and the path.
void check_distinct_outputs(std::span<const NamedOutput> outputs);

/// A file written under a temporary name and moved onto its path by `commit()`.
///
/// The constructor refuses a target that is not a regular file (see the top of this file)
/// and creates the temporary file in the target's directory; the destructor removes it
/// unless `commit()` succeeded. Not copyable; use it from one thread.
class AtomicFile {
 public:
  /// Creates the temporary file for `path`; throws `dp::Error` if `path` exists and is not
  /// a regular file or the temporary file cannot be created.
  explicit AtomicFile(std::filesystem::path path);
  /// Removes the temporary file unless `commit()` succeeded.
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  /// Appends `bytes` bytes at `data`; throws `dp::Error` with the system's reason on failure.
  void write(const void* data, std::size_t bytes);
  /// Appends `text`.
  void write(std::string_view text) { write(text.data(), text.size()); }
  /// Flushes the file to disk, checks the target again, renames the file onto it (keeping
  /// the permissions of a file it replaces) and flushes the directory. Throws `dp::Error`
  /// on failure; then the target is as it was.
  void commit();

  /// The target path.
  const std::filesystem::path& path() const { return path_; }
  /// The temporary file's path (it exists until `commit()` or destruction).
  const std::filesystem::path& temporary_path() const { return temporary_; }

 private:
  std::filesystem::path path_;
  std::filesystem::path temporary_;
  int descriptor_ = -1;  // of the temporary file; -1 once closed
  bool committed_ = false;
};

/// Removes the temporary files that `AtomicFile`s of other processes left beside `path`
/// (".<name>.<pid>.<n>.tmp", hidden) when that process no longer exists: a run killed while
/// it saved leaves one, and nothing else would ever remove it. A file of a living process
/// (another run writing now) is kept. Returns the files removed; errors are ignored (a file
/// that cannot be removed stays, as before).
std::vector<std::filesystem::path> remove_stale_temporaries(const std::filesystem::path& path);

/// An exclusive claim on writing `path` for as long as it lives: a lock (flock) on the hidden
/// file ".<name>.lock" beside it, which holds the owner's pid. Two runs that save the same
/// checkpoint would otherwise replace each other's files in turn, silently; the second is
/// refused instead. The lock is released when the process ends, however it ends; the lock
/// file is removed by the destructor (a killed run leaves it, unlocked and harmless).
class OutputLock {
 public:
  /// Takes the lock; throws `dp::Error` naming the path, the lock file and the pid of the
  /// process that holds it, or the system's reason when the lock file cannot be made.
  explicit OutputLock(std::filesystem::path path);
  /// Releases the lock and removes the lock file.
  ~OutputLock();
  OutputLock(const OutputLock&) = delete;
  OutputLock& operator=(const OutputLock&) = delete;
  /// The lock file's path.
  const std::filesystem::path& lock_file() const { return lock_file_; }

 private:
  std::filesystem::path path_;
  std::filesystem::path lock_file_;
  int descriptor_ = -1;  // of the locked lock file
};

/// Writes `contents` to `path` with an `AtomicFile`: the whole of it or nothing. Throws
/// `dp::Error` as `AtomicFile` does.
void write_file_atomically(const std::filesystem::path& path, std::string_view contents);

}  // namespace dp
