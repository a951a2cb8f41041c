"""The in-process StickyRouter: LRU, ties, rebalancing, quarantine, hash mode, membership."""

from __future__ import annotations

from collections import Counter

import pytest

from ferryman_router import NoReplicaError, StickyRouter


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def in_flight(router: StickyRouter) -> dict[str, float]:
    return {k.rsplit("/", 1)[1]: v for k, v in router.stats_nowait().items() if k.startswith("router/in_flight/")}


# ---------------------------------------------------------------------------- stickiness & LRU


async def test_every_turn_of_a_session_sticks_while_the_lru_holds_it():
    r = StickyRouter([f"r{i}" for i in range(4)], rebalance=False)
    home = {}
    for turn in range(5):
        for s in range(40):
            rep = await r.acquire(f"s{s}")
            assert home.setdefault(s, rep) == rep
            await r.release(f"s{s}", rep)
    st = await r.stats()
    assert st["router/sticky_hits"] == 4 * 40 and st["router/new_sessions"] == 40
    assert st["router/sticky_hit_rate"] == 1.0


async def test_lru_evicts_the_least_recently_used_session():
    r = StickyRouter(["a", "b", "c"], sticky_capacity=2, rebalance=False)
    for rid in ("x", "y"):
        await r.release(rid, await r.acquire(rid))
    await r.release("x", await r.acquire("x"))  # x is now the most recent
    await r.release("z", await r.acquire("z"))  # evicts y, not x
    assert r.replica_of("x") is not None and r.replica_of("z") is not None
    assert r.replica_of("y") is None
    st = await r.stats()
    assert st["router/lru_evictions"] == 1 and st["router/sticky_sessions"] == 2
    await r.acquire("y")  # a forgotten session is routed as new
    assert (await r.stats())["router/new_sessions"] == 4


async def test_capacity_bounds_the_table():
    r = StickyRouter(["a", "b"], sticky_capacity=100)
    for i in range(1000):
        await r.release(f"t{i}", await r.acquire(f"t{i}"))
    st = await r.stats()
    assert st["router/sticky_sessions"] == 100 and st["router/lru_evictions"] == 900


# ---------------------------------------------------------------------------- ties


async def test_idle_ties_rotate_evenly():
    names = [f"r{i}" for i in range(4)]
    r = StickyRouter(names)
    picks = []
    for i in range(100):
        rep = await r.acquire(f"t{i}")
        picks.append(rep)
        await r.release(f"t{i}", rep)
    assert Counter(picks) == dict.fromkeys(names, 25)
    assert picks[:4] == names, "a full round before any replica repeats"


async def test_ties_rotate_among_the_least_loaded_only():
    r = StickyRouter(["a", "b", "c"])
    busy = await r.acquire("busy")  # one replica has a request in flight
    picks = []
    for i in range(10):
        rep = await r.acquire(f"t{i}")
        picks.append(rep)
        await r.release(f"t{i}", rep)
    assert busy not in picks
    assert abs(picks.count(picks[0]) - picks.count(picks[1])) <= 1 and len(set(picks)) == 2


async def test_a_newly_added_replica_takes_new_sessions_first():
    r = StickyRouter(["a", "b"])
    for i in range(6):
        await r.acquire(f"t{i}")  # a: 3, b: 3
    await r.add_replica("c")
    assert [await r.acquire(f"n{i}") for i in range(3)] == ["c", "c", "c"]
    assert in_flight(r) == {"a": 3, "b": 3, "c": 3}


# ---------------------------------------------------------------------------- release accounting


async def test_stale_and_duplicate_releases_never_go_negative_or_steal():
    r = StickyRouter(["a", "b"])
    x = await r.acquire("x")
    y = await r.acquire("y")
    await r.release("x", x)
    await r.release("x", x)  # duplicate
    await r.release("nobody", y)  # never acquired
    await r.release("y", "ghost")  # unknown replica
    assert in_flight(r) == {x: 0, y: 1}, "y's count must survive the bogus releases"
    assert (await r.stats())["router/stale_releases"] == 3
    await r.release("y", y)
    assert set(in_flight(r).values()) == {0}


async def test_same_request_id_twice_in_flight_counts_twice():
    r = StickyRouter(["a", "b"])
    one = await r.acquire("t")
    two = await r.acquire("t")
    assert one == two and in_flight(r)[one] == 2
    await r.release("t", one)
    assert in_flight(r)[one] == 1
    await r.release("t", one)
    assert in_flight(r)[one] == 0


# ---------------------------------------------------------------------------- rebalancing


