"""The seam between a rollout rank and whatever generates its tokens (``rollout_engine``).

A rollout engine turns left-padded prompts into responses and takes new weights; everything
around it (rewards, dynamic sampling, validation, metrics, checkpoints) is the rollout's and does
not know which engine runs. Two engines exist: the built-in decode loop (engine_builtin.py) and
vLLM (engine_vllm.py); rollout.build_engine picks one.

The contract every engine keeps, so that samples mean the same whichever generated them:
- ``logp`` is log-softmax(logits / temperature) of the chosen token, before the top_p cut (what
  the learner recomputes and what TIS and ``engine_mismatch_mean`` compare);
- a response ends at its first stop id (included in the mask) or after ``max_new_tokens``
  (``truncated``); rows past their end hold ``pad_id``, mask False, logp 0;
- draws come from the seeds given: the same request gives the same tokens on every run;
- with routing recorded, ``routed_experts`` holds the experts each token ran through, in
  routing.py's layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol, Sequence

import torch

from device import mix_seed


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn: from softmax(logits / temperature) cut to the top_p nucleus,
    or the most likely one (greedy; the recorded log-probs still use the temperature)."""

    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False


@dataclass(frozen=True)
class Generation:
    response_ids: torch.Tensor  # [N, R]
    response_mask: torch.Tensor  # [N, R] bool, stop token included
    logp: torch.Tensor  # [N, R] float32
    truncated: torch.Tensor  # [N] bool
    # With routing_replay: each MoE layer's top-k expert ids per token, [N, W + R, layers, top_k]
    # over prompt and response (routing.py)
    routed_experts: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class Seeds:
    """Where a generation call's randomness comes from.

    ``batch``: one seed for the whole call; the built-in engine draws every row from one
    generator seeded with it, so its samples depend on which rows share the call (and so on the
    number of rollout ranks). ``per_sample``: one seed per row from (seed, step, generation batch,
    prompt index, sample index), which engines that seed each request use: their samples do not
    depend on batch composition or the number of rollout ranks.
    """

    batch: int
    per_sample: tuple[int, ...]

    @staticmethod
    def of(seed: int, step: int, gen_index: int, batch_key: int, prompt_index: Sequence[int],
           group_size: int) -> "Seeds":
        per_sample = tuple(mix_seed(seed, step, gen_index, prompt, sample)
                           for prompt in prompt_index for sample in range(group_size))
        return Seeds(batch=mix_seed(seed, step, gen_index, batch_key), per_sample=per_sample)


class RolloutEngine(Protocol):
    """What a rollout rank asks of its engine."""

    # How weights travel to this engine (weight_sync.WeightFormat): its ``decode`` hands each
    # parameter to the engine; ``finish_weights`` ends a version.
    weights: Any

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, sampling: Sampling,
                 seeds: Seeds) -> Generation:
        """Responses for left-padded prompts ``[N, W]`` (mask True on real tokens), on the host."""
        ...

    def load_weights(self, tensors: Iterable[torch.Tensor]) -> None:
        """Every parameter whole, in ``weights.names`` order, converted as weight sync converts
        them (the one-process hand-off and a resumed rank's checkpoint read)."""
        ...

    def finish_weights(self) -> None:
        """After the last bucket of a version has been decoded: make it the one generating."""
        ...

    def memory(self) -> dict[str, Optional[int]]:
        """Bytes the engine holds: its weights and its KV cache (None where it cannot say)."""
        ...
