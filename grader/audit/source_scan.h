// source_scan.h: the part of the lab audit that reads a lab's sources: what each file
// includes, and the few constructs that let C++ code step outside the language the audit can
// judge from the objects (inline assembly, compiler attributes, reinterpreting memory,
// names reserved for the implementation, token pasting, pragmas, paths into /proc).
//
// The scan tokenises the file as the compiler's first phases do: lines joined at a
// backslash-newline, comments removed, string and character literals (raw strings too) kept
// whole, so that a refused word inside a comment or a string is not a finding and one split
// across a backslash-newline is.
//
// Example:
//
//   std::vector<SourceFinding> findings =
//       scan_lab_source("zero3.cpp", text, {.contract_header = "lab7.h", .dp_headers = {...}});
//   for (const SourceFinding& f : findings) fmt::print("{}:{}: {}\n", f.file, f.line, f.what);
#pragma once

#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace dp::grader::audit {

/// What a lab's sources may include.
struct IncludePolicy {
  std::string contract_header;       ///< "lab7.h": the lab's own contract, as "lab7.h"
  std::set<std::string> dp_headers;  ///< the public runtime headers, e.g. "dp/tensor.h"
};

/// One construct of a source file that the audit refuses.
struct SourceFinding {
  std::string file;  ///< the file, as given
  int line = 0;      ///< 1-based
  std::string what;  ///< the construct, e.g. "reinterpret_cast"
  std::string why;   ///< why it is refused and what to use instead
};

/// Scans the text of lab source `file` and returns what it refuses, in order.
std::vector<SourceFinding> scan_lab_source(std::string_view file, std::string_view text,
                                           const IncludePolicy& policy);

/// The standard library headers lab code may include (every C++20 header but those that
/// start threads, read or write files, or handle signals), e.g. "vector", "cmath".
const std::set<std::string>& allowed_standard_headers();

}  // namespace dp::grader::audit
