"""A stand-in accelerator: the project runs on a fake device while this records what a GPU/NPU
would reject or do differently.

Most sessions and CI machines have no GPU or NPU, yet mistakes that only a device shows (a host
tensor meeting a device tensor, a float64 collective HCCL rejects, a thread that never bound
its device, an fp32 matmul in a bf16 learner) pass every plain CPU test. Here PrivateUse1 is
renamed ``accel``; its tensors wrap real CPU tensors, so the run computes real numbers while
every op sees two distinct devices. device.select_platform answers Platform("accel", "hccl"),
every process group runs on gloo while remembering the backend it was meant for, and each op on
the device is checked. Kinds of findings:

  mix     a host tensor (dim > 0) meets a device tensor in one op (CUDA/NPU raise)
  gen     a generator on the other device than the tensors it draws for (CUDA/NPU raise)
  sync    the host waits for the device: item()/tolist()/bool(), .cpu(), nonzero & co.
  thread  device work on a thread whose current device is not the rank's own (a new thread
          starts on device 0 on CUDA and NPU)
  dtype   matmuls (mm, bmm, _grouped_mm, ...) and attention, with their input dtypes
  coll    a collective whose tensors the intended backend rejects: a host tensor into an
          NCCL/HCCL group, a device tensor into gloo, a dtype HCCL or NCCL lacks

Each finding carries the innermost project frame, the innermost frame outside torch, the
thread, and the project functions on the stack (so a test can count what happens inside one
function). Not modelled: streams and events beyond what DCP asks, c10d functional collectives
(FSDP2 over 2+ ranks uses them), fused attention kernels (the math path runs).

    AUDIT_OUT=DIR python tests/accel_standin.py train_dapo.py ARGS      # or under torchrun
writes DIR/audit_rank<R>.json: {"findings": [...], "device_ops": {op(dtypes): count}}.
"""
from __future__ import annotations

import collections
import json
import os
import runpy
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

NAME = "accel"
PROJECT = Path(__file__).resolve().parents[1]
RANK_DEVICE = int(os.environ.get("LOCAL_RANK", "0"))
aten = torch.ops.aten

# ----- findings --------------------------------------------------------------------------------

_lock = threading.RLock()
_findings: dict[tuple, dict[str, Any]] = {}
_device_ops: collections.Counter = collections.Counter()
_local = threading.local()  # per thread: its current device, autocast stack, re-entry guard


def _in_project(path: str) -> bool:
    return path.startswith(str(PROJECT)) and "site-packages" not in path and not path.endswith("accel_standin.py")


def _where() -> tuple[str, str, tuple[str, ...]]:
    """(innermost project frame, innermost frame outside torch, project functions on the stack)."""
    site = via = "?"
    functions = []
    for frame in reversed(traceback.extract_stack()):
        path = os.path.realpath(frame.filename)
        if via == "?" and "/torch/" not in path and not path.endswith("accel_standin.py"):
            via = f"{path.split('site-packages/')[-1]}:{frame.lineno}"
        if _in_project(path):
            if site == "?":
                site = f"{os.path.relpath(path, PROJECT)}:{frame.lineno}"
            functions.append(frame.name)
    return site, via, tuple(sorted(set(functions)))


def record(kind: str, what: str) -> None:
    if getattr(_local, "recording", False):
        return
    _local.recording = True
    try:
        site, via, functions = _where()
        thread = threading.current_thread().name
        with _lock:
            entry = _findings.setdefault((kind, what, site, via, functions, thread), {
                "kind": kind, "what": what, "site": site, "via": via, "functions": list(functions),
                "thread": thread, "count": 0})
            entry["count"] += 1
    finally:
        _local.recording = False


def current_device() -> int:
    return getattr(_local, "device", 0)  # CUDA and NPU: a thread starts on device 0


def check_thread(what: str) -> None:
    if current_device() != RANK_DEVICE:
        record("thread", f"{what} runs on device {current_device()} (the rank's device is {RANK_DEVICE})")
    elif threading.current_thread() is not threading.main_thread() and not hasattr(_local, "device"):
        record("thread", f"{what} on a thread that never set its device (right only for local rank 0)")


# ----- the device module (torch.accel) ---------------------------------------------------------

