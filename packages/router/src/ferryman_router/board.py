"""The shared form by default: local decisions, shared counts.

Every process that routes (the Rollouter, or each of several processes issuing generate calls)
holds its own :class:`BoardStickyRouter`: a full :class:`~ferryman_router.router.StickyRouter`
whose sticky table, in-flight counts and decisions are local, so ``acquire`` and ``release`` never
leave the process. A small Ray actor, the :class:`CountsBoard`, joins the processes. A background
task in each process calls it every ``sync_interval_s`` (one actor call, off the request path) to

- **publish** this process's exact in-flight count per replica (a full snapshot, not deltas, so
  a lost or repeated call changes nothing and no count can go negative), and the failures,
  additions and removals of replicas made here since the last call;
- **pull** the global view: per replica, the requests in flight from every *other* process, the
  membership, and the quarantines with their remaining cool-down.

Decisions then weigh ``local in flight (exact) + remote in flight (a period or so old)``, so
least-in-flight placement and rebalancing see the whole fleet's load. A conversation's turns are
all issued by the process that runs it, so stickiness needs no sharing. How the remote part is
read: placement trusts the latest view as far as the requests it counted are likely still
running (LLM turns last seconds, a view is milliseconds old: fully); rebalancing, which costs a
session its cache, acts only on the mean of the last few views, i.e. on a lasting overload.

If the board cannot be reached, routing goes on: one warning, the remote counts are kept for
``board_timeout_s`` and then dropped (decisions on this process's own counts only), and the task
keeps retrying with back-off. Ray restarts a board whose process crashed (``max_restarts``); a
named board that is gone is created again by the first member that notices. A restarted board
starts empty: every member re-publishes its counts on its next call, and the first member to
reach it hands over its membership and quarantines.

Ray is imported only when a board is created or looked up.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import socket
import time
import uuid
from collections import deque
from collections.abc import Iterable
from typing import Any

from ferryman_router.router import StickyRouter, _Replica

__all__ = ["BoardStickyRouter", "CountsBoard", "make_board", "make_board_router"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 60.0
"""How long the first call to a board may take (starting its process), before the first view."""

Event = tuple[str, Any, Any]
"""``("fail", replica, error)``, ``("add", replica, None)``, ``("remove", replica, None)`` or
``("state", [replicas], {replica: (remaining_s | None, error)})`` (membership and quarantines
handed to a restarted board)."""


class CountsBoard:
    """Ray actor body: per-replica in-flight counts of every member process, the membership and
    the quarantines. Each :meth:`sync` is a handful of dict operations; the board never decides.

    :param replicas: the initial membership.
    :param quarantine_s: cool-down after a reported failure (``None``: until re-added).
    :param member_ttl_s: a member that has not synced for this long is forgotten (its process
        died or is stuck); its counts stop weighing on the replicas.
    """

    def __init__(self, replicas: Iterable[str], quarantine_s: float | None = 60.0, member_ttl_s: float = 10.0) -> None:
        self._setup(replicas, quarantine_s, member_ttl_s)

    def _setup(self, replicas: Iterable[str], quarantine_s: float | None, member_ttl_s: float) -> None:
        self.incarnation = uuid.uuid4().hex
        """Changes whenever the board starts afresh (created, restarted by Ray, reset)."""
        self.replicas: list[str] = list(dict.fromkeys(replicas))
        self.version = 1
        """Bumped by every membership change; members fetch the list only when it changed."""
        self.quarantine_s = quarantine_s
        self.member_ttl_s = member_ttl_s
        self.quarantined: dict[str, tuple[float, str]] = {}
        """replica → (monotonic time it is re-admitted, inf: only by add; last error)."""
        self.members: dict[str, tuple[dict[str, int], float]] = {}
        """member → (its in-flight count per replica, monotonic time of its last sync)."""
        self.handed_over = False
        """Whether a member already handed its state to this (restarted) board."""
        self.syncs = 0
        self.expired_members = 0

    async def reset(self, replicas: list[str], quarantine_s: float | None = 60.0, member_ttl_s: float = 10.0) -> None:
        """Start afresh (tests reuse one board process)."""
        self._setup(replicas, quarantine_s, member_ttl_s)

    # ------------------------------------------------------------------ events
    def _apply(self, event: Event, now: float) -> None:
        kind, arg, extra = event
        if kind == "fail":
            if arg in self.replicas:
                until = math.inf if self.quarantine_s is None else now + self.quarantine_s
                self.quarantined[arg] = (until, str(extra))
        elif kind == "add":
            if arg not in self.replicas:
                self.replicas.append(arg)
                self.version += 1
            self.quarantined.pop(arg, None)
        elif kind == "remove":
            if arg in self.replicas:
                self.replicas.remove(arg)
                self.version += 1
            self.quarantined.pop(arg, None)
        elif kind == "state":
            if self.handed_over:
                return  # another member was first; its state stands
            self.handed_over = True
            self.replicas = list(dict.fromkeys(arg))
            self.version += 1
            self.quarantined = {
                name: (math.inf if remaining is None else now + remaining, str(error))
                for name, (remaining, error) in extra.items()
                if name in self.replicas
            }

    # ------------------------------------------------------------------ the call members make
    async def sync(
        self, member: str, counts: dict[str, int], events: list[Event], known_version: int
    ) -> tuple[str, int, list[str] | None, dict[str, int], dict[str, tuple[float | None, str]], int]:
        """Record ``member``'s counts, apply its events, and answer with the view:
        ``(incarnation, version, replicas if version != known_version else None,
        {replica: in flight from the other members}, {replica: (remaining s | None, error)},
        number of members)``."""
        now = time.monotonic()
        self.syncs += 1
        for event in events:
            self._apply(event, now)
        self.members[member] = (counts, now)
        if self.member_ttl_s is not None and (self.syncs & 63) == 0:
            self._expire(now)
        remote = dict.fromkeys(self.replicas, 0)
        for other, (theirs, _) in self.members.items():
            if other == member:
                continue
            for name, n in theirs.items():
                if name in remote and n > 0:
                    remote[name] += n
        quarantined: dict[str, tuple[float | None, str]] = {}
        for name, (until, error) in list(self.quarantined.items()):
            if until <= now:
                del self.quarantined[name]  # cool-down over: re-admitted
            else:
                quarantined[name] = (None if math.isinf(until) else until - now, error)
        replicas = None if known_version == self.version else list(self.replicas)
        return self.incarnation, self.version, replicas, remote, quarantined, len(self.members)

    def _expire(self, now: float) -> None:
        for member, (_, seen) in list(self.members.items()):
            if now - seen > self.member_ttl_s:
                del self.members[member]
                self.expired_members += 1

    async def leave(self, member: str) -> None:
        """``member`` stops routing: its counts are dropped now."""
        self.members.pop(member, None)

    async def describe(self) -> dict[str, Any]:
        """Totals, members and quarantines (for tests and debugging)."""
        now = time.monotonic()
        totals = dict.fromkeys(self.replicas, 0)
        for counts, _ in self.members.values():
            for name, n in counts.items():
                if name in totals:
                    totals[name] += n
        return {
            "pid": os.getpid(),
            "incarnation": self.incarnation,
            "replicas": list(self.replicas),
            "in_flight": totals,
            "members": {m: {"counts": dict(c), "age_s": now - seen} for m, (c, seen) in self.members.items()},
            "quarantined": {n: e for n, (until, e) in self.quarantined.items() if until > now},
            "syncs": self.syncs,
            "expired_members": self.expired_members,
        }


class BoardStickyRouter(StickyRouter):
    """A :class:`StickyRouter` that shares its in-flight counts, quarantines and membership with
    the other processes of a :class:`CountsBoard` (see the module docstring).

    :param replicas: replica names.
    :param board: the board's Ray actor handle.
    :param board_name: the board's actor name, if it has one (then a board that is gone is
        looked up or created again under that name).
    :param sync_interval_s: pause between two board calls (a call itself takes a few ms).
    :param board_timeout_s: an unanswered call counts as failed after this long; remote counts
        older than this are dropped.
    :param member_ttl_s: passed on when this router has to create the board again.
    :param remote_window: views averaged for the other processes' lasting load. Rebalancing
        uses that mean; placement blends it with the latest view (see :meth:`_set_remote`).
    :param options: :class:`StickyRouter` keyword arguments.

    Picklable: a copy unpickled in another process is a new member of the same board, with its
    own (empty) sticky table and counts.
    """

    def __init__(
        self,
        replicas: Iterable[str],
        *,
        board: Any,
        board_name: str | None = None,
        sync_interval_s: float = 0.01,
        board_timeout_s: float = 2.0,
        member_ttl_s: float = 10.0,
        remote_window: int = 4,
        **options: Any,
    ) -> None:
        if remote_window < 1:
            raise ValueError(f"BoardStickyRouter: remote_window must be >= 1, got {remote_window}")
        self.remote_window = int(remote_window)
        if not sync_interval_s > 0:
            raise ValueError(f"BoardStickyRouter: sync_interval_s must be > 0, got {sync_interval_s}")
        if not board_timeout_s > 0:
            raise ValueError(f"BoardStickyRouter: board_timeout_s must be > 0, got {board_timeout_s}")
        self._outbox: dict[str, Event] = {}
        """Unsent local changes, the latest per replica (so an outage cannot grow it unboundedly)."""
        self._handover: Event | None = None
        super().__init__(replicas, **options)
        self._options = options
        self.board = board
        self.board_name = board_name
        self.sync_interval_s = float(sync_interval_s)
        self.board_timeout_s = float(board_timeout_s)
        self.member_ttl_s = float(member_ttl_s)
        self.member = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # idle ties rotate from a different replica in every process, so that processes starting
        # at the same moment do not all send their first sessions to the same replica
        order = list(self._replicas.values())
        random.Random(self.member).shuffle(order)
        for i, rep in enumerate(order):
            rep.last_pick = i - len(order) - 1
        self._rebuild_heap()  # the tie-break stamps changed: the least-loaded heap must know

        self._task: asyncio.Task[None] | None = None
        self._lock: asyncio.Lock | None = None
        self._closed = False
        self._connecting = True
        """No answer yet from this board handle (its process may still be starting)."""
        self._incarnation: str | None = None
        self._version = 0
        self._last_ok = -math.inf
        self._warned = False
        self.connected = False
        """A view arrived within ``board_timeout_s``."""
        self.board_members = 0
        self.syncs = 0
        self.sync_failures = 0
        self.sync_s_total = 0.0
        self.syncs_timed = 0
        self.board_restarts = 0
        """Times the board was found restarted or re-created (this member re-joined it)."""
        self.remote_quarantines = 0
        """Quarantines learnt from the board (reported by other processes)."""
        self._recent: deque[dict[str, int]] = deque(maxlen=self.remote_window)
        """The last ``remote_window`` views' remote counts."""
        self._remote_mean: dict[str, float] = {}
        self._rtt_s: float | None = None
        """Smoothed duration of a board call."""
        self.request_s: float | None = None
        """Smoothed lifetime of this process's requests (acquire to release), by Little's law."""
        self._last_obs: tuple[float, int, int] | None = None
        self.view_weight = 1.0
        """How much of the latest view placement trusts (see :meth:`_set_remote`)."""

    def __reduce__(self) -> tuple[Any, ...]:
        kwargs = {
            "board": self.board,
            "board_name": self.board_name,
            "sync_interval_s": self.sync_interval_s,
            "board_timeout_s": self.board_timeout_s,
            "member_ttl_s": self.member_ttl_s,
            "remote_window": self.remote_window,
            **self._options,
        }
        return (_rebuild, (list(self._replicas), kwargs))

    # ------------------------------------------------------------------ local changes → outbox
    def _quarantine(self, rep: _Replica, reason: str) -> None:
        super()._quarantine(rep, reason)
        self._outbox.pop(rep.name, None)
        self._outbox[rep.name] = ("fail", rep.name, reason)

    def add_replica_nowait(self, replica: str) -> None:
        super().add_replica_nowait(replica)
        self._outbox.pop(replica, None)
        self._outbox[replica] = ("add", replica, None)

    def remove_replica_nowait(self, replica: str) -> None:
        known = replica in self._replicas
        super().remove_replica_nowait(replica)
        if known:
            self._outbox.pop(replica, None)
            self._outbox[replica] = ("remove", replica, None)

    # ------------------------------------------------------------------ the Router protocol
    async def acquire(self, request_id: str) -> str:
        task = self._task
        if task is None or task.done():
            self.start()
        return self.acquire_nowait(request_id)

    def start(self) -> None:
        """Start the background sync task on the running event loop (``acquire`` does it)."""
        if self._closed:
            return
        task = self._task
        if task is not None and not task.done():
            return
        self._lock = asyncio.Lock()
        self._task = asyncio.get_running_loop().create_task(self._sync_loop(), name=f"router-board-sync {self.member}")

    async def sync_now(self) -> bool:
        """Publish this process's counts and pull the view now; True if the board answered."""
        if self._task is None or self._task.done():
            self.start()
        assert self._lock is not None
        async with self._lock:
            return await self._sync_once()

    async def aclose(self) -> None:
        """Stop syncing and leave the board (its counts from this process vanish at once)."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping
                pass
        try:
            await asyncio.wait_for(_await_ref(self.board.leave.remote(self.member)), self.board_timeout_s)
        except Exception as e:  # noqa: BLE001 - the board may be gone already
            log.debug("router board leave failed: %r", e)

    async def stats(self) -> dict[str, float]:
        out = self.stats_nowait()
        latest = self._recent[-1] if self._recent else {}
        for name, rep in self._replicas.items():  # what the board last said, not the estimate
            out[f"router/in_flight/{name}"] = float(rep.in_flight + latest.get(name, 0))
        now = time.monotonic()
        out.update(
            {
                "router/board/connected": 1.0 if self.connected else 0.0,
                "router/board/members": float(self.board_members),
                "router/board/syncs": float(self.syncs),
                "router/board/sync_failures": float(self.sync_failures),
                "router/board/sync_ms": 1e3 * self.sync_s_total / self.syncs_timed if self.syncs_timed else 0.0,
                "router/board/view_age_ms": 1e3 * (now - self._last_ok) if self.syncs else -1.0,
                "router/board/remote_load": float(sum(r.remote for r in self._replicas.values())),
                "router/board/restarts": float(self.board_restarts),
                "router/board/remote_quarantines": float(self.remote_quarantines),
                "router/board/request_ms": 1e3 * self.request_s if self.request_s is not None else -1.0,
                "router/board/view_weight": self.view_weight,
            }
        )
        return out

    # ------------------------------------------------------------------ syncing
    async def _sync_loop(self) -> None:
        assert self._lock is not None
        failures = 0
        while not self._closed:
            try:
                async with self._lock:
                    ok = await self._sync_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop the sharing for good
                log.exception("router counts board: sync failed unexpectedly")
                ok = False
            failures = 0 if ok else failures + 1
            # while the board is unreachable, retry with back-off (at most once a second)
            delay = self.sync_interval_s if ok else min(1.0, self.sync_interval_s * 2 ** min(failures, 10))
            await asyncio.sleep(delay)

    async def _sync_once(self) -> bool:
        counts = {rep.name: rep.in_flight for rep in self._replicas.values()}
        decisions = self.decisions
        events = list(self._outbox.values())
        self._outbox.clear()
        if self._handover is not None:
            events.insert(0, self._handover)
        t0 = time.monotonic()
        try:
            ref = self.board.sync.remote(self.member, counts, events, self._version)
            # a board that was just created (a new process) gets time to start
            timeout = max(self.board_timeout_s, CONNECT_TIMEOUT_S) if self._connecting else self.board_timeout_s
            view = await asyncio.wait_for(_await_ref(ref), timeout)
        except asyncio.CancelledError:
            self._requeue(events)
            raise
        except Exception as e:  # noqa: BLE001 - board dead, restarting, or too slow
            self._requeue(events)
            await self._failed(e)
            return False
        rtt = time.monotonic() - t0
        if self._connecting:  # the first answer of a board may include starting its process
            self._connecting = False
        else:
            self.syncs_timed += 1
            self.sync_s_total += rtt
            self._rtt_s = rtt if self._rtt_s is None else self._rtt_s + 0.2 * (rtt - self._rtt_s)
        self.syncs += 1
        self._observe_requests(t0, sum(counts.values()), decisions)
        if self._handover is not None and self._handover in events:
            self._handover = None
        self._apply_view(view)
        return True

    def _requeue(self, events: list[Event]) -> None:
        """Put unsent events back in front of anything newer for the same replica."""
        newer = self._outbox
        self._outbox = {}
        for event in events:
            if event[0] != "state":
                self._outbox[event[1]] = event
        for name, event in newer.items():
            self._outbox.pop(name, None)
            self._outbox[name] = event

    async def _failed(self, error: BaseException) -> None:
        self.sync_failures += 1
        now = time.monotonic()
        if not self._warned:
            self._warned = True
            log.warning(
                "router counts board unreachable (%r); routing continues on this process's own counts%s",
                error,
                "" if math.isinf(self._last_ok) else f", remote counts are dropped after {self.board_timeout_s:g} s",
            )
        if self.connected and now - self._last_ok > self.board_timeout_s:
            self.connected = False
            self._set_remote({})
            log.warning("router counts board: no view for %.1f s, remote counts dropped", now - self._last_ok)
        if self.board_name is not None and _actor_is_gone(error):
            await self._reconnect_named()

    async def _reconnect_named(self) -> None:
        """Look the named board up again, or create it (with this process's replicas)."""
        name = self.board_name
        assert name is not None
        try:
            loop = asyncio.get_running_loop()
            board = await loop.run_in_executor(
                None, lambda: make_board(list(self._replicas), quarantine_s=self.quarantine_s, member_ttl_s=self.member_ttl_s, name=name)
            )
        except Exception as e:  # noqa: BLE001 - retried on the next failure
            log.debug("router counts board %r: re-creating failed: %r", name, e)
            return
        self.board = board
        self._connecting = True

    def _apply_view(self, view: tuple[Any, ...]) -> None:
        incarnation, version, replicas, remote, quarantined, members = view
        now = self._clock()
        self.board_members = members
        self._last_ok = time.monotonic()
        if not self.connected:
            if self._warned:
                log.warning("router counts board reachable again")
            self.connected = True
            self._warned = False
        if self._incarnation is not None and incarnation != self._incarnation:
            # the board restarted (or was re-created) empty: offer it this process's membership
            # and quarantines; the first member to reach it wins, the others adopt its view
            self.board_restarts += 1
            log.warning("router counts board restarted; handing over membership and quarantines")
            self._incarnation = incarnation
            self._version = 0  # fetch the membership again after the handover
            self._handover = ("state", list(self._replicas), self._quarantine_view(now))
            self._recent.clear()
            self._set_remote(remote)
            return
        self._incarnation = incarnation
        pending = self._outbox  # changes made here while the call was out win over the view
        if replicas is not None:
            self._version = version
            wanted = set(replicas)
            for name in replicas:
                if name not in self._replicas and name not in pending:
                    StickyRouter.add_replica_nowait(self, name)
            for name in list(self._replicas):
                if name not in wanted and name not in pending:
                    StickyRouter.remove_replica_nowait(self, name)
        changed = False
        self._set_remote(remote)
        for name, rep in self._replicas.items():
            if name in pending:
                continue
            q = quarantined.get(name)
            if q is not None:
                remaining, error = q
                rep.until = math.inf if remaining is None else now + remaining
                self.errors[name] = error
                if rep.healthy:
                    rep.healthy = False
                    self._quarantined[name] = rep
                    self.quarantines += 1
                    self.remote_quarantines += 1
                changed = True
            elif not rep.healthy:
                self._restore(rep)  # re-admitted elsewhere, or its cool-down ended on the board
                self.readmissions += 1
                changed = True
        if changed:
            self._rebuild_healthy()
            self._next_readmit = min((r.until for r in self._quarantined.values()), default=math.inf)

    def _observe_requests(self, now: float, in_flight: int, decisions: int) -> None:
        """Update :attr:`request_s` from two snapshots: requests finished in between = acquires
        minus the growth of the in-flight count; lifetime = mean in flight × time / finished."""
        last, self._last_obs = self._last_obs, (now, in_flight, decisions)
        if last is None:
            return
        t, before, d = last
        finished = (decisions - d) - (in_flight - before)
        if now <= t or finished <= 0:
            return
        sample = (before + in_flight) / 2 * (now - t) / finished
        self.request_s = sample if self.request_s is None else self.request_s + 0.2 * (sample - self.request_s)

    def _set_remote(self, remote: dict[str, int]) -> None:
        """The other processes' load per replica, as decisions use it.

        A view is ``age`` old when it is used: about one board call plus half a period. A
        request counted in it is still running with probability ``w = exp(-age / request
        lifetime)``, so placement uses ``mean + w × (latest − mean)`` (the best guess of the
        current count: a view far older than a request says little more than the average), where
        ``mean`` is over the last ``remote_window`` views. Requests of seconds, as LLM turns
        are, give ``w ≈ 1``: the latest view. Rebalancing uses ``mean`` alone: a session loses its
        cache only for a lasting overload."""
        recent = self._recent
        if not remote:
            recent.clear()
        else:
            recent.append(remote)
        n = len(recent)
        w = 1.0
        if self.request_s is not None and self._rtt_s is not None:
            age = self._rtt_s + self.sync_interval_s / 2
            w = math.exp(-age / max(self.request_s, 1e-6))
        self.view_weight = w
        mean = self._remote_mean
        for name, rep in self._replicas.items():
            m = sum(view.get(name, 0) for view in recent) / n if n else 0.0
            mean[name] = m
            rep.remote = m + w * (remote.get(name, 0) - m)
        self._rebuild_heap()  # every load changed: one heapify, not a push per replica

    def _overloaded(self, cur: _Replica, healthy: list[_Replica]) -> bool:
        """As :meth:`StickyRouter._overloaded`, with the other processes' load averaged over the
        last ``remote_window`` views: a session loses its cache only for a lasting overload."""
        mean = self._remote_mean
        load = cur.in_flight + mean.get(cur.name, 0.0)
        low = min(r.in_flight + mean.get(r.name, 0.0) for r in healthy)
        return load - low >= self.rebalance_min_gap and (load + 1) > self.rebalance_threshold * (low + 1)

    def _quarantine_view(self, now: float) -> dict[str, tuple[float | None, str]]:
        return {
            name: (None if math.isinf(rep.until) else max(0.0, rep.until - now), self.errors.get(name, "?"))
            for name, rep in self._quarantined.items()
        }


async def _await_ref(ref: Any) -> Any:
    return await asyncio.wrap_future(ref.future())


def _actor_is_gone(error: BaseException) -> bool:
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover - ray is a core dependency
        return False
    return isinstance(error, RayActorError)


def _rebuild(replicas: list[str], kwargs: dict[str, Any]) -> BoardStickyRouter:
    return BoardStickyRouter(replicas, **kwargs)


def make_board(
    replicas: Iterable[str], *, quarantine_s: float | None = 60.0, member_ttl_s: float = 10.0, name: str | None = None
) -> Any:
    """Start a :class:`CountsBoard` actor (or, with ``name``, join the live one of that name).
    Ray restarts it if its process crashes."""
    import ray

    opts: dict[str, Any] = {"num_cpus": 0, "max_restarts": -1}
    if name is not None:
        opts.update(name=name, get_if_exists=True)
    return ray.remote(CountsBoard).options(**opts).remote(list(replicas), quarantine_s, member_ttl_s)


def make_board_router(
    replicas: Iterable[str],
    *,
    actor_name: str | None = None,
    sync_interval_s: float = 0.01,
    board_timeout_s: float = 2.0,
    **options: Any,
) -> BoardStickyRouter:
    """Start (or, with ``actor_name``, join) a counts board and return this process's router.
    ``options`` are :class:`StickyRouter` keyword arguments. A joined board keeps its membership
    and quarantine cool-down."""
    names = list(replicas)
    member_ttl_s = max(5.0, 100 * sync_interval_s)
    board = make_board(names, quarantine_s=options.get("quarantine_s", 60.0), member_ttl_s=member_ttl_s, name=actor_name)
    return BoardStickyRouter(
        names,
        board=board,
        board_name=actor_name,
        sync_interval_s=sync_interval_s,
        board_timeout_s=board_timeout_s,
        member_ttl_s=member_ttl_s,
        **options,
    )
