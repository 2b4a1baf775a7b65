"""The memory plan: what each rank of a run will hold, in bytes, from the model's config.json
(no weights), the run's settings and the world layout, and whether it fits ``device_memory_gb``.

    python train_dapo.py --config X --plan      # prints the table, writes OUTPUT_DIR/memory_plan.json

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

import hf_weights
from config import Config, Derived, UserError, uses_fsdp
from device import Platform
from metrics import log
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
            fp8_rollout_bytes=weight_bytes(convert_to_fp8(model, torch.bfloat16)))

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
    """One rollout rank: its copy of the policy, the KV cache of its share of a generation batch
    (validation batches are no larger), the transient buffers of generation and weight sync, and
    the reward model's weights when there is one (and it could be counted)."""
    model, rollout = cfg.model, cfg.rollout
    compute = _dtype_bytes(model.rollout_dtype)
    weights = arch.fp8_rollout_bytes if model.rollout_dtype == "fp8" else arch.params * compute
    sequences = math.ceil(rollout.prompts_per_step / derived.num_rollout_ranks) * rollout.sample_num
    tokens = cfg.data.max_prompt_length + rollout.max_response_length
    kv_cache = sequences * tokens * 2 * arch.layers * arch.kv_heads * arch.head_dim * compute
    # Prefill of one layer at a time, three float32 copies of the last position's logits
    # (logits, log-softmax, the sampling distribution), one weight-sync bucket.
    prefill = sequences * cfg.data.max_prompt_length * arch.saved_per_token_layer(compute)
    activations = prefill + 3 * sequences * arch.vocab * 4 + cfg.run.weight_sync_bucket_mb * 2**20
    items = {"weights": weights, "kv_cache": kv_cache, "activations": activations}
    if reward is not None and reward["bytes"] is not None:
        items["reward_model"] = reward["bytes"]
    return {**items, "total": sum(items.values())}


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
    host["checkpoint_copy"] = 4 * shard + 8 * shard if cfg.run.save_every else 0  # weights + AdamW shards
    host["total"] = sum(host.values())
    return {"device": device, "host": host}


def checkpoint_bytes(params: int) -> int:
    """A checkpoint's size: the fp32 weights and AdamW's two fp32 moments (the rest is small)."""
    return 4 * params + 8 * params


def make_plan(cfg: Config, derived: Derived, model_config: Any, device_memory: Optional[int],
              *, with_reference: bool) -> dict[str, Any]:
    """The plan as memory_plan.json holds it, every size in bytes."""
    arch = Architecture.of(model_config)
    reward = reward_model(cfg)
    rollout = rollout_rank(cfg, derived, arch, reward)
    learner = learner_rank(cfg, derived, arch, with_reference=with_reference)
    single = one_process(cfg, arch, rollout, learner["device"]) if derived.world_size == 1 else None
    # Each rank's own device, or with one process the one device both roles share.
    device_total = single["total"] if single else max(rollout["total"], learner["device"]["total"])
    ranks_per_node = derived.world_size  # one node: every rank shares the host
    # A rollout rank reads its weights one parameter at a time: as stored, in fp32 while quantized,
    # and its encoded bytes.
    rollout_host = arch.largest_param * (hf_weights.stored_dtype(model_config).itemsize + 4 + 1)
    node_host = derived.num_learner_ranks * learner["host"]["total"] + derived.num_rollout_ranks * rollout_host
    checkpoint = {"per_step": checkpoint_bytes(arch.params),
                  "per_learner_rank": 12 * math.ceil(arch.params / derived.num_learner_ranks)}
    fits = None if device_memory is None else device_total <= device_memory
    layout = (f"{derived.world_size} ranks: {derived.num_rollout_ranks} rollout + {derived.num_learner_ranks} "
              f"learner" if derived.world_size > 1 else "1 process (both roles)")
    plan_engine = {"rollout_engine": cfg.model.rollout_engine}
    if cfg.model.rollout_engine == "vllm":  # the engine's own settings come from the plan's rollout rank
        import engine_vllm

        plan_engine["vllm"] = engine_vllm.engine_memory(rollout, device_memory)
    return {**plan_engine, "model": {"params": arch.params}, "layout": layout, "reward_model": reward,
            "rollout_rank": rollout, "rollout_rank_host_at_start": rollout_host, "learner_rank": learner,
            "one_process": single,
            "node_host_total": node_host, "ranks_per_node": ranks_per_node, "checkpoint": checkpoint,
            "device_memory": device_memory, "fits": fits}


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


