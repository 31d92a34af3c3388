// The adversarial completion mode: a decorator over any backend's communicator.
//
// Real communication libraries complete calls when they please: NCCL on its own stream,
// MPI whenever its progress engine runs. Lab code that reads a result before waiting for
// it, or waits for the last call only, is wrong, yet on the local backend (which finishes
// calls in issue order) it usually gets the right bits. This decorator removes that luck:
//
//   * every call runs on private copies: inputs are copied at issue, outputs land in a
//     staging buffer, and the caller's output buffer holds the call's poison (below) until
//     the call's own Work is waited on;
//   * wait() (or a test() that returns true, or the Work's destructor) copies the result
//     into the caller's buffer, so results arrive in the order the caller waits, not the
//     order it issued;
//   * before it does, wait() reports an input buffer the caller changed before the call
//     completed, which real transports forbid (they may read it at any moment until then),
//     and an output buffer that no longer holds exactly its poison: the caller wrote it or
//     computed on it, which they forbid too (they may write the result at any moment); for
//     an all-reduce in place, the buffer is both, and the poison check covers it. A Work
//     destroyed unwaited checks too, and since a destructor cannot throw, the rank's next
//     call (or launch(), when the rank's function returns) throws its report;
//   * test() answers false at random (seeded by the launch and the rank) before it asks the
//     backend, so code that polls once and moves on sees calls that have not finished.
//
// The poison. It used to be all bits set, a NaN for float32. That caught a write, but not
// arithmetic: NaN / N, NaN * s and NaN + y are the same NaN, so dividing the buffer of an
// in-flight all-reduce left every bit as it was, the check saw nothing, and the wait then
// overwrote the buffer with the result: the divide vanished without a word. Code that
// divided once more after the wait scored full marks, though on a real transport the first
// divide lands on the input or on the result, as the timing has it. Now element i of a
// call's output holds a number hashed from (seed, rank, the call's number on the rank, i),
// which differs between calls, ranks and elements, and is shaped so that no arithmetic
// keeps it:
//   float32  +-[1, 2) with a random mantissa: finite and ordinary, and x / N, x * s (s not
//            1), x + y (y not tiny against x) or another call's poison copied in change it;
//   bfloat16, float16  the same in the 16-bit formats: +-[1, 2), random sign and mantissa;
//   int32    a random odd number: x / N, x * s (s not 1) and x + y (y not 0) change it;
//   uint8    a random odd byte, likewise.
// A read alone changes nothing and is not reported: it sees the poison, numbers the checks
// find wrong. Dividing by 1 or adding 0 changes nothing either, and no check could see it.
//
// Groups (CommOptions::point_to_point_in_groups). NCCL launches the messages a rank issues
// between two waits as one group on the rank's one communication stream: a group starts only
// once the rank's previous one has finished, and a send finishes only once its receive is
// posted. Code that waits for its sends before posting the receives its peers' sends need
// therefore hangs on nccl while the local and mpi backends, which post every call at issue,
// run it. With the option, `Stream` below holds isend and irecv and hands a group to the
// backend only when the group before it has completed, so the local backend (whose sends are
// rendezvous without the simulated network) deadlocks as nccl hangs, and its deadlock
// detector reports it at once. Two simplifications: a group's completion is noticed when the
// rank next waits or tests (the calls of the next group are handed over then, not at the
// instant a GPU would start them), and a collective or barrier hands every held call over
// at once instead of queueing behind them.
//
// The backend underneath counts, validates and times the calls exactly as it would
// without the decorator. Staging buffers come from malloc inside a
// dp::detail::UncountedHeapAllocations, so that the grader's count of the allocations made
// by lab code does not see them.
//
// Device buffers are staged on their device (the backend gets device buffers, as the caller
// gave it), and copied and compared with copies on the caller's compute stream
// (cuda::copy_bytes), which run after the caller's kernels and, once the backend's Work
// waited, after the call: the poison is drawn on the host and copied in, and comparisons
// copy the device's bytes to the host first. It is slow, and only for grading.
#include "comm/adversarial.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "comm/argument_checks.h"
#include "comm/in_flight_buffers.h"
#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/clock.h"
#include "dp/error.h"
#include "dp/memory.h"
#include "dp/rng.h"

