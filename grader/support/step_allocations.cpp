// step_allocations.cpp: see step_allocations.h. Linked into each check program with
// heap_use.cpp (dp_check_main), whose counting functions it reads.
#include "step_allocations.h"

#include <fmt/format.h>

#include <utility>

#include "dp/tensor.h"
#include "grading.h"
#include "sharded.h"

namespace dp::grading {

StepAllocations measure_step_allocations(Model& model, Model& twin, const Batch& batch,
                                         Communicator& comm, const std::function<void()>& step) {
  MemoryTracker& tracker = this_rank_memory().tracker();
  StepAllocations a;
  std::array<std::size_t, kNumMemoryCategories> before{};
  for (std::size_t c = 0; c < kNumMemoryCategories; ++c)
    before[c] = tracker.allocations(static_cast<MemoryCategory>(c));
  const std::size_t twin_activations_before = tracker.allocations(MemoryCategory::kActivations);
  const std::size_t plain_tensors_before = tracker.allocations_total();
  const HeapUse plain_before = heap_use_of_this_thread();
  twin.zero_grad();
  twin.backward(grading::forward(twin, batch), batch.labels);
  a.plain_heap = heap_use_of_this_thread().since(plain_before);
  const std::size_t activations_before = tracker.allocations(MemoryCategory::kActivations);
  a.plain_activation_tensors = activations_before - twin_activations_before;
  a.twin_gradient_tensors = tracker.allocations(MemoryCategory::kGradients) -
                            before[static_cast<std::size_t>(MemoryCategory::kGradients)];
  const CommCounters calls_before = comm.counters();
  const std::size_t hooked_tensors_before = tracker.allocations_total();
  a.plain_tensors = hooked_tensors_before - plain_tensors_before;
  const HeapUse hooked_before = heap_use_of_this_thread();
  model.backward(grading::forward(model, batch), batch.labels);
  a.hooked_heap = heap_use_of_this_thread().since(hooked_before);
  a.hook_calls = comm.counters().since(calls_before).total_calls();
  a.hooked_tensors = tracker.allocations_total() - hooked_tensors_before;
  const std::size_t tensors = tracker.allocations_total();
  const HeapUse heap = heap_use_of_this_thread();
  const CommCounters step_calls_before = comm.counters();
  step();
  a.step_heap = heap_use_of_this_thread().since(heap);
  a.step_calls = comm.counters().since(step_calls_before).total_calls();
  a.step_tensors = tracker.allocations_total() - tensors;
  for (std::size_t c = 0; c < kNumMemoryCategories; ++c)
    a.tensors_made[c] = tracker.allocations(static_cast<MemoryCategory>(c)) - before[c];
  a.hooked_activation_tensors =
      tracker.allocations(MemoryCategory::kActivations) - activations_before;
  return a;
}

HeapUse heap_of_one_collective_call(Communicator& comm) {
  const HeapUse call_start = heap_use_of_this_thread();
  {
    Tensor chunk({1}, MemoryCategory::kOther, check_device());
    Tensor full({comm.size()}, MemoryCategory::kOther, check_device());
    comm.allgather(std::as_const(chunk).view(), full.view())->wait();
  }
  return heap_use_of_this_thread().since(call_start);
}

std::string state_bytes_finding(const HeldState& held) {
  const MemoryTracker& tracker = this_rank_memory().tracker();
  const std::size_t expected = 4 * held.floats_per_element * held.shard;
  const std::size_t current = tracker.current(MemoryCategory::kOptimizerState) - held.base;
  const std::size_t peak = tracker.peak(MemoryCategory::kOptimizerState) - held.base;
  if (current == expected && peak == expected) return "";
  return fmt::format(
      "{} on N = {} (S = {}): optimizer-state bytes {} after two steps, peak {}; "
      "expected {} x 4 x S = {}{}",
      held.label, held.world, held.shard, current, peak, held.floats_per_element, expected,
      peak >= 4 * held.floats_per_element * held.num_parameters
          ? " (an optimizer over the whole model existed)"
          : "");
}

}  // namespace dp::grading
