"""ThreadCore's stepping on CPU, over a named stand-in for vLLM's ``LLMEngine`` (vLLM needs a
GPU; the real core is tested by test_gpu.py and timed by bench/engine.py there). What is
checked here is ThreadCore's own logic: every request's tokens come out whole and in order, an
abort ends a request once, and ``freeze`` leaves no step running or starting until
``unfreeze``."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from ferryman.types import SamplingParams
from ferryman_engine_vllm import cores
from ferryman_engine_vllm.cores import ThreadCore


class FakeLLMEngine:
    """Stands in for vLLM's LLMEngine: each step() takes ``step_s`` and gives every running
    request its next token (token = step count of that request, log-prob -0.5), finishing it at
    its ``max_tokens``."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.running: dict[str, list[int]] = {}
        self.budget: dict[str, int] = {}
        self.steps = 0
        self.in_step = False

    def add_request(self, rid: str, prompt: object, sp: SimpleNamespace) -> None:
        self.running[rid] = []
        self.budget[rid] = sp.max_tokens

    def abort_request(self, rids: list[str]) -> None:
        for rid in rids:
            self.running.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    engine_core = SimpleNamespace()  # no inner scheduler to ask

    def step(self) -> list[SimpleNamespace]:
        self.steps += 1
        self.in_step = True
        time.sleep(self.step_s)
        outs = []
        for rid, toks in list(self.running.items()):
            t = len(toks)
            toks.append(t)
            done = len(toks) >= self.budget[rid]
            comp = SimpleNamespace(token_ids=[t], logprobs=[{t: SimpleNamespace(logprob=-0.5)}],
                                   finish_reason="length" if done else None)
            outs.append(SimpleNamespace(request_id=rid, outputs=[comp], finished=done, num_cached_tokens=0))
            if done:
                del self.running[rid]
        self.in_step = False
        return outs


@pytest.fixture
def fake_vllm(monkeypatch):
    # vLLM's own sampling-params and prompt types are imported from vllm: stand-ins carry what
    # the fake reads
    monkeypatch.setattr(cores, "vllm_sampling_params", lambda params, max_tokens: SimpleNamespace(max_tokens=max_tokens))
    monkeypatch.setattr(cores, "token_prompt", lambda ids: list(ids))


async def _core(step_s: float, on_delta, on_error=lambda rid, exc: None) -> tuple[ThreadCore, FakeLLMEngine]:
    fake = FakeLLMEngine(step_s)
    core = ThreadCore({}, on_delta, on_error)
    core._build = lambda: fake  # type: ignore[method-assign]
    fake.model_config = SimpleNamespace(max_model_len=4096)
    await core.start()
    return core, fake


async def test_every_request_gets_its_tokens_in_order(fake_vllm):
    got: dict[str, list[int]] = {}
    finished: dict[str, str] = {}

    def on_delta(rid: str, d: cores.Delta) -> None:
        got.setdefault(rid, []).extend(d.token_ids)
        if d.finish_reason is not None:
            finished[rid] = d.finish_reason

    core, fake = await _core(0.005, on_delta)
    try:
        n, budget = 8, 12
        for i in range(n):
            await core.add(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=budget), budget)
        deadline = time.monotonic() + 20
        while len(finished) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert finished == {f"r{i}": "length" for i in range(n)}
        assert all(got[f"r{i}"] == list(range(budget)) for i in range(n)), got
        # nothing left to do: the pump stops stepping
        steps = fake.steps
        await asyncio.sleep(0.05)
        assert fake.steps == steps
    finally:
        await core.shutdown()


async def test_freeze_waits_for_the_step_in_flight_and_no_step_starts_until_unfreeze(fake_vllm):
    got: dict[str, list[int]] = {}
    finished: set[str] = set()

    def on_delta(rid: str, d: cores.Delta) -> None:
        got.setdefault(rid, []).extend(d.token_ids)
        if d.finish_reason is not None:
            finished.add(rid)

    core, fake = await _core(0.004, on_delta)
    try:
        await core.add("a", [1], SamplingParams(max_tokens=400), 400)
        while len(got.get("a", [])) < 5:
            await asyncio.sleep(0.002)
        await core.freeze()
        assert not fake.in_step
        frozen_at, handed = fake.steps, len(got["a"])
        assert handed == frozen_at  # every step's token was handed out before freeze returned
        await asyncio.sleep(0.1)
        assert fake.steps == frozen_at and len(got["a"]) == handed
        await core.unfreeze()
        deadline = time.monotonic() + 20
        while "a" not in finished and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert got["a"] == list(range(400))
    finally:
        await core.shutdown()


async def test_abort_while_stepping_ends_the_request_once(fake_vllm):
    ends: dict[str, list[str]] = {}
    got: dict[str, list[int]] = {}

    def on_delta(rid: str, d: cores.Delta) -> None:
        got.setdefault(rid, []).extend(d.token_ids)
        if d.finish_reason is not None:
            ends.setdefault(rid, []).append(d.finish_reason)

    core, fake = await _core(0.003, on_delta)
    try:
        await core.add("x", [1], SamplingParams(max_tokens=1000), 1000)
        await core.add("y", [1], SamplingParams(max_tokens=30), 30)
        while len(got.get("x", [])) < 3:
            await asyncio.sleep(0.002)
        await core.abort(["x"])
        deadline = time.monotonic() + 20
        while "y" not in ends and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert ends == {"x": ["abort"], "y": ["length"]}
        assert got["x"] == list(range(len(got["x"]))) and len(got["x"]) < 1000
        assert got["y"] == list(range(30))
    finally:
        await core.shutdown()
