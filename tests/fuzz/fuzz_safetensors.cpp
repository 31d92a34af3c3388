// Fuzz target: safetensors files (dp::load_safetensors reads checkpoints users pass with
// --resume, and files other tools wrote). Any input must give a checkpoint or a dp::Error.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "dp/error.h"
#include "parsers.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    dp::detail::parse_safetensors(std::string_view(reinterpret_cast<const char*>(data), size),
                                  "fuzz.safetensors", dp::MemoryCategory::kOther);
  } catch (const dp::Error&) {
    // The expected answer to a malformed file; anything else escapes and is a finding.
  }
  return 0;
}
