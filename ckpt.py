"""Checkpoints on disk: atomic step folders, their validation, and the safe formats inside them.

A step folder is written under a temporary name, flushed, marked ``COMPLETE`` last (with the
size of every file, so truncation is caught on load), then renamed into place;
``checkpoints/latest`` is replaced atomically after that. A folder without ``COMPLETE`` is never
loaded, so a crash mid-save leaves the previous checkpoint usable. Only safe formats are
written: safetensors, JSON and torch.distributed.checkpoint (DCP, whose tensors load with
``weights_only=True``; its small ``.metadata`` index is DCP's own pickle); nothing else is pickled.

The second half says what a step folder holds: every learner's shards of the weights and the
optimizer state, the Hugging Face export written from them, every rank's state, the lead's
sample buffer and trainer state (:class:`Checkpointer`). Whether a run may resume from a folder
is resuming.py's business; when a checkpoint is taken, the choreography's (train_dapo.py).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

import hf_weights
import memory_plan
from metrics import warn

STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp_"
COMPLETE = "COMPLETE"
LEARNER_STATE = "learner_state"  # every learner's shard of the weights and optimizer state (DCP)
HF_CONFIG = "hf_config"  # config, generation config and tokenizer: a Hugging Face folder but the weights
HF_MODEL = "model"  # the Hugging Face export, when the step has one


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


# Held while a step folder is marked complete and moved into place. A process being stopped takes
# it for good (stop_completing), so that the checkpoint its last line names stays the newest
# complete one; a save under way then stays a .tmp_ folder, which the next run removes.
_completing = threading.Lock()


def stop_completing() -> None:
    """For a process about to exit: no checkpoint completes from now on (one that is being
    marked complete this instant finishes first)."""
    _completing.acquire()


def save_step(ckpt_root: Path, step: int, write_contents: Callable[[Path], None], *, keep_last: int) -> Path:
    """Write one step folder atomically; ``write_contents(tmp_dir)`` fills it (other ranks may
    have written their shards into the same temporary folder already)."""
    tmp = tmp_dir(ckpt_root, step)
    tmp.mkdir(parents=True, exist_ok=True)
    write_contents(tmp)
    _fsync_tree(tmp)
    sizes = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    final = ckpt_root / step_dir_name(step)
    with _completing:
        _write_text_atomic(tmp / COMPLETE, json.dumps({"step": step, "file_sizes": sizes}, indent=1) + "\n")
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

    def __init__(self, bind_device: Callable[[], None]) -> None:
        # A new thread starts on device 0 on CUDA and NPU, and DCP's writer asks the thread's
        # current stream: unbound, every rank but local rank 0 would open a context on device 0.
        self._bind_device = bind_device
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def start(self, name: str, task: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                self._bind_device()
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
            cause = _causes(error)[-1]
            detail = " ".join(f"{type(cause).__name__}: {cause}".split())[:300]
            raise CheckpointError(f"writing a checkpoint failed: {detail}") from error


def _causes(error: BaseException) -> list[BaseException]:
    """``error`` and what it came from, back to where the failure started (DCP hands each rank's
    failure over inside a CheckpointException; a failed write there shows as a position mismatch
    raised while handling the OSError)."""
    chain = [error]
    while True:
        failures = getattr(chain[-1], "failures", None)  # DCP's {rank: (exception, traceback)}
        earlier = next(iter(failures.values()))[0] if failures else chain[-1].__cause__ or chain[-1].__context__
        if earlier is None or earlier in chain:
            return chain
        chain.append(earlier)


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` comes from a full disk (or an exhausted quota)."""
    return any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in _causes(error))


def human_size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


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


def resume_hint(output_dir: Path) -> str:
    """Where ``--resume_from_checkpoint auto`` would continue this run from, said for its user."""
    folder = find_checkpoint(output_dir / "checkpoints", "auto", warn=lambda message: None)
    if folder is None:
        return "no checkpoint is complete yet: --resume_from_checkpoint auto would start over"
    return f"--resume_from_checkpoint auto continues from {folder}"


# ----- formats ---------------------------------------------------------------------------------

