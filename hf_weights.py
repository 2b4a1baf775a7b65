"""The policy's weights in Hugging Face files, read and written a piece at a time.

A learner reads only the rows of each parameter that its FSDP2 shard holds; an export writes
one file at a time: no process holds a whole model it does not need. transformers keeps each
MoE layer's experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]) while files hold them per expert
(``mlp.experts.{e}.gate_proj.weight`` ...), the layout from_pretrained and serving engines read
(docs/platform.md); this module translates between the two.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from config import UserError
from moe_kernels import TRANSFORMERS_EXPERTS, experts_implementation, use_experts_kernel

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_FILE_BYTES = 5 * 2**30  # the size Hugging Face repositories cut weight files at

# A fused experts parameter and the per-expert weights it stacks, each cut along its rows.
_FUSED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _fused_experts(name: str) -> Optional[tuple[str, tuple[str, ...]]]:
    prefix, _, leaf = name.rpartition(".")
    if prefix.endswith(".experts") and leaf in _FUSED_EXPERTS:
        return prefix, _FUSED_EXPERTS[leaf]
    return None


def file_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The tensors the files hold for the in-memory parameter ``name`` (views of ``tensor``)."""
    fused = _fused_experts(name)
    if fused is None:
        return [(name, tensor)]
    prefix, parts = fused
    return [(f"{prefix}.{expert}.{part}.weight", piece)
            for expert, weights in enumerate(tensor) for part, piece in zip(parts, weights.chunk(len(parts)))]


class WeightFiles:
    """The safetensors files of a Hugging Face model folder, memory-mapped: any rows of any
    parameter under its in-memory name, without reading the rest of the file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        index = folder / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (folder / SINGLE_FILE).is_file():
            from safetensors import safe_open

            with safe_open(str(folder / SINGLE_FILE), framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
        else:
            raise UserError(f"model_path {folder} holds no {SINGLE_FILE} or {INDEX_FILE}")
        self.file_of: dict[str, str] = weight_map
        self._open: dict[str, Any] = {}

    def _slice(self, key: str) -> Any:
        from safetensors import safe_open

        file = self.file_of.get(key)
        if file is None:
            raise UserError(f"model_path {self.folder} holds no weights for {key}")
        if file not in self._open:
            self._open[file] = safe_open(str(self.folder / file), framework="pt")
        return self._open[file].get_slice(key)

    def rows(self, name: str, shape: torch.Size, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the in-memory parameter ``name`` of full shape ``shape``, in the
        files' dtype."""
        fused = _fused_experts(name)
        if name in self.file_of:
            found = self._slice(name)[start:stop]
        elif fused is not None and f"{fused[0]}.0.{fused[1][0]}.weight" in self.file_of:
            prefix, parts = fused
            experts = [torch.cat([self._slice(f"{prefix}.{e}.{part}.weight")[:] for part in parts])
                       for e in range(start, stop)]
            found = torch.stack(experts) if experts else torch.empty(0, *shape[1:])
        else:
            raise UserError(f"model_path {self.folder} holds no weights for {name}")
        if tuple(found.shape[1:]) != tuple(shape[1:]) or found.shape[0] != stop - start:
            raise UserError(f"model_path {self.folder}: {name} has shape {tuple(found.shape)} for rows "
                            f"{start}:{stop}, the model's config.json gives {tuple(shape)}")
        return found


