// zero1.cpp: lab 5, ZeRO-1. Your part: the partition rule, the members of
// ZeroOneOptimizer::State and the bodies below.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dp/error.h"
#include "dp/memory.h"
#include "dp/sharded_checkpoint.h"
#include "dp/tensor_ops.h"
#include "lab5.h"

namespace dp::lab5 {

std::size_t Partition::shard_offset(int rank) const {
  // BEGIN SOLUTION
  // SKELETON: (void)rank;
  // SKELETON: throw NotImplemented("lab5::Partition::shard_offset");
  return static_cast<std::size_t>(rank) * shard_elements;
  // END SOLUTION
}

std::size_t Partition::real_elements(int rank) const {
  // BEGIN SOLUTION
  // SKELETON: (void)rank;
  // SKELETON: throw NotImplemented("lab5::Partition::real_elements");
  const std::size_t offset = shard_offset(rank);
  if (offset >= num_parameters) return 0;
  return std::min(shard_elements, num_parameters - offset);
  // END SOLUTION
}

Partition partition(std::size_t num_parameters, int world_size) {
  // BEGIN SOLUTION
  // SKELETON: (void)num_parameters;
  // SKELETON: (void)world_size;
  // SKELETON: throw NotImplemented("lab5::partition");
  if (world_size < 1) throw Error(fmt::format("partition: world size {} < 1", world_size));
  const auto n = static_cast<std::size_t>(world_size);
  Partition p;
  p.num_parameters = num_parameters;
  p.world_size = world_size;
  p.shard_elements = (num_parameters + n - 1) / n;
  p.padded_elements = p.shard_elements * n;
  return p;
  // END SOLUTION
}

/// Everything a ZeroOneOptimizer keeps between steps.
struct ZeroOneOptimizer::State {
  // BEGIN SOLUTION
  // SKELETON: // Your members.
  State(Model& m, Communicator& c) : model(m), comm(c) {}

  Model& model;
  Communicator& comm;
  float max_norm = 0;
  Partition layout;
  std::unique_ptr<Optimizer> inner;
  // Overlap (`overlap_allgather`): the all-gather in up to kMaxPieces pieces, piece j being
  // elements [piece_begin[j], piece_begin[j + 1]) of every rank's shard, gathered rank after
  // rank into region [N piece_begin[j], N piece_begin[j + 1]) of `flat`. The boundaries
  // follow the ends of the layers in shard 0 (the first layers forward runs), growing
  // geometrically: the first piece is small, so that the first layer waits little, and each
  // next piece travels while the layers of the one before compute.
  static constexpr std::size_t kMaxPieces = 4;
  bool overlap = false;
  std::size_t pieces = 0;
  std::array<std::size_t, kMaxPieces + 1> piece_begin{};
  std::array<std::unique_ptr<Work>, kMaxPieces> gathers;
  std::size_t gathers_waited = 0;  ///< pieces [0, gathers_waited) have been waited on
  /// The model's layers, and the index of each one's first parameter (layer l owns
  /// parameters [first_parameter[l], first_parameter[l + 1])).
  std::vector<Layer*> layers;
  std::vector<std::size_t> first_parameter;
  /// Per parameter: its value still waits for this step's all-gather.
  std::vector<std::uint8_t> stale;

  /// The piece that holds element `t` of a shard.
  std::size_t piece_of(std::size_t t) const {
    std::size_t j = 0;
    while (t >= piece_begin[j + 1]) ++j;
    return j;
  }

