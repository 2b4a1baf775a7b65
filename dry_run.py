"""The dry run: the model's full architecture, built without weights, wrapped by the learner's
own FSDP2 code over a fake process group of the learner ranks, one learner micro-batch traced
forward and backward plus one AdamW step, and what that measured beside the memory plan.

    python train_dapo.py --config X --model_path DIR --dry_run [WORLD_SIZE]    # writes OUTPUT_DIR/dry_run.json

Every tensor is a FakeTensor (shape, dtype and device, no data), so nothing is computed and no
weights are read: Qwen3-30B-A3B goes through on a CPU in under a minute and half a GB.
FSDPMemTracker (torch.distributed._tools, as torchtitan's memory estimation uses it) counts the
bytes of every tensor, by device and kind, as the step allocates and frees them.

What the measurement leans on, and why:
- The learner's device is a stand-in accelerator, ``accel``, registered from Python as torch's
  PrivateUse1 backend, so that device and host memory (offloaded shards) are told apart: a
  CPU-only torch cannot run autograd on fake tensors of the usual accelerators. The registration cannot be undone, so
  the trace runs in a child process and leaves the caller's process as it was.
- Attention runs as a fused kernel that keeps the output and its log-sum-exp, as the flash
  kernels of GPUs and NPUs do; SDPA has no kernel for the stand-in, and its math fallback would
  hold two float32 sequence x sequence score matrices per layer (~17 GiB at 4 x 4096 tokens).
- MoE experts trace with learner_dtype bf16 only: the meta kernel of grouped_mm takes bf16
  alone. The fp32 master weights are no obstacle: FSDP2 gathers them as bf16, as in a real run.
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from config import Config, Derived, UserError, uses_fsdp
from memory_plan import GIB, make_plan

STAND_IN = "accel"
FUSED_ATTENTION = "dry_run_fused"
PERSISTENT = ("Sharded Param", "Buffer", "Sharded Grad", "OptState")  # what outlives one step
DEVICE_ITEMS = ("params", "grads", "optimizer", "activations", "optimizer_step", "total")
HOST_ITEMS = ("params", "grads", "optimizer")  # the host's checkpoint copy is not traced


def run(cfg: Config, derived: Derived) -> int:
    """Print planned against measured, one line per item, and write OUTPUT_DIR/dry_run.json.
    Returns 0, or 1 when the learner step could not be traced (the reason is printed)."""
    from transformers import AutoConfig

    from learner import uses_reference_model

    path = Path(cfg.model.model_path)
    if not (path / "config.json").is_file():
        raise UserError(f"model_path {path} has no config.json; the dry run needs the architecture only, e.g. "
                        f"--model_path configs/models/qwen3-30b-a3b")
    model_config = AutoConfig.from_pretrained(path, local_files_only=True)
    if cfg.model.learner_dtype == "fp32" and getattr(model_config.get_text_config(), "num_experts", None):
        raise UserError("the dry run traces MoE experts with learner_dtype bf16 only (the fake kernel of grouped_mm "
                        "takes bf16 alone); --plan counts fp32")
    memory = int(cfg.run.device_memory_gb * GIB) if cfg.run.device_memory_gb else None
    plan = make_plan(cfg, derived, model_config, memory, with_reference=uses_reference_model(cfg))
    start = time.perf_counter()
    # A device's share of a tensor-parallel engine's weights: the plan's even split of the whole copy measured.
    measured: dict[str, Any] = {"rollout_rank.weights": math.ceil(
        rollout_weight_bytes(path, cfg.model.rollout_dtype) / derived.rollout_tensor_parallel)}
    learner = measure_learner(cfg, derived)
    for where in ("device", "host"):
        measured.update({f"learner_rank.{where}.{k}": v for k, v in learner.get(where, {}).items()})
    result = {"planned": planned_items(plan), "measured": measured,
              "traced": learner.get("traced"), "not_traced": learner.get("not_traced"),
              "seconds": round(time.perf_counter() - start, 1)}
    print(table(result, plan), flush=True)
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dry_run.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0 if "device" in learner else 1


def planned_items(plan: dict[str, Any]) -> dict[str, Optional[int]]:
    items: dict[str, Optional[int]] = {"rollout_rank.weights": plan["rollout_rank"]["weights"]}
    for where, keys in (("device", DEVICE_ITEMS), ("host", HOST_ITEMS)):
        items.update({f"learner_rank.{where}.{k}": plan["learner_rank"][where].get(k) for k in keys})
    return items


def rollout_weight_bytes(path: Path, rollout_dtype: str) -> int:
    """Bytes of the rollout copy as rollout ranks build it (rollout.build_rollout_model), on meta."""
    from fp8 import weight_bytes
    from rollout import build_rollout_model

    return weight_bytes(build_rollout_model(path, rollout_dtype, "meta"))


def measure_learner(cfg: Config, derived: Derived) -> dict[str, Any]:
    """:func:`trace_learner` in a child process (see the module's docstring); on failure
    ``{"not_traced": reason}``, with the child's traceback on stderr."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
            return child.submit(trace_learner, cfg, derived).result()
    except Exception as e:  # a child's exception arrives with its traceback as the cause
        traceback.print_exception(e, file=sys.stderr)
        reason = "".join(traceback.format_exception_only(e)).strip().splitlines()[-1]
        return {"not_traced": f"the learner step: {reason}"}


class StandInDevice:
    """``torch.accel``: torch.cpu's no-op streams and events, one device, bf16 autocast."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    def get_rng_state(self, device: Any = None) -> torch.Tensor:  # activation checkpointing saves it
        return torch.empty(0, dtype=torch.uint8)

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        pass


def learner_device_type() -> str:
    """The stand-in accelerator; where a vendor backend (the Ascend one) already holds PrivateUse1, its own."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    taken = torch._C._get_privateuse1_backend_name()
    if taken != "privateuseone":
        return taken
    _setup_privateuseone_for_python_backend(rename=STAND_IN, backend_module=StandInDevice())
    return STAND_IN


def fused_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention as a fused kernel computes it: the output and its log-sum-exp are all it
    keeps (the sequences are full, so there is no padding mask)."""
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, is_causal=True,
                                                                        scale=scaling)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def fake_tracing_fixes() -> Iterator[None]:
    """What a fake trace needs that a real run does not; none changes the bytes measured."""
    from unittest import mock

    import torch.distributed.tensor._sharding_prop as sharding_prop
    from torch.distributed import fsdp

    cpu_offload = fsdp.CPUOffloadPolicy
    with contextlib.ExitStack() as stack:
        # DTensor works out output shapes with fake tensors of the *global* size; under our fake
        # mode it reuses that mode, so the tracker would count them (3x an optimizer step's real
        # peak, measured on a small model); a fresh mode of its own is invisible to the tracker.
        stack.enter_context(mock.patch.object(sharding_prop, "detect_fake_mode", lambda *args: None))
        # Fake tensors cannot be pinned; pinning changes which host memory, not how much.
        stack.enter_context(mock.patch.object(fsdp, "CPUOffloadPolicy",
                                              lambda pin_memory=True: cpu_offload(pin_memory=False)))
        # Backward on this thread, not on a device thread of autograd's: for the stand-in, such a
        # thread aborts the process at exit, and on any error (its Python device guard is noexcept).
        stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        yield


def trace_learner(cfg: Config, derived: Derived) -> dict[str, Any]:
    """One learner rank's step under FakeTensorMode over a fake group of the learner ranks:
    measured bytes on the device and on the host, and what was and was not traced."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    device = learner_device_type()
    AttentionInterface.register(FUSED_ATTENTION, fused_attention)
    AttentionMaskInterface.register(FUSED_ATTENTION, flash_attention_mask)  # no 4-D mask: sequences are full
    learners = derived.num_learner_ranks
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=learners)
    try:
        mesh = DeviceMesh(device, torch.arange(learners))
        with fake_tracing_fixes(), FakeTensorMode():
            return measure_step(cfg, mesh, device)
    finally:
        dist.destroy_process_group()


