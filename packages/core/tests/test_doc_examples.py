"""docs/writing-a-plugin.md stays true: its multi-turn env and contract test, extracted from the
page as written, pass; the env takes a tool call through a real tokenizer and chat template."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

# these build the tiny model (core alone, as in `nox -s core`, has no transformers)
pytest.importorskip("transformers")

from ferryman.client import ServerClient
from ferryman.defaults.router import LocalRouter
from ferryman.engine_host import EngineHandle
from ferryman.testing.fixtures import tiny_tokenizer
from ferryman.types import SamplingParams, TokenOutput

DOC = Path(__file__).resolve().parents[3] / "docs" / "writing-a-plugin.md"


def doc_files() -> dict[str, str]:
    """The code blocks marked ``<!-- doc-test: NAME -->`` on the page, by file name."""
    text = DOC.read_text()
    return dict(re.findall(r"<!-- doc-test: (\S+) -->\n```python\n(.*?)```", text, re.S))


@pytest.fixture(scope="module")
def doc_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("doc")
    files = doc_files()
    assert set(files) == {"add_env.py", "test_add_env.py"}, sorted(files)
    for name, code in files.items():
        (d / name).write_text(code)
    return d


@pytest.fixture(scope="module")
def add_env(doc_dir):
    spec = importlib.util.spec_from_file_location("doc_add_env", doc_dir / "add_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # a fresh interpreter importing torch and transformers; the next test is the quick form
def test_the_pages_contract_test_passes_as_written(doc_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "asyncio_mode=auto", "-o", "addopts=", str(doc_dir / "test_add_env.py")],
        cwd=doc_dir, capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(doc_dir)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 passed" in proc.stdout, proc.stdout[-2000:]


async def test_the_pages_env_passes_the_contract(add_env):
    """What the page's test file does, in this process: every EnvContract test on AddEnv."""
    from ferryman.testing import EnvContract
    from ferryman.testing.fixtures import echo_client

    env = add_env.AddEnv(add_env.AddConfig(), tiny_tokenizer())
    contract = EnvContract()
    names = [n for n in dir(EnvContract) if n.startswith("test_")]
    assert len(names) == 4
    for name in names:
        method = getattr(contract, name)
        wants_client = "client" in method.__code__.co_varnames[: method.__code__.co_argcount]
        await (method(env, echo_client()) if wants_client else method(env))


class FakeScriptEngine:
    """An engine double that answers from a script of texts (encoded with the real tokenizer),
    one per call, and records the prompts it was given."""

    def __init__(self, tok, texts: list[str]) -> None:
        self.tok = tok
        self.texts = list(texts)
        self.prompts: list[tuple[str, list[int], list[int]]] = []

    async def start(self):
        pass

    async def generate(self, request_id, prompt_ids, params: SamplingParams, **_):
        self.prompts.append((request_id, list(prompt_ids), list(params.stop_token_ids)))
        ids = self.tok.encode(self.texts.pop(0), add_special_tokens=False)
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), versions=[0] * len(ids))


async def test_a_tool_call_round_trip_through_the_tiny_template(add_env):
    tok = tiny_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    env = add_env.AddEnv(add_env.AddConfig(), tok)
    task = env.get_task(7)  # 7 + 1
    engine = FakeScriptEngine(tok, ['<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 1}}\n</tool_call><|im_end|>', "It is 8.<|im_end|>"])
    client = ServerClient(LocalRouter(["r0"]), {"r0": EngineHandle("r0", engine=engine)}, partial_rollout=False)
    traj = await env.run(task, "run-1", client, SamplingParams(max_tokens=64))
    assert traj.reward == 1.0
    (rid1, p1, stop1), (rid2, p2, _) = engine.prompts
    assert rid1 == rid2 == "run-1", "every turn of the run under its request id"
    assert end in stop1, "a turn ends at <|im_end|>"
    first = tok.encode(engine_text := '<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 1}}\n</tool_call><|im_end|>', add_special_tokens=False)
    assert p2[: len(p1) + len(first)] == p1 + first, "the next turn's prompt extends the conversation"
    obs = [t for t, m in zip(traj.response_ids, traj.response_mask) if m == 0]
    assert "<tool_response>\n8\n</tool_response>" in tok.decode(obs) and engine_text
    # exactly what the chat template renders for the same conversation: the env's glue is right
    messages = [
        {"role": "user", "content": "What is 7 plus 1? Use the add tool."},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 7, "b": 1}}}]},
        {"role": "tool", "content": "8"},
    ]
    rendered = tok.apply_chat_template(messages, tools=add_env.TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.decode(p2) == tok.decode(rendered)
    assert sum(traj.response_mask) == len(first) + len(tok.encode("It is 8.<|im_end|>", add_special_tokens=False))
