// tensor.h: a contiguous array of float32, bfloat16 or float16 elements with a shape, charged
// to a rank's memory, and views of a range of its elements.
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
// Element types: a tensor holds float32 elements unless it is made with another
// `DataType`: `DataType::kBFloat16` or `DataType::kFloat16` (dp/float16.h), the 2-byte
// storage of mixed-precision training, charged 2 bytes per element. The untyped accessors
// above are float32's: on a 16-bit tensor or view they throw `dp::Error` naming the type
// expected and the type seen, rather than read its bytes as floats. The typed ones name their
// element type, `data<BFloat16>()`, `span<Float16>()`, `host_span<BFloat16>()`, and throw the
// same way for another. `to(DataType)` and `dp::convert` (dp/tensor_ops.h) convert between the
// types, rounding to nearest even as dp/float16.h states. Views and the communicator's buffers
// made from them carry the type, so a bfloat16 view all-reduces as `DataType::kBFloat16`.
//
// A `TensorView` names elements [offset, offset + count) of a tensor without owning them:
// a parameter's gradient, or one parameter's place in a flat buffer. The element-wise
// operations of dp/tensor_ops.h and the communicator take views, so lab code that works
// on views never touches raw memory and runs unchanged wherever the tensor lives.
//
// Example:
//
//   dp::Tensor x({32, 64});                  // (B, D) activations, zero-filled, float32
//   x.at(0, 3) = 1.5f;
//   std::span<float> flat = x.span();        // all 2048 elements
//   dp::Tensor w = dp::Tensor::uninitialized({256, 64}, dp::MemoryCategory::kParameters);
//   dp::TensorView row1 = x.view(64, 64);    // elements [64, 128): the second row
//   dp::Tensor g({256, 64}, dp::MemoryCategory::kGradients, dp::Device::kCuda);
//   dp::Tensor g_host = g.to(dp::Device::kHost);  // a copy the host can read
//   dp::Tensor x16 = x.to(dp::DataType::kBFloat16);  // 4096 bytes: rounded to bfloat16
//   std::span<dp::BFloat16> halves = x16.span<dp::BFloat16>();  // x16.span() would throw
//   comm.allreduce(x16.view(), dp::ReduceOp::kSum)->wait();   // reduced as bfloat16
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "dp/comm.h"
#include "dp/float16.h"
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
/// Throws `dp::Error`: `accessor` reads elements of type `expected` and the tensor or view
/// holds elements of type `seen` (naming both, and the accessor or conversion to use).
[[noreturn]] void throw_wrong_type(std::string_view accessor, DataType expected, DataType seen);
/// Throws `dp::Error`: `where` was given elements of `type`, which no tensor holds.
[[noreturn]] void throw_not_a_tensor_type(std::string_view where, DataType type);
/// Throws `dp::Error` naming `where` unless `type` is one a tensor may hold: float32,
/// bfloat16 or float16.
inline void check_tensor_type(std::string_view where, DataType type) {
  if (type != DataType::kFloat32 && type != DataType::kBFloat16 && type != DataType::kFloat16)
    throw_not_a_tensor_type(where, type);
}

/// Maps a C++ element type to its `DataType`: float, dp::BFloat16, dp::Float16 (const or not).
template <typename T>
constexpr DataType tensor_type_of() {
  using Element = std::remove_const_t<T>;
  if constexpr (std::is_same_v<Element, float>) {
    return DataType::kFloat32;
  } else if constexpr (std::is_same_v<Element, BFloat16>) {
    return DataType::kBFloat16;
  } else {
    static_assert(std::is_same_v<Element, Float16>,
                  "a tensor's elements are float, dp::BFloat16 or dp::Float16");
    return DataType::kFloat16;
  }
}
}  // namespace detail

/// The `DataType` of the C++ element type `T` (float, dp::BFloat16 or dp::Float16): the
/// type a tensor or view must hold for the typed accessors `data<T>()`, `span<T>()` and
/// `host_span<T>()`.
template <typename T>
inline constexpr DataType data_type_of = detail::tensor_type_of<T>();

