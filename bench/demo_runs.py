"""What the demo benches share: the demo assets, an N-rank run of the demo, medians of metrics.csv."""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_demo(out: Path, nproc: int, steps: int, *overrides: str) -> Path:
    """Train the demo for ``steps`` steps on ``nproc`` ranks (validation off); returns metrics.csv."""
    assets = ROOT / "runs" / "demo_assets"
    if not (assets / "demo_info.json").is_file():
        subprocess.run([sys.executable, "data_prep.py", "demo", "--out", str(assets)], cwd=ROOT, check=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                    "train_dapo.py", "--config", "configs/demo_cpu.yaml", "--output_dir", str(out),
                    "--max_steps", str(steps), "--val_every", "0", "--val_dataset", "null",
                    "--log_every", str(steps), *overrides],
                   cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return out / "metrics.csv"


def medians(metrics: Path, skip: int, keys: tuple[str, ...]) -> dict[str, float]:
    """Median of each column over the training rows after the first ``skip`` (start-up) ones."""
    with metrics.open() as f:
        rows = [r for r in csv.DictReader(f) if r["step_time_s"]][skip:]
    return {key: statistics.median(float(r[key] or 0.0) for r in rows) for key in keys}


def bench_arguments(description: str) -> argparse.Namespace:
    """--steps, --nproc and --skip (start-up steps left out of the medians), as every demo bench takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--skip", type=int, default=5)
    return parser.parse_args()
