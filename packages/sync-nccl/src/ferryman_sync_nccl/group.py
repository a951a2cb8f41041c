"""A private torch.distributed group for the weight broadcast, and waiting on it with deadlines.

The group is built directly from a ``TCPStore`` (``ProcessGroupGloo`` / ``ProcessGroupNCCL``
objects, not ``init_process_group``), so it lives beside whatever default group the trainer or
the engine already uses, several can exist in one process (in-process receivers on gloo), and it
can be torn down and rebuilt after a failure. Rank 0 sends; ranks 1..N receive.

:class:`Group` is how the transports hold one: it remembers every collective started on it
that has not ended, and frees the group only once none is in flight, in the thread that owns
it (a group destroyed while one of its collectives runs, or destroyed implicitly by whichever
thread happens to drop the last reference, is what the teardown must never do). Collectives are
handed to gloo groups one thread at a time (:data:`_ISSUE_LOCK`: a data race in torch's flight
recorder between groups of one process). A gloo group's
own deadline is set to the transport's ``timeout_s`` once it is built, so a collective whose
peer is gone ends (with an error) within that time, and freeing the group never waits longer.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

POLL_S = 0.00005
"""How long a wait for the device (or for a bucket's acks while the device packs) sleeps
between looks: short against a bucket's copy (about 0.25 ms for 512 MiB on an H200)."""
RELEASE_GRACE_S = 5.0
"""How much longer than its collectives' own deadline freeing a group waits for them."""


class GroupError(RuntimeError):
    """The weight-sync process group failed (a peer died, or a collective timed out); the group
    cannot be used any more."""


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


@contextlib.contextmanager
def _env(name: str, value: str):
    """Set ``name`` unless the user did, for the duration of a constructor that reads it."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


def new_group(store: Any, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    """A process-group backend object for ``rank`` of ``world_size``. For gloo the constructor
    is the rendezvous (it returns once every rank has joined, or raises after ``timeout_s``);
    an NCCL communicator is created by the first collective."""
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, world_size, _td(timeout_s))
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        # the PG's own watchdog fires after ours (which aborts the communicator first); if it
        # ever fires, it cleans up instead of killing the process (the default, mode 3)
        opts._timeout = _td(timeout_s + 60.0)
        with _env("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"):
            pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    else:
        raise ValueError(f"unknown backend {backend!r} (allowed: nccl, gloo)")
    return pg


_ISSUE_LOCK = threading.Lock()
"""Held while a collective is handed to a gloo group. torch (2.11) records every collective in
its process-wide flight recorder, and the first one of each group inserts that group's status
into a shared ``std::map`` before taking the recorder's mutex: two groups of one process
issuing collectives at once (the sender's and the receivers' first broadcasts of a session in
the in-process tests) can corrupt it; a SIGSEGV in ``_Rb_tree_insert_and_rebalance`` under
``FlightRecorder::recordWithResetEnabled`` from ``ProcessGroupGloo::enqueue`` (a core dump of
the CI crash's pattern). A gloo collective is only queued here (its worker threads run it), so
the lock is held for microseconds. NCCL groups are not serialized: their first collective
creates the communicator and blocks until every rank has joined."""


def broadcast(pg: Any, tensor: torch.Tensor, root: int = 0) -> Any:
    """Start a broadcast of ``tensor`` from ``root``; returns the Work."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    try:
        if "NCCL" in type(pg).__name__:
            return pg.broadcast([tensor], opts)
        with _ISSUE_LOCK:
            return pg.broadcast([tensor], opts)
    except Exception as e:  # noqa: BLE001 - a dead peer shows up here on gloo
        raise GroupError(f"broadcast failed: {e}") from e


def wait(work: Any, timeout_s: float, *, cuda: bool) -> None:
    """Wait for a Work. On a CPU (gloo) group this blocks until it is done or ``timeout_s``
    passed; on NCCL (``cuda``) it only orders the current CUDA stream after it (use
    :func:`wait_stream` to block with a deadline)."""
    if work is None:
        return
    try:
        if cuda:
            work.wait()
        else:
            work.wait(_td(timeout_s))
    except Exception as e:  # noqa: BLE001
        raise GroupError(f"collective failed: {e}") from e


def completion_event(work: Any, stream: Any) -> Any:
    """A CUDA event that completes when ``work`` does, recorded on ``stream`` (a side stream:
    the compute stream is not made to wait, so packing the next bucket overlaps this one)."""
    with torch.cuda.stream(stream):
        work.wait()
        ev = torch.cuda.Event()
        ev.record(stream)
    return ev


def wait_event(ev: Any, timeout_s: float, what: str) -> None:
    """Block until a CUDA event completes, or raise :class:`GroupError` after ``timeout_s``."""
    if ev is None:
        return
    deadline = time.monotonic() + timeout_s
    while not ev.query():
        if time.monotonic() > deadline:
            raise GroupError(f"{what}: not done within {timeout_s:g}s (a peer is dead or stuck)")
        time.sleep(POLL_S)


def wait_stream(device: torch.device, timeout_s: float, what: str) -> None:
    """Block until everything queued on ``device``'s current stream is done, or raise
    :class:`GroupError` after ``timeout_s`` (a hung NCCL collective never returns by itself)."""
    if device.type != "cuda":
        return
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    wait_event(ev, timeout_s, what)


def abort(pg: Any) -> None:
    """Abort the group's communicators (pending collectives end with an error)."""
    if pg is None:
        return
    for name in ("abort", "_abort", "shutdown"):
        fn = getattr(pg, name, None)
        if fn is None:
            continue
        try:
            fn()
            return
        except Exception:  # noqa: BLE001 - best effort on a group that already failed
            continue


def shutdown(pg: Any) -> None:
    """Free a group's communicators (best effort). An NCCL group is aborted: that is local,
    whereas finalizing may wait for peers that are gone."""
    if pg is None:
        return
    if "NCCL" in type(pg).__name__:
        abort(pg)
        return
    fn = getattr(pg, "shutdown", None)
    if fn is None:
        return
    try:
        fn()
    except Exception:  # noqa: BLE001
        pass


class Group:
    """A process group owned by one thread, and the collectives started on it that may still
    run. Only the owning thread starts collectives and calls :meth:`release`."""

    def __init__(self, pg: Any, backend: str, op_timeout_s: float) -> None:
        self.pg = pg
        self.backend = backend
        self.op_timeout_s = op_timeout_s
        """The longest deadline a collective started on this group may have."""
        self.aborted = False
        self._works: list[Any] = []

    def set_op_timeout(self, seconds: float) -> None:
        """Collectives started from now on give up after ``seconds`` (gloo; an NCCL group's
        watchdog keeps its own, longer, deadline and ours aborts it first)."""
        if self.pg is not None and self.backend == "gloo":
            self.pg.set_timeout(_td(seconds))

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> Any:
        if self.pg is None:
            raise GroupError("the weight-sync group was released")
        work = broadcast(self.pg, tensor, root)
        self._works = [w for w in self._works if not _ended(w)]
        self._works.append(work)
        return work

    def in_flight(self) -> int:
        """How many collectives started here have not ended yet."""
        self._works = [w for w in self._works if not _ended(w)]
        return len(self._works)

    def abort(self) -> None:
        """Abort the communicators (NCCL: pending collectives end with an error; gloo has no
        abort: its collectives end at their deadline)."""
        if self.pg is not None and "NCCL" in type(self.pg).__name__:
            abort(self.pg)
            self.aborted = True

    def release(self, wait_s: float | None = None) -> bool:
        """Free the group here, once none of its collectives is in flight (waiting at most
        ``wait_s``, default the collectives' deadline plus :data:`RELEASE_GRACE_S`). Returns
        whether it was freed; a group still busy then is kept aside, never destroyed under a
        running collective, and freed by a later :meth:`release` of any group."""
        _sweep()
        if self.pg is None:
            return True
        deadline = time.monotonic() + (self.op_timeout_s + RELEASE_GRACE_S if wait_s is None else wait_s)
        while not self.aborted and self.in_flight() and time.monotonic() < deadline:
            time.sleep(0.005)
        if not self.aborted and self.in_flight():
            log.warning("a weight-sync group still has %d collective(s) in flight; it is kept, not destroyed", self.in_flight())
            with _RETIRED_LOCK:
                _RETIRED.append(self)
            return False
        pg, self.pg, self._works = self.pg, None, []
        _free(pg)
        return True


_RETIRED: list[Group] = []
"""Groups released while a collective of theirs still ran: freed once it has ended."""
_RETIRED_LOCK = threading.Lock()


def _ended(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a failed work has ended
        return True


def _free(pg: Any) -> None:
    """Drop the last reference to ``pg`` here (its destructor joins its worker threads, which
    are idle now). NCCL communicators are aborted first: that is local, whereas finalizing may
    wait for peers that are gone."""
    if "NCCL" in type(pg).__name__:
        abort(pg)
    del pg


def _sweep() -> None:
    with _RETIRED_LOCK:
        done = [g for g in _RETIRED if not g.in_flight()]
        for g in done:
            _RETIRED.remove(g)
    for g in done:
        pg, g.pg = g.pg, None
        if pg is not None:
            _free(pg)
