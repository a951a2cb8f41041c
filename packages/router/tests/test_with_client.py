"""The router under core's ServerClient: release always happens, failed replicas are quarantined
and their sessions continue elsewhere, counters survive cancellation storms."""

from __future__ import annotations

import asyncio
import random

import pytest

from ferryman.client import ServerClient
from ferryman.engine_host import EngineHandle
from ferryman.testing.doubles import EchoEngine
from ferryman.types import SamplingParams
from ferryman_router import StickyRouter


class BrokenEngine(EchoEngine):
    """Fails every call with ``error`` (after a short while, like a dying replica)."""

    def __init__(self, error: BaseException, **kw) -> None:
        super().__init__(**kw)
        self.error = error

    async def generate(self, request_id, prompt_ids, params):
        await asyncio.sleep(0.002)
        raise self.error


def fleet(router, engines: dict[str, EchoEngine]) -> ServerClient:
    handles = {name: EngineHandle(name, engine=e) for name, e in engines.items()}
    return ServerClient(router, handles, partial_rollout=False)


def loads(stats: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in stats.items() if k.startswith("router/in_flight/")}


PARAMS = SamplingParams(max_tokens=4)


async def test_release_happens_when_generate_raises_bad_input():
    engines = {"a": BrokenEngine(ValueError("prompt too long")), "b": BrokenEngine(ValueError("prompt too long"))}
    router = StickyRouter(list(engines))
    client = fleet(router, engines)
    with pytest.raises(ValueError, match="prompt too long"):
        await client.generate("t", [1, 2], PARAMS)
    await client.drain()
    st = await router.stats()
    assert set(loads(st).values()) == {0.0} and st["router/decisions"] == 1
    assert st["router/quarantined"] == 0, "bad input is not the replica's fault"


async def test_release_happens_when_generate_is_cancelled():
    engines = {"a": EchoEngine(step_delay_s=0.01), "b": EchoEngine(step_delay_s=0.01)}
    router = StickyRouter(list(engines))
    client = fleet(router, engines)
    task = asyncio.ensure_future(client.generate("t", [1, 2], SamplingParams(max_tokens=1000)))
    await asyncio.sleep(0.03)
    assert sum(loads(await router.stats()).values()) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await client.drain()
    assert set(loads(await router.stats()).values()) == {0.0}


async def test_a_dead_replica_is_quarantined_and_sessions_continue_elsewhere():
    engines = {
        "r0": EchoEngine(step_delay_s=0.001),
        "r1": BrokenEngine(ConnectionError("replica r1 died")),
        "r2": EchoEngine(step_delay_s=0.001),
    }
    router = StickyRouter(list(engines), quarantine_s=3600, rebalance=False)
    client = fleet(router, engines)

    async def session(i: int) -> list[str]:
        reps = []
        for _turn in range(3):
            out = await client.generate(f"traj-{i}", [1, 2, 3], PARAMS)
            reps.append(out.replica)
        return reps

    runs = await asyncio.gather(*(session(i) for i in range(12)))
    await client.drain()
    assert all(rep != "r1" for reps in runs for rep in reps), "every turn succeeded elsewhere"
    assert all(len(set(reps)) == 1 for reps in runs), "after failing over, a session sticks to its new replica"
    st = await router.stats()
    assert st["router/quarantined"] == 1 and router.describe()["r1"]["healthy"] is False
    assert "died" in router.describe()["r1"]["last_error"]
    assert set(loads(st).values()) == {0.0}
    assert client.num_failovers >= 1


@pytest.mark.parametrize("rebalance", [True, False])
async def test_counters_survive_a_cancellation_storm(rebalance):
    rng = random.Random(0)
    engines = {f"r{i}": EchoEngine(step_delay_s=0.0005) for i in range(4)}
    router = StickyRouter(list(engines), rebalance=rebalance, rebalance_min_gap=1, rebalance_threshold=1.1)
    client = fleet(router, engines)
    tasks = [
        asyncio.ensure_future(client.generate(f"traj-{i % 60}", [1, 2], SamplingParams(max_tokens=rng.randint(1, 30))))
        for i in range(300)
    ]
    for _ in range(20):
        await asyncio.sleep(0.002)
        st = await router.stats()
        assert min(loads(st).values()) >= 0
        for t in rng.sample(tasks, 12):
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.drain()
    st = await router.stats()
    assert set(loads(st).values()) == {0.0}, st
    assert st["router/stale_releases"] == 0
    assert sum(t.cancelled() for t in tasks) > 50
