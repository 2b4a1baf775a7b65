"""Waiting is not hanging: a peer that works keeps a rank waiting, a dead or stuck one ends the run.

A rank often waits long for a peer that is busy: the lead learner for a generation batch, a
rollout rank for the next weights (a whole training step), a learner for the lead's collection,
validation and checkpoint. Such waits happen here, in the job's store (the c10d store the
process group was built on), never inside a collective: a rank marks its arrival at an exchange
and blocks until every member of the group has arrived, so the collective that follows runs with
everybody present and the backends' own timeouts (gloo, NCCL, HCCL_EXEC_TIMEOUT) see only the
exchange itself.

Meanwhile a thread renews this rank's heartbeat in the store every few seconds, saying what the
rank is doing, and reads the heartbeats of the peers the rank is waiting for. A peer whose
heartbeat has not changed for ``timeout_s`` (dist_timeout_s) is dead or stuck (a lost host, a
frozen process): the rank stops with one line naming its phase, the peer and what the peer was
doing. A peer whose heartbeat goes on keeps the wait going, however long its phase lasts.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist

# One store wait; a wait that lasts longer starts another (the heartbeats decide whether to go on).
_STORE_WAIT = datetime.timedelta(hours=24)
STORE_HOST = 0  # the job's store lives in rank 0's process (ranks._attempt_store, or env://)


def _heartbeat_key(rank: int) -> str:
    return f"liveness/heartbeat/{rank}"


def _process_exists(pid: int) -> bool:
    """Whether process ``pid`` still runs: a zombie (dead, not yet reaped by torchrun) does not."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # someone else's process
            return True
        return True