  /// Writes parameter `i`'s value from the gathered pieces, waiting for those it needs.
  void write_parameter(std::size_t i) {
    Parameter& parameter = *model.parameters()[i];
    const std::size_t begin = parameter.offset;
    const std::size_t end = begin + parameter.value.size();
    const std::size_t shard = layout.shard_elements;
    // The last piece this parameter needs: the one holding its last element in its shard,
    // or, when it spans a shard boundary, the last piece of all.
    const std::size_t needed =
        (begin / shard == (end - 1) / shard) ? piece_of((end - 1) % shard) + 1 : pieces;
    for (; gathers_waited < needed; ++gathers_waited) gathers[gathers_waited]->wait();
    const auto world = static_cast<std::size_t>(layout.world_size);
    for (std::size_t element = begin; element < end;) {
      const std::size_t rank = element / shard;
      const std::size_t t = element % shard;
      const std::size_t j = piece_of(t);
      const std::size_t length =
          std::min(end - element, piece_begin[j + 1] - t);  // within one piece of one shard
      const std::size_t piece_size = piece_begin[j + 1] - piece_begin[j];
      const std::size_t at = world * piece_begin[j] + rank * piece_size + (t - piece_begin[j]);
      copy(std::as_const(flat).view(at, length), parameter.value.view(element - begin, length));
      element += length;
    }
    stale[i] = 0;
  }

  /// Before layer `layer` runs forward: its parameters' values from the all-gather.
  void before_forward(const Layer& layer) {
    if (gathers_waited == pieces && std::ranges::none_of(stale, [](auto x) { return x != 0; }))
      return;
    for (std::size_t l = 0; l < layers.size(); ++l) {
      if (layers[l] != &layer) continue;
      for (std::size_t i = first_parameter[l]; i < first_parameter[l + 1]; ++i)
        if (stale[i] != 0) write_parameter(i);
    }
  }

