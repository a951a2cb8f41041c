"""The sglang engine's own logic on CPU, over FakeSGLangEngine (a named test double of
``sglang.Engine``: SGLang needs a GPU). What ferryman sends to SGLang and how it reads SGLang's
answers are checked here; the same engine over real SGLang is tested by test_gpu.py."""

from __future__ import annotations

import asyncio
import base64
import importlib.util

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from ferryman.client import ServerClient  # noqa: E402
from ferryman.defaults.router import LocalRouter  # noqa: E402
from ferryman.testing.engine_contract import EngineContract  # noqa: E402
from ferryman.tiny import build_tiny_model  # noqa: E402
from ferryman.types import SamplingParams  # noqa: E402
from ferryman_engine_sglang.api import EXTRA_HINT, check_version  # noqa: E402
from ferryman_engine_sglang.config import SGLangEngineConfig  # noqa: E402
from ferryman_engine_sglang.engine import SGLangEngine, _Request, make_sglang_engine  # noqa: E402
from ferryman_engine_sglang import engine as ENGINE  # noqa: E402
from ferryman_engine_sglang.testing import FakeSGLangEngine  # noqa: E402
from ferryman.engine_checks import check_bucket, read_checkpoint_spec  # noqa: E402

VOCAB = 160


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-engine-sglang", init_std=0.2)


@pytest.fixture(scope="session")
def own_state(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    return [(k, v.detach().clone()) for k, v in model.state_dict().items()]


@pytest.fixture(scope="session")
def prompt(model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    msgs = [{"role": "user", "content": "Repeat the digit 7."}]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))


def checksums(named):
    return {k: float(v.double().sum().item()) for k, v in named}


async def started(model_dir, own_state, *, eos_id=2, fake=None, **cfg):
    made: list[FakeSGLangEngine] = []
    factory = FakeSGLangEngine.factory(made, vocab_size=VOCAB, initial_weights=checksums(own_state), eos_id=eos_id, **(fake or {}))
    engine = make_sglang_engine(SGLangEngineConfig(**cfg), model_path=str(model_dir), replica="fake-0", seed=5, sglang_factory=factory)
    await engine.start()
    return engine, made[0]


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


async def _update(engine, weights, version):
    await engine.pause(abort=True)
    await engine.release_kv_cache()
    half = len(weights) // 2
    await engine.load_weights(weights[:half])
    await engine.load_weights(weights[half:])
    await engine.set_version(version)
    await engine.resume_kv_cache()
    await engine.resume()


async def _wait_tokens(fake, n):
    """Until the fake's running requests have made ``n`` tokens between them (the engine
    counts a request's tokens when SGLang answers it, at its end unless it streams)."""
    while sum(len(r.output) for r in fake.running) < n:
        await asyncio.sleep(0.002)


class TestSGLangEngineLogicContract(EngineContract):
    """The engine contract, SGLang replaced by the test double."""

    @pytest.fixture
    async def engine(self, model_dir, own_state):
        engine, fake = await started(model_dir, own_state)
        yield engine
        await engine.shutdown()
        assert fake.crashed is None and fake.prefix_aborted == []

    @pytest.fixture
    def prompt_ids(self, prompt):
        return prompt

    @pytest.fixture
    def own_weights(self, own_state):
        return own_state


# ---------------------------------------------------------------------- config, plugin, install


def test_config_defaults_map_to_server_args():
    kw = SGLangEngineConfig().engine_kwargs(model_path="/m", seed=3)
    assert kw["model_path"] == "/m" and kw["random_seed"] == 3 and kw["skip_tokenizer_init"] is True
    assert kw["disable_radix_cache"] is False and kw["enable_memory_saver"] is True
    assert kw["tp_size"] == 1 and kw["log_level"] == "error"
    assert "enable_return_routed_experts" not in kw and "max_total_tokens" not in kw
    kw = SGLangEngineConfig(
        return_routed_experts=True, tensor_parallel_size=2, cuda_graph=False, max_total_tokens=4096, server_args={"page_size": 16}
    ).engine_kwargs(model_path="/m", seed=0)
    assert kw["enable_return_routed_experts"] is True and kw["tp_size"] == 2 and kw["disable_cuda_graph"] is True
    assert kw["max_total_tokens"] == 4096 and kw["page_size"] == 16


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"pause_mode": "retract"}, "pause_mode"),
        ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
        ({"server_args": {"disable_radix_cache": True}}, "server_args"),
        ({"release_weights": True, "memory_saver": False}, "release_weights"),
        ({"chunked_prefill_size": 0}, "chunked_prefill_size"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ],
)
def test_bad_config_names_the_field(bad, field):
    from ferryman.config import ConfigError, validate_plugin_section
    from ferryman.plugins import PluginHost

    host = PluginHost()  # entry points: the installed plugin, no SGLang needed
    with pytest.raises(ConfigError, match=field):
        validate_plugin_section(host, "engine", "engine", {"type": "sglang", **bad})
    cfg = validate_plugin_section(host, "engine", "engine", {"type": "sglang", "pause_mode": "keep"})
    assert isinstance(cfg, SGLangEngineConfig)


