"""The fault matrix: one rank of the 8-rank demo SIGKILLed in each phase; the job must restart by
itself and end exactly like a run that was never interrupted.

    python bench/fault_matrix.py [--steps 6] [--at_step 3] [--cell ROLE/PHASE ...]

Rows: a rollout rank (2), the lead learner (6), the other learner (7). Columns: generation,
sample transfer, weight sync, update, save (the ``checkpoint`` phase). Each cell runs the demo
under ``torchrun --max-restarts 1`` with DAPO_FAULT (faults.py) killing that rank when it enters
that phase of step ``at_step``; a rank that has no part in the phase is killed when a rank that
does enters it (a learner when rollout rank 0 starts generating, a rollout rank when the lead
learner starts updating). A cell is equal when the job restarted, finished, and its metrics
rows (timing columns aside) and final weights are those of the uninterrupted run. Prints the
table with the seconds each cell took; about a minute a cell on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ckpt import step_dir_name  # noqa: E402
from metrics import TIMING_COLUMNS  # noqa: E402

PHASES = {"generation": "generation", "sample transfer": "sample transfer", "weight sync": "weight sync",
          "update": "update", "save": "checkpoint"}


@dataclass(frozen=True)
class Job:
    """The torchrun job a cell runs in: ``nproc`` ranks, the last ``learners`` of them learning."""

    nproc: int = 8
    learners: int = 2

    @property
    def victims(self) -> dict[str, int]:
        """The rank each row kills: a rollout rank other than 0 (which holds the store) where there
        are several, the lead learner, the other learner (ranks 2, 6 and 7 of 8; 0, 1, 2 of 3)."""
        lead = self.nproc - self.learners
        return {"rollout": min(2, lead - 1), "lead learner": lead, "other learner": lead + 1}

    def fault(self, role: str, column: str, step: int) -> str:
        """One DAPO_FAULT entry for a cell: the victim kills itself in a phase it runs; otherwise
        a rank that runs the phase (rollout rank 0, the lead learner) kills it there."""
        victim, phase, lead = self.victims[role], PHASES[column], self.nproc - self.learners
        witness = {"generation": 0, "update": lead}.get(phase)
        has_no_part = phase == ("generation" if victim >= lead else "update")
        return f"{witness}:{phase}:{step}:kill={victim}" if has_no_part else f"{victim}:{phase}:{step}"


def torchrun(train_args: list[str], *, job: Job = Job(), restarts: int = 0, fault: Optional[str] = None,
             timeout: int = 600) -> subprocess.CompletedProcess:
    """The job, one thread a rank, torchrun watching it every second."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DAPO_FAULT", None)
    if fault:
        env["DAPO_FAULT"] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={job.nproc}",
           f"--max-restarts={restarts}", "--monitor_interval=1", *train_args, "--learner_ranks", str(job.learners)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def run_cells(train_args: list[str], cells: list[tuple[str, str, int]], job: Job = Job()) -> tuple[Optional[str], float]:
    """One job that meets each (role, column, step) cell in turn, one per attempt, under
    ``--max-restarts len(cells)``; returns (None, seconds) when it restarted after each and
    finished, else (why not, seconds)."""
    start = time.perf_counter()
    faults = ",".join(job.fault(role, column, step) for role, column, step in cells)
    done = torchrun(train_args, job=job, restarts=len(cells), fault=faults)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        return f"the job failed (exit status {done.returncode}): {errors[:3] or done.stderr[-1000:]}", seconds
    if "forcefully exiting" in done.stderr:  # torchrun's SIGKILL, 30 s after its SIGTERM
        return "a surviving rank did not end on torchrun's SIGTERM", seconds
    attempts = done.stdout.count(" role=") // job.nproc
    if attempts != len(cells) + 1:
        return f"the job ran {attempts} attempts, not {len(cells) + 1}: a fault never struck", seconds
    return None, seconds


def rows(out: Path) -> list[dict[str, str]]:
    with (out / "metrics.csv").open() as f:
        return [{k: v for k, v in row.items() if k not in TIMING_COLUMNS} for row in csv.DictReader(f)]


def final_weights(out: Path, steps: int) -> bytes:
    return (out / "checkpoints" / step_dir_name(steps) / "model" / "model.safetensors").read_bytes()


def differences(out: Path, reference: Path, steps: int) -> list[str]:
    """What differs between a run and the uninterrupted one: [] when rows and final weights match."""
    found = []
    if rows(out) != rows(reference):
        found.append("metrics rows")
    if final_weights(out, steps) != final_weights(reference, steps):
        found.append("final weights")
    return found


def demo_args(out: Path, steps: int) -> list[str]:
    """The demo with a checkpoint every step, all of them kept, validation every 3 steps."""
    return ["train_dapo.py", "--config", "configs/demo_cpu.yaml", "--output_dir", str(out), "--max_steps", str(steps),
            "--save_every", "1", "--keep_last", str(steps), "--val_every", "3", "--val_max_prompts", "24",
            "--log_every", "1", "--dist_timeout_s", "30"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--at_step", type=int, default=3)
    parser.add_argument("--cell", action="append", help="ROLE/PHASE, e.g. 'lead learner/save' (default: all 15)")
    args = parser.parse_args()
    cells = [tuple(c.split("/")) for c in args.cell] if args.cell else [(r, p) for r in Job().victims for p in PHASES]
    if not (ROOT / "runs" / "demo_assets" / "demo_info.json").is_file():
        subprocess.run([sys.executable, "data_prep.py", "demo", "--out", "runs/demo_assets"], cwd=ROOT, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        reference = Path(tmp) / "uninterrupted"
        uninterrupted = torchrun(demo_args(reference, args.steps))
        assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
        results = {}
        for role, column in cells:
            out = Path(tmp) / f"{role}-{column}".replace(" ", "_")
            failure, seconds = run_cells(demo_args(out, args.steps), [(role, column, args.at_step)])
            failure = failure or ", ".join(differences(out, reference, args.steps)) or None
            results[role, column] = ("equal" if failure is None else "DIFFERS", seconds)
            print(f"{role} / {column}: {failure or 'equal'} ({seconds:.0f} s)", file=sys.stderr, flush=True)
    print_table(results, args.at_step)


def print_table(results: dict[tuple[str, str], tuple[str, float]], step: int) -> None:
    print(f"SIGKILL in step {step} of the 8-rank demo, torchrun --max-restarts 1: result (seconds)")
    print(f"{'':18}" + "".join(f"{column:>18}" for column in PHASES))
    for role, victim in Job().victims.items():
        cells = [results.get((role, column)) for column in PHASES]
        print(f"{role + f' ({victim})':18}" + "".join(f"{f'{c[0]} ({c[1]:.0f})' if c else '-':>18}" for c in cells))
    print(f"{sum(verdict == 'equal' for verdict, _ in results.values())} of {len(results)} cells equal")


if __name__ == "__main__":
    main()
