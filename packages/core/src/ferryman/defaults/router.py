"""Core's default router: sticky per request id (LRU), least in flight for new request ids.

It lives in the process that generates (the Rollouter), so a decision is a dict lookup. The
``ferryman-router`` plugin adds rebalancing, quarantine and a shared actor for many processes.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Any, Literal

from pydantic import Field

import ferryman
from ferryman.config import PluginConfig
from ferryman.specs import RouterSpec


class LocalRouterConfig(PluginConfig):
    type: Literal["local"] = "local"
    sticky_capacity: int = Field(10_000, ge=1)
    """How many request ids the LRU remembers."""


class NoReplicaError(RuntimeError):
    """Every replica has been removed or reported as failed."""


class LocalRouter:
    def __init__(self, replicas: list[str], sticky_capacity: int = 10_000) -> None:
        if len(set(replicas)) != len(replicas):
            raise ValueError(f"LocalRouter: duplicate replica names in {replicas}")
        self.capacity = sticky_capacity
        self.in_flight: dict[str, int] = {r: 0 for r in replicas}
        self.failed: set[str] = set()
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._tiebreak = itertools.count()
        self._order: dict[str, int] = {}
        self._index = {r: i for i, r in enumerate(replicas)}
        self._heap: list[tuple[int, int, int, str]] = []
        """Lazy min-heap of ``(in_flight, last chosen, index, replica)``: the least loaded
        healthy replica in O(log n) (stale entries are dropped when they reach the top)."""
        self._rebuild()
        self.sticky_hits = 0
        self.decisions = 0

    @classmethod
    def from_config(cls, config: LocalRouterConfig, *, replicas: list[str], **_: Any) -> LocalRouter:
        return cls(list(replicas), config.sticky_capacity)

    def _healthy(self) -> list[str]:
        return [r for r in self.in_flight if r not in self.failed]

    def _entry(self, r: str) -> tuple[int, int, int, str]:
        return (self.in_flight[r], self._order.get(r, -1), self._index.setdefault(r, len(self._index)), r)

    def _rebuild(self) -> None:
        self._heap = [self._entry(r) for r in self._healthy()]
        heapq.heapify(self._heap)

    def _push(self, r: str) -> None:
        if r not in self.failed and r in self.in_flight:
            heapq.heappush(self._heap, self._entry(r))
            if len(self._heap) > 4 * len(self.in_flight) + 64:
                self._rebuild()

    def _least_loaded(self) -> str:
        """Least in flight; ties go to the replica chosen least recently (then the first)."""
        heap = self._heap
        while heap:
            load, stamp, _, r = heap[0]
            if r in self.in_flight and r not in self.failed and load == self.in_flight[r] and stamp == self._order.get(r, -1):
                return r
            heapq.heappop(heap)
        raise NoReplicaError("no healthy engine replica left")

    async def acquire(self, request_id: str) -> str:
        if len(self.failed) >= len(self.in_flight):
            raise NoReplicaError("no healthy engine replica left")
        self.decisions += 1
        replica = self._sticky.get(request_id)
        if replica is not None and replica in self.in_flight and replica not in self.failed:
            self._sticky.move_to_end(request_id)
            self.sticky_hits += 1
        else:
            replica = self._least_loaded()
            self._order[replica] = next(self._tiebreak)
            self._sticky[request_id] = replica
            self._sticky.move_to_end(request_id)
            while len(self._sticky) > self.capacity:
                self._sticky.popitem(last=False)
        self.in_flight[replica] += 1
        self._push(replica)
        return replica

    async def release(self, request_id: str, replica: str) -> None:
        if self.in_flight.get(replica, 0) > 0:
            self.in_flight[replica] -= 1
            self._push(replica)

    async def add_replica(self, replica: str) -> None:
        self.in_flight.setdefault(replica, 0)
        self.failed.discard(replica)
        self._push(replica)

    async def remove_replica(self, replica: str) -> None:
        self.in_flight.pop(replica, None)
        self.failed.discard(replica)

    async def report_failure(self, replica: str, error: str) -> None:
        if replica in self.in_flight:
            self.failed.add(replica)

    async def stats(self) -> dict[str, float]:
        out = {f"router/in_flight/{r}": float(n) for r, n in self.in_flight.items()}
        out["router/decisions"] = float(self.decisions)
        out["router/sticky_hits"] = float(self.sticky_hits)
        out["router/failed_replicas"] = float(len(self.failed))
        return out


@ferryman.hookimpl
def ferryman_register_routers() -> list[RouterSpec]:
    return [RouterSpec("local", LocalRouter.from_config, LocalRouterConfig, "sticky LRU + least in flight, in-process")]
