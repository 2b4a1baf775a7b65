"""Does the length penalty shorten responses? Two demo runs, same seed, coef 0 vs coef > 0.

    python bench/length_penalty.py [--steps 200] [--coef 2.0] [--last 50]

Builds the demo assets into runs/demo_assets if absent, trains twice in one process each, and
prints the mean response length over the last steps of both runs and their ratio.

What to expect: REFERENCE.md §5's term equals coef * sum_i log pi(o_i) / (total tokens), a
score-function term with the same weight for every response, whose expected gradient under
on-policy samples is zero (E[grad log pi(o)] = 0). Any difference this script shows is
therefore sampling noise, in either direction; a term that reliably shortens responses needs
a weight that grows with length (for example rho_i times the summed log-prob).
"""
from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mean_length(metrics: Path, last: int) -> float:
    with metrics.open() as f:
        rows = [r for r in csv.DictReader(f) if r["response_length_mean"]]
    tail = rows[-last:]
    return sum(float(r["response_length_mean"]) for r in tail) / len(tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--coef", type=float, default=2.0)
    parser.add_argument("--last", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    assets = ROOT / "runs" / "demo_assets"
    if not (assets / "demo_info.json").is_file():
        subprocess.run([sys.executable, "data_prep.py", "demo", "--out", str(assets)], cwd=ROOT, check=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    lengths = {}
    with tempfile.TemporaryDirectory() as tmp:
        for coef in (0.0, args.coef):
            out = Path(tmp) / f"coef_{coef}"
            subprocess.run([sys.executable, "train_dapo.py", "--config", "configs/demo_cpu.yaml",
                            "--output_dir", str(out), "--max_steps", str(args.steps), "--seed", str(args.seed),
                            "--length_penalty_coef", str(coef), "--val_every", "0", "--save_every", "0",
                            "--log_every", str(args.steps)], cwd=ROOT, env=env, check=True,
                           stdout=subprocess.DEVNULL)
            lengths[coef] = mean_length(out / "metrics.csv", args.last)
    base, penalised = lengths[0.0], lengths[args.coef]
    print(f"mean response length over the last {args.last} of {args.steps} steps (seed {args.seed}):")
    print(f"  length_penalty_coef 0      : {base:.3f} tokens")
    print(f"  length_penalty_coef {args.coef:<6g} : {penalised:.3f} tokens")
    print(f"  ratio penalised / unpenalised: {penalised / base:.3f}")


if __name__ == "__main__":
    main()
