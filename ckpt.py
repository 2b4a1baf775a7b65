"""Checkpoints on disk: atomic step folders, their validation, and the safe formats inside them.

A step folder is written under a temporary name, flushed, marked ``COMPLETE`` last (with the
size of every file, so truncation is caught on load), then renamed into place;
``checkpoints/latest`` is replaced atomically after that. A folder without ``COMPLETE`` is never
loaded, so a crash mid-save leaves the previous checkpoint usable. Only safe formats are
written: safetensors, JSON and torch.distributed.checkpoint (DCP, whose tensors load with
``weights_only=True``; its small ``.metadata`` index is DCP's own pickle); nothing else is pickled.

What goes into a folder, and when, is the trainer's business (train_dapo.py); this module knows
files, not training.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp_"
COMPLETE = "COMPLETE"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line saying why."""


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def tmp_dir(ckpt_root: Path, step: int) -> Path:
    """Where step ``step`` is written before it is complete (every learner writes its shards here)."""
    return ckpt_root / f"{TMP_PREFIX}{step_dir_name(step)}"


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _step_folders(ckpt_root: Path) -> list[Path]:
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX))


def complete_steps(ckpt_root: Path) -> list[Path]:
    """Complete step folders, oldest first."""
    return [p for p in _step_folders(ckpt_root) if (p / COMPLETE).is_file()]


def incomplete_steps(ckpt_root: Path) -> list[Path]:
    return [p for p in _step_folders(ckpt_root) if not (p / COMPLETE).is_file()]


def remove_partial_saves(ckpt_root: Path) -> None:
    """Delete what a crash mid-save left behind (never a complete folder)."""
    if ckpt_root.is_dir():
        for stale in ckpt_root.glob(f"{TMP_PREFIX}{STEP_PREFIX}*"):
            shutil.rmtree(stale)


def save_step(ckpt_root: Path, step: int, write_contents: Callable[[Path], None], *, keep_last: int) -> Path:
    """Write one step folder atomically; ``write_contents(tmp_dir)`` fills it (other ranks may
    have written their shards into the same temporary folder already)."""
    tmp = tmp_dir(ckpt_root, step)
    tmp.mkdir(parents=True, exist_ok=True)
    write_contents(tmp)
    _fsync_tree(tmp)
    sizes = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    _write_text_atomic(tmp / COMPLETE, json.dumps({"step": step, "file_sizes": sizes}, indent=1) + "\n")
    final = ckpt_root / step_dir_name(step)
    if final.exists():  # a re-run of this step after a resume from an earlier one
        _delete_step(final)
    os.replace(tmp, final)
    _fsync_dir(ckpt_root)
    _write_text_atomic(ckpt_root / "latest", final.name + "\n")
    for old in complete_steps(ckpt_root)[:-keep_last]:
        _delete_step(old)
    return final


def _delete_step(folder: Path) -> None:
    # The marker goes first: a crash halfway through the deletion leaves an incomplete folder,
    # never one that claims to be complete with files missing.
    (folder / COMPLETE).unlink(missing_ok=True)
    shutil.rmtree(folder)


