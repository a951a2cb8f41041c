"""Live streaming: what may be sent before the answer is complete (a property over random
answers, for every tool parser and stop strings), incremental decoding of multi-byte text, and
the SSE stream over real HTTP from a scripted fake engine that streams token by token."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ferryman.client import ServerClient
from ferryman.defaults.router import LocalRouter
from ferryman.types import SamplingParams, TokenOutput
from ferryman_proxy import ProxyConfig, ProxyServer
from ferryman_proxy.parsers import get_parser
from ferryman_proxy.streaming import IncrementalDecoder, content_limit
from ferryman_proxy.testing import ScriptedEngine

from proxy_helpers import TOOLS, hermes_call, snapshot

EOS = 2

# ------------------------------------------------------------------ what may be sent early (pure)

FRAGMENTS = [
    "a", "b", " ", "\n", "\n\n", "é", "🙂", "<", "<tool", "<tool_call>", "</tool_call>", "<tool_call>\n", "\n</tool_call>",
    '{"name": "add", "arguments": {"a": 1}}', "<function=add>\n", "<parameter=a>\n", "1", "\n</parameter>\n", "</function>\n",
    "STOP", "ST", "OP", "<|", "end",
]


def final_content(text: str, parser_name: str | None, stops: list[str]) -> str:
    """The answer's ``content`` as the session computes it (cut at the first stop string, then
    parse the tool calls)."""
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    if hits:
        text = text[: min(hits)]
    if parser_name is None:
        return text
    return get_parser(parser_name).parse(text, TOOLS).content or ""


CALLS = [
    hermes_call("add", {"a": 1, "b": 2}),
    "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
]
"""Well-formed calls in both formats (so that answers with real calls are common)."""

texts = st.one_of(
    st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join),
    st.tuples(
        st.lists(st.sampled_from(FRAGMENTS[:8] + ["STOP", "ok."]), max_size=6).map("".join),
        st.sampled_from(["", "\n", "\n\n", " ", " \n"]),
        st.lists(st.sampled_from(CALLS), min_size=1, max_size=2).map("\n".join),
        st.sampled_from(["", "\n", "x", "<tool"]),
    ).map("".join),
)


@pytest.mark.parametrize("parser_name", ["hermes", "qwen3_coder", "none", None])
@given(text=texts, stops=st.lists(st.sampled_from(["STOP", "\n\n", "end", "é"]), max_size=2))
def test_what_is_sent_early_is_always_a_prefix_of_the_final_content(parser_name, text, stops):
    want = final_content(text, parser_name, stops)
    parser = get_parser(parser_name) if parser_name is not None else None
    sent = 0
    for i in range(len(text) + 1):
        limit = content_limit(text[:i], parser, stops)
        assert want.startswith(text[:limit]), (text[:i], limit, want)
        sent = max(sent, limit)
    # nothing that is certainly content is held back once the whole text is in (except what a
    # tool call, a trim or a stop may still cut off, which the final chunk settles)
    if parser_name in ("none", None) and not stops:
        assert sent == len(text) == len(want)


def test_held_back_examples():
    hermes, coder = get_parser("hermes"), get_parser("qwen3_coder")
    assert content_limit("Let me add.\n<tool", hermes, []) == len("Let me add.")
    assert content_limit("Let me add.\n<tool_call>\n{", hermes, []) == len("Let me add.")
    assert content_limit("so <to", hermes, []) == len("so ")
    assert content_limit("so <to", None, []) == len("so <to"), "tool_choice none: tags are content"
    assert content_limit("done ST", hermes, ["STOP"]) == len("done ")
    assert content_limit("done STOP more", hermes, ["STOP"]) == len("done ")
    assert content_limit("ok then  ", coder, []) == len("ok then")
    assert content_limit(" ok", coder, []) == 0, "leading space: stripped only if a call follows"


def _byte_decode(ids: list[int]) -> str:
    """A byte-level decoder (one token per UTF-8 byte, as byte-level BPE falls back to): an
    incomplete character decodes to U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