def store_answers(store: dist.Store) -> bool:
    """Whether the job's store still takes connections. Connecting a client (``clone()``) to a
    store whose host died retries for the store's whole timeout (dist_timeout_s) and prints a
    page per retry; a plain socket says "refused" at once."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return True  # another kind of store: it has no host to die
    try:
        socket.create_connection((store.host, store.port), timeout=1).close()
    except OSError:
        return False
    return True


def _arrival_key(members: str, count: int, rank: int) -> str:
    return f"liveness/arrived/{members}/{count}/{rank}"


class Liveness:
    """This rank's heartbeat, and its waits for the other members of a group.

    ``describe()`` says what this rank is doing (``phase``, ``step``, ``role``); it travels with
    every heartbeat and names this rank's phase in its own error line.
    """

    def __init__(self, store: dist.Store, rank: int, timeout_s: float,
                 describe: Callable[[], dict[str, Any]]) -> None:
        self.store, self.rank, self.timeout_s, self.describe = store, rank, timeout_s, describe
        self.beat_s = min(5.0, timeout_s / 10)
        self._arrivals: dict[str, int] = {}  # exchanges reached so far, per member list
        self._awaited: list[int] = []  # the peers the training thread is waiting for now
        self._beats = 0
        self._stopped = threading.Event()
        # A connection of the thread's own: a training thread blocked in a store wait holds its
        # connection, and must not hold up a heartbeat.
        self._store = store.clone()
        self._beat()  # there before any peer can wait for this rank
        self._thread = threading.Thread(target=self._watch, name="liveness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the heartbeat; on return the thread no longer uses the store (one blocked on a
        store that does not answer is left behind)."""
        self._stopped.set()
        self._thread.join(timeout=self.beat_s)

    def peer(self, rank: int) -> Optional[dict[str, Any]]:
        """What rank ``rank`` said in its latest heartbeat (pid, host, phase, step, role), or None."""
        key = _heartbeat_key(rank)
        return json.loads(self._store.get(key)) if self._store.check([key]) else None

    def dead_peer(self, world_size: int) -> Optional[str]:
        """"rank R (ROLE) died in PHASE of step S" for a rank on this host whose process is gone,
        from its last heartbeat; None when there is none or the store cannot say (rank 0 died)."""
        if not store_answers(self.store):
            return None
        try:
            store = self.store.clone()  # the caller is neither the training thread nor the heartbeat's
            for peer in range(world_size):
                key = _heartbeat_key(peer)
                if peer == self.rank or not store.check([key]):
                    continue
                latest = json.loads(store.get(key))
                if latest["host"] == socket.gethostname() and not _process_exists(latest["pid"]):
                    return f"rank {peer} ({latest['role']}) died in {latest['phase']} of step {latest['step']}"
        except dist.DistError:
            return None
        return None

    def wait_for(self, members: list[int]) -> None:
        """Block until every rank of ``members`` (this one among them) has reached this exchange.

        Members reach the exchanges of a group in one order, so the count of exchanges each has
        reached names the same exchange on every member.
        """
        others = [m for m in members if m != self.rank]
        if not others:
            return
        group = "-".join(map(str, members))
        count = self._arrivals[group] = self._arrivals.get(group, 0) + 1
        keys = [_arrival_key(group, count, m) for m in others]
        self._awaited = others  # from the first store call on: a store that hangs is noticed too
        try:
            self.store.set(_arrival_key(group, count, self.rank), b"")
            if count > 2:  # every member has passed exchange count - 2 to reach count - 1: nobody reads this key again
                self.store.delete_key(_arrival_key(group, count - 2, self.rank))
            while True:
                try:
                    self.store.wait(keys, _STORE_WAIT)
                    return
                except dist.DistNetworkError as error:
                    raise RuntimeError(f"the job's store, in rank {STORE_HOST}'s process, is gone (rank "
                                       f"{STORE_HOST} died): {error}") from None
                except dist.DistStoreError:  # the store wait's own limit: wait again
                    pass
        finally:
            self._awaited = []

    def announce(self) -> None:
        """Renew the heartbeat now, from the training thread, as this rank enters a phase: a rank
        that dies there is then known to have died there."""
        self._beat(self.store)

    def _beat(self, store: Optional[dist.Store] = None) -> None:
        self._beats += 1
        (store or self._store).set(_heartbeat_key(self.rank), json.dumps(
            {"beat": self._beats, "pid": os.getpid(), "host": socket.gethostname(), **self.describe()}))

    def _watch(self) -> None:
        heard: dict[int, tuple[Optional[dict[str, Any]], float]] = {}  # peer -> (last heartbeat, when it changed)
        while not self._stopped.wait(self.beat_s):
            # A store whose host is frozen neither answers nor fails: give it timeout_s per round.
            no_answer = threading.Timer(self.timeout_s, self._store_silent)
            no_answer.start()
            try:
                self._beat()
                for peer in list(self._awaited):
                    latest, now = self.peer(peer), time.monotonic()
                    if peer not in heard or heard[peer][0] != latest:
                        heard[peer] = (latest, now)
                    elif now - heard[peer][1] > self.timeout_s:
                        self._fail(self._silence(peer, latest, now - heard[peer][1]))
            except dist.DistError:
                return  # rank 0 has left, its store with it; a training thread waiting on it hears so itself
            finally:
                no_answer.cancel()

    def _store_silent(self) -> None:
        if not self._stopped.is_set():
            self._fail(f"rank {STORE_HOST}, which holds the job's store, is dead or stuck: the store has not "
                       f"answered for {self.timeout_s:g}s (dist_timeout_s)")

    def _silence(self, peer: int, latest: Optional[dict[str, Any]], seconds: float) -> str:
        who = f"rank {peer}" if latest is None else \
            f"rank {peer} ({latest['role']}, last heard in {latest['phase']} of step {latest['step']})"
        return f"{who} is dead or stuck: no heartbeat for {seconds:.0f}s (dist_timeout_s {self.timeout_s:g})"

    def _fail(self, reason: str) -> None:
        # The training thread is blocked in the store wait and cannot raise: say it and end here.
        sys.stderr.write(f"error: rank {self.rank}: {self.describe()['phase']} failed: {reason}\n")
        sys.stderr.flush()
        os._exit(1)
