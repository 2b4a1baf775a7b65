"""The learner rank: the policy sharded with FSDP2, old log-probs, the DAPO update, the optimizer
step, gathering the new weights, and the learner's part of every checkpoint.

With several learner ranks each holds a shard of the parameters, gradients and AdamW state
(ZeRO-3) and trains on an equal share of every mini-batch; the loss is normalised by the whole
mini-batch's token (or sequence) count, so the update does not depend on the number of learners
or micro-batches. A bf16 learner runs under FSDP2 even alone (one learner rank, or a one-process
run over a group of its own): its mixed precision is the one way to bf16 in every matmul.
The algorithm's math is in dapo_loss.py; this file only feeds it.
"""
from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol, Union

import torch
import torch.distributed as dist

import ckpt
import dapo_loss
import packing
import rollout_correction
import routing
import throughput
from config import AlgoConfig, Config, Derived, OptimConfig, UserError, uses_fsdp
from device import Platform, RolloutDtype, step_generator
from fp8 import convert_to_fp8
from hf_weights import WeightFiles, empty_model
from metrics import log, warn
from packing import PackedRows
from ranks import (Groups, Layout, all_reduce_max, all_reduce_sum, all_reduce_tensor, gather_json, phase,
                   wait_for_group)
from samples import SampleBatch

# The metrics a policy loss (PolicyLoss) may report, each a mean over its call's valid tokens;
# dapo_loss.policy_loss reports all three. One a loss leaves out is empty in metrics.csv.
PG_METRICS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")
# Summed over micro-batches and learners, then averaged over optimizer steps (metrics.csv).
LOSS_METRICS = ("policy_loss", "kl", "entropy", "length_penalty", *PG_METRICS)


class PolicyLoss(Protocol):
    """The policy-gradient term of the loss, with its aggregation: the seam Trainer.policy_loss
    fills (its docstring states the contract). Tensors and plain numbers in, (scalar loss,
    metrics of PG_METRICS as tensors or floats) out; no config, no model."""

    def __call__(self, log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, *, loss_agg_mode: str, normalizer: float,
                 is_weights: Optional[torch.Tensor]) -> tuple[torch.Tensor, dict[str, Union[torch.Tensor, float]]]: ...


def dapo_policy_loss(algo: AlgoConfig) -> PolicyLoss:
    """DAPO's clipped loss (dapo_loss.policy_loss) with the run's clip ratios: the default policy
    loss, of Trainer.policy_loss and of a Learner.update that is given none."""
    return functools.partial(dapo_loss.policy_loss, clip_ratio_low=algo.clip_ratio_low,
                             clip_ratio_high=algo.clip_ratio_high, clip_ratio_c=algo.clip_ratio_c)


def add_pg_metrics(sums: dict[str, torch.Tensor], reported: set[str], loss: torch.Tensor, metrics: dict[str, Any],
                   share: float) -> None:
    """Add a policy loss's ``metrics`` (means over its tokens, ``share`` of the mini-batch's) into
    ``sums``, their names into ``reported``; a loss that is not a scalar, or a metric that is not
    one of PG_METRICS, is a mistake in an overriding loss, said here rather than as a missing
    column later."""
    if loss.dim() != 0:
        raise ValueError(f"policy_loss must return a scalar loss, got shape {tuple(loss.shape)}")
    if unknown := sorted(set(metrics) - set(PG_METRICS)):
        raise ValueError(f"policy_loss returned metrics {unknown}; it may report {', '.join(PG_METRICS)}")
    for key, value in metrics.items():
        sums[key] += (value.detach() if isinstance(value, torch.Tensor) else value) * share
    reported.update(metrics)


# Hugging Face model_type values whose models this trainer and both engines run: decoder-only
# causal LMs laid out as model.layers / model.embed_tokens / lm_head (what shard_model, the
# memory plan, the FP8 copy and the weight sync walk), each trained in the suite or on a device.
SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen3", "qwen2", "llama")


