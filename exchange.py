"""The seam between the roles: both ends of everything that crosses between ranks, in one place.

| exchange   | sent by                                | received by                                | group    | key     |
|------------|----------------------------------------|--------------------------------------------|----------|---------|
| samples    | rollout ranks: ``send_samples``        | lead learner: ``collect``                  | sync     | step.k  |
| answer     | lead learner: ``collect``              | rollout ranks: ``send_samples``            | sync     | step.k  |
| batch      | lead learner: ``share_batch``          | other learners: ``share_batch``            | learners | step    |
| weights    | lead learner: ``send_weights``; the    | rollout ranks that take weights:           | weights  | version |
|            | other learners gather with it over     | ``receive_weights``                        |          |         |
|            | ``learners``: ``join_weights``         |                                            |          |         |
| validation | rollout ranks: ``send_validation``     | lead learner: ``receive_validation``       | sync     | version |
| rank_state | rollout ranks: ``send_rank_state``     | lead learner: ``receive_rank_states``      | sync     | version |

k is the generation batch of the step ("more" asks for batch k + 1). The key is what both ends
agree on, not the step each is at: rollout runs up to ``max_staleness`` steps ahead of training.
The order within a step is roles.py's: the lead's hand-off of version j - 1 (weights, then
validation and rank states when due) comes before collecting step j when ``max_staleness`` is 0
and after it otherwise; then the batch goes to the other learners.

Two implementations, picked by the world size: :class:`Torchrun`, the collectives (ranks.py,
weight_sync.py), each send beside its receive; :class:`Local`, one process holding both roles,
where each exchange is a call on this process's rollout and nothing crosses. The lead's ends
exist in both; the other roles' only in :class:`Torchrun` (one process has no such roles).

With DAPO_EXCHANGE_LOG naming a folder, every end a rank takes part in is appended to
``rank_<rank>.log`` there as "key exchange end", ``join_weights`` as a send (its gather is part of
sending); tests/test_exchange.py pairs the ends.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Protocol

import torch
import torch.distributed as dist

from ranks import (MORE, NEXT, Groups, Layout, all_reduce_sum, broadcast_flag, broadcast_samples, gather_json,
                   gather_samples, phase)
from rollout import DynamicSampler, Generated, Rollout, wire_dtype
from samples import SampleBatch
from weight_sync import RolloutWeights, WeightBroadcast, WeightFormat

LOG_ENV = "DAPO_EXCHANGE_LOG"
Collected = tuple[SampleBatch, dict[str, Any]]  # a step's batch and its metrics row so far


class LeadExchange(Protocol):
    """The lead learner's ends, which a one-process run has too."""

    def collect(self, sampler: DynamicSampler, step: int) -> Collected: ...

    def share_batch(self, step: int, batch: Optional[SampleBatch]) -> SampleBatch: ...

    def send_weights(self, version: int, tensors: Iterable[torch.Tensor]) -> None: ...

    def receive_validation(self, version: int) -> list[float]: ...

    def receive_rank_states(self, version: int, own: dict[str, Any]) -> list[dict[str, Any]]: ...


def one_process_groups(backend: str) -> Groups:
    """The groups of a one-process run whose learner runs under FSDP2 (config.uses_fsdp): this
    process alone, over an in-process store, so nothing listens on a port. The world lasts until
    leave_world; another Trainer in this process (the tests make many) shares it."""
    if not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    # Checkpoint writer threads get a gloo group of their own, as in a torchrun job (init_groups).
    return Groups(learners=dist.group.WORLD, sync=None, checkpoint=dist.new_group([0], backend="gloo"))


class Local:
    """One process, both roles: the lead's ends are calls on this process's rollout."""

    def __init__(self, rollout: Rollout) -> None:
        self.rollout = rollout

    def collect(self, sampler: DynamicSampler, step: int) -> Collected:
        def generate_here(gen_index: int) -> Generated:
            batch, malformed, seconds = self.rollout.generate_shard(step, gen_index)
            return ([batch] if batch is not None else []), malformed, seconds, self.rollout.take_weight_sync()
        return sampler.collect(step, generate_here, answer=lambda full: None)

    def share_batch(self, step: int, batch: Optional[SampleBatch]) -> SampleBatch:
        return batch

    def send_weights(self, version: int, tensors: Iterable[torch.Tensor]) -> None:
        self.rollout.load_weights(tensors, version)

    def receive_validation(self, version: int) -> list[float]:
        return self.rollout.validation_sums()

    def receive_rank_states(self, version: int, own: dict[str, Any]) -> list[dict[str, Any]]:
        return []  # the lead's own state comes with the learners'


def weight_format(cfg: Any, layout: Layout, learner: Any, rollout: Optional[Rollout]) -> Optional[WeightFormat]:
    """What this rank's weight broadcast encodes or decodes into; None where it takes no weights:
    a rank of a tensor-parallel engine without the engine takes them only for its device's worker."""
    if layout.is_lead:
        return RolloutWeights(learner.policy.config, wire_dtype(cfg))
    if layout.is_learner:
        return None
    return rollout.engine.weights if layout.drives_engine else rollout.device_copy


