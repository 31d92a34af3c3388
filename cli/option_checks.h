// option_checks.h: the checks every dplab command applies to its numbers before it starts.
//
// A number option is checked when it is parsed, so that a typo costs an error message
// naming the option, never undefined behaviour, a silent default or an hour of work:
// `--lr inf`, `--hang-timeout nan`, `-n -1` and `--timeout 1e16` are all refused.
//
// Example:
//
//   command->add_option("--lr", lr)->check(finite_in(0, 1e6));
//   command->add_option("-n", ranks)->check(world_size_range());
//   std::chrono::milliseconds limit = timeout_milliseconds(seconds, "--timeout", kMax);
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstddef>
#include <string>
#include <string_view>

#include "dp/comm.h"

namespace dp::cli {

/// The device that `--device` names: "host", "cuda" (the GPU), or "emulated": the CUDA
/// device emulated in host memory (dp::set_cuda_device_emulated, which this turns on), for
/// running device code on a machine without a GPU. Throws `dp::Error` naming `option` and
/// the choices for another name, and for "cuda" in a build without CUDA or a process that
/// sees no GPU.
Device select_device(const std::string& name, std::string_view option = "--device");

/// `text`, the value of option `option`, as bytes: "8", "4K", "256M", "1G" (binary
/// multiples). Throws `dp::Error` naming the option unless it is a positive size.
std::size_t parse_byte_size(const std::string& text, std::string_view option);

/// A CLI11 check: the value is a finite number in [low, high] (NaN and infinities fail).
CLI::Validator finite_in(double low, double high);

/// A CLI11 check: the value is a finite number > 0 and <= high.
CLI::Validator positive_finite(double high);

/// A CLI11 check: a whole number >= low (and within int).
CLI::Validator whole_number_at_least(int low);

/// A CLI11 check for an option stored as a float: a value other than 0 that rounds to 0 in
/// float (e.g. --lr 1e-50) fails, where it would silently become 0 and change the run.
CLI::Validator nonzero_in_float();

/// A CLI11 check of a 64-bit seed: decimal digits of a number from 0 to 2^64-1. CLI11 alone
/// would wrap "-1" to 2^64-1 or saturate a larger number; `grade --seed` and `train --seed`
/// share it so that one seed means the same in both.
CLI::Validator seed_number();

/// A CLI11 check of a path option: not empty. An empty path is a mistake (an unset shell
/// variable), never "no file": it would otherwise be ignored or name the current directory.
CLI::Validator non_empty_path();

/// A CLI11 check: a whole number from low to high. For counts that arithmetic combines
/// (warm-up plus timed iterations): a bound well inside int keeps every sum exact.
CLI::Validator whole_number_in(int low, int high);

/// A CLI11 check: a whole number of ranks from 1 to dp::kMaxWorldSize.
CLI::Validator world_size_range();

/// `seconds`, the value of the timeout option `option`, as whole milliseconds (at least 1).
/// Throws `dp::Error` naming the option unless it is finite, positive and at most `max`.
std::chrono::milliseconds timeout_milliseconds(double seconds, std::string_view option,
                                               std::chrono::milliseconds max);

}  // namespace dp::cli
