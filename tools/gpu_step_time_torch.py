#!/usr/bin/env python3
"""PyTorch eager's wall time for one training step of an MLP or a GPT, for tools/gpu-check.

The same step as tests/gpu/step_time.cpp (dp_gpu_step_time): for an MLP spec such as
4096-4096-4096-4096-10, Linear layers with ReLU between them and softmax cross-entropy; for
a GPT spec ("gpt" or "gpt:layers=12,dim=768,heads=12,context=1024", dplab's keys and
defaults), dplab's GPT (tools/cpu_step_time_torch.py's gpt_model) over a vocabulary of 114
on BATCH windows of random token ids, the mean cross-entropy over every token. Then the
loss read back to the host (loss.item(), as dplab's Model::backward returns it), and SGD
with lr 0.1, all in float32 on the GPU with TF32 off (dplab's products do not use it
either). Three warm-up steps, then the mean over the timed steps.

    python3 tools/gpu_step_time_torch.py 4096-4096-4096-4096-10 1024 [STEPS]
    -> pytorch model 4096-4096-4096-4096-10  batch 1024: 5.012 ms/step (mean of 20 steps)

Exit status: 0; 77 when torch or a CUDA device is missing (the caller prints why).
"""
import os
import sys
import time

GPT_DEFAULTS = {"layers": 4, "dim": 128, "heads": 4, "context": 64}  # dp::GptSpec's
GPT_VOCABULARY = 114  # dp_gpu_step_time's


def gpt_sizes(spec):
    """The sizes of a GPT spec, as dp::parse_gpt_spec reads it (a ValueError otherwise)."""
    sizes = dict(GPT_DEFAULTS)
    if spec != "gpt":
        for pair in spec[len("gpt:"):].split(","):
            key, _, value = pair.partition("=")
            if key not in sizes or not value.isdigit() or int(value) <= 0:
                raise ValueError(f"GPT spec {spec!r}: expected key=value with keys "
                                 f"{', '.join(GPT_DEFAULTS)} and positive values, got {pair!r}")
            sizes[key] = int(value)
    return sizes


def main() -> int:
    if len(sys.argv) not in (3, 4):
        print("usage: gpu_step_time_torch.py MLP-SPEC|GPT-SPEC BATCH [STEPS]", file=sys.stderr)
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
    torch.backends.cuda.matmul.allow_tf32 = False  # full float32, as dplab's cuBLAS calls
    torch.manual_seed(1)
    device = torch.device("cuda")
    tokens = 0
    if spec == "gpt" or spec.startswith("gpt:"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from cpu_step_time_torch import gpt_model

        sizes = gpt_sizes(spec)
        model = gpt_model(torch, vocab=GPT_VOCABULARY, **sizes).to(device)
        inputs = torch.randint(0, GPT_VOCABULARY, (batch, sizes["context"]), device=device)
        labels = torch.randint(0, GPT_VOCABULARY, (batch * sizes["context"],), device=device)
        tokens = batch * sizes["context"]
    else:
        widths = [int(width) for width in spec.split("-")]
        layers = []
        for i in range(len(widths) - 1):
            layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
            if i + 2 < len(widths):
                layers.append(torch.nn.ReLU())
        model = torch.nn.Sequential(*layers).to(device)
        inputs = torch.rand(batch, widths[0], device=device) * 2 - 1
        labels = torch.arange(batch, device=device) % widths[-1]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_function = torch.nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)  # dplab zeroes its gradients in place
        logits = model(inputs)
        loss = loss_function(logits.view(-1, logits.shape[-1]), labels)
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
    rate = f"; {tokens / seconds:.0f} tokens/s" if tokens else ""
    print(f"pytorch  model {spec}  batch {batch}: {seconds * 1e3:.3f} ms/step "
          f"(mean of {steps} steps{rate}; torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
