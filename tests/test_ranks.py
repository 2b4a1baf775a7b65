"""The multi-rank layout through real torchrun processes on CPU/gloo, plus its pure pieces."""
import csv
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ranks import Layout, pack, unpack
from metrics import TIMING_COLUMNS, read_metrics
from tests.test_rollout import fake_batch
from hf_weights import bucket_plan

ROOT = Path(__file__).resolve().parents[1]


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


def test_tensor_parallel_groups_consecutive_rollout_ranks_under_their_first():
    layouts = [Layout(8, rank, 2, tensor_parallel=2) for rank in range(8)]
    assert [layout.drives_engine for layout in layouts] == [True, False] * 3 + [False, False]
    assert [layout.engine_index for layout in layouts[:6]] == [0, 0, 1, 1, 2, 2]
    assert layouts[3].engine_ranks == [2, 3] and {layout.num_engines for layout in layouts} == {3}
    assert [layout.title for layout in layouts] == [
        "rollout: engine 0 over the devices of ranks 0-1", "rollout: engine 0's device 2 of 2, no model",
        "rollout: engine 1 over the devices of ranks 2-3", "rollout: engine 1's device 2 of 2, no model",
        "rollout: engine 2 over the devices of ranks 4-5", "rollout: engine 2's device 2 of 2, no model",
        "lead learner", "learner"]
    assert [layout.role for layout in layouts] == ["rollout"] * 6 + ["learner"] * 2
    # The vLLM engines (and their weight staging buffers) on each of two nodes of 4 ranks.
    assert (layouts[0].engines_on_node(2), layouts[5].engines_on_node(2)) == (2, 1)
    assert [Layout(8, rank, 2).title for rank in (0, 6, 7)] == ["rollout", "lead learner", "learner"]
    assert Layout(8, 4, 2).engines_on_node(1) == 6 and Layout(1, 0, 1).drives_engine


@pytest.mark.parametrize("every_rank", [False, True])
def test_weights_reach_every_rank_of_a_tensor_parallel_engine_only_where_its_workers_read_their_own(
        monkeypatch, every_rank):
    """6 rollout ranks at tensor parallel 2 and a learner: the weights group is the engine ranks
    and the lead, or (IPC: each worker reads its own device's rank) the sync group with every
    rollout rank, and then each engine's ranks share a gloo group of their own for the handles."""
    import ranks

    made = []

    def new_group(members, backend, timeout):
        made.append((tuple(members), backend))
        return len(made) - 1  # a group's token: the order it was made in, the same on every rank
    monkeypatch.setattr(ranks.dist, "new_group", new_group)
    every = {rank: (made.clear(), ranks.init_groups(Layout(world_size=7, rank=rank, num_learners=1, tensor_parallel=2),
                                                    "gloo", 60, every_engine_rank_takes_weights=every_rank))[1]
             for rank in range(7)}
    sync = made.index(((0, 1, 2, 3, 4, 5, 6), "gloo"))
    if every_rank:
        assert [every[rank].weights for rank in range(7)] == [sync] * 7
        assert [made[every[rank].engine][0] for rank in range(6)] == [(0, 1), (0, 1), (2, 3), (2, 3), (4, 5), (4, 5)]
        assert {made[every[rank].engine][1] for rank in range(6)} == {"gloo"} and every[6].engine is None
    else:
        weights = made.index(((0, 2, 4, 6), "gloo"))
        assert [every[rank].weights for rank in range(7)] == [weights, None, weights, None, weights, None, weights]
        assert all(every[rank].engine is None for rank in range(7))


