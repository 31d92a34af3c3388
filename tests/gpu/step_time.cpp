// dp_gpu_step_time: the wall time of one training step of an MLP or a GPT on the GPU, for
// tools/gpu-check, which prints it next to PyTorch eager's time for the same model and
// batch (tools/gpu_step_time_torch.py does the same step in PyTorch).
//
// A step is what `dplab train` does on one rank: zero the gradients, forward, the loss read
// back to the host, backward, and an SGD update (lr 0.1, no momentum), every tensor on the
// device. The inputs are fixed random values drawn once (data loading is not timed): an
// MLP's rows uniform in [-1, 1) with labels cycling through the classes; a GPT's windows of
// `context` token ids and their next-token labels drawn uniformly from a vocabulary of 114
// (the default corpus's; tools/cpu_step_time_torch.py uses the same). A few warm-up steps
// come first (the pool, the cuBLAS handle and its kernels' first calls), then the mean over
// the timed steps, which ends with a read of a parameter so that the last step's kernels
// have finished.
//
//   dp_gpu_step_time 4096-4096-4096-4096-10 1024 [STEPS]
//   -> dplab    model 4096-4096-4096-4096-10  batch 1024: 5.123 ms/step (mean of 20 steps)
//   dp_gpu_step_time gpt:layers=12,dim=768,heads=12,context=1024 8
//   -> dplab    model gpt:layers=12,...  batch 8: 81.2 ms/step (mean of 20 steps; 100900 tokens/s)
//
// `dp_gpu_step_time --cases [MLP-SPEC BATCH [STEPS]]` times the performance work of issue 28
// against what it replaced, each case with and without it, on the model given (by default
// the 4096-wide one at batch 1024):
//   first-layer   a step with the first layer's input gradient skipped (Model::backward)
//                 and computed (every layer's full backward, as before: one product more);
//   gradient-scan the trainer's per-step reads of the gradients: one fused pass
//                 (cuda::fold_max_abs_bits, one launch and one read) and per parameter
//                 (all_finite and max_abs: an allocation, a launch and a read each);
//   column-sums   the bias gradient's column sums of a (BATCH, width) gradient, next to a
//                 copy of the same bytes (the memory-bound time they can approach);
//   cublas-handles a launch of 2 rank threads doing one product each, with the handles
//                 pooled across launches and made and destroyed per launch (as before).
//
// `dp_gpu_step_time --emulated SPEC BATCH [STEPS]` runs the same step on the emulated CUDA
// device (dp::set_cuda_device_emulated: device tensors in host memory, computed by the host
// code), so that a machine without a GPU runs this program's every line but the kernels'
// (ctest does, on a tiny MLP and a tiny GPT); its times say nothing about a GPU.
//
// `dp_gpu_step_time --probe` is tools/gpu-check's first step: it loads what a GPU run needs
// and says what it found, before any long step: the devices, cuBLAS (loaded on the first
// product, so a one-element product on the device) and NCCL (a one-rank all-reduce).
//
// Exit status: 0, 1 on an error, 77 without a CUDA device (as the GPU tests).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cuda/device_ops.h"  // the kernels the cases time on their own (library-internal)
#include "dp/comm.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/model.h"
#include "dp/ops.h"
#include "dp/optimizer.h"
#include "dp/rng.h"
#include "dp/tensor.h"
#include "dp/tensor_ops.h"

