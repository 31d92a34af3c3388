// Tests of output files (dp/output_file.h): only regular files are replaced, inputs of the
// run are never overwritten, a write is whole or absent, and errors quote the system.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "dp/checkpoint.h"
#include "dp/error.h"
#include "dp/output_file.h"
#include "test_support.h"

namespace {

namespace fs = std::filesystem;

using dp::testing::contains;
using dp::testing::message_of;
using dp::testing::test_directory;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// The names of the files in `dir`, hidden ones included.
std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir))
    names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(OutputFile, WritesANewFileAndReplacesAnOldOneKeepingItsPermissions) {
  const fs::path dir = test_directory();
  const fs::path path = dir / "report.json";
  dp::write_file_atomically(path, "first");
  EXPECT_EQ(read_text(path), "first");
  ASSERT_EQ(::chmod(path.c_str(), 0640), 0);
  dp::write_file_atomically(path, "second, longer");
  EXPECT_EQ(read_text(path), "second, longer");
  struct stat status {};
  ASSERT_EQ(::stat(path.c_str(), &status), 0);
  EXPECT_EQ(status.st_mode & 0777, 0640u);
  EXPECT_EQ(listing(dir), std::vector<std::string>{"report.json"}) << "no temporary file is left";
}

TEST(OutputFile, AnUncommittedFileLeavesNothingBehind) {
  const fs::path dir = test_directory();
  dp::write_file_atomically(dir / "kept.txt", "old");
  {
    dp::AtomicFile file(dir / "kept.txt");
    file.write("new, but never committed");
    EXPECT_TRUE(fs::exists(file.temporary_path()));
    EXPECT_EQ(file.temporary_path().parent_path(), dir)
        << "the temporary file shares the directory";
  }
  EXPECT_EQ(read_text(dir / "kept.txt"), "old");
  EXPECT_EQ(listing(dir), std::vector<std::string>{"kept.txt"});
}

TEST(OutputFile, RefusesADirectoryAFifoAndASymbolicLink) {
  const fs::path dir = test_directory();
  fs::create_directory(dir / "folder");
  EXPECT_TRUE(
      contains(message_of<dp::Error>([&] { dp::write_file_atomically(dir / "folder", "x"); }),
               "is a directory"));
  EXPECT_TRUE(fs::is_directory(dir / "folder"));

  ASSERT_EQ(::mkfifo((dir / "pipe").c_str(), 0600), 0);
  EXPECT_TRUE(contains(message_of<dp::Error>([&] { dp::write_file_atomically(dir / "pipe", "x"); }),
                       "FIFO"));
  EXPECT_TRUE(fs::is_fifo(dir / "pipe")) << "the FIFO must not be replaced";

  dp::write_file_atomically(dir / "target.txt", "target");
  fs::create_symlink("target.txt", dir / "link");
  const std::string message =
      message_of<dp::Error>([&] { dp::write_file_atomically(dir / "link", "x"); });
  EXPECT_TRUE(contains(message, "symbolic link")) << message;
  EXPECT_TRUE(fs::is_symlink(dir / "link")) << "the link must not be replaced";
  EXPECT_EQ(read_text(dir / "target.txt"), "target");
  EXPECT_EQ(listing(dir), (std::vector<std::string>{"folder", "link", "pipe", "target.txt"}));
}

TEST(OutputFile, RefusesADeviceNode) {
  const fs::path dir = test_directory();
  const fs::path node = dir / "null";
  // A node like /dev/null, made here so that nothing of the system is at risk.
  if (::mknod(node.c_str(), S_IFCHR | 0666, makedev(1, 3)) != 0)
    GTEST_SKIP() << "cannot create a device node here (needs CAP_MKNOD)";
  const std::string message = message_of<dp::Error>([&] { dp::write_file_atomically(node, "x"); });
  EXPECT_TRUE(contains(message, "character device")) << message;
  struct stat status {};
  ASSERT_EQ(::lstat(node.c_str(), &status), 0);
  EXPECT_TRUE(S_ISCHR(status.st_mode)) << "the device node must not be replaced";
  // check_output_path says the same before any work starts.
  EXPECT_TRUE(
      contains(message_of<dp::Error>([&] { dp::check_output_path(node); }), "character device"));
}