  /// Completes every all-gather still in flight and writes every value still stale.
  void finish_gathers() {
    for (std::size_t i = 0; i < stale.size(); ++i)
      if (stale[i] != 0) write_parameter(i);
    for (; gathers_waited < pieces; ++gathers_waited) gathers[gathers_waited]->wait();
  }
  /// (N S): the packed local gradients going into the reduce-scatter, then the
  /// all-gathered parameters coming out of the all-gather (with overlap, piece after piece,
  /// each rank after rank). Padding stays zero in both.
  Tensor flat;
  /// (S): this rank's shard of the averaged gradient.
  Tensor shard_grad;
  /// (S): this rank's shard of the parameters, which the inner optimizer updates.
  Tensor shard_params;
  /// (1): this rank's partial squared norm, then the sum over ranks (clipping only).
  Tensor norm_buffer;
  // END SOLUTION
};

ZeroOneOptimizer::ZeroOneOptimizer(Model& model, Communicator& comm, OptimizerFactory make_inner,
                                   float max_norm, bool overlap_allgather) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)comm;
  // SKELETON: (void)make_inner;
  // SKELETON: (void)max_norm;
  // SKELETON: (void)overlap_allgather;
  // SKELETON: throw NotImplemented("lab5::ZeroOneOptimizer::ZeroOneOptimizer");
  for (const Parameter* parameter : model.parameters())
    if (parameter->frozen)
      throw Error(
          fmt::format("ZeroOneOptimizer: parameter {} is frozen; ZeRO-1 steps the whole flat space",
                      parameter->name));
  if (!std::isfinite(max_norm) || max_norm < 0)
    throw Error(fmt::format("ZeroOneOptimizer: max_norm {} is not finite and >= 0", max_norm));
  if (!make_inner) throw Error("ZeroOneOptimizer: no optimizer factory");
  auto state = std::make_unique<State>(model, comm);
  state->max_norm = max_norm;
  state->layout = lab5::partition(model.num_parameters(), comm.size());
  const Partition& p = state->layout;
  state->inner = make_inner(p.shard_elements);
  if (state->inner == nullptr) throw Error("ZeroOneOptimizer: the factory returned no optimizer");
  if (state->inner->state_size() != p.shard_elements)
    throw Error(fmt::format(
        "ZeroOneOptimizer: the factory's optimizer keeps state for {} elements; expected the "
        "shard's {}",
        state->inner->state_size(), p.shard_elements));
  // Every buffer lives where the model does, so the same code runs on the host or a GPU.
  const Device device = model.device();
  if (state->inner->device() != device)
    throw Error(fmt::format(
        "ZeroOneOptimizer: the factory's optimizer keeps its state in {} memory; expected the "
        "model's, {} memory",
        to_string(state->inner->device()), to_string(device)));
  const auto padded = static_cast<std::int64_t>(p.padded_elements);
  const auto shard = static_cast<std::int64_t>(p.shard_elements);
  state->flat = Tensor({padded}, MemoryCategory::kCommunication, device);  // zero-filled
  state->shard_grad = Tensor({shard}, MemoryCategory::kGradients, device);
  state->shard_params = Tensor({shard}, MemoryCategory::kParameters, device);
  if (max_norm > 0) state->norm_buffer = Tensor({1}, MemoryCategory::kCommunication, device);
  // This rank's shard of the (identical) initial parameters; the padding stays zero.
  const std::size_t begin = p.shard_offset(comm.rank());
  for (const Parameter* parameter : model.parameters()) {
    const std::size_t first = std::max(begin, parameter->offset);
    const std::size_t last =
        std::min(begin + p.shard_elements, parameter->offset + parameter->value.size());
    if (first >= last) continue;
    copy(parameter->value.view(first - parameter->offset, last - first),
         state->shard_params.view(first - begin, last - first));
  }
  if (overlap_allgather) {
    State& s = *state;
    s.overlap = true;
    s.stale.assign(model.parameters().size(), 0);
    const std::vector<std::size_t> counts = model.parameter_counts_per_layer();
    s.first_parameter.push_back(0);
    for (std::size_t l = 0; l < counts.size(); ++l) {
      s.layers.push_back(model.layers()[l]);
      s.first_parameter.push_back(s.first_parameter.back() + counts[l]);
    }
    // Piece boundaries: S/8, S/4, S/2 and S, each moved up to the next end of a layer (at
    // most S), so that a piece brings whole layers of shard 0 and no layer waits for a
    // second piece for the sake of a few of its elements. Pieces left empty are dropped.
    std::vector<std::size_t> layer_ends;
    for (std::size_t l = 0; l < counts.size(); ++l) {
      if (counts[l] == 0) continue;
      const Parameter& last = *model.parameters()[s.first_parameter[l + 1] - 1];
      layer_ends.push_back(last.offset + last.value.size());
    }
    const std::size_t shard_size = p.shard_elements;
    s.piece_begin[0] = 0;
    for (std::size_t j = 1; j <= State::kMaxPieces; ++j) {
      const std::size_t target = shard_size >> (State::kMaxPieces - j);
      std::size_t boundary = target;
      if (j < State::kMaxPieces)
        for (const std::size_t end : layer_ends)
          if (end >= target) {
            boundary = std::min(end, shard_size);
            break;
          }
      if (boundary > s.piece_begin[s.pieces]) s.piece_begin[++s.pieces] = boundary;
    }
    s.gathers_waited = s.pieces;  // nothing in flight before the first step
    State* const st = state.get();
    model.on_pre_forward([st](Layer& layer) { st->before_forward(layer); });
  }
  state_ = std::move(state);
  // END SOLUTION
}

ZeroOneOptimizer::~ZeroOneOptimizer() {
  // BEGIN SOLUTION
  // SKELETON: // Complete any call your design leaves in flight.
  // A `Work` must not outlive its buffer: complete what the last step left in flight.
  if (state_ && state_->overlap)
    for (; state_->gathers_waited < state_->pieces; ++state_->gathers_waited)
      state_->gathers[state_->gathers_waited]->wait();
  // END SOLUTION
}

