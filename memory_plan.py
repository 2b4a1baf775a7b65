"""The memory plan's counting: what each rank and each node of a run will hold, in bytes, from
the model's config.json (no weights), the run's settings and the world layout, and the fit checks
against the device (``device_memory_gb``), the host memory of each node (``host_memory_gb``) and
the disk under output_dir for the checkpoints kept (``disk_gb``); each defaults to what this
machine reports. plan_advice.py prints the plan, advises on it (``--plan``) and refuses a run that
does not fit; dry_run.py checks it against a traced step. At the end of a run, record_usage writes
what each rank held (memory_used.json).

Parameters and FP8 rollout weights are counted exactly, on an instance of the architecture on
the meta device; the KV cache exactly from the layer shapes; activations are estimates, stated
as such (what one layer saves per token, the logits of a micro-batch). What the learners hold
follows the code as built: FSDP2 shards fp32 parameters, gradients and AdamW's two moments over
the learner ranks, on the device or, with learner_offload, in host memory; the KL reference
model, when loaded, is sharded the same way in fp32; when a checkpoint is taken every learner
copies its shards to host memory, which a writer thread saves while training goes on (async_save;
false: no copy, the step waits for the write; the plan counts both modes). No rank holds the
whole model in fp32: weight sync and the Hugging Face export go a piece at a time.

A reward model (``reward_model``) lives on every rollout rank, in the rollout's compute dtype
(rewards.reward_model_dtype); its parameters are counted like the policy's, on meta from its
config.json. With one process both roles share one device, so the device holds the learner and
the rollout side together, and at start-up, before either has its working memory, the rollout
copy is made as a full fp32 copy of the policy (learner.Learner.rollout_copy) and only then
cast: the plan's peak is the larger of that moment and the steady state, and it names which.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch

import hf_weights
from config import Config, Derived, RunConfig, uses_fsdp
from device import Platform, RolloutDtype
from metrics import log
from routing import RoutingShape, moe_routers
from ranks import Layout, gather_json

GIB = 2**30


@dataclass(frozen=True)
class Architecture:
    """The numbers of a causal LM config that memory depends on."""

    params: int
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    q_dim: int
    vocab: int
    experts_per_token: int
    expert_intermediate: int
    largest_layer_params: int
    largest_param: int
    fp8_rollout_bytes: int  # the FP8 rollout copy: quantized weights, scales, the rest in bf16
    routing_bytes_per_token: int = 0  # routing_replay's expert ids (routing.py); 0 without MoE layers
    router_weights_fp32: bool = False  # the router hands the experts float32 top-k weights at bf16 (router_keeps_fp32)

    @staticmethod
    def of(model_config: Any) -> "Architecture":
        from transformers import AutoModelForCausalLM

        from fp8 import convert_to_fp8, weight_bytes

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config)
        text = model_config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        layers = model.model.layers
        return Architecture(
            params=sum(p.numel() for p in model.parameters()), layers=text.num_hidden_layers,
            hidden=text.hidden_size, kv_heads=text.num_key_value_heads, head_dim=head_dim,
            q_dim=text.num_attention_heads * head_dim, vocab=text.vocab_size,
            experts_per_token=getattr(text, "num_experts_per_tok", 1),
            expert_intermediate=getattr(text, "moe_intermediate_size", text.intermediate_size),
            largest_layer_params=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
            largest_param=max(p.numel() for p in model.parameters()),
            fp8_rollout_bytes=weight_bytes(convert_to_fp8(model, torch.bfloat16)),
            routing_bytes_per_token=routing.bytes_per_token if (routing := RoutingShape.of(model_config)) else 0,
            router_weights_fp32=bool(routers := moe_routers(model)) and router_keeps_fp32(type(routers[0]), text))

    def saved_per_token_layer(self, dtype_bytes: int) -> int:
        """Activations one decoder layer keeps for backward, per token: norms' inputs, q/k/v and
        attention output, and the experts' intermediates (an estimate, as autograd decides)."""
        attention = 2 * self.hidden + self.q_dim + 2 * self.kv_heads * self.head_dim + self.q_dim
        experts = self.experts_per_token * 3 * self.expert_intermediate
        return (attention + experts) * dtype_bytes

    def routed_in_fp32(self, dtype_bytes: int, outputs: int) -> int:
        """Bytes per token beyond ``dtype_bytes`` compute where the router hands the experts
        float32 top-k weights (router_weights_fp32): the weights themselves, and ``outputs`` of the
        experts' weighted outputs ([top_k, hidden] a token), which the weights promote to float32
        (transformers 5.5.4's integrations/moe.py:418, ``proj_out * sample_weights_g``). One
        layer's backward holds three at once (measured by the dry run: the gradient of the
        unpermuted outputs and the two of the weighting multiply), a no-grad forward two (the
        weighted outputs and their unpermuted copy). 0 where the weights come in the compute dtype."""
        if not self.router_weights_fp32 or dtype_bytes >= 4:
            return 0
        return self.experts_per_token * (outputs * self.hidden + 1) * (4 - dtype_bytes)


