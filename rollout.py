"""The rollout side: generation through the rollout engine (engine.py), reward scoring, the
prompt stream, validation, taking new weights, and DAPO dynamic sampling (on the lead learner,
over every rollout rank's samples).

Everything random in generation draws from seeds derived from (seed, step, batch, ...)
(engine.Seeds), never from the global RNG, so the samples of a step depend only on the weights
and the prompts: that is what makes runs repeatable and resume exact.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

import ckpt
import dapo_loss
from buckets import bucket_bound, bucketed_batches
from config import Config, Derived, RolloutConfig, UserError
from device import Platform, RolloutDtype, decode_compile_mode
from engine import RolloutEngine, Sampling, Seeds
from fp8 import convert_to_fp8
from hf_weights import WeightFiles, empty_model
from ranks import Layout, phase
from rewards import Scored
from routing import RoutingShape
from samples import SampleBatch
from weight_sync import RolloutWeights, WeightBroadcast, vllm_weights


def left_pad(sequences: Sequence[Sequence[int]], width: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq):] = True
    return ids, mask


def _model_stop_ids(model, tokenizer) -> list[int]:
    """A model's own stop tokens (its generation config's EOS and the tokenizer's), for the tools
    that sample a model folder without a run's Config (stop_ids below reads the Config's)."""
    configured = model.generation_config.eos_token_id
    configured = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    return sorted((set(configured) | {tokenizer.eos_token_id}) - {None})


def generate_responses(model, tokenizer, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int,
                       do_sample: bool, temperature: float = 1.0, top_p: float = 1.0,
                       batch_size: int = 64) -> list[tuple[list[int], bool]]:
    """Per prompt: (response token ids before the first stop token, whether a stop token came):
    data_prep's reward-check and the demo's warm start (demo_model.py) sample through it.

    Uses the trainer's own decode loop (engine_builtin.generate); sampling draws from the global
    torch RNG, so seed it first for repeatable samples.
    """
    from engine_builtin import generate

    stop_ids = _model_stop_ids(model, tokenizer)
    results: list[tuple[list[int], bool]] = []
    was_training = model.training
    model.eval()
    for start in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[start:start + batch_size]
        ids, mask = left_pad(chunk, max(len(p) for p in chunk), tokenizer.pad_token_id)
        out = generate(model, ids, mask, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                       pad_id=tokenizer.pad_token_id,
                       sampling=Sampling(temperature=temperature, top_p=top_p, greedy=not do_sample))
        for row, row_mask, truncated in zip(out.response_ids.tolist(), out.response_mask.tolist(),
                                            out.truncated.tolist()):
            kept = row[:sum(row_mask)]
            results.append((kept if truncated else kept[:-1], not truncated))
    model.train(was_training)
    return results


@dataclass(frozen=True)
class RewardSource:
    """Scores decoded responses: a rule (with reference answers) or a reward model."""

    # (prompts, responses, reference answers, rows' data_prep.RowInfo) -> scores
    score: Callable[[list[str], list[str], list[Optional[str]], list[Any]], Scored]
    has_correct: bool


def shaped_rewards(scored: Scored, lengths: torch.Tensor, *, max_response_length: int,
                   overlong_buffer_len: int, overlong_penalty_factor: float) -> torch.Tensor:
    """The reward function's score plus DAPO's soft overlong punishment (docs/algorithm.md §1)."""
    penalty = dapo_loss.overlong_penalty(
        lengths, max_response_length=max_response_length,
        buffer_len=overlong_buffer_len, penalty_factor=overlong_penalty_factor,
    )
    return torch.tensor(scored.scores, dtype=torch.float32) + penalty.float()


def keep_informative(batch: SampleBatch, metric: str) -> list[int]:
    """Indices of groups whose metric is not constant (docs/algorithm.md §3)."""
    values = batch.correct.float() if metric == "acc" else batch.reward
    return torch.nonzero(dapo_loss.informative_groups(values, batch.group_size)).flatten().tolist()


class GroupPool:
    """Informative groups waiting to be trained on; surplus carries over to the next step."""

    def __init__(self) -> None:
        self.pending: Optional[SampleBatch] = None

    @property
    def num_groups(self) -> int:
        return 0 if self.pending is None else self.pending.num_groups

    def add(self, batch: SampleBatch) -> None:
        if batch.num_groups:
            self.pending = batch if self.pending is None else SampleBatch.concat([self.pending, batch])

    def take(self, groups: int) -> SampleBatch:
        assert self.pending is not None and self.pending.num_groups >= groups, "take() before the pool is full"
        taken = self.pending.select_groups(range(groups))
        rest = self.pending.num_groups - groups
        self.pending = self.pending.select_groups(range(groups, groups + rest)) if rest else None
        return taken


def make_reward_source(reward_fn: str, reward_model: Optional[str], device: torch.device,
                       rollout_dtype: str) -> RewardSource:
    """A reward model when one is configured (the article's setup), in the rollout's compute
    dtype, else the named rule."""
    from rewards import RewardModelScorer, resolve_rule, score_with_rule

    if reward_model:
        scorer = RewardModelScorer.for_rollout(reward_model, rollout_dtype, device)
        return RewardSource(lambda prompts, responses, answers, infos: scorer(prompts, responses), has_correct=False)
    rule = resolve_rule(reward_fn)
    return RewardSource(lambda prompts, responses, answers, infos: score_with_rule(rule, responses, answers, infos),
                        has_correct=True)


def check_rollout_inputs(cfg: Config) -> None:
    """Refuse (UserError) before any model loads what would otherwise stop the rollout later: a
    reward_fn that does not resolve or lacks its package, stop ids the policy can never emit."""
    from rewards import resolve_rule

    if not cfg.model.reward_model:
        resolve_rule(cfg.model.reward_fn)
    model_config = Path(cfg.model.model_path) / "config.json"
    if cfg.model.rollout_tensor_parallel > 1 and model_config.is_file():
        from engine_vllm import tensor_parallel_problem
        from transformers import AutoConfig

        text = AutoConfig.from_pretrained(model_config.parent, local_files_only=True).get_text_config()
        problem = tensor_parallel_problem(cfg.model.rollout_tensor_parallel, text.num_attention_heads,
                                          text.num_key_value_heads or text.num_attention_heads)
        if problem:
            raise UserError(f"rollout_tensor_parallel {cfg.model.rollout_tensor_parallel} {problem} "
                            f"(model_path {cfg.model.model_path}): vLLM splits them evenly over an engine's devices")
    if cfg.model.eos_token_ids and model_config.is_file():  # without one, load_run_inputs names the folder
        from transformers import AutoConfig

        vocab_size = AutoConfig.from_pretrained(model_config.parent, local_files_only=True).get_text_config().vocab_size
        outside = [token for token in cfg.model.eos_token_ids if not 0 <= token < vocab_size]
        if outside:
            raise UserError(f"eos_token_ids: {outside[0]} is outside the vocabulary of model_path "
                            f"{cfg.model.model_path} ({vocab_size} ids, 0 to {vocab_size - 1})")
    if cfg.algo.routing_replay and model_config.is_file():
        from transformers import AutoConfig

        if RoutingShape.of(AutoConfig.from_pretrained(model_config.parent, local_files_only=True)) is None:
            raise UserError(f"routing_replay: model_path {cfg.model.model_path} has no mixture-of-experts layers "
                            f"whose routing could be replayed; set routing_replay false")


def stop_ids(cfg: Config, tokenizer) -> list[int]:
    """The tokens a response ends at: the tokenizer's EOS and ``eos_token_ids``."""
    return sorted({tokenizer.eos_token_id, *cfg.model.eos_token_ids})


def check_engine(cfg: Config, plat: Platform) -> None:
    """Refuse (UserError) a rollout engine this machine cannot run, before anything is written."""
    if cfg.model.rollout_engine == "vllm":
        import engine_vllm

        engine_vllm.check_available(cfg, plat.kind)


def wire_dtype(cfg: Config) -> str:
    """The form weights travel in to this run's engine (RolloutWeights' rollout_dtype)."""
    if cfg.model.rollout_engine == "vllm":
        return RolloutDtype.of(cfg.model.rollout_dtype).vllm_wire
    return cfg.model.rollout_dtype


def build_engine(cfg: Config, plat: Platform, layout: Layout, tokenizer,
                 rollout_copy: Callable[[], torch.nn.Module],
                 learner_weights: Optional[Callable[[], Iterable[torch.Tensor]]] = None,
                 engine_group: Optional[Any] = None) -> RolloutEngine:
    """This rank's rollout engine. ``rollout_copy()`` builds the built-in engine's model: the
    learner's copy in one process, else read from model_path (load_rollout_model). In one
    process ``learner_weights()`` are the learner's weights (a resumed run's), which an engine
    that reads model_path itself then takes. ``engine_group``: a tensor-parallel vLLM engine's
    ranks, where each holds the weights its device's worker reads (ranks.Groups.engine)."""
    settings = dict(stop_ids=stop_ids(cfg, tokenizer), pad_id=tokenizer.pad_token_id,
                    max_new_tokens=cfg.rollout.max_response_length)
    # The most sequences one call has: the engine's share of a step's prompts, each sample_num
    # times (a validation batch is as large, Rollout.val_batch_size).
    sequences = math.ceil(cfg.rollout.prompts_per_step / layout.num_engines) * cfg.rollout.sample_num
    if cfg.model.rollout_engine == "vllm":
        from transformers import AutoConfig

        from engine_vllm import VllmEngine

        import memory_plan

        model_config = AutoConfig.from_pretrained(cfg.model.model_path, local_files_only=True)
        derived = Derived.of(cfg, layout.world_size)
        planned = memory_plan.rollout_rank(cfg, derived, memory_plan.Architecture.of(model_config))
        device_memory = int(cfg.run.device_memory_gb * 2**30) if cfg.run.device_memory_gb else plat.memory_bytes()
        engine = VllmEngine(cfg, plat, layout, RolloutWeights(model_config, wire_dtype(cfg)), planned=planned,
                            sequences=sequences, device_memory=device_memory,
                            routing=RoutingShape.of(model_config) if cfg.algo.routing_replay else None,
                            group=engine_group, **settings)
        if learner_weights is not None:
            engine.load_weights(learner_weights())
        return engine
    from engine_builtin import BuiltinEngine

    model = rollout_copy()
    return BuiltinEngine(model, RolloutWeights(model.config, cfg.model.rollout_dtype), device=plat.device,
                         stop_check_every=cfg.rollout.rollout_stop_check_every,
                         compile_mode=decode_compile_mode(plat.kind, cfg.rollout.rollout_compile,
                                                          RolloutDtype.of(cfg.model.rollout_dtype).compute),
                         record_routing=cfg.algo.routing_replay, max_rows=sequences,
                         max_prompt_width=bucket_bound(cfg.data.max_prompt_length, cfg.data.bucket_size), **settings)


def engine_device_copy(cfg: Config, plat: Platform, layout: Layout, engine_group: Any) -> Any:
    """A rank of a tensor-parallel vLLM engine other than its engine rank, whose device's worker
    reads the weights from this rank (IPC): the weight format that holds each bucket here and
    hands its handle to the engine rank (weight_sync.IpcWeights without an engine)."""
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(cfg.model.model_path, local_files_only=True)
    return vllm_weights(RolloutWeights(model_config, wire_dtype(cfg)), None, plat, layout,
                        cfg.run.weight_sync_bucket_mb * 2**20, engine_group)


class RolloutWorker:
    """Turns prompt rows into scored, group-contiguous samples through the rollout engine."""

    def __init__(self, engine: RolloutEngine, tokenizer, reward: RewardSource, *, stop_ids: Sequence[int],
                 max_response_length: int, sampling: Sampling, overlong_buffer_len: int,
                 overlong_penalty_factor: float, bucket_size: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.reward = reward
        self.stop_ids = list(stop_ids)
        self.pad_id = tokenizer.pad_token_id
        self.max_response_length = max_response_length
        self.sampling = sampling
        self.overlong_buffer_len = overlong_buffer_len
        self.overlong_penalty_factor = overlong_penalty_factor
        self.bucket_size = bucket_size

    def rollout(self, prompt_ids: Sequence[Sequence[int]], prompt_texts: Sequence[str],
                answers: Sequence[Optional[str]], prompt_index: Sequence[int], *, group_size: int,
                version: int, seeds: Seeds, sampling: Optional[Sampling] = None,
                infos: Optional[Sequence[Any]] = None) -> tuple[SampleBatch, Scored]:
        """Generate ``group_size`` responses for each prompt and score them (``sampling``: the
        worker's own, for training, unless given; ``infos``: the rows' data_prep.RowInfo)."""
        repeat = lambda seq: [item for item in seq for _ in range(group_size)]  # noqa: E731
        rows = repeat(prompt_ids)
        # Pad to the bucket's bound, not the batch's own maximum, so generation sees few distinct
        # shapes (article 3.3: static-shape friendly on NPU).
        width = bucket_bound(max(len(r) for r in rows), self.bucket_size)
        ids, mask = left_pad(rows, width, self.pad_id)
        gen = self.engine.generate(ids, mask, sampling=sampling or self.sampling, seeds=seeds)
        texts = self.decode(gen.response_ids, gen.response_mask)
        scored = self.reward.score(repeat(prompt_texts), texts, repeat(answers), repeat(infos or [None] * len(answers)))
        lengths = gen.response_mask.sum(-1)
        reward = shaped_rewards(scored, lengths, max_response_length=self.max_response_length,
                                overlong_buffer_len=self.overlong_buffer_len,
                                overlong_penalty_factor=self.overlong_penalty_factor)
        n = len(rows)
        correct = torch.tensor(scored.correct if scored.correct is not None else [False] * n, dtype=torch.bool)
        batch = SampleBatch(
            prompt_ids=ids, prompt_mask=mask, response_ids=gen.response_ids, response_mask=gen.response_mask,
            rollout_logp=gen.logp, reward=reward, score=torch.tensor(scored.scores, dtype=torch.float32),
            correct=correct, truncated=gen.truncated,
            prompt_index=torch.tensor(repeat(prompt_index), dtype=torch.long),
            version=torch.full((n,), version, dtype=torch.long), group_size=group_size,
            routed_experts=gen.routed_experts,
        )
        return batch, scored

    def decode(self, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        """Response text without the stop token and padding, as reward functions expect."""
        texts = []
        for ids, mask in zip(response_ids.tolist(), response_mask.tolist()):
            kept = [t for t, m in zip(ids, mask) if m and t not in self.stop_ids]
            texts.append(self.tokenizer.decode(kept, skip_special_tokens=True))
        return texts


class PromptStream:
    """Batches of prompt rows in length-bucketed, seeded order, epoch after epoch.

    Its position (epoch, batch) is all a resume needs to continue without replaying prompts.
    """

    def __init__(self, lengths: list[int], batch_size: int, bucket_size: int, seed: int) -> None:
        self.lengths, self.batch_size, self.bucket_size, self.seed = lengths, batch_size, bucket_size, seed
        self.epoch, self.cursor = 0, 0
        self._batches = self._plan()

    def _plan(self) -> list[list[int]]:
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


class Rollout:
    """The rollout side of a run: a rollout rank, or the rollout half of a one-process run.

    It holds the rollout engine (with its copy of the policy) and the weight version it
    carries, generates its engine's share of every generation batch (prompts are split over
    engines), and validates its share of the val set. A rank of a tensor-parallel engine other
    than its engine rank has no engine (``engine`` None): it keeps the prompt stream's position
    and the weight version as the others do, and its shares are empty. Where its device's
    worker of the engine reads the weights from this rank (IPC), it holds them there
    (``device_copy``, :func:`engine_device_copy`).
    """

    def __init__(self, cfg: Config, plat: Platform, layout: Layout, engine: Optional[RolloutEngine], tokenizer,
                 train_set, val_set, device_copy: Optional[Any] = None) -> None:
        self.cfg, self.plat, self.train_set, self.val_set = cfg, plat, train_set, val_set
        self.engine, self.device_copy = engine, device_copy
        self.shard_index, self.num_shards = layout.engine_index, layout.num_engines
        # Validation prompts go no more at a time than a training generation batch's sequences,
        # whose KV cache the memory plan counts.
        self.val_batch_size = math.ceil(cfg.rollout.prompts_per_step / self.num_shards) * cfg.rollout.sample_num
        self.weight_version = 0
        self.weight_sync = (0.0, 0.0)  # (transfer, load) seconds of the syncs since take_weight_sync
        self.prompts = PromptStream([len(p) for p in train_set.prompt_ids], cfg.rollout.prompts_per_step,
                                    cfg.data.bucket_size, cfg.run.seed)
        if engine is None:
            return
        self.worker = RolloutWorker(
            engine, tokenizer, make_reward_source(cfg.model.reward_fn, cfg.model.reward_model, plat.device,
                                                  cfg.model.rollout_dtype),
            stop_ids=stop_ids(cfg, tokenizer),
            max_response_length=cfg.rollout.max_response_length,
            sampling=Sampling(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p),
            overlong_buffer_len=cfg.algo.overlong_buffer_len,
            overlong_penalty_factor=cfg.algo.overlong_penalty_factor, bucket_size=cfg.data.bucket_size)

    def generate_shard(self, step: int, gen_index: int) -> tuple[Optional[SampleBatch], int, float]:
        """This rank's share of the next generation batch: (samples or None, malformed count, seconds)."""
        start = time.perf_counter()
        mine = self.prompts.next()[self.shard_index::self.num_shards]
        if not mine or self.engine is None:
            return None, 0, time.perf_counter() - start
        data = self.train_set
        batch, scored = self.worker.rollout(
            [data.prompt_ids[r] for r in mine], [data.prompt_texts[r] for r in mine], [data.answers[r] for r in mine],
            mine, group_size=self.cfg.rollout.sample_num, version=self.weight_version, infos=[data.infos[r] for r in mine],
            seeds=Seeds.of(self.cfg.run.seed, step, gen_index, self.shard_index, mine, self.cfg.rollout.sample_num))
        self.plat.release_cache()
        return batch, scored.num_malformed, time.perf_counter() - start

    @torch.no_grad()
    def validation_sums(self) -> list[float]:
        """[reward sum, correct count, prompts] over this rank's share of the val set (greedy unless
        val_temperature > 0)."""
        if self.engine is None:
            return [0.0, 0.0, 0.0]
        val, settings = self.val_set, self.cfg.rollout
        greedy = settings.val_temperature == 0
        sampling = Sampling(temperature=1.0 if greedy else settings.val_temperature, top_p=settings.val_top_p,
                            greedy=greedy)
        limit = settings.val_max_prompts or len(val.prompt_ids)
        mine = list(range(limit))[self.shard_index::self.num_shards]
        sums = [0.0, 0.0, 0.0]
        for start in range(0, len(mine), self.val_batch_size):
            rows = mine[start:start + self.val_batch_size]
            batch, _ = self.worker.rollout(
                [val.prompt_ids[r] for r in rows], [val.prompt_texts[r] for r in rows], [val.answers[r] for r in rows],
                rows, group_size=1, version=self.weight_version, sampling=sampling, infos=[val.infos[r] for r in rows],
                seeds=Seeds.of(self.cfg.run.seed, -1, self.weight_version, start, rows, 1))
            sums = [sums[0] + batch.reward.sum().item(), sums[1] + batch.correct.sum().item(), sums[2] + len(rows)]
        return sums

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[torch.Tensor], version: int) -> None:
        """One process: the learner's weights into the engine, in the form they would travel
        between ranks (so one process and several compute the same): a load, no transfer."""
        start = time.perf_counter()
        self.engine.load_weights(tensors)
        self.weight_version = version
        self._count_weight_sync(0.0, time.perf_counter() - start)

    def load_checkpoint_weights(self, folder: Path, version: int) -> None:
        """A resumed rollout rank: weights ``version`` from a checkpoint's learner shards, read a
        bucket at a time and converted as the weight sync converts them."""
        bucket_bytes = self.cfg.run.weight_sync_bucket_mb * 2**20
        with phase("checkpoint load"):
            if self.engine is not None:
                self.engine.load_weights(ckpt.iter_full_weights(folder, self.engine.weights.names, bucket_bytes))
            elif self.device_copy is not None:  # in step with the engine rank, whose engine reads both copies
                self.device_copy.load(ckpt.iter_full_weights(folder, self.device_copy.names, bucket_bytes))
        self.weight_version = version

    def receive_weights(self, broadcast: Optional[WeightBroadcast]) -> int:
        """A rollout rank: the next weight version from the lead learner, by broadcast. A rank
        that takes no weights (``broadcast`` None: its engine rank takes them) counts it."""
        with phase("weight sync"):
            if broadcast is None:
                version = self.weight_version + 1
            else:
                version = broadcast.receive()
                start = time.perf_counter()
                if self.engine is not None:
                    self.engine.finish_weights()
                transfer, decode = broadcast.seconds
                self._count_weight_sync(transfer, decode + time.perf_counter() - start)
        assert version == self.weight_version + 1, f"weights arrived out of order: v{version} after v{self.weight_version}"
        self.weight_version = version
        return version

    def _count_weight_sync(self, transfer: float, load: float) -> None:
        self.weight_sync = (self.weight_sync[0] + transfer, self.weight_sync[1] + load)

    def take_weight_sync(self) -> tuple[float, float]:
        """The (transfer, load) seconds of the weight syncs since the last call: the broadcast's
        buckets as this rank waited for them, and the engine taking them (decoding, vLLM's reload)."""
        taken, self.weight_sync = self.weight_sync, (0.0, 0.0)
        return taken

    def position(self) -> dict[str, int]:
        """Where this rank is in the prompt stream (saved in every checkpoint)."""
        return {"epoch": self.prompts.epoch, "cursor": self.prompts.cursor}


# (batches, malformed responses, generation seconds, (transfer, load) seconds of the weight syncs before them)
Generated = tuple[list[SampleBatch], int, float, tuple[float, float]]


class DynamicSampler:
    """The lead learner's side of DAPO dynamic sampling (docs/algorithm.md §3): generation batches are
    pooled until ``prompts_per_step`` informative groups are in; surplus groups wait for the next
    step. Every sample not yet trained on lives here, so a checkpoint saves it from here."""

    def __init__(self, cfg: RolloutConfig, metric: str, reports_acc: bool) -> None:
        self.cfg, self.metric, self.reports_acc = cfg, metric, reports_acc
        self.pool = GroupPool()
        self.collected_ahead: Optional[tuple[SampleBatch, dict[str, Any]]] = None  # restored from a checkpoint

    def collect(self, step: int, next_generation: Callable[[int], Generated],
                answer: Callable[[bool], None]) -> tuple[SampleBatch, dict[str, Any]]:
        """The step's batch and its generation statistics. ``next_generation(k)`` brings generation
        batch k of the step; ``answer(full)`` tells the rollout side "next" (full) or "more"."""
        if self.collected_ahead is not None:  # collected before the checkpoint this run resumed from
            collected, self.collected_ahead = self.collected_ahead, None
            return collected
        cfg, target = self.cfg, self.cfg.prompts_per_step
        carried, generated = self.pool.num_groups, []
        malformed, gen_time, gen_batches, informative, transfer, load = 0, 0.0, 0, 0, 0.0, 0.0
        while True:
            gen_batches += 1
            pieces, bad, seconds, (sync_transfer, sync_load) = next_generation(gen_batches)
            malformed, gen_time = malformed + bad, gen_time + seconds
            transfer, load = transfer + sync_transfer, load + sync_load
            for batch in pieces:
                generated.append(batch)
                groups = keep_informative(batch, self.metric)
                informative += len(groups)
                self.pool.add(batch.select_groups(groups) if cfg.dynamic_sampling else batch)
            full = self.pool.num_groups >= target
            if not full and cfg.max_gen_batches and gen_batches >= cfg.max_gen_batches:
                raise UserError(
                    f"step {step}: only {self.pool.num_groups} of {target} groups were informative after "
                    f"{gen_batches} generation batches (max_gen_batches): every response to the other prompts got "
                    f"the same reward, so the data is too easy or too hard for the current policy")
            answer(full)
            if full:
                break
        stats = self.generation_stats(generated, informative=informative, malformed=malformed, gen_time=gen_time)
        stats.update(num_gen_batches=gen_batches, carried_groups=carried, weight_transfer_s=transfer, weight_load_s=load)
        return self.pool.take(target), stats

    def generation_stats(self, generated: list[SampleBatch], *, informative: int, malformed: int,
                         gen_time: float) -> dict[str, Any]:
        """What was sampled (``informative`` of its groups), before the dynamic-sampling filter."""
        everything = SampleBatch.concat(generated)
        return {
            "informative_frac": informative / everything.num_groups,
            "reward_malformed": malformed,
            "reward_mean": everything.reward.mean().item(),
            "reward_std": everything.reward.std().item() if everything.reward.numel() > 1 else 0.0,
            "score_mean": everything.score.mean().item(),
            "acc_mean": everything.correct.float().mean().item() if self.reports_acc else None,
            "response_length_mean": everything.response_lengths.float().mean().item(),
            "response_length_max": int(everything.response_lengths.max()),
            "truncated_frac": everything.truncated.float().mean().item(),
            "gen_time_s": gen_time,
            "gen_tokens_per_s": int(everything.response_lengths.sum()) / max(gen_time, 1e-9),
        }

    def buffers(self, collected: Optional[tuple[SampleBatch, dict[str, Any]]]) -> dict[str, torch.Tensor]:
        """The samples a checkpoint keeps: surplus groups, and the next step's batch when rollout ran ahead."""
        buffers = self.pool.pending.named_tensors("pool") if self.pool.pending else {}
        if collected is not None:
            buffers.update(collected[0].named_tensors("ahead"))
        return buffers

    def restore(self, buffers: dict[str, torch.Tensor], group_size: int, ahead_row: Optional[dict[str, Any]]) -> None:
        self.pool.pending = SampleBatch.from_named_tensors(buffers, "pool", group_size)
        if ahead_row is not None:
            self.collected_ahead = (SampleBatch.from_named_tensors(buffers, "ahead", group_size), ahead_row)


def build_rollout_model(path: Path, rollout_dtype: str, device: Any) -> torch.nn.Module:
    """The rollout copy's architecture (FP8-converted for fp8 rollout) with storage on ``device``
    and no weights yet."""
    dtype = RolloutDtype.of(rollout_dtype)
    to_fp8 = (lambda model: convert_to_fp8(model, dtype.compute, torch.device(device).type)) if dtype.fp8_weights \
        else None
    return empty_model(path, device, dtype.compute, to_fp8)


def load_rollout_model(path: Path, rollout_dtype: str, device: torch.device) -> torch.nn.Module:
    """A rollout rank's copy of the policy, read from the files one parameter at a time and
    converted as weight sync converts what it sends (FP8: quantized on the host): neither the
    host nor the device ever holds the model in full precision."""
    model = build_rollout_model(path, rollout_dtype, device)
    weights = RolloutWeights(model.config, rollout_dtype)
    weights.bind(model)
    files = WeightFiles(path)
    weights.load((files.rows(name, shape, 0, shape[0]) for name, shape in zip(weights.names, weights.shapes)),
                 device)
    return model