def build_learner_model(cfg: Config, mesh: Any, device: str, *, trainable: bool) -> torch.nn.Module:
    """The policy (or the KL reference) as the Learner builds it (learner.build_model), with fake
    storage and the stand-in attention kernel."""
    from learner import build_model, prepare_policy, reference_dtype

    model_cfg = cfg.model
    dtype = torch.float32 if trainable else reference_dtype(cfg, sharded=True)  # the fake group always shards
    model = build_model(Path(model_cfg.model_path), torch.device(device), mesh, learner_dtype=model_cfg.learner_dtype,
                        offload=model_cfg.learner_offload, dtype=dtype)
    model.set_attn_implementation(FUSED_ATTENTION)
    if not trainable:
        return model.eval().requires_grad_(False)
    prepare_policy(model, cfg)
    return model.train()


def forward_backward(model: torch.nn.Module, cfg: Config, device: str) -> None:
    """One micro-batch: per_device_batch_size full-length sequences, the response tokens'
    log-probs as learner.sequence_logprobs takes them, backward through their sum."""
    from dapo_loss import token_logprobs

    prompt, response = cfg.data.max_prompt_length, cfg.rollout.max_response_length
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (cfg.optim.per_device_batch_size,
                                                                        prompt + response), device=device)
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=response + 1).logits
    logp = token_logprobs(logits[:, :-1].contiguous(), ids[:, prompt:], cfg.rollout.temperature)
    del logits
    (-logp.sum()).backward()


