// test_support.h: small helpers the unit tests share.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <string>

namespace dp::testing {

/// True when `text` contains `part` (for checking what an error message says).
inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// The message of the exception of type `E` that `action` throws; a test failure (and
/// "") if it throws none.
template <typename E>
std::string message_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const E& error) {
    return error.what();
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

/// A fresh, empty directory for the running test's files, named after the test.
inline std::filesystem::path test_directory() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "dplab_tests" /
                                    (std::string(info->test_suite_name()) + "." + info->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace dp::testing
