"""Faults through real torchrun jobs on CPU/gloo: ranks killed and the job restarted, a rank
killed or stuck for good, a phase slower than dist_timeout_s (faults.py injects them)."""
import contextlib
import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.test_ranks import ROOT, metrics_rows, run_args, torchrun

if str(ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench"))
import fault_matrix  # noqa: E402


THREE_RANKS = fault_matrix.Job(nproc=3, learners=2)  # every role: rollout rank 0, the lead (1), the other learner (2)


def test_ranks_killed_in_three_phases_restart_the_job_which_ends_like_an_uninterrupted_one(demo_assets, tmp_path):
    """Three cells of bench/fault_matrix.py in one job under torchrun --max-restarts 3, one per
    role, each SIGKILLed as a phase begins (the rollout rank, which holds the job's store, by the
    lead learner as it starts the update of step 3; the lead as it saves step 4; the other
    learner in the sample transfer of step 6); the job restarts by itself from its newest checkpoint each time and ends with the
    uninterrupted run's metrics rows and weights, so resuming is exact, and so is repeating."""
    args = ("--save_every", "1", "--keep_last", "10", "--val_every", "3")
    reference, restarted = tmp_path / "uninterrupted", tmp_path / "restarted"
    uninterrupted = fault_matrix.torchrun(run_args(demo_assets, reference, 6, *args), job=THREE_RANKS)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    assert uninterrupted.stdout.count("role=rollout") == 1 and uninterrupted.stdout.count("role=learner") == 2
    rows = metrics_rows(reference)
    assert [r["step"] for r in rows] == [str(s) for s in range(7)]
    assert rows[2]["staleness"] == "1"  # step 2 trained on samples from v0: rollout ran one step ahead
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(reference / "checkpoints" / "step_00000006" / "model")
    base = AutoModelForCausalLM.from_pretrained(demo_assets / "model")
    assert any(not torch.equal(p, q) for p, q in zip(trained.parameters(), base.parameters()))

    cells = [("rollout", "update", 3), ("lead learner", "save", 4), ("other learner", "sample transfer", 6)]
    failure, _ = fault_matrix.run_cells(run_args(demo_assets, restarted, 6, *args), cells, THREE_RANKS)
    assert failure is None, failure
    assert fault_matrix.differences(restarted, reference, 6) == []


def test_one_fault_per_attempt():
    """DAPO_FAULT lists one fault per attempt of the job; an attempt past the list meets none."""
    import faults

    spec = "2:update:2:kill=1,3:checkpoint:3"
    planned = []
    for attempt in ("0", "1", "2"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("DAPO_FAULT", spec)
            patch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
            faults.planned.cache_clear()
            planned.append(faults.planned())
    faults.planned.cache_clear()
    assert planned == [faults.Fault(2, "update", 2, "kill", "1"), faults.Fault(3, "checkpoint", 3, "kill", None), None]


def test_a_killed_rank_ends_the_job_and_the_survivor_names_it_and_its_phase(demo_assets, tmp_path):
    """The lead learner SIGKILLed from outside mid-run, without restarts: the rollout rank, whose
    exchange with it breaks or which torchrun stops, says once which rank died and in which phase
    (from its last heartbeat), not the phase it was waiting in."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "stopping.py", "--standalone", "--nproc_per_node=2", "--monitor_interval=5",
           *run_args(demo_assets, tmp_path / "kill", 500, "--dist_timeout_s", "30", "--learner_ranks", "1")]
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        metrics = tmp_path / "kill" / "metrics.csv"
        deadline = time.time() + 180
        while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            time.sleep(0.5)
        assert metrics.exists(), "the job never wrote a metrics row"
        children = sorted(map(int, subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True,
                                                  text=True).stdout.split()))
        assert len(children) == 2
        killed_at = time.time()
        os.kill(children[1], signal.SIGKILL)  # rank 1, the lead learner (ranks start in order)
        _, err = job.communicate(timeout=30 + 60)
        assert job.returncode != 0
        assert time.time() - killed_at < 30 + 30
        said = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(said) == 1 and re.fullmatch(
            r"error: rank 1 \(lead learner\) died in (generation|sample transfer|weight sync|update|validation|"
            r"checkpoint|training) of step \d+; the other ranks stopped", said[0]), err[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


def test_a_phase_longer_than_dist_timeout_is_waited_for(demo_assets, tmp_path):
    """Rank 0 generates step 2 for 15 s, dist_timeout_s is 6: its heartbeat goes on, so the lead
    waits for its samples however long, and the run ends normally."""
    out = tmp_path / "slow"
    proc = torchrun(2, run_args(demo_assets, out, 3, "--learner_ranks", "1", "--dist_timeout_s", "6"),
                    fault="0:generation:2:sleep=15")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with (out / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"]
    # the slow generation was step 2's: more than twice dist_timeout_s (not the full 15 s: rollout
    # runs a step ahead, so part of the sleep can fall before step 2's clock starts)
    assert float(rows[2]["step_time_s"]) > 2 * 6


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP): state T in /proc/PID/stat."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("fault, named", [
    ("1:update:2:stop", "rank 1 (lead learner, last heard in "),  # the rollout rank waits for its weights
    ("0:generation:2:stop", "rank 0, which holds the job's store, is dead or stuck"),  # its store freezes too
])
def test_a_stuck_rank_is_given_up_after_dist_timeout_naming_it(demo_assets, tmp_path, fault, named):
    """A rank that stops (SIGSTOP: its heartbeat stops too) while the other waits for it: the
    waiting rank ends the run with one line naming its phase and the stuck rank, after
    dist_timeout_s (6 s) of silence and not before (a margin for a loaded machine's heartbeats)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DAPO_FAULT": fault}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--monitor_interval=1",
           *run_args(demo_assets, tmp_path / "stuck", 6, "--learner_ranks", "1", "--dist_timeout_s", "6")]
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err:
        job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                               start_new_session=True)
    pids = {}
    try:
        for line in job.stdout:
            if " pid=" in line:
                pids[int(line.split("/")[0].split()[1])] = int(line.split(" pid=")[1].split()[0])
            if len(pids) == 2:
                break
        stuck = pids[int(fault.split(":")[0])]
        deadline = time.time() + 120
        while not stopped(stuck) and time.time() < deadline:
            time.sleep(0.02)
        stuck_at = time.time()
        while "error:" not in stderr.read_text() and time.time() < deadline:
            time.sleep(0.02)
        given_up_after = time.time() - stuck_at
        errors = [line for line in stderr.read_text().splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and named in errors[0] and "failed: " in errors[0], stderr.read_text()[-3000:]
        assert 6 - 0.5 < given_up_after < 6 + 6, given_up_after
    finally:
        for pid in pids.values():  # torchrun would wait 30 s for the stopped rank to end
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.wait(timeout=60)


def test_a_survivor_of_the_store_host_learns_at_once_that_the_store_is_gone():
    """torchrun SIGTERMs the survivors of a dead rank 0 and SIGKILLs them 30 s later; a survivor
    asking the dead store what happened (Liveness.dead_peer) must hear "gone" at once, not after
    the store's timeout of client reconnects."""
    import datetime

    import torch.distributed as dist

    from liveness import Liveness

    timeout = datetime.timedelta(seconds=20)
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout, wait_for_workers=False)
    store = dist.PrefixStore("job", dist.TCPStore("127.0.0.1", host.port, is_master=False, timeout=timeout))
    liveness = Liveness(store, rank=1, timeout_s=20, describe=lambda: {"phase": "update", "step": 3, "role": "learner"})
    try:
        assert liveness.dead_peer(world_size=2) is None  # rank 0 lives: nobody died
        del host  # rank 0 dies, its store with it
        start = time.monotonic()
        assert liveness.dead_peer(world_size=2) is None
        assert time.monotonic() - start < 3
    finally:
        liveness.stop()