def advice(cfg: Config, plan: dict[str, Any]) -> list[str]:
    """Settings that would shrink what does not fit."""
    memory, notes = plan["device_memory"], []
    rollout, learner = plan["rollout_rank"], plan["learner_rank"]["device"]
    bf16_rollout = rollout["total"] - rollout["weights"] + 2 * plan["model"]["params"]
    if memory is not None and cfg.model.rollout_dtype == "fp8" and bf16_rollout > memory:
        notes.append(f"rollout_dtype fp8 is needed: with bf16 weights a rollout rank would need "
                     f"{bf16_rollout / GIB:.1f} GiB")
    host = plan["learner_rank"]["host"]
    without_offload = host["params"] + host["grads"] + host["optimizer"] + max(learner["activations"],
                                                                               host["optimizer_step"])
    if memory is not None and cfg.model.learner_offload and without_offload > memory:
        notes.append(f"learner_offload is needed: without it a learner rank would need {without_offload / GIB:.1f} GiB")
    if memory is not None and rollout["total"] > memory:
        if cfg.model.rollout_dtype != "fp8":
            notes.append(f"rollout_dtype: fp8 would bring the rollout weights from {rollout['weights'] / GIB:.1f} GiB "
                         f"to about half")
        if rollout["kv_cache"] > memory / 4:
            notes.append("fewer sequences per rollout rank (prompts_per_step, sample_num) or a shorter "
                         "max_response_length shrink the KV cache")
    if memory is not None and learner["total"] > memory:
        if learner["params"] + learner["grads"] + learner["optimizer"] > memory / 2:
            notes.append("the learners need learner_offload: true (parameters, gradients and AdamW state in "
                         "host memory) or more learner ranks")
        if learner["activations"] > memory / 4:
            notes.append("gradient_checkpointing: true and a smaller per_device_batch_size shrink the activations")
    return notes


def table(plan: dict[str, Any], notes: list[str]) -> str:
    gib = lambda n: f"{n / GIB:9.2f} GiB"  # noqa: E731
    rollout, learner = plan["rollout_rank"], plan["learner_rank"]
    lines = [f"model: {plan['model']['params'] / 1e9:.2f}B parameters; {plan['layout']}",
             "rollout rank (device):"]
    lines += [f"  {k:<16} {gib(v)}" for k, v in rollout.items()]
    if "vllm" in plan:
        vllm, share = plan["vllm"], plan["vllm"]["gpu_memory_utilization"]
        lines.append(f"  vLLM engine: weights {gib(rollout['weights']).strip()}, KV cache "
                     f"{gib(vllm['kv_cache_memory_bytes']).strip()} (kv_cache_memory_bytes on CPU; "
                     f"gpu_memory_utilization {share if share is not None else 'unknown'} on a device)")
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
    lines += [f"host memory per node: {gib(plan['node_host_total'])}",
              f"checkpoint: {gib(plan['checkpoint']['per_step'])} per step, "
              f"{gib(plan['checkpoint']['per_learner_rank'])} written by each learner rank"]
    if plan["device_memory"] is None:
        lines.append("device memory: unknown (set device_memory_gb): fit not checked")
    else:
        lines.append(f"device memory: {gib(plan['device_memory'])}: " + ("fits" if plan["fits"] else "DOES NOT FIT"))
    lines += [f"  - {note}" for note in notes]
    return "\n".join(lines)


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
          lead: bool) -> bool:
    """``--plan``: print the plan and write OUTPUT_DIR/memory_plan.json (returns True: nothing
    else to do). A run: refuse to start (UserError naming the biggest item) when the plan does
    not fit the device memory, which is known from ``device_memory_gb`` or the device itself."""
    from transformers import AutoConfig


    memory = int(cfg.run.device_memory_gb * GIB) if cfg.run.device_memory_gb else device_memory
    if not plan_only and memory is None:
        return False  # a CPU run without device_memory_gb: nothing to check against
    model_config = AutoConfig.from_pretrained(cfg.model.model_path, local_files_only=True)
    plan = make_plan(cfg, derived, model_config, memory, with_reference=with_reference)
    if plan_only:
        if lead or "WORLD_SIZE" not in os.environ:  # one line of output per job, not per rank
            print(table(plan, advice(cfg, plan)), flush=True)
            out = Path(cfg.run.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            write(plan, out / "memory_plan.json")
        return True
    overflow = biggest_overflow(plan)
    if overflow:
        raise UserError(f"the memory plan does not fit: {overflow} (python train_dapo.py --config ... --plan "
                        f"shows it all)")
    return False

