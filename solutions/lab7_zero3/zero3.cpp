// zero3.cpp: lab 7, ZeRO-3. Your part: the unit rule, the members of
// ZeroThreeOptimizer::State and the bodies below.
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
#include "lab7.h"

namespace dp::lab7 {

// BEGIN SOLUTION
// SKELETON: // Your design's constants, if any.
/// This design's gather buffers: one. Every unit is gathered into it; a unit's values are
/// copied out of it (materialised) before the next unit's all-gather is issued into it, so
/// one buffer gives the same overlap as two.
constexpr std::size_t kGatherBuffers = 1;

/// This design's gradient buffers (fewer when there are fewer units): unit u's gradients
/// are reduce-scattered from gradient buffer u mod 2, so that unit u - 1 can fill the other
/// while unit u's reduce-scatter still reads its own.
constexpr std::size_t kGradientBuffers = 2;
// END SOLUTION

std::vector<Unit> plan_units(const Model& model, int world_size) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)world_size;
  // SKELETON: throw NotImplemented("lab7::plan_units");
  if (world_size < 1) throw Error(fmt::format("plan_units: world size {} < 1", world_size));
  const std::span<const Parameter* const> parameters = model.parameters();
  const std::vector<std::size_t> counts = model.parameter_counts_per_layer();
  std::vector<Unit> units;
  std::size_t next = 0;  // parameters seen so far: layer l's are the next counts[l]
  for (std::size_t l = 0; l < counts.size(); ++l) {
    if (counts[l] == 0) continue;
    Unit unit;
    unit.layer = l;
    for (std::size_t k = 0; k < counts[l] && next < parameters.size(); ++k) {
      const Parameter* parameter = parameters[next];
      if (parameter->frozen)
        throw Error(fmt::format("plan_units: parameter {} is frozen; ZeRO-3 shards every parameter",
                                parameter->name));
      unit.parameters.push_back(parameter->index);
      unit.elements += parameter->value.size();
      ++next;
    }
    units.push_back(std::move(unit));
  }
  if (next != parameters.size())
    throw Error("plan_units: some parameters belong to no layer of the model");
  const auto n = static_cast<std::size_t>(world_size);
  std::size_t offset = 0;
  for (Unit& unit : units) {
    unit.chunk_elements = (unit.elements + n - 1) / n;
    unit.shard_offset = offset;
    offset += unit.chunk_elements;
  }
  return units;
  // END SOLUTION
}

std::size_t shard_elements(const std::vector<Unit>& units) {
  // BEGIN SOLUTION
  // SKELETON: (void)units;
  // SKELETON: throw NotImplemented("lab7::shard_elements");
  std::size_t total = 0;
  for (const Unit& unit : units) total += unit.chunk_elements;
  return total;
  // END SOLUTION
}

/// Everything a ZeroThreeOptimizer keeps between hooks and steps.
struct ZeroThreeOptimizer::State {
  // BEGIN SOLUTION
  // SKELETON: // Your members.
  static constexpr std::size_t kNone = static_cast<std::size_t>(-1);

  State(Model& m, Communicator& c) : model(m), comm(c) {}

  Model& model;
  Communicator& comm;
  float max_norm = 0;
  /// Where the model lives, and every buffer with it: model.device() cannot say once the
  /// values are released.
  Device device = Device::kHost;
  std::vector<Unit> units;
  std::unique_ptr<Optimizer> inner;
  /// Per parameter index: the shape its value is materialised with.
  std::vector<std::vector<std::int64_t>> shapes;
  /// Per layer index: its unit, or kNone for a layer without parameters.
  std::vector<std::size_t> unit_of_layer;
  /// max_u N C_u elements: every unit is gathered here, then copied out (materialised).
  Tensor gather_buffer;
  /// min(2, U) buffers of max_u N C_u elements: unit u's gradients go into u mod 2.
  std::vector<Tensor> grad_buffers;
  /// (S): this rank's chunks of the summed, then averaged, gradient.
  Tensor shard_grad;
  /// (S): this rank's chunks of the parameters: the only copy of them on this rank.
  Tensor shard_params;
  /// (1): this rank's partial squared norm, then the sum over ranks (clipping only).
  Tensor norm_buffer;
  // The calls in flight come after the buffers they use: they are destroyed (each waiting
  // for its call) before the buffers are freed.
  /// The all-gather in flight into the gather buffer, and its unit (kNone: none).
  std::unique_ptr<Work> gather;
  std::size_t gathering = kNone;
  /// Per unit: its reduce-scatter in flight, and whether it was launched since the step.
  std::vector<std::unique_ptr<Work>> pending;
  std::vector<char> launched;

