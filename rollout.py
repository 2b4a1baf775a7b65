"""Rollout: batched generation with the KV cache, reward scoring, and DAPO dynamic sampling.

Everything random here draws from an explicit ``torch.Generator`` seeded from (seed, step,
batch), never from the global RNG, so the samples of a step depend only on the weights and the
prompts: that is what makes runs repeatable and resume exact.
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, fields, replace
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

import dapo_loss
from rewards import Scored

try:  # a progress bar is a nicety, not a dependency of the math
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    tqdm = None


@dataclass
class SampleBatch:
    """Responses as tensors, group-contiguous: rows g*G .. g*G+G-1 answer the same prompt.

    Prompts are left-padded to a common width, responses right-padded; the masks mark real
    tokens (the response mask includes the stop token that ended the response).
    """

    prompt_ids: torch.Tensor  # [N, P] long
    prompt_mask: torch.Tensor  # [N, P] bool
    response_ids: torch.Tensor  # [N, R] long
    response_mask: torch.Tensor  # [N, R] bool
    rollout_logp: torch.Tensor  # [N, R] float32: the generating engine's own log-probs
    reward: torch.Tensor  # [N] float32, the score plus overlong shaping
    score: torch.Tensor  # [N] float32, the reward function's raw score
    correct: torch.Tensor  # [N] bool (all False where the reward has no notion of correct)
    truncated: torch.Tensor  # [N] bool: hit max_response_length without a stop token
    prompt_index: torch.Tensor  # [N] long: dataset row of the prompt
    version: torch.Tensor  # [N] long: weight version that generated the response
    group_size: int

    @property
    def num_groups(self) -> int:
        return self.prompt_ids.shape[0] // self.group_size

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "group_size"}

    def named_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The tensors under ``prefix.NAME`` keys, for a safetensors file holding several batches."""
        return {f"{prefix}.{name}": tensor for name, tensor in self.tensors().items()}

    @staticmethod
    def from_named_tensors(tensors: dict[str, torch.Tensor], prefix: str, group_size: int) -> Optional["SampleBatch"]:
        """The batch :meth:`named_tensors` stored under ``prefix``, or None when there is none."""
        mine = {key[len(prefix) + 1:]: value for key, value in tensors.items() if key.startswith(f"{prefix}.")}
        return SampleBatch(**mine, group_size=group_size) if mine else None

    def select_groups(self, groups: Sequence[int]) -> "SampleBatch":
        g = self.group_size
        rows = torch.tensor([r for grp in groups for r in range(grp * g, grp * g + g)], dtype=torch.long)
        return self.select_rows(rows)

    def select_rows(self, rows: torch.Tensor) -> "SampleBatch":
        return replace(self, **{k: v[rows] for k, v in self.tensors().items()})

    def widen(self, width_p: int, width_r: int) -> "SampleBatch":
        """The same samples padded to wider prompts (on the left) and responses (on the right)."""
        grow_p, grow_r = width_p - self.prompt_ids.shape[1], width_r - self.response_ids.shape[1]
        return replace(
            self,
            prompt_ids=F.pad(self.prompt_ids, (grow_p, 0), value=0),
            prompt_mask=F.pad(self.prompt_mask, (grow_p, 0), value=False),
            response_ids=F.pad(self.response_ids, (0, grow_r), value=0),
            response_mask=F.pad(self.response_mask, (0, grow_r), value=False),
            rollout_logp=F.pad(self.rollout_logp, (0, grow_r), value=0.0),
        )

    @staticmethod
    def concat(batches: Sequence["SampleBatch"]) -> "SampleBatch":
        """Concatenate batches whose widths differ: prompts pad on the left, responses on the right."""
        width_p = max(b.prompt_ids.shape[1] for b in batches)
        width_r = max(b.response_ids.shape[1] for b in batches)
        widened = [b.widen(width_p, width_r) for b in batches]
        first = widened[0]
        return replace(first, **{k: torch.cat([getattr(b, k) for b in widened]) for k in first.tensors()})


@dataclass(frozen=True)
class Generation:
    response_ids: torch.Tensor  # [N, R]
    response_mask: torch.Tensor  # [N, R] bool, stop token included
    logp: torch.Tensor  # [N, R] float32
    truncated: torch.Tensor  # [N] bool


