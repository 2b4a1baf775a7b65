"""What a run shows its user: metrics.csv (and the same scalars as TensorBoard curves, or in a
Weights & Biases run), the console line, the article's training alarms, sample completions, and
curves.png.

    python metrics.py plot OUTPUT_DIR      # OUTPUT_DIR/curves.png from OUTPUT_DIR/metrics.csv

The alarms are the article's rules of thumb (sections 4.2 and 5.4) turned into checks that
print when they fire and are counted in metrics.csv, so a user does not have to stare at
curves to notice a run going wrong.
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from config import RunConfig, UserError
from curves import plot_curves

if TYPE_CHECKING:  # for annotations only: `python metrics.py plot` need not import torch
    from samples import SampleBatch

# The names of rollout_correction.METRICS (a module that imports torch, which this one does not).
ROLLOUT_CORRECTION = ("rollout_is_mean", "rollout_is_max", "rollout_is_eff_sample_size",
                      "rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction")
# throughput.phase_metrics's columns (a module that imports torch): per phase of the learner's step,
# real tokens a second over the learners, the share of computed tokens that were padding, MFU.
LEARNER_THROUGHPUT = tuple(f"{phase}_{what}" for phase in ("old_logp", "ref", "update")
                           for what in ("tokens_per_s", "padding_frac", "mfu"))
COLUMNS = [
    "step", "reward_mean", "reward_std", "acc_mean", "score_mean", "reward_malformed",
    "response_length_mean", "response_length_max", "truncated_frac",
    "policy_loss", "kl", "kl_coef", "entropy", "length_penalty", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl",
    "grad_norm", "lr", "optimizer_steps", "skipped_steps",
    "num_gen_batches", "informative_frac", "carried_groups", "staleness", "weight_version",
    "mismatch_mean", "mismatch_max", "engine_mismatch_mean",
    "routing_mismatch",  # empty where routing_replay is off
    *ROLLOUT_CORRECTION,  # empty where rollout_is / rollout_rs is off
    "val_reward_mean", "val_acc",
    "alarm_kl_jump", "alarm_length_rising", "alarm_no_signal", "alarm_overfit",
    "step_time_s", "gen_time_s", "train_time_s", "sync_time_s", "weight_transfer_s", "weight_load_s", "save_time_s",
    "overlap", "gen_tokens_per_s",
    *LEARNER_THROUGHPUT,
]
# Columns that measure wall time and so differ between otherwise identical runs.
TIMING_COLUMNS = frozenset(c for c in COLUMNS if c.endswith(("_s", "_mfu")) or c in ("overlap", "gen_tokens_per_s"))
# Every column but step (the x axis) as a TensorBoard tag GROUP/column, so related curves share a
# section in TensorBoard.
TENSORBOARD_GROUPS = {
    "reward": ("reward_mean", "reward_std", "acc_mean", "score_mean", "reward_malformed"),
    "length": ("response_length_mean", "response_length_max", "truncated_frac"),
    "loss": ("policy_loss", "kl", "kl_coef", "entropy", "length_penalty"),
    "policy": ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "mismatch_mean", "mismatch_max", "engine_mismatch_mean",
               "routing_mismatch"),
    "rollout_corr": ROLLOUT_CORRECTION,  # verl's tags for these: rollout_corr/rollout_is_mean, ...
    "optim": ("grad_norm", "lr", "optimizer_steps", "skipped_steps"),
    "sampling": ("num_gen_batches", "informative_frac", "carried_groups", "staleness", "weight_version"),
    "val": ("val_reward_mean", "val_acc"),
    "alarm": ("alarm_kl_jump", "alarm_length_rising", "alarm_no_signal", "alarm_overfit"),
    "timing": tuple(c for c in COLUMNS if c in TIMING_COLUMNS and c not in LEARNER_THROUGHPUT),
    "learner": LEARNER_THROUGHPUT,
}
TENSORBOARD_TAGS = {column: f"{group}/{column}" for group, columns in TENSORBOARD_GROUPS.items() for column in columns}


def log(message: str) -> None:
    # One write per line: print() writes the text and the newline separately, and the lines of
    # eight ranks sharing one pipe would interleave.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def quiet(message: str) -> None:
    """For ranks other than the lead, which leave the talking to it."""


def warn(message: str) -> None:
    sys.stderr.write(f"warning: {message}\n")
    sys.stderr.flush()


def _format(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    return str(value)


def read_metrics(path: Path) -> list[dict[str, str]]:
    """metrics.csv's rows as text, "" where a value is absent."""
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def check_report_to(report_to: Sequence[str]) -> None:
    """Refuse at start-up, not at the first step, a reporter whose package is not installed (looked
    up, not imported: every rank checks, only the lead writes)."""
    for reporter in ("tensorboard", "wandb"):
        if reporter in report_to and importlib.util.find_spec(reporter) is None:
            raise UserError(f"report_to {reporter} needs the {reporter} package, which is not installed: "
                            f"pip install -e '.[{reporter}]'")


