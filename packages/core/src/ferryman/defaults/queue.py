"""The MessageQueue: a bounded FIFO of Samples, one in and one out.

``MessageQueue`` is a plain asyncio object (a deque guarded by one ``asyncio.Condition``).
The default ``ray`` queue runs it inside an async Ray actor so the Rollouter and the Trainer,
in other processes, share one instance; ``local`` uses it in-process (tests, single process).
Unlike VeRL's queue, a full queue never drops a sample: ``put`` waits (back-pressure).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, Literal

from pydantic import Field

import ferryman
from ferryman import trace
from ferryman.config import PluginConfig
from ferryman.specs import QueueSpec
from ferryman.types import Sample


class MessageQueueConfig(PluginConfig):
    type: Literal["ray", "local"] = "ray"
    maxsize: int | None = Field(None, ge=1)
    """Capacity; default: the funnel's ``max_queue_size``."""


class MessageQueue:
    def __init__(self, maxsize: int, trace_to: tuple[str, str] | None = None) -> None:
        if maxsize < 1:
            raise ValueError(f"MessageQueue: maxsize must be >= 1, got {maxsize}")
        if trace_to is not None:  # (run_dir, level): trace put/get from this process
            trace.configure(trace_to[0], trace_to[1], proc="queue")
        self.maxsize = maxsize
        self._items: deque[Sample] = deque()
        self._cond = asyncio.Condition()
        self._closed = False
        self.total_put = 0
        self.total_get = 0
        self._put_wait_s = 0.0
        self._get_wait_s = 0.0

    async def put(self, sample: Sample) -> bool:
        t0 = time.monotonic()
        async with self._cond:
            await self._cond.wait_for(lambda: self._closed or len(self._items) < self.maxsize)
            self._put_wait_s += time.monotonic() - t0
            if self._closed:
                return False
            self._items.append(sample)
            self.total_put += 1
            trace.instant("queue.put", uid=sample.uid, qsize=len(self._items), wait=time.monotonic() - t0)
            self._cond.notify_all()
            return True

    async def get(self, timeout: float | None = None) -> Sample | None:
        t0 = time.monotonic()
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self._closed or bool(self._items)), timeout)
            except TimeoutError:
                return None
            finally:
                self._get_wait_s += time.monotonic() - t0
            if not self._items:
                return None
            sample = self._items.popleft()
            self.total_get += 1
            trace.instant("queue.get", uid=sample.uid, qsize=len(self._items), wait=time.monotonic() - t0)
            self._cond.notify_all()
            return sample

    async def qsize(self) -> int:
        return len(self._items)

    async def close(self) -> None:
        async with self._cond:
            self._closed = True
            self._cond.notify_all()
        trace.flush()

    async def snapshot(self) -> list[Sample]:
        return list(self._items)

    async def stats(self) -> dict[str, float]:
        return {
            "queue/size": float(len(self._items)),
            "queue/maxsize": float(self.maxsize),
            "queue/total_put": float(self.total_put),
            "queue/total_get": float(self.total_get),
            "queue/put_wait_s": self._put_wait_s,
            "queue/get_wait_s": self._get_wait_s,
            "queue/closed": 1.0 if self._closed else 0.0,
        }


class RayQueue:
    """Client of a MessageQueue living in an async Ray actor. Picklable: pass it to actors."""

    def __init__(self, maxsize: int, actor: Any = None, trace_to: tuple[str, str] | None = None) -> None:
        import ray

        self.maxsize = maxsize
        if actor is None:
            from ferryman.cluster import control_actor_options

            # on the driver's node when the runner asks for it (ray.control_on_driver_node)
            opts = {"num_cpus": 0, "max_concurrency": 1000, **control_actor_options()}
            actor = ray.remote(**opts)(MessageQueue).remote(maxsize, trace_to)
        self._actor = actor

    async def put(self, sample: Sample) -> bool:
        return await self._actor.put.remote(sample)

    async def get(self, timeout: float | None = None) -> Sample | None:
        return await self._actor.get.remote(timeout)

    async def qsize(self) -> int:
        return await self._actor.qsize.remote()

    async def close(self) -> None:
        await self._actor.close.remote()

    async def snapshot(self) -> list[Sample]:
        return await self._actor.snapshot.remote()

    async def stats(self) -> dict[str, float]:
        return await self._actor.stats.remote()


def make_queue(
    config: MessageQueueConfig, *, maxsize: int, trace_to: tuple[str, str] | None = None, **_: Any
) -> MessageQueue | RayQueue:
    size = config.maxsize or maxsize
    return RayQueue(size, trace_to=trace_to) if config.type == "ray" else MessageQueue(size)


@ferryman.hookimpl
def ferryman_register_queues() -> list[QueueSpec]:
    return [
        QueueSpec("ray", make_queue, MessageQueueConfig, "bounded FIFO in an async Ray actor (default)"),
        QueueSpec("local", make_queue, MessageQueueConfig, "bounded FIFO in this process"),
    ]
