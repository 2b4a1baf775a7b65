"""The one owner of device, backend, dtype, seeding, RNG state and cache release.

Nothing else in the project names ``cuda`` or ``npu``: callers hold a :class:`Platform` and go
through it. The FP8 and MoE kernels live beside it (fp8_kernels.py, moe_kernels.py) and import
it, never the other way round; they name torch_npu's operators but reach them through
:func:`torch_npu_op`. ``torch_npu`` is optional and imported only here, guarded, because on a
machine without CANN a stray torch_npu breaks even ``import torch`` (docs/platform.md).
"""
from __future__ import annotations

import base64
import functools
import importlib
import json
import os
import platform as host
import random
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

import numpy as np
import torch

from config import UserError

# The variable that says which devices a process may open (its device i is the list's i-th).
VISIBLE_DEVICES_VARIABLE = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


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

    def device_name(self) -> Optional[str]:
        """The name the accelerator reports (e.g. "NVIDIA H200", "Ascend910B3"); None on the CPU."""
        get_name = getattr(self.module, "get_device_name", None)
        return get_name(self.local_rank) if get_name is not None else None

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

    def memory_held(self) -> Optional[int]:
        """The device memory this process's allocator holds now (reserved, cached blocks
        included: none of it is free to another process), or None on CPU."""
        return None if self.module is None else self.module.memory_reserved(self.local_rank)

    def child_visible_devices(self, count: int = 1) -> dict[str, str]:
        """The environment under which a child process sees this process's device as its device
        0, and alone, or with ``count`` > 1 the next ``count - 1`` of the node after it (the
        devices of a tensor-parallel engine's consecutive ranks): a fresh interpreter otherwise
        opens device 0, whatever rank started it. Composes with a visible-devices list this
        process was started under."""
        name = VISIBLE_DEVICES_VARIABLE.get(self.kind)
        if name is None:
            return {}
        inherited = [entry.strip() for entry in os.environ.get(name, "").split(",") if entry.strip()]
        mine = range(self.local_rank, self.local_rank + count)
        return {name: ",".join(inherited[index] if inherited else str(index) for index in mine)}

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


# Device types that follow another platform's rules: tests/accel_standin.py's stand-in device,
# set there to the platform it imitates (its ACCEL_KIND). Every other device type follows its own.
IMITATED_PLATFORM: dict[str, str] = {}


def kind_of(device_type: str) -> str:
    """The platform ("npu", "cuda", "cpu", ...) whose rules a ``device_type`` device follows
    wherever the project branches per platform (FP8 storage, expert kernels, attention masks)."""
    return IMITATED_PLATFORM.get(device_type, device_type)


# Platforms whose attention takes a bool mask only: torch_npu documents a bool attn_mask for
# scaled_dot_product_attention (its fused kernel), no additive float one. Elsewhere the KV cache
# keeps an additive float mask: the same outputs (equal on the CPU, bit for bit), and on the
# CPU an fp32 decode step's attention took 1.01-1.15x as long with a bool mask (torch's math
# path turns it into an additive one each call; 16-48 rows, 72-256 keys; equal in bf16).
BOOL_ATTENTION_MASKS = {"npu"}


