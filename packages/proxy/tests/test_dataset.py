"""The ``dataset`` env: rows from jsonl/parquet checked with file, line and field; single-turn and
multi-turn runs with Python tools, tokenized exactly as the chat template renders the whole
conversation (the proxy's tokenization, as for a black-box agent)."""

from __future__ import annotations

import json

import pytest

from ferryman.config import ConfigError, load_config
from ferryman.plugins import PluginHost
from ferryman.testing import EnvContract
from ferryman.types import SamplingParams
from ferryman_proxy.dataset import DatasetEnv, DatasetEnvConfig, DatasetError, load_rows, tool_schema
from ferryman_proxy.dataset_examples import arithmetic_rows, calculator, first_number_reward
from ferryman_proxy.testing import ScriptedEngine

from proxy_helpers import hermes_call, server_client

EOS = 2
CALC = "ferryman_proxy.dataset_examples:calculator"


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", [{"q": "What is 2 plus 3?", "a": "5"}, {"q": "What is 1 plus 1?", "a": "2"}])


def answering(tok, text_for):
    def respond(prompt, params):
        return tok.encode(text_for(tok.decode(prompt)), add_special_tokens=False) + [EOS]

    return respond


def tool_script(text):
    """First turn: a calculator call; after the tool's answer: the number it returned."""
    if "<tool_response>" in text:
        return text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
    a, b = (int(x) for x in text.rsplit("What is ", 1)[1].split("?")[0].split(" plus "))
    return hermes_call("calculator", {"a": a, "b": b})


@pytest.fixture
def client(tokenizer):
    return server_client({"e0": ScriptedEngine(answering(tokenizer, tool_script))})


@pytest.fixture
def env(tokenizer, data):
    cfg = DatasetEnvConfig(path=str(data), prompt_key="q", answer_key="a", tools=[CALC], max_turns=3,
                           reward="ferryman_proxy.dataset_examples:first_number_reward")
    return DatasetEnv(cfg, tokenizer)


class TestDatasetEnvContract(EnvContract):
    sampling = SamplingParams(max_tokens=64, temperature=1.0)


async def test_tool_loop_runs_the_tool_and_tokenizes_like_the_whole_conversation(env, client, tokenizer):
    trajs = await env.run(env.get_task(0), "r-1", client, SamplingParams(max_tokens=64))
    assert len(trajs) == 1
    t = trajs[0]
    assert t.reward == 1.0 and t.metrics["dataset/exact"] == 1.0
    assert t.metrics["dataset/turns"] == 2 and t.metrics["dataset/tool_calls"] == 1
    assert t.extra["completion"] == "5"
    conversation = [
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    expected = tokenizer.apply_chat_template(conversation, tools=[tool_schema(calculator)], tokenize=True, return_dict=False)
    assert t.prompt_ids + t.response_ids == list(expected)
    # the model's tokens are exactly the two answers (mask 1); template and tool output mask 0
    model_text = tokenizer.decode([i for i, m in zip(t.response_ids, t.response_mask) if m])
    assert model_text == hermes_call("calculator", {"a": 2, "b": 3}) + "<|im_end|>" + "5<|im_end|>"
    assert env.stats()["dataset/tool_calls"] == 1


async def test_single_turn_without_tools(tokenizer, data):
    env = DatasetEnv(DatasetEnvConfig(path=str(data), prompt_key="q", answer_key="a", system_prompt="Answer with a number."), tokenizer)
    c = server_client({"e0": ScriptedEngine(answering(tokenizer, lambda text: "2 or so"))})
    (t,) = await env.run(env.get_task(1), "r-2", c, SamplingParams(max_tokens=16))
    assert t.reward == 0.0  # default reward: exact match of "2 or so" with "2"
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 1 plus 1?"},
         {"role": "assistant", "content": "2 or so"}], tokenize=True, return_dict=False)
    assert t.prompt_ids + t.response_ids == list(expected)
    assert first_number_reward("2 or so", "2") == {"reward": 0.5, "exact": 0.0}