namespace dp::detail {
namespace {

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
    // The backend below checks that a device buffer lies in device memory.
    if (on_emulated_device()) note_emulated_device_memory(data_, bytes_);
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
    if (on_emulated_device()) forget_emulated_device_memory(data_);
    if (!on_gpu(device_))
      std::free(data_);
    else
      cuda::deallocate(data_);
  }

  unsigned char* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  bool on_emulated_device() const { return device_ != Device::kHost && !on_gpu(device_); }

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

/// The bytes [first, last) of `a` that `b` covers, as offsets into `a` (first == last if
/// they do not overlap).
struct ByteRange {
  std::size_t first = 0;
  std::size_t last = 0;
};
ByteRange overlap(ConstBuffer a, ConstBuffer b) {
  const auto* a_begin = static_cast<const unsigned char*>(a.data);
  const auto* b_begin = static_cast<const unsigned char*>(b.data);
  if (a.bytes() == 0 || b.bytes() == 0 || a_begin >= b_begin + b.bytes() ||
      b_begin >= a_begin + a.bytes())
    return {};
  const auto* first = std::max(a_begin, b_begin);
  const auto* last = std::min(a_begin + a.bytes(), b_begin + b.bytes());
  return {static_cast<std::size_t>(first - a_begin), static_cast<std::size_t>(last - a_begin)};
}

/// The first byte in [first, last) where `a` and `b` differ, or `last` (memcmp answers the
/// common case, no difference, fast).
std::size_t first_different_byte(const unsigned char* a, const unsigned char* b, std::size_t first,
                                 std::size_t last) {
  if (first == last || std::memcmp(a + first, b + first, last - first) == 0) return last;
  return static_cast<std::size_t>(std::mismatch(a + first, a + last, b + first).first - a);
}

/// The bits of element `i` of `bytes` (element_size(type) bytes: 1, 2 or 4).
std::uint32_t element_bits(DataType type, const unsigned char* bytes, std::size_t i) {
  const std::size_t size = element_size(type);
  if (size == 1) return bytes[i];
  if (size == 2) {
    std::uint16_t bits = 0;
    std::memcpy(&bits, bytes + 2 * i, 2);
    return bits;
  }
  std::uint32_t bits = 0;
  std::memcpy(&bits, bytes + 4 * i, 4);
  return bits;
}

/// An element's value as the caller's code sees it, for messages.
std::string element_text(DataType type, std::uint32_t bits) {
  switch (type) {
    case DataType::kFloat32: return fmt::format("{}", std::bit_cast<float>(bits));
    case DataType::kInt32: return fmt::format("{}", std::bit_cast<std::int32_t>(bits));
    case DataType::kBFloat16:
      return fmt::format("{}", to_float(BFloat16{static_cast<std::uint16_t>(bits)}));
    case DataType::kFloat16:
      return fmt::format("{}", to_float(Float16{static_cast<std::uint16_t>(bits)}));
    case DataType::kUInt8: break;
  }
  return fmt::format("{}", bits);
}

/// A 32-bit hash: the finaliser of MurmurHash3 (Austin Appleby, public domain). A bijection
/// whose every output bit depends on every input bit: consecutive inputs give unrelated
/// outputs, and distinct inputs distinct ones.
constexpr std::uint32_t mix(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EB'CA6BU;
  x ^= x >> 13;
  x *= 0xC2B2'AE35U;
  x ^= x >> 16;
  return x;
}

/// What a call's output holds from its issue until its wait (see the top of this file for
/// why): element i is mix(key + i) with some bits fixed by the element type, and a key that
/// Philox draws for (seed, rank, the call's number on the rank). It differs between calls,
/// ranks and elements, and costs a few vectorised instructions per element, where a Philox
/// draw per element would cost tens: filling and checking a buffer take about as long as
/// copying it.
class Poison {
 public:
  Poison(std::uint64_t seed, int rank, std::uint64_t call, DataType type)
      : key_(CounterRng(seed,
                        // Streams of their own: high bit set (the test() coin's are small),
                        // then the rank (below 2^8) and the call (below 2^40).
                        (std::uint64_t{1} << 63) | (static_cast<std::uint64_t>(rank) << 40) | call)
                 .next_u32()),
        width_(element_size(type)) {
    switch (type) {
      case DataType::kFloat32:
        // Sign and mantissa random, the exponent of 1: +-[1, 2), never 0, NaN or infinite.
        keep_ = 0x807F'FFFFU;
        set_ = 0x3F80'0000U;
        break;
      case DataType::kBFloat16:  // the same in bfloat16's 16 bits: +-[1, 2)
        keep_ = 0x807FU;
        set_ = 0x3F80U;
        break;
      case DataType::kFloat16:  // float16's exponent of 1 (15): +-[1, 2)
        keep_ = 0x83FFU;
        set_ = 0x3C00U;
        break;
      case DataType::kInt32:  // odd
        keep_ = 0xFFFF'FFFFU;
        set_ = 1;
        break;
      case DataType::kUInt8:  // odd
        keep_ = 0xFFU;
        set_ = 1;
        break;
    }
  }

