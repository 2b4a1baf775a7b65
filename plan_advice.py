"""What ``--plan`` prints and advises, and a run's refusal to start when the memory plan
(memory_plan.py, the counting) does not fit.

    python train_dapo.py --config X --plan [WORLD_SIZE] [--nnodes N]   # the table, OUTPUT_DIR/memory_plan.json;
                                                                       # exit status 1 when it does not fit

The table: what a rollout rank, a learner rank and each node hold, the checkpoint modes side by
side, what the rollout can run on each kind of device, and the device, host and disk checks.
``--plan``'s advice names settings that would fit, each planned again with them under the rules
a run enforces (config.validate, Derived.of, the engines' dtypes per kind of device) before it
is printed: a suggestion the run would refuse is never shown. A run (check without --plan)
refuses to start, naming what does not fit, when the device, a node's host memory or disk_gb is
known not to fit.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Optional

from config import KEY_SECTION, Config, ConfigError, Derived, UserError, validate
from device import ROLLOUT_DTYPES, RolloutDtype
from memory_plan import (GIB, Architecture, Capacity, checkpoint_disk, machine_capacity, make_plan, size_text,
                         value_text)
from metrics import warn


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


def learner_device_without_offload(plan: dict[str, Any]) -> int:
    """What a learner rank's device holds when its state is there too (learner_offload off)."""
    host, device = plan["learner_rank"]["host"], plan["learner_rank"]["device"]
    state = sum(host[k] + device[k] for k in ("params", "grads", "optimizer"))
    return state + max(device["activations"], host["optimizer_step"] + device["optimizer_step"])


# ----- advice: what to change, each suggestion planned again before it is printed -------------

DEVICE_NAMES = {"npu": "npu (Atlas A2/A3)", "cuda": "cuda"}  # the plan's lines: the devices a 30B run is for


@dataclass(frozen=True)
class Suggestion:
    """Settings to change (config keys, with the layout when it must change too), the check they
    are for ("device", "host", "disk", or one role's device: "rollout", "learner") and what they
    do, as its advice line says."""

    changes: tuple[tuple[str, Any], ...]
    check: str
    effect: str = ""  # " shards that state over them": follows the settings in the line
    world_size: Optional[int] = None  # None: the plan's
    nodes: Optional[int] = None

    def settings(self, derived: Derived) -> str:
        """'learner_ranks 8 with --plan 16 --nnodes 2 (torchrun --nproc_per_node 8 --nnodes 2)'."""
        keys = ", ".join(f"{key} {value_text(value)}" for key, value in self.changes)
        world, nodes = self.world_size or derived.world_size, self.nodes or derived.nodes
        if (world, nodes) == (derived.world_size, derived.nodes):
            return keys
        spread = f" --nnodes {nodes}" if nodes > 1 else ""
        layout = f"--plan {world}{spread} (torchrun --nproc_per_node {world // nodes}{spread})"
        return f"{keys} with {layout}" if keys else layout


Advice = list[Any]  # notes (str) and suggestions, before the suggestions are re-planned