class Event:
    """Work on the stand-in is done when it returns, so an event is always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> "Event":
        check_thread("event.record()")
        return self

    def wait(self, stream: Any = None) -> None:
        check_thread("event.wait()")

    def synchronize(self) -> None:
        check_thread("event.synchronize()")

    def query(self) -> bool:
        return True


class Stream:
    device_type = NAME

    def __init__(self, index: Optional[int] = None, priority: int = 0, **kwargs: Any) -> None:
        self.device_index = current_device() if index is None else index

    def synchronize(self) -> None:
        check_thread("stream.synchronize()")

    def wait_stream(self, other: Any) -> None:
        check_thread("stream.wait_stream()")

    def wait_event(self, event: Any) -> None:
        check_thread("stream.wait_event()")

    def record_event(self, event: Optional[Event] = None) -> Event:
        return (event or Event()).record(self)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Stream) and other.device_index == self.device_index

    def __hash__(self) -> int:
        return hash(self.device_index)


class StreamContext:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def __enter__(self) -> Stream:
        check_thread("a stream context")
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        return None


class Properties:
    total_memory = 64 * 2**30
    name = "stand-in accelerator"


class DeviceModule:
    """What device.Platform, autocast, DCP and FSDP ask of torch.<device>."""

    Stream = Stream
    Event = Event

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return 8

    def current_device(self) -> int:
        return current_device()

    def set_device(self, index: Any) -> None:
        _local.device = index.index if isinstance(index, torch.device) else int(index)

    def get_device_properties(self, index: int = 0) -> Properties:
        return Properties()

    def get_device_name(self, index: int = 0) -> str:
        return Properties.name

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    def is_bf16_supported(self, *args: Any) -> bool:
        return True

    def manual_seed(self, seed: int) -> None:
        pass

    def manual_seed_all(self, seed: int) -> None:
        pass

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        check_thread("get_rng_state()")
        return torch.zeros(16, dtype=torch.uint8)

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        check_thread("set_rng_state()")

    def synchronize(self, device: Any = None) -> None:
        check_thread("synchronize()")

    def empty_cache(self) -> None:
        pass

    def max_memory_allocated(self, device: Any = None) -> int:
        return 0

    def memory_allocated(self, device: Any = None) -> int:
        return 0

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def current_stream(self, device: Any = None) -> Stream:
        check_thread("current_stream()")
        return Stream(current_device())

    def default_stream(self, device: Any = None) -> Stream:
        return Stream(current_device())

    def stream(self, stream: Stream) -> StreamContext:
        return StreamContext(stream)


def is_device(value: Any) -> bool:
    return isinstance(value, torch.device) and value.type == NAME or isinstance(value, str) and value.startswith(NAME)


# ----- generators, autocast and tensor factories that name the device --------------------------

_generator_devices: dict[int, torch.device] = {}  # by seed: see DeviceAwareGenerator.manual_seed


class DeviceAwareGenerator(torch.Generator):
    """A CPU generator that remembers the device it was made for."""

    def __new__(cls, device: Any = "cpu") -> "DeviceAwareGenerator":
        generator = super().__new__(cls, "cpu")
        generator.made_for = torch.device(device)
        return generator

    def __init__(self, device: Any = "cpu") -> None:
        pass

    def manual_seed(self, seed: int) -> "DeviceAwareGenerator":
        # Kernels get a fresh wrapper of the C++ generator (the subclass is lost), so the device
        # is remembered by the seed, which survives.
        _generator_devices[int(seed)] = self.made_for
        return super().manual_seed(seed)


def generator_device(generator: Any) -> torch.device:
    return _generator_devices.get(generator.initial_seed(), generator.device)


def _autocast_on() -> bool:
    return any(getattr(_local, "autocast", []))


def _patch_autocast() -> None:
    """Autocast for the stand-in casts what CUDA's does (autocast_mode.cpp, lower_precision_fp);
    every other op keeps its input dtypes, as on a device."""
    enter, leave = torch.autocast.__enter__, torch.autocast.__exit__

    def on_enter(self: Any) -> Any:
        _local.autocast = [*getattr(_local, "autocast", []), self.device == NAME and self._enabled]
        return enter(self)

    def on_exit(self: Any, *args: Any) -> Any:
        _local.autocast = getattr(_local, "autocast", [False])[:-1]
        return leave(self, *args)

    torch.autocast.__enter__, torch.autocast.__exit__ = on_enter, on_exit
    lower, others = torch.library.Library("aten", "IMPL"), torch.library.Library("_", "IMPL")
    others.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
    autocast_key = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

    def cast_kernel(op: Any) -> Any:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            dtype = torch.get_autocast_dtype(NAME)

            def cast(v: Any) -> Any:
                on_device = isinstance(v, torch.Tensor) and v.is_floating_point() and v.device.type == NAME
                return v.to(dtype) if on_device else v
            with torch._C._ExcludeDispatchKeyGuard(autocast_key):
                return op(*tree_map(cast, args), **tree_map(cast, kwargs))
        return kernel

    for name in AUTOCAST_LOWER:
        lower.impl(name, cast_kernel(getattr(aten, name).default), "AutocastPrivateUse1")
    _keep.extend([lower, others])


AUTOCAST_LOWER = ("mm", "addmm", "addmv", "addr", "matmul", "einsum", "mv", "linear", "addbmm", "baddbmm", "bmm",
                  "chain_matmul", "scaled_dot_product_attention")
_keep: list[Any] = []  # libraries that must outlive their registration


def _patch_factories() -> None:
    """torch.tensor(data, device=accel) builds on the host with the Python key excluded: give it
    the host-to-device move a device would make."""
    tensor, as_tensor = torch.tensor, torch.as_tensor

    def new_tensor(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if is_device(device):
            return tensor(data, *args, **kwargs).to(device)
        return tensor(data, *args, device=device, **kwargs)

    def new_as_tensor(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if is_device(device):
            if isinstance(data, torch.Tensor) and data.device == torch.device(device):
                return data
            return as_tensor(data, *args, **kwargs).to(device)
        return as_tensor(data, *args, device=device, **kwargs)

    torch.tensor, torch.as_tensor = new_tensor, new_as_tensor
    torch.Generator = DeviceAwareGenerator


# ----- device tensors and the checks on every op -----------------------------------------------

class DeviceTensor(torch.Tensor):
    """A tensor on ``accel:<index>`` holding a real CPU tensor (``elem``)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, index: int = 0) -> "DeviceTensor":
        out = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                  storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                  layout=elem.layout, device=torch.device(NAME, index),
                                                  requires_grad=elem.requires_grad)
        out.elem = elem
        return out

    @property
    def data(self) -> "DeviceTensor":  # type: ignore[override]
        return DeviceTensor(self.elem.detach(), self.device.index)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        # `param.data = t` swaps the wrapper's metadata in C++; the wrapped tensor must follow.
        if not isinstance(new, DeviceTensor):
            record("mix", f"param.data = a host tensor {tuple(new.shape)} on a device parameter")
            new = DeviceTensor(new.detach(), self.device.index)
        torch._C.TensorBase.data.__set__(self, new)
        self.elem = new.elem

    def untyped_storage(self) -> torch.UntypedStorage:  # type: ignore[override]
        # FSDP2 frees and re-allocates unsharded parameters by resizing their storage.
        return self.elem.untyped_storage()

    def tolist(self) -> Any:  # type: ignore[override]
        check_thread("tolist()")
        record("sync", "tolist()")
        return self.elem.tolist()

    def numpy(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        record("sync", "numpy()")
        return self.elem.numpy(*args, **kwargs)

    def __repr__(self, **kwargs: Any) -> str:  # type: ignore[override]
        return f"DeviceTensor({self.elem!r}, device={self.device})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["elem"], self.device.index

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], index: Any, outer_size: Any, outer_stride: Any) -> Any:
        return DeviceTensor(inner["elem"], index or 0)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        return run_op(func, args, kwargs or {})