  std::size_t world() const { return static_cast<std::size_t>(comm.size()); }

  /// Unit of `layer`, or kNone.
  std::size_t unit_of(const Layer& layer) const {
    const std::span<Layer* const> layers = model.layers();
    for (std::size_t l = 0; l < layers.size(); ++l)
      if (layers[l] == &layer) return unit_of_layer[l];
    return kNone;
  }

  /// Issues unit u's all-gather into the gather buffer, which must be free: no all-gather
  /// in flight, and the unit gathered last already copied out.
  void issue_gather(std::size_t u) {
    const Unit& unit = units[u];
    gather =
        comm.allgather(std::as_const(shard_params).view(unit.shard_offset, unit.chunk_elements),
                       gather_buffer.view(0, world() * unit.chunk_elements));
    gathering = u;
  }

  /// Waits for unit u's all-gather (issuing it if it is not in flight) and materialises
  /// the unit's values from it; then prefetches unit `next` (kNone: none).
  void acquire(std::size_t u, std::size_t next) {
    if (gathering != u) {
      if (gather != nullptr) gather->wait();  // another unit's, out of order
      issue_gather(u);
    }
    gather->wait();
    gather.reset();
    gathering = kNone;
    const std::span<Parameter* const> parameters = model.parameters();
    std::size_t offset = 0;
    for (const std::size_t index : units[u].parameters) {
      Parameter& parameter = *parameters[index];
      parameter.value = Tensor::uninitialized(shapes[index], MemoryCategory::kParameters, device);
      copy(std::as_const(gather_buffer).view(offset, parameter.value.size()),
           parameter.value.view());
      offset += parameter.value.size();
    }
    // Unit u's values are copied out: the buffer is free for the next unit, which travels
    // while unit u computes.
    if (next != kNone) issue_gather(next);
  }

  /// Releases unit u's values.
  void release_values(std::size_t u) {
    const std::span<Parameter* const> parameters = model.parameters();
    for (const std::size_t index : units[u].parameters) parameters[index]->value = Tensor();
  }

  /// After unit u's backward: its gradients into gradient buffer u mod 2, released, and the
  /// buffer reduce-scattered into this rank's chunk of the gradient.
  void reduce_gradients(std::size_t u) {
    const std::size_t b = u % grad_buffers.size();
    const Unit& unit = units[u];
    // Unit u + 2 used this buffer: its reduce-scatter must be done reading it.
    const std::size_t previous = u + grad_buffers.size();
    if (previous < units.size() && pending[previous] != nullptr) {
      pending[previous]->wait();
      pending[previous].reset();
    }
    const std::span<Parameter* const> parameters = model.parameters();
    std::size_t offset = 0;
    for (const std::size_t index : unit.parameters) {
      Parameter& parameter = *parameters[index];
      copy(std::as_const(parameter.grad).view(),
           grad_buffers[b].view(offset, parameter.grad.size()));
      offset += parameter.grad.size();
      parameter.grad = Tensor();  // released: only the shard of the gradient stays
    }
    const std::size_t padded = world() * unit.chunk_elements;
    // The buffer is shared with other units: zero this unit's padding before it goes.
    if (unit.elements < padded)
      fill(grad_buffers[b].view(unit.elements, padded - unit.elements), 0.0f);
    pending[u] = comm.reduce_scatter(std::as_const(grad_buffers[b]).view(0, padded),
                                     shard_grad.view(unit.shard_offset, unit.chunk_elements),
                                     ReduceOp::kSum);
    launched[u] = 1;
  }

  void pre_forward(Layer& layer) {
    const std::size_t u = unit_of(layer);
    if (u == kNone) return;
    acquire(u, u + 1 < units.size() ? u + 1 : kNone);
  }
  void post_forward(Layer& layer) {
    const std::size_t u = unit_of(layer);
    if (u != kNone) release_values(u);
  }
  void pre_backward(Layer& layer) {
    const std::size_t u = unit_of(layer);
    if (u == kNone) return;
    // A second backward would reduce-scatter over the first one's shard of the gradient.
    // Thrown before this unit's all-gather, so every rank stops at the same point with
    // nothing in flight.
    if (launched[u])
      throw Error(fmt::format(
          "ZeroThreeOptimizer: a second backward reached unit {} since the last step(); call "
          "step() after every backward",
          u));
    acquire(u, u > 0 ? u - 1 : kNone);
  }
  void post_backward(Layer& layer) {
    const std::size_t u = unit_of(layer);
    if (u == kNone) return;
    reduce_gradients(u);
    release_values(u);
  }