namespace {

constexpr int kWarmUpSteps = 3;

/// A batch of `batch` rows for the MLP `spec` on the GPU: inputs uniform in [-1, 1), the
/// labels cycling through the classes (the same for every run, as PyTorch's side draws).
struct DeviceBatch {
  dp::Tensor inputs;        // (batch, widths.front())
  std::vector<int> labels;  // (batch)
};

/// The batch every run of `spec` times (the same values each time).
DeviceBatch random_batch(const std::string& spec, std::int64_t batch) {
  const std::vector<std::int64_t> widths = dp::parse_mlp_spec(spec);
  dp::CounterRng rng(2, 0);
  std::vector<float> values(static_cast<std::size_t>(batch * widths.front()));
  for (float& value : values) value = rng.uniform(-1.0f, 1.0f);
  DeviceBatch result{dp::Tensor::from(values, dp::MemoryCategory::kActivations, dp::Device::kCuda),
                     {}};
  result.inputs.reshape({batch, widths.front()});
  result.labels.resize(static_cast<std::size_t>(batch));
  for (std::size_t i = 0; i < result.labels.size(); ++i)
    result.labels[i] = static_cast<int>(i % static_cast<std::size_t>(widths.back()));
  return result;
}

/// The vocabulary of a timed GPT: the default corpus's 114 symbols.
constexpr std::int64_t kGptVocabulary = 114;

/// A model on the GPU, the batch its steps are timed on, and how many items (samples or
/// predicted tokens) one step trains on.
struct Workload {
  dp::Model model;
  DeviceBatch batch;
  std::int64_t items = 0;
};

/// The workload of `spec` (an MLP spec, or a GPT's: "gpt" or "gpt:...") at `batch` rows or
/// windows. A GPT's windows are `context` token ids drawn uniformly, stored as floats as
/// `Model::gpt`'s forward takes them, (batch, context), with one drawn label per token.
Workload make_workload(const std::string& spec, std::int64_t batch) {
  if (!dp::is_gpt_spec(spec))
    return {dp::Model::mlp(spec, {.seed = 1, .device = dp::Device::kCuda}),
            random_batch(spec, batch), batch};
  const dp::GptSpec gpt = dp::parse_gpt_spec(spec);
  dp::CounterRng rng(2, 0);
  const auto tokens = static_cast<std::size_t>(batch * gpt.context);
  std::vector<float> ids(tokens);
  for (float& id : ids) id = static_cast<float>(rng.below(kGptVocabulary));
  DeviceBatch windows{dp::Tensor::from(ids, dp::MemoryCategory::kActivations, dp::Device::kCuda),
                      std::vector<int>(tokens)};
  windows.inputs.reshape({batch, gpt.context});  // (B, T)
  for (int& label : windows.labels) label = static_cast<int>(rng.below(kGptVocabulary));
  return {dp::Model::gpt(gpt, kGptVocabulary, {.seed = 1, .device = dp::Device::kCuda}),
          std::move(windows), batch * gpt.context};
}

/// Mean seconds of one training step of `workload` over `steps` steps.
double seconds_per_step(Workload& workload, int steps) {
  dp::Model& model = workload.model;
  dp::Sgd optimizer(model.num_parameters(), {.lr = 0.1f}, dp::Device::kCuda);
  const dp::Tensor& inputs = workload.batch.inputs;
  const std::vector<int>& labels = workload.batch.labels;

  const auto step = [&] {
    model.zero_grad();
    const dp::Tensor logits = model.forward(inputs);
    (void)model.backward(logits, labels);  // reads the loss back: a host synchronisation
    optimizer.step(model);
  };
  for (int i = 0; i < kWarmUpSteps; ++i) step();
  (void)model.parameters().back()->value.to(dp::Device::kHost);  // the warm-up has finished
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  (void)model.parameters().back()->value.to(dp::Device::kHost);  // waits for the last update
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / steps;
}

/// Mean seconds of `run()` over `repeats` calls after 2 warm-up calls, the device drained
/// before the clock starts and before it stops.
template <typename Run>
double mean_seconds(int repeats, Run&& run) {
  for (int i = 0; i < 2; ++i) run();
  dp::cuda::synchronize();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < repeats; ++i) run();
  dp::cuda::synchronize();
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / repeats;
}

/// Prints one line of a case: its name, the variant, and the mean time.
void print_case(const std::string& name, const std::string& variant, double seconds) {
  fmt::print("{:<15} {:<44} {:10.3f} ms\n", name, variant, seconds * 1e3);
}