class MetricsWriter:
    """Appends one row per training step to OUTPUT_DIR/metrics.csv (header written once)."""

    def __init__(self, path: Path, *, append: bool = False) -> None:
        self.path = path
        if not append or not path.exists() or path.stat().st_size == 0:
            with path.open("w", newline="") as f:
                csv.writer(f).writerow(COLUMNS)

    def write(self, row: dict[str, Any]) -> None:
        unknown = set(row) - set(COLUMNS)
        assert not unknown, f"metrics row has columns metrics.COLUMNS does not list: {sorted(unknown)}"
        with self.path.open("a", newline="") as f:
            csv.writer(f).writerow([_format(row.get(c)) for c in COLUMNS])
            f.flush()


class TensorBoardWriter:
    """OUTPUT_DIR/tensorboard/: the metrics.csv rows as TensorBoard scalars, one tag per column."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir, self.writer = log_dir, None
        self.rewrite([])

    def rewrite(self, rows: Sequence[dict[str, Any]]) -> None:
        """Start the event files over with ``rows``. A resumed run redraws its curves from the
        checkpoint's metrics.csv, so no step shows two values (TensorBoard keeps every event it
        reads, and not every reader honours the purge markers a restarted writer leaves)."""
        from torch.utils.tensorboard import SummaryWriter  # the optional extra, checked at start-up

        self.close()
        shutil.rmtree(self.log_dir, ignore_errors=True)
        self.writer = SummaryWriter(str(self.log_dir))
        for row in rows:
            self.write(row)

    def write(self, row: dict[str, Any]) -> None:
        """One row: its values as metrics.csv gets them, or as text read back from it."""
        step = int(row["step"])
        for column, value in row.items():
            if column != "step" and value is not None and value != "":
                self.writer.add_scalar(TENSORBOARD_TAGS[column], float(value), step)
        self.writer.flush()  # TensorBoard shows a step as soon as metrics.csv has it

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandbWriter:
    """The TensorBoard scalars, under the same tags and steps, in a Weights & Biases run: project
    WANDB_PROJECT (default dapo-npu), name WANDB_NAME (default output_dir's name), files under
    WANDB_DIR (default output_dir); WANDB_MODE=offline and wandb's other settings apply as usual.

    The run starts here, so that a wandb that cannot start (not logged in) stops the run before
    it trains; the first row brings the run's config (output_dir/config.yaml, written by then).
    W&B keeps every value it is sent and takes no step twice, so a resumed run is a new W&B run
    of the same name that first redraws the checkpoint's metrics.csv, as TensorBoard's curves
    are redrawn: one value per step in it."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.run, self.sent = out_dir, None, False
        self.pending: list[dict[str, Any]] = []  # rows to send before the next one
        self._start()

    def _start(self) -> None:
        import wandb  # the optional extra, checked at start-up

        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "dapo-npu",
                                  name=os.environ.get("WANDB_NAME") or self.out_dir.resolve().name,
                                  dir=os.environ.get("WANDB_DIR") or str(self.out_dir))
        except wandb.errors.Error as error:
            message = " ".join(str(error).split())
            raise UserError(f"report_to wandb: wandb could not start a run: {message} "
                            f"(WANDB_MODE=offline logs without an account)") from None
        self.sent = False

    def rewrite(self, rows: Sequence[dict[str, Any]]) -> None:
        """Send ``rows`` first, to a fresh W&B run if this one has rows already."""
        if self.sent:
            self.close()
        self.pending = list(rows)

    def write(self, row: dict[str, Any]) -> None:
        if self.run is None:
            self._start()
        if not self.sent:
            config_file = self.out_dir / "config.yaml"
            if config_file.is_file():
                import yaml

                self.run.config.update(yaml.safe_load(config_file.read_text()))
        for earlier in [*self.pending, row]:
            scalars = {TENSORBOARD_TAGS[column]: float(value) for column, value in earlier.items()
                       if column != "step" and value is not None and value != ""}
            self.run.log(scalars, step=int(earlier["step"]))
        self.pending, self.sent = [], True

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def console_line(row: dict[str, Any]) -> str:
    def num(key: str, fmt: str) -> str:
        value = row.get(key)
        return "-" if value is None else format(value, fmt)

    val = f" val_acc {num('val_acc', '.3f')}" if row.get("val_acc") is not None else ""
    correction = ""
    if row.get("rollout_is_mean") is not None:
        correction += f" is {num('rollout_is_mean', '.3f')} ess {num('rollout_is_eff_sample_size', '.3f')}"
    if row.get("rollout_rs_masked_fraction") is not None:
        correction += f" rejected {num('rollout_rs_masked_fraction', '.3f')}"
    if row.get("routing_mismatch") is not None:
        correction += f" routing {num('routing_mismatch', '.3f')} engine {num('engine_mismatch_mean', '.4f')}"
    learner = ""
    if row.get("update_tokens_per_s") is not None:  # per phase: old log-probs / reference / update
        phases = lambda what, fmt: "/".join(num(f"{phase}_{what}", fmt) for phase in ("old_logp", "ref", "update"))  # noqa: E731
        learner = f" | old/ref/upd tok/s {phases('tokens_per_s', '.0f')} pad {phases('padding_frac', '.2f')}"
        if row.get("update_mfu") is not None:
            learner += f" mfu {phases('mfu', '.1%')}"
    if row.get("policy_loss") is None:  # the validation-only row before training
        return f"step {row['step']:>5} | val_reward {num('val_reward_mean', '+.3f')}{val}"
    return (
        f"step {row['step']:>5} | reward {num('reward_mean', '+.3f')} acc {num('acc_mean', '.3f')} "
        f"| kl {num('kl', '.4f')} ent {num('entropy', '.3f')} len {num('response_length_mean', '.1f')} "
        f"| loss {num('policy_loss', '+.4f')}{correction} | {num('step_time_s', '.2f')}s{learner}{val}"
    )


