"""The vllm engine's own logic on CPU, over FakeVLLMCore (a named test double: vLLM needs a
GPU). The same engine over real vLLM is tested by test_gpu.py on a GPU machine."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from ferryman.client import ServerClient  # noqa: E402
from ferryman.defaults.router import LocalRouter  # noqa: E402
from ferryman.testing.engine_contract import EngineContract  # noqa: E402
from ferryman.tiny import build_tiny_model  # noqa: E402
from ferryman.types import SamplingParams  # noqa: E402
from ferryman_engine_vllm.config import VLLMEngineConfig  # noqa: E402
from ferryman_engine_vllm.cores import delta_from_output  # noqa: E402
from ferryman_engine_vllm.engine import VLLMEngine, _Request, make_vllm_engine  # noqa: E402
from ferryman_engine_vllm.testing import FakeVLLMCore  # noqa: E402
from ferryman.engine_checks import check_bucket, read_checkpoint_spec  # noqa: E402
from ferryman_engine_vllm.worker import decode_item, encode_bucket  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-engine-vllm", init_std=0.2)


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


async def started(model_dir, own_state, eos_id=2, final_only=False, **cfg):
    cores = []

    def factory(on_delta, on_error):
        core = FakeVLLMCore(on_delta, on_error, vocab_size=160, initial_weights=checksums(own_state), eos_id=eos_id,
                            final_only=final_only)
        cores.append(core)
        return core

    engine = make_vllm_engine(VLLMEngineConfig(**cfg), model_path=str(model_dir), replica="fake-0", core_factory=factory)
    await engine.start()
    return engine, cores[0]


class TestVLLMEngineLogicContract(EngineContract):
    """The engine contract, vLLM replaced by the test double."""

    @pytest.fixture
    async def engine(self, model_dir, own_state):
        engine, _ = await started(model_dir, own_state)
        yield engine
        await engine.shutdown()

    @pytest.fixture
    def prompt_ids(self, prompt):
        return prompt

    @pytest.fixture
    def own_weights(self, own_state):
        return own_state


# ---------------------------------------------------------------------- config and plugin


def test_config_defaults_map_to_engine_args():
    args = VLLMEngineConfig().engine_args(model_path="/m", seed=3)
    assert args["model"] == "/m" and args["seed"] == 3
    assert args["enable_prefix_caching"] is True
    assert args["logprobs_mode"] == "processed_logprobs"
    assert args["worker_extension_cls"] == "ferryman_engine_vllm.worker.FerrymanWorkerExtension"
    assert args["skip_tokenizer_init"] is True
    assert "enable_return_routed_experts" not in args
    assert "async_scheduling" not in args  # vLLM's own default (on where supported), either core
    assert VLLMEngineConfig(async_scheduling=False).engine_args(model_path="/m", seed=0)["async_scheduling"] is False
    assert VLLMEngineConfig(async_scheduling=True).engine_args(model_path="/m", seed=0)["async_scheduling"] is True
    args = VLLMEngineConfig(return_routed_experts=True, kv_cache_memory_bytes=2**30, engine_kwargs={"block_size": 32}).engine_args(
        model_path="/m", seed=0
    )
    assert args["enable_return_routed_experts"] is True
    assert args["kv_cache_memory_bytes"] == 2**30 and args["block_size"] == 32


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"pause_mode": "freeze"}, "pause_mode"),
        ({"core": "ray"}, "core"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"engine_kwargs": {"enable_prefix_caching": False}}, "engine_kwargs"),
        ({"engine_kwargs": {"async_scheduling": True}}, "engine_kwargs"),
        ({"async_scheduling": "sometimes"}, "async_scheduling"),
        ({"core": "process", "step_delay_s": 0.01}, "step_delay_s"),
        ({"sleep_level": 3}, "sleep_level"),
    ],
)
def test_bad_config_names_the_field(bad, field):
    from ferryman.config import ConfigError, validate_plugin_section
    from ferryman.plugins import PluginHost
    from ferryman_engine_vllm import hooks

    host = PluginHost(load_entry_points=False, extra_plugins=(hooks,))
    with pytest.raises(ConfigError, match=field):
        validate_plugin_section(host, "engine", "engine", {"type": "vllm", **bad})


def test_hook_registers_the_vllm_engine():
    from ferryman_engine_vllm import hooks

    (spec,) = hooks.ferryman_register_engines()
    assert spec.name == "vllm" and spec.config_cls is VLLMEngineConfig and spec.factory is make_vllm_engine


# ---------------------------------------------------------------------- weights


def test_checkpoint_spec_reads_names_and_shapes(model_dir, own_state):
    spec = read_checkpoint_spec(model_dir)
    assert spec.vocab_size == 160 and spec.max_position_embeddings == 512
    for name, tensor in own_state:  # tied lm_head.weight included
        assert spec.shapes[name] == tuple(tensor.shape)
    # a name without the leading "model." resolves to the checkpoint's
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
    engine, core = await started(model_dir, own_state)
    try:
        before = dict(core.weights)
        good = own_state[0]
        with pytest.raises(ValueError, match="nothing loaded") as err:
            await engine.load_weights([good, item])
        assert message in str(err.value)
        assert core.weights == before
        assert not [c for c in core.calls if c[0] == "load_weights"]
    finally:
        await engine.shutdown()


def test_bucket_encoding_round_trip():
    pairs = [
        ("a", torch.randn(3, 4, dtype=torch.bfloat16)),
        ("b", torch.randn(5)),
        ("c", torch.zeros(0, 2)),
        ("d", torch.randn(4, 4)[:, 1]),  # not contiguous
    ]
    for (name, tensor), item in zip(pairs, encode_bucket(pairs)):
        got_name, got = decode_item(item)
        assert got_name == name and got.dtype == tensor.dtype and torch.equal(got, tensor)
    assert decode_item(pairs[0])[1] is pairs[0][1]  # in-process pairs pass through


def test_delta_from_vllm_output_shape():
    """The conversion of vLLM's RequestOutput (attribute layout of vllm.outputs, built here)."""
    lp = SimpleNamespace
    comp = SimpleNamespace(
        token_ids=[5, 9],
        logprobs=[{1: lp(logprob=-0.1)}, {5: lp(logprob=-0.5)}, {9: lp(logprob=-0.25), 3: lp(logprob=-2.0)}],
        finish_reason=None,
        routed_experts=None,
    )
    out = SimpleNamespace(outputs=[comp], finished=False, num_cached_tokens=16)
    d = delta_from_output(out)
    assert d.token_ids == [5, 9] and d.log_probs == [-0.5, -0.25] and d.finish_reason is None and d.num_cached_tokens == 16
    comp.finish_reason, out.finished = "length", True
    assert delta_from_output(out).finish_reason == "length"
    comp.finish_reason = None  # finished without a reason: vLLM's abort output
    assert delta_from_output(out).finish_reason == "abort"
    comp.logprobs = None
    with pytest.raises(RuntimeError, match="log-probs"):
        delta_from_output(out)


