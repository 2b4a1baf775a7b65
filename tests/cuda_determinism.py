"""The ops a CUDA device refuses under ``torch.use_deterministic_algorithms(True)`` (run.deterministic),
seen on the CPU, which runs them: torch's list of ops that raise there (the docstring of
use_deterministic_algorithms), less histc, which transformers' and our experts call with integers
on a device (the CPU's kernel takes floats only) and which has a deterministic kernel for those."""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
REFUSED = {aten.nll_loss_forward: "nll_loss", aten.nll_loss2d_forward: "nll_loss", aten.put_: "put_",
           aten.put: "put", aten._ctc_loss: "ctc_loss", aten.max_unpool2d: "max_unpool", aten.max_unpool3d: "max_unpool"}


def refused_on_cuda(func, args: tuple, kwargs: dict, out) -> Optional[str]:
    """Why a CUDA device would refuse this aten call with deterministic algorithms on, or None."""
    packet = func.overloadpacket
    if packet in REFUSED:
        return REFUSED[packet]
    if packet in (aten.cumsum, aten.cumsum_) and (out.dtype.is_floating_point or out.dtype.is_complex):
        return f"cumsum of {out.dtype}"
    if packet is aten.bincount and (args[1] if len(args) > 1 else kwargs.get("weights")) is not None:
        return "bincount with weights"
    if func is aten.median.dim or func is aten.nanmedian.dim:
        return "median with indices"
    if packet in (aten.scatter_reduce, aten.scatter_reduce_) and (args[3] if len(args) > 3 else kwargs["reduce"]) == "prod":
        return "scatter_reduce prod"
    return None


class RefusedOnCuda(TorchDispatchMode):
    """Notes, while entered, each op a CUDA device would refuse under deterministic algorithms."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (why := refused_on_cuda(func, args, kwargs, out)) is not None:
            self.seen.add(why)
        return out
