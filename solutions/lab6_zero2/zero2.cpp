// zero2.cpp: lab 6, ZeRO-2. Your part: the bucket rule, the members of
// ZeroTwoOptimizer::State and the bodies below.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dp/error.h"
#include "dp/memory.h"
#include "dp/sharded_checkpoint.h"
#include "dp/tensor_ops.h"
#include "lab6.h"

namespace dp::lab6 {

// BEGIN SOLUTION
// SKELETON: // Your constants, if any.
/// The reference design's bucket buffers (fewer when there are fewer buckets): bucket k
/// fills buffer k mod 2 while the reduce-scatter of bucket k - 1 is still in flight.
constexpr std::size_t kBucketBuffers = 2;
/// A landing that holds no bucket's earlier sum.
constexpr std::size_t kNothingOwed = static_cast<std::size_t>(-1);
// END SOLUTION

std::vector<Bucket> plan_buckets(const Model& model, int world_size, std::size_t bucket_cap_bytes) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)world_size;
  // SKELETON: (void)bucket_cap_bytes;
  // SKELETON: throw NotImplemented("lab6::plan_buckets");
  if (world_size < 1) throw Error(fmt::format("plan_buckets: world size {} < 1", world_size));
  std::vector<Bucket> buckets;
  Bucket open;
  const std::span<const Parameter* const> parameters = model.parameters();
  // Reverse definition order: the order backward makes the gradients ready.
  for (std::size_t i = parameters.size(); i-- > 0;) {
    const Parameter& parameter = *parameters[i];
    if (parameter.frozen)
      throw Error(
          fmt::format("plan_buckets: parameter {} is frozen; ZeRO-2 shards every "
                      "parameter's gradient",
                      parameter.name));
    const std::size_t bytes_after = (open.elements + parameter.value.size()) * sizeof(float);
    if (!open.parameters.empty() && bytes_after > bucket_cap_bytes) {
      buckets.push_back(std::move(open));
      open = Bucket{};
    }
    open.parameters.push_back(i);
    open.elements += parameter.value.size();
  }
  if (!open.parameters.empty()) buckets.push_back(std::move(open));
  const auto n = static_cast<std::size_t>(world_size);
  std::size_t offset = 0;
  for (Bucket& bucket : buckets) {
    bucket.chunk_elements = (bucket.elements + n - 1) / n;
    bucket.shard_offset = offset;
    offset += bucket.chunk_elements;
  }
  return buckets;
  // END SOLUTION
}

std::size_t shard_elements(const std::vector<Bucket>& buckets) {
  // BEGIN SOLUTION
  // SKELETON: (void)buckets;
  // SKELETON: throw NotImplemented("lab6::shard_elements");
  std::size_t total = 0;
  for (const Bucket& bucket : buckets) total += bucket.chunk_elements;
  return total;
  // END SOLUTION
}

/// Everything a ZeroTwoOptimizer keeps between hooks and steps.
struct ZeroTwoOptimizer::State {
  // BEGIN SOLUTION
  // SKELETON: // Your members.
  /// Where one gradient goes: its bucket and its first element in the bucket's flat range.
  struct Slot {
    std::size_t bucket = 0;
    std::size_t offset = 0;
  };

  State(Model& m, Communicator& c) : model(m), comm(c) {}

  Model& model;
  Communicator& comm;
  float max_norm = 0;
  std::vector<Bucket> buckets;
  std::unique_ptr<Optimizer> inner;
  /// kBucketBuffers (or fewer) buffers of max_k N C_k elements: bucket k uses k mod 2.
  std::vector<Tensor> buffers;
  /// (S): this rank's chunks of the summed, then averaged, gradient.
  Tensor shard_grad;
  /// (S): this rank's chunks of the parameters.
  Tensor shard_params;
  /// (1): this rank's partial squared norm, then the sum over ranks (clipping only).
  Tensor norm_buffer;
  std::vector<Slot> slot_of;                   ///< indexed by parameter index
  std::vector<std::size_t> missing;            ///< per bucket: gradients not yet copied in
  std::vector<std::unique_ptr<Work>> pending;  ///< per bucket: its reduce-scatter in flight
  std::size_t launched = 0;                    ///< buckets 0 .. launched-1 are on their way

