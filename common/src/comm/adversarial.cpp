// The adversarial completion mode: a decorator over any backend's communicator.
//
// Real communication libraries complete calls when they please: NCCL on its own stream,
// MPI whenever its progress engine runs. Lab code that reads a result before waiting for
// it, or waits for the last call only, is wrong, yet on the local backend (which finishes
// calls in issue order) it usually gets the right bits. This decorator removes that luck:
//
//   * every call runs on private copies: inputs are copied at issue, outputs land in a
//     staging buffer, and the caller's output buffer is filled with all-ones bytes (NaN
//     for float32) until the call's own Work is waited on;
//   * wait() (or a test() that returns true, or the Work's destructor) copies the result
//     into the caller's buffer, so results arrive in the order the caller waits, not the
//     order it issued;
//   * wait() reports an input buffer the caller changed before the call completed, which
//     real transports forbid (they may read it at any moment until then), and an output
//     buffer the caller wrote meanwhile (it no longer holds only the garbage bytes), which
//     they forbid too (they may write the result at any moment); for an all-reduce in
//     place, the buffer is both;
//   * test() answers false at random (seeded by the launch and the rank) before it asks the
//     backend, so code that polls once and moves on sees calls that have not finished.
//
// The backend underneath counts, validates and times the calls exactly as it would
// without the decorator. Staging buffers come from malloc inside a
// dp::detail::UncountedHeapAllocations, so that the grader's count of the allocations made
// by lab code does not see them.
//
// Device buffers are staged on their device (the backend gets device buffers, as the caller
// gave it), and copied, poisoned and compared with copies on the caller's compute stream
// (cuda::copy_bytes), which run after the caller's kernels and, once the backend's Work
// waited, after the call; comparisons copy both sides to the host first. It is slow, and only for
// grading.
#include "comm/adversarial.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <string_view>
#include <utility>

#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/error.h"
#include "dp/memory.h"
#include "dp/rng.h"

