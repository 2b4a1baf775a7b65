"""DAPO training: the entry point, the only file with side effects at start-up, and the step's
choreography: who sends what to whom, in which order (docs/design.md).

    python train_dapo.py --config configs/demo_cpu.yaml [--KEY VALUE ...]      # one process, both roles
    torchrun --nproc_per_node=8 train_dapo.py --config ... [--KEY VALUE ...]  # 6 rollout + 2 learner ranks

The work lives with its role: rollout.py (generation, rewards, dynamic sampling, validation),
learner.py (FSDP2 learners, the DAPO update), ckpt.py (what a checkpoint holds, what a resume
checks), ranks.py (what crosses between ranks). To change the algorithm, subclass
:class:`Trainer` and override :meth:`Trainer.compute_advantages`, :meth:`Trainer.policy_loss` or
:meth:`Trainer.update_policy`.
"""
from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

import ckpt
import config
import dapo_loss
import dry_run
import memory_plan
import plan_advice
import resuming
import stopping
import versions
from config import Config, Derived, Schedule, UserError, load_config, split_inspection, uses_fsdp, warnings_for
from data_prep import check_reward_on_data, load_run_inputs
from device import (Platform, bind_host_cores, seed_everything, select_platform, use_deterministic_algorithms,
                    write_env_report)
from learner import Learner, check_model_type, dapo_policy_loss, uses_reference_model
from metrics import StepReporter, check_report_to, log, quiet, warn
from moe_kernels import experts_implementation
from ranks import (MORE, Groups, Layout, PhaseError, SampleChannel, all_reduce_sum, at_step,
                   broadcast_samples, finish_together, init_world, leave_world, phase)
from rollout import (DynamicSampler, Generated, Rollout, build_engine, check_engine, check_rollout_inputs,
                     engine_device_copy, load_rollout_model, wire_dtype)
from samples import SampleBatch
from weight_sync import RolloutWeights, WeightBroadcast, every_engine_rank_takes_weights, host_bounce_reason

Collected = tuple[SampleBatch, dict[str, Any]]  # a step's batch and its metrics row so far


def one_process_groups(backend: str) -> Groups:
    """The groups of a one-process run whose learner runs under FSDP2 (config.uses_fsdp): this
    process alone, over an in-process store, so nothing listens on a port. The world lasts until
    leave_world; another Trainer in this process (the tests make many) shares it."""
    if not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    # Checkpoint writer threads get a gloo group of their own, as in a torchrun job (init_groups).
    return Groups(learners=dist.group.WORLD, sync=None, checkpoint=dist.new_group([0], backend="gloo"))


