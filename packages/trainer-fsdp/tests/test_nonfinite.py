"""The real FSDP backend on a model with a non-finite weight: every update's gradient norm is
NaN and skipped; core's Trainer stops the run instead of reporting success."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from ferryman.checkpoint import TrainingStalledError
from ferryman.config import AlgorithmConfig, RunConfig
from ferryman.defaults.queue import MessageQueue
from ferryman.tiny import build_tiny_model
from ferryman.trainer_loop import Trainer
from ferryman.types import Sample, TokenOutput, Trajectory
from ferryman_trainer_fsdp.trainer import FSDPTrainerConfig, make_fsdp_trainer

torch.set_num_threads(1)


class _NoSync:
    async def update_weights(self, version: int) -> dict[str, float]:
        return {}


def _sample(i: int) -> Sample:
    trajs = []
    for j in range(2):
        t = Trajectory(request_id=f"r{i}-{j}", prompt_ids=[5, 6, 7])
        t.append_model_tokens(TokenOutput(token_ids=[8 + j, 9], log_probs=[-2.0, -2.0], versions=[0, 0]))
        t.reward = float(j)
        trajs.append(t)
    return Sample(uid=f"s{i}", task_index=i, trajectories=trajs)


async def test_a_model_with_a_nan_weight_stops_the_run(tmp_path):
    tiny = build_tiny_model(tmp_path / "tiny", vocab_size=160)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    model.save_pretrained(tiny)
    backend = make_fsdp_trainer(FSDPTrainerConfig(lr=1e-3), model_path=str(tiny), algorithm=AlgorithmConfig(), seed=0)
    try:
        queue = MessageQueue(8)
        for i in range(4):
            await queue.put(_sample(i))
        cfg = RunConfig.model_validate({"training": {"ppo_mini_batch_size": 1, "total_steps": 4, "max_nonfinite_grad_steps": 2}})
        seen: list[float] = []
        trainer = Trainer(
            cfg=cfg, backend=backend, queue=queue, synchronizer=_NoSync(), pad_token_id=0,
            on_step_end=lambda step, m: seen.append(m["actor/grad_norm"]),
        )
        with pytest.raises(TrainingStalledError, match=r"2 trainer steps in a row \(up to step 2\)"):
            await asyncio.wait_for(trainer.fit(), 120)
        assert len(seen) == 1 and math.isnan(seen[0])
    finally:
        backend.close()