def json_text(payload: dict[str, Any]) -> str:
    # repr-exact floats: a resumed run must read back the very numbers it saved.
    return json.dumps(payload, indent=1, sort_keys=True) + "\n"


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    # Readable as the umask says, like the run's other files (safetensors alone makes it 0600).
    hf_weights.save_safetensors({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, path)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


@contextlib.contextmanager
def _one_process_is_fine() -> Iterator[None]:
    # DCP warns whenever it runs without a process group; for a one-process run that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def copy_tensors_to_host(state: Any) -> Any:
    """``state`` with every tensor (a DTensor keeps its sharding) copied to host memory, so the
    optimizer may change the originals while a writer thread saves the copies. Written out
    rather than DCP's stager, whose deep copy fails on some torch versions the project
    supports (torch 2.11: KeyError <class 'type'>)."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda tensor: tensor.detach().to("cpu", copy=True), state)


def stage_learner_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, copy: bool) -> dict[str, Any]:
    """This learner's shard of the weights and of the optimizer state for :func:`write_learner_state`:
    with ``copy``, copied to host memory when the checkpoint is taken, so that a writer thread may
    write them while training changes the originals; else the originals themselves."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {"model": {name: p.detach() for name, p in model.named_parameters()},
             "optimizer": get_optimizer_state_dict(model, optimizer)}
    return copy_tensors_to_host(state) if copy else state


def write_learner_state(folder: Path, staged: dict[str, Any], group: Optional[Any]) -> None:
    """Every learner writes its own shards (DCP): a collective over ``group``, a group that
    training never uses, since every learner's writer thread runs it beside training."""
    import torch.distributed.checkpoint as dcp

    with _one_process_is_fine():
        dcp.save(staged, checkpoint_id=str(folder), process_group=group, no_dist=group is None)


def _load(folder: Path, state: dict[str, Any], group: Optional[Any]) -> None:
    import torch.distributed.checkpoint as dcp

    # The template's shapes and shardings tell DCP what this rank reads (its own shard); keys of
    # the checkpoint that the template lacks are not read.
    with _one_process_is_fine():
        dcp.load(state, checkpoint_id=str(folder), process_group=group, no_dist=group is None)


def load_learner_weights(folder: Path, model: torch.nn.Module, group: Optional[Any]) -> None:
    _load(folder, {"model": {name: p.detach() for name, p in model.named_parameters()}}, group)


def load_learner_optimizer(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           group: Optional[Any]) -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    _load(folder, state, group)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def weight_shapes(folder: Path) -> dict[str, torch.Size]:
    """The full shape of every weight in a learner-state folder, by in-memory name, in saved order."""
    from torch.distributed.checkpoint import FileSystemReader

    found = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return {key.removeprefix("model."): torch.Size(meta.size) for key, meta in found.items()
            if key.startswith("model.")}