/// A writable, non-owning view of `size()` contiguous elements of one type (`dtype()`: float32
/// unless made otherwise) on one device.
///
/// A view does not keep its tensor alive: it is valid while the tensor exists and is not
/// moved from or reassigned.
class TensorView {
 public:
  /// An empty view (of float32).
  TensorView() = default;
  /// Views `size` float32 elements starting at `data` on `device`.
  TensorView(float* data, std::size_t size, Device device = Device::kHost)
      : data_(data), size_(size), device_(device) {}
  /// Views `size` bfloat16 elements starting at `data` on `device`.
  TensorView(BFloat16* data, std::size_t size, Device device = Device::kHost)
      : data_(data), size_(size), device_(device), type_(DataType::kBFloat16) {}
  /// Views `size` float16 elements starting at `data` on `device`.
  TensorView(Float16* data, std::size_t size, Device device = Device::kHost)
      : data_(data), size_(size), device_(device), type_(DataType::kFloat16) {}
  /// Views `size` elements of `type` starting at `data` on `device`; throws `dp::Error` unless
  /// `type` is one a tensor holds (float32, bfloat16, float16).
  TensorView(void* data, std::size_t size, DataType type, Device device)
      : data_(data), size_(size), device_(device), type_(type) {
    detail::check_tensor_type("TensorView", type);
  }
  /// Views the host elements of `host` (a std::vector's or a std::array's): its bounds are
  /// the container's, which is how lab code views host memory of its own.
  explicit TensorView(std::span<float> host) : TensorView(host.data(), host.size()) {}
  /// Views the host bfloat16 elements of `host`.
  explicit TensorView(std::span<BFloat16> host) : TensorView(host.data(), host.size()) {}
  /// Views the host float16 elements of `host`.
  explicit TensorView(std::span<Float16> host) : TensorView(host.data(), host.size()) {}

  /// The first element of a float32 view (throws `dp::Error` for another type): on a device,
  /// a device address to hand to kernels and communicators, never to dereference on the host
  /// (the emulated device cannot catch that: its memory is the host's; a GPU crashes or reads
  /// garbage).
  float* data() const { return data<float>(); }
  /// The first element, of type `T` (float, dp::BFloat16 or dp::Float16); throws `dp::Error`
  /// unless the view holds `T`. On a device, a device address, as `data()`.
  template <typename T>
  T* data() const {
    if (type_ != data_type_of<T>)
      detail::throw_wrong_type("TensorView::data()", data_type_of<T>, type_);
    return static_cast<T*>(data_);
  }
  /// The first element, untyped (for code that moves bytes: read `dtype()` first).
  void* raw_data() const { return data_; }
  /// Number of elements.
  std::size_t size() const { return size_; }
  /// Size in bytes (`size()` times the element type's 4 or 2).
  std::size_t bytes() const { return size_ * element_size(type_); }
  /// True when the view holds no elements.
  bool empty() const { return size_ == 0; }
  /// Where the elements live.
  Device device() const { return device_; }
  /// The element type.
  DataType dtype() const { return type_; }
  /// Elements [offset, offset + count) of this view; throws `dp::Error` past its end.
  TensorView slice(std::size_t offset, std::size_t count) const;
  /// The float32 elements as a host span; throws `dp::Error` for a view of device memory or
  /// of another type.
  std::span<float> host_span() const { return host_span<float>(); }
  /// The elements of type `T` as a host span; throws `dp::Error` for a view of device memory
  /// or of another type.
  template <typename T>
  std::span<T> host_span() const {
    check_host_span(data_type_of<T>);
    return {static_cast<T*>(data_), size_};
  }
  /// The same elements as a communication buffer of the view's type on the view's device,
  /// for the communicator's calls (each backend says which devices it accepts, dp/comm.h).
  operator MutableBuffer() const {  // NOLINT(google-explicit-constructor)
    return {data_, size_, type_, device_};
  }
  /// The same elements as a read-only communication buffer on the view's device.
  operator ConstBuffer() const {  // NOLINT(google-explicit-constructor)
    return {data_, size_, type_, device_};
  }

 private:
  /// Throws `dp::Error` unless the elements are host memory of type `expected`.
  void check_host_span(DataType expected) const;

  void* data_ = nullptr;
  std::size_t size_ = 0;
  Device device_ = Device::kHost;
  DataType type_ = DataType::kFloat32;
};

