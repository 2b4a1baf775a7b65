"""Whether a run may continue from a checkpoint, and from which: the fingerprints a checkpoint
must share with the run that resumes it (model, tokenizer, rank layout, data), the settings that
may change in between, the output folder's state, and the step folder a run continues from.
What a checkpoint holds and how it is written and read is ckpt.py's business.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ckpt import (LEARNER_STATE, CheckpointError, complete_steps, find_checkpoint, incomplete_steps, read_json,
                  remove_partial_saves)
from config import RESUMABLE_KEYS, UserError

_MODEL_CONFIG_NOISE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache")


def model_fingerprint(model_path: Path) -> dict[str, Any]:
    """The architecture as its config.json states it, minus fields that do not change the model."""
    config = json.loads((model_path / "config.json").read_text())
    return {k: v for k, v in sorted(config.items()) if k not in _MODEL_CONFIG_NOISE}


def digest(value: Any) -> str:
    """A short hash of anything JSON can write: equal values, equal digests."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


PROMPT_DIGESTS, PROMPT_DIGEST_CHARS = "train_prompt_digests", 8  # 8 hex digits per training prompt, in order


def run_fingerprint(cfg: Any, tokenizer: Any, train_prompts: list[list[int]], world_size: int,
                    num_learners: int) -> dict[str, Any]:
    """What a checkpoint must share with the run that resumes it: the model, the tokenizer, the
    rank layout, and what its saved data position and sample buffer mean (the same prompts,
    batched the same way)."""
    return {
        "model": model_fingerprint(Path(cfg.model.model_path)), "tokenizer": tokenizer_fingerprint(tokenizer),
        "layout": {"world_size": world_size, "learner_ranks": num_learners},
        "data": {"train_prompts": digest(train_prompts), "prompts_per_step": cfg.rollout.prompts_per_step,
                 "sample_num": cfg.rollout.sample_num, "bucket_size": cfg.data.bucket_size, "seed": cfg.run.seed},
        # Not compared: what a resume on other prompts is told, which prompt differs first.
        PROMPT_DIGESTS: "".join(digest(prompt)[:PROMPT_DIGEST_CHARS] for prompt in train_prompts),
    }


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


def check_resumable(folder: Path, fingerprint: dict[str, Any], config: dict[str, Any],
                    warn: Callable[[str], None], *, source_rows: Sequence[int]) -> dict[str, Any]:
    """The checkpoint's trainer state, if it was written by this model, tokenizer, layout and data;
    ``warn`` hears of changed settings a resume may not change silently (config.RESUMABLE_KEYS:
    each key's field says whether it is one): the run would not match an uninterrupted one.
    ``source_rows``: each training prompt's row in the dataset file, to name the first that differs."""
    if not (folder / LEARNER_STATE).is_dir():
        raise UserError(f"checkpoint {folder} has no {LEARNER_STATE}/: it was written by an older version of this "
                        f"trainer, which cannot resume it (its model/ folder opens with from_pretrained)")
    saved = read_json(folder / "trainer_state.json")
    for what in ("model", "tokenizer", "layout", "data"):
        difference = first_difference(saved["fingerprint"][what], fingerprint[what])
        if what == "data" and saved["fingerprint"][what]["train_prompts"] != fingerprint[what]["train_prompts"]:
            difference = prompts_difference(saved, fingerprint, config["dataset"], source_rows)
        if difference:
            raise UserError(f"checkpoint {folder} does not match this run's {what}: {difference}")
    changed = sorted(k for k, v in config.items() if k not in RESUMABLE_KEYS and saved["config"].get(k, v) != v)
    if changed:
        warn(f"resuming with changed settings ({', '.join(changed)}): the run will not match an uninterrupted one")
    return saved


def prompts_difference(saved: dict[str, Any], fingerprint: dict[str, Any], dataset: str,
                       source_rows: Sequence[int]) -> str:
    """How this run's training prompts differ from the checkpoint's: the files, the counts and the
    first prompt that differs (a bare pair of hashes tells a user nothing to look for)."""
    theirs = f"the checkpoint's ({saved['config'].get('dataset')})"
    if PROMPT_DIGESTS not in saved["fingerprint"]:  # written before checkpoints kept one digest per prompt
        return f"the training prompts of dataset {dataset} are not {theirs}"
    saved_each, current_each = (_chunks(fp[PROMPT_DIGESTS]) for fp in (saved["fingerprint"], fingerprint))
    first = next((i for i, (a, b) in enumerate(zip(saved_each, current_each)) if a != b),
                 min(len(saved_each), len(current_each)))
    where = ""
    if first < len(source_rows):
        where = f" ({dataset}:{source_rows[first]})" if dataset.endswith(".jsonl") else \
            f" ({dataset}: row {source_rows[first]})"
    return (f"training prompts differ: {len(current_each)} in dataset {dataset}, {len(saved_each)} in {theirs}; "
            f"the first that differs is prompt {first}{where}")


