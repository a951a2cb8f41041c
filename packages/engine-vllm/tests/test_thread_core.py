"""ThreadCore's stepping on CPU, over a named stand-in for vLLM's ``LLMEngine`` (vLLM needs a
GPU; the real core is tested by test_gpu.py and timed by bench/engine.py there). What is
checked here is ThreadCore's own logic, streamed (DELTA outputs) and final-only (the default):
every request's tokens come out whole and in order, requests that arrive during a step enter
vLLM together before the next one, an abort ends a request once with its tokens so far, and
``freeze`` leaves no step running or starting until ``unfreeze`` and counts each request's
tokens."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from types import SimpleNamespace

import pytest

from ferryman.types import SamplingParams
from ferryman_engine_vllm import cores
from ferryman_engine_vllm.cores import ThreadCore


class _Detok:
    def __init__(self) -> None:
        self.token_ids: list[int] = []

    def num_output_tokens(self) -> int:
        return len(self.token_ids)


class _State:
    """vLLM's ``RequestState`` as far as ThreadCore reads it: the tokens and log-probs so far,
    and ``make_request_output`` (the whole output for FINAL_ONLY, the new tokens for DELTA)."""

    def __init__(self, rid: str, final_only: bool) -> None:
        self.rid = rid
        self.final_only = final_only
        self.detokenizer = _Detok()
        self.logprobs: list[dict[int, SimpleNamespace]] = []

    def make_request_output(self, new_ids: list[int], pooling: object, finish: object, stop: object) -> SimpleNamespace | None:
        finished = finish is not None
        if self.final_only and not finished:
            return None
        ids = list(self.detokenizer.token_ids) if self.final_only else list(new_ids)
        lps = list(self.logprobs) if self.final_only else self.logprobs[-len(ids):] if ids else []
        comp = SimpleNamespace(token_ids=ids, logprobs=lps, finish_reason=str(finish) if finished else None)
        return SimpleNamespace(request_id=self.rid, outputs=[comp], finished=finished, num_cached_tokens=0)


class _Scheduler:
    def __init__(self, engine: FakeLLMEngine) -> None:
        self.engine = engine
        self.pause_state = "unpaused"

    def set_pause_state(self, state: str) -> None:
        self.pause_state = state

    def has_requests(self) -> bool:
        return bool(self.engine.running) and self.pause_state != "paused_all"


class FakeLLMEngine:
    """Stands in for vLLM's LLMEngine: each step() takes ``step_s`` and gives every running
    request its next token (token = step count of that request, log-prob -0.5), finishing it at
    its ``max_tokens``; requests live under an internal id, as in vLLM's output processor.

    With ``async_scheduling`` it behaves like vLLM's batch queue (two batches): a step
    launches the next batch before it returns the outputs of the one launched before, so a
    batch is "on the GPU" between two steps; with the scheduler in ``paused_all`` a step
    launches nothing and only finishes the batch in flight. Loading weights, sleeping, waking
    up or resetting the prefix cache with a batch in flight is counted as a fault."""

    def __init__(self, step_s: float, async_scheduling: bool = False) -> None:
        self.step_s = step_s
        self.async_scheduling = async_scheduling
        self.running: dict[str, list[int]] = {}
        self.budget: dict[str, int] = {}
        self.entered_at: dict[str, int] = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.in_step = False
        self.output_processor = SimpleNamespace(request_states={}, external_req_ids={})
        self.batch_queue: deque[dict[str, int]] = deque()
        self.scheduler = _Scheduler(self)
        self.engine_core = SimpleNamespace(engine_core=SimpleNamespace(
            batch_queue=self.batch_queue if async_scheduling else None, scheduler=self.scheduler))
        self.faults: list[str] = []
        self.calls: list[str] = []

    def add_request(self, rid: str, prompt: object, sp: SimpleNamespace) -> None:
        if sp.max_tokens <= 0:
            raise ValueError("max_tokens must be at least 1")
        self.running[rid] = []
        self.budget[rid] = sp.max_tokens
        self.entered_at[rid] = self.steps
        iid = f"{rid}-internal"
        self.output_processor.request_states[iid] = _State(rid, sp.final_only)
        self.output_processor.external_req_ids[rid] = [iid]

    def _drop(self, rid: str) -> None:
        self.running.pop(rid, None)
        for iid in self.output_processor.external_req_ids.pop(rid, []):
            self.output_processor.request_states.pop(iid, None)

    def abort_request(self, rids: list[str]) -> None:
        for rid in rids:
            if rid in self.running:
                self.aborted.append(rid)
            self._drop(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def _batch(self) -> dict[str, int]:
        """The next token of every running request not at its budget (counting queued batches)."""
        ahead = {rid: sum(rid in b for b in self.batch_queue) for rid in self.running}
        return {rid: len(toks) + ahead[rid] for rid, toks in self.running.items()
                if len(toks) + ahead[rid] < self.budget[rid]}

    def _apply(self, batch: dict[str, int]) -> list[SimpleNamespace]:
        outs = []
        for rid, t in batch.items():
            if rid not in self.running:  # aborted while its batch ran: dropped, as vLLM does
                continue
            toks = self.running[rid]
            toks.append(t)
            (st,) = (self.output_processor.request_states[i] for i in self.output_processor.external_req_ids[rid])
            st.detokenizer.token_ids.append(t)
            st.logprobs.append({t: SimpleNamespace(logprob=-0.5)})
            done = len(toks) >= self.budget[rid]
            out = st.make_request_output([t], None, "length" if done else None, None)
            if out is not None:
                outs.append(out)
            if done:
                self._drop(rid)
        return outs

    def step(self) -> list[SimpleNamespace]:
        self.steps += 1
        self.in_step = True
        time.sleep(self.step_s)
        try:
            if not self.async_scheduling:
                return self._apply(self._batch())
            if self.scheduler.has_requests():
                batch = self._batch()
                if batch:
                    self.batch_queue.appendleft(batch)
                    if len(self.batch_queue) < 2:
                        return []  # launched; nothing finished yet
            return self._apply(self.batch_queue.pop()) if self.batch_queue else []
        finally:
            self.in_step = False

    def _quiet_call(self, what: str) -> None:
        self.calls.append(what)
        if self.batch_queue:
            self.faults.append(f"{what} with a batch on the GPU")

    def collective_rpc(self, method: str, timeout: object, args: tuple) -> None:
        self._quiet_call("load_weights")

    def sleep(self, level: int) -> None:
        self._quiet_call("sleep")

    def wake_up(self, tags: object) -> None:
        self._quiet_call("wake_up")

    def reset_prefix_cache(self, reset_running: bool) -> bool:
        self._quiet_call("reset_prefix_cache")
        return True


@pytest.fixture
def fake_vllm(monkeypatch):
    # vLLM's own sampling-params and prompt types are imported from vllm: stand-ins carry what
    # the fake reads
    monkeypatch.setattr(cores, "vllm_sampling_params",
                        lambda params, max_tokens, final_only=False: SimpleNamespace(max_tokens=max_tokens, final_only=final_only))
    monkeypatch.setattr(cores, "token_prompt", lambda ids: list(ids))


STREAM = pytest.mark.parametrize("stream", [False, True], ids=["final-only", "streamed"])
ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-sched", "async-sched"])


class Recorder:
    def __init__(self) -> None:
        self.got: dict[str, list[int]] = {}
        self.lps: dict[str, list[float]] = {}
        self.ends: dict[str, list[str]] = {}
        self.deltas: dict[str, int] = {}

    def __call__(self, rid: str, d: cores.Delta) -> None:
        self.got.setdefault(rid, []).extend(d.token_ids)
        self.lps.setdefault(rid, []).extend(d.log_probs)
        self.deltas[rid] = self.deltas.get(rid, 0) + 1
        if d.finish_reason is not None:
            self.ends.setdefault(rid, []).append(d.finish_reason)

    async def wait_ended(self, rids, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not set(rids) <= set(self.ends) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)


async def _core(step_s: float, on_delta, *, stream: bool, on_error=lambda rid, exc: None,
                async_scheduling: bool = False) -> tuple[ThreadCore, FakeLLMEngine]:
    fake = FakeLLMEngine(step_s, async_scheduling)
    core = ThreadCore({}, on_delta, on_error, stream_tokens=stream)
    core._build = lambda: fake  # type: ignore[method-assign]
    fake.model_config = SimpleNamespace(max_model_len=4096)
    await core.start()
    return core, fake


async def _until(cond, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


@ASYNC
@STREAM
async def test_every_request_gets_its_tokens_in_order(fake_vllm, stream, async_scheduling):
    rec = Recorder()
    core, fake = await _core(0.005, rec, stream=stream, async_scheduling=async_scheduling)
    try:
        n, budget = 8, 12
        for i in range(n):
            await core.add(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=budget), budget)
        await rec.wait_ended([f"r{i}" for i in range(n)])
        assert rec.ends == {f"r{i}": ["length"] for i in range(n)}
        assert all(rec.got[f"r{i}"] == list(range(budget)) for i in range(n)), rec.got
        assert all(rec.lps[f"r{i}"] == [-0.5] * budget for i in range(n))
        # final-only: one hand-over per request; streamed: one per token
        assert set(rec.deltas.values()) == ({budget} if stream else {1})
        # nothing left to do: the pump stops stepping
        steps = fake.steps
        await asyncio.sleep(0.05)
        assert fake.steps == steps and not fake.batch_queue
    finally:
        await core.shutdown()


async def test_requests_that_arrive_during_a_step_enter_together_before_the_next(fake_vllm):
    rec = Recorder()
    core, fake = await _during_a_slow_step(rec, 50)
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(core.add(f"late{i}", [1], SamplingParams(max_tokens=3), 3) for i in range(6)))
        took = time.perf_counter() - t0
        entered = {fake.entered_at[f"late{i}"] for i in range(6)}
        assert len(entered) == 1, fake.entered_at  # one batch, between two steps
        assert took < 10 * fake.step_s  # not one step per request
        await rec.wait_ended([f"late{i}" for i in range(6)])
        assert all(rec.got[f"late{i}"] == [0, 1, 2] for i in range(6))
    finally:
        await core.shutdown()


async def test_a_refused_request_fails_alone(fake_vllm):
    rec = Recorder()
    core, fake = await _core(0.003, rec, stream=False)
    try:
        ok = asyncio.ensure_future(core.add("ok", [1], SamplingParams(max_tokens=4), 4))
        with pytest.raises(ValueError, match="max_tokens"):
            await core.add("bad", [1], SamplingParams(max_tokens=4), 0)
        await ok
        await rec.wait_ended(["ok"])
        assert rec.ends == {"ok": ["length"]} and rec.got["ok"] == [0, 1, 2, 3]
        assert "bad" not in fake.entered_at
    finally:
        await core.shutdown()


@ASYNC
@STREAM
async def test_freeze_waits_for_the_step_in_flight_and_no_step_starts_until_unfreeze(fake_vllm, stream, async_scheduling):
    rec = Recorder()
    core, fake = await _core(0.004, rec, stream=stream, async_scheduling=async_scheduling)
    try:
        await core.add("a", [1], SamplingParams(max_tokens=400), 400)
        await _until(lambda: len(fake.running.get("a", [])) >= 5)
        made = await core.freeze()
        assert not fake.in_step and not fake.batch_queue  # async: the batch on the GPU finished too
        frozen_at = fake.steps
        assert made == {"a": len(fake.running["a"])} and core.in_flight_tokens() == made["a"] >= 5
        # streamed: every step's token was handed out before freeze returned; final-only: none yet
        assert len(rec.got.get("a", [])) == (made["a"] if stream else 0)
        await asyncio.sleep(0.1)
        assert fake.steps == frozen_at
        await core.unfreeze()
        await rec.wait_ended(["a"])
        assert rec.got["a"] == list(range(400))
    finally:
        await core.shutdown()


@ASYNC
@STREAM
async def test_abort_while_stepping_ends_the_request_once_with_its_tokens(fake_vllm, stream, async_scheduling):
    rec = Recorder()
    core, fake = await _core(0.003, rec, stream=stream, async_scheduling=async_scheduling)
    try:
        await core.add("x", [1], SamplingParams(max_tokens=1000), 1000)
        await core.add("y", [1], SamplingParams(max_tokens=30), 30)
        await _until(lambda: len(fake.running.get("x", [])) >= 3)
        await core.abort(["x"])
        await rec.wait_ended(["y"])
        await asyncio.sleep(0.05)
        assert rec.ends == {"x": ["abort"], "y": ["length"]}
        k = len(rec.got["x"])
        assert 3 <= k < 1000 and rec.got["x"] == list(range(k)) and rec.lps["x"] == [-0.5] * k
        assert fake.aborted == ["x"]
        assert rec.got["y"] == list(range(30))
    finally:
        await core.shutdown()


async def _during_a_slow_step(rec: Recorder, first_tokens: int) -> tuple[ThreadCore, FakeLLMEngine]:
    """A core whose vLLM stand-in is in the middle of a 50 ms step for request ``first``."""
    core, fake = await _core(0.05, rec, stream=False)
    await core.add("first", [1], SamplingParams(max_tokens=first_tokens), first_tokens)
    await _until(lambda: fake.in_step)
    return core, fake


async def test_abort_of_a_request_not_yet_in_vllm_never_sends_it(fake_vllm):
    rec = Recorder()
    core, fake = await _during_a_slow_step(rec, 5)
    try:
        late = asyncio.ensure_future(core.add("late", [1], SamplingParams(max_tokens=5), 5))
        await asyncio.sleep(0)  # queued behind the running step
        await core.abort(["late"])
        await asyncio.wait_for(late, 5)
        await rec.wait_ended(["first"])
        await asyncio.sleep(0.1)
        assert rec.ends == {"late": ["abort"], "first": ["length"]} and rec.got["late"] == []
        assert "late" not in fake.entered_at
    finally:
        await core.shutdown()


async def test_a_caller_that_gives_up_while_its_request_enters_leaves_nothing_running(fake_vllm):
    rec = Recorder()
    core, fake = await _during_a_slow_step(rec, 3)
    try:
        gone = asyncio.ensure_future(core.add("gone", [1], SamplingParams(max_tokens=1000), 1000))
        await _until(lambda: "gone" in fake.entered_at)  # the next step call has sent it
        gone.cancel()
        await _until(lambda: "gone" in fake.aborted)  # aborted at the next step
        await rec.wait_ended(["first"])
        assert "gone" not in rec.ends and not fake.running
    finally:
        await core.shutdown()


@STREAM
async def test_with_async_scheduling_no_weight_load_sleep_or_reset_meets_a_batch_on_the_gpu(fake_vllm, stream):
    """vLLM's async scheduling leaves a batch on the GPU when step() returns: a keep freeze
    finishes it (and hands its tokens out) before the weights change, and so does every
    weight load, sleep, wake-up and prefix-cache reset after the requests were aborted."""
    rec = Recorder()
    core, fake = await _core(0.003, rec, stream=stream, async_scheduling=True)
    try:
        await core.add("a", [1], SamplingParams(max_tokens=300), 300)
        await _until(lambda: len(fake.running.get("a", [])) >= 5)
        made = await core.freeze()
        await core.load_weights([("w", None)])
        await core.reset_prefix_cache(True)
        assert fake.faults == [] and made == {"a": len(fake.running["a"])}
        await core.unfreeze()
        await rec.wait_ended(["a"])
        assert rec.got["a"] == list(range(300))
        await core.add("b", [1], SamplingParams(max_tokens=1000), 1000)
        await _until(lambda: len(fake.running.get("b", [])) >= 5)
        await core.abort(["b"])
        await core.sleep(1)
        await core.wake_up(["weights"])
        await core.load_weights([("w", None)])
        await core.wake_up(["kv_cache"])
        assert fake.faults == [] and fake.calls.count("load_weights") == 2
        assert rec.ends["b"] == ["abort"] and rec.got["b"] == list(range(len(rec.got["b"])))
    finally:
        await core.shutdown()
