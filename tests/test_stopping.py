"""How a run stops: Ctrl-C and SIGTERM end it with one line and 128 + the signal, with one process
and under torchrun; a full disk ends it with one line that names the checkpoint to resume from;
a checkpoint being completed when the stop comes is left incomplete, never half done."""
import errno
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import ckpt
import metrics
import train_dapo
from tests.test_ranks import run_args

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
STOP_LINE = re.compile(r"stopped by (.+) during step (\d+); --resume_from_checkpoint auto continues from (\S+)$")


def signal_at_step(cmd: list[str], step: int, sig: int, *, whole_group: bool, env: dict[str, str] = ENV
                   ) -> tuple[int, str]:
    """Start ``cmd`` and send ``sig`` once its console shows step ``step``: to its whole process
    group (what a terminal's Ctrl-C does) or to its first process only (``kill PID``). Returns
    (exit status, stderr)."""
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        for line in job.stdout:
            if line.startswith(f"step {step:5d} |"):
                (os.killpg if whole_group else os.kill)(job.pid, sig)
                break
        else:
            pytest.fail(f"the run ended before step {step}: {job.stderr.read()[-3000:]}")
        _, err = job.communicate(timeout=60)
        return job.returncode, err
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


def the_stop_line(err: str, out: Path) -> tuple[str, int, Path]:
    """The one line a stopped run prints (besides warnings and launch.sh's set-up), as (signal,
    step, checkpoint named), after checking that it names the newest complete checkpoint."""
    lines = [line for line in err.splitlines() if not line.startswith(("warning: ", "setup: "))]
    assert len(lines) == 1 and STOP_LINE.match(lines[0]), err[-3000:]
    how, step, named = STOP_LINE.match(lines[0]).groups()
    assert Path(named) == ckpt.find_checkpoint(out / "checkpoints", "auto", pytest.fail)  # complete and intact
    assert int(Path(named).name.split("_")[1]) in (int(step) - 2, int(step) - 1)  # v_(step-1) may still be saving
    return how, int(step), Path(named)


