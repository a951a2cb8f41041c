"""The control plane at fleet scale, on one machine: the real Rollouter, MessageQueue,
ServerClient and router (ferryman-router's ``sticky``, or core's ``local``) against simulated
engine replicas, with the concurrency of a large cluster.

``FakeFleetEngine`` is a *named fake*: it computes no token. A generate call waits its modelled
latency (``prefill_s + tokens × per_token_s``) and returns that many tokens; its cost is an
``asyncio.sleep`` and a few lists. ``FleetEnv`` is an agent that makes ``turns`` generate calls
per run, with a modelled tool latency between them, and grows its context like a real multi-turn
agent. A stand-in trainer takes samples from the queue one by one and, every window, runs the
Rollouter's sync protocol (``pause_for_sync`` … ``reset_staleness``) as the real Synchronizer
does (no weights move).

Per scale (engine replicas R: 64, 256, 1,024), in a fresh process of its own: 8 runs per replica
at once (1 sample of ``n = 8`` runs per replica; 8,192 concurrent agent runs at 1,024), a window
of R samples, ``staleness_threshold = 0.5``, ``WINDOWS`` windows. Measured: CPU time of the
process (``time.process_time``, immune to other jobs on the machine) per trained sample and per
generate call, with the fake engines' own share measured apart (the same calls straight on the
fakes) and subtracted; peak RSS; queue latency (sample finished → trainer has it); routing
latency (``acquire``); event-loop lag. Then the capacity of one client process: closed-loop
agent runs on zero-latency fakes, generate calls per CPU-second through the whole stack.

    flock /tmp/ferryman-heavy.lock .venv/bin/python bench/fleet.py            # table → stdout
    .venv/bin/python bench/fleet.py --one 1024 --profile                      # where the CPU goes
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from ferryman.client import ServerClient
from ferryman.defaults.queue import MessageQueue
from ferryman.engine_host import EngineHandle
from ferryman.rollouter import Rollouter
from ferryman.types import SamplingParams, TokenOutput, Trajectory

RUNS_PER_REPLICA = 8
N = 8  # runs per sample
STALENESS = 0.5
WINDOWS = 3
TURNS = 4
PROMPT_TOKENS = 64
TOKENS = 32
OBS_TOKENS = 16
PREFILL_S = 0.05
PER_TOKEN_S = 0.01
TOOL_S = 0.2


class FakeFleetEngine:
    """A *fake* engine replica: modelled latency, no tokens computed (see the module docstring)."""

    def __init__(self, *, prefill_s: float, per_token_s: float, tokens: int) -> None:
        self.prefill_s = prefill_s
        self.per_token_s = per_token_s
        self.tokens = tokens
        self.version = 0
        self.calls = 0
        self._ids = [7] * tokens
        self._lps = [-0.5] * tokens

    async def start(self) -> None:
        pass

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> TokenOutput:
        n = min(params.max_tokens, self.tokens)
        self.calls += 1
        delay = self.prefill_s + n * self.per_token_s
        if delay > 0:
            await asyncio.sleep(delay)
        return TokenOutput(self._ids[:n], self._lps[:n], [self.version] * n, "length" if n == params.max_tokens else "stop")

    async def pause(self, abort: bool) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def release_kv_cache(self) -> None:
        pass

    async def resume_kv_cache(self) -> None:
        pass

    async def load_weights(self, named_tensors: Any) -> None:
        pass

    async def set_version(self, version: int) -> None:
        self.version = version

    async def get_version(self) -> int:
        return self.version

    async def stats(self) -> dict[str, float]:
        return {}

    async def shutdown(self) -> None:
        pass


class FleetEnv:
    """An agent: ``turns`` generate calls per run with a modelled tool latency in between."""

    def __init__(self, *, num_tasks: int = 10_000, turns: int, tool_s: float) -> None:
        self._num_tasks = num_tasks
        self.turns = turns
        self.tool_s = tool_s
        self._obs = [5] * OBS_TOKENS

    def num_tasks(self) -> int:
        return self._num_tasks

    def get_task(self, index: int) -> dict[str, Any]:
        return {"index": index, "prompt": [1 + index % 50] * PROMPT_TOKENS}

    async def run(self, task: dict[str, Any], request_id: str, client: Any, sampling: SamplingParams) -> Trajectory:
        traj = Trajectory(request_id=request_id, prompt_ids=task["prompt"])
        for turn in range(self.turns):
            out = await client.generate(request_id, task["prompt"] + traj.response_ids, sampling)
            traj.append_model_tokens(out)
            if turn < self.turns - 1:
                if self.tool_s > 0:
                    await asyncio.sleep(self.tool_s)
                traj.append_observation(self._obs)
        traj.reward = 1.0
        return traj


class TimedRouter:
    """Forwards to a router; times every 8th ``acquire`` (wall, on the event loop)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.samples: list[float] = []
        self._k = 0

    async def acquire(self, request_id: str) -> str:
        self._k += 1
        if self._k & 7:
            return await self.inner.acquire(request_id)
        t0 = time.perf_counter()
        out = await self.inner.acquire(request_id)
        self.samples.append(time.perf_counter() - t0)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def make_router(kind: str, names: list[str]) -> Any:
    if kind == "local":
        from ferryman.defaults.router import LocalRouter

        return LocalRouter(names)
    from ferryman_router import StickyRouter

    return StickyRouter(names)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def engines_only(replicas: int, calls: int, prefill_s: float, per_token_s: float) -> float:
    """CPU seconds per call of the fakes alone (the same concurrency, no control plane)."""
    engines = [FakeFleetEngine(prefill_s=prefill_s, per_token_s=per_token_s, tokens=TOKENS) for _ in range(replicas)]
    params = SamplingParams(max_tokens=TOKENS)
    prompt = [1] * PROMPT_TOKENS
    conc = replicas * RUNS_PER_REPLICA
    per_worker = max(1, calls // conc)

    async def worker(i: int) -> None:
        e = engines[i % replicas]
        for _ in range(per_worker):
            await e.generate("x", prompt, params)

    c0 = time.process_time()
    await asyncio.gather(*(worker(i) for i in range(conc)))
    return (time.process_time() - c0) / (per_worker * conc)


async def one_scale(replicas: int, router_kind: str, windows: int, prefill_s: float, per_token_s: float, tool_s: float) -> dict[str, Any]:
    names = [f"replica-{i}" for i in range(replicas)]
    fakes = {n: FakeFleetEngine(prefill_s=prefill_s, per_token_s=per_token_s, tokens=TOKENS) for n in names}
    handles = {n: EngineHandle(n, engine=e) for n, e in fakes.items()}
    router = TimedRouter(make_router(router_kind, names))
    client = ServerClient(router, handles, partial_rollout=False)
    window = replicas * RUNS_PER_REPLICA // N  # samples consumed per sync
    max_required = int((1 + STALENESS) * window)
    max_concurrent = min(replicas * RUNS_PER_REPLICA // N, max_required)
    total = windows * window
    queue = MessageQueue(max_required)
    env = FleetEnv(turns=TURNS, tool_s=tool_s)
    rollouter = Rollouter(
        env=env, client=client, queue=queue, n=N, sampling=SamplingParams(max_tokens=TOKENS), max_required_samples=max_required,
        max_concurrent_samples=max_concurrent, total_samples=total, seed=0,
    )
    lag: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.01)
            lag.append(time.perf_counter() - t0 - 0.01)

    queue_lat: list[float] = []
    sync_s: list[float] = []

    async def trainer() -> None:
        version = 0
        for got in range(1, total + 1):
            s = await queue.get()
            assert s is not None
            queue_lat.append(time.time() - s.timings["generate_end"])
            if got % window == 0:
                t0 = time.perf_counter()
                await rollouter.pause_for_sync(False)
                version += 1
                for e in fakes.values():
                    e.version = version
                await rollouter.reset_staleness(version)
                sync_s.append(time.perf_counter() - t0)

    gc.collect()
    tick = asyncio.create_task(ticker())
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    c0, w0 = time.process_time(), time.perf_counter()
    fit = asyncio.create_task(rollouter.fit())
    await trainer()
    await fit
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    stop.set()
    await tick
    await client.drain()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    calls = client.num_calls
    assert calls == total * N * TURNS, (calls, total)
    assert rollouter.total_produced == total and rollouter.total_failed_trajectories == 0
    eng = await engines_only(replicas, min(calls, 40_000), prefill_s, per_token_s)
    rstats = await router.stats()
    return {
        "replicas": replicas,
        "router": router_kind,
        "concurrent_runs": max_concurrent * N,
        "max_runs_seen": rollouter.max_active_seen * N,
        "samples": total,
        "calls": calls,
        "cpu_s": cpu,
        "wall_s": wall,
        "engine_cpu_per_call_us": eng * 1e6,
        "cpu_per_sample_ms": (cpu - eng * calls) / total * 1e3,
        "cpu_per_call_us": (cpu - eng * calls) / calls * 1e6,
        "calls_per_cpu_s": calls / max(cpu - eng * calls, 1e-9),
        "calls_per_wall_s": calls / wall,
        "peak_rss_mb": rss1 / 1024,
        "rss_growth_mb": (rss1 - rss0) / 1024,
        "queue_p50_ms": pct(queue_lat, 0.5) * 1e3,
        "queue_p99_ms": pct(queue_lat, 0.99) * 1e3,
        "acquire_p50_us": pct(router.samples, 0.5) * 1e6,
        "acquire_p99_us": pct(router.samples, 0.99) * 1e6,
        "loop_lag_p50_ms": pct(lag, 0.5) * 1e3,
        "loop_lag_p99_ms": pct(lag, 0.99) * 1e3,
        "sync_mean_ms": statistics.fmean(sync_s) * 1e3 if sync_s else 0.0,
        "sticky_hit_rate": rstats.get("router/sticky_hit_rate", float("nan")),
    }


async def capacity(replicas: int, router_kind: str, seconds: float) -> dict[str, Any]:
    """Closed loop, zero-latency fakes and tools: as many generate calls as one process can
    route; 8 runs per replica in flight."""
    names = [f"replica-{i}" for i in range(replicas)]
    handles = {n: EngineHandle(n, engine=FakeFleetEngine(prefill_s=0, per_token_s=0, tokens=TOKENS)) for n in names}
    router = make_router(router_kind, names)
    client = ServerClient(router, handles, partial_rollout=False)
    window = replicas * RUNS_PER_REPLICA // N
    queue = MessageQueue(int((1 + STALENESS) * window))
    rollouter = Rollouter(
        env=FleetEnv(turns=TURNS, tool_s=0), client=client, queue=queue, n=N, sampling=SamplingParams(max_tokens=TOKENS),
        max_required_samples=int((1 + STALENESS) * window), max_concurrent_samples=window, seed=0,
    )
    fit = asyncio.create_task(rollouter.fit())
    got = 0
    c0, w0 = time.process_time(), time.perf_counter()
    version = 0
    while time.perf_counter() - w0 < seconds:
        s = await queue.get()
        got += 1
        if got % window == 0:
            await rollouter.pause_for_sync(False)
            version += 1
            await rollouter.reset_staleness(version)
    calls0 = client.num_calls
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    await rollouter.stop()
    fit.cancel()
    await asyncio.gather(fit, return_exceptions=True)
    return {"replicas": replicas, "router": router_kind, "calls": calls0, "cpu_s": cpu, "wall_s": wall,
            "calls_per_cpu_s": calls0 / cpu, "calls_per_wall_s": calls0 / wall, "samples": got}


def _child(args: argparse.Namespace) -> None:
    if args.gc == "tuned":  # what the Rollouter's actor does (ferryman.cluster.tuning)
        from ferryman.cluster.tuning import tune_control_plane_gc

        tune_control_plane_gc()
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
    if args.capacity:
        out = asyncio.run(capacity(args.one, args.router, args.seconds))
    else:
        out = asyncio.run(one_scale(args.one, args.router, args.windows, args.prefill_s, args.per_token_s, args.tool_s))
    if args.profile:
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", default="64,256,1024")
    ap.add_argument("--routers", default="sticky,local")
    ap.add_argument("--windows", type=int, default=WINDOWS)
    ap.add_argument("--prefill-s", type=float, default=PREFILL_S)
    ap.add_argument("--per-token-s", type=float, default=PER_TOKEN_S)
    ap.add_argument("--tool-s", type=float, default=TOOL_S)
    ap.add_argument("--seconds", type=float, default=15.0, help="length of the capacity run")
    ap.add_argument("--one", type=int, help="(internal) run one scale in this process and print its JSON")
    ap.add_argument("--capacity", action="store_true", help="with --one: the capacity run")
    ap.add_argument("--router", default="sticky", help="with --one")
    ap.add_argument("--profile", action="store_true", help="with --one: cProfile's top 25 to stderr")
    ap.add_argument("--gc", choices=["tuned", "default"], default="tuned", help="with --one: the Rollouter's GC tuning, or CPython's default")
    args = ap.parse_args()
    if args.one is not None:
        _child(args)
        return
    scales = [int(x) for x in args.scales.split(",")]
    routers = args.routers.split(",")
    base = [sys.executable, os.path.abspath(__file__), "--windows", str(args.windows), "--prefill-s", str(args.prefill_s),
            "--per-token-s", str(args.per_token_s), "--tool-s", str(args.tool_s), "--seconds", str(args.seconds)]

    def child(extra: list[str]) -> dict[str, Any]:
        p = subprocess.run([*base, *extra], capture_output=True, text=True, check=False)
        if p.returncode:
            sys.exit(f"fleet child {extra} failed:\n{p.stderr[-3000:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])

    print(f"# fleet: {RUNS_PER_REPLICA} runs/replica, n={N}, {TURNS} turns, {TOKENS} tokens/turn, "
          f"latency {args.prefill_s}+{args.per_token_s}/token s, tool {args.tool_s} s, {args.windows} windows; "
          f"load average {os.getloadavg()[0]:.1f}")
    rows = []
    for rk in routers:
        for r in scales:
            row = child(["--one", str(r), "--router", rk])
            row["gc"] = "tuned"
            rows.append(row)
            print(json.dumps(row), flush=True)
    # the same at the largest scale with CPython's default GC thresholds, side by side
    untuned = child(["--one", str(max(scales)), "--router", routers[0], "--gc", "default"])
    untuned["gc"] = "default"
    print(json.dumps(untuned), flush=True)
    caps = []
    for rk in routers:
        row = child(["--one", str(max(scales)), "--router", rk, "--capacity"])
        caps.append(row)
        print(json.dumps(row), flush=True)

    print()
    print("| router | GC | replicas | concurrent runs | samples | generate calls | CPU/sample (ms) | CPU/call (µs) | calls per CPU-s | "
          "fake-engine CPU/call (µs) | peak RSS (MB) | queue p50/p99 (ms) | acquire p50/p99 (µs) | loop lag p50/p99 (ms) | wall (s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for x in [*rows, untuned]:
        print(f"| {x['router']} | {x['gc']} | {x['replicas']} | {x['concurrent_runs']} | {x['samples']} | {x['calls']} | {x['cpu_per_sample_ms']:.2f} | "
              f"{x['cpu_per_call_us']:.0f} | {x['calls_per_cpu_s']:.0f} | {x['engine_cpu_per_call_us']:.0f} | {x['peak_rss_mb']:.0f} | "
              f"{x['queue_p50_ms']:.1f}/{x['queue_p99_ms']:.1f} | {x['acquire_p50_us']:.1f}/{x['acquire_p99_us']:.1f} | "
              f"{x['loop_lag_p50_ms']:.1f}/{x['loop_lag_p99_ms']:.1f} | {x['wall_s']:.1f} |")
    print()
    for rk in routers:
        mine = {x["replicas"]: x for x in rows if x["router"] == rk}
        lo, hi = mine[min(scales)], mine[max(scales)]
        print(f"{rk}: CPU per sample at {max(scales)} / at {min(scales)} replicas = {hi['cpu_per_sample_ms'] / lo['cpu_per_sample_ms']:.2f}x "
              f"(aim <= 1.5x); per call {hi['cpu_per_call_us'] / lo['cpu_per_call_us']:.2f}x")
    tuned = next(x for x in rows if x["router"] == routers[0] and x["replicas"] == max(scales))
    print(f"GC tuning at {max(scales)} replicas ({routers[0]}): CPU per sample {untuned['cpu_per_sample_ms'] / tuned['cpu_per_sample_ms']:.2f}x "
          f"with CPython's default thresholds; peak RSS {tuned['peak_rss_mb']:.0f} MB tuned, {untuned['peak_rss_mb']:.0f} MB default")
    for c in caps:
        print(f"capacity ({c['router']}, {c['replicas']} zero-latency replicas, one process): {c['calls_per_cpu_s']:.0f} generate calls per "
              f"CPU-second ({c['calls_per_wall_s']:.0f}/s wall on this loaded machine; aim >= 2000)")


if __name__ == "__main__":
    main()
