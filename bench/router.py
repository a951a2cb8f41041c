"""Benchmark of the sticky router (ferryman-router) on a simulated fleet.

Two parts, one run:

1. **Fleet.** 8 simulated engine replicas and 512 concurrent multi-turn agent sessions (a new one
   starts whenever one ends). Turn counts are long-tailed (Pareto), every session has its own
   long-tailed response length, and a request's service time grows with the number of requests
   in flight on its replica (a batched decoder slows down as its batch grows); a turn that lands
   on another replica than the session's previous turn re-prefills its whole context (a prefix
   cache miss). Tool time between turns is exponential. After the steady phase, admission stops
   (the end of a staleness window) and the tail drains. Every policy sees the same sessions.
   Printed per policy: decisions/s and p50/p99 ``acquire`` latency through the public API,
   stickiness (share of turns on the session's previous replica), load imbalance (max/min
   requests in flight across replicas, sampled every 5 ms; min counted as at least 1), rebalances,
   and the simulated turn throughput.

2. **Capacity.** Closed-loop callers doing acquire + release pairs back to back (sticky ids),
   in-process and through the Ray actor: the most pairs/s each form sustains, and its latency.

    .venv/bin/python bench/router.py                 # the full run (about 2 minutes)
    .venv/bin/python bench/router.py --duration 2    # quicker, noisier
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SRC = str(ROOT / "packages" / "router" / "src")
if importlib.util.find_spec("ferryman_router") is None:  # not installed in the venv yet
    sys.path.insert(0, SRC)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)

from ferryman_router import StickyRouter, StickyRouterConfig, make_router  # noqa: E402

REPLICAS = [f"replica-{i}" for i in range(8)]


@dataclass
class Workload:
    sessions: int = 512
    """Concurrent sessions."""
    decode_ms: float = 10.0
    """Service time of a request of an average session on an idle replica."""
    batch_knee: float = 16.0
    """Service time × (1 + in_flight / batch_knee): proportional to the replica's load."""
    prefill_ms_per_turn: float = 1.0
    """Prefix-cache miss: re-prefill costs this × turns of context so far × session weight."""
    think_ms: float = 60.0
    """Mean tool/agent time between turns (exponential)."""
    pareto_alpha: float = 1.3
    min_turns: int = 2
    max_turns: int = 200
    weight_sigma: float = 0.8
    """Per-session response length factor: lognormal(0, sigma), normalised to mean 1."""


@dataclass
class Session:
    sid: int
    turns: int
    weight: float
    rng: random.Random


def make_session(sid: int, w: Workload, seed: int) -> Session:
    rng = random.Random(seed * 1_000_003 + sid)
    turns = min(w.max_turns, int(w.min_turns / rng.random() ** (1 / w.pareto_alpha)))
    weight = rng.lognormvariate(0.0, w.weight_sigma) / math.exp(w.weight_sigma**2 / 2)
    return Session(sid, turns, weight, rng)


@dataclass
class Result:
    name: str
    decisions: int = 0
    wall_s: float = 0.0
    lat: list[float] = field(default_factory=list)
    same: int = 0
    revisits: int = 0
    turns_done: int = 0
    steady_turns: int = 0
    steady_s: float = 0.0
    imb_steady: list[float] = field(default_factory=list)
    imb_drain: list[float] = field(default_factory=list)
    sum_steady: dict[str, float] = field(default_factory=dict)
    sum_drain: dict[str, float] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    extra: str = ""
    steady_rebalances: float = 0.0
    steady_decisions: int = 0
    steady_same: int = 0
    steady_revisits: int = 0
    service_ms: list[float] = field(default_factory=list)
    lag: list[float] = field(default_factory=list)