def test_prompts_split_over_engines_and_a_rank_without_an_engine_keeps_count_with_nothing_to_do():
    """Rollout on each of 4 rollout ranks at tensor parallel 2: the engine ranks take every other
    prompt each (engine 0 the even ones); the others generate and validate nothing, yet move
    through the prompt stream and the weight versions in step."""
    from types import SimpleNamespace

    from config import Config
    from device import select_platform
    from rollout import Rollout

    data = SimpleNamespace(prompt_ids=[[1, 2]] * 12)
    rollouts = [Rollout(Config(), select_platform("cpu"), Layout(5, rank, 1, tensor_parallel=2), None, None, data,
                        data) for rank in range(4)]
    assert [(r.shard_index, r.num_shards) for r in rollouts] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    idle = rollouts[1]
    assert idle.generate_shard(step=1, gen_index=1)[:2] == (None, 0)
    assert idle.position() == {"epoch": 0, "cursor": 1} and idle.validation_sums() == [0.0, 0.0, 0.0]
    assert idle.receive_weights(None) == 1 and idle.receive_weights(None) == 2


def test_pack_round_trip_keeps_every_field():
    batch = fake_batch([1, 0, 0, 1], group_size=2, prompt_width=3, response_width=2)
    longs, floats = pack(batch, width_p=5, width_r=4, rows=6)
    back = unpack(longs, floats, rows=4, width_p=5, width_r=4, group_size=2)
    expected = batch.widen(5, 4)
    for name, tensor in expected.tensors().items():
        assert torch.equal(getattr(back, name), tensor), name


def test_weight_buckets_respect_the_limit_and_cover_every_parameter():
    sizes = [1024 * 256 * 4] * 3 + [40] + [4096 * 512 * 4]
    plan = bucket_plan(sizes, bucket_bytes=2 * 2**20)
    assert [i for bucket in plan for i in bucket] == list(range(5))  # every piece once, in order
    for bucket in plan:
        assert sum(sizes[i] for i in bucket) <= 2 * 2**20 or len(bucket) == 1  # an oversized piece travels alone
    assert len(plan) == 3  # greedy: [0, 1], [2, 3], [4]


def test_two_nodes_on_one_machine_run_as_one_job(demo_assets, tmp_path):
    """The shape users run, 8 ranks (6 rollout + 2 learners), as two nodes of four through launch.sh."""
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


# Synchronous: without dynamic sampling no group is carried over to a later step (a carried group
# is one version staler by design), so every sample of step j comes from v_(j-1) by construction.
SYNCHRONOUS = ("--max_staleness", "0", "--dynamic_sampling", "false")


@pytest.mark.parametrize("rollout_dtype, schedule", [("fp32", SYNCHRONOUS), ("fp8", ())], ids=["fp32-sync", "fp8"])
def test_two_ranks_reproduce_the_one_process_run(demo_assets, tmp_path, rollout_dtype, schedule):
    """One rollout rank + one learner run the same choreography as one process, through real
    process groups: any slip in sample transfer or weight sync (FP8 values and scales included)
    changes the numbers. Rollout one step ahead (the default), and synchronous."""
    # Both runs in fresh processes with one thread each, so the float arithmetic is the same.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    dtype = ("--rollout_dtype", rollout_dtype, *schedule)
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
    if schedule == SYNCHRONOUS:
        assert [(r["staleness"], r["carried_groups"]) for r in two[1:]] == [("0", "0")] * 3
    else:
        assert two[2]["staleness"] == "1"  # step 2 trained on samples from v0
    weights = [(tmp_path / n / "checkpoints" / "step_00000003" / "model" / "model.safetensors").read_bytes()
               for n in ("one", "two")]
    assert weights[0] == weights[1]
    # Each weight sync's transfer and load, apart: one process loads its engine and transfers nothing.
    syncs = {n: [(float(r["weight_transfer_s"]), float(r["weight_load_s"]))
                 for r in read_metrics(tmp_path / n / "metrics.csv")[1:]] for n in ("one", "two")}
    assert all(transfer == 0 for transfer, _ in syncs["one"]) and max(load for _, load in syncs["one"]) > 0
    assert min(map(max, zip(*syncs["two"]))) > 0
