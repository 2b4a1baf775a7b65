"""FP8 rollout weights (article 3.1): the rollout copy of the policy stores the weights of its
linear layers and fused experts as ``float8_e4m3fn`` with one float32 scale per output channel,
and multiplies with them through :func:`fp8_kernels.fp8_linear`. On platforms without float8 kernels
(NPU: device.FP8_AS_CODES) the same values are stored as their e4m3 codes in uint8.

Why per output channel, not the 128 x 128 blocks of published FP8 checkpoints: the FP8 values
convert exactly to the compute dtype and a per-row scale is then one multiply per output element
of the matmul (fp8_kernels.fp8_linear); block scales pay off with native block-scaled FP8 GEMM
kernels, which this path does not use. The error is measured (tests/test_fp8.py, README):
per-channel e4m3 keeps ~2 significant digits of each weight relative to its row's largest.

What stays in the rollout dtype (bf16): embeddings, norms, the router (its top-k choices are
what a small error would flip) and the lm_head (the sampling distribution itself).
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import nn

from fp8_kernels import (FP8_DENSE_EXPERTS_FIRST, fp8_batched_linear, fp8_grouped_linear, fp8_linear, fp8_values,
                         fp8_values_as)
from moe_kernels import experts_implementation

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize(weight: torch.Tensor, stored_on: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, float32 scales of shape weight.shape[:-1]): weight ~= values * scales[..., None].

    Each output channel (row) is scaled so its largest magnitude maps to FP8_MAX; an all-zero
    row gets scale 1, so it stays exactly zero instead of dividing by zero. The values are
    stored as the device type ``stored_on`` (default: the weight's) stores FP8 values.
    """
    amax = weight.detach().abs().amax(dim=-1).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = (weight.detach().float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return fp8_values(scaled, stored_on or weight.device.type), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (fp8_values_as(values, torch.float32) * scale.unsqueeze(-1)).to(dtype)


class Fp8Weight(nn.Module):
    """A weight held as FP8 values and per-row scales (buffers: no gradient, no optimizer)."""

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("values", values)
        self.register_buffer("scale", scale)
        self.compute_dtype = compute_dtype

    def load(self, weight: torch.Tensor) -> None:
        """Quantize a full-precision weight into the existing buffers (weight sync)."""
        values, scale = quantize(weight.to(self.values.device))
        self.values.copy_(values)
        self.scale.copy_(scale)


class Fp8Linear(nn.Module):
    """nn.Linear without bias whose weight is an :class:`Fp8Weight`."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype, stored_on: Optional[str] = None) -> None:
        super().__init__()
        assert linear.bias is None, "Qwen3 linear layers have no bias"
        self.weight = Fp8Weight(*quantize(linear.weight, stored_on), compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight.values, self.weight.scale)


# Where a platform has no grouped GEMM for FP8 experts (NPU: moe_kernels.experts_implementation is not grouped_mm),
# the experts run "dense" up to this many (token, expert) pairs, tokens x experts: every expert
# on every token, E / top-k times the FLOPs of the routed computation (16x for Qwen3-30B-A3B's
# 128 experts, top-8) and [E, T, 3I + H] activations (285 MB at 30B-A3B's sizes and 256 tokens),
# but each expert's weights are read once and nothing is read on the host. A decode step's
# matmuls are bound by reading the weights, so the extra FLOPs cost little there; beyond it (a
# prefill) the 16x would not, and the experts run "host": one host read per layer (how many
# tokens each expert has), then one matmul per expert that has tokens.
# The CPU runs "dense" up to it too (beyond it, "grouped"; fp8_kernels.FP8_DENSE_EXPERTS_FIRST): FP8
# decode ran 1.45x faster so on bench/decode.py's model (16 rows; 2.20 s -> 1.52 s for 32 tokens).
DENSE_MAX_PAIRS = 32768


class Fp8Experts(nn.Module):
    """Qwen3-MoE's fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) in FP8, routed as
    transformers' grouped_mm experts are: the (token, expert) pairs sorted by expert, one grouped
    GEMM per projection over all the layer's experts (fp8_kernels.fp8_grouped_linear), the pairs'
    outputs times their routing weights summed per token. Everything stays on the device: no
    host read, no per-expert loop, the same number of kernels whatever the number of experts.
    Where there is no grouped GEMM, "dense" or "host"; on the CPU "dense" or "grouped"
    (DENSE_MAX_PAIRS; the CPU's dense matmuls go by parts of the weights' bytes, not experts)."""

    implementation: Optional[str] = None  # "grouped", "dense", "host"; None: the platform's choice

    def __init__(self, experts: nn.Module, compute_dtype: torch.dtype, stored_on: Optional[str] = None) -> None:
        super().__init__()
        self.num_experts, self.act_fn = experts.num_experts, experts.act_fn
        self.gate_up_proj = Fp8Weight(*quantize(experts.gate_up_proj, stored_on), compute_dtype)
        self.down_proj = Fp8Weight(*quantize(experts.down_proj, stored_on), compute_dtype)

    def path(self, tokens: int, device_type: str) -> str:
        if self.implementation is not None:
            return self.implementation
        dense = tokens * self.num_experts <= DENSE_MAX_PAIRS
        grouped = experts_implementation(device_type) == "grouped_mm"
        if grouped and not (dense and device_type in FP8_DENSE_EXPERTS_FIRST):
            return "grouped"
        return "dense" if dense else "host"

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        path = self.path(hidden_states.shape[0], hidden_states.device.type)
        if path == "dense":
            return self._dense(hidden_states, top_k_index, top_k_weights)
        return self._sorted(hidden_states, top_k_index, top_k_weights, host=path == "host")

    def _sorted(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                host: bool) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        expert_of_row, order = torch.sort(top_k_index.reshape(-1), stable=True)  # pair order: by expert
        rows = hidden_states[order // top_k]
        if host:
            # counted by a scatter-add: bincount reads its input's largest value on the host too
            per_expert = torch.zeros(self.num_experts, dtype=torch.long, device=expert_of_row.device)
            offsets, counts = None, per_expert.scatter_add_(0, expert_of_row, torch.ones_like(expert_of_row)).tolist()
        else:
            # histc, not bincount, whose CUDA kernel reads its input's largest value on the host;
            # histc counts floats on the CPU, integers elsewhere (as transformers' grouped_mm experts)
            counted = expert_of_row.float() if hidden_states.device.type == "cpu" else expert_of_row.int()
            per_expert = torch.histc(counted, bins=self.num_experts, min=0, max=self.num_experts - 1)
            offsets, counts = torch.cumsum(per_expert, 0, dtype=torch.int32), None
        gate_up = fp8_grouped_linear(rows, self.gate_up_proj.values, self.gate_up_proj.scale, offsets,
                                     expert_of_row, counts=counts)
        gate, up = gate_up.chunk(2, dim=-1)
        down = fp8_grouped_linear(self.act_fn(gate) * up, self.down_proj.values, self.down_proj.scale, offsets,
                                  expert_of_row, row_weight=top_k_weights.reshape(-1)[order], counts=counts)
        pairs = torch.empty_like(down)
        pairs[order] = down  # back to (token, slot) order
        return pairs.view(tokens, top_k, -1).sum(dim=1)

    def _dense(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:
        gate, up = fp8_batched_linear(hidden_states, self.gate_up_proj.values, self.gate_up_proj.scale).chunk(2, -1)
        down = fp8_batched_linear(self.act_fn(gate) * up, self.down_proj.values, None)  # [E, T, H], unscaled
        tokens = torch.arange(hidden_states.shape[0], device=hidden_states.device)[:, None]
        pairs = down[top_k_index, tokens]  # [T, top-k, H]: each token's chosen experts
        # the output scales and routing weights, in float32, as fp8_grouped_linear applies them
        pairs.mul_(self.down_proj.scale[top_k_index] * top_k_weights[..., None])
        return pairs.sum(dim=1)


def _targets(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not name.endswith("lm_head"):
            yield name, module, "weight"
        elif type(module).__name__.endswith("Experts") and hasattr(module, "gate_up_proj"):
            yield name, module, "gate_up_proj"
            yield name, module, "down_proj"


def fp8_parameter_names(model: nn.Module) -> set[str]:
    """Names (as in ``named_parameters`` of the full-precision policy) of what FP8 rollout stores in FP8."""
    return {f"{name}.{parameter}" for name, _, parameter in _targets(model)}


def convert_to_fp8(model: nn.Module, compute_dtype: torch.dtype, stored_on: Optional[str] = None) -> nn.Module:
    """Replace, in place, every linear layer but the lm_head and every fused-experts block by its
    FP8 form; the rest is cast to ``compute_dtype``. Works one module at a time, so the model
    never exists in full precision and FP8 at once. ``stored_on``: the device type the model
    will live on, where that is not where it is now (built on meta)."""
    replaced: dict[str, nn.Module] = {}
    for name, module, _ in list(_targets(model)):
        if name not in replaced:
            replaced[name] = (Fp8Linear(module, compute_dtype, stored_on) if isinstance(module, nn.Linear)
                              else Fp8Experts(module, compute_dtype, stored_on))
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, replaced[name])
    for parameter in model.parameters():
        parameter.data = parameter.data.to(compute_dtype)
    return model


def fp8_slot(model: nn.Module, parameter_name: str) -> Fp8Weight:
    """The FP8 weight of a converted model that holds the policy's ``parameter_name``."""
    module, _, attribute = parameter_name.rpartition(".")
    holder = model.get_submodule(module)
    return holder.weight if attribute == "weight" else getattr(holder, attribute)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer: what the rollout copy holds in memory."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
