"""A stand-in accelerator: the project runs on a fake device while this records what a GPU/NPU
would reject or do differently.

Most sessions and CI machines have no GPU or NPU, yet mistakes that only a device shows (a host
tensor meeting a device tensor, a float64 collective HCCL rejects, a thread that never bound
its device, an fp32 matmul in a bf16 learner) pass every plain CPU test. Here PrivateUse1 is
renamed ``accel``; its tensors wrap real CPU tensors, so the run computes real numbers while
every op sees two distinct devices. device.select_platform answers Platform("accel", B), B
the intended backend (AUDIT_BACKEND: hccl, the default, or nccl); every process group runs on
gloo while remembering the backend it was meant for, and each op on the device is checked.
Kinds of findings:

  mix     a host tensor (dim > 0) meets a device tensor in one op (CUDA/NPU raise)
  gen     a generator on the other device than the tensors it draws for (CUDA/NPU raise)
  sync    the host waits for the device: item()/tolist()/bool(), .cpu(), nonzero & co.
  thread  device work on a thread whose current device is not the rank's own (a new thread
          starts on device 0 on CUDA and NPU)
  dtype   matmuls (mm, bmm, _grouped_mm, ...) and attention, with their input dtypes (and
          "in backward" / "in attention's backward" where autograd's backward runs them);
          outer products (an inner dimension of 1) left out: is_outer_product
  coll    a collective the intended backend lacks or whose tensors it rejects: gather and
          scatter (and their object variants) into HCCL, a host tensor into an NCCL/HCCL
          group, a device tensor into gloo, a dtype HCCL or NCCL lacks (HCCL: no float64 in
          any collective). torch.distributed's functions (FSDP2's all_gather_single and
          reduce_scatter_single among them) and c10d's functional collectives (DTensor's) alike
  npu     with ACCEL_KIND=npu (the stand-in follows the NPU's rules: device.kind_of gives
          "npu" for it): a device op with a float8 operand or result (torch_npu on Atlas
          A2/A3 has no float8 kernels), an attention mask that is not bool

Each finding carries the innermost project frame, the innermost frame outside torch, the
thread, and the project functions on the stack (so a test can count what happens inside one
function). Not modelled: streams and events beyond what DCP asks, fused attention kernels (the
math path runs).

    AUDIT_OUT=DIR python tests/accel_standin.py train_dapo.py ARGS      # or under torchrun
writes DIR/audit_rank<R>.json: {"findings": [...], "device_ops": {op(dtypes): count}}.
"""
from __future__ import annotations

import collections
import functools
import json
import os
import runpy
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils import _pytree as pytree
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

NAME = "accel"
PROJECT = Path(__file__).resolve().parents[1]
RANK_DEVICE = int(os.environ.get("LOCAL_RANK", "0"))
IMITATES = os.environ.get("ACCEL_KIND")  # the platform whose rules the project follows here: "npu", or its own
aten = torch.ops.aten

# ----- an op's arguments ------------------------------------------------------------------------
# What an aten op takes and returns: tensors, numbers, dtypes, devices, generators, in lists,
# tuples and dicts. Walked here for every op of the run; torch's pytree, which knows every
# registered container, is several times slower, and is left the rest (a structseq, a namedtuple).

def tree_flatten(value: Any) -> tuple[list[Any], None]:
    leaves: list[Any] = []
    _collect(value, leaves)
    return leaves, None


def _collect(value: Any, leaves: list[Any]) -> None:
    kind = type(value)
    if kind is list or kind is tuple:
        for item in value:
            _collect(item, leaves)
    elif kind is dict:
        for item in value.values():
            _collect(item, leaves)
    elif isinstance(value, (list, tuple, dict)):
        leaves.extend(pytree.tree_leaves(value))
    else:
        leaves.append(value)


def tree_map(fn: Any, value: Any) -> Any:
    kind = type(value)
    if kind is list:
        return [tree_map(fn, item) for item in value]
    if kind is tuple:
        return tuple(tree_map(fn, item) for item in value)
    if kind is dict:
        return {key: tree_map(fn, item) for key, item in value.items()}
    if isinstance(value, (list, tuple, dict)):
        return pytree.tree_map(fn, value)
    return fn(value)


# ----- findings --------------------------------------------------------------------------------

_lock = threading.RLock()
_findings: dict[tuple, dict[str, Any]] = {}
_device_ops: collections.Counter = collections.Counter()
_local = threading.local()  # per thread: its current device, autocast stack, re-entry guard


