"""The proxy over real HTTP (aiohttp server and client) in front of a scripted fake engine
behind core's ServerClient: answer formats, segments, retries, limits, security, bad input."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from ferryman.types import SamplingParams
from ferryman_proxy import ProxyConfig, ProxyServer
from ferryman_proxy.testing import ScriptedEngine

from proxy_helpers import TOOLS, hermes_call, server_client, snapshot

EOS = 2  # <|im_end|>


class Script:
    """Answers from a queue of texts (encoded, EOS appended unless ``eos=False``)."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.queue: list[list[int]] = []

    def say(self, text: str, eos: bool = True) -> None:
        self.queue.append(self.tok.encode(text, add_special_tokens=False) + ([EOS] if eos else []))

    def __call__(self, prompt, params):
        return self.queue.pop(0) if self.queue else [EOS]


@pytest.fixture
async def proxy(tokenizer, tmp_path):
    """A factory: ``await proxy(**config)`` -> (server, script, engine); stopped after the test."""
    made: list[ProxyServer] = []

    async def make(**cfg: Any):
        script = Script(tokenizer)
        engine = ScriptedEngine(script)
        cfg.setdefault("debug_dir", str(tmp_path / "debug"))
        server = ProxyServer(tokenizer=tokenizer, client=server_client({"e0": engine}), config=ProxyConfig(**cfg))
        await server.start()
        made.append(server)
        return server, script, engine

    yield make
    for s in made:
        await s.stop()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as s:
        yield s


async def post(http, sess, body: dict[str, Any] | bytes | str, path: str = "/chat/completions") -> tuple[int, Any]:
    url = sess.base_url + path if not isinstance(sess, str) else sess
    if isinstance(body, dict):
        body = {"model": "ferryman-policy", **body}
        r = await http.post(url, json=body)
    else:
        r = await http.post(url, data=body, headers={"Content-Type": "application/json"})
    text = await r.text()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text


def render(tok, messages, tools=None, gen=False) -> list[int]:
    return list(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=True, return_dict=False))


# ------------------------------------------------------------------ answers


