"""Our demo step against TRL's GRPOTrainer on the same work, both in one go: samples/s of each
and the ratio ours / TRL (issue 33's target: at least 1.5).

    OMP_NUM_THREADS=2 python bench/versus_trl.py --trl-python VENV/bin/python [--steps 30] [--rounds 2]

VENV is a virtual environment with torch, trl 1.16.0 and datasets; without --trl-python, or when
its interpreter cannot import trl, one line says how to make one and the bench exits 0. The
demo's assets are built once in a temporary folder; each round then runs, one after the other:
- ours: train_dapo.main in this process (one process, both roles) on configs/demo_cpu.yaml with
  dynamic sampling, validation and checkpoints off, for --steps steps. Samples/s: the step's 48
  samples over the median step_time_s of metrics.csv after the first --warmup steps; its parts
  are gen_time_s (generation and rewards), train_time_s (old log-probs and the 6 optimizer steps)
  and the rest (mostly the weight load into the rollout copy).
- TRL: this file under --trl-python (--trl-side), GRPOTrainer on the same model folder with the
  same settings, read from the same config: 6 prompts x 8 generations a generation batch (48),
  micro-batches of 8 with one optimizer step each (steps_per_generation 6, as our 48 sequences
  make 6 optimizer steps), num_iterations 1, at most 8 new tokens, temperature 1.0, top_p 1.0,
  loss_type "dapo", clip 0.2 / 0.28, beta 0, AdamW (fused) at 2e-4 constant, no warmup or weight
  decay, gradient norm clipped at 1.0, fp32, no gradient checkpointing, no MoE load-balancing
  loss, on the CPU. Its prompts are the same chat messages through the same chat template (the
  run refuses to start when TRL's prompt tokens differ from ours); its reward is ours
  (rewards.py's demo_arithmetic with the config's soft overlong punishment, on the completion's
  tokens with its EOS, as ours counts them). Samples/s: 48 over the median seconds between the
  ends of every 6th optimizer step after the first --warmup generation batches; its parts are
  generation (transformers' generate), the batch's preparation (rewards, advantages and the old
  log-probs, which TRL computes because gradient_accumulation_steps 1 is not a multiple of the
  6 steps a generation batch lasts) and the update.

Where the two runs still differ:
- Generation: ours is the built-in decode loop on a separate rollout copy that takes the new
  weights every step (a load counted in our step); TRL generates with the policy itself.
- Staleness: ours runs the demo's max_staleness 1 (samples one weight version old), which one
  process does not overlap, so it changes no time; TRL is on-policy.
- Padding: our prompts are left-padded to the bucket's bound for generation (32 tokens for the
  demo's 23), and each of the learner's micro-batches is cut to its own widths; TRL pads prompts
  and completions to the generation batch's longest, in generation and in the learner.
- The token-mean's normaliser: ours is each mini-batch's token count; TRL's "dapo" divides by
  the generation batch's tokens over 6. Advantages: std + 1e-6 (ours), std + 1e-4 (TRL).
- Prompt order: ours length-bucketed and seeded, TRL's shuffled; the samples' draws differ, so
  response lengths (all at most 8) differ from step to step.
- torch and transformers: each venv's own.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEMO_CONFIG = ROOT / "configs" / "demo_cpu.yaml"
TRL_TIMES = "trl_times.json"
PROMPT_IDS = "prompt_ids.json"  # in the assets folder: our run's prompt tokens, for the TRL side to check
HOW_TO_GET_TRL = ("SKIP versus_trl: pass --trl-python, the python of a virtual environment with torch and trl "
                  "(python -m venv VENV && VENV/bin/pip install torch==2.13.0 trl==1.16.0 datasets)")


def demo_argv(assets: Path, out: Path, steps: int) -> list[str]:
    """The command line of our run; the TRL side reads its settings from the same one."""
    return ["--config", str(DEMO_CONFIG), "--model_path", str(assets / "model"),
            "--dataset", str(assets / "train.jsonl"), "--val_dataset", "null", "--output_dir", str(out),
            "--max_steps", str(steps), "--dynamic_sampling", "false", "--val_every", "0", "--save_every", "0",
            "--report_to", "csv", "--log_every", str(steps)]


@dataclass(frozen=True)
class Speed:
    """A run's samples/s and the median seconds of each part of its step (or generation batch)."""

    samples_per_s: float
    parts: dict[str, float]

    def text(self) -> str:
        return f"{self.samples_per_s:6.1f} samples/s (" + ", ".join(
            f"{name} {seconds:.3f} s" for name, seconds in self.parts.items()) + ")"