  /// Waits for every call in flight.
  void drain() {
    if (gather != nullptr) gather->wait(), gather.reset();
    gathering = kNone;
    for (auto& work : pending)
      if (work != nullptr) work->wait(), work.reset();
  }

  /// Whether unit u's values are materialised now.
  bool holds_values(std::size_t u) const {
    return !model.parameters()[units[u].parameters.front()]->value.empty();
  }

  // The hooks with reshard_after_forward false: every unit's values stay from its forward
  // until its backward has used them, so backward gathers nothing.
  void pre_forward_keeping(Layer& layer) {
    const std::size_t u = unit_of(layer);
    // Kept by a forward that no backward followed: gathered again (the update of a step
    // since may have changed them), and released first, so that a unit's values are never
    // there twice.
    if (u != kNone && holds_values(u)) release_values(u);
    pre_forward(layer);
  }
  void pre_backward_keeping(Layer& layer) {
    const std::size_t u = unit_of(layer);
    // Kept since its forward: nothing to gather, nothing to prefetch (the units before it
    // are kept too). A second backward finds the unit launched: pre_backward throws.
    if (u != kNone && !launched[u] && holds_values(u)) return;
    pre_backward(layer);
  }
  // END SOLUTION
};

ZeroThreeOptimizer::ZeroThreeOptimizer(Model& model, Communicator& comm,
                                       OptimizerFactory make_inner, float max_norm,
                                       bool reshard_after_forward) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)comm;
  // SKELETON: (void)make_inner;
  // SKELETON: (void)max_norm;
  // SKELETON: (void)reshard_after_forward;
  // SKELETON: throw NotImplemented("lab7::ZeroThreeOptimizer::ZeroThreeOptimizer");
  if (!std::isfinite(max_norm) || max_norm < 0)
    throw Error(fmt::format("ZeroThreeOptimizer: max_norm {} is not finite and >= 0", max_norm));
  if (!make_inner) throw Error("ZeroThreeOptimizer: no optimizer factory");
  for (const Parameter* parameter : model.parameters())
    if (parameter->value.empty())
      throw Error(fmt::format("ZeroThreeOptimizer: parameter {} has no value (released already?)",
                              parameter->name));
  auto state = std::make_unique<State>(model, comm);
  State& s = *state;
  s.max_norm = max_norm;
  s.units = plan_units(model, comm.size());  // throws on a frozen parameter
  const std::size_t shard = shard_elements(s.units);
  s.inner = make_inner(shard);
  if (s.inner == nullptr) throw Error("ZeroThreeOptimizer: the factory returned no optimizer");
  if (s.inner->state_size() != shard)
    throw Error(fmt::format(
        "ZeroThreeOptimizer: the factory's optimizer keeps state for {} elements; expected the "
        "shard's {}",
        s.inner->state_size(), shard));
  // Every buffer lives where the model does, so the same code runs on the host or a GPU.
  s.device = model.device();
  if (s.inner->device() != s.device)
    throw Error(fmt::format(
        "ZeroThreeOptimizer: the factory's optimizer keeps its state in {} memory; expected "
        "the model's, {} memory",
        to_string(s.inner->device()), to_string(s.device)));
  const std::size_t world = s.world();
  std::size_t largest = 0;
  for (const Unit& unit : s.units) largest = std::max(largest, world * unit.chunk_elements);
  const std::vector<std::int64_t> shape{static_cast<std::int64_t>(largest)};
  s.gather_buffer = Tensor(shape, MemoryCategory::kCommunication, s.device);
  for (std::size_t i = 0; i < std::min(kGradientBuffers, s.units.size()); ++i)
    s.grad_buffers.emplace_back(shape, MemoryCategory::kCommunication, s.device);
  s.shard_grad = Tensor({static_cast<std::int64_t>(shard)}, MemoryCategory::kGradients, s.device);
  s.shard_params =
      Tensor({static_cast<std::int64_t>(shard)}, MemoryCategory::kParameters, s.device);
  if (max_norm > 0) s.norm_buffer = Tensor({1}, MemoryCategory::kCommunication, s.device);

  // This rank's chunks of the initial parameters (padding stays zero), and the shapes.
  const std::span<Parameter* const> parameters = model.parameters();
  s.shapes.resize(parameters.size());
  s.unit_of_layer.assign(model.layers().size(), State::kNone);
  const std::size_t rank = static_cast<std::size_t>(comm.rank());
  for (std::size_t u = 0; u < s.units.size(); ++u) {
    const Unit& unit = s.units[u];
    s.unit_of_layer[unit.layer] = u;
    const std::size_t mine_begin = rank * unit.chunk_elements;
    const std::size_t mine_end = mine_begin + unit.chunk_elements;
    std::size_t offset = 0;
    for (const std::size_t index : unit.parameters) {
      Parameter& parameter = *parameters[index];
      const std::size_t size = parameter.value.size();
      s.shapes[index] = parameter.value.shape();
      const std::size_t first = std::max(mine_begin, offset);
      const std::size_t last = std::min(mine_end, offset + size);
      if (first < last)
        copy(std::as_const(parameter.value).view(first - offset, last - first),
             s.shard_params.view(unit.shard_offset + first - mine_begin, last - first));
      offset += size;
    }
  }
  // Only the shard stays: every value and gradient is released.
  for (Parameter* parameter : parameters) {
    parameter->value = Tensor();
    parameter->grad = Tensor();
  }
  s.pending.resize(s.units.size());
  s.launched.assign(s.units.size(), 0);
  state_ = std::move(state);
  State* const st = state_.get();
  if (!reshard_after_forward) {
    model.on_pre_forward([st](Layer& layer) { st->pre_forward_keeping(layer); });
    model.on_pre_backward([st](Layer& layer) { st->pre_backward_keeping(layer); });
    model.on_post_backward([st](Layer& layer) { st->post_backward(layer); });
    return;
  }
  model.on_pre_forward([st](Layer& layer) { st->pre_forward(layer); });
  model.on_post_forward([st](Layer& layer) { st->post_forward(layer); });
  model.on_pre_backward([st](Layer& layer) { st->pre_backward(layer); });
  model.on_post_backward([st](Layer& layer) { st->post_backward(layer); });
  // END SOLUTION
}

