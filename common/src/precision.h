// precision.h (internal): the conversions of mixed-precision arithmetic inside the runtime's
// own operations (the 16-bit layers, the master-weight optimizer), where an operation is
// already one op on the rank's clock, so these are not charged to it again (dp::convert
// would be: a nested compute op would count the time twice).
//
// The rule of every 16-bit operation of the runtime: its inputs are widened to float32
// exactly, it computes in float32 (the same code, BLAS sgemm included, as a float32 model),
// and each result is rounded once to the 16-bit type, to nearest even (dp/float16.h). A
// gradient is accumulated the same way: grad = round(widen(grad) + contribution).
//
// On the host and the emulated device these are loops over dp/float16.h; on a GPU the
// conversion kernel of dp::convert (cuda::convert, the same bit arithmetic), so the results
// are the host's bit for bit.
#pragma once

#include "dp/tensor.h"

namespace dp::detail {

/// destination[i] = source[i] converted to the destination's type (exact to float32, rounded
/// to nearest even to 16 bits); sizes and devices must agree (checked). Not charged to the
/// clock.
void convert_uncharged(ConstTensorView source, TensorView destination);

/// A float32 copy of `tensor` (the same shape, on its device, charged under `category`):
/// the tensor itself widened exactly. Not charged to the clock.
Tensor widened(const Tensor& tensor, MemoryCategory category = MemoryCategory::kActivations);

/// A copy of float32 `tensor` rounded to `type` (same shape and device), charged under
/// `category`; for float32, a plain copy. Not charged to the clock.
Tensor rounded(const Tensor& tensor, DataType type,
               MemoryCategory category = MemoryCategory::kActivations);

/// destination[i] = round(widen(destination[i]) + contribution[i]) for a 16-bit destination,
/// destination[i] += contribution[i] for a float32 one; `contribution` is float32. Not charged
/// to the clock.
void accumulate_rounded(ConstTensorView contribution, TensorView destination);

/// x[i] = factor * x[i] on float32 `x`, wherever it lives. Not charged to the clock.
void scale_uncharged(TensorView x, float factor);

}  // namespace dp::detail