def failed(run: str, log: Path) -> SystemExit:
    """The end of a failed run's log, which goes with the temporary folder."""
    return SystemExit(f"{run} failed; the end of its log:\n" + "\n".join(log.read_text().splitlines()[-20:]))


# ----- our side --------------------------------------------------------------------------------

def write_prompt_ids(assets: Path) -> None:
    """Our run's prompt tokens (data_prep's rendering with our transformers) into assets/PROMPT_IDS."""
    from config import load_config
    from data_prep import load_run_inputs
    from metrics import warn

    _, train_set, _ = load_run_inputs(load_config(demo_argv(assets, assets, 1)), warn)
    (assets / PROMPT_IDS).write_text(json.dumps(train_set.prompt_ids))


def run_ours(assets: Path, out: Path, steps: int, warmup: int) -> Speed:
    import train_dapo
    from config import load_config
    from demo_runs import medians

    argv = demo_argv(assets, out, steps)
    cfg = load_config(argv)
    log_path = out.with_suffix(".log")
    with log_path.open("w") as log, contextlib.redirect_stdout(log):
        status = train_dapo.main(argv)
    if status != 0:
        raise failed("our run", log_path)
    step = medians(out / "metrics.csv", warmup, ("step_time_s", "gen_time_s", "train_time_s"))
    return Speed(cfg.rollout.prompts_per_step * cfg.rollout.sample_num / step["step_time_s"],
                 {"step": step["step_time_s"], "generation": step["gen_time_s"], "training": step["train_time_s"],
                  "rest": step["step_time_s"] - step["gen_time_s"] - step["train_time_s"]})


# ----- TRL's side (runs under --trl-python: imports only what that venv has) -------------------

def trl_reward(cfg: Any):
    """Our reward in TRL's reward-function form: the config's rule on the completion's text, plus
    the config's soft overlong punishment on its length in tokens (its EOS included, as ours)."""
    import torch

    from dapo_loss import overlong_penalty
    from rewards import resolve_rule, score_with_rule

    rule = resolve_rule(cfg.model.reward_fn)

    def demo_reward(completions: list[Any], completion_ids: list[list[int]], answer: list[str],
                    **kwargs: Any) -> list[float]:
        texts = [completion[-1]["content"] for completion in completions]  # conversational: one message
        scores = torch.tensor(score_with_rule(rule, texts, answer).scores)
        penalty = overlong_penalty(torch.tensor([len(ids) for ids in completion_ids]),
                                   max_response_length=cfg.rollout.max_response_length,
                                   buffer_len=cfg.algo.overlong_buffer_len,
                                   penalty_factor=cfg.algo.overlong_penalty_factor)
        return (scores + penalty).tolist()

    return demo_reward


def trl_config(cfg: Any, out: Path, generation_batches: int):
    """Our config's work in GRPOConfig's terms (module docstring)."""
    from trl import GRPOConfig

    rollout, algo, optim = cfg.rollout, cfg.algo, cfg.optim
    if algo.loss_agg_mode != "token-mean" or cfg.model.learner_dtype != "fp32":
        raise SystemExit("versus_trl maps a token-mean loss and an fp32 learner only (TRL's dapo, fp32)")
    sequences = rollout.prompts_per_step * rollout.sample_num
    optimizer_steps = sequences // (optim.per_device_batch_size * optim.gradient_accumulation_steps)
    return GRPOConfig(
        output_dir=str(out), max_steps=generation_batches * optimizer_steps * optim.ppo_epochs,
        per_device_train_batch_size=optim.per_device_batch_size,
        gradient_accumulation_steps=optim.gradient_accumulation_steps, generation_batch_size=sequences,
        num_generations=rollout.sample_num, num_iterations=optim.ppo_epochs,
        max_completion_length=rollout.max_response_length, temperature=rollout.temperature, top_p=rollout.top_p,
        loss_type="dapo", epsilon=algo.clip_ratio_low, epsilon_high=algo.clip_ratio_high, beta=algo.kl_coef,
        scale_rewards="group" if algo.norm_adv_by_std else "none", mask_truncated_completions=False,
        learning_rate=optim.learning_rate, lr_scheduler_type="constant", warmup_steps=optim.lr_warmup_steps,
        weight_decay=optim.weight_decay, max_grad_norm=optim.grad_clip, optim="adamw_torch_fused",
        bf16=False, model_init_kwargs={"dtype": "float32"},
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        router_aux_loss_coef=0.0, use_cpu=True, seed=cfg.run.seed, logging_steps=10**9, report_to="none",
        save_strategy="no", disable_tqdm=True)