def spread(sums: dict[str, float]) -> float:
    """max/min across replicas of the time-averaged requests in flight."""
    if not sums:
        return float("nan")
    return max(sums.values()) / max(1e-9, min(sums.values()))


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run_fleet(name: str, router: Any, *, sticky_ids: bool, w: Workload, steady_s: float, drain_s: float, seed: int) -> Result:
    res = Result(name)
    load = dict.fromkeys(REPLICAS, 0)  # ground truth: requests being served per replica
    pending: set[asyncio.Future[Any]] = set()
    running: set[asyncio.Future[Any]] = set()
    next_sid = 0
    admitting = True
    active = 0
    done = asyncio.Event()
    t0 = time.perf_counter()

    def release_later(rid: str, rep: str) -> None:  # as ferryman.client.ServerClient does
        task = asyncio.ensure_future(router.release(rid, rep))
        pending.add(task)
        task.add_done_callback(pending.discard)

    async def session(s: Session) -> None:
        nonlocal active
        prev: str | None = None
        for turn in range(s.turns):
            rid = f"s{s.sid}" if sticky_ids else f"s{s.sid}/t{turn}"
            t = time.perf_counter()
            rep = await router.acquire(rid)
            res.lat.append(time.perf_counter() - t)
            res.decisions += 1
            if prev is not None:
                res.revisits += 1
                res.same += rep == prev
            load[rep] += 1
            try:
                ms = w.decode_ms * s.weight * (1 + load[rep] / w.batch_knee)
                if rep != prev:  # no prefix cache for this session there
                    ms += w.prefill_ms_per_turn * turn * s.weight
                res.service_ms.append(ms)
                await asyncio.sleep(ms / 1000)
            finally:
                load[rep] -= 1
                release_later(rid, rep)
            res.turns_done += 1
            prev = rep
            await asyncio.sleep(s.rng.expovariate(1000 / w.think_ms))
        active -= 1
        spawn()

    def spawn() -> None:
        nonlocal next_sid, active
        while admitting and active < w.sessions:
            s = make_session(next_sid, w, seed)
            next_sid += 1
            active += 1
            task = asyncio.ensure_future(session(s))
            running.add(task)
            task.add_done_callback(running.discard)
        if active == 0:
            done.set()

    async def sample() -> None:
        while not done.is_set():
            vals = [load[r] for r in REPLICAS]
            ratio = max(vals) / max(1, min(vals))
            (res.imb_steady if admitting else res.imb_drain).append(ratio)
            sums = res.sum_steady if admitting else res.sum_drain
            for r in REPLICAS:
                sums[r] = sums.get(r, 0.0) + load[r]
            await asyncio.sleep(0.005)

    async def probe() -> None:  # how late the event loop wakes a task (the simulated Rollouter's own lag)
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            res.lag.append(time.perf_counter() - t - 0.001)

    spawn()
    sampler = asyncio.ensure_future(sample())
    prober = asyncio.ensure_future(probe())
    await asyncio.sleep(steady_s)
    admitting = False
    res.steady_turns, res.steady_s = res.turns_done, time.perf_counter() - t0
    res.steady_rebalances = (await router.stats()).get("router/rebalances", 0.0)
    res.steady_decisions = res.decisions
    res.steady_same, res.steady_revisits = res.same, res.revisits
    try:
        await asyncio.wait_for(done.wait(), drain_s)
    except TimeoutError:
        pass
    res.wall_s = time.perf_counter() - t0
    done.set()
    await sampler
    await prober
    for task in list(running):  # the tail past the drain limit: stop it (ServerClient releases in finally)
        task.cancel()
    await asyncio.gather(*list(running), return_exceptions=True)
    if hasattr(router, "flush"):
        await router.flush()
    if pending:
        await asyncio.gather(*list(pending), return_exceptions=True)
    res.stats = await router.stats()
    return res