@dataclass
class AlarmMonitor:
    """The article's warning signs, evaluated once per step; history is checkpointed."""

    kl_jump: float = 0.02
    length_rising_steps: int = 20
    overfit_checks: int = 3
    reward_std_floor: float = 1e-6
    last_kl: Optional[float] = None
    rising_streak: int = 0
    last_length: Optional[float] = None
    val_history: list[tuple[float, float]] = field(default_factory=list)  # (val reward, train reward)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("alarm_kl_jump", "alarm_length_rising", "alarm_no_signal", "alarm_overfit"), 0))

    def observe_step(self, *, kl: Optional[float], length: float, reward_std: float) -> list[str]:
        """Check the per-step rules; return the messages of the alarms that fired."""
        fired = []
        if kl is not None and self.last_kl is not None and abs(kl - self.last_kl) > self.kl_jump:
            fired.append(("alarm_kl_jump", f"KL changed by {kl - self.last_kl:+.4f} in one step "
                                           f"(> {self.kl_jump}): the learning rate may be too high"))
        if kl is not None:
            self.last_kl = kl
        self.rising_streak = self.rising_streak + 1 if self.last_length is not None and length > self.last_length else 0
        self.last_length = length
        if self.rising_streak >= self.length_rising_steps:
            fired.append(("alarm_length_rising", f"mean response length rose for {self.rising_streak} steps in a "
                                                 f"row: the length penalty may be too low"))
        if reward_std <= self.reward_std_floor:
            fired.append(("alarm_no_signal", "every response in the batch got the same reward: the reward gives "
                                             "no signal (check it with data_prep.py reward-check)"))
        return self._count(fired)

    def observe_validation(self, *, val_reward: float, train_reward: float) -> list[str]:
        """Validation reward falling while training reward rises, over ``overfit_checks`` checks."""
        self.val_history.append((val_reward, train_reward))
        recent = self.val_history[-(self.overfit_checks + 1):]
        if len(recent) <= self.overfit_checks:
            return []
        val_falling = all(b[0] < a[0] for a, b in zip(recent, recent[1:]))
        train_rising = all(b[1] > a[1] for a, b in zip(recent, recent[1:]))
        if val_falling and train_rising:
            return self._count([("alarm_overfit", f"validation reward fell while training reward rose over "
                                                  f"{self.overfit_checks} checks: the policy may be memorising; "
                                                  f"raise sample_num or kl_coef")])
        return []

    def history(self) -> dict[str, Any]:
        """What a checkpoint keeps (the thresholds come from the config of the run that resumes)."""
        return {"counts": dict(self.counts), "val_history": [list(pair) for pair in self.val_history],
                "last_kl": self.last_kl, "rising_streak": self.rising_streak, "last_length": self.last_length}

    def restore(self, history: dict[str, Any]) -> None:
        self.counts = dict(history["counts"])
        self.val_history = [tuple(pair) for pair in history["val_history"]]
        self.last_kl, self.rising_streak, self.last_length = (history["last_kl"], history["rising_streak"],
                                                              history["last_length"])

    def _count(self, fired: list[tuple[str, str]]) -> list[str]:
        for key, _ in fired:
            self.counts[key] += 1
        return [message for _, message in fired]


