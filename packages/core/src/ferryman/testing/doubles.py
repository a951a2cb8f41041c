"""Test doubles for exercising core's control logic where no model is installed.

``EchoEngine`` is a *fake* engine (no model): it implements the Engine protocol's scheduling
semantics for real — concurrent requests, per-step delay, pause with or without abort, waiting
while paused, versions, weight loading by name — but its "model" is a formula: the next token is
``(last token + shift) % vocab`` and every log-prob is ``-1.0 - shift``. Core's own tests use it
so they run with core alone installed; the cross-package tests use the real transformers engine.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from ferryman.types import SamplingParams, TokenOutput


class EchoEngine:
    def __init__(self, *, vocab_size: int = 100, eos_id: int = 0, step_delay_s: float = 0.0, stop_after: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.step_delay_s = step_delay_s
        self.stop_after = stop_after
        """Emit EOS as the ``stop_after``-th token of a call (None: never)."""
        self.weights = {"shift": torch.tensor([1.0])}
        self.version = 0
        self._paused = False
        self._abort = False
        self._resumed: asyncio.Event | None = None
        self._in_flight = 0
        self._idle: asyncio.Event | None = None
        self.calls: list[tuple[str, list[int], int]] = []
        self.num_aborted = 0
        self.generated = 0
        self.started = False

    def _events(self) -> tuple[asyncio.Event, asyncio.Event]:
        if self._resumed is None:
            self._resumed = asyncio.Event()
            self._resumed.set()
            self._idle = asyncio.Event()
            self._idle.set()
        assert self._idle is not None
        return self._resumed, self._idle

    async def start(self) -> None:
        self.started = True

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, *, on_tokens: Any = None
    ) -> TokenOutput:
        """``on_tokens`` (optional, :mod:`ferryman.streaming`) receives each token as it is made."""
        if not prompt_ids:
            raise ValueError("EchoEngine.generate: empty prompt_ids")
        if params.max_tokens < 1:
            raise ValueError("EchoEngine.generate: max_tokens must be >= 1")
        resumed, idle = self._events()
        while not resumed.is_set():
            await resumed.wait()
        self.calls.append((request_id, list(prompt_ids), params.max_tokens))
        self._in_flight += 1
        idle.clear()
        out = TokenOutput()
        try:
            last = prompt_ids[-1]
            shift = int(self.weights["shift"].item())
            while True:
                if self._abort:
                    self.num_aborted += 1
                    out.stop_reason = "aborted"
                    return out
                await asyncio.sleep(self.step_delay_s)
                if self._abort:
                    self.num_aborted += 1
                    out.stop_reason = "aborted"
                    return out
                tok = (last + shift) % self.vocab_size
                if tok == self.eos_id:
                    tok = (tok + 1) % self.vocab_size
                if self.stop_after is not None and len(out.token_ids) + 1 >= self.stop_after:
                    tok = self.eos_id
                out.token_ids.append(tok)
                out.log_probs.append(-1.0 - shift)
                out.versions.append(self.version)
                self.generated += 1
                if on_tokens is not None:
                    on_tokens(TokenOutput([tok], [-1.0 - shift], [self.version]))
                last = tok
                if tok == self.eos_id or tok in params.stop_token_ids:
                    out.stop_reason = "stop"
                    return out
                if len(out.token_ids) >= params.max_tokens:
                    out.stop_reason = "length"
                    return out
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                idle.set()

    async def pause(self, abort: bool) -> None:
        resumed, idle = self._events()
        resumed.clear()
        self._paused = True
        if abort:
            self._abort = True
        await idle.wait()
        self._abort = False

    async def resume(self) -> None:
        resumed, _ = self._events()
        self._paused = False
        resumed.set()

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in named_tensors:
            if name not in self.weights or self.weights[name].shape != t.shape:
                raise ValueError(f"EchoEngine.load_weights: unknown weight or wrong shape: {name} {tuple(t.shape)}")
        for name, t in named_tensors:
            self.weights[name] = t.detach().clone()

    async def set_version(self, version: int) -> None:
        self.version = version

    async def get_version(self) -> int:
        return self.version

    async def stats(self) -> dict[str, float]:
        return {"in_flight": float(self._in_flight), "generated": float(self.generated), "num_aborted": float(self.num_aborted), "version": float(self.version)}

    async def shutdown(self) -> None:
        await self.resume()


def echo_weights(shift: int) -> list[tuple[str, Any]]:
    return [("shift", torch.tensor([float(shift)]))]