@dataclass(frozen=True)
class Planning:
    """What a plan is made from, kept so that advice can plan the run again with settings or the
    layout changed; the architecture is counted once (seconds for a 30B model)."""

    cfg: Config
    derived: Derived
    model_config: Any
    arch: Architecture
    device_memory: Optional[int]
    with_reference: bool
    capacity: Capacity = Capacity()
    # The kind of device the run is for ("npu", "cuda", "cpu"): what the rollout engines may compute
    # in there (ROLLOUT_DTYPES); None when unknown (--device auto, planned on a CPU), every kind's.
    device_kind: Optional[str] = None

    @staticmethod
    def of(cfg: Config, derived: Derived, model_config: Any, device_memory: Optional[int], *, with_reference: bool,
           capacity: Capacity = Capacity(), device_kind: Optional[str] = None) -> "Planning":
        return Planning(cfg, derived, model_config, Architecture.of(model_config), device_memory, with_reference,
                        capacity, device_kind)

    def plan(self) -> dict[str, Any]:
        return make_plan(self.cfg, self.derived, self.model_config, self.device_memory,
                         with_reference=self.with_reference, capacity=self.capacity, arch=self.arch)

    def changed(self, suggestion: Suggestion) -> Optional["Planning"]:
        """This run with ``suggestion`` applied, checked as the run checks it (config.validate,
        Derived.of, the engine's dtypes on the device named by ``device``, vLLM's split of the
        attention heads); None when the run would refuse it."""
        from engine_vllm import tensor_parallel_problem

        sections: dict[str, dict[str, Any]] = {}
        for key, value in suggestion.changes:
            sections.setdefault(KEY_SECTION[key], {})[key] = value
        cfg = replace(self.cfg, **{name: replace(getattr(self.cfg, name), **values)
                                   for name, values in sections.items()})
        model, kind = cfg.model, self.device_kind
        if kind in ROLLOUT_DTYPES and model.rollout_dtype not in ROLLOUT_DTYPES[kind][model.rollout_engine]:
            return None
        if model.rollout_engine == "vllm" and tensor_parallel_problem(
                model.rollout_tensor_parallel, self.arch.q_dim // self.arch.head_dim, self.arch.kv_heads):
            return None
        try:
            validate(cfg)
            derived = Derived.of(cfg, suggestion.world_size or self.derived.world_size,
                                 suggestion.nodes or self.derived.nodes)
        except ConfigError:
            return None
        return replace(self, cfg=cfg, derived=derived)


# The checks a suggestion is for: plan["checks"]'s, and one role's device (a part of "device").
ROLE_CHECKS = ("rollout", "learner")


def check_need(plan: dict[str, Any], check: str) -> int:
    """What ``check`` holds against its capacity."""
    return {"device": plan["device_need"], "host": plan["node_host_total"], "disk": plan["checkpoint"]["disk_need"],
            "rollout": plan["rollout_rank"]["total"], "learner": plan["learner_rank"]["device"]["total"]}[check]


def check_fits(plan: dict[str, Any], check: str) -> Optional[bool]:
    if check not in ROLE_CHECKS:
        return plan["checks"][check]
    return None if plan["device_memory"] is None else check_need(plan, check) <= plan["device_memory"]


def check_text(plan: dict[str, Any], check: str) -> str:
    """'a learner device needs 78.2 GiB of 141.0 GiB', 'node 1 needs ...', 'the checkpoints need ...'."""
    have = plan["host_memory"] if check == "host" else plan["disk_free"] if check == "disk" else plan["device_memory"]
    who = {"device": "the busiest device", "host": f"node {plan['most_loaded_node']}", "disk": "the checkpoints",
           "rollout": "a rollout device", "learner": "a learner device"}[check]
    needs, need = "need" if check == "disk" else "needs", size_text(check_need(plan, check))
    return f"{who} {needs} {need} (not checked: capacity unknown)" if have is None else \
        f"{who} {needs} {need} of {size_text(have)}"


def replanned(planning: Planning, plan: dict[str, Any], suggestion: Suggestion, *,
              must_help: bool = True) -> Optional[str]:
    """The advice line of ``suggestion``: what its re-plan gives for its check (and any other check
    it breaks). None when the run would refuse it or, with ``must_help``, when it neither fits
    nor needs less than ``plan``."""
    changed = planning.changed(suggestion)
    if changed is None:
        return None
    after, check = changed.plan(), suggestion.check
    fits = check_fits(after, check)
    if must_help and fits is False and check_need(after, check) >= check_need(plan, check):
        return None
    outcome = f"re-planned: {check_text(after, check)}{', fits' if fits else ''}" if fits is not False else \
        f"still does not fit: {check_text(after, check)}"
    broken = [other for other in ("device", "host", "disk") if other != check and not (
              other == "device" and check in ROLE_CHECKS) and plan["checks"][other] is not False
              and after["checks"][other] is False]
    if broken:
        outcome += "; but then " + ", ".join(f"{check_text(after, other)}: DOES NOT FIT" for other in broken)
    return f"{suggestion.settings(planning.derived)}{suggestion.effect}: {outcome}"


def first_fitting(planning: Planning, candidates: Iterable[Suggestion], *, or_the_most: bool = False,
                  tries: int = 32) -> Optional[Suggestion]:
    """The first candidate the run accepts whose re-plan fits its check (the first ``tries`` it
    accepts are planned); with ``or_the_most``, when none fits, the one accepted that needs least."""
    best: Optional[tuple[int, Suggestion]] = None
    for candidate in candidates:
        changed = planning.changed(candidate)
        if changed is None:
            continue
        after = changed.plan()
        if check_fits(after, candidate.check) is not False:
            return candidate
        if best is None or check_need(after, candidate.check) < best[0]:
            best = check_need(after, candidate.check), candidate
        tries -= 1
        if not tries:
            break
    return best[1] if or_the_most and best else None


def advise(planning: Planning, plan: dict[str, Any]) -> list[tuple[str, Optional[Suggestion]]]:
    """What to change, for every check that does not fit (the device's rollout and learner ranks,
    the host of the most loaded node, the disk), each line with the suggestion it makes (None: a
    note); a setting already on is never suggested, and a suggestion is printed only when the run
    would accept it, re-planned. First, the settings on that the plan shows are needed."""
    cfg = planning.cfg
    items = [*needed_settings(cfg, plan), *device_advice(planning, plan), *host_advice(planning, plan),
             *disk_advice(planning, plan)]
    lines: list[tuple[str, Optional[Suggestion]]] = []
    for item in items:
        if isinstance(item, str):
            lines.append((item, None))
        elif (line := replanned(planning, plan, item)) is not None:
            lines.append((line, item))
    return lines


def advice(planning: Planning, plan: dict[str, Any]) -> list[str]:
    """The lines of :func:`advise`."""
    return [text for text, _ in advise(planning, plan)]


def needed_settings(cfg: Config, plan: dict[str, Any]) -> list[str]:
    memory, notes = plan["device_memory"], []
    if memory is None:
        return notes
    rollout = plan["rollout_rank"]
    bf16_weights = 2 * plan["model"]["params"] // plan["rollout_tensor_parallel"]  # a device's share
    bf16_rollout = rollout["total"] - rollout["weights"] + bf16_weights
    if RolloutDtype.of(cfg.model.rollout_dtype).fp8_weights and bf16_rollout > memory:
        notes.append(f"rollout_dtype fp8 is needed: with bf16 weights a rollout rank would need "
                     f"{bf16_rollout / GIB:.1f} GiB")
    without_offload = learner_device_without_offload(plan)
    if cfg.model.learner_offload and without_offload > memory:
        notes.append(f"learner_offload is needed: without it a learner rank would need {without_offload / GIB:.1f} GiB")
    return notes


def device_advice(planning: Planning, plan: dict[str, Any]) -> Advice:
    memory, single = plan["device_memory"], plan["one_process"]
    if memory is None or plan["checks"]["device"] is not False:
        return []
    if single is None:
        return rollout_advice(planning, plan, memory, "rollout") + learner_advice(planning, plan, memory, "learner")
    # Both roles on one device: each has what the other leaves.
    rollout, learner = plan["rollout_rank"]["total"], plan["learner_rank"]["device"]["total"]
    jobs = (Suggestion((), "device", f" gives the learner and the rollout a device each (one process needs "
                                     f"{single['total'] / GIB:.1f} GiB for both)", world_size=world, nodes=1)
            for world in range(2, 65))  # up to 8 nodes of 8
    torchrun = first_fitting(planning, jobs, or_the_most=True)
    return ([torchrun] if torchrun else []) + rollout_advice(planning, plan, memory - learner, "device") + \
        learner_advice(planning, plan, memory - rollout, "device")


def rollout_advice(planning: Planning, plan: dict[str, Any], room: int, check: str) -> Advice:
    """``room``: what the rollout has of its device; ``check``: what its suggestions are re-planned
    for, its own device ("rollout") or, with one process, the device both roles share."""
    cfg, rollout = planning.cfg, plan["rollout_rank"]
    if rollout["total"] <= room:
        return []
    notes = tensor_parallel_advice(plan, room, check)
    if not RolloutDtype.of(cfg.model.rollout_dtype).fp8_weights:
        fp8 = plan["model"]["fp8_rollout_bytes"] / plan["rollout_tensor_parallel"]
        effect = f" brings the rollout weights from {rollout['weights'] / GIB:.1f} GiB to {fp8 / GIB:.1f} GiB"
        if cfg.model.rollout_engine == "vllm":  # vLLM's FP8 on CUDA; on an NPU ours, without tensor parallel
            notes.append(Suggestion((("rollout_dtype", "fp8"),), check, effect + " (vllm: on cuda only)"))
            whole = (("rollout_tensor_parallel", 1),) if cfg.model.rollout_tensor_parallel > 1 else ()
            notes.append(Suggestion((("rollout_engine", "builtin"), ("rollout_dtype", "fp8"), *whole), check,
                                    " (our FP8: on npu too)"))
        else:
            notes.append(Suggestion((("rollout_dtype", "fp8"),), check, effect))
    return notes + kv_cache_advice(planning, plan, room, check)


def tensor_parallel_advice(plan: dict[str, Any], room: int, check: str) -> Advice:
    """vLLM: the smallest rollout_tensor_parallel above this one whose rollout device fits."""
    totals = {int(n): total for n, total in plan.get("rollout_device_by_tensor_parallel", {}).items()}
    larger = {n: total for n, total in totals.items() if n > plan["rollout_tensor_parallel"]}
    fitting = [n for n, total in sorted(larger.items()) if total <= room]
    if fitting:
        n = fitting[0]
        return [Suggestion((("rollout_tensor_parallel", n),), check,
                           f" (one vLLM engine over {n} devices, {plan['num_rollout_ranks'] // n} engines)")]
    if larger:
        n = max(larger)
        return [f"no rollout_tensor_parallel that divides the {plan['num_rollout_ranks']} rollout ranks fits alone "
                f"(at {n}: {larger[n] / GIB:.1f} GiB a rollout device)"]
    return []


def kv_cache_advice(planning: Planning, plan: dict[str, Any], room: int, check: str) -> Advice:
    """The largest prompts_per_step, sample_num and max_response_length (each alone, with what
    must change with it) that the run accepts and that fit."""
    cfg, shape, rollout = planning.cfg, plan["rollout_shape"], plan["rollout_rank"]
    group = cfg.rollout.sample_num
    fixed = rollout["total"] - shape["per_sequence"] * shape["sequences"]  # weights, the sync bucket
    fit = max(0, (room - fixed) // shape["per_sequence"])  # sequences a rollout rank has room for
    prompts_here = shape["sequences"] // group
    what = (f"the KV cache ({rollout['kv_cache'] / GIB:.1f} GiB: {shape['sequences']} sequences of "
            f"{shape['tokens']} tokens a rollout rank)")
    effect = f" shrinks {what}"

    def largest(key: str, most: int, *also: tuple[str, Any]) -> Optional[Suggestion]:
        return first_fitting(planning, (Suggestion(((key, value), *also), check, effect)
                                        for value in range(most, 0, -1)))
    response = (room - (rollout["total"] - rollout["kv_cache"])) // shape["kv_per_token"] - cfg.data.max_prompt_length
    buffer = cfg.algo.overlong_buffer_len
    options = [fit // group and largest("prompts_per_step", fit // group * plan["num_rollout_engines"]),
               1 <= fit // prompts_here < group and largest("sample_num", fit // prompts_here),
               response >= 1 and largest("max_response_length", response,
                                         *([("overlong_buffer_len", response)] if buffer > response else []))]
    found = [option for option in options if option]
    if found:
        return found
    return [f"{what} leaves no room for one group: more rollout ranks, or a shorter max_prompt_length"]


def learner_advice(planning: Planning, plan: dict[str, Any], room: int, check: str) -> Advice:
    """As rollout_advice, for the learner: ``check`` "learner", or "device" with one process."""
    cfg, device, notes = planning.cfg, plan["learner_rank"]["device"], []
    if device["total"] <= room:
        return notes
    state = device["params"] + device["grads"] + device["optimizer"]
    if state and plan["one_process"] is None:  # offload and sharding need a torchrun job
        if not cfg.model.learner_offload:
            notes.append(Suggestion((("learner_offload", True),), check,
                                    f" (parameters, gradients and AdamW state, {state / GIB:.1f} GiB a rank, in "
                                    f"host memory)"))
        more = first_fitting(planning, more_learners(planning, " shards that state over them", check))
        if more:
            notes.append(more)
    if device["activations"] > min(room / 4, room - state):
        fitting = plan["learner_tokens"]["largest_fitting_budget"]
        if cfg.optim.use_dynamic_bsz and fitting:
            notes.append(Suggestion((("ppo_max_token_len_per_gpu", fitting),), check,
                                    " (the largest token budget whose activations fit)"))
        notes += activation_advice(cfg, device["activations"], check)
    return notes


def more_learners(planning: Planning, effect: str, check: str) -> Iterable[Suggestion]:
    """learner_ranks above this one, fewest first, each with a layout the run accepts: at least
    the rollout ranks there are now, on whole nodes of the size they are now (a node further
    when the engines' groups would not fit)."""
    derived = planning.derived
    per_node = derived.world_size // derived.nodes
    most = derived.sequences_per_step // derived.minibatch_sequences  # a mini-batch for every learner at least
    for learners in range(derived.num_learner_ranks + 1, most + 1):
        world = max(derived.world_size, math.ceil((derived.num_rollout_ranks + learners) / per_node) * per_node)
        for grown in (world, world + per_node):
            yield Suggestion((("learner_ranks", learners),), check, effect, world_size=grown, nodes=grown // per_node)


def activation_advice(cfg: Config, activations: int, check: str) -> Advice:
    notes: Advice = []
    if not cfg.model.gradient_checkpointing:
        notes.append(Suggestion((("gradient_checkpointing", True),), check,
                                f" recomputes the activations ({activations / GIB:.1f} GiB) in backward, keeping "
                                f"one layer's"))
    batch, accumulation = cfg.optim.per_device_batch_size, cfg.optim.gradient_accumulation_steps
    if batch > 1:
        smaller = max(d for d in range(1, batch) if batch % d == 0)
        notes.append(Suggestion((("per_device_batch_size", smaller),
                                 ("gradient_accumulation_steps", accumulation * batch // smaller)), check,
                                f" (the same mini-batch) shrinks the activations about {batch // smaller}x"))
    else:
        notes.append(f"a shorter max_response_length: the activations are a micro-batch's of 1 x "
                     f"{cfg.data.max_prompt_length + cfg.rollout.max_response_length} tokens")
    if cfg.optim.log_prob_rows > batch:
        notes.append(Suggestion((("log_prob_batch_size", batch),), check,
                                " (the old and reference log-probs' forwards no wider than a micro-batch)"))
    return notes


def host_advice(planning: Planning, plan: dict[str, Any]) -> Advice:
    if plan["checks"]["host"] is not False:
        return []
    cfg, notes = planning.cfg, []
    node = plan["nodes"][plan["most_loaded_node"]]
    host, memory = plan["learner_rank"]["host"], plan["device_memory"]
    if plan["host_memory_from"] != "host_memory_gb":  # a plan made on another machine than the run's
        notes.append("host_memory_gb: the host memory of a node that will run it, if this machine is not one")
    if cfg.model.learner_offload and node["learner_ranks"] and memory is not None:
        on_device = learner_device_without_offload(plan)
        if on_device <= memory:
            moved = node["learner_ranks"] * sum(host[k] for k in ("params", "grads", "optimizer", "optimizer_step"))
            notes.append(Suggestion((("learner_offload", False),), "host",
                                    f" moves {moved / GIB:.1f} GiB of node {node['node']}'s host memory to the "
                                    f"learners' devices ({on_device / GIB:.1f} of {memory / GIB:.1f} GiB)"))
    world = planning.derived.world_size
    if world > 1:
        nodes = (Suggestion((), "host", world_size=world, nodes=n)
                 for n in range(planning.derived.nodes + 1, world + 1) if world % n == 0)
        spread = first_fitting(planning, nodes)
        more = spread or first_fitting(planning, more_learners(
            planning, " splits the learners' host memory over more of them", "host"), or_the_most=True)
        notes += [more] if more else []
    if host["checkpoint_copy"] and node["learner_ranks"]:
        copy = node["learner_ranks"] * host["checkpoint_copy"]
        waits = plan["checkpoint"]["modes"]["false"]["seconds_per_save"]
        notes.append(Suggestion((("async_save", False),), "host",
                                f" frees the {copy / GIB:.1f} GiB of checkpoint copies node {node['node']} holds while "
                                f"a checkpoint is written; the step then waits about {waits:.0f} s a save (at "
                                f"disk_write_gb_per_s {cfg.run.disk_write_gb_per_s:g})"))
        notes.append(Suggestion((("save_every", 0),), "host", " (no checkpoints; another save_every changes how "
                                                               "often they are copied, not how much)"))
    return notes


def disk_advice(planning: Planning, plan: dict[str, Any]) -> Advice:
    if plan["checks"]["disk"] is not False:
        return []
    cfg, ck, free, notes = planning.cfg, plan["checkpoint"], plan["disk_free"], []
    need = {keep: checkpoint_disk(replace(cfg.run, keep_last=keep), ck["per_step"], ck["export_bytes"])
            for keep in range(1, ck["keep_last"] + 1)}
    fitting = [keep for keep in need if need[keep]["disk_need"] <= free]
    if fitting:
        keep = max(fitting)
        notes.append(Suggestion((("keep_last", keep),), "disk",
                                f" ({need[keep]['copies']} checkpoints on disk at once)"))
    else:
        notes.append(f"not even keep_last 1 fits ({need[1]['disk_need'] / GIB:.1f} GiB: one checkpoint kept, one "
                     f"being written): put output_dir on a disk with more room (disk_gb: what is free there)")
    if ck["exports"] > 1:
        notes.append(Suggestion((("hf_export_every", 0),), "disk",
                                " (Hugging Face weights in the last checkpoint only)"))
    return notes


# How each engine stores what it runs on a kind of device, where that is worth saying.
ENGINE_NOTES = {("npu", "builtin"): " (FP8 as e4m3 codes in uint8)", ("npu", "vllm"): " (vllm-ascend: no FP8)"}


def rollout_by_device(planning: Planning, plan: dict[str, Any]) -> list[str]:
    """Per kind of device, what each rollout engine computes in, and, where this config's rollout
    cannot run there or vLLM needs another dtype there, what vLLM needs (re-planned)."""
    model, lines = planning.cfg.model, []
    for kind in [planning.device_kind] if planning.device_kind in DEVICE_NAMES else DEVICE_NAMES:
        engines = ROLLOUT_DTYPES[kind]
        if len(set(engines.values())) == 1 and not any((kind, engine) in ENGINE_NOTES for engine in engines):
            runs = f"{' and '.join(engines)} {', '.join(next(iter(engines.values())))}"
        else:
            runs = "; ".join(f"{engine}{ENGINE_NOTES.get((kind, engine), '')} {', '.join(dtypes)}"
                             for engine, dtypes in engines.items())
        line = f"{DEVICE_NAMES[kind]}: {runs}"
        refused = model.rollout_dtype not in engines[model.rollout_engine]
        if refused:
            line += f"; this config's {model.rollout_engine} {model.rollout_dtype} is refused there"
        if refused or model.rollout_dtype not in engines["vllm"]:
            line += f"; {vllm_on(planning, plan, kind)}"
        lines.append(line)
    return lines


def vllm_on(planning: Planning, plan: dict[str, Any], kind: str) -> str:
    """What rollout_engine vllm needs on ``kind``: the dtype it runs there (this config's if it
    can) and the smallest rollout_tensor_parallel that fits, re-planned."""
    model, dtypes = planning.cfg.model, ROLLOUT_DTYPES[kind]["vllm"]
    wanted = {"rollout_engine": "vllm", "rollout_dtype": model.rollout_dtype if model.rollout_dtype in dtypes else
              dtypes[0]}
    on_kind = replace(planning, device_kind=kind)
    candidates = (Suggestion(tuple((key, value) for key, value in {**wanted, "rollout_tensor_parallel": n}.items()
                                   if getattr(model, key) != value), "rollout")
                  for n in range(1, planning.derived.num_rollout_ranks + 1))
    found = first_fitting(on_kind, candidates, or_the_most=True)
    line = found and replanned(on_kind, plan, found, must_help=False)
    return f"vllm there: {line}" if line else "vllm there: no rollout_tensor_parallel that this layout accepts"


# What rollout_enforce_eager makes of vLLM's graphs, as the plan says it.
VLLM_GRAPHS = {None: "CUDA graphs on CUDA, their memory measured by vLLM and taken from its KV cache; eager elsewhere",
               True: "eager: no graphs", False: "graphs wherever vLLM captures them"}


def rank_lines(plan: dict[str, Any]) -> list[str]:
    """What a rollout rank and a learner rank hold (and one process, both roles on one device)."""
    gib = lambda n: f"{n / GIB:9.2f} GiB"  # noqa: E731
    rollout, learner = plan["rollout_rank"], plan["learner_rank"]
    lines = [f"model: {plan['model']['params'] / 1e9:.2f}B parameters; {plan['layout']}",
             "rollout rank (device):" if plan["rollout_tensor_parallel"] == 1 else
             f"rollout rank (device; the busiest of an engine's {plan['rollout_tensor_parallel']}, its engine rank's):"]
    lines += [f"  {k:<16} {gib(v)}" for k, v in rollout.items() if k not in ("reward_model", "total")]
    reward = plan["reward_model"]
    if reward is None:
        lines.append(f"  {'reward_model':<16} none (reward_fn {plan['reward_fn']} scores)")
    elif reward["bytes"] is None:
        lines.append(f"  {'reward_model':<16} not counted: {reward['path']} has no config.json (nor in the fit)")
    else:
        lines.append(f"  {'reward_model':<16} {gib(reward['bytes'])}  ({reward['bytes'] / rollout['total']:.0%} of "
                     f"the rollout device)")
    lines.append(f"  {'total':<16} {gib(rollout['total'])}")
    if "vllm" in plan:
        vllm, share = plan["vllm"], plan["vllm"]["gpu_memory_utilization"]
        split = plan["rollout_tensor_parallel"]
        per_device = f"; a device of {split}, tensor parallel" if split > 1 else ""
        lines.append(f"  vLLM engine: weights {gib(rollout['weights']).strip()}, KV cache "
                     f"{gib(vllm['kv_cache_memory_bytes']).strip()}{per_device} (kv_cache_memory_bytes on CPU; "
                     f"gpu_memory_utilization {share if share is not None else 'unknown'} on a device; "
                     f"{VLLM_GRAPHS[vllm['enforce_eager']]})")
    if plan.get("rollout_by_device"):
        lines.append("rollout by kind of device (engine: dtypes):")
        lines += [f"  {line}" for line in plan["rollout_by_device"]]
    lines.append(f"rollout rank (host, at start-up): {gib(plan['rollout_rank_host_at_start']).strip()}")
    for where in ("device", "host"):
        lines.append(f"learner rank ({where}):")
        lines += [f"  {k:<16} {gib(v)}" for k, v in learner[where].items()]
        if where == "device":
            lines.append(f"  {learner_tokens_text(plan['learner_tokens'])}")
    single = plan["one_process"]
    if single is not None:
        lines.append("one process, both roles on one device:")
        lines += [f"  {k:<16} {gib(single[k])}" for k in ("learner", "rollout", "steady_state")]
        lines.append(f"  {'start_up':<16} {gib(single['start_up'])}  (learner params + "
                     f"{single['fp32_rollout_copy'] / GIB:.2f} GiB fp32 rollout copy)")
        lines.append(f"  {'peak':<16} {gib(single['total'])}  at {single['peak_at']}")
    return lines


def learner_tokens_text(tokens: dict[str, Any]) -> str:
    """The learner's micro-batch in tokens, and the token budget the device leaves room for."""
    how = "ppo_max_token_len_per_gpu" if tokens["by"] == "budget" else "per_device_batch_size full-length rows"
    fitting = tokens["largest_fitting_budget"]
    room = f"ppo_max_token_len_per_gpu up to {fitting} fits" if fitting else \
        "no token budget fits" if tokens["device_memory_known"] else "the device's memory is unknown"
    return (f"(activations of a micro-batch of {tokens['tokens']} tokens ({how}), of a log-prob forward "
            f"{tokens['log_prob_tokens']}; with use_dynamic_bsz, {room})")


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
    return lines + checkpoint_mode_lines(plan["checkpoint"])


def checkpoint_mode_lines(ck: dict[str, Any]) -> list[str]:
    """The two async_save modes side by side: host memory, disk, the bytes and time of a save,
    and what the step waits for."""
    if not ck["save_every"]:
        return ["checkpoint modes: save_every 0, no checkpoints"]
    true, false, every = ck["modes"]["true"], ck["modes"]["false"], ck["save_every"]
    steps = f"{every} training step{'s' * (every > 1)}"

    def row(name: str, at_true: str, at_false: str) -> str:
        return f"  {name:<20} {at_true:>18} {at_false:>18}"

    def seconds(mode: dict[str, Any]) -> str:
        taken = mode["seconds_per_save"]
        return f"{taken:.{0 if taken >= 10 else 1}f} s"
    sizes = (("host, busiest node", "busiest_node_host"), ("disk needed", "disk_need"),
             ("written a learner", "written_per_learner_rank"), ("written a node", "written_per_node"))
    return [f"checkpoint modes (async_save; this run: {value_text(ck['async_save'])}), a save every {steps}, "
            f"written at {ck['disk_write_gb_per_s']:g} GiB/s a node (disk_write_gb_per_s):",
            row("", "true (host copy)", "false (no copy)"),
            *(row(name, size_text(true[key]), size_text(false[key])) for name, key in sizes),
            row("write time a save", seconds(true), seconds(false)),
            row("the step waits", "for the host copy", f"{seconds(false)} a save"),
            f"  true waits too when a save ({seconds(true)}) outlasts {steps} (the writer is still busy then)"]


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


def explained(planning: Planning, plan: dict[str, Any]) -> dict[str, Any]:
    """The plan with what --plan adds: what the rollout runs per kind of device, and the advice,
    each suggestion with the settings and the layout it names."""
    derived = planning.derived
    lines = [{"text": text} if suggestion is None else
             {"text": text, "check": suggestion.check, "settings": dict(suggestion.changes),
              "world_size": suggestion.world_size or derived.world_size, "nodes": suggestion.nodes or derived.nodes}
             for text, suggestion in advise(planning, plan)]
    return {**plan, "rollout_by_device": rollout_by_device(planning, plan), "advice": lines}


def planned_kind(device_setting: str, platform_kind: str) -> Optional[str]:
    """The kind of device a plan is for: the one ``device`` names, else the accelerator this
    process found; None (every kind) for --device auto on a CPU, where plans for nodes elsewhere
    are made."""
    if device_setting != "auto":
        return device_setting
    return None if platform_kind == "cpu" else platform_kind


def check(cfg: Config, derived: Derived, device_memory: Optional[int], *, with_reference: bool, plan_only: bool,
          lead: bool, platform_kind: str = "cpu") -> Optional[int]:
    """``--plan``: print the plan, write OUTPUT_DIR/memory_plan.json and return the exit status:
    0 when it fits, 1 when the device, a node's host memory or the disk does not. A run: None,
    after refusing to start (UserError naming what does not fit) when the device (device_memory_gb
    or what the device reports), the host memory of a node (host_memory_gb or MemTotal) or, with
    disk_gb, the disk is known not to fit. Free space as the filesystem reports it is a warning
    only: it changes while a run goes on, and the checkpointer warns again before each save.
    ``platform_kind``: the device this process found (device.Platform.kind); an accelerator's
    kind is what the plan is for, unless --device names one (a CPU plans for any kind)."""
    from transformers import AutoConfig

    memory = int(cfg.run.device_memory_gb * GIB) if cfg.run.device_memory_gb else device_memory
    capacity = machine_capacity(cfg)
    model_config = AutoConfig.from_pretrained(cfg.model.model_path, local_files_only=True)
    planning = Planning.of(cfg, derived, model_config, memory, with_reference=with_reference, capacity=capacity,
                           device_kind=planned_kind(cfg.run.device, platform_kind))
    plan = planning.plan()
    if plan_only:
        if lead or "WORLD_SIZE" not in os.environ:  # one line of output per job, not per rank
            plan = explained(planning, plan)
            print(table(plan, [line["text"] for line in plan["advice"]]), flush=True)
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