async def test_a_tool_error_goes_back_to_the_model(tokenizer, data):
    env = DatasetEnv(DatasetEnvConfig(path=str(data), prompt_key="q", answer_key="a", tools=[CALC], max_turns=2), tokenizer)
    seen = []

    def script(text):
        seen.append(text)
        return "done" if "<tool_response>" in text else hermes_call("calculator", {"a": 1, "b": 2, "op": "/"})

    c = server_client({"e0": ScriptedEngine(answering(tokenizer, script))})
    (t,) = await env.run(env.get_task(0), "r-3", c, SamplingParams(max_tokens=64))
    assert "error: ValueError: unknown op '/'" in seen[-1]
    assert env.stats()["dataset/tool_errors"] == 1 and t.reward == 0.0


def test_rows_from_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = arithmetic_rows(("What is {a} plus {b}?",))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert load_rows(tmp_path / "d.parquet", "question", "answer") == rows
    with pytest.raises(DatasetError, match=r"d.parquet: field 'prompt' \(prompt_key\): no such column"):
        load_rows(tmp_path / "d.parquet", "prompt", "answer")
    pq.write_table(pa.Table.from_pylist([{"question": "x", "answer": 1}, {"question": "", "answer": 2}]), tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match=r"bad.parquet: row 1: field 'question': empty prompt"):
        load_rows(tmp_path / "bad.parquet", "question", "answer")


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        (['{"q": "a", "a": 1}', '{"q": "b"}'], r"train.jsonl:2: field 'a' \(answer_key\): missing"),
        (['{"q": "a", "a": 1}', "", '{"q": "b", "a": 1'], r"train.jsonl:3: not valid JSON"),
        (['[1, 2]'], r"train.jsonl:1: a row must be a JSON object"),
        (['{"q": 3, "a": 1}'], r"train.jsonl:1: field 'q': must be a string or a non-empty list"),
        (['{"q": [{"role": "user"}], "a": 1}'], r"train.jsonl:1: field 'q'\[0\]: a chat message needs"),
    ],
)
def test_bad_rows_fail_the_config_with_file_line_and_field(tmp_path, lines, match):
    path = write_jsonl(tmp_path / "train.jsonl", lines)
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["env.type=dataset", f"env.path={path}", "env.prompt_key=q", "env.answer_key=a"], PluginHost())


def test_config_errors_name_the_field(tmp_path, data):
    host = PluginHost()
    base = ["env.type=dataset", f"env.path={data}", "env.prompt_key=q", "env.answer_key=a"]
    with pytest.raises(ConfigError, match="env.reward"):
        load_config(None, [*base, "env.reward=nope"], host)
    with pytest.raises(ConfigError, match="reward: cannot import 'no_such_module'"):
        load_config(None, [*base, "env.reward=no_such_module:f"], host)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(None, ["env.type=dataset", f"env.path={tmp_path / 'missing.jsonl'}"], host)
    _, plugin = load_config(None, [*base, f"env.tools=[{CALC}]"], host)
    assert plugin["env"].tools == [CALC]


async def test_a_tool_run_replays_from_its_record(env, client):
    """resumable: a run is a function of its row and the model's outputs, so a resumed run that
    replays the recorded outputs rebuilds the same trajectory without calling the engine."""
    from ferryman.replay import RunRecorder

    rec = RunRecorder(client)
    rec.begin("r-9")
    (first,) = await env.run(env.get_task(0), "r-9", rec, SamplingParams(max_tokens=64))
    log = rec.runs["r-9"].log
    rec.end("r-9")

    class NoEngine:
        async def generate(self, *a, **k):
            raise AssertionError("a replayed run must not call the engine")

    again = RunRecorder(NoEngine())
    again.begin("r-9", log)
    (second,) = await env.run(env.get_task(0), "r-9", again, SamplingParams(max_tokens=64))
    assert again.replayed_calls == 2 and again.diverged_runs == 0
    assert (second.prompt_ids, second.response_ids, second.response_mask, second.rollout_log_probs) == (
        first.prompt_ids, first.response_ids, first.response_mask, first.rollout_log_probs)