  /// The bits of element `i` (an element's worth: a byte for uint8, two for the 16-bit
  /// floats).
  std::uint32_t element(std::size_t i) const {
    return (mix(key_ + static_cast<std::uint32_t>(i)) & keep_) | set_;
  }

  /// Fills `count` elements of host memory with the poison.
  void fill(unsigned char* bytes, std::size_t count) const {
    if (width_ == 1)
      fill_with<std::uint8_t>(bytes, count);
    else if (width_ == 2)
      fill_with<std::uint16_t>(bytes, count);
    else
      fill_with<std::uint32_t>(bytes, count);
  }

  /// The index of the first of `count` elements of host memory that is not the poison, or
  /// `count` if all are.
  std::size_t first_difference(const unsigned char* bytes, std::size_t count) const {
    if (width_ == 1) return first_difference_of<std::uint8_t>(bytes, count);
    if (width_ == 2) return first_difference_of<std::uint16_t>(bytes, count);
    return first_difference_of<std::uint32_t>(bytes, count);
  }

 private:
  template <typename Word>
  void fill_with(unsigned char* bytes, std::size_t count) const {
    // A local copy: the stores below cannot change it, so the loop vectorises.
    const Poison poison = *this;
    for (std::size_t i = 0; i < count; ++i) {
      const auto word = static_cast<Word>(poison.element(i));
      std::memcpy(bytes + sizeof(Word) * i, &word, sizeof(Word));
    }
  }

  template <typename Word>
  std::size_t first_difference_of(const unsigned char* bytes, std::size_t count) const {
    const auto seen = [bytes](std::size_t i) {
      Word word = 0;
      std::memcpy(&word, bytes + sizeof(Word) * i, sizeof(Word));
      return std::uint32_t{word};
    };
    // Blocks without an early exit inside, which the compiler vectorises; a block with a
    // difference is searched again to find it.
    constexpr std::size_t kBlock = 4096;
    for (std::size_t begin = 0; begin < count; begin += kBlock) {
      const std::size_t end = std::min(count, begin + kBlock);
      std::uint32_t differences = 0;
      for (std::size_t i = begin; i < end; ++i) differences |= seen(i) ^ element(i);
      if (differences == 0) continue;
      for (std::size_t i = begin; i < end; ++i)
        if (seen(i) != element(i)) return i;
    }
    return count;
  }

