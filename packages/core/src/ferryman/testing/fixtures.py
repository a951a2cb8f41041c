"""Ready pieces for a plugin's contract tests: the tiny model's tokenizer and a client over the
formula engine, so an env's tests need neither a downloaded model nor a GPU.

    import pytest
    from ferryman.testing.fixtures import echo_client, tiny_tokenizer

    @pytest.fixture(scope="session")
    def tokenizer():
        return tiny_tokenizer()

    @pytest.fixture
    def client():
        return echo_client()
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path
from typing import Any


@functools.lru_cache(maxsize=None)
def tiny_tokenizer(path: str | os.PathLike[str] | None = None, vocab_size: int = 160) -> Any:
    """The tokenizer (with its chat template) of :func:`ferryman.tiny.build_tiny_model`'s model,
    built on the spot once and reused: in ``path``, or by default in the system's temporary
    directory, shared by every process and test session (the build is atomic).

    What it can encode: printable ASCII, tab, newline and carriage return; any other character
    (``é``, an emoji) has no token and is dropped (``encode("héllo")`` decodes as ``"hllo"``).
    Every digit is a token of its own. ``<|endoftext|>`` (id 0, pad), ``<|im_start|>`` (1) and
    ``<|im_end|>`` (2, eos, the end of a chat turn) are special tokens; ``<tool_call>``,
    ``</tool_call>``, ``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>`` are
    single tokens that ``decode(..., skip_special_tokens=True)`` keeps. The chat template is
    Qwen2.5-style ChatML with tools (:data:`ferryman.tiny.CHAT_TEMPLATE`)."""
    from transformers import AutoTokenizer

    from ferryman.tiny import build_tiny_model

    target = Path(path) if path is not None else Path(tempfile.gettempdir()) / f"ferryman-tiny-model-v{vocab_size}"
    return AutoTokenizer.from_pretrained(build_tiny_model(target, vocab_size=vocab_size))


def echo_client(replicas: int = 1, partial_rollout: bool = False) -> Any:
    """Core's :class:`~ferryman.client.ServerClient` over ``replicas`` formula engines
    (:class:`~ferryman.testing.doubles.EchoEngine`: token ids from a formula, no model), routed
    by the default router: what the Rollouter gives an env, in milliseconds."""
    from ferryman.client import ServerClient
    from ferryman.defaults.router import LocalRouter
    from ferryman.engine_host import EngineHandle
    from ferryman.testing.doubles import EchoEngine

    engines = {f"r{i}": EngineHandle(f"r{i}", engine=EchoEngine()) for i in range(replicas)}
    return ServerClient(LocalRouter(list(engines)), engines, partial_rollout=partial_rollout)
