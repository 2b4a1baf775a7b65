"""The built-in rollout engine (``rollout_engine: builtin``): a batched decode loop over a
transformers model with its KV cache, in this process, on the rank's device.

Every row of a call draws from one generator seeded with ``Seeds.batch`` (engine.py), in the
order of the rows, so a row's tokens depend on the rows it shares the call with.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any, Iterable, Optional, Sequence

import torch

from engine import Generation, Sampling, Seeds

try:  # a progress bar is a nicety, not a dependency of the math
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    tqdm = None


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


def _choose_token(logits: torch.Tensor, *, greedy: bool, top_p: float,
                  generator: Optional[torch.Generator]) -> torch.Tensor:
    if greedy:
        return logits.argmax(-1)
    probs = _top_p_filter(logits, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_id: int,
    sampling: Sampling = Sampling(),
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
        logits = out.logits[:, -1, :].float() / sampling.temperature
        logp_all = logits.log_softmax(-1)
        token = _choose_token(logits, greedy=sampling.greedy, top_p=sampling.top_p, generator=generator)
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
    return Generation(response_ids=torch.stack(tokens, dim=1), response_mask=torch.stack(masks, dim=1),
                      logp=torch.stack(logps, dim=1), truncated=~finished)


class BuiltinEngine:
    """The rollout copy of the policy (a transformers model on the rank's device) and the decode
    loop above. ``weights`` (rollout.RolloutWeights) decodes synced weights into the model."""

    def __init__(self, model: torch.nn.Module, weights: Any, *, device: torch.device, stop_ids: Sequence[int],
                 pad_id: int, max_new_tokens: int) -> None:
        self.model = model.eval().requires_grad_(False)
        self.model.config.use_cache = True
        self.weights = weights
        self.weights.bind(self.model)
        self.device, self.stop_ids, self.pad_id, self.max_new_tokens = device, list(stop_ids), pad_id, max_new_tokens

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, sampling: Sampling,
                 seeds: Seeds) -> Generation:
        generator = torch.Generator(device=self.device).manual_seed(seeds.batch)
        gen = generate(self.model, prompt_ids.to(self.device), prompt_mask.to(self.device),
                       max_new_tokens=self.max_new_tokens, stop_ids=self.stop_ids, pad_id=self.pad_id,
                       sampling=sampling, generator=generator, progress=True)
        return Generation(*(t.cpu() for t in (gen.response_ids, gen.response_mask, gen.logp, gen.truncated)))

    def load_weights(self, tensors: Iterable[torch.Tensor]) -> None:
        self.weights.load(tensors, self.device)

    def finish_weights(self) -> None:
        """Nothing to do: each parameter was decoded into the model in place."""

    def memory(self) -> dict[str, Optional[int]]:
        weights = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        return {"weights": weights, "kv_cache": None}  # the cache lives only during a call
