"""Failing agent runs: counted, named, logged sparingly; a systematically failing env stops the
Rollouter (and so the run) instead of retrying forever; non-finite numbers never reach the queue."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import pytest

from ferryman.client import ServerClient
from ferryman.config import ConfigError, RunFailuresConfig, load_config
from ferryman.defaults.queue import MessageQueue
from ferryman.defaults.router import LocalRouter
from ferryman.engine_host import EngineHandle
from ferryman.rollouter import AgentRunsFailingError, Rollouter
from ferryman.testing.doubles import EchoEngine
from ferryman.types import SamplingParams

from helpers import EchoEnv


class BrokenEnv(EchoEnv):
    """Fails in one of several ways; ``every``: only every this many runs (others succeed)."""

    def __init__(self, how: str, every: int = 1) -> None:
        super().__init__(num_tasks=5)
        self.how = how
        self.every = every
        self.calls = 0

    async def run(self, task, request_id, client, params):
        self.calls += 1
        call = self.calls
        traj = await super().run(task, request_id, client, params)
        if call % self.every:
            return traj
        if self.how == "raise":
            raise RuntimeError("my env is broken")
        if self.how == "no_reward":
            traj.reward = None
        elif self.how == "nan_reward":
            traj.reward = float("nan")
        elif self.how == "inf_reward":
            traj.reward = float("-inf")
        elif self.how == "nan_log_prob":
            traj.rollout_log_probs[0] = float("nan")
        return traj


def _rollouter(env, failures: RunFailuresConfig | None = None, max_required: int = 8):
    engines = {"r0": EngineHandle("r0", engine=EchoEngine())}
    client = ServerClient(LocalRouter(list(engines)), engines, partial_rollout=False)
    queue = MessageQueue(max_required)
    r = Rollouter(
        env=env, client=client, queue=queue, n=2, sampling=SamplingParams(max_tokens=3),
        max_required_samples=max_required, max_concurrent_samples=4, failures=failures,
    )
    return r, queue


async def test_always_failing_env_stops_within_bounded_time_and_log(caplog):
    caplog.set_level(logging.WARNING, logger="ferryman.rollouter")
    r, queue = _rollouter(BrokenEnv("raise"), RunFailuresConfig(max_consecutive=40, log_first=3, log_every_s=30))
    t0 = time.monotonic()
    with pytest.raises(AgentRunsFailingError) as err:
        await asyncio.wait_for(r.fit(), 20)
    elapsed = time.monotonic() - t0
    await r.stop()
    assert elapsed < 10
    assert 40 <= r.total_failed_trajectories < 40 + 4 * 2  # at most the runs already in flight
    assert await queue.qsize() == 0
    msg = str(err.value)
    assert "40 agent runs in a row failed" in msg
    # the first failure's full traceback, with the env's own frame and message
    assert "Traceback (most recent call last)" in msg and "in run" in msg and "RuntimeError: my env is broken" in msg
    records = [rec for rec in caplog.records if rec.name == "ferryman.rollouter"]
    # 3 with traceback + the "further failures are counted" line + the error line; no per-run flood
    assert len(records) <= 6, [rec.getMessage() for rec in records]
    assert sum(1 for rec in records if rec.exc_info) == 3
    assert r.stats()["rollouter/failed/error"] == r.total_failed_trajectories


class FlakyEnv(EchoEnv):
    """All runs but one of every ``period`` raise."""

    def __init__(self, period: int = 4) -> None:
        super().__init__(num_tasks=5)
        self.calls = 0
        self.period = period

    async def run(self, task, request_id, client, params):
        self.calls += 1
        if self.calls % self.period:
            raise RuntimeError("flaky")
        return await super().run(task, request_id, client, params)


async def test_failure_ratio_over_a_window_stops():
    # never 40 in a row, but about 75% of the last 20 > 60% (failures finish first: more)
    r, _ = _rollouter(FlakyEnv(), RunFailuresConfig(max_consecutive=40, max_ratio=0.6, window=20))
    with pytest.raises(AgentRunsFailingError, match=r"\d+% of the last 20 finished agent runs failed \(limit 60%\)"):
        await asyncio.wait_for(_consume_while(r), 20)
    await r.stop()
    assert r.total_runs_finished >= 1
    assert r.consecutive_failures < 40


async def test_a_healthy_share_of_failures_does_not_stop():
    r, queue = _rollouter(FlakyEnv(period=2), RunFailuresConfig(max_consecutive=40, max_ratio=0.8, window=20))
    fit = asyncio.create_task(_consume_while(r, stop_after=15))
    await asyncio.wait_for(fit, 20)
    assert r.failure is None and r.total_failed_trajectories >= 15


async def _consume_while(r: Rollouter, stop_after: int | None = None) -> None:
    """fit() while a consumer drains the queue and syncs (so the quota never blocks); with
    ``stop_after``, stop the Rollouter after that many samples."""
    fit = asyncio.create_task(r.fit())
    version = 0
    while not fit.done():
        s = await r.queue.get(timeout=0.05)
        if s is not None:
            version += 1
            await r.pause_for_sync(False)
            await r.reset_staleness(version)
            if stop_after is not None and version >= stop_after:
                await r.stop()
    await fit


@pytest.mark.parametrize(
    "how,kind", [("no_reward", "no_reward"), ("nan_reward", "nonfinite_reward"), ("inf_reward", "nonfinite_reward"), ("nan_log_prob", "nonfinite_log_prob")]
)
async def test_untrainable_runs_fail_like_a_missing_reward(how, kind, caplog):
    caplog.set_level(logging.WARNING, logger="ferryman.rollouter")
    # every other run is bad: its group still reaches the queue, without the bad run
    r, queue = _rollouter(BrokenEnv(how, every=2))
    fit = asyncio.create_task(r.fit())
    got = [await asyncio.wait_for(queue.get(), 10) for _ in range(4)]
    await r.stop()
    fit.cancel()
    await asyncio.gather(fit, return_exceptions=True)
    for sample in got:
        for t in sample.trajectories:
            assert t.reward is not None and math.isfinite(t.reward)
            assert all(math.isfinite(lp) for lp in t.rollout_log_probs)
    assert r.failed_by_kind[kind] >= 1 and r.failed_by_kind[kind] == r.total_failed_trajectories
    assert r.stats()[f"rollouter/failed/{kind}"] == r.failed_by_kind[kind]
    first = next(rec for rec in caplog.records if rec.name == "ferryman.rollouter")
    assert f"({kind})" in first.getMessage()
    assert ("not finite" in first.getMessage()) == kind.startswith("nonfinite")


async def test_failure_trace_records_are_bounded(tmp_path):
    from ferryman import trace

    trace.configure(tmp_path, "basic", proc="rollouter")
    try:
        r, _ = _rollouter(BrokenEnv("raise"), RunFailuresConfig(max_consecutive=60, trace_max=10))
        with pytest.raises(AgentRunsFailingError):
            await asyncio.wait_for(r.fit(), 20)
        await r.stop()
    finally:
        trace.close()
    recs = trace.read_trace(tmp_path)
    trajs = [x for x in recs if x.get("name") == "rollouter.traj"]
    samples = [x for x in recs if x.get("name") == "rollouter.sample"]
    assert r.total_failed_trajectories >= 60
    assert len(trajs) + len(samples) == 10


def test_failure_limits_are_validated_config_fields(host):
    cfg, _ = load_config(None, ["engine={type: echo}", "trainer={type: echo}"], host)
    assert cfg.rollout.failures.max_consecutive == 100 and cfg.rollout.failures.max_ratio == 0.9
    cfg, _ = load_config(None, ["engine={type: echo}", "trainer={type: echo}", "rollout.failures.max_consecutive=null"], host)
    assert cfg.rollout.failures.max_consecutive is None
    with pytest.raises(ConfigError, match=r"rollout.failures.max_ratio: Input should be less than 1"):
        load_config(None, ["rollout.failures.max_ratio=1.5"], host)
    with pytest.raises(ConfigError, match=r"rollout.failures.max_consecutive: Input should be greater than or equal to 1"):
        load_config(None, ["rollout.failures.max_consecutive=0"], host)