def measure_step(cfg: Config, mesh: Any, device: str) -> dict[str, Any]:
    """A warm-up step creates AdamW's state; then one tracked forward+backward (with the
    gradients of an earlier micro-batch still held, as under gradient accumulation) and one
    tracked clip + optimizer step."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from learner import uses_reference_model

    model = build_learner_model(cfg, mesh, device, trainable=True)
    reference = build_learner_model(cfg, mesh, device, trainable=False) if uses_reference_model(cfg) else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.learning_rate, weight_decay=cfg.optim.weight_decay)
    forward_backward(model, cfg, device)
    optimizer.step()
    if cfg.optim.gradient_accumulation_steps == 1:
        optimizer.zero_grad(set_to_none=True)
    with FSDPMemTracker(model, optimizer) as backward_tracker:
        forward_backward(model, cfg, device)
    with FSDPMemTracker(model, optimizer) as step_tracker:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
    # The reference is created before the trackers, which count only the policy and its optimizer.
    reference_bytes = {where: tensor_bytes(reference, where) for where in (device, "cpu")} if reference else {}
    sizes = items(snapshot(backward_tracker, "peak"), snapshot(step_tracker, "peak"),
                  snapshot(step_tracker, "current"), device=device, reference_bytes=reference_bytes)
    return {**sizes, **describe(cfg, model, mesh.size(), device)}


def snapshot(tracker: Any, kind: str) -> dict[str, dict[str, int]]:
    """{device type: {kind of memory ("Sharded Param", "Activation", ..., "Total"): bytes}}."""
    return {dev.type: {getattr(k, "value", k): v for k, v in kinds.items()}
            for dev, kinds in tracker.get_tracker_snapshot(kind).items()}


def tensor_bytes(model: torch.nn.Module, device: str) -> int:
    """Bytes of this rank's shards of ``model`` that live on ``device``."""
    local = [getattr(t, "_local_tensor", t) for t in [*model.parameters(), *model.buffers()]]
    return sum(t.numel() * t.element_size() for t in local if t.device.type == device)


