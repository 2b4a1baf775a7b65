"""TRL's GRPOTrainer (loss_type "dapo") on the probe that probe_step.py built, for the ratio of
this project's step time to TRL's on the same model and work.

    PYTHONPATH=. python bench/probe_trl.py --out DIR [--device auto]

Needs trl (and the datasets package it imports); without it prints "SKIP trl" and exits 0.
Trains 3 steps on DIR/probe into DIR/probe_trl with the probe's work (16 prompts x 8
generations x 256 new tokens, all of them: the EOS cannot be sampled), one optimizer step per
generation batch in micro-batches of 16, the DAPO loss (clip 0.2 / 0.28, token mean), no KL and
no MoE load-balancing loss, the probe's zero reward, gradient checkpointing, bf16 weights as
stored with bf16 autocast, and transformers' generate. Prints TRL's mean step time over steps
2-3 split into generation and the rest (the learner: loss, backward, optimizer; TRL skips the
old-log-prob pass when each batch is trained on once), its peak device memory, and, when
DIR/probe_ours.json is there, the ratios ours / TRL.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Any

from device import Platform, select_platform
from probe_model import Probe, load_probe, zero_reward
from probe_step import MEASURED_STEPS, MICRO_BATCH, RESULT_FILE, STEPS


def trl_zero_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """probe_model.zero_reward in TRL's reward-function form."""
    return [zero_reward(str(completion), None)[0] for completion in completions]


def trl_config(plat: Platform, probe: Probe, run_dir: Path):
    """The probe's work in GRPOConfig's terms (module docstring)."""
    from trl import GRPOConfig

    work = probe.work
    return GRPOConfig(
        output_dir=str(run_dir), max_steps=STEPS, per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=work.sequences // MICRO_BATCH, num_generations=work.samples,
        max_completion_length=work.new_tokens, temperature=1.0, top_p=1.0, loss_type="dapo", epsilon=0.2,
        epsilon_high=0.28, beta=0.0, learning_rate=1e-6, bf16=True, gradient_checkpointing=True,
        router_aux_loss_coef=0.0,  # DAPO (and this project) has no MoE load-balancing loss
        # The probe's bf16 weights as stored: how docs/platform.md's TRL baseline (7.5 s, 27 GB) ran.
        model_init_kwargs={"dtype": "bfloat16"}, use_cpu=plat.kind == "cpu", logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True, seed=0)


def timed_trainer(plat: Platform, model_path: Path, reward_funcs: Any, args: Any, train_dataset: Any):
    """A GRPOTrainer on ``model_path`` that records, for each generation batch, the seconds of its
    generation (``generation_seconds``) and of its whole making (``batch_seconds``: the generation,
    the rewards and advantages, and the old log-probs where TRL computes them), and a callback that
    records when each optimizer step ends (TRL's own step_time leaves the optimizer out)."""
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    def timed(seconds: list[float], call: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = call(*args, **kwargs)
        plat.synchronize()
        seconds.append(time.perf_counter() - start)
        return result

    class TimedGRPOTrainer(GRPOTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.generation_seconds: list[float] = []
            self.batch_seconds: list[float] = []

        def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:  # TRL 1.x: one generation batch
            return timed(self.generation_seconds, super()._generate_single_turn, *args, **kwargs)

        def _generate_and_score_completions(self, *args: Any, **kwargs: Any) -> Any:
            return timed(self.batch_seconds, super()._generate_and_score_completions, *args, **kwargs)

    class StepEnds(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            plat.synchronize()
            self.times.append(time.perf_counter())

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            plat.synchronize()  # the optimizer step's kernels belong to this step
            self.times.append(time.perf_counter())

    step_ends = StepEnds()
    trainer = TimedGRPOTrainer(model=str(model_path), reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                               processing_class=AutoTokenizer.from_pretrained(model_path), callbacks=[step_ends])
    return trainer, step_ends


def probe_dataset(probe: Probe):
    """The probe's prompts as TRL's conversational dataset."""
    from datasets import Dataset

    prompts = [json.loads(line)["prompt"] for line in probe.dataset.read_text().splitlines()]
    return Dataset.from_list([{"prompt": [{"role": "user", "content": text}]} for text in prompts])


def ratio_text(out: Path, step: float, learner: float) -> str:
    ours_file = out / RESULT_FILE
    if not ours_file.is_file():
        return "no ratio: probe_step.py wrote no result"
    ours = json.loads(ours_file.read_text())
    return (f"ours / TRL: step {ours['step_time_s'] / step:.2f}x, learner {ours['train_time_s'] / learner:.2f}x "
            f"(ours: train; TRL: step minus generation)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    # GRPOTrainer trains from a datasets.Dataset, and trl imports datasets only when it needs it.
    missing = [name for name in ("trl", "datasets") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"SKIP trl: the comparison needs {' and '.join(missing)}, not installed here")
        return 0
    import trl

    plat = select_platform(args.device)
    probe = load_probe(args.out / "probe")
    if plat.module is not None:
        plat.module.reset_peak_memory_stats()
    trainer, step_ends = timed_trainer(plat, probe.model_path, trl_zero_reward,
                                       trl_config(plat, probe, args.out / "probe_trl"), probe_dataset(probe))
    trainer.train()
    peak = f"{plat.module.max_memory_allocated() / 2**30:.1f} GiB" if plat.module is not None else "n/a on cpu"
    first, last = MEASURED_STEPS[0], MEASURED_STEPS[-1]
    step = statistics.mean(step_ends.times[s] - step_ends.times[s - 1] for s in MEASURED_STEPS)
    generation = statistics.mean(trainer.generation_seconds[first - 1:last])
    print(f"PASS trl: TRL {trl.__version__} GRPOTrainer (loss_type dapo) on the same probe; means of steps "
          f"{first}-{last}: step {step:.2f} s = generation {generation:.2f} s + learner (the rest) "
          f"{step - generation:.2f} s; peak device memory {peak}; {ratio_text(args.out, step, step - generation)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
