"""Host cores and the host optimizer: an NPU rank binds itself to its share of its device's NUMA
node, so the vLLM engine's process and the checkpoint writer threads it starts get those cores,
not the one core a pinned parent (torch_npu's CPU_AFFINITY_CONF=2) would hand down; the learner
steps AdamW with torch's fused kernel where its parameters are in host memory."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from config import OptimConfig

ROOT = Path(__file__).resolve().parents[1]

# Runs in a child process, since binding changes the process's cores: pinned to one core like a
# rank under CPU_AFFINITY_CONF=2, with a thread started before the binding (OpenMP's pool, gloo's),
# then bound on a pretend NUMA layout; reports the cores each of them reads.
RANK = r"""
import json, multiprocessing, os, sys, threading
from pathlib import Path
import ckpt, device

def engine_cores(queue):  # a vLLM-like engine process, spawned as engine_vllm has vLLM do
    queue.put(sorted(os.sched_getaffinity(0)))

def bound(layout, local_rank, devices):
    return device.bind_host_cores(device.Platform("npu", "hccl", local_rank), devices, Path(layout))

if __name__ == "__main__":
    cases, report = json.loads(sys.argv[1]), {}
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    started, check = threading.Event(), threading.Event()
    earlier = {}
    def wait_then_read():
        started.set(); check.wait(); earlier["cores"] = sorted(os.sched_getaffinity(0))
    thread = threading.Thread(target=wait_then_read); thread.start(); started.wait()
    report["rank"] = sorted(bound(*cases["main"]))
    report["binding"] = os.environ["DAPO_CPU_BINDING"]
    check.set(); thread.join()
    report["earlier_thread"] = earlier["cores"]
    writer, seen = ckpt.BackgroundWriter(lambda: None), {}
    writer.start("writer", lambda: seen.update(cores=sorted(os.sched_getaffinity(0))))
    writer.wait()
    report["writer_thread"] = seen["cores"]
    queue = multiprocessing.get_context("spawn").Queue()
    child = multiprocessing.get_context("spawn").Process(target=engine_cores, args=(queue,))
    child.start(); report["engine_process"] = queue.get(timeout=60); child.join()
    report["shares"] = [sorted(bound(*case)) for case in cases["shares"]]
    os.environ["CPU_AFFINITY_CONF"] = "1"
    os.environ.pop("DAPO_CPU_BINDING")
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    report["user_choice"] = [bound(*cases["main"]), sorted(os.sched_getaffinity(0)), os.environ["DAPO_CPU_BINDING"]]
    print(json.dumps(report))
"""


def pretend_nodes(root: Path, *cpulists: str) -> str:
    """A /sys/devices/system/node with one nodeN/cpulist per entry."""
    for index, cpulist in enumerate(cpulists):
        (root / f"node{index}").mkdir(parents=True)
        (root / f"node{index}" / "cpulist").write_text(cpulist + "\n")
    return str(root)


def test_a_pinned_rank_binds_to_its_node_share_and_its_engine_and_writer_threads_inherit_it(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, "the test needs two cores to tell one pinned core from a node's"
    first, second = cores[:2]
    one_node = pretend_nodes(tmp_path / "one", f"{first}-{second}" if second == first + 1 else f"{first},{second}")
    two_nodes = pretend_nodes(tmp_path / "two", str(first), str(second), "")  # and a node of memory alone
    cases = {"main": [one_node, 0, 1],  # one device on a node of two cores: both
             "shares": [[one_node, 1, 2],  # two devices on that node: the second core for the second
                        [two_nodes, 1, 2],  # two nodes, two devices: device 1 on node 1
                        [two_nodes, 3, 4],  # two devices a node: devices 2, 3 on node 1, one core between them
                        [two_nodes, 1, 4]]}
    script = tmp_path / "rank.py"  # a file: the spawned process imports its __main__ from it
    script.write_text(RANK)
    env = {key: value for key, value in os.environ.items() if key not in ("CPU_AFFINITY_CONF", "DAPO_CPU_BINDING")}
    proc = subprocess.run([sys.executable, str(script), json.dumps(cases)], cwd=ROOT,
                          env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    node = [first, second]
    assert report["rank"] == node  # not the pinned core it started on
    assert report["binding"] == f"NUMA node 0, cores {first},{second} (rank's share)"
    assert report["earlier_thread"] == node  # threads it already had are bound too
    assert report["writer_thread"] == node
    assert report["engine_process"] == node
    assert report["shares"] == [[second], [second], [second], [first]]
    # The user's CPU_AFFINITY_CONF stands: nothing bound here, and env_report.json says which binding applies.
    assert report["user_choice"] == [None, [first], "CPU_AFFINITY_CONF=1"]


def test_only_an_npu_rank_binds_itself(tmp_path):
    import device

    layout = Path(pretend_nodes(tmp_path, "0"))
    for kind, backend in (("cpu", "gloo"), ("cuda", "nccl")):
        assert device.bind_host_cores(device.Platform(kind, backend, 0), 1, layout) is None


def reference_and_chosen(params: list[torch.Tensor], steps: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                                              torch.optim.AdamW]:
    """The same steps from torch's default AdamW and from the learner's choice."""
    from learner import adamw

    optim = OptimConfig(learning_rate=1e-3, weight_decay=0.1)
    results = []
    for build in (lambda ps: torch.optim.AdamW(ps, lr=optim.learning_rate, betas=(0.9, 0.999),
                                               weight_decay=optim.weight_decay),
                  lambda ps: adamw(ps, optim)):
        own = [torch.nn.Parameter(p.clone()) for p in params]
        optimizer = build(own)
        draws = torch.Generator().manual_seed(1)
        for _ in range(steps):
            for p in own:
                p.grad = torch.randn(p.shape, generator=draws)
            optimizer.step()
        results.append(([p.detach() for p in own], optimizer))
    (reference, _), (chosen, optimizer) = results
    return reference, chosen, optimizer


def test_host_parameters_get_the_fused_adamw_and_its_update_equals_the_default_s():
    params = [torch.randn(300, 200, generator=torch.Generator().manual_seed(0)), torch.randn(77)]
    reference, chosen, optimizer = reference_and_chosen(params)
    assert optimizer.defaults["fused"] is True
    for ref, got, start in zip(reference, chosen, params):
        assert not torch.equal(ref, start)  # the steps moved the weights
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)  # float rounding, not another update
    from learner import adamw

    assert adamw([torch.nn.Parameter(torch.empty(3, device="meta"))], OptimConfig()).defaults["fused"] is None


def test_the_demo_learner_steps_with_the_fused_adamw(demo_argv):
    from tests.test_train import make_trainer

    assert make_trainer(demo_argv + ["--max_steps", "1"]).learner.optimizer.defaults["fused"] is True


def test_launch_sh_leaves_the_binding_to_the_ranks_and_keeps_a_users_cpu_affinity_conf(tmp_path, monkeypatch):
    from tests.test_launch import launched_env

    monkeypatch.delenv("CPU_AFFINITY_CONF", raising=False)
    assert "CPU_AFFINITY_CONF" not in launched_env(tmp_path / "default")
    assert launched_env(tmp_path / "user", CPU_AFFINITY_CONF="1")["CPU_AFFINITY_CONF"] == "1"
