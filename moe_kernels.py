"""Fused MoE experts kernels for platforms without torch's grouped GEMM (NPU): which kernel a
platform's experts run (experts_implementation), their registration in transformers'
ExpertsInterface, and the two forwards, torch_npu's grouped matmul and every expert dense.
Moved out of device.py, which they reach torch_npu through (torch_npu_op)."""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from device import kind_of, torch_npu_op


def experts_implementation(device_type: str) -> str:
    """transformers' kernel for fused MoE experts on a ``device_type`` device (its config's
    ``experts_implementation``; transformers itself picks ``grouped_mm`` on every device).

    ``grouped_mm`` (one grouped GEMM per projection) on CUDA and CPU. On NPU, where torch_npu's
    operator table lists no ``_grouped_mm`` and transformers' ``eager`` loop reads the device
    twice per expert and layer (~12k host waits a 30B forward): torch_npu's grouped matmul
    (NPU_GROUPED_EXPERTS) where torch_npu has it, else every expert on every token
    (DENSE_EXPERTS). Neither waits for the device.
    """
    if kind_of(device_type) != "npu":
        return "grouped_mm"
    _register_experts_kernels()
    return NPU_GROUPED_EXPERTS if _npu_grouped_matmul() is not None else DENSE_EXPERTS


NPU_GROUPED_EXPERTS, DENSE_EXPERTS = "npu_grouped_matmul", "dense"
# The experts kernels transformers ships and builds a model with by name (it accepts "deepgemm"
# too, but experts_implementation never gives it).
TRANSFORMERS_EXPERTS = ("eager", "grouped_mm", "batched_mm")


def use_experts_kernel(model: torch.nn.Module, kernel: str) -> None:
    """``model``'s fused MoE experts run ``kernel`` (experts_implementation's) from their next
    forward: the name goes on the model's config and its sub-configs, which each experts module
    reads at every forward and looks up in transformers' ExpertsInterface, where ours are
    registered (integrations/moe.py, use_experts_implementation). Ours are set on a built
    model, here, because transformers before 5.7 builds one with its own names only, whatever
    the interface holds (modeling_utils.py, get_correct_experts_implementation): a model for
    ours is built with "eager" and given ours here (hf_weights.empty_model)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if kernel != "eager" and kernel not in ALL_EXPERTS_FUNCTIONS:
        raise ValueError(f"experts kernel {kernel!r} is not registered in transformers' ExpertsInterface")
    model.config._experts_implementation = kernel


@functools.lru_cache(maxsize=None)
def _register_experts_kernels() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NPU_GROUPED_EXPERTS, _npu_grouped_experts_forward)
    ExpertsInterface.register(DENSE_EXPERTS, _dense_experts_forward)


def _npu_grouped_matmul() -> Optional[Any]:
    return torch_npu_op("npu_grouped_matmul")


def _in_out(weight: torch.Tensor, is_transposed: bool) -> torch.Tensor:
    """Fused expert weights as [E, in, out] (transformers stores [E, out, in] unless transposed)."""
    return weight if is_transposed else weight.transpose(-2, -1)


def _check_experts(experts: torch.nn.Module) -> None:
    if experts.has_bias or not experts.has_gate:
        raise NotImplementedError(f"{type(experts).__name__}: the NPU experts kernels take gated experts "
                                  "without biases (Qwen3-MoE's)")


class _NpuGroupedMatmul(torch.autograd.Function):
    """Rows of ``x`` [S, K], sorted by expert, times their expert's ``weight`` [E, K, N], with
    ``counts`` [E] (int64, on the device) the rows of each expert: torch_npu's grouped matmul
    in its m-grouped form (split_item 2: one x, one output), and for the weights' gradient its
    k-grouped form (x.T's columns grouped by expert: one [K, N] product per expert, packed), as
    MindSpeed and verl call it for training. The counts stay on the device."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, counts)
        return _npu_grouped_matmul()([x], [weight], group_list=counts, group_type=0, split_item=2,
                                     group_list_type=1)[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, counts = ctx.saved_tensors
        kernel = _npu_grouped_matmul()
        grad_x = kernel([grad], [weight.transpose(-2, -1)], group_list=counts, group_type=0, split_item=2,
                        group_list_type=1)[0]
        grad_weight = kernel([x.transpose(0, 1)], [grad], group_list=counts, group_type=2, split_item=3,
                             group_list_type=1)[0]
        return grad_x, grad_weight.view(weight.shape), None


def _npu_grouped_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                 top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' grouped_mm experts (integrations/moe.py) on torch_npu's grouped matmul; the
    rows per expert counted by a scatter-add (histc takes no integers on every platform)."""
    _check_experts(self)
    tokens, top_k = top_k_index.shape
    expert_of_row, order = torch.sort(top_k_index.reshape(-1), stable=True)
    counts = torch.zeros(self.num_experts, dtype=torch.int64, device=hidden_states.device)
    counts.scatter_add_(0, expert_of_row, torch.ones_like(expert_of_row))
    rows = hidden_states[order // top_k]
    gate_up = _NpuGroupedMatmul.apply(rows, _in_out(self.gate_up_proj, self.is_transposed), counts)
    down = _NpuGroupedMatmul.apply(self._apply_gate(gate_up), _in_out(self.down_proj, self.is_transposed), counts)
    weighted = down * top_k_weights.reshape(-1)[order, None]
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)  # (token, slot) order
    return weighted[back].view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def _dense_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, as W @ x.T (fp8_batched_linear's form), each output times
    its routing weight, zero for the experts a token did not choose: E / top-k times the
    routed FLOPs and [E, tokens, 2I] activations, but no grouped GEMM and no host read."""
    _check_experts(self)
    gate_up = torch.matmul(_in_out(self.gate_up_proj, self.is_transposed).transpose(-2, -1),
                           hidden_states.transpose(0, 1)).transpose(-2, -1)  # [E, T, 2I]
    down = torch.matmul(self._apply_gate(gate_up), _in_out(self.down_proj, self.is_transposed))  # [E, T, H]
    routing = torch.zeros(hidden_states.shape[0], self.num_experts, dtype=top_k_weights.dtype,
                          device=hidden_states.device).scatter_add_(1, top_k_index, top_k_weights)
    return (down * routing.transpose(0, 1)[..., None]).sum(dim=0).to(hidden_states.dtype)