  std::uint32_t key_;
  std::size_t width_;       // bytes per element: 1, 2 or 4
  std::uint32_t keep_ = 0;  // the random bits of the element kept
  std::uint32_t set_ = 0;   // the bits then set
};

/// What one call keeps until it is delivered.
struct Pending {
  std::string call;              // "allreduce (its call #3: 128 float32 in place)", for messages
  std::string_view kind;         // "allreduce"
  std::uint64_t number = 0;      // the call's position among this rank's calls
  int rank = 0;                  // the rank that made it
  ConstBuffer input;             // the caller's input (checked at wait), or empty
  Staging input_copy;            // what the backend reads
  MutableBuffer output;          // the caller's output, or empty
  Staging output_staging;        // what the backend writes (may be input_copy's memory)
  std::optional<Poison> poison;  // what `output` holds until the call is delivered
  bool output_in_input_copy = false;
  bool check_input = false;   // compare `input` with `input_copy` at wait()
  ByteRange input_in_output;  // the bytes of `input` that `output` covers: not compared
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

/// A dp::Error raised on `rank`: its message reads "rank R: <message>" wherever it is caught
/// (launch() would add the same when it rethrows it).
Error error_of_rank(int rank, const std::string& message) {
  Error error(message);
  error.set_rank(rank);
  return error;
}

/// The first report a Work's destructor found (it cannot throw it), until the communicator
/// throws it.
struct DeferredReport {
  std::string message;
};

/// One point-to-point call held back under grouped launching (see `Stream`).
struct HeldCall {
  std::function<std::unique_ptr<Work>()> issue;  // hands the call to the backend
  std::unique_ptr<Work> backend_work;            // once handed over
  int tag = 0;
  bool done = false;       // its group has completed
  bool abandoned = false;  // its Work was destroyed unwaited during an unwind: never handed over
};

/// A rank's point-to-point calls under `CommOptions::point_to_point_in_groups`, as the nccl
/// backend runs them (see the top of this file): held until the next wait or test, launched
/// as one group sorted by tag, and the groups handed to the backend one after another, each
/// once the one before it has completed.
class Stream {
 public:
  /// Holds `call` until the next launch.
  void hold(std::shared_ptr<HeldCall> call) { held_.push_back(std::move(call)); }

  /// Launches the held calls as one group behind the launched ones (handed to the backend at
  /// once when no group is ahead of it).
  void launch() {
    if (held_.empty()) return;
    std::stable_sort(held_.begin(), held_.end(),
                     [](const auto& a, const auto& b) { return a->tag < b->tag; });
    groups_.push_back(std::exchange(held_, {}));
    if (groups_.size() == 1) start_front();
  }

  /// Launches the held calls, then completes the groups up to `call`'s, each after the one
  /// before it (blocking in the backend's waits, where its deadlock detector sees the rank).
  void complete(const HeldCall& call) {
    launch();
    while (!call.done && !groups_.empty()) finish_front();
  }

  /// As `complete`, without blocking: false when a call of a group up to `call`'s has not
  /// completed yet.
  bool try_complete(const HeldCall& call) {
    launch();
    while (!call.done && !groups_.empty()) {
      for (const auto& each : groups_.front())
        if (each->backend_work && !each->backend_work->test()) return false;
      finish_front();
    }
    return call.done;
  }

  /// Launches the held calls and hands every launched call to the backend (before a
  /// collective or a barrier, which would otherwise wait for calls no one hands over).
  void hand_over_all() {
    launch();
    for (const auto& group : groups_)
      for (const auto& each : group) hand_over(*each);
  }

 private:
  static void hand_over(HeldCall& call) {
    if (!call.backend_work && !call.abandoned) call.backend_work = call.issue();
  }
  void start_front() {
    for (const auto& each : groups_.front()) hand_over(*each);
  }
  /// Completes the front group (every call of it), then hands the next one to the backend.
  void finish_front() {
    const std::vector<std::shared_ptr<HeldCall>> group = std::move(groups_.front());
    groups_.pop_front();
    for (const auto& each : group)
      if (each->backend_work) each->backend_work->wait();
    for (const auto& each : group) each->done = true;
    if (!groups_.empty()) start_front();
  }

  std::vector<std::shared_ptr<HeldCall>> held_;
  std::deque<std::vector<std::shared_ptr<HeldCall>>> groups_;
};

class AdversarialWork final : public Work {
 public:
  AdversarialWork(std::unique_ptr<Work> inner, Pending pending, std::shared_ptr<Coin> coin,
                  std::shared_ptr<DeferredReport> deferred, std::shared_ptr<Stream> stream)
      : inner_(std::move(inner)),
        pending_(std::move(pending)),
        coin_(std::move(coin)),
        deferred_(std::move(deferred)),
        stream_(std::move(stream)) {}
  /// A point-to-point call held by `stream` (grouped launching): `held` reaches the backend
  /// when its group does.
  AdversarialWork(std::shared_ptr<HeldCall> held, std::shared_ptr<Stream> stream, Pending pending,
                  std::shared_ptr<Coin> coin, std::shared_ptr<DeferredReport> deferred)
      : pending_(std::move(pending)),
        coin_(std::move(coin)),
        deferred_(std::move(deferred)),
        held_(std::move(held)),
        stream_(std::move(stream)) {}