def test_ctrl_c_stops_one_process_with_one_line_and_a_resumable_checkpoint(demo_argv, tmp_path):
    out = tmp_path / "run"
    argv = demo_argv + ["--output_dir", str(out), "--max_steps", "500", "--save_every", "1"]
    status, err = signal_at_step([sys.executable, "train_dapo.py", *argv], 4, signal.SIGINT, whole_group=True)
    assert status == 130
    how, _, named = the_stop_line(err, out)
    assert how == "Ctrl-C (SIGINT)"
    resumed_to = int(named.name.split("_")[1]) + 1
    resumed = subprocess.run([sys.executable, "train_dapo.py", *argv, "--max_steps", str(resumed_to),
                              "--resume_from_checkpoint", "auto"], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {named}" in resumed.stdout


@pytest.mark.parametrize("launcher, sig, whole_group, said", [
    (["./launch.sh", "train", "configs/demo_cpu.yaml"], signal.SIGINT, True, "Ctrl-C (SIGINT)"),
    ([sys.executable, "stopping.py", "--standalone", "--nproc_per_node=2", "train_dapo.py", "--config",
      "configs/demo_cpu.yaml"], signal.SIGTERM, False, "SIGTERM"),
], ids=["Ctrl-C on launch.sh train", "SIGTERM to torchrun"])
def test_a_stopped_torchrun_job_says_it_once(demo_assets, tmp_path, launcher, sig, whole_group, said):
    """Two ranks: the rollout rank is usually inside a collective or generating when the signal
    comes, the lead inside the update; torchrun forwards the signal to both."""
    out = tmp_path / "run"
    args = run_args(demo_assets, out, 500, "--learner_ranks", "1", "--save_every", "1")[3:]  # after the config
    status, err = signal_at_step([*launcher, *args], 4, sig, whole_group=whole_group,
                                 env={**ENV, "NPROC_PER_NODE": "2"})
    assert status == 128 + sig
    assert the_stop_line(err, out)[0] == said


def test_bad_input_under_launch_sh_train_is_one_line_and_exit_status_2(demo_assets, tmp_path):
    """Two ranks both refuse a misspelt key: the line once, no torchrun traceback, the launcher's
    status 2, and nothing written."""
    out = tmp_path / "run"
    args = run_args(demo_assets, out, 2, "--learner_ranks", "1", "--kl_coeff", "0.1")[3:]
    proc = subprocess.run(["./launch.sh", "train", "configs/demo_cpu.yaml", *args], cwd=ROOT,
                          env={**ENV, "NPROC_PER_NODE": "2"}, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if not line.startswith(("setup:", "WARNING: Location"))]
    assert lines == ["error: unknown config key 'kl_coeff' on the command line (did you mean 'kl_coef'?)"], lines
    assert not out.exists()


@pytest.mark.parametrize("first_status", [2, 1])
def test_torchrun_s_lines_about_a_rank_that_exits_on_bad_input_first_are_dropped(tmp_path, first_status):
    """Rank 1 exits first (status 2: bad input) while rank 0 is still starting (sleeping), so
    torchrun SIGTERMs it: the job still ends with rank 1's line alone and status 2. Any other
    status keeps torchrun's lines, the SIGTERM it sent included, and its own exit status."""
    script = tmp_path / "rank.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n"
                      f"    sys.stderr.write('error: rank 1 refuses\\n'); sys.exit({first_status})\n"
                      "time.sleep(60)\n")
    proc = subprocess.run([sys.executable, "stopping.py", "--standalone", "--nproc_per_node=2", "--monitor_interval=0.1",
                           str(script)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    lines = proc.stderr.splitlines()
    if first_status == 2:
        assert (proc.returncode, lines) == (2, ["error: rank 1 refuses"])
    else:
        assert proc.returncode == 1 and lines[0] == "error: rank 1 refuses", proc.stderr
        assert "closing signal SIGTERM" in proc.stderr and "rank.py FAILED" in proc.stderr, proc.stderr


class WatchedLock:
    """A lock that tells whether a thread is waiting for it, and whether it got it."""

    def __init__(self) -> None:
        self.lock, self.waiting, self.got = threading.Lock(), threading.Event(), threading.Event()

    def acquire(self) -> None:
        self.waiting.set()
        self.lock.acquire()
        self.got.set()

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def test_a_stop_while_a_checkpoint_is_completed_leaves_it_incomplete(tmp_path, monkeypatch):
    """The stop takes the lock under which a folder is marked complete and renamed: a save that
    reaches that point afterwards waits there (blocked, not merely slow) with its folder still a
    .tmp_ one, so the checkpoint the stop line names is still the newest complete one when the
    process is gone. (Given the lock back, the save completes: the lock alone held it.)"""
    root = tmp_path / "checkpoints"
    ckpt.save_step(root, 1, lambda folder: (folder / "w").write_text("1"), keep_last=3)
    completing, files_written = WatchedLock(), threading.Event()
    monkeypatch.setattr(ckpt, "_completing", completing)

    def write(folder: Path) -> None:
        (folder / "w").write_text("2")
        files_written.wait()

    saving = threading.Thread(target=ckpt.save_step, args=(root, 2, write), kwargs={"keep_last": 3}, daemon=True)
    saving.start()
    ckpt.stop_completing()
    assert ckpt.resume_hint(root.parent) == f"--resume_from_checkpoint auto continues from {root / 'step_00000001'}"
    assert completing.got.is_set()  # the stop holds the lock
    completing.waiting.clear(), completing.got.clear()  # from here on, only the save asks for it
    files_written.set()
    assert completing.waiting.wait(timeout=30), "the save never reached the lock"
    saving.join(timeout=0.5)
    assert saving.is_alive() and not completing.got.is_set(), "the save went past the stop"
    assert [p.name for p in ckpt.complete_steps(root)] == ["step_00000001"]
    unfinished = root / ".tmp_step_00000002"
    assert (unfinished / "w").read_text() == "2" and not (unfinished / "COMPLETE").exists()
    completing.release()
    saving.join(timeout=30)
    assert not saving.is_alive() and [p.name for p in ckpt.complete_steps(root)] == ["step_00000001", "step_00000002"]


def the_failure_line(argv: list[str], capsys) -> str:
    assert train_dapo.main(argv) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def full_disk(path: Path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_a_full_disk_under_a_checkpoint_ends_with_one_line_naming_the_previous_one(demo_argv, tmp_path, capsys,
                                                                                   monkeypatch):
    out = tmp_path / "run"
    write_tensors = ckpt.write_tensors

    def disk_fills_at_step_3(path, tensors):
        if ckpt.step_dir_name(3) in str(path):
            raise full_disk(path)
        write_tensors(path, tensors)

    monkeypatch.setattr(ckpt, "write_tensors", disk_fills_at_step_3)
    line = the_failure_line(demo_argv + ["--output_dir", str(out), "--max_steps", "6", "--save_every", "1"], capsys)
    assert line.startswith("error: writing a checkpoint failed: no space left on device (")
    assert "keep_last" in line and "save_every" in line and "another disk" in line
    assert line.endswith(f"then --resume_from_checkpoint auto continues from {out / 'checkpoints' / 'step_00000002'}")


def test_a_full_disk_under_the_logs_ends_with_one_line_too(demo_argv, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    record = metrics.CompletionLog.record

    def disk_full_at_step_3(log, step, batch):
        if step == 3:
            raise full_disk(log.path)
        record(log, step, batch)

    monkeypatch.setattr(metrics.CompletionLog, "record", disk_full_at_step_3)
    line = the_failure_line(demo_argv + ["--output_dir", str(out), "--max_steps", "6", "--save_every", "1"], capsys)
    assert line.startswith(f"error: writing {out / 'completions.jsonl'} failed: no space left on device (")
    named = Path(line.split("continues from ")[1])
    assert named.name in ("step_00000001", "step_00000002")  # checkpoint 2 is being written during step 3
    ckpt.check_step(named)