def _in_project(path: str) -> bool:
    return path.startswith(str(PROJECT)) and "site-packages" not in path and not path.endswith("accel_standin.py")


@functools.lru_cache(maxsize=None)
def _real_path(filename: str) -> str:
    return os.path.realpath(filename)


def _where() -> tuple[str, str, tuple[str, ...]]:
    """(innermost project frame, innermost frame outside torch, project functions on the stack).
    From the frames themselves: traceback's summaries stat every file for its source lines."""
    site = via = "?"
    functions = []
    frame = sys._getframe()
    while frame is not None:  # innermost first
        path = _real_path(frame.f_code.co_filename)
        if via == "?" and "/torch/" not in path and not path.endswith("accel_standin.py"):
            via = f"{path.split('site-packages/')[-1]}:{frame.f_lineno}"
        if _in_project(path):
            if site == "?":
                site = f"{os.path.relpath(path, PROJECT)}:{frame.f_lineno}"
            functions.append(frame.f_code.co_name)
        frame = frame.f_back
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

# Kernels see a plain wrapper of the C++ generator, not the subclass instance that named its
# device; c10 hands out one wrapper per generator while that wrapper lives, so each generator
# keeps its wrapper alive and the wrapper is what remembers the device.
# Generators take weak references from torch 2.13; before (torch 2.10, vllm-ascend's), a plain
# dict keeps the few a run makes.
_generator_devices: "dict[torch._C.Generator, torch.device]" = weakref.WeakKeyDictionary()
try:
    weakref.ref(torch.Generator())
except TypeError:
    _generator_devices = {}


class _CaptureGenerator(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        self.generator = (kwargs or {}).get("generator")
        return func(*args, **(kwargs or {}))


class DeviceAwareGenerator(torch.Generator):
    """A CPU generator that remembers the device it was made for."""

    def __new__(cls, device: Any = "cpu") -> "DeviceAwareGenerator":
        generator = super().__new__(cls, "cpu")
        generator.made_for = torch.device(device)
        with _CaptureGenerator() as capture:
            torch.empty(0).uniform_(generator=generator)  # draws nothing
        generator.as_kernels_see_it = capture.generator
        _generator_devices[capture.generator] = generator.made_for
        return generator

    def __init__(self, device: Any = "cpu") -> None:
        pass


def generator_device(generator: Any) -> torch.device:
    return getattr(generator, "made_for", None) or _generator_devices.get(generator, generator.device)


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
_FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._grouped_mm.default,
            aten.linear.default, aten.matmul.default, aten._scaled_mm.default}
_ADDED_TO = {aten.addmm.default, aten.baddbmm.default}  # their first operand is what the product is added to


def is_outer_product(func: Any, args: tuple) -> bool:
    """Whether matmul ``func`` on ``args`` is one-deep (an inner dimension of 1): an outer
    product, each output one multiply with nothing summed, so fp32 inputs cost no bf16 kernel
    anything. transformers 5.5.4's rotary embedding takes inv_freq times the positions as one,
    in fp32 on purpose (models/qwen3_moe/modeling_qwen3_moe.py:443). The dtype checks (here
    and tests/test_learner_precision.py) leave these out; a product two deep or more is checked."""
    return args[1 if func in _ADDED_TO else 0].shape[-1] == 1


def op_name(func: Any) -> str:
    return str(func.overloadpacket).replace("aten.", "")


def dtype_names(tensors: list[torch.Tensor]) -> str:
    return ",".join(str(t.dtype).replace("torch.", "") for t in tensors)


def check_op(func: Any, args: tuple, flat: list[Any], on_device: list[DeviceTensor]) -> None:
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
    if func in _MATMULS and not getattr(_local, "in_attention", False) and not is_outer_product(func, args):
        uncast = " under autocast, which does not cast it" if _autocast_on() and op_name(func) not in AUTOCAST_LOWER \
            else ""
        record("dtype", f"aten.{op_name(func)}({dtype_names(on_device)}){uncast}{_in_backward()}")
    with _lock:
        _device_ops[f"{op_name(func)}({','.join(sorted({dtype_names([t]) for t in on_device}))})"] += 1


