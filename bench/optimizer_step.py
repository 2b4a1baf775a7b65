"""What one AdamW step over host parameters costs: the learner's fused kernel against the default
it replaced, on one thread (torchrun's OMP_NUM_THREADS=1) and on this process's cores.

    python bench/optimizer_step.py [--params 100e6] [--steps 5]

Times ``optimizer.step()`` over fp32 parameters laid out like a decoder's (per layer four
attention projections and three MLP matrices, plus embeddings; ~100M in all by default), with
fresh gradients each step: the median over ``--steps`` after one warm-up step, for torch's default
(on the CPU neither fused nor foreach: separate ops, tensor by tensor) and for ``learner.adamw`` (fused),
each on 1 thread and on ``len(os.sched_getaffinity(0))`` threads (an NPU learner with
learner_offload gets its NUMA node's share: device.bind_host_cores). Prints each time, the ratios
to the default on one thread, and the largest difference between the two optimizers' weights
after the same steps (float rounding). A 30B learner with offload steps ~150x as many parameters.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from config import OptimConfig  # noqa: E402
from learner import adamw  # noqa: E402

HIDDEN, VOCAB = 1024, 32000


def decoder_shapes(params: float) -> list[tuple[int, ...]]:
    """Embeddings, lm_head and as many layers (4 H x H, 3 H x 3H) as bring the total near ``params``."""
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * 3 * HIDDEN + 2 * HIDDEN
    layers = max(1, round((params - 2 * VOCAB * HIDDEN) / per_layer))
    layer = [(HIDDEN, HIDDEN)] * 4 + [(3 * HIDDEN, HIDDEN)] * 2 + [(HIDDEN, 3 * HIDDEN), (HIDDEN,), (HIDDEN,)]
    return [(VOCAB, HIDDEN), (VOCAB, HIDDEN)] + layer * layers


def time_steps(build, shapes: list[tuple[int, ...]], threads: int, steps: int) -> tuple[float, list[torch.Tensor]]:
    """Median seconds per step, and the weights after warm-up + ``steps`` steps (the same start and
    gradients for every optimizer)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        start = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape, generator=start) * 0.02) for shape in shapes]
        optimizer = build(params)
        draws, seconds = torch.Generator().manual_seed(1), []
        for _ in range(1 + steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=draws)
            begin = time.perf_counter()
            optimizer.step()
            seconds.append(time.perf_counter() - begin)
        return statistics.median(seconds[1:]), [p.detach() for p in params]
    finally:
        torch.set_num_threads(previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    optim = OptimConfig(learning_rate=1e-6, weight_decay=0.1)
    shapes = decoder_shapes(args.params)
    count = sum(torch.Size(shape).numel() for shape in shapes)
    cores = len(os.sched_getaffinity(0))
    optimizers = {
        "default": lambda ps: torch.optim.AdamW(ps, lr=optim.learning_rate, betas=(0.9, 0.999),
                                                weight_decay=optim.weight_decay),
        "fused": lambda ps: adamw(ps, optim),
    }
    print(f"AdamW step over {count / 1e6:.1f}M fp32 host parameters ({len(shapes)} tensors), "
          f"median of {args.steps} steps, torch {torch.__version__}:")
    times, weights = {}, {}
    for name, build in optimizers.items():
        for threads in sorted({1, cores}):
            times[name, threads], weights[name] = time_steps(build, shapes, threads, args.steps)
            print(f"  {name:7s} {threads:3d} thread(s): {times[name, threads]:.3f} s")
    today = times["default", 1]
    for (name, threads), seconds in times.items():
        if (name, threads) != ("default", 1):
            print(f"  default on 1 thread / {name} on {threads}: {today / seconds:.2f}x")
    difference = max((a - b).abs().max().item() for a, b in zip(weights["default"], weights["fused"]))
    print(f"  largest weight difference fused vs default after {1 + args.steps} steps: {difference:.3g}")


if __name__ == "__main__":
    main()
