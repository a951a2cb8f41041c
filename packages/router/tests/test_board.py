"""The counts-board form (``shared: true``, ``shared_mode: board``): local decisions, with the
in-flight counts, quarantines and membership of every routing process shared through a board
actor. Two Ray actors stand for two routing processes (e.g. two Rollouter or env-worker
processes); they share one board and must see each other's load and failures. A board that hangs
or dies must never hold up routing."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from ferryman.testing import RouterContract
from ferryman_router import BoardStickyRouter, StickyRouterConfig, make_router
from ferryman_router.board import make_board

pytestmark = pytest.mark.timeout(120)


async def remote(ref):
    """Await a Ray object ref from this test's event loop."""
    return await asyncio.wrap_future(ref.future())


def loads(stats: dict[str, float]) -> dict[str, float]:
    return {k.rsplit("/", 1)[1]: v for k, v in stats.items() if k.startswith("router/in_flight/")}


async def eventually(check, timeout_s: float, what: str, poll_s: float = 0.02):
    """Poll ``check`` (async, returns a truthy value when satisfied) for at most ``timeout_s``."""
    t0 = time.monotonic()
    while True:
        got = await check()
        if got:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(poll_s)


@pytest.fixture(scope="module")
def board(ray_local):
    """One board process for the module, reset for every test."""
    board = make_board(["a"])
    ray_local.get(board.describe.remote())
    yield board
    ray_local.kill(board)


@pytest.fixture
async def fresh_board(board, ray_local):
    """``make(replicas, **options)``: the board reset to ``replicas`` and a router of this
    process on it (a member joining a board adopts the board's membership)."""
    made: list[BoardStickyRouter] = []

    def make(replicas, **options):
        ray_local.get(board.reset.remote(list(replicas), options.get("quarantine_s", 60.0), 10.0))
        router = BoardStickyRouter(replicas, board=board, sync_interval_s=0.005, **options)
        made.append(router)
        return router

    yield make
    for router in made:
        await router.aclose()


class TestBoardStickyRouterContract(RouterContract):
    @pytest.fixture
    def make_router(self, fresh_board):
        return fresh_board


# ---------------------------------------------------------------------------- two processes


@pytest.fixture(scope="module")
def processes(ray_local):
    """Two Ray actors, each a routing process holding its own BoardStickyRouter."""

    class RoutingProcess:
        def __init__(self) -> None:
            self.router = None

        async def adopt(self, router) -> str:
            """``router`` arrives pickled: in this process it is a new member of its board."""
            if self.router is not None:
                await self.router.aclose()
            self.router = router
            await router.sync_now()
            return router.member

        async def acquire_many(self, request_ids):
            return [await self.router.acquire(rid) for rid in request_ids]

        async def release_many(self, pairs):
            for rid, rep in pairs:
                await self.router.release(rid, rep)

        async def call(self, method, *args):
            return await getattr(self.router, method)(*args)

        def describe(self):
            return self.router.describe()

        async def storm(self, seed: int, tag: str):
            """Generate through core's ServerClient and cancel a good share of the calls."""
            import random

            from ferryman.client import ServerClient
            from ferryman.engine_host import EngineHandle
            from ferryman.types import SamplingParams, TokenOutput

            gate = asyncio.Event()

            class TokenClock:
                """Test double of a replica (EchoEngine would import torch into this process):
                one token every 2 ms; answers of more than 10 tokens also wait for the end of the
                cancellation phase, so that phase always finds calls to cancel however slowly
                this machine runs it (short ones finish during it, as real ones would)."""

                async def generate(self, request_id, prompt_ids, params):
                    await asyncio.sleep(0.002 * params.max_tokens)
                    if params.max_tokens > 10:
                        await gate.wait()
                    return TokenOutput(token_ids=[1] * params.max_tokens, log_probs=[0.0] * params.max_tokens, stop_reason="length")

            rng = random.Random(seed)
            names = list(self.router.describe())
            engines = {n: EngineHandle(n, engine=TokenClock()) for n in names}
            client = ServerClient(self.router, engines, partial_rollout=False)
            tasks = [
                asyncio.ensure_future(client.generate(f"{tag}-{i % 40}", [1, 2], SamplingParams(max_tokens=rng.randint(1, 30))))
                for i in range(240)
            ]
            lowest = 0
            for _ in range(20):
                await asyncio.sleep(0.003)
                lowest = min(lowest, *(r["in_flight"] for r in self.router.describe().values()))
                for t in rng.sample(tasks, 12):
                    t.cancel()
            gate.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.drain()
            await self.router.sync_now()
            own = {name: r["in_flight"] for name, r in self.router.describe().items()}
            return {"lowest": lowest, "cancelled": sum(t.cancelled() for t in tasks), "stats": await self.router.stats(), "own": own}

        async def close(self):
            if self.router is not None:
                await self.router.aclose()
                self.router = None

    actor = ray_local.remote(num_cpus=0)(RoutingProcess)
    pa, pb = actor.remote(), actor.remote()
    yield pa, pb
    for p in (pa, pb):
        ray_local.kill(p)