def run_op(func: Any, args: tuple, kwargs: dict) -> Any:
    if func.namespace in _FUNCTIONAL:
        check_functional_collective(func, args, kwargs)
    flat, _ = tree_flatten((args, kwargs))
    on_device = [t for t in flat if isinstance(t, DeviceTensor)]
    to_device = is_device(kwargs.get("device")) if func is aten._to_copy.default else any(is_device(v) for v in flat)
    if on_device or to_device:
        check_thread(f"aten.{op_name(func)}")
    if on_device:
        check_op(func, args, flat, on_device)
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
    target = kwargs.get("device") if func is aten._to_copy.default else None
    index = torch.device(target).index if is_device(target) else next((t.device.index for t in on_device), None)
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
    if IMITATES == "npu":
        results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)] if wrap_out else []
        if any(t.dtype in _FLOAT8 for t in on_device + results):
            record("npu", f"aten.{op_name(func)}: a float8 tensor on the device (Atlas A2/A3 kernels take none)")

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
        if func.namespace in _FUNCTIONAL:  # host tensors only
            check_functional_collective(func, args, kwargs)
        return func(*args, **kwargs)


# ----- collectives: what the intended backend accepts -------------------------------------------

# The dtypes each backend moves (ProcessGroupNCCL's ncclDataType map; HCCL on Atlas A2/A3: no
# float64 and no float8 in any collective), and those it reduces.
HCCL_REDUCE_DTYPES = {torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.bfloat16}
HCCL_DTYPES = HCCL_REDUCE_DTYPES | {torch.uint8, torch.bool}
NCCL_REDUCE_DTYPES = {torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64,
                      torch.bfloat16, torch.bool}
NCCL_DTYPES = NCCL_REDUCE_DTYPES | {torch.float8_e4m3fn, torch.float8_e5m2}
# ProcessGroupHCCL has no gather or scatter (torch_npu 2.7 raises; later versions unless
# TORCH_NPU_USE_COMPATIBLE_IMPL=1); the object variants are built on them.
HCCL_LACKS = ("gather", "scatter", "gather_object", "scatter_object_list")
_REDUCING = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")
_MOVING = ("all_gather", "all_gather_into_tensor", "all_gather_single", "gather", "scatter", "broadcast", "send",
           "recv", "all_to_all", "all_to_all_single", "gather_object", "scatter_object_list")
# c10d's functional collectives (DTensor's redistribute, full_tensor, clip_grad_norm_ over
# shards) are ops, checked where they are dispatched.
_FUNCTIONAL = ("_c10d_functional", "_c10d_functional_autograd")
_intended: dict[str, str] = {}  # process group name -> the backend the project asked for


def intended_backend(group: Any) -> str:
    """What ``group`` (a ProcessGroup, its name, or None for the world) was meant to run on:
    "hccl", "nccl", "gloo" or a per-device mix such as "accel:hccl,cpu:gloo"."""
    import torch.distributed as dist

    if group is None:
        group = dist.group.WORLD
    return _intended.get(group if isinstance(group, str) else group.group_name, "gloo")


def check_collective(name: str, backend: str, tensors: list[torch.Tensor], reducing: bool) -> None:
    """Record what ``backend`` rejects in collective ``name`` over ``tensors`` (none: an object
    collective, whose pickles travel on the group's device, or the host where it has gloo)."""
    def backend_for(on_device: bool) -> str:  # "accel:hccl,cpu:gloo": each tensor meets its device's
        if ":" not in backend:
            return backend
        return dict(part.split(":") for part in backend.split(",")).get(NAME if on_device else "cpu", "none")

    on_hccl = backend == "hccl" or backend_for(True) == "hccl" and any(isinstance(t, DeviceTensor) for t in tensors)
    if on_hccl and name.split(".")[-1] in HCCL_LACKS:
        record("coll", f"{name} into a '{backend}' group (ProcessGroupHCCL has no {name.split('.')[-1]})")
    for t in tensors:
        on_device = isinstance(t, DeviceTensor)
        meets = backend_for(on_device)
        if meets in ("hccl", "nccl") and not on_device:
            record("coll", f"{name}: a host {t.dtype} tensor into a '{backend}' group")
        if meets == "gloo" and on_device:
            record("coll", f"{name}: a device tensor into a gloo group")
        if meets == "hccl" and on_device:
            if t.dtype not in (HCCL_REDUCE_DTYPES if reducing else HCCL_DTYPES):
                record("coll", f"{name}: {t.dtype} (HCCL on Atlas A2/A3 {'reduces' if reducing else 'takes'} "
                               "no such type)")
        if meets == "nccl" and on_device and t.dtype not in (NCCL_REDUCE_DTYPES if reducing else NCCL_DTYPES):
            record("coll", f"{name}: {t.dtype} (NCCL {'reduces' if reducing else 'takes'} no such type)")
    if any(isinstance(t, DeviceTensor) for t in tensors):
        check_thread(name)