def check_model_type(model_path: str) -> None:
    """UserError (one line) for a model folder whose architecture is not one of SUPPORTED_MODEL_TYPES;
    a folder without config.json is config.check_input_paths's to refuse."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (OSError, ValueError) as exc:
        raise UserError(f"model_path {model_path}: config.json is not readable JSON ({exc})") from None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"model_path {model_path}: model_type {model_type!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")


def adamw(parameters: list[torch.nn.Parameter], optim: OptimConfig) -> torch.optim.AdamW:
    """The learner's AdamW: torch's fused kernel where every parameter is in host memory
    (learner_offload, the CPU). torch's default there is neither fused nor foreach: a loop over
    the tensors, several passes of separate ops over each, ~7x the fused step's time on one
    thread (bench/optimizer_step.py), minutes per step over a 30B learner's 15.25B parameters.
    The update equals the default's within float rounding. Elsewhere torch picks (foreach)."""
    on_host = all(parameter.device.type == "cpu" for parameter in parameters)
    return torch.optim.AdamW(parameters, lr=optim.learning_rate, betas=(0.9, 0.999),
                             weight_decay=optim.weight_decay, fused=True if on_host else None)


def shard_model(model: torch.nn.Module, mesh: Any, *, learner_dtype: str, offload: bool,
                frozen: bool = False) -> None:
    """FSDP2 over ``mesh``: parameters, gradients and optimizer state split (ZeRO-3), each decoder
    layer gathered only while it computes.

    With learner_dtype bf16, FSDP2 gathers each layer's fp32 master weights as bf16 and reduces
    gradients in fp32: bf16 compute that reaches every matmul, fused MoE experts included, which
    autocast over fp32 weights does not (its grouped_mm experts run fp32 GEMMs, 2.7x slower on an
    H200: docs/platform.md). So a bf16 learner is sharded even over one rank. With ``offload`` the
    shards, their gradients and AdamW's state live in host memory and each layer is copied to
    the device for its forward and backward (CPUOffloadPolicy).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if learner_dtype == "bf16" else MixedPrecisionPolicy()
    # Pinned host memory makes the copies to the device asynchronous; a CPU mesh has no device.
    placement = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if offload else OffloadPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=precision, offload_policy=placement)
    # The root's own parameters (embeddings, final norm, lm_head: 622M at 30B) are the first that
    # backward needs, so they stay gathered from forward to backward instead of being gathered
    # twice per micro-batch (as torchtitan does; said here, not left to the default, which torch
    # has changed). A frozen model (the KL reference) has no backward: its root reshards at once.
    fully_shard(model, mesh=mesh, mp_policy=precision, offload_policy=placement, reshard_after_forward=frozen)


def build_model(path: Path, device: torch.device, mesh: Any = None, *, learner_dtype: str = "fp32",
                offload: bool = False, dtype: torch.dtype = torch.float32, frozen: bool = False) -> torch.nn.Module:
    """The architecture of ``path`` in ``dtype``, sharded over ``mesh`` when given, with storage
    for this rank's shards only (on the host with ``offload``): its weights are not filled in
    yet (:func:`fill_from_files`, or a checkpoint's learner state). ``frozen``: never trained."""
    shard = None if mesh is None else \
        (lambda model: shard_model(model, mesh, learner_dtype=learner_dtype, offload=offload, frozen=frozen))
    return empty_model(path, "cpu" if offload else device, dtype, shard, computes_on=device.type)


def shard_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's piece of ``param``, the index of its first row in the whole parameter):
    FSDP2 cuts dim 0 as torch.chunk does."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param, 0
    rows, mesh = param.shape[0], param.device_mesh
    chunk = math.ceil(rows / mesh.size())
    start = min(mesh.get_local_rank() * chunk, rows)
    local = param.to_local()
    assert local.shape[0] == min(chunk, rows - start), \
        f"FSDP2 gave this rank {local.shape[0]} rows of {rows}, not torch.chunk's {min(chunk, rows - start)}"
    return local, start


@torch.no_grad()
def fill_from_files(model: torch.nn.Module, path: Path) -> None:
    """Each parameter's rows that this rank holds, read from the Hugging Face files of ``path``
    (nothing else is read)."""
    files = WeightFiles(path)
    for name, param in model.named_parameters():
        local, start = shard_rows(param)
        local.copy_(files.rows(name, param.shape, start, start + local.shape[0]))


def prepare_policy(model: torch.nn.Module, cfg: Config) -> None:
    """The policy for training: no KV cache, activation checkpointing when configured."""
    model.config.use_cache = False
    if cfg.model.gradient_checkpointing:
        # transformers renamed the switch; take whichever this version has.
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()


def packed_kernel(model: torch.nn.Module) -> str:
    """The attention kernel of a learner model whose forwards are packed (use_remove_padding): ours
    (packing.VARLEN_ATTENTION); a model with a sliding window keeps its own, which finds the packed
    sequences from their positions."""
    if getattr(model.config, "sliding_window", None) is not None:
        return model.config._attn_implementation
    packing.register_varlen_attention()
    return packing.VARLEN_ATTENTION


def attention_mask_for(model: torch.nn.Module, valid: torch.Tensor) -> torch.Tensor:
    """The attention mask of a full-sequence forward over left-padded rows (``valid`` [N, L]).

    For sdpa without a sliding window (and packing.VARLEN_ATTENTION, which is sdpa for padded rows) it
    is built here, on the device, as transformers builds it
    ([N, 1, L, L] bool: query i sees keys j <= i that are real tokens; torch's attention gives a
    padding query that sees nothing a zero row), so the numbers do not change. Given the 2D mask,
    transformers first reads it on the host to decide whether it may drop it: one or two device
    syncs per forward. Other attention kernels get the 2D mask and build their own."""
    config = model.config
    sdpa = config._attn_implementation in ("sdpa", packing.VARLEN_ATTENTION)
    if not sdpa or getattr(config, "sliding_window", None) is not None:
        return valid.long()
    length = valid.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
    return causal & valid[:, None, None, :]


def reference_dtype(cfg: Config, sharded: bool) -> torch.dtype:
    """The frozen KL reference needs no fp32 master copy where FSDP2 computes in bf16: bf16
    weights give that compute bit for bit, in half the bytes."""
    return torch.bfloat16 if sharded and cfg.model.learner_dtype == "bf16" else torch.float32


def uses_reference_model(cfg: Config) -> bool:
    """Whether any step has a KL term, so the base model must be kept as the KL reference."""
    return cfg.algo.kl_coef > 0 or (cfg.algo.kl_coef_init is not None and cfg.algo.kl_warmup_steps > 0
                                    and cfg.algo.kl_coef_init > 0)


@dataclass(frozen=True)
class StepTensors:
    """What the update computes once per step, before cutting it into mini-batches: one row per
    sample ([N] or [N, R]); the reference log-probs and importance weights only when in use."""

    advantages: torch.Tensor
    old_logp: torch.Tensor
    ref_logp: Optional[torch.Tensor]
    is_weights: Optional[torch.Tensor]
    # The response mask less the tokens rollout_rs rejects: what every loss term, its token count
    # and the loss metrics sum over (the forward still attends to every token).
    loss_mask: torch.Tensor
    length_ratio: torch.Tensor  # rho of docs/algorithm.md §5: length over the group's mean length


class Learner:
    """One learner rank (or the learner half of a one-process run)."""

    def __init__(self, cfg: Config, plat: Platform, derived: Derived, layout: Layout, groups: Optional[Groups],
                 resume: Optional[Path]) -> None:
        self.cfg, self.plat, self.derived, self.layout, self.groups = cfg, plat, derived, layout, groups
        torch.manual_seed(cfg.run.seed)
        self.sharded = uses_fsdp(cfg, layout.num_learners)
        assert groups is not None or not self.sharded, "FSDP2 needs a learner group (exchange.one_process_groups)"
        self.policy = self._build(resume)
        prepare_policy(self.policy, cfg)
        # The policy continues from the checkpoint's weights; the KL reference stays the base model.
        self.ref_model = None
        if uses_reference_model(cfg):
            self.ref_model = self._build(None, reference_dtype(cfg, self.sharded), frozen=True)
            self.ref_model.eval().requires_grad_(False)
        if cfg.model.learner_offload and plat.kind != "cpu":
            # AdamW and the gradient norm run on the host here, where torchrun's OMP_NUM_THREADS=1
            # would leave them one thread: a thread per core of the rank's share of its NUMA node
            # (device.bind_host_cores on NPU, launch.sh's torchrun --numa-binding on CUDA).
            torch.set_num_threads(len(os.sched_getaffinity(0)))
        self.optimizer = adamw(list(self.policy.parameters()), cfg.optim)
        self.meter = throughput.PhaseMeter()
        self.active_params = throughput.active_parameters(self.policy)
        self.peak_tflops = throughput.peak_tflops(plat.device_name(), cfg.run.peak_tflops)
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.writer = ckpt.BackgroundWriter(plat.bind)
        if layout.is_lead:
            log(self.describe())

    def describe(self) -> str:
        where = "in host memory (learner_offload)" if self.cfg.model.learner_offload else "on the device"
        how = f"FSDP2 over {self.layout.num_learners} learner rank(s)" if self.sharded else "unsharded"
        return f"learner: {how}; fp32 weights, gradients and AdamW state {where}; computes in {self.cfg.model.learner_dtype}"

    def _build(self, resume: Optional[Path], dtype: torch.dtype = torch.float32,
               frozen: bool = False) -> torch.nn.Module:
        """The policy (or the ``frozen`` reference model) with this learner's shards of the base
        model's weights, or of checkpoint ``resume``'s."""
        mesh = None
        if self.sharded:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(self.groups.learners, self.plat.device.type)
        model = build_model(Path(self.cfg.model.model_path), self.plat.device, mesh,
                            learner_dtype=self.cfg.model.learner_dtype, offload=self.cfg.model.learner_offload,
                            dtype=dtype, frozen=frozen)
        if self.cfg.model.use_remove_padding:
            model.set_attn_implementation(packed_kernel(model))
        if resume is None:
            fill_from_files(model, Path(self.cfg.model.model_path))
        else:
            with phase("checkpoint load"):
                ckpt.load_learner_weights(resume / ckpt.LEARNER_STATE, model, self.learner_group())
        return model

    def learner_group(self) -> Any:
        return self.groups.learners if self.groups is not None else None

    @torch.no_grad()
    def rollout_copy(self, rollout_dtype: str) -> torch.nn.Module:
        """An unsharded copy of the policy for a one-process run's rollout side: its full fp32
        weights (gathered when sharded), then converted to the rollout dtype."""
        model = empty_model(Path(self.cfg.model.model_path), self.plat.device, torch.float32)
        for param, weight in zip(model.parameters(), self.full_weights(), strict=True):
            param.copy_(weight)
        dtype = RolloutDtype.of(rollout_dtype)
        return convert_to_fp8(model, dtype.compute) if dtype.fp8_weights else model.to(dtype.compute)

    # ----- schedules ----------------------------------------------------------------------------

    def kl_coef_at(self, step: int) -> float:
        """The KL coefficient of training step ``step`` (1-based): kl_coef_init for the first
        kl_warmup_steps steps, kl_coef after."""
        algo = self.cfg.algo
        if algo.kl_coef_init is not None and step <= algo.kl_warmup_steps:
            return algo.kl_coef_init
        return algo.kl_coef

    def lr_at(self, step: int) -> float:
        """The learning rate of every optimizer step of training step ``step`` (1-based): linear
        warmup over lr_warmup_steps training steps, as verl counts them; the first is non-zero."""
        warmup = self.cfg.optim.lr_warmup_steps
        scale = min(1.0, step / warmup) if warmup > 0 else 1.0
        return self.cfg.optim.learning_rate * scale

    # ----- log-probs ----------------------------------------------------------------------------

    def routed(self, model: torch.nn.Module, batch: SampleBatch, packed: Optional[PackedRows] = None, *,
               measure: bool = False) -> Any:
        """The block in which ``model``'s forwards over ``batch`` (``packed``, when given) take the
        recorded experts (routing_replay; routing.replaying), or do nothing."""
        if not self.cfg.algo.routing_replay:
            return routing.replaying(model, None)
        assert batch.routed_experts is not None, "routing_replay: samples reached the learner without their expert ids"
        ids = batch.routed_experts.to(self.plat.device)
        return routing.replaying(model, ids if packed is None else packed.pack_tokens(ids), measure=measure)

    def packed(self, batch: SampleBatch, phase: str) -> Optional[PackedRows]:
        """``batch``'s rows packed for one padding-free forward (use_remove_padding), or None; the
        tokens it computes, real and padding, counted for ``phase``."""
        real = int(batch.prompt_mask.sum() + batch.response_mask.sum())
        padded = batch.prompt_ids.numel() + batch.response_ids.numel()
        packs = self.cfg.model.use_remove_padding
        self.meter.count(phase, real, real if packs else padded)
        return packing.pack(batch, self.plat.device) if packs else None

    def sequence_logprobs(self, model: torch.nn.Module, batch: SampleBatch, *, with_entropy: bool,
                          entropy_grad: bool = True, packed: Optional[PackedRows] = None,
                          ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Log-probs (and entropy) of the response tokens under ``model``, temperature-scaled, in
        ``batch``'s padded [rows, response width] layout: from one forward over the padded rows,
        or over the rows ``packed`` (zero at padding). Without ``entropy_grad`` the entropy is a
        metric only: no graph over the full vocabulary. With routing replay, call it inside
        :meth:`routed`."""
        device = self.plat.device
        if packed is None:
            ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1).to(device)
            attention = torch.cat([batch.prompt_mask, batch.response_mask], dim=1).to(device)
            positions = (attention.long().cumsum(-1) - 1).clamp(min=0)
            width = batch.response_ids.shape[1]
            logits = model(input_ids=ids, attention_mask=attention_mask_for(model, attention), position_ids=positions,
                           use_cache=False, logits_to_keep=width + 1).logits
            # One contiguous copy that the log-prob and entropy kernels both view (and save for
            # backward), instead of one copy each of a strided slice.
            logits, targets = logits[:, :-1].contiguous(), batch.response_ids.to(device)
        else:
            logits = model(input_ids=packed.ids, position_ids=packed.positions, use_cache=False,
                           logits_to_keep=packed.predicting,
                           **packing.attention_inputs(model.config, packed)).logits
            targets = packed.targets
        temperature = self.cfg.rollout.temperature
        logp = dapo_loss.token_logprobs(logits, targets, temperature)
        entropy = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropy = dapo_loss.entropy_from_logits(logits, temperature)
        if packed is not None:
            logp = packed.unpack_responses(logp)
            entropy = None if entropy is None else packed.unpack_responses(entropy)
        return logp, entropy

    def micro_batches(self, batch: SampleBatch, rows: torch.Tensor, size: int, budget: Optional[int] = None,
                      shares: Optional[list[torch.Tensor]] = None) -> list[tuple[torch.Tensor, SampleBatch]]:
        """``rows`` (this learner's) cut into micro-batches, each trimmed to its own widths: ``size``
        rows each, or, given a token ``budget`` (use_dynamic_bsz), filled by real tokens, in as many
        micro-batches as the fullest of ``shares`` (every learner's rows; default ``rows`` alone)
        needs (packing.fill_by_tokens)."""
        if budget is None:
            chunks = list(rows.split(size))
        else:
            tokens = batch.prompt_mask.sum(1) + batch.response_mask.sum(1)
            chunks = packing.fill_by_tokens(tokens, rows, shares or [rows], budget)
        return [(chunk, batch.select_rows(chunk).trimmed()) for chunk in chunks]

    def phase_of(self, model: torch.nn.Module) -> str:
        """The throughput phase (throughput.PHASES) of a no-grad forward of ``model``."""
        return "ref" if model is self.ref_model else "old_logp"

    def shares(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Each learner's rows of ``rows``, dealt out in turn."""
        learners = self.layout.num_learners
        return [rows[index::learners] for index in range(learners)]

    @torch.no_grad()
    def logprobs_of(self, model: torch.nn.Module, batch: SampleBatch, rows: torch.Tensor,
                    routing_counts: Optional[torch.Tensor] = None,
                    shares: Optional[list[torch.Tensor]] = None) -> torch.Tensor:
        """[N, R] log-probs on the host, filled in for ``rows`` only, computed in forwards of
        log_prob_batch_size rows (or of log_prob_max_token_len_per_gpu tokens, with use_dynamic_bsz:
        as many forwards as the fullest of every learner's ``shares`` needs) into one device buffer
        that is read once. With routing replay and
        ``routing_counts`` (a [2] device tensor), the forwards add to it how many routing
        decisions for the response tokens were, by the learner's own router, other experts
        than the recorded ones, and how many there were (routing.response_disagreement)."""
        out = torch.zeros(batch.response_ids.shape, dtype=torch.float32, device=self.plat.device)
        optim = self.cfg.optim
        for chunk, part in self.micro_batches(batch, rows, optim.log_prob_rows, optim.log_prob_token_budget, shares):
            packed = self.packed(part, self.phase_of(model))
            with self.routed(model, part, packed, measure=routing_counts is not None) as replay:
                logp, _ = self.sequence_logprobs(model, part, with_entropy=False, packed=packed)
            if replay is not None and routing_counts is not None:
                differs = replay.differs if packed is None else packed.unpack_tokens(replay.differs)
                routing_counts += routing.response_disagreement(differs, part.response_mask.to(self.plat.device))
            out[chunk, : logp.shape[1]] = logp.float()
        return out.cpu()

    # ----- the update ---------------------------------------------------------------------------

    def update(self, batch: SampleBatch, advantages: torch.Tensor, step: int,
               policy_loss: Optional[PolicyLoss] = None) -> dict[str, Any]:
        """Train on the step's samples: mini-batches of optimizer steps, micro-batches of backward;
        the policy-gradient term is ``policy_loss`` (default :func:`dapo_policy_loss`).

        Each pass over the step draws one order of all rows and cuts it into mini-batches of
        ``minibatch_sequences`` rows per learner; each mini-batch is dealt out to the learners in
        turn and its loss normalised by its whole token (or sequence) count. So the mini-batches,
        and the update, do not depend on the number of learners or of micro-batches.
        """
        cfg, learners, me = self.cfg, self.layout.num_learners, self.layout.learner_index
        policy_loss = policy_loss or dapo_policy_loss(cfg.algo)
        self.policy.train()
        self.meter.reset()
        mask = batch.response_mask
        shares = self.shares(torch.arange(mask.shape[0]))
        own = shares[me]  # the rows whose old log-probs this learner computes
        routing_counts = torch.zeros(2, device=self.plat.device)
        old_logp = self.shared_logprobs(self.policy, batch, shares, routing_counts)
        ref_logp = self.shared_logprobs(self.ref_model, batch, shares) if self.ref_model is not None else None
        gap = (old_logp - batch.rollout_logp).abs()[own]
        # The samples generated by the very weights the learner holds: their gap is the engine's
        # own error (rollout dtype, FP8, kernels), without the drift of one or more updates.
        same_weights = (batch.version[own] == step - 1)[:, None] & mask[own]
        gaps = {"all": gap[mask[own]], "engine": gap[same_weights]}
        # Over the whole step, the same on every learner (old_logp was exchanged), as verl computes
        # it once per batch: so the batch normalisation and the metrics are the step's.
        is_level, is_threshold = cfg.algo.importance_sampling()
        correction = rollout_correction.correct(
            old_logp, batch.rollout_logp, mask, is_level=is_level, is_threshold=is_threshold,
            is_batch_normalize=cfg.algo.rollout_is_batch_normalize, rs_modes=cfg.algo.rollout_rs,
            rs_threshold=cfg.algo.rollout_rs_threshold)
        per_row = StepTensors(advantages=advantages, old_logp=old_logp, ref_logp=ref_logp,
                              is_weights=correction.weights, loss_mask=correction.loss_mask,
                              length_ratio=dapo_loss.group_length_ratio(batch.response_lengths, batch.group_size))
        # Summed where they are computed: a read into Python would wait for each backward before
        # the next forward is queued; reduce_metrics reads them once per step.
        sums = {key: torch.zeros((), device=self.plat.device) for key in LOSS_METRICS}
        reported: set[str] = set()  # the PG_METRICS that policy_loss returns
        grad_norms = []
        with self.meter.timed("update"):  # ends with the last optimizer step's read of the gradient norm
            for epoch in range(cfg.optim.ppo_epochs):
                order = torch.randperm(mask.shape[0], generator=step_generator(cfg.run.seed, step, epoch))
                for minibatch in order.split(self.derived.minibatch_sequences * learners):
                    self.accumulate_minibatch(batch, per_row, minibatch, self.kl_coef_at(step), sums, policy_loss,
                                              reported)
                    grad_norms.append(self.optimizer_step(step))
        return {**self.reduce_metrics(sums, gaps, grad_norms, routing_counts, kl_coef=self.kl_coef_at(step),
                                      lr=self.lr_at(step), reported=reported),
                **correction.metrics}

    def shared_logprobs(self, model: torch.nn.Module, batch: SampleBatch, shares: list[torch.Tensor],
                        routing_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[N, R] log-probs of every row under ``model``: each learner computes its own rows of
        ``shares`` and the learners exchange them (a sum with zeros elsewhere, so every value is
        exact), since any row may land on any learner in a mini-batch."""
        with self.meter.timed(self.phase_of(model)):
            logp = self.logprobs_of(model, batch, shares[self.layout.learner_index], routing_counts, shares)
            if self.layout.num_learners > 1:
                with phase("update"):
                    logp = all_reduce_tensor(logp, self.groups.learners, self.plat.device)
        return logp

    def accumulate_minibatch(self, batch: SampleBatch, per_row: StepTensors, minibatch: torch.Tensor,
                             kl_coef: float, sums: dict[str, torch.Tensor], policy_loss: PolicyLoss,
                             reported: set[str]) -> None:
        """Backward over this learner's rows of one mini-batch (``minibatch``: every learner's rows),
        adding its metrics into ``sums`` on the device and the PG_METRICS ``policy_loss`` gave into
        ``reported``.
        The KL, entropy and length terms are added here, outside ``policy_loss``: regularisers of
        the run's settings that any policy-gradient estimator keeps (verl adds them outside too)."""
        algo, learners = self.cfg.algo, self.layout.num_learners
        shares = self.shares(minibatch)
        # As in verl, rejected tokens leave the token-mean's denominator (it counts the loss mask),
        # while the sequence means still count every row. At least 1: a mini-batch whose every
        # token was rejected adds a loss of 0.
        tokens = max(int(per_row.loss_mask[minibatch].sum()), 1)
        normalizer = tokens if algo.loss_agg_mode == "token-mean" else len(minibatch)
        optim = self.cfg.optim
        for chunk, part in self.micro_batches(batch, shares[self.layout.learner_index], optim.per_device_batch_size,
                                              optim.update_token_budget, shares):
            width = part.response_ids.shape[1]
            host_mask = per_row.loss_mask[chunk, :width]
            part_mask = host_mask.to(self.plat.device)
            packed = self.packed(part, "update")
            # Inside the replay block: the backward recomputes checkpointed layers, routed the same.
            with self.routed(self.policy, part, packed):
                logp, entropy = self.sequence_logprobs(self.policy, part, with_entropy=True,
                                                       entropy_grad=algo.entropy_coeff != 0, packed=packed)
                on_device = lambda t: t[chunk, :width].to(self.plat.device) if t is not None else None  # noqa: E731
                pg_loss, pg_metrics = policy_loss(
                    logp, on_device(per_row.old_logp), per_row.advantages[chunk].to(self.plat.device), part_mask,
                    loss_agg_mode=algo.loss_agg_mode, normalizer=normalizer, is_weights=on_device(per_row.is_weights))
                entropy_term = dapo_loss.aggregate(entropy, part_mask, algo.loss_agg_mode, normalizer)
                loss = pg_loss - algo.entropy_coeff * entropy_term
                share = int(host_mask.sum()) / tokens  # the metrics are means over tokens
                if per_row.ref_logp is not None:
                    kl = dapo_loss.aggregate(dapo_loss.kl_penalty(logp, on_device(per_row.ref_logp), algo.kl_type),
                                             part_mask, algo.loss_agg_mode, normalizer)
                    loss = loss + kl_coef * kl
                    sums["kl"] += kl.detach()
                if algo.length_penalty_coef:
                    ratio = per_row.length_ratio[chunk].to(self.plat.device)
                    penalty = dapo_loss.length_penalty(logp, part_mask, ratio, coef=algo.length_penalty_coef,
                                                       normalizer=normalizer)
                    loss = loss + penalty
                    sums["length_penalty"] += penalty.detach()
                # FSDP averages gradients over learners, but each learner's loss is already its share
                # of the whole mini-batch's loss: scale so the average is the sum.
                (loss * learners).backward()
            sums["policy_loss"] += pg_loss.detach()
            sums["entropy"] += entropy_term.detach()
            add_pg_metrics(sums, reported, pg_loss, pg_metrics, share)

    def reduce_metrics(self, sums: dict[str, torch.Tensor], gaps: dict[str, torch.Tensor], grad_norms: list[float],
                       routing_counts: torch.Tensor, *, kl_coef: float, lr: float,
                       reported: set[str]) -> dict[str, Any]:
        """The step's metrics, summed over learners and averaged over optimizer steps (empty: the
        KL without a reference model, the PG_METRICS not ``reported`` by the policy loss); the
        rollout/learner log-prob gaps over all tokens and over the engine's own (``gaps``); the
        fraction of routing decisions the learner's own router made otherwise (``routing_counts``)."""
        keys = list(sums)
        gap, engine = gaps["all"], gaps["engine"]
        # the step's one read of the metrics
        totals = torch.cat([torch.stack([sums[k] for k in keys]), routing_counts]).tolist()
        totals += [float(gap.sum()), float(gap.numel()), float(engine.sum()), float(engine.numel())]
        totals += self.meter.counts()
        gap_max = float(gap.max()) if gap.numel() else 0.0
        if self.layout.num_learners > 1:
            with phase("update"):
                totals = all_reduce_sum(totals, self.groups.learners, self.plat.device)
                gap_max = all_reduce_max(gap_max, self.groups.learners, self.plat.device)
        totals, tokens = totals[:-len(throughput.PHASES) * 2], totals[-len(throughput.PHASES) * 2:]
        count = len(grad_norms)
        result = {k: v / count for k, v in zip(keys, totals)}
        if self.ref_model is None:
            result["kl"] = None
        result.update({key: None for key in PG_METRICS if key not in reported})
        routing_differ, routing_decisions, gap_sum, gap_count, engine_sum, engine_count = totals[-6:]
        result.update(grad_norm=sum(grad_norms) / count, kl_coef=kl_coef, lr=lr,
                      mismatch_mean=gap_sum / max(gap_count, 1.0), mismatch_max=gap_max,
                      engine_mismatch_mean=engine_sum / engine_count if engine_count else None,
                      routing_mismatch=routing_differ / routing_decisions if routing_decisions else None)
        result.update(throughput.phase_metrics(throughput.PhaseMeter.from_counts(tokens), self.meter.seconds,
                                               active=self.active_params, learners=self.layout.num_learners,
                                               peak=self.peak_tflops))
        return result

    def optimizer_step(self, step: int) -> float:
        """Clip, check and apply the accumulated gradient; a non-finite one is skipped, never applied."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg.optim.grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if not math.isfinite(grad_norm):
            self.skipped_steps += 1
            warn(f"step {step}: gradient norm is {grad_norm}; optimizer step skipped "
                 f"({self.skipped_steps} skipped so far)")
            self.optimizer.zero_grad(set_to_none=True)
            return 0.0
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return grad_norm

    # ----- weights out --------------------------------------------------------------------------

    def full_weights(self) -> Iterator[torch.Tensor]:
        """Every parameter whole, one at a time, in the model's order: each is an all-gather over
        the learners, so every learner walks the whole sequence at the same point of its run,
        the lead to send the weights, the others to take part (exchange.Torchrun.join_weights)."""
        from torch.distributed.tensor import DTensor

        if self.sharded:
            with phase("weight sync"):
                wait_for_group(self.groups.learners)  # the lead may come late: it collects samples first
        for param in self.policy.parameters():
            if not isinstance(param, DTensor):
                yield param.detach()
            elif param.to_local().device == self.plat.device:
                yield param.detach().full_tensor()
            else:  # an offloaded shard: the collective runs on the device
                local = param.detach().to_local().to(self.plat.device)
                yield DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                         stride=param.stride()).full_tensor()

    # ----- the learner's part of a checkpoint ---------------------------------------------------

    def counters(self) -> dict[str, int]:
        return {"optimizer_steps": self.optimizer_steps, "skipped_steps": self.skipped_steps}

    def stage_checkpoint(self, rank_state: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Every learner: a host copy of its weight and optimizer shards, and the learners' rank
        states (on the lead)."""
        self.writer.wait()  # the previous checkpoint's files are complete, and the host buffers free
        staged = ckpt.stage_learner_state(self.policy, self.optimizer, copy=self.cfg.run.async_save)
        if self.layout.num_learners == 1:
            return staged, [rank_state]
        with phase("checkpoint"):
            states = gather_json(rank_state, self.layout.lead_learner, self.groups.learners, self.plat.device)
        return staged, states

    def write_checkpoint_part(self, folder: Path, staged: dict[str, Any], export: bool) -> None:
        """On a writer thread: this learner's shards; with ``export``, its share of the Hugging Face
        files too, written from the shards on disk (so no rank gathers the model)."""
        group = self.groups.checkpoint if self.groups is not None else None
        ckpt.write_learner_state(folder / ckpt.LEARNER_STATE, staged, group)
        if export:
            ckpt.export_model(folder, folder / ckpt.HF_MODEL, part=self.layout.learner_index,
                              parts=self.layout.num_learners, max_file_bytes=self.cfg.run.hf_export_file_mb * 2**20)
            if group is not None:
                dist.barrier(group=group)  # the lead marks the folder complete once every file is in

    def save_shard_in_background(self, step_folder: Path, rank_state: dict[str, Any], export: bool) -> None:
        """A learner other than the lead: its part of a checkpoint, written beside training."""
        staged, _ = self.stage_checkpoint(rank_state)
        self.write_checkpoint(f"save-{step_folder.name}", lambda: self.write_checkpoint_part(step_folder, staged, export))

    def write_checkpoint(self, name: str, write: Callable[[], None]) -> None:
        """A checkpoint's writing, on the writer thread: beside training (async_save, from host
        copies), or while this rank waits (from the shards themselves, which the step changes next)."""
        self.writer.start(name, write)
        if not self.cfg.run.async_save:
            self.writer.wait()

    def restore(self, folder: Path, saved: dict[str, Any]) -> None:
        with phase("checkpoint load"):
            ckpt.load_learner_optimizer(folder / ckpt.LEARNER_STATE, self.policy, self.optimizer, self.learner_group())
        self.optimizer_steps, self.skipped_steps = saved["optimizer_steps"], saved["skipped_steps"]