def _cache_kwarg(model: torch.nn.Module) -> str:
    # transformers 5 renamed past_key_values to cache; accept either generation of the API.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask out the tail of the distribution beyond cumulative probability top_p (nucleus)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def left_pad(sequences: Sequence[Sequence[int]], width: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq):] = True
    return ids, mask


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: Optional[torch.Generator] = None,
    progress: bool = False,
) -> Generation:
    """Sample up to ``max_new_tokens`` per row with the KV cache; a row ends at its first stop id.

    ``prompt_ids`` are left-padded so every row's next token sits in the last column.
    """
    device = prompt_ids.device
    n = prompt_ids.shape[0]
    attention = prompt_mask.long()
    stop = torch.tensor(sorted(set(stop_ids)), device=device)
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    tokens, logps, masks = [], [], []
    cache_key = _cache_kwarg(model)
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    next_input = prompt_ids
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    steps = range(max_new_tokens)
    if progress and tqdm is not None and sys.stderr.isatty():
        steps = tqdm(steps, desc="generating", leave=False, file=sys.stderr)
    for _ in steps:
        out = model(input_ids=next_input, attention_mask=attention, position_ids=positions,
                    use_cache=True, logits_to_keep=1, **{cache_key: cache})
        logits = out.logits[:, -1, :].float() / temperature
        logp_all = logits.log_softmax(-1)
        if greedy:
            token = logits.argmax(-1)
        else:
            probs = _top_p_filter(logits, top_p).softmax(-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        token = torch.where(finished, torch.full_like(token, pad_id), token)
        tokens.append(token)
        logps.append(logp_all.gather(-1, token[:, None]).squeeze(-1).masked_fill(finished, 0.0))
        masks.append(~finished)
        finished = finished | torch.isin(token, stop)
        if bool(finished.all()):
            break
        next_input = token[:, None]
        attention = torch.cat([attention, torch.ones((n, 1), dtype=attention.dtype, device=device)], dim=-1)
        positions = positions[:, -1:] + 1
    response_mask = torch.stack(masks, dim=1)
    return Generation(
        response_ids=torch.stack(tokens, dim=1),
        response_mask=response_mask,
        logp=torch.stack(logps, dim=1),
        truncated=~finished,
    )


@dataclass(frozen=True)
class RewardSource:
    """Scores decoded responses: a rule (with reference answers) or a reward model."""

    score: Callable[[list[str], list[str], list[Optional[str]]], Scored]  # (prompts, responses, answers)
    has_correct: bool


def shaped_rewards(scored: Scored, lengths: torch.Tensor, *, max_response_length: int,
                   overlong_buffer_len: int, overlong_penalty_factor: float) -> torch.Tensor:
    """The reward function's score plus DAPO's soft overlong punishment (REFERENCE.md §1)."""
    penalty = dapo_loss.overlong_penalty(
        lengths, max_response_length=max_response_length,
        buffer_len=overlong_buffer_len, penalty_factor=overlong_penalty_factor,
    )
    return torch.tensor(scored.scores, dtype=torch.float32) + penalty.float()


def keep_informative(batch: SampleBatch, metric: str) -> list[int]:
    """Indices of groups whose metric is not constant (REFERENCE.md §3)."""
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


def make_reward_source(reward_fn: str, reward_model: Optional[str], device: torch.device) -> RewardSource:
    """A reward model when one is configured (the article's setup), else the named rule."""
    from rewards import RewardModelScorer, resolve_rule, score_with_rule

    if reward_model:
        scorer = RewardModelScorer(reward_model, device=device)
        return RewardSource(lambda prompts, responses, answers: scorer(prompts, responses), has_correct=False)
    rule = resolve_rule(reward_fn)
    return RewardSource(lambda prompts, responses, answers: score_with_rule(rule, responses, answers),
                        has_correct=True)


class RolloutWorker:
    """Turns prompt rows into scored, group-contiguous samples with the rollout copy of the policy."""

    def __init__(self, model: torch.nn.Module, tokenizer, reward: RewardSource, *, device: torch.device,
                 stop_ids: Sequence[int], max_response_length: int, temperature: float, top_p: float,
                 overlong_buffer_len: int, overlong_penalty_factor: float, bucket_size: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.reward = reward
        self.device = device
        self.stop_ids = list(stop_ids)
        self.pad_id = tokenizer.pad_token_id
        self.max_response_length = max_response_length
        self.temperature = temperature
        self.top_p = top_p
        self.overlong_buffer_len = overlong_buffer_len
        self.overlong_penalty_factor = overlong_penalty_factor
        self.bucket_size = bucket_size

    def rollout(self, prompt_ids: Sequence[Sequence[int]], prompt_texts: Sequence[str],
                answers: Sequence[Optional[str]], prompt_index: Sequence[int], *, group_size: int,
                version: int, generator: Optional[torch.Generator], greedy: bool = False) -> tuple[SampleBatch, Scored]:
        """Generate ``group_size`` responses for each prompt and score them."""
        from data_prep import bucket_bound

        repeat = lambda seq: [item for item in seq for _ in range(group_size)]  # noqa: E731
        rows = repeat(prompt_ids)
        # Pad to the bucket's bound, not the batch's own maximum, so generation sees few distinct
        # shapes (article 3.3: static-shape friendly on NPU).
        width = bucket_bound(max(len(r) for r in rows), self.bucket_size)
        ids, mask = left_pad(rows, width, self.pad_id)
        gen = generate(
            self.model, ids.to(self.device), mask.to(self.device),
            max_new_tokens=self.max_response_length, stop_ids=self.stop_ids, pad_id=self.pad_id,
            temperature=self.temperature, top_p=self.top_p, greedy=greedy, generator=generator, progress=True,
        )
        gen = Generation(*(t.cpu() for t in (gen.response_ids, gen.response_mask, gen.logp, gen.truncated)))
        texts = self.decode(gen.response_ids, gen.response_mask)
        scored = self.reward.score(repeat(prompt_texts), texts, repeat(answers))
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
        )
        return batch, scored

    def decode(self, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        """Response text without the stop token and padding, as reward functions expect."""
        texts = []
        for ids, mask in zip(response_ids.tolist(), response_mask.tolist()):
            kept = [t for t, m in zip(ids, mask) if m and t not in self.stop_ids]
            texts.append(self.tokenizer.decode(kept, skip_special_tokens=True))
        return texts
