"""Does the length penalty shorten responses, and what does it cost? Demo runs, coef 0 vs coef > 0,
at the same seed, for several seeds.

    python bench/length_penalty.py [--steps 300] [--coef 1.0] [--last 50] [--seeds 0 1 2] [--nproc 8]

For each seed it trains the demo twice (the shape users run: 8 ranks), prints the mean response
length over the last steps and the greedy val accuracy at the end of both runs, and ends with
how many seeds the penalty shortened. The penalty is docs/algorithm.md §5's group-relative term:
responses longer than their group's mean are pushed down, shorter ones up.
"""
from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_runs import ROOT, run_demo  # noqa: E402


def summary(metrics: Path, last: int) -> tuple[float, float]:
    """(mean response length over the last ``last`` training steps, the last val accuracy)."""
    with metrics.open() as f:
        rows = list(csv.DictReader(f))
    lengths = [float(r["response_length_mean"]) for r in rows if r["response_length_mean"]][-last:]
    accuracy = [float(r["val_acc"]) for r in rows if r["val_acc"]][-1]
    return sum(lengths) / len(lengths), accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--coef", type=float, default=1.0)
    parser.add_argument("--last", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--nproc", type=int, default=8)
    args = parser.parse_args()
    validate_at_the_end = ("--val_every", str(args.steps), "--val_dataset", str(ROOT / "runs/demo_assets/val.jsonl"))
    print(f"mean response length over the last {args.last} of {args.steps} steps, and final greedy val_acc")
    print(f"{'seed':>4} | {'coef 0: length':>14} {'val_acc':>7} | {f'coef {args.coef:g}: length':>14} {'val_acc':>7} "
          f"| length ratio")
    shorter = 0
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            results = []
            for coef in (0.0, args.coef):
                metrics = run_demo(Path(tmp) / f"seed{seed}_coef{coef}", args.nproc, args.steps, "--seed", str(seed),
                                   "--length_penalty_coef", str(coef), *validate_at_the_end)
                results.append(summary(metrics, args.last))
            (base, base_acc), (penalised, penalised_acc) = results
            shorter += penalised < base
            print(f"{seed:>4} | {base:>14.3f} {base_acc:>7.3f} | {penalised:>14.3f} {penalised_acc:>7.3f} "
                  f"| {penalised / base:.3f}", flush=True)
    print(f"the penalty shortened responses on {shorter} of {len(args.seeds)} seeds")


if __name__ == "__main__":
    main()
