"""The learner's throughput: real tokens a second, the share of computed tokens that were padding,
and model FLOPs utilisation (MFU), per phase of its step (old log-probs, reference, update).

MFU counts model FLOPs as MindSpeed-LLM and Megatron do: 2 x active parameters per token for a
forward, 6 x for forward and backward (recomputed activations, gradient checkpointing, are not
counted again), attention's quadratic term left out; an MoE's active parameters are its dense
ones plus top-k of its experts. It is held against the device's dense bf16 peak: ``peak_tflops``
when set, else PEAK_TFLOPS by the device's name; unknown (the CPU) leaves the column empty.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

PHASES = ("old_logp", "ref", "update")
# Forward (no-grad) or forward and backward: model FLOPs per token and active parameter.
FLOPS_PER_TOKEN_PARAM = {"old_logp": 2, "ref": 2, "update": 6}
# Dense bf16 peaks, TFLOPS, by a piece of the name the device reports (the first that matches):
# Ascend's product briefs for the Atlas 800T A2 modules, NVIDIA's data sheets (SXM, no sparsity).
PEAK_TFLOPS = (("910B1", 414.0), ("910B2", 376.0), ("910B3", 313.0), ("910B4", 280.0), ("910C", 752.0),
               ("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("H20", 148.0), ("A100", 312.0),
               ("A800", 312.0), ("L40S", 362.0))


def peak_tflops(device_name: Optional[str], configured: Optional[float]) -> Optional[float]:
    """The peak the MFU is held against: ``configured`` (peak_tflops), else the table's entry for
    ``device_name``, else None."""
    if configured is not None:
        return configured
    return next((peak for piece, peak in PEAK_TFLOPS if device_name and piece in device_name), None)


def active_parameters(model: torch.nn.Module) -> int:
    """Parameters one token runs through: all but the MoE experts', plus top-k / experts of those
    (whole counts, sharded or not: a DTensor's numel is the whole parameter's)."""
    total = sum(p.numel() for p in model.parameters())
    text = model.config.get_text_config()
    experts, top_k = getattr(text, "num_experts", 0) or 0, getattr(text, "num_experts_per_tok", 0) or 0
    if not experts:
        return total
    expert_params = sum(p.numel() for layer in model.model.layers if hasattr(layer.mlp, "experts")
                        for p in layer.mlp.experts.parameters())
    return total - expert_params + expert_params * top_k // experts


def phase_metrics(tokens: dict[str, tuple[float, float]], seconds: dict[str, float], *, active: int,
                  learners: int, peak: Optional[float]) -> dict[str, Optional[float]]:
    """Per phase with tokens (real, computed; summed over the learners) and its wall ``seconds``:
    {phase}_tokens_per_s, {phase}_padding_frac and {phase}_mfu (None without a peak); a phase that
    did not run (no reference model) has None in all three."""
    row: dict[str, Optional[float]] = {}
    for phase in PHASES:
        real, computed = tokens.get(phase, (0.0, 0.0))
        elapsed = seconds.get(phase)
        ran = computed > 0 and elapsed
        row[f"{phase}_tokens_per_s"] = real / elapsed if ran else None
        row[f"{phase}_padding_frac"] = 1 - real / computed if ran else None
        flops = FLOPS_PER_TOKEN_PARAM[phase] * active * real
        row[f"{phase}_mfu"] = flops / elapsed / (learners * peak * 1e12) if ran and peak else None
    return row


class PhaseMeter:
    """A learner's tokens (real, computed) and wall seconds per phase over one step, counted on
    the host from the samples' masks and the clock: no device value is read. A phase's time ends
    where its results are read anyway (the log-probs copied to the host, the gradient norm)."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.seconds: dict[str, float] = {}

    def reset(self) -> None:
        self.tokens, self.seconds = {}, {}

    def count(self, phase: str, real: int, computed: int) -> None:
        counts = self.tokens.setdefault(phase, [0, 0])
        counts[0] += real
        counts[1] += computed

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def counts(self) -> list[float]:
        """(real, computed) of every phase in PHASES order, flat: what the learners sum."""
        return [float(n) for phase in PHASES for n in self.tokens.get(phase, (0, 0))]

    @staticmethod
    def from_counts(flat: list[float]) -> dict[str, tuple[float, float]]:
        return {phase: (flat[2 * i], flat[2 * i + 1]) for i, phase in enumerate(PHASES)}
