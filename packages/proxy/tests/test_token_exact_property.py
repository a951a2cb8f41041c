"""The token-in, token-out invariant as a property, for both chat templates written by us.

Hypothesis draws random multi-turn conversations — an optional system prompt, 0–3 tool
definitions with typed parameters, answers that are text or (parallel) tool calls with
schema-conforming arguments, tool results, follow-up user messages — and an agent plays them
against a proxy session, one request per answer, sending back exactly the assistant messages
the proxy returned. The engine is a named fake that answers each prompt with the tokens
``apply_chat_template`` gives the next answer in the whole conversation (a model that writes what
the template would); it also records the prompt the proxy sent.

Checked for every conversation:

* each prompt the proxy sent the engine equals ``apply_chat_template(history so far,
  add_generation_prompt=True)``;
* each answer the proxy returned is the drawn answer (the tool parser inverts the template);
* the finished trajectory ``prompt_ids + response_ids`` equals ``apply_chat_template(whole
  conversation)`` token for token, in one segment;
* the mask is 1 on exactly the tokens the engine generated, with their log-probs and versions,
  and 0 (log-prob 0.0, version -1) everywhere else.
"""

from __future__ import annotations

import asyncio
import json
import string
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferryman.types import SamplingParams
from ferryman_proxy.config import ProxyConfig
from ferryman_proxy.messages import normalize_message, parse_chat_request
from ferryman_proxy.parsers import get_parser
from ferryman_proxy.session import Session
from ferryman_proxy.templates import BUILTIN_TEMPLATES
from ferryman_proxy.testing import ScriptedEngine
from ferryman_proxy.tokenization import ChatTokenizer

PROFILE = settings.get_profile("ferryman-proxy")
LOG_PROB = -0.25

# ------------------------------------------------------------------ strategies

# The tiny tokenizer covers printable ASCII, tab, newline and carriage return.
ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \n\t"
FORBIDDEN = ("<|", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
             "<function=", "</function>", "<parameter=", "</parameter>")


def _clean(s: str) -> bool:
    return not any(f in s for f in FORBIDDEN)


text = st.text(alphabet=ALPHABET, max_size=24).filter(_clean)
ident = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=8)

SCALARS = {
    "string": text,
    "integer": st.integers(-10_000, 10_000),
    "number": st.floats(allow_nan=False, allow_infinity=False, width=32),
    "boolean": st.booleans(),
}
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-99, 99), text)
json_value = json_leaf | st.lists(json_leaf, max_size=3) | st.dictionaries(ident, json_leaf, max_size=3)
TYPES = {**SCALARS, "object": st.dictionaries(ident, json_value, max_size=3), "array": st.lists(json_value, max_size=3)}


@st.composite
def tools_strategy(draw) -> list[dict[str, Any]]:
    names = draw(st.lists(ident, max_size=3, unique=True))
    tools = []
    for name in names:
        params = draw(st.dictionaries(ident, st.sampled_from(sorted(TYPES)), max_size=3))
        fn: dict[str, Any] = {"name": name}
        if draw(st.booleans()):
            fn["description"] = draw(text)
        fn["parameters"] = {"type": "object", "properties": {p: {"type": t} for p, t in params.items()}}
        tools.append({"type": "function", "function": fn})
    return tools