def items(backward_peak: dict, step_peak: dict, after_step: dict, *, device: str,
          reference_bytes: dict[str, int]) -> dict[str, dict[str, int]]:
    """The plan's items, measured. On the device and on the host, what persists: parameters (the
    KL reference's included), gradients, AdamW's state; on the device, what comes and goes over
    it: activations in forward+backward, temporaries in the optimizer step; and the peak."""
    def held(where: str) -> dict[str, int]:
        end = after_step.get(where, {})
        return {"params": end.get("Sharded Param", 0) + end.get("Buffer", 0) + reference_bytes.get(where, 0),
                "grads": end.get("Sharded Grad", 0), "optimizer": end.get("OptState", 0)}

    def persistent(snap: dict[str, int]) -> int:
        return sum(snap.get(kind, 0) for kind in PERSISTENT)

    backward, step = backward_peak.get(device, {}), step_peak.get(device, {})
    # The tracker files what the optimizer step allocates as optimizer state, temporaries too:
    # what it holds beyond the state it keeps is the step's transient.
    step_transient = step.get("Total", 0) - persistent(after_step.get(device, {}))
    peak = max(backward.get("Total", 0), step.get("Total", 0)) + reference_bytes.get(device, 0)
    on_device = {**held(device), "activations": backward.get("Total", 0) - persistent(backward),
                 "optimizer_step": step_transient, "total": peak}
    return {"device": on_device, "host": held("cpu")}


def describe(cfg: Config, model: torch.nn.Module, learners: int, device: str) -> dict[str, str]:
    text, model_cfg = model.config.get_text_config(), cfg.model
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    kernel = getattr(model.config, "_experts_implementation", None) or "grouped_mm"
    routing = f", {experts} experts with top-{text.num_experts_per_tok} routing through {kernel}" if experts else ""
    unsharded = "" if uses_fsdp(cfg, learners) else " (an fp32 run with one learner does not shard)"
    held = ", the previous micro-batch's gradients held" if cfg.optim.gradient_accumulation_steps > 1 else ""
    on_off = {True: "on", False: "off"}
    checkpointing = on_off[model_cfg.gradient_checkpointing]
    traced = (f"{type(model).__name__.removeprefix('FSDP')} at full size ({text.num_hidden_layers} layers{routing}) "
              f"on device '{device}' of a fake group of {learners} learner rank(s){unsharded}, built and wrapped by "
              f"learner.build_model (fp32 master weights, {model_cfg.learner_dtype} compute, offload "
              f"{on_off[model_cfg.learner_offload]}, gradient checkpointing {checkpointing}); "
              f"after a warm-up step that creates AdamW's state: one micro-batch of {cfg.optim.per_device_batch_size} "
              f"x {cfg.data.max_prompt_length + cfg.rollout.max_response_length} tokens forward and backward{held} "
              f"(response log-probs as the learner takes them), grad clipping, one AdamW step")
    not_traced = ("the no-grad forwards of the old and KL reference log-probs (planned for log_prob_batch_size "
                  "sequences; the reference's shards are counted), "
                  "attention's own kernel (a fused one stands in), generation and the KV cache (rollout weights only), "
                  "weight sync and checkpoint staging (host memory)")
    return {"traced": traced, "not_traced": not_traced}


def table(result: dict[str, Any], plan: dict[str, Any]) -> str:
    def size(n: Optional[int]) -> str:
        return "-" if n is None else f"{n / GIB:.2f} GiB" if n >= GIB / 10 or n == 0 else f"{n / 2**20:.2f} MiB"

    planned, measured = result["planned"], result["measured"]
    lines = [f"dry run: {plan['model']['params'] / 1e9:.2f}B parameters; {plan['layout']}",
             f"{'item':<34} {'planned':>12} {'measured':>12} {'ratio':>7}"]
    for item, plan_bytes in planned.items():
        got = measured.get(item)
        ratio = f"{got / plan_bytes:.3f}" if got is not None and plan_bytes else "-"
        lines.append(f"{item:<34} {size(plan_bytes):>12} {size(got):>12} {ratio:>7}")
    total = measured.get("learner_rank.device.total")
    if plan["device_memory"] is not None and total is not None:
        fits = "fits" if total <= plan["device_memory"] else "DOES NOT FIT"
        lines.append(f"device memory {size(plan['device_memory'])}: measured learner peak {fits}")
    if result["traced"]:
        lines.append(f"traced: {result['traced']}")
    lines.append(f"not traced: {result['not_traced']}")
    return "\n".join(lines)
