"""The memory plan: what each rank and each node of a run will hold, in bytes, from the model's
config.json (no weights), the run's settings and the world layout, and whether it fits: the
device (``device_memory_gb``), the host memory of each node (``host_memory_gb``) and the disk
under output_dir for the checkpoints kept (``disk_gb``); each defaults to what this machine reports.

    python train_dapo.py --config X --plan [WORLD_SIZE] [--nnodes N]   # the table, OUTPUT_DIR/memory_plan.json;
                                                                       # exit status 1 when it does not fit

Parameters and FP8 rollout weights are counted exactly, on an instance of the architecture on
the meta device; the KV cache exactly from the layer shapes; activations are estimates, stated
as such (what one layer saves per token, the logits of a micro-batch). What the learners hold
follows the code as built: FSDP2 shards fp32 parameters, gradients and AdamW's two moments over
the learner ranks, on the device or, with learner_offload, in host memory; the KL reference
model, when loaded, is sharded the same way in fp32; when a checkpoint is taken every learner
copies its shards to host memory, which a writer thread saves while training goes on. No rank
holds the whole model in fp32: weight sync and the Hugging Face export go a piece at a time.

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
from config import Config, Derived, RunConfig, UserError, uses_fsdp
from device import Platform
from metrics import log, warn
from routing import RoutingShape
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
            routing_bytes_per_token=routing.bytes_per_token if (routing := RoutingShape.of(model_config)) else 0)

    def saved_per_token_layer(self, dtype_bytes: int) -> int:
        """Activations one decoder layer keeps for backward, per token: norms' inputs, q/k/v and
        attention output, and the experts' intermediates (an estimate, as autograd decides)."""
        attention = 2 * self.hidden + self.q_dim + 2 * self.kv_heads * self.head_dim + self.q_dim
        experts = self.experts_per_token * 3 * self.expert_intermediate
        return (attention + experts) * dtype_bytes