TEST(OutputFile, TheTargetIsCheckedAgainAtCommit) {
  const fs::path dir = test_directory();
  dp::AtomicFile file(dir / "late");
  file.write("data");
  fs::create_directory(dir / "late");  // appears while the file is written
  const std::string message = message_of<dp::Error>([&] { file.commit(); });
  EXPECT_TRUE(contains(message, "is a directory")) << message;
  EXPECT_TRUE(fs::is_directory(dir / "late"));
}

TEST(OutputFile, StaleTemporaryFilesOfGoneProcessesAreRemoved) {
  // Issue 32: a run killed while saving left ".<name>.<pid>.<n>.tmp", and nothing removed it.
  const fs::path dir = test_directory();
  const fs::path target = dir / "run.st";
  // A pid no process has: a child that has exited and been waited for.
  const pid_t gone = ::fork();
  if (gone == 0) ::_exit(0);
  ASSERT_GT(gone, 0);
  int status = 0;
  ::waitpid(gone, &status, 0);
  const auto touch = [&](const std::string& name) {
    std::ofstream(dir / name) << "partial";
    return dir / name;
  };
  const fs::path stale = touch(fmt::format(".run.st.{}.3.tmp", gone));
  const fs::path living = touch(fmt::format(".run.st.{}.0.tmp", ::getppid()));
  const fs::path other_target = touch(fmt::format(".run.st.old.{}.0.tmp", gone));
  const fs::path not_ours = touch(fmt::format(".run.st.{}.x.tmp", gone));
  const std::vector<fs::path> removed = dp::remove_stale_temporaries(target);
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_EQ(removed[0], stale);
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(living)) << "a living process may be writing it";
  EXPECT_TRUE(fs::exists(other_target)) << "another target's file (run.st.old)";
  EXPECT_TRUE(fs::exists(not_ours)) << "not a name AtomicFile makes";
}

TEST(OutputFile, ASecondWriterOfOnePathIsRefusedByTheLock) {
  const fs::path dir = test_directory();  // emptied anew on every call
  const fs::path target = dir / "locked.st";
  {
    const dp::OutputLock first(target);
    EXPECT_TRUE(fs::exists(first.lock_file()));
    // A second lock, as another run would take it (flock locks open files, not processes).
    const std::string message = message_of<dp::Error>([&] { dp::OutputLock second(target); });
    EXPECT_TRUE(contains(message, "refusing to write '" + target.string() +
                                      "': another process (pid " + std::to_string(::getpid()) +
                                      ") is writing it"))
        << message;
  }
  EXPECT_FALSE(fs::exists(dir / ".locked.st.lock")) << "removed by its holder";
  const dp::OutputLock again(target);  // free once the first is gone
}

TEST(OutputFile, ConcurrentWritersOfOnePathEachWriteAWholeFile) {
  const fs::path dir = test_directory();
  const fs::path path = dir / "shared.bin";
  // Large enough that interleaved writes of one shared temporary file would show.
  const std::string a(1 << 20, 'a');
  const std::string b(1 << 20, 'b');
  auto writer = [&](const std::string& contents) {
    for (int i = 0; i < 20; ++i) dp::write_file_atomically(path, contents);
  };
  std::thread first(writer, std::cref(a));
  std::thread second(writer, std::cref(b));
  first.join();
  second.join();
  const std::string result = read_text(path);
  EXPECT_TRUE(result == a || result == b) << "a mix of both writers";
  EXPECT_EQ(listing(dir), std::vector<std::string>{"shared.bin"});
}

TEST(OutputFile, CheckOutputPathRefusesAnInputOfTheRunUnderAnySpelling) {
  const fs::path dir = test_directory();
  fs::create_directory(dir / "data");
  dp::write_file_atomically(dir / "data" / "train.csv", "1,2,0\n");
  const std::vector<fs::path> inputs = {dir / "data" / "train.csv"};
  const std::string message = message_of<dp::Error>(
      [&] { dp::check_output_path(dir / "data" / ".." / "data" / "train.csv", inputs); });
  EXPECT_TRUE(contains(message, "which this run reads")) << message;
  fs::create_hard_link(dir / "data" / "train.csv", dir / "alias.csv");
  EXPECT_TRUE(
      contains(message_of<dp::Error>([&] { dp::check_output_path(dir / "alias.csv", inputs); }),
               "which this run reads"));
  EXPECT_NO_THROW(dp::check_output_path(dir / "data" / "model.safetensors", inputs));
  EXPECT_EQ(listing(dir / "data"), std::vector<std::string>{"train.csv"})
      << "the check leaves no probe file behind";
}

