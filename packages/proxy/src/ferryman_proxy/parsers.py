"""Tool-call parsers: the model's text → OpenAI ``content`` + ``tool_calls``.

Each parser inverts the way one family of chat templates writes an assistant message with tool
calls, so that ``parse(render(message)) == message`` (up to what the template itself drops, such
as surrounding whitespace the template trims). A call that cannot be read — bad JSON, a missing
closing tag, no function name — makes the whole answer plain text (``error`` says why); the
proxy counts it and never fails the request.

* ``hermes``: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`` (Qwen2.5,
  Hermes, :data:`ferryman.tiny.CHAT_TEMPLATE`). Content is the text before the first call, less
  the one newline the template puts between them.
* ``qwen3_coder``: ``<tool_call>\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n
  </function>\\n</tool_call>`` (Qwen3-Coder, :data:`ferryman_proxy.templates.QWEN3_CODER_TEMPLATE`).
  Content is the text before the first call, trimmed. A parameter declared ``string`` in the
  request's tool schema stays a string; any other value is read as JSON when it parses, else kept
  as a string.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from ferryman_proxy._fast import dumps_arguments, loads, random_hex

__all__ = ["ParsedOutput", "ToolCall", "ToolParser", "HermesParser", "Qwen3CoderParser", "NoToolParser", "get_parser"]


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{random_hex(24)}")

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": dumps_arguments(self.arguments)},
        }


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    error: str | None = None
    """Why the text held a tool-call tag but no readable call (then ``content`` is the whole text)."""


class ToolParser(Protocol):
    start_tag: str

    def parse(self, text: str, tools: list[dict[str, Any]] | None) -> ParsedOutput: ...

    def stream_limit(self, text: str) -> int:
        """How much of ``text`` (the answer so far) is certainly the start of the ``content``
        that ``parse`` will give for the whole answer, whatever the model writes next: text
        that could begin a tool call (or be trimmed before one) is held back."""
        ...


def partial_suffix(text: str, word: str) -> int:
    """The length of the longest proper prefix of ``word`` that ``text`` ends with."""
    for k in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:k]):
            return k
    return 0


def _plain(text: str, error: str | None = None) -> ParsedOutput:
    return ParsedOutput(content=text if text else None, error=error)


class _TaggedParser:
    """Shared scanning: ``content <tool_call>…</tool_call>[\\n<tool_call>…</tool_call>]…``."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse(self, text: str, tools: list[dict[str, Any]] | None) -> ParsedOutput:
        first = text.find(self.start_tag)
        if first < 0:
            return _plain(text)
        calls: list[ToolCall] = []
        pos = first
        while True:
            start = text.find(self.start_tag, pos)
            if start < 0:
                break
            if text[pos:start].strip():
                return _plain(text, "text between tool calls")
            end = text.find(self.end_tag, start)
            if end < 0:
                return _plain(text, "unterminated <tool_call>")
            body = text[start + len(self.start_tag) : end]
            try:
                calls.append(self._parse_call(body, tools))
            except ValueError as e:
                return _plain(text, str(e))
            pos = end + len(self.end_tag)
        if text[pos:].strip():
            return _plain(text, "text after tool calls")
        return ParsedOutput(content=self._content(text[:first]), tool_calls=calls)

    def _content(self, head: str) -> str | None:
        raise NotImplementedError

    def stream_limit(self, text: str) -> int:
        first = text.find(self.start_tag)
        # a parsed call makes the content the head (trimmed); a malformed one the whole text,
        # of which the trimmed head is a prefix too. With no tag yet, a tag may still start
        # where the text ends with the beginning of one.
        head = text[:first] if first >= 0 else text[: len(text) - partial_suffix(text, self.start_tag)]
        return self._head_limit(head)

    def _head_limit(self, head: str) -> int:
        raise NotImplementedError

    def _parse_call(self, body: str, tools: list[dict[str, Any]] | None) -> ToolCall:
        raise NotImplementedError


class HermesParser(_TaggedParser):
    def _content(self, head: str) -> str | None:
        if head.endswith("\n"):
            head = head[:-1]
        return head or None

    def _head_limit(self, head: str) -> int:
        return len(head) - 1 if head.endswith("\n") else len(head)

    def _parse_call(self, body: str, tools: list[dict[str, Any]] | None) -> ToolCall:
        try:
            obj = loads(body)
        except ValueError as e:
            raise ValueError(f"tool call is not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ValueError("tool call is not a JSON object")
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("tool call has no name")
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = loads(args)
            except ValueError:
                raise ValueError("tool-call arguments are a string that is not JSON") from None
        if not isinstance(args, dict):
            raise ValueError("tool-call arguments are not a JSON object")
        return ToolCall(name=name, arguments=args)


_FUNCTION_RE = re.compile(r"\A\s*<function=([^>\n]+)>\n(.*)</function>\s*\Z", re.DOTALL)
_PARAM_OPEN_RE = re.compile(r"<parameter=([^>\n]+)>\n")
_PARAM_CLOSE = "\n</parameter>"


def _param_types(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            if isinstance(props, dict):
                return {k: (v.get("type") if isinstance(v, dict) else None) for k, v in props.items()}
    return {}


def _convert(raw: str, declared: Any) -> Any:
    if declared == "string" or (isinstance(declared, list) and "string" in declared and len(declared) == 1):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


class Qwen3CoderParser(_TaggedParser):
    def _content(self, head: str) -> str | None:
        return head.strip() or None

    def _head_limit(self, head: str) -> int:
        if head[:1].isspace():
            return 0  # stripped if a call follows, kept if none does: known only at the end
        return len(head.rstrip())

    def _parse_call(self, body: str, tools: list[dict[str, Any]] | None) -> ToolCall:
        m = _FUNCTION_RE.match(body)
        if m is None:
            raise ValueError("tool call has no <function=…>…</function>")
        name, inner = m.group(1).strip(), m.group(2)
        if not name:
            raise ValueError("tool call has no name")
        types = _param_types(tools, name)
        args: dict[str, Any] = {}
        pos = 0
        while pos < len(inner):
            rest = inner[pos:]
            if not rest.strip():
                break
            om = _PARAM_OPEN_RE.match(inner, pos)
            if om is None:
                raise ValueError("unexpected text inside <function=…>")
            pname = om.group(1).strip()
            close = inner.find(_PARAM_CLOSE, om.end())
            if close < 0:
                raise ValueError(f"unterminated <parameter={pname}>")
            args[pname] = _convert(inner[om.end() : close], types.get(pname))
            pos = close + len(_PARAM_CLOSE)
            if inner.startswith("\n", pos):
                pos += 1
        return ToolCall(name=name, arguments=args)


class NoToolParser:
    start_tag = "\0never"

    def parse(self, text: str, tools: list[dict[str, Any]] | None) -> ParsedOutput:
        return _plain(text)

    def stream_limit(self, text: str) -> int:
        return len(text)


PARSERS: dict[str, type] = {"hermes": HermesParser, "qwen3_coder": Qwen3CoderParser, "none": NoToolParser}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r} (allowed: {', '.join(sorted(PARSERS))})") from None