def _dtype_bytes(name: str) -> int:
    return {"fp32": 4, "bf16": 2, "fp8": 2}[name]  # FP8 rollout computes (and caches) in bf16


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
    and experts, while the hidden states and the logits stay whole on every device; the
    weight-sync bucket and the reward model are the engine rank's. vLLM runs eagerly here
    (enforce_eager): no CUDA graphs to count."""
    model, rollout = cfg.model, cfg.rollout
    compute, split = _dtype_bytes(model.rollout_dtype), derived.rollout_tensor_parallel
    weights = math.ceil((arch.fp8_rollout_bytes if model.rollout_dtype == "fp8" else arch.params * compute) / split)
    sequences = math.ceil(rollout.prompts_per_step / derived.num_rollout_engines) * rollout.sample_num
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
    casting = 0 if cfg.model.rollout_dtype == "fp32" else arch.largest_param * _dtype_bytes(cfg.model.rollout_dtype)
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
    tokens = cfg.optim.per_device_batch_size * (cfg.data.max_prompt_length + cfg.rollout.max_response_length)
    saved_layers = 1 if cfg.model.gradient_checkpointing else arch.layers
    layer_inputs = tokens * arch.hidden * compute * arch.layers if cfg.model.gradient_checkpointing else 0
    response_tokens = cfg.optim.per_device_batch_size * cfg.rollout.max_response_length
    activations = (tokens * arch.saved_per_token_layer(compute) * saved_layers + layer_inputs
                   + 2 * response_tokens * arch.vocab * compute  # the logits and their gradient
                   + 2 * 4 * arch.largest_layer_params)  # FSDP2's gathered layer and the next, prefetched
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


def node_hosts(world: int, node_count: int, num_learners: int, learner_host: int,
               rollout_host: int) -> list[dict[str, Any]]:
    """Each node's ranks and host memory. Ranks are laid out by index, as ranks.Layout numbers
    them (0..R-1 roll out, R..W-1 learn, R leads) and torchrun places them (node k holds ranks
    k*P..(k+1)*P-1, P ranks a node): so the learners share the last node(s)."""
    per_node = world // node_count
    first_learner = world - num_learners if world > 1 else 0
    nodes = []
    for k in range(node_count):
        ranks = range(k * per_node, (k + 1) * per_node)
        learners = sum(rank >= first_learner for rank in ranks)
        rollout = 1 if world == 1 else per_node - learners  # one process holds both roles
        nodes.append({"node": k, "ranks": [ranks[0], ranks[-1]], "rollout_ranks": rollout, "learner_ranks": learners,
                      "lead": first_learner in ranks, "host": learners * learner_host + rollout * rollout_host})
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


def rollout_shape(cfg: Config, derived: Derived, rollout: dict[str, int]) -> dict[str, int]:
    """How a rollout rank's memory scales, for advice: its sequences and their tokens, the bytes
    each sequence costs (KV cache, prefill, logits) and the KV cache's bytes per token position."""
    sequences = math.ceil(cfg.rollout.prompts_per_step / derived.num_rollout_engines) * cfg.rollout.sample_num
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
              *, with_reference: bool, capacity: Capacity = Capacity()) -> dict[str, Any]:
    """The plan as memory_plan.json holds it, every size in bytes; ``fits`` is False when the
    device, the host of a node or the disk is known not to fit, None when none is known."""
    arch = Architecture.of(model_config)
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
    nodes = node_hosts(derived.world_size, derived.nodes, derived.num_learner_ranks, learner["host"]["total"],
                       rollout_host)
    busiest = max(nodes, key=lambda node: node["host"])
    checkpoint = {"per_learner_rank": 12 * math.ceil(arch.params / derived.num_learner_ranks),
                  **checkpoint_disk(cfg.run, checkpoint_bytes(arch.params), arch.params * stored)}
    split = derived.rollout_tensor_parallel
    engines = f" ({derived.num_rollout_engines} vLLM engines over {split} devices each)" if split > 1 else ""
    layout = (f"{derived.world_size} ranks: {derived.num_rollout_ranks} rollout{engines} + {derived.num_learner_ranks} "
              f"learner" if derived.world_size > 1 else "1 process (both roles)")
    plan_engine: dict[str, Any] = {"rollout_engine": cfg.model.rollout_engine, "rollout_tensor_parallel": split}
    if cfg.model.rollout_engine == "vllm":  # the engine's own settings come from the plan's rollout rank
        import engine_vllm

        plan_engine["vllm"] = engine_vllm.engine_memory(rollout, device_memory,
                                                        bucket_bytes=cfg.run.weight_sync_bucket_mb * 2**20)
        plan_engine["rollout_device_by_tensor_parallel"] = {
            str(n): rollout_rank(cfg, replace(derived, rollout_tensor_parallel=n), arch, reward)["total"]
            for n in tensor_parallel_choices(derived, arch)}
    plan = {**plan_engine, "model": {"params": arch.params, "fp8_rollout_bytes": arch.fp8_rollout_bytes},
            "routing_ids": routing_ids(cfg, derived, arch),
            "layout": layout, "num_rollout_ranks": derived.num_rollout_ranks,
            "num_rollout_engines": derived.num_rollout_engines,
            "num_learner_ranks": derived.num_learner_ranks, "reward_model": reward,
            "rollout_rank": rollout, "rollout_shape": rollout_shape(cfg, derived, rollout),
            "rollout_rank_host_at_start": rollout_host, "learner_rank": learner, "one_process": single,
            "nodes": nodes, "ranks_per_node": derived.world_size // derived.nodes,
            "node_host_total": busiest["host"], "most_loaded_node": busiest["node"],
            "host_memory": capacity.host_memory, "host_memory_from": capacity.host_from,
            "checkpoint": checkpoint, "disk_free": capacity.disk_free, "disk_free_from": capacity.disk_from,
            "device_memory": device_memory, "device_need": device_total}
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


