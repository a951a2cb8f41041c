"""The sticky router: its whole state and every decision, in one plain object.

One :class:`StickyRouter` holds

- the **sticky table**, an LRU ``request id → replica`` (``sticky_capacity`` entries), so that
  every turn of a trajectory (and every partial-rollout resume) lands on the replica that holds
  its KV cache;
- per replica: requests **in flight**, and which request ids they belong to (so that a release
  that does not match an acquire, e.g. a duplicate or one for a removed replica, changes
  nothing instead of stealing another request's count);
- the **quarantine**: replicas that reported failures (or stalled), until their cool-down ends.

A new session goes to the healthy replica with the fewest requests in flight; among equals, to
the one picked least recently (so ties rotate instead of always going to the first). A known
session goes back to its replica unless that replica is quarantined or removed (then it is
re-routed: ``router/failovers``), or, with rebalancing on, unless its replica is overloaded
compared with the least loaded one (then it moves and loses its cache knowingly:
``router/rebalances``). ``mode="hash"`` replaces all of this by rendezvous hashing.

Every method is synchronous underneath (the ``*_nowait`` forms); the async methods of the Router
protocol call them without awaiting anything, so in one event loop a decision is atomic and a
release never makes its caller wait. :mod:`ferryman_router.shared` hosts the same object in a Ray
actor for several processes.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Literal

from ferryman.defaults.router import NoReplicaError

__all__ = ["NoReplicaError", "StickyRouter"]


class _Replica:
    __slots__ = ("active", "hash_key", "healthy", "in_flight", "last_pick", "last_progress", "name", "order", "remote", "until")

    def __init__(self, name: str, hash_key: bytes) -> None:
        self.name = name
        self.hash_key = hash_key
        self.in_flight = 0
        """Requests this router handed out to it and that are not released yet (exact)."""
        self.remote = 0
        """Requests in flight on it from other routing processes, as last heard from a counts
        board (:mod:`ferryman_router.board`); always 0 for a router that shares nothing.
        Decisions weigh ``in_flight + remote``."""
        self.active: dict[str, int] = {}
        """request id → requests of it in flight here."""
        self.last_pick = -1
        self.order = 0
        """Position among the replicas (the last tie-break: the first added wins)."""
        """Tie-break stamp: increases each time a replica gets a new session; lowest wins a tie."""
        self.healthy = True
        self.until = 0.0
        """While quarantined: the monotonic time it may come back (``inf``: only by add_replica)."""
        self.last_progress = 0.0
        """Stall detection: when it last released a request or went from idle to busy."""


class StickyRouter:
    """Sticky, load-aware replica selection. See the module docstring.

    :param replicas: replica names (unique).
    :param sticky_capacity: LRU size of the request-id → replica table.
    :param mode: ``"least_in_flight"`` or ``"hash"``.
    :param rebalance: move sticky sessions off overloaded replicas (ignored in hash mode).
    :param rebalance_threshold: move when ``(in_flight[r] + 1) / (min in_flight + 1)`` exceeds it…
    :param rebalance_min_gap: …and ``in_flight[r] - min in_flight`` is at least this.
    :param quarantine_s: cool-down after a failure; ``None``: until ``add_replica``.
    :param stall_timeout_s: quarantine a replica with work in flight that released nothing for
        this long; ``None``: off.
    :param seed: salt of the hash in hash mode.
    :param clock: monotonic clock (tests pass a fake one).
    """

    def __init__(
        self,
        replicas: Iterable[str],
        *,
        sticky_capacity: int = 10_000,
        mode: Literal["least_in_flight", "hash"] = "least_in_flight",
        rebalance: bool = True,
        rebalance_threshold: float = 2.0,
        rebalance_min_gap: int = 6,
        quarantine_s: float | None = 60.0,
        stall_timeout_s: float | None = None,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        names = list(replicas)
        if len(set(names)) != len(names):
            raise ValueError(f"StickyRouter: duplicate replica names in {names}")
        if sticky_capacity < 1:
            raise ValueError(f"StickyRouter: sticky_capacity must be >= 1, got {sticky_capacity}")
        if mode not in ("least_in_flight", "hash"):
            raise ValueError(f"StickyRouter: mode must be 'least_in_flight' or 'hash', got {mode!r}")
        if not rebalance_threshold > 1.0:
            raise ValueError(f"StickyRouter: rebalance_threshold must be > 1, got {rebalance_threshold}")
        if rebalance_min_gap < 1:
            raise ValueError(f"StickyRouter: rebalance_min_gap must be >= 1, got {rebalance_min_gap}")
        if quarantine_s is not None and not quarantine_s > 0:
            raise ValueError(f"StickyRouter: quarantine_s must be > 0 or None, got {quarantine_s}")
        if stall_timeout_s is not None and not stall_timeout_s > 0:
            raise ValueError(f"StickyRouter: stall_timeout_s must be > 0 or None, got {stall_timeout_s}")
        self.capacity = sticky_capacity
        self.mode = mode
        self.hash_mode = mode == "hash"
        self.rebalance = rebalance and not self.hash_mode
        self.rebalance_threshold = float(rebalance_threshold)
        self.rebalance_min_gap = int(rebalance_min_gap)
        self.quarantine_s = quarantine_s
        self.stall_timeout_s = stall_timeout_s
        self.seed = seed
        self._clock = clock

        self._replicas: dict[str, _Replica] = {}
        self._healthy: list[_Replica] = []
        self._quarantined: dict[str, _Replica] = {}
        self._next_readmit = math.inf
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._stamp = itertools.count()
        self._order = itertools.count()
        self._heap: list[tuple[float, int, int, _Replica]] = []
        """Lazy min-heap of ``(load, last_pick, order, replica)`` over the healthy replicas: an
        entry is current while its load and stamp are the replica's; stale ones are dropped
        when they reach the top. The least loaded replica and the lowest load cost O(log n)
        instead of a pass over the fleet (per new session, and per sticky turn for rebalancing)."""

        self.decisions = 0
        self.sticky_hits = 0
        self.new_sessions = 0
        self.rebalances = 0
        self.failovers = 0
        self.lru_evictions = 0
        self.quarantines = 0
        self.readmissions = 0
        self.stale_releases = 0
        self.errors: dict[str, str] = {}
        """Last reported error per replica (for ``describe()``)."""

        for name in names:
            self._add(name)

    @classmethod
    def from_config(cls, config: Any, *, replicas: Iterable[str], seed: int = 0, **_: Any) -> StickyRouter:
        """Build from a :class:`~ferryman_router.config.StickyRouterConfig` (``shared`` ignored)."""
        from ferryman_router.factory import router_options

        return cls(replicas, **router_options(config, seed))

    # ------------------------------------------------------------------ membership & health
    def _add(self, name: str) -> _Replica:
        key = hashlib.blake2b(f"{self.seed}/{name}".encode(), digest_size=32).digest()
        rep = _Replica(name, key)
        rep.order = next(self._order)
        rep.last_progress = self._clock() if self.stall_timeout_s is not None else 0.0
        self._replicas[name] = rep
        self._rebuild_healthy()
        return rep

    def _rebuild_healthy(self) -> None:
        self._healthy = [r for r in self._replicas.values() if r.healthy]
        self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """After the healthy set or many loads changed at once (a counts-board view)."""
        self._heap = [(r.in_flight + r.remote, r.last_pick, r.order, r) for r in self._healthy]
        heapq.heapify(self._heap)

    def _push(self, rep: _Replica) -> None:
        """``rep``'s load or stamp changed."""
        if rep.healthy:
            heap = self._heap
            heapq.heappush(heap, (rep.in_flight + rep.remote, rep.last_pick, rep.order, rep))
            if len(heap) > 4 * len(self._healthy) + 64:  # stale entries: O(1) amortised
                self._rebuild_heap()

    def _top(self) -> _Replica | None:
        """The least loaded healthy replica (ties: the least recently picked, then the first)."""
        heap = self._heap
        replicas = self._replicas
        while heap:
            load, stamp, _, rep = heap[0]
            if rep.healthy and stamp == rep.last_pick and load == rep.in_flight + rep.remote and replicas.get(rep.name) is rep:
                return rep
            heapq.heappop(heap)
        return None

    def _quarantine(self, rep: _Replica, reason: str) -> None:
        now = self._clock()
        until = math.inf if self.quarantine_s is None else now + self.quarantine_s
        self.errors[rep.name] = reason
        if rep.healthy:
            rep.healthy = False
            self.quarantines += 1
            self._quarantined[rep.name] = rep
            self._rebuild_healthy()
        rep.until = until  # a failure while quarantined restarts the cool-down
        self._next_readmit = min((r.until for r in self._quarantined.values()), default=math.inf)

    def _readmit_due(self) -> None:
        now = self._clock()
        if now < self._next_readmit:
            return
        for rep in list(self._quarantined.values()):
            if rep.until <= now:
                self._restore(rep)
                self.readmissions += 1
        self._next_readmit = min((r.until for r in self._quarantined.values()), default=math.inf)

    def _restore(self, rep: _Replica) -> None:
        rep.healthy = True
        rep.until = 0.0
        rep.last_progress = self._clock() if self.stall_timeout_s is not None else 0.0
        self._quarantined.pop(rep.name, None)
        self._rebuild_healthy()

    def add_replica_nowait(self, replica: str) -> None:
        """Add a replica, or re-admit a quarantined one now. Adding a healthy one does nothing."""
        rep = self._replicas.get(replica)
        if rep is None:
            self._add(replica)
        elif not rep.healthy:
            self._restore(rep)
            self._next_readmit = min((r.until for r in self._quarantined.values()), default=math.inf)

    def remove_replica_nowait(self, replica: str) -> None:
        """Forget a replica: its sessions are re-routed on their next turn, late releases for it
        are ignored. Removing an unknown replica does nothing."""
        rep = self._replicas.pop(replica, None)
        if rep is None:
            return
        self._quarantined.pop(replica, None)
        self.errors.pop(replica, None)
        self._next_readmit = min((r.until for r in self._quarantined.values()), default=math.inf)
        self._rebuild_healthy()

    def report_failure_nowait(self, replica: str, error: str) -> None:
        """Quarantine ``replica`` (unknown names are ignored); its sessions move on their next turn."""
        rep = self._replicas.get(replica)
        if rep is not None:
            self._quarantine(rep, error)

    # ------------------------------------------------------------------ decisions
    def _least_loaded(self, healthy: list[_Replica]) -> _Replica:
        if healthy is self._healthy:
            top = self._top()
            if top is not None:
                return top
        best = healthy[0]
        low = best.in_flight + best.remote
        for rep in healthy:
            load = rep.in_flight + rep.remote
            if load < low or (load == low and rep.last_pick < best.last_pick):
                best, low = rep, load
        return best

    def _hashed(self, request_id: str, healthy: list[_Replica]) -> _Replica:
        data = request_id.encode()
        best, best_score = healthy[0], b""
        for rep in healthy:
            score = hashlib.blake2b(data, digest_size=8, key=rep.hash_key).digest()
            if score > best_score:
                best, best_score = rep, score
        return best

    def _remember(self, request_id: str, name: str) -> None:
        sticky = self._sticky
        sticky[request_id] = name
        sticky.move_to_end(request_id)
        if len(sticky) > self.capacity:
            sticky.popitem(last=False)
            self.lru_evictions += 1

    def acquire_nowait(self, request_id: str) -> str:
        """The replica for ``request_id`` (counted in flight until :meth:`release_nowait`).

        :raises NoReplicaError: every replica is removed or quarantined.
        """
        if self._quarantined:
            self._readmit_due()
        healthy = self._healthy
        if not healthy:
            raise NoReplicaError(self._no_replica_message())
        self.decisions += 1
        prev = self._sticky.get(request_id)
        if self.hash_mode:
            rep = self._hashed(request_id, healthy)
            if prev is None:
                self.new_sessions += 1
            elif prev == rep.name:
                self.sticky_hits += 1
            else:
                self.failovers += 1
            self._remember(request_id, rep.name)
        elif prev is None:
            self.new_sessions += 1
            rep = self._pick_new(healthy)
            self._remember(request_id, rep.name)
        else:
            cur = self._replicas.get(prev)
            if cur is None or not cur.healthy:
                self.failovers += 1
                rep = self._pick_new(healthy)
            elif self.rebalance and self._overloaded(cur, healthy):
                self.rebalances += 1
                rep = self._pick_new(healthy)
            else:
                self.sticky_hits += 1
                rep = cur
            self._remember(request_id, rep.name)
        if self.stall_timeout_s is not None:
            rep = self._avoid_stalled(request_id, rep)
        rep.in_flight += 1
        self._push(rep)
        active = rep.active
        active[request_id] = active.get(request_id, 0) + 1
        return rep.name

    def _pick_new(self, healthy: list[_Replica]) -> _Replica:
        rep = self._least_loaded(healthy)
        rep.last_pick = next(self._stamp)
        return rep  # pushed with its new load by the caller

    def _lowest_load(self, healthy: list[_Replica]) -> float:
        top = self._top() if healthy is self._healthy else None
        return top.in_flight + top.remote if top is not None else min(r.in_flight + r.remote for r in healthy)

    def _overloaded(self, cur: _Replica, healthy: list[_Replica]) -> bool:
        load = cur.in_flight + cur.remote
        if load < self.rebalance_min_gap:
            return False
        low = self._lowest_load(healthy)
        return load - low >= self.rebalance_min_gap and (load + 1) > self.rebalance_threshold * (low + 1)

    def _avoid_stalled(self, request_id: str, rep: _Replica) -> _Replica:
        """Stall detection: a replica with work in flight that released nothing for
        ``stall_timeout_s`` is quarantined and the request goes elsewhere."""
        assert self.stall_timeout_s is not None
        now = self._clock()
        while rep.in_flight > 0 and now - rep.last_progress >= self.stall_timeout_s:
            self._quarantine(rep, f"stalled: {rep.in_flight} requests in flight, none released for {self.stall_timeout_s:g} s")
            if not self._healthy:
                raise NoReplicaError(self._no_replica_message())
            self.failovers += 1
            rep = self._hashed(request_id, self._healthy) if self.hash_mode else self._pick_new(self._healthy)
            self._remember(request_id, rep.name)
        if rep.in_flight == 0:
            rep.last_progress = now  # idle → busy: the stall clock starts now
        return rep

    def release_nowait(self, request_id: str, replica: str) -> None:
        """One request of ``request_id`` finished (in any way) on ``replica``. A release that
        matches no acquire (duplicate, unknown or removed replica) is ignored and counted in
        ``router/stale_releases``; counts never go negative."""
        rep = self._replicas.get(replica)
        n = rep.active.get(request_id, 0) if rep is not None else 0
        if rep is None or n == 0:
            self.stale_releases += 1
            return
        if n == 1:
            del rep.active[request_id]
        else:
            rep.active[request_id] = n - 1
        rep.in_flight -= 1
        self._push(rep)
        if self.stall_timeout_s is not None:
            rep.last_progress = self._clock()

    def _no_replica_message(self) -> str:
        if not self._replicas:
            return "no engine replica: every replica was removed"
        errs = "; ".join(f"{n}: {self.errors.get(n, '?')}" for n in self._quarantined)
        return f"no healthy engine replica: all {len(self._replicas)} are quarantined ({errs})"

    # ------------------------------------------------------------------ the Router protocol
    async def acquire(self, request_id: str) -> str:
        return self.acquire_nowait(request_id)

    async def release(self, request_id: str, replica: str) -> None:
        self.release_nowait(request_id, replica)

    async def add_replica(self, replica: str) -> None:
        self.add_replica_nowait(replica)

    async def remove_replica(self, replica: str) -> None:
        self.remove_replica_nowait(replica)

    async def report_failure(self, replica: str, error: str) -> None:
        self.report_failure_nowait(replica, error)

    async def stats(self) -> dict[str, float]:
        return self.stats_nowait()

    # ------------------------------------------------------------------ observation
    def stats_nowait(self) -> dict[str, float]:
        """Counters (monotonic totals) and gauges, as ``router/...`` metrics."""
        if self._quarantined:
            self._readmit_due()
        out = {f"router/in_flight/{r.name}": float(r.in_flight + r.remote) for r in self._replicas.values()}
        loads = [r.in_flight + r.remote for r in self._healthy]
        revisits = self.decisions - self.new_sessions
        out.update(
            {
                "router/decisions": float(self.decisions),
                "router/new_sessions": float(self.new_sessions),
                "router/sticky_hits": float(self.sticky_hits),
                "router/sticky_hit_rate": self.sticky_hits / revisits if revisits else 1.0,
                "router/rebalances": float(self.rebalances),
                "router/failovers": float(self.failovers),
                "router/lru_evictions": float(self.lru_evictions),
                "router/sticky_sessions": float(len(self._sticky)),
                "router/replicas": float(len(self._replicas)),
                "router/healthy_replicas": float(len(self._healthy)),
                "router/quarantined": float(len(self._quarantined)),
                "router/quarantines": float(self.quarantines),
                "router/readmissions": float(self.readmissions),
                "router/stale_releases": float(self.stale_releases),
                "router/load_imbalance": (max(loads) + 1) / (min(loads) + 1) if loads else 1.0,
            }
        )
        return out

    def replica_of(self, request_id: str) -> str | None:
        """The replica ``request_id`` would stick to (without counting a decision)."""
        return self._sticky.get(request_id)

    def describe(self) -> dict[str, Any]:
        """Replicas with their load and health, for debugging."""
        now = self._clock()
        return {
            r.name: {
                "in_flight": r.in_flight,
                "remote_in_flight": r.remote,
                "healthy": r.healthy,
                "readmit_in_s": None if r.healthy else (None if math.isinf(r.until) else max(0.0, r.until - now)),
                "last_error": self.errors.get(r.name),
            }
            for r in self._replicas.values()
        }
