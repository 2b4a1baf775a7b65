"""One DAPO step of the probe (probe_model.py) through this project's own trainer, in one process.

    PYTHONPATH=. python bench/probe_step.py --out DIR [--layers 4] [--small] [--device auto] [--peak-tflops 989]
        [--rollout-compile null] [--set KEY=VALUE ...]

Builds the probe in DIR/probe (about 6 GB for 4 layers; reused when built the same way), trains
3 steps with train_dapo.main into DIR/probe_ours (bf16 rollout and learner, gradient
checkpointing, no dynamic sampling, validation or checkpoints), and prints one line from the
means of steps 2-3 (step 1 carries the warm-up): the step time split into generation, training
and weight sync, generated tokens/s, the training's MFU (Probe.training_flops over the train
time, against --peak-tflops; 989 is H100/H200 bf16 dense), the peak device memory, and how many
responses ran the full length. Writes DIR/probe_ours.json for probe_trl.py's ratios. A failed
run exits with train_dapo's status, its one-line error last.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

import train_dapo
from device import select_platform
from probe_model import Probe, build_probe

STEPS = 3
MEASURED_STEPS = (2, 3)  # step 1 carries the warm-up: first kernels, allocator growth
MICRO_BATCH = 16
RESULT_FILE = "probe_ours.json"


def train_argv(probe: Probe, run_dir: Path, device: str, rollout_compile: str, overrides: list[str]) -> list[str]:
    work = probe.work
    settings = {
        "model_path": probe.model_path, "dataset": probe.dataset, "reward_fn": "probe_model:zero_reward",
        "prompts_per_step": work.prompts, "sample_num": work.samples, "max_response_length": work.new_tokens,
        # Every prompt in one length bucket, unpadded: one generation batch per step.
        "bucket_size": probe.prompt_tokens, "max_prompt_length": probe.prompt_tokens,
        # Random weights earn one constant reward, so no group would count as informative.
        "dynamic_sampling": "false",
        "rollout_dtype": "bf16", "learner_dtype": "bf16", "gradient_checkpointing": "true",
        "rollout_compile": rollout_compile,
        # One optimizer step on all the step's sequences in micro-batches of 16, as TRL's default
        # layout (steps_per_generation = gradient_accumulation_steps) does.
        "per_device_batch_size": MICRO_BATCH, "gradient_accumulation_steps": work.sequences // MICRO_BATCH,
        "max_steps": STEPS, "val_every": 0, "save_every": 0, "log_completions": 0, "report_to": "csv",
        "device": device, "output_dir": run_dir, "overwrite_output_dir": "true",
    }
    settings.update(override.split("=", 1) for override in overrides)
    return [item for key, value in settings.items() for item in (f"--{key}", str(value))]


def measured_means(metrics_csv: Path) -> dict[str, float]:
    """Means over MEASURED_STEPS of the columns the result line reports."""
    with metrics_csv.open() as f:
        rows = [row for row in csv.DictReader(f) if row["step"] and int(row["step"]) in MEASURED_STEPS]
    columns = ("step_time_s", "gen_time_s", "train_time_s", "sync_time_s", "gen_tokens_per_s",
               "response_length_mean", "truncated_frac")
    return {column: statistics.mean(float(row[column]) for row in rows) for column in columns}


def result_line(probe: Probe, means: dict[str, float], peak_memory: int | None, peak_tflops: float) -> str:
    response_tokens = means["response_length_mean"] * probe.work.sequences
    mfu = probe.training_flops(response_tokens) / means["train_time_s"] / (peak_tflops * 1e12)
    memory = f"{peak_memory / 2**30:.1f} GiB" if peak_memory is not None else "n/a on cpu"
    return (f"PASS probe: {probe.describe()}; means of steps {MEASURED_STEPS[0]}-{MEASURED_STEPS[-1]}: "
            f"step {means['step_time_s']:.2f} s = generation {means['gen_time_s']:.2f} s "
            f"({means['gen_tokens_per_s'] / 1e3:.1f}k tokens/s) + train {means['train_time_s']:.2f} s "
            f"(MFU {mfu:.1%} of {peak_tflops:g} TFLOP/s) + weight sync {means['sync_time_s']:.2f} s; "
            f"peak device memory {memory}; {means['truncated_frac']:.0%} of responses ran all "
            f"{probe.work.new_tokens} tokens")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--small", action="store_true", help="a tiny geometry for a CPU (probe_model.py)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a training setting over the probe's own (use_remove_padding=false, ...), repeatable")
    parser.add_argument("--rollout-compile", choices=("true", "false", "null"), default="null",
                        help="rollout_compile (null: the platform's choice; on CUDA the decode step compiles once per "
                             "attended length, in step 1, which the means leave out)")
    return parser.parse_args()


def main() -> int:
    args = parse_arguments()
    plat = select_platform(args.device)
    probe = build_probe(args.out / "probe", args.layers, args.small, plat.device)
    plat.release_cache()
    if plat.module is not None:
        plat.module.reset_peak_memory_stats()  # the run's peak, not the build's
    run_dir = args.out / "probe_ours"
    status = train_dapo.main(train_argv(probe, run_dir, args.device, args.rollout_compile, args.overrides))
    if status != 0:
        return status  # train_dapo's one-line error is the last line of output, for the FAIL line
    peak_memory = plat.module.max_memory_allocated() if plat.module is not None else None
    means = measured_means(run_dir / "metrics.csv")
    (args.out / RESULT_FILE).write_text(json.dumps(means, indent=2) + "\n")
    print(result_line(probe, means, peak_memory, args.peak_tflops))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
