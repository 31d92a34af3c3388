// tensor.h: a contiguous float32 array with a shape, charged to a rank's memory, and
// views of a range of its elements.
//
// Tensors are move-only, so every copy of a large array is visible in the code
// (`clone()`, `to()`). Memory comes from the rank's caching allocator and is recorded by
// its `MemoryTracker` under the category given at construction.
//
// A tensor lives on the host or, in a build with CUDA, on the calling thread's current CUDA
// device (`Device::kCuda`). Device bytes are charged to the same per-category accounts as
// host bytes, so the memory the ZeRO labs are graded on is counted wherever it lives. The
// host accessors (`data()`, `span()`, `operator[]`, `at()`) throw `dp::Error` for a device
// tensor: code that must run on both works on views with the operations of dp/tensor_ops.h,
// and moves data across with `to()` or `dp::copy`.
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
//   dp::Tensor g({256, 64}, dp::MemoryCategory::kGradients, dp::Device::kCuda);
//   dp::Tensor g_host = g.to(dp::Device::kHost);  // a copy the host can read
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

/// True when this build has CUDA (configured with a CUDA compiler and DP_CUDA on).
bool cuda_compiled();
/// Number of CUDA devices this process sees: 0 in a build without CUDA, without a driver
/// or without a GPU. The GPU tests skip when it is 0.
int cuda_device_count();

/// Turns the emulated CUDA device on or off for the whole process. While it is on,
/// `Device::kCuda` tensors live in host memory and the library computes on them with its
/// host code (so results are bitwise the host's), but everything a device tensor refuses
/// on a GPU is refused the same way: the host accessors (`data()`, `span()`, `[]`, `at()`,
/// `host_span()`) throw, the mpi backend refuses the buffers, and operations on a host and
/// a device view throw. A machine without a GPU can thus run lab code "on a device" and
/// prove that it only uses the operations of dp/tensor_ops.h and the communicator:
/// `dplab grade --device emulated` grades the labs this way. Works in every build, with or
/// without CUDA. Throws `dp::Error` while any device tensor exists (its memory would
/// change meaning under it).
void set_cuda_device_emulated(bool emulated);
/// True while the emulated CUDA device is on (`set_cuda_device_emulated`).
bool cuda_device_emulated();

/// Waits until the device work the calling thread has issued (kernels, copies, and the
/// compute-stream side of communication: nccl's `Work::wait()` only orders the stream) has
/// finished; nothing to wait for on the host or the emulated device. For timing on the
/// wall clock, and before another thread reads this thread's device tensors.
void synchronize_device();