def attention_mask_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of an attention mask over ``dtype`` scores on a ``device_type`` device: bool
    (True: attend) where the platform takes no other, else ``dtype`` (0 or -inf, added)."""
    return torch.bool if kind_of(device_type) in BOOL_ATTENTION_MASKS else dtype


def npu_varlen_attention(device_type: str) -> Optional[Any]:
    """On NPU with torch_npu: transformers' wrapper of torch_npu's fused attention in its varlen
    (TND) form, (q, k, v, cu_seqlens_q, cu_seqlens_k, ...) -> out, which reads the bounds on the
    host; None elsewhere (packing.varlen_attention then runs sdpa a sequence at a time)."""
    if kind_of(device_type) != "npu" or _import_torch_npu() is None:
        return None
    from transformers.integrations.npu_flash_attention import npu_flash_attn_varlen_func

    return npu_flash_attn_varlen_func


def torch_npu_op(name: str) -> Optional[Any]:
    """torch_npu's operator ``name``; None without torch_npu, or where its build has none (the
    kernels elsewhere reach torch_npu through here, which imports it guarded)."""
    return getattr(_import_torch_npu(), name, None)


# --- FP8 storage ---------------------------------------------------------------------------------
# What a platform can hold FP8 weights as: a fact of its kernels, here beside the other dtype facts.
# The FP8 conversions and matmuls that read it are fp8_kernels.py.

# Platforms whose kernels take no float8 tensor: torch_npu's cast and copy kernels have no
# float8 on Atlas A2/A3 (910B), so a float8 device tensor fails at its first copy (loading a
# rollout rank, the lead's first weight sync). FP8 weights live there as their e4m3 bit
# patterns in uint8: written by integer ops (fp8_kernels.fp8_values), sent as the same bytes as
# float8 values elsewhere, and read through a table of the 256 values in the compute dtype
# (index_select by code): exact, where "bits" (fp8_kernels.FP8_TO_COMPUTE) gives V * 2^-120,
# bf16 subnormals for small V, whose products fall below float32's normal range where a kernel
# flushes subnormals.
FP8_AS_CODES = {"npu"}


def fp8_storage_dtype(device_type: str) -> torch.dtype:
    """What FP8 values are stored as on a ``device_type`` device: float8_e4m3fn, or uint8 codes."""
    return torch.uint8 if kind_of(device_type) in FP8_AS_CODES else torch.float8_e4m3fn


# The built-in engine's decode step under torch.compile (rollout_compile), per platform: the mode
# when compiled, and whether it is compiled when the config says null. CUDA captures the step in
# CUDA graphs: a decode step is hundreds of small kernels whose launches cost more host time than
# the device spends on them (issue 22: ~85 ms against ~20-25 ms at 48 layers). NPU: off until
# measured there. CPU: off, the compile takes longer than the demo's whole rollout saves.
DECODE_COMPILE_MODE = {"cuda": "reduce-overhead", "cpu": "default", "npu": "default"}
DECODE_COMPILE_BY_DEFAULT = {"cuda": True, "cpu": False, "npu": False}
# The compute dtypes whose decode step a CUDA graph can hold whole. Under torch.compile transformers'
# grouped_mm experts take torch's grouped GEMM for bf16 weights only; any other dtype goes through
# its fallback op, which reads the experts' row offsets on the host (offs.tolist(), integrations/
# moe.py, 5.5.4 to 5.19): a device-to-host copy during capture, or one routing replayed for every
# token. Those dtypes compile without graphs ("default").
CUDA_GRAPH_DTYPES = (torch.bfloat16,)


# ----- tensors another process of the node opens in place: a rollout rank's weights, read by its
# vLLM engine's workers (weight_sync.IpcWeights, vllm_worker.WeightTransfer) --------------------

def ipc_key(device: torch.device, position: int = 0) -> str:
    """Which copy of a shared bucket a process on ``device`` opens: the device's identity, the
    same in every process of the node whatever devices each sees (CUDA: the GPU's UUID; NPU: the
    chip's number on the node, through ASCEND_RT_VISIBLE_DEVICES). On a CPU every process reaches
    every copy, so the key is ``position``, a rank's place in its engine's group: each
    tensor-parallel worker opens its own rank's copy, as it must on a device."""
    kind = kind_of(device.type)
    index = device.index or 0
    if kind == "cuda":
        return str(torch.cuda.get_device_properties(index).uuid)
    if kind == "npu":
        visible = [entry.strip() for entry in os.environ.get(VISIBLE_DEVICES_VARIABLE["npu"], "").split(",")
                   if entry.strip()]
        return f"npu-{visible[index] if visible else index}"
    return f"host-{position}"


def shareable_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` uint8 that another process of the node can open in place (:func:`ipc_handle`):
    any device memory; on a CPU, shared memory that another process maps by name (torch's
    file_system sharing)."""
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_using_filename_cpu(nbytes))


def ipc_handle(tensor: torch.Tensor) -> tuple:
    """What another process of the node opens the whole storage under ``tensor`` from, without a
    copy (:func:`open_ipc_handle`): torch's rebuild arguments on a device (reduce_tensor, which
    torch_npu replaces with its own on NPU), the shared memory's name on a CPU. It does not keep
    the storage alive: the caller does, until the receiver has copied from it."""
    whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
    if tensor.device.type == "cpu":
        before = whole.data_ptr()
        manager, name, size = whole.untyped_storage()._share_filename_cpu_()
        if whole.data_ptr() != before:  # torch moved it into shared memory: a copy, and a handle to the copy
            raise ValueError("ipc_handle: a CPU tensor must live in a shareable_buffer")
        return manager, name, size
    from torch.multiprocessing import reductions

    _, args = reductions.reduce_tensor(whole)
    return args


def open_ipc_handle(handle: tuple, device: torch.device) -> torch.Tensor:
    """The uint8 storage :func:`ipc_handle` shared, opened in this process on ``device`` (its
    index replaces the sender's: each process numbers the devices it sees from 0)."""
    kind = kind_of(device.type)
    if kind == "cpu":
        return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared_filename_cpu(*handle))
    if kind == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor as rebuild
    else:
        from torch_npu.multiprocessing.reductions import rebuild_npu_tensor as rebuild
    args = list(handle)
    args[6] = device.index or 0  # rebuild's storage_device
    return rebuild(*args)


# verl's gate on NPU IPC (verl/utils/device.py): torch_npu's shared NPU memory needs an Ascend
# driver and a CANN toolkit at least this new; below it the weights go through shared memory.
NPU_IPC_MINIMUM = {"driver": "25.3.RC1", "cann": "8.3.RC1"}


def ascend_version(text: str) -> Optional[tuple[int, ...]]:
    """An Ascend version ("25.3.RC1", "8.3.rc1", "25.5.0", "8.5.0.alpha002") as a tuple that
    orders them: a release candidate before its release, an alpha or beta before both."""
    match = re.match(r"\s*(\d+)\.(\d+)(?:\.(rc|alpha|beta|t)?(\d+))?", text, flags=re.IGNORECASE)
    if match is None:
        return None
    major, minor, stage, number = match.groups()
    rank = {"alpha": 0, "beta": 1, "t": 1, "rc": 2}.get((stage or "").lower(), 3)
    return int(major), int(minor), rank, int(number or 0)


@functools.cache  # one reading a process: every rank asks when it plans its groups and builds its engine
def npu_ipc_problem() -> Optional[str]:
    """Why this node's NPU memory cannot be shared with a vLLM engine's process, or None."""
    return ascend_versions_problem(npu_driver_version(), _cann_version())


def ascend_versions_problem(driver: Optional[str], cann: Optional[str]) -> Optional[str]:
    """Why an Ascend driver and CANN toolkit cannot share NPU memory between processes, or None:
    either older than NPU_IPC_MINIMUM, or its version not found."""
    for name, found in (("driver", driver), ("cann", cann)):
        version = ascend_version(found or "")
        if version is None:
            return f"the Ascend {name} version was not found"
        if version < ascend_version(NPU_IPC_MINIMUM[name]):
            return f"the Ascend {name} is {found}, below {NPU_IPC_MINIMUM[name]}"
    return None


def npu_driver_version() -> Optional[str]:
    """The driver's "Software Version" in ``npu-smi info -t board -i 0``, or None."""
    import subprocess

    try:
        board = subprocess.run(["npu-smi", "info", "-t", "board", "-i", "0"], capture_output=True, text=True,
                               timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in board.splitlines():
        if line.strip().lower().startswith("software version"):
            return line.split(":", 1)[1].strip()
    return None


@dataclass(frozen=True)
class RolloutDtype:
    """What a ``rollout_dtype`` (config.ModelConfig) means, the one place that says it: the rollout
    model, weight sync, the engines and the memory plan all read it here rather than re-deriving
    it from the name."""
    compute: torch.dtype  # what the rollout model computes and caches in (and holds a reward model in)
    fp8_weights: bool  # its linear weights are FP8 (fp8.py), quantized on the way in
    # The form weights travel in to a vLLM engine: vLLM quantizes to FP8 itself from bf16 weights.
    # The built-in engine takes them as the rollout dtype names them (FP8: quantized by weight sync).
    vllm_wire: str
    # Per kind of device, the rollout engines that run it. Neither vllm-ascend on Atlas A2/A3 nor
    # vLLM's CPU build has FP8; the built-in engine runs FP8 everywhere, on an NPU from e4m3 codes
    # stored as uint8 (FP8_AS_CODES).
    engines: dict[str, tuple[str, ...]]

    @staticmethod
    def of(name: str) -> "RolloutDtype":
        return ROLLOUT_DTYPE[name]

    @property
    def compute_name(self) -> str:
        """The compute dtype as vLLM and the plan's JSON spell it ("bfloat16", "float32")."""
        return str(self.compute).removeprefix("torch.")

    def runs_on(self, kind: str, engine: str) -> bool:
        """Whether ``engine`` runs this dtype on a ``kind`` device (one not in the table: yes)."""
        return engine in self.engines.get(kind, (engine,))


_EVERYWHERE = {kind: ("builtin", "vllm") for kind in ("npu", "cuda", "cpu")}
ROLLOUT_DTYPE = {
    "fp8": RolloutDtype(torch.bfloat16, True, "bf16", {**_EVERYWHERE, "npu": ("builtin",), "cpu": ("builtin",)}),
    "bf16": RolloutDtype(torch.bfloat16, False, "bf16", _EVERYWHERE),
    "fp32": RolloutDtype(torch.float32, False, "fp32", _EVERYWHERE),
}
# The same, per kind of device and engine, the dtypes it runs: plan_advice says what runs where
# from it and engine_vllm.check_available refuses the rest at start-up.
ROLLOUT_DTYPES = {kind: {engine: tuple(name for name, dtype in ROLLOUT_DTYPE.items() if dtype.runs_on(kind, engine))
                         for engine in engines} for kind, engines in _EVERYWHERE.items()}

# Where vLLM captures graphs unless told otherwise (rollout_enforce_eager null): CUDA. On the CPU
# vLLM's graph mode is torch.compile at start-up (minutes on a few cores); vllm-ascend's ACL graphs
# around the weight reload are not checked on a device yet.
VLLM_GRAPHS_BY_DEFAULT = {"cuda"}


def vllm_enforce_eager(device_type: str, requested: Optional[bool]) -> bool:
    """Whether a vLLM engine on a ``device_type`` device runs eagerly (``rollout_enforce_eager``)."""
    return kind_of(device_type) not in VLLM_GRAPHS_BY_DEFAULT if requested is None else requested


def decode_compile_mode(device_type: str, requested: Optional[bool], compute_dtype: torch.dtype) -> Optional[str]:
    """torch.compile's mode for the decode step of a rollout model computing in ``compute_dtype``
    (RolloutDtype.compute), or None for eager (another device: off unless asked)."""
    on = DECODE_COMPILE_BY_DEFAULT.get(device_type, False) if requested is None else requested
    if not on:
        return None
    mode = DECODE_COMPILE_MODE.get(device_type, "default")
    return "default" if mode == "reduce-overhead" and compute_dtype not in CUDA_GRAPH_DTYPES else mode


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


# What fixed-order kernels and collectives need beyond torch.use_deterministic_algorithms, read by
# the libraries when they start, so set before the first kernel or collective: cuBLAS's fixed
# workspace (torch's "Reproducibility" notes); on Ascend, HCCL's and LCCL's reductions in a fixed
# order and matmuls without the K-axis shift, as verl's Ascend inference-consistency guide and
# vllm-ascend's batch-invariant mode set them. A value the user set is kept.
DETERMINISM_VARIABLES = {
    "cuda": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
    "npu": {"HCCL_DETERMINISTIC": "true", "LCCL_DETERMINISTIC": "1", "CLOSE_MATMUL_K_SHIFT": "1",
            "ATB_MATMUL_SHUFFLE_K_ENABLE": "0", "ATB_LLM_LCOC_ENABLE": "0"},
}


def use_deterministic_algorithms(platform_kind: str, enabled: bool) -> Callable[[], None]:
    """With ``enabled`` (run.deterministic), this process computes the same twice on its device:
    torch's deterministic kernels (an op that has none raises), cuDNN without autotuning, fresh
    tensors filled rather than left with old memory, and DETERMINISM_VARIABLES in the environment
    (the ranks' engines inherit them). Returns what puts the process back as it was: a run called
    in-process (a test, bench/probe_step.py) leaves nothing behind."""
    if not enabled:
        return lambda: None
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    added = {name: value for name, value in DETERMINISM_VARIABLES.get(platform_kind, {}).items()
             if name not in os.environ}
    os.environ.update(added)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False

    def restore() -> None:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
        for name in added:
            os.environ.pop(name, None)

    return restore


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA/NPU device generator


def bind_host_cores(plat: Platform, device_count: Optional[int] = None,
                    nodes_dir: Path = Path("/sys/devices/system/node")) -> Optional[set[int]]:
    """Bind this NPU rank to its share of its device's NUMA node (article 5.3): every thread it
    has now, and so every thread and child process it starts later (the vLLM engine, checkpoint
    writers, OpenMP's pool), which inherit their starter's cores. Returns the cores the rank has
    then, or None where it is left as it is. Records what applies in DAPO_CPU_BINDING, which
    env_report.json's cpu_binding reports.

    The devices lie over the NUMA nodes with cores in order (device 0 on node 0, as torch_npu's
    documentation has it), and a node's cores (``nodes_dir``/nodeN/cpulist) are split evenly among
    its devices, so that two ranks share a core only where a node has fewer cores than devices;
    the kernel drops the cores a cpuset does not allow.

    Not torch_npu's binding (CPU_AFFINITY_CONF, launch.sh's default until now): mode 1 binds the
    main thread to the device's share of the cores, all of them split evenly by device index with
    no regard to NUMA nodes; mode 2 pins the main thread to the share's first core (torch_npu's
    own dispatch, ACL and release threads to one core each), and every thread and process the main
    thread starts inherits that one core. A CPU_AFFINITY_CONF the user sets is left to torch_npu,
    which binds nothing where it finds the process bound already. CUDA ranks get torchrun's
    --numa-binding from launch.sh; CPU ranks share the host as the user's OMP_NUM_THREADS says.
    """
    if plat.kind != "npu":
        return None
    if (user_choice := os.environ.get("CPU_AFFINITY_CONF")) is not None:
        os.environ.setdefault("DAPO_CPU_BINDING", f"CPU_AFFINITY_CONF={user_choice}")
        return None
    nodes = {}
    for path in nodes_dir.glob("node[0-9]*"):
        cores = []
        for part in filter(None, (path / "cpulist").read_text().strip().split(",")):
            first, _, last = part.partition("-")
            cores.extend(range(int(first), int(last or first) + 1))
        if cores:  # not a node of memory alone
            nodes[int(path.name[4:])] = cores
    if not nodes:
        return None
    devices = device_count if device_count is not None else plat.module.device_count()
    node_of = [sorted(nodes)[device * len(nodes) // devices] for device in range(devices)]
    node = node_of[plat.local_rank]
    neighbours = [device for device in range(devices) if node_of[device] == node]
    index, cores = neighbours.index(plat.local_rank), nodes[node]
    share = len(cores) / len(neighbours)
    mine = cores[int(index * share):int((index + 1) * share)] or [cores[index % len(cores)]]
    try:
        os.sched_setaffinity(0, mine)
    except OSError:  # a cpuset that allows none of them: left to the cpuset
        return None
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), mine)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    bound = os.sched_getaffinity(0)
    os.environ["DAPO_CPU_BINDING"] = f"NUMA node {node}, cores {','.join(map(str, sorted(bound)))} (rank's share)"
    return bound


def _cann_version() -> Optional[str]:
    home = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH")
    candidates = [Path(home)] if home else []
    candidates.append(Path("/usr/local/Ascend/ascend-toolkit/latest"))
    names = (f"{host.machine()}-linux/ascend_toolkit_install.info", "version.cfg", "compiler/version.info",
             "runtime/version.info")
    for root in candidates:
        for name in names:
            info = root / name
            if info.is_file():
                pairs = [line.split("=", 1) for line in info.read_text(errors="replace").splitlines() if "=" in line]
                exact = [value for key, value in pairs if key.strip().lower() == "version"]
                loose = [value for key, value in pairs if "version" in key.lower()]
                if exact or loose:
                    return (exact or loose)[0].strip()
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
