// Fuzz target: the index.json of a sharded checkpoint (dp/sharded_checkpoint.h), which a
// user may copy between machines or edit by hand. Any input must give a plan or a dp::Error,
// in memory bounded by the input: the shapes and offsets it states are checked, never
// allocated.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "dp/error.h"
#include "parsers.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    dp::detail::parse_checkpoint_index(std::string_view(reinterpret_cast<const char*>(data), size),
                                       "fuzz-index.json");
  } catch (const dp::Error&) {
    // The expected answer to a malformed index; anything else escapes and is a finding.
  }
  return 0;
}
