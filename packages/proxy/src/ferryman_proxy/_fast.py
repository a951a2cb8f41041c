"""Small helpers on the request path, chosen for CPU cost (see ``bench/results/proxy.md``)."""

from __future__ import annotations

import json
import random
from typing import Any

import orjson

_rng = random.Random()  # seeded from os.urandom at import; ids need to be unique, not secret
_ARGS_ENCODER = json.JSONEncoder(ensure_ascii=False)
try:  # the C encoder that json.dumps builds on every call, built once (no circular check: the
    # values come from parsing JSON, which cannot make a cycle)
    from json.encoder import c_make_encoder as _c_make_encoder
    from json.encoder import encode_basestring as _encode_basestring

    _C_ARGS_ENCODER = (
        _c_make_encoder(None, _ARGS_ENCODER.default, _encode_basestring, None, ": ", ", ", False, False, True)
        if _c_make_encoder is not None
        else None
    )
except ImportError:  # pragma: no cover - CPython always has it
    _C_ARGS_ENCODER = None


def loads(text: str | bytes) -> Any:
    """``json.loads``, through orjson when it can read the text (the same values, faster); the
    standard library decides what orjson refuses (``NaN``, integers beyond 64 bits)."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


def dumps_arguments(obj: Any) -> str:
    """``json.dumps(obj, ensure_ascii=False)`` without building an encoder per call."""
    if _C_ARGS_ENCODER is not None and isinstance(obj, dict):
        try:
            return "".join(_C_ARGS_ENCODER(obj, 0))
        except RecursionError:
            pass
    return _ARGS_ENCODER.encode(obj)


def random_hex(n: int) -> str:
    """``n`` random hex digits (ids of completions and tool calls)."""
    return f"{_rng.getrandbits(4 * n):0{n}x}"
