"""DAPO training: the entry point, and the only file with side effects at start-up.

    python train_dapo.py --config configs/demo_cpu.yaml [--KEY VALUE ...]

One step: roll out ``prompts_per_step`` informative groups of ``sample_num`` responses (DAPO
dynamic sampling, surplus groups carried over), recompute old log-probs, compute group-relative
advantages, train on mini-batches with the clip-higher token-level loss, then hand the new
weights to the rollout copy of the policy. To change the algorithm, subclass :class:`Trainer`
and override :meth:`Trainer.compute_advantages` or :meth:`Trainer.update_policy`.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

import ckpt
import dapo_loss
from config import Config, ConfigError, Derived, load_config, warnings_for
from device import DTYPES, Platform, seed_everything, select_platform, write_env_report
from metrics import AlarmMonitor, MetricsWriter, console_line
from ranks import (MORE, NEXT, Groups, Layout, PhaseError, WeightBroadcast, all_reduce_max, all_reduce_sum,
                   broadcast_flag, broadcast_samples, gather_json, gather_samples, init_world, phase,
                   report_phase_on_sigterm)
from rollout import GroupPool, RolloutWorker, SampleBatch, keep_informative, make_reward_source


class UserError(Exception):
    """Bad input that ends the run with one line on stderr and exit status 2."""


def log(message: str) -> None:
    # One write per line: print() writes the text and the newline separately, and the lines of
    # eight ranks sharing one pipe would interleave.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def warn(message: str) -> None:
    sys.stderr.write(f"warning: {message}\n")
    sys.stderr.flush()


def step_generator(seed: int, *keys: int) -> torch.Generator:
    """A generator that depends only on (seed, keys): the same draw on every run and resume."""
    mixed = seed
    for key in keys:
        mixed = (mixed * 1_000_003 + key + 1) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)


class PromptStream:
    """Batches of prompt rows in length-bucketed, seeded order, epoch after epoch.

    Its position (epoch, batch) is all a resume needs to continue without replaying prompts.
    """

    def __init__(self, lengths: list[int], batch_size: int, bucket_size: int, seed: int) -> None:
        self.lengths, self.batch_size, self.bucket_size, self.seed = lengths, batch_size, bucket_size, seed
        self.epoch, self.cursor = 0, 0
        self._batches = self._plan()

    def _plan(self) -> list[list[int]]:
        from data_prep import bucketed_batches

        return bucketed_batches(self.lengths, self.batch_size, self.bucket_size, seed=self.seed, epoch=self.epoch)

    def seek(self, epoch: int, cursor: int) -> None:
        self.epoch, self.cursor = epoch, cursor
        self._batches = self._plan()

    def next(self) -> list[int]:
        if self.cursor == len(self._batches):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._batches = self._plan()
        batch = self._batches[self.cursor]
        self.cursor += 1
        return batch


class Trainer:
    """DAPO on one process (both roles) or on a rank of a torchrun job (one role).

    Override points (article 4.1):

    - ``compute_advantages(batch) -> Tensor[N]``: one advantage per response. The default is
      DAPO's group-relative advantage, normalised within each prompt's group.
    - ``update_policy(batch, advantages) -> dict``: one training step on the step's samples;
      returns metrics for metrics.csv (keys among metrics.COLUMNS).

    The step choreography (DESIGN.md), with s = max_staleness and v_k the weights after k
    updates: the lead learner collects step j's samples, which rollout generated with
    v_max(0, j-1-s), sends v_(j-1) (after collecting when s = 1, so rollout generates step
    j+1 while step j trains; before collecting when s = 0), then the learners train step j.
    With one process the same order runs with local hand-offs, so staleness means the same.
    """

    def __init__(self, cfg: Config, plat: Platform, derived: Derived, layout: Optional[Layout] = None,
                 groups: Optional[Groups] = None, resume: Optional[Path] = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from data_prep import DataError, load_prompts

        self.cfg, self.plat, self.derived = cfg, plat, derived
        self.layout = layout or Layout(world_size=1, rank=0, num_learners=1)
        self.groups = groups
        self.single = self.layout.world_size == 1
        self.out_dir = Path(cfg.run.output_dir)
        model_path = Path(cfg.model.model_path)
        if not (model_path / "config.json").is_file():
            raise UserError(f"model_path {model_path}: no config.json (expected a Hugging Face model folder)")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        data_kw = dict(prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key,
                       system_prompt=cfg.data.system_prompt, max_prompt_length=cfg.data.max_prompt_length,
                       overlong_prompts=cfg.data.overlong_prompts, skip_bad_rows=cfg.data.skip_bad_rows)
        try:
            self.train_set = load_prompts(cfg.data.dataset, self.tokenizer, **data_kw)
            self.val_set = load_prompts(cfg.data.val_dataset, self.tokenizer, **data_kw) if cfg.data.val_dataset else None
        except DataError as e:
            raise UserError(str(e)) from None
        for name, prompts in (("dataset", self.train_set), ("val_dataset", self.val_set)):
            if prompts is not None and (prompts.num_bad_rows or prompts.num_overlong_dropped or prompts.num_truncated):
                warn(f"{name}: skipped {prompts.num_bad_rows} bad rows, dropped {prompts.num_overlong_dropped} "
                     f"and left-truncated {prompts.num_truncated} prompts longer than max_prompt_length")
        if not self.train_set.prompt_ids:
            raise UserError(f"dataset {cfg.data.dataset}: no usable prompts")
        if cfg.model.rollout_dtype == "fp8":
            raise UserError("rollout_dtype fp8 is not supported yet in this build; use bf16 or fp32")
        self.fingerprint = {
            "model": ckpt.model_fingerprint(model_path), "tokenizer": ckpt.tokenizer_fingerprint(self.tokenizer),
            "layout": {"world_size": self.layout.world_size, "learner_ranks": self.layout.num_learners},
            # What the saved data position and sample buffer mean: the same prompts, batched the same way.
            "data": {"train_prompts": ckpt.digest(self.train_set.prompt_ids), "prompts_per_step":
                     cfg.rollout.prompts_per_step, "sample_num": cfg.rollout.sample_num,
                     "bucket_size": cfg.data.bucket_size, "seed": cfg.run.seed},
        }
        saved = self._check_resumable(resume) if resume is not None else None

        def load(path: Path, dtype: torch.dtype) -> torch.nn.Module:
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(plat.device)

        # The policy continues from the checkpoint's weights; the KL reference stays the base model.
        weights_path = resume / "model" if resume is not None else model_path
        self.weight_version = 0
        self.step = 0
        self.resumed_from = 0  # the step of the checkpoint this run continues (0: a fresh start)
        self.first_generation_step = 1
        self.has_rollout = self.single or not self.layout.is_learner
        if self.layout.is_learner:
            torch.manual_seed(cfg.run.seed)
            self.policy = load(weights_path, torch.float32)
            self.policy.config.use_cache = False
            self.param_shapes = [p.shape for p in self.policy.parameters()]
            if self.single:
                self.rollout_model = copy.deepcopy(self.policy).to(DTYPES[cfg.model.rollout_dtype])
            if cfg.model.gradient_checkpointing:
                # transformers renamed the switch; take whichever this version has.
                enable = getattr(self.policy, "activation_checkpointing_enable", None) or \
                    self.policy.gradient_checkpointing_enable
                enable()
            self.ref_model = None
            if self.kl_coef_at(0) > 0 or cfg.algo.kl_coef > 0:
                self.ref_model = load(model_path, torch.float32).eval().requires_grad_(False)
            if self.layout.num_learners > 1:
                self._shard_learner_models()
            self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.optim.learning_rate,
                                               betas=(0.9, 0.999), weight_decay=cfg.optim.weight_decay)
            self.optimizer_steps = 0
            self.skipped_steps = 0
            self.writer = ckpt.BackgroundWriter()
            self.optimizer_saver = ckpt.OptimizerSaver()
            self.full_weights: list[torch.Tensor] = []
        else:
            self.rollout_model = load(weights_path, DTYPES[cfg.model.rollout_dtype])
        if self.has_rollout:
            self.rollout_model.eval().requires_grad_(False)
            self.rollout_model.config.use_cache = True
            stop_ids = sorted({self.tokenizer.eos_token_id, *cfg.model.eos_token_ids})
            self.worker = RolloutWorker(
                self.rollout_model, self.tokenizer,
                make_reward_source(cfg.model.reward_fn, cfg.model.reward_model, plat.device),
                device=plat.device, stop_ids=stop_ids, max_response_length=cfg.rollout.max_response_length,
                temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                overlong_buffer_len=cfg.algo.overlong_buffer_len,
                overlong_penalty_factor=cfg.algo.overlong_penalty_factor, bucket_size=cfg.data.bucket_size,
            )
            self.prompts = PromptStream([len(p) for p in self.train_set.prompt_ids], cfg.rollout.prompts_per_step,
                                        cfg.data.bucket_size, cfg.run.seed)
        if not self.single and (self.layout.is_lead or not self.layout.is_learner):
            shapes = self.param_shapes if self.layout.is_learner else [p.shape for p in self.rollout_model.parameters()]
            self.weights = WeightBroadcast(shapes, DTYPES[cfg.model.rollout_dtype], cfg.run.weight_sync_bucket_mb,
                                           src=self.layout.lead_learner, group=groups.sync, device=plat.device)
        if self.layout.is_lead:
            self.pool = GroupPool()
            self.alarms = AlarmMonitor(length_rising_steps=cfg.run.length_alarm_steps,
                                       overfit_checks=cfg.run.overfit_alarm_checks)
            # A fresh start begins a new metrics.csv; a resumed one continues the checkpoint's copy.
            self.metrics = MetricsWriter(self.out_dir / "metrics.csv", append=resume is not None)
            self.train_rewards_since_val: list[float] = []
            self.pending_rows: dict[int, dict[str, Any]] = {}
            self.collected_ahead: Optional[tuple[SampleBatch, dict[str, Any]]] = None  # restored from a checkpoint
        if saved is not None:
            self._restore(resume, saved)

    def _shard_learner_models(self) -> None:
        """FSDP2 over the learner group: parameters, gradients and optimizer state split (ZeRO-3)."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(self.groups.learners, self.plat.device.type)
        for model in filter(None, (self.policy, self.ref_model)):
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)

    # ----- schedules and precision -------------------------------------------------------------

    def learner_autocast(self) -> contextlib.AbstractContextManager:
        # bf16 compute over fp32 master weights and optimizer state, as mixed-precision trainers do.
        if self.cfg.model.learner_dtype == "bf16":
            return torch.autocast(device_type=self.plat.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def kl_coef_at(self, step: int) -> float:
        algo = self.cfg.algo
        if algo.kl_coef_init is not None and step < algo.kl_warmup_steps:
            return algo.kl_coef_init
        return algo.kl_coef

    def lr_at(self, optimizer_step: int) -> float:
        warmup = self.cfg.optim.lr_warmup_steps
        scale = min(1.0, (optimizer_step + 1) / warmup) if warmup > 0 else 1.0  # first step is non-zero
        return self.cfg.optim.learning_rate * scale

    def val_due(self, version: int) -> bool:
        run = self.cfg.run
        if self.val_set is None:
            return False
        return version == 0 or (run.val_every > 0 and (version % run.val_every == 0 or version == run.max_steps))

    # ----- rollout side ------------------------------------------------------------------------

    def generate_shard(self, step: int, gen_index: int) -> tuple[Optional[SampleBatch], int, float]:
        """This rank's share of the next generation batch: (samples or None, malformed count, seconds)."""
        start = time.perf_counter()
        rows = self.prompts.next()
        shards = max(1, self.layout.num_rollout)
        mine = rows[self.layout.rollout_index::shards] if not self.single else rows
        if not mine:
            return None, 0, time.perf_counter() - start
        batch, scored = self.worker.rollout(
            [self.train_set.prompt_ids[r] for r in mine], [self.train_set.prompt_texts[r] for r in mine],
            [self.train_set.answers[r] for r in mine], mine, group_size=self.cfg.rollout.sample_num,
            version=self.weight_version,
            generator=step_generator(self.cfg.run.seed, step, gen_index, self.layout.rollout_index))
        self.plat.release_cache()
        return batch, scored.num_malformed, time.perf_counter() - start

    @torch.no_grad()
    def validation_sums(self) -> list[float]:
        """[reward sum, correct count, prompts] over this rank's share of the val set (greedy unless
        val_temperature > 0)."""
        val = self.val_set
        limit = self.cfg.rollout.val_max_prompts or len(val.prompt_ids)
        shards = 1 if self.single else self.layout.num_rollout
        mine = list(range(limit))[self.layout.rollout_index::shards]
        sums = [0.0, 0.0, 0.0]
        batch_size = max(1, self.derived.sequences_per_step)
        for start in range(0, len(mine), batch_size):
            rows = mine[start:start + batch_size]
            batch, _ = self.worker.rollout(
                [val.prompt_ids[r] for r in rows], [val.prompt_texts[r] for r in rows], [val.answers[r] for r in rows],
                rows, group_size=1, version=self.weight_version, greedy=self.cfg.rollout.val_temperature == 0,
                generator=step_generator(self.cfg.run.seed, -1, self.weight_version, start))
            sums = [sums[0] + batch.reward.sum().item(), sums[1] + batch.correct.sum().item(), sums[2] + len(rows)]
        return sums

    def receive_weights(self) -> None:
        """Rollout rank: take the next weight version from the lead learner; validate it when due."""
        with phase("weight sync"):
            version = self.weights.receive_into(list(self.rollout_model.parameters()))
        assert version == self.weight_version + 1, f"weights arrived out of order: v{version} after v{self.weight_version}"
        self.weight_version = version
        if self.val_due(version):
            sums = self.validation_sums()
            with phase("validation"):
                all_reduce_sum(sums, self.groups.sync, self.plat.device)
        if self.saves_at(version):
            self.send_rank_state()

    def run_rollout(self) -> None:
        """A rollout rank's whole run: generate, send, obey "more"/"next", take new weights."""
        cfg = self.cfg
        if self.weight_version == 0 and self.val_due(0):  # a resumed run validated v0 long ago
            sums = self.validation_sums()
            with phase("validation"):
                all_reduce_sum(sums, self.groups.sync, self.plat.device)
        for step in range(self.first_generation_step, cfg.run.max_steps + 1 + self.collects_past_the_end()):
            while self.weight_version < max(0, step - 1 - cfg.run.max_staleness):
                self.receive_weights()
            gen_index, flag = 0, MORE
            while flag == MORE:
                gen_index += 1
                with phase("generation"):
                    batch, malformed, seconds = self.generate_shard(step, gen_index)
                with phase("sample transfer"):
                    gather_samples(batch, [seconds, malformed], self.layout, self.groups, self.plat.device,
                                   cfg.rollout.sample_num)
                    flag = broadcast_flag(0, self.layout.lead_learner, self.groups.sync, self.plat.device)
        while self.weight_version < cfg.run.max_steps:
            self.receive_weights()

    # ----- lead learner: collecting, weight hand-off, metrics ------------------------------------

    def collect(self, step: int) -> tuple[SampleBatch, dict[str, Any]]:
        """Gather generation batches until ``prompts_per_step`` informative groups are pooled
        (REFERENCE.md §3); surplus groups stay in the pool for the next step."""
        if self.collected_ahead is not None:  # collected before the checkpoint this run resumed from
            collected, self.collected_ahead = self.collected_ahead, None
            return collected
        cfg = self.cfg
        target, metric = cfg.rollout.prompts_per_step, cfg.rollout.dynamic_sampling_metric
        carried = self.pool.num_groups
        generated: list[SampleBatch] = []
        malformed, gen_time, gen_batches = 0, 0.0, 0
        while True:
            gen_batches += 1
            if self.single:
                batch, bad, gen_seconds = self.generate_shard(step, gen_batches)
                pieces = [batch] if batch is not None else []
            else:
                with phase("sample transfer"):
                    pieces, table = gather_samples(None, [0.0, 0.0], self.layout, self.groups, self.plat.device,
                                                   cfg.rollout.sample_num)
                bad, gen_seconds = int(table[:, 1].sum()), float(table[:, 0].max())
            malformed += bad
            gen_time += gen_seconds
            for batch in pieces:
                generated.append(batch)
                self.pool.add(batch.select_groups(keep_informative(batch, metric)) if cfg.rollout.dynamic_sampling
                              else batch)
            full = self.pool.num_groups >= target
            if not full and cfg.rollout.max_gen_batches and gen_batches >= cfg.rollout.max_gen_batches:
                raise UserError(
                    f"step {step}: only {self.pool.num_groups} of {target} groups were informative after "
                    f"{gen_batches} generation batches (max_gen_batches): every response to the other prompts got "
                    f"the same reward, so the data is too easy or too hard for the current policy")
            if not self.single:
                with phase("sample transfer"):
                    broadcast_flag(NEXT if full else MORE, self.layout.lead_learner, self.groups.sync, self.plat.device)
            if full:
                break
        everything = SampleBatch.concat(generated)
        informative = sum(len(keep_informative(b, metric)) for b in generated)
        stats = {
            "num_gen_batches": gen_batches,
            "informative_frac": informative / everything.num_groups,
            "carried_groups": carried,
            "reward_malformed": malformed,
            # Generation statistics describe everything sampled, before the dynamic-sampling filter.
            "reward_mean": everything.reward.mean().item(),
            "reward_std": everything.reward.std().item() if everything.reward.numel() > 1 else 0.0,
            "score_mean": everything.score.mean().item(),
            "acc_mean": everything.correct.float().mean().item() if not self.cfg.model.reward_model else None,
            "response_length_mean": everything.response_lengths.float().mean().item(),
            "response_length_max": int(everything.response_lengths.max()),
            "truncated_frac": everything.truncated.float().mean().item(),
            "gen_time_s": gen_time,
            "gen_tokens_per_s": int(everything.response_lengths.sum()) / max(gen_time, 1e-9),
        }
        return self.pool.take(target), stats

    def send_weights(self, version: int) -> None:
        """Lead learner: hand weights v_version to the rollout side, then finish that step's row."""
        start = time.perf_counter()
        if self.single:
            with torch.no_grad():
                for dst, src in zip(self.rollout_model.parameters(), self.full_weights):
                    dst.copy_(src)
            self.weight_version = version
        else:
            with phase("weight sync"):
                self.weights.send(self.full_weights, version)
        row = self.pending_rows.pop(version, {"step": version})
        row["sync_time_s"] = time.perf_counter() - start
        if self.val_due(version):
            self.record_validation(row)
        self.write_row(row)

    def record_validation(self, row: dict[str, Any]) -> None:
        if self.single:
            reward_sum, correct, count = self.validation_sums()
        else:
            with phase("validation"):
                reward_sum, correct, count = all_reduce_sum([0.0, 0.0, 0.0], self.groups.sync, self.plat.device)
        val_reward, val_acc = reward_sum / count, (correct / count if not self.cfg.model.reward_model else None)
        row.update(val_reward_mean=val_reward, val_acc=val_acc)
        if self.train_rewards_since_val:
            train_reward = sum(self.train_rewards_since_val) / len(self.train_rewards_since_val)
            for message in self.alarms.observe_validation(val_reward=val_reward, train_reward=train_reward):
                warn(f"ALARM step {row['step']}: {message}")
        self.train_rewards_since_val = []

    def write_row(self, row: dict[str, Any]) -> None:
        if row["step"] > 0:
            row.update(self.alarms.counts)
        self.metrics.write(row)
        step = row["step"]
        if step == 0 or step % self.cfg.run.log_every == 0 or step == self.cfg.run.max_steps:
            log(console_line(row))

    # ----- learners ------------------------------------------------------------------------------

    def sequence_logprobs(self, model: torch.nn.Module, batch: SampleBatch, *,
                          with_entropy: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Log-probs (and entropy) of the response tokens under ``model``, temperature-scaled."""
        device = self.plat.device
        ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1).to(device)
        attention = torch.cat([batch.prompt_mask, batch.response_mask], dim=1).to(device)
        positions = (attention.long().cumsum(-1) - 1).clamp(min=0)
        width = batch.response_ids.shape[1]
        with self.learner_autocast():
            logits = model(input_ids=ids, attention_mask=attention.long(), position_ids=positions,
                           use_cache=False, logits_to_keep=width + 1).logits[:, :-1]
        temperature = self.cfg.rollout.temperature
        logp = dapo_loss.token_logprobs(logits, batch.response_ids.to(device), temperature)
        entropy = dapo_loss.entropy_from_logits(logits, temperature) if with_entropy else None
        return logp, entropy

    def micro_batches(self, batch: SampleBatch, rows: torch.Tensor) -> list[tuple[torch.Tensor, SampleBatch]]:
        """Cut ``rows`` into per_device_batch_size pieces, each trimmed to its own widths."""
        pieces = []
        for chunk in rows.split(self.cfg.optim.per_device_batch_size):
            part = batch.select_rows(chunk)
            keep_p = int(part.prompt_mask.any(0).nonzero().min()) if part.prompt_mask.any() else 0
            keep_r = int(part.response_lengths.max())
            part = SampleBatch(**{**part.tensors(),
                                  "prompt_ids": part.prompt_ids[:, keep_p:], "prompt_mask": part.prompt_mask[:, keep_p:],
                                  "response_ids": part.response_ids[:, :keep_r],
                                  "response_mask": part.response_mask[:, :keep_r],
                                  "rollout_logp": part.rollout_logp[:, :keep_r]}, group_size=1)
            pieces.append((chunk, part))
        return pieces

    @torch.no_grad()
    def logprobs_of(self, model: torch.nn.Module, batch: SampleBatch, rows: torch.Tensor) -> torch.Tensor:
        """[N, R] log-probs, filled in for ``rows`` only, computed micro-batch by micro-batch."""
        out = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
        for chunk, part in self.micro_batches(batch, rows):
            logp, _ = self.sequence_logprobs(model, part, with_entropy=False)
            out[chunk, : logp.shape[1]] = logp.float().cpu()
        return out

    def compute_advantages(self, batch: SampleBatch) -> torch.Tensor:
        """Group-relative advantages, one per response (REFERENCE.md §2)."""
        return dapo_loss.group_advantages(batch.reward, batch.group_size,
                                          norm_by_std=self.cfg.algo.norm_adv_by_std)

    def update_policy(self, batch: SampleBatch, advantages: torch.Tensor) -> dict[str, Any]:
        """Train on the step's samples: mini-batches of optimizer steps, micro-batches of backward.

        Each learner owns a fixed, equal share of the rows; mini-batch m is the m-th slice of every
        learner's share, and its loss is normalised by the whole mini-batch's token (or sequence)
        count across learners, so neither micro-batching nor the number of learners changes it.
        """
        cfg, algo = self.cfg, self.cfg.algo
        learners, me = self.layout.num_learners, self.layout.learner_index
        self.policy.train()
        mask = batch.response_mask
        perm = torch.randperm(mask.shape[0], generator=step_generator(cfg.run.seed, self.step))
        shares = [perm[i::learners] for i in range(learners)]
        old_logp = self.logprobs_of(self.policy, batch, shares[me])
        ref_logp = self.logprobs_of(self.ref_model, batch, shares[me]) if self.ref_model is not None else None
        gap = (old_logp - batch.rollout_logp).abs()[shares[me]][mask[shares[me]]]
        is_weights = None
        if algo.tis_cap > 0:
            is_weights = torch.exp(old_logp - batch.rollout_logp).clamp(max=algo.tis_cap) * mask
        kl_coef = self.kl_coef_at(self.step)
        token_mean = algo.loss_agg_mode == "token-mean"
        sums: dict[str, float] = dict.fromkeys(("policy_loss", "kl", "entropy", "length_penalty", "pg_clipfrac",
                                                "pg_clipfrac_lower", "ppo_kl"), 0.0)
        grad_norms = []
        size = self.derived.minibatch_sequences
        for epoch in range(cfg.optim.ppo_epochs):
            order = torch.randperm(len(shares[me]), generator=step_generator(cfg.run.seed, self.step, epoch))
            minibatches = [share[order].split(size) for share in shares]
            for parts in zip(*minibatches):
                rows = parts[me]
                global_tokens = sum(int(mask[p].sum()) for p in parts)
                normalizer = global_tokens if token_mean else sum(len(p) for p in parts)
                for chunk, part in self.micro_batches(batch, rows):
                    width = part.response_ids.shape[1]
                    part_mask = part.response_mask.to(self.plat.device)
                    logp, entropy = self.sequence_logprobs(self.policy, part, with_entropy=True)
                    on_device = lambda t: t[chunk, :width].to(self.plat.device)  # noqa: E731
                    pg_loss, pg_metrics = dapo_loss.policy_loss(
                        logp, on_device(old_logp), advantages[chunk].to(self.plat.device), part_mask,
                        clip_ratio_low=algo.clip_ratio_low, clip_ratio_high=algo.clip_ratio_high,
                        clip_ratio_c=algo.clip_ratio_c, loss_agg_mode=algo.loss_agg_mode, normalizer=normalizer,
                        is_weights=on_device(is_weights) if is_weights is not None else None)
                    entropy_term = dapo_loss.aggregate(entropy, part_mask, algo.loss_agg_mode, normalizer)
                    loss = pg_loss - algo.entropy_coeff * entropy_term
                    share = len(chunk) / (len(rows) * learners)
                    if ref_logp is not None:
                        kl = dapo_loss.aggregate(dapo_loss.kl_penalty(logp, on_device(ref_logp), algo.kl_type),
                                                 part_mask, algo.loss_agg_mode, normalizer)
                        loss = loss + kl_coef * kl
                        sums["kl"] += kl.item()
                    if algo.length_penalty_coef:
                        # Normalised by the mini-batch's tokens, so the micro-batch terms add up to
                        # the penalty of the whole mini-batch (rho relative to its mean length).
                        penalty = dapo_loss.length_penalty(logp, part_mask, coef=algo.length_penalty_coef,
                                                           normalizer=global_tokens)
                        loss = loss + penalty
                        sums["length_penalty"] += penalty.item()
                    # FSDP averages gradients over learners, but each learner's loss is already its
                    # share of the whole mini-batch's loss: scale so the average is the sum.
                    (loss * learners).backward()
                    sums["policy_loss"] += pg_loss.item()
                    sums["entropy"] += entropy_term.item()
                    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
                        sums[key] += pg_metrics[key].item() * share
                grad_norms.append(self.optimizer_step())
        keys = list(sums)
        totals = [sums[k] for k in keys] + [float(gap.sum()), float(gap.numel())]
        if learners > 1:
            with phase("update"):
                totals = all_reduce_sum(totals, self.groups.learners, self.plat.device)
                gap_max = all_reduce_max(float(gap.max()) if gap.numel() else 0.0, self.groups.learners,
                                         self.plat.device)
        else:
            gap_max = float(gap.max()) if gap.numel() else 0.0
        count = len(grad_norms)
        result = {k: v / count for k, v in zip(keys, totals)}
        if ref_logp is None:
            result["kl"] = None
        result.update(grad_norm=sum(grad_norms) / count, kl_coef=kl_coef, lr=self.lr_at(self.optimizer_steps - 1),
                      mismatch_mean=totals[-2] / max(totals[-1], 1.0), mismatch_max=gap_max)
        return result

    def optimizer_step(self) -> float:
        """Clip, check and apply the accumulated gradient; a non-finite one is skipped, never applied."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg.optim.grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if not math.isfinite(grad_norm):
            self.skipped_steps += 1
            warn(f"step {self.step}: gradient norm is {grad_norm}; optimizer step skipped "
                 f"({self.skipped_steps} skipped so far)")
            self.optimizer.zero_grad(set_to_none=True)
            return 0.0
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.optimizer_steps)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return grad_norm

    def gather_full_weights(self) -> None:
        """Every learner joins the all-gather of each shard; the lead keeps the full tensors."""
        from torch.distributed.tensor import DTensor

        with phase("weight sync"):
            full = [p.full_tensor() if isinstance(p, DTensor) else p for p in self.policy.parameters()]
        if self.layout.is_lead:
            self.full_weights = [t.detach().to("cpu", copy=True) for t in full]

    def learn(self, step: int, batch: Optional[SampleBatch]) -> dict[str, Any]:
        """All learners: receive the step's batch, train on it, gather the new weights."""
        if self.layout.num_learners > 1:
            with phase("sample transfer"):
                batch = broadcast_samples(batch, self.layout.lead_learner, self.groups.learners, self.plat.device,
                                          self.cfg.rollout.sample_num)
        self.step = step
        with phase("update"):
            advantages = self.compute_advantages(batch)
            row = self.update_policy(batch, advantages)
        row.update(optimizer_steps=self.optimizer_steps, skipped_steps=self.skipped_steps,
                   staleness=int(step - 1 - batch.version.min()))
        self.gather_full_weights()
        return row

    def collects_past_the_end(self) -> bool:
        return self.cfg.run.max_staleness > 0 and self.saves_at(self.cfg.run.max_steps)

    def hand_off(self, version: int, collected: Optional[tuple[SampleBatch, dict[str, Any]]]) -> Optional[float]:
        """Lead learner: send weights ``version`` to the rollout side, then checkpoint when due;
        returns the seconds spent saving (None when nothing was saved)."""
        if version <= self.resumed_from:  # v0 is the base model; a resumed run's first one went out before its save
            return None
        self.send_weights(version)
        return self.save_checkpoint(version, collected) if self.saves_at(version) else None

    def run_learner(self) -> None:
        """A learner's whole run; the lead also collects samples, hands off weights and writes metrics."""
        cfg, lead, stale = self.cfg.run, self.layout.is_lead, self.cfg.run.max_staleness
        if lead and self.resumed_from == 0 and self.val_due(0):
            row: dict[str, Any] = {"step": 0}
            self.record_validation(row)
            self.write_row(row)
        last_end = time.perf_counter()
        for step in range(self.resumed_from + 1, cfg.max_steps + 1):
            batch, row, save_time = None, {}, None
            if lead:
                if stale == 0:
                    save_time = self.hand_off(step - 1, None)
                batch, row = self.collect(step)
                if stale > 0:
                    save_time = self.hand_off(step - 1, (batch, row))
            elif self.saves_at(step - 1):
                self.save_learner_shards(step - 1)
            train_start = time.perf_counter()
            row = {**row, **self.learn(step, batch)}
            train_time = time.perf_counter() - train_start
            if not lead:
                continue
            messages = self.alarms.observe_step(kl=row.get("kl"), length=row["response_length_mean"],
                                                reward_std=row["reward_std"])
            for message in messages:
                warn(f"ALARM step {step}: {message}")
            self.train_rewards_since_val.append(row["reward_mean"])
            now = time.perf_counter()
            row.update(step=step, weight_version=step, train_time_s=train_time, step_time_s=now - last_end,
                       save_time_s=save_time, overlap=(row["gen_time_s"] + train_time) / (now - last_end))
            last_end = now
            self.pending_rows[step] = row
        final, waited = cfg.max_steps, None
        if lead:
            # With rollout ahead, the final checkpoint holds the next step's batch like every other
            # one, so a finished run extended with a larger max_steps continues exactly.
            ahead = self.collect(final + 1) if self.collects_past_the_end() else None
            waited = self.hand_off(final, ahead)
        elif self.saves_at(final):
            self.save_learner_shards(final)
        start = time.perf_counter()
        self.writer.wait()  # the run ends with its last checkpoint complete on disk
        if waited is not None:
            log(f"checkpoint {ckpt.step_dir_name(final)} saved in {waited + time.perf_counter() - start:.2f}s")

    def export_model(self) -> torch.nn.Module:
        """An unsharded model holding the lead's latest weights, ready for save_pretrained."""
        from transformers import AutoModelForCausalLM

        # The gathered full tensors in a plain model, without copying them: the next update
        # replaces self.full_weights and never changes these, so a background writer can save them.
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.policy.config)
        names = [name for name, _ in model.named_parameters()]
        model.load_state_dict(dict(zip(names, self.full_weights)), strict=False, assign=True)
        model.tie_weights()
        # transformers writes files only on global rank 0; the lead learner is a later rank.
        model.should_save_on_this_rank = lambda is_main_process: is_main_process
        return model

    # ----- checkpoints (DESIGN.md "Checkpoints") -------------------------------------------------
    #
    # Checkpoint v is written right after weights v are handed to the rollout side, so rollout
    # generates while the lead saves, and every sample generated but not yet trained on is in the
    # lead's hands: the surplus groups, plus, when rollout runs ahead (max_staleness >= 1), the
    # batch already collected for step v+1. Resuming from v therefore regenerates nothing.

    def saves_at(self, version: int) -> bool:
        """Whether this run writes checkpoint ``version`` (a resumed run has its first one already)."""
        every = self.cfg.run.save_every
        return version > self.resumed_from and bool(every) and (version % every == 0 or
                                                                 version == self.cfg.run.max_steps)

    def rank_state(self) -> dict[str, Any]:
        """What this rank alone knows: its random generators and, on rollout ranks, the data position."""
        state: dict[str, Any] = {"rank": self.layout.rank, "rng": self.plat.rng_state()}
        if self.has_rollout:
            state["prompt_stream"] = {"epoch": self.prompts.epoch, "cursor": self.prompts.cursor}
        return state

    def take_learner_shards(self, version: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Every learner, for checkpoint ``version``: a host copy of its optimizer shard, and the
        learners' rank states (on the lead)."""
        self.writer.wait()  # the previous checkpoint's files are complete, and the host buffers free
        staged = self.optimizer_saver.stage(self.policy, self.optimizer)
        if self.layout.num_learners == 1:
            return staged, [self.rank_state()]
        with phase("checkpoint"):
            states = gather_json(self.rank_state(), self.layout.lead_learner, self.groups.learners, self.plat.device)
        return staged, states

    def write_optimizer_shard(self, folder: Path, staged: dict[str, Any]) -> None:
        group = self.groups.checkpoint if self.groups is not None else None
        ckpt.OptimizerSaver.write(folder / "optimizer", staged, group)

    def save_learner_shards(self, version: int) -> None:
        """A learner other than the lead: its part of checkpoint ``version``, written beside training."""
        staged, _ = self.take_learner_shards(version)
        folder = ckpt.tmp_dir(self.out_dir / "checkpoints", version)
        self.writer.start(f"save-{version}", lambda: self.write_optimizer_shard(folder, staged))

    def send_rank_state(self) -> None:
        """Rollout rank, when a checkpoint is due: its rank state to the lead, then on to generation."""
        with phase("checkpoint"):
            gather_json(self.rank_state(), self.layout.lead_learner, self.groups.sync, self.plat.device)

    def save_checkpoint(self, version: int, collected: Optional[tuple[SampleBatch, dict[str, Any]]]) -> float:
        """Lead learner: checkpoint ``version`` (weights, optimizer, sample buffer, data position,
        every rank's RNG, trainer state); returns the seconds the run waited for it.

        Everything is captured now (the optimizer shards as host copies on every learner) and
        written by writer threads while the learners train the next step; the next save, or the
        end of the run, waits for them.
        """
        start = time.perf_counter()
        states = []
        if not self.single:
            with phase("checkpoint"):
                states = gather_json(self.rank_state(), self.layout.lead_learner, self.groups.sync,
                                     self.plat.device)[:-1]  # the lead's own entry comes with the learners'
        staged, learner_states = self.take_learner_shards(version)
        states.extend(learner_states)
        buffers = self.pool.pending.named_tensors("pool") if self.pool.pending else {}
        if collected is not None:
            buffers.update(collected[0].named_tensors("ahead"))
        texts = {
            "rank_states.json": ckpt.json_text({str(s["rank"]): s for s in states}),
            "trainer_state.json": ckpt.json_text({
                "step": version, "weight_version": version,
                "generated_through_step": version + (collected is not None),
                "optimizer_steps": self.optimizer_steps, "skipped_steps": self.skipped_steps,
                "kl_coef": self.kl_coef_at(version), "lr": self.lr_at(self.optimizer_steps),
                "group_size": self.cfg.rollout.sample_num,
                "collected_ahead_row": collected[1] if collected is not None else None,
                "train_rewards_since_val": self.train_rewards_since_val,
                "alarms": self.alarms.history(),
                "fingerprint": self.fingerprint, "config": self.cfg.flat(),
            }),
            "metrics.csv": (self.out_dir / "metrics.csv").read_text(),
        }
        model = self.export_model()

        def contents(folder: Path) -> None:
            self.write_optimizer_shard(folder, staged)
            model.save_pretrained(folder / "model", safe_serialization=True)
            self.tokenizer.save_pretrained(folder / "model")
            ckpt.write_tensors(folder / "sample_buffer.safetensors", buffers)
            for name, text in texts.items():
                (folder / name).write_text(text)

        root, keep_last = self.out_dir / "checkpoints", self.cfg.run.keep_last
        self.writer.start(f"save-{version}", lambda: ckpt.save_step(root, version, contents, keep_last=keep_last))
        return time.perf_counter() - start

    def _check_resumable(self, folder: Path) -> dict[str, Any]:
        """The checkpoint's trainer state, if it was written by this model, tokenizer and layout."""
        saved = ckpt.read_json(folder / "trainer_state.json")
        for what in ("model", "tokenizer", "layout", "data"):
            difference = ckpt.first_difference(saved["fingerprint"][what], self.fingerprint[what])
            if difference:
                raise UserError(f"checkpoint {folder} does not match this run's {what}: {difference}")
        if self.layout.is_lead:
            unchanged = ("max_steps", "output_dir", "resume_from_checkpoint", "overwrite_output_dir", "log_every",
                         "save_every", "keep_last", "dist_timeout_s")
            changed = sorted(k for k, v in self.cfg.flat().items()
                             if k not in unchanged and saved["config"].get(k, v) != v)
            if changed:
                warn(f"resuming with changed settings ({', '.join(changed)}): the run will not match an "
                     f"uninterrupted one")
        return saved

    def _restore(self, folder: Path, saved: dict[str, Any]) -> None:
        """Everything but the weights (loaded with the models): optimizer, counters, buffer, data
        position, metrics so far, and last this rank's random generators."""
        self.resumed_from = self.step = saved["step"]
        self.first_generation_step = saved["generated_through_step"] + 1
        if self.layout.is_learner:
            group = self.groups.learners if self.groups is not None else None
            with phase("checkpoint load"):
                ckpt.load_optimizer(folder / "optimizer", self.policy, self.optimizer, group)
            self.optimizer_steps, self.skipped_steps = saved["optimizer_steps"], saved["skipped_steps"]
        if self.has_rollout:
            self.weight_version = saved["weight_version"]
        mine = ckpt.read_json(folder / "rank_states.json")[str(self.layout.rank)]
        if self.has_rollout:
            self.prompts.seek(**mine["prompt_stream"])
        if self.layout.is_lead:
            buffers = ckpt.read_tensors(folder / "sample_buffer.safetensors")
            self.pool.pending = SampleBatch.from_named_tensors(buffers, "pool", saved["group_size"])
            if saved["collected_ahead_row"] is not None:
                self.collected_ahead = (SampleBatch.from_named_tensors(buffers, "ahead", saved["group_size"]),
                                        saved["collected_ahead_row"])
            self.alarms.restore(saved["alarms"])
            self.train_rewards_since_val = saved["train_rewards_since_val"]
            shutil.copyfile(folder / "metrics.csv", self.out_dir / "metrics.csv")  # drops rows after the checkpoint
        self.plat.set_rng_state(mine["rng"])

    def train(self) -> None:
        if self.layout.is_learner:
            self.run_learner()
        else:
            self.run_rollout()


def prepare_output_dir(cfg: Config, *, create: bool, resuming: bool) -> Path:
    """Refuse to overwrite checkpoints (every rank checks; only ``create`` changes anything)."""
    out = Path(cfg.run.output_dir)
    existing = ckpt.complete_steps(out / "checkpoints") + ckpt.incomplete_steps(out / "checkpoints")
    if existing and not cfg.run.overwrite_output_dir and not resuming:
        raise UserError(f"output_dir {out} already holds checkpoints; pass --resume_from_checkpoint auto to continue "
                        f"or --overwrite_output_dir true to start over")
    if not create:
        return out
    if cfg.run.overwrite_output_dir and not resuming:
        for stale in (out / "checkpoints", out / "metrics.csv"):
            if stale.is_dir():
                shutil.rmtree(stale)
            elif stale.exists():
                stale.unlink()
    ckpt.remove_partial_saves(out / "checkpoints")
    out.mkdir(parents=True, exist_ok=True)
    return out


def find_resume_checkpoint(cfg: Config, *, lead: bool) -> Optional[Path]:
    """The step folder to continue from, or None for a fresh start.

    After torchrun restarts a crashed job (TORCHELASTIC_RESTART_COUNT > 0) the run continues
    from its own newest checkpoint by itself, whatever it was told; until it has one, from what
    it was told (a PATH into another run, say).
    """
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    specs = (["auto"] if restarted else []) + ([cfg.run.resume_from_checkpoint] if cfg.run.resume_from_checkpoint
                                               else [])
    root = Path(cfg.run.output_dir) / "checkpoints"
    for spec in dict.fromkeys(specs):  # in order, without repeats
        try:
            folder = ckpt.find_checkpoint(root, spec, warn if lead else (lambda message: None))
        except ckpt.CheckpointError as error:
            raise UserError(str(error)) from None
        if folder is not None:
            if lead:
                log(f"resuming from {folder}")
            return folder
    if specs and lead:
        log(f"no complete checkpoint in {root}: starting fresh")
    return None


def main(argv: list[str]) -> int:
    groups = None
    try:
        cfg = load_config(argv)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        derived = Derived.of(cfg, world_size)
        layout = Layout(world_size=world_size, rank=int(os.environ.get("RANK", "0")),
                        num_learners=derived.num_learner_ranks)
        if cfg.data.val_dataset is None and cfg.run.val_every and layout.is_lead:
            warn("no val_dataset: validation is off")
        plat = select_platform(cfg.run.device, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # weight-loading bars would bury the training log
        if layout.is_lead:
            for message in warnings_for(cfg):
                warn(message)
        resume = find_resume_checkpoint(cfg, lead=layout.is_lead)
        prepare_output_dir(cfg, create=layout.is_lead, resuming=cfg.run.resume_from_checkpoint is not None
                           or resume is not None)
        role = "rollout+learner" if world_size == 1 else layout.role + (" (lead)" if layout.is_lead else "")
        log(f"rank {layout.rank}/{world_size} role={role} pid={os.getpid()} device={plat.device} "
            f"backend={plat.backend}")
        if world_size > 1:
            report_phase_on_sigterm(layout.rank)
            plat.bind()
            groups = init_world(layout, plat.backend, cfg.run.dist_timeout_s)
        seed_everything(cfg.run.seed + layout.rank)
        trainer = Trainer(cfg, plat, derived, layout, groups, resume)  # checks the inputs before anything is written
        if layout.is_lead and trainer.resumed_from >= cfg.run.max_steps:
            log(f"the checkpoint is at step {trainer.resumed_from}, max_steps is {cfg.run.max_steps}: nothing to train")
        if layout.is_lead:
            out = Path(cfg.run.output_dir)
            (out / "config.yaml").write_text(cfg.to_yaml())
            write_env_report(out / "env_report.json", plat, world_size)
        trainer.train()
        if groups is not None:
            with phase("shutdown"):
                dist.barrier()  # ranks that finish early must not tear down gloo pairs others still use
    except (ConfigError, UserError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    except (PhaseError, ckpt.CheckpointError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    finally:
        if groups is not None:
            dist.destroy_process_group()  # an exit with live gloo groups can abort after success
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
