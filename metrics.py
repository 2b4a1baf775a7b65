"""Per-step metrics: metrics.csv, the console line, and the article's training alarms.

The alarms are the article's rules of thumb (sections 4.2 and 5.4) turned into checks that
print when they fire and are counted in metrics.csv, so a user does not have to stare at
curves to notice a run going wrong.
"""
from __future__ import annotations

import csv
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

COLUMNS = [
    "step", "reward_mean", "reward_std", "acc_mean", "score_mean", "reward_malformed",
    "response_length_mean", "response_length_max", "truncated_frac",
    "policy_loss", "kl", "kl_coef", "entropy", "length_penalty", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl",
    "grad_norm", "lr", "optimizer_steps", "skipped_steps",
    "num_gen_batches", "informative_frac", "carried_groups", "staleness", "weight_version",
    "mismatch_mean", "mismatch_max",
    "val_reward_mean", "val_acc",
    "alarm_kl_jump", "alarm_length_rising", "alarm_no_signal", "alarm_overfit",
    "step_time_s", "gen_time_s", "train_time_s", "sync_time_s", "save_time_s", "overlap", "gen_tokens_per_s",
]
# Columns that measure wall time and so differ between otherwise identical runs.
TIMING_COLUMNS = frozenset(c for c in COLUMNS if c.endswith("_s") or c in ("overlap", "gen_tokens_per_s"))


def log(message: str) -> None:
    # One write per line: print() writes the text and the newline separately, and the lines of
    # eight ranks sharing one pipe would interleave.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def warn(message: str) -> None:
    sys.stderr.write(f"warning: {message}\n")
    sys.stderr.flush()


def _format(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    return str(value)


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


def console_line(row: dict[str, Any]) -> str:
    def num(key: str, fmt: str) -> str:
        value = row.get(key)
        return "-" if value is None else format(value, fmt)

    val = f" val_acc {num('val_acc', '.3f')}" if row.get("val_acc") is not None else ""
    if row.get("policy_loss") is None:  # the validation-only row before training
        return f"step {row['step']:>5} | val_reward {num('val_reward_mean', '+.3f')}{val}"
    return (
        f"step {row['step']:>5} | reward {num('reward_mean', '+.3f')} acc {num('acc_mean', '.3f')} "
        f"| kl {num('kl', '.4f')} ent {num('entropy', '.3f')} len {num('response_length_mean', '.1f')} "
        f"| loss {num('policy_loss', '+.4f')} | {num('step_time_s', '.2f')}s{val}"
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


class StepReporter:
    """What the lead learner shows the user each step: the metrics.csv row, the console line,
    and the alarms (printed when they fire, counted in the row)."""

    def __init__(self, path: Path, *, log_every: int, max_steps: int, length_alarm_steps: int,
                 overfit_alarm_checks: int, append: bool) -> None:
        self.log_every, self.max_steps = log_every, max_steps
        self.alarms = AlarmMonitor(length_rising_steps=length_alarm_steps, overfit_checks=overfit_alarm_checks)
        # A fresh start begins a new metrics.csv; a resumed one continues the checkpoint's copy.
        self.metrics = MetricsWriter(path, append=append)
        self.train_rewards_since_val: list[float] = []

    def observe_step(self, step: int, row: dict[str, Any]) -> None:
        for message in self.alarms.observe_step(kl=row.get("kl"), length=row["response_length_mean"],
                                                reward_std=row["reward_std"]):
            warn(f"ALARM step {step}: {message}")
        self.train_rewards_since_val.append(row["reward_mean"])

    def observe_validation(self, row: dict[str, Any], *, val_reward: float, val_acc: Optional[float]) -> None:
        row.update(val_reward_mean=val_reward, val_acc=val_acc)
        if self.train_rewards_since_val:
            train_reward = sum(self.train_rewards_since_val) / len(self.train_rewards_since_val)
            for message in self.alarms.observe_validation(val_reward=val_reward, train_reward=train_reward):
                warn(f"ALARM step {row['step']}: {message}")
        self.train_rewards_since_val = []

    def write(self, row: dict[str, Any]) -> None:
        if row["step"] > 0:
            row.update(self.alarms.counts)
        self.metrics.write(row)
        step = row["step"]
        if step == 0 or step % self.log_every == 0 or step == self.max_steps:
            log(console_line(row))

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of this (metrics.csv itself is copied whole)."""
        return {"alarms": self.alarms.history(), "train_rewards_since_val": list(self.train_rewards_since_val)}

    def restore(self, state: dict[str, Any]) -> None:
        self.alarms.restore(state["alarms"])
        self.train_rewards_since_val = state["train_rewards_since_val"]

