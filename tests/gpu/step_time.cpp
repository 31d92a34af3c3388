// dp_gpu_step_time: the wall time of one training step of an MLP on the GPU, for
// tools/gpu-check, which prints it next to PyTorch eager's time for the same model and
// batch (tools/gpu_step_time_torch.py does the same step in PyTorch).
//
// A step is what `dplab train` does on one rank: zero the gradients, forward, the loss read
// back to the host, backward, and an SGD update (lr 0.1, no momentum), every tensor on the
// device. The inputs are fixed random values drawn once (data loading is not timed). A few
// warm-up steps come first (the pool, the cuBLAS handle and its kernels' first calls), then
// the mean over the timed steps, which ends with a read of a parameter so that the last
// step's kernels have finished.
//
//   dp_gpu_step_time 4096-4096-4096-4096-10 1024 [STEPS]
//   -> dplab  model 4096-4096-4096-4096-10  batch 1024: 5.123 ms/step (mean of 20 steps)
//
// `dp_gpu_step_time --probe` is tools/gpu-check's first step: it loads what a GPU run needs
// and says what it found, before any long step: the devices, cuBLAS (loaded on the first
// product, so a one-element product on the device) and NCCL (a one-rank all-reduce).
//
// Exit status: 0, 1 on an error, 77 without a CUDA device (as the GPU tests).
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

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

/// Mean seconds of one training step of `spec` at `batch` rows over `steps` steps.
double seconds_per_step(const std::string& spec, std::int64_t batch, int steps) {
  dp::Model model = dp::Model::mlp(spec, {.seed = 1, .device = dp::Device::kCuda});
  const std::vector<std::int64_t> widths = dp::parse_mlp_spec(spec);
  const std::int64_t classes = widths.back();
  dp::Sgd optimizer(model.num_parameters(), {.lr = 0.1f}, dp::Device::kCuda);

  dp::CounterRng rng(2, 0);
  std::vector<float> values(static_cast<std::size_t>(batch * widths.front()));
  for (float& value : values) value = rng.uniform(-1.0f, 1.0f);
  dp::Tensor inputs = dp::Tensor::from(values, dp::MemoryCategory::kActivations, dp::Device::kCuda);
  inputs.reshape({batch, widths.front()});
  std::vector<int> labels(static_cast<std::size_t>(batch));
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<int>(i % classes);

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
  if (argc < 3 || argc > 4) {
    std::fprintf(stderr, "usage: dp_gpu_step_time MLP-SPEC BATCH [STEPS (default 20)] | --probe\n");
    return 1;
  }
  if (dp::cuda_device_count() == 0) {
    std::fprintf(stderr, "no CUDA device: no step time (exit code 77)\n");
    return 77;
  }
  try {
    const std::string spec = argv[1];
    const std::int64_t batch = std::atoll(argv[2]);
    const int steps = argc == 4 ? std::atoi(argv[3]) : 20;
    if (batch <= 0 || steps <= 0)
      throw dp::Error(fmt::format("expected a positive batch and step count, got {} and {}",
                                  argv[2], argc == 4 ? argv[3] : "20"));
    const double seconds = seconds_per_step(spec, batch, steps);
    fmt::print("dplab    model {}  batch {}: {:.3f} ms/step (mean of {} steps)\n", spec, batch,
               seconds * 1e3, steps);
    return 0;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "dp_gpu_step_time: error: %s\n", error.what());
    return 1;
  }
}