  ~AdversarialWork() override {
    // Destroying a Work waits for its call (comm.h), and the result is delivered then. While
    // an exception unwinds, the backend's own Work decides (it aborts the other ranks
    // rather than wait for a call that may never complete): nothing is delivered.
    if (!delivered_ && std::uncaught_exceptions() == 0) {
      try {
        wait_backend();
        // The caller never waited: a buffer it touched meanwhile is reported by the
        // communicator instead (a destructor cannot throw).
        if (std::optional<std::string> report = find_touched_buffer();
            report && !reported_ && deferred_->message.empty())
          deferred_->message =
              *report +
              " (found when its Work was destroyed without wait(), and reported at "
              "the rank's next call or when its function returned)";
        deliver();
      } catch (const std::exception&) {
        // The backend reports the error through the call that waits or through the abort.
      }
    }
    // The backend's Work goes first: until its destructor returns, the call may still read
    // the input copy and write the staging buffer that `pending_` owns (members would be
    // destroyed in the other order, freeing them under a running call).
    inner_.reset();
    if (held_) {
      if (!held_->done) held_->abandoned = true;  // never handed over after this
      held_->backend_work.reset();
    }
  }

  void wait() override {
    // Under grouped launching any wait launches the calls held so far, as nccl's does.
    if (stream_) stream_->launch();
    if (delivered_) return;
    wait_backend();
    if (std::optional<std::string> report = find_touched_buffer()) {
      reported_ = true;
      throw error_of_rank(pending_.rank, *report);
    }
    deliver();
  }

  bool test() override {
    if (stream_) stream_->launch();
    if (delivered_) return true;
    if (coin_->heads()) return false;  // "not yet", whatever the backend would say
    if (held_ ? !stream_->try_complete(*held_) : !inner_->test()) return false;
    wait();
    return true;
  }

 private:
  /// What the caller did to a buffer of the call before its wait, or nothing.
  std::optional<std::string> find_touched_buffer() const {
    if (std::optional<std::string> report = find_changed_input()) return report;
    return find_touched_output();
  }

  std::optional<std::string> find_changed_input() const {
    if (!pending_.check_input || pending_.input.bytes() == 0) return std::nullopt;
    Staging caller_bytes;
    Staging copy_bytes;
    const unsigned char* caller = readable_on_host(pending_.input, caller_bytes);
    const unsigned char* copy =
        readable_on_host({pending_.input_copy.data(), pending_.input.bytes(), DataType::kUInt8,
                          pending_.input.device},
                         copy_bytes);
    // The bytes that are also the output hold its poison: the output's check covers them.
    const ByteRange skip = pending_.input_in_output;
    const std::size_t bytes = pending_.input.bytes();
    std::size_t byte = first_different_byte(caller, copy, 0, skip.first);
    if (byte == skip.first) byte = first_different_byte(caller, copy, skip.last, bytes);
    if (byte == bytes) return std::nullopt;
    const DataType type = pending_.input.type;
    const std::size_t i = byte / element_size(type);
    return fmt::format(
        "{}: element {} of its input buffer changed before the call completed: it "
        "held {}, now {}; expected it unchanged until wait() returns (a transport may read it "
        "at any moment until then)",
        pending_.call, i, element_text(type, element_bits(type, copy, i)),
        element_text(type, element_bits(type, caller, i)));
  }

