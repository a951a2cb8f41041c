"""Seed §07 funnel numbers and the §06 staleness quota across windows (carry-over conserved)."""

from __future__ import annotations

import asyncio

import pytest

from ferryman.client import ServerClient
from ferryman.config import RunConfig, compute_funnel
from ferryman.defaults.queue import MessageQueue
from ferryman.defaults.router import LocalRouter
from ferryman.engine_host import EngineHandle
from ferryman.rollouter import Rollouter
from ferryman.testing.doubles import EchoEngine
from ferryman.types import SamplingParams

from helpers import EchoEnv


def test_funnel_matches_seed_fully_async_2nodes():
    # rollout 8 GPUs, gen_tp=4, num_workers=128, ppo_mini_batch_size=64, staleness_threshold=1.0
    f = compute_funnel(
        ppo_mini_batch_size=64,
        staleness_threshold=1.0,
        require_batches=1,
        trigger_parameter_sync_step=1,
        num_replicas=8 // 4,
        max_concurrency_per_replica=32,
    )
    assert f["max_required_samples"] == 128
    assert f["num_replicas"] == 2
    assert f["max_concurrent_samples"] == 64
    assert f["max_queue_size"] == 128


def test_funnel_from_run_config():
    cfg = RunConfig.model_validate(
        {
            "training": {"ppo_mini_batch_size": 4},
            "async_training": {"trigger_parameter_sync_step": 2, "require_batches": 3, "staleness_threshold": 0.5},
            "rollout": {"num_replicas": 2, "max_concurrency_per_replica": 100},
        }
    )
    f = cfg.funnel()
    assert f["window_samples"] == 24
    assert f["max_required_samples"] == 36
    assert f["max_concurrent_samples"] == 36
    assert cfg.required_samples == 12


def _rollouter(max_required: int, max_concurrent: int, delay: float = 0.002, replicas: int = 2):
    engines = {f"r{i}": EngineHandle(f"r{i}", engine=EchoEngine(step_delay_s=delay)) for i in range(replicas)}
    client = ServerClient(LocalRouter(list(engines)), engines, partial_rollout=True)
    queue = MessageQueue(max_required)
    r = Rollouter(
        env=EchoEnv(),
        client=client,
        queue=queue,
        n=2,
        sampling=SamplingParams(max_tokens=6),
        max_required_samples=max_required,
        max_concurrent_samples=max_concurrent,
    )
    return r, queue, engines


@pytest.mark.parametrize("staleness,window", [(0.0, 4), (0.5, 4), (1.0, 3)])
async def test_quota_across_windows_conserves_carry_over(staleness, window):
    max_required = int((1 + staleness) * window)
    r, queue, engines = _rollouter(max_required, max_concurrent=3)
    fit = asyncio.create_task(r.fit())
    consumed_per_window = []
    for v in range(1, 6):
        got = [await asyncio.wait_for(queue.get(), 10) for _ in range(window)]
        consumed_per_window.append(len(got))
        # let the Rollouter run ahead as far as its quota allows, then sync (partial rollout: abort)
        await asyncio.sleep(0.05)
        await r.pause_for_sync(wait_for_active=False)
        await asyncio.gather(*(e.pause(True) for e in engines.values()))
        await asyncio.gather(*(e.set_version(v) for e in engines.values()))
        await asyncio.gather(*(e.resume() for e in engines.values()))
        carried = await r.reset_staleness(v)
        assert carried <= max_required - window, "carry-over can never exceed the stale share"
    await r.stop()
    fit.cancel()
    windows = r.window_log()
    for w in windows[:-1]:
        # the quota formula: a window admits at most (1+s)·W − num_staleness_sample
        assert w["admitted"] - w["dropped"] <= max_required - w["carried"], windows
    for prev, nxt in zip(windows, windows[1:]):
        # conservation: carried' = carried + admitted − consumed (dropped samples: none here)
        assert nxt["carried"] == prev["carried"] + prev["admitted"] - prev["dropped"] - window, windows
    if staleness == 0:
        assert all(w["carried"] == 0 for w in windows), "staleness 0 carries nothing over"
    assert r.max_active_seen <= 3


async def test_concurrency_cap_and_pause():
    r, queue, engines = _rollouter(max_required=20, max_concurrent=2, delay=0.01)
    fit = asyncio.create_task(r.fit())
    await asyncio.sleep(0.05)
    assert len(r.active) <= 2
    await r.pause_for_sync(wait_for_active=True)
    assert not r.active, "wait_for_active returns only when nothing is in flight"
    admitted = r.total_admitted
    await asyncio.sleep(0.05)
    assert r.total_admitted == admitted, "paused: nothing admitted"
    await r.reset_staleness(1)
    await asyncio.sleep(0.05)
    assert r.total_admitted > admitted
    await r.stop()
    fit.cancel()
    assert r.max_active_seen <= 2


