"""Contract every Router passes. Subclass and provide a ``make_router`` fixture:
``make_router(replicas: list[str]) -> Router``."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from ferryman.protocols import Router


class RouterContract:
    async def test_is_a_router(self, make_router):
        assert isinstance(make_router(["a", "b"]), Router)

    async def test_sticky_per_request_id(self, make_router):
        r = make_router(["a", "b", "c"])
        first = await r.acquire("traj-1")
        await r.release("traj-1", first)
        for _ in range(5):
            # load elsewhere must not move an existing session in the default setting
            other = await r.acquire(f"other-{_}")
            again = await r.acquire("traj-1")
            assert again == first
            await r.release("traj-1", again)
            await r.release(f"other-{_}", other)

    async def test_new_sessions_spread_least_in_flight(self, make_router):
        r = make_router(["a", "b", "c", "d"])
        chosen = [await r.acquire(f"t{i}") for i in range(8)]
        assert Counter(chosen) == {"a": 2, "b": 2, "c": 2, "d": 2}

    async def test_ties_are_not_always_the_first(self, make_router):
        r = make_router(["a", "b", "c"])
        picks = []
        for i in range(6):
            rep = await r.acquire(f"t{i}")
            picks.append(rep)
            await r.release(f"t{i}", rep)
        assert len(set(picks)) == 3, f"idle ties must rotate, got {picks}"

    async def test_release_frees_capacity(self, make_router):
        r = make_router(["a", "b"])
        x = await r.acquire("x")
        y = await r.acquire("y")
        assert x != y
        await r.release("x", x)
        z = await r.acquire("z")
        assert z == x

    async def test_failed_replica_not_chosen(self, make_router):
        r = make_router(["a", "b"])
        first = await r.acquire("t")
        await r.release("t", first)
        await r.report_failure(first, "boom")
        for i in range(4):
            rep = await r.acquire(f"n{i}")
            assert rep != first
        assert await r.acquire("t") != first, "a session on a failed replica moves"

    async def test_add_and_remove_replica(self, make_router):
        r = make_router(["a"])
        await r.add_replica("b")
        picks = {await r.acquire(f"t{i}") for i in range(2)}
        assert picks == {"a", "b"}
        await r.remove_replica("a")
        assert all([await r.acquire(f"u{i}") == "b" for i in range(3)])

    async def test_no_replica_raises_clearly(self, make_router):
        r = make_router(["a"])
        await r.report_failure("a", "down")
        with pytest.raises(RuntimeError):
            await r.acquire("t")

    async def test_concurrent_acquire_release_balances(self, make_router):
        r = make_router(["a", "b"])

        async def one(i: int) -> None:
            rep = await r.acquire(f"c{i}")
            await asyncio.sleep(0)
            await r.release(f"c{i}", rep)

        await asyncio.gather(*(one(i) for i in range(100)))
        stats = await r.stats()
        in_flight = {k: v for k, v in stats.items() if "in_flight" in k}
        assert in_flight and all(v == 0 for v in in_flight.values()), stats