def check_functional_collective(func: Any, args: tuple, kwargs: dict) -> None:
    """An op of c10d's functional collectives: its group is its ``group_name`` argument (a name
    or, from some callers, the group itself)."""
    names = [a.name for a in func._schema.arguments]
    if "group_name" not in names:
        return  # wait_tensor
    position = names.index("group_name")
    group = args[position] if position < len(args) else kwargs["group_name"]
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    check_collective(op_name(func), intended_backend(group), tensors, "reduce" in op_name(func))


def _patch_distributed() -> None:
    import inspect

    import torch.distributed as dist

    init, new_group = dist.init_process_group, dist.new_group

    def init_on_gloo(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        result = init("gloo", *args, **kwargs)
        _intended[dist.group.WORLD.group_name] = str(backend)
        return result

    def new_group_on_gloo(ranks: Any = None, *args: Any, backend: Any = None, **kwargs: Any) -> Any:
        group = new_group(ranks, *args, backend="gloo", **kwargs)
        if group is not dist.GroupMember.NON_GROUP_MEMBER:
            _intended[group.group_name] = str(backend or intended_backend(None))
        return group

    def checked(name: str) -> Any:
        real = getattr(dist, name)
        signature = inspect.signature(real)

        def collective(*args: Any, **kwargs: Any) -> Any:
            group = signature.bind(*args, **kwargs).arguments.get("group")
            if name.endswith(("_object", "_object_list")):  # pickles, filled into the caller's own lists
                check_collective(f"dist.{name}", intended_backend(group), [], reducing=False)
                return real(*args, **kwargs)
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            check_collective(f"dist.{name}", intended_backend(group), tensors, name in _REDUCING)
            unwrap = lambda v: v.elem if isinstance(v, DeviceTensor) else v  # noqa: E731
            return real(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

        return collective

    dist.init_process_group, dist.new_group = init_on_gloo, new_group_on_gloo
    for name in _REDUCING + _MOVING:
        if hasattr(dist, name):  # torch 2.10's FSDP2 calls the *_tensor forms; *_single came later
            setattr(dist, name, checked(name))


def _in_backward() -> str:
    """Where in autograd's backward this op runs: "" (not in backward), " in backward" or " in
    attention's backward" (a node that :func:`_patch_attention` marked)."""
    node = torch._C._current_autograd_node()
    if node is None:
        return ""
    return " in attention's backward" if node.metadata.get("attention") else " in backward"


def _mark_attention_nodes(output: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> None:
    """Mark the autograd nodes that attention's forward made (from its output back to its
    inputs' nodes), so that their backward can be told apart from the rest of the model's."""
    input_nodes = [t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    stop = {id(node) for node in input_nodes}  # a node's Python object lives as long as the node
    pending, seen = [output.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in stop | seen or type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(id(node))
        node.metadata["attention"] = True
        pending.extend(next_node for next_node, _ in node.next_functions)


def _patch_attention() -> None:
    """Attention's dtype is its inputs': the math path the stand-in runs computes bf16 in fp32
    (a device's fused kernel does not), so its own matmuls are not recorded, and those of its
    backward are recorded as such."""
    attention = torch.nn.functional.scaled_dot_product_attention

    def recorded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if isinstance(query, DeviceTensor):
            record("dtype", f"attention({dtype_names([query, key, value])})")
            mask = kwargs.get("attn_mask", args[0] if args else None)
            if IMITATES == "npu" and mask is not None and mask.dtype != torch.bool:
                record("npu", f"attention: a {mask.dtype} attn_mask (torch_npu takes bool masks)")
        _local.in_attention = True
        try:
            output = attention(query, key, value, *args, **kwargs)
        finally:
            _local.in_attention = False
        _mark_attention_nodes(output, (query, key, value))
        return output

    torch.nn.functional.scaled_dot_product_attention = recorded


def _patch_platform() -> None:
    sys.path.insert(0, str(PROJECT))
    import device

    device.select_platform = lambda requested="auto", local_rank=0: \
        device.Platform(NAME, os.environ.get("AUDIT_BACKEND", "hccl"), local_rank)
    if IMITATES:
        device.IMITATED_PLATFORM[NAME] = IMITATES


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