std::optional<float> ZeroOneOptimizer::step() {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab5::ZeroOneOptimizer::step");
  if (state_->overlap) state_->finish_gathers();  // `flat` is about to be packed again
  State& s = *state_;
  const Partition& p = s.layout;
  const int rank = s.comm.rank();
  // Pack the local gradients; the padding of `flat` is zeroed, since the all-gather of the
  // previous step wrote the parameters' (zero) padding there.
  for (const Parameter* parameter : s.model.parameters())
    copy(parameter->grad.view(), s.flat.view(parameter->offset, parameter->grad.size()));
  if (p.padded_elements > p.num_parameters)
    fill(s.flat.view(p.num_parameters, p.padded_elements - p.num_parameters), 0.0f);
  s.comm.reduce_scatter(s.flat.view(), s.shard_grad.view(), ReduceOp::kSum)->wait();
  divide(s.shard_grad.view(), static_cast<float>(p.world_size));

  std::optional<float> norm;
  if (s.max_norm > 0) {
    const std::size_t real = p.real_elements(rank);
    const ConstTensorView mine = std::as_const(s.shard_grad).view(0, real);
    fill(s.norm_buffer.view(), static_cast<float>(dot(mine, mine)));
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

  if (s.overlap) {
    // Issue the pieces; the next forward waits for each where a layer first needs it.
    const auto world = static_cast<std::size_t>(p.world_size);
    for (std::size_t j = 0; j < s.pieces; ++j) {
      const std::size_t begin = s.piece_begin[j];
      const std::size_t size = s.piece_begin[j + 1] - begin;
      s.gathers[j] = s.comm.allgather(std::as_const(s.shard_params).view(begin, size),
                                      s.flat.view(world * begin, world * size));
    }
    s.gathers_waited = 0;
    std::ranges::fill(s.stale, std::uint8_t{1});
    return norm;
  }
  s.comm.allgather(std::as_const(s.shard_params).view(), s.flat.view())->wait();
  for (Parameter* parameter : s.model.parameters())
    copy(std::as_const(s.flat).view(parameter->offset, parameter->value.size()),
         parameter->value.view());
  return norm;
  // END SOLUTION
}

const Partition& ZeroOneOptimizer::partition() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab5::ZeroOneOptimizer::partition");
  return state_->layout;
  // END SOLUTION
}

const Tensor& ZeroOneOptimizer::shard_parameters() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab5::ZeroOneOptimizer::shard_parameters");
  return state_->shard_params;
  // END SOLUTION
}

const Tensor& ZeroOneOptimizer::flat_parameters() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab5::ZeroOneOptimizer::flat_parameters");
  return state_->flat;
  // END SOLUTION
}

Optimizer& ZeroOneOptimizer::inner() {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab5::ZeroOneOptimizer::inner");
  return *state_->inner;
  // END SOLUTION
}

// BEGIN SOLUTION
// SKELETON: // Your helpers for the checkpoints, if any.
namespace {

/// ZeRO-1's checkpoint plan for `model` on `world_size` ranks: one segment of every
/// parameter, cut into the partition's N equal shards (the last ones padded), so that the
/// index says exactly which flat elements each shard holds.
ShardedCheckpointPlan checkpoint_plan(const Model& model, int world_size, Optimizer& inner) {
  ShardedCheckpointPlan plan;
  plan.parameters = checkpoint_parameters(model);
  const std::vector<std::vector<std::size_t>> segments = {all_parameters(plan.parameters)};
  plan.layouts = chunked_layouts(plan.parameters, segments, world_size);
  plan.tensors = {kShardParameters};
  for (const OptimizerState& state : inner.state()) plan.tensors.push_back(state.name);
  plan.metadata = {{"step", std::to_string(inner.step_count())}};
  return plan;
}

}  // namespace
// END SOLUTION

