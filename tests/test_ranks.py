"""The multi-rank layout through real torchrun processes on CPU/gloo, plus its pure pieces."""
import contextlib
import csv
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ranks import Layout, _buckets, pack, unpack
from metrics import TIMING_COLUMNS
from tests.test_rollout import fake_batch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench"))
import fault_matrix  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_args(demo_assets: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return ["train_dapo.py", "--config", "configs/demo_cpu.yaml", "--model_path", str(demo_assets / "model"),
            "--dataset", str(demo_assets / "train.jsonl"), "--val_dataset", str(demo_assets / "val.jsonl"),
            "--output_dir", str(out), "--max_steps", str(steps), "--val_every", "2", "--val_max_prompts", "24",
            "--save_every", str(steps), "--log_every", "1", "--dist_timeout_s", "60", *extra]


def torchrun(nproc: int, args: list[str], timeout: int = 240, fault: str = "") -> subprocess.CompletedProcess:
    """The job under torchrun, one thread a rank; ``fault``: DAPO_FAULT (faults.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DAPO_FAULT": fault}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def metrics_rows(out: Path) -> list[dict[str, str]]:
    with (out / "metrics.csv").open() as f:
        return [{k: v for k, v in row.items() if k not in TIMING_COLUMNS} for row in csv.DictReader(f)]


def test_layout_splits_ranks_by_index():
    roles = [Layout(8, r, 2).role for r in range(8)]
    assert roles == ["rollout"] * 6 + ["learner"] * 2
    assert Layout(8, 6, 2).is_lead and not Layout(8, 7, 2).is_lead
    assert [Layout(2, r, 1).role for r in range(2)] == ["rollout", "learner"]


def test_pack_round_trip_keeps_every_field():
    batch = fake_batch([1, 0, 0, 1], group_size=2, prompt_width=3, response_width=2)
    longs, floats = pack(batch, width_p=5, width_r=4, rows=6)
    back = unpack(longs, floats, rows=4, width_p=5, width_r=4, group_size=2)
    expected = batch.widen(5, 4)
    for name, tensor in expected.tensors().items():
        assert torch.equal(getattr(back, name), tensor), name


def test_weight_buckets_respect_the_limit_and_cover_every_parameter():
    sizes = [1024 * 256 * 4] * 3 + [40] + [4096 * 512 * 4]
    plan = _buckets(sizes, bucket_bytes=2 * 2**20)
    assert [i for bucket in plan for i in bucket] == list(range(5))  # every piece once, in order
    for bucket in plan:
        assert sum(sizes[i] for i in bucket) <= 2 * 2**20 or len(bucket) == 1  # an oversized piece travels alone
    assert len(plan) == 3  # greedy: [0, 1], [2, 3], [4]


def weights_at(out: Path, step: int) -> bytes:
    return (out / "checkpoints" / f"step_{step:08d}" / "model" / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def eight_rank_reference(demo_assets, tmp_path_factory) -> tuple[Path, str]:
    """An uninterrupted 6-step 8-rank run with every checkpoint kept: (output dir, stdout)."""
    out = tmp_path_factory.mktemp("eight") / "uninterrupted"
    proc = torchrun(8, run_args(demo_assets, out, 6, "--save_every", "1", "--keep_last", "10", "--val_every", "3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


def test_eight_ranks_resume_exactly_and_repeat_exactly(demo_assets, eight_rank_reference, tmp_path):
    """Stopped after step 3 and resumed to 6: the same weights and rows as the uninterrupted run,
    which also shows two runs of the same steps are identical (rows and weights 1-3)."""
    reference, log = eight_rank_reference
    assert log.count("role=rollout") == 6 and log.count("role=learner") == 2
    out = tmp_path / "resumed"
    extra = ("--save_every", "1", "--val_every", "3")
    first = torchrun(8, run_args(demo_assets, out, 3, *extra))
    assert first.returncode == 0, first.stderr[-3000:]
    assert weights_at(out, 3) == weights_at(reference, 3)
    second = torchrun(8, run_args(demo_assets, out, 6, *extra, "--resume_from_checkpoint", "auto"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from" in second.stdout and "step_00000003" in second.stdout
    rows, expected = metrics_rows(out), metrics_rows(reference)
    assert [r["step"] for r in rows] == [str(s) for s in range(7)] and rows == expected
    assert rows[2]["staleness"] == "1"  # step 2 trained on samples from v0: rollout ran one step ahead
    assert weights_at(out, 6) == weights_at(reference, 6)
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_00000006" / "model")
    base = AutoModelForCausalLM.from_pretrained(demo_assets / "model")
    assert any(not torch.equal(p, q) for p, q in zip(trained.parameters(), base.parameters()))


@pytest.mark.parametrize("role, column", [("rollout", "update"), ("lead learner", "save"),
                                          ("other learner", "sample transfer")])
def test_a_rank_killed_in_a_phase_restarts_the_job_which_ends_like_an_uninterrupted_one(
        demo_assets, eight_rank_reference, tmp_path, role, column):
    """Three cells of bench/fault_matrix.py, one per role: under torchrun --max-restarts 1 the
    rank is SIGKILLed as the phase of step 3 begins (a rollout rank by the lead learner, as it
    starts the update); the job restarts by itself from its newest checkpoint and ends with the
    uninterrupted run's metrics rows and weights."""
    reference, _ = eight_rank_reference
    out = tmp_path / "restarted"
    failure, _ = fault_matrix.run_cell(run_args(demo_assets, out, 6, "--save_every", "1", "--keep_last", "10",
                                                "--val_every", "3"), role, column, 3)
    assert failure is None, failure
    assert fault_matrix.differences(out, reference, 6) == []


def test_synchronous_mode_has_no_staleness(demo_assets, tmp_path):
    # Without dynamic sampling no group is carried over to a later step (a carried group is one
    # version staler by design), so every sample of step j comes from v_(j-1) by construction.
    proc = torchrun(3, run_args(demo_assets, tmp_path / "sync", 3, "--max_staleness", "0",
                                "--learner_ranks", "1", "--dynamic_sampling", "false"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics_rows(tmp_path / "sync")[1:]
    assert [r["staleness"] for r in rows] == ["0", "0", "0"]
    assert [r["carried_groups"] for r in rows] == ["0", "0", "0"]


def test_a_killed_rank_ends_the_job_naming_the_phase(demo_assets, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "--monitor_interval=5",
           *run_args(demo_assets, tmp_path / "kill", 500, "--dist_timeout_s", "30")]
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        metrics = tmp_path / "kill" / "metrics.csv"
        deadline = time.time() + 180
        while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            time.sleep(0.5)
        assert metrics.exists(), "the job never wrote a metrics row"
        children = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 4
        killed_at = time.time()
        os.kill(int(children[0]), signal.SIGKILL)  # a rollout rank
        _, err = job.communicate(timeout=30 + 60)
        assert job.returncode != 0
        assert time.time() - killed_at < 30 + 30
        assert any(f"{phase} failed" in err for phase in ("generation", "sample transfer", "weight sync", "update",
                                                           "validation")), \
            [line for line in err.splitlines() if "rror" in line or "Signal" in line][:20]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


def test_a_phase_longer_than_dist_timeout_is_waited_for(demo_assets, tmp_path):
    """Rank 0 generates step 2 for 12 s, dist_timeout_s is 4: its heartbeat goes on, so the lead
    waits for its samples however long, and the run ends normally."""
    out = tmp_path / "slow"
    proc = torchrun(2, run_args(demo_assets, out, 3, "--learner_ranks", "1", "--dist_timeout_s", "4"),
                    fault="0:generation:2:sleep=12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with (out / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"]
    assert float(rows[2]["step_time_s"]) > 12  # the slow generation was step 2's


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
    dist_timeout_s (4 s) of silence and not before."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DAPO_FAULT": fault}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--monitor_interval=1",
           *run_args(demo_assets, tmp_path / "stuck", 6, "--learner_ranks", "1", "--dist_timeout_s", "4")]
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
        assert 4 - 0.5 < given_up_after < 4 + 4, given_up_after
    finally:
        for pid in pids.values():  # torchrun would wait 30 s for the stopped rank to end
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.wait(timeout=60)


def test_two_nodes_on_one_machine_run_as_one_job(demo_assets, tmp_path):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NNODES": "2", "NPROC_PER_NODE": "4",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    args = run_args(demo_assets, tmp_path / "nodes", 2)[3:]  # launch.sh train takes the config itself
    nodes = [subprocess.Popen(["./launch.sh", "train", "configs/demo_cpu.yaml", *args], cwd=ROOT,
                              env={**env, "NODE_RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for rank in (0, 1)]
    results = [node.communicate(timeout=240) for node in nodes]
    errors = [line for _, err in results for line in err.splitlines() if line.startswith("error:")]
    assert [node.returncode for node in nodes] == [0, 0], errors or results[0][1][-2000:]
    logs = results[0][0] + results[1][0]
    assert logs.count("role=rollout") == 6 and logs.count("role=learner") == 2
    assert [r["step"] for r in metrics_rows(tmp_path / "nodes")] == ["0", "1", "2"]


@pytest.mark.parametrize("rollout_dtype", ["fp32", "fp8"])
def test_two_ranks_reproduce_the_one_process_run(demo_assets, tmp_path, rollout_dtype):
    """One rollout rank + one learner run the same choreography as one process, through real
    process groups: any slip in sample transfer or weight sync (FP8 values and scales included)
    changes the numbers."""
    # Both runs in fresh processes with one thread each, so the float arithmetic is the same.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    dtype = ("--rollout_dtype", rollout_dtype)
    one_process = subprocess.run([sys.executable, *run_args(demo_assets, tmp_path / "one", 3, *dtype)], cwd=ROOT,
                                 env=env, capture_output=True, text=True, timeout=240)
    assert one_process.returncode == 0, one_process.stderr[-3000:]
    proc = torchrun(2, run_args(demo_assets, tmp_path / "two", 3, *dtype, "--learner_ranks", "1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = metrics_rows(tmp_path / "one"), metrics_rows(tmp_path / "two")
    # The rollout log-probs come from two model copies built differently (a copy of the learner's
    # policy vs a load from disk) and the learner's from batches of other widths: they agree to
    # float32 rounding of log-probs of magnitude ~1-10 (~1e-6 per token), not bit for bit. Only
    # the mismatch metrics see that noise; everything else must be identical.
    for key in ("mismatch_mean", "mismatch_max", "engine_mismatch_mean"):
        gaps = [(a.pop(key), b.pop(key)) for a, b in zip(one[1:], two[1:])]
        assert [a == "" for a, _ in gaps] == [b == "" for _, b in gaps], key  # empty: no sample of that version
        numbers = [(float(a), float(b)) for a, b in gaps if a]
        assert [a for a, _ in numbers] == pytest.approx([b for _, b in numbers], rel=1e-4, abs=1e-5), key
    assert one == two
    weights = [(tmp_path / n / "checkpoints" / "step_00000003" / "model" / "model.safetensors").read_bytes()
               for n in ("one", "two")]
    assert weights[0] == weights[1]