  std::optional<std::string> find_touched_output() const {
    if (!pending_.poison || pending_.output.bytes() == 0) return std::nullopt;
    Staging output_bytes;
    const unsigned char* seen = readable_on_host(pending_.output, output_bytes);
    const std::size_t count = pending_.output.count;
    const std::size_t i = pending_.poison->first_difference(seen, count);
    if (i == count) return std::nullopt;
    const DataType type = pending_.output.type;
    return fmt::format(
        "{}: element {} of its {} changed before its wait(): it held the poison {}, "
        "now {}. The buffer of an in-flight {} was written or computed on before its wait(): "
        "a transport may write the result at any moment until then",
        pending_.call, i, pending_.output_in_input_copy ? "buffer" : "output buffer",
        element_text(type, pending_.poison->element(i)),
        element_text(type, element_bits(type, seen, i)), pending_.kind);
  }

  void deliver() {
    delivered_ = true;
    if (pending_.output.bytes() == 0) return;
    const unsigned char* result =
        pending_.output_in_input_copy ? pending_.input_copy.data() : pending_.output_staging.data();
    copy_on(pending_.output.device, pending_.output.data, result, pending_.output.bytes());
  }

  /// Waits for the backend's call (a held call: for its group and the groups before it).
  void wait_backend() {
    if (held_)
      stream_->complete(*held_);
    else
      inner_->wait();
  }

  std::unique_ptr<Work> inner_;  // the backend's Work, unless the call is held
  Pending pending_;
  std::shared_ptr<Coin> coin_;
  std::shared_ptr<DeferredReport> deferred_;
  std::shared_ptr<HeldCall> held_;  // a held call (grouped launching), instead of inner_
  std::shared_ptr<Stream> stream_;  // the rank's stream under grouped launching, or null
  bool delivered_ = false;
  bool reported_ = false;  // wait() threw the report already
};

/// The clock lab code sees in a graded run: it reads the rank's clock and charges nothing.
/// The runtime charges compute as the code runs (the layers and the optimizer through
/// `this_thread_clock()`), and the checks mark steps through `charging_clock`; were lab code
/// able to charge the clock, it could add compute while a call is in flight and make its
/// communication look hidden.
class ReadingClock final : public Clock {
 public:
  explicit ReadingClock(Clock& inner) : inner_(inner) {}

  bool simulated() const override { return inner_.simulated(); }
  double now() const override { return inner_.now(); }
  double link_free() const override { return inner_.link_free(); }
  ComputeStart start_compute() const override { return inner_.start_compute(); }
  void finish_compute(const ComputeStart&, std::string_view name, std::string_view,
                      const OpCost&) override {
    refuse(fmt::format("finish_compute(\"{}\")", name));
  }
  void compute(std::string_view name, double) override {
    refuse(fmt::format("compute(\"{}\")", name));
  }
  void mark_step() override { refuse("mark_step()"); }
  RankTrace trace() const override { return inner_.trace(); }

 private:
  [[noreturn]] static void refuse(const std::string& call) {
    throw Error(fmt::format(
        "comm.clock().{}: in a graded run the clock only reads; the runtime charges compute as "
        "your code runs and the checks mark the steps, so lab code charges nothing",
        call));
  }

  Clock& inner_;
};

class Decorator final : public AdversarialCommunicator {
 public:
  Decorator(Communicator& inner, std::uint64_t seed, bool in_groups)
      : Decorator(nullptr, inner, seed, in_groups) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string_view backend() const override { return inner_.backend(); }

  std::unique_ptr<Work> isend(ConstBuffer data, int peer, int tag) override {
    Pending pending =
        with_input("isend", fmt::format("{} to rank {}, tag {}", sizes(data), peer, tag), data,
                   /*check=*/true);
    const ConstBuffer copy{pending.input_copy.data(), data.count, data.type, data.device};
    if (stream_)
      return hold([&inner = inner_, copy, peer, tag] { return inner.isend(copy, peer, tag); }, tag,
                  std::move(pending));
    return finish(inner_.isend(copy, peer, tag), std::move(pending));
  }

  std::unique_ptr<Work> irecv(MutableBuffer data, int peer, int tag) override {
    Pending pending = with_output(
        "irecv", fmt::format("{} from rank {}, tag {}", sizes(data), peer, tag), {}, data);
    const MutableBuffer staging{pending.output_staging.data(), data.count, data.type, data.device};
    if (stream_)
      return hold([&inner = inner_, staging, peer, tag] { return inner.irecv(staging, peer, tag); },
                  tag, std::move(pending));
    return finish(inner_.irecv(staging, peer, tag), std::move(pending));
  }