void ZeroOneOptimizer::save_checkpoint(const std::filesystem::path& directory) const {
  // BEGIN SOLUTION
  // SKELETON: (void)directory;
  // SKELETON: throw NotImplemented("lab5::ZeroOneOptimizer::save_checkpoint");
  State& s = *state_;
  const ShardedCheckpointPlan plan = checkpoint_plan(s.model, s.comm.size(), *s.inner);
  // Each rank saves what it holds, as it lies in memory: its shard and its optimizer state.
  std::vector<NamedTensor> mine = {{kShardParameters, &s.shard_params}};
  for (const OptimizerState& state : s.inner->state()) mine.push_back({state.name, state.tensor});
  save_checkpoint_shard(directory, plan, s.comm.rank(), mine);
  s.comm.barrier();  // complete only when every rank's shard (and rank 0's index) is written
  // END SOLUTION
}

void ZeroOneOptimizer::load_checkpoint(const std::filesystem::path& directory) {
  // BEGIN SOLUTION
  // SKELETON: (void)directory;
  // SKELETON: throw NotImplemented("lab5::ZeroOneOptimizer::load_checkpoint");
  State& s = *state_;
  const int rank = s.comm.rank();
  const ShardedCheckpointPlan plan = checkpoint_plan(s.model, s.comm.size(), *s.inner);
  const ShardedCheckpointPlan saved = load_checkpoint_index(directory);
  if (s.overlap) s.finish_gathers();         // `flat` is about to take the loaded shards
  check_checkpoint_compatible(saved, plan);  // before changing anything
  const std::int64_t step = checkpoint_count(saved, "step");
  // This rank's shard at the current world size, whatever world size saved it: the runtime
  // copies every range by parameter name and offset and zeroes the padding.
  std::vector<ShardTarget> targets = {{kShardParameters, &s.shard_params}};
  for (const OptimizerState& state : s.inner->state())
    targets.push_back({state.name, state.tensor});
  load_checkpoint_shard(directory, plan.layouts[static_cast<std::size_t>(rank)], targets);
  s.inner->set_step_count(step);
  // Every rank's model must hold the parameters again: all-gather the shards, as a step does.
  s.comm.allgather(std::as_const(s.shard_params).view(), s.flat.view())->wait();
  for (Parameter* parameter : s.model.parameters())
    copy(std::as_const(s.flat).view(parameter->offset, parameter->value.size()),
         parameter->value.view());
  // END SOLUTION
}

std::size_t predicted_state_bytes_per_rank(std::size_t num_parameters, int world_size,
                                           std::size_t state_floats_per_element) {
  // BEGIN SOLUTION
  // SKELETON: (void)num_parameters;
  // SKELETON: (void)world_size;
  // SKELETON: (void)state_floats_per_element;
  // SKELETON: throw NotImplemented("lab5::predicted_state_bytes_per_rank");
  const Partition p = partition(num_parameters, world_size);
  const std::size_t model = 2 * 4 * num_parameters;     // parameters and gradients
  const std::size_t flat = 4 * p.padded_elements;       // the flat buffer
  const std::size_t shards = 2 * 4 * p.shard_elements;  // shard gradient and parameters
  const std::size_t state = 4 * state_floats_per_element * p.shard_elements;
  return model + flat + shards + state;
  // END SOLUTION
}

double predicted_exposed_communication_seconds(std::size_t num_parameters, int world_size,
                                               const LinkModel& link) {
  // BEGIN SOLUTION
  // SKELETON: (void)num_parameters;
  // SKELETON: (void)world_size;
  // SKELETON: (void)link;
  // SKELETON: throw NotImplemented("lab5::predicted_exposed_communication_seconds");
  // Nothing computes beside either call: the reduce-scatter waits for backward's gradients,
  // the all-gather for the update. Each is a ring over the padded flat buffer of N S floats:
  // N - 1 rounds, each a message of one shard (4 S bytes) per link, paying alpha.
  const Partition p = partition(num_parameters, world_size);
  const double rounds = world_size - 1;
  const double shard_bytes = 4.0 * static_cast<double>(p.shard_elements);
  const double one_collective = rounds * (link.alpha_seconds + shard_bytes / link.bytes_per_second);
  return 2 * one_collective;
  // END SOLUTION
}

}  // namespace dp::lab5
