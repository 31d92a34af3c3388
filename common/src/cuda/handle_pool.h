// cuda/handle_pool.h: a thread-safe pool of library handles, one per device (internal).
//
// A cuBLAS handle is costly to make (it allocates device workspace and loads kernels) and
// must not be used by two threads at once. Ranks are threads that live for one launch, so a
// handle per thread made and destroyed with the thread costs every launch that many
// creations. The pool keeps the handles instead: a thread leases one for a device on first
// use, the lease gives it back when the thread ends, and the next thread on that device
// takes it over. A handle is created only when every one made for its device is leased (as
// many as threads use the device at once), and destroyed with the pool, at process exit.
//
// The pool knows nothing of CUDA: blas.cpp instantiates it with cuBLAS's create and destroy,
// and the unit tests with counters, so its bookkeeping is tested on machines without a GPU.
//
// Example:
//
//   HandlePool<cublasHandle_t> pool(create_on_current_device, destroy);
//   cublasHandle_t handle = pool.acquire(device);  // an idle one, or a new one
//   ... use it from this thread only ...
//   pool.release(device, handle);                  // another thread may take it now
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace dp::cuda {

/// Handles of type `Handle` per device, made by `create(device)` on demand and kept for
/// reuse until the pool is destroyed; every member function is safe to call from any thread.
template <typename Handle>
class HandlePool {
 public:
  /// A pool that makes handles with `create` (called with the device; it may throw) and
  /// destroys them with `destroy` (which must not throw) when the pool is destroyed.
  HandlePool(std::function<Handle(int device)> create, std::function<void(Handle)> destroy)
      : create_(std::move(create)), destroy_(std::move(destroy)) {}
  /// Destroys every handle it made that was given back (a handle still leased is the
  /// leaseholder's to give back; at process exit none is).
  ~HandlePool() {
    for (auto& [device, handles] : idle_)
      for (Handle handle : handles) destroy_(handle);
  }
  HandlePool(const HandlePool&) = delete;
  HandlePool& operator=(const HandlePool&) = delete;

  /// An idle handle of `device` (the one given back last), or a new one made outside the
  /// lock when none is idle. The caller has it to itself until `release`.
  Handle acquire(int device) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      std::vector<Handle>& idle = idle_[device];
      if (!idle.empty()) {
        Handle handle = idle.back();
        idle.pop_back();
        return handle;
      }
    }
    Handle handle = create_(device);  // may throw: nothing was taken
    const std::lock_guard<std::mutex> lock(mutex_);
    ++created_;
    return handle;
  }

  /// Gives `handle` (from `acquire(device)`) back for the next thread on `device`.
  void release(int device, Handle handle) {
    const std::lock_guard<std::mutex> lock(mutex_);
    idle_[device].push_back(handle);
  }

  /// How many handles the pool has made so far, on every device.
  std::size_t created() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return created_;
  }
  /// How many handles of `device` are idle now.
  std::size_t idle(int device) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = idle_.find(device);
    return it == idle_.end() ? 0 : it->second.size();
  }

 private:
  std::function<Handle(int)> create_;
  std::function<void(Handle)> destroy_;
  mutable std::mutex mutex_;
  std::map<int, std::vector<Handle>> idle_;  // given back, by device
  std::size_t created_ = 0;
};

}  // namespace dp::cuda