ZeroThreeOptimizer::~ZeroThreeOptimizer() = default;  // each Work in flight waits as it goes

std::optional<float> ZeroThreeOptimizer::step() {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab7::ZeroThreeOptimizer::step");
  State& s = *state_;
  for (std::size_t u = s.units.size(); u-- > 0;) {
    if (s.launched[u]) continue;
    s.drain();
    std::ranges::fill(s.launched, 0);
    throw Error(fmt::format(
        "ZeroThreeOptimizer::step: unit {} of {} (layer {}) was never reduce-scattered since the "
        "last step (did forward and backward run?)",
        u, s.units.size(), s.units[u].layer));
  }
  for (auto& work : s.pending) {
    if (work == nullptr) continue;  // waited in a hook already
    work->wait();
    work.reset();
  }
  divide(s.shard_grad.view(), static_cast<float>(s.world()));

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
  // No all-gather: the next forward gathers each unit as it needs it.
  std::ranges::fill(s.launched, 0);
  return norm;
  // END SOLUTION
}

const std::vector<Unit>& ZeroThreeOptimizer::units() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab7::ZeroThreeOptimizer::units");
  return state_->units;
  // END SOLUTION
}

const Tensor& ZeroThreeOptimizer::shard_gradients() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab7::ZeroThreeOptimizer::shard_gradients");
  return state_->shard_grad;
  // END SOLUTION
}

const Tensor& ZeroThreeOptimizer::shard_parameters() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab7::ZeroThreeOptimizer::shard_parameters");
  return state_->shard_params;
  // END SOLUTION
}

Optimizer& ZeroThreeOptimizer::inner() {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab7::ZeroThreeOptimizer::inner");
  return *state_->inner;
  // END SOLUTION
}

// BEGIN SOLUTION
// SKELETON: // Your helpers for the checkpoints, if any.
namespace {

/// ZeRO-3's checkpoint plan on `world_size` ranks: one segment per unit, each cut into N
/// chunks (the last ones padded), rank r's chunks one after another in unit order, exactly
/// as the shard lies in memory. The values are released, so the parameters' names come
/// from the model and their shapes from those kept at construction.
ShardedCheckpointPlan checkpoint_plan(const Model& model,
                                      const std::vector<std::vector<std::int64_t>>& shapes,
                                      const std::vector<Unit>& units, int world_size,
                                      Optimizer& inner) {
  ShardedCheckpointPlan plan;
  for (const Parameter* parameter : model.parameters())
    plan.parameters.push_back({parameter->name, shapes[parameter->index]});
  std::vector<std::vector<std::size_t>> segments;
  for (const Unit& unit : units) segments.push_back(unit.parameters);
  plan.layouts = chunked_layouts(plan.parameters, segments, world_size);
  plan.tensors = {kShardParameters};
  for (const OptimizerState& state : inner.state()) plan.tensors.push_back(state.name);
  plan.metadata = {{"step", std::to_string(inner.step_count())}};
  return plan;
}

}  // namespace
// END SOLUTION