# Ops that move data between host and device, or that may take host index tensors on CUDA.
_TRANSFERS = {aten.copy_.default, aten._to_copy.default, aten._copy_from.default, aten._copy_from_and_resize.default}
_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default,
             aten._unsafe_index.Tensor}
# Ops whose output size or value the host must read from the device.
_SYNCS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.nonzero.default,
          aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
          aten.unique_consecutive.default, aten.repeat_interleave.Tensor}
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._grouped_mm.default,
            aten.linear.default, aten.matmul.default, aten._scaled_mm.default}


def op_name(func: Any) -> str:
    return str(func.overloadpacket).replace("aten.", "")


def dtype_names(tensors: list[torch.Tensor]) -> str:
    return ",".join(str(t.dtype).replace("torch.", "") for t in tensors)


def check_op(func: Any, flat: list[Any], on_device: list[DeviceTensor]) -> None:
    if len({t.device.index for t in on_device}) > 1:
        record("mix", f"aten.{op_name(func)}: tensors on {NAME}:{sorted({t.device.index for t in on_device})}")
    if func not in _TRANSFERS and func not in _INDEXING:
        for t in flat:
            if isinstance(t, torch.Tensor) and not isinstance(t, DeviceTensor) and t.dim() > 0:
                record("mix", f"aten.{op_name(func)}: host tensor {tuple(t.shape)} {t.dtype} with device tensors")
    for g in flat:
        if isinstance(g, torch._C.Generator) and generator_device(g).type != NAME:
            record("gen", f"aten.{op_name(func)}: a {generator_device(g).type} generator draws for {NAME} tensors")
    if func in _SYNCS:
        record("sync", f"aten.{op_name(func)}")
    if func in _MATMULS and not getattr(_local, "in_attention", False):
        uncast = " under autocast, which does not cast it" if _autocast_on() and op_name(func) not in AUTOCAST_LOWER \
            else ""
        record("dtype", f"aten.{op_name(func)}({dtype_names(on_device)}){uncast}")
    with _lock:
        _device_ops[f"{op_name(func)}({','.join(sorted({dtype_names([t]) for t in on_device}))})"] += 1


