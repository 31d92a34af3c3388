// Output files: checked targets, unique temporary files, fsync and rename (see output_file.h).
#include "dp/output_file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <csignal>
#include <cstring>
#include <system_error>

#include "dp/error.h"

namespace dp {
namespace {

namespace fs = std::filesystem;

/// The reason of the last failed system call, read before anything else can change errno.
std::string system_reason(int error_number) {
  return std::strerror(error_number);
}

/// What kind of file `mode` describes, for a message ("a directory", "a FIFO", ...).
std::string_view kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

/// Throws unless `path` is absent or a regular file (not following a symbolic link).
void check_target_kind(const fs::path& path) {
  struct stat status {};
  if (::lstat(path.c_str(), &status) != 0) {
    const int error = errno;
    if (error == ENOENT) return;
    throw Error(fmt::format("cannot write '{}': {}", path.string(), system_reason(error)));
  }
  if (S_ISREG(status.st_mode)) return;
  throw Error(fmt::format(
      "refusing to write '{}': it is {}; dplab writes and replaces only regular files{}",
      path.string(), kind_of(status.st_mode),
      S_ISLNK(status.st_mode) ? " (give the path the link points to)" : ""));
}

/// The directory a file at `path` is created in ("." for a bare file name).
fs::path directory_of(const fs::path& path) {
  const fs::path parent = path.parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

/// The target's name as the hidden files beside it use it: kept well under NAME_MAX (255).
std::string short_name(const fs::path& path) {
  return path.filename().string().substr(0, 160);
}

/// A name no other writer uses: the target's name, this process and a per-process counter.
/// Hidden (a leading dot), so that a listing shows no half-written file.
fs::path temporary_name_for(const fs::path& path) {
  static std::atomic<std::uint64_t> counter{0};
  return directory_of(path) / fmt::format(".{}.{}.{}.tmp", short_name(path), ::getpid(), counter++);
}

/// The process id in `file_name` if it is one of `temporary_name_for`'s names for `path`:
/// ".<name>.<pid>.<counter>.tmp" with decimal pid and counter; 0 otherwise.
pid_t temporary_owner(const std::string& file_name, const fs::path& path) {
  const std::string prefix = fmt::format(".{}.", short_name(path));
  const std::string_view suffix = ".tmp";
  if (file_name.size() <= prefix.size() + suffix.size() || !file_name.starts_with(prefix) ||
      !file_name.ends_with(suffix))
    return 0;
  const std::string_view middle(file_name.data() + prefix.size(),
                                file_name.size() - prefix.size() - suffix.size());
  pid_t pid = 0;
  const auto [dot, error] = std::from_chars(middle.data(), middle.data() + middle.size(), pid);
  if (error != std::errc() || pid <= 0 || dot == middle.data() + middle.size() || *dot != '.')
    return 0;
  const std::string_view counter(dot + 1, middle.data() + middle.size() - (dot + 1));
  if (counter.empty() || counter.find_first_not_of("0123456789") != std::string_view::npos)
    return 0;
  return pid;
}

/// Creates a new temporary file for `path` and returns its descriptor and name. O_EXCL makes
/// the name ours alone; 0666 lets the umask decide the permissions, as for any new file.
std::pair<int, fs::path> create_temporary_for(const fs::path& path) {
  for (int attempt = 0;; ++attempt) {
    fs::path temporary = temporary_name_for(path);
    const int descriptor = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (descriptor >= 0) return {descriptor, std::move(temporary)};
    const int error = errno;
    // A stale file of an earlier process with our pid: take the next name.
    if (error == EEXIST && attempt < 100) continue;
    const fs::path directory = directory_of(path);
    // ENOENT also comes from a directory that exists but makes no new files (/proc):
    // "does not exist" only when it is so.
    std::error_code ignored;
    if (error == ENOENT && !fs::exists(directory, ignored))
      throw Error(fmt::format("cannot write '{}': the directory '{}' does not exist", path.string(),
                              directory.string()));
    if (error == ENOENT)
      throw Error(fmt::format(
          "cannot write '{}': the directory '{}' exists but does not accept new files (No such "
          "file or directory: a virtual file system such as /proc or /sys?)",
          path.string(), directory.string()));
    throw Error(fmt::format("cannot write '{}': cannot create a file in '{}': {}", path.string(),
                            directory.string(), system_reason(error)));
  }
}

/// True when `a` and `b` are the same file (same device and inode).
bool same_file(const struct stat& a, const struct stat& b) {
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

}  // namespace

void check_output_path(const fs::path& path, std::span<const fs::path> inputs) {
  if (path.empty()) throw Error("an output path is empty: expected a file name");
  check_target_kind(path);
  struct stat target {};
  if (::stat(path.c_str(), &target) == 0) {
    for (const fs::path& input : inputs) {
      struct stat read_file {};
      if (::stat(input.c_str(), &read_file) == 0 && same_file(target, read_file))
        throw Error(fmt::format(
            "refusing to write '{}': it is '{}', which this run reads; choose another path",
            path.string(), input.string()));
    }
  }
  const fs::path directory = directory_of(path);
  struct stat folder {};
  if (::stat(directory.c_str(), &folder) != 0) {
    const int error = errno;
    throw Error(fmt::format("cannot write '{}': the directory '{}' {}", path.string(),
                            directory.string(),
                            error == ENOENT ? "does not exist" : system_reason(error)));
  }
  if (!S_ISDIR(folder.st_mode))
    throw Error(fmt::format("cannot write '{}': '{}' is not a directory", path.string(),
                            directory.string()));
  // Permissions, a read-only file system, quotas: only creating a file tells for sure.
  const auto [descriptor, probe] = create_temporary_for(path);
  ::close(descriptor);
  ::unlink(probe.c_str());
}

void check_distinct_outputs(std::span<const NamedOutput> outputs) {
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    for (std::size_t j = i + 1; j < outputs.size(); ++j) {
      const NamedOutput& first = outputs[i];
      const NamedOutput& second = outputs[j];
      if (first.path.empty() || second.path.empty()) continue;
      bool same = fs::absolute(first.path).lexically_normal() ==
                  fs::absolute(second.path).lexically_normal();
      struct stat a {};
      struct stat b {};
      if (!same && ::stat(first.path.c_str(), &a) == 0 && ::stat(second.path.c_str(), &b) == 0)
        same = same_file(a, b);
      if (same)
        throw Error(fmt::format(
            "{} and {} both write '{}': the one written last would replace the other; give "
            "each its own path",
            first.option, second.option, second.path.string()));
    }
  }
}

AtomicFile::AtomicFile(fs::path path) : path_(std::move(path)) {
  if (path_.empty()) throw Error("an output path is empty: expected a file name");
  check_target_kind(path_);
  try {
    std::tie(descriptor_, temporary_) = create_temporary_for(path_);
  } catch (const Error& error) {
    // A result is written after its work: the file that cannot be created is output lost.
    throw OutputError(error.what());
  }
}

AtomicFile::~AtomicFile() {
  if (descriptor_ >= 0) ::close(descriptor_);
  if (!committed_) ::unlink(temporary_.c_str());
}

void AtomicFile::write(const void* data, std::size_t bytes) {
  if (descriptor_ < 0)
    throw Error(fmt::format("cannot write '{}': the file was already committed", path_.string()));
  const char* next = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t written = ::write(descriptor_, next, bytes);
    if (written < 0) {
      const int error = errno;
      if (error == EINTR) continue;
      throw OutputError(fmt::format("cannot write '{}' (temporary file '{}'): {}", path_.string(),
                                    temporary_.string(), system_reason(error)));
    }
    next += written;
    bytes -= static_cast<std::size_t>(written);
  }
}

void AtomicFile::commit() {
  if (committed_) return;
  const auto fail = [&](std::string_view step, int error) {
    return OutputError(fmt::format("cannot write '{}': {} failed: {}", path_.string(), step,
                                   system_reason(error)));
  };
  // The target may have appeared or changed since the constructor looked.
  check_target_kind(path_);
  // A file that replaces another keeps its permissions, as a shell redirection would.
  struct stat target {};
  if (::stat(path_.c_str(), &target) == 0 && ::fchmod(descriptor_, target.st_mode & 07777) != 0)
    throw fail("setting the permissions", errno);
  if (::fsync(descriptor_) != 0) throw fail("flushing to disk (fsync)", errno);
  const int descriptor = descriptor_;
  descriptor_ = -1;
  if (::close(descriptor) != 0) throw fail("closing", errno);
  if (::rename(temporary_.c_str(), path_.c_str()) != 0)
    throw fail(fmt::format("renaming '{}' onto it", temporary_.string()), errno);
  committed_ = true;
  // The rename is durable only once the directory is on disk too.
  const int directory = ::open(directory_of(path_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (directory < 0) throw fail("opening its directory to flush it", errno);
  const int synced = ::fsync(directory);
  const int error = errno;
  ::close(directory);
  // Some file systems cannot flush a directory (EINVAL); the file itself is already safe.
  if (synced != 0 && error != EINVAL) throw fail("flushing its directory (fsync)", error);
}

std::vector<fs::path> remove_stale_temporaries(const fs::path& path) {
  std::vector<fs::path> removed;
  std::error_code error;
  for (fs::directory_iterator entry(directory_of(path), error), end; !error && entry != end;
       entry.increment(error)) {
    const pid_t owner = temporary_owner(entry->path().filename().string(), path);
    if (owner == 0 || owner == ::getpid()) continue;
    // Signal 0 only asks whether the process exists; EPERM means it does (another user's).
    if (::kill(owner, 0) == 0 || errno != ESRCH) continue;
    std::error_code ignored;
    if (entry->is_regular_file(ignored) && fs::remove(entry->path(), ignored))
      removed.push_back(entry->path());
  }
  return removed;
}

OutputLock::OutputLock(fs::path path)
    : path_(std::move(path)),
      lock_file_(directory_of(path_) / fmt::format(".{}.lock", short_name(path_))) {
  // A holder that finishes unlinks the lock file; a process that opened it just before then
  // locks a file no longer in the directory, so the lock is taken again until the file
  // locked is the one at the name.
  for (int attempt = 0; attempt < 100; ++attempt) {
    descriptor_ = ::open(lock_file_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (descriptor_ < 0)
      throw Error(fmt::format("cannot write '{}': cannot create its lock file '{}': {}",
                              path_.string(), lock_file_.string(), system_reason(errno)));
    if (::flock(descriptor_, LOCK_EX | LOCK_NB) != 0) {
      const int error = errno;
      char text[32] = {};
      const ssize_t length = ::pread(descriptor_, text, sizeof text - 1, 0);
      ::close(descriptor_);
      descriptor_ = -1;
      if (error != EWOULDBLOCK)
        throw Error(fmt::format("cannot write '{}': cannot lock '{}': {}", path_.string(),
                                lock_file_.string(), system_reason(error)));
      const std::string holder =
          length > 0 ? std::string(text, static_cast<std::size_t>(length)) : std::string("?");
      throw Error(fmt::format(
          "refusing to write '{}': another process (pid {}) is writing it (it holds the lock "
          "file '{}'); two runs writing one file would replace each other's saves, so give "
          "this run another path or wait for the other",
          path_.string(), holder, lock_file_.string()));
    }
    struct stat locked {};
    struct stat named {};
    if (::fstat(descriptor_, &locked) == 0 && ::stat(lock_file_.c_str(), &named) == 0 &&
        locked.st_dev == named.st_dev && locked.st_ino == named.st_ino) {
      const std::string pid = std::to_string(::getpid());
      if (::ftruncate(descriptor_, 0) == 0 &&
          ::pwrite(descriptor_, pid.data(), pid.size(), 0) == static_cast<ssize_t>(pid.size()))
        return;
    }
    ::close(descriptor_);
    descriptor_ = -1;
  }
  throw Error(fmt::format("cannot write '{}': its lock file '{}' keeps changing", path_.string(),
                          lock_file_.string()));
}

OutputLock::~OutputLock() {
  // Unlinked while still locked, so that no other process locks the name in between.
  ::unlink(lock_file_.c_str());
  ::close(descriptor_);
}

void write_file_atomically(const fs::path& path, std::string_view contents) {
  AtomicFile file(path);
  file.write(contents);
  file.commit();
}

}  // namespace dp
