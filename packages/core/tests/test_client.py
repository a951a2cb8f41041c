"""The server client: routing, release in finally, and partial-rollout resume + merge."""

from __future__ import annotations

import asyncio

import pytest

from ferryman.client import ReplicaFailedError, ServerClient
from ferryman.defaults.router import LocalRouter
from ferryman.engine_host import EngineHandle
from ferryman.testing.doubles import EchoEngine
from ferryman.types import SamplingParams


def _client(n=2, partial=True, delay=0.01, **kw):
    raw = {f"r{i}": EchoEngine(step_delay_s=delay, **kw) for i in range(n)}
    engines = {k: EngineHandle(k, engine=v) for k, v in raw.items()}
    router = LocalRouter(list(engines))
    return ServerClient(router, engines, partial_rollout=partial), raw, router


async def test_partial_rollout_merges_tokens_logprobs_versions_and_budget():
    client, raw, router = _client(n=2)
    params = SamplingParams(max_tokens=30)
    task = asyncio.ensure_future(client.generate("traj-1", [10, 11], params))
    await asyncio.sleep(0.055)  # ~5 tokens in
    # a weight sync: abort in flight, load version 1 (shift 2), resume
    await asyncio.gather(*(e.pause(abort=True) for e in raw.values()))
    for e in raw.values():
        await e.load_weights([("shift", __import__("torch").tensor([2.0]))])
        await e.set_version(1)
    await asyncio.sleep(0.02)
    await asyncio.gather(*(e.resume() for e in raw.values()))
    out = await asyncio.wait_for(task, 10)

    assert out.stop_reason == "length"
    assert len(out.token_ids) == 30, "the merged answer uses exactly the original budget"
    assert out.num_aborts == 1
    k = out.versions.index(1)
    assert 0 < k < 30
    assert out.versions == [0] * k + [1] * (30 - k)
    assert out.log_probs == [-2.0] * k + [-3.0] * (30 - k)
    # tokens: +1 steps under version 0, then +2 steps continuing from the last token
    expect, last = [], 11
    for i in range(30):
        last = (last + (1 if i < k else 2)) % 100
        if last == 0:
            last = 1
        expect.append(last)
    assert out.token_ids == expect

    # the resume went to the same replica with prompt + tokens so far and a shrunk budget
    calls = [c for e in raw.values() for c in e.calls]
    assert len(calls) == 2
    (rid1, p1, b1), (rid2, p2, b2) = sorted(calls, key=lambda c: len(c[1]))
    assert rid1 == rid2 == "traj-1"
    assert p1 == [10, 11] and p2 == [10, 11] + expect[:k]
    assert (b1, b2) == (30, 30 - k)
    assert sum(1 for e in raw.values() if e.calls) == 1, "sticky: both pieces on one replica"
    await client.drain()
    assert all(v == 0 for v in router.in_flight.values()), "released in finally"


async def test_without_partial_rollout_abort_is_returned():
    client, raw, _ = _client(n=1, partial=False)
    task = asyncio.ensure_future(client.generate("t", [3], SamplingParams(max_tokens=50)))
    await asyncio.sleep(0.03)
    await raw["r0"].pause(abort=True)
    out = await task
    await raw["r0"].resume()
    assert out.stop_reason == "aborted"
    assert 0 < len(out.token_ids) < 50
    assert out.num_aborts == 0


async def test_stop_token_ends_generation():
    client, _, _ = _client(n=1, delay=0.0, stop_after=3)
    out = await client.generate("t", [5], SamplingParams(max_tokens=10))
    assert out.stop_reason == "stop" and len(out.token_ids) == 3 and out.token_ids[-1] == 0


async def test_bad_input_is_a_clear_error_and_releases_nothing():
    client, raw, router = _client(n=1)
    with pytest.raises(ValueError, match="prompt_ids"):
        await client.generate("t", [], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        await client.generate("t", [1], SamplingParams(max_tokens=0))
    assert router.decisions == 0


async def test_dead_replica_fails_over():
    client, raw, router = _client(n=2, delay=0.0)

    async def dead(*a, **k):
        raise ConnectionError("replica died")

    raw["r0"].generate = dead  # type: ignore[method-assign]
    outs = [await client.generate(f"t{i}", [1], SamplingParams(max_tokens=2)) for i in range(4)]
    assert all(len(o.token_ids) == 2 for o in outs)
    assert "r0" in router.failed
    assert client.num_failovers == 1


async def test_all_replicas_dead_raises():
    client, raw, router = _client(n=1, delay=0.0)

    async def dead(*a, **k):
        raise ConnectionError("replica died")

    raw["r0"].generate = dead  # type: ignore[method-assign]
    with pytest.raises((ReplicaFailedError, RuntimeError)):
        await client.generate("t", [1], SamplingParams(max_tokens=2))


async def test_cancel_while_router_decides_does_not_leak_a_slot():
    class SlowRouter(LocalRouter):
        async def acquire(self, request_id):
            await asyncio.sleep(0.05)  # a remote router: the decision takes a round trip
            return await super().acquire(request_id)

    engines = {"r0": EngineHandle("r0", engine=EchoEngine())}
    router = SlowRouter(["r0"])
    client = ServerClient(router, engines, partial_rollout=False)
    task = asyncio.ensure_future(client.generate("t", [1], SamplingParams(max_tokens=2)))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.1)
    await client.drain()
    assert router.decisions == 1
    assert router.in_flight["r0"] == 0, "the slot granted after the cancel was released"