@pytest.fixture
async def two(fresh_board, processes):
    """Two routing processes on a fresh board, each with its own router (same options)."""
    pa, pb = processes

    async def start(replicas, **options):
        template = fresh_board(replicas, **options)  # pickled into each process: two new members
        await asyncio.gather(remote(pa.adopt.remote(template)), remote(pb.adopt.remote(template)))
        return pa, pb

    yield start
    await asyncio.gather(remote(pa.close.remote()), remote(pb.close.remote()))


async def test_b_avoids_the_replica_loaded_by_a_after_one_refresh(two):
    pa, pb = await two(["x", "y"], rebalance=False)
    picks = await remote(pa.acquire_many.remote([f"a{i}" for i in range(8)]))
    assert sorted(picks) == ["x"] * 4 + ["y"] * 4
    loaded = picks[0]
    other = "y" if loaded == "x" else "x"
    # A keeps 4 requests on `loaded` and none on the other replica
    await remote(pa.release_many.remote([(f"a{i}", p) for i, p in enumerate(picks) if p == other]))
    assert await remote(pa.call.remote("sync_now"))  # A publishes…
    assert await remote(pb.call.remote("sync_now"))  # …B refreshes once
    # B's own load is 0 everywhere; only A's counts tell it where not to go
    assert await remote(pb.acquire_many.remote([f"b{i}" for i in range(4)])) == [other] * 4
    st = await remote(pb.call.remote("stats"))
    assert loads(st) == {loaded: 4.0, other: 4.0}, st
    assert st["router/board/members"] == 2 and st["router/board/remote_load"] == 4

    # without explicit syncs, the background task carries A's releases to B within a few periods
    await remote(pa.release_many.remote([(f"a{i}", p) for i, p in enumerate(picks) if p == loaded]))

    async def b_sees_a_idle():
        return (await remote(pb.call.remote("stats")))["router/board/remote_load"] == 0

    await eventually(b_sees_a_idle, 10, "B sees A's releases")


async def test_quarantine_and_membership_reported_in_a_are_honoured_by_b(two):
    pa, pb = await two(["x", "y", "z"], rebalance=False, quarantine_s=None)
    homes = await remote(pb.acquire_many.remote([f"s{i}" for i in range(6)]))
    await remote(pb.release_many.remote(list(zip([f"s{i}" for i in range(6)], homes, strict=True))))
    await remote(pa.call.remote("report_failure", "x", "ConnectionError('x died')"))
    assert await remote(pa.call.remote("sync_now"))
    assert await remote(pb.call.remote("sync_now"))
    desc = await remote(pb.describe.remote())
    assert desc["x"]["healthy"] is False and "x died" in desc["x"]["last_error"]
    # B's sessions that lived on x move; the others stay; new sessions avoid x
    again = await remote(pb.acquire_many.remote([f"s{i}" for i in range(6)]))
    for before, after in zip(homes, again, strict=True):
        assert after != "x" and (before == "x" or after == before)
    assert "x" not in await remote(pb.acquire_many.remote([f"n{i}" for i in range(6)]))
    st = await remote(pb.call.remote("stats"))
    assert st["router/board/remote_quarantines"] == 1 and st["router/failovers"] == homes.count("x")

    # B re-admits x, removes y and adds w: A follows
    await remote(pb.call.remote("add_replica", "x"))
    await remote(pb.call.remote("remove_replica", "y"))
    await remote(pb.call.remote("add_replica", "w"))
    assert await remote(pb.call.remote("sync_now"))
    assert await remote(pa.call.remote("sync_now"))
    desc = await remote(pa.describe.remote())
    assert set(desc) == {"x", "z", "w"} and all(r["healthy"] for r in desc.values())
    picks = await remote(pa.acquire_many.remote([f"m{i}" for i in range(30)]))
    assert set(picks) == {"x", "z", "w"}


