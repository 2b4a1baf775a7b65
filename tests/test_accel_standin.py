"""Real training runs on the stand-in accelerator (tests/accel_standin.py): nothing a GPU or NPU
would reject, bf16 compute where the learner asks for it, and few host syncs per micro-batch.

Each layout runs once (module fixtures) with validation and a checkpoint; the tests read the
reports. On a plain CPU these mistakes pass unseen: every tensor is a host tensor, every group
is gloo, every thread is on the one device.
"""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "accel_standin.py"
# What a device rejects outright, or where it would run something else than the CPU does.
REJECTED = ("mix", "gen", "thread", "coll")

LAYOUTS = {
    # name: (processes, arguments beyond the common ones)
    "one process, bf16 rollout": (1, ["--rollout_dtype", "bf16", "--max_steps", "1"]),
    # two steps: the second rolls out with FP8 weights synced from the learners
    "1 rollout + 2 learners, offload, fp8 rollout": (3, ["--rollout_dtype", "fp8", "--learner_ranks", "2",
                                                         "--max_steps", "2", "--learner_offload", "true"]),
}


class Audit:
    def __init__(self, out: Path, processes: int) -> None:
        self.reports = [json.loads((out / "audit" / f"audit_rank{r}.json").read_text()) for r in range(processes)]
        with (out / "run" / "metrics.csv").open() as f:
            self.metrics = list(csv.DictReader(f))

    def findings(self, kind: str) -> list[dict]:
        return [f for report in self.reports for f in report["findings"] if f["kind"] == kind]


def audited_run(demo_assets: Path, out: Path, processes: int, extra: list[str]) -> Audit:
    args = [str(STANDIN), "train_dapo.py", "--config", "configs/demo_cpu.yaml",
            "--model_path", str(demo_assets / "model"), "--dataset", str(demo_assets / "train.jsonl"),
            "--val_dataset", str(demo_assets / "val.jsonl"), "--output_dir", str(out / "run"),
            "--val_every", "1", "--val_max_prompts", "8", "--save_every", "1", "--report_to", "csv",
            "--learner_dtype", "bf16", "--dist_timeout_s", "60", *extra]
    launcher = [sys.executable] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUDIT_OUT": str(out / "audit")}
    done = subprocess.run([*launcher, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "run" / "checkpoints" / "latest").is_file()
    return Audit(out, processes)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def audit(request, demo_assets, tmp_path_factory) -> Audit:
    processes, extra = LAYOUTS[request.param]
    return audited_run(demo_assets, tmp_path_factory.mktemp("audit"), processes, extra)


def describe(findings: list[dict]) -> str:
    return "\n".join(f"{f['kind']} x{f['count']} {f['site']} via {f['via']} [{f['thread']}] {f['what']}"
                     for f in findings)


def test_nothing_a_device_rejects(audit):
    rejected = [f for kind in REJECTED for f in audit.findings(kind)]
    assert not rejected, describe(rejected)


def test_a_bf16_learner_computes_every_expert_and_attention_matmul_in_bf16(audit):
    """bmm is left out: the stand-in's attention is the math path, which computes bf16 inputs
    in fp32 (a device's fused kernel does not); attention's own inputs are checked instead."""
    fp32 = [f for f in audit.findings("dtype") if "float32" in f["what"] and "aten.bmm" not in f["what"]]
    assert not fp32, describe(fp32)
    assert any("_grouped_mm(bfloat16" in f["what"] for f in audit.findings("dtype"))
    assert any(f["what"].startswith("attention(bfloat16") for f in audit.findings("dtype"))


def test_the_learner_waits_for_the_device_at_most_once_per_micro_batch(audit):
    syncs = sum(f["count"] for f in audit.findings("sync") if "accumulate_minibatch" in f["functions"])
    # demo_cpu.yaml: gradient_accumulation_steps 1, so one micro-batch per optimizer step.
    learners = len([r for r in audit.reports if any("update_policy" in f["functions"] for f in r["findings"])])
    micro_batches = int(audit.metrics[-1]["optimizer_steps"]) * learners
    assert micro_batches > 0 and syncs <= micro_batches, describe(
        [f for f in audit.findings("sync") if "accumulate_minibatch" in f["functions"]])


def test_each_injected_mistake_is_caught(tmp_path):
    """tests/accel_regressions.py makes each mistake once through the project's own code."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUDIT_OUT": str(tmp_path)}
    done = subprocess.run([sys.executable, str(STANDIN), str(ROOT / "tests" / "accel_regressions.py")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    findings = json.loads((tmp_path / "audit_rank0.json").read_text())["findings"]
    caught = {(f["kind"], f["site"].split(":")[0]) for f in findings}
    assert ("gen", "engine_builtin.py") in caught  # a host generator for device probabilities (the decode loop)
    assert ("mix", "dapo_loss.py") in caught  # host advantages in the loss
    assert ("coll", "ranks.py") in caught  # a host tensor into the HCCL group
    assert any(f["kind"] == "coll" and "float64" in f["what"] for f in findings)  # HCCL reduces no float64
    assert any(f["kind"] == "thread" and f["thread"] == "save-unbound" for f in findings)
