#include "dp/error.h"

namespace dp {

const char* Error::what() const noexcept {
  return ranked_message_ ? ranked_message_->c_str() : std::runtime_error::what();
}

void Error::set_rank(int rank) {
  if (rank_ >= 0) return;
  rank_ = rank;
  ranked_message_ = std::make_shared<const std::string>(
      fmt::format("rank {}: {}", rank, std::runtime_error::what()));
}

}  // namespace dp

namespace dp::detail {

void fail_check(const char* file, int line, const char* condition, const std::string& message) {
  throw InvariantError(
      fmt::format("{}:{}: internal check '{}' failed: {}", file, line, condition, message));
}

}  // namespace dp::detail
