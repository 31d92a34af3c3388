// Fuzz target: CSV data sets (dplab train --dataset csv:PATH). Any input must give a data
// set or a dp::Error.
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "dp/error.h"
#include "parsers.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::istringstream text(std::string(reinterpret_cast<const char*>(data), size));
  try {
    dp::detail::parse_csv(text, "fuzz.csv", 0.5f, "fuzz");
  } catch (const dp::Error&) {
    // The expected answer to a malformed file; anything else escapes and is a finding.
  }
  return 0;
}