TEST(OutputFile, CheckOutputPathNamesAMissingDirectory) {
  const fs::path dir = test_directory();
  const std::string missing =
      message_of<dp::Error>([&] { dp::check_output_path(dir / "no-such-dir" / "out.json"); });
  EXPECT_TRUE(contains(missing, "no-such-dir")) << missing;
  EXPECT_TRUE(contains(missing, "does not exist")) << missing;

  dp::write_file_atomically(dir / "plain", "a file, not a directory");
  const std::string not_dir =
      message_of<dp::Error>([&] { dp::check_output_path(dir / "plain" / "out.json"); });
  EXPECT_TRUE(contains(not_dir, "Not a directory")) << not_dir;
}

TEST(OutputFile, CheckOutputPathNamesAnUnwritableDirectory) {
  // Root writes into a read-only directory anyway; sysfs refuses new files even to root.
  if (::geteuid() == 0) {
    const std::string refused =
        message_of<dp::Error>([&] { dp::check_output_path("/sys/dplab-out.json"); });
    EXPECT_TRUE(contains(refused, "Permission denied") || contains(refused, "Read-only"))
        << refused;
    return;
  }
  const fs::path dir = test_directory();
  fs::create_directory(dir / "locked");
  fs::permissions(dir / "locked", fs::perms::owner_read | fs::perms::owner_exec);
  const std::string locked =
      message_of<dp::Error>([&] { dp::check_output_path(dir / "locked" / "out.json"); });
  fs::permissions(dir / "locked", fs::perms::owner_all);
  EXPECT_TRUE(contains(locked, "Permission denied")) << locked;
}

TEST(OutputFile, SafetensorsLeavesAnotherWritersTemporaryFileAlone) {
  // Before: every save wrote "<path>.tmp", so two runs saving one path shared that file.
  const fs::path dir = test_directory();
  const fs::path path = dir / "model.safetensors";
  dp::write_file_atomically(dir / "model.safetensors.tmp", "another run's half-written file");
  dp::Tensor weight({2, 3});
  const std::vector<dp::NamedTensor> tensors = {{"w", &weight}};
  dp::save_safetensors(path, tensors);
  EXPECT_EQ(read_text(dir / "model.safetensors.tmp"), "another run's half-written file");
  EXPECT_EQ(dp::load_safetensors(path).tensors.at("w").shape(), (std::vector<std::int64_t>{2, 3}));
}

TEST(OutputFile, SafetensorsOntoADirectorySaysSoInsteadOfSuccess) {
  // Before: the rename failed and the message ended in ": Success" (errno overwritten).
  const fs::path dir = test_directory();
  fs::create_directories(dir / "model.safetensors" / "inside");
  dp::Tensor weight({2});
  const std::vector<dp::NamedTensor> tensors = {{"w", &weight}};
  const std::string message =
      message_of<dp::Error>([&] { dp::save_safetensors(dir / "model.safetensors", tensors); });
  EXPECT_TRUE(contains(message, "is a directory")) << message;
  EXPECT_FALSE(message.ends_with(": Success")) << message;
  EXPECT_TRUE(fs::is_directory(dir / "model.safetensors" / "inside"));
}

TEST(OutputFile, SafetensorsReplacesNeitherAFifoNorASymbolicLink) {
  const fs::path dir = test_directory();
  dp::Tensor weight({2});
  const std::vector<dp::NamedTensor> tensors = {{"w", &weight}};
  ASSERT_EQ(::mkfifo((dir / "fifo.safetensors").c_str(), 0600), 0);
  EXPECT_TRUE(contains(
      message_of<dp::Error>([&] { dp::save_safetensors(dir / "fifo.safetensors", tensors); }),
      "FIFO"));
  EXPECT_TRUE(fs::is_fifo(dir / "fifo.safetensors"));
  dp::write_file_atomically(dir / "elsewhere", "untouched");
  fs::create_symlink("elsewhere", dir / "link.safetensors");
  EXPECT_TRUE(contains(
      message_of<dp::Error>([&] { dp::save_safetensors(dir / "link.safetensors", tensors); }),
      "symbolic link"));
  EXPECT_TRUE(fs::is_symlink(dir / "link.safetensors"));
  EXPECT_EQ(read_text(dir / "elsewhere"), "untouched");
}

}  // namespace
