// server.cpp: lab 3's parameter server, synchronous (staleness 0) and with bounded
// staleness. Your part: the State a rank keeps between steps, and the bodies of the
// constructor, step, finish and staleness_log.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dp/error.h"
#include "dp/tensor_ops.h"
#include "lab3.h"

namespace dp::lab3 {

// BEGIN SOLUTION
// SKELETON: struct ParameterServer::State {
// SKELETON:   // Whatever a rank keeps between steps: yours to design.
// SKELETON: };
namespace {

constexpr int kPushTag = 51;  // worker -> server: a gradient shard
constexpr int kPullTag = 52;  // server -> worker: a shard's new version

/// A zero-filled 1-D tensor of `count` floats on `device`, charged under `category`.
Tensor buffer_of(std::size_t count, Device device,
                 MemoryCategory category = MemoryCategory::kCommunication) {
  return Tensor({static_cast<std::int64_t>(count)}, category, device);
}

/// Copies elements `range` of `model`'s flat parameter space into `destination`.
void copy_from_parameters(const Model& model, Range range, TensorView destination) {
  for (const Parameter* parameter : model.parameters()) {
    const std::size_t begin = std::max(range.offset, parameter->offset);
    const std::size_t end =
        std::min(range.offset + range.count, parameter->offset + parameter->value.size());
    if (begin >= end) continue;
    copy(parameter->value.view(begin - parameter->offset, end - begin),
         destination.slice(begin - range.offset, end - begin));
  }
}

/// Copies `source`, elements `range` of the flat parameter space, into `model`'s parameters.
void copy_into_parameters(ConstTensorView source, Range range, Model& model) {
  for (Parameter* parameter : model.parameters()) {
    const std::size_t begin = std::max(range.offset, parameter->offset);
    const std::size_t end =
        std::min(range.offset + range.count, parameter->offset + parameter->value.size());
    if (begin >= end) continue;
    copy(source.slice(begin - range.offset, end - begin),
         parameter->value.view(begin - parameter->offset, end - begin));
  }
}

}  // namespace

struct ParameterServer::State {
  ServerOptions options;
  int rank = 0;
  int workers = 0;       // W
  int first_worker = 0;  // the rank of worker 0: 0 co-located, S dedicated
  bool serves = false;
  bool works = false;
  std::vector<Range> shards;  // server j's shard of the flat parameter space
  int steps = 0;              // steps taken so far: the next is step `steps`

  // As a worker.
  int model_version = 0;  // the version the model's parameters hold
  Tensor gradients;       // (P) this step's gradients, packed for the pushes
  // Pulled versions: version v lands in slot v % (s + 1), with its receives in flight. A
  // worker needs version t + 1 - s after step t and has asked for t + 1 by then: s + 1
  // versions at most are waited for or in use at once.
  std::vector<Tensor> versions;
  std::vector<std::vector<std::unique_ptr<Work>>> pulls;
  std::vector<StalenessRecord> log;

  // As a server.
  std::unique_ptr<Optimizer> optimizer;
  Tensor shard;                              // the newest version of this server's shard
  Tensor average;                            // this step's averaged gradient of the shard
  std::vector<Tensor> pushed;                // per worker: its gradient shard of this step
  std::vector<std::unique_ptr<Work>> sends;  // the newest version on its way to the workers

  /// The server's part of step `t`, once the sends of the previous version are done:
  /// receive the workers' gradients of its shard, average them in worker order, step the
  /// optimizer, send the new version to every worker.
  void serve(int t, Model& model, Communicator& comm);

