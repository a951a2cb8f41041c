"""Request validation and message normalisation.

Every field the proxy reads is checked here, before anything in a session changes; a bad one
raises :class:`~ferryman_proxy.errors.ProxyError` (400) naming the parameter, as OpenAI does
(``param: "messages[3].role"``).

Normalised messages are plain dicts a chat template can render:

* ``role``: ``system`` / ``user`` / ``assistant`` / ``tool`` (``developer`` becomes ``system``);
* ``content``: a string (``None`` and lists of text parts are flattened; other parts are refused);
* assistant ``tool_calls``: ``[{"id", "type": "function", "function": {"name", "arguments"}}]``
  with ``arguments`` parsed into an object when it is a JSON object string;
* tool ``tool_call_id`` / ``name`` when given. Keys whose value is ``None`` are dropped, as
  transformers does before rendering.

:func:`message_key` is the identity used to recognise history: assistant messages compare by
content and by tool-call names and arguments (not ids, which some clients rewrite).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ferryman_proxy._fast import loads
from ferryman_proxy.errors import ProxyError, bad_request

ROLES = {"system", "developer", "user", "assistant", "tool"}

MAX_DEPTH = 64
"""Deepest nesting accepted in tool-call arguments and tool parameter schemas: the chat
template renders them recursively (and Python's recursion limit is about 1000)."""

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def lone_surrogate_at(raw: bytes, body: Any) -> str | None:
    """Where (``messages[0].content``) the decoded body holds a string with a lone surrogate,
    or None. Only JSON escapes can make one, so the walk runs only when the raw bytes have a
    ``\\uD8xx``..``\\uDFxx`` escape (a valid pair, such as an emoji, is not lone)."""
    if _SURROGATE_ESCAPE.search(raw) is None:
        return None
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return path or "<body>"
        elif isinstance(value, dict):
            for k, v in value.items():
                key = k if _is_text(k) else repr(k)
                if key is not k:
                    return f"{path}.{key}" if path else key
                stack.append((v, f"{path}.{k}" if path else k))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
    return None


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` nests lists/objects deeper than ``limit`` (iteratively: no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            items: Any = v.values()
        elif isinstance(v, list):
            items = v
        else:
            continue
        if depth > limit:
            return True
        stack.extend((x, depth + 1) for x in items)
    return False


def _content(value: Any, where: str, *, allow_none: bool) -> str:
    if value is None:
        if allow_none:
            return ""
        raise bad_request(f"{where} is required", param=where)
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        out = []
        for i, part in enumerate(value):
            if isinstance(part, str):
                out.append(part)
                continue
            if not isinstance(part, dict):
                raise bad_request(f"{where}[{i}] must be a content part object", param=f"{where}[{i}]")
            kind = part.get("type")
            if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
                out.append(part["text"])
            elif kind in ("text", "input_text", "output_text"):
                raise bad_request(f"{where}[{i}].text must be a string", param=f"{where}[{i}].text")
            else:
                raise bad_request(
                    f"{where}[{i}]: content part type {kind!r} is not supported (text only)", param=f"{where}[{i}].type"
                )
        return "".join(out)
    raise bad_request(f"{where} must be a string, null or a list of text parts", param=where)


def _arguments(value: Any, where: str) -> Any:
    if isinstance(value, dict):
        if _too_deep(value):
            raise bad_request(f"{where} nests deeper than {MAX_DEPTH} levels", param=where)
        return value
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            parsed = loads(value) if value.strip() else {}
        except RecursionError:
            raise bad_request(f"{where} nests deeper than {MAX_DEPTH} levels", param=where) from None
        except ValueError:
            return value  # not JSON: kept as given and rendered verbatim (counted: unparsed_arguments)
        if isinstance(parsed, (dict, list)) and _too_deep(parsed):
            raise bad_request(f"{where} nests deeper than {MAX_DEPTH} levels", param=where)
        return parsed if isinstance(parsed, dict) else value
    raise bad_request(f"{where} must be a JSON string or an object", param=where)


_SCHEMA_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def _check_schema(schema: Any, where: str) -> None:
    """What OpenAI's API checks of a function's ``parameters`` before anything runs: a JSON
    schema object of ``type: "object"`` whose ``properties`` (if any) are schema objects and
    whose ``required`` (if any) lists strings; nothing nested deeper than :data:`MAX_DEPTH`."""
    if not isinstance(schema, dict):
        raise bad_request(f"{where} must be a JSON schema object", param=where)
    if _too_deep(schema):
        raise bad_request(f"{where} nests deeper than {MAX_DEPTH} levels", param=where)
    kind = schema.get("type", "object")
    if kind != "object":
        raise bad_request(f"{where}: a function's parameters must be a JSON schema of type 'object', got type {kind!r}", param=where)
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise bad_request(f"{where}.properties must be an object mapping names to schemas", param=where)
    for name, sub in props.items():
        if not isinstance(sub, dict):
            raise bad_request(f"{where}.properties.{name} must be a JSON schema object", param=where)
        t = sub.get("type")
        if t is not None and not (t in _SCHEMA_TYPES if isinstance(t, str) else isinstance(t, list) and all(x in _SCHEMA_TYPES for x in t)):
            raise bad_request(f"{where}.properties.{name}.type: {t!r} is not a JSON schema type", param=where)
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise bad_request(f"{where}.required must be a list of property names", param=where)


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise bad_request(f"{where} must be a list", param=where)
    calls = []
    for i, call in enumerate(value):
        w = f"{where}[{i}]"
        if not isinstance(call, dict):
            raise bad_request(f"{w} must be an object", param=w)
        if call.get("type", "function") != "function":
            raise bad_request(f"{w}.type must be 'function'", param=f"{w}.type")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{w}.function must be an object", param=f"{w}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{w}.function.name must be a non-empty string", param=f"{w}.function.name")
        cid = call.get("id")
        if cid is not None and not isinstance(cid, str):
            raise bad_request(f"{w}.id must be a string", param=f"{w}.id")
        out = {"type": "function", "function": {"name": name, "arguments": _arguments(fn.get("arguments"), f"{w}.function.arguments")}}
        if cid is not None:
            out = {"id": cid, **out}
        calls.append(out)
    return calls


def normalize_message(msg: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise bad_request(f"{where} must be an object", param=where)
    role = msg.get("role")
    if role is None:
        raise bad_request(f"{where}.role is required", param=f"{where}.role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad_request(
            f"{where}.role: {role!r} is not one of 'system', 'developer', 'user', 'assistant', 'tool'", param=f"{where}.role"
        )
    if role == "developer":
        role = "system"
    out: dict[str, Any] = {"role": role}
    if role == "assistant":
        out["content"] = _content(msg.get("content"), f"{where}.content", allow_none=True)
        calls = msg.get("tool_calls")
        if calls is not None:
            calls = _tool_calls(calls, f"{where}.tool_calls")
            if calls:
                out["tool_calls"] = calls
        if msg.get("function_call") is not None:
            raise bad_request(f"{where}.function_call (legacy functions) is not supported; use tool_calls", param=f"{where}.function_call")
    else:
        out["content"] = _content(msg.get("content"), f"{where}.content", allow_none=False)
    if role == "tool":
        tcid = msg.get("tool_call_id")
        if tcid is not None:
            if not isinstance(tcid, str):
                raise bad_request(f"{where}.tool_call_id must be a string", param=f"{where}.tool_call_id")
            out["tool_call_id"] = tcid
    name = msg.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise bad_request(f"{where}.name must be a string", param=f"{where}.name")
        out["name"] = name
    return out


def history_notes(messages: list[dict[str, Any]], start: int = 0) -> dict[str, int]:
    """What is imperfect, but accepted, in ``messages[start:]`` (normalised): a tool message
    whose ``tool_call_id`` is missing or matches no call of the assistant message before it
    (``tool_call_id_mismatches``), and tool-call arguments that are not a JSON object, kept as
    the string the agent sent (``unparsed_arguments``)."""
    mismatches = unparsed = 0
    ids: set[str] = set()
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "assistant":
            calls = m.get("tool_calls", ())
            ids = {c["id"] for c in calls if "id" in c}
            if i >= start:
                unparsed += sum(1 for c in calls if isinstance(c["function"]["arguments"], str))
        elif role == "tool":
            if i >= start and m.get("tool_call_id") not in ids:
                mismatches += 1
        else:
            ids = set()
    return {"tool_call_id_mismatches": mismatches, "unparsed_arguments": unparsed}


def message_key(msg: dict[str, Any]) -> Any:
    """What must stay equal for a message in the history to count as unchanged."""
    if msg["role"] == "assistant":
        # keys are compared with ==, never hashed: arguments compare as parsed JSON values
        calls = tuple((c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", ()))
        return ("assistant", msg["content"], calls)
    return (msg["role"], msg["content"], msg.get("tool_call_id"), msg.get("name"))


def normalize_tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request("tools must be a list", param="tools")
    if not value:
        return None
    names = set()
    for i, tool in enumerate(value):
        w = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{w} must be an object", param=w)
        if tool.get("type") != "function":
            raise bad_request(f"{w}.type must be 'function'", param=f"{w}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{w}.function must be an object", param=f"{w}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-." for c in name):
            raise bad_request(f"{w}.function.name must be 1-64 letters, digits, '_', '-' or '.'", param=f"{w}.function.name")
        if name in names:
            raise bad_request(f"{w}.function.name: duplicate tool {name!r}", param=f"{w}.function.name")
        names.add(name)
        if fn.get("parameters") is not None:
            _check_schema(fn["parameters"], f"{w}.function.parameters")
        if "description" in fn and fn["description"] is not None and not isinstance(fn["description"], str):
            raise bad_request(f"{w}.function.description must be a string", param=f"{w}.function.description")
    return value


# ----------------------------------------------------------------------------- the request


@dataclass
class ChatRequest:
    raw_messages: list[Any]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: Any = "auto"
    stream: bool = False
    include_usage: bool = False
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False
    return_token_ids: bool = False
    keys: list[Any] = field(default_factory=list)
    """:func:`message_key` of each message."""
    raw_tools: Any = None


def _number(body: dict[str, Any], key: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_request(f"{key} must be a number", param=key)
    if v > hi or v < lo or (lo_open and v == lo):
        raise bad_request(f"{key} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", param=key)
    return float(v)


def _int(body: dict[str, Any], key: str, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"{key} must be an integer", param=key)
    if v < lo:
        raise bad_request(f"{key} must be >= {lo}, got {v}", param=key)
    return v


def _flag(body: dict[str, Any], key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad_request(f"{key} must be a boolean", param=key)
    return v


@dataclass
class KnownHistory:
    """What a session already validated: the raw messages of its last answered request, their
    normalised forms and keys, and the raw and normalised tools. Agents resend their whole
    history every turn; a message equal to the raw one at the same index, or tools equal to the
    raw tools, are taken from here instead of being validated and normalised again."""

    raw: list[Any] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    keys: list[Any] = field(default_factory=list)
    raw_tools: Any = None
    tools: list[dict[str, Any]] | None = None


def normalize_messages(raw: list[Any], known: KnownHistory | None = None) -> tuple[list[dict[str, Any]], list[Any]]:
    """Normalise every message and compute its :func:`message_key`; messages equal to the known
    raw message at the same index are taken from ``known`` (see :class:`KnownHistory`)."""
    kraw = known.raw if known is not None else ()
    n_known = len(kraw)
    # the usual cases, one list comparison each: the agent resent everything it sent last time,
    # and the answer as it got it or in its own form (a client library's fields added)
    for n in (n_known, n_known - 1):
        if n > 0 and len(raw) >= n and raw[:n] == kraw[:n]:
            out = known.messages[:n]  # type: ignore[union-attr]
            keys = known.keys[:n]  # type: ignore[union-attr]
            for i in range(n, len(raw)):
                norm = normalize_message(raw[i], i)
                out.append(norm)
                keys.append(message_key(norm))
            return out, keys
    out = []
    keys = []
    for i, m in enumerate(raw):
        if i < n_known and kraw[i] == m:
            out.append(known.messages[i])  # type: ignore[union-attr]
            keys.append(known.keys[i])  # type: ignore[union-attr]
        else:
            norm = normalize_message(m, i)
            out.append(norm)
            keys.append(message_key(norm))
    return out, keys


def parse_chat_request(body: Any, model_name: str, known: KnownHistory | None = None) -> ChatRequest:
    """Validate a ``/chat/completions`` body (already JSON-decoded); ``known``: what the session
    already validated (:class:`KnownHistory`)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise bad_request("model is required", param="model")
    if not isinstance(model, str):
        raise bad_request("model must be a string", param="model")
    if model != model_name:
        raise ProxyError(404, f"The model {model!r} does not exist; this endpoint serves {model_name!r}", code="model_not_found", param="model")
    raw = body.get("messages")
    if raw is None:
        raise bad_request("messages is required", param="messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list", param="messages")
    messages, keys = normalize_messages(raw, known)
    raw_tools = body.get("tools")
    if known is not None and raw_tools is not None and raw_tools == known.raw_tools:
        tools = known.tools
    else:
        tools = normalize_tools(raw_tools)

    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
        raise bad_request("n must be an integer", param="n")
    if n is not None and n != 1:
        raise bad_request(f"n={n} is not supported: one choice per request (n=1)", param="n")

    tool_choice = body.get("tool_choice", "auto")
    if tool_choice is None:
        tool_choice = "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or a function", param="tool_choice")
    elif isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("tool_choice must be {'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        if not tools or fn["name"] not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice names {fn['name']!r}, which is not in tools", param="tool_choice")
    else:
        raise bad_request("tool_choice must be a string or an object", param="tool_choice")
    if tool_choice == "required" and not tools:
        raise bad_request("tool_choice 'required' needs tools", param="tool_choice")

    stream = _flag(body, "stream")
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("stream_options must be an object", param="stream_options")
        include_usage = _flag(so, "include_usage")

    max_tokens = _int(body, "max_completion_tokens", 1)
    legacy = _int(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = legacy

    stop_raw = body.get("stop")
    if stop_raw is None:
        stop: list[str] = []
    elif isinstance(stop_raw, str):
        stop = [stop_raw]
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        stop = list(stop_raw)
    else:
        raise bad_request("stop must be a string or a list of strings", param="stop")
    if any(not s for s in stop):
        raise bad_request("stop strings must be non-empty", param="stop")
    if len(stop) > 16:
        raise bad_request("at most 16 stop strings", param="stop")

    logprobs = _flag(body, "logprobs")
    top = _int(body, "top_logprobs", 0)
    if top:
        raise bad_request("top_logprobs > 0 is not supported: the engine reports the sampled token's log-prob only", param="top_logprobs")

    for key in ("presence_penalty", "frequency_penalty"):
        v = _number(body, key, -2.0, 2.0)
        if v:
            raise bad_request(f"{key} is not supported (it would change the sampling distribution the trainer assumes)", param=key)
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported", param="logit_bias")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise bad_request("functions / function_call (legacy) are not supported; use tools", param="functions")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad_request("response_format other than {'type': 'text'} is not supported", param="response_format")

    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad_request("seed must be an integer", param="seed")

    return ChatRequest(
        raw_messages=raw,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        stream=stream,
        include_usage=include_usage,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True),
        max_tokens=max_tokens,
        stop=stop,
        seed=seed,
        logprobs=logprobs,
        return_token_ids=_flag(body, "return_token_ids"),
        keys=keys,
        raw_tools=raw_tools,
    )
