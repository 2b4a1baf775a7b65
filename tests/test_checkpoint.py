"""Checkpoints: atomic folders, refusal of damaged ones, and resumes that match uninterrupted runs."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt
import resuming
import memory_plan
import train_dapo
from config import Derived, load_config
from device import select_platform
from ranks import Layout
from metrics import TIMING_COLUMNS

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = Path("model") / "model.safetensors"


def rows_without_timing(out: Path) -> list[dict[str, str]]:
    with (out / "metrics.csv").open() as f:
        return [{k: v for k, v in row.items() if k not in TIMING_COLUMNS} for row in csv.DictReader(f)]


def train(argv: list[str], script: tuple[str, ...] = ("train_dapo.py",)) -> subprocess.CompletedProcess:
    """A one-process run in its own interpreter, one thread: the arithmetic every run here compares."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *script, *argv], cwd=ROOT, env=env, capture_output=True, text=True)


def step_folder(out: Path, step: int) -> Path:
    return out / "checkpoints" / ckpt.step_dir_name(step)


def run_argv(demo_argv: list[str], out: Path, steps: int, *extra: str) -> list[str]:
    # val_every 3: the 3-step run validates at step 3 like the 6-step one, so every row can match.
    return demo_argv + ["--output_dir", str(out), "--max_steps", str(steps), "--save_every", "1",
                        "--val_every", "3", *extra]


