// tensor_ops.h: element-wise operations on tensor views (copy, convert, fill, scale, divide,
// add, axpy, dot, norm).
//
// Lab code does its arithmetic on gradients and parameters with these operations instead
// of loops over raw memory: each one checks its operands (sizes, devices), is charged to
// the rank's simulated clock as one compute op, and dispatches on the device the views
// live on, so the same lab code runs on the host and on a GPU. What a compute op costs is
// the simulation's `DeviceModel` (dp/clock.h): on a real device's model, a launch plus its
// bytes over the memory bandwidth (the roofline), so a copy into a flat buffer costs time,
// as it does on a GPU; on a model of free compute (infinite rates, no launch cost), which
// lab 3's all-reduce and speed measurements use, nothing, so that what they time is
// communication alone.
//
// Every operation visits the elements in index order and rounds each result once, exactly
// as the loop in its comment would: results are reproducible bit for bit. `divide(x, 3)`
// and `scale(x, 1.0f / 3)` are different operations that can differ in the last bit.
//
// The operands of an operation live on one device (`copy` excepted: it moves elements
// between host and device), else it throws `dp::Error`. On a CUDA device the element-wise
// operations give bitwise the host's results; `dot` and `norm` add the same exact double
// products in another order, so they agree with the host within 2 (n - 1) 2^-53
// sum|x[i] y[i]| (common/src/cuda/kernels.cu derives it), and are reproducible bit for bit
// from run to run.
//
// Element types (dp/tensor.h): float32 unless a view says otherwise. `copy` moves elements of
// one type and `convert` changes it: exact to float32, rounded to nearest even to bfloat16 and
// float16 (dp/float16.h's rules, NaNs and infinities included, and bitwise the same on a CUDA
// device, which runs the same bit arithmetic). `fill` and `all_finite` take every type. `add`
// and `axpy` take a 16-bit x into a float32 y, widening each x[i] exactly and adding in float32
// (the accumulation of mixed precision: 16-bit gradients into float32 master gradients); the
// result is bitwise convert-then-add. The other operations, and a 16-bit y, are float32's: any
// other type throws `dp::Error` naming the operation, the types seen and what to do instead.
//
// Example (averaging with a flat buffer):
//
//   std::size_t offset = 0;
//   for (dp::Parameter* p : model.parameters()) {          // pack
//     dp::copy(p->grad.view(), flat.view(offset, p->grad.size()));
//     offset += p->grad.size();
//   }
//   comm.allreduce(flat.view(), dp::ReduceOp::kSum)->wait();
//   dp::divide(flat.view(), static_cast<float>(comm.size()));
#pragma once

#include "dp/tensor.h"

namespace dp {

/// x[i] = value for every i, of any type: `value` rounded once to a 16-bit x's type.
void fill(TensorView x, float value);

/// destination[i] = source[i], across devices too (host to device, device to host).
/// Throws `dp::Error` unless the sizes and the element types are equal (`convert` changes
/// the type); the views must not overlap (unless they are the same elements). Returns when a
/// host destination holds the elements.
void copy(ConstTensorView source, TensorView destination);

/// destination[i] = source[i] converted to the destination's element type: exact to float32
/// (and between equal types), rounded to nearest, ties to even, to bfloat16 or float16 with
/// dp/float16.h's special cases (a NaN stays a NaN, float16 overflows to infinity from 65520
/// on and has subnormals down to 2^-24); bfloat16 to float16 and back through float32, which
/// rounds once. Throws `dp::Error` unless the sizes are equal and both views live on one
/// device (`copy` moves elements between devices); the views must not overlap (unless they
/// are the same elements of one type).
void convert(ConstTensorView source, TensorView destination);

/// x[i] = factor * x[i] (float32).
void scale(TensorView x, float factor);

/// x[i] = x[i] / divisor (float32; a division, rounded once: not a multiplication by
/// 1/divisor).
void divide(TensorView x, float divisor);

/// y[i] = y[i] + x[i], y float32 and x of any type (widened exactly, added in float32).
/// Throws `dp::Error` unless the sizes are equal.
void add(ConstTensorView x, TensorView y);

/// y[i] = y[i] + alpha * x[i] (the product rounded, then the sum), y float32 and x of any
/// type (widened exactly first). Throws `dp::Error` unless the sizes are equal.
void axpy(float alpha, ConstTensorView x, TensorView y);

/// The sum of x[i] * y[i] (float32), accumulated in double precision in index order (on a
/// device, in another order: see the top of this file). Throws `dp::Error` unless the sizes
/// are equal.
double dot(ConstTensorView x, ConstTensorView y);

/// The Euclidean norm sqrt(sum of x[i]^2) (float32), accumulated in double precision in
/// index order (on a device, in another order: see the top of this file).
double norm(ConstTensorView x);

/// True when every element, of any type, is finite (no NaN, no infinity).
bool all_finite(ConstTensorView x);

}  // namespace dp
