// tensor.h: a contiguous float32 array with a shape, charged to a rank's memory, and
// views of a range of its elements.
//
// Tensors are move-only, so every copy of a large array is visible in the code
// (`clone()`). Memory comes from the rank's caching allocator and is recorded by its
// `MemoryTracker` under the category given at construction.
//
// A `TensorView` names elements [offset, offset + count) of a tensor without owning them:
// a parameter's gradient, or one parameter's place in a flat buffer. The element-wise
// operations of dp/tensor_ops.h and the communicator take views, so lab code that works
// on views never touches raw memory and runs unchanged wherever the tensor lives.
//
// Example:
//
//   dp::Tensor x({32, 64});                  // (B, D) activations, zero-filled
//   x.at(0, 3) = 1.5f;
//   std::span<float> flat = x.span();        // all 2048 elements
//   dp::Tensor w = dp::Tensor::uninitialized({256, 64}, dp::MemoryCategory::kParameters);
//   dp::TensorView row1 = x.view(64, 64);    // elements [64, 128): the second row
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dp/comm.h"
#include "dp/memory.h"

namespace dp {

namespace detail {
/// Throws `dp::Error`, naming `function`, unless elements [offset, offset + count) lie
/// inside an array of `size` elements.
void check_range(std::string_view function, std::size_t offset, std::size_t count,
                 std::size_t size);
}  // namespace detail

/// Where a tensor's elements live. Only host memory exists so far; CUDA devices come with
/// the GPU backend, and every operation on views checks the device it is given.
enum class Device {
  kHost,  ///< the process's own memory
};

/// A short name, e.g. "host".
std::string_view to_string(Device device);

/// A writable, non-owning view of `size()` contiguous float32 elements on one device.
///
/// A view does not keep its tensor alive: it is valid while the tensor exists and is not
/// moved from or reassigned.
class TensorView {
 public:
  /// An empty view.
  TensorView() = default;
  /// Views `size` elements starting at `data` on `device`.
  TensorView(float* data, std::size_t size, Device device = Device::kHost)
      : data_(data), size_(size), device_(device) {}

  /// The first element (device memory when the view is on a device).
  float* data() const { return data_; }
  /// Number of elements.
  std::size_t size() const { return size_; }
  /// Size in bytes.
  std::size_t bytes() const { return size_ * sizeof(float); }
  /// True when the view holds no elements.
  bool empty() const { return size_ == 0; }
  /// Where the elements live.
  Device device() const { return device_; }
  /// Elements [offset, offset + count) of this view; throws `dp::Error` past its end.
  TensorView slice(std::size_t offset, std::size_t count) const;
  /// The elements as a host span; throws `dp::Error` for a view of device memory.
  std::span<float> host_span() const;
  /// The same elements as a communication buffer, for the communicator's calls.
  operator MutableBuffer() const { return {data_, size_, DataType::kFloat32}; }  // NOLINT
  /// The same elements as a read-only communication buffer.
  operator ConstBuffer() const { return {data_, size_, DataType::kFloat32}; }  // NOLINT

 private:
  float* data_ = nullptr;
  std::size_t size_ = 0;
  Device device_ = Device::kHost;
};

/// A read-only, non-owning view of `size()` contiguous float32 elements on one device.
class ConstTensorView {
 public:
  /// An empty view.
  ConstTensorView() = default;
  /// Views `size` elements starting at `data` on `device`.
  ConstTensorView(const float* data, std::size_t size, Device device = Device::kHost)
      : data_(data), size_(size), device_(device) {}
  /// The same elements, read-only.
  ConstTensorView(const TensorView& view)  // NOLINT(google-explicit-constructor)
      : data_(view.data()), size_(view.size()), device_(view.device()) {}

  /// The first element (device memory when the view is on a device).
  const float* data() const { return data_; }
  /// Number of elements.
  std::size_t size() const { return size_; }
  /// Size in bytes.
  std::size_t bytes() const { return size_ * sizeof(float); }
  /// True when the view holds no elements.
  bool empty() const { return size_ == 0; }
  /// Where the elements live.
  Device device() const { return device_; }
  /// Elements [offset, offset + count) of this view; throws `dp::Error` past its end.
  ConstTensorView slice(std::size_t offset, std::size_t count) const;
  /// The elements as a host span; throws `dp::Error` for a view of device memory.
  std::span<const float> host_span() const;
  /// The same elements as a read-only communication buffer.
  operator ConstBuffer() const { return {data_, size_, DataType::kFloat32}; }  // NOLINT

