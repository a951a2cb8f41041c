"""The built-in `sequence` env on the real transformers engine: EnvContract, answers of 32 tokens,
and its graded score checked against hand-computed values."""

from __future__ import annotations

import pytest

from ferryman.client import ServerClient
from ferryman.defaults.router import LocalRouter
from ferryman.engine_host import EngineHandle
from ferryman.envs.sequence import SequenceEnv, SequenceEnvConfig, make_target, score_sequence
from ferryman.testing import EnvContract
from ferryman.types import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
async def hf_client(tiny_model):
    from ferryman_engine_hf.engine import HFEngineConfig, make_hf_engine

    engine = make_hf_engine(HFEngineConfig(), model_path=str(tiny_model), replica="r0", seed=0)
    handle = EngineHandle("r0", engine=engine)
    await handle.start()
    yield ServerClient(LocalRouter(["r0"]), {"r0": handle}, partial_rollout=True)
    await handle.shutdown()


class TestSequenceEnvContract(EnvContract):
    @pytest.fixture
    def env(self, tokenizer):
        return SequenceEnv(SequenceEnvConfig(num_tasks=4), tokenizer)

    @pytest.fixture
    def client(self, hf_client):
        return hf_client


def test_score_by_hand():
    target = "0123456789"
    assert score_sequence("0123456789", target) == 1.0
    assert score_sequence(" 0123456789\n", target) == 1.0  # surrounding whitespace is not part of it
    assert score_sequence("01234", target) == 5 / 10  # half the target
    assert score_sequence("0123456789999", target) == 10 / 13  # three extra characters
    assert score_sequence("0123x56789", target) == 9 / 10  # one wrong position
    assert score_sequence("123456789", target) == 0 / 10  # shifted by one: nothing in place
    assert score_sequence("", target) == 0.0
    # digit_credit: another digit at a position earns that much, a non-digit or an extra nothing
    assert score_sequence("0123456755", target, digit_credit=0.1) == pytest.approx(8.2 / 10)
    assert score_sequence("01234567xy", target, digit_credit=0.1) == 8 / 10
    assert score_sequence("012345678977", target, digit_credit=0.1) == 10 / 12
    assert score_sequence("9999999999", target, digit_credit=0.5) == pytest.approx((1 + 0.5 * 9) / 10)
    with pytest.raises(ValueError):
        score_sequence("1", "")


def test_targets():
    assert make_target("count", 7, 12) == "789012345678"
    assert make_target("repeat", 4, 5) == "44444"
    assert make_target("copy", 0, 3, "914") == "914"


def test_tasks_and_answers_are_32_tokens(tokenizer):
    for pattern in ("count", "repeat", "copy"):
        env = SequenceEnv(SequenceEnvConfig(num_tasks=20, pattern=pattern), tokenizer, seed=3)
        for i in range(env.num_tasks()):
            task = env.get_task(i)
            assert len(task["target"]) == 32 and task["target"].isdigit()
            # every digit is one token: the exact answer is 32 tokens (and the end-of-turn token)
            assert len(tokenizer.encode(task["target"], add_special_tokens=False)) == 32
        if pattern == "copy":
            assert " ".join(env.get_task(0)["target"]) in env.get_task(0)["prompt"]
    a = SequenceEnv(SequenceEnvConfig(num_tasks=5), tokenizer, seed=1)
    b = SequenceEnv(SequenceEnvConfig(num_tasks=5), tokenizer, seed=1)
    assert [a.get_task(i) for i in range(5)] == [b.get_task(i) for i in range(5)]


async def test_run_scores_what_the_model_said(tokenizer, hf_client):
    env = SequenceEnv(SequenceEnvConfig(num_tasks=2, pattern="count"), tokenizer)
    task = env.get_task(1)
    traj = await env.run(task, "req-1", hf_client, SamplingParams(max_tokens=40, temperature=1.0, seed=0))
    traj.validate()
    text = tokenizer.decode(traj.response_ids, skip_special_tokens=True)
    assert traj.reward == score_sequence(text, task["target"])
    assert 1 <= sum(traj.response_mask) <= 40
    assert traj.metrics["sequence/exact"] == float(text.strip() == task["target"])


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="length"):
        SequenceEnvConfig(length=0)
    with pytest.raises(ValueError, match="pattern"):
        SequenceEnvConfig(pattern="fibonacci")
    with pytest.raises(ValueError, match="digit_credit"):
        SequenceEnvConfig(digit_credit=1.0)
