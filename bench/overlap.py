"""Does rollout really run one step ahead? The 8-rank demo with max_staleness 0 and 1.

    python bench/overlap.py [--steps 40] [--nproc 8]

Prints, for both settings, the median step time and the median overlap =
(generation time + training time) / step time: about 1 or less when generation and training
take turns, above 1 when generation of step j+1 runs while step j trains. The first steps
(start-up, first touches) are left out of the medians.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def medians(metrics: Path, skip: int) -> tuple[float, float, float, float]:
    with metrics.open() as f:
        rows = [r for r in csv.DictReader(f) if r["step_time_s"]][skip:]
    med = lambda key: statistics.median(float(r[key]) for r in rows)  # noqa: E731
    return med("step_time_s"), med("overlap"), med("gen_time_s"), med("train_time_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--skip", type=int, default=5)
    args = parser.parse_args()
    assets = ROOT / "runs" / "demo_assets"
    if not (assets / "demo_info.json").is_file():
        subprocess.run([sys.executable, "data_prep.py", "demo", "--out", str(assets)], cwd=ROOT, check=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for staleness in (0, 1):
            out = Path(tmp) / f"staleness_{staleness}"
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc_per_node={args.nproc}", "train_dapo.py", "--config", "configs/demo_cpu.yaml",
                            "--output_dir", str(out), "--max_steps", str(args.steps), "--max_staleness",
                            str(staleness), "--val_every", "0", "--val_dataset", "null", "--save_every", "0",
                            "--log_every", str(args.steps)],
                           cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
            results[staleness] = medians(out / "metrics.csv", args.skip)
    print(f"{args.nproc} ranks, {args.steps} steps, medians over steps {args.skip + 1}..{args.steps}:")
    for staleness, (step, overlap, gen, train) in results.items():
        print(f"  max_staleness {staleness}: step {step:.3f} s  gen {gen:.3f} s  train {train:.3f} s  "
              f"overlap {overlap:.2f}")
    print(f"  step time ratio staleness 1 / staleness 0: {results[1][0] / results[0][0]:.3f}")


if __name__ == "__main__":
    main()