/// The cases of --cases (see the top).
void run_cases(const std::string& spec, std::int64_t batch, int steps) {
  if (dp::is_gpt_spec(spec))
    throw dp::Error(fmt::format("--cases times an MLP's layers, got the GPT spec '{}'", spec));
  fmt::print("dplab    performance cases, model {} batch {} ({} repeats each)\n", spec, batch,
             steps);
  dp::Model model = dp::Model::mlp(spec, {.seed = 1, .device = dp::Device::kCuda});
  const std::vector<std::int64_t> widths = dp::parse_mlp_spec(spec);
  const DeviceBatch data = random_batch(spec, batch);
  const dp::Tensor& inputs = data.inputs;
  const std::vector<int>& labels = data.labels;

  // first-layer: forward and backward with and without the first layer's input gradient.
  print_case("first-layer", "dx of the first layer skipped (Model::backward)",
             mean_seconds(steps, [&] {
               model.zero_grad();
               (void)model.backward(model.forward(inputs), labels);
             }));
  print_case("first-layer", "dx of the first layer computed (the old backward)",
             mean_seconds(steps, [&] {
               model.zero_grad();
               dp::SoftmaxCrossEntropy loss;
               (void)loss.forward(model.forward(inputs), labels);
               dp::Tensor grad = loss.backward(1.0f);
               const std::span<dp::Layer* const> layers = model.layers();
               for (auto it = layers.rbegin(); it != layers.rend(); ++it)
                 grad = (*it)->backward(grad);
             }));

  // gradient-scan: the gradients of the backward above, read as the trainer reads them.
  std::vector<const float*> arrays;
  std::vector<std::size_t> sizes;
  for (dp::Parameter* parameter : model.parameters()) {
    const dp::ConstTensorView grad = std::as_const(parameter->grad).view();
    arrays.push_back(grad.data());
    sizes.push_back(grad.size());
  }
  unsigned int* bits = static_cast<unsigned int*>(dp::cuda::allocate(2 * sizeof(unsigned int)));
  unsigned int scanned = 0;
  print_case("gradient-scan", fmt::format("one fused pass over {} gradients", arrays.size()),
             mean_seconds(steps, [&] {
               dp::cuda::fold_max_abs_bits(arrays.data(), sizes.data(), arrays.size(), &bits[0],
                                           &bits[1]);
               dp::cuda::copy_bytes(&scanned, &bits[0], sizeof scanned);
             }));
  dp::cuda::deallocate(bits);
  float largest = 0;
  print_case("gradient-scan", "all_finite and max_abs per parameter (before)",
             mean_seconds(steps, [&] {
               for (std::size_t i = 0; i < arrays.size(); ++i) {
                 if (!dp::cuda::all_finite(arrays[i], sizes[i])) throw dp::Error("not finite");
                 largest = std::max(largest, dp::cuda::max_abs(arrays[i], sizes[i]));
               }
             }));

  // column-sums: the widest hidden layer's bias gradient, and a copy of the same bytes.
  const std::int64_t width =
      widths.size() > 2 ? *std::max_element(widths.begin() + 1, widths.end() - 1) : widths.back();
  dp::Tensor gradient({batch, width}, dp::MemoryCategory::kActivations, dp::Device::kCuda);
  gradient.fill(0.5f);
  dp::Tensor sums({width}, dp::MemoryCategory::kGradients, dp::Device::kCuda);
  dp::Tensor copied({batch, width}, dp::MemoryCategory::kActivations, dp::Device::kCuda);
  print_case("column-sums", fmt::format("bias gradient of ({}, {})", batch, width),
             mean_seconds(steps, [&] {
               dp::cuda::add_column_sums(gradient.view().data(), batch, width, sums.view().data());
             }));
  print_case("column-sums", "a copy of the same bytes (memory-bound reference)",
             mean_seconds(steps, [&] { dp::copy(gradient.view(), copied.view()); }));

  // cublas-handles: whole launches of 2 rank threads, each one product.
  const auto one_launch = [] {
    dp::launch({.world_size = 2}, [](dp::Communicator& /*comm*/) {
      dp::Tensor one({8, 8}, dp::MemoryCategory::kActivations, dp::Device::kCuda);
      one.fill(1.0f);
      (void)dp::matmul(one, dp::Transpose::kNo, one, dp::Transpose::kNo);
      dp::cuda::synchronize();
    });
  };
  const std::size_t made_before = dp::cuda::cublas_handles_created();
  dp::cuda::set_cublas_handle_pooling(true);
  const double pooled = mean_seconds(steps, one_launch);
  const std::size_t made_pooled = dp::cuda::cublas_handles_created() - made_before;
  dp::cuda::set_cublas_handle_pooling(false);
  const double per_launch = mean_seconds(steps, one_launch);
  const std::size_t made_unpooled = dp::cuda::cublas_handles_created() - made_before - made_pooled;
  dp::cuda::set_cublas_handle_pooling(true);
  print_case("cublas-handles", fmt::format("pooled across launches ({} handles made)", made_pooled),
             pooled);
  print_case("cublas-handles",
             fmt::format("made and destroyed per launch ({} made)", made_unpooled), per_launch);
}

