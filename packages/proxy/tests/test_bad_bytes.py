"""Bad input never gets a 5xx: each class of input that once crashed the proxy is a 400 with an
OpenAI-style body (and changes nothing); an unexpected error is counted in ``errors_5xx``; the
imperfect histories agents send are accepted and recorded, as the README says."""

from __future__ import annotations

import gzip
import json

import pytest

from ferryman.types import SamplingParams

from proxy_helpers import snapshot
from test_server import http, post, proxy  # noqa: F401 - fixtures

MSGS = [{"role": "user", "content": "fine"}]


def _deep(n: int) -> dict:
    value: dict = {}
    for _ in range(n):
        value = {"a": value}
    return value


def _assistant_call(arguments, cid="call_1", name="get_weather"):
    return {"role": "assistant", "content": None, "tool_calls": [{"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}]}


BAD = [
    # tool-call arguments nested past the recursion limit: as a JSON string, and as an object the
    # body decoder accepts (rendering or comparing it would recurse too deep)
    ("deep_arguments_string", {"messages": [*MSGS, _assistant_call("[" * 50_000 + "]" * 50_000)]}, "messages[1].tool_calls[0].function.arguments"),
    ("deep_arguments_object", {"messages": [*MSGS, _assistant_call(_deep(900))]}, "messages[1].tool_calls[0].function.arguments"),
    ("deep_tool_parameters", {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": _deep(900)}}}]}, "tools[0].function.parameters"),
    # a stop string the tokenizer cannot encode (a lone surrogate)
    ("surrogate_stop", {"messages": MSGS, "stop": ["\ud800"]}, "stop[0]"),
    ("surrogate_content", {"messages": [{"role": "user", "content": "hi \udfff"}]}, "messages[0].content"),
    ("surrogate_tool_name", {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f\ud83d"}}]}, "tools[0].function.name"),
    # a tool whose parameters are not a JSON schema (OpenAI refuses these too)
    ("schema_not_object", {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}}]}, "tools[0].function.parameters"),
    ("schema_bad_properties", {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": [1, 2]}}}]}, "tools[0].function.parameters"),
]


@pytest.mark.parametrize(("name", "body", "param"), BAD, ids=[b[0] for b in BAD])
async def test_bad_input_is_a_400_not_a_500(proxy, http, name, body, param):  # noqa: F811
    server, _, engine = await proxy()
    sess = server.open_session("r", SamplingParams(max_tokens=8))
    status, out = await post(http, sess, {"messages": MSGS})
    assert status == 200
    before, calls = snapshot(sess), len(engine.calls)
    raw = json.dumps({"model": "ferryman-policy", **body}).encode()  # \ud800 stays an escape: valid JSON
    r = await http.post(sess.base_url + "/chat/completions", data=raw, headers={"Content-Type": "application/json"})
    err = await r.json()
    assert r.status == 400, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["param"] == param, err
    assert snapshot(sess) == before and len(engine.calls) == calls
    assert server.counters["errors_5xx"] == 0 and server.counters["errors_4xx"] == 1
    status, _ = await post(http, sess, {"messages": [*MSGS, out["choices"][0]["message"], {"role": "user", "content": "next"}]})
    assert status == 200, "the session goes on"


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd", "rot13"])
async def test_a_body_that_is_not_in_its_content_encoding_is_a_400(proxy, http, encoding):  # noqa: F811
    server, _, engine = await proxy()
    sess = server.open_session("r", SamplingParams(max_tokens=8))
    r = await http.post(
        sess.base_url + "/chat/completions", data=json.dumps({"model": "ferryman-policy", "messages": MSGS}).encode(),
        headers={"Content-Type": "application/json", "Content-Encoding": encoding},
    )
    err = await r.json()
    assert r.status in (400, 415), err
    assert err["error"]["type"] == "invalid_request_error" and "Content-Encoding" in err["error"]["message"]
    assert engine.calls == [] and server.counters["errors_5xx"] == 0


async def test_a_real_gzip_body_is_accepted(proxy, http):  # noqa: F811
    server, _, _ = await proxy()
    sess = server.open_session("r", SamplingParams(max_tokens=8))
    body = gzip.compress(json.dumps({"model": "ferryman-policy", "messages": MSGS}).encode())
    r = await http.post(sess.base_url + "/chat/completions", data=body, headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status == 200, await r.text()


async def test_an_unexpected_error_is_a_counted_500_without_a_traceback(proxy, http, monkeypatch):  # noqa: F811
    server, _, _ = await proxy()
    sess = server.open_session("r", SamplingParams(max_tokens=8))

    def boom(*a, **k):
        raise KeyError("a bug in the proxy")

    monkeypatch.setattr(sess, "chat", boom)
    status, err = await post(http, sess, {"messages": MSGS})
    assert status == 500 and err["error"] == {"message": "internal proxy error", "type": "server_error", "param": None, "code": None}
    assert server.counters["errors_5xx"] == 1


# ------------------------------------------------------------------ accepted and recorded

ACCEPTED = [
    ("tool_call_id_unmatched", [*MSGS, _assistant_call({"city": "Paris"}), {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}], "tool_call_id_mismatches"),
    ("tool_call_id_missing", [*MSGS, _assistant_call({"city": "Paris"}), {"role": "tool", "content": "sunny"}], "tool_call_id_mismatches"),
    ("arguments_not_json", [*MSGS, _assistant_call("{city: Paris"), {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "unparsed_arguments"),
]


@pytest.mark.parametrize(("name", "messages", "counter"), ACCEPTED, ids=[a[0] for a in ACCEPTED])
async def test_imperfect_histories_are_accepted_and_recorded(proxy, http, name, messages, counter):  # noqa: F811
    server, _, _ = await proxy()
    sess = server.open_session("r", SamplingParams(max_tokens=8))
    status, out = await post(http, sess, {"messages": messages})
    assert status == 200, out
    result = await server.close_session(sess)
    assert result.metrics[f"proxy/{counter}"] == 1.0
    others = {c for _, _, c in ACCEPTED} - {counter}
    assert all(result.metrics[f"proxy/{c}"] == 0.0 for c in others)