def read_full_weights(folder: Path, names: list[str], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Whole fp32 tensors of the weights ``names``, assembled from every learner's shards: one
    process reads them, with no process group, a bucket at a time."""
    state = {"model": {name: torch.empty(shapes[name], dtype=torch.float32) for name in names}}
    _load(folder, state, None)
    return state["model"]


def iter_full_weights(folder: Path, names: list[str], bucket_bytes: int) -> Iterator[torch.Tensor]:
    """The weights ``names`` whole, in that order, read ``bucket_bytes`` at a time."""
    saved = weight_shapes(folder)
    shapes = {name: saved[name] for name in names}
    for bucket in hf_weights.plan_files(shapes, 4, bucket_bytes):
        tensors = read_full_weights(folder, bucket, shapes)
        yield from (tensors.pop(name) for name in bucket)


def export_model(step_folder: Path, out_dir: Path, *, part: int = 0, parts: int = 1,
                 max_file_bytes: int = hf_weights.MAX_FILE_BYTES) -> None:
    """Hugging Face weights (what from_pretrained opens) from a step folder's learner shards, one
    file at a time, in the dtype of the model's files; writer ``part`` of ``parts`` writes every
    ``parts``-th file, and part 0 the index, config and tokenizer."""
    from transformers import AutoConfig

    shards, config_dir = step_folder / LEARNER_STATE, step_folder / HF_CONFIG
    shapes = weight_shapes(shards)
    dtype = hf_weights.stored_dtype(AutoConfig.from_pretrained(config_dir, local_files_only=True))
    hf_weights.write_weight_files(out_dir, shapes, dtype, lambda names: read_full_weights(shards, names, shapes),
                                  part=part, parts=parts, max_file_bytes=max_file_bytes)
    if part == 0:
        for path in sorted(config_dir.iterdir()):
            shutil.copyfile(path, out_dir / path.name)


# ----- a training state: what a step folder holds, what a resume checks ------------------------

class Checkpointer:
    """One rank's part in taking and restoring a run's checkpoints (docs/design.md "Checkpoints").

    Checkpoint v is taken right after weights v go to the rollout side. Every rank hands the lead
    its rank state (random generators; on rollout ranks, the data position); every learner stages
    a host copy of its optimizer shard; the lead captures the weights, every sample not yet
    trained on, the trainer state and metrics.csv. Writer threads write the folder while the
    learners train the next step; the next save, or the end of the run, waits for them.
    """

    def __init__(self, cfg: Any, plat: Any, layout: Any, exchange: Any, *, fingerprint: dict[str, Any], tokenizer: Any,
                 learner: Any = None, rollout: Any = None, sampler: Any = None, report: Any = None) -> None:
        # The roles' objects (learner.Learner, rollout.Rollout / DynamicSampler, metrics.StepReporter)
        # and the lead's ends of the exchanges (exchange.py) by duck type: this module sits below them.
        self.cfg, self.plat, self.layout, self.exchange = cfg, plat, layout, exchange
        self.fingerprint, self.tokenizer = fingerprint, tokenizer
        self.learner, self.rollout, self.sampler, self.report = learner, rollout, sampler, report
        self.out_dir = Path(cfg.run.output_dir)
        self.root = self.out_dir / "checkpoints"
        self.warned_of_space = False

    def rank_state(self) -> dict[str, Any]:
        """What this rank alone knows: its random generators and, on rollout ranks, the data position."""
        state: dict[str, Any] = {"rank": self.layout.rank, "rng": self.plat.rng_state()}
        if self.rollout is not None:
            state["prompt_stream"] = self.rollout.position()
        return state

    def save_learner_shard(self, version: int, export: bool) -> None:
        """A learner other than the lead: its shards (and with ``export`` its share of the Hugging
        Face files), written beside training."""
        self.learner.save_shard_in_background(tmp_dir(self.root, version), self.rank_state(), export)

    def save(self, version: int, collected: Optional[tuple[Any, dict[str, Any]]], export: bool) -> float:
        """The lead: take checkpoint ``version`` (``collected``: the next step's batch and row when
        rollout ran ahead; ``export``: with Hugging Face weights); returns the seconds the run waited."""
        start = time.perf_counter()
        states = self.exchange.receive_rank_states(version, self.rank_state())
        staged, learner_states = self.learner.stage_checkpoint(self.rank_state())
        self.warn_if_it_may_not_fit(version)
        learner = self.learner
        state = {"step": version, "weight_version": version, "generated_through_step": version + (collected is not None),
                 "collected_ahead_row": collected[1] if collected is not None else None, **learner.counters(),
                 "kl_coef": learner.kl_coef_at(version), "lr": learner.lr_at(version),
                 "group_size": self.cfg.rollout.sample_num, **self.report.state(), "fingerprint": self.fingerprint,
                 "config": self.cfg.flat()}
        # Serialised now: the trainer goes on changing its state while the writer runs.
        texts = {"rank_states.json": json_text({str(s["rank"]): s for s in states + learner_states}),
                 "trainer_state.json": json_text(state),
                 "metrics.csv": (self.out_dir / "metrics.csv").read_text()}
        buffers = self.sampler.buffers(collected)

        def contents(folder: Path) -> None:
            # The config and tokenizer first: every learner's export reads the dtype from them.
            learner.policy.config.save_pretrained(folder / HF_CONFIG)
            self.tokenizer.save_pretrained(folder / HF_CONFIG)
            sampling_defaults = Path(self.cfg.model.model_path) / "generation_config.json"
            if sampling_defaults.is_file():  # what generate() of the exported model starts from
                shutil.copyfile(sampling_defaults, folder / HF_CONFIG / sampling_defaults.name)
            learner.write_checkpoint_part(folder, staged, export)
            write_tensors(folder / "sample_buffer.safetensors", buffers)
            for name, text in texts.items():
                (folder / name).write_text(text)

        self.learner.write_checkpoint(f"save-{version}",
                                      lambda: save_step(self.root, version, contents, keep_last=self.cfg.run.keep_last))
        return time.perf_counter() - start

    def warn_if_it_may_not_fit(self, version: int) -> None:
        """Warn, once a run, when output_dir's filesystem has less room than checkpoint ``version``
        needs: as much as the newest complete one, or before the first, the memory plan's count."""
        if self.warned_of_space:
            return
        newest = complete_steps(self.root)[-1:]
        needed = sum(read_json(newest[0] / COMPLETE)["file_sizes"].values()) if newest else \
            memory_plan.checkpoint_bytes(sum(p.numel() for p in self.learner.policy.parameters()))
        free = shutil.disk_usage(self.out_dir).free
        if free < needed:
            self.warned_of_space = True
            warn(f"checkpoint {step_dir_name(version)} needs about {human_size(needed)}, and the filesystem of "
                 f"{self.out_dir} has {human_size(free)} free: the save is likely to fail. Keep fewer checkpoints "
                 f"(keep_last {self.cfg.run.keep_last}), save less often (save_every {self.cfg.run.save_every}), "
                 f"or put output_dir on another disk")

    def restore(self, folder: Path, saved: dict[str, Any]) -> None:
        """Everything but the learners' weights (loaded with their models): a rollout rank's weights,
        optimizer, counters, sample buffer, data position, metrics so far, and last this rank's
        random generators."""
        if self.learner is not None:
            self.learner.restore(folder, saved)
        mine = read_json(folder / "rank_states.json")[str(self.layout.rank)]
        if self.rollout is not None and self.learner is None:  # a one-process run's rollout copies the learner
            self.rollout.load_checkpoint_weights(folder / LEARNER_STATE, saved["weight_version"])
        if self.rollout is not None:
            self.rollout.weight_version = saved["weight_version"]
            self.rollout.prompts.seek(**mine["prompt_stream"])
        if self.layout.is_lead:
            self.sampler.restore(read_tensors(folder / "sample_buffer.safetensors"), saved["group_size"],
                                 saved["collected_ahead_row"])
            self.report.restore(saved, folder / "metrics.csv")
        self.plat.set_rng_state(mine["rng"])


def export_command(argv: list[str]) -> int:
    """``python ckpt.py export STEP_DIR OUT_DIR``: a step folder's weights in Hugging Face format."""
    import argparse

    parser = argparse.ArgumentParser(prog="python ckpt.py", description="Checkpoint tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="write a step folder's weights as a Hugging Face model folder")
    export.add_argument("step_dir", type=Path, help="OUTPUT_DIR/checkpoints/step_<N>")
    export.add_argument("out_dir", type=Path, help="a new folder (refused if it exists and is not empty)")
    export.add_argument("--max_file_mb", type=int, default=hf_weights.MAX_FILE_BYTES // 2**20)
    args = parser.parse_args(argv)
    try:
        check_step(args.step_dir)
        if args.out_dir.exists() and any(args.out_dir.iterdir()):
            raise CheckpointError(f"{args.out_dir} exists and is not empty: give a new folder")
        if not (args.step_dir / LEARNER_STATE).is_dir():
            raise CheckpointError(f"{args.step_dir} holds no learner shards ({LEARNER_STATE}/): written by an "
                                  f"older version, its model/ folder is the export")
        # Written beside the target, moved into place when complete: a failure leaves no half model.
        partial = args.out_dir.with_name(f".{args.out_dir.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        export_model(args.step_dir, partial, max_file_bytes=args.max_file_mb * 2**20)
        os.replace(partial, args.out_dir)
    except CheckpointError as error:
        sys.stderr.write(f"error: {error}\n")
        return 2
    print(f"wrote {args.out_dir}: AutoModelForCausalLM.from_pretrained opens it")
    return 0


if __name__ == "__main__":
    sys.exit(export_command(sys.argv[1:]))