async def test_tool_call_round_trip_multi_turn_is_token_exact(proxy, http, tokenizer):
    server, script, engine = await proxy()
    sess = server.open_session("r-1", SamplingParams(max_tokens=64))
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 3?"}]
    script.say(hermes_call("add", {"a": 2, "b": 3}))
    status, out = await post(http, sess, {"messages": msgs, "tools": TOOLS})
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    assert choice["message"]["content"] is None
    assert out["usage"]["prompt_tokens"] == len(render(tokenizer, msgs, TOOLS, gen=True))

    msgs += [choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
    script.say("The answer is 5.")
    status, out = await post(http, sess, {"messages": msgs, "tools": TOOLS})
    assert status == 200 and out["choices"][0]["message"]["content"] == "The answer is 5."
    assert out["choices"][0]["finish_reason"] == "stop"
    # the engine was given exactly the whole conversation so far, under one request id
    assert engine.calls[-1][1] == render(tokenizer, msgs, TOOLS, gen=True)
    assert {c[0] for c in engine.calls} == {"r-1"}

    msgs.append(out["choices"][0]["message"])
    result = await server.close_session(sess)
    assert result.end_reason is None and len(result.trajectories) == 1
    t = result.trajectories[0]
    assert t.prompt_ids + t.response_ids == render(tokenizer, msgs, TOOLS)
    assert result.metrics["proxy/turns"] == 2 and result.metrics["proxy/tool_calls"] == 1
    # generated tokens: mask 1; tool response, template glue and the EOS tail: mask 0
    gen = [tid for tid, m in zip(t.response_ids, t.response_mask) if m]
    assert gen == script_tokens(tokenizer, [hermes_call("add", {"a": 2, "b": 3}), "The answer is 5."])
    assert t.response_mask[-1] == 0 and t.response_ids[-2:] == [EOS, tokenizer.encode("\n")[0]]


def script_tokens(tok, texts):
    return [i for t in texts for i in tok.encode(t, add_special_tokens=False) + [EOS]]


async def test_token_ids_and_logprobs_vllm_style(proxy, http, tokenizer):
    server, script, engine = await proxy()
    sess = server.open_session("r-2", SamplingParams(max_tokens=200))
    msgs = [{"role": "user", "content": "Say hi."}]
    script.say("hi there")
    status, out = await post(http, sess, {"messages": msgs, "logprobs": True, "return_token_ids": True})
    assert status == 200
    choice = out["choices"][0]
    want = tokenizer.encode("hi there", add_special_tokens=False) + [EOS]
    assert choice["token_ids"] == want
    assert out["prompt_token_ids"] == render(tokenizer, msgs, gen=True)
    lp = choice["logprobs"]["content"]
    assert [e["logprob"] for e in lp] == [-0.5] * len(want)
    assert "".join(e["token"] for e in lp[:-1]) == "hi there" and lp[-1]["token"] == "<|im_end|>"

    # streamed: the same ids, content pieces and a usage chunk
    msgs.append(choice["message"])
    msgs.append({"role": "user", "content": "Again."})
    script.say("hi " * 30)
    r = await http.post(
        sess.base_url + "/chat/completions",
        json={"model": "ferryman-policy", "messages": msgs, "stream": True, "return_token_ids": True, "logprobs": True,
              "stream_options": {"include_usage": True}},
    )
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = [line[6:] for line in (await r.text()).split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert content == "hi " * 30
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) > 1, "content comes in pieces"
    assert chunks[0]["prompt_token_ids"] == render(tokenizer, msgs, gen=True)
    ids = [i for c in chunks if c["choices"] for i in c["choices"][0].get("token_ids") or []]
    assert ids == tokenizer.encode("hi " * 30, add_special_tokens=False) + [EOS]
    assert chunks[-1]["usage"]["completion_tokens"] == len(ids) and chunks[-1]["choices"] == []
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


async def test_models_endpoint(proxy, http):
    server, _, _ = await proxy(model_name="policy-x")
    sess = server.open_session("r", SamplingParams())
    r = await http.get(sess.base_url + "/models")
    assert r.status == 200 and (await r.json())["data"][0]["id"] == "policy-x"
    r = await http.get(sess.base_url + "/models/policy-x")
    assert r.status == 200 and (await r.json())["id"] == "policy-x"
    r = await http.get(sess.base_url + "/models/other")
    assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"


async def test_malformed_tool_call_is_plain_text_and_counted(proxy, http):
    server, script, _ = await proxy()
    sess = server.open_session("r", SamplingParams(max_tokens=64))
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1,,}}\n</tool_call>'
    script.say(bad)
    status, out = await post(http, sess, {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
    assert status == 200
    msg = out["choices"][0]["message"]
    assert msg["content"] == bad and "tool_calls" not in msg and out["choices"][0]["finish_reason"] == "stop"
    script.say("<tool_call>\n" + '{"name": "add"')  # cut off: no closing tag
    status, out = await post(http, sess, {"messages": [{"role": "user", "content": "x"}, msg, {"role": "user", "content": "y"}], "tools": TOOLS})
    assert status == 200 and "tool_calls" not in out["choices"][0]["message"]
    result = await server.close_session(sess)
    assert result.metrics["proxy/tool_parse_errors"] == 2 and result.metrics["proxy/tool_calls"] == 0


async def test_tool_choice_none_returns_text(proxy, http):
    server, script, _ = await proxy()
    sess = server.open_session("r", SamplingParams(max_tokens=64))
    script.say(hermes_call("add", {"a": 1, "b": 1}))
    status, out = await post(http, sess, {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": "none"})
    assert status == 200 and out["choices"][0]["message"]["content"].startswith("<tool_call>")


async def test_length_stop_backfills_end_of_turn_with_mask_0(proxy, http, tokenizer):
    server, script, _ = await proxy()
    sess = server.open_session("r", SamplingParams(max_tokens=4))
    script.say("The answer is 5.", eos=False)
    msgs = [{"role": "user", "content": "x"}]
    status, out = await post(http, sess, {"messages": msgs})
    assert status == 200 and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 4
    msgs += [out["choices"][0]["message"], {"role": "user", "content": "go on"}]
    script.say("ok")
    status, out = await post(http, sess, {"messages": msgs})
    assert status == 200
    t = (await server.close_session(sess)).trajectories[0]
    ids, mask = t.response_ids, t.response_mask
    assert ids[:4] == tokenizer.encode("The answer is 5.", add_special_tokens=False)[:4] and mask[:4] == [1] * 4
    assert ids[4] == EOS and mask[4] == 0, "the end-of-turn token the model did not write is backfilled, mask 0"
    msgs.append(out["choices"][0]["message"])
    assert t.prompt_ids + ids == render(tokenizer, msgs)


async def test_stop_strings(proxy, http, tokenizer):
    server, script, engine = await proxy(sampling_from="request")
    sess = server.open_session("r", SamplingParams(max_tokens=64))
    script.say("alpha beta STOP gamma")
    status, out = await post(http, sess, {"messages": [{"role": "user", "content": "x"}], "stop": ["STOP", "zzz"]})
    assert status == 200
    assert out["choices"][0]["message"]["content"] == "alpha beta " and out["choices"][0]["finish_reason"] == "stop"
    t = (await server.close_session(sess)).trajectories[0]
    gen = tokenizer.decode([i for i, m in zip(t.response_ids, t.response_mask) if m])
    assert gen.endswith("STOP") and "gamma" not in gen, "the model's tokens are kept through the stop string"
    # a stop string that is one token becomes a stop token for the engine
    sess = server.open_session("r2", SamplingParams(max_tokens=64))
    await post(http, sess, {"messages": [{"role": "user", "content": "x"}], "stop": ["\n"]})
    assert tokenizer.encode("\n")[0] in engine.calls[-1][2].stop_token_ids


@pytest.mark.parametrize("mode", ["session", "request"])
async def test_sampling_parameters(proxy, http, mode):
    server, script, engine = await proxy(sampling_from=mode)
    sess = server.open_session("r", SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, top_k=5))
    await post(http, sess, {"messages": [{"role": "user", "content": "x"}], "temperature": 0.3, "top_p": 0.5, "max_tokens": 100, "seed": 7})
    p = engine.calls[-1][2]
    assert (p.temperature, p.top_p) == ((1.0, 1.0) if mode == "session" else (0.3, 0.5))
    assert p.max_tokens == 16, "the agent's max_tokens is capped by the session's"
    assert p.top_k == 5 and p.seed == 7 and EOS in p.stop_token_ids
    await post(http, sess, {"messages": [{"role": "user", "content": "y"}], "max_completion_tokens": 3})
    assert engine.calls[-1][2].max_tokens == 3


# ------------------------------------------------------------------ history and segments


async def test_history_rewrite_starts_a_new_segment_with_a_debug_record(proxy, http, tokenizer, tmp_path):
    server, script, _ = await proxy()
    sess = server.open_session("r-seg", SamplingParams(max_tokens=32))
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "First question?"}]
    script.say("First answer.")
    _, out = await post(http, sess, {"messages": msgs})
    msgs += [out["choices"][0]["message"], {"role": "user", "content": "Second question?"}]
    script.say("Second answer.")
    _, out = await post(http, sess, {"messages": msgs})
    msgs.append(out["choices"][0]["message"])
    # the agent compacts its context: the history is rewritten
    compacted = [{"role": "user", "content": "Summary: two questions answered."}, {"role": "user", "content": "Third?"}]
    script.say("Third answer.")
    status, out = await post(http, sess, {"messages": compacted})
    assert status == 200
    compacted.append(out["choices"][0]["message"])
    result = await server.close_session(sess)
    assert [t.extra["segment"] for t in result.trajectories] == [0, 1]
    first, second = result.trajectories
    assert first.prompt_ids + first.response_ids == render(tokenizer, msgs)
    assert second.prompt_ids + second.response_ids == render(tokenizer, compacted)
    assert sum(second.response_mask) == len(tokenizer.encode("Third answer.")) + 1
    assert result.metrics["proxy/history_mismatches"] == 1 and result.metrics["proxy/segments"] == 2
    records = list((tmp_path / "debug").glob("r-seg-*.json"))
    assert len(records) == 1
    rec = json.loads(records[0].read_text())
    assert rec["reason"] == "history_changed" and rec["first_differing_message"] == 0
    assert rec["received_messages"][-1]["content"] == "Third?"


async def test_changed_tools_start_a_new_segment(proxy, http):
    server, script, _ = await proxy()
    sess = server.open_session("r", SamplingParams(max_tokens=8))
    msgs = [{"role": "user", "content": "x"}]
    _, out = await post(http, sess, {"messages": msgs, "tools": TOOLS})
    msgs += [out["choices"][0]["message"], {"role": "user", "content": "y"}]
    await post(http, sess, {"messages": msgs})
    result = await server.close_session(sess)
    assert len(result.trajectories) == 2


async def test_retry_of_the_last_request_replaces_the_unseen_answer(proxy, http, tokenizer):
    server, script, engine = await proxy()
    sess = server.open_session("r", SamplingParams(max_tokens=32))
    msgs = [{"role": "user", "content": "x"}]
    script.say("lost answer")
    await post(http, sess, {"messages": msgs})  # the agent's client timed out and never saw it
    script.say("seen answer")
    _, out = await post(http, sess, {"messages": msgs})
    assert engine.calls[0][1] == engine.calls[1][1], "the retry gets the same prompt"
    msgs.append(out["choices"][0]["message"])
    result = await server.close_session(sess)
    assert len(result.trajectories) == 1 and result.metrics["proxy/retries"] == 1
    t = result.trajectories[0]
    assert t.prompt_ids + t.response_ids == render(tokenizer, msgs)


async def test_concurrent_requests_of_one_session_are_serialised(proxy, http, tokenizer):
    server, script, _ = await proxy()
    sess = server.open_session("r", SamplingParams(max_tokens=8))
    msgs = [{"role": "user", "content": "x"}]
    outs = await asyncio.gather(*(post(http, sess, {"messages": msgs}) for _ in range(5)))
    assert all(s == 200 for s, _ in outs)
    result = await server.close_session(sess)
    assert len(result.trajectories) == 1 and result.metrics["proxy/retries"] == 4
    t = result.trajectories[0]
    assert t.prompt_ids + t.response_ids == render(tokenizer, msgs + [outs[-1][1]["choices"][0]["message"]])


# ------------------------------------------------------------------ limits


async def test_max_consecutive_no_tool_ends_the_session(proxy, http):
    server, script, engine = await proxy(max_consecutive_no_tool=2)
    sess = server.open_session("r", SamplingParams(max_tokens=32))
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "x"}]
    for text in ["chat", hermes_call("add", {"a": 1, "b": 2}), "chat", "chat"]:
        script.say(text)
        status, out = await post(http, sess, {"messages": msgs, "tools": TOOLS})
        assert status == 200
        msg = out["choices"][0]["message"]
        msgs.append(msg)
        msgs.append({"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "3"} if msg.get("tool_calls") else {"role": "user", "content": "use a tool"})
    before, calls = snapshot(sess), len(engine.calls)
    status, out = await post(http, sess, {"messages": msgs, "tools": TOOLS})
    assert status == 400 and out["error"]["code"] == "session_ended" and "no_tool_calls" in out["error"]["message"]
    assert snapshot(sess) == before and len(engine.calls) == calls
    result = await server.close_session(sess)
    assert result.end_reason == "no_tool_calls" and result.metrics["proxy/turns"] == 4


async def test_max_turns(proxy, http):
    server, _, _ = await proxy(max_turns=2)
    sess = server.open_session("r", SamplingParams(max_tokens=4))
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "x"}]
    for _ in range(2):
        status, out = await post(http, sess, {"messages": msgs})
        assert status == 200
        msgs += [out["choices"][0]["message"], {"role": "user", "content": "more"}]
    status, out = await post(http, sess, {"messages": msgs})
    assert status == 400 and out["error"]["code"] == "session_ended"
    assert (await server.close_session(sess)).end_reason == "max_turns"


