"""How new weights reach the rollout engine: one home for every transport.

The path of a weight version, from the lead learner to an engine:

1. The lead gathers each parameter whole, one at a time (learner.full_weights: FSDP2's shards
   all-gathered), and :class:`RolloutWeights` encodes it into the bytes it travels as: the
   rollout dtype, or FP8 values plus one float32 scale per output row (fp8.py).
2. :class:`WeightBroadcast` sends those bytes in buckets (``weight_sync_bucket_mb``, planned
   alike at both ends by hf_weights.bucket_plan, in the model's parameter order: embedding, the
   layers in order, the head) over the weights group: the lead and the rollout ranks that take
   weights (ranks.init_groups): each engine's first rank, and with ``rollout_tensor_parallel``
   > 1 and IPC its other ranks too, each for its own device's worker of the engine. One buffer
   of the largest bucket is reused, on the device.
3. The engine rank decodes each bucket through its engine's weight format:
   - the built-in engine: :class:`RolloutWeights` bound to its model copies each piece into
     place, on the device;
   - vLLM, through its weight-transfer protocol (start_weight_update, update_weights a
     bucket, finish_weight_update: its layerwise reload) into our transfer engine in the
     worker (vllm_worker.WeightTransfer), by the transport :func:`vllm_transport` chooses:
     :class:`IpcWeights` hands it one handle a bucket of the memory the broadcast left the
     bucket in (device.ipc_handle: the rank's GPU or NPU memory, no copy through the host; on a
     CPU, shared memory), which the worker opens in place, each worker of a tensor-parallel
     engine its own device's rank's; where NPU memory cannot be shared (old drivers)
     :class:`SharedMemoryWeights` stages each bucket in a shared-memory file the workers read:
     a host bounce, device -> host -> device.
4. Rows of metrics.csv time it: ``sync_time_s`` (the lead sending), ``weight_transfer_s`` and
   ``weight_load_s`` (a rollout rank waiting for the buckets, and its engine taking them).

One process (no ranks) skips the transfer: the engine takes the learner's tensors through the
same encode and decode (engine.load_weights), so one process and several compute the same. A
resumed rollout rank reads its version from the checkpoint's learner shards the same way
(ckpt.iter_full_weights).
"""
from __future__ import annotations

import copy
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Protocol

import torch
import torch.distributed as dist

import config
from config import UserError
from device import (NPU_IPC_MINIMUM, RolloutDtype, ipc_handle, ipc_key, npu_ipc_problem,
                    shareable_buffer)
from fp8 import fp8_parameter_names, fp8_slot, quantize
from hf_weights import bucket_plan, file_tensors
from ranks import broadcast_flag, wait_for_group

# vLLM's name for our transfer engine (vllm_worker.WeightTransfer), registered in its workers.
TRANSFER_BACKEND = "dapo_weights"


