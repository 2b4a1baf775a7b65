"""The built-in rollout engine (``rollout_engine: builtin``): a batched decode loop over a
transformers model, in this process, on the rank's device.

The loop (issue 22): the KV cache and the attention mask are allocated once per engine and the
responses once per call (kv_cache.py), so no tensor grows with the step; the host reads the
device once every ``rollout_stop_check_every`` steps, to learn whether every row has stopped,
and there compacts finished rows out of the batch; the decode step may run compiled
(``rollout_compile``).

Every step draws one uniform number per row of the call from one generator seeded with
``Seeds.batch`` (engine.py), so a row's tokens depend on its place in the call and the call's
size, not on which rows are still decoding.
"""
from __future__ import annotations

import sys
from contextlib import nullcontext
from typing import Any, Iterable, Optional, Sequence

import torch

from engine import Generation, Sampling, Seeds
from kv_cache import KVCache, attended_lengths, attending_through_cache
from routing import RoutingRecorder

try:  # a progress bar is a nicety, not a dependency of the math
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    tqdm = None


# The sampler sums probabilities in integers, in units of 2**-40 (a float's scaling by a power of
# two is exact): a float cumulative sum on CUDA has no deterministic kernel, and raises under
# run.deterministic, where an integer one is exact in any order. A token below 2**-41 gets no
# share, far below the 2**-24 a float32 uniform draw resolves.
PROBABILITY_UNITS = 2 ** 40


def _probability_units(probs: torch.Tensor) -> torch.Tensor:
    return (probs * PROBABILITY_UNITS).round().to(torch.int64)


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask out the tail of the distribution beyond cumulative probability top_p (nucleus)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_units = _probability_units(sorted_logits.softmax(-1))
    # keep the token that crosses top_p
    drop_sorted = sorted_units.cumsum(-1) - sorted_units >= round(top_p * PROBABILITY_UNITS)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _choose_token(logits: torch.Tensor, *, greedy: bool, top_p: float, generator: Optional[torch.Generator],
                  rows: Optional[torch.Tensor] = None, batch_rows: Optional[int] = None) -> torch.Tensor:
    """The next token of each row: the most likely, or where the row's uniform draw falls in its
    cumulative (top_p-cut) distribution. One draw per row of the whole call (``batch_rows``;
    ``rows``: which of them these logits belong to), so a row's tokens do not depend on which
    rows are still decoding when finished ones are compacted out."""
    if greedy:
        return logits.argmax(-1)
    cumulative = _probability_units(_top_p_filter(logits, top_p).softmax(-1)).cumsum(-1)
    uniform = torch.rand(batch_rows or logits.shape[0], generator=generator, device=logits.device)
    if rows is not None:
        uniform = uniform[rows]
    # cumulative[-1] is PROBABILITY_UNITS up to rounding: scaling by it keeps every draw inside the
    # distribution; right=True skips tokens of probability 0 (flat steps of the cumulative sum)
    target = (uniform * cumulative[:, -1]).to(torch.int64).unsqueeze(-1)
    token = torch.searchsorted(cumulative, target, right=True).squeeze(-1)
    return token.clamp_(max=logits.shape[-1] - 1)


