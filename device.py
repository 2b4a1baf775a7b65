"""The one owner of device, backend, dtype, seeding, RNG state and cache release.

Nothing else in the project names ``cuda`` or ``npu``: callers hold a :class:`Platform` and go
through it. ``torch_npu`` is optional and imported only here, guarded, because on a machine
without CANN a stray torch_npu breaks even ``import torch`` (docs/platform.md).
"""
from __future__ import annotations

import base64
import functools
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
    """NPU if torch_npu imports and sees a device, else CUDA, else CPU (docs/design.md); a device asked
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


# --- FP8 matmuls -------------------------------------------------------------------------------
# fp8.py holds weights as float8_e4m3fn values V with one float32 scale s per output row:
# W = V * s[:, None]. Every e4m3 value is exactly a bf16 (and fp32) value, so the matmuls below
# convert V, exactly, into one reused workspace in the compute dtype, multiply there, and apply s
# to the matmul's output rows in float32 (y = (x @ V.T) * s, rounded once more to x's dtype):
# the weight-only FP8 scheme of W8A16 kernels, where the scale sits in the epilogue. Against
# multiplying by bf16(V * s) (this build before) that moves where the rounding falls (float
# noise, tests/test_fp8_kernels.py), converts 1 byte per weight instead of building an fp32 and
# then a bf16 copy, and costs one multiply per output instead of one per weight.

# Every platform multiplies this way for now. Not written: a native scaled FP8 GEMM
# (torch._scaled_mm / _scaled_grouped_mm on CUDA sm90+, torch_npu's npu_quant_matmul /
# npu_grouped_matmul). It quantizes the activations to FP8 too, which changes the numbers well
# beyond float noise, and nothing here can measure it (no GPU or NPU run; the CPU has no
# _scaled_grouped_mm). It would go behind fp8_linear's and fp8_grouped_linear's signatures,
# chosen per platform beside FP8_TO_COMPUTE, with these functions as the fallback.

# How FP8 values become compute-dtype values, per platform. "bits" (CPU, bf16): integer ops
# build the bf16 bit patterns, ~10x faster there than torch's float8 conversion, a scalar loop
# on the CPU. "cast": torch's conversion (CUDA: a native kernel; NPU: the conversion this build
# has always done there, as values.float() before).
FP8_TO_COMPUTE = {"cpu": "bits", "cuda": "cast", "npu": "cast"}


# One flat buffer per (device, dtype), as large as the largest FP8 weight converted so far, shared
# by every FP8 layer of the process: layers run one after another, and each matmul has read its
# weight before the next conversion overwrites it (the device runs a stream's kernels in order).
# Its size is one weight, the largest: a layer's fused experts (Qwen3-30B-A3B's gate_up_proj,
# 128 x 1536 x 2048 in bf16: 0.8 GB), never a bf16 copy of the model.
_FP8_WORKSPACE: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def free_fp8_workspace() -> None:
    """Drop the conversion buffers (the next FP8 matmul allocates them again)."""
    _FP8_WORKSPACE.clear()


# What the CPU's bit-level conversion leaves out: its values are V * 2^-120 (below). The matmuls
# apply the factor with the output scales, in float32, instead of a pass over every weight (on
# the CPU, a quarter of the conversion's time); the powers of two cancel exactly, so outputs are
# the same unless a matmul's output falls below bf16's normal range at 2^-120 (an output under
# ~3.5e-5 of its row's largest weight, where bf16 keeps fewer digits).
_BITS_FACTOR = 2.0 ** 120


def _fp8_values_scaled_as(values: torch.Tensor, dtype: torch.dtype, reuse: bool) -> tuple[torch.Tensor, float]:
    """(weight, factor): ``values`` == weight * factor exactly, weight in ``dtype`` in the shared
    workspace (or its own buffer: ``reuse`` False); factor 1 except on the CPU's bf16 path."""
    key, numel = (values.device, dtype), values.numel()
    buffer = _FP8_WORKSPACE.get(key) if reuse else None
    if buffer is None or buffer.numel() < numel:
        if reuse:
            _FP8_WORKSPACE.pop(key, None)  # free the smaller one before allocating
        buffer = torch.empty(numel, dtype=dtype, device=values.device)
        if reuse:
            _FP8_WORKSPACE[key] = buffer
    out = buffer[:numel].view(values.shape)
    if dtype != torch.bfloat16 or FP8_TO_COMPUTE.get(values.device.type) != "bits":
        return out.copy_(values), 1.0
    # e4m3 sign|eeee|mmm -> bf16 sign|0000eeee|mmm0000: the int8 sign-extends into int16, the shift
    # puts e and m under bf16's exponent and mantissa, the mask keeps the sign bit alone above
    # them. That is V * 2^-120 (bf16's exponent bias is 127, e4m3's 7; e = 0, e4m3's subnormals,
    # reads as bf16 subnormals with the same mantissa): _BITS_FACTOR.
    # Not NaN-preserving (e4m3's NaN, 0x7f, reads as 480; quantize() never writes it), and it
    # relies on the CPU not flushing subnormals (torch's default; under
    # torch.set_flush_denormal(True) e4m3's subnormals, |V| < 2^-6, would read as 0).
    # The shift and the mask run on int32 words holding two codes (half the element operations);
    # a code's bits shifted across into its neighbour's lane fall under the neighbour's mask.
    bits = out.view(torch.int16)
    bits.copy_(values.view(torch.int8))
    if numel % 2 == 0:
        bits.view(-1).view(torch.int32).bitwise_left_shift_(4).bitwise_and_(-0x780F7810)  # 0x87f087f0
    else:
        bits.bitwise_left_shift_(4).bitwise_and_(-0x7810)  # 0x87f0
    return out, _BITS_FACTOR