async def _pile_on(r: StickyRouter, replica: str, n: int, prefix: str = "load") -> list[str]:
    """Put ``n`` requests in flight on ``replica`` by making it the only choice for a moment."""
    others = [name for name in in_flight(r) if name != replica]
    for o in others:
        r.report_failure_nowait(o, "test: hold back")
    ids = [f"{prefix}{i}" for i in range(n)]
    for rid in ids:
        assert await r.acquire(rid) == replica
    for o in others:
        await r.add_replica(o)
    return ids


async def test_session_moves_off_an_overloaded_replica():
    r = StickyRouter(["a", "b"], rebalance_threshold=2.0, rebalance_min_gap=4)
    home = await r.acquire("s")
    await r.release("s", home)
    other = "b" if home == "a" else "a"
    await _pile_on(r, home, 5)  # home: 5 in flight, other: 0 → (5+1)/(0+1) > 2 and gap 5 >= 4
    moved = await r.acquire("s")
    assert moved == other
    st = await r.stats()
    assert st["router/rebalances"] == 1
    await r.release("s", moved)
    assert await r.acquire("s") == other, "the session now sticks to its new replica"
    assert (await r.stats())["router/rebalances"] == 1


async def test_no_move_below_the_threshold_or_gap():
    r = StickyRouter(["a", "b"], rebalance_threshold=2.0, rebalance_min_gap=4)
    home = await r.acquire("s")
    await r.release("s", home)
    await _pile_on(r, home, 3)  # ratio 4 but gap 3 < 4
    assert await r.acquire("s") == home
    r2 = StickyRouter(["a", "b"], rebalance_threshold=2.0, rebalance_min_gap=1)
    home2 = await r2.acquire("s")
    await r2.release("s", home2)
    other2 = "b" if home2 == "a" else "a"
    ids = await _pile_on(r2, home2, 6)
    await _pile_on(r2, other2, 4, prefix="more")  # 6 vs 4: ratio 7/5 < 2
    assert await r2.acquire("s") == home2
    assert (await r.stats())["router/rebalances"] == 0 and (await r2.stats())["router/rebalances"] == 0
    assert ids


async def test_never_rebalances_when_off():
    r = StickyRouter(["a", "b"], rebalance=False, rebalance_threshold=1.01, rebalance_min_gap=1)
    home = await r.acquire("s")
    await r.release("s", home)
    await _pile_on(r, home, 50)
    for _ in range(5):
        assert await r.acquire("s") == home
    assert (await r.stats())["router/rebalances"] == 0


# ---------------------------------------------------------------------------- quarantine


async def test_quarantine_reroutes_sessions_and_readmits_after_cooldown():
    clock = FakeClock()
    r = StickyRouter(["a", "b"], quarantine_s=30.0, clock=clock)
    on_a = [rid for rid in (f"s{i}" for i in range(6)) if await r.acquire(rid) == "a"]
    assert len(on_a) == 3
    await r.report_failure("a", "ConnectionError('engine died')")
    st = await r.stats()
    assert st["router/quarantined"] == 1 and st["router/healthy_replicas"] == 1
    for rid in on_a:
        assert await r.acquire(rid) == "b", "a session of a quarantined replica continues elsewhere"
    assert (await r.stats())["router/failovers"] == 3
    assert all([await r.acquire(f"new{i}") == "b" for i in range(3)])
    # late releases from the failed replica still come back and are counted down
    for rid in on_a:
        await r.release(rid, "a")
    assert in_flight(r)["a"] == 0
    clock.now += 29.9
    assert await r.acquire("probe") == "b"
    clock.now += 0.2
    assert await r.acquire("fresh") == "a", "re-admitted after the cool-down, and idle"
    st = await r.stats()
    assert st["router/readmissions"] == 1 and st["router/quarantined"] == 0 and st["router/quarantines"] == 1
    assert r.describe()["a"]["last_error"] == "ConnectionError('engine died')"


async def test_failure_during_quarantine_restarts_the_cooldown():
    clock = FakeClock()
    r = StickyRouter(["a", "b"], quarantine_s=10.0, clock=clock)
    await r.report_failure("a", "first")
    clock.now += 8
    await r.report_failure("a", "second")
    clock.now += 8
    assert all([await r.acquire(f"t{i}") == "b" for i in range(3)])
    clock.now += 2.1
    assert await r.acquire("u") == "a"


async def test_no_cooldown_means_only_add_replica_readmits():
    clock = FakeClock()
    r = StickyRouter(["a", "b"], quarantine_s=None, clock=clock)
    await r.report_failure("a", "down")
    clock.now += 1e9
    assert all([await r.acquire(f"t{i}") == "b" for i in range(4)])
    await r.add_replica("a")
    assert await r.acquire("fresh") == "a"


