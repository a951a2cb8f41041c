"""HFEngine on a locally built tiny Qwen2 model: exactness against a plain forward loop,
continuous batching, abort / pause, weight loading, prefix cache, sampling."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from ferryman.protocols import Engine  # noqa: E402
from ferryman.tiny import build_tiny_model  # noqa: E402
from ferryman.types import SamplingParams, TokenOutput  # noqa: E402
from ferryman_engine_hf.engine import HFEngine, HFEngineConfig, make_hf_engine  # noqa: E402

ATOL = 1e-4
EOS = 2  # <|im_end|> in the tiny tokenizer


INIT_STD = 0.2
"""Larger than the default init: the tiny model's greedy text varies instead of repeating the
last token, so batching, padding or cache mistakes show up as different tokens."""


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-engine-hf", init_std=INIT_STD)


@pytest.fixture(scope="session")
def ref_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="session")
def other_weights(tmp_path_factory):
    """Full weights of a tiny model with the same shapes but another seed, and that model."""
    other_dir = build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-engine-hf-seed1", seed=1, init_std=INIT_STD)
    model = transformers.AutoModelForCausalLM.from_pretrained(other_dir).eval()
    return [(k, v.detach().clone()) for k, v in model.state_dict().items()], model


@pytest.fixture(scope="session")
def prompts(model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)

    def chat(text):
        return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False))

    return [
        chat("Repeat the digit 7."),
        chat("What is 3 plus 4?"),
        tok.encode("The answer is", add_special_tokens=False),
        [5],
        chat("Write the digit 2. " * 5),
        tok.encode('{"name": "calculator", "arguments": {"a": 1}}', add_special_tokens=False),
    ]


def reference(model, prompt, max_tokens, *, stop=(EOS,)):
    """Greedy tokens and log-probs from a plain full forward per token (no cache, no batching)."""
    seq, tokens, log_probs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1].float()
            t = int(torch.argmax(logits))
            tokens.append(t)
            log_probs.append(float(torch.log_softmax(logits, -1)[t]))
            seq.append(t)
            if t in stop:
                break
    return tokens, log_probs


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


@contextlib.asynccontextmanager
async def running(model_dir, **cfg):
    engine = HFEngine(HFEngineConfig(**cfg), model_path=str(model_dir), replica="test-0", seed=0)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()


async def wait_for_tokens(engine, n, timeout=30.0):
    deadline = time.monotonic() + timeout
    while (await engine.stats())["total_generated_tokens"] < n:
        assert time.monotonic() < deadline, "engine made no progress"
        await asyncio.sleep(0.002)


def assert_matches_reference(out: TokenOutput, ref):
    tokens, log_probs = ref
    assert out.token_ids == tokens
    assert len(out.log_probs) == len(log_probs)
    for a, b in zip(out.log_probs, log_probs):
        assert abs(a - b) <= ATOL, (a, b)


# ----------------------------------------------------------------------------- exactness


async def test_greedy_equals_plain_forward_loop(model_dir, ref_model, prompts):
    async with running(model_dir) as engine:
        assert isinstance(engine, Engine)
        for i, prompt in enumerate(prompts[:4]):
            out = await engine.generate(f"r{i}", prompt, greedy(24))
            ref = reference(ref_model, prompt, 24)
            assert_matches_reference(out, ref)
            assert out.stop_reason == ("stop" if ref[0][-1] == EOS else "length")
            assert out.versions == [0] * len(out.token_ids)
            assert out.replica == "test-0"


async def test_concurrent_batched_equals_one_by_one(model_dir, ref_model, prompts):
    refs = [reference(ref_model, p, 16) for p in prompts]
    # max_batch_size < number of prompts: some wait in the queue and join between steps
    async with running(model_dir, max_batch_size=4) as engine:
        outs = await asyncio.gather(*[engine.generate(f"b{i}", p, greedy(16)) for i, p in enumerate(prompts)])
        for out, ref in zip(outs, refs):
            assert_matches_reference(out, ref)
        stats = await engine.stats()
        steps_together = stats["steps"]
        assert steps_together < sum(len(o.token_ids) for o in outs), "requests were not batched"

        # staggered arrivals: requests join a batch that is already decoding
        tasks = []
        for i, p in enumerate(prompts):
            tasks.append(asyncio.ensure_future(engine.generate(f"s{i}", p, greedy(16))))
            await asyncio.sleep(0.003)
        for out, ref in zip(await asyncio.gather(*tasks), refs):
            assert_matches_reference(out, ref)


async def test_stop_token_ids_and_context_limit(model_dir, ref_model, prompts):
    tokens, _ = reference(ref_model, prompts[0], 12)
    stop = tokens[3]
    async with running(model_dir) as engine:
        out = await engine.generate("stop", prompts[0], greedy(12, stop_token_ids=[stop]))
        assert out.token_ids == tokens[: tokens.index(stop) + 1]
        assert out.stop_reason == "stop"
        # the model has 512 positions: the budget shrinks to what is left
        long_prompt = (prompts[1] * 40)[:509]
        out = await engine.generate("ctx", long_prompt, greedy(10))
        assert len(out.token_ids) <= 3
        assert out.stop_reason == "length" or out.token_ids[-1] == EOS
        with pytest.raises(ValueError, match="context"):
            await engine.generate("too-long", (prompts[1] * 40)[:512], greedy(1))


async def test_invalid_input(model_dir, prompts):
    engine = HFEngine(HFEngineConfig(), model_path=str(model_dir))
    with pytest.raises(RuntimeError, match="start"):
        await engine.generate("x", [1, 2], greedy(2))
    await engine.start()
    try:
        with pytest.raises(ValueError, match="empty"):
            await engine.generate("x", [], greedy(2))
        with pytest.raises(ValueError, match="max_tokens"):
            await engine.generate("x", [1, 2], greedy(0))
        with pytest.raises(ValueError, match="out of range"):
            await engine.generate("x", [1, 10_000], greedy(2))
        with pytest.raises(ValueError, match="temperature"):
            await engine.generate("x", [1, 2], SamplingParams(temperature=-1.0))
        with pytest.raises(ValueError, match="top_p"):
            await engine.generate("x", [1, 2], SamplingParams(top_p=0.0))
        assert (await engine.stats())["num_requests"] == 0
        out = await engine.generate("x", prompts[0], greedy(2))
        assert len(out.token_ids) == 2
    finally:
        await engine.shutdown()


# ----------------------------------------------------------------------------- sampling


async def test_sampling_log_probs_are_temperature_scaled_and_seeded(model_dir, ref_model, prompts):
    prompt = prompts[0]
    params = SamplingParams(max_tokens=10, temperature=0.7, top_p=0.9, top_k=40, seed=123)
    async with running(model_dir) as engine:
        a, b = await asyncio.gather(engine.generate("t1", prompt, params), engine.generate("t2", prompt, params))
        c = await engine.generate("t3", prompt, params.replace(seed=124))
        d = await engine.generate("t4", prompt, SamplingParams(max_tokens=10, temperature=1.0, top_k=1))
    assert a.token_ids == b.token_ids, "the same seed must give the same sample"
    assert a.token_ids != c.token_ids, "another seed should give another sample"
    # log-prob = log_softmax(logits / temperature)[token], before top-k / top-p truncation
    seq = list(prompt)
    with torch.no_grad():
        for t, lp in zip(a.token_ids, a.log_probs):
            logits = ref_model(input_ids=torch.tensor([seq])).logits[0, -1].float()
            assert abs(lp - float(torch.log_softmax(logits / 0.7, -1)[t])) <= ATOL
            seq.append(t)
    # top_k=1 picks the argmax; its log-prob is under the temperature-1 distribution
    ref_tokens, ref_log_probs = reference(ref_model, prompt, 10)
    assert d.token_ids == ref_tokens
    assert max(abs(x - y) for x, y in zip(d.log_probs, ref_log_probs)) <= ATOL


# ----------------------------------------------------------------------------- pause / abort


async def test_abort_returns_tokens_so_far(model_dir, ref_model, prompts):
    ref_tokens, _ = reference(ref_model, prompts[0], 200, stop=())
    async with running(model_dir, step_delay_s=0.25, max_batch_size=1) as engine:
        task = asyncio.ensure_future(engine.generate("long", prompts[0], greedy(200)))
        queued = asyncio.ensure_future(engine.generate("queued", prompts[1], greedy(5)))
        await wait_for_tokens(engine, 3)
        t0 = time.perf_counter()
        await engine.pause(abort=True)
        out = await task
        waited = time.perf_counter() - t0
        assert waited < 0.15, f"abort took {waited:.3f}s, it must not wait for the running step (0.25 s)"
        assert out.stop_reason == "aborted"
        assert 3 <= len(out.token_ids) < 200
        assert out.token_ids == ref_tokens[: len(out.token_ids)]
        assert len(out.log_probs) == len(out.versions) == len(out.token_ids)
        q = await queued  # still queued behind max_batch_size=1: aborted with no tokens
        assert q.stop_reason == "aborted" and q.token_ids == []
        stats = await engine.stats()
        assert stats["num_aborted"] == 2 and stats["in_flight"] == 0
        await engine.resume()
        again = await engine.generate("after", prompts[0], greedy(5))
        assert again.token_ids == ref_tokens[:5]


async def test_generate_while_paused_waits_until_resume(model_dir, ref_model, prompts):
    async with running(model_dir) as engine:
        await engine.pause(abort=False)
        task = asyncio.ensure_future(engine.generate("held", prompts[2], greedy(6)))
        await asyncio.sleep(0.2)
        assert not task.done()
        stats = await engine.stats()
        assert stats["waiting"] == 1 and stats["paused"] == 1
        await engine.resume()
        out = await asyncio.wait_for(task, 30)
        assert_matches_reference(out, reference(ref_model, prompts[2], 6))


async def test_pause_without_abort_drains_in_flight(model_dir, ref_model, prompts):
    async with running(model_dir, step_delay_s=0.01) as engine:
        task = asyncio.ensure_future(engine.generate("drain", prompts[0], greedy(15)))
        await wait_for_tokens(engine, 2)
        await engine.pause(abort=False)
        assert task.done()
        out = task.result()
        assert out.stop_reason != "aborted"
        assert_matches_reference(out, reference(ref_model, prompts[0], 15))
        await engine.resume()


async def test_cancelled_request_is_dropped(model_dir, prompts):
    async with running(model_dir, step_delay_s=0.01) as engine:
        task = asyncio.ensure_future(engine.generate("cancel-me", prompts[0], greedy(100)))
        other = asyncio.ensure_future(engine.generate("keep-me", prompts[1], greedy(8)))
        await wait_for_tokens(engine, 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len((await other).token_ids) == 8
        await asyncio.sleep(0.05)
        assert (await engine.stats())["in_flight"] == 0


async def test_shutdown_aborts_outstanding(model_dir, prompts):
    engine = HFEngine(HFEngineConfig(step_delay_s=0.01), model_path=str(model_dir))
    await engine.start()
    task = asyncio.ensure_future(engine.generate("bye", prompts[0], greedy(200)))
    await wait_for_tokens(engine, 1)
    await engine.shutdown()
    out = await asyncio.wait_for(task, 5)
    assert out.stop_reason == "aborted"
    with pytest.raises(RuntimeError):
        await engine.generate("late", prompts[0], greedy(2))


# ----------------------------------------------------------------------------- weights


async def test_load_weights_changes_outputs_and_version(model_dir, ref_model, prompts, other_weights):
    weights, other_model = other_weights
    async with running(model_dir) as engine:
        before = await engine.generate("w", prompts[0], greedy(12))
        await engine.pause(abort=False)
        await engine.release_kv_cache()
        # names as in the HF state dict, half of them without the leading "model."
        renamed = [(k.removeprefix("model.") if i % 2 else k, v) for i, (k, v) in enumerate(weights)]
        await engine.load_weights(renamed[:10])
        await engine.load_weights(renamed[10:])
        await engine.set_version(3)
        await engine.resume_kv_cache()
        await engine.resume()
        after = await engine.generate("w", prompts[0], greedy(12))
    assert after.token_ids != before.token_ids
    assert after.versions == [3] * len(after.token_ids)
    assert_matches_reference(after, reference(other_model, prompts[0], 12))


async def test_bad_weights_raise_and_change_nothing(model_dir, ref_model, prompts, other_weights):
    weights, _ = other_weights
    good = dict(weights)
    async with running(model_dir) as engine:
        before = await engine.generate("bad", prompts[0], greedy(10))
        bad_batches = [
            [("model.norm.weight", good["model.norm.weight"]), ("model.no_such.weight", torch.zeros(3))],
            [("model.embed_tokens.weight", good["model.embed_tokens.weight"]), ("model.norm.weight", torch.zeros(7))],
            [("lm_head.weight", good["lm_head.weight"]), ("model.norm.weight", [1.0, 2.0])],
        ]
        for bucket in bad_batches:
            with pytest.raises(ValueError, match="nothing loaded"):
                await engine.load_weights(bucket)
        after = await engine.generate("bad-after", prompts[0], greedy(10))
        assert after.token_ids == before.token_ids
        assert after.log_probs == before.log_probs  # same computation path: bit-identical
        assert_matches_reference(after, reference(ref_model, prompts[0], 10))


# ----------------------------------------------------------------------------- prefix cache


async def test_prefix_cache_hit_on_resumed_request(model_dir, ref_model, prompts):
    prompt = prompts[0]
    full = reference(ref_model, prompt, 30, stop=())
    async with running(model_dir, step_delay_s=0.01) as engine:
        task = asyncio.ensure_future(engine.generate("resume-me", prompt, greedy(30)))
        await wait_for_tokens(engine, 4)
        await engine.pause(abort=True)
        part = await task
        assert part.stop_reason == "aborted" and 4 <= len(part.token_ids) < 30
        await engine.resume()
        # a partial-rollout resume: same request id, prompt + tokens so far, the rest of the budget
        rest = await engine.generate("resume-me", prompt + part.token_ids, greedy(30 - len(part.token_ids)))
        expected_hit = len(prompt) + len(part.token_ids) - 1
        assert rest.num_cached_prompt_tokens == expected_hit
        assert (await engine.stats())["prefix_cache_hit_tokens"] == expected_hit
        merged = TokenOutput(
            token_ids=part.token_ids + rest.token_ids,
            log_probs=part.log_probs + rest.log_probs,
            versions=part.versions + rest.versions,
        )
        assert_matches_reference(merged, full)

        # the next agent turn of the same request id also hits (the prompt extends the sequence)
        turn2 = prompt + part.token_ids + rest.token_ids + [EOS, 11, 1]
        nxt = await engine.generate("resume-me", turn2, greedy(5))
        assert nxt.num_cached_prompt_tokens == len(prompt) + 30 - 1
        assert_matches_reference(nxt, reference(ref_model, turn2, 5))

        # another request id does not hit; release_kv_cache drops everything
        other = await engine.generate("someone-else", prompt + part.token_ids, greedy(3))
        assert other.num_cached_prompt_tokens == 0
        await engine.release_kv_cache()
        await engine.resume_kv_cache()
        again = await engine.generate("resume-me", turn2, greedy(2))
        assert again.num_cached_prompt_tokens == 0

    async with running(model_dir, prefix_cache=False) as engine:
        await engine.generate("p", prompt, greedy(4))
        out = await engine.generate("p", prompt + [7, 8], greedy(4))
        assert out.num_cached_prompt_tokens == 0
        assert (await engine.stats())["prefix_cache_hit_tokens"] == 0


async def test_weight_update_invalidates_prefix_cache(model_dir, prompts, other_weights):
    weights, other_model = other_weights
    async with running(model_dir) as engine:
        first = await engine.generate("inv", prompts[0], greedy(5))
        await engine.load_weights(weights)  # without release_kv_cache: the cached KV is stale anyway
        extended = prompts[0] + first.token_ids
        out = await engine.generate("inv", extended, greedy(5))
        assert out.num_cached_prompt_tokens == 0
        assert_matches_reference(out, reference(other_model, extended, 5))


# ----------------------------------------------------------------------------- misc


async def test_stats_and_bfloat16(model_dir, prompts):
    async with running(model_dir, dtype="bfloat16") as engine:
        out = await engine.generate("bf16", prompts[0], SamplingParams(max_tokens=6, temperature=1.0, seed=0))
        assert len(out.token_ids) >= 1 and all(lp <= 0 for lp in out.log_probs)
        stats = await engine.stats()
    for key in (
        "in_flight",
        "waiting",
        "total_generated_tokens",
        "num_aborted",
        "num_requests",
        "prefix_cache_hit_tokens",
        "version",
        "steps",
    ):
        assert isinstance(stats[key], float), key
    assert stats["num_requests"] == 1 and stats["total_generated_tokens"] == len(out.token_ids)


def test_config_and_factory(model_dir):
    cfg = HFEngineConfig.model_validate({"type": "hf", "max_batch_size": 8, "step_delay_s": 0.1})
    engine = make_hf_engine(cfg, model_path=str(model_dir), replica="r7", seed=5, unknown_context="ignored")
    assert isinstance(engine, HFEngine) and engine.replica == "r7" and engine.seed == 5
    assert engine.model is None  # loaded in start()
    for bad in ({"type": "hf", "max_batch_size": 0}, {"type": "hf", "dtype": "float16"}, {"type": "hf", "nope": 1}):
        with pytest.raises(ValueError):
            HFEngineConfig.model_validate(bad)


def test_hooks_import_is_light_and_registers_hf():
    code = (
        "import sys\n"
        "import ferryman_engine_hf.hooks as h\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'\n"
        "(spec,) = h.ferryman_register_engines()\n"
        "assert spec.name == 'hf' and spec.config_cls.__name__ == 'HFEngineConfig'\n"
        "assert 'transformers' not in sys.modules, 'registering imported transformers'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ----------------------------------------------------------------------------- streaming (on_tokens)


async def test_on_tokens_streams_each_token_during_generation_and_across_abort(model_dir, ref_model, prompts):
    from ferryman.client import ServerClient
    from ferryman.defaults.router import LocalRouter
    from ferryman.engine_host import EngineHandle

    prompt = prompts[0]
    full = reference(ref_model, prompt, 24, stop=())
    async with running(model_dir, step_delay_s=0.01) as engine:
        # directly: one delivery per step, before the generation returns
        arrivals: list[tuple[float, TokenOutput]] = []
        out = await engine.generate("direct", prompt, greedy(8, stop_token_ids=[]), on_tokens=lambda d: arrivals.append((time.monotonic(), d)))
        done = time.monotonic()
        assert [t for _, d in arrivals for t in d.token_ids] == out.token_ids
        assert [x for _, d in arrivals for x in d.log_probs] == out.log_probs
        assert len(arrivals) == len(out.token_ids) and done - arrivals[0][0] >= 0.05, "the first token came long before the end"

        # through core's client with a partial-rollout abort in the middle: each token once
        client = ServerClient(LocalRouter(["e"]), {"e": EngineHandle("e", engine=engine)}, partial_rollout=True)
        deltas: list[TokenOutput] = []
        task = asyncio.ensure_future(client.generate("abort-me", prompt, greedy(24, stop_token_ids=[]), on_tokens=deltas.append))
        await wait_for_tokens(engine, len(out.token_ids) + 5)
        await engine.pause(abort=True)
        await engine.set_version(3)
        await engine.resume()
        merged = await asyncio.wait_for(task, 60)
        assert merged.num_aborts == 1 and 3 in merged.versions and merged.versions[0] == 0
        assert [t for d in deltas for t in d.token_ids] == merged.token_ids
        assert [x for d in deltas for x in d.log_probs] == merged.log_probs
        assert [v for d in deltas for v in d.versions] == merged.versions
        assert_matches_reference(merged, full)
