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

#include <string_view>
#include <type_traits>

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

/// Throws `dp::Error` naming `layer` when 16-bit `tensor` lives on a CUDA device: the 16-bit
/// layers run on the host and the emulated device only (no 16-bit kernels yet).
void require_16bit_off_gpu(std::string_view layer, const Tensor& tensor);

/// Fills host tensor `value` with `draw()` once per element, in order: a float32 tensor
/// directly, a 16-bit one with the same float32 draws rounded to nearest even (so a 16-bit
/// model starts from its float32 twin rounded). Not charged to the clock.
template <typename Draw>
requires std::is_invocable_r_v<float, Draw&>
void fill_drawn(Tensor& value, Draw&& draw) {
  if (value.dtype() == DataType::kFloat32) {
    for (float& element : value.span()) element = draw();
    return;
  }
  Tensor drawn(value.shape(), MemoryCategory::kOther);
  for (float& element : drawn.span()) element = draw();
  convert_uncharged(drawn.view(), value.view());
}

}  // namespace dp::detail
