"""Real training runs on the stand-in accelerator (tests/accel_standin.py): nothing a GPU or NPU
would reject, bf16 compute where the learner asks for it, and no more host syncs per optimizer
step with more micro-batches.

Each job runs once (memoised for the module) with validation and a checkpoint; the tests read
the reports. On a plain CPU these mistakes pass unseen: every tensor is a host tensor, every
group is gloo, every thread is on the one device.
"""
import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist

from tests.accel_standin import is_outer_product

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "accel_standin.py"
REGRESSIONS = ROOT / "tests" / "accel_regressions.py"
# What a device rejects outright, or where it would run something else than the CPU does
# ("npu": recorded only where the stand-in follows the NPU's rules).
REJECTED = ("mix", "gen", "thread", "coll", "npu")
FP8_DEMO = ["--rollout_dtype", "fp8", "--max_steps", "2", "--rollout_stop_check_every", "2"]
HCCL, NCCL = {"AUDIT_BACKEND": "hccl"}, {"AUDIT_BACKEND": "nccl"}
NPU = {**HCCL, "ACCEL_KIND": "npu"}  # HCCL, and the project takes the stand-in for an NPU

JOBS = {
    # name: (processes, learner ranks, the stand-in's settings, arguments beyond the common ones)
    "one process, bf16 rollout": (1, 1, HCCL, ["--rollout_dtype", "bf16", "--max_steps", "1"]),
    # two steps: the second rolls out with FP8 weights synced from the learners
    "1 rollout + 2 learners, offload, fp8 rollout": (3, 2, HCCL, ["--rollout_dtype", "fp8", "--max_steps", "2",
                                                                  "--learner_offload", "true"]),
    # The FP8 demo as on an NPU, with 2 learners: offload's mixed group sends host tensors to gloo,
    # without it every collective (FSDP2's too) is HCCL's; and under NCCL, 2 ranks. A stop check
    # every 2 of the 8 decode steps, so that rows finish and are compacted out; 1 and 4
    # micro-batches per optimizer step.
    "fp8 demo, npu, 2 learners without offload": (3, 2, NPU, FP8_DEMO),
    "fp8 demo, nccl, 4 micro-batches": (2, 1, NCCL, [*FP8_DEMO, "--per_device_batch_size", "4",
                                                     "--gradient_accumulation_steps", "4"]),
    # Packed micro-batches of at most 64 real tokens (about 4 of the demo's rows), forwards of 128.
    "fp8 demo, npu, 2 learners by token budget": (3, 2, NPU, [*FP8_DEMO, "--use_dynamic_bsz", "true",
                                                              "--ppo_max_token_len_per_gpu", "64",
                                                              "--log_prob_max_token_len_per_gpu", "128"]),
}


class Audit:
    def __init__(self, out: Path, processes: int, learners: int) -> None:
        self.reports = [json.loads((out / "audit" / f"audit_rank{r}.json").read_text()) for r in range(processes)]
        with (out / "run" / "metrics.csv").open() as f:
            self.metrics = list(csv.DictReader(f))
        self.learner_reports = self.reports[-learners:]  # the last ranks learn; one process does both
        self.rollout_reports = self.reports[:max(processes - learners, 1)]

    def findings(self, kind: str, reports: Optional[list[dict]] = None) -> list[dict]:
        return [f for report in reports or self.reports for f in report["findings"] if f["kind"] == kind]