/// A read-only, non-owning view of `size()` contiguous elements of one type (`dtype()`:
/// float32 unless made otherwise) on one device.
class ConstTensorView {
 public:
  /// An empty view (of float32).
  ConstTensorView() = default;
  /// Views `size` float32 elements starting at `data` on `device`.
  ConstTensorView(const float* data, std::size_t size, Device device = Device::kHost)
      : data_(data), size_(size), device_(device) {}
  /// Views `size` bfloat16 elements starting at `data` on `device`.
  ConstTensorView(const BFloat16* data, std::size_t size, Device device = Device::kHost)
      : data_(data), size_(size), device_(device), type_(DataType::kBFloat16) {}
  /// Views `size` float16 elements starting at `data` on `device`.
  ConstTensorView(const Float16* data, std::size_t size, Device device = Device::kHost)
      : data_(data), size_(size), device_(device), type_(DataType::kFloat16) {}
  /// Views `size` elements of `type` starting at `data` on `device`; throws `dp::Error` unless
  /// `type` is one a tensor holds (float32, bfloat16, float16).
  ConstTensorView(const void* data, std::size_t size, DataType type, Device device)
      : data_(data), size_(size), device_(device), type_(type) {
    detail::check_tensor_type("ConstTensorView", type);
  }
  /// Views the host elements of `host` (a std::vector's or a std::array's), read-only.
  explicit ConstTensorView(std::span<const float> host)
      : ConstTensorView(host.data(), host.size()) {}
  /// Views the host bfloat16 elements of `host`, read-only.
  explicit ConstTensorView(std::span<const BFloat16> host)
      : ConstTensorView(host.data(), host.size()) {}
  /// Views the host float16 elements of `host`, read-only.
  explicit ConstTensorView(std::span<const Float16> host)
      : ConstTensorView(host.data(), host.size()) {}
  /// The same elements, read-only (and of the same type).
  ConstTensorView(const TensorView& view)  // NOLINT(google-explicit-constructor)
      : data_(view.raw_data()), size_(view.size()), device_(view.device()), type_(view.dtype()) {}

  /// The first element of a float32 view (throws `dp::Error` for another type): on a device,
  /// a device address, never to dereference on the host.
  const float* data() const { return data<float>(); }
  /// The first element, of type `T` (float, dp::BFloat16 or dp::Float16); throws `dp::Error`
  /// unless the view holds `T`. On a device, a device address, as `data()`.
  template <typename T>
  const T* data() const {
    if (type_ != data_type_of<T>)
      detail::throw_wrong_type("ConstTensorView::data()", data_type_of<T>, type_);
    return static_cast<const T*>(data_);
  }
  /// The first element, untyped (for code that moves bytes: read `dtype()` first).
  const void* raw_data() const { return data_; }
  /// Number of elements.
  std::size_t size() const { return size_; }
  /// Size in bytes (`size()` times the element type's 4 or 2).
  std::size_t bytes() const { return size_ * element_size(type_); }
  /// True when the view holds no elements.
  bool empty() const { return size_ == 0; }
  /// Where the elements live.
  Device device() const { return device_; }
  /// The element type.
  DataType dtype() const { return type_; }
  /// Elements [offset, offset + count) of this view; throws `dp::Error` past its end.
  ConstTensorView slice(std::size_t offset, std::size_t count) const;
  /// The float32 elements as a host span; throws `dp::Error` for a view of device memory or
  /// of another type.
  std::span<const float> host_span() const { return host_span<float>(); }
  /// The elements of type `T` as a host span; throws `dp::Error` for a view of device memory
  /// or of another type.
  template <typename T>
  std::span<const T> host_span() const {
    check_host_span(data_type_of<T>);
    return {static_cast<const T*>(data_), size_};
  }
  /// The same elements as a read-only communication buffer of the view's type on the view's
  /// device (each backend says which devices it accepts, dp/comm.h).
  operator ConstBuffer() const {  // NOLINT(google-explicit-constructor)
    return {data_, size_, type_, device_};
  }

 private:
  /// Throws `dp::Error` unless the elements are host memory of type `expected`.
  void check_host_span(DataType expected) const;

  const void* data_ = nullptr;
  std::size_t size_ = 0;
  Device device_ = Device::kHost;
  DataType type_ = DataType::kFloat32;
};

