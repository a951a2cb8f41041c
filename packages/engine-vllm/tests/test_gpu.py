"""The vllm engine over real vLLM on a GPU (marked ``gpu``; never run in CI).

Run on a machine with an NVIDIA GPU and vLLM 0.24 installed::

    pytest -m gpu packages/engine-vllm/tests/test_gpu.py

``FERRYMAN_VLLM_TEST_ASYNC=1`` / ``=0`` runs them with ``async_scheduling: true`` / ``false``
(unset: the default, vLLM's own, which is on).
``FERRYMAN_VLLM_TEST_CORES`` picks the cores (``thread``, ``process`` or ``thread,process``;
default ``thread``). One engine per core is started for the whole module (a vLLM start takes
many seconds); tests leave it resumed, at its own weights, in ``abort`` pause mode.

The model is a tiny random Qwen2 built on the spot, in float32: batched and single runs of
vLLM agree to 1e-3 in log-prob, and transformers on the same GPU gives the same greedy tokens.
Their log-probs differ by up to about 1e-2 (other kernels: Triton attention, fused RMSNorm and
SiLU; the random weights give large logits), hence ``REF_ATOL`` for comparisons with it.
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest

pytest.importorskip("vllm")
pytest_asyncio = pytest.importorskip("pytest_asyncio")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ferryman.client import ServerClient  # noqa: E402
from ferryman.defaults.router import LocalRouter  # noqa: E402
from ferryman.testing.engine_contract import EngineContract  # noqa: E402
from ferryman.tiny import build_tiny_model  # noqa: E402
from ferryman.types import SamplingParams  # noqa: E402
from ferryman_engine_vllm.config import VLLMEngineConfig  # noqa: E402
from ferryman_engine_vllm.engine import make_vllm_engine  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CORES = [c.strip() for c in os.environ.get("FERRYMAN_VLLM_TEST_CORES", "thread").split(",") if c.strip()]
ATOL = 1e-3
"""vLLM against itself (batched vs alone, before vs after an abort)."""
REF_ATOL = 2e-2
"""vLLM against a plain transformers forward loop (other kernels, same fp32 weights)."""
NEAR_TIE = 5e-2
"""A token counts as transformers' greedy choice when its log-prob is this close to the top."""
KV_BYTES = 512 * 2**20
TINY = dict(hidden_size=128, num_heads=2, num_kv_heads=1, num_layers=2, init_std=0.2)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-vllm-gpu", **TINY)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-vllm-gpu-seed1", seed=1, **TINY)


def _state(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return [(k, v.detach().clone()) for k, v in model.state_dict().items()]


@pytest.fixture(scope="module")
def own_weights(model_dir):
    return _state(model_dir)


@pytest.fixture(scope="module")
def other_weights(other_dir):
    return _state(other_dir)


@pytest.fixture(scope="module")
def hf_models(model_dir, other_dir):
    load = lambda p: transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).cuda().eval()  # noqa: E731
    return {"own": load(model_dir), "other": load(other_dir)}


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and log-probs by full forwards (no cache, no batching)."""
    seq, tokens, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([seq], device="cuda")).logits[0, -1].float()
            t = int(torch.argmax(logits))
            tokens.append(t)
            lps.append(float(torch.log_softmax(logits, -1)[t]))
            seq.append(t)
            if t == 2:
                break
    return tokens, lps


def hf_log_probs(model, seq: list[int]):
    """Log-softmax at every position of one teacher-forced forward ([len(seq), vocab])."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq], device="cuda")).logits[0].float()
    return torch.log_softmax(logits, -1)


@pytest.fixture(scope="module")
def tok(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def chat(tok):
    def render(text: str) -> list[int]:
        msgs = [{"role": "user", "content": text}]
        return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))

    return render


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=CORES)
async def vllm_engine(request, model_dir):
    core = request.param
    cfg = VLLMEngineConfig(
        core=core,
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        kv_cache_memory_bytes=KV_BYTES,
        max_num_seqs=64,
        # a few ms per step keeps the abort tests deterministic (thread core only)
        step_delay_s=0.003 if core == "thread" else 0.0,
        # FERRYMAN_VLLM_TEST_ASYNC=1 / 0: vLLM's async scheduling on / off (unset: the default)
        async_scheduling={"1": True, "0": False}.get(os.environ.get("FERRYMAN_VLLM_TEST_ASYNC", "")),
    )
    engine = make_vllm_engine(cfg, model_path=str(model_dir), replica=f"gpu-{core}", seed=0)
    await engine.start()
    yield engine
    await engine.shutdown()


@pytest_asyncio.fixture(loop_scope="module", autouse=True)
async def _leave_engine_ready(request):
    yield
    if "vllm_engine" in request.fixturenames:
        engine = request.getfixturevalue("vllm_engine")
        engine.config.pause_mode = "abort"
        await engine.resume()


