"""Roles, process groups and the collectives that carry samples, control flags and numbers
(exchange.py pairs their ends into the run's exchanges).

Ranks 0 .. W-L-1 roll out, W-L .. W-1 learn (L = learner_ranks); the first learner leads. Three
groups: ``learners`` (sharded training), ``sync`` (lead learner + rollout ranks: samples go
up, flags and weights come down) and the world. Everything crosses as tensors, never pickled
objects. Every collective runs under ``dist_timeout_s`` inside :func:`phase`, so a dead peer
becomes an error naming what the run was doing instead of a silent hang. An exchange that may
wait long for a busy peer (a generation batch, a training step) first waits in the store, where
a peer is given up only when its heartbeat stops (liveness.py).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import time
from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

import faults
from config import Derived
from liveness import Liveness
from samples import SampleBatch

NEXT, MORE = 0, 1  # the lead learner's answer after each generation batch


class PhaseError(RuntimeError):
    """A collective failed or timed out; the message names the phase and the rank."""


_current_phase = "start-up"
_current_step = 0  # the trainer's step on this rank (at_step)
_liveness: Optional[Liveness] = None  # a multi-rank job's, from init_world on


def at_step(step: int) -> None:
    """This rank begins its step ``step`` (said in its heartbeat and stop lines, matched by
    DAPO_FAULT); its work outside the named phases is "training" from now on, not "start-up"."""
    global _current_phase, _current_step
    _current_phase, _current_step = "training", step


def whereabouts() -> tuple[str, int]:
    """The phase and the step this rank is in."""
    return _current_phase, _current_step


def dead_peer() -> Optional[str]:
    """What a rank of this job that died on this host was doing (liveness.Liveness.dead_peer)."""
    return _liveness.dead_peer(dist.get_world_size()) if _liveness is not None else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    global _current_phase
    outer, _current_phase = _current_phase, name
    try:
        if _liveness is not None:
            _liveness.announce()
        faults.strike(_rank(), name, _current_step, _liveness.peer if _liveness else lambda rank: None)
        yield
    except PhaseError:
        raise
    except Exception as error:  # gloo/NCCL/HCCL raise several types for a lost peer or a timeout
        detail = " ".join(str(error).split())[:300]
        raise PhaseError(f"rank {_rank()}: {name} failed (a peer died or timed out): {detail}") from error
    finally:
        _current_phase = outer


def wait_for_group(group: Optional[dist.ProcessGroup]) -> None:
    """Wait, in the store, until every member of ``group`` (None: the world) has come to this
    exchange, however long a live member takes (liveness.py)."""
    if _liveness is not None:
        _liveness.wait_for(dist.get_process_group_ranks(group))


@dataclass(frozen=True)
class Layout:
    """Who does what, by rank index. With ``tensor_parallel`` N the rollout ranks form groups of N
    consecutive ranks, one rollout engine each: the first of a group (its engine rank) drives the
    engine over the group's N devices; the others hold no model and take no prompts, yet take
    part in every exchange of the rollout ranks, the weight sync too where the engine's worker on
    their device reads their copy of the weights (init_groups)."""

    world_size: int
    rank: int
    num_learners: int
    tensor_parallel: int = 1

    @staticmethod
    def of(derived: Derived, rank: int = 0) -> "Layout":
        """Rank ``rank``'s place in the world ``derived`` describes (Derived.of checked that its
        engines fit: config.check_engine_groups); any rank for what the world as a whole holds."""
        return Layout(world_size=derived.world_size, rank=rank, num_learners=derived.num_learner_ranks,
                      tensor_parallel=derived.rollout_tensor_parallel)

    @property
    def num_rollout(self) -> int:
        return self.world_size - self.num_learners

    @property
    def lead_learner(self) -> int:
        return self.num_rollout

    @property
    def is_learner(self) -> bool:
        return self.rank >= self.num_rollout

    @property
    def is_lead(self) -> bool:
        return self.rank == self.lead_learner

    @property
    def role(self) -> str:
        return "learner" if self.is_learner else "rollout"

    @property
    def rollout_index(self) -> int:
        return self.rank

    @property
    def learner_index(self) -> int:
        return self.rank - self.num_rollout

    @property
    def num_engines(self) -> int:
        """The rollout engines, over which the prompts of every batch are split."""
        return 1 if self.world_size == 1 else self.num_rollout // self.tensor_parallel

    @property
    def engine_index(self) -> int:
        """A rollout rank's engine (its group of ranks); 0 in one process."""
        return 0 if self.world_size == 1 else self.rollout_index // self.tensor_parallel

    @property
    def engine_groups(self) -> list[list[int]]:
        """Every rollout engine's ranks (engine_ranks of its engine rank), in order; none in one
        process, whose engine is its own."""
        return [replace(self, rank=first).engine_ranks for first in range(0, self.num_rollout, self.tensor_parallel)]

    @property
    def engine_ranks(self) -> list[int]:
        """The ranks whose devices a rollout rank's engine runs on, its engine rank first."""
        first = self.engine_index * self.tensor_parallel
        return list(range(first, first + self.tensor_parallel))

    @property
    def device_in_engine(self) -> int:
        """Which of its engine's devices a rollout rank's is, 0 for the engine rank's (the
        engine's workers take the devices in this order)."""
        return self.rank - self.engine_ranks[0]

    @property
    def drives_engine(self) -> bool:
        """Whether this rank builds a rollout engine (one process: always; a learner: never)."""
        return self.world_size == 1 or (not self.is_learner and self.rollout_index % self.tensor_parallel == 0)

    @property
    def title(self) -> str:
        """What this rank is, as heartbeats and error lines name it."""
        if self.is_lead:
            return "lead learner"
        if self.is_learner or self.tensor_parallel == 1:
            return self.role
        first, last = self.engine_ranks[0], self.engine_ranks[-1]
        if self.drives_engine:
            return f"rollout: engine {self.engine_index} over the devices of ranks {first}-{last}"
        return (f"rollout: engine {self.engine_index}'s device {self.device_in_engine + 1} of {self.tensor_parallel}, "
                f"no model")

    def node_ranks(self, nodes: int) -> range:
        """The ranks on this rank's node of ``nodes``: torchrun places ranks k*P..(k+1)*P-1 on
        node k, P ranks a node (Derived.of checked that P is whole)."""
        per_node = self.world_size // nodes
        first = self.rank // per_node * per_node
        return range(first, first + per_node)

    def engines_on_node(self, nodes: int) -> int:
        """The rollout engines driven from this rank's node; one process holds both roles."""
        if self.world_size == 1:
            return 1
        return sum(group[0] in self.node_ranks(nodes) for group in self.engine_groups)


