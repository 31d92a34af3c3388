// option_checks.cpp: number checks of the dplab commands (see option_checks.h).
#include "option_checks.h"

#include <fmt/format.h>

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

#include "dp/error.h"
#include "dp/launch.h"
#include "dp/tensor.h"

namespace dp::cli {
namespace {

/// `text` as a number, or NaN when it is not one (CLI11 reports the type error itself).
double as_number(const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  return end != text.c_str() && *end == '\0' ? value : std::nan("");
}

}  // namespace

Device select_device(const std::string& name, std::string_view option) {
  if (name == "host") return Device::kHost;
  if (name == "cuda") {
    if (!cuda_compiled() || cuda_device_count() == 0)
      throw Error(fmt::format(
          "{} cuda: {}; use the host ({} host), or the CUDA device emulated in host memory "
          "({} emulated)",
          option,
          cuda_compiled() ? "this process sees no CUDA device (no GPU, no driver, or "
                            "CUDA_VISIBLE_DEVICES hides them)"
                          : "this dplab was built without CUDA",
          option, option));
    return Device::kCuda;
  }
  if (name == "emulated") {
    set_cuda_device_emulated(true);
    return Device::kCuda;
  }
  throw Error(fmt::format(
      "unknown {} '{}': expected 'host', 'cuda' (the GPU) or 'emulated' (the CUDA device "
      "emulated in host memory; the simulated device of --net is --sim-device)",
      option, name));
}

std::size_t parse_byte_size(const std::string& text, std::string_view option) {
  std::size_t value = 0;
  const char* end = text.data() + text.size();
  const auto [rest, status] = std::from_chars(text.data(), end, value);
  std::size_t multiplier = 1;
  if (status == std::errc() && rest + 1 == end) {
    switch (std::toupper(static_cast<unsigned char>(*rest))) {
      case 'K': multiplier = std::size_t{1} << 10; break;
      case 'M': multiplier = std::size_t{1} << 20; break;
      case 'G': multiplier = std::size_t{1} << 30; break;
      default: multiplier = 0; break;
    }
  }
  if (status != std::errc() || value == 0 || multiplier == 0 || (rest != end && rest + 1 != end) ||
      value > std::numeric_limits<std::size_t>::max() / multiplier)
    throw Error(
        fmt::format("{} '{}' is not a size: expected a positive number of bytes, "
                    "optionally with K, M or G (e.g. 256M)",
                    option, text));
  return value * multiplier;
}

CLI::Validator finite_in(double low, double high) {
  return CLI::Validator(
      [low, high](std::string& text) -> std::string {
        const double value = as_number(text);
        if (std::isfinite(value) && value >= low && value <= high) return {};
        return fmt::format("expected a finite number from {} to {}, got {}", low, high, text);
      },
      fmt::format("NUMBER in [{}, {}]", low, high));
}

CLI::Validator positive_finite(double high) {
  return CLI::Validator(
      [high](std::string& text) -> std::string {
        const double value = as_number(text);
        if (std::isfinite(value) && value > 0 && value <= high) return {};
        return fmt::format("expected a finite number above 0 and at most {}, got {}", high, text);
      },
      fmt::format("NUMBER in (0, {}]", high));
}

CLI::Validator whole_number_at_least(int low) {
  return CLI::Validator(
      [low](std::string& text) -> std::string {
        const double value = as_number(text);
        if (value >= low && value <= std::numeric_limits<int>::max() && value == std::floor(value))
          return {};
        return fmt::format("expected a whole number >= {}, got {}", low, text);
      },
      fmt::format("INT >= {}", low));
}

CLI::Validator whole_number_in(int low, int high) {
  return CLI::Validator(
      [low, high](std::string& text) -> std::string {
        const double value = as_number(text);
        if (value >= low && value <= high && value == std::floor(value)) return {};
        return fmt::format("expected a whole number from {} to {}, got {}", low, high, text);
      },
      fmt::format("INT in [{}, {}]", low, high));
}

CLI::Validator nonzero_in_float() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const double value = as_number(text);
        if (!(value != 0 && static_cast<float>(value) == 0)) return {};
        return fmt::format("expected 0 or a number a float can hold (at least {:g}), got {}",
                           std::numeric_limits<float>::denorm_min(), text);
      },
      "");
}

CLI::Validator seed_number() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        std::uint64_t value = 0;
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
        if (!text.empty() && error == std::errc() && end == text.data() + text.size()) return {};
        return fmt::format("expected a whole number from 0 to {}, got '{}'",
                           std::numeric_limits<std::uint64_t>::max(), text);
      },
      "UINT64");
}

CLI::Validator non_empty_path() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        if (!text.empty()) return {};
        return "expected a path, got an empty string";
      },
      "PATH");
}

CLI::Validator world_size_range() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const double value = as_number(text);
        if (value >= 1 && value <= kMaxWorldSize && value == std::floor(value)) return {};
        return fmt::format("expected a number of ranks from 1 to {}, got {}", kMaxWorldSize, text);
      },
      fmt::format("RANKS in [1, {}]", kMaxWorldSize));
}

std::chrono::milliseconds timeout_milliseconds(double seconds, std::string_view option,
                                               std::chrono::milliseconds max) {
  const double max_seconds = std::chrono::duration<double>(max).count();
  // Compared as doubles before any conversion: a cast of 1e16 s or inf to an integer
  // count is undefined behaviour.
  if (!(std::isfinite(seconds) && seconds > 0 && seconds <= max_seconds))
    throw Error(fmt::format("{} must be a number of seconds above 0 and at most {}, got {}", option,
                            max_seconds, seconds));
  const auto milliseconds = static_cast<std::int64_t>(std::ceil(seconds * 1000));
  return std::chrono::milliseconds(std::max<std::int64_t>(milliseconds, 1));
}

}  // namespace dp::cli
