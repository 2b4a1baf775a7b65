"""Routing replay (``routing_replay``, R3): the learner routes each token to the experts the
rollout engine chose for it.

Rollout and learner compute the same router on slightly different numbers (rollout dtype, FP8,
kernels), and a near tie between two experts then goes different ways: the token runs through
other experts and its log-prob moves far more than the weights' error alone would move it. With
replay the engine records, per token and MoE layer, the top-k expert ids it ran (the built-in
engine from its router, :class:`RoutingRecorder`; vLLM from ``CompletionOutput.routed_experts``),
the ids travel with the samples, and every learner forward over them (old log-probs, the KL
reference, the update) uses them, :func:`replaying`. Only the choice is replayed: the gate
weights are recomputed from the learner's own router logits at the recorded ids, so the router
still gets its gradient.

Layout of the ids everywhere: ``[rows, sequence, MoE layers, top_k]`` over the concatenated
prompt and response (the columns of the learner's forward), in ``id_dtype`` (uint8 up to 256
experts). A token's own ids are those of the forward that took it as input; a response's last
token never is an input to the engine, and padding positions carry whatever was computed there:
neither reaches a log-prob.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RoutingShape:
    """What one token's routing record holds: ``layers`` MoE layers x ``top_k`` ids, each one of
    ``num_experts``; ``layer_indices`` are those layers' places among all decoder layers."""

    layer_indices: tuple[int, ...]
    top_k: int
    num_experts: int

    @property
    def layers(self) -> int:
        return len(self.layer_indices)

    @property
    def id_dtype(self) -> torch.dtype:
        return id_dtype(self.num_experts)

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.top_k * torch.iinfo(self.id_dtype).bits // 8

    @staticmethod
    def of(model_config: Any) -> Optional["RoutingShape"]:
        """The routing of a Qwen3-MoE config (which layers are sparse, as transformers decides),
        or None for a model without MoE layers."""
        text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        experts = getattr(text, "num_experts", 0) or 0
        if experts <= 0:
            return None
        dense = set(getattr(text, "mlp_only_layers", None) or ())
        step = getattr(text, "decoder_sparse_step", 1) or 1
        layers = tuple(i for i in range(text.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
        return RoutingShape(layer_indices=layers, top_k=text.num_experts_per_tok, num_experts=experts) \
            if layers else None


def id_dtype(num_experts: int) -> torch.dtype:
    """The narrowest dtype holding every expert id (as vLLM stores them: uint8 up to 256)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router (``mlp.gate``: hidden states -> (logits, top-k weights, top-k ids)) of every MoE
    layer, in layer order."""
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]


class RoutingRecorder:
    """The top-k ids each router of ``model`` chose in the latest forward, kept on the device.

    Forward hooks inside :meth:`recording` keep each router's ids; :meth:`take` stacks them as
    ``[rows, tokens, layers, top_k]`` in ``id_dtype`` (on the device: no host read)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = moe_routers(model)
        assert self.routers, "routing is recorded from MoE layers, and this model has none"
        self.dtype = id_dtype(self.routers[0].num_experts)
        self.latest: list[Optional[torch.Tensor]] = [None] * len(self.routers)

    @contextmanager
    def recording(self) -> Iterator[None]:
        handles = [router.register_forward_hook(self._keeper(index)) for index, router in enumerate(self.routers)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.latest = [None] * len(self.routers)

    def _keeper(self, index: int) -> Any:
        def keep(module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, ...]) -> None:
            self.latest[index] = output[2]
        return keep

    def take(self, rows: int) -> torch.Tensor:
        ids = torch.stack(self.latest, dim=1)  # [rows * tokens, layers, top_k]
        return ids.view(rows, -1, *ids.shape[1:]).to(self.dtype)


class Replay:
    """While active (:func:`replaying`): each router of the model routes to the recorded ids;
    ``differs`` [rows, sequence, layers] (with ``measure``) says where the learner's own top-k
    set is another one."""

    def __init__(self, ids: torch.Tensor, measure: bool) -> None:
        self.ids, self.measure = ids, measure
        self.layer_differs: list[Optional[torch.Tensor]] = [None] * ids.shape[2]

    @property
    def differs(self) -> torch.Tensor:
        return torch.stack(self.layer_differs, dim=-1).view(*self.ids.shape[:2], -1)

    def hook(self, index: int, gives_probabilities: bool) -> Any:
        def replay(module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            first, _, own = output
            chosen = self.ids[:, :, index].reshape(-1, self.ids.shape[-1]).long()
            if self.measure:
                self.layer_differs[index] = top_k_differs(own, chosen)
            return first, replayed_weights(first, chosen, module.norm_topk_prob, softmaxed=gives_probabilities), chosen
        return replay


def replayed_weights(logits: torch.Tensor, chosen: torch.Tensor, norm_topk_prob: bool, *,
                     softmaxed: bool = False) -> torch.Tensor:
    """The gate weights of the ``chosen`` experts, as the router computes them for its own top-k:
    softmax over all experts' logits (in float32; ``softmaxed``: ``logits`` are already that, the
    router's first output where gives_probabilities), taken at the chosen ids, renormalised over
    them when the model does so; differentiable in the logits."""
    weights = (logits if softmaxed else F.softmax(logits, dtype=torch.float, dim=-1)).gather(-1, chosen)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


_GIVES_PROBABILITIES: dict[type, bool] = {}


def gives_probabilities(router: torch.nn.Module, text_config: Any) -> bool:
    """Whether ``router``'s first output is its softmax over the experts, not its logits:
    transformers 5.5.4's Qwen3-MoE router returns the probabilities
    (models/qwen3_moe/modeling_qwen3_moe.py:266), later releases the logits. Asked once per class
    of a fresh router on the host, on zero hidden states: logits 0, probabilities 1 / experts."""
    kind = type(router)
    if kind not in _GIVES_PROBABILITIES:
        with torch.device("cpu"), torch.no_grad():
            probe = kind(text_config)
            for parameter in probe.parameters():
                parameter.zero_()
            first = probe(torch.zeros(1, text_config.hidden_size))[0]
        _GIVES_PROBABILITIES[kind] = bool(first.abs().sum() > 0)
    return _GIVES_PROBABILITIES[kind]


def top_k_differs(own: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """[...]: whether two top-k choices ([..., top_k] ids) are different sets (order aside)."""
    return (own.sort(dim=-1).values != recorded.long().sort(dim=-1).values).any(dim=-1)


@contextmanager
def replaying(model: torch.nn.Module, ids: Optional[torch.Tensor], *,
              measure: bool = False) -> Iterator[Optional[Replay]]:
    """Every MoE layer of ``model`` routes the forwards inside the block to ``ids``
    ([rows, sequence, layers, top_k], on the model's device; the rows and sequence of the
    forward's input); None: no replay. The block must hold the backward too where activations
    are recomputed (gradient checkpointing), so the recomputed forward routes the same."""
    if ids is None:
        yield None
        return
    replay = Replay(ids, measure)
    routers = moe_routers(model)
    assert len(routers) == ids.shape[2], f"{ids.shape[2]} layers of recorded routing for {len(routers)} MoE layers"
    text_config = model.config.get_text_config()
    handles = [router.register_forward_hook(replay.hook(index, gives_probabilities(router, text_config)))
               for index, router in enumerate(routers)]
    try:
        yield replay
    finally:
        for handle in handles:
            handle.remove()


def response_disagreement(differs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[2] float: how many (token, layer) routing decisions that bear on the response's log-probs
    differ, and how many there are. ``differs`` [rows, prompt + response, layers]; the decisions
    counted are those at the positions whose outputs predict the response tokens (the prompt's
    last token and every response token but the last), one per real response token."""
    width = response_mask.shape[1]
    predicting = differs[:, -width - 1:-1]  # position t predicts the token at t + 1
    mask = response_mask[..., None].expand_as(predicting)
    return torch.stack([(predicting & mask).sum(), mask.sum()]).float()