class _Decoder:
    """The model's forward passes over its :class:`kv_cache.KVCache` (``cache``, reused by every
    call): the prompt once, then one token per row per step, compiled (``compile_mode``) or
    eager. Each returns the next-token logits and, with ``record_routing``, the expert ids its
    tokens were routed to ([rows, tokens, layers, top_k], routing.py), else None.

    A compiled step is specialised on its rows and attended length (kv_cache.attended_length),
    so the distinct step shapes of a run number (row counts) x (attended lengths): the row counts
    of the calls and, below the largest, the powers of two compaction leaves; the attended
    lengths of the cache's storage (kv_cache.attended_lengths, 28 for 4,096 positions).
    ``step_shapes`` is that bound for the storage reserved, with two row counts of calls (a
    training batch and a smaller last validation batch)."""

    def __init__(self, model: torch.nn.Module, compile_mode: Optional[str], record_routing: bool = False) -> None:
        self.model = model
        self.recorder = RoutingRecorder(model) if record_routing else None
        self.compiled = compile_mode is not None
        self.step = self._step if compile_mode is None else _compiled(self._step, compile_mode)
        embedding = model.get_input_embeddings().weight
        self.cache = KVCache(model.config, dtype=embedding.dtype, device=embedding.device)

    def reserve(self, rows: int, length: int) -> None:
        """The cache's storage for calls of up to ``rows`` rows and ``length`` positions."""
        self.cache.reserve(rows, length)
        if self.compiled:  # dynamo keeps fewer graphs per function by default
            for limit in ("recompile_limit", "accumulated_recompile_limit"):
                setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), self.step_shapes()))

    def step_shapes(self) -> int:
        rows, length = self.cache.capacity
        return (2 + (rows - 1).bit_length()) * attended_lengths(length)

    def recording(self) -> Any:
        return self.recorder.recording() if self.recorder is not None else nullcontext()

    def prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        out = self.model(input_ids=prompt_ids, attention_mask=self.cache.prefill_mask(prompt_mask),
                         position_ids=positions, use_cache=False, logits_to_keep=1, kv_cache=self.cache)
        return out.logits[:, -1], self._routing(prompt_ids.shape[0])

    def _step(self, token: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        out = self.model(input_ids=token[:, None], attention_mask=self.cache.decode_mask(), position_ids=positions,
                         use_cache=False, logits_to_keep=1, kv_cache=self.cache)
        return out.logits[:, -1], self._routing(token.shape[0])

    def next_token(self, token: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """A decode step, then the cache's column advanced (outside the step, which a compile
        specialises on the attended length, not on the column)."""
        out = self.step(token, positions)
        self.cache.advance()
        return out

    def _routing(self, rows: int) -> Optional[torch.Tensor]:
        return None if self.recorder is None else self.recorder.take(rows)


def _compiled(step: Any, mode: str) -> Any:
    # One graph per step shape (_Decoder's docstring), each specialised: no dynamic shapes.
    return torch.compile(step, mode=None if mode == "default" else mode, dynamic=False)


def _with_progress_bar(steps: range, *, shown: bool) -> Iterable[int]:
    """The decode steps, with a progress bar when ``shown`` and stderr is a terminal."""
    if not shown or tqdm is None or not sys.stderr.isatty():
        return steps
    return tqdm(steps, desc="generating", leave=False, file=sys.stderr)


def _compacted_rows(finished: torch.Tensor, active: int) -> Optional[torch.Tensor]:
    """The rows to go on with when at most half of them are still decoding (the ``active``
    unfinished ones, topped up with finished ones to a power of two, so that compiled shapes
    repeat); else None."""
    size = 1 << max(active - 1, 0).bit_length()
    if size * 2 > finished.numel():
        return None
    order = torch.argsort(finished.to(torch.int8), stable=True)  # unfinished first, in row order
    return order[:size].sort().values


class _Responses:
    """The call's responses, preallocated [rows, max_new_tokens], filled a column per step; with
    routing recorded, the prompt's routing and the responses' [rows, max_new_tokens, layers,
    top_k], kept on the device until the call ends."""

    def __init__(self, rows: int, max_new_tokens: int, pad_id: int, device: torch.device,
                 prompt_routing: Optional[torch.Tensor] = None) -> None:
        self.ids = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
        self.mask = torch.zeros((rows, max_new_tokens), dtype=torch.bool, device=device)
        self.logp = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=device)
        self.prompt_routing = prompt_routing
        self.routing = None if prompt_routing is None else \
            prompt_routing.new_zeros((rows, max_new_tokens, *prompt_routing.shape[2:]))

    def record(self, step: int, rows: torch.Tensor, token: torch.Tensor, logp: torch.Tensor,
               finished: torch.Tensor) -> None:
        self.ids[rows, step] = token
        self.logp[rows, step] = logp.masked_fill(finished, 0.0)
        self.mask[rows, step] = ~finished

    def route(self, step: int, rows: torch.Tensor, routing: Optional[torch.Tensor]) -> None:
        """The experts response token ``step`` of ``rows`` ran through, as the decode step's input."""
        if routing is not None:
            self.routing[rows, step] = routing[:, 0]

    def generation(self, rows: torch.Tensor, finished: torch.Tensor) -> Generation:
        # As many columns as the longest response: where a loop checking every step would end.
        length = int(self.mask.sum(-1).max())
        truncated = torch.zeros(self.ids.shape[0], dtype=torch.bool, device=self.ids.device)
        truncated[rows] = ~finished  # the rows compacted out had finished
        routed = None if self.routing is None else torch.cat([self.prompt_routing, self.routing[:, :length]], dim=1)
        return Generation(response_ids=self.ids[:, :length], response_mask=self.mask[:, :length],
                          logp=self.logp[:, :length], truncated=truncated, routed_experts=routed)


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
    stop_check_every: int = 8,
    compact: bool = True,
    decoder: Optional[_Decoder] = None,
    progress: bool = False,
) -> Generation:
    """Sample up to ``max_new_tokens`` per row; a row ends at its first stop id.

    ``prompt_ids`` are left-padded so every row's next token sits in the last column. The host
    reads whether every row has finished only every ``stop_check_every`` steps (a row's tokens
    after its stop are padding either way); there, with ``compact``, finished rows leave the
    batch once at most half are left (_compacted_rows). A ``decoder`` that records routing adds
    the call's ``routed_experts``.
    """
    assert stop_check_every >= 1, "stop_check_every counts decode steps: at least 1"
    device = prompt_ids.device
    n, width = prompt_ids.shape
    decoder = decoder or _Decoder(model, None)
    decoder.reserve(n, width + max_new_tokens)
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    rows = torch.arange(n, device=device)  # the call's row each batch row is
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    steps = _with_progress_bar(range(max_new_tokens), shown=progress)
    with attending_through_cache(model), decoder.recording():
        logits, routing = decoder.prefill(prompt_ids, prompt_mask, positions)
        responses = _Responses(n, max_new_tokens, pad_id, device, prompt_routing=routing)
        positions = positions[:, -1:]
        for step in steps:
            scaled = logits.float() / sampling.temperature
            token = _choose_token(scaled, greedy=sampling.greedy, top_p=sampling.top_p, generator=generator,
                                  rows=rows, batch_rows=n).masked_fill(finished, pad_id)
            responses.record(step, rows, token, scaled.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1),
                             finished)
            finished = finished | torch.isin(token, stop)
            if step + 1 == max_new_tokens:
                break
            if (step + 1) % stop_check_every == 0:
                active = int((~finished).sum())  # the loop's one host read
                if not active:
                    break
                keep = _compacted_rows(finished, active) if compact else None
                if keep is not None:
                    decoder.cache.keep(keep)
                    rows, finished, token, positions = rows[keep], finished[keep], token[keep], positions[keep]
            positions = positions + 1
            logits, routing = decoder.next_token(token, positions)
            responses.route(step, rows, routing)
    return responses.generation(rows, finished)


