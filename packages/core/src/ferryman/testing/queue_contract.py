"""Contract every Queue implementation passes. Subclass and provide a ``make_queue`` fixture
returning an async-free factory ``make_queue(maxsize) -> Queue``."""

from __future__ import annotations

import asyncio

import pytest

from ferryman.protocols import Queue
from ferryman.types import Sample, Trajectory


def _sample(i: int) -> Sample:
    return Sample(uid=f"s{i}", task_index=i, trajectories=[Trajectory(request_id=f"r{i}", prompt_ids=[1, 2])])


class QueueContract:
    async def test_is_a_queue(self, make_queue):
        assert isinstance(make_queue(2), Queue)

    async def test_fifo_one_in_one_out(self, make_queue):
        q = make_queue(8)
        for i in range(5):
            assert await q.put(_sample(i))
        assert await q.qsize() == 5
        got = [(await q.get()).uid for _ in range(5)]
        assert got == [f"s{i}" for i in range(5)]
        assert await q.qsize() == 0

    async def test_get_waits_until_put(self, make_queue):
        q = make_queue(2)
        getter = asyncio.ensure_future(q.get())
        await asyncio.sleep(0.05)
        assert not getter.done()
        await q.put(_sample(7))
        assert (await asyncio.wait_for(getter, 5)).uid == "s7"

    async def test_bounded_put_waits_and_loses_nothing(self, make_queue):
        q = make_queue(2)
        await q.put(_sample(0))
        await q.put(_sample(1))
        putter = asyncio.ensure_future(q.put(_sample(2)))
        await asyncio.sleep(0.05)
        assert not putter.done(), "put on a full queue must wait, not drop"
        assert (await q.get()).uid == "s0"
        assert await asyncio.wait_for(putter, 5) is True
        assert [(await q.get()).uid for _ in range(2)] == ["s1", "s2"]

    async def test_get_timeout_returns_none(self, make_queue):
        q = make_queue(2)
        assert await q.get(timeout=0.05) is None

    async def test_close_wakes_getters_and_refuses_puts(self, make_queue):
        q = make_queue(2)
        getter = asyncio.ensure_future(q.get())
        await asyncio.sleep(0.05)
        await q.close()
        assert await asyncio.wait_for(getter, 5) is None
        assert await q.put(_sample(1)) is False
        assert await q.qsize() == 0

    async def test_close_drains_remaining_first(self, make_queue):
        q = make_queue(4)
        await q.put(_sample(1))
        await q.close()
        assert (await q.get()).uid == "s1"
        assert await q.get() is None

    async def test_snapshot_does_not_remove(self, make_queue):
        q = make_queue(4)
        await q.put(_sample(1))
        await q.put(_sample(2))
        snap = await q.snapshot()
        assert [s.uid for s in snap] == ["s1", "s2"]
        assert await q.qsize() == 2

    async def test_stats_are_numbers(self, make_queue):
        q = make_queue(4)
        await q.put(_sample(1))
        stats = await q.stats()
        assert stats and all(isinstance(v, (int, float)) for v in stats.values())

    async def test_invalid_maxsize_rejected(self, make_queue):
        with pytest.raises(ValueError):
            make_queue(0)
