#!/usr/bin/env python3
"""PyTorch eager's wall time for one training step of an MLP, for tools/gpu-check.

The same step as tests/gpu/step_time.cpp (dp_gpu_step_time): Linear layers with ReLU
between them, built from a spec such as 4096-4096-4096-4096-10, softmax cross-entropy,
the loss read back to the host (loss.item(), as dplab's Model::backward returns it), and
SGD with lr 0.1, all in float32 on the GPU with TF32 off (dplab's products do not use it
either). Three warm-up steps, then the mean over the timed steps.

    python3 tools/gpu_step_time_torch.py 4096-4096-4096-4096-10 1024 [STEPS]
    -> pytorch model 4096-4096-4096-4096-10  batch 1024: 5.012 ms/step (mean of 20 steps)

Exit status: 0; 77 when torch or a CUDA device is missing (the caller prints why).
"""
import sys
import time


def main() -> int:
    if len(sys.argv) not in (3, 4):
        print("usage: gpu_step_time_torch.py MLP-SPEC BATCH [STEPS]", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print("pytorch: not installed here: no comparison", file=sys.stderr)
        return 77
    if not torch.cuda.is_available():
        print("pytorch: sees no CUDA device: no comparison", file=sys.stderr)
        return 77
    spec, batch = sys.argv[1], int(sys.argv[2])
    steps = int(sys.argv[3]) if len(sys.argv) == 4 else 20
    widths = [int(width) for width in spec.split("-")]

    torch.backends.cuda.matmul.allow_tf32 = False  # full float32, as dplab's cuBLAS calls
    torch.manual_seed(1)
    device = torch.device("cuda")
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths):
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_function = torch.nn.CrossEntropyLoss()
    inputs = torch.rand(batch, widths[0], device=device) * 2 - 1
    labels = torch.arange(batch, device=device) % widths[-1]

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)  # dplab zeroes its gradients in place
        loss = loss_function(model(inputs), labels)
        loss.item()  # the loss read back, as dplab does each step
        loss.backward()
        optimizer.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    print(f"pytorch  model {spec}  batch {batch}: {seconds * 1e3:.3f} ms/step "
          f"(mean of {steps} steps; torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