 private:
  const float* data_ = nullptr;
  std::size_t size_ = 0;
  Device device_ = Device::kHost;
};

/// A contiguous row-major float32 array with a shape.
class Tensor {
 public:
  /// An empty tensor: no shape, no elements.
  Tensor() = default;
  /// A zero-filled tensor of `shape`, charged to this thread's rank under `category`.
  explicit Tensor(std::vector<std::int64_t> shape,
                  MemoryCategory category = MemoryCategory::kActivations);
  /// A tensor whose elements are left as the allocator hands them over (for outputs that
  /// are overwritten at once).
  static Tensor uninitialized(std::vector<std::int64_t> shape,
                              MemoryCategory category = MemoryCategory::kActivations);
  /// A 1-D tensor holding a copy of `values`.
  static Tensor from(std::span<const float> values,
                     MemoryCategory category = MemoryCategory::kActivations);

  /// Takes over `other`'s memory; `other` becomes empty.
  Tensor(Tensor&& other) noexcept;
  /// Releases this tensor's memory and takes over `other`'s; `other` becomes empty.
  Tensor& operator=(Tensor&& other) noexcept;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  ~Tensor();

  /// A deep copy with the same shape; `category` defaults to this tensor's.
  Tensor clone() const;
  /// A deep copy charged under another category.
  Tensor clone(MemoryCategory category) const;

  /// The shape, outermost dimension first.
  const std::vector<std::int64_t>& shape() const { return shape_; }
  /// Number of dimensions.
  std::size_t rank() const { return shape_.size(); }
  /// Extent of dimension `d` (bounds-checked).
  std::int64_t dim(std::size_t d) const;
  /// Number of elements.
  std::size_t size() const { return size_; }
  /// Size in bytes.
  std::size_t bytes() const { return size_ * sizeof(float); }
  /// True when the tensor holds no elements.
  bool empty() const { return size_ == 0; }
  /// The category this tensor is charged under.
  MemoryCategory category() const { return category_; }

  /// Where the elements live.
  Device device() const { return Device::kHost; }
  /// A view of every element.
  TensorView view() { return {data_, size_, device()}; }
  /// A read-only view of every element.
  ConstTensorView view() const { return {data_, size_, device()}; }
  /// A view of elements [offset, offset + count) of the flat array; throws `dp::Error`
  /// past the end.
  TensorView view(std::size_t offset, std::size_t count) {
    detail::check_range("Tensor::view", offset, count, size_);
    return view().slice(offset, count);
  }
  /// A read-only view of elements [offset, offset + count); throws past the end.
  ConstTensorView view(std::size_t offset, std::size_t count) const {
    detail::check_range("Tensor::view", offset, count, size_);
    return view().slice(offset, count);
  }

  /// Pointer to the first element.
  float* data() { return data_; }
  /// Pointer to the first element (read-only).
  const float* data() const { return data_; }
  /// All elements, flat.
  std::span<float> span() { return {data_, size_}; }
  /// All elements, flat (read-only).
  std::span<const float> span() const { return {data_, size_}; }
  /// Element `i` of the flat array.
  float& operator[](std::size_t i) { return data_[i]; }
  /// Element `i` of the flat array (read-only).
  float operator[](std::size_t i) const { return data_[i]; }
  /// Element (row, col) of a 2-D tensor.
  float& at(std::int64_t row, std::int64_t col) { return data_[row * shape_[1] + col]; }
  /// Element (row, col) of a 2-D tensor (read-only).
  float at(std::int64_t row, std::int64_t col) const { return data_[row * shape_[1] + col]; }

  /// Sets every element to `value`.
  void fill(float value);
  /// Changes the shape to one with the same number of elements.
  void reshape(std::vector<std::int64_t> shape);
  /// The shape as text, e.g. "(32, 64)".
  std::string shape_string() const;

 private:
  void allocate(std::vector<std::int64_t> shape, MemoryCategory category);
  void release();

  std::vector<std::int64_t> shape_;
  std::size_t size_ = 0;
  float* data_ = nullptr;
  MemoryCategory category_ = MemoryCategory::kActivations;
  std::shared_ptr<RankMemory> owner_;  // the rank charged for this tensor
};

/// The number of elements of `shape`; throws `dp::Error` on a negative extent.
std::size_t element_count(const std::vector<std::int64_t>& shape);
/// `shape` as text, e.g. "(32, 64)".
std::string shape_to_string(const std::vector<std::int64_t>& shape);

}  // namespace dp
