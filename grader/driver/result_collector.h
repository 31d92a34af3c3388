// result_collector.h: turns the bytes that arrive on a run's results channel into each
// rank's `RankReport`, keeping only lines that carry the run's token (see result_channel.h
// for the format) and at most `channel::kMaxResultBytes` in all.
//
// Example:
//
//   ResultCollector collector(token, /*ranks=*/2);
//   collector.add(1, bytes_read_from_rank1_fifo);
//   ...
//   collector.finish();
//   const RankReport& rank1 = collector.ranks()[1];
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "runner.h"

namespace dp::grader {

/// Collects the results channel's lines of every rank of one run.
class ResultCollector {
 public:
  /// Accepts lines that open with `token` from `ranks` ranks.
  ResultCollector(std::string token, int ranks);

  /// Takes the next bytes from rank `rank`'s FIFO (any split into lines).
  void add(int rank, std::string_view bytes);
  /// Ends the input: an unfinished last line of a rank is ignored (counted as malformed).
  void finish();

  /// What each rank reported, by rank.
  const std::vector<RankReport>& ranks() const { return ranks_; }
  /// Complete lines ignored because they did not open with the token.
  std::size_t lines_without_token() const { return lines_without_token_; }
  /// Lines ignored although they had the token: not a known event, or too long.
  std::size_t malformed_lines() const { return malformed_lines_; }
  /// Bytes ignored because the run had already sent `channel::kMaxResultBytes`.
  std::size_t ignored_bytes() const { return ignored_bytes_; }

 private:
  void handle_line(int rank, std::string_view line);
  bool handle_event(RankReport& report, std::string_view text);

  std::string token_;
  std::vector<RankReport> ranks_;
  std::vector<std::string> partial_lines_;  ///< per rank: bytes after its last newline
  std::vector<bool> in_long_line_;  ///< per rank: dropping a line longer than the driver reads
  std::size_t accepted_bytes_ = 0;
  std::size_t lines_without_token_ = 0;
  std::size_t malformed_lines_ = 0;
  std::size_t ignored_bytes_ = 0;
};

}  // namespace dp::grader