def _aligned(nbytes: int) -> int:
    # Every piece starts on an 8-byte boundary of the transfer buffer, so its bytes can be viewed
    # as float32 (scales) or any parameter dtype in place.
    return -(-nbytes // 8) * 8


class RolloutWeights:
    """The policy's parameters as the rollout side stores them, and as they travel there: in the
    rollout dtype, or with FP8 rollout, FP8 values plus one float32 scale per output row for the
    linear layers and experts (fp8.py). One object per end: the lead encodes full-precision
    tensors into bytes, a rollout rank decodes bytes into its model (:meth:`bind`)."""

    def __init__(self, model_config: Any, rollout_dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        # The architecture's names and shapes, without weights, built from a copy of the config
        # (from_config writes its settings into the one it is given) with transformers' own experts
        # kernel: a policy's config may name ours, which transformers before 5.7 builds with no
        # model (moe_kernels.use_experts_kernel).
        with torch.device("meta"):
            policy = AutoModelForCausalLM.from_config(copy.deepcopy(model_config), experts_implementation="eager")
        named = list(policy.named_parameters())
        self.names, self.shapes = [n for n, _ in named], [p.shape for _, p in named]
        dtype = RolloutDtype.of(rollout_dtype)
        self.fp8 = fp8_parameter_names(policy) if dtype.fp8_weights else set()
        self.dtype = dtype.compute
        self.targets: list[Any] = []

    def bind(self, model: torch.nn.Module) -> None:
        """Where each parameter lands in the rollout model (converted to FP8 or not)."""
        self.targets = [fp8_slot(model, n) if n in self.fp8 else model.get_parameter(n) for n in self.names]

    def _is_fp8(self, index: int) -> bool:
        return self.names[index] in self.fp8

    def nbytes(self, index: int) -> int:
        shape = self.shapes[index]
        if self._is_fp8(index):
            return _aligned(shape.numel()) + _aligned(4 * (shape.numel() // shape[-1]))
        return _aligned(shape.numel() * self.dtype.itemsize)

    def encode(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        if self._is_fp8(index):
            values, scale = quantize(tensor)
            pieces = [values.reshape(-1).view(torch.uint8), scale.reshape(-1).view(torch.uint8)]
        else:
            pieces = [tensor.detach().to(self.dtype).reshape(-1).view(torch.uint8)]
        return torch.cat([torch.nn.functional.pad(p, (0, _aligned(p.numel()) - p.numel())) for p in pieces])

    def load(self, tensors: Iterable[torch.Tensor], device: torch.device) -> None:
        """Every parameter, whole and in order, into the bound model, by way of the bytes that
        weight sync sends (so weights loaded and weights received are the same)."""
        for index, tensor in enumerate(tensors):
            self.decode(index, self.encode(index, tensor).to(device))

    @torch.no_grad()
    def decode(self, index: int, data: torch.Tensor) -> None:
        shape, target = self.shapes[index], self.targets[index]
        if self._is_fp8(index):
            numel = shape.numel()
            target.values.copy_(data[:numel].view(target.values.dtype).view(shape))  # float8, or uint8 codes
            scale = data[_aligned(numel):_aligned(numel) + 4 * (numel // shape[-1])]
            target.scale.copy_(scale.view(torch.float32).view(shape[:-1]))
        else:
            target.copy_(data[:shape.numel() * self.dtype.itemsize].view(self.dtype).view(shape))

    def flush(self) -> None:
        """Nothing is held back: decode copies each piece into place."""


class WeightFormat(Protocol):
    """How each parameter travels: as ``nbytes(i)`` bytes that ``encode`` writes and ``decode`` reads."""

    names: list[str]  # the parameters, in the order they travel

    def nbytes(self, index: int) -> int: ...
    def encode(self, index: int, tensor: torch.Tensor) -> torch.Tensor: ...
    def decode(self, index: int, data: torch.Tensor) -> None: ...
    def flush(self) -> None: ...  # the pieces decoded so far are complete: an engine may take them


class WeightBroadcast:
    """Send (lead learner) or receive (rollout ranks) a full set of parameters with its version,
    bucket by bucket, as bytes in the layout a :class:`WeightFormat` gives (the rollout's dtype,
    or FP8 values and scales).

    Parameters travel under their in-memory names and shapes, which are the same at both ends
    (one model class) even for fused MoE experts whose on-disk names differ (docs/platform.md). One
    buffer, the size of the largest bucket, is allocated once and reused: a fresh buffer is much
    slower on first touch, and one buffer per bucket would be a second copy of the model.
    """

    def __init__(self, weight_format: WeightFormat, bucket_mb: int, src: int, group: dist.ProcessGroup,
                 device: torch.device) -> None:
        self.format, self.src, self.group, self.device = weight_format, src, group, device
        self.sizes = [weight_format.nbytes(i) for i in range(len(weight_format.names))]
        self.plan = bucket_plan(self.sizes, bucket_mb * 2**20)
        largest = max(sum(self.sizes[i] for i in bucket) for bucket in self.plan)
        self.buffer = shareable_buffer(largest, device) if getattr(weight_format, "shares_buffer", False) else \
            torch.empty(largest, dtype=torch.uint8, device=device)
        self.seconds = (0.0, 0.0)  # the last receive's: (waiting for and taking the buckets, decoding them)

    def send(self, tensors: Iterable[torch.Tensor], version: int) -> None:
        """``tensors``: every parameter whole, in order, each taken only when its bucket is filled
        (so a sharded learner gathers one parameter at a time)."""
        wait_for_group(self.group)
        broadcast_flag(version, self.src, self.group, self.device)
        tensors = iter(tensors)
        for bucket in self.plan:
            offset = 0
            for i in bucket:
                self.buffer[offset:offset + self.sizes[i]].copy_(self.format.encode(i, next(tensors)))
                offset += self.sizes[i]
            dist.broadcast(self.buffer[:offset], src=self.src, group=self.group)

    def receive(self) -> int:
        """Decode the next version into place; returns its number."""
        wait_for_group(self.group)
        version = broadcast_flag(-1, self.src, self.group, self.device)
        transfer = decode = 0.0
        with torch.no_grad():
            for bucket in self.plan:
                filled = self.buffer[:sum(self.sizes[i] for i in bucket)]
                start = time.perf_counter()
                dist.broadcast(filled, src=self.src, group=self.group)
                received = time.perf_counter()
                for i, data in zip(bucket, filled.split([self.sizes[i] for i in bucket])):
                    self.format.decode(i, data)
                self.format.flush()  # before the next bucket overwrites the buffer
                transfer, decode = transfer + received - start, decode + time.perf_counter() - received
        self.seconds = (transfer, decode)
        return version


def vllm_transport(platform_kind: str) -> str:
    """How a rollout rank hands the buckets it received to its vLLM engine: "ipc", each worker of
    the engine opening the memory its own device's rank received them into (device.ipc_handle:
    the rank's GPU or NPU memory, no copy through the host; on a CPU, shared memory), or
    "shared_memory", a staging file the engine rank copies each bucket into (a host bounce on a
    device), where an NPU's driver or CANN cannot share NPU memory (device.npu_ipc_problem).
    vllm-ascend's own ``npu_ipc`` engine is not used: (its main at 182b75e, for vLLM 0.27.1) it
    runs no layerwise reload, so the expert weights we send in checkpoint layout would land in
    experts it holds transposed, and its packed receive loads nothing (docs/platform.md)."""
    return "ipc" if host_bounce_reason(platform_kind) is None else "shared_memory"


def host_bounce_reason(platform_kind: str) -> Optional[str]:
    """Why a vLLM engine on this platform takes its weights through host memory, a slower sync
    (a warning at start-up), or None."""
    problem = npu_ipc_problem() if platform_kind == "npu" else None
    if problem is None:
        return None
    return (f"vLLM weight sync goes through host shared memory, not NPU IPC: {problem} (NPU IPC needs the driver "
            f">= {NPU_IPC_MINIMUM['driver']} and CANN >= {NPU_IPC_MINIMUM['cann']})")


def every_engine_rank_takes_weights(rollout_engine: str, platform_kind: str, tensor_parallel: int) -> bool:
    """Whether the weight broadcast reaches every rank of a tensor-parallel engine (ranks.init_groups),
    not its engine rank alone: with IPC each device's worker reads its own rank's copy."""
    return rollout_engine == "vllm" and tensor_parallel > 1 and vllm_transport(platform_kind) == "ipc"


def vllm_weights(form: Any, engine: Any, platform: Any, layout: Any, bucket_bytes: int,
                 group: Optional[dist.ProcessGroup] = None) -> "_VllmWeights":
    """The weight format of a rank of a vLLM engine, by the transport :func:`vllm_transport`
    chooses: its engine rank's (``engine`` the VllmEngine), or with IPC and tensor parallel any
    rank's of the engine's ``group`` (``engine`` None on the others), once the room for its
    buffers is checked."""
    capacity = staging_bytes(form, bucket_bytes)
    engines_here = layout.engines_on_node(config.torchrun_nodes())
    if vllm_transport(platform.kind) == "ipc":
        if platform.kind == "cpu":  # every engine rank's broadcast buffer is then shared memory
            check_staging_space(SHARED_MEMORY_DIR, capacity, engines_here * layout.tensor_parallel, movable=False)
        return IpcWeights(form, engine, capacity, platform, group, position=layout.device_in_engine)
    folder = staging_dir()
    check_staging_space(folder, capacity, engines_here)
    return SharedMemoryWeights(form, engine, capacity, folder)


class _VllmWeights:
    """What both vLLM weight formats share: RolloutWeights' names, sizes and encoding (``form``),
    the engine each bucket goes to, the bytes a bucket holds (``capacity``), and the bucket in
    the making: (in-memory name, offset, bytes, shape, dtype) a parameter, as vllm_worker.Bucket
    takes them."""

    backend = TRANSFER_BACKEND
    shares_buffer = False  # whether WeightBroadcast must receive into memory the engine opens in place

    def __init__(self, form: Any, engine: Any, capacity: int) -> None:
        self.form, self.engine, self.capacity = form, engine, capacity
        self.names, self.shapes = form.names, form.shapes
        self.staged: list[list[Any]] = []

    def nbytes(self, index: int) -> int:
        return self.form.nbytes(index)

    def encode(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        return self.form.encode(index, tensor)

    def _stage(self, index: int, offset: int, size: int) -> None:
        dtype = str(self.form.dtype).removeprefix("torch.")
        self.staged.append([self.names[index], offset, size, list(self.shapes[index]), dtype])

    def load(self, tensors: Iterable[torch.Tensor]) -> None:
        """Whole tensors (one process, a resume), encoded and handed over a bucket at a time."""
        for index, tensor in enumerate(tensors):
            self.decode(index, self.encode(index, tensor))
        self.flush()


class IpcWeights(_VllmWeights):
    """The weight format (WeightFormat) of a vLLM engine whose workers open the memory their
    device's rank received each bucket into (vllm_transport "ipc"): ``decode`` notes where each
    parameter lies in the broadcast buffer (a shareable one, device.shareable_buffer), and
    ``flush`` hands the engine the bucket's entries with one handle of that memory per device,
    which vllm_worker.WeightTransfer opens and copies from on its device. With tensor parallel
    every rank of the engine's ``group`` receives each bucket; their handles are gathered to the
    engine rank, and no rank's buffer is overwritten (the next bucket) before the engine has
    taken the bucket. The broadcast flushes after every bucket."""

    transport = "ipc"
    init_info: dict[str, Any] = {}  # no staging file
    shares_buffer = True

    def __init__(self, form: Any, engine: Any, capacity: int, platform: Any,
                 group: Optional[dist.ProcessGroup] = None, position: int = 0) -> None:
        super().__init__(form, engine, capacity)
        self.platform = platform  # device.Platform: the rank's device, where the shared memory lies
        self.group, self.position = group, position  # the engine's ranks; this rank's place among them
        self.storage: Optional[torch.Tensor] = None  # the memory the staged entries lie in
        self.load_buffer: Optional[torch.Tensor] = None  # where loads stage their buckets (load)

    def decode(self, index: int, data: torch.Tensor) -> None:
        if self.storage is None:
            self.storage = data
        assert data.untyped_storage().data_ptr() == self.storage.untyped_storage().data_ptr(), \
            "a bucket's parameters lie in one shared buffer"
        self._stage(index, data.storage_offset() * data.element_size(), data.numel() * data.element_size())

    def flush(self) -> None:
        if self.staged:
            if self.load_buffer is not None and self.storage.data_ptr() != self.load_buffer.data_ptr():
                self.load_buffer = None  # a resumed rank's: the broadcast's buffer serves from now on
            if torch.accelerator.is_available():  # the broadcast's writes are done before another process reads them
                torch.accelerator.synchronize()
            handles = {ipc_key(self.platform.device, self.position): ipc_handle(self.storage)}
            if self.group is not None:
                handles = self._gather(handles)
            if self.engine is not None:
                self.engine.update_weights({"entries": self.staged, "handles": handles})
            if self.group is not None:  # the engine has copied from every rank's buffer
                dist.barrier(group=self.group)
        self.staged, self.storage = [], None

    def _gather(self, handles: dict[str, tuple]) -> dict[str, tuple]:
        """Every rank's handle of the bucket, by device. The entries name places in each rank's
        buffer, so they must be the same on every rank: the same plan, buffers alike."""
        mine = (handles, [entry[1] for entry in self.staged])
        every: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, mine, group=self.group)
        assert all(offsets == mine[1] for _, offsets in every), "the engine's ranks staged a bucket alike"
        return {key: handle for shared, _ in every for key, handle in shared.items()}

    def load(self, tensors: Iterable[torch.Tensor]) -> None:
        """Whole tensors (one process, a resume), copied a bucket at a time into a shareable
        buffer of the rank's own (no larger than the model), kept for the next load: a
        one-process run loads every step, and the worker maps the same memory again."""
        size = min(self.capacity, sum(self.nbytes(i) for i in range(len(self.names))))
        if self.load_buffer is None or self.load_buffer.numel() < size:
            self.load_buffer = shareable_buffer(size, self.platform.device)
        buffer, offset = self.load_buffer, 0
        for index, tensor in enumerate(tensors):
            data = self.encode(index, tensor)
            if offset + data.numel() > size:
                self.flush()
                offset = 0
            buffer[offset:offset + data.numel()].copy_(data)
            self.decode(index, buffer[offset:offset + data.numel()])
            offset += data.numel()
        self.flush()


class SharedMemoryWeights(_VllmWeights):
    """The weight format (WeightFormat) of a vLLM engine that reads a staging file (vllm_transport
    "shared_memory"): ``decode`` copies each parameter into a shared-memory file of one bucket
    that the engine's workers map; a full file goes into the engine in one call."""

    transport = "shared_memory"

    def __init__(self, form: Any, engine: Any, capacity: int, folder: str) -> None:
        super().__init__(form, engine, capacity)
        handle, self.path = tempfile.mkstemp(prefix="dapo-vllm-weights-", dir=folder)
        os.close(handle)
        self.buffer = torch.from_file(self.path, shared=True, size=self.capacity, dtype=torch.uint8)
        self.offset = 0
        self.init_info = {"path": self.path, "capacity": capacity}

    def decode(self, index: int, data: torch.Tensor) -> None:
        size = data.numel()
        if self.offset + size > self.capacity:
            self.flush()
        self.buffer[self.offset:self.offset + size].copy_(data)
        self._stage(index, self.offset, size)
        self.offset += size

    def flush(self) -> None:
        if self.staged:
            self.engine.update_weights({"entries": self.staged})
        self.staged, self.offset = [], 0

    def __del__(self) -> None:
        Path(self.path).unlink(missing_ok=True)


# Where POSIX shared memory lives: the staging files by default, and a CPU rank's shareable broadcast buffer.
SHARED_MEMORY_DIR = "/dev/shm"
# Where the staging buffers go instead of shared memory (/dev/shm), when that cannot be made large enough.
STAGING_DIR_VARIABLE = "DAPO_VLLM_STAGING_DIR"


def staging_bytes(form: Any, bucket_bytes: int) -> int:
    """One staging buffer: a bucket, or the largest parameter where that is larger."""
    return max([bucket_bytes] + [form.nbytes(i) for i in range(len(form.names))])


def staging_dir() -> str:
    chosen = os.environ.get(STAGING_DIR_VARIABLE)
    if chosen and not Path(chosen).is_dir():
        raise UserError(f"{STAGING_DIR_VARIABLE}: {chosen} is not a folder (where vLLM's weight staging buffers go)")
    if chosen:
        return chosen
    return SHARED_MEMORY_DIR if Path(SHARED_MEMORY_DIR).is_dir() else tempfile.gettempdir()


def check_staging_space(folder: str, capacity: int, engines: int, movable: bool = True) -> None:
    """A UserError unless ``folder`` has room for every engine's buffer on this host at once. The
    buffers are sparse files: a full folder surfaces only when a weight sync writes into one,
    as a SIGBUS that kills the rank mid-sync. ``movable``: the buffers may go elsewhere
    (STAGING_DIR_VARIABLE: the staging files; a CPU's shareable buffers cannot)."""
    need, free = capacity * engines, shutil.disk_usage(folder).free
    if free < need:
        gib = 2**30
        suggested = math.ceil(need * 1.25 / gib)  # room beside it for NCCL's and vLLM's own shared memory
        elsewhere = f" or set {STAGING_DIR_VARIABLE} to a folder with room" if movable else ""
        raise UserError(f"vLLM weight staging: {folder} has {free / gib:.2f} GiB free, the {engines} vLLM engine(s) "
                        f"on this host need {need / gib:.2f} GiB (one {capacity / 2**20:.0f} MiB staging buffer "
                        f"each: a weight-sync bucket); enlarge it (docker run --shm-size={suggested}g){elsewhere}")