def audited_run(demo_assets: Path, out: Path, processes: int, learners: int, settings: dict[str, str],
                extra: list[str]) -> Audit:
    args = [str(STANDIN), "train_dapo.py", "--config", "configs/demo_cpu.yaml",
            "--model_path", str(demo_assets / "model"), "--dataset", str(demo_assets / "train.jsonl"),
            "--val_dataset", str(demo_assets / "val.jsonl"), "--output_dir", str(out / "run"),
            "--val_every", "1", "--val_max_prompts", "8", "--save_every", "1", "--report_to", "csv",
            "--learner_dtype", "bf16", "--dist_timeout_s", "60", *extra]
    if processes > 1:
        args += ["--learner_ranks", str(learners)]
    launcher = [sys.executable] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUDIT_OUT": str(out / "audit"), **settings}
    done = subprocess.run([*launcher, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "run" / "checkpoints" / "latest").is_file()
    return Audit(out, processes, learners)


@pytest.fixture(scope="module")
def job(demo_assets, tmp_path_factory) -> Callable[[str], Audit]:
    """The audit of a job of JOBS, run the first time a test asks for it."""
    audits: dict[str, Audit] = {}

    def audit_of(name: str) -> Audit:
        if name not in audits:
            audits[name] = audited_run(demo_assets, tmp_path_factory.mktemp("audit"), *JOBS[name])
        return audits[name]
    return audit_of


@pytest.fixture(params=list(JOBS))
def audit(request, job) -> Audit:
    return job(request.param)


def describe(findings: list[dict]) -> str:
    return "\n".join(f"{f['kind']} x{f['count']} {f['site']} via {f['via']} [{f['thread']}] {f['what']}"
                     for f in findings)


def is_matmul(finding: dict) -> bool:
    return finding["what"].startswith(("aten.mm(", "aten.addmm(", "aten._grouped_mm(", "aten.bmm("))


def test_nothing_a_device_rejects(audit):
    """Nor does any rank stay on the host: each ran its role's matmuls on the device."""
    rejected = [f for kind in REJECTED for f in audit.findings(kind)]
    assert not rejected, describe(rejected)
    for report in audit.reports:
        assert report["device_ops"], "a rank ran nothing on the device"
    for report in audit.rollout_reports:
        assert any(is_matmul(f) and "_step" in f["functions"] for f in audit.findings("dtype", [report])), \
            "a rollout rank decoded without device matmuls"
    for report in audit.learner_reports:
        assert any(is_matmul(f) and f["what"].endswith(" in backward") and "accumulate_minibatch" in f["functions"]
                   for f in audit.findings("dtype", [report])), "a learner rank's backward ran no device matmul"


def test_a_bf16_learner_computes_every_expert_and_attention_matmul_in_bf16(audit):
    """Attention's backward is left out: the stand-in's attention is the math path, which
    computes bf16 inputs in fp32 (a device's fused kernel does not); attention's own inputs
    are checked instead."""
    fp32 = [f for f in audit.findings("dtype") if "float32" in f["what"] and "in attention's backward" not in f["what"]]
    assert not fp32, describe(fp32)
    experts = [f for f in audit.findings("dtype") if f["what"].startswith("aten._grouped_mm(")
               or "_dense_experts_forward" in f["functions"]]  # the latter: the NPU's experts (moe_kernels.py)
    assert any("bfloat16" in f["what"] for f in experts)
    assert any(f["what"].startswith("attention(bfloat16") for f in audit.findings("dtype"))


def test_decoding_reaches_a_stop_check_and_compacts_rows(job):
    """At a stop check every 2 of the demo's 8 decode steps, finished rows leave the batch:
    _compacted_rows sorts the int8 finished flags on the device then, and only then."""
    for name in ("fp8 demo, npu, 2 learners without offload", "fp8 demo, nccl, 4 micro-batches"):
        assert any(op.startswith("sort(int8") for op in job(name).rollout_reports[0]["device_ops"]), name


def host_waits_per_optimizer_step(audit: Audit) -> float:
    syncs = sum(f["count"] for f in audit.findings("sync", audit.learner_reports)
                if "accumulate_minibatch" in f["functions"])
    optimizer_steps = int(audit.metrics[-1]["optimizer_steps"]) * len(audit.learner_reports)
    assert optimizer_steps > 0
    return syncs / optimizer_steps


def test_the_learner_waits_for_the_device_no_more_often_with_more_micro_batches(job):
    """At most one host wait per optimizer step, however many micro-batches it accumulates: a
    wait per micro-batch would stall the device between backward passes. One micro-batch under
    the NPU's rules, four under CUDA's: a wait per micro-batch on either path breaks the equality."""
    one, four = job("fp8 demo, npu, 2 learners without offload"), job("fp8 demo, nccl, 4 micro-batches")
    assert host_waits_per_optimizer_step(one) == host_waits_per_optimizer_step(four) <= 1, describe(
        [f for f in one.findings("sync") + four.findings("sync") if "accumulate_minibatch" in f["functions"]])


def test_micro_batches_by_token_budget_add_no_host_wait(job):
    """Micro-batches filled by real tokens (several per optimizer step, cut on the host from the
    samples' lengths) wait for the device no more often than one micro-batch of rows does."""
    rows, budget = job("fp8 demo, npu, 2 learners without offload"), job("fp8 demo, npu, 2 learners by token budget")
    assert host_waits_per_optimizer_step(budget) == host_waits_per_optimizer_step(rows) <= 1, describe(
        [f for f in budget.findings("sync") if "accumulate_minibatch" in f["functions"]])
    trained = [row for row in budget.metrics if row["update_padding_frac"]]
    assert trained and all(float(row["update_padding_frac"]) == 0.0 for row in trained)  # packed


# Each plant_* function of tests/accel_regressions.py: the kind of finding it must leave and a
# piece of what the finding says.
FSDP_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
FSDP_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
PLANTED = {
    "plant_host_generator_for_device_draws": ("gen", "a cpu generator draws for accel tensors"),
    "plant_host_generator_with_a_device_generators_seed": ("gen", "a cpu generator draws for accel tensors"),
    "plant_device_generator_for_host_draws": ("gen", "a accel generator draws for host tensors"),
    "plant_host_advantages_in_the_loss": ("mix", "host tensor"),
    "plant_tensors_on_two_device_indices": ("mix", "tensors on accel:[0, 1]"),
    "plant_param_data_from_the_host": ("mix", "param.data = a host tensor"),
    "plant_host_read_of_a_device_value": ("sync", "aten._local_scalar_dense"),
    "plant_fp32_matmul_in_a_bf16_region": ("dtype", "aten._grouped_mm(float32,float32,int32) under autocast"),
    "plant_fp32_bmm_beside_a_rotary_outer_product": ("dtype", "aten.bmm(float32,float32)"),
    "plant_writer_thread_left_unbound": ("thread", "never set its device"),
    "plant_writer_thread_on_another_device": ("thread", "runs on device 1"),
    "plant_host_tensor_into_hccl": ("coll", "dist.all_reduce: a host torch.float32 tensor into a 'hccl' group"),
    "plant_device_tensor_into_gloo": ("coll", "dist.all_reduce: a device tensor into a gloo group"),
    "plant_float64_reduction_on_hccl": ("coll", "dist.all_reduce: torch.float64 (HCCL"),
    "plant_float64_broadcast_on_hccl": ("coll", "dist.broadcast: torch.float64 (HCCL"),
    "plant_dtype_nccl_lacks": ("coll", "torch.int16 (NCCL"),
    "plant_gather_into_hccl": ("coll", "ProcessGroupHCCL has no gather"),
    "plant_gather_object_into_hccl": ("coll", "ProcessGroupHCCL has no gather_object"),
    # FSDP2's own collectives: the *_single forms from torch 2.13, the *_tensor forms before
    "plant_fsdp_all_gather_of_a_host_shard": ("coll", f"dist.{FSDP_GATHER}: a host"),
    "plant_fsdp_reduce_scatter_of_float64_gradients": ("coll", f"dist.{FSDP_REDUCE_SCATTER}: torch.float64"),
    "plant_functional_collective_of_a_host_tensor": ("coll", "_c10d_functional.all_reduce: a host"),
    "plant_functional_collective_of_float64": ("coll", "_c10d_functional.all_gather_into_tensor: torch.float64"),
}


def test_each_injected_mistake_is_caught(tmp_path):
    """tests/accel_regressions.py makes each mistake once, each in a function of its own (those
    of the NPU kinds, at its end, only count under ACCEL_KIND=npu: tests/test_npu_paths.py)."""
    before_npu_kinds = REGRESSIONS.read_text().split("# ----- NPU kinds")[0]
    assert set(re.findall(r"^def (plant_\w+)", before_npu_kinds, re.MULTILINE)) == set(PLANTED)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUDIT_OUT": str(tmp_path)}
    done = subprocess.run([sys.executable, str(STANDIN), str(REGRESSIONS)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    findings = json.loads((tmp_path / "audit_rank0.json").read_text())["findings"]
    missed = [plant for plant, (kind, what) in PLANTED.items()
              if not any(f["kind"] == kind and what in f["what"] and plant in (*f["functions"], f["thread"])
                         for f in findings)]
    assert not missed, f"not caught: {missed}\n{describe(findings)}"
    beside = [f for f in findings if "plant_fp32_bmm_beside_a_rotary_outer_product" in f["functions"]]
    assert [(f["what"], f["count"]) for f in beside] == [("aten.bmm(float32,float32)", 1)], describe(beside)  # one of two
    assert any(f["site"].startswith("engine_builtin.py") for f in findings if f["kind"] == "gen")  # the decode loop


def test_only_a_one_deep_matmul_is_an_outer_product():
    """What the dtype checks leave out (here and in test_learner_precision): an inner dimension of
    1, wherever each op keeps it (addmm and baddbmm: after the tensor added to)."""
    aten = torch.ops.aten
    for depth, outer in ((1, True), (2, False)):
        a2, b2, a3, b3 = torch.ones(4, depth), torch.ones(depth, 3), torch.ones(2, 4, depth), torch.ones(2, depth, 3)
        assert is_outer_product(aten.mm.default, (a2, b2)) is outer
        assert is_outer_product(aten.addmm.default, (torch.ones(4, 3), a2, b2)) is outer
        assert is_outer_product(aten.bmm.default, (a3, b3)) is outer
        assert is_outer_product(aten.baddbmm.default, (torch.ones(2, 4, 3), a3, b3)) is outer
        assert is_outer_product(aten.linear.default, (a2, torch.ones(3, depth))) is outer
    # The bias is no operand: addmm of a [4, 1] bias with a two-deep product is checked.
    assert not is_outer_product(aten.addmm.default, (torch.ones(4, 1), torch.ones(4, 2), torch.ones(2, 1)))


def test_on_the_npus_rules_fp8_stays_codes_and_the_experts_wait_for_nothing(job):
    """The FP8 demo as on an NPU (its second step rolls out with FP8 weights synced from the
    learner): no float8 device op on any rank, the rollout's FP8 layers decode their uint8 codes
    through the table, and the learner's experts run the NPU's kernel (dense here: no torch_npu)
    in bf16 with no host wait inside."""
    audit = job("fp8 demo, npu, 2 learners without offload")
    float8_ops = [op for report in audit.reports for op in report["device_ops"] if "float8" in op]
    assert not float8_ops, float8_ops
    assert any("fp8_linear" in f["functions"] for f in audit.findings("dtype", audit.rollout_reports))
    assert "index_select(bfloat16,int32)" in audit.rollout_reports[0]["device_ops"]
    dense = [f for f in audit.findings("dtype", audit.learner_reports) if "_dense_experts_forward" in f["functions"]]
    assert dense and all("float32" not in f["what"] for f in dense), describe(dense)
    in_experts = [f for f in audit.findings("sync") if "_dense_experts_forward" in f["functions"]]
    assert not in_experts, describe(in_experts)