def test_routed_experts_of_the_last_output_are_the_whole_sequence():
    """vLLM 0.24 sets CompletionOutput.routed_experts only with the last output: the prompt's
    routing and one position per decode step ([prompt + generated - 1, layers, top_k])."""
    import numpy as np

    from ferryman_engine_vllm.cores import Delta

    lp = SimpleNamespace
    prompt, gen = 4, [5, 9, 2]
    routed = np.arange((prompt + len(gen) - 1) * 2 * 2, dtype=np.int32).reshape(-1, 2, 2)
    comp = SimpleNamespace(token_ids=[2], logprobs=[{2: lp(logprob=-0.3)}], finish_reason="stop", routed_experts=routed)
    d = delta_from_output(SimpleNamespace(outputs=[comp], finished=True, num_cached_tokens=0))
    assert d.routed_experts == routed.tolist() and len(d.routed_experts) == prompt + len(gen) - 1
    # the engine keeps the latest list whole (never appends): a later list replaces it
    engine = VLLMEngine(VLLMEngineConfig(), model_path="unused")
    loop = asyncio.new_event_loop()
    try:
        req = _Request("r", "r", prompt, loop.create_future())
        engine._requests["r"] = req
        engine._on_delta("r", Delta([5], [-0.1], routed_experts=[[[0, 1], [0, 1]]]))
        engine._on_delta("r", Delta([9, 2], [-0.2, -0.3], "stop", routed_experts=d.routed_experts))
        out = req.future.result()
    finally:
        loop.close()
    assert out.token_ids == gen and out.routed_experts == routed.tolist()