/// A contiguous row-major array with a shape, of float32 elements unless made with another
/// `DataType` (bfloat16 or float16: see the top of this file).
class Tensor {
 public:
  /// An empty tensor: no shape, no elements.
  Tensor() = default;
  /// A zero-filled float32 tensor of `shape` on `device`, charged to this thread's rank under
  /// `category`. Throws `dp::Error` for `Device::kCuda` in a build without CUDA or in a
  /// process that sees no CUDA device.
  explicit Tensor(std::vector<std::int64_t> shape,
                  MemoryCategory category = MemoryCategory::kActivations,
                  Device device = Device::kHost);
  /// A zero-filled tensor of `shape` whose elements are of `type` (float32, bfloat16 or
  /// float16; another throws `dp::Error`), charged `element_size(type)` bytes per element.
  explicit Tensor(std::vector<std::int64_t> shape, DataType type,
                  MemoryCategory category = MemoryCategory::kActivations,
                  Device device = Device::kHost);
  /// A float32 tensor whose elements are left as the allocator hands them over (for outputs
  /// that are overwritten at once).
  static Tensor uninitialized(std::vector<std::int64_t> shape,
                              MemoryCategory category = MemoryCategory::kActivations,
                              Device device = Device::kHost);
  /// A tensor of `type` whose elements are left as the allocator hands them over.
  static Tensor uninitialized(std::vector<std::int64_t> shape, DataType type,
                              MemoryCategory category = MemoryCategory::kActivations,
                              Device device = Device::kHost);
  /// A 1-D float32 tensor on `device` holding a copy of `values` (host memory).
  static Tensor from(std::span<const float> values,
                     MemoryCategory category = MemoryCategory::kActivations,
                     Device device = Device::kHost);
  /// A 1-D bfloat16 tensor on `device` holding a copy of `values` (host memory).
  static Tensor from(std::span<const BFloat16> values,
                     MemoryCategory category = MemoryCategory::kActivations,
                     Device device = Device::kHost);
  /// A 1-D float16 tensor on `device` holding a copy of `values` (host memory).
  static Tensor from(std::span<const Float16> values,
                     MemoryCategory category = MemoryCategory::kActivations,
                     Device device = Device::kHost);

  /// Takes over `other`'s memory; `other` becomes empty.
  Tensor(Tensor&& other) noexcept;
  /// Releases this tensor's memory and takes over `other`'s; `other` becomes empty.
  Tensor& operator=(Tensor&& other) noexcept;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  ~Tensor();

  /// A deep copy with the same shape and type; `category` defaults to this tensor's.
  Tensor clone() const;
  /// A deep copy charged under another category.
  Tensor clone(MemoryCategory category) const;
  /// A deep copy on `device`, same shape, type and category: how data crosses between host
  /// and device (a copy to the device it is already on is a `clone()`).
  Tensor to(Device device) const;
  /// A copy whose elements are converted to `type`, same shape, device and category: exact
  /// to float32, rounded to nearest even to bfloat16 or float16 (dp/float16.h); `dp::convert`
  /// (dp/tensor_ops.h) on the whole tensor. A conversion to the tensor's own type is a
  /// `clone()`. Throws `dp::Error` for a type a tensor cannot hold.
  Tensor to(DataType type) const;

  /// The shape, outermost dimension first.
  const std::vector<std::int64_t>& shape() const { return shape_; }
  /// Number of dimensions.
  std::size_t rank() const { return shape_.size(); }
  /// Extent of dimension `d` (bounds-checked).
  std::int64_t dim(std::size_t d) const;
  /// Number of elements.
  std::size_t size() const { return size_; }
  /// Size in bytes (`size()` times the element type's 4 or 2), as the rank is charged.
  std::size_t bytes() const { return size_ * element_size(type_); }
  /// True when the tensor holds no elements.
  bool empty() const { return size_ == 0; }
  /// The category this tensor is charged under.
  MemoryCategory category() const { return category_; }
  /// The element type (`DataType::kFloat32` unless made with another).
  DataType dtype() const { return type_; }

  /// Where the elements live.
  Device device() const { return device_; }
  /// A view of every element (on the tensor's device, of its type).
  TensorView view() { return {data_, size_, type_, device_}; }
  /// A read-only view of every element (on the tensor's device, of its type).
  ConstTensorView view() const { return {data_, size_, type_, device_}; }
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
  // pointer on the host would crash or read garbage, far from the line at fault. The untyped
  // ones read float32 and throw for a 16-bit tensor, whose bytes are not floats; the typed
  // ones (`data<T>()`, `span<T>()`) throw unless the tensor holds `T`.