void ZeroThreeOptimizer::save_checkpoint(const std::filesystem::path& directory) const {
  // BEGIN SOLUTION
  // SKELETON: (void)directory;
  // SKELETON: throw NotImplemented("lab7::ZeroThreeOptimizer::save_checkpoint");
  State& s = *state_;
  const ShardedCheckpointPlan plan =
      checkpoint_plan(s.model, s.shapes, s.units, s.comm.size(), *s.inner);
  // Each rank saves what it holds, as it lies in memory: its shard and its optimizer state.
  std::vector<NamedTensor> mine = {{kShardParameters, &s.shard_params}};
  for (const OptimizerState& state : s.inner->state()) mine.push_back({state.name, state.tensor});
  save_checkpoint_shard(directory, plan, s.comm.rank(), mine);
  s.comm.barrier();  // complete only when every rank's shard (and rank 0's index) is written
  // END SOLUTION
}

void ZeroThreeOptimizer::load_checkpoint(const std::filesystem::path& directory) {
  // BEGIN SOLUTION
  // SKELETON: (void)directory;
  // SKELETON: throw NotImplemented("lab7::ZeroThreeOptimizer::load_checkpoint");
  State& s = *state_;
  const ShardedCheckpointPlan plan =
      checkpoint_plan(s.model, s.shapes, s.units, s.comm.size(), *s.inner);
  const ShardedCheckpointPlan saved = load_checkpoint_index(directory);
  check_checkpoint_compatible(saved, plan);  // before changing anything
  const std::int64_t step = checkpoint_count(saved, "step");
  // Straight into the tensors this rank holds: its shard for the current units and world
  // size, copied by parameter name and offset, the padding zero. No gather: the values stay
  // released until the next forward gathers them from these shards.
  std::vector<ShardTarget> targets = {{kShardParameters, &s.shard_params}};
  for (const OptimizerState& state : s.inner->state())
    targets.push_back({state.name, state.tensor});
  load_checkpoint_shard(directory, plan.layouts[static_cast<std::size_t>(s.comm.rank())], targets);
  s.inner->set_step_count(step);
  // END SOLUTION
}

std::size_t predicted_parameter_peak_bytes(const Model& model, int world_size) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)world_size;
  // SKELETON: throw NotImplemented("lab7::predicted_parameter_peak_bytes");
  const std::vector<Unit> units = plan_units(model, world_size);
  const auto world = static_cast<std::size_t>(world_size);
  std::size_t largest_padded = 0;
  std::size_t largest_unit = 0;
  for (const Unit& unit : units) {
    largest_padded = std::max(largest_padded, world * unit.chunk_elements);
    largest_unit = std::max(largest_unit, unit.elements);
  }
  // The shard always; one unit's values at a time (each freed before the next arrives);
  // one gather buffer and two gradient buffers, allocated once.
  const std::size_t shard = 4 * shard_elements(units);
  const std::size_t values = 4 * largest_unit;
  const std::size_t buffers =
      (kGatherBuffers + std::min(kGradientBuffers, units.size())) * 4 * largest_padded;
  return shard + values + buffers;
  // END SOLUTION
}

std::size_t predicted_keep_gathered_extra_bytes(const Model& model, int world_size) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)world_size;
  // SKELETON: throw NotImplemented("lab7::predicted_keep_gathered_extra_bytes");
  const std::vector<Unit> units = plan_units(model, world_size);
  std::size_t largest_unit = 0;
  for (const Unit& unit : units) largest_unit = std::max(largest_unit, unit.elements);
  // The buffers are the same in both modes. Resharding, the values peak at the largest
  // unit; keeping, at the end of forward, where every unit's values are there at once
  // (the whole model, unpadded: values are the parameters' own tensors).
  return 4 * (model.num_parameters() - largest_unit);
  // END SOLUTION
}

}  // namespace dp::lab7