@dataclass(frozen=True)
class Groups:
    learners: Optional[dist.ProcessGroup]  # None on rollout ranks
    sync: Optional[dist.ProcessGroup]  # None on learners other than the lead
    checkpoint: Optional[dist.ProcessGroup] = None  # the learners again, for checkpoint writer threads only
    weights: Optional[dist.ProcessGroup] = None  # the lead + the ranks that take weights (sync itself, or engine ranks)
    engine: Optional[dist.ProcessGroup] = None  # a tensor-parallel engine's ranks, where every one takes weights


def init_groups(layout: Layout, backend: str, timeout_s: float, learner_backend: Optional[str] = None,
                every_engine_rank_takes_weights: bool = False) -> Groups:
    """Create the subgroups; every rank must call this, in the same order (new_group is collective).
    ``learner_backend``: the learners' own (Platform.learner_backend), by default ``backend``.
    ``every_engine_rank_takes_weights``: with tensor parallel, whether each rank of an engine
    receives the weights for its device's worker (weight_sync.every_engine_rank_takes_weights),
    or only the engine rank."""
    timeout = datetime.timedelta(seconds=timeout_s)
    learner_ranks = list(range(layout.num_rollout, layout.world_size))
    sync_ranks = list(range(layout.num_rollout)) + [layout.lead_learner]
    learners = dist.new_group(learner_ranks, backend=learner_backend or backend, timeout=timeout)
    sync = dist.new_group(sync_ranks, backend=backend, timeout=timeout)
    # Checkpoint files are written beside training, so their collectives need a group of their
    # own; gloo, because what they carry are host copies.
    checkpoint = dist.new_group(learner_ranks, backend="gloo", timeout=timeout)
    # Weights go to the ranks that hold them: without a copy for each worker, a rank that holds
    # no model need not receive one it would drop, and its part in the exchanges of the sync
    # group is all it has to keep.
    weights, engine = sync, None
    if layout.tensor_parallel > 1 and every_engine_rank_takes_weights:
        # Each engine's ranks hand their handles to the engine rank (Python objects: gloo).
        for ranks in layout.engine_groups:
            group = dist.new_group(ranks, backend="gloo", timeout=timeout)
            if not layout.is_learner and layout.engine_ranks == ranks:
                engine = group
    elif layout.tensor_parallel > 1:
        engine_ranks = [ranks[0] for ranks in layout.engine_groups]
        weights = dist.new_group(engine_ranks + [layout.lead_learner], backend=backend, timeout=timeout)
    takes_weights = layout.drives_engine or (engine is not None)
    return Groups(learners=learners if layout.is_learner else None,
                  sync=sync if (not layout.is_learner or layout.is_lead) else None,
                  checkpoint=checkpoint if layout.is_learner else None,
                  weights=weights if takes_weights or layout.is_lead else None, engine=engine)


