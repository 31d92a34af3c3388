// Fuzz target: IDX image and label files (dplab train --dataset idx:IMAGES,LABELS). The
// first byte says where the input splits into the two files (as a fraction of the rest),
// so that both files and their agreement are fuzzed. Any input must give a data set or a
// dp::Error.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "dp/error.h"
#include "parsers.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  const std::size_t split = rest.size() * data[0] / 255;
  try {
    dp::detail::parse_idx(rest.substr(0, split), rest.substr(split), "fuzz-images.idx",
                          "fuzz-labels.idx");
  } catch (const dp::Error&) {
    // The expected answer to a malformed file; anything else escapes and is a finding.
  }
  return 0;
}