def test_hook_registers_the_sglang_engine():
    from ferryman_engine_sglang import hooks

    (spec,) = hooks.ferryman_register_engines()
    assert spec.name == "sglang" and spec.config_cls is SGLangEngineConfig and spec.factory is make_sglang_engine


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_without_sglang_creating_the_engine_names_the_extra(model_dir):
    with pytest.raises(RuntimeError) as err:
        make_sglang_engine(SGLangEngineConfig(), model_path=str(model_dir))
    assert str(err.value) == EXTRA_HINT and "\n" not in EXTRA_HINT and "--extra sglang" in EXTRA_HINT


def test_supported_sglang_versions():
    for ok in ("0.5.11", "0.5.12.post1", "0.5.17"):
        check_version(ok)
    for bad in ("0.5.10.post1", "0.5.18", "0.5.21", "0.6.0"):
        with pytest.raises(RuntimeError, match="0.5.11"):
            check_version(bad)


# ---------------------------------------------------------------------- what ferryman sends


async def test_generate_sends_token_ids_and_asks_for_output_log_probs(model_dir, own_state, prompt):
    engine, fake = await started(model_dir, own_state)
    try:
        params = SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, top_k=20, seed=11, stop_token_ids=[5])
        out = await engine.generate("req-1", prompt, params)
        (call,) = fake.generate_kwargs
        assert call["input_ids"] == prompt and call["prompt"] is None
        assert call["return_logprob"] is True and call["logprob_start_len"] == -1 and call["stream"] is False
        assert call["return_routed_experts"] is False
        assert call["sampling_params"] == {
            "max_new_tokens": 6, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "stop_token_ids": [5],
            "no_stop_trim": True, "skip_special_tokens": False, "sampling_seed": 11,
        }
        assert call["rid"].endswith("-req-1") and len(call["rid"].split("-", 1)[0]) == 12
        assert len(out.token_ids) == len(out.log_probs) == len(out.versions) >= 1
        # log-probs as SGLang reports them (temperature applied, before top-k/top-p)
        assert out.log_probs == [lp for lp, _, _ in fake_last_logprobs(fake)]
        await engine.generate("req-2", prompt, greedy(3))
        assert "sampling_seed" not in fake.generate_kwargs[-1]["sampling_params"]
        assert fake.generate_kwargs[-1]["sampling_params"]["temperature"] == 0.0
        assert fake.server_args["skip_tokenizer_init"] is True and fake.server_args["random_seed"] == 5
    finally:
        await engine.shutdown()


def fake_last_logprobs(fake):
    return fake.last_answer_logprobs


@pytest.fixture(autouse=True)
def _record_last_answer(monkeypatch):
    """Keep the log-prob triples of the fake's last final answer, to compare with the output."""
    orig = FakeSGLangEngine._answer

    def answer(self, req, finish, **kw):
        if finish is not None:
            self.last_answer_logprobs = list(req.logprobs)
        return orig(self, req, finish, **kw)

    monkeypatch.setattr(FakeSGLangEngine, "_answer", answer)


async def test_request_ids_sent_to_sglang_are_prefix_free(model_dir, own_state, prompt):
    """SGLang's scheduler aborts every request whose id starts with the id given: aborting one
    of "a", "a1", "a10" must not touch the others."""
    engine, fake = await started(model_dir, own_state, eos_id=-1)
    try:
        ids = ["a", "a1", "a10", "a1-x"] * 3
        tasks = [asyncio.ensure_future(engine.generate(r, prompt, greedy(200))) for r in ids]
        await _wait_tokens(fake, 40)
        await engine.pause(abort=True)
        outs = await asyncio.gather(*tasks)
        assert all(o.stop_reason == "aborted" for o in outs)
        assert fake.prefix_aborted == []
        rids = [c["rid"] for c in fake.generate_kwargs]
        assert len(set(rids)) == len(rids)
        assert not any(a != b and b.startswith(a) for a in rids for b in rids)
    finally:
        await engine.shutdown()


async def test_tensor_parallel_ranks_each_get_a_payload(model_dir, own_state, prompt):
    engine, fake = await started(model_dir, own_state, tensor_parallel_size=2)
    try:
        await engine.pause(abort=False)
        await engine.load_weights(own_state[:3])
        await engine.set_version(1)
        await engine.resume()
        (load,) = [c for c in fake.calls if c[0] == "update_weights_from_tensor"]
        assert load[1] == [n for n, _ in own_state[:3]] and load[2] is False and load[3] is None
        assert ("flush_cache", True) in fake.calls
    finally:
        await engine.shutdown()


# ---------------------------------------------------------------------- how ferryman reads meta_info


def _answer(ids, lps, total=None, finish=None):
    return {"output_ids": ids, "meta_info": {"completion_tokens": len(ids) if total is None else total, "output_token_logprobs": lps, "finish_reason": finish}}