async def _update(engine, weights, version: int, *, buckets: int = 2) -> None:
    """The weight-sync sequence of ferryman.sync, with the weights in several buckets."""
    await engine.pause(abort=True)
    await engine.release_kv_cache()
    size = max(1, len(weights) // buckets)
    for i in range(0, len(weights), size):
        await engine.load_weights(weights[i : i + size])
    await engine.set_version(version)
    await engine.resume_kv_cache()
    await engine.resume()


async def _long_prompt(engine, chat, n: int) -> tuple[list[int], object]:
    """A prompt whose greedy continuation uses the whole budget of ``n`` tokens."""
    rng = random.Random(0)
    for i in range(40):
        prompt = chat(" ".join(rng.choice(["Repeat", "the", "digit", "7", "sum", "plus", "now"]) for _ in range(6)))
        ref = await engine.generate(f"long-{i}", prompt, greedy(n))
        if ref.stop_reason == "length":
            return prompt, ref
    pytest.skip("no prompt found whose greedy continuation avoids EOS")


class TestVLLMContract(EngineContract):
    log_prob_atol = ATOL

    @pytest.fixture
    def engine(self, vllm_engine):
        return vllm_engine

    @pytest.fixture
    def prompt_ids(self, chat):
        return chat("Repeat the digit 7.")

    @pytest.fixture
    def own_weights(self, own_weights):
        return own_weights


async def test_matches_transformers_reference(vllm_engine, chat, hf_models):
    """Token ids and log-probs equal a plain transformers forward loop on the same GPU."""
    prompts = [chat("Repeat the digit 7."), chat("What is 3 plus 4?"), [5, 6, 7]]
    outs = await asyncio.gather(*[vllm_engine.generate(f"ref-{i}", p, greedy(16)) for i, p in enumerate(prompts)])
    for p, out in zip(prompts, outs):
        tokens, lps = hf_greedy(hf_models["own"], p, 16)
        assert out.token_ids == tokens
        assert max(abs(a - b) for a, b in zip(out.log_probs, lps)) <= REF_ATOL


async def test_partial_rollout_round_trip_same_tokens(vllm_engine, chat):
    """A greedy generation aborted by a sync and resumed by the server client (prompt + tokens
    so far, same request id) gives the tokens of an uninterrupted run; the resumed piece is
    served from the prefix cache and its tokens carry the new version."""
    engine = vllm_engine
    prompt, ref = await _long_prompt(engine, chat, 96)
    client = ServerClient(LocalRouter([engine.replica]), {engine.replica: engine}, partial_rollout=True)
    v0 = await engine.get_version()
    hits0 = (await engine.stats())["prefix_cache_hit_tokens"]
    task = asyncio.ensure_future(client.generate("round-trip", prompt, greedy(96)))
    while (await engine.stats())["in_flight_tokens"] < 40:
        await asyncio.sleep(0.001)
    await engine.pause(abort=True)
    await engine.set_version(v0 + 1)
    await engine.resume()
    out = await asyncio.wait_for(task, 120)
    await client.drain()
    assert out.token_ids == ref.token_ids
    assert max(abs(a - b) for a, b in zip(out.log_probs, ref.log_probs)) <= ATOL
    assert out.num_aborts == 1 and out.stop_reason == "length"
    k = out.versions.index(v0 + 1)
    assert 40 <= k < 96 and out.versions == [v0] * k + [v0 + 1] * (96 - k)
    # the resend of prompt + k tokens reused the KV of all full blocks of what was computed
    assert (await engine.stats())["prefix_cache_hit_tokens"] - hits0 >= (len(prompt) + k - 1) // 16 * 16 - 16


async def test_weight_load_changes_outputs_and_version(vllm_engine, chat, own_weights, other_weights, hf_models):
    engine = vllm_engine
    prompt = chat("Write the digit 2. Now the digit 5.")
    before = await engine.generate("w-before", prompt, greedy(16))
    v = await engine.get_version()
    free0 = torch.cuda.mem_get_info()[0]
    await engine.pause(abort=True)
    await engine.release_kv_cache()
    freed = torch.cuda.mem_get_info()[0] - free0
    assert freed >= KV_BYTES // 2, f"release_kv_cache freed {freed} bytes"
    for i in range(0, len(other_weights), 4):
        await engine.load_weights(other_weights[i : i + 4])
    await engine.set_version(v + 1)
    await engine.resume_kv_cache()
    await engine.resume()
    after = await engine.generate("w-after", prompt, greedy(16))
    assert after.token_ids != before.token_ids
    assert after.versions == [v + 1] * len(after.token_ids)
    tokens, lps = hf_greedy(hf_models["other"], prompt, 16)
    assert after.token_ids == tokens, "vLLM with the loaded weights differs from the other model"
    assert max(abs(a - b) for a, b in zip(after.log_probs, lps)) <= REF_ATOL
    await _update(engine, own_weights, v + 2)
    again = await engine.generate("w-again", prompt, greedy(16))
    assert again.token_ids == before.token_ids and again.versions == [v + 2] * len(again.token_ids)


async def test_bad_weights_change_nothing(vllm_engine, chat, own_weights):
    engine = vllm_engine
    prompt = chat("Say 3.")
    before = await engine.generate("bad-before", prompt, greedy(8))
    name, tensor = own_weights[1]
    with pytest.raises(ValueError, match="nothing loaded"):
        await engine.load_weights([(own_weights[0][0], own_weights[0][1] * 3), (name, tensor[:1])])
    with pytest.raises(ValueError, match="unknown parameter"):
        await engine.load_weights([("model.layers.0.not_a_weight", tensor)])
    after = await engine.generate("bad-after", prompt, greedy(8))
    assert after.token_ids == before.token_ids


async def test_prefix_cache_hits_on_a_multi_turn_session(vllm_engine, tok, chat):
    """An agent session (three turns, one request id) stays on its replica; every turn after
    the first prefills only what is new."""
    engine = vllm_engine
    client = ServerClient(LocalRouter([engine.replica]), {engine.replica: engine}, partial_rollout=True)
    hits0 = (await engine.stats())["prefix_cache_hit_tokens"]
    prompt = chat("Repeat the digit 7. Then add 3 plus 4 and say the result.")
    computed = 0
    for turn in range(3):
        out = await client.generate("session-1", prompt, greedy(24))
        assert out.replica == engine.replica
        if turn:
            assert out.num_cached_prompt_tokens > 0
            assert out.num_cached_prompt_tokens >= computed // 16 * 16 - 16
        computed = len(prompt) + len(out.token_ids) - 1
        user = tok.encode("<|im_end|>\n<|im_start|>user\nNow the digit 9.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        prompt = prompt + out.token_ids + user
    await client.drain()
    stats = await engine.stats()
    assert stats["prefix_cache_hit_tokens"] - hits0 >= 32
    assert 0 < stats["prefix_cache_hit_rate"] <= 1


async def test_keep_mode_freezes_requests_through_a_weight_update(vllm_engine, chat, own_weights, other_weights, hf_models):
    """pause_mode keep: the in-flight call is frozen inside vLLM, continues after the update in
    the same generate() call, and its later tokens are those of the new weights (its KV is
    recomputed with them)."""
    engine = vllm_engine
    prompt, ref = await _long_prompt(engine, chat, 96)
    engine.config.pause_mode = "keep"
    v = await engine.get_version()
    task = asyncio.ensure_future(engine.generate("kept", prompt, greedy(96)))
    while (await engine.stats())["in_flight_tokens"] < 30:
        await asyncio.sleep(0.001)
    await engine.pause(abort=True)
    assert (await engine.stats())["in_flight"] == 1
    await asyncio.sleep(0.2)
    assert not task.done()
    await engine.release_kv_cache()  # kept: the frozen request needs its KV
    for i in range(0, len(other_weights), 4):
        await engine.load_weights(other_weights[i : i + 4])
    await engine.set_version(v + 1)
    await engine.resume_kv_cache()
    await engine.resume()
    out = await asyncio.wait_for(task, 120)
    assert out.stop_reason in ("length", "stop") and out.num_aborts == 0
    k = out.versions.index(v + 1)
    assert k >= 30 and out.versions == [v] * k + [v + 1] * (len(out.versions) - k)
    assert out.token_ids[:k] == ref.token_ids[:k]
    # the tokens after the update are greedy choices of the NEW weights (teacher-forced check
    # with transformers, up to near-ties) ...
    lp = hf_log_probs(hf_models["other"], prompt + out.token_ids)
    for i in range(k, min(k + 8, len(out.token_ids))):
        row = lp[len(prompt) + i - 1]
        assert float(row[out.token_ids[i]]) >= float(row.max()) - NEAR_TIE, f"token {i} is not a greedy choice of the new weights"
    # ... and equal to what vLLM computes from scratch for the same context with the new weights
    engine.config.pause_mode = "abort"
    await engine.pause(abort=False)
    await engine.release_kv_cache()  # sleep drops the prefix cache: nothing below is reused
    await engine.resume_kv_cache()
    await engine.resume()
    fresh = await engine.generate("kept-fresh", prompt + out.token_ids[:k], greedy(8))
    assert fresh.token_ids == out.token_ids[k : k + len(fresh.token_ids)]
    await _update(engine, own_weights, v + 2)