class Torchrun:
    """A rank of a torchrun job: every exchange a collective over the group the table names."""

    def __init__(self, cfg: Any, layout: Layout, groups: Groups, device: torch.device,
                 form: Optional[WeightFormat]) -> None:
        self.layout, self.groups, self.device = layout, groups, device
        self.group_size = cfg.rollout.sample_num
        self.weights = WeightBroadcast(form, cfg.run.weight_sync_bucket_mb, src=layout.lead_learner,
                                       group=groups.weights, device=device) if form is not None else None
        self.log: Optional[Path] = Path(os.environ[LOG_ENV]) / f"rank_{layout.rank}.log" \
            if os.environ.get(LOG_ENV) else None

    def record(self, key: Any, exchange: str, end: str) -> None:
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(f"{key} {exchange} {end}\n")

    # ----- samples and the answer: rollout ranks <-> lead -----------------------------------------

    def send_samples(self, step: int, gen_index: int, batch: Optional[SampleBatch], malformed: int, seconds: float,
                     weight_sync: tuple[float, float]) -> int:
        """A rollout rank: its share of generation batch ``gen_index`` (None: no prompts for it),
        and the (transfer, load) seconds of the weight sync before it; returns the answer."""
        self.record(f"{step}.{gen_index}", "samples", "send")
        self.record(f"{step}.{gen_index}", "answer", "receive")
        with phase("sample transfer"):
            gather_samples(batch, [seconds, malformed, *weight_sync], self.layout, self.groups, self.device,
                           self.group_size)
            return broadcast_flag(0, self.layout.lead_learner, self.groups.sync, self.device)

    def collect(self, sampler: DynamicSampler, step: int) -> Collected:
        """The lead: the step's batch from the rollout ranks' generation batches, answering each
        ``MORE`` (the step still lacks informative groups) or ``NEXT``."""
        received = [0]

        def receive(gen_index: int) -> Generated:
            received[0] = gen_index
            self.record(f"{step}.{gen_index}", "samples", "receive")
            with phase("sample transfer"):
                pieces, table = gather_samples(None, [0.0] * 4, self.layout, self.groups, self.device,
                                               self.group_size)
            return pieces, int(table[:, 1].sum()), float(table[:, 0].max()), (float(table[:, 2].max()),
                                                                              float(table[:, 3].max()))

        def answer(full: bool) -> None:
            self.record(f"{step}.{received[0]}", "answer", "send")
            with phase("sample transfer"):
                broadcast_flag(NEXT if full else MORE, self.layout.lead_learner, self.groups.sync, self.device)
        return sampler.collect(step, receive, answer)

    # ----- the step's batch: lead -> other learners ---------------------------------------------

    def share_batch(self, step: int, batch: Optional[SampleBatch]) -> SampleBatch:
        """Every learner: the lead's ``batch`` (None on the others)."""
        if self.layout.num_learners == 1:
            return batch
        self.record(step, "batch", "send" if self.layout.is_lead else "receive")
        with phase("sample transfer"):
            return broadcast_samples(batch, self.layout.lead_learner, self.groups.learners, self.device,
                                     self.group_size)

    # ----- weights: learners -> rollout ranks ---------------------------------------------------

    def send_weights(self, version: int, tensors: Iterable[torch.Tensor]) -> None:
        """The lead: ``tensors`` (the learners' gather, :meth:`join_weights`) to the rollout ranks."""
        self.record(version, "weights", "send")
        self.weights.send(tensors, version)

    def join_weights(self, version: int, full_weights: Callable[[], Iterable[torch.Tensor]]) -> None:
        """A learner other than the lead: its part in gathering the weights the lead sends."""
        self.record(version, "weights", "send")
        with phase("weight sync"):
            for _ in full_weights():
                pass

    def receive_weights(self, rollout: Rollout) -> int:
        """A rollout rank: the next version (counted only, where its engine rank takes them)."""
        if self.weights is not None:
            self.record(rollout.weight_version + 1, "weights", "receive")
        return rollout.receive_weights(self.weights)

    # ----- validation sums and rank states: rollout ranks -> lead ---------------------------------

    def send_validation(self, version: int, sums: list[float]) -> None:
        self.record(version, "validation", "send")
        with phase("validation"):
            all_reduce_sum(sums, self.groups.sync, self.device)  # the lead reads the totals

    def receive_validation(self, version: int) -> list[float]:
        self.record(version, "validation", "receive")
        with phase("validation"):
            return all_reduce_sum([0.0, 0.0, 0.0], self.groups.sync, self.device)

    def send_rank_state(self, version: int, state: dict[str, Any]) -> None:
        """A rollout rank, when ``version`` is checkpointed: its rank state to the lead."""
        self.record(version, "rank_state", "send")
        with phase("checkpoint"):
            gather_json(state, self.layout.lead_learner, self.groups.sync, self.device)

    def receive_rank_states(self, version: int, own: dict[str, Any]) -> list[dict[str, Any]]:
        """The lead: every rollout rank's state; its ``own`` comes with the learners'."""
        self.record(version, "rank_state", "receive")
        with phase("checkpoint"):
            return gather_json(own, self.layout.lead_learner, self.groups.sync, self.device)[:-1]