async def test_context_length_limit(proxy, http, tokenizer):
    server, script, engine = await proxy(max_total_tokens=40)
    sess = server.open_session("r", SamplingParams(max_tokens=1000))
    msgs = [{"role": "user", "content": "hi"}]
    n_prompt = len(render(tokenizer, msgs, gen=True))
    script.say("x " * 100, eos=False)
    status, out = await post(http, sess, {"messages": msgs})
    assert status == 200 and engine.calls[-1][2].max_tokens == 40 - n_prompt, "the budget is cut to fit"
    assert out["choices"][0]["finish_reason"] == "length"
    msgs += [out["choices"][0]["message"], {"role": "user", "content": "more"}]
    before = snapshot(sess)
    status, out = await post(http, sess, {"messages": msgs})
    assert status == 400 and out["error"]["code"] == "context_length_exceeded"
    assert "maximum context length" in out["error"]["message"]
    assert snapshot(sess)[0] == before[0], "the trajectory is unchanged"
    result = await server.close_session(sess)
    assert result.end_reason == "context_length"
    t = result.trajectories[0]
    assert len(t.prompt_ids) + sum(t.response_mask) <= 40


# ------------------------------------------------------------------ bad input and security


BAD = [
    (b"{not json", 400, None),
    (b"\xff\xfe", 400, None),
    (b"[" * 100_000, 400, None),
    ("[1, 2]", 400, None),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0].type"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 7}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400, "stream"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "always"}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 5, "logprobs": True}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 1.0}, 400, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, 404, "model"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {}}]}]}, 400, "messages[0].tool_calls[0].function.name"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD)
