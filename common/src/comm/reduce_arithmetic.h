// reduce_arithmetic.h: one step of a reduction, per element type (internal). The backends
// that add on the host (the local backend and its emulated device, the emulated nccl
// backend, the mpi backend's rank-order sums) combine through these functions, so that they
// agree bit for bit, and the CUDA kernel of comm_kernels.cu does the same arithmetic.
//
// float32 and int32 use the C++ operators. bfloat16 and float16 follow the rule comm.h
// states at `ReduceOp`, NCCL's (src/device/reduce_kernel.h): every step converts both
// operands to float32, operates once in float32 and rounds the result to the 16-bit type,
// so a sum over p ranks rounds after each of its p - 1 additions.
#pragma once

#include <cstdint>

#include "dp/comm.h"
#include "dp/float16.h"
#include "element_types.h"

namespace dp::detail {

/// running + next, one step of a sum.
inline float reduce_add(float running, float next) {
  return running + next;
}
/// running + next, one step of a sum.
inline std::int32_t reduce_add(std::int32_t running, std::int32_t next) {
  return running + next;
}
/// running + next added in float32 and rounded to bfloat16 (nearest even).
inline BFloat16 reduce_add(BFloat16 running, BFloat16 next) {
  return to_bfloat16(to_float(running) + to_float(next));
}
/// running + next added in float32 and rounded to float16 (nearest even; past 65504 an
/// infinity).
inline Float16 reduce_add(Float16 running, Float16 next) {
  return to_float16(to_float(running) + to_float(next));
}

/// The value a maximum compares for an int32: the element itself.
inline std::int32_t compared_value(std::int32_t value) {
  return value;
}
/// The value a maximum compares for a float type: its exact float32 value (`widen`).
template <typename T>
float compared_value(T value) {
  return widen(value);
}

/// One step of a maximum, std::max's rule: `running` unless `next` is greater, so on ties
/// (+0 and -0 included) and NaN the running value stays. Exact: one operand's bits.
template <typename T>
T reduce_max(T running, T next) {
  return compared_value(running) < compared_value(next) ? next : running;
}

/// The second half of ReduceOp::kAvg: `sum` / `parts`.
inline float reduce_average(float sum, int parts) {
  return sum / static_cast<float>(parts);
}
/// The second half of ReduceOp::kAvg: `sum` / `parts` (truncated toward zero).
inline std::int32_t reduce_average(std::int32_t sum, int parts) {
  return sum / parts;
}
/// The second half of ReduceOp::kAvg: `sum` / `parts` divided in float32 and rounded once to
/// bfloat16 (the correctly rounded quotient).
inline BFloat16 reduce_average(BFloat16 sum, int parts) {
  return to_bfloat16(to_float(sum) / static_cast<float>(parts));
}
/// The second half of ReduceOp::kAvg: `sum` / `parts` divided in float32 and rounded once to
/// float16 (the correctly rounded quotient).
inline Float16 reduce_average(Float16 sum, int parts) {
  return to_float16(to_float(sum) / static_cast<float>(parts));
}

/// One step of `op` (kSum and kAvg add; the average divides once at the end).
template <typename T>
T reduce_step(T running, T next, ReduceOp op) {
  return op == ReduceOp::kMax ? reduce_max(running, next) : reduce_add(running, next);
}

}  // namespace dp::detail
