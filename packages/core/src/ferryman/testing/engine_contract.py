"""Contract every Engine implementation passes.

Subclass :class:`EngineContract` in a ``Test*`` class and provide three fixtures:

``engine``
    yields a STARTED engine (``await engine.start()`` done) and shuts it down afterwards. Its
    model must make temperature-0 generation deterministic. A small per-step delay (a few
    milliseconds per token) makes the abort tests robust on fast hardware.
``prompt_ids``
    a ``list[int]`` prompt the model accepts; the suite also uses its prefixes and
    ``prompt_ids + prompt_ids[:3]``.
``own_weights``
    ``list[(name, tensor)]``: the engine model's own full weights, named as a trainer would
    send them; loading them must not change greedy output.

Example::

    class TestMyEngine(EngineContract):
        @pytest.fixture
        async def engine(self, model_dir):
            e = MyEngine(model_dir)
            await e.start()
            yield e
            await e.shutdown()

        @pytest.fixture
        def prompt_ids(self):
            return [1, 2, 3]

        @pytest.fixture
        def own_weights(self, model_dir):
            return load_named_tensors(model_dir)

``log_prob_atol`` (class attribute) is the tolerance when comparing log-probs of two runs of
the same greedy generation.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from ferryman.protocols import Engine
from ferryman.types import SamplingParams, TokenOutput

STOP_REASONS = ("stop", "length", "aborted")
LONG = 64
"""Budget of the generations that the abort tests interrupt."""


def _greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


def _check_output(out: TokenOutput, max_tokens: int) -> None:
    assert isinstance(out, TokenOutput), f"generate must return a TokenOutput, got {type(out).__name__}"
    assert len(out.token_ids) == len(out.log_probs) == len(out.versions)
    assert out.stop_reason in STOP_REASONS, f"stop_reason {out.stop_reason!r} not in {STOP_REASONS}"
    assert len(out.token_ids) <= max_tokens, f"{len(out.token_ids)} tokens for max_tokens={max_tokens}"
    assert all(isinstance(t, int) for t in out.token_ids)
    for lp in out.log_probs:
        assert math.isfinite(lp) and lp <= 1e-6, f"log-prob {lp} is not a finite value <= 0"
    assert all(isinstance(v, int) for v in out.versions)


def _check_finished(out: TokenOutput, max_tokens: int) -> None:
    _check_output(out, max_tokens)
    assert out.stop_reason in ("stop", "length"), f"an undisturbed generation ended with {out.stop_reason!r}"
    assert len(out.token_ids) >= 1
    if out.stop_reason == "length":
        assert len(out.token_ids) == max_tokens, "stop_reason 'length' before the budget was used"
    else:
        assert len(out.token_ids) <= max_tokens


class EngineContract:
    log_prob_atol: float = 1e-4

    def assert_same_generation(self, a: TokenOutput, b: TokenOutput, what: str = "") -> None:
        assert a.token_ids == b.token_ids, f"{what}: token ids differ: {a.token_ids} vs {b.token_ids}"
        assert a.stop_reason == b.stop_reason, f"{what}: stop reasons differ"
        for x, y in zip(a.log_probs, b.log_probs):
            assert abs(x - y) <= self.log_prob_atol, f"{what}: log-probs differ: {x} vs {y}"

    # ------------------------------------------------------------------ basics
    async def test_is_an_engine(self, engine):
        assert isinstance(engine, Engine)

    async def test_generate_returns_token_output(self, engine, prompt_ids):
        out = await engine.generate("contract-basic", list(prompt_ids), _greedy(8))
        _check_finished(out, 8)

    async def test_respects_max_tokens(self, engine, prompt_ids):
        for n in (1, 2, 5):
            out = await engine.generate(f"contract-budget-{n}", list(prompt_ids), _greedy(n))
            _check_finished(out, n)

    async def test_sampling_respects_max_tokens(self, engine, prompt_ids):
        params = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, top_k=20, seed=3)
        out = await engine.generate("contract-sampled", list(prompt_ids), params)
        _check_finished(out, 6)

    async def test_stop_token_is_included_and_ends_generation(self, engine, prompt_ids):
        ref = await engine.generate("contract-stop-ref", list(prompt_ids), _greedy(8))
        if len(ref.token_ids) < 3:
            pytest.skip("the model stops too early for this check")
        stop = ref.token_ids[2]
        expected = ref.token_ids[: ref.token_ids.index(stop) + 1]
        out = await engine.generate("contract-stop", list(prompt_ids), _greedy(8, stop_token_ids=[stop]))
        _check_output(out, 8)
        assert out.token_ids == expected
        assert out.stop_reason == "stop"

    async def test_greedy_is_deterministic(self, engine, prompt_ids):
        a = await engine.generate("contract-det-a", list(prompt_ids), _greedy(12))
        b = await engine.generate("contract-det-b", list(prompt_ids), _greedy(12))
        self.assert_same_generation(a, b, "two sequential greedy runs")
        c, d = await asyncio.gather(
            engine.generate("contract-det-c", list(prompt_ids), _greedy(12)),
            engine.generate("contract-det-d", list(prompt_ids), _greedy(12)),
        )
        self.assert_same_generation(a, c, "a concurrent greedy run")
        self.assert_same_generation(a, d, "a concurrent greedy run")

    async def test_concurrent_requests_match_one_by_one(self, engine, prompt_ids):
        prompts = [
            list(prompt_ids),
            list(prompt_ids[: max(1, len(prompt_ids) // 2)]),
            list(prompt_ids) + list(prompt_ids[:3]),
            list(prompt_ids[-1:]),
        ]
        alone = [await engine.generate(f"contract-alone-{i}", p, _greedy(10)) for i, p in enumerate(prompts)]
        together = await asyncio.gather(
            *[engine.generate(f"contract-together-{i}", p, _greedy(10)) for i, p in enumerate(prompts)]
        )
        for i, (a, b) in enumerate(zip(alone, together)):
            self.assert_same_generation(a, b, f"prompt {i} alone vs batched")

    # ------------------------------------------------------------------ versions
    async def test_versions_are_stamped_with_current_version(self, engine, prompt_ids):
        version = await engine.get_version()
        assert isinstance(version, int)
        out = await engine.generate("contract-version", list(prompt_ids), _greedy(5))
        assert out.versions == [version] * len(out.token_ids)

    async def test_set_version_changes_stamps(self, engine, prompt_ids):
        version = await engine.get_version()
        await engine.set_version(version + 7)
        assert await engine.get_version() == version + 7
        out = await engine.generate("contract-set-version", list(prompt_ids), _greedy(5))
        assert out.versions == [version + 7] * len(out.token_ids)

    # ------------------------------------------------------------------ streaming (optional)
    async def test_streamed_tokens_are_the_output(self, engine, prompt_ids):
        """An engine that takes ``on_tokens`` (``ferryman.streaming``) delivers a prefix of its
        output, in order, with the same log-probs and versions; skipped for engines without it."""
        from ferryman.streaming import accepts_on_tokens

        if not accepts_on_tokens(engine):
            pytest.skip("the engine does not stream (optional)")
        got: list[TokenOutput] = []
        out = await engine.generate("contract-stream", list(prompt_ids), _greedy(12), on_tokens=got.append)
        _check_finished(out, 12)
        ids = [t for d in got for t in d.token_ids]
        n = len(ids)
        assert got and n > 0, "a streaming engine delivered nothing"
        assert ids == out.token_ids[:n], "streamed tokens are not the output's"
        assert [x for d in got for x in d.log_probs] == out.log_probs[:n]
        assert [v for d in got for v in d.versions] == out.versions[:n]

    # ------------------------------------------------------------------ pause / abort
    async def test_abort_returns_tokens_so_far(self, engine, prompt_ids):
        started = time.perf_counter()
        ref = await engine.generate("contract-abort-ref", list(prompt_ids), _greedy(LONG))
        elapsed = time.perf_counter() - started
        task = asyncio.ensure_future(engine.generate("contract-abort", list(prompt_ids), _greedy(LONG)))
        await asyncio.sleep(elapsed / 2)
        running = not task.done()
        await engine.pause(abort=True)
        out = await asyncio.wait_for(task, 60)
        _check_output(out, LONG)
        assert out.token_ids == ref.token_ids[: len(out.token_ids)], "aborted tokens are not the greedy prefix"
        for x, y in zip(out.log_probs, ref.log_probs):
            assert abs(x - y) <= self.log_prob_atol
        if ref.stop_reason == "length" and running:
            assert out.stop_reason == "aborted", "pause(abort=True) must abort a running request"
            assert len(out.token_ids) < LONG
        elif out.stop_reason != "aborted":
            self.assert_same_generation(out, ref, "a request that finished before the abort")
        await engine.resume()
        again = await asyncio.wait_for(engine.generate("contract-after-abort", list(prompt_ids), _greedy(8)), 60)
        _check_finished(again, 8)
        assert again.token_ids == ref.token_ids[: len(again.token_ids)]

    async def test_pause_without_abort_lets_requests_finish(self, engine, prompt_ids):
        ref = await engine.generate("contract-drain-ref", list(prompt_ids), _greedy(16))
        task = asyncio.ensure_future(engine.generate("contract-drain", list(prompt_ids), _greedy(16)))
        await asyncio.sleep(0.01)
        await engine.pause(abort=False)
        assert task.done(), "pause(abort=False) returned while a request was still running"
        self.assert_same_generation(task.result(), ref, "a request drained by pause(abort=False)")
        await engine.resume()

    async def test_pause_blocks_new_requests_until_resume(self, engine, prompt_ids):
        ref = await engine.generate("contract-pause-ref", list(prompt_ids), _greedy(6))
        await engine.pause(abort=False)
        task = asyncio.ensure_future(engine.generate("contract-paused", list(prompt_ids), _greedy(6)))
        await asyncio.sleep(0.2)
        assert not task.done(), "generate() must wait while the engine is paused"
        await engine.resume()
        out = await asyncio.wait_for(task, 60)
        self.assert_same_generation(out, ref, "a request held by pause")

    # ------------------------------------------------------------------ weights
    async def test_loading_own_weights_keeps_greedy_output(self, engine, prompt_ids, own_weights):
        before = await engine.generate("contract-weights-before", list(prompt_ids), _greedy(10))
        version = await engine.get_version()
        await engine.pause(abort=False)
        await engine.release_kv_cache()
        await engine.load_weights(list(own_weights))
        await engine.set_version(version + 1)
        await engine.resume_kv_cache()
        await engine.resume()
        after = await engine.generate("contract-weights-after", list(prompt_ids), _greedy(10))
        self.assert_same_generation(before, after, "greedy output after reloading the same weights")
        assert after.versions == [version + 1] * len(after.token_ids)

    # ------------------------------------------------------------------ misc
    async def test_stats_are_numbers(self, engine, prompt_ids):
        await engine.generate("contract-stats", list(prompt_ids), _greedy(3))
        stats = await engine.stats()
        assert isinstance(stats, dict) and stats
        for key, value in stats.items():
            assert isinstance(key, str)
            assert isinstance(value, (int, float)) and not isinstance(value, bool), f"stats[{key!r}] = {value!r}"
            assert math.isfinite(value), f"stats[{key!r}] = {value!r}"

    async def test_invalid_input_raises_value_error(self, engine, prompt_ids):
        with pytest.raises(ValueError):
            await engine.generate("contract-empty", [], _greedy(4))
        with pytest.raises(ValueError):
            await engine.generate("contract-zero-budget", list(prompt_ids), _greedy(0))
        # the engine keeps serving afterwards
        out = await engine.generate("contract-after-invalid", list(prompt_ids), _greedy(2))
        _check_finished(out, 2)
