"""The roles of a run and each one's loop: who takes part in which exchange (exchange.py), in
which order, step by step (docs/design.md).

The loops, with s = max_staleness and v_k the weights after k updates: the lead learner collects
step j's samples, which rollout generated with v_max(0, j-1-s), sends v_(j-1) (after collecting
when s = 1, so rollout generates step j+1 while step j trains; before collecting when s = 0),
then the learners train step j. Checkpoint v is written right after v goes to the rollout side,
so every sample generated but not yet trained on is on the lead. One process is the lead with
exchange.Local: the same loop, its exchanges calls on its own rollout.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import ckpt
import resuming
from config import Config, Derived, Schedule, uses_fsdp
from data_prep import load_run_inputs
from device import Platform
from exchange import Collected, Local, Torchrun, one_process_groups, weight_format
from learner import Learner
from metrics import StepReporter, log, quiet, warn
from ranks import MORE, Groups, Layout, at_step, phase
from rollout import DynamicSampler, Rollout, build_engine, engine_device_copy, load_rollout_model
from samples import SampleBatch


def build_rollout(cfg: Config, plat: Platform, layout: Layout, groups: Optional[Groups], tokenizer: Any,
                  train_set: Any, val_set: Any, learner: Optional[Learner]) -> Rollout:
    """A rollout rank's side (or a one-process run's, whose engine copies ``learner``)."""
    rollout_copy = (lambda: learner.rollout_copy(cfg.model.rollout_dtype)) if learner is not None else \
        (lambda: load_rollout_model(Path(cfg.model.model_path), cfg.model.rollout_dtype, plat.device))
    engine_group = groups.engine if groups is not None else None
    engine = build_engine(cfg, plat, layout, tokenizer, rollout_copy,
                          learner_weights=learner.full_weights if learner is not None else None,
                          engine_group=engine_group) if layout.drives_engine else None
    device_copy = engine_device_copy(cfg, plat, layout, engine_group) \
        if engine_group is not None and not layout.drives_engine else None
    rollout = Rollout(cfg, plat, layout, engine, tokenizer, train_set, val_set, device_copy)
    held = ", ".join(f"{item} {size / 2**30:.2f} GiB" for item, size in engine.memory().items() if size) \
        if engine is not None else ""
    role = f"rollout engine {cfg.model.rollout_engine}" if engine is not None else layout.title
    if device_copy is not None:
        role += ", takes the weights its device's worker reads"
    log(f"rank {layout.rank}: {role}" + (f" ({held})" if held else ""))
    return rollout


class Roles:
    """What this process is (one rank's role, or both roles in one process) and its loop. The
    algorithm is the subclass's (train_dapo.Trainer): ``compute_advantages`` and ``update_policy``."""

    def __init__(self, cfg: Config, plat: Platform, derived: Derived, layout: Optional[Layout] = None,
                 groups: Optional[Groups] = None, resume: Optional[Path] = None) -> None:
        self.cfg, self.plat, self.derived, self.groups = cfg, plat, derived, groups
        self.layout = layout = layout or Layout(world_size=1, rank=0, num_learners=1)
        single, lead = layout.world_size == 1, layout.is_lead
        self.out_dir = Path(cfg.run.output_dir)
        self.tokenizer, self.train_set, self.val_set = load_run_inputs(cfg, warn if lead else quiet)
        self.fingerprint = resuming.run_fingerprint(cfg, self.tokenizer, self.train_set.prompt_ids,
                                                    layout.world_size, layout.num_learners)
        saved = resume and resuming.check_resumable(resume, self.fingerprint, cfg.flat(), warn if lead else quiet,
                                                    source_rows=self.train_set.source_rows)
        self.step, self.first_generation_step = 0, 1
        self.schedule = Schedule(cfg.run, has_val_set=self.val_set is not None)
        if single and groups is None and uses_fsdp(cfg, num_learners=1):
            self.groups = groups = one_process_groups(plat.backend)
        self.learner = Learner(cfg, plat, derived, layout, groups, resume) if layout.is_learner else None
        self.rollout = build_rollout(cfg, plat, layout, groups, self.tokenizer, self.train_set, self.val_set,
                                     self.learner) if single or not layout.is_learner else None
        self.exchange = Local(self.rollout) if single else \
            Torchrun(cfg, layout, groups, plat.device, weight_format(cfg, layout, self.learner, self.rollout))
        self.sampler, self.report = None, None  # the lead's
        if lead:
            self.sampler = DynamicSampler(cfg.rollout, derived.dynamic_sampling_metric,
                                          reports_acc=not cfg.model.reward_model)
            self.report = StepReporter(cfg.run, tokenizer=self.tokenizer, reference_answers=self.train_set.answers,
                                       advantages=self.compute_advantages, append=resume is not None)
        self.pending_rows: dict[int, dict[str, Any]] = {}  # the lead's rows, finished when their weights go out
        self.checkpoints = ckpt.Checkpointer(cfg, plat, layout, self.exchange, fingerprint=self.fingerprint,
                                             tokenizer=self.tokenizer, learner=self.learner, rollout=self.rollout,
                                             sampler=self.sampler, report=self.report)
        if saved is not None:
            self.checkpoints.restore(resume, saved)
            self.step, self.first_generation_step = saved["step"], saved["generated_through_step"] + 1
            self.schedule = replace(self.schedule, resumed_from=saved["step"])

    def train(self) -> None:
        if self.layout.is_lead:  # one process included
            self.run_lead()
        elif self.layout.is_learner:
            self.run_learner()
        else:
            self.run_rollout()

    # ----- rollout ranks (with an engine, or without one: nothing to generate or validate) ------

    def run_rollout(self) -> None:
        """A rollout rank's whole run: generate, send, obey "more"/"next", take new weights."""
        run = self.cfg.run
        if self.rollout.weight_version == 0 and self.schedule.validates(0):  # a resumed run validated v0 long ago
            self.exchange.send_validation(0, self.rollout.validation_sums())
        for step in range(self.first_generation_step, run.max_steps + 1 + self.schedule.collects_past_the_end()):
            at_step(step)
            while self.rollout.weight_version < max(0, step - 1 - run.max_staleness):
                self.receive_weights()
            gen_index, flag = 0, MORE
            while flag == MORE:
                gen_index += 1
                with phase("generation"):
                    batch, malformed, seconds = self.rollout.generate_shard(step, gen_index)
                flag = self.exchange.send_samples(step, gen_index, batch, malformed, seconds,
                                                  self.rollout.take_weight_sync())
        while self.rollout.weight_version < run.max_steps:
            self.receive_weights()

    def receive_weights(self) -> None:
        """Take the next weight version; validate it when due; hand the lead this rank's state
        when the version is checkpointed."""
        version = self.exchange.receive_weights(self.rollout)
        if self.schedule.validates(version):
            self.exchange.send_validation(version, self.rollout.validation_sums())
        if self.schedule.saves(version):
            self.exchange.send_rank_state(version, self.checkpoints.rank_state())

    # ----- learners other than the lead ---------------------------------------------------------

    def run_learner(self) -> None:
        """Take part in each hand-off the lead makes and train on the step's batch it shares."""
        for step in range(self.schedule.resumed_from + 1, self.cfg.run.max_steps + 1):
            at_step(step)
            self.follow_hand_off(step - 1)
            self.learn(step, None)
        self.follow_hand_off(self.cfg.run.max_steps)
        self.learner.writer.wait()  # the run ends with its last checkpoint complete on disk

    def follow_hand_off(self, version: int) -> None:
        """A learner other than the lead: its part in the lead's hand_off of ``version``."""
        if version > self.schedule.resumed_from:
            self.exchange.join_weights(version, self.learner.full_weights)
        if self.schedule.saves(version):
            self.checkpoints.save_learner_shard(version, export=self.schedule.exports(version))

    # ----- the lead learner ---------------------------------------------------------------------

    def run_lead(self) -> None:
        """The lead's whole run: collect samples, hand off weights, train, write metrics."""
        run, stale = self.cfg.run, self.cfg.run.max_staleness
        if self.schedule.resumed_from == 0 and self.schedule.validates(0):
            self.report.write(self.record_validation({"step": 0}))
        last_end = time.perf_counter()
        for step in range(self.schedule.resumed_from + 1, run.max_steps + 1):
            at_step(step)
            save_time = self.hand_off(step - 1, None) if stale == 0 else None
            batch, row = self.collect(step)
            if stale > 0:
                save_time = self.hand_off(step - 1, (batch, row))
            train_start = time.perf_counter()
            row = {**row, **self.learn(step, batch)}
            now, train_time = time.perf_counter(), time.perf_counter() - train_start
            self.report.observe_step(step, row, batch)
            row.update(step=step, weight_version=step, train_time_s=train_time, step_time_s=now - last_end,
                       save_time_s=save_time, overlap=(row["gen_time_s"] + train_time) / (now - last_end))
            last_end = now
            self.pending_rows[step] = row
        self.finish()

    def learn(self, step: int, batch: Optional[SampleBatch]) -> dict[str, Any]:
        """All learners: receive the step's batch and train on it."""
        batch = self.exchange.share_batch(step, batch)
        self.step = step
        with phase("update"):
            row = self.update_policy(batch, self.compute_advantages(batch))
        row.update(self.learner.counters(), staleness=int(step - 1 - batch.version.min()))
        return row

    def collect(self, step: int) -> Collected:
        """The step's batch, from the rollout ranks or this process's rollout."""
        return self.exchange.collect(self.sampler, step)

    def hand_off(self, version: int, collected: Optional[Collected]) -> Optional[float]:
        """Send weights ``version`` to the rollout side, finish that step's row, then checkpoint
        when due; returns the seconds spent saving (None when nothing was saved)."""
        if version <= self.schedule.resumed_from:  # v0: the base model; a resumed run's first: sent before its save
            return None
        start = time.perf_counter()
        with phase("weight sync"):
            self.exchange.send_weights(version, self.learner.full_weights())
        row = {**self.pending_rows.pop(version, {"step": version}), "sync_time_s": time.perf_counter() - start}
        if self.schedule.validates(version):
            self.record_validation(row)
        self.report.write(row)
        saves = self.schedule.saves(version)
        return self.checkpoints.save(version, collected, export=self.schedule.exports(version)) if saves else None

    def record_validation(self, row: dict[str, Any]) -> dict[str, Any]:
        reward_sum, correct, count = self.exchange.receive_validation(row["step"])
        return self.report.observe_validation(row, val_reward=reward_sum / count,
                                              val_acc=correct / count if not self.cfg.model.reward_model else None)

    def finish(self) -> None:
        """Hand off the last weights (and checkpoint them) and wait until every file is on disk."""
        final = self.cfg.run.max_steps
        ahead = self.collect(final + 1) if self.schedule.collects_past_the_end() else None
        waited = self.hand_off(final, ahead)
        start = time.perf_counter()
        self.learner.writer.wait()  # the run ends with its last checkpoint complete on disk
        if waited is not None:
            log(f"checkpoint {ckpt.step_dir_name(final)} saved in {waited + time.perf_counter() - start:.2f}s")