  int worker_rank(int worker) const { return first_worker + worker; }
  Range own_shard() const { return shards[static_cast<std::size_t>(rank)]; }
  std::size_t slot_of(int version) const {
    return static_cast<std::size_t>(version % (options.staleness + 1));
  }
};

void ParameterServer::State::serve(int t, Model& model, Communicator& comm) {
  const Range own = own_shard();
  std::vector<std::unique_ptr<Work>> receives;
  for (int worker = 0; worker < workers; ++worker)
    if (worker_rank(worker) != rank && own.count > 0)
      receives.push_back(comm.irecv(pushed[static_cast<std::size_t>(worker)].view(),
                                    worker_rank(worker), kPushTag));
  for (auto& receive : receives) receive->wait();

  // ((g_0 + g_1) + g_2) + ... in worker order, then / W: lab 2's arithmetic.
  for (int worker = 0; worker < workers; ++worker) {
    const ConstTensorView gradient = worker_rank(worker) == rank
                                         ? gradients.view(own.offset, own.count)
                                         : pushed[static_cast<std::size_t>(worker)].view();
    if (worker == 0)
      copy(gradient, average.view());
    else
      add(gradient, average.view());
  }
  divide(average.view(), static_cast<float>(workers));
  optimizer->begin_step();
  // Views, not spans: the shard may live on a GPU, where the host cannot touch it.
  optimizer->update(0, shard.view(), average.view());

  // Version t + 1 of the shard: to every other worker, into this rank's own pulled version
  // when it is a worker too, into the model when it only serves.
  if (works)
    copy(shard.view(), versions[slot_of(t + 1)].view(own.offset, own.count));
  else
    copy_into_parameters(shard.view(), own, model);
  if (own.count == 0) return;
  for (int worker = 0; worker < workers; ++worker)
    if (worker_rank(worker) != rank)
      sends.push_back(comm.isend(shard.view(), worker_rank(worker), kPullTag));
}
// END SOLUTION

ParameterServer::ParameterServer(const Model& model, const ServerOptions& options,
                                 OptimizerFactory make_optimizer, const Communicator& comm) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)options;
  // SKELETON: (void)make_optimizer;
  // SKELETON: (void)comm;
  // SKELETON: throw NotImplemented("lab3::ParameterServer::ParameterServer");
  const int ranks = comm.size();
  const int largest = options.dedicated ? ranks - 1 : ranks;
  if (options.servers < 1 || options.servers > largest)
    throw Error(
        fmt::format("ParameterServer: {} server(s) on {} ranks; expected 1 to {} {} servers{}",
                    options.servers, ranks, largest, options.dedicated ? "dedicated" : "co-located",
                    options.dedicated ? " (at least one rank must be a worker)" : ""));
  if (options.staleness < 0)
    throw Error(fmt::format("ParameterServer: staleness {}; expected s >= 0", options.staleness));
  for (const Parameter* parameter : model.parameters())
    if (parameter->frozen)
      throw Error(
          fmt::format("ParameterServer: parameter {} is frozen; expected every parameter trainable",
                      parameter->name));

  state_ = std::make_unique<State>();
  State& s = *state_;
  s.options = options;
  s.rank = comm.rank();
  s.serves = s.rank < options.servers;
  s.works = !options.dedicated || !s.serves;
  s.first_worker = options.dedicated ? options.servers : 0;
  s.workers = ranks - s.first_worker;
  const std::size_t parameters = model.num_parameters();
  const Device device = model.device();  // every buffer lives beside the parameters
  for (int server = 0; server < options.servers; ++server)
    s.shards.push_back(chunk_of(parameters, options.servers, server));

  if (s.works) {
    s.gradients = buffer_of(parameters, device);
    for (int slot = 0; slot <= options.staleness; ++slot)
      s.versions.push_back(buffer_of(parameters, device));
    s.pulls.resize(s.versions.size());
  }
  if (s.serves) {
    const Range own = s.own_shard();
    s.optimizer = make_optimizer(own.count);
    s.shard = buffer_of(own.count, device, MemoryCategory::kParameters);
    copy_from_parameters(model, own, s.shard.view());
    s.average = buffer_of(own.count, device);
    for (int worker = 0; worker < s.workers; ++worker)
      s.pushed.push_back(buffer_of(s.worker_rank(worker) == s.rank ? 0 : own.count, device));
  }
  // END SOLUTION
}

ParameterServer::~ParameterServer() = default;

void ParameterServer::step(Model& model, Communicator& comm) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)comm;
  // SKELETON: throw NotImplemented("lab3::ParameterServer::step");
  State& s = *state_;
  const int t = s.steps;
  // The shard changes in this step: the sends of its previous version must be done first.
  // Wait for them before the pushes, not after: on nccl a wait launches every message issued
  // since the rank's previous wait as one group, which completes only as a whole (lab3.h).
  // Waited for after the pushes, it would launch them alone, ahead of this server's
  // receives, and two co-located servers would each wait for the other's receive.
  if (s.serves) {
    for (auto& send : s.sends) send->wait();
    s.sends.clear();
  }
  std::vector<std::unique_ptr<Work>> pushes;
  if (s.works) {
    s.log.push_back({t, s.model_version});
    for (const Parameter* parameter : model.parameters())
      copy(parameter->grad.view(), s.gradients.view(parameter->offset, parameter->grad.size()));
    for (int server = 0; server < s.options.servers; ++server) {
      const Range range = s.shards[static_cast<std::size_t>(server)];
      if (server != s.rank && range.count > 0)
        pushes.push_back(comm.isend(s.gradients.view(range.offset, range.count), server, kPushTag));
    }
  }
  if (s.serves) s.serve(t, model, comm);
  if (s.works) {
    // Ask for version t + 1 now, so that it can arrive while the next steps compute.
    const std::size_t slot = s.slot_of(t + 1);
    for (int server = 0; server < s.options.servers; ++server) {
      const Range range = s.shards[static_cast<std::size_t>(server)];
      if (server != s.rank && range.count > 0)
        s.pulls[slot].push_back(
            comm.irecv(s.versions[slot].view(range.offset, range.count), server, kPullTag));
    }
    // Step t + 1 is computed on version t + 1 - s: wait for that one only.
    const int needed = std::max(0, t + 1 - s.options.staleness);
    if (needed > s.model_version) {
      const std::size_t needed_slot = s.slot_of(needed);
      for (auto& pull : s.pulls[needed_slot]) pull->wait();
      s.pulls[needed_slot].clear();
      copy_into_parameters(s.versions[needed_slot].view(), {0, s.gradients.size()}, model);
      s.model_version = needed;
    }
    // The pushes read `gradients`, which the next step overwrites.
    for (auto& push : pushes) push->wait();
  }
  ++s.steps;
  // END SOLUTION
}

void ParameterServer::finish(Model& model, Communicator& comm) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)comm;
  // SKELETON: throw NotImplemented("lab3::ParameterServer::finish");
  (void)comm;
  State& s = *state_;
  for (auto& send : s.sends) send->wait();
  s.sends.clear();
  if (!s.works || s.steps == s.model_version) return;
  // Complete every version asked for, oldest first; the model takes the last.
  for (int version = s.model_version + 1; version <= s.steps; ++version) {
    for (auto& pull : s.pulls[s.slot_of(version)]) pull->wait();
    s.pulls[s.slot_of(version)].clear();
  }
  copy_into_parameters(s.versions[s.slot_of(s.steps)].view(), {0, s.gradients.size()}, model);
  s.model_version = s.steps;
  // END SOLUTION
}

std::span<const StalenessRecord> ParameterServer::staleness_log() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab3::ParameterServer::staleness_log");
  return state_->log;
  // END SOLUTION
}

}  // namespace dp::lab3