/// The probe (see the top): throws dp::Error naming what could not be loaded or run.
void probe() {
  fmt::print("CUDA devices: {}\n", dp::cuda_device_count());
  dp::Tensor one = dp::Tensor::from(std::vector<float>{3.0f}, dp::MemoryCategory::kActivations,
                                    dp::Device::kCuda);
  one.reshape({1, 1});
  const dp::Tensor product = dp::matmul(one, dp::Transpose::kNo, one, dp::Transpose::kNo);
  const float nine = product.to(dp::Device::kHost).span()[0];
  if (nine != 9.0f) throw dp::Error(fmt::format("cuBLAS: 3 x 3 gave {}, expected 9", nine));
  fmt::print("cuBLAS: loaded, a product on the device is right\n");
  dp::launch({.world_size = 1, .backend = dp::Backend::kNccl}, [](dp::Communicator& comm) {
    dp::Tensor value = dp::Tensor::from(std::vector<float>{2.0f}, dp::MemoryCategory::kActivations,
                                        dp::Device::kCuda);
    comm.allreduce(value.view(), dp::ReduceOp::kSum)->wait();
    const float two = value.to(dp::Device::kHost).span()[0];
    if (two != 2.0f) throw dp::Error(fmt::format("NCCL: a one-rank sum of 2 gave {}", two));
  });
  fmt::print("NCCL: loaded, a one-rank all-reduce is right\n");
}

}  // namespace

int main(int argc, char** argv) {
  const bool probing = argc == 2 && std::string(argv[1]) == "--probe";
  if (probing) {
    if (dp::cuda_device_count() == 0) {
      std::fprintf(stderr, "no CUDA device: nothing to probe (exit code 77)\n");
      return 77;
    }
    try {
      probe();
      return 0;
    } catch (const std::exception& error) {
      std::fprintf(stderr, "dp_gpu_step_time --probe: error: %s\n", error.what());
      return 1;
    }
  }
  const bool cases = argc >= 2 && std::string(argv[1]) == "--cases";
  const bool emulated = argc >= 2 && std::string(argv[1]) == "--emulated";
  const int first = cases || emulated ? 2 : 1;  // where the model's spec is
  if (cases ? (argc != 2 && argc != 4 && argc != 5) : (argc < first + 2 || argc > first + 3)) {
    std::fprintf(stderr,
                 "usage: dp_gpu_step_time [--emulated] MODEL-SPEC BATCH [STEPS (default 20)] | "
                 "--probe | --cases [MLP-SPEC BATCH [STEPS]]\n");
    return 1;
  }
  if (emulated) {
    dp::set_cuda_device_emulated(true);
  } else if (dp::cuda_device_count() == 0) {
    std::fprintf(stderr, "no CUDA device: no step time (exit code 77)\n");
    return 77;
  }
  try {
    const bool given = argc > first + 1;  // --cases alone takes the large model
    const std::string spec = given ? argv[first] : "4096-4096-4096-4096-10";
    const std::int64_t batch = given ? std::atoll(argv[first + 1]) : 1024;
    const char* steps_text = argc > first + 2 ? argv[first + 2] : "20";
    const int steps = std::atoi(steps_text);
    if (batch <= 0 || steps <= 0)
      throw dp::Error(fmt::format("expected a positive batch and step count, got {} and {}",
                                  given ? argv[first + 1] : "1024", steps_text));
    if (cases) {
      run_cases(spec, batch, steps);
      return 0;
    }
    Workload workload = make_workload(spec, batch);
    const double seconds = seconds_per_step(workload, steps);
    const std::string tokens =
        dp::is_gpt_spec(spec)
            ? fmt::format("; {:.0f} tokens/s", static_cast<double>(workload.items) / seconds)
            : "";
    fmt::print("dplab    model {}  batch {}: {:.3f} ms/step (mean of {} steps{})\n", spec, batch,
               seconds * 1e3, steps, tokens);
    return 0;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "dp_gpu_step_time: error: %s\n", error.what());
    return 1;
  }
}