# ---------------------------------------------------------------------- engine logic


async def test_release_and_resume_kv_cache_sleep_and_wake_in_order(model_dir, own_state, prompt):
    engine, core = await started(model_dir, own_state, sleep_level=2)
    try:
        before = await engine.generate("a", prompt, SamplingParams(max_tokens=8, temperature=0))
        await engine.pause(abort=False)
        await engine.release_kv_cache()
        assert (await engine.stats())["kv_released"] == 1.0
        await engine.load_weights(own_state)  # level 2: every parameter must come back
        await engine.set_version(1)
        await engine.resume_kv_cache()
        await engine.resume()
        after = await engine.generate("b", prompt, SamplingParams(max_tokens=8, temperature=0))
        assert after.token_ids == before.token_ids and after.versions == [1] * len(after.token_ids)
        kinds = [c for c in core.calls if c[0] in ("sleep", "wake_up", "load_weights", "reset_prefix_cache")]
        assert kinds[0] == ("sleep", 2) and kinds[1] == ("wake_up", ["weights"])
        assert kinds[2][0] == "load_weights" and kinds[3] == ("reset_prefix_cache", False)
        assert kinds[4] == ("wake_up", ["kv_cache"])
    finally:
        await engine.shutdown()


async def test_loading_other_weights_changes_output_and_stamps(model_dir, own_state, prompt):
    engine, _ = await started(model_dir, own_state)
    try:
        greedy = SamplingParams(max_tokens=12, temperature=0)
        before = await engine.generate("a", prompt, greedy)
        await engine.pause(abort=True)
        await engine.release_kv_cache()
        await engine.load_weights([(k, v * 1.5) for k, v in own_state])
        await engine.set_version(4)
        await engine.resume_kv_cache()
        await engine.resume()
        after = await engine.generate("b", prompt, greedy)
        assert after.token_ids != before.token_ids and after.versions == [4] * len(after.token_ids)
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("final_only", [False, True], ids=["streamed", "final-only"])
async def test_partial_rollout_round_trip_matches_uninterrupted(model_dir, own_state, prompt, final_only):
    """abort mid-generation, resume through the server client: the same greedy tokens, the
    resumed piece served from the prefix cache, versions recording the update; the same when
    the core reports a request only when it ends (the abort hands over its tokens so far)."""
    engine, core = await started(model_dir, own_state, eos_id=-1, final_only=final_only)  # no EOS: the whole budget
    try:
        greedy = SamplingParams(max_tokens=48, temperature=0)
        ref = await engine.generate("ref", prompt, greedy)
        assert ref.stop_reason == "length"
        client = ServerClient(LocalRouter(["fake-0"]), {"fake-0": engine}, partial_rollout=True)
        task = asyncio.ensure_future(client.generate("traj", prompt, greedy))
        while (await engine.stats())["in_flight_tokens"] < 10:
            await asyncio.sleep(0.002)
        await engine.pause(abort=True)
        await engine.set_version(1)
        await engine.resume()
        out = await asyncio.wait_for(task, 30)
        assert out.token_ids == ref.token_ids and out.log_probs == ref.log_probs
        assert out.num_aborts == 1 and out.stop_reason == "length"
        assert out.versions[0] == 0 and out.versions[-1] == 1 and sorted(out.versions) == out.versions
        assert (await engine.stats())["prefix_cache_hit_tokens"] >= len(prompt)
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("final_only", [False, True], ids=["streamed", "final-only"])
async def test_keep_mode_freezes_and_continues_in_the_same_call(model_dir, own_state, prompt, final_only):
    """the tokens made before the update carry the old version, those after it the new one,
    whether the core streams them or hands them over once at the end (then ``freeze`` tells
    how many the old weights made)"""
    engine, core = await started(model_dir, own_state, eos_id=-1, pause_mode="keep", final_only=final_only)
    try:
        greedy = SamplingParams(max_tokens=40, temperature=0)
        task = asyncio.ensure_future(engine.generate("kept", prompt, greedy))
        while (await engine.stats())["in_flight_tokens"] < 10:
            await asyncio.sleep(0.002)
        await engine.pause(abort=True)
        frozen_at = len(core.requests["kept#0"].tokens)
        await asyncio.sleep(0.05)
        assert not task.done() and len(core.requests["kept#0"].tokens) == frozen_at
        await engine.release_kv_cache()  # frozen requests keep their KV: no sleep
        await engine.load_weights([(k, v * 1.5) for k, v in own_state])
        await engine.set_version(1)
        await engine.resume_kv_cache()
        await engine.resume()
        out = await asyncio.wait_for(task, 30)
        assert out.stop_reason == "length" and len(out.token_ids) == 40 and out.num_aborts == 0
        assert out.versions == [0] * frozen_at + [1] * (40 - frozen_at) and 10 <= frozen_at < 40
        assert ("sleep", 1) not in core.calls
        assert ("reset_prefix_cache", True) in core.calls  # frozen KV recomputed with new weights
        assert (await engine.stats())["num_aborted"] == 0
    finally:
        await engine.shutdown()


