"""Live streaming: the answer's text as the engine produces its tokens, never ahead of the truth.

Two pieces, both pure:

* :class:`IncrementalDecoder` turns tokens into text as they arrive, holding back the end while
  it is an incomplete multi-byte character (decoded over a short window of recent tokens, so
  each step costs O(1) in the answer's length).
* :func:`content_limit` says how much of the text so far is certainly the beginning of the
  ``content`` the finished answer will have: text that could start a tool call (the parser's
  start tag, or what the parser trims before one) or a stop string is held back, and nothing
  after a stop string or a tool-call tag is sent. The rest comes once the answer is complete,
  from the same ``content`` the non-streamed answer has, so the streamed pieces always add up
  to it.
"""

from __future__ import annotations

from collections.abc import Callable

from ferryman_proxy.parsers import ToolParser, partial_suffix

__all__ = ["IncrementalDecoder", "content_limit"]


class IncrementalDecoder:
    """``feed(ids)`` appends tokens; ``text`` is the decoded text so far, less any trailing
    incomplete character. ``skip`` are token ids not decoded (the end-of-turn and EOS tokens,
    which the final answer's text leaves out too)."""

    def __init__(self, decode: Callable[[list[int]], str], skip: frozenset[int] = frozenset()) -> None:
        self._decode = decode
        self._skip = skip
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start: tokens before it are settled in ``text``
        self._read = 0  # tokens up to here are in ``text``

    def feed(self, ids: list[int]) -> str:
        """Add tokens; returns the text this added (maybe empty)."""
        self.ids.extend(t for t in ids if t not in self._skip)
        if self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        if len(now) <= len(before) or now.endswith("\ufffd") or not now.startswith(before):
            return ""  # an incomplete character (or nothing visible yet): wait for more tokens
        new = now[len(before) :]
        self.text += new
        self._prefix, self._read = self._read, len(self.ids)
        return new


def content_limit(text: str, parser: ToolParser | None, stops: list[str]) -> int:
    """The length of the prefix of ``text`` (the answer so far) that is certainly a prefix of
    the final answer's ``content``, whatever tokens follow. ``parser`` is ``None`` when tool
    calls are not parsed (``tool_choice: "none"``)."""
    end = len(text)
    if stops:
        hits = [i for s in stops if (i := text.find(s)) >= 0]
        if hits:
            end = min(hits)  # the answer is cut there
        else:
            end -= max(partial_suffix(text, s) for s in stops)
    if parser is None:
        return end
    return parser.stream_limit(text[:end])