  std::unique_ptr<Work> allreduce(MutableBuffer data, ReduceOp op) override {
    hand_over_held_calls();
    // In place: the backend reduces a copy of the input, which becomes the result. The
    // buffer holds the poison meanwhile, whose check covers it as input too.
    Pending pending =
        with_input("allreduce", fmt::format("{} in place", sizes(data)), data, /*check=*/false);
    pending.output = data;
    pending.output_in_input_copy = true;
    const MutableBuffer copy{pending.input_copy.data(), data.count, data.type, data.device};
    return finish(inner_.allreduce(copy, op), std::move(pending));
  }

  std::unique_ptr<Work> reduce_scatter(ConstBuffer in, MutableBuffer out, ReduceOp op) override {
    hand_over_held_calls();
    Pending pending =
        with_output("reduce_scatter", fmt::format("{} in, {} out", sizes(in), out.count), in, out);
    const ConstBuffer copy{pending.input_copy.data(), in.count, in.type, in.device};
    const MutableBuffer staging{pending.output_staging.data(), out.count, out.type, out.device};
    return finish(inner_.reduce_scatter(copy, staging, op), std::move(pending));
  }

  std::unique_ptr<Work> allgather(ConstBuffer in, MutableBuffer out) override {
    hand_over_held_calls();
    Pending pending =
        with_output("allgather", fmt::format("{} in, {} out", sizes(in), out.count), in, out);
    const ConstBuffer copy{pending.input_copy.data(), in.count, in.type, in.device};
    const MutableBuffer staging{pending.output_staging.data(), out.count, out.type, out.device};
    return finish(inner_.allgather(copy, staging), std::move(pending));
  }

  std::unique_ptr<Work> broadcast(MutableBuffer data, int root) override {
    hand_over_held_calls();
    const std::string what = fmt::format("{} from rank {}", sizes(data), root);
    if (rank() == root) {
      // The root's buffer is only read: it must stay unchanged until the call completes.
      Pending pending = with_input("broadcast", what, data, /*check=*/true);
      const MutableBuffer copy{pending.input_copy.data(), data.count, data.type, data.device};
      return finish(inner_.broadcast(copy, root), std::move(pending));
    }
    Pending pending = with_output("broadcast", what, {}, data);
    const MutableBuffer staging{pending.output_staging.data(), data.count, data.type, data.device};
    return finish(inner_.broadcast(staging, root), std::move(pending));
  }

  void barrier() override {
    throw_report_of_destroyed_work();
    hand_over_held_calls();
    inner_.barrier();
  }
  std::unique_ptr<Communicator> split(int color, int key) override {
    throw_report_of_destroyed_work();
    hand_over_held_calls();
    std::unique_ptr<Communicator> inner = inner_.split(color, key);
    if (!inner) return nullptr;
    // A seed of its own for the new communicator (its ranks and call numbers start again),
    // so that its poisons and coins are not this communicator's again.
    CounterRng draw(seed_, 0x5B17'0000'0000ULL + ++splits_);
    const std::uint64_t seed = (std::uint64_t{draw.next_u32()} << 32) | draw.next_u32();
    Communicator& backend = *inner;
    return std::unique_ptr<Communicator>(
        new Decorator(std::move(inner), backend, seed, stream_ != nullptr));
  }
  CommCounters counters() const override { return inner_.counters(); }
  Clock& clock() override { return reading_clock_; }
  Clock& charging_clock() override { return inner_.clock(); }

  void throw_report_of_destroyed_work() override {
    if (deferred_->message.empty()) return;
    throw error_of_rank(rank(), std::exchange(deferred_->message, {}));
  }

 private:
  /// Decorates `inner`, which `owned` owns when it is not null (a communicator split from
  /// a decorated one).
  Decorator(std::unique_ptr<Communicator> owned, Communicator& inner, std::uint64_t seed,
            bool in_groups)
      : owned_(std::move(owned)),
        inner_(inner),
        reading_clock_(inner.clock()),
        seed_(seed),
        coin_(std::make_shared<Coin>(seed, inner.rank())),
        deferred_(std::make_shared<DeferredReport>()),
        stream_(in_groups ? std::make_shared<Stream>() : nullptr) {}