def check_same_prompt_tokens(trainer: Any, rows: Any, ours: list[list[int]]) -> None:
    """Refuse to time TRL on other prompt tokens than ``ours`` (our run's, from our venv)."""
    theirs, _, _ = trainer._tokenize_prompts(rows.messages)
    if [list(ids) for ids in theirs] != ours:
        raise SystemExit("TRL tokenizes the demo prompts otherwise than this project: no comparison")


def trl_side(assets: Path, out: Path, steps: int) -> None:
    """Train TRL on the demo's work for ``steps`` generation batches; write out/TRL_TIMES."""
    import torch
    import trl
    from datasets import Dataset

    from config import load_config
    from data_prep import read_rows
    from device import select_platform
    from probe_trl import timed_trainer

    cfg = load_config(demo_argv(assets, out, steps))
    rows = read_rows(cfg.data.dataset, prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key,
                     system_prompt=cfg.data.system_prompt)
    dataset = Dataset.from_list([{"prompt": messages, "answer": answer}
                                 for messages, answer in zip(rows.messages, rows.answers)])
    args = trl_config(cfg, out / "trl", steps)
    trainer, step_ends = timed_trainer(select_platform("cpu"), Path(cfg.model.model_path), trl_reward(cfg), args,
                                       dataset)
    check_same_prompt_tokens(trainer, rows, json.loads((assets / PROMPT_IDS).read_text()))
    trainer.train()
    (out / TRL_TIMES).write_text(json.dumps({
        "trl": trl.__version__, "threads": torch.get_num_threads(), "sequences": args.generation_batch_size,
        "batch_s": batch_seconds(step_ends.times, args.max_steps // steps),
        "generation_s": trainer.generation_seconds, "prepared_s": trainer.batch_seconds}))


def batch_seconds(step_ends: list[float], steps_per_batch: int) -> list[float]:
    """Seconds of each generation batch from the training's start and every optimizer step's end."""
    batch_ends = step_ends[::steps_per_batch]
    return [end - start for start, end in zip(batch_ends, batch_ends[1:])]


def trl_speed(times: dict[str, Any], warmup: int) -> Speed:
    """Samples/s and the median parts of TRL's generation batches after the first ``warmup``."""
    batch, generation, prepared = (times[key][warmup:] for key in ("batch_s", "generation_s", "prepared_s"))
    return Speed(times["sequences"] / statistics.median(batch),
                 {"batch": statistics.median(batch), "generation": statistics.median(generation),
                  "rewards+old logp": statistics.median(p - g for p, g in zip(prepared, generation)),
                  "update": statistics.median(b - p for b, p in zip(batch, prepared))})


def run_trl(trl_python: str, assets: Path, out: Path, steps: int) -> dict[str, Any]:
    out.mkdir(parents=True)
    with (out / "trl.log").open("w") as log:
        status = subprocess.run([trl_python, __file__, "--trl-side", "--assets", str(assets), "--out", str(out),
                                 "--steps", str(steps)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if status != 0:
        raise failed("TRL's run", out / "trl.log")
    return json.loads((out / TRL_TIMES).read_text())


# ----- the comparison --------------------------------------------------------------------------

def has_trl(python: str | None) -> bool:
    if python is None:
        return False
    try:
        return subprocess.run([python, "-c", "import trl, datasets"], capture_output=True).returncode == 0
    except OSError:  # no such interpreter, or not one that runs
        return False


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-python", help="the python of a virtual environment with trl")
    parser.add_argument("--steps", type=int, default=30, help="steps (generation batches) of each run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    parser.add_argument("--trl-side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--assets", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_side:
        trl_side(args.assets, args.out, args.steps)
        return 0
    if not has_trl(args.trl_python):
        print(HOW_TO_GET_TRL)
        return 0
    import torch

    from data_prep import build_demo_assets

    ratios = []
    with tempfile.TemporaryDirectory(prefix="versus-trl-") as scratch:
        work = Path(scratch)
        build_demo_assets(work / "assets")
        write_prompt_ids(work / "assets")
        for round_index in range(1, args.rounds + 1):
            ours = run_ours(work / "assets", work / f"ours{round_index}", args.steps, args.warmup)
            times = run_trl(args.trl_python, work / "assets", work / f"trl{round_index}", args.steps)
            theirs = trl_speed(times, args.warmup)
            ratios.append(ours.samples_per_s / theirs.samples_per_s)
            print(f"round {round_index}: ours {ours.text()} ({torch.get_num_threads()} threads)")
            print(f"round {round_index}: TRL {times['trl']} {theirs.text()} ({times['threads']} threads)")
            print(f"round {round_index}: ours / TRL {ratios[-1]:.2f}x", flush=True)
    print(f"median ours / TRL over {args.rounds} rounds: {statistics.median(ratios):.2f}x samples/s (target >= 1.5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
