"""The Trainer's loop around its backend: it takes the next local step's samples while a step
trains (within a sync window only, never across a sync) and reports a step's metrics while the
next step runs, in step order."""

from __future__ import annotations

import asyncio
import time

from ferryman.config import RunConfig
from ferryman.defaults.queue import MessageQueue
from ferryman.trainer_loop import Trainer
from ferryman.types import Sample, TokenOutput, Trajectory

TRAIN_S = 0.2


class _SlowBackend:
    """A backend double: each actor update takes TRAIN_S (a thread, like a real update)."""

    has_reference = False
    has_critic = False

    def __init__(self) -> None:
        self.updates: list[tuple[float, float]] = []

    def update_actor(self, batch):
        t0 = time.monotonic()
        time.sleep(TRAIN_S)
        self.updates.append((t0, time.monotonic()))
        return {}


class _Sync:
    """Records each weight update; the update itself takes a little while."""

    def __init__(self, queue: MessageQueue) -> None:
        self.queue = queue
        self.updates: list[tuple[int, float, float, int]] = []

    async def update_weights(self, version: int) -> dict[str, float]:
        t0 = time.monotonic()
        await asyncio.sleep(0.05)
        self.updates.append((version, t0, time.monotonic(), await self.queue.qsize()))
        return {}


class _TimedQueue(MessageQueue):
    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        self.gets: list[float] = []

    async def get(self, timeout=None):
        sample = await super().get(timeout)
        if sample is not None:
            self.gets.append(time.monotonic())
        return sample


def _sample(i: int) -> Sample:
    traj = Trajectory(request_id=f"r{i}", prompt_ids=[1, 2, 3])
    traj.append_model_tokens(TokenOutput(token_ids=[4, 5], log_probs=[-1.0, -1.0], versions=[0, 0]))
    traj.reward = float(i % 2)
    return Sample(uid=f"s{i}", task_index=i, trajectories=[traj])


def _trainer(queue, sync, backend, trigger: int, steps: int, on_metrics=None, colocated: bool = False) -> Trainer:
    cfg = RunConfig.model_validate(
        {
            "training": {"ppo_mini_batch_size": 1, "total_steps": steps},
            "async_training": {"trigger_parameter_sync_step": trigger, "colocated": colocated},
        }
    )
    return Trainer(cfg=cfg, backend=backend, queue=queue, synchronizer=sync, pad_token_id=0, on_metrics=on_metrics)


async def test_next_samples_are_taken_while_a_step_trains_but_not_across_a_sync():
    queue = _TimedQueue(16)
    for i in range(10):
        await queue.put(_sample(i))
    backend, sync = _SlowBackend(), _Sync(queue)
    trainer = _trainer(queue, sync, backend, trigger=3, steps=6)
    records = await asyncio.wait_for(trainer.fit(), 30)
    assert [r["sample_uids"] for r in records] == [[f"s{i}"] for i in range(6)]
    assert len(queue.gets) == 6, "nothing taken beyond the last step"
    up = backend.updates
    # steps 2 and 3 (same window as step 1) and 5, 6: taken before the step before finished
    # training (as it started)
    for k in (1, 2, 4, 5):
        assert queue.gets[k] < up[k - 1][1] and queue.gets[k] < up[k - 1][0] + TRAIN_S / 2, (k, queue.gets, up)
    # steps 4 (first of window 2): taken only after the sync that ended window 1
    (_, _, s1, qsize_at_sync), _ = sync.updates
    assert queue.gets[3] >= s1
    assert qsize_at_sync == 7, "at the sync the next window's samples are all still queued"


async def test_mode_a_takes_nothing_ahead():
    queue = _TimedQueue(16)
    for i in range(4):
        await queue.put(_sample(i))
    backend = _SlowBackend()
    sync = _Sync(queue)
    await asyncio.wait_for(_trainer(queue, sync, backend, trigger=1, steps=3).fit(), 30)
    assert [q for *_, q in sync.updates] == [3, 2, 1], "each sync sees every later sample still queued"
    for (_, _, s_end, _), get in zip(sync.updates, queue.gets[1:]):
        assert get >= s_end


async def test_metrics_are_reported_while_the_next_step_runs_in_order():
    queue = _TimedQueue(16)
    for i in range(4):
        await queue.put(_sample(i))
    seen: list[tuple[int, float, float]] = []

    async def slow_metrics(step, m):
        start = time.monotonic()
        await asyncio.sleep(0.15)  # e.g. stats asked of other actors
        seen.append((step, start, time.monotonic()))

    backend = _SlowBackend()
    await asyncio.wait_for(_trainer(queue, _Sync(queue), backend, trigger=4, steps=4, on_metrics=slow_metrics).fit(), 30)
    assert [s for s, _, _ in seen] == [1, 2, 3, 4], "every step reported, in order, before fit returns"
    # each report overlapped the next step's update: it ended after that update had started, and
    # began before that update ended. Serial reporting would end every report before the next
    # update starts. (Intervals, not a wall-clock budget: a busy machine stretches both alike.)
    for k in range(3):
        _, report_start, report_end = seen[k]
        next_start, next_end = backend.updates[k + 1]
        assert report_end > next_start, f"step {k + 1}'s report finished before step {k + 2} began training"
        assert report_start < next_end, f"step {k + 1}'s report began after step {k + 2} had trained"