def test_reading_cumulative_incremental_and_streamed_abort_answers():
    engine = SGLangEngine(SGLangEngineConfig(), model_path="/nowhere")
    req = _Request("r", [1, 2], SamplingParams(), 10, None)
    engine._take(req, _answer([5], [(-0.5, 5, None)]))
    engine._take(req, _answer([5, 6], [(-0.5, 5, None), (-0.25, 6, None)]))  # whole output so far
    engine._take(req, _answer([6], [(-0.25, 6, None)], total=2))  # the same again: nothing new
    engine._take(req, _answer([7], [(-0.125, 7, None)], total=3))  # incremental streaming
    # a streamed abort answer: the last token only, log-probs of the whole output
    lps = [(-0.5, 5, None), (-0.25, 6, None), (-0.125, 7, None), (-1.0, 8, None)]
    engine._take(req, _answer([8], lps, total=4, finish={"type": "abort"}))
    assert req.tokens == [5, 6, 7, 8] and req.log_probs == [-0.5, -0.25, -0.125, -1.0] and req.versions == [0] * 4
    # a streamed abort answer for two tokens not read yet (SGLang answers the newest of the
    # outputs waiting): the token ids come from the log-prob entries
    lps += [(-2.0, 9, None), (-3.0, 10, None)]
    engine._take(req, _answer([10], lps, total=6, finish={"type": "abort"}))
    assert req.tokens == [5, 6, 7, 8, 9, 10] and req.log_probs[-2:] == [-2.0, -3.0]
    with pytest.raises(RuntimeError, match="1 token ids for 2 new tokens"):
        engine._take(req, _answer([12], lps + [(-1.0, None, None), (-1.0, 12, None)], total=8, finish={"type": "abort"}))
    lps = lps[:4]
    req = _Request("r", [1, 2], SamplingParams(), 10, None)
    engine._take(req, _answer([5, 6, 7, 8], lps))
    with pytest.raises(RuntimeError, match="log-prob entry is for token 3"):
        engine._take(req, _answer([5, 6, 7, 8, 9], lps + [(-1.0, 3, None)]))
    with pytest.raises(RuntimeError, match="0 log-probs for 1 new tokens"):
        engine._take(req, _answer([5, 6, 7, 8, 9], []))


async def test_streamed_abort_answer_for_several_unread_tokens(model_dir, own_state, prompt, monkeypatch):
    """A streamed request moved back to SGLang's waiting queue (retracted) with two steps'
    outputs not read yet, then aborted: SGLang answers the newest output only, its abort answer, which
    holds the last token id and the log-probs of all; the tokens come from the log-probs."""
    engine, fake = await started(model_dir, own_state, eos_id=-1)
    orig = FakeSGLangEngine._sched_abort

    def retract_then_abort(self, rid, abort_all):
        for req in list(self.running):
            for _ in range(2):  # two steps whose outputs are not read yet
                token, lp = self._next(req)
                req.output.append(token)
                req.logprobs.append((lp, token, None))
                self._answer(req, None)
            self.running.remove(req)  # retracted, its output kept
            self.waiting.append(req)
        orig(self, rid, abort_all)

    monkeypatch.setattr(FakeSGLangEngine, "_sched_abort", retract_then_abort)
    try:
        streamed: list[int] = []
        task = asyncio.ensure_future(engine.generate("s", prompt, greedy(200), on_tokens=lambda d: streamed.extend(d.token_ids)))
        while len(streamed) < 5:
            await asyncio.sleep(0.002)
        await engine.pause(abort=True)
        out = await asyncio.wait_for(task, 10)
        assert out.stop_reason == "aborted" and streamed == out.token_ids
        assert out.log_probs == [lp for lp, _, _ in fake.last_answer_logprobs]
        assert out.token_ids == [t for _, t, _ in fake.last_answer_logprobs]
        await engine.resume()
    finally:
        await engine.shutdown()


async def test_routed_experts_are_decoded_per_position(tmp_path, own_state, prompt):
    import json
    import shutil

    src = build_tiny_model(tmp_path / "moe-shaped", init_std=0.2)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_experts_per_tok"] = 2  # read like an MoE config (the fake routes; nothing else changes)
    (src / "config.json").write_text(json.dumps(cfg))
    engine, fake = await started(src, own_state, return_routed_experts=True, fake={"num_layers": cfg["num_hidden_layers"]})
    try:
        out = await engine.generate("moe", prompt, greedy(5))
        assert fake.generate_kwargs[0]["return_routed_experts"] is True
        assert fake.server_args["enable_return_routed_experts"] is True
        routed = out.routed_experts
        assert len(routed) == len(prompt) + len(out.token_ids) - 1
        assert all(len(pos) == cfg["num_hidden_layers"] and all(len(layer) == 2 for layer in pos) for pos in routed)
        flat = [e for pos in routed for layer in pos for e in layer]
        assert flat[:9] == [0, 1, 2, 3, 4, 5, 6, 0, 1]
        with pytest.raises(RuntimeError, match="do not split"):
            engine._decode_routed(base64.b64encode(b"\0" * 12).decode())
    finally:
        await engine.shutdown()
        shutil.rmtree(src, ignore_errors=True)


# ---------------------------------------------------------------------- abort, resume, keep, in_place


