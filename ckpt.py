"""Checkpoints: atomic step folders, retention, and finding the newest complete one.

A step folder is written under a temporary name, flushed, marked ``COMPLETE`` last, then renamed
into place; ``checkpoints/latest`` is replaced atomically after that. A folder without
``COMPLETE`` is never loaded, so a crash mid-save leaves the previous checkpoint usable.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

STEP_PREFIX = "step_"
COMPLETE = "COMPLETE"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line saying why."""


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def complete_steps(ckpt_root: Path) -> list[Path]:
    """Complete step folders, oldest first."""
    if not ckpt_root.is_dir():
        return []
    folders = [p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)]
    return sorted((p for p in folders if (p / COMPLETE).is_file()), key=lambda p: p.name)


def incomplete_steps(ckpt_root: Path) -> list[Path]:
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.iterdir()
                  if p.is_dir() and p.name.startswith(STEP_PREFIX) and not (p / COMPLETE).is_file())


def save_step(ckpt_root: Path, step: int, write_contents: Callable[[Path], None], *, keep_last: int) -> Path:
    """Write one step folder atomically; ``write_contents(tmp_dir)`` fills it."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / step_dir_name(step)
    tmp = ckpt_root / f".tmp_{final.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write_contents(tmp)
    _fsync_tree(tmp)
    _write_text_atomic(tmp / COMPLETE, json.dumps({"step": step}) + "\n")
    if final.exists():  # a re-run of this step after a resume from an earlier one
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_text_atomic(ckpt_root / "latest", final.name + "\n")
    for old in complete_steps(ckpt_root)[:-keep_last]:
        shutil.rmtree(old)
    return final


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
