#include "dp/tensor.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <utility>

#include "comm/in_flight_buffers.h"
#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/error.h"
#include "dp/tensor_ops.h"

namespace dp {

void detail::check_range(std::string_view function, std::size_t offset, std::size_t count,
                         std::size_t size) {
  // Written so that a huge offset or count cannot wrap around.
  if (offset > size || count > size - offset)
    throw Error(fmt::format(
        "{}(offset {}, count {}) of {} elements: expected elements [{}, {} + {}) to lie "
        "inside them",
        function, offset, count, size, offset, offset, count));
}

std::string_view to_string(Device device) {
  switch (device) {
    case Device::kHost: return "host";
    case Device::kCuda: return cuda_device_emulated() ? "cuda (emulated)" : "cuda";
  }
  return "unknown";
}

bool cuda_compiled() {
  return cuda::compiled();
}

int cuda_device_count() {
  return cuda::device_count();
}

namespace {

std::atomic<bool> emulating_cuda{false};
// Device tensors alive in the process: the emulation may only change while there are none,
// since their memory was allocated by (and must return to) the one that was on.
std::atomic<std::int64_t> device_tensors_alive{0};

/// The blocks of emulated device memory (device_dispatch.h), by the address of their first
/// byte: the size of each. Every rank's thread notes and reads them.
struct EmulatedDeviceBlocks {
  std::shared_mutex mutex;
  std::map<std::uintptr_t, std::size_t> bytes_at;
};

EmulatedDeviceBlocks& emulated_device_blocks() {
  static EmulatedDeviceBlocks blocks;
  return blocks;
}

/// True for a tensor or buffer on `device` that lives in emulated device memory.
bool in_emulated_device(Device device) {
  return device != Device::kHost && !detail::on_gpu(device);
}

}  // namespace

void detail::note_emulated_device_memory(const void* first, std::size_t bytes) {
  if (first == nullptr || bytes == 0) return;
  const UncountedHeapAllocations bookkeeping;  // the runtime's, not the lab's
  EmulatedDeviceBlocks& blocks = emulated_device_blocks();
  const std::unique_lock lock(blocks.mutex);
  blocks.bytes_at[reinterpret_cast<std::uintptr_t>(first)] = bytes;
}

void detail::forget_emulated_device_memory(const void* first) {
  if (first == nullptr) return;
  EmulatedDeviceBlocks& blocks = emulated_device_blocks();
  const std::unique_lock lock(blocks.mutex);
  blocks.bytes_at.erase(reinterpret_cast<std::uintptr_t>(first));
}

bool detail::in_emulated_device_memory(const void* first, std::size_t bytes) {
  const auto start = reinterpret_cast<std::uintptr_t>(first);
  EmulatedDeviceBlocks& blocks = emulated_device_blocks();
  const std::shared_lock lock(blocks.mutex);
  // The last block that begins at or before `first`: the only one that can hold it.
  auto after = blocks.bytes_at.upper_bound(start);
  if (after == blocks.bytes_at.begin()) return false;
  const auto& [block, size] = *std::prev(after);
  const std::uintptr_t offset = start - block;
  return offset <= size && bytes <= size - offset;  // written so that nothing wraps around
}

void set_cuda_device_emulated(bool emulated) {
  const std::int64_t alive = device_tensors_alive.load();
  if (emulated != emulating_cuda.load() && alive != 0)
    throw Error(fmt::format(
        "set_cuda_device_emulated({}): {} device tensor(s) still exist; expected none (their "
        "memory belongs to the {} device): switch before making any, or after releasing them",
        emulated, alive, emulating_cuda.load() ? "emulated" : "real"));
  emulating_cuda.store(emulated);
}

bool cuda_device_emulated() {
  return emulating_cuda.load(std::memory_order_relaxed);
}

void synchronize_device() {
  if (cuda_compiled() && !cuda_device_emulated() && cuda_device_count() > 0) cuda::synchronize();
}

bool detail::on_gpu(Device device) {
  return device != Device::kHost && !cuda_device_emulated();
}

void detail::copy_memory(void* destination, Device destination_device, const void* source,
                         Device source_device, std::size_t bytes) {
  if (bytes == 0) return;
  if (on_gpu(destination_device) || on_gpu(source_device))
    cuda::copy_bytes(destination, source, bytes);
  else
    std::memcpy(destination, source, bytes);
}

void detail::throw_wrong_type(std::string_view accessor, DataType expected, DataType seen) {
  throw Error(
      fmt::format("{} of {} elements: expected {} elements; {} (dp/tensor.h), or convert them with "
                  "Tensor::to(DataType::{}) or dp::convert",
                  accessor, to_string(seen), to_string(expected),
                  seen == DataType::kFloat32    ? "read them with the untyped accessor (or <float>)"
                  : seen == DataType::kBFloat16 ? "read them with the typed accessor <dp::BFloat16>"
                                                : "read them with the typed accessor <dp::Float16>",
                  expected == DataType::kFloat32    ? "kFloat32"
                  : expected == DataType::kBFloat16 ? "kBFloat16"
                                                    : "kFloat16"));
}

void detail::throw_not_a_tensor_type(std::string_view where, DataType type) {
  throw Error(
      fmt::format("{} of {} elements: expected float32, bfloat16 or float16, the types "
                  "a tensor holds",
                  where, to_string(type)));
}

void detail::throw_not_host(std::string_view accessor, Device device) {
  throw Error(fmt::format(
      "{} of a tensor in {} memory: expected host memory; the host cannot read device "
      "memory: use the operations of dp/tensor_ops.h, which work on every device, or copy "
      "it to the host first (Tensor::to(Device::kHost))",
      accessor, to_string(device)));
}

namespace {

/// Throws `dp::Error` unless a view's elements, on `device` and of type `seen`, can be read
/// as a host span of `expected`.
void check_host_span(std::string_view accessor, Device device, DataType expected, DataType seen) {
  if (device != Device::kHost)
    throw Error(
        fmt::format("host_span() of a view of {} memory: expected a host view; use the "
                    "operations of dp/tensor_ops.h, which work on every device",
                    to_string(device)));
  if (seen != expected) detail::throw_wrong_type(accessor, expected, seen);
}

}  // namespace

TensorView TensorView::slice(std::size_t offset, std::size_t count) const {
  detail::check_range("TensorView::slice", offset, count, size_);
  return {static_cast<std::byte*>(data_) + offset * element_size(type_), count, type_, device_};
}

void TensorView::check_host_span(DataType expected) const {
  dp::check_host_span("TensorView::host_span()", device_, expected, type_);
}

ConstTensorView ConstTensorView::slice(std::size_t offset, std::size_t count) const {
  detail::check_range("ConstTensorView::slice", offset, count, size_);
  return {static_cast<const std::byte*>(data_) + offset * element_size(type_), count, type_,
          device_};
}

void ConstTensorView::check_host_span(DataType expected) const {
  dp::check_host_span("ConstTensorView::host_span()", device_, expected, type_);
}

std::size_t element_count(const std::vector<std::int64_t>& shape) {
  std::size_t count = 1;
  bool too_many = false;
  bool has_zero = false;
  for (std::int64_t extent : shape) {
    if (extent < 0)
      throw Error(fmt::format("tensor shape {} has a negative extent", shape_to_string(shape)));
    const auto n = static_cast<std::size_t>(extent);
    // Checked before the multiplication: a product that wrapped around would allocate a
    // small buffer for a huge tensor. A zero extent makes any product 0.
    if (n != 0 && count > kMaxTensorElements / n) too_many = true;
    has_zero = has_zero || n == 0;
    count *= n;
  }
  if (too_many && !has_zero)
    throw Error(
        fmt::format("tensor shape {} has more than {} elements (2^60), more than any "
                    "memory holds",
                    shape_to_string(shape), kMaxTensorElements));
  return count;
}

std::string shape_to_string(const std::vector<std::int64_t>& shape) {
  return fmt::format("({})", fmt::join(shape, ", "));
}

Tensor::Tensor(std::vector<std::int64_t> shape, MemoryCategory category, Device device)
    : Tensor(std::move(shape), DataType::kFloat32, category, device) {}

Tensor::Tensor(std::vector<std::int64_t> shape, DataType type, MemoryCategory category,
               Device device) {
  allocate(std::move(shape), type, category, device);
  fill(0.0f);
}

Tensor Tensor::uninitialized(std::vector<std::int64_t> shape, MemoryCategory category,
                             Device device) {
  return uninitialized(std::move(shape), DataType::kFloat32, category, device);
}

Tensor Tensor::uninitialized(std::vector<std::int64_t> shape, DataType type,
                             MemoryCategory category, Device device) {
  Tensor tensor;
  tensor.allocate(std::move(shape), type, category, device);
  return tensor;
}

namespace {

/// A 1-D tensor of `values`' type on `device` holding a copy of them.
template <typename T>
Tensor tensor_from(std::span<const T> values, MemoryCategory category, Device device) {
  Tensor tensor = Tensor::uninitialized({static_cast<std::int64_t>(values.size())}, data_type_of<T>,
                                        category, device);
  detail::copy_memory(tensor.view().raw_data(), device, values.data(), Device::kHost,
                      tensor.bytes());
  return tensor;
}

}  // namespace

Tensor Tensor::from(std::span<const float> values, MemoryCategory category, Device device) {
  return tensor_from(values, category, device);
}

Tensor Tensor::from(std::span<const BFloat16> values, MemoryCategory category, Device device) {
  return tensor_from(values, category, device);
}

Tensor Tensor::from(std::span<const Float16> values, MemoryCategory category, Device device) {
  return tensor_from(values, category, device);
}

void Tensor::allocate(std::vector<std::int64_t> shape, DataType type, MemoryCategory category,
                      Device device) {
  detail::check_tensor_type("Tensor", type);
  size_ = element_count(shape);
  shape_ = std::move(shape);
  category_ = category;
  device_ = device;
  type_ = type;
  owner_ = this_rank_memory_shared();
  // Charged first: past the rank's memory budget this throws before anything is allocated.
  // Device bytes go to the same accounts as host bytes: a rank's training state is counted
  // wherever it lives (on a GPU, the budget is that GPU's memory).
  owner_->tracker().on_allocate(category_, bytes());
  try {
    // Device memory comes from CUDA's stream-ordered pool (cuda/runtime.cpp says why),
    // host memory (and the emulated device's) from the rank's caching allocator.
    if (detail::on_gpu(device_))
      data_ = cuda::allocate(bytes());
    else
      data_ = owner_->allocator().allocate(bytes());
    if (in_emulated_device(device_)) detail::note_emulated_device_memory(data_, bytes());
    if (device_ != Device::kHost) ++device_tensors_alive;
  } catch (const std::bad_alloc&) {
    // The machine refused the bytes (a huge model, data set or checkpoint): say what and how
    // much, instead of an unexplained std::bad_alloc.
    const std::size_t refused = bytes();
    const std::size_t elements = size_;
    owner_->tracker().on_release(category_, refused);
    owner_.reset();
    size_ = 0;
    shape_.clear();
    device_ = Device::kHost;
    throw machine_out_of_memory(
        fmt::format("{} (a tensor of {} {}elements)", to_string(category), elements,
                    type_ == DataType::kFloat32 ? "" : fmt::format("{} ", to_string(type_))),
        refused);
  } catch (...) {
    owner_->tracker().on_release(category_, bytes());
    owner_.reset();
    size_ = 0;
    shape_.clear();
    device_ = Device::kHost;
    throw;
  }
}

namespace {

/// Returns a tensor's block to where it came from.
void free_tensor_block(RankMemory& owner, void* data, std::size_t bytes, Device device) {
  if (in_emulated_device(device)) detail::forget_emulated_device_memory(data);
  if (detail::on_gpu(device))
    cuda::deallocate(data);
  else
    owner.allocator().deallocate(data, bytes);
  if (device != Device::kHost) --device_tensors_alive;
}

}  // namespace

void Tensor::release() {
  if (owner_ != nullptr) {
    owner_->tracker().on_release(category_, bytes());
    // Memory a call in flight still reads or writes is reported, and held back until the
    // call completes (comm/in_flight_buffers.h); a single atomic load while none is.
    // The lambdas capture `this` alone: std::function keeps them without an allocation.
    const bool held =
        detail::any_call_in_flight() &&
        detail::hold_block_under_call_in_flight(
            data_, bytes(),
            [this] {
              return fmt::format("a tensor of {}, shape {} on {} ({} bytes{}{})",
                                 to_string(category_), shape_string(), to_string(device_), bytes(),
                                 type_ == DataType::kFloat32 ? "" : ", ",
                                 type_ == DataType::kFloat32 ? "" : to_string(type_));
            },
            [this]() -> std::function<void()> {
              return [owner = owner_, data = data_, bytes = bytes(), device = device_] {
                free_tensor_block(*owner, data, bytes, device);
              };
            });
    if (!held) free_tensor_block(*owner_, data_, bytes(), device_);
  }
  owner_.reset();
  data_ = nullptr;
  size_ = 0;
  shape_.clear();
  device_ = Device::kHost;
  type_ = DataType::kFloat32;
}

Tensor::Tensor(Tensor&& other) noexcept
    : shape_(std::move(other.shape_)),
      size_(std::exchange(other.size_, 0)),
      data_(std::exchange(other.data_, nullptr)),
      category_(other.category_),
      device_(std::exchange(other.device_, Device::kHost)),
      type_(std::exchange(other.type_, DataType::kFloat32)),
      owner_(std::move(other.owner_)) {
  other.shape_.clear();
}

Tensor& Tensor::operator=(Tensor&& other) noexcept {
  if (this != &other) {
    release();
    shape_ = std::move(other.shape_);
    other.shape_.clear();
    size_ = std::exchange(other.size_, 0);
    data_ = std::exchange(other.data_, nullptr);
    category_ = other.category_;
    device_ = std::exchange(other.device_, Device::kHost);
    type_ = std::exchange(other.type_, DataType::kFloat32);
    owner_ = std::move(other.owner_);
  }
  return *this;
}

Tensor::~Tensor() {
  release();
}

Tensor Tensor::clone() const {
  return clone(category_);
}

Tensor Tensor::clone(MemoryCategory category) const {
  Tensor copy = uninitialized(shape_, type_, category, device_);
  detail::copy_memory(copy.data_, device_, data_, device_, bytes());
  return copy;
}

Tensor Tensor::to(Device device) const {
  Tensor copy = uninitialized(shape_, type_, category_, device);
  detail::copy_memory(copy.data_, device, data_, device_, bytes());
  return copy;
}

Tensor Tensor::to(DataType type) const {
  detail::check_tensor_type("Tensor::to", type);
  if (type == type_) return clone();
  Tensor converted = uninitialized(shape_, type, category_, device_);
  convert(view(), converted.view());
  return converted;
}

std::int64_t Tensor::dim(std::size_t d) const {
  if (d >= shape_.size())
    throw Error(fmt::format("dimension {} requested of a tensor of shape {}", d, shape_string()));
  return shape_[d];
}

void Tensor::fill(float value) {
  if (type_ == DataType::kFloat32) {
    float* first = static_cast<float*>(data_);
    if (detail::on_gpu(device_))
      cuda::fill(first, size_, value);
    else
      std::fill(first, first + size_, value);
    return;
  }
  // A 16-bit type: the value is rounded once, and its bits are what every element holds.
  const std::uint16_t bits =
      type_ == DataType::kBFloat16 ? to_bfloat16(value).bits : to_float16(value).bits;
  auto* first = static_cast<std::uint16_t*>(data_);
  if (detail::on_gpu(device_))
    cuda::fill_bits16(first, size_, bits);
  else
    std::fill(first, first + size_, bits);
}

void Tensor::reshape(std::vector<std::int64_t> shape) {
  if (element_count(shape) != size_)
    throw Error(fmt::format("cannot reshape a tensor of shape {} ({} elements) to {}",
                            shape_string(), size_, shape_to_string(shape)));
  shape_ = std::move(shape);
}

std::string Tensor::shape_string() const {
  return shape_to_string(shape_);
}

}  // namespace dp