def router_keeps_fp32(router_class: type, text_config: Any) -> bool:
    """Whether a router of ``router_class`` (routing.moe_routers), computing in bf16, returns its
    top-k weights in float32. transformers 5.5.4's Qwen3-MoE router writes its float32 softmax
    over ``router_logits`` and casts the top-k weights to that tensor's dtype, so they stay float32
    (models/qwen3_moe/modeling_qwen3_moe.py:266-270); later releases keep the logits and cast the
    weights to the input's dtype. Asked of the installed transformers, on the meta device."""
    with torch.device("meta"):
        probe = router_class(text_config).to(torch.bfloat16)
        out = probe(torch.zeros(1, text_config.hidden_size, dtype=torch.bfloat16))
    return isinstance(out, tuple) and len(out) > 1 and out[1].dtype == torch.float32


def reward_model_params(path: str) -> Optional[int]:
    """Parameters of the reward model folder ``path``, counted as the policy's are: on an
    instance built on the meta device from its config.json. None when the folder has no
    config.json (a placeholder such as the shipped 30B config's /path/to/reward_model)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    if not (Path(path) / "config.json").is_file():
        return None
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(path, local_files_only=True))
    return sum(p.numel() for p in model.parameters())


def reward_model(cfg: Config) -> Optional[dict[str, Any]]:
    """What a rollout rank holds of the reward model: its weights in the rollout's compute dtype
    (``bytes`` None when it could not be counted); None when the run scores with a rule."""
    from rewards import reward_model_dtype

    if not cfg.model.reward_model:
        return None
    params = reward_model_params(cfg.model.reward_model)
    dtype = reward_model_dtype(cfg.model.rollout_dtype)
    return {"path": cfg.model.reward_model, "params": params, "dtype": str(dtype).removeprefix("torch."),
            "bytes": None if params is None else params * dtype.itemsize}


def rollout_rank(cfg: Config, derived: Derived, arch: Architecture,
                 reward: Optional[dict[str, Any]] = None) -> dict[str, int]:
    """One rollout rank's device: its copy of the policy, the KV cache of its share of a
    generation batch (validation batches are no larger), the transient buffers of generation and
    weight sync, and the reward model's weights when there is one (and it could be counted).

    With rollout_tensor_parallel N, the device of an engine rank (the busiest of its engine's
    N): the engine's share of a batch is N ranks' shares, and vLLM splits over the N devices the
    weights, the KV cache's heads (a device keeps one head at least) and the layers' projections
    and experts, while the hidden states and the logits stay whole on every device; the reward
    model is the engine rank's, and a weight-sync bucket is on every device of the engine where
    each worker reads its own rank's copy (IPC, weight_sync.every_engine_rank_takes_weights). vLLM runs eagerly here
    (enforce_eager): no CUDA graphs to count."""
    model, rollout = cfg.model, cfg.rollout
    dtype, split = RolloutDtype.of(model.rollout_dtype), derived.rollout_tensor_parallel
    compute = dtype.compute.itemsize  # FP8 rollout computes (and caches) in bf16
    weights = math.ceil((arch.fp8_rollout_bytes if dtype.fp8_weights else arch.params * compute) / split)
    sequences = math.ceil(rollout.prompts_per_step / Layout.of(derived).num_engines) * rollout.sample_num
    tokens = cfg.data.max_prompt_length + rollout.max_response_length
    kv_cache = sequences * tokens * 2 * arch.layers * math.ceil(arch.kv_heads / split) * arch.head_dim * compute
    # Prefill of one layer at a time, three float32 copies of the last position's logits
    # (logits, log-softmax, the sampling distribution), one weight-sync bucket.
    whole = 2 * arch.hidden * compute  # a token's hidden states around the layer's norms
    prefill = sequences * cfg.data.max_prompt_length * (whole + math.ceil(
        (arch.saved_per_token_layer(compute) - whole) / split))
    activations = prefill + 3 * sequences * arch.vocab * 4 + cfg.run.weight_sync_bucket_mb * 2**20
    items = {"weights": weights, "kv_cache": kv_cache, "activations": activations}
    if (routed := routing_ids(cfg, derived, arch)) is not None:
        items["routing_ids"] = routed["in_transit"]  # more than the share it records
    if reward is not None and reward["bytes"] is not None:
        items["reward_model"] = reward["bytes"]
    return {**items, "total": sum(items.values())}


def routing_ids(cfg: Config, derived: Derived, arch: Architecture) -> Optional[dict[str, int]]:
    """With routing_replay, the bytes of the recorded expert ids, ``per_token`` over prompt and
    response (routing.py: MoE layers x top_k x 1 byte up to 256 experts): a rollout rank's share of
    a generation batch (on its device until the call ends); ``in_transit``, that share from every
    member of the sync group at once, on every member's device while the lead gathers them
    (ranks.gather_samples: an all_gather; the lead's learner device holds it between updates);
    ``sample_buffer``, on the lead's host, the step's samples and as many collected ahead or
    pooled (max_staleness 1), what sample_buffer.safetensors holds at most. None without replay."""
    if not cfg.algo.routing_replay or not arch.routing_bytes_per_token:
        return None
    rollout = cfg.rollout
    per_sequence = (cfg.data.max_prompt_length + rollout.max_response_length) * arch.routing_bytes_per_token
    share = math.ceil(rollout.prompts_per_step / derived.num_rollout_ranks) * rollout.sample_num * per_sequence
    step = rollout.prompts_per_step * rollout.sample_num * per_sequence
    return {"per_token": arch.routing_bytes_per_token, "rollout_share": share,
            "in_transit": (derived.num_rollout_ranks + 1) * share, "sample_buffer": (1 + cfg.run.max_staleness) * step}


def one_process(cfg: Config, arch: Architecture, rollout: dict[str, int], learner_device: dict[str, int]) -> dict[str, Any]:
    """One process, both roles on one device. Steady state: everything the learner and the
    rollout side hold, together (the caching allocator keeps what each phase freed). Start-up:
    the learner's parameters (and KL reference) and learner.Learner.rollout_copy's fp32 copy
    of the policy, while it is cast to the rollout dtype one parameter at a time (a parameter's
    cast beside its fp32 original; nothing extra for an fp32 rollout, whose copy is that fp32 copy);
    the reward model is loaded only after that."""
    fp32_copy = 4 * arch.params
    compute = RolloutDtype.of(cfg.model.rollout_dtype).compute
    casting = 0 if compute == torch.float32 else arch.largest_param * compute.itemsize
    steady_state = learner_device["total"] + rollout["total"]
    start_up = learner_device["params"] + fp32_copy + casting
    return {"learner": learner_device["total"], "rollout": rollout["total"], "steady_state": steady_state,
            "fp32_rollout_copy": fp32_copy, "start_up": start_up, "total": max(steady_state, start_up),
            "peak_at": "steady state" if steady_state >= start_up else "start-up (the rollout copy's fp32 copy)"}


def learner_rank(cfg: Config, derived: Derived, arch: Architecture, *, with_reference: bool) -> dict[str, Any]:
    """One learner rank, on its device and on its host (the lead's host: the most loaded)."""
    shard = math.ceil(arch.params / derived.num_learner_ranks)
    # fp32 master weights, and the KL reference: frozen, so bf16 where FSDP2 computes in bf16.
    sharded = uses_fsdp(cfg, derived.num_learner_ranks)
    reference = (2 if sharded and cfg.model.learner_dtype == "bf16" else 4) * shard if with_reference else 0
    params = 4 * shard + reference
    grads, optimizer = 4 * shard, 8 * shard  # fp32 gradients, AdamW's two fp32 moments
    compute = 2 if cfg.model.learner_dtype == "bf16" else 4
    activations = learner_activations(cfg, derived, arch, compute)["activations"]
    # AdamW (foreach) holds one fp32 temporary the size of a shard while it steps; activations are
    # gone by then, so the peak is the larger of the two on top of what persists.
    state, step = {"params": params, "grads": grads, "optimizer": optimizer}, 4 * shard
    offload = cfg.model.learner_offload
    device = {**{k: 0 if offload else v for k, v in state.items()}, "activations": activations,
              "optimizer_step": 0 if offload else step}
    device["total"] = sum(device[k] for k in state) + max(activations, device["optimizer_step"])
    host = {**{k: v if offload else 0 for k, v in state.items()}, "optimizer_step": step if offload else 0}
    copied = cfg.run.save_every and cfg.run.async_save  # async_save false writes from the shards themselves
    host["checkpoint_copy"] = 4 * shard + 8 * shard if copied else 0  # weights + AdamW shards
    if (routed := routing_ids(cfg, derived, arch)) is not None:
        host["routing_ids"] = routed["sample_buffer"]
    host["total"] = sum(host.values())
    return {"device": device, "host": host}


def micro_batch_tokens(cfg: Config, derived: Derived) -> dict[str, int]:
    """The most tokens a learner's forward computes, and the most whose logits it keeps: a
    training micro-batch's, and a no-grad forward's of the old and reference log-probs (at most
    the learner's share of the step). By rows: that many full-length sequences (packed or padded,
    the longest case), logits for each row's response. By a token budget (use_dynamic_bsz): the
    budget, or one full-length sequence where that is longer (a longer row runs alone), and
    logits for at most every one of those tokens."""
    optim, prompt, response = cfg.optim, cfg.data.max_prompt_length, cfg.rollout.max_response_length
    sequence, share = prompt + response, math.ceil(derived.sequences_per_step / derived.num_learner_ranks)

    def by_rows(rows: int) -> tuple[int, int]:
        return rows * sequence, rows * response

    def by_tokens(budget: int) -> tuple[int, int]:
        tokens = min(max(budget, sequence), share * sequence)
        return tokens, tokens

    training = by_tokens(optim.update_token_budget) if optim.use_dynamic_bsz else by_rows(optim.per_device_batch_size)
    log_prob = by_tokens(optim.log_prob_token_budget) if optim.use_dynamic_bsz else \
        by_rows(min(optim.log_prob_rows, share))
    return {"tokens": training[0], "logit_tokens": training[1],
            "log_prob_tokens": log_prob[0], "log_prob_logit_tokens": log_prob[1]}


def learner_activations(cfg: Config, derived: Derived, arch: Architecture, compute: int) -> dict[str, int]:
    """A learner rank's activation bytes at its peak (a training micro-batch's forward and
    backward, or a no-grad log-prob forward's), what each training token adds
    (``per_token``: its saved activations, its logits and their gradient) and what does not grow
    with tokens (``fixed``: FSDP2's gathered layers)."""
    sizes = micro_batch_tokens(cfg, derived)
    saved_layers = 1 if cfg.model.gradient_checkpointing else arch.layers
    # Where the router's weights are float32 (transformers 5.5.4), one layer's backward holds
    # three float32 routed outputs, and each saved layer keeps float32 weights.
    routed_fp32 = arch.routed_in_fp32(compute, outputs=3) + (saved_layers - 1) * arch.routed_in_fp32(compute, outputs=0)
    per_token = (arch.saved_per_token_layer(compute) * saved_layers + routed_fp32
                 + (arch.hidden * compute * arch.layers if cfg.model.gradient_checkpointing else 0))
    per_logit = 2 * arch.vocab * compute  # the logits and their gradient (no-grad: their trimmed copy)
    fixed = 2 * 4 * arch.largest_layer_params  # FSDP2's gathered layer and the next, prefetched
    training = sizes["tokens"] * per_token + sizes["logit_tokens"] * per_logit + fixed
    # The no-grad forwards keep no graph: one layer's working set and the logits.
    log_prob_forward = (sizes["log_prob_tokens"] * (arch.saved_per_token_layer(compute)
                                                    + arch.routed_in_fp32(compute, outputs=2))
                        + sizes["log_prob_logit_tokens"] * per_logit + fixed)
    return {"activations": max(training, log_prob_forward), "per_token": per_token + per_logit, "fixed": fixed,
            **sizes}


def learner_tokens(cfg: Config, derived: Derived, arch: Architecture, device: dict[str, int],
                   device_memory: Optional[int]) -> dict[str, Any]:
    """The tokens a learner's forwards compute (micro_batch_tokens), and the largest training token
    budget (ppo_max_token_len_per_gpu, in steps of 1024) whose activations fit beside what the
    learner's device holds anyway (None: the device's memory is unknown, or not even one full-length
    sequence fits)."""
    compute = 2 if cfg.model.learner_dtype == "bf16" else 4
    sizes = learner_activations(cfg, derived, arch, compute)
    budget = None
    if device_memory is not None:
        held = device["total"] - device["activations"]
        most = (device_memory - held - sizes["fixed"]) // sizes["per_token"] // 1024 * 1024
        budget = most if most >= cfg.data.max_prompt_length + cfg.rollout.max_response_length else None
    return {"by": "budget" if cfg.optim.use_dynamic_bsz else "rows", "tokens": sizes["tokens"],
            "log_prob_tokens": sizes["log_prob_tokens"], "largest_fitting_budget": budget,
            "device_memory_known": device_memory is not None}


def checkpoint_bytes(params: int) -> int:
    """A checkpoint's size: the fp32 weights and AdamW's two fp32 moments (the rest is small)."""
    return 4 * params + 8 * params


@dataclass(frozen=True)
class Capacity:
    """What the plan is held against besides the device, in bytes (None: unknown, not checked),
    each with where it came from: host memory per node, and the room for checkpoints."""

    host_memory: Optional[int] = None
    host_from: str = "unknown"
    disk_free: Optional[int] = None
    disk_from: str = "unknown"
    disk_measured: bool = False  # read from the filesystem (not disk_gb): it changes while a run goes on


def this_machines_memory() -> Optional[int]:
    """MemTotal of /proc/meminfo, else the physical pages os.sysconf counts; None when neither says."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def checkpoint_room(output_dir: Path) -> tuple[int, str]:
    """Bytes free for checkpoints under ``output_dir`` (its nearest existing parent before a run
    creates it), and what they are. This run's checkpoints already there count as room: they are
    among the keep_last + 1 the plan counts, and rotation deletes them."""
    where = output_dir.absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    kept = output_dir / "checkpoints"
    held = sum(f.stat().st_size for f in kept.rglob("*") if f.is_file()) if kept.is_dir() else 0
    return free + held, f"free under {where}" + (f" + {size_text(held)} of this run's checkpoints" if held else "")


def machine_capacity(cfg: Config) -> Capacity:
    """host_memory_gb and disk_gb, or what this machine and output_dir's filesystem report."""
    run = cfg.run
    host, host_from = ((int(run.host_memory_gb * GIB), "host_memory_gb") if run.host_memory_gb
                       else (this_machines_memory(), "this machine's MemTotal"))
    if run.disk_gb:
        return Capacity(host, host_from, int(run.disk_gb * GIB), "free (disk_gb)")
    free, disk_from = checkpoint_room(Path(run.output_dir))
    return Capacity(host, host_from, free, disk_from, disk_measured=True)


def node_hosts(derived: Derived, learner_host: int, rollout_host: int) -> list[dict[str, Any]]:
    """Each node's ranks and host memory, the ranks placed as ranks.Layout places them (0..R-1
    roll out, R..W-1 learn, R leads; node k holds ranks k*P..(k+1)*P-1): so the learners share
    the last node(s)."""
    per_node = derived.world_size // derived.nodes
    nodes = []
    for k in range(derived.nodes):
        ranks = Layout.of(derived, rank=k * per_node).node_ranks(derived.nodes)
        learners = sum(Layout.of(derived, rank).is_learner for rank in ranks)
        rollout = 1 if derived.world_size == 1 else per_node - learners  # one process holds both roles
        nodes.append({"node": k, "ranks": [ranks[0], ranks[-1]], "rollout_ranks": rollout, "learner_ranks": learners,
                      "lead": Layout.of(derived).lead_learner in ranks,
                      "host": learners * learner_host + rollout * rollout_host})
    return nodes


def checkpoint_disk(run: RunConfig, per_step: int, export_bytes: int) -> dict[str, int]:
    """The most checkpoints take on disk at once: keep_last complete ones and the one being
    written (old ones are deleted only once a new one is complete), fewer when the whole run
    writes fewer; and the Hugging Face weights of those among them that hold an export."""
    every, last = run.save_every, run.max_steps
    saved = [*range(every, last + 1, every), *([last] if every and last % every else [])] if every else []
    copies = min(run.keep_last + 1, len(saved))
    # The last step exports, and so does a saved step divisible by hf_export_every.
    exported = [int(step == last or bool(run.hf_export_every) and step % run.hf_export_every == 0) for step in saved]
    exports = max((sum(exported[i:i + copies]) for i in range(len(saved) - copies + 1)), default=0)
    return {"per_step": per_step, "keep_last": run.keep_last, "copies": copies, "export_bytes": export_bytes,
            "exports": exports, "disk_need": per_step * copies + export_bytes * exports}


def checkpoint_modes(cfg: Config, derived: Derived, arch: Architecture, rollout_host: int,
                     checkpoint: dict[str, int], *, with_reference: bool) -> dict[str, dict[str, Any]]:
    """Both ways a checkpoint reaches the disk, by async_save: "true", each learner copies its
    shards to host memory and a writer thread writes them while training goes on; "false", no
    copy, the step waits while they are written. For each: the busiest node's host memory, the
    disk needed, the bytes a save writes (per learner rank, and on the node with the most
    learners, whose disk they share) and how long that takes at disk_write_gb_per_s."""
    saves = bool(cfg.run.save_every)
    modes = {}
    for copied in (True, False):
        host = learner_rank(replace(cfg, run=replace(cfg.run, async_save=copied)), derived, arch,
                            with_reference=with_reference)["host"]["total"]
        nodes = node_hosts(derived, host, rollout_host)
        busiest = max(nodes, key=lambda node: node["host"])
        per_learner = checkpoint["per_learner_rank"] if saves else 0
        per_node = max(node["learner_ranks"] for node in nodes) * per_learner
        seconds = per_node / (cfg.run.disk_write_gb_per_s * GIB)
        modes[value_text(copied)] = {"busiest_node": busiest["node"], "busiest_node_host": busiest["host"],
                                      "disk_need": checkpoint["disk_need"], "written_per_learner_rank": per_learner,
                                      "written_per_node": per_node, "seconds_per_save": seconds,
                                      "step_waits_for_the_write_s": 0.0 if copied else seconds}
    return modes


def rollout_shape(cfg: Config, derived: Derived, rollout: dict[str, int]) -> dict[str, int]:
    """How a rollout rank's memory scales, for advice: its sequences and their tokens, the bytes
    each sequence costs (KV cache, prefill, logits) and the KV cache's bytes per token position."""
    sequences = math.ceil(cfg.rollout.prompts_per_step / Layout.of(derived).num_engines) * cfg.rollout.sample_num
    tokens = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    scaling = rollout["kv_cache"] + rollout["activations"] - cfg.run.weight_sync_bucket_mb * 2**20
    return {"sequences": sequences, "tokens": tokens, "per_sequence": scaling // sequences,
            "kv_per_token": rollout["kv_cache"] // tokens}


def fit_checks(plan: dict[str, Any], device_total: int, capacity: Capacity) -> dict[str, Optional[bool]]:
    """Device, host per node and disk: each True or False, or None when its capacity is unknown."""
    def fits(need: int, have: Optional[int]) -> Optional[bool]:
        return None if have is None else need <= have
    return {"device": fits(device_total, plan["device_memory"]),
            "host": fits(plan["node_host_total"], capacity.host_memory),
            "disk": fits(plan["checkpoint"]["disk_need"], capacity.disk_free)}


def make_plan(cfg: Config, derived: Derived, model_config: Any, device_memory: Optional[int],
              *, with_reference: bool, capacity: Capacity = Capacity(),
              arch: Optional[Architecture] = None) -> dict[str, Any]:
    """The plan as memory_plan.json holds it, every size in bytes; ``fits`` is False when the
    device, the host of a node or the disk is known not to fit, None when none is known.
    ``arch``: the model_config's, when counted already."""
    arch = arch or Architecture.of(model_config)
    reward = reward_model(cfg)
    rollout = rollout_rank(cfg, derived, arch, reward)
    learner = learner_rank(cfg, derived, arch, with_reference=with_reference)
    single = one_process(cfg, arch, rollout, learner["device"]) if derived.world_size == 1 else None
    # Each rank's own device, or with one process the one device both roles share.
    device_total = single["total"] if single else max(rollout["total"], learner["device"]["total"])
    # A rollout rank reads its weights one parameter at a time: as stored, in fp32 while quantized,
    # and its encoded bytes.
    stored = hf_weights.stored_dtype(model_config).itemsize
    rollout_host = arch.largest_param * (stored + 4 + 1)
    nodes = node_hosts(derived, learner["host"]["total"], rollout_host)
    busiest = max(nodes, key=lambda node: node["host"])
    checkpoint = {"per_learner_rank": 12 * math.ceil(arch.params / derived.num_learner_ranks),
                  **checkpoint_disk(cfg.run, checkpoint_bytes(arch.params), arch.params * stored)}
    checkpoint.update(save_every=cfg.run.save_every, async_save=cfg.run.async_save,
                      disk_write_gb_per_s=cfg.run.disk_write_gb_per_s,
                      modes=checkpoint_modes(cfg, derived, arch, rollout_host, checkpoint,
                                             with_reference=with_reference))
    split, num_engines = derived.rollout_tensor_parallel, Layout.of(derived).num_engines
    engines = f" ({num_engines} vLLM engines over {split} devices each)" if split > 1 else ""
    layout = (f"{derived.world_size} ranks: {derived.num_rollout_ranks} rollout{engines} + {derived.num_learner_ranks} "
              f"learner" if derived.world_size > 1 else "1 process (both roles)")
    plan_engine: dict[str, Any] = {"rollout_engine": cfg.model.rollout_engine, "rollout_tensor_parallel": split}
    if cfg.model.rollout_engine == "vllm":  # the engine's own settings come from the plan's rollout rank
        import engine_vllm

        plan_engine["vllm"] = {**engine_vllm.engine_memory(rollout, device_memory,
                                                           bucket_bytes=cfg.run.weight_sync_bucket_mb * 2**20),
                               "enforce_eager": cfg.rollout.rollout_enforce_eager}
        plan_engine["rollout_device_by_tensor_parallel"] = {
            str(n): rollout_rank(cfg, replace(derived, rollout_tensor_parallel=n), arch, reward)["total"]
            for n in tensor_parallel_choices(derived, arch)}
    plan = {**plan_engine, "model": {"params": arch.params, "fp8_rollout_bytes": arch.fp8_rollout_bytes},
            "routing_ids": routing_ids(cfg, derived, arch),
            "layout": layout, "num_rollout_ranks": derived.num_rollout_ranks,
            "num_rollout_engines": num_engines,
            "num_learner_ranks": derived.num_learner_ranks, "reward_model": reward, "reward_fn": cfg.model.reward_fn,
            "rollout_rank": rollout, "rollout_shape": rollout_shape(cfg, derived, rollout),
            "rollout_rank_host_at_start": rollout_host, "learner_rank": learner, "one_process": single,
            "nodes": nodes, "ranks_per_node": derived.world_size // derived.nodes,
            "node_host_total": busiest["host"], "most_loaded_node": busiest["node"],
            "host_memory": capacity.host_memory, "host_memory_from": capacity.host_from,
            "checkpoint": checkpoint, "disk_free": capacity.disk_free, "disk_free_from": capacity.disk_from,
            "device_memory": device_memory, "device_need": device_total,
            "learner_tokens": learner_tokens(cfg, derived, arch, learner["device"], device_memory)}
    checks = fit_checks(plan, device_total, capacity)
    known = [ok for ok in checks.values() if ok is not None]
    return {**plan, "checks": checks, "fits": all(known) if known else None}


def tensor_parallel_choices(derived: Derived, arch: Architecture) -> list[int]:
    """The rollout_tensor_parallel values this layout (config.check_engine_groups) and the
    model's attention heads (engine_vllm.tensor_parallel_problem) allow."""
    from config import ConfigError, check_engine_groups
    from engine_vllm import tensor_parallel_problem

    choices = []
    for n in range(1, derived.num_rollout_ranks + 1):
        try:
            check_engine_groups(n, derived.world_size, derived.num_rollout_ranks, derived.nodes)
        except ConfigError:
            continue
        if tensor_parallel_problem(n, arch.q_dim // arch.head_dim, arch.kv_heads) is None:
            choices.append(n)
    return choices


def size_text(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def value_text(value: Any) -> str:
    """A setting's value as a config file writes it (true/false for a bool)."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def record_usage(layout: Layout, plat: Platform, out_dir: Path) -> None:
    """At the end of a run: every rank's peak host and device memory, written by the lead to
    OUTPUT_DIR/memory_used.json (what the run held, beside what memory_plan.json expected)."""
    mine = {"rank": layout.rank, "role": layout.role + " (lead)" * layout.is_lead, **plat.peak_memory()}
    everyone = gather_json(mine, layout.lead_learner, None, plat.device) if layout.world_size > 1 else [mine]
    if not layout.is_lead:
        return
    (out_dir / "memory_used.json").write_text(json.dumps({"ranks": everyone}, indent=1) + "\n")
    roles: dict[str, list[dict[str, Any]]] = {}
    for entry in everyone:
        roles.setdefault(entry["role"], []).append(entry)

    def most(entries: list[dict[str, Any]], key: str) -> str:
        values = [e[key] for e in entries if e[key] is not None]
        return f"{max(values) / GIB:.2f}" if values else "-"
    peaks = [f"{role} {most(entries, 'host_peak')}/{most(entries, 'device_peak')}" for role, entries in roles.items()]
    log("peak memory per rank, host/device GiB: " + ", ".join(peaks) + " (memory_used.json)")