def biggest_overflow(plan: dict[str, Any]) -> Optional[str]:
    """'ROLE ITEM (SIZE) of TOTAL against DEVICE' for the rank that does not fit, or None."""
    memory = plan["device_memory"]
    single = plan["one_process"]
    if single is not None:
        if memory is None or single["total"] <= memory:
            return None
        # The biggest item of the peak moment, named by role, as both roles share the device.
        learner, rollout = plan["learner_rank"]["device"], plan["rollout_rank"]
        if single["peak_at"] == "steady state":
            items = {**{f"learner {k}": v for k, v in learner.items() if k != "total"},
                     **{f"rollout {k}": v for k, v in rollout.items() if k != "total"}}
        else:
            items = {"learner params": learner["params"], "fp32 rollout copy": single["fp32_rollout_copy"]}
        item = max(items, key=items.get)
        return (f"one process (both roles) needs {single['total'] / GIB:.1f} GiB of device memory at its peak "
                f"({single['peak_at']}), {memory / GIB:.1f} GiB available; the biggest item is {item} "
                f"({items[item] / GIB:.1f} GiB)")
    for role, items in (("learner rank", plan["learner_rank"]["device"]), ("rollout rank", plan["rollout_rank"])):
        if memory is not None and items["total"] > memory:
            item = max((k for k in items if k != "total"), key=items.get)
            return (f"a {role} needs {items['total'] / GIB:.1f} GiB of device memory, {memory / GIB:.1f} GiB "
                    f"available; the biggest item is {item} ({items[item] / GIB:.1f} GiB)")
    return None


def node_roles(node: dict[str, Any]) -> str:
    """'6 rollout + 2 learner', or 'both roles' for one process."""
    first, last = node["ranks"]
    if node["rollout_ranks"] + node["learner_ranks"] > last - first + 1:
        return "both roles"
    return " + ".join(f"{node[key]} {role}" for key, role in (("rollout_ranks", "rollout"),
                                                              ("learner_ranks", "learner")) if node[key])


def node_name(node: dict[str, Any]) -> str:
    """'node 1 (ranks 8-15: 6 rollout + 2 learner, the lead)'."""
    first, last = node["ranks"]
    ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
    return f"node {node['node']} ({ranks}: {node_roles(node)}{', the lead' if node['lead'] else ''})"


def host_overflow(plan: dict[str, Any]) -> Optional[str]:
    if plan["checks"]["host"] is not False:
        return None
    node = plan["nodes"][plan["most_loaded_node"]]
    return (f"{node_name(node)} needs {size_text(node['host'])} of host memory, {size_text(plan['host_memory'])} "
            f"a node ({plan['host_memory_from']})")


def disk_overflow(plan: dict[str, Any]) -> Optional[str]:
    if plan["checks"]["disk"] is not False:
        return None
    return (f"checkpoints need {size_text(plan['checkpoint']['disk_need'])} of disk ({disk_sum(plan)}), "
            f"{size_text(plan['disk_free'])} {plan['disk_free_from']}")


def disk_sum(plan: dict[str, Any]) -> str:
    """'341.2 GiB per step x (keep_last 3 + 1) + 56.9 GiB Hugging Face weights x 1'."""
    ck = plan["checkpoint"]
    if not ck["copies"]:
        return "save_every 0: no checkpoints"
    keep = ck["keep_last"]
    copies = f"(keep_last {keep} + 1)" if ck["copies"] == keep + 1 else f"{ck['copies']} (all the run writes)"
    text = f"{size_text(ck['per_step'])} per step x {copies}"
    return text + (f" + {size_text(ck['export_bytes'])} Hugging Face weights x {ck['exports']}" if ck["exports"] else "")