  // Gradient accumulation.
  AccumulationOptions accumulation;
  /// Per parameter: the backwards since the last step that made its gradient ready.
  std::vector<int> arrivals;
  /// kReduceEveryMicroBatch: micro-batches before the current one since the last step.
  int micro = 0;
  /// kReduceEveryMicroBatch with M > 1, one per buffer, C_max elements each: while a later
  /// micro-batch's reduce-scatter overwrites a bucket's chunk of the shard, the sum of the
  /// micro-batches before it waits here.
  std::vector<Tensor> landings;
  /// Per landing: the bucket whose earlier sum it holds (kNothingOwed: none).
  std::vector<std::size_t> owed;

  Tensor& buffer_of(std::size_t bucket) { return buffers[bucket % buffers.size()]; }

  /// M, the backwards of every step.
  std::size_t micro_batches() const { return static_cast<std::size_t>(accumulation.micro_batches); }

  /// The buffer of bucket `bucket` seen as its padded flat range (N C elements).
  TensorView padded_range(std::size_t bucket) {
    return buffer_of(bucket).view(
        0, buckets[bucket].chunk_elements * static_cast<std::size_t>(comm.size()));
  }

  bool reduce_once() const { return accumulation.accumulation == Accumulation::kReduceOnce; }

  /// The backwards since the last step (each begins with the first bucket's first gradient).
  int backwards() const { return arrivals[buckets.front().parameters.front()]; }

  /// Adds the earlier micro-batches' sum kept in landing `l` into its bucket's chunk of the
  /// shard once that chunk's reduce-scatter is complete: s_m + (s_0 + ... + s_{m-1}), the
  /// bits of (s_0 + ... + s_{m-1}) + s_m, since IEEE addition commutes.
  void settle(std::size_t l) {
    if (owed[l] == kNothingOwed) return;
    const Bucket& bucket = buckets[owed[l]];
    if (pending[owed[l]] != nullptr) {
      pending[owed[l]]->wait();
      pending[owed[l]].reset();
    }
    add(std::as_const(landings[l]).view(0, bucket.chunk_elements),
        shard_grad.view(bucket.shard_offset, bucket.chunk_elements));
    owed[l] = kNothingOwed;
  }

  /// Before bucket `b` of a later micro-batch is reduce-scattered into its chunk of the
  /// shard (which overwrites it), keeps the sum of the micro-batches before it aside.
  void keep_sum_aside(std::size_t b) {
    if (micro == 0) return;
    const std::size_t l = b % landings.size();
    settle(l);
    const Bucket& bucket = buckets[b];
    copy(std::as_const(shard_grad).view(bucket.shard_offset, bucket.chunk_elements),
         landings[l].view(0, bucket.chunk_elements));
    owed[l] = b;
  }

  /// Counts this gradient's backward; false while kReduceOnce keeps it in
  /// Parameter::grad for a later backward to add into. A later micro-batch of
  /// kReduceEveryMicroBatch first completes the one before it.
  bool arrive(const Parameter& parameter) {
    int& seen = arrivals[parameter.index];
    if (seen == accumulation.micro_batches)
      throw Error(fmt::format(
          "ZeroTwoOptimizer: the gradient of {} is ready for backward {} since the last step(), "
          "with {} micro-batch(es) per step; call step() after every {} backward(s)",
          parameter.name, seen + 1, accumulation.micro_batches, accumulation.micro_batches));
    ++seen;
    if (reduce_once()) return seen == accumulation.micro_batches;
    if (launched == buckets.size()) {  // the first gradient of the next micro-batch
      for (auto& work : pending)
        if (work != nullptr) {
          work->wait();
          work.reset();
        }
      for (std::size_t l = 0; l < landings.size(); ++l) settle(l);
      for (std::size_t b = 0; b < buckets.size(); ++b) missing[b] = buckets[b].parameters.size();
      launched = 0;
      ++micro;
    }
    return true;
  }

