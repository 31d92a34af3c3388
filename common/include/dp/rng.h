// rng.h: deterministic, counter-based random numbers.
//
// A counter-based generator (Philox4x32-10, Salmon et al., SC11) computes the i-th
// random number of a stream directly from (seed, stream, i). Every rank can therefore
// draw the same initial weights, or its own data, without talking to the others, and a
// result never depends on how many numbers were drawn elsewhere.
//
// Example:
//
//   dp::CounterRng init(/*seed=*/42, /*stream=*/parameter_index);  // same on every rank
//   float w = init.uniform(-bound, bound);
//   dp::CounterRng noise(42, 1000 + comm.rank());                   // different per rank
#pragma once

#include <array>
#include <cstdint>

namespace dp {

/// Philox4x32-10: four 32-bit outputs from a 128-bit counter and a 64-bit key.
std::array<std::uint32_t, 4> philox4x32(std::array<std::uint32_t, 4> counter,
                                        std::array<std::uint32_t, 2> key);

/// A stream of random numbers identified by (seed, stream); position `i` of a stream is
/// the same on every machine and every rank.
class CounterRng {
 public:
  /// The stream `stream` of generator `seed`, positioned at its start.
  CounterRng(std::uint64_t seed, std::uint64_t stream) : seed_(seed), stream_(stream) {}

  /// The next 32 uniformly distributed bits.
  std::uint32_t next_u32();
  /// A float uniformly distributed in [0, 1).
  float uniform();
  /// A float uniformly distributed in [low, high).
  float uniform(float low, float high) { return low + (high - low) * uniform(); }
  /// A standard normal float (Box-Muller).
  float normal();
  /// An integer uniformly distributed in [0, bound); bound must be positive.
  std::uint64_t below(std::uint64_t bound);
  /// Moves to position `position` of the stream (in 32-bit outputs).
  void seek(std::uint64_t position);
  /// The current position in 32-bit outputs.
  std::uint64_t position() const { return position_; }

 private:
  std::uint64_t seed_;
  std::uint64_t stream_;
  std::uint64_t position_ = 0;
  std::uint64_t cached_block_ = ~std::uint64_t{0};
  std::array<std::uint32_t, 4> block_{};
};

}  // namespace dp