class CompletionLog:
    """OUTPUT_DIR/completions.jsonl: the first ``prompts`` prompts of a step, one line each, with the
    reference answer and every response, decoded, with its reward, raw score and advantage, so a
    user can read what the model writes."""

    def __init__(self, path: Path, *, prompts: int, tokenizer: Any, reference_answers: Sequence[Optional[str]],
                 advantages: Callable[["SampleBatch"], Any], append: bool) -> None:
        self.path, self.prompts, self.tokenizer = path, prompts, tokenizer
        self.reference_answers, self.advantages = reference_answers, advantages
        self.latest: Optional[dict[str, Any]] = None  # the newest entry, for the console
        if not append:
            path.unlink(missing_ok=True)  # a fresh start, like metrics.csv's

    def record(self, step: int, batch: "SampleBatch") -> None:
        groups = min(self.prompts, batch.num_groups)
        if not groups:
            return
        advantages = self.advantages(batch).tolist()  # over the whole batch, as training saw them
        entries = [self._entry(step, batch, group, advantages) for group in range(groups)]
        with self.path.open("a") as f:
            f.writelines(json.dumps(entry) + "\n" for entry in entries)
        self.latest = entries[0]

    def _entry(self, step: int, batch: "SampleBatch", group: int, advantages: list[float]) -> dict[str, Any]:
        rows = range(group * batch.group_size, (group + 1) * batch.group_size)
        responses = [{"text": self._decode(batch.response_ids[r], batch.response_mask[r]),
                      "reward": round(float(batch.reward[r]), 4), "score": round(float(batch.score[r]), 4),
                      "advantage": round(advantages[r], 4), "length": int(batch.response_mask[r].sum()),
                      "truncated": bool(batch.truncated[r]), "weight_version": int(batch.version[r])} for r in rows]
        return {"step": step, "prompt": self._decode(batch.prompt_ids[rows[0]], batch.prompt_mask[rows[0]]),
                "answer": self.reference_answers[int(batch.prompt_index[rows[0]])], "responses": responses}

    def _decode(self, ids: Any, mask: Any) -> str:
        # Special tokens stay: the chat template and the stop token are part of what the model read and wrote.
        return self.tokenizer.decode(ids[mask].tolist(), skip_special_tokens=False)

    def drop_after(self, step: int) -> None:
        """A resumed run: forget the entries of the steps after its checkpoint, which it trains again."""
        if self.path.exists():
            lines = self.path.read_text().splitlines(keepends=True)
            self.path.write_text("".join(line for line in lines if json.loads(line)["step"] <= step))

    def console_sample(self) -> Optional[str]:
        """The newest entry's first response on one line (newlines escaped), prompt cut to its end."""
        if self.latest is None:
            return None
        prompt, response = self.latest["prompt"], self.latest["responses"][0]
        prompt = prompt if len(prompt) <= 120 else "..." + prompt[-117:]
        text = response["text"] if len(response["text"]) <= 200 else response["text"][:197] + "..."
        return (f"sample from step {self.latest['step']}: {prompt!r} -> {text!r} "
                f"(reward {response['reward']:+.3f}, advantage {response['advantage']:+.3f})")