async def test_partial_rollout_round_trip_matches_uninterrupted(model_dir, own_state, prompt):
    """abort mid-generation, resume through the server client under the same request id: the
    same greedy tokens, the resumed piece served from the radix cache, versions recording the
    update."""
    engine, fake = await started(model_dir, own_state, eos_id=-1)
    try:
        ref = await engine.generate("ref", prompt, greedy(48))
        assert ref.stop_reason == "length"
        client = ServerClient(LocalRouter(["fake-0"]), {"fake-0": engine}, partial_rollout=True)
        task = asyncio.ensure_future(client.generate("traj", prompt, greedy(48)))
        await _wait_tokens(fake, 10)
        await engine.pause(abort=True)
        await engine.set_version(1)
        await engine.resume()
        out = await asyncio.wait_for(task, 30)
        assert out.token_ids == ref.token_ids and out.log_probs == ref.log_probs
        assert out.num_aborts == 1 and out.stop_reason == "length"
        k = out.versions.index(1)
        assert 10 <= k < 48 and out.versions == [0] * k + [1] * (48 - k)
        resent = fake.generate_kwargs[-1]
        assert resent["rid"].endswith("-traj") and resent["input_ids"] == prompt + out.token_ids[:k]
        # the resend's prompt (prompt + k tokens) came from the radix cache, all but its last token
        assert (await engine.stats())["prefix_cache_hit_tokens"] >= len(prompt) + k - 1
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("semantics", ["0.5.11", "0.5.17"])
async def test_abort_before_prefill_returns_zero_tokens(model_dir, own_state, prompt, semantics):
    """0.5.11: an abort that overtakes its request (still being tokenized) finds nothing in
    SGLang's scheduler; ferryman repeats it until SGLang answers from its waiting queue. 0.5.17:
    the tokenizer manager ends such a request with an error. Either way: no tokens, aborted."""
    fake_cfg = {"admit_delay_s": 0.08, "step_delay_s": 0.3, "abort_semantics": semantics}
    engine, fake = await started(model_dir, own_state, fake=fake_cfg)
    try:
        task = asyncio.ensure_future(engine.generate("early", prompt, greedy(16)))
        await asyncio.sleep(0.01)
        await engine.pause(abort=True)
        out = await asyncio.wait_for(task, 10)
        assert out.stop_reason == "aborted" and out.token_ids == [] and out.log_probs == []
        aborts = [c for c in fake.calls if c[0] == "abort_request"]
        if semantics == "0.5.11":
            assert len(aborts) >= 2  # the first was lost
        await engine.resume()
        again = await engine.generate("later", prompt, greedy(4))
        assert again.stop_reason in ("stop", "length") and fake.crashed is None
    finally:
        await engine.shutdown()


async def test_keep_mode_continues_in_the_same_call_with_new_weights(model_dir, own_state, prompt):
    engine, fake = await started(model_dir, own_state, eos_id=-1, pause_mode="keep")
    try:
        other = [(k, v * 1.5) for k, v in own_state]
        task = asyncio.ensure_future(engine.generate("kept", prompt, greedy(40)))
        await _wait_tokens(fake, 10)
        await engine.pause(abort=True)
        await asyncio.sleep(0.03)
        assert not task.done() and (await engine.stats())["in_sglang"] == 0
        await _update_paused(engine, other, 1)
        out = await asyncio.wait_for(task, 30)
        assert out.stop_reason == "length" and len(out.token_ids) == 40 and out.num_aborts == 0
        k = out.versions.index(1)
        assert k >= 10 and out.versions == [0] * k + [1] * (40 - k)
        resent = fake.generate_kwargs[-1]
        assert resent["input_ids"] == prompt + out.token_ids[:k] and resent["sampling_params"]["max_new_tokens"] == 40 - k
        # the tokens after the update are the new weights' greedy continuation of that context
        fresh = await engine.generate("fresh", prompt + out.token_ids[:k], greedy(40 - k))
        assert fresh.token_ids == out.token_ids[k:]
        assert [c[0] for c in fake.calls if c[0] in ("release_memory_occupation", "flush_cache")][:3] == [
            "flush_cache", "release_memory_occupation", "flush_cache"
        ]
        assert fake.crashed is None and (await engine.stats())["num_aborted"] == 0
    finally:
        await engine.shutdown()


async def _update_paused(engine, weights, version):
    await engine.release_kv_cache()
    await engine.load_weights(weights)
    await engine.set_version(version)
    await engine.resume_kv_cache()
    await engine.resume()


