#include "dp/error.h"

namespace dp::detail {

void fail_check(const char* file, int line, const char* condition, const std::string& message) {
  throw InvariantError(
      fmt::format("{}:{}: internal check '{}' failed: {}", file, line, condition, message));
}

}  // namespace dp::detail
