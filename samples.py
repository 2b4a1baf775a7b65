"""The samples that travel from rollout to the learners: responses, rewards and the engine's
log-probs as tensors, one group of ``sample_num`` rows per prompt."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional, Sequence

import torch
import torch.nn.functional as F


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
    # [N, P + R, MoE layers, top_k] uint8 (int16 past 256 experts): the experts each token ran
    # through in the engine, with routing_replay (routing.py); None without
    routed_experts: Optional[torch.Tensor] = None

    @property
    def num_groups(self) -> int:
        return self.prompt_ids.shape[0] // self.group_size

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "group_size" and getattr(self, f.name) is not None}

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
            routed_experts=None if self.routed_experts is None else
            F.pad(self.routed_experts, (0, 0, 0, 0, grow_p, grow_r), value=0),
        )

    @staticmethod
    def concat(batches: Sequence["SampleBatch"]) -> "SampleBatch":
        """Concatenate batches whose widths differ: prompts pad on the left, responses on the right."""
        width_p = max(b.prompt_ids.shape[1] for b in batches)
        width_r = max(b.response_ids.shape[1] for b in batches)
        widened = [b.widen(width_p, width_r) for b in batches]
        first = widened[0]
        return replace(first, **{k: torch.cat([getattr(b, k) for b in widened]) for k in first.tensors()})

    def trimmed(self) -> "SampleBatch":
        """The same rows cut to their own widths (the longest prompt and response among them);
        the rows need not form groups any more (group_size 1)."""
        keep_p = int(self.prompt_mask.any(0).nonzero().min()) if self.prompt_mask.any() else 0
        keep_r = int(self.response_lengths.max())
        width_p = self.prompt_ids.shape[1]
        return replace(self, prompt_ids=self.prompt_ids[:, keep_p:], prompt_mask=self.prompt_mask[:, keep_p:],
                       response_ids=self.response_ids[:, :keep_r], response_mask=self.response_mask[:, :keep_r],
                       rollout_logp=self.rollout_logp[:, :keep_r], group_size=1,
                       routed_experts=None if self.routed_experts is None else
                       self.routed_experts[:, keep_p:width_p + keep_r])

    @staticmethod
    def empty(group_size: int) -> "SampleBatch":
        """No rows: what a rank with no prompts in a generation batch sends."""
        empty = torch.zeros(0, 0)
        return SampleBatch(prompt_ids=empty.long(), prompt_mask=empty.bool(), response_ids=empty.long(),
                           response_mask=empty.bool(), rollout_logp=empty, reward=torch.zeros(0),
                           score=torch.zeros(0), correct=torch.zeros(0, dtype=torch.bool),
                           truncated=torch.zeros(0, dtype=torch.bool), prompt_index=torch.zeros(0, dtype=torch.long),
                           version=torch.zeros(0, dtype=torch.long), group_size=group_size)