class BackgroundWriter:
    """Runs one writing task at a time on a thread, so training goes on while files are written;
    a failure surfaces at the next :meth:`wait`. Tasks get only data that nothing changes under
    them (host copies, tensors the next update replaces rather than modifies)."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def start(self, name: str, task: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                task()
            except BaseException as error:  # handed to the training thread at wait()
                self._error = error

        # A daemon: a run that dies mid-write must not hang at exit in the writer's collective; its
        # half-written folder is never marked complete, so nothing is lost but that checkpoint.
        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the task in flight (if any) is done."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"writing a checkpoint failed: {error}") from error


def check_step(folder: Path) -> None:
    """Raise CheckpointError unless ``folder`` is a complete, untruncated step folder."""
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} does not exist")
    marker = folder / COMPLETE
    if not marker.is_file() and not folder.name.startswith(STEP_PREFIX):
        raise CheckpointError(f"{folder} is not a checkpoint step folder (expected OUTPUT_DIR/checkpoints/"
                              f"{STEP_PREFIX}<N>)")
    if not marker.is_file():
        raise CheckpointError(f"checkpoint {folder} is incomplete (no {COMPLETE} marker: its save was interrupted)")
    try:
        sizes = json.loads(marker.read_text())["file_sizes"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint {folder}: {COMPLETE} is unreadable") from None
    for name, size in sizes.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {folder}: {name} is missing")
        if path.stat().st_size != size:
            raise CheckpointError(f"checkpoint {folder}: {name} is truncated or damaged "
                                  f"({path.stat().st_size} bytes, {size} when saved)")
    from safetensors import safe_open

    for path in folder.rglob("*.safetensors"):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as error:  # safetensors raises its own types for bad headers and offsets
            raise CheckpointError(f"checkpoint {folder}: {path.relative_to(folder)} is corrupted ({error})") from None
    for path in folder.rglob("*.json"):
        try:
            json.loads(path.read_text())
        except ValueError:
            raise CheckpointError(f"checkpoint {folder}: {path.relative_to(folder)} is corrupted") from None


def find_checkpoint(ckpt_root: Path, spec: str, warn: Callable[[str], None]) -> Optional[Path]:
    """The folder to resume from: ``auto`` = the newest usable one under ``ckpt_root`` (None when
    there is none), anything else = that folder, which must be usable."""
    if spec != "auto":
        check_step(Path(spec))
        return Path(spec)
    for folder in reversed(_step_folders(ckpt_root)):
        try:
            check_step(folder)
            return folder
        except CheckpointError as error:
            warn(f"skipping {error}")
    return None


# ----- formats ---------------------------------------------------------------------------------

def json_text(payload: dict[str, Any]) -> str:
    # repr-exact floats: a resumed run must read back the very numbers it saved.
    return json.dumps(payload, indent=1, sort_keys=True) + "\n"


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


@contextlib.contextmanager
def _one_process_is_fine() -> Iterator[None]:
    # DCP warns whenever it runs without a process group; for a one-process run that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class OptimizerSaver:
    """Each learner's shard of the optimizer state through DCP: copied to host memory when the
    checkpoint is taken (:meth:`stage`), written later (:meth:`write`, on a writer thread)."""

    def __init__(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # Synchronous, unpinned copies; the stager reuses its host buffers from one save to the
        # next, so a write must finish before the next stage (BackgroundWriter.start waits).
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=False))

    def stage(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return {"optimizer": self._stager.stage(get_optimizer_state_dict(model, optimizer))}

    @staticmethod
    def write(folder: Path, staged: dict[str, Any], group: Optional[Any]) -> None:
        """A collective over ``group`` (every learner's writer thread joins it): a group that
        training never uses, since it runs beside training's own collectives."""
        import torch.distributed.checkpoint as dcp

        with _one_process_is_fine():
            dcp.save(staged, checkpoint_id=str(folder), process_group=group, no_dist=group is None)


def load_optimizer(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   group: Optional[Any]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    # The template's shapes and shardings tell DCP what this rank reads (its own shard).
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    with _one_process_is_fine():
        dcp.load(state, checkpoint_id=str(folder), process_group=group, no_dist=group is None)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


# ----- fingerprints: what a checkpoint must share with the run that resumes it -------------------

_MODEL_CONFIG_NOISE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache")


def model_fingerprint(model_path: Path) -> dict[str, Any]:
    """The architecture as its config.json states it, minus fields that do not change the model."""
    config = json.loads((model_path / "config.json").read_text())
    return {k: v for k, v in sorted(config.items()) if k not in _MODEL_CONFIG_NOISE}


def digest(value: Any) -> str:
    """A short hash of anything JSON can write: equal values, equal digests."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    return {"vocab_size": len(tokenizer), "vocab": digest(sorted(tokenizer.get_vocab().items())),
            "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token,
            "chat_template": digest(getattr(tokenizer, "chat_template", None) or "")}


def first_difference(saved: dict[str, Any], current: dict[str, Any]) -> Optional[str]:
    """'KEY: SAVED (checkpoint) vs CURRENT (this run)' for the first differing key, or None."""
    for key in sorted(set(saved) | set(current)):
        if saved.get(key) != current.get(key):
            return f"{key}: {saved.get(key)!r} (checkpoint) vs {current.get(key)!r} (this run)"
    return None