async def test_counts_never_go_negative_under_cancellation_storms_in_two_processes(two, board):
    pa, pb = await two([f"r{i}" for i in range(4)], rebalance_min_gap=1, rebalance_threshold=1.1)
    storms = asyncio.gather(remote(pa.storm.remote(1, "a")), remote(pb.storm.remote(2, "b")))
    seen = []
    while not storms.done():  # the board's view while both processes cancel requests
        seen.append(await remote(board.describe.remote()))
        await asyncio.sleep(0.01)
    ra, rb = await storms
    for r in (ra, rb):
        assert r["lowest"] >= 0 and r["cancelled"] > 40, r
        assert r["stats"]["router/stale_releases"] == 0
        assert set(r["own"].values()) == {0}, r
    assert len(seen) > 3
    assert all(n >= 0 for d in seen for n in d["in_flight"].values())
    assert any(sum(d["in_flight"].values()) > 0 for d in seen), "the board saw the load"
    final = await remote(board.describe.remote())
    assert set(final["in_flight"].values()) == {0} and len(final["members"]) == 2


# ---------------------------------------------------------------------------- the board fails


async def test_routing_goes_on_when_the_board_hangs_or_dies(ray_local, caplog):
    board = make_board(["a", "b"])
    router = BoardStickyRouter(["a", "b"], board=board, sync_interval_s=0.01, board_timeout_s=0.3, rebalance=False)
    try:
        info = await remote(board.describe.remote())
        # another routing process has 5 requests on b
        await remote(board.sync.remote("other-process", {"a": 0, "b": 5}, [], 0))
        assert await router.sync_now()
        assert router.describe()["b"]["remote_in_flight"] == 5
        assert [await router.acquire(f"s{i}") for i in range(3)] == ["a"] * 3

        caplog.set_level(logging.WARNING, logger="ferryman_router.board")
        os.kill(info["pid"], signal.SIGSTOP)  # the board hangs
        try:
            t0 = time.perf_counter()
            picks = [await router.acquire(f"t{i}") for i in range(200)]
            assert time.perf_counter() - t0 < 1.0, "acquire never waits for the board"
            assert len(picks) == 200

            async def dropped():
                return (await router.stats())["router/board/connected"] == 0

            await eventually(dropped, 10, "remote counts dropped")
            assert router.describe()["b"]["remote_in_flight"] == 0
            assert any("unreachable" in r.getMessage() for r in caplog.records)
        finally:
            os.kill(info["pid"], signal.SIGCONT)

        async def back():
            return (await router.stats())["router/board/connected"] == 1

        await eventually(back, 20, "reconnected after the board resumed")
        assert router.describe()["b"]["remote_in_flight"] == 5, "the other process's counts are back"

        ray_local.kill(board)  # the board dies for good (unnamed, no restart)
        failures = (await router.stats())["router/board/sync_failures"]
        for i in range(50):
            rep = await router.acquire(f"u{i}")
            await router.release(f"u{i}", rep)
            await asyncio.sleep(0.01)
        st = await router.stats()
        assert st["router/board/sync_failures"] > failures
        assert st["router/decisions"] == 3 + 200 + 50
    finally:
        await router.aclose()