async def test_failed_runs_are_counted_and_give_back_quota():
    class Broken:
        def num_tasks(self):
            return 3

        def get_task(self, i):
            return {"i": i}

        async def run(self, task, request_id, client, params):
            raise RuntimeError("sandbox failed")

    engines = {"r0": EngineHandle("r0", engine=EchoEngine())}
    r = Rollouter(
        env=Broken(),
        client=ServerClient(LocalRouter(["r0"]), engines, partial_rollout=False),
        queue=MessageQueue(4),
        n=2,
        sampling=SamplingParams(max_tokens=2),
        max_required_samples=4,
        max_concurrent_samples=2,
        total_samples=6,
    )
    await asyncio.wait_for(r.fit(), 10)
    assert r.total_failed_trajectories == 12
    assert r.total_dropped_samples == 6
    assert r.window_admitted == 0, "dropped samples give their quota slot back"


async def test_env_may_return_segments():
    """An env returns one agent run as several segments (a black-box agent rewrote its history):
    each becomes a row of the sample; a run that returns an unscored segment counts as failed."""

    class Segmenting(EchoEnv):
        async def run(self, task, request_id, client, params):
            first = await super().run(task, request_id, client, params)
            second = await super().run(task, request_id, client, params)
            if task["index"] == 1:
                second.reward = None  # a broken env: every segment must be scored
            return [first, second]

    engines = {"r0": EngineHandle("r0", engine=EchoEngine())}
    queue = MessageQueue(8)
    r = Rollouter(
        env=Segmenting(num_tasks=2),
        client=ServerClient(LocalRouter(["r0"]), engines, partial_rollout=False),
        queue=queue,
        n=2,
        sampling=SamplingParams(max_tokens=2),
        max_required_samples=8,
        max_concurrent_samples=1,
        total_samples=2,
        shuffle=False,
    )
    await asyncio.wait_for(r.fit(), 10)
    samples = await queue.snapshot()
    assert len(samples) == 1 and samples[0].task_index == 0
    assert len(samples[0].trajectories) == 4, "2 runs x 2 segments"
    run_ids = [t.run_id for t in samples[0].trajectories]
    assert run_ids[0] == run_ids[1] != run_ids[2] == run_ids[3], "the segments of one run share its run_id"
    assert run_ids[0] == samples[0].trajectories[0].request_id
    assert samples[0].dropped == 0
    assert r.total_failed_trajectories == 2 and r.total_dropped_samples == 1


class _SlowReplyQueue(MessageQueue):
    """A queue whose ``put`` lands at once but answers late, like a put to the queue actor
    whose reply is still on its way back to the Rollouter."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        self.reply = asyncio.Event()

    async def put(self, sample):
        ok = await super().put(sample)
        await self.reply.wait()
        return ok


async def test_quota_counts_landed_samples_once_and_not_taken_ones():
    """Known numbers: quota 4 (window 2, staleness 1). The first window admits 4; all 4 land in
    the queue while their puts have not returned yet; the trainer takes 1. At the sync the
    carry-over is 3 (each queued sample once; the taken one not at all), so the next window may
    admit exactly 4 - 3 = 1 more."""
    engines = {"r0": EngineHandle("r0", engine=EchoEngine())}
    queue = _SlowReplyQueue(8)
    r = Rollouter(
        env=EchoEnv(),
        client=ServerClient(LocalRouter(["r0"]), engines, partial_rollout=True),
        queue=queue,
        n=1,
        sampling=SamplingParams(max_tokens=2),
        max_required_samples=4,
        max_concurrent_samples=8,
    )
    fit = asyncio.create_task(r.fit())
    for _ in range(200):
        if await queue.qsize() == 4:
            break
        await asyncio.sleep(0.01)
    assert await queue.qsize() == 4 and len(r.active) == 4, "all four landed, none of their puts returned"
    assert (await queue.get()) is not None  # the trainer takes one
    await r.pause_for_sync(wait_for_active=False)
    carried = await r.reset_staleness(1)
    assert carried == 3, "a landed sample counts once; a taken one does not count"
    await asyncio.sleep(0.1)
    assert r.windows[-1].quota == 1
    assert r.windows[-1].admitted == 1 and r.total_admitted == 5
    queue.reply.set()
    await asyncio.sleep(0.05)
    await r.stop()
    fit.cancel()
    assert r.window_admitted == 4