  /// "128 float32", for messages.
  static std::string sizes(ConstBuffer buffer) {
    return fmt::format("{} {}", buffer.count, to_string(buffer.type));
  }

  Pending with_input(std::string_view kind, std::string_view what, ConstBuffer input, bool check) {
    throw_report_of_destroyed_work();
    Pending pending;
    pending.kind = kind;
    pending.number = ++calls_;
    pending.call = fmt::format("{} (its call #{}: {})", kind, pending.number, what);
    pending.rank = inner_.rank();
    require_device_memory(input, kind);
    pending.input = input;
    pending.input_copy = copy_of(input);
    pending.check_input = check;
    return pending;
  }

  Pending with_output(std::string_view kind, std::string_view what, ConstBuffer input,
                      MutableBuffer output) {
    require_device_memory(output, kind);
    Pending pending = with_input(kind, what, input, /*check=*/true);
    // An input inside the output (an all-gather or reduce-scatter in place) holds the
    // poison there: only its other bytes must stay as they were.
    pending.input_in_output = overlap(input, output);
    pending.output = output;
    pending.output_staging = Staging(output.bytes(), output.device);
    return pending;
  }

  /// Fills the caller's output with the call's poison (drawn on the host, then copied to a
  /// device buffer).
  void poison(Pending& pending) {
    const MutableBuffer output = pending.output;
    if (output.bytes() == 0) return;
    pending.poison.emplace(seed_, pending.rank, pending.number, output.type);
    if (!on_gpu(output.device)) {
      pending.poison->fill(static_cast<unsigned char*>(output.data), output.count);
      return;
    }
    Staging host(output.bytes());
    pending.poison->fill(host.data(), output.count);
    cuda::copy_bytes(output.data, host.data(), host.bytes());
  }

  /// Under grouped launching: hands every held point-to-point call to the backend.
  void hand_over_held_calls() {
    if (stream_) stream_->hand_over_all();
  }

  /// Holds a point-to-point call, which `issue` hands to the backend when its group goes
  /// (grouped launching); the caller's output gets its poison now.
  std::unique_ptr<Work> hold(std::function<std::unique_ptr<Work>()> issue, int tag,
                             Pending pending) {
    auto held = std::make_shared<HeldCall>();
    held->issue = std::move(issue);
    held->tag = tag;
    stream_->hold(held);
    poison(pending);
    return std::make_unique<AdversarialWork>(std::move(held), stream_, std::move(pending), coin_,
                                             deferred_);
  }

  /// Wraps the backend's Work of a call that was issued without error; only now does the
  /// caller's output get its poison (a call that throws at issue leaves it alone).
  std::unique_ptr<Work> finish(std::unique_ptr<Work> inner, Pending pending) {
    poison(pending);
    return std::make_unique<AdversarialWork>(std::move(inner), std::move(pending), coin_, deferred_,
                                             stream_);
  }

  std::unique_ptr<Communicator> owned_;  // a split's communicator, or null
  Communicator& inner_;
  ReadingClock reading_clock_;
  std::uint64_t seed_;
  std::shared_ptr<Coin> coin_;
  std::shared_ptr<DeferredReport> deferred_;
  std::shared_ptr<Stream> stream_;  // grouped launching, or null
  std::uint64_t calls_ = 0;
  std::uint64_t splits_ = 0;
};

}  // namespace

std::unique_ptr<AdversarialCommunicator> make_adversarial(Communicator& inner, std::uint64_t seed,
                                                          bool in_groups) {
  return std::make_unique<Decorator>(inner, seed, in_groups);
}

Clock& charging_clock(Communicator& comm) {
  if (auto* guard = dynamic_cast<InFlightBufferGuard*>(&comm))
    return charging_clock(guard->inner());
  if (auto* adversarial = dynamic_cast<AdversarialCommunicator*>(&comm))
    return adversarial->charging_clock();
  return comm.clock();
}

}  // namespace dp::detail