def run_op(func: Any, args: tuple, kwargs: dict) -> Any:
    flat, _ = tree_flatten((args, kwargs))
    on_device = [t for t in flat if isinstance(t, DeviceTensor)]
    to_device = is_device(kwargs.get("device")) if func is aten._to_copy.default else any(is_device(v) for v in flat)
    if on_device or to_device:
        check_thread(f"aten.{op_name(func)}")
    if on_device:
        check_op(func, flat, on_device)
        # A non-blocking copy into (pinned) host memory is queued, not waited for.
        if func is aten._to_copy.default and not is_device(kwargs.get("device", on_device[0].device)) \
                and not kwargs.get("non_blocking"):
            record("sync", "device-to-host copy (.cpu() / .to(cpu))")
        if func is aten.copy_.default and not isinstance(args[0], DeviceTensor) and not kwargs.get("non_blocking") \
                and not (len(args) > 2 and args[2]):
            record("sync", "device-to-host copy_")
    else:  # a host op, or a factory naming the device (torch.rand(..., device=accel))
        for g in flat:
            if isinstance(g, torch._C.Generator) and (generator_device(g).type == NAME) != to_device:
                drawn = f"{NAME} tensors" if to_device else "host tensors"
                record("gen", f"aten.{op_name(func)}: a {generator_device(g).type} generator draws for {drawn}")
    index = next((t.device.index for t in on_device), None)
    if index is None:
        index = next((torch.device(v).index or current_device() for v in flat if is_device(v)), RANK_DEVICE)
    originals = {id(t.elem): t for t in on_device}

    def unwrap(value: Any) -> Any:
        if isinstance(value, DeviceTensor):
            return value.elem
        return torch.device("cpu") if is_device(value) else value

    real_args, real_kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    if func is aten.histc.default and not real_args[0].is_floating_point():
        record("ops", "histc on integer input (CUDA has no integer histc)")
        real_args = (real_args[0].float(), *real_args[1:])
    out = func(*real_args, **real_kwargs)
    wrap_out = is_device(kwargs.get("device", args[0].device)) if func is aten._to_copy.default \
        else bool(on_device) or to_device

    def wrap(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not isinstance(value, DeviceTensor):
            if id(value) in originals:  # in-place ops return their input
                return originals[id(value)]
            return DeviceTensor(value, index) if wrap_out else value
        return value

    return tree_map(wrap, out)


_PLAIN = (torch.Tensor, torch.nn.Parameter, DeviceTensor)


class DeviceMode(TorchDispatchMode):
    """Factory functions and host-to-device copies that name the device go through run_op too."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        if any(isinstance(t, torch.Tensor) and type(t) not in _PLAIN for t in flat):
            return NotImplemented  # a DTensor (FSDP2) unwraps itself first, then comes back here
        if func is aten._pin_memory.default:
            return args[0].clone()  # page-locked host memory is ordinary host memory here
        if any(isinstance(t, DeviceTensor) or is_device(t) for t in flat) or \
                any(isinstance(g, torch._C.Generator) and generator_device(g).type == NAME for g in flat):
            return run_op(func, args, kwargs)
        return func(*args, **kwargs)


# ----- collectives: what the intended backend accepts -------------------------------------------

HCCL_REDUCE_DTYPES = {torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.bfloat16}
NCCL_DTYPES = HCCL_REDUCE_DTYPES | {torch.uint8, torch.float64, torch.bool, torch.float8_e4m3fn}
_REDUCING = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor")
_MOVING = ("all_gather", "all_gather_into_tensor", "gather", "scatter", "broadcast", "send", "recv",
           "all_to_all_single")


def _patch_distributed() -> None:
    import torch.distributed as dist

    intended: dict[Any, str] = {}
    init, new_group = dist.init_process_group, dist.new_group

    def init_on_gloo(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        result = init("gloo", *args, **kwargs)
        intended["world"] = str(backend)
        return result

    def new_group_on_gloo(ranks: Any = None, *args: Any, backend: Any = None, **kwargs: Any) -> Any:
        group = new_group(ranks, *args, backend="gloo", **kwargs)
        intended[group] = str(backend or intended.get("world"))
        return group

    def backend_of(group: Any) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return intended.get("world", "gloo")
        return intended.get(group, "gloo")

    def checked(name: str) -> Any:
        real = getattr(dist, name)

        def collective(*args: Any, **kwargs: Any) -> Any:
            backend = backend_of(kwargs.get("group"))
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            device_only = backend not in ("gloo",) and "," not in backend  # "accel:hccl,cpu:gloo" takes both
            for t in tensors:
                on_device = isinstance(t, DeviceTensor)
                if device_only and not on_device:
                    record("coll", f"dist.{name}: a host {t.dtype} tensor into a '{backend}' group")
                if backend == "gloo" and on_device:
                    record("coll", f"dist.{name}: a device tensor into a gloo group")
                if on_device and name in _REDUCING and t.dtype not in HCCL_REDUCE_DTYPES:
                    record("coll", f"dist.{name}: {t.dtype} (HCCL on Atlas A2/A3 reduces no such type)")
                if on_device and t.dtype not in NCCL_DTYPES:
                    record("coll", f"dist.{name}: {t.dtype} (NCCL has no such type)")
            if any(isinstance(t, DeviceTensor) for t in tensors):
                check_thread(f"dist.{name}")
            unwrap = lambda v: v.elem if isinstance(v, DeviceTensor) else v  # noqa: E731
            return real(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

        return collective

    dist.init_process_group, dist.new_group = init_on_gloo, new_group_on_gloo
    for name in _REDUCING + _MOVING:
        setattr(dist, name, checked(name))


def _patch_attention() -> None:
    """Attention's dtype is its inputs': the math path the stand-in runs computes bf16 in fp32
    (a device's fused kernel does not), so its own matmuls are not recorded."""
    attention = torch.nn.functional.scaled_dot_product_attention

    def recorded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if isinstance(query, DeviceTensor):
            record("dtype", f"attention({dtype_names([query, key, value])})")
        _local.in_attention = True
        try:
            return attention(query, key, value, *args, **kwargs)
        finally:
            _local.in_attention = False

    torch.nn.functional.scaled_dot_product_attention = recorded


def _patch_platform() -> None:
    sys.path.insert(0, str(PROJECT))
    import device

    device.select_platform = lambda requested="auto", local_rank=0: \
        device.Platform(NAME, os.environ.get("AUDIT_BACKEND", "hccl"), local_rank)


def write_report() -> None:
    out = Path(os.environ.get("AUDIT_OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    with _lock:
        findings = sorted(_findings.values(), key=lambda f: (f["kind"], -f["count"]))
        report = {"findings": findings, "device_ops": dict(_device_ops.most_common())}
    (out / f"audit_rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(report, indent=1))


def install() -> None:
    _setup_privateuseone_for_python_backend(rename=NAME, backend_module=DeviceModule())
    _patch_autocast()
    _patch_factories()
    _patch_distributed()
    _patch_attention()
    _patch_platform()
    # Backward on the calling thread: a real engine's device threads bind their device, the
    # stand-in's would not (and would be reported as unbound threads).
    torch.autograd.set_multithreading_enabled(False)


def main() -> None:
    install()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    try:
        with DeviceMode():
            runpy.run_path(script, run_name="__main__")
    finally:
        write_report()


if __name__ == "__main__":
    main()