async def test_all_quarantined_raises_naming_the_errors():
    r = StickyRouter(["a", "b"])
    await r.report_failure("a", "oom")
    await r.report_failure("b", "timeout")
    with pytest.raises(NoReplicaError, match=r"a: oom.*b: timeout"):
        await r.acquire("t")
    assert isinstance(NoReplicaError("x"), RuntimeError)
    await r.report_failure("nonexistent", "ignored")  # unknown names change nothing


async def test_a_stalled_replica_is_quarantined():
    clock = FakeClock()
    r = StickyRouter(["a", "b"], stall_timeout_s=5.0, clock=clock)
    s = await r.acquire("s")  # on one replica, never released: it hangs
    other = "b" if s == "a" else "a"
    await r.release("x", await r.acquire("x"))
    clock.now += 4
    assert await r.acquire("s") == s
    clock.now += 2  # 6 s since the stuck replica last made progress
    assert await r.acquire("s") == other
    st = await r.stats()
    assert st["router/quarantined"] == 1 and st["router/failovers"] == 1
    assert "stalled" in r.describe()[s]["last_error"]
    # the healthy one is busy but releasing: never counted as stalled
    for i in range(3):
        clock.now += 4
        rid = await r.acquire(f"y{i}")
        await r.release(f"y{i}", rid)
    assert (await r.stats())["router/quarantines"] == 1


# ---------------------------------------------------------------------------- membership


async def test_remove_replica_at_run_time():
    r = StickyRouter(["a", "b", "c"])
    homes = {f"s{i}": await r.acquire(f"s{i}") for i in range(6)}
    await r.remove_replica("b")
    for rid, home in homes.items():
        rep = await r.acquire(rid)
        assert rep != "b"
        if home != "b":
            assert rep == home
        await r.release(rid, home)  # the first turn's release; b's are late and ignored
    st = await r.stats()
    assert "router/in_flight/b" not in st and st["router/replicas"] == 2
    assert st["router/failovers"] == 2 and st["router/stale_releases"] == 2
    assert min(v for k, v in st.items() if k.startswith("router/in_flight/")) >= 0
    await r.remove_replica("b")  # twice: nothing happens
    await r.add_replica("b")
    assert await r.acquire("fresh") == "b"


async def test_remove_every_replica_then_add_one():
    r = StickyRouter(["a"])
    await r.remove_replica("a")
    with pytest.raises(NoReplicaError, match="removed"):
        await r.acquire("t")
    await r.add_replica("z")
    assert await r.acquire("t") == "z"


# ---------------------------------------------------------------------------- hash mode


async def test_hash_mode_is_deterministic_and_order_free():
    names = [f"replica-{i}" for i in range(8)]
    r1 = StickyRouter(names, mode="hash", seed=7)
    r2 = StickyRouter(list(reversed(names)), mode="hash", seed=7)
    ids = [f"traj-{i}" for i in range(500)]
    m1 = [await r1.acquire(i) for i in ids]
    # r2 sees a different history (releases, other traffic) and the same answers
    for i in range(50):
        await r2.acquire(f"noise{i}")
    m2 = [await r2.acquire(i) for i in ids]
    assert m1 == m2
    counts = Counter(m1)
    assert len(counts) == 8 and min(counts.values()) > 30, counts
    r3 = StickyRouter(names, mode="hash", seed=8)
    m3 = [await r3.acquire(i) for i in ids]
    assert sum(a != b for a, b in zip(m1, m3, strict=True)) > 300, "the seed changes the mapping"


async def test_hash_mode_moves_only_the_sessions_of_a_lost_replica():
    names = [f"replica-{i}" for i in range(8)]
    r = StickyRouter(names, mode="hash")
    ids = [f"traj-{i}" for i in range(400)]
    before = {i: await r.acquire(i) for i in ids}
    await r.report_failure("replica-3", "down")
    after = {i: await r.acquire(i) for i in ids}
    for i in ids:
        if before[i] == "replica-3":
            assert after[i] != "replica-3"
        else:
            assert after[i] == before[i]
    await r.add_replica("replica-3")
    assert {i: await r.acquire(i) for i in ids} == before
    st = await r.stats()
    assert st["router/rebalances"] == 0


async def test_hash_mode_ignores_load():
    r = StickyRouter(["a", "b"], mode="hash", rebalance=True, rebalance_min_gap=1, rebalance_threshold=1.01)
    home = await r.acquire("s")
    for i in range(40):
        await r.acquire(f"s{i}")
    assert all([await r.acquire("s") == home for _ in range(5)])
