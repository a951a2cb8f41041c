"""A trainer that skips step after step for non-finite gradients stops the run (it would train
nothing and still report success); the occasional skipped step does not."""

from __future__ import annotations

import asyncio

import pytest

from ferryman.checkpoint import TrainingStalledError
from ferryman.config import RunConfig
from ferryman.defaults.queue import MessageQueue
from ferryman.trainer_loop import Trainer
from ferryman.types import Sample, TokenOutput, Trajectory


class _NormBackend:
    """A backend double reporting the gradient norms it is given, one per update."""

    has_reference = False
    has_critic = False

    def __init__(self, norms: list[float]) -> None:
        self.norms = list(norms)

    def update_actor(self, batch):
        return {"actor/grad_norm": self.norms.pop(0), "actor/pg_loss": 0.0}


class _NoSync:
    async def update_weights(self, version: int) -> dict[str, float]:
        return {}


def _sample(i: int) -> Sample:
    traj = Trajectory(request_id=f"r{i}", prompt_ids=[1, 2, 3])
    traj.append_model_tokens(TokenOutput(token_ids=[4, 5], log_probs=[-1.0, -1.0], versions=[0, 0]))
    traj.reward = float(i % 2)
    return Sample(uid=f"s{i}", task_index=i, trajectories=[traj])


async def _fit(norms: list[float], steps: int, limit: int) -> Trainer:
    queue = MessageQueue(32)
    for i in range(steps):
        await queue.put(_sample(i))
    cfg = RunConfig.model_validate({"training": {"ppo_mini_batch_size": 1, "total_steps": steps, "max_nonfinite_grad_steps": limit}})
    trainer = Trainer(cfg=cfg, backend=_NormBackend(norms), queue=queue, synchronizer=_NoSync(), pad_token_id=0)
    await asyncio.wait_for(trainer.fit(), 30)
    return trainer


async def test_consecutive_nonfinite_gradient_steps_stop_the_run():
    nan = float("nan")
    with pytest.raises(TrainingStalledError, match=r"3 trainer steps in a row \(up to step 4\) had a non-finite gradient norm \(actor/grad_norm=nan\)"):
        await _fit([1.0, nan, float("inf"), nan, 1.0, 1.0], steps=6, limit=3)


async def test_a_run_whose_every_step_was_skipped_fails_at_its_end():
    with pytest.raises(TrainingStalledError, match=r"every one of the 2 trainer steps had a non-finite gradient norm"):
        await _fit([float("nan")] * 2, steps=2, limit=5)


async def test_occasional_nonfinite_steps_are_counted_not_fatal():
    nan = float("nan")
    trainer = await _fit([nan, 1.0, nan, nan, 1.0], steps=5, limit=3)
    assert len(trainer.step_records) == 5 and trainer.nonfinite_grad_steps == 3