async def test_in_place_mode_keeps_requests_and_flushes_when_idle(model_dir, own_state, prompt):
    """SGLang's in_place pause: requests stay in its batch with their KV; memory is not
    released (SGLang asserts idleness), the weight load must not ask for a flush (SGLang
    asserts it succeeds), the radix cache is flushed once SGLang is idle again."""
    engine, fake = await started(model_dir, own_state, eos_id=-1, pause_mode="in_place")
    try:
        other = [(k, v * 1.5) for k, v in own_state]
        task = asyncio.ensure_future(engine.generate("frozen", prompt, greedy(40)))
        await _wait_tokens(fake, 10)
        await engine.pause(abort=True)
        await asyncio.sleep(0.02)
        n = len(fake.tokenizer_manager.rid_to_state[fake.generate_kwargs[-1]["rid"]].output)
        await asyncio.sleep(0.03)
        assert len(fake.tokenizer_manager.rid_to_state[fake.generate_kwargs[-1]["rid"]].output) == n
        await _update_paused(engine, other, 1)
        assert (await engine.stats())["cache_stale"] == 1.0
        out = await asyncio.wait_for(task, 30)
        assert out.stop_reason == "length" and len(out.token_ids) == 40 and out.num_aborts == 0
        assert out.versions[0] == 0 and out.versions[-1] == 1 and sorted(out.versions) == out.versions
        assert ("pause_generation", "in_place") in fake.calls and ("continue_generation",) in fake.calls
        assert not [c for c in fake.calls if c[0] == "release_memory_occupation"]
        for _ in range(100):
            if not (await engine.stats())["cache_stale"]:
                break
            await asyncio.sleep(0.01)
        assert (await engine.stats())["cache_stale"] == 0.0 and ("flush_cache", False) in fake.calls
        assert ("flush_cache", True) in fake.calls and fake.crashed is None
    finally:
        await engine.shutdown()


async def test_in_place_pause_releases_nothing_until_resume(model_dir, own_state, prompt):
    """While SGLang is paused in place its scheduler is not idle, even once the last request
    ferryman had in it has answered (one that ended in the step the pause arrived in):
    release_kv_cache releases nothing until resume()."""
    engine, fake = await started(model_dir, own_state, eos_id=-1, pause_mode="in_place")
    try:
        task = asyncio.ensure_future(engine.generate("last-step", prompt, greedy(40)))
        await _wait_tokens(fake, 5)
        await engine.pause(abort=True)
        await asyncio.sleep(0.01)
        (req,) = fake.running  # SGLang answers it as finished (its last step ran with the pause)
        fake.running.remove(req)
        fake._answer(req, {"type": "length", "length": len(req.output)})
        out = await asyncio.wait_for(task, 10)
        assert out.stop_reason == "length" and (await engine.stats())["in_sglang"] == 0
        await engine.release_kv_cache()
        assert not [c for c in fake.calls if c[0] in ("release_memory_occupation", "flush_cache")]
        assert (await engine.stats())["kv_released"] == 0.0
        await engine.resume()
        await engine.pause(abort=True)
        await engine.release_kv_cache()  # not paused in place now: released
        assert (await engine.stats())["kv_released"] == 1.0 and fake.crashed is None
        await engine.resume_kv_cache()
        await engine.resume()
    finally:
        await engine.shutdown()


