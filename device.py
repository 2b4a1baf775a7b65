"""The one owner of device, backend, dtype, seeding, RNG state and cache release.

Nothing else in the project names ``cuda`` or ``npu``: callers hold a :class:`Platform` and go
through it. ``torch_npu`` is optional and imported only here, guarded, because on a machine
without CANN a stray torch_npu breaks even ``import torch`` (PLATFORM.md).
"""
from __future__ import annotations

import base64
import importlib
import json
import os
import platform as host
import random
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import numpy as np
import torch

from config import UserError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# FP8 rollout computes in bf16 around its FP8 weights (fp8.py).
ROLLOUT_COMPUTE_DTYPES = {**DTYPES, "fp8": torch.bfloat16}


def _import_torch_npu() -> Optional[ModuleType]:
    try:
        return importlib.import_module("torch_npu")
    except Exception:  # ImportError, or a vendor build that fails without CANN
        return None


@dataclass(frozen=True)
class Platform:
    kind: str  # "npu" | "cuda" | "cpu"
    backend: str  # "hccl" | "nccl" | "gloo"
    local_rank: int = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device(self.kind, self.local_rank)

    @property
    def module(self) -> Any:
        """torch.cuda / torch.npu; None on CPU."""
        return None if self.kind == "cpu" else getattr(torch, self.kind)

    def learner_backend(self, offload: bool) -> str:
        """The learners' group backend: with offload, collectives on host tensors (gradient
        clipping's norm over offloaded gradients) go to gloo, the rest to the device's backend,
        as torchtitan does for CPU offload."""
        return f"{self.kind}:{self.backend},cpu:gloo" if offload and self.kind != "cpu" else self.backend

    def bind(self) -> None:
        """Make this process's accelerator the current one (before any collective)."""
        if self.module is not None:
            self.module.set_device(self.local_rank)

    def memory_bytes(self) -> Optional[int]:
        """This process's device memory, or None on CPU (where the plan needs device_memory_gb)."""
        if self.module is None:
            return None
        return self.module.get_device_properties(self.local_rank).total_memory

    def peak_memory(self) -> dict[str, Optional[int]]:
        """The most this process has held so far, in bytes: host (resident set) and device
        (allocated by torch; None on CPU)."""
        import resource

        host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        device = self.module.max_memory_allocated(self.local_rank) if self.module is not None else None
        return {"host_peak": host, "device_peak": device}

    def synchronize(self) -> None:
        if self.module is not None:
            self.module.synchronize()

    def release_cache(self) -> None:
        """Hand cached blocks back after a rollout (article 5.2: the KV cache otherwise piles up)."""
        if self.module is not None:
            self.module.empty_cache()

    def rng_state(self) -> dict[str, Any]:
        """Every generator this process draws from, as JSON-safe values (checkpoints hold no pickles)."""
        version, internal, gauss = random.getstate()
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state: dict[str, Any] = {
            "python": [version, list(internal), gauss],
            "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
            "torch": _bytes_to_text(torch.get_rng_state()),
        }
        if self.module is not None:
            state["device"] = _bytes_to_text(self.module.get_rng_state())
        return state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(_text_to_bytes(state["torch"]))
        if self.module is not None and "device" in state:
            self.module.set_rng_state(_text_to_bytes(state["device"]))


