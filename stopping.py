"""How a run stops, in one line: a user's Ctrl-C or SIGTERM, torchrun stopping the ranks that
survive one that died, a full disk. And torchrun, as launch.sh runs it:

    python stopping.py TORCHRUN_ARGS...     # torchrun, but a stopped job ends with the workers'
                                            # line and 128 + the signal number, not a traceback

A stop signal must reach a rank wherever it is, inside a collective too, in C code that does not
return to Python to run a handler: Python's C-level handler writes the signal number to a
wake-up pipe, and a watcher thread acts on it.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

import ckpt
import ranks
from liveness import STORE_HOST, store_answers

STOP_SIGNALS = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}
# torchrun signals the ranks of a job within milliseconds of each other; a rank waits this long
# for the others to say they got it too before it takes the signal for the launcher's stop of
# the survivors of a rank that died.
STOP_GRACE_S = 3.0
_END_OF_WATCH = 0  # written to the wake-up pipe by unwatch(); no signal has this number
_stopping = threading.Event()  # a stop signal is being handled: the watcher thread speaks, then ends the process


@dataclass
class _Watch:
    layout: ranks.Layout
    output_dir: Path
    read_end: int
    write_end: int
    handlers: dict[int, Any]
    wakeup_fd: int


_watch: Optional[_Watch] = None


def watch(layout: ranks.Layout, output_dir: Path) -> None:
    """From now until :func:`unwatch`, SIGINT and SIGTERM end this process with one line: a stop
    of the whole job says at which step it stopped and where a resume continues (on the lead
    only) and exits with 128 + the signal; torchrun's SIGTERM to the survivors of a rank that died
    names the phase this rank was in and exits with 1."""
    global _watch
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    handlers = {sig: signal.signal(sig, lambda signum, frame: None) for sig in STOP_SIGNALS}
    _watch = _Watch(layout, output_dir, read_end, write_end, handlers, signal.set_wakeup_fd(write_end))
    threading.Thread(target=_wait_for_a_signal, args=(_watch,), name="stop-signals", daemon=True).start()


def unwatch() -> None:
    """Give the signals back to their earlier handlers (a run inside a longer-lived process)."""
    global _watch
    if _watch is None:
        return
    signal.set_wakeup_fd(_watch.wakeup_fd)
    for sig, handler in _watch.handlers.items():
        signal.signal(sig, handler)
    os.write(_watch.write_end, bytes([_END_OF_WATCH]))
    os.close(_watch.write_end)
    _watch = None


def _wait_for_a_signal(watched: _Watch) -> None:
    while True:
        for signum in os.read(watched.read_end, 16):
            if signum == _END_OF_WATCH:
                os.close(watched.read_end)
                return
            if signum in STOP_SIGNALS:
                _stop(signal.Signals(signum), watched)


def _stop(signum: signal.Signals, watched: _Watch) -> None:
    _stopping.set()
    layout, (where, step) = watched.layout, ranks.whereabouts()
    survivor = f"error: rank {layout.rank}: {where} failed (the launcher stopped this rank after another rank died)"
    # Armed before the first store call: a frozen rank 0 never answers one, and its silence means the same.
    threading.Timer(2 * STOP_GRACE_S, _leave, args=(1, survivor)).start()
    status, line = 1, survivor
    try:
        if dead := ranks.dead_peer():
            line = f"error: {dead}; the other ranks stopped"
        ckpt.stop_completing()  # the checkpoint named below stays the newest complete one
        ranks.stop_heartbeat()  # no heartbeat may outlive rank 0's store, which may leave first
        if _every_rank_stopping(layout.world_size):
            during = f"during step {step}" if step else "before the first step"
            status = 128 + signum
            line = f"stopped by {STOP_SIGNALS[signum]} {during}; {ckpt.resume_hint(watched.output_dir)}" \
                if layout.is_lead else ""
    finally:
        _leave(status, line)


def _leave(status: int, line: str) -> None:
    if line:
        say_once_per_job(line)
    os._exit(status)  # now, whatever the training thread is blocked in


def _every_rank_stopping(world_size: int) -> bool:
    """Whether every rank got a stop signal (the whole job is being stopped) rather than only the
    survivors of a rank that died, which torchrun SIGTERMs: each rank counts itself in the job's
    store and waits a moment for the others. Rank 0 holds the store and leaves last, once every
    rank has made up its mind (a store that vanishes under a rank makes c10d print pages)."""
    if world_size == 1 or not dist.is_initialized():
        return True  # one process; or a rank so early in its start-up that it cannot ask
    if not store_answers(dist.distributed_c10d._get_default_store()):
        return False  # rank 0 died, its store with it
    store = dist.distributed_c10d._get_default_store().clone()  # the training thread may hold its own
    deadline = time.monotonic() + STOP_GRACE_S
    try:
        every_rank = _count_in(store, "stopping/signalled", world_size, deadline)
        _count_in(store, "stopping/decided", world_size if dist.get_rank() == STORE_HOST else 0, deadline + 1)
        return every_rank
    except dist.DistError:  # the store has gone with rank 0: a rank died
        return False


def _count_in(store: dist.Store, key: str, expected: int, deadline: float) -> bool:
    """Add this rank to the count under ``key``; wait until it reaches ``expected`` or the deadline."""
    count = store.add(key, 1)
    while count < expected and time.monotonic() < deadline:
        time.sleep(0.05)
        count = store.add(key, 0)
    return count >= expected


def failure_line(error: BaseException) -> str:
    """The one line for a run that cannot go on (exit status 1): a full disk said as such, with
    what to change and the checkpoint a resume continues from. While a stop signal is being
    handled it never returns: the error is a peer that left on the same signal, and the watcher
    thread ends the process with the stop's own line."""
    if _stopping.is_set():
        threading.Event().wait()
    if isinstance(error, ranks.PhaseError) and (dead := ranks.dead_peer()):
        return f"{dead}; the other ranks stopped"  # the peer's death, not this rank's broken exchange
    if _watch is None or not ckpt.disk_full(error):
        return " ".join(str(error).split())
    out = _watch.output_dir
    what = f"writing {error.filename}" if isinstance(error, OSError) and error.filename else \
        "writing a checkpoint" if isinstance(error, ckpt.CheckpointError) else f"writing to {out}"
    free = shutil.disk_usage(out).free
    return (f"{what} failed: no space left on device ({ckpt.human_size(free)} free on the filesystem of {out}); "
            f"make room (fewer checkpoints: keep_last; fewer saves: save_every; or output_dir on another disk), "
            f"then {ckpt.resume_hint(out)}")