async def test_cancelled_call_is_aborted_in_sglang(model_dir, own_state, prompt):
    engine, fake = await started(model_dir, own_state, eos_id=-1)
    try:
        task = asyncio.ensure_future(engine.generate("gone", prompt, greedy(300)))
        await _wait_tokens(fake, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        rid = fake.generate_kwargs[-1]["rid"]
        assert ("abort_request", rid, False) in fake.calls
        for _ in range(200):
            if fake.idle():
                break
            await asyncio.sleep(0.005)
        assert fake.idle() and (await engine.stats())["in_flight"] == 0
    finally:
        await engine.shutdown()


# ---------------------------------------------------------------------- memory and weights


async def test_release_and_resume_kv_cache_in_order(model_dir, own_state, prompt):
    engine, fake = await started(model_dir, own_state)
    try:
        before = await engine.generate("a", prompt, greedy(8))
        await _update(engine, own_state, 1)
        after = await engine.generate("b", prompt, greedy(8))
        assert after.token_ids == before.token_ids and after.versions == [1] * len(after.token_ids)
        kinds = [c for c in fake.calls if c[0] in ("release_memory_occupation", "resume_memory_occupation", "update_weights_from_tensor", "flush_cache")]
        assert kinds[0] == ("flush_cache", True) and kinds[1] == ("release_memory_occupation", ["kv_cache"])
        assert [k[0] for k in kinds[2:4]] == ["update_weights_from_tensor"] * 2 and kinds[2][2] is False
        assert kinds[4] == ("flush_cache", True) and kinds[5] == ("resume_memory_occupation", ["kv_cache"])
        assert fake.flush_timeouts == [ENGINE.FLUSH_WAIT_S] * 2 and fake.crashed is None
    finally:
        await engine.shutdown()


async def test_flushes_wait_until_sglang_is_idle(model_dir, own_state, prompt):
    """SGLang flushes only when its scheduler is fully idle, a moment after its last answer:
    right after an abort an immediate flush is refused; ferryman's waiting flush (0.5.17's
    flush_cache(timeout_s=...)) succeeds, and the release that SGLang asserts idleness for
    comes after it."""
    engine, fake = await started(model_dir, own_state, eos_id=-1, fake={"idle_lag_s": 0.05})
    try:
        task = asyncio.ensure_future(engine.generate("busy", prompt, greedy(200)))
        await _wait_tokens(fake, 5)
        await engine.pause(abort=True)
        assert (await task).stop_reason == "aborted" and not fake.idle()
        assert (await fake.tokenizer_manager.flush_cache()).success is False  # what an immediate flush gets
        await engine.release_kv_cache()
        assert fake.flush_timeouts == [None, ENGINE.FLUSH_WAIT_S] and fake.calls[-2:] == [
            ("flush_cache", True), ("release_memory_occupation", ["kv_cache"])
        ]
        await engine.load_weights(own_state)
        await engine.set_version(1)
        await engine.resume_kv_cache()
        await engine.resume()
        assert (await engine.stats())["flushes_refused"] == 0 and fake.crashed is None
    finally:
        await engine.shutdown()


async def test_release_is_refused_when_sglang_does_not_become_idle(model_dir, own_state, prompt, monkeypatch):
    """A request in SGLang that this engine does not know of (another client of the same
    Engine) keeps its scheduler busy: the waiting flush times out and release_kv_cache raises
    instead of sending a release that SGLang's assertion would answer by ending its scheduler."""
    monkeypatch.setattr(ENGINE, "FLUSH_WAIT_S", 0.05)
    engine, fake = await started(model_dir, own_state, eos_id=-1)
    try:
        other = asyncio.ensure_future(
            fake.async_generate(input_ids=prompt, sampling_params={"max_new_tokens": 400}, rid="other-client")
        )
        while not fake.running:
            await asyncio.sleep(0.002)
        await engine.pause(abort=True)
        with pytest.raises(RuntimeError, match="not released"):
            await engine.release_kv_cache()
        assert fake.flush_timeouts == [0.05] and ("flush_cache", False) in fake.calls
        assert not [c for c in fake.calls if c[0] == "release_memory_occupation"] and fake.crashed is None
        assert (await engine.stats())["kv_released"] == 0.0
        fake.tokenizer_manager.abort_request(rid="other-client")
        await other
        await engine.resume()
    finally:
        await engine.shutdown()


async def test_colocated_release_weights_brings_them_back_before_loading(model_dir, own_state, prompt):
    engine, fake = await started(model_dir, own_state, release_weights=True)
    try:
        before = await engine.generate("a", prompt, greedy(8))
        await engine.pause(abort=False)  # what core's sleep_engines does
        await engine.release_kv_cache()
        assert (await engine.stats())["weights_released"] == 1.0
        assert fake.released == {"kv_cache", "weights"}
        await engine.pause(abort=True)
        await engine.release_kv_cache()  # already released: nothing
        await engine.load_weights(own_state)
        await engine.set_version(1)
        await engine.resume_kv_cache()
        await engine.resume()
        after = await engine.generate("b", prompt, greedy(8))
        assert after.token_ids == before.token_ids and fake.crashed is None
        mem = [c for c in fake.calls if "memory" in c[0]]
        assert mem == [
            ("release_memory_occupation", ["kv_cache", "weights"]),
            ("resume_memory_occupation", ["weights"]),
            ("resume_memory_occupation", ["kv_cache"]),
        ]
    finally:
        await engine.shutdown()


async def test_loading_other_weights_changes_output_and_old_weights_restore_it(model_dir, own_state, prompt):
    engine, _ = await started(model_dir, own_state)
    try:
        before = await engine.generate("a", prompt, greedy(12))
        await _update(engine, [(k, v * 1.5) for k, v in own_state], 4)
        after = await engine.generate("b", prompt, greedy(12))
        assert after.token_ids != before.token_ids and after.versions == [4] * len(after.token_ids)
        await _update(engine, own_state, 5)
        again = await engine.generate("c", prompt, greedy(12))
        assert again.token_ids == before.token_ids and again.log_probs == before.log_probs
    finally:
        await engine.shutdown()


def test_checkpoint_spec_reads_names_and_shapes(model_dir, own_state):
    spec = read_checkpoint_spec(model_dir)
    assert spec.vocab_size == VOCAB and spec.max_position_embeddings == 512 and spec.num_layers == 2
    for name, tensor in own_state:  # tied lm_head.weight included
        assert spec.shapes[name] == tuple(tensor.shape)
    name = next(n for n, _ in own_state if n.startswith("model.layers.0.mlp.up_proj"))
    tensor = dict(own_state)[name]
    assert check_bucket([(name.removeprefix("model."), tensor)], spec) == [(name, tensor)]


@pytest.mark.parametrize(
    "item, message",
    [
        (("model.nope.weight", torch.zeros(2)), "unknown parameter"),
        (("model.norm.weight", torch.zeros(3)), "shape"),
        (("model.norm.weight", [1.0]), "not a torch.Tensor"),
        (("model.norm.weight", torch.zeros(64, dtype=torch.int64)), "not floating point"),
        ("model.norm.weight", "not a (name, tensor) pair"),
    ],
)
async def test_bad_weights_raise_and_load_nothing(model_dir, own_state, prompt, item, message):
    engine, fake = await started(model_dir, own_state)
    try:
        before = await engine.generate("x", prompt, greedy(6))
        weights = dict(fake.weights)
        with pytest.raises(ValueError, match="nothing loaded") as err:
            await engine.load_weights([(own_state[0][0], own_state[0][1] * 3), item])
        assert message in str(err.value)
        assert fake.weights == weights and not [c for c in fake.calls if c[0] == "update_weights_from_tensor"]
        assert (await engine.generate("y", prompt, greedy(6))).token_ids == before.token_ids
    finally:
        await engine.shutdown()


async def test_radix_cache_hits_on_every_later_turn(model_dir, own_state, prompt):
    engine, fake = await started(model_dir, own_state)
    try:
        client = ServerClient(LocalRouter(["fake-0"]), {"fake-0": engine}, partial_rollout=True)
        turn_prompt, computed = list(prompt), 0
        for turn in range(3):
            out = await client.generate("session", turn_prompt, greedy(8))
            if turn:
                assert out.num_cached_prompt_tokens >= computed
            computed = len(turn_prompt) + len(out.token_ids)
            turn_prompt = turn_prompt + out.token_ids + [11, 12, 13]
        stats = await engine.stats()
        assert 0 < stats["prefix_cache_hit_rate"] <= 1
    finally:
        await engine.shutdown()


async def test_invalid_prompts_are_rejected_before_sglang(model_dir, own_state, prompt):
    engine, fake = await started(model_dir, own_state)
    try:
        with pytest.raises(ValueError, match="out of range"):
            await engine.generate("v", [1, VOCAB], greedy(2))
        with pytest.raises(ValueError, match="context"):
            await engine.generate("c", [5] * 512, greedy(2))
        with pytest.raises(ValueError, match="top_k"):
            await engine.generate("k", prompt, SamplingParams(max_tokens=2, top_k=0))
        with pytest.raises(ValueError, match="negative stop"):
            await engine.generate("s", prompt, greedy(2, stop_token_ids=[-3]))
        assert fake.generate_kwargs == [] and (await engine.stats())["num_requests"] == 0
    finally:
        await engine.shutdown()


async def test_prompts_and_budgets_follow_sglangs_request_limits(model_dir, own_state, prompt):
    """SGLang's scheduler aborts a prompt of max_req_input_len tokens or more (min(context - 1,
    KV pool - 1) - 5) and clips max_new_tokens: ferryman refuses such a prompt itself and asks
    for no more tokens than SGLang would give."""
    engine, fake = await started(model_dir, own_state, eos_id=-1, fake={"max_total_tokens": 100})
    try:
        assert fake.tokenizer_manager.max_req_input_len == 94 and engine.max_prompt == 94 and engine.max_context == 512
        with pytest.raises(ValueError, match="fewer than 94 tokens"):
            await engine.generate("long", [5] * 94, greedy(2))
        assert fake.generate_kwargs == []
        out = await engine.generate("fits", [5] * 90, greedy(50))
        assert fake.generate_kwargs[-1]["sampling_params"]["max_new_tokens"] == 4
        assert out.stop_reason == "length" and len(out.token_ids) == 4
        # what SGLang does with a prompt at the limit, sent past ferryman's check
        answer = await fake.async_generate(input_ids=[5] * 94, sampling_params={"max_new_tokens": 2}, rid="direct")
        assert answer["meta_info"]["finish_reason"]["type"] == "abort" and answer["output_ids"] == []
    finally:
        await engine.shutdown()


async def test_shutdown_answers_kept_and_running_calls(model_dir, own_state, prompt):
    engine, fake = await started(model_dir, own_state, eos_id=-1, pause_mode="keep")
    running = asyncio.ensure_future(engine.generate("run", prompt, greedy(300)))
    await _wait_tokens(fake, 5)
    await engine.pause(abort=True)  # "run" is held, waiting for resume
    await engine.shutdown()
    out = await asyncio.wait_for(running, 10)
    assert out.stop_reason == "aborted" and len(out.token_ids) >= 5 and fake.shut_down


async def test_starting_sglang_keeps_the_root_logger(model_dir, own_state):
    """SGLang's start runs logging.basicConfig(force=True) in this process (the fake too): the
    root logger's handlers (not closed) and level are as before; SGLang's own level is on the
    ``sglang`` logger."""
    import logging

    class Kept(logging.Handler):
        closed = False

        def emit(self, record):
            self.last = record.getMessage()

        def close(self):
            self.closed = True
            super().close()

    root, mine = logging.getLogger(), Kept()
    handlers, level, sglang_level = list(root.handlers), root.level, logging.getLogger("sglang").level
    root.addHandler(mine)
    root.setLevel(logging.INFO)
    try:
        engine, _ = await started(model_dir, own_state, log_level="error")
        assert root.handlers == handlers + [mine] and root.level == logging.INFO and not mine.closed
        assert logging.getLogger("sglang").level == logging.ERROR
        logging.getLogger("ferryman.somewhere").info("still here")
        assert mine.last == "still here"
        await engine.shutdown()
    finally:
        root.removeHandler(mine)
        root.setLevel(level)
        logging.getLogger("sglang").setLevel(sglang_level)


async def test_shutdown_kills_only_sglangs_own_processes(model_dir, own_state, prompt):
    """sglang.Engine.shutdown SIGKILLs every child of this process (the fake's shutdown too);
    the engine stops only the processes its SGLang started, with their children: another
    replica's scheduler, a child of this process started elsewhere, lives on."""
    import subprocess

    from ferryman.cluster.processes import process_tree
    from ferryman_engine_sglang.engine import _running

    sibling = subprocess.Popen(["sleep", "60"])
    (engine, fake), (other, other_fake) = [await started(model_dir, own_state) for _ in range(2)]
    try:
        await engine.generate("x", prompt, greedy(3))
        for _ in range(200):  # the "scheduler" and the child it starts
            own = process_tree(*fake.get_all_child_pids())
            if len(own) == 2:
                break
            await asyncio.sleep(0.01)
        assert len(own) == 2 and all(_running(p) for p in own)
        await engine.shutdown()
        assert not any(_running(p) for p in own) and fake.shut_down
        assert fake.tokenizer_manager._subprocess_watchdog.stopped
        assert sibling.poll() is None and not other_fake.shut_down
        assert (await other.generate("y", prompt, greedy(3))).stop_reason in ("stop", "length")
        other_fake.shutdown()  # what SGLang's own shutdown does: the sibling is killed too
        assert sibling.wait(5) == -9
    finally:
        sibling.kill()
        sibling.wait()
        await other.shutdown()


def test_engine_requires_start():
    engine = SGLangEngine(SGLangEngineConfig(), model_path="/nowhere")
    with pytest.raises(RuntimeError, match="start"):
        asyncio.run(engine.generate("x", [1], SamplingParams()))


def test_ferryman_config_validates_an_sglang_run_without_sglang(capsys):
    """``ferryman config`` on the README's example with ``engine.type=sglang`` (the plugin found
    through its entry point; SGLang is not imported)."""
    from pathlib import Path

    from ferryman.cli import main

    example = Path(__file__).resolve().parents[3] / "examples" / "tiny_digits.yaml"
    assert main(["config", str(example), "engine.type=sglang", "engine.pause_mode=keep"]) == 0
    assert "sglang" in capsys.readouterr().out
    assert main(["config", str(example), "engine.type=sglang", "engine.pause_mode=freeze"]) != 0


async def test_weights_through_the_nccl_transport(model_dir, own_state, prompt):
    """The ``nccl`` weight sync (over gloo here): its receiver, beside each replica, hands the
    buckets (views of its receive buffer) to the engine's load_weights, which passes them to
    SGLang's update_weights_from_tensor; both replicas end with the sent weights."""
    sync_nccl = pytest.importorskip("ferryman_sync_nccl")
    from ferryman.engine_host import EngineHandle
    from ferryman.plugins import PluginHost
    from ferryman_sync_nccl import hooks as nccl_hooks

    host = PluginHost(load_entry_points=False, extra_plugins=(nccl_hooks,))
    pairs = [await started(model_dir, own_state) for _ in range(2)]
    handles = [EngineHandle(f"replica-{i}", engine=e, plugin_host=host) for i, (e, _) in enumerate(pairs)]
    transport = sync_nccl.NcclSync(sync_nccl.NcclSyncConfig(backend="gloo", timeout_s=20, bucket_megabytes=0.25))
    try:
        before = await pairs[0][0].generate("a", prompt, greedy(10))
        other = [(k, v * 1.5) for k, v in own_state]
        for version, weights in ((1, other), (2, own_state)):
            for h in handles:
                await h.pause(True)
                await h.release_kv_cache()
            metrics = await transport.transfer(iter([weights[i : i + 3] for i in range(0, len(weights), 3)]), handles, version)
            assert metrics["sync/buckets"] >= 2
            for h in handles:
                await h.set_version(version)
                await h.resume_kv_cache()
                await h.resume()
            outs = [await e.generate(f"v{version}", prompt, greedy(10)) for e, _ in pairs]
            assert outs[0].token_ids == outs[1].token_ids and outs[0].versions == [version] * len(outs[0].token_ids)
            for _, fake in pairs:
                assert fake.weights == pytest.approx(checksums(weights), rel=1e-6)
                assert fake.crashed is None
            if version == 1:
                assert outs[0].token_ids != before.token_ids
            else:
                assert outs[0].token_ids == before.token_ids
    finally:
        transport.close()
        for h in handles:
            await h.shutdown()


async def test_abort_before_anything_was_sent_sends_nothing(model_dir, own_state, prompt):
    engine, fake = await started(model_dir, own_state)
    try:
        tasks = [asyncio.ensure_future(engine.generate(f"n{i}", prompt, greedy(8))) for i in range(4)]
        await asyncio.sleep(0)  # the calls are in, their SGLang calls not yet made
        await engine.pause(abort=True)
        outs = await asyncio.gather(*tasks)
        assert [o.stop_reason for o in outs] == ["aborted"] * 4 and all(o.token_ids == [] for o in outs)
        assert fake.generate_kwargs == [] and (await engine.stats())["num_aborted"] == 4
        await engine.resume()
    finally:
        await engine.shutdown()


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_ferryman_train_names_the_missing_extra_before_starting():
    from ferryman.config import missing_requirements

    (line,) = missing_requirements({"engine": SGLangEngineConfig()})
    assert "'sglang'" in line and "--extra sglang" in line