async def capacity(router: Any, *, callers: int, seconds: float, ids: int = 512) -> tuple[float, list[float]]:
    pending: set[asyncio.Future[Any]] = set()
    lat: list[float] = []
    pairs = 0
    stop = time.perf_counter() + seconds

    async def caller(i: int) -> None:
        nonlocal pairs
        k = i
        while time.perf_counter() < stop:
            rid = f"c{k % ids}"
            k += callers
            t = time.perf_counter()
            rep = await router.acquire(rid)
            lat.append(time.perf_counter() - t)
            task = asyncio.ensure_future(router.release(rid, rep))
            pending.add(task)
            task.add_done_callback(pending.discard)
            pairs += 1
            await asyncio.sleep(0)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(callers)))
    if pending:
        await asyncio.gather(*list(pending))
    if hasattr(router, "flush"):
        await router.flush()
    elapsed = time.perf_counter() - t0
    stats = await router.stats()
    leaked = sum(v for k, v in stats.items() if k.startswith("router/in_flight/"))
    assert leaked == 0, f"in-flight counts leaked: {leaked}"
    return pairs / elapsed, lat


def fmt_row(cols: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(wd) if i else c.ljust(wd) for i, (c, wd) in enumerate(zip(cols, widths, strict=True)))


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=8.0, help="steady phase per policy, seconds")
    ap.add_argument("--drain", type=float, default=3.0, help="longest drain phase per policy, seconds")
    ap.add_argument("--capacity-seconds", type=float, default=3.0)
    ap.add_argument("--callers", type=int, default=64, help="closed-loop callers in the capacity test")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threshold", type=float, default=None, help="override rebalance_threshold")
    ap.add_argument("--gap", type=int, default=None, help="override rebalance_min_gap")
    ap.add_argument("--outstanding", type=int, default=None, help="override the shared client's max_outstanding")
    ap.add_argument("--only-shared", action="store_true", help="fleet: the shared form only")
    ap.add_argument("--no-ray", action="store_true", help="skip the shared (Ray actor) form")
    args = ap.parse_args()
    w = Workload()

    print(f"# ferryman-router bench: {len(REPLICAS)} replicas, {w.sessions} concurrent sessions, "
          f"steady {args.duration:g} s + drain <= {args.drain:g} s per policy; cpus={os.cpu_count()} "
          f"loadavg={os.getloadavg()[0]:.1f}")
    sample_turns = [make_session(i, w, args.seed).turns for i in range(10_000)]
    print(f"# turns/session: mean {statistics.mean(sample_turns):.1f}, p50 {pct(sample_turns, .5)}, "
          f"p99 {pct(sample_turns, .99)}, max {max(sample_turns)}")

    ray = None
    if not args.no_ray:
        # under `uv run`, Ray would start its workers through `uv run` too (see runner.py)
        os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
        import ray as _ray

        ray = _ray
        t = time.perf_counter()
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        print(f"# ray.init took {time.perf_counter() - t:.1f} s")

    overrides = {k: v for k, v in (("rebalance_threshold", args.threshold), ("rebalance_min_gap", args.gap)) if v is not None}
    defaults = StickyRouterConfig(**overrides)
    policies: list[tuple[str, Any, bool]] = [
        ("plain sticky (no rebalance)", StickyRouter(REPLICAS, rebalance=False), True),
        ("least-in-flight, no stickiness", StickyRouter(REPLICAS, rebalance=False), False),
        ("ours (sticky + rebalance)", make_router(defaults, replicas=REPLICAS), True),
    ]
    if ray is not None:
        shared = make_router(StickyRouterConfig(shared=True, **overrides), replicas=REPLICAS)
        await shared.stats()  # the actor is up
        if args.outstanding:
            shared.max_outstanding = args.outstanding
        if args.only_shared:
            policies = []
        policies.append(("ours, shared Ray actor", shared, True))

    results = []
    for name, router, sticky in policies:
        r = await run_fleet(name, router, sticky_ids=sticky, w=w, steady_s=args.duration, drain_s=args.drain, seed=args.seed)
        if "router/client_ops_per_call" in r.stats:
            r.extra = f"{r.stats['router/client_ops_per_call']:.1f} ops/actor call"
        results.append(r)
        await asyncio.sleep(0.5)

    print()
    print(f"## fleet (rebalance_threshold={defaults.rebalance_threshold:g}, rebalance_min_gap={defaults.rebalance_min_gap})")
    head = ["policy", "decisions/s", "p50 ms", "p99 ms", "sticky % s/all", "spread s/d", "inst s/d", "rebal s+d", "gen ms/turn", "loop lag p50/p99 ms", "note"]
    widths = [30, 11, 7, 7, 14, 11, 11, 9, 11, 18, 18]
    print(fmt_row(head, widths))
    for r in results:
        print(fmt_row([
            r.name,
            f"{r.decisions / r.wall_s:,.0f}",
            f"{pct(r.lat, .5) * 1e3:.3f}",
            f"{pct(r.lat, .99) * 1e3:.3f}",
            f"{100 * r.steady_same / max(1, r.steady_revisits):.2f}/{100 * r.same / max(1, r.revisits):.2f}",
            f"{spread(r.sum_steady):.2f}/{spread(r.sum_drain):.2f}",
            f"{statistics.mean(r.imb_steady):.2f}/{statistics.mean(r.imb_drain) if r.imb_drain else float('nan'):.2f}",
            f"{r.steady_rebalances:.0f}+{r.stats.get('router/rebalances', 0) - r.steady_rebalances:.0f}",
            f"{statistics.mean(r.service_ms):.1f}",
            f"{pct(r.lag, .5) * 1e3:.2f}/{pct(r.lag, .99) * 1e3:.2f}",
            r.extra,
        ], widths))
    print(
        "# decisions/s: acquire calls per second (the simulated agents' offered load); p50/p99: acquire latency\n"
        "# through the Router API; sticky %: turns on the session's previous replica, steady phase / whole run;\n"
        "# spread: max/min across replicas of the time-averaged requests in flight, steady / drain phase;\n"
        "# inst: time-mean of the instantaneous max/min in flight (min counted as >= 1), steady / drain;\n"
        "# rebal: sessions moved by load, steady + drain; gen ms/turn: mean simulated service time\n"
        "# (load-dependent decode + re-prefill on a cache miss); loop lag: how late the bench's event loop\n"
        "# wakes a 1 ms sleep (the simulated Rollouter's own load)."
    )
    print()
    print(f"## capacity: {args.callers} closed-loop callers, acquire + fire-and-forget release, {args.capacity_seconds:g} s")
    head = ["form", "pairs/s", "p50 ms", "p99 ms", "note"]
    widths = [31, 9, 7, 7, 24]
    print(fmt_row(head, widths))
    forms: list[tuple[str, Any]] = [("in-process StickyRouter", make_router(defaults, replicas=REPLICAS))]
    if ray is not None:
        cap_shared = make_router(StickyRouterConfig(shared=True, **overrides), replicas=REPLICAS)
        await cap_shared.stats()
        if args.outstanding:
            cap_shared.max_outstanding = args.outstanding
        forms.append(("shared Ray actor (batched)", cap_shared))
    for name, router in forms:
        rate, lat = await capacity(router, callers=args.callers, seconds=args.capacity_seconds)
        note = ""
        if hasattr(router, "remote_calls"):
            note = f"{router.batched_ops / max(1, router.remote_calls):.1f} ops/actor call"
        print(fmt_row([name, f"{rate:,.0f}", f"{pct(lat, .5) * 1e3:.3f}", f"{pct(lat, .99) * 1e3:.3f}", note], widths))
    # the decision itself, without an event loop or a bench around it
    raw = StickyRouter(REPLICAS)
    ids = [f"s{i}" for i in range(512)]
    n = 200_000
    t = time.perf_counter()
    for k in range(n):
        rid = ids[k & 511]
        raw.release_nowait(rid, raw.acquire_nowait(rid))
    print(fmt_row(["raw acquire_nowait+release_nowait", f"{n / (time.perf_counter() - t):,.0f}", "-", "-", "one thread, no event loop"], widths))
    if ray is not None:
        ray.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