# ------------------------------------------------------------------ streaming (on_tokens)


class _NoStream:
    """EchoEngine seen through the plain protocol: ``generate`` without ``on_tokens``."""

    def __init__(self, engine: EchoEngine) -> None:
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, request_id, prompt_ids, params):
        return await self._engine.generate(request_id, prompt_ids, params)


class _DiesAfter:
    """EchoEngine that streams ``n`` tokens and then fails, as a replica whose process died."""

    def __init__(self, engine: EchoEngine, n: int) -> None:
        self._engine, self.n = engine, n

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, request_id, prompt_ids, params, *, on_tokens=None):
        seen = []

        def sink(delta):
            if len(seen) < self.n:
                seen.extend(delta.token_ids)
                on_tokens(delta)

        task = asyncio.ensure_future(self._engine.generate(request_id, prompt_ids, params, on_tokens=sink))
        while len(seen) < self.n and not task.done():
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise RuntimeError("replica died")


def _joined(deltas):
    return ([t for d in deltas for t in d.token_ids], [x for d in deltas for x in d.log_probs], [v for d in deltas for v in d.versions])


def _echo_expect(last: int, shifts: list[int]) -> list[int]:
    out = []
    for s in shifts:
        last = (last + s) % 100
        if last == 0:
            last = 1
        out.append(last)
    return out


@pytest.mark.parametrize("streams", [True, False], ids=["engine-streams", "engine-does-not"])
async def test_on_tokens_delivers_each_token_once_across_an_abort_resume(streams):
    raw = {"r0": EchoEngine(step_delay_s=0.01)}
    engines = {"r0": EngineHandle("r0", engine=raw["r0"] if streams else _NoStream(raw["r0"]))}
    client = ServerClient(LocalRouter(["r0"]), engines, partial_rollout=True)
    deltas, arrivals = [], []

    def on_tokens(d):
        deltas.append(d)
        arrivals.append(len(d.token_ids))

    task = asyncio.ensure_future(client.generate("s-1", [10, 11], SamplingParams(max_tokens=30), on_tokens=on_tokens))
    await asyncio.sleep(0.055)
    streamed_before_abort = sum(arrivals)
    e = raw["r0"]
    await e.pause(abort=True)
    await e.load_weights([("shift", __import__("torch").tensor([2.0]))])
    await e.set_version(1)
    await e.resume()
    out = await asyncio.wait_for(task, 10)

    assert out.num_aborts == 1 and len(out.token_ids) == 30
    ids, lps, vers = _joined(deltas)
    assert (ids, lps, vers) == (out.token_ids, out.log_probs, out.versions), "streamed pieces == final output, each token once"
    if streams:
        assert streamed_before_abort >= 2, "tokens arrive while the engine generates"
        assert max(arrivals) == 1
    else:
        assert streamed_before_abort == 0 and arrivals == [out.versions.index(1), 30 - out.versions.index(1)], "one delivery per piece"


async def test_on_tokens_survives_a_replica_that_dies_after_streaming():
    a, b = EchoEngine(step_delay_s=0.005), EchoEngine(step_delay_s=0.005)
    engines = {"r0": EngineHandle("r0", engine=_DiesAfter(a, 4)), "r1": EngineHandle("r1", engine=b)}
    router = LocalRouter(["r0", "r1"])
    client = ServerClient(router, engines, partial_rollout=False)
    deltas = []
    out = await asyncio.wait_for(client.generate("s-2", [10, 11], SamplingParams(max_tokens=12), on_tokens=deltas.append), 10)
    assert _joined(deltas)[0] == out.token_ids == _echo_expect(11, [1] * 12), "the 4 tokens streamed by the dead replica are kept, not sent again"
    assert out.stop_reason == "length" and client.num_failovers == 1
    assert [c[1] for c in b.calls] == [[10, 11] + out.token_ids[:4]], "the other replica resumed after the streamed tokens"


async def test_a_failing_on_tokens_callback_does_not_break_generation():
    client, raw, _ = _client(n=1, partial=False, delay=0.0)
    calls = []

    def bad(d):
        calls.append(d)
        raise RuntimeError("consumer bug")

    out = await client.generate("s-3", [10, 11], SamplingParams(max_tokens=5), on_tokens=bad)
    assert out.token_ids == _echo_expect(11, [1] * 5) and len(calls) == 1