# ----- samples: rollout ranks -> lead learner -> all learners ----------------------------------

_LONG_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
_ROW_LONG_FIELDS = ("correct", "truncated", "prompt_index", "version")
_ROW_FLOAT_FIELDS = ("reward", "score")


def pack(batch: SampleBatch, width_p: int, width_r: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two matrices (int64, float32), rows padded to ``rows`` with zeros, widths to the given ones."""
    wide = batch.widen(width_p, width_r)
    longs = torch.zeros(rows, 2 * width_p + 2 * width_r + len(_ROW_LONG_FIELDS), dtype=torch.long)
    floats = torch.zeros(rows, width_r + len(_ROW_FLOAT_FIELDS), dtype=torch.float32)
    n = wide.prompt_ids.shape[0]
    longs[:n] = torch.cat([getattr(wide, f).long() for f in _LONG_FIELDS]
                          + [getattr(wide, f).long()[:, None] for f in _ROW_LONG_FIELDS], dim=1)
    floats[:n] = torch.cat([wide.rollout_logp] + [getattr(wide, f)[:, None] for f in _ROW_FLOAT_FIELDS], dim=1)
    return longs, floats


def unpack(longs: torch.Tensor, floats: torch.Tensor, rows: int, width_p: int, width_r: int,
           group_size: int) -> SampleBatch:
    longs, floats = longs[:rows].cpu(), floats[:rows].cpu()
    cuts = [width_p, width_p, width_r, width_r] + [1] * len(_ROW_LONG_FIELDS)
    parts = dict(zip(_LONG_FIELDS + _ROW_LONG_FIELDS, longs.split(cuts, dim=1)))
    logp, *row_floats = floats.split([width_r] + [1] * len(_ROW_FLOAT_FIELDS), dim=1)
    flags = ("prompt_mask", "response_mask", "correct", "truncated")
    fields = {k: (v.bool() if k in flags else v) for k, v in parts.items()}
    fields.update({k: v[:, 0] for k, v in fields.items() if k in _ROW_LONG_FIELDS})
    fields.update({k: v[:, 0] for k, v in zip(_ROW_FLOAT_FIELDS, row_floats)})
    return SampleBatch(rollout_logp=logp, group_size=group_size, **fields)


# The routing ids (routing_replay) travel as their bytes: every backend's collectives take uint8,
# NCCL's no int16. A batch's routing is (MoE layers, top_k, bytes per id), (0, 0, 0) without.
_ROUTING_DTYPES = {1: torch.uint8, 2: torch.int16}


def routing_of(batch: Optional[SampleBatch]) -> tuple[int, int, int]:
    routed = None if batch is None else batch.routed_experts
    return (0, 0, 0) if routed is None else (routed.shape[2], routed.shape[3], routed.element_size())


def pack_routing(batch: SampleBatch, width_p: int, width_r: int, rows: int,
                 routing: tuple[int, int, int]) -> torch.Tensor:
    """The batch's routing ids as bytes, [rows, (width_p + width_r) * layers * top_k * bytes], rows
    padded with zeros (an empty batch is all padding)."""
    layers, top_k, itemsize = routing
    data = torch.zeros(rows, width_p + width_r, layers, top_k * itemsize, dtype=torch.uint8)
    if batch.routed_experts is not None:
        wide = batch.widen(width_p, width_r).routed_experts
        data[:wide.shape[0]] = wide.contiguous().view(torch.uint8)
    return data.view(rows, -1)


def unpack_routing(data: torch.Tensor, rows: int, width_p: int, width_r: int,
                   routing: tuple[int, int, int]) -> torch.Tensor:
    layers, top_k, itemsize = routing
    return data[:rows].cpu().view(rows, width_p + width_r, layers, top_k * itemsize).view(_ROUTING_DTYPES[itemsize])


def _all_gather(tensor: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every member's ``tensor`` (all the same shape), in group order, on every member.

    What only one rank needs still travels to all: HCCL (ProcessGroupHCCL) has no gather or
    scatter (the NPU extension 2.7 always raises; later versions unless TORCH_NPU_USE_COMPATIBLE_IMPL=1
    on A2/A3), and every backend has all_gather. The price is small: the largest exchange, a
    30B generation batch (6 rollout ranks, each 6 prompts x 8 samples of up to 2048 + 2048
    tokens in int64, 65.6 kB a row), puts 7 members x 48 rows = 22 MB on every member of the
    sync group for the moment of the transfer, next to an 805 MB weight-sync bucket. Receiving
    at the lead from each rank in turn (send/recv) would spare the rollout ranks that, at the
    cost of a round trip per rank in every generation batch."""
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor, group=group)
    return gathered


