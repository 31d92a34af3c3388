#!/usr/bin/env python3
"""PyTorch eager's CPU throughput for the training steps of bench/bench_train_step.

The same steps as bench_train_step's, on one thread (ATen's and the BLAS library's, as each
dplab rank gets one BLAS thread), float32, SGD with lr 0.1:

  mlp   train_step/single/batch:64: the MLP 64-256-256-10 (Linear, ReLU), softmax
        cross-entropy, on random inputs and labels; prints samples/s
  gpt   gpt_step/single/checkpointing:off/batch:8: dplab's default GPT (4 pre-LayerNorm
        blocks, dim 128, 4 heads, context 64, tanh GELU, untied head without bias) over a
        vocabulary of 114 bytes, mean cross-entropy over every token of 8 windows; prints
        tokens/s

The loss is read back each step (loss.item(), as dplab's Model::backward returns it).
Three warm-up steps, then the fastest of five rounds of STEPS steps (noise on a shared
machine only adds time, as tools/run-benchmarks keeps each benchmark's fastest round).

    python3 tools/cpu_step_time_torch.py mlp|gpt [STEPS] [--json FILE]
    -> pytorch mlp 64-256-256-10 batch 64, 1 thread: 41234 samples/s (0.001552 s/step)

--json also writes the result as Google Benchmark's JSON writes one benchmark
(run_name "pytorch_step/mlp/batch:64" or "pytorch_step/gpt/batch:8", real_time in s, the
counter samples_per_s or tokens_per_s), so that tools/run-benchmarks reads it with the rest.

Exit status: 0; 77 when torch is missing (Debian's python3-torch; the caller says why).
"""
import json
import math
import os
import sys
import time


def mlp_step(torch):
    torch.manual_seed(1)
    widths = [64, 256, 256, 10]
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths):
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.randn(64, widths[0])
    labels = torch.randint(0, widths[-1], (64,))

    def step():
        optimizer.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step, 64, "mlp 64-256-256-10 batch 64", "samples/s", "mlp/batch:64"


def gpt_model(torch, layers=4, dim=128, heads=4, context=64, vocab=114):
    """dplab's GPT (Model::gpt) in PyTorch: pre-LayerNorm blocks, a fused QKV projection,
    the plain causal attention, a tanh-GELU MLP d -> 4d -> d, a final LayerNorm and an untied
    head without bias. tools/gpu_step_time_torch.py builds it too."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(dim)
            self.c_attn = nn.Linear(dim, 3 * dim)
            self.attn_proj = nn.Linear(dim, dim)
            self.ln_2 = nn.LayerNorm(dim)
            self.c_fc = nn.Linear(dim, 4 * dim)
            self.mlp_proj = nn.Linear(4 * dim, dim)
            self.register_buffer(
                "mask", torch.tril(torch.ones(context, context, dtype=torch.bool)))

        def attention(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(x).split(dim, dim=2)
            q = q.view(b, t, heads, c // heads).transpose(1, 2)  # (B, H, T, d)
            k = k.view(b, t, heads, c // heads).transpose(1, 2)
            v = v.view(b, t, heads, c // heads).transpose(1, 2)
            # The plain attention dplab computes (scores, mask, softmax, P v), not a fused kernel.
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // heads)
            scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
            y = torch.softmax(scores, dim=-1) @ v
            return self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c))

        def forward(self, x):
            x = x + self.attention(self.ln_1(x))
            return x + self.mlp_proj(
                nn.functional.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocab, dim)
            self.wpe = nn.Embedding(context, dim)
            self.h = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(dim)
            self.lm_head = nn.Linear(dim, vocab, bias=False)

        def forward(self, ids):
            positions = torch.arange(ids.shape[1], device=ids.device)
            x = self.wte(ids) + self.wpe(positions)
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    return Gpt()


def gpt_step(torch):
    torch.manual_seed(1)
    nn = torch.nn
    layers, dim, heads, context, vocab, batch = 4, 128, 4, 64, 114, 8

    model = gpt_model(torch, layers, dim, heads, context, vocab)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, vocab, (batch, context))
    targets = torch.randint(0, vocab, (batch, context))

    def step():
        optimizer.zero_grad(set_to_none=False)
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits.view(-1, vocab), targets.view(-1))
        loss.backward()
        optimizer.step()
        return loss.item()

    return (step, batch * context, "gpt 4 blocks dim 128 context 64 batch 8", "tokens/s",
            "gpt/batch:8")


def main() -> int:
    args = sys.argv[1:]
    json_file = None
    if len(args) >= 2 and args[-2] == "--json":
        json_file, args = args[-1], args[:-2]
    if len(args) not in (1, 2) or args[0] not in ("mlp", "gpt") or (
            len(args) == 2 and not args[1].isdigit()):
        print("usage: cpu_step_time_torch.py mlp|gpt [STEPS] [--json FILE]", file=sys.stderr)
        return 2
    # One thread everywhere: torch.set_num_threads sets ATen's pool only, and the BLAS
    # library under it (OpenBLAS in Debian's build) starts one thread per core unless told
    # before it loads; measured here, PyTorch then used 2 cores for a 1-thread step.
    for variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[variable] = "1"
    try:
        import torch
    except ImportError:
        print("pytorch: not installed here (Debian's python3-torch): no comparison",
              file=sys.stderr)
        return 77
    torch.set_num_threads(1)
    steps = int(args[1]) if len(args) == 2 else 20
    step, items, what, unit, name = (mlp_step if args[0] == "mlp" else gpt_step)(torch)
    for _ in range(3):
        step()
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(steps):
            loss = step()
        best = min(best, (time.perf_counter() - start) / steps)
    if not math.isfinite(loss):
        print(f"pytorch: the loss is not finite ({loss})", file=sys.stderr)
        return 1
    print(f"pytorch {what}, 1 thread: {items / best:.0f} {unit} ({best:.6f} s/step)")
    if json_file:
        counter = unit.replace("/", "_per_")
        with open(json_file, "w") as f:
            json.dump({"context": {"torch": torch.__version__}, "benchmarks": [
                {"run_name": f"pytorch_step/{name}", "real_time": best, "time_unit": "s",
                 counter: items / best}]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