async def test_a_named_board_that_dies_is_recreated_with_the_quarantines(ray_local):
    cfg = StickyRouterConfig(shared=True, actor_name="ferryman-board-test", sync_interval_ms=10, board_timeout_s=0.5, quarantine_s=None)
    router = make_router(cfg, replicas=["a", "b", "c"])
    assert isinstance(router, BoardStickyRouter)
    try:
        await router.report_failure("c", "down")
        assert await router.sync_now()
        first = await remote(router.board.describe.remote())
        assert first["quarantined"] == {"c": "down"}
        ray_local.kill(router.board)

        async def rejoined():
            await router.acquire("probe")  # routing goes on meanwhile (and starts the sync task)
            await router.release("probe", "a")
            return router.board_restarts >= 1 and router.connected and router._handover is None

        await eventually(rejoined, 60, "the named board re-created and re-joined", poll_s=0.05)
        desc = await remote(router.board.describe.remote())
        assert desc["incarnation"] != first["incarnation"]
        assert desc["quarantined"] == {"c": "down"}, "handed over by the member"
        # a process joining now learns the quarantine from the new board
        joined = make_router(cfg, replicas=["a", "b", "c"])
        try:
            assert await joined.sync_now()
            assert "c" not in {await joined.acquire(f"j{i}") for i in range(10)}
        finally:
            await joined.aclose()
    finally:
        await router.aclose()
        ray_local.kill(router.board)


async def test_the_factory_joins_a_named_board_across_routers(ray_local):
    cfg = StickyRouterConfig(shared=True, actor_name="ferryman-board-join", rebalance=False)
    r1 = make_router(cfg, replicas=["a", "b"])
    r2 = make_router(cfg, replicas=["a", "b"])
    try:
        held = [await r1.acquire(f"s{i}") for i in range(2)]  # one on a, one on b
        await r1.release("s0", held[0])  # r1 keeps one request on held[1]
        assert await r1.sync_now() and await r2.sync_now()
        assert await r2.acquire("new") == held[0]
        assert (await r2.stats())["router/board/members"] == 2
    finally:
        await r1.aclose()
        await r2.aclose()
        ray_local.kill(r1.board)


# ---------------------------------------------------------------------------- how views are read (no board needed)


def test_a_lasting_overload_moves_a_session_a_single_noisy_view_does_not():
    r = BoardStickyRouter(["a", "b"], board=None, rebalance_min_gap=6, rebalance_threshold=2.0)
    home = r.acquire_nowait("s")
    r.release_nowait("s", home)
    other = "b" if home == "a" else "a"
    for _ in range(3):
        r._set_remote({home: 5, other: 5})  # white box: views as the sync task applies them
    r._set_remote({home: 13, other: 0})  # one view says home is overloaded: could be noise
    assert r.acquire_nowait("s") == home and r.rebalances == 0
    r.release_nowait("s", home)
    for _ in range(3):
        r._set_remote({home: 13, other: 0})  # …it lasts
    assert r.acquire_nowait("s") == other and r.rebalances == 1


def test_placement_trusts_the_latest_view_as_far_as_requests_outlive_it():
    r = BoardStickyRouter(["a", "b"], board=None, sync_interval_s=0.01)
    # lifetime by Little's law: 100 requests finished in 1 s with 10 in flight -> 0.1 s
    r._observe_requests(0.0, 10, 0)
    r._observe_requests(1.0, 10, 100)
    assert r.request_s == pytest.approx(0.1)
    r._rtt_s = 0.005
    for _ in range(3):
        r._set_remote({"a": 0, "b": 0})
    r.request_s = 10.0  # LLM turns of seconds: a 10 ms old view is as good as exact
    r._set_remote({"a": 8, "b": 0})
    assert r.view_weight > 0.99 and r.describe()["a"]["remote_in_flight"] == pytest.approx(8, abs=0.02)
    r.request_s = 0.001  # requests far shorter than the view's age: it says little beyond the mean
    r._set_remote({"a": 8, "b": 0})
    assert r.view_weight < 1e-3 and r.describe()["a"]["remote_in_flight"] == pytest.approx(4, abs=0.01)
