"""Optional token streaming: an engine that can deliver tokens while it generates.

An engine opts in by accepting a keyword argument ``on_tokens`` in ``generate``::

    async def generate(self, request_id, prompt_ids, params, *, on_tokens=None) -> TokenOutput

``on_tokens(delta)`` is called on the engine's event loop, without awaiting, with a
:class:`~ferryman.types.TokenOutput` holding the tokens produced since the last call (their
``log_probs``, ``versions`` and, when the engine gives them, ``routed_experts``: unlike the
tokens, the routing of the WHOLE sequence so far, prompt included
(:attr:`~ferryman.types.TokenOutput.routed_experts`), superseding any earlier delta's; its
``stop_reason`` means nothing). The rules:

* every token delivered is in the returned output, at the same position, in the same order;
* the returned output may end with tokens that were never delivered (the caller delivers them
  itself), so an engine may deliver as often or as rarely as it likes;
* the callback must be cheap; an engine isolates itself from a callback that raises.

Engines without the keyword keep working unchanged: :func:`accepts_on_tokens` says which is
which, and core's ``ServerClient`` then delivers each whole piece when it returns.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from ferryman.types import TokenOutput

log = logging.getLogger(__name__)

TokenSink = Callable[[TokenOutput], None]
"""Receives newly generated tokens (see the module docstring)."""

_ACCEPTS: dict[Any, bool] = {}


def accepts_on_tokens(obj: Any) -> bool:
    """Whether ``obj.generate`` takes an ``on_tokens`` keyword (an engine or a generate client
    that can stream). Cached per class where the method comes from a class."""
    fn = getattr(obj, "generate", None)
    if fn is None:
        return False
    key = getattr(fn, "__func__", None)
    if key is not None and key in _ACCEPTS:
        return _ACCEPTS[key]
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        ok = False
    else:
        p = params.get("on_tokens")
        ok = p is not None and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if key is not None:
        _ACCEPTS[key] = ok
    return ok


async def generate_to(client: Any, request_id: str, prompt_ids: list[int], params: Any, on_tokens: TokenSink | None) -> TokenOutput:
    """``client.generate(...)``, streaming to ``on_tokens`` when given: through the client when it
    takes ``on_tokens``, else the whole output once it returns."""
    if on_tokens is None:
        return await client.generate(request_id, prompt_ids, params)
    if accepts_on_tokens(client):
        return await client.generate(request_id, prompt_ids, params, on_tokens=on_tokens)
    out = await client.generate(request_id, prompt_ids, params)
    deliver(out, on_tokens)
    return out


def deliver(out: TokenOutput, on_tokens: TokenSink | None) -> None:
    """Hand a whole output to ``on_tokens`` (nothing if it has no tokens)."""
    if on_tokens is not None and out.token_ids:
        on_tokens(TokenOutput(list(out.token_ids), list(out.log_probs), list(out.versions), routed_experts=out.routed_experts))


def safe_sink(sink: TokenSink, where: str) -> TokenSink:
    """``sink`` that logs (once) and then ignores its own exceptions, so that a failing consumer
    never breaks the generation it watches."""
    failed = False

    def call(delta: TokenOutput) -> None:
        nonlocal failed
        if failed:
            return
        try:
            sink(delta)
        except Exception:  # noqa: BLE001 - a consumer's bug must not stop the engine
            failed = True
            log.exception("%s: the on_tokens callback raised; no more tokens are delivered to it", where)

    return call