namespace dp::detail {
namespace {

/// All bits set: a quiet NaN for float32, -1 for int32; what an output holds until its
/// call completes.
constexpr unsigned char kGarbageByte = 0xFF;

/// A malloc'd copy of some bytes (see the top of this file for why not operator new), or
/// device memory for a device buffer's copy.
class Staging {
 public:
  Staging() = default;
  explicit Staging(std::size_t bytes, Device device = Device::kHost)
      : bytes_(bytes), device_(device) {
    if (bytes_ == 0) return;
    const UncountedHeapAllocations runtime_copy;  // the mode's, not the lab's
    data_ = static_cast<unsigned char*>(!on_gpu(device_) ? std::malloc(bytes_)
                                                         : cuda::allocate(bytes_));
    if (data_ == nullptr) throw std::bad_alloc();
  }
  Staging(Staging&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        device_(other.device_) {}
  Staging& operator=(Staging&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    std::swap(device_, other.device_);
    return *this;
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() {
    if (!on_gpu(device_))
      std::free(data_);
    else
      cuda::deallocate(data_);
  }

  unsigned char* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  unsigned char* data_ = nullptr;
  std::size_t bytes_ = 0;
  Device device_ = Device::kHost;
};

/// Copies `bytes` between two buffers on `device` (host: memcpy; CUDA: a synchronous copy).
void copy_on(Device device, void* destination, const void* source, std::size_t bytes) {
  if (bytes == 0) return;
  if (!on_gpu(device))
    std::memcpy(destination, source, bytes);
  else
    cuda::copy_bytes(destination, source, bytes);
}

Staging copy_of(ConstBuffer buffer) {
  Staging copy(buffer.bytes(), buffer.device);
  copy_on(buffer.device, copy.data(), buffer.data, copy.bytes());
  return copy;
}

/// The bytes of `buffer` readable on the host: `buffer.data` itself for host memory, else a
/// host copy kept in `keep`.
const unsigned char* readable_on_host(ConstBuffer buffer, Staging& keep) {
  if (!on_gpu(buffer.device)) return static_cast<const unsigned char*>(buffer.data);
  keep = Staging(buffer.bytes());
  if (keep.bytes() > 0) cuda::copy_bytes(keep.data(), buffer.data, keep.bytes());
  return keep.data();
}

bool overlap(ConstBuffer a, ConstBuffer b) {
  const auto* a_begin = static_cast<const unsigned char*>(a.data);
  const auto* b_begin = static_cast<const unsigned char*>(b.data);
  return a.bytes() > 0 && b.bytes() > 0 && a_begin < b_begin + b.bytes() &&
         b_begin < a_begin + a.bytes();
}

/// What one call keeps until it is delivered.
struct Pending {
  std::string_view call;     // "allreduce", for messages
  std::uint64_t number = 0;  // the call's position among this rank's calls
  int rank = 0;              // the rank that made it
  ConstBuffer input;         // the caller's input (checked at wait), or empty
  Staging input_copy;        // what the backend reads
  MutableBuffer output;      // the caller's output, or empty
  Staging output_staging;    // what the backend writes (may be input_copy's memory)
  bool output_in_input_copy = false;
  bool check_input = false;  // compare `input` with `input_copy` at wait()
};

/// A random yes/no per test() call, the same in every run with the same seed and rank.
class Coin {
 public:
  Coin(std::uint64_t seed, int rank)
      : rng_(seed, 0x7e57'0000ULL + static_cast<std::uint64_t>(rank)) {}
  bool heads() { return (rng_.next_u32() & 1U) != 0; }

 private:
  CounterRng rng_;
};

class AdversarialWork final : public Work {
 public:
  AdversarialWork(std::unique_ptr<Work> inner, Pending pending, std::shared_ptr<Coin> coin)
      : inner_(std::move(inner)), pending_(std::move(pending)), coin_(std::move(coin)) {}

  ~AdversarialWork() override {
    // Destroying a Work waits for its call (comm.h), and the result is delivered then. While
    // an exception unwinds, the backend's own Work decides (it aborts the other ranks
    // rather than wait for a call that may never complete): nothing is delivered.
    if (!delivered_ && std::uncaught_exceptions() == 0) {
      try {
        inner_->wait();
        deliver();
      } catch (const std::exception&) {
        // The backend reports the error through the call that waits or through the abort.
      }
    }
    // The backend's Work goes first: until its destructor returns, the call may still read
    // the input copy and write the staging buffer that `pending_` owns (members would be
    // destroyed in the other order, freeing them under a running call).
    inner_.reset();
  }

  void wait() override {
    if (delivered_) return;
    inner_->wait();
    check_input_unchanged();
    check_output_untouched();
    deliver();
  }

  bool test() override {
    if (delivered_) return true;
    if (coin_->heads()) return false;  // "not yet", whatever the backend would say
    if (!inner_->test()) return false;
    wait();
    return true;
  }

 private:
  void check_input_unchanged() const {
    if (!pending_.check_input || pending_.input.bytes() == 0) return;
    Staging caller_bytes;
    Staging copy_bytes;
    const unsigned char* caller = readable_on_host(pending_.input, caller_bytes);
    const unsigned char* copy =
        readable_on_host({pending_.input_copy.data(), pending_.input.bytes(), DataType::kUInt8,
                          pending_.input.device},
                         copy_bytes);
    if (std::memcmp(caller, copy, pending_.input.bytes()) != 0)
      throw Error(fmt::format(
          "rank {}: {} (its call #{}): its input buffer was changed before the call "
          "completed; expected it unchanged until wait() returns (a transport may read it at "
          "any moment until then)",
          pending_.rank, pending_.call, pending_.number));
  }

  void check_output_untouched() const {
    // One pass over the buffer (64 MiB in lab 3's checks): the size is read once and the
    // search is a plain loop over bytes that the compiler vectorises.
    Staging output_bytes;
    const unsigned char* begin = readable_on_host(pending_.output, output_bytes);
    const unsigned char* end = begin + pending_.output.bytes();
    const auto* written =
        std::find_if(begin, end, [](unsigned char byte) { return byte != kGarbageByte; });
    if (written != end) {
      const auto i = static_cast<std::size_t>(written - begin);
      throw Error(
          fmt::format("rank {}: {} (its call #{}): its output buffer was written before the call "
                      "completed (byte {} of {}); expected it untouched until wait() returns (a "
                      "transport may write the result at any moment until then)",
                      pending_.rank, pending_.call, pending_.number, i, pending_.output.bytes()));
    }
  }

  void deliver() {
    delivered_ = true;
    if (pending_.output.bytes() == 0) return;
    const unsigned char* result =
        pending_.output_in_input_copy ? pending_.input_copy.data() : pending_.output_staging.data();
    copy_on(pending_.output.device, pending_.output.data, result, pending_.output.bytes());
  }

  std::unique_ptr<Work> inner_;
  Pending pending_;
  std::shared_ptr<Coin> coin_;
  bool delivered_ = false;
};

class AdversarialCommunicator final : public Communicator {
 public:
  AdversarialCommunicator(Communicator& inner, std::uint64_t seed)
      : inner_(inner), coin_(std::make_shared<Coin>(seed, inner.rank())) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string_view backend() const override { return inner_.backend(); }

  std::unique_ptr<Work> isend(ConstBuffer data, int peer, int tag) override {
    Pending pending = with_input("isend", data, /*check=*/true);
    const ConstBuffer copy{pending.input_copy.data(), data.count, data.type, data.device};
    return finish(inner_.isend(copy, peer, tag), std::move(pending));
  }

  std::unique_ptr<Work> irecv(MutableBuffer data, int peer, int tag) override {
    Pending pending = with_output("irecv", {}, data);
    const MutableBuffer staging{pending.output_staging.data(), data.count, data.type, data.device};
    return finish(inner_.irecv(staging, peer, tag), std::move(pending));
  }

  std::unique_ptr<Work> allreduce(MutableBuffer data, ReduceOp op) override {
    // In place: the backend reduces a copy of the input, which becomes the result.
    Pending pending = with_input("allreduce", data, /*check=*/false);
    pending.output = data;
    pending.output_in_input_copy = true;
    const MutableBuffer copy{pending.input_copy.data(), data.count, data.type, data.device};
    return finish(inner_.allreduce(copy, op), std::move(pending));
  }

  std::unique_ptr<Work> reduce_scatter(ConstBuffer in, MutableBuffer out, ReduceOp op) override {
    Pending pending = with_output("reduce_scatter", in, out);
    const ConstBuffer copy{pending.input_copy.data(), in.count, in.type, in.device};
    const MutableBuffer staging{pending.output_staging.data(), out.count, out.type, out.device};
    return finish(inner_.reduce_scatter(copy, staging, op), std::move(pending));
  }

  std::unique_ptr<Work> allgather(ConstBuffer in, MutableBuffer out) override {
    Pending pending = with_output("allgather", in, out);
    const ConstBuffer copy{pending.input_copy.data(), in.count, in.type, in.device};
    const MutableBuffer staging{pending.output_staging.data(), out.count, out.type, out.device};
    return finish(inner_.allgather(copy, staging), std::move(pending));
  }

  std::unique_ptr<Work> broadcast(MutableBuffer data, int root) override {
    if (rank() == root) {
      // The root's buffer is only read: it must stay unchanged until the call completes.
      Pending pending = with_input("broadcast", data, /*check=*/true);
      const MutableBuffer copy{pending.input_copy.data(), data.count, data.type, data.device};
      return finish(inner_.broadcast(copy, root), std::move(pending));
    }
    Pending pending = with_output("broadcast", {}, data);
    const MutableBuffer staging{pending.output_staging.data(), data.count, data.type, data.device};
    return finish(inner_.broadcast(staging, root), std::move(pending));
  }

  void barrier() override { inner_.barrier(); }
  CommCounters counters() const override { return inner_.counters(); }
  Clock& clock() override { return inner_.clock(); }

 private:
  Pending with_input(std::string_view call, ConstBuffer input, bool check) {
    Pending pending;
    pending.call = call;
    pending.number = ++calls_;
    pending.rank = inner_.rank();
    pending.input = input;
    pending.input_copy = copy_of(input);
    pending.check_input = check;
    return pending;
  }

  Pending with_output(std::string_view call, ConstBuffer input, MutableBuffer output) {
    Pending pending = with_input(call, input, /*check=*/!overlap(input, output));
    pending.output = output;
    pending.output_staging = Staging(output.bytes(), output.device);
    return pending;
  }

  static void poison(MutableBuffer output) {
    if (output.bytes() == 0) return;
    if (!on_gpu(output.device)) {
      std::memset(output.data, kGarbageByte, output.bytes());
      return;
    }
    Staging garbage(output.bytes());
    std::memset(garbage.data(), kGarbageByte, garbage.bytes());
    cuda::copy_bytes(output.data, garbage.data(), garbage.bytes());
  }

  /// Wraps the backend's Work of a call that was issued without error; only now is the
  /// caller's output filled with garbage (a call that throws at issue leaves it alone).
  std::unique_ptr<Work> finish(std::unique_ptr<Work> inner, Pending pending) {
    poison(pending.output);
    return std::make_unique<AdversarialWork>(std::move(inner), std::move(pending), coin_);
  }

  Communicator& inner_;
  std::shared_ptr<Coin> coin_;
  std::uint64_t calls_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_adversarial(Communicator& inner, std::uint64_t seed) {
  return std::make_unique<AdversarialCommunicator>(inner, seed);
}

}  // namespace dp::detail
