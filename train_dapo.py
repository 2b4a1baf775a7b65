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

import ckpt
import dapo_loss
from config import Config, ConfigError, Derived, load_config, warnings_for
from device import DTYPES, Platform, seed_everything, select_platform, write_env_report
from metrics import AlarmMonitor, MetricsWriter, console_line
from rollout import GroupPool, RolloutWorker, SampleBatch, keep_informative, make_reward_source


class UserError(Exception):
    """Bad input that ends the run with one line on stderr and exit status 2."""


def log(message: str) -> None:
    print(message, flush=True)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


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

    def next(self) -> list[int]:
        if self.cursor == len(self._batches):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._batches = self._plan()
        batch = self._batches[self.cursor]
        self.cursor += 1
        return batch


class Trainer:
    """Rollout and learning in one process (world size 1).

    Override points (article 4.1):

    - ``compute_advantages(batch) -> Tensor[N]``: one advantage per response. The default is
      DAPO's group-relative advantage, normalised within each prompt's group.
    - ``update_policy(batch, advantages) -> dict``: one training step on the step's samples;
      returns metrics for metrics.csv (keys among metrics.COLUMNS).
    """

    def __init__(self, cfg: Config, plat: Platform, derived: Derived) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from data_prep import DataError, load_prompts

        self.cfg, self.plat, self.derived = cfg, plat, derived
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

        torch.manual_seed(cfg.run.seed)
        self.policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                           local_files_only=True).to(plat.device)
        if cfg.model.gradient_checkpointing:
            # transformers renamed the switch; take whichever this version has.
            enable = getattr(self.policy, "activation_checkpointing_enable", None) or \
                self.policy.gradient_checkpointing_enable
            enable()
        self.policy.config.use_cache = False
        self.rollout_model = self._rollout_copy(self.policy)
        self.ref_model = None
        if self.kl_coef_at(0) > 0 or cfg.algo.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.optim.learning_rate, betas=(0.9, 0.999),
                                           weight_decay=cfg.optim.weight_decay)
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.weight_version = 0
        self.step = 0

        stop_ids = sorted({self.tokenizer.eos_token_id, *cfg.model.eos_token_ids})
        self.worker = RolloutWorker(
            self.rollout_model, self.tokenizer, make_reward_source(cfg.model.reward_fn, cfg.model.reward_model, plat.device),
            device=plat.device, stop_ids=stop_ids, max_response_length=cfg.rollout.max_response_length,
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
            overlong_buffer_len=cfg.algo.overlong_buffer_len, overlong_penalty_factor=cfg.algo.overlong_penalty_factor,
            bucket_size=cfg.data.bucket_size,
        )
        self.prompts = PromptStream([len(p) for p in self.train_set.prompt_ids], cfg.rollout.prompts_per_step,
                                    cfg.data.bucket_size, cfg.run.seed)
        self.pool = GroupPool()
        self.alarms = AlarmMonitor(length_rising_steps=cfg.run.length_alarm_steps,
                                   overfit_checks=cfg.run.overfit_alarm_checks)
        self.metrics = MetricsWriter(self.out_dir / "metrics.csv")
        self.train_rewards_since_val: list[float] = []

    # ----- precision and weights -------------------------------------------------------------

    def _rollout_copy(self, policy: torch.nn.Module) -> torch.nn.Module:
        dtype = self.cfg.model.rollout_dtype
        if dtype == "fp8":
            raise UserError("rollout_dtype fp8 is not supported yet in this build; use bf16 or fp32")
        model = copy.deepcopy(policy).to(DTYPES[dtype]).eval().requires_grad_(False)
        model.config.use_cache = True
        return model

    def sync_weights(self) -> None:
        """Hand the learner's new weights to the rollout copy (in-process: a tensor copy)."""
        with torch.no_grad():
            for dst, src in zip(self.rollout_model.parameters(), self.policy.parameters()):
                dst.copy_(src)
        self.weight_version += 1

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

    # ----- rollout ---------------------------------------------------------------------------

    def collect_step_batch(self) -> tuple[SampleBatch, dict[str, Any]]:
        """Generate until ``prompts_per_step`` informative groups are pooled (REFERENCE.md §3)."""
        cfg = self.cfg
        target = cfg.rollout.prompts_per_step
        carried = self.pool.num_groups
        generated: list[SampleBatch] = []
        malformed = 0
        gen_batches = 0
        while self.pool.num_groups < target:
            limit = cfg.rollout.max_gen_batches
            if limit and gen_batches >= limit:
                raise RuntimeError(
                    f"step {self.step + 1}: only {self.pool.num_groups} of {target} groups were informative after "
                    f"{gen_batches} generation batches (max_gen_batches): every response to the other prompts got "
                    f"the same reward, so the data is too easy or too hard for the current policy")
            rows = self.prompts.next()
            gen_batches += 1
            batch, scored = self.worker.rollout(
                [self.train_set.prompt_ids[r] for r in rows], [self.train_set.prompt_texts[r] for r in rows],
                [self.train_set.answers[r] for r in rows], rows, group_size=cfg.rollout.sample_num,
                version=self.weight_version, generator=step_generator(cfg.run.seed, self.step + 1, gen_batches))
            malformed += scored.num_malformed
            generated.append(batch)
            if cfg.rollout.dynamic_sampling:
                self.pool.add(batch.select_groups(keep_informative(batch, cfg.rollout.dynamic_sampling_metric)))
            else:
                self.pool.add(batch)
        everything = SampleBatch.concat(generated)
        informative = sum(len(keep_informative(b, cfg.rollout.dynamic_sampling_metric)) for b in generated)
        stats = {
            "num_gen_batches": gen_batches,
            "informative_frac": informative / everything.num_groups,
            "carried_groups": carried,
            "reward_malformed": malformed,
            # Generation statistics describe everything sampled, before the dynamic-sampling filter.
            "reward_mean": everything.reward.mean().item(),
            "reward_std": everything.reward.std().item() if everything.reward.numel() > 1 else 0.0,
            "score_mean": everything.score.mean().item(),
            "acc_mean": everything.correct.float().mean().item() if self.worker.reward.has_correct else None,
            "response_length_mean": everything.response_lengths.float().mean().item(),
            "response_length_max": int(everything.response_lengths.max()),
            "truncated_frac": everything.truncated.float().mean().item(),
            "generated_tokens": int(everything.response_lengths.sum()),
        }
        return self.pool.take(target), stats

    @torch.no_grad()
    def validate(self) -> tuple[float, Optional[float]]:
        """Reward and accuracy on the val set (greedy unless val_temperature > 0)."""
        val = self.val_set
        limit = self.cfg.rollout.val_max_prompts or len(val.prompt_ids)
        greedy = self.cfg.rollout.val_temperature == 0
        rewards, correct = [], []
        batch_size = max(1, self.derived.sequences_per_step)
        for start in range(0, limit, batch_size):
            rows = list(range(start, min(limit, start + batch_size)))
            batch, _ = self.worker.rollout(
                [val.prompt_ids[r] for r in rows], [val.prompt_texts[r] for r in rows], [val.answers[r] for r in rows],
                rows, group_size=1, version=self.weight_version, greedy=greedy,
                generator=step_generator(self.cfg.run.seed, -1, self.step, start))
            rewards.append(batch.reward)
            correct.append(batch.correct)
        acc = torch.cat(correct).float().mean().item() if self.worker.reward.has_correct else None
        return torch.cat(rewards).mean().item(), acc

    # ----- learning --------------------------------------------------------------------------

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
    def logprobs_of(self, model: torch.nn.Module, batch: SampleBatch) -> torch.Tensor:
        """[N, R] log-probs for the whole batch, computed micro-batch by micro-batch."""
        out = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
        for rows, part in self.micro_batches(batch, torch.arange(batch.response_ids.shape[0])):
            logp, _ = self.sequence_logprobs(model, part, with_entropy=False)
            out[rows, : logp.shape[1]] = logp.float().cpu()
        return out

    def compute_advantages(self, batch: SampleBatch) -> torch.Tensor:
        """Group-relative advantages, one per response (REFERENCE.md §2)."""
        return dapo_loss.group_advantages(batch.reward, batch.group_size,
                                          norm_by_std=self.cfg.algo.norm_adv_by_std)

    def update_policy(self, batch: SampleBatch, advantages: torch.Tensor) -> dict[str, Any]:
        """Train on the step's samples: mini-batches of optimizer steps, micro-batches of backward."""
        cfg, algo = self.cfg, self.cfg.algo
        self.policy.train()
        old_logp = self.logprobs_of(self.policy, batch)
        ref_logp = self.logprobs_of(self.ref_model, batch) if self.ref_model is not None else None
        mask = batch.response_mask
        gap = (old_logp - batch.rollout_logp).abs()[mask]
        is_weights = None
        if algo.tis_cap > 0:
            is_weights = torch.exp(old_logp - batch.rollout_logp).clamp(max=algo.tis_cap) * mask
        kl_coef = self.kl_coef_at(self.step)
        token_mean = algo.loss_agg_mode == "token-mean"
        sums: dict[str, float] = dict.fromkeys(("policy_loss", "kl", "entropy", "length_penalty", "pg_clipfrac",
                                                "pg_clipfrac_lower", "ppo_kl", "grad_norm"), 0.0)
        minibatches = 0
        n = mask.shape[0]
        for epoch in range(cfg.optim.ppo_epochs):
            order = torch.randperm(n, generator=step_generator(cfg.run.seed, self.step, epoch))
            for rows in order.split(self.derived.minibatch_sequences):
                # The step's loss is normalised by the whole mini-batch's token (or sequence) count,
                # so it does not depend on how the mini-batch is cut into micro-batches.
                normalizer = int(mask[rows].sum()) if token_mean else len(rows)
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
                    share = len(chunk) / len(rows)
                    if ref_logp is not None:
                        kl = dapo_loss.aggregate(dapo_loss.kl_penalty(logp, on_device(ref_logp), algo.kl_type),
                                                 part_mask, algo.loss_agg_mode, normalizer)
                        loss = loss + kl_coef * kl
                        sums["kl"] += kl.item()
                    if algo.length_penalty_coef:
                        # Normalised by the mini-batch's tokens, so the micro-batch terms add up to
                        # the penalty of the whole mini-batch (rho relative to its mean length).
                        penalty = dapo_loss.length_penalty(logp, part_mask, coef=algo.length_penalty_coef,
                                                           normalizer=int(mask[rows].sum()))
                        loss = loss + penalty
                        sums["length_penalty"] += penalty.item()
                    loss.backward()
                    sums["policy_loss"] += pg_loss.item()
                    sums["entropy"] += entropy_term.item()
                    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
                        sums[key] += pg_metrics[key].item() * share
                sums["grad_norm"] += self.optimizer_step()
                minibatches += 1
        result = {k: v / minibatches for k, v in sums.items()}
        if ref_logp is None:
            result["kl"] = None
        result.update(kl_coef=kl_coef, lr=self.lr_at(self.optimizer_steps - 1),
                      mismatch_mean=gap.mean().item() if gap.numel() else 0.0,
                      mismatch_max=gap.max().item() if gap.numel() else 0.0)
        return result

    def optimizer_step(self) -> float:
        """Clip, check and apply the accumulated gradient; a non-finite one is skipped, never applied."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg.optim.grad_clip).item()
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

    # ----- the loop --------------------------------------------------------------------------

    def train_step(self) -> dict[str, Any]:
        start = time.perf_counter()
        batch, row = self.collect_step_batch()
        generated_tokens = row.pop("generated_tokens")
        gen_time = time.perf_counter() - start
        self.plat.release_cache()

        train_start = time.perf_counter()
        self.step += 1
        advantages = self.compute_advantages(batch)
        row.update(self.update_policy(batch, advantages))
        train_time = time.perf_counter() - train_start

        sync_start = time.perf_counter()
        self.sync_weights()
        sync_time = time.perf_counter() - sync_start
        step_time = time.perf_counter() - start
        row.update(step=self.step, optimizer_steps=self.optimizer_steps, skipped_steps=self.skipped_steps,
                   staleness=int(self.weight_version - 1 - batch.version.min()), weight_version=self.weight_version,
                   gen_time_s=gen_time, train_time_s=train_time, sync_time_s=sync_time, step_time_s=step_time,
                   overlap=(gen_time + train_time) / step_time, gen_tokens_per_s=generated_tokens / gen_time)
        return row

    def run_validation(self, row: dict[str, Any]) -> None:
        val_reward, val_acc = self.validate()
        row.update(val_reward_mean=val_reward, val_acc=val_acc)
        if self.train_rewards_since_val:
            train_reward = sum(self.train_rewards_since_val) / len(self.train_rewards_since_val)
            for message in self.alarms.observe_validation(val_reward=val_reward, train_reward=train_reward):
                warn(f"ALARM step {self.step}: {message}")
        self.train_rewards_since_val = []

    def save_checkpoint(self) -> float:
        start = time.perf_counter()

        def contents(folder: Path) -> None:
            self.policy.save_pretrained(folder / "model", safe_serialization=True)
            self.tokenizer.save_pretrained(folder / "model")
            ckpt.write_json(folder / "trainer_state.json", {
                "step": self.step, "weight_version": self.weight_version, "optimizer_steps": self.optimizer_steps,
                "skipped_steps": self.skipped_steps, "kl_coef": self.kl_coef_at(self.step),
                "data_epoch": self.prompts.epoch, "data_cursor": self.prompts.cursor,
            })

        ckpt.save_step(self.out_dir / "checkpoints", self.step, contents, keep_last=self.cfg.run.keep_last)
        return time.perf_counter() - start

    def train(self) -> None:
        cfg = self.cfg.run
        if self.val_set is not None:
            row: dict[str, Any] = {"step": 0}
            self.run_validation(row)
            self.metrics.write(row)
            log(console_line(row))
        while self.step < cfg.max_steps:
            row = self.train_step()
            messages = self.alarms.observe_step(kl=row.get("kl"), length=row["response_length_mean"],
                                                reward_std=row["reward_std"])
            self.train_rewards_since_val.append(row["reward_mean"])
            if self.val_set is not None and cfg.val_every and (self.step % cfg.val_every == 0 or self.step == cfg.max_steps):
                self.run_validation(row)
            if cfg.save_every and (self.step % cfg.save_every == 0 or self.step == cfg.max_steps):
                row["save_time_s"] = self.save_checkpoint()
            row.update(self.alarms.counts)
            for message in messages:
                warn(f"ALARM step {self.step}: {message}")
            self.metrics.write(row)
            if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                log(console_line(row))


def prepare_output_dir(cfg: Config) -> Path:
    out = Path(cfg.run.output_dir)
    existing = ckpt.complete_steps(out / "checkpoints") + ckpt.incomplete_steps(out / "checkpoints")
    if existing and not cfg.run.overwrite_output_dir and not cfg.run.resume_from_checkpoint:
        raise UserError(f"output_dir {out} already holds checkpoints; pass --resume_from_checkpoint auto to continue "
                        f"or --overwrite_output_dir true to start over")
    if cfg.run.overwrite_output_dir:
        for stale in (out / "checkpoints", out / "metrics.csv"):
            if stale.is_dir():
                shutil.rmtree(stale)
            elif stale.exists():
                stale.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return out


def main(argv: list[str]) -> int:
    try:
        cfg = load_config(argv)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size != 1:
            raise UserError(f"this build trains in one process; WORLD_SIZE={world_size} (multi-rank roles are "
                            f"not implemented yet)")
        derived = Derived.of(cfg, world_size)
        if cfg.run.resume_from_checkpoint:
            raise UserError("resume_from_checkpoint is not implemented in this build yet")
        if cfg.data.val_dataset is None and cfg.run.val_every:
            warn("no val_dataset: validation is off")
        plat = select_platform(cfg.run.device)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # weight-loading bars would bury the training log
        for message in warnings_for(cfg):
            warn(message)
        out = prepare_output_dir(cfg)
        log(f"rank 0/{world_size} role=rollout+learner device={plat.device} backend={plat.backend}")
        seed_everything(cfg.run.seed)
        (out / "config.yaml").write_text(cfg.to_yaml())
        write_env_report(out / "env_report.json", plat, world_size)
        Trainer(cfg, plat, derived).train()
    except (ConfigError, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