@pytest.fixture(scope="module")
def uninterrupted(demo_assets, tmp_path_factory) -> Path:
    """A 6-step one-process run, checkpoint every step, the reference for every resume below."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    argv = ["--config", str(ROOT / "configs" / "demo_cpu.yaml"), "--model_path", str(demo_assets / "model"),
            "--dataset", str(demo_assets / "train.jsonl"), "--val_dataset", str(demo_assets / "val.jsonl"),
            "--val_max_prompts", "24", "--log_every", "1"]
    proc = train(run_argv(argv, out, 6))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


# ----- the folder format ------------------------------------------------------------------------

def fill(folder: Path) -> None:
    (folder / "weights.bin").write_bytes(b"x" * 100)
    (folder / "state.json").write_text(ckpt.json_text({"a": 1}))


def test_save_is_atomic_and_keeps_the_newest(tmp_path):
    root = tmp_path / "checkpoints"
    for step in range(1, 6):
        ckpt.save_step(root, step, fill, keep_last=3)
    assert [p.name for p in ckpt.complete_steps(root)] == [ckpt.step_dir_name(s) for s in (3, 4, 5)]
    assert (root / "latest").read_text().strip() == ckpt.step_dir_name(5)
    assert not list(root.glob(".tmp_*"))
    newest = root / ckpt.step_dir_name(5)
    marker = json.loads((newest / ckpt.COMPLETE).read_text())
    assert marker["file_sizes"] == {"state.json": (newest / "state.json").stat().st_size, "weights.bin": 100}


def test_damaged_folders_are_refused_and_auto_skips_them(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        ckpt.save_step(root, step, fill, keep_last=5)
    (root / ckpt.step_dir_name(3) / ckpt.COMPLETE).unlink()
    with (root / ckpt.step_dir_name(2) / "weights.bin").open("r+b") as f:
        f.truncate(40)
    with pytest.raises(ckpt.CheckpointError, match="incomplete"):
        ckpt.check_step(root / ckpt.step_dir_name(3))
    with pytest.raises(ckpt.CheckpointError, match="weights.bin is truncated"):
        ckpt.check_step(root / ckpt.step_dir_name(2))
    warnings: list[str] = []
    assert ckpt.find_checkpoint(root, "auto", warnings.append) == root / ckpt.step_dir_name(1)
    assert len(warnings) == 2 and "incomplete" in warnings[0] and "truncated" in warnings[1]
    assert ckpt.find_checkpoint(tmp_path / "nothing", "auto", warnings.append) is None
    with pytest.raises(ckpt.CheckpointError, match="not a checkpoint step folder"):
        ckpt.find_checkpoint(root, str(tmp_path), warnings.append)


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    ckpt.save_step(root, 1, fill, keep_last=3)
    script = (f"import os, signal, sys; sys.path.insert(0, {str(ROOT)!r}); import ckpt\n"
              f"def die(folder):\n"
              f"    (folder / 'weights.bin').write_bytes(b'half')\n"
              f"    os.kill(os.getpid(), signal.SIGKILL)\n"
              f"ckpt.save_step(ckpt.Path({str(root)!r}), 2, die, keep_last=3)\n")
    assert subprocess.run([sys.executable, "-c", script]).returncode == -9
    assert (root / ".tmp_step_00000002" / "weights.bin").is_file()
    assert ckpt.find_checkpoint(root, "auto", pytest.fail) == root / ckpt.step_dir_name(1)
    ckpt.remove_partial_saves(root)
    assert sorted(p.name for p in root.iterdir()) == ["latest", ckpt.step_dir_name(1)]


# ----- resuming the one-process run ---------------------------------------------------------------

def test_one_process_resume_matches_the_uninterrupted_run(demo_argv, uninterrupted, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "resumed"
    # Its checkpoints written without the host copy, from the learner's tensors while the step waits.
    assert train(run_argv(demo_argv, out, 3, "--async_save", "false")).returncode == 0
    proc = train(run_argv(demo_argv, out, 6, "--resume_from_checkpoint", "auto"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"resuming from {step_folder(out, 3)}" in proc.stdout
    assert (step_folder(out, 6) / WEIGHTS).read_bytes() == (step_folder(uninterrupted, 6) / WEIGHTS).read_bytes()
    resumed, reference = rows_without_timing(out), rows_without_timing(uninterrupted)
    assert [r["step"] for r in resumed] == [str(s) for s in range(7)]
    assert resumed == reference
    # keep_last 3 (the config's default) and a model folder any transformers user can open. Keys
    # that do not fit only earn a warning from from_pretrained (missing ones start random), so
    # ask it what it matched.
    assert [p.name for p in ckpt.complete_steps(out / "checkpoints")] == [ckpt.step_dir_name(s) for s in (4, 5, 6)]
    _, loading = AutoModelForCausalLM.from_pretrained(step_folder(out, 6) / "model", output_loading_info=True)
    assert not any(loading[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), \
        loading


def test_sigkill_while_saving_then_auto_resume(demo_argv, uninterrupted, tmp_path):
    """The whole job (one process) is killed while checkpoint 3 is being written."""
    out = tmp_path / "killed"
    script = ("import os, signal, sys; import ckpt, train_dapo\n"
              "real = ckpt._fsync_tree\n"
              "def fsync_then_die(folder):\n"
              "    if folder.name.endswith('step_00000003'): os.kill(os.getpid(), signal.SIGKILL)\n"
              "    real(folder)\n"
              "ckpt._fsync_tree = fsync_then_die\n"
              "sys.exit(train_dapo.main(sys.argv[1:]))\n")
    killed = train(run_argv(demo_argv, out, 6), script=("-c", script))
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (out / "checkpoints" / ".tmp_step_00000003" / WEIGHTS).is_file()  # written, never marked complete
    assert (out / "checkpoints" / "latest").read_text().strip() == ckpt.step_dir_name(2)
    resumed = train(run_argv(demo_argv, out, 6, "--resume_from_checkpoint", "auto"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming from {step_folder(out, 2)}" in resumed.stdout
    assert not (out / "checkpoints" / ".tmp_step_00000003").exists()
    assert (step_folder(out, 6) / WEIGHTS).read_bytes() == (step_folder(uninterrupted, 6) / WEIGHTS).read_bytes()
    assert rows_without_timing(out) == rows_without_timing(uninterrupted)


# ----- refusals: one line, exit 2, nothing on disk changed -----------------------------------------

def refused(argv: list[str], capsys) -> str:
    assert train_dapo.main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if not line.startswith("warning: ")]
    assert len(errors) == 1 and errors[0].startswith("error: "), err
    return errors[0]


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.fixture
def finished_copy(uninterrupted, tmp_path) -> Path:
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(uninterrupted, out)
    return out


def test_truncated_weights_are_refused(demo_argv, finished_copy, capsys):
    weights = step_folder(finished_copy, 6) / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:1000])
    before = snapshot(finished_copy)
    err = refused(run_argv(demo_argv, finished_copy, 8, "--resume_from_checkpoint", str(step_folder(finished_copy, 6))),
                  capsys)
    assert err.startswith("error: checkpoint") and "model/model.safetensors is truncated" in err
    assert snapshot(finished_copy) == before


def test_missing_complete_is_refused(demo_argv, finished_copy, capsys):
    (step_folder(finished_copy, 5) / ckpt.COMPLETE).unlink()
    err = refused(run_argv(demo_argv, finished_copy, 8, "--resume_from_checkpoint", str(step_folder(finished_copy, 5))),
                  capsys)
    assert "is incomplete (no COMPLETE marker" in err


def test_checkpoint_of_another_model_is_refused(demo_argv, demo_assets, finished_copy, tmp_path, capsys):
    import shutil

    other = tmp_path / "other_model"
    shutil.copytree(demo_assets / "model", other)
    config = json.loads((other / "config.json").read_text())
    config["max_position_embeddings"] *= 2  # loads fine, is a different model
    (other / "config.json").write_text(json.dumps(config))
    before = snapshot(finished_copy)
    err = refused(run_argv(demo_argv, finished_copy, 8, "--resume_from_checkpoint", "auto", "--model_path", str(other)),
                  capsys)
    assert "does not match this run's model: max_position_embeddings: 128 (checkpoint) vs 256" in err
    assert snapshot(finished_copy) == before


def test_checkpoint_of_another_layout_or_batching_is_refused(demo_argv, finished_copy, capsys):
    err = refused(run_argv(demo_argv, finished_copy, 8, "--resume_from_checkpoint", "auto", "--prompts_per_step", "4"),
                  capsys)
    assert "does not match this run's data: prompts_per_step: 6 (checkpoint) vs 4 (this run)" in err
    # The layout check runs in every rank's Trainer, before any model is loaded or group used.
    cfg = load_config(run_argv(demo_argv, finished_copy, 8, "--learner_ranks", "1"))  # 2 processes: 1 + 1
    with pytest.raises(train_dapo.UserError, match="does not match this run's layout: world_size: 1 .checkpoint. vs 2"):
        train_dapo.Trainer(cfg, select_platform("cpu"), Derived.of(cfg, 2),
                           Layout(world_size=2, rank=1, num_learners=1), resume=step_folder(finished_copy, 6))


def test_a_checkpoint_without_learner_shards_is_refused_with_one_line(demo_argv, finished_copy, capsys):
    import shutil

    shutil.rmtree(step_folder(finished_copy, 6) / ckpt.LEARNER_STATE)  # what an older version wrote
    complete = step_folder(finished_copy, 6) / ckpt.COMPLETE
    marker = json.loads(complete.read_text())
    marker["file_sizes"] = {k: v for k, v in marker["file_sizes"].items() if not k.startswith(ckpt.LEARNER_STATE)}
    complete.write_text(json.dumps(marker))
    before = snapshot(finished_copy)
    err = refused(run_argv(demo_argv, finished_copy, 8, "--resume_from_checkpoint", str(step_folder(finished_copy, 6))),
                  capsys)
    assert f"has no {ckpt.LEARNER_STATE}/: it was written by an older version" in err
    assert snapshot(finished_copy) == before


def test_auto_without_a_checkpoint_starts_fresh_and_says_so(demo_argv, tmp_path, capsys):
    out = tmp_path / "fresh"
    assert train_dapo.main(run_argv(demo_argv, out, 1, "--resume_from_checkpoint", "auto")) == 0
    assert "no complete checkpoint" in capsys.readouterr().out
    assert [r["step"] for r in rows_without_timing(out)] == ["0", "1"]


def test_alarm_history_and_sample_buffers_survive_the_checkpoint_formats(tmp_path):
    from metrics import AlarmMonitor
    from tests.test_rollout import fake_batch

    def feed(monitor, lengths):
        return [monitor.observe_step(kl=0.01 * n, length=n, reward_std=0.5) for n in lengths]

    uninterrupted, first = AlarmMonitor(length_rising_steps=3), AlarmMonitor(length_rising_steps=3)
    feed(uninterrupted, [1, 2, 3]), feed(first, [1, 2, 3])
    uninterrupted.observe_validation(val_reward=0.5, train_reward=0.1)
    first.observe_validation(val_reward=0.5, train_reward=0.1)
    resumed = AlarmMonitor(length_rising_steps=3)
    resumed.restore(json.loads(json.dumps(first.history())))
    fired = feed(resumed, [4, 5, 1])
    assert fired == feed(uninterrupted, [4, 5, 1])
    assert fired[0], "the length alarm needs the streak carried over from before the checkpoint"
    assert resumed.history() == uninterrupted.history()

    batch = fake_batch([1, 0, 0, 1], group_size=2, prompt_width=3, response_width=2)
    ckpt.write_tensors(tmp_path / "buffer.safetensors", batch.named_tensors("pool"))
    stored = ckpt.read_tensors(tmp_path / "buffer.safetensors")
    back = type(batch).from_named_tensors(stored, "pool", group_size=2)
    assert all(torch.equal(getattr(back, k), v) and getattr(back, k).dtype == v.dtype
               for k, v in batch.tensors().items())
    assert type(batch).from_named_tensors(stored, "ahead", group_size=2) is None


def test_a_restarted_job_prefers_its_own_newest_checkpoint(demo_argv, tmp_path):
    other_run = tmp_path / "other" / "checkpoints"
    ckpt.save_step(other_run, 7, fill, keep_last=3)
    out = tmp_path / "run"
    cfg = load_config(demo_argv + ["--output_dir", str(out), "--resume_from_checkpoint",
                                   str(other_run / ckpt.step_dir_name(7))])
    def resume_folder(cfg, restarted: bool):
        return resuming.find_resume_checkpoint(Path(cfg.run.output_dir), cfg.run.resume_from_checkpoint,
                                           restarted=restarted, warn=print, log=print)

    assert resume_folder(cfg, restarted=False) == other_run / ckpt.step_dir_name(7)
    assert resume_folder(cfg, restarted=True) == other_run / ckpt.step_dir_name(7)  # none of its own
    ckpt.save_step(out / "checkpoints", 9, fill, keep_last=3)
    assert resume_folder(cfg, restarted=False) == other_run / ckpt.step_dir_name(7)  # as told
    assert resume_folder(cfg, restarted=True) == out / "checkpoints" / ckpt.step_dir_name(9)
    fresh = load_config(demo_argv + ["--output_dir", str(tmp_path / "fresh")])
    assert resume_folder(fresh, restarted=True) is None


# ----- disk space ----------------------------------------------------------------------------------

def test_a_checkpoint_that_may_not_fit_is_warned_of_once(demo_argv, demo_assets, tmp_path, capsys, monkeypatch):
    import shutil

    from transformers import AutoConfig

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=2**20))  # 1 MiB free, it says
    out = tmp_path / "run"
    assert train_dapo.main(run_argv(demo_argv, out, 3)) == 0  # the disk is not really full: every save succeeds
    warnings = [line for line in capsys.readouterr().err.splitlines() if "needs about" in line]
    # Before the first checkpoint, the memory plan's count: fp32 weights and AdamW's two moments.
    params = memory_plan.Architecture.of(AutoConfig.from_pretrained(demo_assets / "model")).params
    expected = ckpt.human_size(memory_plan.checkpoint_bytes(params))
    assert warnings == [f"warning: checkpoint step_00000001 needs about {expected}, and the filesystem of {out} has "
                        f"1.0 MiB free: the save is likely to fail. Keep fewer checkpoints (keep_last 3), save less "
                        f"often (save_every 1), or put output_dir on another disk"]


def test_a_dcp_write_on_a_full_disk_is_named_in_one_line():
    """DCP reports a write that hit a full disk as a position mismatch raised while handling the
    OSError, wrapped per rank in a CheckpointException whose text holds whole tracebacks."""
    import errno
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    def dcp_save() -> None:
        try:
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        except RuntimeError as error:
            failure = error
        # Raised afterwards, as DCP's coordinator does: nothing but its failures leads to the OSError.
        raise CheckpointException("ranks:dict_keys([0])", {0: (failure, traceback.extract_tb(failure.__traceback__))})

    writer = ckpt.BackgroundWriter(bind_device=lambda: None)
    writer.start("save-3", dcp_save)
    with pytest.raises(ckpt.CheckpointError) as failure:
        writer.wait()
    assert str(failure.value) == "writing a checkpoint failed: OSError: [Errno 28] No space left on device"
    assert ckpt.disk_full(failure.value)
    assert not ckpt.disk_full(ckpt.CheckpointError("writing a checkpoint failed: PermissionError"))


def test_async_save_false_stages_the_shards_themselves_and_true_copies_them():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    for copy in (True, False):
        staged = ckpt.stage_learner_state(model, optimizer, copy=copy)
        weight, moment = staged["model"]["weight"], staged["optimizer"]["state"]["weight"]["exp_avg"]
        assert torch.equal(weight, model.weight) and torch.equal(moment, optimizer.state[model.weight]["exp_avg"])
        shared = (weight.data_ptr() == model.weight.data_ptr(),
                  moment.data_ptr() == optimizer.state[model.weight]["exp_avg"].data_ptr())
        assert shared == ((False, False) if copy else (True, True)), copy