def empty_model(path: Path, device: Any, dtype: torch.dtype,
                prepare: Optional[Callable[[torch.nn.Module], Any]] = None, *,
                computes_on: Optional[str] = None) -> torch.nn.Module:
    """The architecture of the model folder ``path`` in ``dtype``, built on the meta device,
    ``prepare``-d there (sharded, converted to FP8), then given storage on ``device`` without
    its weights, which the caller reads a piece at a time. Buffers (the rotary frequencies) are
    computed, not read. Its MoE experts run the kernel moe_kernels.experts_implementation gives the
    type of device it computes on: ``computes_on`` where that is not ``device``'s (an offloaded
    learner keeps its storage on the host)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    text = config.get_text_config()
    has_experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    # transformers refuses the setting for a dense model, and before 5.7 any kernel but its own
    # (moe_kernels.use_experts_kernel): ours are set on the built model
    kernel = experts_implementation(computes_on or torch.device(device).type) if has_experts else None
    built_with = {} if kernel is None else \
        {"experts_implementation": kernel if kernel in TRANSFORMERS_EXPERTS else "eager"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **built_with)
    if kernel is not None:
        use_experts_kernel(model, kernel)
    if prepare is not None:
        prepare(model)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each module a parameter of its own
    with torch.no_grad():
        for module in model.modules():
            if next(module.buffers(recurse=False), None) is not None:
                model._init_weights(module)  # transformers' own initialisation of the buffers
    return model


def plan_files(shapes: dict[str, torch.Size], itemsize: int, max_file_bytes: int = MAX_FILE_BYTES) -> list[list[str]]:
    """In-memory parameter names grouped into weight files of at most ``max_file_bytes`` (a
    larger parameter fills a file alone), in the given order."""
    names = list(shapes)
    sizes = [shape.numel() * itemsize for shape in shapes.values()]
    return [[names[index] for index in file] for file in bucket_plan(sizes, max_file_bytes)]


def bucket_plan(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Piece indices grouped so each bucket stays under bucket_bytes (one large piece may fill a
    bucket alone). Both ends of a weight sync compute the same plan from the same sizes
    (weight_sync), and a model's weight files are cut by it (plan_files)."""
    plan, current, used = [], [], 0
    for index, size in enumerate(sizes):
        if current and used + size > bucket_bytes:
            plan.append(current)
            current, used = [], 0
        current.append(index)
        used += size
    if current:
        plan.append(current)
    return plan


def file_names(count: int) -> list[str]:
    return [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_weight_files(folder: Path, shapes: dict[str, torch.Size], dtype: torch.dtype,
                       read: Callable[[list[str]], dict[str, torch.Tensor]], *, part: int = 0, parts: int = 1,
                       max_file_bytes: int = MAX_FILE_BYTES) -> None:
    """Write the files of ``shapes`` (in-memory names and full shapes) whose index is ``part``
    modulo ``parts`` (so several writers share the work), each from ``read(names)`` (full
    tensors), cast to ``dtype`` and cut into the files' per-expert layout; part 0 also writes
    the index when there is more than one file."""
    plan = plan_files(shapes, dtype.itemsize, max_file_bytes)
    names = file_names(len(plan))
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(part, len(plan), parts):
        tensors = read(plan[index])
        pieces = {key: piece.to(dtype).contiguous() for name in plan[index]
                  for key, piece in file_tensors(name, tensors.pop(name))}
        save_safetensors(pieces, folder / names[index], metadata={"format": "pt"})
    if part == 0 and len(plan) > 1:
        weight_map = {key: file for names_in_file, file in zip(plan, names) for name in names_in_file
                      for key, _ in file_tensors(name, torch.empty(shapes[name], device="meta"))}
        total = sum(shape.numel() for shape in shapes.values()) * dtype.itemsize
        (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                    indent=1, sort_keys=True) + "\n")


# ----- file permissions -------------------------------------------------------------------------

def process_umask() -> int:
    """The process's umask, read without changing it where the system allows (/proc on Linux):
    setting it to read it back would race with the checkpoint writer's thread creating files."""
    try:
        with open("/proc/self/status", encoding="utf-8", errors="replace") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: Optional[dict[str, str]] = None) -> None:
    """safetensors' save_file, leaving the file readable as the umask says: save_file (0.8) creates
    it with mode 0600, where every other file a run writes gets 0666 less the umask (0644 under
    the usual 022)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~process_umask())


def stored_dtype(model_config: Any) -> torch.dtype:
    """The dtype the model's files declare (what an export writes), float32 when unsaid."""
    name = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None) or "float32"
    return name if isinstance(name, torch.dtype) else getattr(torch, str(name).removeprefix("torch."))