  /// Pointer to the first element (host float32 tensors only).
  float* data() { return data<float>(); }
  /// Pointer to the first element, read-only (host float32 tensors only).
  const float* data() const { return data<float>(); }
  /// Pointer to the first element of type `T` (float, dp::BFloat16 or dp::Float16; host
  /// tensors of that type only).
  template <typename T>
  T* data() {
    require_host_of("Tensor::data()", data_type_of<T>);
    return static_cast<T*>(data_);
  }
  /// Pointer to the first element of type `T`, read-only (host tensors of that type only).
  template <typename T>
  const T* data() const {
    require_host_of("Tensor::data()", data_type_of<T>);
    return static_cast<const T*>(data_);
  }
  /// All elements, flat (host float32 tensors only).
  std::span<float> span() { return span<float>(); }
  /// All elements, flat, read-only (host float32 tensors only).
  std::span<const float> span() const { return span<float>(); }
  /// All elements of type `T`, flat (host tensors of that type only), e.g.
  /// `span<BFloat16>()`.
  template <typename T>
  std::span<T> span() {
    require_host_of("Tensor::span()", data_type_of<T>);
    return {static_cast<T*>(data_), size_};
  }
  /// All elements of type `T`, flat, read-only (host tensors of that type only).
  template <typename T>
  std::span<const T> span() const {
    require_host_of("Tensor::span()", data_type_of<T>);
    return {static_cast<const T*>(data_), size_};
  }
  /// Element `i` of the flat array (host float32 tensors only).
  float& operator[](std::size_t i) {
    require_host_of("Tensor::operator[]", DataType::kFloat32);
    return static_cast<float*>(data_)[i];
  }
  /// Element `i` of the flat array, read-only (host float32 tensors only).
  float operator[](std::size_t i) const {
    require_host_of("Tensor::operator[]", DataType::kFloat32);
    return static_cast<const float*>(data_)[i];
  }
  /// Element (row, col) of a 2-D tensor (host float32 tensors only).
  float& at(std::int64_t row, std::int64_t col) {
    require_host_of("Tensor::at()", DataType::kFloat32);
    return static_cast<float*>(data_)[row * shape_[1] + col];
  }
  /// Element (row, col) of a 2-D tensor, read-only (host float32 tensors only).
  float at(std::int64_t row, std::int64_t col) const {
    require_host_of("Tensor::at()", DataType::kFloat32);
    return static_cast<const float*>(data_)[row * shape_[1] + col];
  }

  /// Sets every element to `value` (on the tensor's device), rounded once to a 16-bit type.
  void fill(float value);
  /// Changes the shape to one with the same number of elements.
  void reshape(std::vector<std::int64_t> shape);
  /// The shape as text, e.g. "(32, 64)".
  std::string shape_string() const;

 private:
  void allocate(std::vector<std::int64_t> shape, DataType type, MemoryCategory category,
                Device device);
  void release();
  void require_host_of(std::string_view accessor, DataType expected) const {
    // One test on the common path (a host float32 tensor read as float32).
    if (device_ != Device::kHost || type_ != expected) [[unlikely]] {
      if (device_ != Device::kHost) detail::throw_not_host(accessor, device_);
      detail::throw_wrong_type(accessor, expected, type_);
    }
  }

  std::vector<std::int64_t> shape_;
  std::size_t size_ = 0;
  void* data_ = nullptr;
  MemoryCategory category_ = MemoryCategory::kActivations;
  Device device_ = Device::kHost;
  DataType type_ = DataType::kFloat32;
  std::shared_ptr<RankMemory> owner_;  // the rank charged for this tensor
};

/// The most elements a tensor may have (2^60): its bytes, at most four per element, then fit in 64
/// bits with room to add, so no size computed from a shape can wrap around.
inline constexpr std::size_t kMaxTensorElements = std::size_t{1} << 60;

/// The number of elements of `shape`; throws `dp::Error` on a negative extent and on more
/// than `kMaxTensorElements` (checked without overflow: extents near 2^63 are refused, not
/// multiplied into a small number).
std::size_t element_count(const std::vector<std::int64_t>& shape);
/// `shape` as text, e.g. "(32, 64)".
std::string shape_to_string(const std::vector<std::int64_t>& shape);

}  // namespace dp
