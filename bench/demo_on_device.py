"""The demo on one device, one process: it learns, checkpoints, and resumes exactly.

    PYTHONPATH=. python bench/demo_on_device.py --out DIR [--device auto] [--steps 200] [--rollout-compile false]

Builds the demo assets into DIR/assets (data_prep.py demo), then runs train_dapo.py with
configs/demo_cpu.yaml on the device, deterministic (run.deterministic: a GPU's fastest kernels
do not compute the same twice): run A trains STEPS steps straight; run B, started beside run A,
trains STEPS/2 steps and is then resumed (--resume_from_checkpoint auto) to STEPS. Both validate
and save every STEPS/2 steps; side by side, each has half the host's cores. The decode step is
not compiled unless --rollout-compile says so: compiling one graph per attended length would
take most of the check, and bench/decode.py measures the compiled step. Prints one
line: run A's val_acc at the start and the end, its median step time, and whether run B ended
with run A's weights (the .safetensors files of the last checkpoint, byte for byte) and
metrics.csv rows (every column but the timings). On a difference it names the first one and
whether the runs already differed before the resume (the device does not compute the same
twice) or only after it (the resume is not exact). Exit status 0 on PASS. Logs:
DIR/assets.log, DIR/straight.log, DIR/resumed.log.
"""
from __future__ import annotations

import argparse
import csv
import filecmp
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from ckpt import step_dir_name
from metrics import TIMING_COLUMNS

ROOT = Path(__file__).resolve().parents[1]


class CheckFailed(Exception):
    """One line saying why the check failed."""


def start(command: list[str], log: Path) -> subprocess.Popen:
    """``python command...`` in the project folder, output to ``log``, with half the host's cores:
    two runs go side by side, and two sets of spinning OpenMP threads on every core slowed a step
    tenfold on a 2-core host."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, os.cpu_count() // 2)))}
    with log.open("a") as sink:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, *command], cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)


def wait(process: subprocess.Popen, log: Path, what: str) -> None:
    if process.wait() != 0:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        raise CheckFailed(f"{what} exited with status {process.returncode}: {lines[-1] if lines else 'no output'} "
                          f"(log: {log})")


def train(run_dir: Path, assets: Path, options: argparse.Namespace, steps: int, every: int,
          *extra: str) -> subprocess.Popen:
    return start(["train_dapo.py", "--config", "configs/demo_cpu.yaml", "--device", options.device,
                  "--deterministic", "true", "--rollout_compile", options.rollout_compile,
                  "--model_path", str(assets / "model"), "--dataset", str(assets / "train.jsonl"),
                  "--val_dataset", str(assets / "val.jsonl"), "--output_dir", str(run_dir), "--max_steps", str(steps),
                  "--save_every", str(every), "--val_every", str(every), "--log_every", str(every),
                  "--report_to", "csv", *extra], run_dir.with_suffix(".log"))


def metrics_rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def first_difference(rows_a: list[dict[str, str]], rows_b: list[dict[str, str]], through: int) -> Optional[str]:
    """The first differing non-timing value in the rows up to step ``through``, or None."""
    rows_a = [row for row in rows_a if int(row["step"]) <= through]
    rows_b = [row for row in rows_b if int(row["step"]) <= through]
    for row_a, row_b in zip(rows_a, rows_b):
        for column, value in row_a.items():
            if column not in TIMING_COLUMNS and value != row_b.get(column):
                return f"step {row_a['step']} {column}: {value} vs {row_b.get(column)}"
    if len(rows_a) != len(rows_b):
        return f"{len(rows_a)} metrics rows through step {through} vs {len(rows_b)}"
    return None


def same_weights(run_a: Path, run_b: Path, step: int) -> bool:
    model = Path("checkpoints") / step_dir_name(step) / "model"
    files = sorted(path.name for path in (run_a / model).glob("*.safetensors"))
    return bool(files) and all((run_b / model / name).is_file()
                               and filecmp.cmp(run_a / model / name, run_b / model / name, shallow=False)
                               for name in files)


def compare(straight: Path, resumed: Path, half: int, steps: int) -> str:
    """How run B (resumed at ``half``) compares with run A; raises CheckFailed on a difference."""
    rows_a, rows_b = metrics_rows(straight), metrics_rows(resumed)
    before = first_difference(rows_a, rows_b, through=half) or \
        (None if same_weights(straight, resumed, half) else f"step {half} weights")
    if before:
        raise CheckFailed(f"two runs differ before any resume ({before}): the device does not compute the same "
                          f"twice, so exact resume cannot be checked")
    after = first_difference(rows_a, rows_b, through=steps) or \
        (None if same_weights(straight, resumed, steps) else f"step {steps} weights")
    if after:
        raise CheckFailed(f"identical through step {half}, then the resumed run differs: {after}")
    return f"resume at {half} exact (step {steps} weights and {len(rows_a)} metrics rows identical)"


def train_straight_and_resumed(assets: Path, straight: Path, resumed: Path, options: argparse.Namespace) -> None:
    """Run A beside the first half of run B, then run B's resumed half; a failure stops them all."""
    steps, half = options.steps, options.steps // 2
    running = [train(straight, assets, options, steps, half)]
    try:
        wait(train(resumed, assets, options, half, half), resumed.with_suffix(".log"), f"run B (steps 1-{half})")
        running.append(train(resumed, assets, options, steps, half, "--resume_from_checkpoint", "auto"))
        wait(running[0], straight.with_suffix(".log"), f"run A (steps 1-{steps})")
        wait(running[1], resumed.with_suffix(".log"), f"run B resumed (steps {half + 1}-{steps})")
    finally:
        for process in running:
            if process.poll() is None:
                process.kill()  # no run outlives a failed check


def run_check(out: Path, options: argparse.Namespace) -> str:
    assets, straight, resumed = out / "assets", out / "straight", out / "resumed"
    build_log = out / "assets.log"
    steps = options.steps
    wait(start(["data_prep.py", "demo", "--out", str(assets)], build_log), build_log, "data_prep demo")
    train_straight_and_resumed(assets, straight, resumed, options)
    verdict = compare(straight, resumed, steps // 2, steps)
    rows = metrics_rows(straight)
    val_acc = {int(r["step"]): float(r["val_acc"]) for r in rows if r["val_acc"]}
    step_time = statistics.median(float(r["step_time_s"]) for r in rows if r["step_time_s"])
    device = json.loads((straight / "env_report.json").read_text())["device"]
    return (f"on {device}, val_acc {val_acc[0]:.2f} -> {val_acc[steps]:.2f} over {steps} steps "
            f"({step_time:.2f} s/step median, beside run B), {verdict}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--steps", type=int, default=200, help="an even number: run B resumes at half of it")
    parser.add_argument("--rollout-compile", choices=("true", "false", "null"), default="false",
                        help="rollout_compile for both runs (null: the platform's choice)")
    args = parser.parse_args()
    if args.steps < 2 or args.steps % 2:
        parser.error(f"--steps must be an even number >= 2, got {args.steps}")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        verdict = run_check(args.out, args)
    except CheckFailed as failure:
        print(f"FAIL demo: {failure}")
        return 1
    print(f"PASS demo: {verdict}; {time.perf_counter() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
