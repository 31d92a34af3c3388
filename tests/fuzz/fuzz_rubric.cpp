// Fuzz target: rubric files (grader/<lab>/rubric.json, which instructors edit by hand).
// Any input must give a rubric or a dp::Error.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "dp/error.h"
#include "rubric.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    dp::grader::parse_rubric(std::string_view(reinterpret_cast<const char*>(data), size),
                             "fuzz-rubric.json");
  } catch (const dp::Error&) {
    // The expected answer to a malformed rubric; anything else escapes and is a finding.
  }
  return 0;
}
