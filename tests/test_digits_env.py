"""The built-in `digits` env on the real transformers engine: passes EnvContract, scores
exactly, and its multi-turn trajectories are token-exact with the chat template."""

from __future__ import annotations

import pytest

from ferryman.client import ServerClient
from ferryman.defaults.router import LocalRouter
from ferryman.engine_host import EngineHandle
from ferryman.envs.digits import DigitsEnv, DigitsEnvConfig, score_answer
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


class TestDigitsEnvContract(EnvContract):
    @pytest.fixture
    def env(self, tokenizer):
        return DigitsEnv(DigitsEnvConfig(num_tasks=4, turns=2), tokenizer)

    @pytest.fixture
    def client(self, hf_client):
        return hf_client


def test_scoring():
    assert score_answer("7", "7") == 1.0
    assert score_answer(" 7 ", "7") == 1.0
    assert score_answer("78", "7", partial=0.5) == 0.5
    assert score_answer("3", "7", wrong=0.1) == 0.1
    assert score_answer("x7", "7") == 0.0
    assert score_answer("", "7") == 0.0


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="digits"):
        DigitsEnvConfig(digits="12a")
    with pytest.raises(ValueError, match="turns"):
        DigitsEnvConfig(turns=0)


async def test_multi_turn_trajectory_is_token_exact(tokenizer, hf_client):
    env = DigitsEnv(DigitsEnvConfig(num_tasks=3, turns=3), tokenizer, seed=1)
    task = env.get_task(0)
    traj = await env.run(task, "req-1", hf_client, SamplingParams(max_tokens=1, temperature=1.0, seed=0))
    traj.validate()
    # rebuild the conversation as messages and render it whole with the chat template
    ids = traj.response_ids
    mask = traj.response_mask
    answers, cur = [], []
    for tok, m in zip(ids, mask):
        if m:
            cur.append(tok)
        elif cur:
            answers.append(cur)
            cur = []
    answers.append(cur)
    assert len(answers) == 3
    messages = []
    from ferryman.envs.digits import FOLLOW_UP

    for turn, digit in enumerate(task["digits"]):
        content = task["template"].format(d=digit) if turn == 0 else FOLLOW_UP.format(d=digit)
        messages.append({"role": "user", "content": content})
        if turn < 2:
            text = tokenizer.decode([t for t in answers[turn] if t != tokenizer.eos_token_id])
            messages.append({"role": "assistant", "content": text})
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    built = traj.prompt_ids + ids[: len(ids) - len(answers[2])]
    assert built == list(full), "incremental tokens must equal the template of the whole conversation"
    # model tokens carry versions and log-probs; observation tokens carry none
    assert all(v == 0 for v, m in zip(traj.token_versions, mask) if m)
    assert all(v == -1 and lp == 0.0 for v, lp, m in zip(traj.token_versions, traj.rollout_log_probs, mask) if not m)