class BuiltinEngine:
    """The rollout copy of the policy (a transformers model on the rank's device) and the decode
    loop above. ``weights`` (weight_sync.RolloutWeights) decodes synced weights into the model.
    The KV cache is reserved here for calls of up to ``max_rows`` rows of prompts up to
    ``max_prompt_width`` wide (a call beyond them gets a larger one)."""

    def __init__(self, model: torch.nn.Module, weights: Any, *, device: torch.device, stop_ids: Sequence[int],
                 pad_id: int, max_new_tokens: int, stop_check_every: int = 8,
                 compile_mode: Optional[str] = None, record_routing: bool = False,
                 max_rows: int = 0, max_prompt_width: int = 0) -> None:
        self.model = model.eval().requires_grad_(False)
        self.weights = weights
        self.weights.bind(self.model)
        self.device, self.stop_ids, self.pad_id, self.max_new_tokens = device, list(stop_ids), pad_id, max_new_tokens
        self.stop_check_every = stop_check_every
        self.decoder = _Decoder(self.model, compile_mode, record_routing)
        if max_rows:
            self.decoder.reserve(max_rows, max_prompt_width + max_new_tokens)

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, sampling: Sampling,
                 seeds: Seeds) -> Generation:
        generator = torch.Generator(device=self.device).manual_seed(seeds.batch)
        gen = generate(self.model, prompt_ids.to(self.device), prompt_mask.to(self.device),
                       max_new_tokens=self.max_new_tokens, stop_ids=self.stop_ids, pad_id=self.pad_id,
                       sampling=sampling, generator=generator, stop_check_every=self.stop_check_every,
                       decoder=self.decoder, progress=True)
        routed = None if gen.routed_experts is None else gen.routed_experts.cpu()
        return Generation(*(t.cpu() for t in (gen.response_ids, gen.response_mask, gen.logp, gen.truncated)),
                          routed_experts=routed)

    def load_weights(self, tensors: Iterable[torch.Tensor]) -> None:
        self.weights.load(tensors, self.device)

    def finish_weights(self) -> None:
        """Nothing to do: each parameter was decoded into the model in place."""

    def memory(self) -> dict[str, Optional[int]]:
        weights = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        return {"weights": weights, "kv_cache": self.decoder.cache.nbytes()}
