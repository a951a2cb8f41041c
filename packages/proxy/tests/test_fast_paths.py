"""The request path's cheaper ways of doing things give what the plain ways give."""

from __future__ import annotations

import json

import pytest

from ferryman_proxy._fast import dumps_arguments, loads, random_hex
from ferryman_proxy.errors import ProxyError
from ferryman_proxy.messages import KnownHistory, message_key, normalize_message, normalize_messages, parse_chat_request
from ferryman_proxy.tokenization import ChatTokenizer, _with_memoised_sandbox_checks

ARGS = [
    {},
    {"command": "ls -la data", "timeout": 10},
    {"a": [1.5, -0.0, 1e300, True, None], "b": {"c": {}}, "big": 10**30},
    {"text": "é漢字\u2028\x01\"\\ tab\t", "nested": [[{"x": "y"}]]},
]


@pytest.mark.parametrize("value", ARGS)
def test_dumps_arguments_is_json_dumps(value):
    assert dumps_arguments(value) == json.dumps(value, ensure_ascii=False)


def test_loads_reads_what_the_standard_library_reads():
    for text in ['{"a": 1}', '{"x": NaN, "y": Infinity}', '{"big": 123456789012345678901234567890}', "[1, 2.5]"]:
        got, want = loads(text), json.loads(text)
        assert json.dumps(got) == json.dumps(want)
    with pytest.raises(ValueError):
        loads('{"a": ')


def test_random_hex_is_fresh():
    ids = {random_hex(24) for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == 24 and int(i, 16) >= 0 for i in ids)


def test_ascii_encoding_without_the_normalizer_gives_the_same_ids(tokenizer):
    ct = ChatTokenizer(tokenizer)
    assert ct._encode_ascii is not None, "the tiny tokenizer's normalizer is NFC only"
    assert type(ct._compiled.environment).__name__.startswith("Memoised"), "renders go through the memoised sandbox"
    texts = [
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n-rw-r--r-- 1 user  1000 Jan\t1\r\n</tool_response><|im_end|>\n",
        "plain words, punctuation!? and   spaces \n\n\n",
        "caf\u00e9 \u0065\u0301 \ufb01 non-ascii takes the normalising path",
    ]
    backend = tokenizer.backend_tokenizer
    for text in texts:
        assert ct.encode(text) == backend.encode(text, add_special_tokens=False).ids


def test_memoised_sandbox_still_refuses_unsafe_attributes():
    from jinja2.exceptions import SecurityError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    template = "{{ messages[0].content.__class__.__mro__ }}"
    fast = _with_memoised_sandbox_checks(_compile_jinja_template(template), template)
    assert type(fast.environment).__name__.startswith("Memoised")
    for _ in range(2):  # decided, then from the memo
        with pytest.raises(SecurityError):
            fast.render(messages=[{"content": "x"}])
    mutate = "{{ messages.append(1) }}"
    fast = _with_memoised_sandbox_checks(_compile_jinja_template(mutate), mutate)
    with pytest.raises(SecurityError):
        fast.render(messages=[])
    for _ in range(2):  # and again, from the memo
        with pytest.raises(SecurityError):
            fast.render(messages=[])


def _known(raw: list) -> KnownHistory:
    msgs, keys = normalize_messages(raw)
    return KnownHistory(raw, msgs, keys)


def test_history_reuse_matches_a_fresh_normalisation():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    sent = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    known = _known(sent)
    cases = [
        sent + [{"role": "tool", "tool_call_id": "c1", "content": "out"}],  # resent unchanged
        sent[:2] + [{**sent[2], "refusal": None}, {"role": "tool", "content": "out"}],  # the answer in the client's form
        [sent[0], {"role": "developer", "content": "edited"}] + sent[2:],  # an edit in the middle
        sent[:1],  # shorter
    ]
    for raw in cases:
        got = normalize_messages(raw, known)
        want = [normalize_message(m, i) for i, m in enumerate(raw)]
        assert got == (want, [message_key(m) for m in want])


def test_a_bad_message_is_refused_even_after_reuse():
    sent = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    known = _known(sent)
    with pytest.raises(ProxyError) as e:
        parse_chat_request({"model": "m", "messages": [*sent, {"role": "robot", "content": "x"}]}, "m", known)
    assert e.value.param == "messages[2].role"
    with pytest.raises(ProxyError) as e:
        parse_chat_request({"model": "m", "messages": sent, "tools": [{"type": "nope"}]}, "m", known)
    assert e.value.param == "tools[0].type"


def test_loads_keeps_big_integers_exact_and_the_body_too():
    for text in ['{"n": 18446744073709551616}', '{"n": -9223372036854775809}', '[123456789012345678901234567890, "x"]']:
        assert loads(text) == json.loads(text) and loads(text.encode()) == json.loads(text)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "maximum": 10**25}}}]}
    req = parse_chat_request(loads(json.dumps(body).encode()), "m")
    assert req.tools[0]["function"]["parameters"]["maximum"] == 10**25
    assert isinstance(req.tools[0]["function"]["parameters"]["maximum"], int)