def _reuse_workspace(x: torch.Tensor) -> bool:
    """Whether a matmul on ``x`` may use the shared workspace: not when autograd would keep the
    weight for a backward pass (the next layer overwrites it)."""
    return not (torch.is_grad_enabled() and x.requires_grad)


def fp8_linear(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ W.T with W = values * scale[:, None] (FP8 values, one float32 scale per output row):
    (x @ values.T) in x's dtype, then times the scales in float32, rounded to x's dtype."""
    weight, factor = _fp8_values_scaled_as(values, x.dtype, _reuse_workspace(x))
    return torch.nn.functional.linear(x, weight).mul_(scale if factor == 1.0 else scale * factor)


# Rows of (token, expert) pairs whose output scales are gathered at once: bounds the float32
# [rows, N] gather of a long prefill (S = tokens x top-k) to ~100 MB at N = 1536; a decode step
# is one chunk.
FP8_SCALE_CHUNK_ROWS = 16384


def _scale_rows_(out: torch.Tensor, scale: torch.Tensor, expert_of_row: torch.Tensor,
                 row_weight: Optional[torch.Tensor], factor: float) -> torch.Tensor:
    """out[i] *= scale[expert_of_row[i]] * factor (* row_weight[i]), in float32, rounded to out's dtype."""
    if row_weight is not None:
        row_weight = row_weight.to(scale.dtype)
    for start in range(0, out.shape[0], FP8_SCALE_CHUNK_ROWS):
        part = slice(start, start + FP8_SCALE_CHUNK_ROWS)
        row_factor = scale.index_select(0, expert_of_row[part])
        if factor != 1.0:
            row_factor.mul_(factor)
        if row_weight is not None:
            row_factor.mul_(row_weight[part, None])
        out[part].mul_(row_factor)
    return out


def fp8_grouped_linear(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, offsets: Optional[torch.Tensor],
                       expert_of_row: torch.Tensor, row_weight: Optional[torch.Tensor] = None,
                       counts: Optional[list[int]] = None) -> torch.Tensor:
    """Row i of ``x`` (rows sorted by expert) times its expert's W.T: [S, K] -> [S, N], with
    ``values`` [E, N, K], ``scale`` [E, N], ``offsets`` [E] the int32 end of each expert's rows,
    ``expert_of_row`` [S]; each output row also times ``row_weight`` (the routing weight) if given.

    One grouped GEMM over every expert's converted weights (torch._grouped_mm, through
    transformers' dispatcher: the kernel the bf16 experts run), no host read. With ``counts`` (the
    rows of each expert, read on the host by the caller: platforms without _grouped_mm, long
    prefills), one matmul per expert that has rows instead.
    """
    weight, factor = _fp8_values_scaled_as(values, x.dtype, _reuse_workspace(x))
    if counts is None:
        out = _grouped_mm(x, weight.transpose(-2, -1), offsets)
    else:
        out, start = x.new_empty(x.shape[0], values.shape[1]), 0
        for expert, rows in enumerate(counts):
            if rows:
                out[start:start + rows] = torch.nn.functional.linear(x[start:start + rows], weight[expert])
            start += rows
    return _scale_rows_(out, scale, expert_of_row, row_weight, factor)


# Where converting a whole weight before its matmul spills the cache (the CPU: 2 MiB of L2 a core
# on the machines measured), the batched matmul converts and multiplies the experts in parts of
# at most this many bytes once converted, so that it reads each part from the cache its
# conversion has just written it to. GPUs and NPUs convert with one fused kernel at full
# bandwidth: one part, every expert.
FP8_PART_BYTES = {"cpu": 1 << 20}


def _expert_parts(values: torch.Tensor, dtype: torch.dtype) -> list[tuple[int, int]]:
    """[start, stop) over the experts of ``values`` [E, N, K]: all of them, or parts of at most
    FP8_PART_BYTES once converted to ``dtype`` (one expert each at least)."""
    limit, experts = FP8_PART_BYTES.get(values.device.type), values.shape[0]
    size = experts if limit is None else max(1, limit // (values[0].numel() * dtype.itemsize))
    return [(start, min(start + size, experts)) for start in range(0, experts, size)]


def fp8_batched_linear(x: torch.Tensor, values: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """Every expert's W.T on every row: x [T, K] (the same rows for each expert) or [E, T, K]
    -> [E, T, N], with ``values`` [E, N, K], ``scale`` [E, N] (None: x @ values.T, the scaling
    left to the caller). No grouped GEMM, no host read.

    Computed as W @ x.T ([E, N, T], returned as its [E, T, N] view): with few rows that is one
    matmul of E x N rows over the shared x.T, which the CPU runs ~2x faster than E matmuls of T
    rows (it repacks the second operand, here x, not the weights)."""
    reuse, products = _reuse_workspace(x), []
    for start, stop in _expert_parts(values, x.dtype):
        weight, factor = _fp8_values_scaled_as(values[start:stop], x.dtype, reuse)
        rows = x.transpose(-2, -1) if x.dim() == 2 else x[start:stop].transpose(-2, -1)
        products.append(torch.matmul(weight, rows))
    out = (products[0] if len(products) == 1 else torch.cat(products)).transpose(-2, -1)
    if scale is None:
        return out if factor == 1.0 else out.mul_(factor)
    return out.mul_(scale.unsqueeze(-2) if factor == 1.0 else scale.unsqueeze(-2) * factor)


@functools.lru_cache(maxsize=None)
def _grouped_mm_kernel() -> Any:
    try:  # transformers' dispatcher: torch's grouped kernel or its fallback, as the bf16 experts get
        from transformers.integrations.moe import _grouped_mm
        return _grouped_mm
    except ImportError:  # a transformers without it
        return torch._grouped_mm


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _grouped_mm_kernel()(x, weight, offs=offsets)


# Platforms whose FP8 experts run "dense" (fp8.DENSE_MAX_PAIRS) though they have a grouped GEMM:
# the CPU's is one small matmul per expert, each repacking its expert's weights, where the dense
# path is one matmul per cache-sized part of the converted weights (fp8_batched_linear).
FP8_DENSE_EXPERTS_FIRST = {"cpu"}


def experts_implementation(device_type: str) -> str:
    """transformers' kernel for fused MoE experts on a ``device_type`` device (its config's
    ``experts_implementation``; transformers itself picks ``grouped_mm`` on every device).

    ``grouped_mm`` (one grouped GEMM per projection) on CUDA and CPU. ``eager`` (a loop over the
    experts that received tokens) on NPU: torch_npu's operator table lists no ``_grouped_mm``, so
    the first forward there may raise NotImplementedError; eager is the safe path until a run on
    an NPU confirms the grouped kernel.
    """
    return "eager" if device_type == "npu" else "grouped_mm"


# The built-in engine's decode step under torch.compile (rollout_compile), per platform: the mode
# when compiled, and whether it is compiled when the config says null. CUDA captures the step in
# CUDA graphs: a decode step is hundreds of small kernels whose launches cost more host time than
# the device spends on them (issue 22: ~85 ms against ~20-25 ms at 48 layers). NPU: off until
# measured there. CPU: off, the compile takes longer than the demo's whole rollout saves.
DECODE_COMPILE_MODE = {"cuda": "reduce-overhead", "cpu": "default", "npu": "default"}
DECODE_COMPILE_BY_DEFAULT = {"cuda": True, "cpu": False, "npu": False}


def decode_compile_mode(device_type: str, requested: Optional[bool]) -> Optional[str]:
    """torch.compile's mode for the decode step, or None for eager (another device: off unless asked)."""
    on = DECODE_COMPILE_BY_DEFAULT.get(device_type, False) if requested is None else requested
    return DECODE_COMPILE_MODE.get(device_type, "default") if on else None


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
