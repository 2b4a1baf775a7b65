"""Deliberate faults, for bench/fault_matrix.py and the fault tests: one environment variable,
read here and acted on where a rank enters a phase (ranks.phase).

    DAPO_FAULT=RANK:PHASE:STEP[:ACTION][,RANK:PHASE:STEP[:ACTION]...]

When rank RANK enters PHASE (a ranks.phase name: generation, sample transfer, weight sync,
update, validation, checkpoint) during its step STEP, ACTION happens, once. The first fault
belongs to the job's first attempt, the second (if any) to the attempt torchrun restarts after
it, and so on: a restarted job never meets the fault that ended its previous attempt.

    kill      SIGKILL this rank (the default)
    kill=R    SIGKILL rank R, on the same host: a rank killed while another one is in PHASE
              (a learner during generation, a rollout rank during the update)
    sleep=S   sleep S seconds, the heartbeat going on: a slow phase
    stop      SIGSTOP this rank: a stuck one, whose heartbeat stops too
"""
from __future__ import annotations

import functools
import os
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

_fired = False


@dataclass(frozen=True)
class Fault:
    rank: int
    phase: str
    step: int
    action: str
    argument: Optional[str]


@functools.lru_cache(maxsize=1)
def planned() -> Optional[Fault]:
    """The fault DAPO_FAULT names for this attempt of the job, or None."""
    specs = [part for part in os.environ.get("DAPO_FAULT", "").split(",") if part]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt >= len(specs):
        return None
    spec = specs[attempt]
    rank, phase, step, *rest = spec.split(":")
    action, _, argument = (rest[0] if rest else "kill").partition("=")
    if action not in ("kill", "sleep", "stop"):
        raise ValueError(f"DAPO_FAULT={spec}: the action must be kill, kill=R, sleep=S or stop")
    return Fault(int(rank), phase, int(step), action, argument or None)


def strike(rank: int, phase: str, step: int, peer: Callable[[int], Optional[dict[str, Any]]]) -> None:
    """Act on the planned fault if it names this rank, phase and step; ``peer(r)`` is rank r's
    latest heartbeat (liveness.Liveness.peer), which says where a rank to kill runs."""
    global _fired
    fault = planned()
    if _fired or fault is None or (fault.rank, fault.phase, fault.step) != (rank, phase, step):
        return
    _fired = True
    if fault.action == "sleep":
        time.sleep(float(fault.argument))
    elif fault.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.argument is None:
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        victim = peer(int(fault.argument))
        if victim is None or victim["host"] != socket.gethostname():
            raise RuntimeError(f"DAPO_FAULT: rank {fault.argument} does not run on this host")
        os.kill(victim["pid"], signal.SIGKILL)