def _chunks(digests: str) -> list[str]:
    return [digests[i:i + PROMPT_DIGEST_CHARS] for i in range(0, len(digests), PROMPT_DIGEST_CHARS)]


# What an earlier run leaves that a fresh start would replace or delete.
EARLIER_OUTPUT = ("metrics.csv", "completions.jsonl", "curves.png", "tensorboard")


def earlier_output(output_dir: Path) -> list[str]:
    return [name for name in EARLIER_OUTPUT if (output_dir / name).exists()]


def prepare_output_dir(output_dir: Path, *, overwrite: bool, resuming: bool, create: bool) -> None:
    """Refuse to overwrite checkpoints or an earlier run's output; only ``create`` (the lead)
    changes anything. Every rank checks the checkpoints; the earlier output only the lead, which
    writes it: another rank starting late could see what this run has begun to write."""
    root = output_dir / "checkpoints"
    if (complete_steps(root) or incomplete_steps(root)) and not overwrite and not resuming:
        raise UserError(f"output_dir {output_dir} already holds checkpoints; pass --resume_from_checkpoint auto to "
                        f"continue or --overwrite_output_dir true to start over")
    if not create:
        return
    if (found := earlier_output(output_dir)) and not overwrite and not resuming:
        raise UserError(f"output_dir {output_dir} already holds an earlier run's {', '.join(found)}; pass "
                        f"--overwrite_output_dir true to replace it, or choose another output_dir")
    if overwrite and not resuming:
        for stale in (root, output_dir / "metrics.csv"):
            if stale.is_dir():
                shutil.rmtree(stale)
            elif stale.exists():
                stale.unlink()
    remove_partial_saves(root)
    output_dir.mkdir(parents=True, exist_ok=True)


def restarted_by_torchrun() -> bool:
    """Whether torchrun restarted this job after a crash: it then continues its own output,
    checkpoint or not."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def check_resume_path(output_dir: Path, requested: Optional[str], *, restarted: bool) -> None:
    """UserError (one line naming the key, the path and the step folders there are) when
    resume_from_checkpoint names a folder that does not exist, before anything loads. A restarted
    job is let through: it continues from its own newest checkpoint, and keep_last may have
    deleted the folder it was first told since."""
    if requested in (None, "auto") or restarted or Path(requested).is_dir():
        return
    raise UserError(f"resume_from_checkpoint {requested}: no such folder; {step_folders_there(output_dir, requested)}")


def step_folders_there(output_dir: Path, requested: str) -> str:
    """The step folders in output_dir/checkpoints and beside ``requested``: what a user who named
    a wrong one can choose from."""
    found = []
    for root in dict.fromkeys([output_dir / "checkpoints", Path(requested).parent]):
        names = sorted([p.name for p in complete_steps(root)] +
                       [f"{p.name} (incomplete)" for p in incomplete_steps(root)])
        if names:
            found.append(f"{root} holds {', '.join(names)}")
    return "; ".join(found) or f"{output_dir / 'checkpoints'} holds no step folder"


def find_resume_checkpoint(output_dir: Path, requested: Optional[str], *, restarted: bool,
                           warn: Callable[[str], None], log: Callable[[str], None]) -> Optional[Path]:
    """The step folder to continue from, or None for a fresh start.

    After torchrun restarts a crashed job (``restarted``) the run continues from its own newest
    checkpoint by itself, whatever it was told; until it has one, from what it was told (a PATH
    into another run, say).
    """
    specs = (["auto"] if restarted else []) + ([requested] if requested else [])
    root = output_dir / "checkpoints"
    for spec in dict.fromkeys(specs):  # in order, without repeats
        try:
            folder = find_checkpoint(root, spec, warn)
        except CheckpointError as error:  # a folder named by PATH ("auto" skips unusable ones)
            raise UserError(f"{error}; {step_folders_there(output_dir, spec)}") from None
        if folder is not None:
            log(f"resuming from {folder}")
            return folder
    if specs:
        log(f"no complete checkpoint in {root}: starting fresh")
    return None