class StepReporter:
    """What the lead learner shows the user: each step's metrics.csv row (and TensorBoard scalars),
    the console line, the alarms (printed when they fire, counted in the row), sample completions
    at every logged step, and curves.png at a validation (at most every CURVES_REDRAW_S) and at the end."""

    # Drawing curves.png takes the lead about a second, which every rank waits for: a run that
    # validates often (a short one, a test) redraws at most this often; TensorBoard's curves are live.
    CURVES_REDRAW_S = 60.0

    def __init__(self, run: RunConfig, *, tokenizer: Any, reference_answers: Sequence[Optional[str]],
                 advantages: Callable[["SampleBatch"], Any], append: bool) -> None:
        self.out_dir = Path(run.output_dir)
        self.log_every, self.max_steps = run.log_every, run.max_steps
        self.alarms = AlarmMonitor(length_rising_steps=run.length_alarm_steps, overfit_checks=run.overfit_alarm_checks)
        # A fresh start begins a new metrics.csv; a resumed one continues the checkpoint's copy,
        # and redraws its TensorBoard curves from it in restore().
        self.metrics = MetricsWriter(self.out_dir / "metrics.csv", append=append)
        self.curves = TensorBoardWriter(self.out_dir / "tensorboard") if "tensorboard" in run.report_to else None
        self.wandb = WandbWriter(self.out_dir) if "wandb" in run.report_to else None
        self.completions = CompletionLog(self.out_dir / "completions.jsonl", prompts=run.log_completions,
                                         tokenizer=tokenizer, reference_answers=reference_answers,
                                         advantages=advantages, append=append)
        self.train_rewards_since_val: list[float] = []
        self.curves_drawn_at = time.monotonic()

    def logs(self, step: int) -> bool:
        """Whether ``step`` is shown on the console and in completions.jsonl."""
        return step == 0 or step % self.log_every == 0 or step == self.max_steps

    def observe_step(self, step: int, row: dict[str, Any], batch: "SampleBatch") -> None:
        """The step's alarms, from its row so far, and its sample completions when it is logged."""
        for message in self.alarms.observe_step(kl=row.get("kl"), length=row["response_length_mean"],
                                                reward_std=row["reward_std"]):
            warn(f"ALARM step {step}: {message}")
        self.train_rewards_since_val.append(row["reward_mean"])
        if self.logs(step):
            self.completions.record(step, batch)

    def observe_validation(self, row: dict[str, Any], *, val_reward: float, val_acc: Optional[float]) -> dict[str, Any]:
        """``row`` with the validation's values; the overfit alarm hears of them."""
        row.update(val_reward_mean=val_reward, val_acc=val_acc)
        if self.train_rewards_since_val:
            train_reward = sum(self.train_rewards_since_val) / len(self.train_rewards_since_val)
            for message in self.alarms.observe_validation(val_reward=val_reward, train_reward=train_reward):
                warn(f"ALARM step {row['step']}: {message}")
        self.train_rewards_since_val = []
        return row

    def write(self, row: dict[str, Any]) -> None:
        """The finished row everywhere it goes; at validation a sample completion and the pictures."""
        step, validated = row["step"], row.get("val_reward_mean") is not None
        if step > 0:
            row.update(self.alarms.counts)
        self.metrics.write(row)
        if self.curves is not None:
            self.curves.write(row)
        if self.wandb is not None:
            self.wandb.write(row)
        if self.logs(step):
            log(console_line(row))
        if validated and (sample := self.completions.console_sample()):
            log(sample)
        redraw = validated and time.monotonic() - self.curves_drawn_at >= self.CURVES_REDRAW_S
        if step > 0 and (redraw or step == self.max_steps):  # step 0 alone would be an empty picture
            plot_curves(self.out_dir)
            self.curves_drawn_at = time.monotonic()
        if step == self.max_steps:  # the run's last row
            for writer in (self.curves, self.wandb):
                if writer is not None:
                    writer.close()

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of this (metrics.csv itself is copied whole)."""
        return {"alarms": self.alarms.history(), "train_rewards_since_val": list(self.train_rewards_since_val)}

    def restore(self, state: dict[str, Any], metrics_csv: Path) -> None:
        """Continue from a checkpoint: its trainer ``state`` and its copy of metrics.csv, which
        replaces the run's (dropping rows of steps after the checkpoint, as the curves and
        completions.jsonl drop them)."""
        self.alarms.restore(state["alarms"])
        self.train_rewards_since_val = state["train_rewards_since_val"]
        shutil.copyfile(metrics_csv, self.metrics.path)
        for writer in (self.curves, self.wandb):
            if writer is not None:
                writer.rewrite(read_metrics(self.metrics.path))
        self.completions.drop_after(state["step"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="metrics.py", description="Pictures of a run's metrics.")
    commands = parser.add_subparsers(dest="command", required=True)
    plot = commands.add_parser("plot", help="write OUTPUT_DIR/curves.png from OUTPUT_DIR/metrics.csv")
    plot.add_argument("output_dir", type=Path)
    args = parser.parse_args(argv)
    if not (args.output_dir / "metrics.csv").is_file():
        sys.stderr.write(f"error: {args.output_dir / 'metrics.csv'}: no such file (not a run's output_dir?)\n")
        return 2
    log(f"wrote {plot_curves(args.output_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

