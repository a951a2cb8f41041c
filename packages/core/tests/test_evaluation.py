"""``ferryman.evaluation``: pass@k, held-out splits, and evaluate() over a scripted client."""

from __future__ import annotations

import math

import pytest

from ferryman.config import ConfigError, load_config
from ferryman.evaluation import TaskSubset, evaluate, pass_at_k, split_env
from ferryman.types import SamplingParams, TokenOutput, Trajectory

from conftest import BASE


def test_pass_at_k_is_the_unbiased_estimate():
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert pass_at_k(4, 3, 2) == 1.0  # any two answers contain a pass
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


class CountingEnv:
    """Task i is passed by answers whose first token id is i (the client answers with the
    request's attempt number), so the expected numbers are known."""

    def __init__(self, num: int) -> None:
        self.num = num

    def num_tasks(self) -> int:
        return self.num

    def get_task(self, index: int) -> dict:
        return {"i": index}

    async def run(self, task, request_id, client, params):
        out = await client.generate(request_id, [1, 2], params)
        t = Trajectory(request_id=request_id, prompt_ids=[1, 2])
        t.append_model_tokens(out)
        if task["i"] == 3:
            raise RuntimeError("this task's runs fail")
        t.reward = 1.0 if out.token_ids[0] <= task["i"] else 0.0
        return t


class AttemptClient:
    async def generate(self, request_id, prompt_ids, params):
        attempt = int(request_id.split("-")[2])  # {prefix}-{task}-{attempt}-...
        return TokenOutput(token_ids=[attempt, 9][: params.max_tokens], log_probs=[-1.0] * min(2, params.max_tokens),
                           versions=[7] * min(2, params.max_tokens))


async def test_evaluate_counts_passes_failures_lengths_and_versions():
    r = await evaluate(CountingEnv(4), AttemptClient(), n=2, sampling=SamplingParams(max_tokens=2))
    # task 0: attempts 0, 1 -> rewards 1, 0; task 1: 1, 1; task 2: 1, 1; task 3: both fail
    assert [t["passed"] for t in r.tasks] == [1, 2, 2, 0]
    assert r.metrics["pass@1"] == pytest.approx((0.5 + 1 + 1 + 0) / 4)
    assert r.metrics["pass@2"] == pytest.approx(3 / 4)
    assert r.metrics["reward_mean"] == pytest.approx(5 / 6) and r.metrics["failed_runs"] == 2
    assert r.metrics["response_length_mean"] == 2 and r.metrics["min_version"] == r.metrics["max_version"] == 7
    r2 = await evaluate(CountingEnv(4), AttemptClient(), n=1, sampling=SamplingParams(max_tokens=1), num_tasks=2)
    assert r2.metrics["num_tasks"] == 2 and "val/pass@1" in r2.prefixed()


def test_split_holds_out_the_last_tasks():
    train, held = split_env(CountingEnv(10), 0.25)
    assert train.num_tasks() == 7 and held.num_tasks() == 3
    assert held.get_task(0) == {"i": 7} and train.get_task(6) == {"i": 6}
    with pytest.raises(ValueError, match="none to train on"):
        split_env(CountingEnv(1), 0.5)
    with pytest.raises(ValueError):
        TaskSubset(CountingEnv(2), [])


def test_validation_config_errors_name_the_field(host):
    with pytest.raises(ConfigError, match="env .held-out tasks. or split"):
        load_config(None, ["validation.split=0.1", "validation.env={num_tasks: 3}"], host)
    with pytest.raises(ConfigError, match="validation.n"):
        load_config(None, ["validation.n=0"], host)
    with pytest.raises(ConfigError, match="validation.env.num_tasks"):
        load_config(None, [*BASE, "validation.env={num_tasks: 0}"], host)
    cfg, plugin = load_config(None, [*BASE, "validation.env={num_tasks: 3}", "validation.every_steps=5"], host)
    assert cfg.validation.enabled and plugin["validation_env"].num_tasks == 3
    cfg, plugin = load_config(None, [*BASE, "validation.tasks={num_tasks: 4}"], host)  # the other spelling
    assert cfg.validation.env == {"num_tasks": 4} and plugin["validation_env"].num_tasks == 4