  /// The gradient-ready hook: copy in, release, launch every complete bucket in order.
  void on_ready(Parameter& parameter) {
    if (!arrive(parameter)) return;  // kept for the next backward to add into
    const Slot slot = slot_of[parameter.index];
    const Bucket& bucket = buckets[slot.bucket];
    if (missing[slot.bucket] == bucket.parameters.size() && slot.bucket >= buffers.size() &&
        pending[slot.bucket - buffers.size()] != nullptr) {
      // The first gradient of this bucket: the bucket that used its buffer must be done.
      pending[slot.bucket - buffers.size()]->wait();
      pending[slot.bucket - buffers.size()].reset();
    }
    copy(parameter.grad.view(), buffer_of(slot.bucket).view(slot.offset, parameter.grad.size()));
    parameter.grad = Tensor();  // released: only the shard of the gradient stays
    --missing[slot.bucket];
    while (launched < buckets.size() && missing[launched] == 0) {
      keep_sum_aside(launched);
      const Bucket& full = buckets[launched];
      const std::size_t padded = full.chunk_elements * static_cast<std::size_t>(comm.size());
      // The buffer is shared with other buckets: zero this bucket's padding before it goes.
      if (full.elements < padded)
        fill(buffer_of(launched).view(full.elements, padded - full.elements), 0.0f);
      pending[launched] = comm.reduce_scatter(
          std::as_const(buffer_of(launched)).view(0, padded),
          shard_grad.view(full.shard_offset, full.chunk_elements), ReduceOp::kSum);
      ++launched;
    }
  }

  /// Makes every bucket wait for all of its gradients again (after a step).
  void rearm() {
    for (std::size_t b = 0; b < buckets.size(); ++b) missing[b] = buckets[b].parameters.size();
    launched = 0;

    std::ranges::fill(arrivals, 0);  // and every micro-batch
    std::ranges::fill(owed, kNothingOwed);
    micro = 0;
  }
  // END SOLUTION
};

ZeroTwoOptimizer::ZeroTwoOptimizer(Model& model, Communicator& comm, OptimizerFactory make_inner,
                                   std::size_t bucket_cap_bytes, float max_norm,
                                   AccumulationOptions accumulation) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)comm;
  // SKELETON: (void)make_inner;
  // SKELETON: (void)bucket_cap_bytes;
  // SKELETON: (void)max_norm;
  // SKELETON: (void)accumulation;
  // SKELETON: throw NotImplemented("lab6::ZeroTwoOptimizer::ZeroTwoOptimizer");
  if (!std::isfinite(max_norm) || max_norm < 0)
    throw Error(fmt::format("ZeroTwoOptimizer: max_norm {} is not finite and >= 0", max_norm));
  if (!make_inner) throw Error("ZeroTwoOptimizer: no optimizer factory");
  if (accumulation.micro_batches < 1)
    throw Error(fmt::format("ZeroTwoOptimizer: {} micro-batches per step; expected 1 or more",
                            accumulation.micro_batches));
  auto state = std::make_unique<State>(model, comm);
  State& s = *state;
  s.max_norm = max_norm;
  s.buckets = plan_buckets(model, comm.size(), bucket_cap_bytes);  // throws on a frozen one
  const std::size_t shard = shard_elements(s.buckets);
  s.inner = make_inner(shard);
  if (s.inner == nullptr) throw Error("ZeroTwoOptimizer: the factory returned no optimizer");
  if (s.inner->state_size() != shard)
    throw Error(fmt::format(
        "ZeroTwoOptimizer: the factory's optimizer keeps state for {} elements; expected the "
        "shard's {}",
        s.inner->state_size(), shard));
  // Every buffer lives where the model does, so the same code runs on the host or a GPU.
  const Device device = model.device();
  if (s.inner->device() != device)
    throw Error(fmt::format(
        "ZeroTwoOptimizer: the factory's optimizer keeps its state in {} memory; expected the "
        "model's, {} memory",
        to_string(s.inner->device()), to_string(device)));
  const auto world = static_cast<std::size_t>(comm.size());
  std::size_t largest = 0;
  for (const Bucket& bucket : s.buckets) largest = std::max(largest, world * bucket.chunk_elements);
  const std::size_t buffers = std::min(kBucketBuffers, s.buckets.size());
  for (std::size_t i = 0; i < buffers; ++i)
    s.buffers.emplace_back(std::vector<std::int64_t>{static_cast<std::int64_t>(largest)},
                           MemoryCategory::kCommunication, device);  // zero-filled: padding is zero
  s.shard_grad = Tensor({static_cast<std::int64_t>(shard)}, MemoryCategory::kGradients, device);
  s.shard_params = Tensor({static_cast<std::int64_t>(shard)}, MemoryCategory::kParameters, device);
  if (max_norm > 0) s.norm_buffer = Tensor({1}, MemoryCategory::kCommunication, device);

  // Slots, and this rank's chunks of the initial parameters (padding stays zero).
  const std::span<Parameter* const> parameters = model.parameters();
  s.slot_of.resize(parameters.size());
  const std::size_t rank = static_cast<std::size_t>(comm.rank());
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    const Bucket& bucket = s.buckets[b];
    const std::size_t mine_begin = rank * bucket.chunk_elements;
    const std::size_t mine_end = mine_begin + bucket.chunk_elements;
    std::size_t offset = 0;
    for (const std::size_t index : bucket.parameters) {
      Parameter& parameter = *parameters[index];
      const std::size_t size = parameter.value.size();
      s.slot_of[index] = {b, offset};
      const std::size_t first = std::max(mine_begin, offset);
      const std::size_t last = std::min(mine_end, offset + size);
      if (first < last)
        copy(std::as_const(parameter.value).view(first - offset, last - first),
             s.shard_params.view(bucket.shard_offset + first - mine_begin, last - first));
      offset += size;
    }
  }
  for (Parameter* parameter : parameters) parameter->grad = Tensor();  // the shard replaces them

  // Gradient accumulation: a landing of the largest chunk per buffer (reducing every
  // micro-batch), and the backwards counted per parameter.
  s.accumulation = accumulation;
  if (accumulation.micro_batches > 1 && !s.reduce_once()) {
    std::size_t chunk = 0;
    for (const Bucket& bucket : s.buckets) chunk = std::max(chunk, bucket.chunk_elements);
    for (std::size_t i = 0; i < std::min(kBucketBuffers, s.buckets.size()); ++i)
      s.landings.emplace_back(std::vector<std::int64_t>{static_cast<std::int64_t>(chunk)},
                              MemoryCategory::kCommunication, device);
    s.owed.assign(s.landings.size(), kNothingOwed);
  }
  s.arrivals.resize(parameters.size());

  s.missing.resize(s.buckets.size());
  s.pending.resize(s.buckets.size());
  s.rearm();
  state_ = std::move(state);
  model.on_gradient_ready(
      [state = state_.get()](Parameter& parameter) { state->on_ready(parameter); });
  // END SOLUTION
}