def size_text(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def learner_device_without_offload(plan: dict[str, Any]) -> int:
    """What a learner rank's device holds when its state is there too (learner_offload off)."""
    host, device = plan["learner_rank"]["host"], plan["learner_rank"]["device"]
    state = sum(host[k] + device[k] for k in ("params", "grads", "optimizer"))
    return state + max(device["activations"], host["optimizer_step"] + device["optimizer_step"])


def advice(cfg: Config, plan: dict[str, Any]) -> list[str]:
    """What to change, for every check that does not fit (the device's rollout and learner ranks,
    the host of the most loaded node, the disk); a setting already on is never suggested. First,
    the settings on that the plan shows are needed."""
    return [*needed_settings(cfg, plan), *device_advice(cfg, plan), *host_advice(cfg, plan), *disk_advice(cfg, plan)]


def needed_settings(cfg: Config, plan: dict[str, Any]) -> list[str]:
    memory, notes = plan["device_memory"], []
    if memory is None:
        return notes
    rollout = plan["rollout_rank"]
    bf16_weights = 2 * plan["model"]["params"] // plan["rollout_tensor_parallel"]  # a device's share
    bf16_rollout = rollout["total"] - rollout["weights"] + bf16_weights
    if cfg.model.rollout_dtype == "fp8" and bf16_rollout > memory:
        notes.append(f"rollout_dtype fp8 is needed: with bf16 weights a rollout rank would need "
                     f"{bf16_rollout / GIB:.1f} GiB")
    without_offload = learner_device_without_offload(plan)
    if cfg.model.learner_offload and without_offload > memory:
        notes.append(f"learner_offload is needed: without it a learner rank would need {without_offload / GIB:.1f} GiB")
    return notes


def device_advice(cfg: Config, plan: dict[str, Any]) -> list[str]:
    memory, single = plan["device_memory"], plan["one_process"]
    if memory is None or plan["checks"]["device"] is not False:
        return []
    if single is None:
        return rollout_advice(cfg, plan, memory) + learner_advice(cfg, plan, memory)
    # Both roles on one device: each has what the other leaves.
    rollout, learner = plan["rollout_rank"]["total"], plan["learner_rank"]["device"]["total"]
    return ([f"a torchrun job gives the learner and the rollout a device each (one process needs "
             f"{single['total'] / GIB:.1f} GiB for both)"]
            + rollout_advice(cfg, plan, memory - learner) + learner_advice(cfg, plan, memory - rollout))


def rollout_advice(cfg: Config, plan: dict[str, Any], room: int) -> list[str]:
    rollout, notes = plan["rollout_rank"], []
    if rollout["total"] <= room:
        return notes
    notes += tensor_parallel_advice(plan, room)
    if cfg.model.rollout_dtype != "fp8":
        fp8 = plan["model"]["fp8_rollout_bytes"] / plan["rollout_tensor_parallel"]
        notes.append(f"rollout_dtype: fp8 would bring the rollout weights from {rollout['weights'] / GIB:.1f} GiB "
                     f"to {fp8 / GIB:.1f} GiB")
    return notes + kv_cache_advice(cfg, plan, room)


def tensor_parallel_advice(plan: dict[str, Any], room: int) -> list[str]:
    """vLLM: the smallest rollout_tensor_parallel above this one whose rollout device fits."""
    totals = {int(n): total for n, total in plan.get("rollout_device_by_tensor_parallel", {}).items()}
    larger = {n: total for n, total in totals.items() if n > plan["rollout_tensor_parallel"]}
    fitting = [n for n, total in sorted(larger.items()) if total <= room]
    if fitting:
        n = fitting[0]
        return [f"rollout_tensor_parallel {n} (one vLLM engine over {n} devices, {plan['num_rollout_ranks'] // n} "
                f"engines) would bring a rollout device to {totals[n] / GIB:.1f} GiB"]
    if larger:
        n = max(larger)
        return [f"no rollout_tensor_parallel that divides the {plan['num_rollout_ranks']} rollout ranks fits alone "
                f"(at {n}: {larger[n] / GIB:.1f} GiB a rollout device)"]
    return []


def kv_cache_advice(cfg: Config, plan: dict[str, Any], room: int) -> list[str]:
    """The largest prompts_per_step, sample_num and max_response_length (each alone) that fit."""
    shape, rollout, group = plan["rollout_shape"], plan["rollout_rank"], cfg.rollout.sample_num
    fixed = rollout["total"] - shape["per_sequence"] * shape["sequences"]  # weights, the sync bucket
    fit = max(0, (room - fixed) // shape["per_sequence"])  # sequences a rollout rank has room for
    prompts_here = shape["sequences"] // group
    options = []
    if fit // group:
        options.append(f"prompts_per_step {fit // group * plan['num_rollout_engines']}")
    if 1 <= fit // prompts_here < group:
        options.append(f"sample_num {fit // prompts_here}")
    response = (room - (rollout["total"] - rollout["kv_cache"])) // shape["kv_per_token"] - cfg.data.max_prompt_length
    if response >= 1:
        options.append(f"max_response_length {response}")
    what = (f"the KV cache ({rollout['kv_cache'] / GIB:.1f} GiB: {shape['sequences']} sequences of {shape['tokens']} "
            f"tokens a rollout rank)")
    if not options:
        return [f"{what} leaves no room for one group: more rollout ranks, or a shorter max_prompt_length"]
    return [f"{what} would fit with, at most: " + " or ".join(options) + " (or more rollout ranks)"]


def learner_advice(cfg: Config, plan: dict[str, Any], room: int) -> list[str]:
    device, notes = plan["learner_rank"]["device"], []
    if device["total"] <= room:
        return notes
    state = device["params"] + device["grads"] + device["optimizer"]
    if state and plan["one_process"] is None:  # offload and sharding need a torchrun job
        if not cfg.model.learner_offload:
            notes.append(f"the learners need learner_offload: true (parameters, gradients and AdamW state, "
                         f"{state / GIB:.1f} GiB a rank, in host memory) or more learner ranks")
        more = learners_that_fit(cfg, plan, room)
        if more:
            notes.append(f"learner_ranks {more} would shard that state to {state * plan['num_learner_ranks'] / more / GIB:.1f} "
                         f"GiB a rank")
    if device["activations"] > min(room / 4, room - state):
        notes += activation_advice(cfg, device["activations"])
    return notes


def learners_that_fit(cfg: Config, plan: dict[str, Any], room: int) -> Optional[int]:
    """The fewest learner ranks (more than now) that split a step's sequences evenly and shard
    the learner state small enough for ``room``; None when none does."""
    device, learners = plan["learner_rank"]["device"], plan["num_learner_ranks"]
    state = device["params"] + device["grads"] + device["optimizer"]
    sequences = cfg.rollout.prompts_per_step * cfg.rollout.sample_num
    per_rank = cfg.optim.per_device_batch_size * cfg.optim.gradient_accumulation_steps
    for k in range(learners + 1, sequences // per_rank + 1):
        scale = learners / k  # every item of the state is a shard's multiple
        if sequences % (per_rank * k) == 0 and state * scale + max(device["activations"],
                                                                    device["optimizer_step"] * scale) <= room:
            return k
    return None


def activation_advice(cfg: Config, activations: int) -> list[str]:
    notes = []
    if not cfg.model.gradient_checkpointing:
        notes.append(f"gradient_checkpointing: true recomputes the activations ({activations / GIB:.1f} GiB) in "
                     f"backward, keeping one layer's")
    batch, accumulation = cfg.optim.per_device_batch_size, cfg.optim.gradient_accumulation_steps
    if batch > 1:
        smaller = max(d for d in range(1, batch) if batch % d == 0)
        notes.append(f"per_device_batch_size {smaller} with gradient_accumulation_steps {accumulation * batch // smaller} "
                     f"(the same mini-batch) shrinks the activations about {batch // smaller}x")
    else:
        notes.append(f"a shorter max_response_length: the activations are a micro-batch's of 1 x "
                     f"{cfg.data.max_prompt_length + cfg.rollout.max_response_length} tokens")
    return notes


def host_advice(cfg: Config, plan: dict[str, Any]) -> list[str]:
    if plan["checks"]["host"] is not False:
        return []
    node, notes = plan["nodes"][plan["most_loaded_node"]], []
    host, memory = plan["learner_rank"]["host"], plan["device_memory"]
    if plan["host_memory_from"] != "host_memory_gb":  # a plan made on another machine than the run's
        notes.append("host_memory_gb: the host memory of a node that will run it, if this machine is not one")
    if cfg.model.learner_offload and node["learner_ranks"] and memory is not None:
        on_device = learner_device_without_offload(plan)
        if on_device <= memory:
            moved = node["learner_ranks"] * sum(host[k] for k in ("params", "grads", "optimizer", "optimizer_step"))
            notes.append(f"learner_offload: false moves {moved / GIB:.1f} GiB of node {node['node']}'s host memory "
                         f"to the learners' devices, which have room ({on_device / GIB:.1f} of {memory / GIB:.1f} GiB)")
    notes += more_nodes_advice(plan)
    if host["checkpoint_copy"] and node["learner_ranks"]:
        copy = node["learner_ranks"] * host["checkpoint_copy"]
        notes.append(f"node {node['node']} holds {copy / GIB:.1f} GiB of checkpoint copies while a checkpoint is "
                     f"written ({(node['host'] - copy) / GIB:.1f} GiB without them): save_every changes how often, "
                     f"not how much; only save_every 0 (no checkpoints) drops them")
    return notes


def more_nodes_advice(plan: dict[str, Any]) -> list[str]:
    """The fewest nodes (more than now) over which the same ranks fit; else how many learner
    ranks, spread over nodes of the same size, would split the learners' host memory enough."""
    world, learners, have = plan["ranks_per_node"] * len(plan["nodes"]), plan["num_learner_ranks"], plan["host_memory"]
    if world == 1:
        return []
    learner_host, rollout_host = plan["learner_rank"]["host"]["total"], plan["rollout_rank_host_at_start"]
    for nodes in (n for n in range(len(plan["nodes"]) + 1, world + 1) if world % n == 0):
        need = max(node["host"] for node in node_hosts(world, nodes, learners, learner_host, rollout_host))
        if need <= have:
            per_node = world // nodes
            return [f"--nnodes {nodes} ({per_node} rank{'s' * (per_node > 1)} a node): the most loaded node would "
                    f"need {need / GIB:.1f} GiB"]
    per_node, all_learners = plan["ranks_per_node"], learners * learner_host
    wanted = math.ceil(per_node * all_learners / have)  # a node full of learners holds per_node of them
    if wanted <= learners:
        return []
    ranks = world - learners + wanted
    return [f"the learners' host memory ({all_learners / GIB:.1f} GiB in all) is split over learner_ranks, and a "
            f"node of {per_node} ranks holds {per_node} of them at most: about learner_ranks {wanted} "
            f"({ranks} ranks, {math.ceil(ranks / per_node)} nodes of {per_node}; a step's sequences split over them) "
            f"would fit"]


def disk_advice(cfg: Config, plan: dict[str, Any]) -> list[str]:
    if plan["checks"]["disk"] is not False:
        return []
    ck, free, notes = plan["checkpoint"], plan["disk_free"], []
    need = {keep: checkpoint_disk(replace(cfg.run, keep_last=keep), ck["per_step"], ck["export_bytes"])
            for keep in range(1, ck["keep_last"] + 1)}
    fitting = [keep for keep in need if need[keep]["disk_need"] <= free]
    if fitting:
        keep = max(fitting)
        notes.append(f"keep_last {keep}: {need[keep]['copies']} checkpoints on disk at once, "
                     f"{need[keep]['disk_need'] / GIB:.1f} GiB")
    else:
        notes.append(f"not even keep_last 1 fits ({need[1]['disk_need'] / GIB:.1f} GiB: one checkpoint kept, one "
                     f"being written): put output_dir on a disk with more room (disk_gb: what is free there)")
    if ck["exports"] > 1:
        notes.append(f"hf_export_every 0 (Hugging Face weights in the last checkpoint only) needs "
                     f"{(ck['exports'] - 1) * ck['export_bytes'] / GIB:.1f} GiB less")
    return notes


def rank_lines(plan: dict[str, Any]) -> list[str]:
    """What a rollout rank and a learner rank hold (and one process, both roles on one device)."""
    gib = lambda n: f"{n / GIB:9.2f} GiB"  # noqa: E731
    rollout, learner = plan["rollout_rank"], plan["learner_rank"]
    lines = [f"model: {plan['model']['params'] / 1e9:.2f}B parameters; {plan['layout']}",
             "rollout rank (device):" if plan["rollout_tensor_parallel"] == 1 else
             f"rollout rank (device; the busiest of an engine's {plan['rollout_tensor_parallel']}, its engine rank's):"]
    lines += [f"  {k:<16} {gib(v)}" for k, v in rollout.items()]
    if "vllm" in plan:
        vllm, share = plan["vllm"], plan["vllm"]["gpu_memory_utilization"]
        split = plan["rollout_tensor_parallel"]
        per_device = f"; a device of {split}, tensor parallel" if split > 1 else ""
        lines.append(f"  vLLM engine: weights {gib(rollout['weights']).strip()}, KV cache "
                     f"{gib(vllm['kv_cache_memory_bytes']).strip()}{per_device} (kv_cache_memory_bytes on CPU; "
                     f"gpu_memory_utilization {share if share is not None else 'unknown'} on a device; no CUDA "
                     f"graphs: eager)")
    reward = plan["reward_model"]
    if reward is not None and reward["bytes"] is None:
        lines.append(f"  {'reward_model':<16} not counted: {reward['path']} has no config.json (nor in the fit)")
    lines.append(f"rollout rank (host, at start-up): {gib(plan['rollout_rank_host_at_start']).strip()}")
    for where in ("device", "host"):
        lines.append(f"learner rank ({where}):")
        lines += [f"  {k:<16} {gib(v)}" for k, v in learner[where].items()]
    single = plan["one_process"]
    if single is not None:
        lines.append("one process, both roles on one device:")
        lines += [f"  {k:<16} {gib(single[k])}" for k in ("learner", "rollout", "steady_state")]
        lines.append(f"  {'start_up':<16} {gib(single['start_up'])}  (learner params + "
                     f"{single['fp32_rollout_copy'] / GIB:.2f} GiB fp32 rollout copy)")
        lines.append(f"  {'peak':<16} {gib(single['total'])}  at {single['peak_at']}")
    return lines


def node_lines(plan: dict[str, Any]) -> list[str]:
    """Each node's host memory, nodes alike (same ranks' roles, not the lead) on one line."""
    nodes, per_node = plan["nodes"], plan["ranks_per_node"]
    lines = [f"host memory per node ({len(nodes)} node{'s' * (len(nodes) > 1)} of {per_node} "
             f"rank{'s' * (per_node > 1)}):"]
    groups: list[list[dict[str, Any]]] = []
    for node in nodes:
        alike = groups and not node["lead"] and not groups[-1][-1]["lead"] and groups[-1][-1]["host"] == node["host"]
        groups[-1].append(node) if alike else groups.append([node])
    names = [node_name(group[0]) if len(group) == 1 else
             f"nodes {group[0]['node']}-{group[-1]['node']} ({node_roles(group[0])} each)" for group in groups]
    width = max(len(name) for name in names)
    lines += [f"  {name:<{width}} {plan_gib(group[0]['host'])}" for name, group in zip(names, groups)]
    lines.append(f"checkpoint: {plan_gib(plan['checkpoint']['per_step'])} per step, "
                 f"{plan_gib(plan['checkpoint']['per_learner_rank'])} written by each learner rank")
    return lines


def plan_gib(n: int) -> str:
    return f"{n / GIB:9.2f} GiB"


def check_lines(plan: dict[str, Any]) -> list[str]:
    """Device, host per node, disk: what is needed, what there is, and whether it fits."""
    verdict = {True: "fits", False: "DOES NOT FIT"}
    checks, lines = plan["checks"], []
    if plan["device_memory"] is None:
        lines.append("device memory: unknown (set device_memory_gb): fit not checked")
    else:
        margin = plan["device_memory"] - plan["device_need"]
        lines.append(f"device memory: {plan_gib(plan['device_memory'])}: {verdict[checks['device']]} (the busiest "
                     f"device needs {plan['device_need'] / GIB:.2f} GiB: {abs(margin) / GIB:.2f} GiB "
                     f"{'to spare' if margin >= 0 else 'short'})")
    need = f"need {plan['node_host_total'] / GIB:.2f}"
    if plan["host_memory"] is None:
        lines.append(f"host memory per node: {need} GiB, available unknown (set host_memory_gb): not checked")
    else:
        where = "" if checks["host"] else f" (node {plan['most_loaded_node']})"
        lines.append(f"host memory per node: {need} of {plan['host_memory'] / GIB:.2f} GiB "
                     f"({plan['host_memory_from']}): {verdict[checks['host']]}{where}")
    disk = f"checkpoint disk: need {plan['checkpoint']['disk_need'] / GIB:.2f} GiB ({disk_sum(plan)})"
    if plan["disk_free"] is None:
        lines.append(f"{disk}, free unknown (set disk_gb): not checked")
    else:
        lines.append(f"{disk} of {plan['disk_free'] / GIB:.2f} GiB {plan['disk_free_from']}: {verdict[checks['disk']]}")
    return lines


def table(plan: dict[str, Any], notes: list[str]) -> str:
    return "\n".join(rank_lines(plan) + node_lines(plan) + check_lines(plan) + [f"  - {note}" for note in notes])


def write(plan: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(plan, indent=1) + "\n")


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


def check(cfg: Config, derived: Derived, device_memory: Optional[int], *, with_reference: bool, plan_only: bool,
          lead: bool) -> Optional[int]:
    """``--plan``: print the plan, write OUTPUT_DIR/memory_plan.json and return the exit status:
    0 when it fits, 1 when the device, a node's host memory or the disk does not. A run: None,
    after refusing to start (UserError naming what does not fit) when the device (device_memory_gb
    or what the device reports), the host memory of a node (host_memory_gb or MemTotal) or, with
    disk_gb, the disk is known not to fit. Free space as the filesystem reports it is a warning
    only: it changes while a run goes on, and the checkpointer warns again before each save."""
    from transformers import AutoConfig

    memory = int(cfg.run.device_memory_gb * GIB) if cfg.run.device_memory_gb else device_memory
    capacity = machine_capacity(cfg)
    model_config = AutoConfig.from_pretrained(cfg.model.model_path, local_files_only=True)
    plan = make_plan(cfg, derived, model_config, memory, with_reference=with_reference, capacity=capacity)
    if plan_only:
        if lead or "WORLD_SIZE" not in os.environ:  # one line of output per job, not per rank
            print(table(plan, advice(cfg, plan)), flush=True)
            out = Path(cfg.run.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            write(plan, out / "memory_plan.json")
        return 1 if plan["fits"] is False else 0
    disk = disk_overflow(plan)
    problems = [p for p in (biggest_overflow(plan), host_overflow(plan), None if capacity.disk_measured else disk) if p]
    if problems:
        raise UserError(f"the memory plan does not fit: {'; '.join(problems)} (python train_dapo.py --config ... "
                        f"--plan shows it all)")
    if disk and lead:
        warn(f"{disk}: a save may fail for want of room; fewer keep_last, or another disk (--plan shows it all)")
    return None