async def test_bad_input_is_a_4xx_with_an_openai_error_and_changes_nothing(proxy, http, body, status, param):
    server, script, engine = await proxy()
    sess = server.open_session("r", SamplingParams(max_tokens=8))
    msgs = [{"role": "user", "content": "fine"}]
    _, out = await post(http, sess, {"messages": msgs})
    before, calls = snapshot(sess), len(engine.calls)
    if isinstance(body, dict) and "model" in body:
        r = await http.post(sess.base_url + "/chat/completions", json=body)
        got, err = r.status, await r.json()
    else:
        got, err = await post(http, sess, body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert err["error"]["param"] == param
    assert snapshot(sess) == before and len(engine.calls) == calls
    # the session goes on as if nothing happened
    status2, _ = await post(http, sess, {"messages": msgs + [out["choices"][0]["message"], {"role": "user", "content": "next"}]})
    assert status2 == 200
    assert len((await server.close_session(sess)).trajectories) == 1


async def test_oversize_body_is_413(proxy, http):
    server, _, engine = await proxy(max_body_bytes=4096)
    sess = server.open_session("r", SamplingParams())
    status, err = await post(http, sess, {"messages": [{"role": "user", "content": "x" * 10_000}]})
    assert status == 413 and err["error"]["code"] == "request_too_large"
    assert engine.calls == [] and snapshot(sess)[0] == []


async def test_per_session_rate_limit_is_429_and_leaves_other_sessions_alone(proxy, http):
    server, _, engine = await proxy(max_requests_per_minute=3)
    a = server.open_session("ra", SamplingParams(max_tokens=2))
    b = server.open_session("rb", SamplingParams(max_tokens=2))
    body = {"messages": [{"role": "user", "content": "x"}]}
    codes = [(await post(http, a, body))[0] for _ in range(4)]
    assert codes == [200, 200, 200, 429]
    status, err = await post(http, a, body)
    assert status == 429 and err["error"]["code"] == "rate_limit_exceeded" and err["error"]["type"] == "rate_limit_error"
    assert (await post(http, b, body))[0] == 200, "another session's budget is its own"
    result = await server.close_session(a)
    assert result.metrics["proxy/rate_limited"] == 2
    assert [c[0] for c in engine.calls].count("ra") == 3


async def test_per_session_concurrency_limit(proxy, http):
    server, script, engine = await proxy(max_concurrent_requests=2)
    gate = asyncio.Event()
    inner = engine.generate

    async def slow(*args, **kwargs):  # hold the engine until the three requests are in
        await gate.wait()
        return await inner(*args, **kwargs)

    engine.generate = slow
    a = server.open_session("ra", SamplingParams(max_tokens=2))
    body = {"messages": [{"role": "user", "content": "x"}]}
    tasks = [asyncio.create_task(post(http, a, body)) for _ in range(3)]
    for _ in range(200):
        if a.in_flight == 2 and server.counters["requests"] >= 3:
            break
        await asyncio.sleep(0.01)
    gate.set()
    codes = sorted(s for s, _ in await asyncio.gather(*tasks))
    assert codes == [200, 200, 429]
    assert a.in_flight == 0


async def test_oversized_header_is_refused(proxy, http):
    server, _, engine = await proxy(max_header_bytes=2048)
    sess = server.open_session("r", SamplingParams())
    r = await http.post(sess.base_url + "/chat/completions", json={"model": "ferryman-policy", "messages": []},
                        headers={"X-Big": "y" * 4096})
    assert r.status == 400 and engine.calls == []


async def test_sessions_are_private_and_loopback_only(proxy, http):
    server, _, engine = await proxy()
    assert server.url.startswith("http://127.0.0.1:")
    a = server.open_session("ra", SamplingParams(max_tokens=4))
    b = server.open_session("rb", SamplingParams(max_tokens=4))
    assert a.secret != b.secret and len(a.secret) >= 32, "192 random bits, URL-safe"
    assert a.base_url == f"{server.url}/sess/{a.secret}/v1"
    for url in (f"{server.url}/sess/guess/v1/chat/completions", f"{server.url}/v1/chat/completions"):
        status, err = await post(http, url, {"messages": [{"role": "user", "content": "x"}]})
        assert status == 404 and "error" in err
    status, _ = await post(http, a, {"messages": [{"role": "user", "content": "x"}]})
    assert status == 200 and [c[0] for c in engine.calls] == ["ra"]
    await server.close_session(a)
    status, err = await post(http, a, {"messages": [{"role": "user", "content": "x"}]})
    assert status == 404 and err["error"]["code"] == "session_not_found"
    r = await http.get(f"{server.url}/sess/{b.secret}/v1/chat/completions")
    assert r.status == 405 and "error" in await r.json()


async def test_engine_failure_is_5xx_and_changes_nothing(tokenizer, http):
    class Broken(ScriptedEngine):
        async def generate(self, request_id, prompt_ids, params):
            raise RuntimeError("replica lost")

    client = server_client({"e0": Broken(lambda p, s: [EOS])})
    client.max_failovers = 0
    async with ProxyServer(tokenizer=tokenizer, client=client) as server:
        sess = server.open_session("r", SamplingParams(max_tokens=4))
        status, err = await post(http, sess, {"messages": [{"role": "user", "content": "x"}]})
        assert status in (502, 503) and err["error"]["type"] == "server_error"
        assert snapshot(sess)[0] == []


async def test_routed_experts_travel_with_the_tokens(tokenizer, http):
    from ferryman.types import TokenOutput

    prompts = []

    class MoE:
        """Routing of the whole sequence it ran (prompt + answer, less the last token), each
        position's experts derived from its token and index, as an engine reports it."""

        async def generate(self, request_id, prompt_ids, params):
            prompts.append(list(prompt_ids))
            ids = tokenizer.encode("ok", add_special_tokens=False) + [EOS]
            seq = list(prompt_ids) + ids
            return TokenOutput(token_ids=ids, log_probs=[-1.0] * len(ids), versions=[3] * len(ids),
                               routed_experts=[[[tok, i]] for i, tok in enumerate(seq[:-1])])

    async with ProxyServer(tokenizer=tokenizer, client=MoE()) as server:
        sess = server.open_session("r", SamplingParams(max_tokens=4))
        msgs = [{"role": "user", "content": "x"}]
        _, out = await post(http, sess, {"messages": msgs})
        await post(http, sess, {"messages": msgs + [out["choices"][0]["message"], {"role": "user", "content": "y"}]})
        t = (await server.close_session(sess)).trajectories[0]
    routed = t.extra["routed_experts"]
    full = t.prompt_ids + t.response_ids
    # the second turn's routing superseded the first's: every position it ran, aligned with the
    # trajectory's tokens, up to (not including) its last token; the backfilled tail is not run
    assert len(prompts) == 2 and full[: len(prompts[1])] == prompts[1]
    assert routed == [[[tok, i]] for i, tok in enumerate(full[: len(routed)])]
    last_model = max(i for i, m in enumerate(t.response_mask) if m) + len(t.prompt_ids)
    assert len(routed) == last_model
    assert [v for v, m in zip(t.token_versions, t.response_mask) if m] == [3] * sum(t.response_mask)
    from ferryman.batch import build_train_batch
    from ferryman.types import Sample

    batch = build_train_batch([Sample("u", 0, [t])], pad_token_id=0)
    assert batch.meta["routed_experts"].shape == (1, len(full), 1, 2)


async def test_required_tool_choice_without_a_call_is_counted(proxy, http):
    server, script, _ = await proxy()
    sess = server.open_session("r", SamplingParams(max_tokens=16))
    script.say("no call")
    status, out = await post(http, sess, {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": "required"})
    assert status == 200 and out["choices"][0]["message"]["content"] == "no call"
    assert (await server.close_session(sess)).metrics["proxy/tool_choice_unmet"] == 1


def _external_ip() -> str | None:
    """This machine's address on a non-loopback interface (None if it has none)."""
    import socket

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent, the kernel picks the interface
        ip = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if ip.startswith("127.") else ip


async def test_reachable_from_other_nodes_with_the_secret_kept(proxy, http):
    """``host: 0.0.0.0`` with ``advertise_host``: session URLs name the node's address, which
    answers (as a sandbox on another node would connect); a URL without the session's secret
    still gets 404."""
    ip = _external_ip()
    if ip is None:
        pytest.skip("no non-loopback interface")
    server, _, engine = await proxy(host="0.0.0.0", advertise_host=ip)
    assert server.url.startswith(f"http://{ip}:")
    sess = server.open_session("ra", SamplingParams(max_tokens=4))
    assert sess.base_url.startswith(f"http://{ip}:") and sess.secret in sess.base_url
    status, _ = await post(http, sess, {"messages": [{"role": "user", "content": "x"}]})
    assert status == 200 and [c[0] for c in engine.calls] == ["ra"]
    status, err = await post(http, f"{server.url}/sess/{'x' * len(sess.secret)}/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 404 and "error" in err


def test_advertised_host():
    from ferryman_proxy.server import advertised_host

    assert advertised_host("10.1.2.3") == "10.1.2.3"
    assert advertised_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"
    assert advertised_host("0.0.0.0") == "127.0.0.1", "outside Ray: loopback"
    with pytest.raises(ValueError, match="advertise_host"):
        ProxyConfig(advertise_host="0.0.0.0")