@given(text=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"), max_size=40), sizes=st.lists(st.integers(1, 4), min_size=1, max_size=8))
def test_incremental_decoder_never_emits_a_broken_character(text, sizes):
    ids = list(text.encode("utf-8"))
    dec = IncrementalDecoder(_byte_decode, frozenset({256}))
    pos, k, out = 0, 0, []
    while pos < len(ids):
        step = ids[pos : pos + sizes[k % len(sizes)]] + [256]  # a skipped id in between too
        pos, k = pos + len(step) - 1, k + 1
        new = dec.feed(step)
        out.append(new)
        assert text.startswith(dec.text) and "".join(out) == dec.text
    assert dec.text == text


def test_incremental_decoder_with_the_tiny_tokenizer(tokenizer):
    text = "The answer is 5. Then: add 2 and 3, twice over."
    ids = tokenizer.encode(text, add_special_tokens=False)
    dec = IncrementalDecoder(lambda x: tokenizer.decode(x, skip_special_tokens=True), frozenset({EOS}))
    pieces = [dec.feed([t]) for t in [*ids, EOS]]
    assert "".join(pieces) == dec.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert sum(1 for p in pieces if p) > 5, "text comes as it is decoded"


# ------------------------------------------------------------------ over HTTP


class StreamingScriptedEngine(ScriptedEngine):
    """A *fake* engine (:class:`ScriptedEngine`'s scripted answers) that streams: each token is
    delivered through ``on_tokens`` after ``step_s``, as a real engine's steps would be."""

    def __init__(self, responder, *, step_s: float = 0.002) -> None:
        super().__init__(responder)
        self.step_s = step_s
        self.progress: list[int] = []

    async def generate(self, request_id, prompt_ids, params, *, on_tokens=None) -> TokenOutput:
        out = await super().generate(request_id, prompt_ids, params)
        for i, t in enumerate(out.token_ids):
            await asyncio.sleep(self.step_s)
            self.progress.append(t)
            if on_tokens is not None:
                on_tokens(TokenOutput([t], [out.log_probs[i]], [out.versions[i]]))
        return out


class PlainClient:
    """A generate client without ``on_tokens`` (the GenerateClient protocol as it was)."""

    def __init__(self, client: ServerClient) -> None:
        self.client = client

    async def generate(self, request_id, prompt_ids, params):
        return await self.client.generate(request_id, prompt_ids, params)


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def live(tokenizer, tmp_path):
    made: list[ProxyServer] = []

    async def make(answers: list[str], *, plain: bool = False, **cfg: Any):
        queue = [tokenizer.encode(a, add_special_tokens=False) + [EOS] for a in answers]
        engine = StreamingScriptedEngine(lambda prompt, params: queue.pop(0))
        client: Any = ServerClient(LocalRouter(["e0"]), {"e0": engine}, partial_rollout=False)
        if plain:
            client = PlainClient(client)
        cfg.setdefault("debug_dir", str(tmp_path / "debug"))
        server = ProxyServer(tokenizer=tokenizer, client=client, config=ProxyConfig(**cfg))
        await server.start()
        made.append(server)
        return server, engine

    yield make
    for s in made:
        await s.stop()


async def sse(http, sess, body: dict[str, Any], engine=None) -> tuple[list[dict[str, Any]], list[int]]:
    """The chunks of a streamed answer, and per chunk how many tokens the engine had made."""
    r = await http.post(sess.base_url + "/chat/completions", json={"model": "ferryman-policy", "stream": True, **body})
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    chunks, progress, buf = [], [], b""
    async for data in r.content.iter_any():
        buf += data
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            assert event.startswith(b"data: ")
            payload = event[6:]
            if payload == b"[DONE]":
                return chunks, progress
            chunks.append(json.loads(payload))
            progress.append(len(engine.progress) if engine is not None else 0)
    raise AssertionError("no [DONE]")


def contents(chunks) -> list[str]:
    return [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]


async def test_stream_holds_back_a_stop_string_and_equals_the_json_answer(live, http):
    answer = "The sum is 5. ENDING here, more text"
    server, engine = await live([answer, answer])
    msgs = [{"role": "user", "content": "Add."}]
    s1, s2 = server.open_session("a", SamplingParams(max_tokens=64)), server.open_session("b", SamplingParams(max_tokens=64))
    chunks, progress = await sse(http, s1, {"messages": msgs, "stop": ["END"]}, engine)
    status = await http.post(s2.base_url + "/chat/completions", json={"model": "ferryman-policy", "messages": msgs, "stop": ["END"]})
    plain = (await status.json())["choices"][0]
    assert "".join(contents(chunks)) == plain["message"]["content"] == "The sum is 5. "
    assert chunks[-1]["choices"][0]["finish_reason"] == plain["finish_reason"] == "stop"
    n = len(engine.progress)
    first = next(i for i, c in enumerate(chunks) if c["choices"][0]["delta"].get("content"))
    assert progress[first] < n / 2, "content was sent while the engine was generating"
    assert snapshot(s1)[0] == snapshot(s2)[0], "the same tokens, masks and log-probs are recorded"
    assert server.counters["live_streams"] == 1


async def test_stream_sends_content_then_the_tool_call(live, http, tokenizer):
    answer = "Adding now.\n" + hermes_call("add", {"a": 2, "b": 3})
    server, engine = await live([answer])
    sess = server.open_session("t", SamplingParams(max_tokens=128))
    chunks, progress = await sse(http, sess, {"messages": [{"role": "user", "content": "2+3?"}], "tools": TOOLS, "return_token_ids": True}, engine)
    text = contents(chunks)
    assert "".join(text) == "Adding now." and len(text) >= 2
    assert not any("<" in t or "\n" in t for t in text), "nothing of the tool call leaks into content"
    calls = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls") or ()]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "add" and json.loads(calls[0]["function"]["arguments"]) == {"a": 2, "b": 3}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    first = next(i for i, c in enumerate(chunks) if c["choices"][0]["delta"].get("content"))
    assert progress[first] < len(engine.progress) / 3
    ids = [i for c in chunks for i in c["choices"][0].get("token_ids") or []]
    assert ids == tokenizer.encode(answer, add_special_tokens=False) + [EOS]
    assert chunks[0]["prompt_token_ids"] == engine.calls[0][1]


async def test_client_without_on_tokens_streams_the_old_way(live, http):
    server, engine = await live(["hello there, " * 8], plain=True, stream_chunk_chars=16)
    sess = server.open_session("p", SamplingParams(max_tokens=128))
    chunks, progress = await sse(http, sess, {"messages": [{"role": "user", "content": "hi"}]}, engine)
    assert "".join(contents(chunks)) == "hello there, " * 8 and len(contents(chunks)) > 1
    assert all(p == len(engine.progress) for p in progress), "the whole stream comes once the answer is done"
    assert server.counters["live_streams"] == 0


async def test_error_after_the_stream_opened_is_an_error_event(live, http):
    server, engine = await live(["word " * 60])
    engine.step_s = 0.01
    sess = server.open_session("x", SamplingParams(max_tokens=128))
    r = await http.post(sess.base_url + "/chat/completions", json={"model": "ferryman-policy", "stream": True, "messages": [{"role": "user", "content": "go"}]})
    assert r.status == 200
    first = await r.content.readuntil(b"\n\n")
    assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
    await server.close_session(sess)  # the session ends while the answer streams
    rest = (await r.content.read()).split(b"\n\n")
    events = [e[6:] for e in rest if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "session_not_found"
    assert server.counters["stream_errors"] == 1
    assert sess.result().trajectories == [], "an answer that was not delivered whole is not recorded"


async def test_agent_that_hangs_up_mid_stream_still_gets_its_turn_recorded(live, http):
    """As without streaming: the answer is recorded, so the agent's retry replaces it."""
    server, engine = await live(["word " * 40, "word " * 40])
    engine.step_s = 0.005
    sess = server.open_session("h", SamplingParams(max_tokens=400))
    msgs = [{"role": "user", "content": "go"}]
    r = await http.post(sess.base_url + "/chat/completions", json={"model": "ferryman-policy", "stream": True, "messages": msgs})
    await r.content.readuntil(b"\n\n")
    r.close()  # hang up
    for _ in range(400):
        if sess.turns == 1:
            break
        await asyncio.sleep(0.01)
    assert sess.turns == 1 and len(sess.result().trajectories[0].response_ids) > 40
    assert engine.progress and len(engine.progress) == sess.counters["completion_tokens"], "generated to the end"
    chunks, _ = await sse(http, sess, {"messages": msgs})  # the retry
    assert "".join(contents(chunks)) == "word " * 40 and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert sess.counters["retries"] == 1 and sess.turns == 2