BAD_INPUT_STATUS = 2  # what a rank exits with after its one line about bad input (train_dapo)


class _StopChatter(logging.Filter):
    """Drops torchrun's own lines about a stop signal it got and forwards to the workers, and
    about a rank that exited on bad input: the workers say what matters, once.

    torchrun says it SIGTERMs the ranks still running before it says which rank failed and how:
    those lines are held until that one, and dropped with it when the failure was bad input."""

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "released", False):
            return True
        message = str(record.msg)
        self.stopping = self.stopping or message.startswith("Received %s death signal")
        if self.stopping and ("death signal" in message or "closing signal" in message):
            return False
        if message.startswith("Sending process %s closing signal"):
            self.held.append(record)
            return False
        if message.startswith("failed (exitcode: %s)") and record.args and record.args[0] == BAD_INPUT_STATUS:
            self.held.clear()
            return False
        self.release()
        return True

    def release(self) -> None:
        """Log the held lines after all: the failure they belong to was not bad input."""
        held, self.held = self.held, []
        for record in held:
            record.released = True
            logging.getLogger(record.name).handle(record)


def _bad_input_only(failed: Any) -> bool:
    """Whether a failed job is a rank that exited on bad input, the others either the same or
    ended by torchrun's signal before they could say it too (they are slower to start)."""
    failures = failed.failures.values()
    first = min(failures, key=lambda failure: failure.timestamp)
    return first.exitcode == BAD_INPUT_STATUS and all(f.exitcode in (BAD_INPUT_STATUS, -signal.SIGTERM, -signal.SIGKILL)
                                                      for f in failures)


def run_torchrun(argv: list[str]) -> int:
    """torchrun with ``argv``; a job stopped by a signal returns 128 + the signal number, and one
    whose ranks stopped on bad input returns 2, without torchrun's traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    chatter = _StopChatter()
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(chatter)
    try:
        torchrun(argv)
    except SignalException as stop:
        return 128 + stop.sigval
    except KeyboardInterrupt:  # Ctrl-C before torchrun took the signals over
        return 128 + signal.SIGINT
    except ChildFailedError as failed:
        if _bad_input_only(failed):
            return BAD_INPUT_STATUS
        raise
    finally:
        chatter.release()
    return 0


def say_once_per_job(line: str) -> None:
    """Write ``line`` to stderr unless another rank of this torchrun job on this machine already
    has: bad input is seen alike by every rank, and the user needs to read it once."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import hashlib
        import tempfile

        digest = hashlib.sha1(f"{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{line}".encode())
        try:
            os.close(os.open(Path(tempfile.gettempdir()) / f"dapo-said-{digest.hexdigest()[:16]}",
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return
        except OSError:
            pass  # no temporary folder to mark it in: say it anyway
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(run_torchrun(sys.argv[1:]))
