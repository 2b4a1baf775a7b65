"""Host reads counted on the CPU: every way a value computed on an accelerator comes back to
the host, where the host waits for every kernel queued before it. On a CPU nothing waits, so
the count is the only way a CPU test sees such a wait; it does not depend on the machine.

Two kinds of read, seen two ways:
- aten ops that hand a value to Python (``item()``, ``float()``, ``int()``, ``bool()``, an index
  taken from a tensor) or whose output size depends on the data (``nonzero``, ``masked_select``,
  ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``, a boolean-mask index,
  ``histc`` over the data's own range): the dispatcher sees them, whoever calls them;
- reads the CPU does without the dispatcher (``tolist()``, ``numpy()``, ``repr()``) and copies to
  the host, which are no-ops on a host tensor (``cpu()``, ``to()`` a CPU device): Tensor's Python
  methods are replaced while counting, and a call counts when project code makes it (a test's own
  reads, and torch's and libraries' Python around them, do not)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

ROOT = Path(__file__).resolve().parents[1]
TORCH = Path(torch.__file__).resolve().parent
aten = torch.ops.aten

# Ops that return a host value, or whose output's size is read from the data.
VALUE_OPS = {aten._local_scalar_dense.default: "item", aten.is_nonzero.default: "item", aten.equal.default: "equal",
             aten.allclose.default: "equal"}
SIZED_BY_DATA = {aten.nonzero: "nonzero", aten.masked_select: "masked_select", aten._unique: "unique",
                 aten._unique2: "unique", aten.unique_dim: "unique", aten.unique_consecutive: "unique",
                 aten.unique_dim_consecutive: "unique", aten.bincount: "bincount"}
INDEXING = (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_)
# Tensor methods that read or copy to the host without the dispatcher on a CPU.
PYTHON_READS = ("tolist", "numpy", "__repr__", "cpu", "to")


def aten_read(func, args: tuple, kwargs: dict) -> Optional[str]:
    """The kind of host read an aten call makes, or None."""
    packet = func.overloadpacket
    if func in VALUE_OPS:
        return VALUE_OPS[func]
    if packet in SIZED_BY_DATA:
        return SIZED_BY_DATA[packet]
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave"
    if packet is aten.histc and _histc_range(args, kwargs) == (0, 0):
        return "histc"  # no range given: the kernel reads the data's min and max
    if packet in INDEXING and any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
                                  for t in (args[1] if len(args) > 1 else kwargs["indices"])):
        return "boolean mask"
    return None


def _histc_range(args: tuple, kwargs: dict) -> tuple[float, float]:
    low = args[2] if len(args) > 2 else kwargs.get("min", 0)
    high = args[3] if len(args) > 3 else kwargs.get("max", 0)
    return low, high


def _to_the_host(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` waits for a CPU device: names one (or a tensor on one),
    blocking. On a CPU test the platform's device is one too: a blocking copy to an accelerator
    also waits for its stream, so it counts as well."""
    if kwargs.get("non_blocking", next((a for a in args if isinstance(a, bool)), False)):
        return False  # no wait (the value is read later, after a wait that is counted)
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, torch.Tensor):
        target = target.device
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


def project_caller(project: Path) -> Optional[str]:
    """'file:line' of the code in ``project`` (its modules, not its subfolders) calling into torch
    here, or None when the nearest caller outside torch and this file is a test or a library."""
    frame = sys._getframe(1)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if not (path.is_relative_to(TORCH) or path == Path(__file__)):
            return f"{path.name}:{frame.f_lineno}" if path.parent == project else None
        frame = frame.f_back
    return None


class HostReads(TorchDispatchMode):
    """Notes each host read made while it is entered and ``active`` in ``reads``, as (kind, where):
    where is 'file:line' of the project code for the Python methods, 'aten' for dispatched ops.
    ``of_model_values_only``: count only reads of values computed from a tensor that requires grad
    (the forward, the loss, the metrics), not of a batch's own host tensors, which a device run
    reads without waiting. ``project``: the folder whose modules are the project's code."""

    def __init__(self, *, of_model_values_only: bool = False, project: Path = ROOT) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []
        self.active = True
        self.of_model_values_only, self.project = of_model_values_only, project
        self._inside_a_read = False  # repr() reads with tolist(): one read
        self._computed = WeakIdKeyDictionary()
        self._replaced: dict[str, Callable] = {}

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.reads]

    def _counts(self, tensors: Iterable) -> bool:
        return self.active and (not self.of_model_values_only or any(
            isinstance(t, torch.Tensor) and (t.requires_grad or t in self._computed) for t in tensors))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        counts = not self._inside_a_read and self._counts(inputs)
        if counts and (kind := aten_read(func, args, kwargs)):
            self.reads.append((kind, "aten"))
        out = func(*args, **kwargs)
        if self.of_model_values_only and any(t.requires_grad or t in self._computed for t in inputs):
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    self._computed[tensor] = True
        return out

    def __enter__(self):
        for name in PYTHON_READS:
            self._replaced[name] = original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._noting(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._replaced.items():
            setattr(torch.Tensor, name, original)
        self._replaced.clear()
        return super().__exit__(*exc)

    def _noting(self, name: str, original: Callable) -> Callable:
        def noted(tensor, *args, **kwargs):
            if self._inside_a_read:
                return original(tensor, *args, **kwargs)
            if (name != "to" or _to_the_host(args, kwargs)) and self._counts([tensor]):
                if where := project_caller(self.project):
                    self.reads.append((name.strip("_"), where))
            self._inside_a_read = True
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._inside_a_read = False
        return noted