namespace detail {
/// Throws `dp::Error`: `accessor` reads host memory and the tensor lives on `device`.
[[noreturn]] void throw_not_host(std::string_view accessor, Device device);
}  // namespace detail

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
  /// Views the host elements of `host` (a std::vector's or a std::array's): its bounds are
  /// the container's, which is how lab code views host memory of its own.
  explicit TensorView(std::span<float> host) : TensorView(host.data(), host.size()) {}

  /// The first element: on a device, a device address to hand to kernels and communicators,
  /// never to dereference on the host (the emulated device cannot catch that: its memory is
  /// the host's; a GPU crashes or reads garbage).
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
  /// The same elements as a communication buffer on the view's device, for the
  /// communicator's calls (each backend says which devices it accepts, dp/comm.h).
  operator MutableBuffer() const {  // NOLINT(google-explicit-constructor)
    return {data_, size_, DataType::kFloat32, device_};
  }
  /// The same elements as a read-only communication buffer on the view's device.
  operator ConstBuffer() const {  // NOLINT(google-explicit-constructor)
    return {data_, size_, DataType::kFloat32, device_};
  }

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
  /// Views the host elements of `host` (a std::vector's or a std::array's), read-only.
  explicit ConstTensorView(std::span<const float> host)
      : ConstTensorView(host.data(), host.size()) {}
  /// The same elements, read-only.
  ConstTensorView(const TensorView& view)  // NOLINT(google-explicit-constructor)
      : data_(view.data()), size_(view.size()), device_(view.device()) {}

  /// The first element: on a device, a device address, never to dereference on the host.
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
  /// The same elements as a read-only communication buffer on the view's device (each
  /// backend says which devices it accepts, dp/comm.h).
  operator ConstBuffer() const {  // NOLINT(google-explicit-constructor)
    return {data_, size_, DataType::kFloat32, device_};
  }

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
  /// A zero-filled tensor of `shape` on `device`, charged to this thread's rank under
  /// `category`. Throws `dp::Error` for `Device::kCuda` in a build without CUDA or in a
  /// process that sees no CUDA device.
  explicit Tensor(std::vector<std::int64_t> shape,
                  MemoryCategory category = MemoryCategory::kActivations,
                  Device device = Device::kHost);
  /// A tensor whose elements are left as the allocator hands them over (for outputs that
  /// are overwritten at once).
  static Tensor uninitialized(std::vector<std::int64_t> shape,
                              MemoryCategory category = MemoryCategory::kActivations,
                              Device device = Device::kHost);
  /// A 1-D tensor on `device` holding a copy of `values` (host memory).
  static Tensor from(std::span<const float> values,
                     MemoryCategory category = MemoryCategory::kActivations,
                     Device device = Device::kHost);

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
  /// A deep copy on `device`, same shape and category: how data crosses between host and
  /// device (a copy to the device it is already on is a `clone()`).
  Tensor to(Device device) const;

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
  Device device() const { return device_; }
  /// A view of every element (on the tensor's device).
  TensorView view() { return {data_, size_, device_}; }
  /// A read-only view of every element (on the tensor's device).
  ConstTensorView view() const { return {data_, size_, device_}; }
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

  // The host accessors below throw `dp::Error` for a device tensor: dereferencing a device
  // pointer on the host would crash or read garbage, far from the line at fault.

  /// Pointer to the first element (host tensors only).
  float* data() {
    require_host("Tensor::data()");
    return data_;
  }
  /// Pointer to the first element, read-only (host tensors only).
  const float* data() const {
    require_host("Tensor::data()");
    return data_;
  }
  /// All elements, flat (host tensors only).
  std::span<float> span() {
    require_host("Tensor::span()");
    return {data_, size_};
  }
  /// All elements, flat, read-only (host tensors only).
  std::span<const float> span() const {
    require_host("Tensor::span()");
    return {data_, size_};
  }
  /// Element `i` of the flat array (host tensors only).
  float& operator[](std::size_t i) {
    require_host("Tensor::operator[]");
    return data_[i];
  }
  /// Element `i` of the flat array, read-only (host tensors only).
  float operator[](std::size_t i) const {
    require_host("Tensor::operator[]");
    return data_[i];
  }
  /// Element (row, col) of a 2-D tensor (host tensors only).
  float& at(std::int64_t row, std::int64_t col) {
    require_host("Tensor::at()");
    return data_[row * shape_[1] + col];
  }
  /// Element (row, col) of a 2-D tensor, read-only (host tensors only).
  float at(std::int64_t row, std::int64_t col) const {
    require_host("Tensor::at()");
    return data_[row * shape_[1] + col];
  }

  /// Sets every element to `value` (on the tensor's device).
  void fill(float value);
  /// Changes the shape to one with the same number of elements.
  void reshape(std::vector<std::int64_t> shape);
  /// The shape as text, e.g. "(32, 64)".
  std::string shape_string() const;

 private:
  void allocate(std::vector<std::int64_t> shape, MemoryCategory category, Device device);
  void release();
  void require_host(std::string_view accessor) const {
    if (device_ != Device::kHost) detail::throw_not_host(accessor, device_);
  }

  std::vector<std::int64_t> shape_;
  std::size_t size_ = 0;
  float* data_ = nullptr;
  MemoryCategory category_ = MemoryCategory::kActivations;
  Device device_ = Device::kHost;
  std::shared_ptr<RankMemory> owner_;  // the rank charged for this tensor
};

/// The most elements a tensor may have (2^60): its bytes, four per element, then fit in 64
/// bits with room to add, so no size computed from a shape can wrap around.
inline constexpr std::size_t kMaxTensorElements = std::size_t{1} << 60;

/// The number of elements of `shape`; throws `dp::Error` on a negative extent and on more
/// than `kMaxTensorElements` (checked without overflow: extents near 2^63 are refused, not
/// multiplied into a small number).
std::size_t element_count(const std::vector<std::int64_t>& shape);
/// `shape` as text, e.g. "(32, 64)".
std::string shape_to_string(const std::vector<std::int64_t>& shape);

}  // namespace dp