ZeroTwoOptimizer::~ZeroTwoOptimizer() = default;  // each pending Work waits as it is destroyed

std::optional<float> ZeroTwoOptimizer::step() {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab6::ZeroTwoOptimizer::step");
  State& s = *state_;
  if (s.launched < s.buckets.size()) {
    const std::size_t bucket = s.launched;
    const std::size_t missing = s.missing[bucket];
    for (auto& work : s.pending)
      if (work != nullptr) work->wait();
    s.rearm();
    throw Error(fmt::format(
        "ZeroTwoOptimizer::step: bucket {} of {} was never launched: {} of its gradients did "
        "not arrive since the last step (did backward run?)",
        bucket, s.buckets.size(), missing));
  }
  if (const int backwards = s.backwards(); backwards < s.accumulation.micro_batches) {
    for (auto& work : s.pending)
      if (work != nullptr) work->wait();
    s.rearm();
    throw Error(fmt::format(
        "ZeroTwoOptimizer::step: {} backward(s) since the last step; expected {}, one per "
        "micro-batch",
        backwards, s.accumulation.micro_batches));
  }
  for (std::size_t l = 0; l < s.landings.size(); ++l) s.settle(l);  // the micro-batches' sums
  const auto world = static_cast<std::size_t>(s.comm.size());
  for (auto& work : s.pending) {
    if (work == nullptr) continue;  // waited in a hook already
    work->wait();
    work.reset();
  }
  // One division by N M: the sum of M micro-batches' gradients over N ranks.
  divide(s.shard_grad.view(), static_cast<float>(world * s.micro_batches()));

  std::optional<float> norm;
  if (s.max_norm > 0) {
    const ConstTensorView g = std::as_const(s.shard_grad).view();
    fill(s.norm_buffer.view(), static_cast<float>(dot(g, g)));
    s.comm.allreduce(s.norm_buffer.view(), ReduceOp::kSum)->wait();
    // The sum may live on a GPU: copy it into a host float (no allocation) to read it.
    std::array<float, 1> sum{};
    copy(std::as_const(s.norm_buffer).view(), TensorView(std::span<float>(sum)));
    norm = std::sqrt(sum[0]);
    const float coefficient = s.max_norm / (*norm + 1e-6f);
    if (coefficient < 1.0f) scale(s.shard_grad.view(), coefficient);
  }

  s.inner->begin_step();
  s.inner->update(0, s.shard_params.view(), std::as_const(s.shard_grad).view());

  const std::span<Parameter* const> parameters = s.model.parameters();
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    const Bucket& bucket = s.buckets[b];
    s.comm
        .allgather(std::as_const(s.shard_params).view(bucket.shard_offset, bucket.chunk_elements),
                   s.padded_range(b))
        ->wait();
    const Tensor& gathered = s.buffer_of(b);
    std::size_t offset = 0;
    for (const std::size_t index : bucket.parameters) {
      Parameter& parameter = *parameters[index];
      copy(gathered.view(offset, parameter.value.size()), parameter.value.view());
      offset += parameter.value.size();
    }
  }
  s.rearm();
  return norm;
  // END SOLUTION
}