class Trainer:
    """DAPO on one process (both roles) or on a rank of a torchrun job (one role).

    Override points (article 4.1): ``compute_advantages(batch) -> Tensor[N]``, one advantage per
    response (default: DAPO's, group-relative); ``policy_loss(log_prob, old_log_prob, advantages,
    response_mask, *, loss_agg_mode, normalizer, is_weights) -> (loss, metrics)``, the
    policy-gradient term of each micro-batch (default: DAPO's clipped loss);
    ``update_policy(batch, advantages) -> dict``, the whole training step on the step's samples,
    returning metrics.csv values (keys of metrics.COLUMNS).

    The choreography, with s = max_staleness and v_k the weights after k updates: the lead
    learner collects step j's samples, which rollout generated with v_max(0, j-1-s), sends v_(j-1)
    (after collecting when s = 1, so rollout generates step j+1 while step j trains; before
    collecting when s = 0), then the learners train step j; one process runs the same order with
    local hand-offs. Checkpoint v is written right after v goes to the rollout side, so every
    sample generated but not yet trained on is on the lead.
    """

    def __init__(self, cfg: Config, plat: Platform, derived: Derived, layout: Optional[Layout] = None,
                 groups: Optional[Groups] = None, resume: Optional[Path] = None) -> None:
        self.cfg, self.plat, self.derived, self.groups = cfg, plat, derived, groups
        self.layout = layout = layout or Layout(world_size=1, rank=0, num_learners=1)
        self.single, lead = layout.world_size == 1, layout.is_lead
        self.out_dir = Path(cfg.run.output_dir)
        self.tokenizer, self.train_set, self.val_set = load_run_inputs(cfg, warn if lead else quiet)
        self.fingerprint = resuming.run_fingerprint(cfg, self.tokenizer, self.train_set.prompt_ids,
                                                    layout.world_size, layout.num_learners)
        saved = resume and resuming.check_resumable(resume, self.fingerprint, cfg.flat(), warn if lead else quiet,
                                                    source_rows=self.train_set.source_rows)
        self.step, self.first_generation_step = 0, 1
        self.schedule = Schedule(cfg.run, has_val_set=self.val_set is not None)
        if self.single and groups is None and uses_fsdp(cfg, num_learners=1):
            self.groups = groups = one_process_groups(plat.backend)
        self.learner = Learner(cfg, plat, derived, layout, groups, resume) if layout.is_learner else None
        self.rollout = None
        if self.single or not layout.is_learner:
            rollout_copy = (lambda: self.learner.rollout_copy(cfg.model.rollout_dtype)) if self.single else \
                (lambda: load_rollout_model(Path(cfg.model.model_path), cfg.model.rollout_dtype, plat.device))
            engine_group = groups.engine if groups is not None else None
            engine = build_engine(cfg, plat, layout, self.tokenizer, rollout_copy,
                                  learner_weights=self.learner.full_weights if self.single else None,
                                  engine_group=engine_group) if layout.drives_engine else None
            device_copy = engine_device_copy(cfg, plat, layout, engine_group) \
                if engine_group is not None and not layout.drives_engine else None
            self.rollout = Rollout(cfg, plat, layout, engine, self.tokenizer, self.train_set, self.val_set, device_copy)
            held = ", ".join(f"{item} {size / 2**30:.2f} GiB" for item, size in engine.memory().items() if size) \
                if engine is not None else ""
            role = f"rollout engine {cfg.model.rollout_engine}" if engine is not None else layout.title
            if device_copy is not None:
                role += ", takes the weights its device's worker reads"
            log(f"rank {layout.rank}: {role}" + (f" ({held})" if held else ""))
        if not self.single and (lead or not layout.is_learner):
            # A rank of a tensor-parallel engine without the engine takes weights only for its device's worker.
            self.weights = None
            if lead or layout.drives_engine or self.rollout.device_copy is not None:
                form = RolloutWeights(self.learner.policy.config, wire_dtype(cfg)) if lead else \
                    self.rollout.engine.weights if layout.drives_engine else self.rollout.device_copy
                self.weights = WeightBroadcast(form, cfg.run.weight_sync_bucket_mb, src=layout.lead_learner,
                                               group=groups.weights, device=plat.device)
            self.samples = SampleChannel(layout, groups, plat.device, cfg.rollout.sample_num)
        self.sampler, self.report = None, None  # the lead's
        if lead:
            self.sampler = DynamicSampler(cfg.rollout, derived.dynamic_sampling_metric,
                                          reports_acc=not cfg.model.reward_model)
            self.report = StepReporter(cfg.run, tokenizer=self.tokenizer, reference_answers=self.train_set.answers,
                                       advantages=self.compute_advantages, append=resume is not None)
        self.pending_rows: dict[int, dict[str, Any]] = {}  # the lead's rows, finished when their weights go out
        self.checkpoints = ckpt.Checkpointer(cfg, plat, layout, groups, fingerprint=self.fingerprint,
                                             tokenizer=self.tokenizer, learner=self.learner, rollout=self.rollout,
                                             sampler=self.sampler, report=self.report)
        if saved is not None:
            self.checkpoints.restore(resume, saved)
            self.step, self.first_generation_step = saved["step"], saved["generated_through_step"] + 1
            self.schedule = replace(self.schedule, resumed_from=saved["step"])

    # ----- the algorithm (override these) -------------------------------------------------------

    def compute_advantages(self, batch: SampleBatch) -> torch.Tensor:
        """Group-relative advantages, one per response (docs/algorithm.md §2)."""
        return dapo_loss.group_advantages(batch.reward, batch.group_size, norm_by_std=self.cfg.algo.norm_adv_by_std)

    def policy_loss(self, log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, *, loss_agg_mode: str, normalizer: float,
                    is_weights: Optional[torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        """The policy-gradient term of one micro-batch's loss and its aggregation (docs/algorithm.md
        §4; default: DAPO's clipped loss, dapo_loss.policy_loss with the run's clip ratios).

        log_prob [n, T]: the policy's, with gradient; old_log_prob [n, T]: the learner's at the
        step's start; advantages [n]: compute_advantages's; response_mask [n, T] bool: the tokens
        the loss counts (rollout_rs's rejected ones left out); is_weights [n, T] or None: the
        rollout correction's truncated importance weights, to multiply into each token's term
        before aggregating, which only the loss can do (None unless rollout_is is set); the
        weights and the rejection are computed outside, once per step. loss_agg_mode and normalizer (the whole mini-batch's token,
        or sequence, count, over every micro-batch and learner) are dapo_loss.aggregate's, so the
        micro-batches' losses add up to the mini-batch's. Returns (scalar loss, metrics): any of
        learner.PG_METRICS as means over this call's tokens; one left out is empty in metrics.csv.
        The learner adds the KL, entropy and length-penalty terms outside: regularisers that any
        estimator keeps, as verl's policy losses leave them out. Settings come from self.cfg.
        """
        return dapo_policy_loss(self.cfg.algo)(log_prob, old_log_prob, advantages, response_mask,
                                               loss_agg_mode=loss_agg_mode, normalizer=normalizer,
                                               is_weights=is_weights)

    def update_policy(self, batch: SampleBatch, advantages: torch.Tensor) -> dict[str, Any]:
        """One training step on the step's samples (learner.py), its loss's policy-gradient term
        :meth:`policy_loss`; returns metrics.csv values."""
        return self.learner.update(batch, advantages, self.step, policy_loss=self.policy_loss)

    # ----- rollout ranks ------------------------------------------------------------------------

    def run_rollout(self) -> None:
        """A rollout rank's whole run: generate, send, obey "more"/"next", take new weights."""
        run = self.cfg.run
        if self.rollout.weight_version == 0 and self.schedule.validates(0):  # a resumed run validated v0 long ago
            self.send_validation()
        for step in range(self.first_generation_step, run.max_steps + 1 + self.schedule.collects_past_the_end()):
            at_step(step)
            while self.rollout.weight_version < max(0, step - 1 - run.max_staleness):
                self.receive_weights()
            gen_index, flag = 0, MORE
            while flag == MORE:
                gen_index += 1
                with phase("generation"):
                    batch, malformed, seconds = self.rollout.generate_shard(step, gen_index)
                flag = self.samples.send(batch, malformed, seconds, self.rollout.take_weight_sync())
        while self.rollout.weight_version < run.max_steps:
            self.receive_weights()

    def receive_weights(self) -> None:
        """Take the next weight version; validate it when due; hand the lead this rank's state
        when the version is checkpointed."""
        version = self.rollout.receive_weights(self.weights)
        if self.schedule.validates(version):
            self.send_validation()
        if self.schedule.saves(version):
            self.checkpoints.send_rank_state()

    def send_validation(self) -> None:
        sums = self.rollout.validation_sums()
        with phase("validation"):
            all_reduce_sum(sums, self.groups.sync, self.plat.device)  # the lead reads the totals

    # ----- learners -----------------------------------------------------------------------------

    def run_learner(self) -> None:
        """A learner's whole run; the lead also collects samples, hands off weights and writes metrics."""
        run, lead, stale = self.cfg.run, self.layout.is_lead, self.cfg.run.max_staleness
        if lead and self.schedule.resumed_from == 0 and self.schedule.validates(0):
            self.report.write(self.record_validation({"step": 0}))
        last_end = time.perf_counter()
        for step in range(self.schedule.resumed_from + 1, run.max_steps + 1):
            at_step(step)
            batch, row, save_time = None, {}, None
            if lead:
                if stale == 0:
                    save_time = self.hand_off(step - 1, None)
                batch, row = self.collect(step)
                if stale > 0:
                    save_time = self.hand_off(step - 1, (batch, row))
            else:
                self.follow_hand_off(step - 1)
            train_start = time.perf_counter()
            row = {**row, **self.learn(step, batch)}
            if lead:
                now, train_time = time.perf_counter(), time.perf_counter() - train_start
                self.report.observe_step(step, row, batch)
                row.update(step=step, weight_version=step, train_time_s=train_time, step_time_s=now - last_end,
                           save_time_s=save_time, overlap=(row["gen_time_s"] + train_time) / (now - last_end))
                last_end = now
                self.pending_rows[step] = row
        self.finish()

    def learn(self, step: int, batch: Optional[SampleBatch]) -> dict[str, Any]:
        """All learners: receive the step's batch and train on it."""
        if self.layout.num_learners > 1:
            with phase("sample transfer"):
                batch = broadcast_samples(batch, self.layout.lead_learner, self.groups.learners, self.plat.device,
                                          self.cfg.rollout.sample_num)
        self.step = step
        with phase("update"):
            row = self.update_policy(batch, self.compute_advantages(batch))
        row.update(self.learner.counters(), staleness=int(step - 1 - batch.version.min()))
        return row

    def collect(self, step: int) -> Collected:
        """Lead learner: the step's batch, from this process's rollout or from the rollout ranks."""
        if not self.single:
            return self.sampler.collect(step, self.samples.receive, self.samples.answer)

        def generate_here(gen_index: int) -> Generated:
            batch, malformed, seconds = self.rollout.generate_shard(step, gen_index)
            return ([batch] if batch is not None else []), malformed, seconds, self.rollout.take_weight_sync()
        return self.sampler.collect(step, generate_here, answer=lambda full: None)

    def hand_off(self, version: int, collected: Optional[Collected]) -> Optional[float]:
        """Lead learner: send weights ``version`` to the rollout side, finish that step's row, then
        checkpoint when due; returns the seconds spent saving (None when nothing was saved)."""
        if version <= self.schedule.resumed_from:  # v0: the base model; a resumed run's first: sent before its save
            return None
        start = time.perf_counter()
        with phase("weight sync"):
            send = self.rollout.load_weights if self.single else self.weights.send
            send(self.learner.full_weights(), version)
        row = {**self.pending_rows.pop(version, {"step": version}), "sync_time_s": time.perf_counter() - start}
        if self.schedule.validates(version):
            self.record_validation(row)
        self.report.write(row)
        saves = self.schedule.saves(version)
        return self.checkpoints.save(version, collected, export=self.schedule.exports(version)) if saves else None

    def follow_hand_off(self, version: int) -> None:
        """A learner other than the lead: its part in the lead's hand_off of ``version``."""
        if version > self.schedule.resumed_from:
            self.learner.join_weight_sync()
        if self.schedule.saves(version):
            self.checkpoints.save_learner_shard(version, export=self.schedule.exports(version))

    def record_validation(self, row: dict[str, Any]) -> dict[str, Any]:
        if self.single:
            reward_sum, correct, count = self.rollout.validation_sums()
        else:
            with phase("validation"):
                reward_sum, correct, count = all_reduce_sum([0.0, 0.0, 0.0], self.groups.sync, self.plat.device)
        return self.report.observe_validation(row, val_reward=reward_sum / count,
                                              val_acc=correct / count if not self.cfg.model.reward_model else None)

    def finish(self) -> None:
        """Hand off the last weights (and checkpoint them) and wait until every file is on disk."""
        final, waited = self.cfg.run.max_steps, None
        if self.layout.is_lead:
            ahead = self.collect(final + 1) if self.schedule.collects_past_the_end() else None
            waited = self.hand_off(final, ahead)
        else:
            self.follow_hand_off(final)
        start = time.perf_counter()
        self.learner.writer.wait()  # the run ends with its last checkpoint complete on disk
        if waited is not None:
            log(f"checkpoint {ckpt.step_dir_name(final)} saved in {waited + time.perf_counter() - start:.2f}s")

    def train(self) -> None:
        self.run_learner() if self.layout.is_learner else self.run_rollout()


def launch_layout(cfg: Config, ranks: Optional[int], nodes: Optional[int]) -> tuple[Derived, Layout]:
    """The world this process is in (torchrun's), or the one --plan / --dry_run lays out: its
    ``ranks`` over ``nodes``, each torchrun's when not given."""
    world_size = ranks or int(os.environ.get("WORLD_SIZE", "1"))
    derived = Derived.of(cfg, world_size, nodes=nodes or config.torchrun_nodes())
    return derived, Layout(world_size=world_size, rank=int(os.environ.get("RANK", "0")),
                           num_learners=derived.num_learner_ranks, tensor_parallel=derived.rollout_tensor_parallel)


def check_inputs(cfg: Config, *, reads_data: bool) -> None:
    """Refuse (UserError, one line naming the key) what this run could not read or use, before
    anything loads: every path it reads (--plan and --dry_run read no data, ``reads_data`` False),
    the model's type, the rollout settings, the reporters."""
    config.check_input_paths(cfg, reads_data=reads_data)
    if reads_data:
        resuming.check_resume_path(Path(cfg.run.output_dir), cfg.run.resume_from_checkpoint,
                                   restarted=resuming.restarted_by_torchrun())
    check_model_type(cfg.model.model_path)
    check_rollout_inputs(cfg)
    check_report_to(cfg.run.report_to)


def start_up_warnings(cfg: Config, platform_kind: str) -> list[str]:
    """Legal but suspicious settings (config.warnings_for), and a weight sync slower than it
    should be on this platform."""
    notes = warnings_for(cfg)
    if cfg.model.rollout_engine == "vllm" and (slow_sync := host_bounce_reason(platform_kind)):
        notes.append(slow_sync)
    return notes


def join_world(cfg: Config, plat: Platform, layout: Layout) -> Optional[Groups]:
    """This rank's device made current and the job's process groups; None for a job of one rank."""
    if layout.world_size == 1:
        return None
    plat.bind()
    return init_world(layout, plat.backend, cfg.run.dist_timeout_s, plat.learner_backend(cfg.model.learner_offload),
                      every_engine_rank_takes_weights(cfg.model.rollout_engine, plat.kind, layout.tensor_parallel))


@config.answers_usage  # -h/--help: every key with its default, exit 0; no arguments: the usage, exit 2
def main(argv: list[str], trainer_class: type[Trainer] = Trainer) -> int:
    """The run; ``trainer_class`` is a user's subclass of :class:`Trainer` (README.md)."""
    restore_determinism = None
    try:
        argv, inspection, *asked = split_inspection(argv)  # --plan / --dry_run [WORLD_SIZE] [--nnodes N]
        cfg = load_config(argv)
        derived, layout = launch_layout(cfg, *asked)
        world_size, lead = layout.world_size, layout.is_lead
        plat = select_platform(cfg.run.device, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        versions.check_stack(plat.kind, cfg.model.rollout_engine)  # --plan and --dry_run too
        restore_determinism = use_deterministic_algorithms(plat.kind, cfg.run.deterministic)  # before any kernel
        check_inputs(cfg, reads_data=inspection is None)  # before anything loads and output_dir is written
        if inspection == "dry_run":
            return dry_run.run(cfg, derived)
        if (status := plan_advice.check(cfg, derived, plat.memory_bytes(), with_reference=uses_reference_model(cfg),
                                        plan_only=inspection == "plan", lead=lead, platform_kind=plat.kind)) is not None:
            return status  # --plan: 0 when it fits, 1 when it does not
        check_engine(cfg, plat)  # vLLM installed, FP8 available: before output_dir is written
        check_reward_on_data(cfg)
        from transformers.utils import logging as hf_logging  # here: a bad command line fails fast
        hf_logging.disable_progress_bar()  # weight-loading bars would bury the training log
        for message in start_up_warnings(cfg, plat.kind) if lead else []:
            warn(message)  # "no val_dataset" among them
        out = Path(cfg.run.output_dir)
        restarted = resuming.restarted_by_torchrun()
        resume = resuming.find_resume_checkpoint(out, cfg.run.resume_from_checkpoint, restarted=restarted,
                                                 warn=warn if lead else quiet, log=log if lead else quiet)
        resuming.prepare_output_dir(out, overwrite=cfg.run.overwrite_output_dir, create=lead,
                                    resuming=cfg.run.resume_from_checkpoint is not None or resume is not None or restarted)
        role = "rollout+learner" if world_size == 1 else layout.role + " (lead)" * lead if layout.is_learner \
            else layout.title
        log(f"rank {layout.rank}/{world_size} role={role} pid={os.getpid()} device={plat.device} "
            f"backend={plat.backend} moe_experts={experts_implementation(plat.kind)}")
        bind_host_cores(plat)  # before the run's threads and processes start: they inherit its cores
        stopping.watch(layout, out)  # Ctrl-C and SIGTERM end the run with one line from here on
        groups = join_world(cfg, plat, layout)
        seed_everything(cfg.run.seed + layout.rank)
        trainer = trainer_class(cfg, plat, derived, layout, groups, resume)  # checks the inputs; writes nothing
        if lead and (resumed := trainer.schedule.resumed_from) >= cfg.run.max_steps:
            log(f"the checkpoint is at step {resumed}, max_steps is {cfg.run.max_steps}: nothing to train")
        elif lead:  # a resume that trains nothing leaves the run's config.yaml and env report as they were
            (out / "config.yaml").write_text(cfg.to_yaml())
            write_env_report(out / "env_report.json", plat, world_size)
        trainer.train()
        memory_plan.record_usage(layout, plat, out)
        finish_together()
    except UserError as e:
        stopping.say_once_per_job(f"error: {e}")
        return stopping.BAD_INPUT_STATUS
    except (PhaseError, ckpt.CheckpointError, OSError) as e:  # OSError: a full disk among others
        stopping.say_once_per_job(f"error: {stopping.failure_line(e)}")
        return 1
    finally:
        stopping.unwatch()
        leave_world()
        if restore_determinism is not None:
            restore_determinism()
    return 0


if __name__ == "__main__":
    if "triton" not in sys.modules:
        # What the imports made lives as long as the process: no collection, the exit's included,
        # walks it again (2 CPU s of a rank). Not triton's: nanobind would report it leaked at exit.
        gc.freeze()
    sys.exit(main(sys.argv[1:]))
