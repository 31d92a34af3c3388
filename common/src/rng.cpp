#include "dp/rng.h"

#include <cmath>
#include <numbers>

#include "dp/error.h"

namespace dp {

std::array<std::uint32_t, 4> philox4x32(std::array<std::uint32_t, 4> counter,
                                        std::array<std::uint32_t, 2> key) {
  // Constants from Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC11).
  constexpr std::uint32_t kMultiplier0 = 0xD2511F53;
  constexpr std::uint32_t kMultiplier1 = 0xCD9E8D57;
  constexpr std::uint32_t kWeyl0 = 0x9E3779B9;
  constexpr std::uint32_t kWeyl1 = 0xBB67AE85;
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t product0 = std::uint64_t{kMultiplier0} * counter[0];
    const std::uint64_t product1 = std::uint64_t{kMultiplier1} * counter[2];
    counter = {static_cast<std::uint32_t>(product1 >> 32) ^ counter[1] ^ key[0],
               static_cast<std::uint32_t>(product1),
               static_cast<std::uint32_t>(product0 >> 32) ^ counter[3] ^ key[1],
               static_cast<std::uint32_t>(product0)};
    key[0] += kWeyl0;
    key[1] += kWeyl1;
  }
  return counter;
}

std::uint32_t CounterRng::next_u32() {
  // Counter = (block number, stream); key = seed. One block yields four outputs.
  const std::uint64_t block = position_ / 4;
  if (block != cached_block_) {
    block_ =
        philox4x32({static_cast<std::uint32_t>(block), static_cast<std::uint32_t>(block >> 32),
                    static_cast<std::uint32_t>(stream_), static_cast<std::uint32_t>(stream_ >> 32)},
                   {static_cast<std::uint32_t>(seed_), static_cast<std::uint32_t>(seed_ >> 32)});
    cached_block_ = block;
  }
  return block_[position_++ % 4];
}

float CounterRng::uniform() {
  // The top 24 bits give every float in [0, 1) with spacing 2^-24.
  return static_cast<float>(next_u32() >> 8) * 0x1.0p-24f;
}

float CounterRng::normal() {
  const float u1 = 1.0f - uniform();  // (0, 1]: log is finite
  const float u2 = uniform();
  return std::sqrt(-2.0f * std::log(u1)) * std::cos(2.0f * std::numbers::pi_v<float> * u2);
}

std::uint64_t CounterRng::below(std::uint64_t bound) {
  if (bound == 0) throw Error("CounterRng::below needs a positive bound, got 0");
  // Rejection sampling on 64 bits removes the modulo bias.
  const std::uint64_t limit = ~std::uint64_t{0} - (~std::uint64_t{0} % bound);
  while (true) {
    const std::uint64_t value = (std::uint64_t{next_u32()} << 32) | next_u32();
    if (value < limit) return value % bound;
  }
}

void CounterRng::seek(std::uint64_t position) {
  position_ = position;
}

}  // namespace dp