const std::vector<Bucket>& ZeroTwoOptimizer::buckets() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab6::ZeroTwoOptimizer::buckets");
  return state_->buckets;
  // END SOLUTION
}

const Tensor& ZeroTwoOptimizer::shard_gradients() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab6::ZeroTwoOptimizer::shard_gradients");
  return state_->shard_grad;
  // END SOLUTION
}

const Tensor& ZeroTwoOptimizer::shard_parameters() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab6::ZeroTwoOptimizer::shard_parameters");
  return state_->shard_params;
  // END SOLUTION
}

Optimizer& ZeroTwoOptimizer::inner() {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab6::ZeroTwoOptimizer::inner");
  return *state_->inner;
  // END SOLUTION
}

// BEGIN SOLUTION
// SKELETON: // Your helpers for the checkpoints, if any.
namespace {

/// ZeRO-2's checkpoint plan for `model` on `world_size` ranks: one segment per bucket, each
/// cut into N chunks (the last ones padded), rank r's chunks one after another in bucket
/// order, exactly as the shard lies in memory. The index records this layout, padding and
/// all, so that a load at another world size finds every element by name and offset.
ShardedCheckpointPlan checkpoint_plan(const Model& model, const std::vector<Bucket>& buckets,
                                      int world_size, Optimizer& inner) {
  ShardedCheckpointPlan plan;
  plan.parameters = checkpoint_parameters(model);
  std::vector<std::vector<std::size_t>> segments;
  for (const Bucket& bucket : buckets) segments.push_back(bucket.parameters);
  plan.layouts = chunked_layouts(plan.parameters, segments, world_size);
  plan.tensors = {kShardParameters};
  for (const OptimizerState& state : inner.state()) plan.tensors.push_back(state.name);
  plan.metadata = {{"step", std::to_string(inner.step_count())}};
  return plan;
}

}  // namespace
// END SOLUTION

void ZeroTwoOptimizer::save_checkpoint(const std::filesystem::path& directory) const {
  // BEGIN SOLUTION
  // SKELETON: (void)directory;
  // SKELETON: throw NotImplemented("lab6::ZeroTwoOptimizer::save_checkpoint");
  State& s = *state_;
  const ShardedCheckpointPlan plan = checkpoint_plan(s.model, s.buckets, s.comm.size(), *s.inner);
  // Each rank saves what it holds, as it lies in memory: its shard and its optimizer state.
  std::vector<NamedTensor> mine = {{kShardParameters, &s.shard_params}};
  for (const OptimizerState& state : s.inner->state()) mine.push_back({state.name, state.tensor});
  save_checkpoint_shard(directory, plan, s.comm.rank(), mine);
  s.comm.barrier();  // complete only when every rank's shard (and rank 0's index) is written
  // END SOLUTION
}