@st.composite
def answer_strategy(draw, tools: list[dict[str, Any]]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": draw(text)}
    if tools and draw(st.booleans()):
        calls = []
        for _ in range(draw(st.integers(1, 3))):
            fn = draw(st.sampled_from(tools))["function"]
            props = fn["parameters"]["properties"]
            chosen = draw(st.lists(st.sampled_from(sorted(props)), unique=True)) if props else []
            args = {p: draw(TYPES[props[p]["type"]]) for p in chosen}
            calls.append({"id": f"call_{len(calls)}", "type": "function", "function": {"name": fn["name"], "arguments": args}})
        msg["tool_calls"] = calls
    return msg


@st.composite
def conversation_strategy(draw) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages ending with an assistant answer, tools)."""
    tools = draw(tools_strategy())
    msgs: list[dict[str, Any]] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(text)})
    msgs.append({"role": "user", "content": draw(text)})
    for turn in range(draw(st.integers(1, 5))):
        if turn:
            last = msgs[-1]
            for call in last.get("tool_calls", ()):
                msgs.append({"role": "tool", "tool_call_id": call["id"], "content": draw(text)})
            if not last.get("tool_calls") or draw(st.booleans()):
                msgs.append({"role": "user", "content": draw(text)})
        msgs.append(draw(answer_strategy(tools)))
    return msgs, tools


# ------------------------------------------------------------------ the agent and the fake model


def _wire(msg: dict[str, Any]) -> dict[str, Any]:
    """How an OpenAI client sends a message: tool-call arguments as a JSON string."""
    out = dict(msg)
    if "tool_calls" in out:
        out["tool_calls"] = [
            {**c, "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
            for c in out["tool_calls"]
        ]
    return out


class TeacherForcing:
    """The fake model: answers the prompt with the reference tokens of the next answer."""

    def __init__(self, tokenizer: Any, template: str, turn_end_id: int) -> None:
        self.tok = tokenizer
        self.template = template
        self.turn_end_id = turn_end_id
        self.expected_prompt: list[int] = []
        self.answer: list[int] = []
        self.prompts: list[list[int]] = []

    def ids(self, messages, tools, gen: bool) -> list[int]:
        return list(
            self.tok.apply_chat_template(
                messages, tools=tools or None, chat_template=self.template, add_generation_prompt=gen, tokenize=True, return_dict=False
            )
        )

    def expect(self, history, full: list[int], tools) -> None:
        """The next answer follows ``history``: its tokens are those of the whole conversation's
        render from the end of the prompt through the next end-of-turn token."""
        self.expected_prompt = self.ids(history, tools, True)
        assert full[: len(self.expected_prompt)] == self.expected_prompt, "template lacks the generation-prompt prefix property"
        end = full.index(self.turn_end_id, len(self.expected_prompt))
        self.answer = full[len(self.expected_prompt) : end + 1]

    def __call__(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        self.prompts.append(list(prompt_ids))
        return self.answer


def play(tokenizer, template_name: str, parser: str, messages, tools) -> None:
    template = BUILTIN_TEMPLATES[template_name]
    ct = _chat_tokenizer(tokenizer, template_name)
    model = TeacherForcing(tokenizer, template, ct.turn_end_id)
    engine = ScriptedEngine(model, log_prob=LOG_PROB)
    config = ProxyConfig(tool_parser=parser, chat_template=template_name)
    sess = Session(
        secret="s",
        request_id="r-prop",
        params=SamplingParams(max_tokens=10_000),
        base_url="http://test",
        model_name=config.model_name,
        client=engine,
        chat_tokenizer=ct,
        parser=get_parser(parser),
        config=config,
    )
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    full = model.ids(messages, tools, False)
    conv: list[dict[str, Any]] = []  # what the agent holds and sends (OpenAI wire format)
    spans = []
    pos = 0
    for j in answers:
        conv += [_wire(m) for m in messages[pos:j]]
        model.expect(messages[:j], full, tools)
        body = {"model": config.model_name, "messages": conv}
        if tools:
            body["tools"] = tools
        # as the server does: the history the agent resends is matched against the last request's
        turn = asyncio.run(sess.chat(parse_chat_request(json.loads(json.dumps(body)), config.model_name, sess.known)))
        assert model.prompts[-1] == model.expected_prompt, "the prompt sent to the engine differs from apply_chat_template"
        assert turn.completion_ids == model.answer
        got, want = normalize_message(turn.message, 0), normalize_message(_wire(messages[j]), 0)
        # the session keeps the answer pre-normalised (an agent sending it back is not validated again)
        assert sess._current.messages[-1] == got and sess.known.messages[-1] == got
        if template_name == "qwen3_coder" and "tool_calls" in want:
            want["content"] = want["content"].strip()  # the template trims text before tool calls
        for m in (got, want):
            for c in m.get("tool_calls", ()):
                c.pop("id", None)
        assert got == want, "the tool parser did not invert the template"
        spans.append((len(model.expected_prompt), len(model.answer)))
        conv.append(turn.message)
        pos = j + 1

    result = sess.result()
    assert len(result.trajectories) == 1 and result.end_reason is None
    traj = result.trajectories[0]
    traj.validate()
    assert traj.prompt_ids + traj.response_ids == full, "incremental ids differ from apply_chat_template(whole conversation)"
    p0 = len(traj.prompt_ids)
    mask = [0] * len(traj.response_ids)
    for start, n in spans:
        mask[start - p0 : start - p0 + n] = [1] * n
    assert traj.response_mask == mask, "the mask must mark exactly the generated tokens"
    assert all(lp == (LOG_PROB if m else 0.0) for lp, m in zip(traj.rollout_log_probs, traj.response_mask))
    assert all(v == (0 if m else -1) for v, m in zip(traj.token_versions, traj.response_mask))


_CT: dict[tuple[int, str], ChatTokenizer] = {}


def _chat_tokenizer(tokenizer, name: str) -> ChatTokenizer:
    key = (id(tokenizer), name)
    if key not in _CT:
        _CT[key] = ChatTokenizer(tokenizer, BUILTIN_TEMPLATES[name])
        assert _CT[key].incremental, _CT[key].probe_error
    return _CT[key]


# ------------------------------------------------------------------ the properties


@pytest.mark.parametrize(("template_name", "parser"), [("chatml_hermes", "hermes"), ("qwen3_coder", "qwen3_coder")])
def test_incremental_ids_equal_whole_conversation(tokenizer, template_name, parser):
    @settings(PROFILE)
    @given(conversation_strategy())
    def check(conv):
        messages, tools = conv
        play(tokenizer, template_name, parser, messages, tools)

    check()
