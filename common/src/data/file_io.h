// file_io.h (private to library dp): reading a whole file for the loaders.
//
// The data set and checkpoint parsers read a file into memory once and then parse the
// bytes, so that every error can name the byte offset or line where it was found.
//
// Example:
//
//   std::string bytes = dp::detail::read_whole_file(path, "IDX image file");
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

namespace dp::detail {

/// The contents of `path`; throws `dp::Error` naming `what` and the file when it cannot
/// be opened or read.
std::string read_whole_file(const std::filesystem::path& path, std::string_view what);

}  // namespace dp::detail