async def test_cancelled_call_is_aborted_in_vllm(model_dir, own_state, prompt):
    engine, core = await started(model_dir, own_state)
    try:
        task = asyncio.ensure_future(engine.generate("gone", prompt, SamplingParams(max_tokens=64, temperature=0)))
        while not core.requests:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ("abort", ["gone#0"]) in core.calls and not core.requests
        assert (await engine.stats())["in_flight"] == 0
    finally:
        await engine.shutdown()


async def test_core_error_reaches_the_caller(model_dir, own_state, prompt):
    engine, core = await started(model_dir, own_state)
    try:
        core.asleep = {"kv_cache"}  # what vLLM would do with no KV cache: fail the request
        with pytest.raises(RuntimeError, match="asleep"):
            await engine.generate("x", prompt, SamplingParams(max_tokens=4, temperature=0))
        core.asleep = set()
        out = await engine.generate("y", prompt, SamplingParams(max_tokens=4, temperature=0))
        assert len(out.token_ids) >= 1
    finally:
        await engine.shutdown()


async def test_prompt_beyond_vocab_or_context_is_rejected(model_dir, own_state, prompt):
    engine, core = await started(model_dir, own_state)
    try:
        with pytest.raises(ValueError, match="out of range"):
            await engine.generate("v", [1, 160], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="context"):
            await engine.generate("c", [5] * 512, SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="top_k"):
            await engine.generate("k", prompt, SamplingParams(max_tokens=2, top_k=0))
        assert not core.requests and (await engine.stats())["num_requests"] == 0
    finally:
        await engine.shutdown()


def test_engine_requires_start():
    engine = VLLMEngine(VLLMEngineConfig(), model_path="/nowhere")
    with pytest.raises(RuntimeError, match="start"):
        asyncio.run(engine.generate("x", [1], SamplingParams()))


# ---------------------------------------------------------------------- install


def test_workspace_lists_the_plugin_and_validates_without_vllm():
    """The plugin is a workspace member: found through its entry point, its config validates
    whether or not vLLM is installed (vLLM is the ``vllm`` extra)."""
    from ferryman.config import validate_plugin_section
    from ferryman.plugins import PluginHost

    host = PluginHost()
    assert "vllm" in host.specs("engine")
    assert host.owner("engine", "vllm").distribution == "ferryman-engine-vllm"
    cfg = validate_plugin_section(host, "engine", "engine", {"type": "vllm", "gpu_memory_utilization": 0.3})
    assert cfg.gpu_memory_utilization == 0.3


def test_missing_vllm_is_one_line_naming_the_extra(monkeypatch, model_dir):
    """Without vLLM, creating the engine (or starting a run that uses it) fails with one
    line that says how to install it, before anything starts."""
    import importlib.util

    from ferryman.config import missing_requirements
    from ferryman.plugins import PluginError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    import ferryman_engine_vllm.engine as engine_mod

    monkeypatch.setattr(engine_mod, "find_spec", importlib.util.find_spec)
    lines = missing_requirements({"engine": VLLMEngineConfig(), "trainer": None})
    assert len(lines) == 1 and "engine.type 'vllm' needs 'vllm'" in lines[0] and "--extra vllm" in lines[0]
    with pytest.raises(PluginError, match=r"uv sync --extra vllm") as e:
        make_vllm_engine(VLLMEngineConfig(), model_path=str(model_dir))
    assert "\n" not in str(e.value)
