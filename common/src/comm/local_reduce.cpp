// local_reduce.cpp: the local backend's arithmetic. A collective reduces each element over
// the ranks' buffers in rank order, ((x_0 + x_1) + x_2) + ..., whatever the rank count and
// whichever thread does the work, so every rank ends with the same bits on every run (see
// local_world.h). bfloat16 and float16 round each partial sum to their type (the rule of
// `ReduceOp` in comm.h; the arithmetic is in comm/reduce_arithmetic.h).
#include <cstring>

#include "comm/local_world.h"
#include "comm/reduce_arithmetic.h"

namespace dp::detail::local {
namespace {

/// dst[k] = combine(src_0[k], ..., src_{p-1}[k]) in rank order, for every destination;
/// destinations may alias sources.
template <typename T>
void reduce_in_rank_order(std::span<T* const> destinations, std::span<const T* const> sources,
                          std::size_t count, ReduceOp op) {
  // Blocks are combined in a small buffer that stays in L1 cache and then stored, so every
  // source is read before its block of a destination (possibly the same memory) is
  // written. Each element is ((s0 + s1) + s2) + ..., whatever the rank count.
  constexpr std::size_t kBlock = 2048;
  T block[kBlock];
  const std::size_t parts = sources.size();
  for (std::size_t start = 0; start < count; start += kBlock) {
    const std::size_t length = std::min(kBlock, count - start);
    const T* first = sources[0] + start;
    for (std::size_t k = 0; k < length; ++k) block[k] = first[k];
    for (std::size_t s = 1; s < parts; ++s) {
      const T* source = sources[s] + start;
      if (op == ReduceOp::kMax) {
        for (std::size_t k = 0; k < length; ++k) block[k] = reduce_max(block[k], source[k]);
      } else {
        for (std::size_t k = 0; k < length; ++k) block[k] = reduce_add(block[k], source[k]);
      }
    }
    if (op == ReduceOp::kAvg) {
      const int divisor = static_cast<int>(parts);
      for (std::size_t k = 0; k < length; ++k) block[k] = reduce_average(block[k], divisor);
    }
    for (T* destination : destinations) std::memcpy(destination + start, block, length * sizeof(T));
  }
}

template <typename T>
void reduce_typed(std::span<const MutableBuffer> destinations, std::size_t dst_offset,
                  std::span<const ConstBuffer> sources, std::size_t src_offset, std::size_t count,
                  ReduceOp op) {
  // On the stack: this runs for every piece of a small collective.
  std::array<T*, kMaxWorldSize> outputs;
  for (std::size_t d = 0; d < destinations.size(); ++d)
    outputs[d] = static_cast<T*>(destinations[d].data) + dst_offset;
  std::array<const T*, kMaxWorldSize> inputs;
  for (std::size_t s = 0; s < sources.size(); ++s)
    inputs[s] = static_cast<const T*>(sources[s].data) + src_offset;
  reduce_in_rank_order<T>(std::span<T* const>(outputs.data(), destinations.size()),
                          std::span<const T* const>(inputs.data(), sources.size()), count, op);
}

}  // namespace

Chunk chunk_of(std::size_t count, int parts, int index) {
  return {count * static_cast<std::size_t>(index) / static_cast<std::size_t>(parts),
          count * static_cast<std::size_t>(index + 1) / static_cast<std::size_t>(parts)};
}

/// Reduces elements [src_offset, src_offset + count) of every source into elements
/// [dst_offset, dst_offset + count) of every destination.
void reduce_chunk(std::span<const MutableBuffer> destinations, std::size_t dst_offset,
                  std::span<const ConstBuffer> sources, std::size_t src_offset, std::size_t count,
                  ReduceOp op) {
  if (count == 0) return;
  if (on_device(sources[0])) {
    reduce_device_chunk(destinations, dst_offset, sources, src_offset, count, op);
    return;
  }
  switch (sources[0].type) {
    case DataType::kFloat32:
      reduce_typed<float>(destinations, dst_offset, sources, src_offset, count, op);
      return;
    case DataType::kInt32:
      reduce_typed<std::int32_t>(destinations, dst_offset, sources, src_offset, count, op);
      return;
    case DataType::kBFloat16:
      reduce_typed<BFloat16>(destinations, dst_offset, sources, src_offset, count, op);
      return;
    case DataType::kFloat16:
      reduce_typed<Float16>(destinations, dst_offset, sources, src_offset, count, op);
      return;
    case DataType::kUInt8: break;
  }
  DP_CHECK(false, "reduction of {} reached the kernel", to_string(sources[0].type));
}

void copy_elements(MutableBuffer dst, std::size_t dst_offset, ConstBuffer src,
                   std::size_t src_offset, std::size_t count) {
  if (count == 0) return;
  if (on_device(dst) || on_device(src)) {
    copy_device_elements(dst, dst_offset, src, src_offset, count);
    return;
  }
  const std::size_t size = element_size(dst.type);
  std::memcpy(static_cast<char*>(dst.data) + dst_offset * size,
              static_cast<const char*>(src.data) + src_offset * size, count * size);
}

}  // namespace dp::detail::local