void ZeroTwoOptimizer::load_checkpoint(const std::filesystem::path& directory) {
  // BEGIN SOLUTION
  // SKELETON: (void)directory;
  // SKELETON: throw NotImplemented("lab6::ZeroTwoOptimizer::load_checkpoint");
  State& s = *state_;
  const ShardedCheckpointPlan plan = checkpoint_plan(s.model, s.buckets, s.comm.size(), *s.inner);
  const ShardedCheckpointPlan saved = load_checkpoint_index(directory);
  check_checkpoint_compatible(saved, plan);  // before changing anything
  const std::int64_t step = checkpoint_count(saved, "step");
  // This rank's shard for the current buckets and world size, whatever saved it: the
  // runtime copies every range by parameter name and offset and zeroes the padding.
  std::vector<ShardTarget> targets = {{kShardParameters, &s.shard_params}};
  for (const OptimizerState& state : s.inner->state())
    targets.push_back({state.name, state.tensor});
  load_checkpoint_shard(directory, plan.layouts[static_cast<std::size_t>(s.comm.rank())], targets);
  s.inner->set_step_count(step);
  // Every rank's model must hold the parameters again: all-gather bucket by bucket, as a
  // step does, through the bucket buffers.
  const std::span<Parameter* const> parameters = s.model.parameters();
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    const Bucket& bucket = s.buckets[b];
    s.comm
        .allgather(std::as_const(s.shard_params).view(bucket.shard_offset, bucket.chunk_elements),
                   s.padded_range(b))
        ->wait();
    std::size_t offset = 0;
    for (const std::size_t index : bucket.parameters) {
      Parameter& parameter = *parameters[index];
      copy(std::as_const(s.buffer_of(b)).view(offset, parameter.value.size()),
           parameter.value.view());
      offset += parameter.value.size();
    }
  }
  // END SOLUTION
}

std::size_t predicted_gradient_peak_bytes(Model& model, int world_size,
                                          std::size_t bucket_cap_bytes) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)world_size;
  // SKELETON: (void)bucket_cap_bytes;
  // SKELETON: throw NotImplemented("lab6::predicted_gradient_peak_bytes");
  const std::vector<Bucket> buckets = plan_buckets(model, world_size, bucket_cap_bytes);
  const auto world = static_cast<std::size_t>(world_size);
  std::size_t largest_bucket = 0;
  for (const Bucket& bucket : buckets)
    largest_bucket = std::max(largest_bucket, world * bucket.chunk_elements);
  // Backward allocates a layer's gradients before their hooks fire: one layer at a time.
  std::size_t largest_layer = 0;
  for (const auto& layer : model.layers()) {
    std::size_t elements = 0;
    for (const Parameter* parameter : layer->parameters()) elements += parameter->value.size();
    largest_layer = std::max(largest_layer, elements);
  }
  const std::size_t shard = 4 * shard_elements(buckets);
  const std::size_t in_backward = 4 * largest_layer;
  const std::size_t buffers = 4 * std::min(kBucketBuffers, buckets.size()) * largest_bucket;
  return shard + in_backward + buffers;
  // END SOLUTION
}

AccumulationCost predicted_accumulation_cost(Model& model, int world_size,
                                             std::size_t bucket_cap_bytes,
                                             AccumulationOptions accumulation) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)world_size;
  // SKELETON: (void)bucket_cap_bytes;
  // SKELETON: (void)accumulation;
  // SKELETON: throw NotImplemented("lab6::predicted_accumulation_cost");
  const std::vector<Bucket> buckets = plan_buckets(model, world_size, bucket_cap_bytes);
  const auto world = static_cast<std::size_t>(world_size);
  const auto micro_batches = static_cast<std::size_t>(accumulation.micro_batches);
  const bool once = accumulation.accumulation == Accumulation::kReduceOnce;
  // One step without accumulation: the shard, one layer's gradients, the buffers.
  std::size_t peak = predicted_gradient_peak_bytes(model, world_size, bucket_cap_bytes);
  if (micro_batches > 1 && once) {
    // Between the micro-batches every gradient stays: the whole 4 Psi instead of a layer's.
    std::size_t largest_layer = 0;
    for (const auto& layer : model.layers()) {
      std::size_t elements = 0;
      for (const Parameter* parameter : layer->parameters()) elements += parameter->value.size();
      largest_layer = std::max(largest_layer, elements);
    }
    peak += 4 * (model.num_parameters() - largest_layer);
  } else if (micro_batches > 1) {
    // A landing of the largest chunk per buffer.
    std::size_t chunk = 0;
    for (const Bucket& bucket : buckets) chunk = std::max(chunk, bucket.chunk_elements);
    peak += 4 * std::min(kBucketBuffers, buckets.size()) * chunk;
  }
  // The local backend counts ring algorithms: a reduce-scatter of N C elements and an
  // all-gather into N C each send (N - 1) C floats from every rank.
  std::uint64_t per_collective = 0;
  for (const Bucket& bucket : buckets) per_collective += 4 * (world - 1) * bucket.chunk_elements;
  const std::size_t reduce_scatters = once ? 1 : micro_batches;
  return {.gradient_peak_bytes = peak, .bytes_sent = (reduce_scatters + 1) * per_collective};
  // END SOLUTION
}

}  // namespace dp::lab6
