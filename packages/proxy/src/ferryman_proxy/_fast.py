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


_DIGITS = bytes(48 if 48 <= i <= 57 else 32 for i in range(256))  # digits -> "0", the rest -> " "
_LONG_NUMBER = b"0" * 19


def loads(text: str | bytes) -> Any:
    """``json.loads``, the same values, through orjson where it gives them (about 4x faster).

    The standard library reads what orjson refuses (``NaN``, ``Infinity``) and any text with a
    run of 19 or more digits: orjson reads an integer beyond 64 bits as a float, where
    ``json.loads`` keeps it exact (a tool's schema or a call's arguments would render
    differently). The scan is one ``bytes.translate``, cheap next to the parse."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if _LONG_NUMBER in data.translate(_DIGITS):
        return json.loads(text)
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


def dumpb(obj: Any) -> bytes:
    """Compact UTF-8 JSON (orjson; the standard library for what orjson refuses, such as an
    integer beyond 64 bits in a tool call's arguments)."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


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