def _bytes_to_text(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode("ascii")


def _text_to_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def select_platform(requested: str = "auto", local_rank: int = 0) -> Platform:
    """NPU if torch_npu imports and sees a device, else CUDA, else CPU (DESIGN.md); a device asked
    for by name that this machine lacks is a UserError."""
    if requested in ("auto", "npu") and _import_torch_npu() is not None and hasattr(torch, "npu") \
            and torch.npu.is_available():
        return Platform("npu", "hccl", local_rank)
    if requested == "npu":
        raise UserError("device npu: torch_npu is not installed or sees no NPU here (use --device auto or cpu)")
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        return Platform("cuda", "nccl", local_rank)
    if requested == "cuda":
        raise UserError("device cuda: torch sees no CUDA device here (use --device auto or cpu)")
    return Platform("cpu", "gloo", local_rank)


def fp8_linear(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ W.T with W = values * scale[:, None] (FP8 values, one float32 scale per output row).

    Dequantized on the fly, in float32 then rounded once to x's dtype, which works on every
    device. A native scaled FP8 GEMM (torch._scaled_mm on Hopper) would quantize x as well and
    change the numbers; it belongs here, behind this signature, once a GPU run has measured it.
    """
    weight = (values.float() * scale.float().unsqueeze(-1)).to(x.dtype)
    return torch.nn.functional.linear(x, weight)


def experts_implementation(device_type: str) -> str:
    """transformers' kernel for fused MoE experts on a ``device_type`` device (its config's
    ``experts_implementation``; transformers itself picks ``grouped_mm`` on every device).

    ``grouped_mm`` (one grouped GEMM per projection) on CUDA and CPU. ``eager`` (a loop over the
    experts that received tokens) on NPU: torch_npu's operator table lists no ``_grouped_mm``, so
    the first forward there may raise NotImplementedError; eager is the safe path until a run on
    an NPU confirms the grouped kernel.
    """
    return "eager" if device_type == "npu" else "grouped_mm"


def mix_seed(seed: int, *keys: int) -> int:
    """One 63-bit seed from the run's seed and integer keys (step, batch, ...)."""
    mixed = seed
    for key in keys:
        mixed = (mixed * 1_000_003 + key + 1) % (2**63 - 1)
    return mixed


def step_generator(seed: int, *keys: int, device: torch.device = torch.device("cpu")) -> torch.Generator:
    """A generator on ``device`` (where the tensors it draws for live) that depends only on
    (seed, keys): the same draws on every run and resume on that kind of device."""
    return torch.Generator(device=device).manual_seed(mix_seed(seed, *keys))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA/NPU device generator


def _cann_version() -> Optional[str]:
    home = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH")
    candidates = [Path(home)] if home else []
    candidates.append(Path("/usr/local/Ascend/ascend-toolkit/latest"))
    for root in candidates:
        for name in ("version.cfg", "compiler/version.info", "runtime/version.info"):
            info = root / name
            if info.is_file():
                for line in info.read_text(errors="replace").splitlines():
                    if "version" in line.lower() and "=" in line:
                        return line.split("=", 1)[1].strip()
    return None


def _version_of(module_name: str) -> Optional[str]:
    try:
        return importlib.import_module(module_name).__version__
    except Exception:
        return None


def env_report(plat: Platform, world_size: int) -> dict[str, Any]:
    """Everything article 5.1 says to compare first when a new error appears."""
    torch_npu = sys.modules.get("torch_npu")
    collective = None
    if plat.kind == "cuda":
        collective = ".".join(map(str, torch.cuda.nccl.version()))
    elif plat.kind == "npu":
        collective = os.environ.get("HCCL_VERSION") or _cann_version()
    devices = []
    if plat.module is not None:
        devices = [plat.module.get_device_name(i) for i in range(plat.module.device_count())]
    return {
        "python": host.python_version(),
        "torch": torch.__version__,
        "torch_npu": getattr(torch_npu, "__version__", None),
        "cann": _cann_version(),
        "collective_backend": plat.backend,
        "collective_version": collective,
        "transformers": _version_of("transformers"),
        "device": plat.kind,
        "device_count": len(devices) if devices else 1,
        "device_names": devices or [host.processor() or host.machine()],
        "hostname": socket.gethostname(),
        "world_size": world_size,
        "cpu_binding": os.environ.get("DAPO_CPU_BINDING"),  # what launch.sh applied (article 5.3)
    }


def write_env_report(path: Path, plat: Platform, world_size: int) -> None:
    path.write_text(json.dumps(env_report(plat, world_size), indent=2) + "\n")