def gather_samples(batch: Optional[SampleBatch], header_values: Sequence[float], layout: Layout, groups: Groups,
                   device: torch.device, group_size: int) -> Optional[tuple[list[SampleBatch], torch.Tensor]]:
    """Rollout ranks send their batch (or None) plus a few numbers; the lead receives, in rank order,
    every non-empty batch and a [num_rollout, len(header_values)] table of the numbers."""
    wait_for_group(groups.sync)
    rows = 0 if batch is None else batch.prompt_ids.shape[0]
    width_p = 0 if batch is None else batch.prompt_ids.shape[1]
    width_r = 0 if batch is None else batch.response_ids.shape[1]
    # The lead's own header (last in the group) is padding.
    table = all_gather_float64([rows, width_p, width_r, *routing_of(batch), *header_values], groups.sync, device)[:-1]
    max_rows, max_p, max_r, *routing = (int(table[:, i].max()) for i in range(6))
    if batch is None:
        batch = SampleBatch.empty(group_size)
    longs, floats = (t.to(device) for t in pack(batch, max_p, max_r, max_rows))
    long_list, float_list = _all_gather(longs, groups.sync), _all_gather(floats, groups.sync)
    routing_list = _all_gather(pack_routing(batch, max_p, max_r, max_rows, routing).to(device), groups.sync) \
        if routing[0] else None
    if not layout.is_lead:
        return None
    batches = [replace(unpack(long_list[r], float_list[r], int(table[r, 0]), max_p, max_r, group_size),
                       routed_experts=None if routing_list is None else
                       unpack_routing(routing_list[r], int(table[r, 0]), max_p, max_r, routing))
               for r in range(layout.num_rollout) if int(table[r, 0])]
    return batches, table[:, 6:]


def broadcast_flag(value: int, src: int, group: dist.ProcessGroup, device: torch.device) -> int:
    flag = torch.tensor([value], dtype=torch.long, device=device)
    dist.broadcast(flag, src=src, group=group)
    return int(flag.item())


def broadcast_samples(batch: Optional[SampleBatch], src: int, group: dist.ProcessGroup, device: torch.device,
                      group_size: int) -> SampleBatch:
    """The lead learner's step batch to every learner."""
    wait_for_group(group)
    shape = torch.tensor([0] * 6 if batch is None else
                         [batch.prompt_ids.shape[0], batch.prompt_ids.shape[1], batch.response_ids.shape[1],
                          *routing_of(batch)], dtype=torch.long, device=device)
    dist.broadcast(shape, src=src, group=group)
    rows, width_p, width_r, *routing = shape.tolist()
    if batch is None:
        batch = SampleBatch.empty(group_size)
    longs, floats = (t.to(device) for t in pack(batch, width_p, width_r, rows))
    dist.broadcast(longs, src=src, group=group)
    dist.broadcast(floats, src=src, group=group)
    routed = None
    if routing[0]:
        data = pack_routing(batch, width_p, width_r, rows, routing).to(device)
        dist.broadcast(data, src=src, group=group)
        routed = unpack_routing(data, rows, width_p, width_r, routing)
    return replace(unpack(longs, floats, rows, width_p, width_r, group_size), routed_experts=routed)


