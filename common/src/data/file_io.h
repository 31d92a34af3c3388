// file_io.h (private to library dp): opening and reading input files for the loaders.
//
// Every loader opens its file through here, so every one refuses the same things with the
// same words: a missing file, a directory (which would otherwise read as empty) or anything
// else that is not a regular file.
//
// Example:
//
//   std::string bytes = dp::detail::read_whole_file(path, "IDX image file");
//   std::ifstream csv = dp::detail::open_input_file(path, "CSV file");
#pragma once

#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace dp::detail {

/// Opens `path` for binary reading; throws `dp::Error` naming `what` and the file when it
/// does not exist, is not a regular file or cannot be opened (with the system's reason).
std::ifstream open_input_file(const std::filesystem::path& path, std::string_view what);

/// The contents of `path`, opened as `open_input_file` does; throws `dp::Error` naming
/// `what` and the file when it cannot be opened or read.
std::string read_whole_file(const std::filesystem::path& path, std::string_view what);

}  // namespace dp::detail