def all_gather_float64(values: Sequence[float], group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """[group size, len(values)] on the host: every rank's values, in group order, in float64.

    They travel as their bits in int64: HCCL (Atlas A2/A3) takes no float64 in its collectives,
    and float32 would round token counts and sums of many values."""
    bits = torch.tensor(list(values), dtype=torch.float64).view(torch.int64).to(device)
    gathered = [torch.empty_like(bits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, bits, group=group)
    return torch.stack(gathered).cpu().view(torch.float64)


def all_reduce_sum(values: Sequence[float], group: dist.ProcessGroup, device: torch.device) -> list[float]:
    """The float64 sums over the group: gathered, then added on the host in group order, so every
    rank gets the same bits."""
    wait_for_group(group)
    return all_gather_float64(values, group, device).sum(dim=0).tolist()


def gather_json(value: Any, dst: int, group: dist.ProcessGroup, device: torch.device) -> Optional[list[Any]]:
    """Every rank's JSON-safe ``value``, in group order, on global rank ``dst`` (None elsewhere).
    JSON bytes in a tensor, so nothing is unpickled on the receiving side."""
    wait_for_group(group)
    payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(device)
    size = torch.tensor([payload.numel()], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    padded = torch.zeros(int(max(sizes)), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    received = _all_gather(padded, group)
    if dist.get_rank() != dst:
        return None
    return [json.loads(bytes(t[: int(n)].cpu().tolist())) for t, n in zip(received, sizes)]


def all_reduce_tensor(tensor: torch.Tensor, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """The sum over the group of a host tensor, through ``device`` (NCCL/HCCL reduce device memory)."""
    on_device = tensor.to(device)
    dist.all_reduce(on_device, group=group)
    return on_device.to(tensor.device)


def all_reduce_max(value: float, group: dist.ProcessGroup, device: torch.device) -> float:
    return max(all_gather_float64([value], group, device)[:, 0].tolist())


_ATTEMPT_STORE_KEY = "ranks.attempt_store"


def _attempt_store(rank: int, timeout: datetime.timedelta) -> Optional[dist.Store]:
    """A store that lives and dies with this attempt's rank 0, or None where env:// already gives one.

    Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) env:// makes every rank a client of the
    agent's store, which outlives worker-group restarts: a restarted group finds the dead group's
    keys there and gloo dials dead addresses ("connectFullMesh failed ... Connection refused") or
    waits forever (pytorch/pytorch#135712). A key prefix from TORCHELASTIC_RESTART_COUNT is no
    cure with several nodes: an agent whose own workers were healthy restarts them without
    counting (#108158). So rank 0 hosts a fresh store and posts its address in the agent's store;
    an address posted by a dead attempt refuses connections, and the others read again until the
    one they reach is live. Without the agent, env:// has rank 0 host the store already.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent_address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    agent = dist.TCPStore(*agent_address, is_master=False, timeout=timeout)
    if rank == 0:
        # The agent's store may live on another node than rank 0: post the address on which the
        # other ranks reach this node (the one this node uses to reach the agent).
        with socket.create_connection(agent_address) as probe:
            host = probe.getsockname()[0]
        store = dist.TCPStore(host, 0, is_master=True, timeout=timeout, wait_for_workers=False)
        agent.set(_ATTEMPT_STORE_KEY, f"{host} {store.port}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        host, port = agent.get(_ATTEMPT_STORE_KEY).decode().split()  # blocks until rank 0's first post
        try:
            socket.create_connection((host, int(port)), timeout=10).close()  # quiet check before TCPStore
            return dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        except (OSError, dist.DistError):  # a dead attempt's store
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def init_world(layout: Layout, backend: str, timeout_s: float, learner_backend: Optional[str] = None,
               every_engine_rank_takes_weights: bool = False) -> Groups:
    """Join the torchrun job (env:// rendezvous, in a store of this attempt's own: see
    :func:`_attempt_store`), every collective bounded by timeout_s, start this rank's heartbeat
    and create the subgroups."""
    global _liveness
    timeout = datetime.timedelta(seconds=timeout_s)
    role = layout.title
    with phase("process group start-up"):
        dist.init_process_group(backend, store=_attempt_store(layout.rank, timeout), rank=layout.rank,
                                world_size=layout.world_size, timeout=timeout)
        _liveness = Liveness(dist.distributed_c10d._get_default_store(), layout.rank, timeout_s,
                             describe=lambda: {"phase": _current_phase, "step": _current_step, "role": role})
        return init_groups(layout, backend, timeout_s, learner_backend, every_engine_rank_takes_weights)


def finish_together() -> None:
    """Wait for every rank before any tears the groups down: a rank that finishes early must not
    close gloo pairs that others still use (the lead may still be writing its last checkpoint)."""
    if not dist.is_initialized():
        return  # one process: nobody to wait for
    with phase("shutdown"):
        wait_for_group(None)
        # Before the barrier: rank 0 leaves once past it and takes the store with it, which a
        # heartbeat must not outlive (c10d prints pages of warnings about the lost connection).
        stop_heartbeat()
        dist.barrier()


def stop_heartbeat() -> None:
    global _liveness
    if _liveness is not None:
        _liveness.stop()
        _liveness = None


def leave_world() -> None:
    """Stop the heartbeat and destroy the process groups, if this process has them (an exit with
    live gloo groups can abort after success)."""
    stop_heartbeat()
    if dist.is_initialized():
        dist.destroy_process_group()
