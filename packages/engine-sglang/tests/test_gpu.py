"""The sglang engine over real SGLang on a GPU (marked ``gpu``; never run in CI).

Run on a machine with an NVIDIA GPU and SGLang 0.5.11-0.5.17 installed (see
``tools/gpu_tests.sh``)::

    pytest -m gpu packages/engine-sglang/tests/test_gpu.py

One engine is started for the whole module (an SGLang start takes many seconds); tests leave
it resumed, at its own weights, in ``abort`` pause mode.

The model is a tiny random Qwen2 built on the spot, served in bfloat16 (SGLang's RMSNorm
kernels take fp16/bf16 only) with ``deterministic: true`` (SGLang's batch-invariant kernels)
and SGLang's Triton attention and PyTorch sampling backends (no FlashInfer JIT needed; override
with ``FERRYMAN_SGLANG_TEST_ATTENTION``). Greedy tokens of SGLang against itself (batched vs
alone, before vs after an abort, a reload of the same weights) are compared exactly, log-probs
to ``ATOL``; against transformers (other kernels) the check is teacher-forced on SGLang's
tokens: each is the reference's greedy choice up to ``REF_ATOL`` of logit (a bf16 near-tie may
go either way) and its log-prob is within ``REF_ATOL``. See the tolerances for the reasoning.
Not yet run on a GPU in this form.
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest

pytest.importorskip("sglang")
pytest_asyncio = pytest.importorskip("pytest_asyncio")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ferryman.client import ServerClient  # noqa: E402
from ferryman.defaults.router import LocalRouter  # noqa: E402
from ferryman.testing.engine_contract import EngineContract  # noqa: E402
from ferryman.tiny import build_tiny_model  # noqa: E402
from ferryman.types import SamplingParams  # noqa: E402
from ferryman_engine_sglang.config import SGLangEngineConfig  # noqa: E402
from ferryman_engine_sglang.engine import make_sglang_engine  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Tolerances for bfloat16. bf16 keeps 8 significant bits: one ulp is 2**-7 relative, 2**-5 =
# 0.031 for values in [4, 8). This model's logits have a spread of about sqrt(hidden_size) *
# init_std = 2.3, so the largest of its vocabulary reach 6-8. A log-prob is logit - logsumexp:
# a computation that rounds differently moves each by up to about an ulp of the largest logit,
# the two together 2 ulps = 0.0625, and as much again from the two layers' activations before
# them; errors of that size are what bf16 allows, a bug (another position's, another
# temperature's, another model's log-prob) is off by far more (tenths to units).
ATOL = 0.125
"""SGLang against itself. With ``deterministic`` the kernels are batch-invariant (batched and
alone agree bit for bit), but a resumed piece computes its first position in a prefill over
cached KV where the uninterrupted run decoded it: 4 ulps at [4, 8) (see above)."""
REF_ATOL = 0.25
"""SGLang against transformers: other kernels at every layer (attention, fused RMSNorm, bf16
GEMMs), so twice the self-consistency bound; also the logit margin within which SGLang's greedy
token must be the reference's argmax (a near-tie can go either way in bf16)."""
TINY = dict(hidden_size=128, num_heads=2, num_kv_heads=1, num_layers=2, init_std=0.2)
KV_TOKENS = 65536
DTYPE = os.environ.get("FERRYMAN_SGLANG_TEST_DTYPE", "bfloat16")
"""SGLang's and the reference's dtype: bfloat16 (SGLang's RMSNorm, sgl_kernel / FlashInfer,
takes fp16 and bf16 only; the tolerances above are for bf16)."""


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-sglang-gpu", **TINY)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-sglang-gpu-seed1", seed=1, **TINY)


def _state(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # as a trainer sends them
    return [(k, v.detach().clone()) for k, v in model.state_dict().items()]


@pytest.fixture(scope="module")
def own_weights(model_dir):
    return _state(model_dir)


@pytest.fixture(scope="module")
def other_weights(other_dir):
    return _state(other_dir)


@pytest.fixture(scope="module")
def hf_models(model_dir, other_dir):
    load = lambda p: transformers.AutoModelForCausalLM.from_pretrained(p, dtype=getattr(torch, DTYPE)).cuda().eval()  # noqa: E731
    return {"own": load(model_dir), "other": load(other_dir)}


def hf_check(model, prompt: list[int], tokens: list[int], log_probs: list[float] | None = None) -> int:
    """Check SGLang's greedy ``tokens`` (and ``log_probs``) against transformers, teacher-forced
    on them (one forward, no cache): each token's reference logit is within ``REF_ATOL`` of the
    reference's largest (bf16 near-ties may go either way) and its log-prob within
    ``REF_ATOL``. Returns how many tokens are exactly the reference's argmax."""
    assert tokens, "no tokens to check"
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens], device="cuda")).logits[0].float()
    logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    ref_lps = torch.log_softmax(logits, -1)
    exact = 0
    for i, t in enumerate(tokens):
        best = int(torch.argmax(logits[i]))
        gap = float(logits[i, best] - logits[i, t])
        assert gap <= REF_ATOL, f"token {i}: {t} is {gap:.3f} below the reference's greedy choice {best}"
        if log_probs is not None:
            diff = abs(float(ref_lps[i, t]) - log_probs[i])
            assert diff <= REF_ATOL, f"token {i}: log-prob {log_probs[i]:.4f} vs the reference's {float(ref_lps[i, t]):.4f}"
        exact += best == t
    return exact


@pytest.fixture(scope="module")
def tok(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def chat(tok):
    def render(text: str) -> list[int]:
        msgs = [{"role": "user", "content": text}]
        return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))

    return render


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sgl_engine(model_dir):
    cfg = SGLangEngineConfig(
        dtype=DTYPE,
        deterministic=True,  # batch-invariant kernels: batched and alone agree exactly
        cuda_graph=False,
        mem_fraction_static=0.3,
        max_total_tokens=KV_TOKENS,
        max_running_requests=64,
        server_args={
            "attention_backend": os.environ.get("FERRYMAN_SGLANG_TEST_ATTENTION", "triton"),
            "sampling_backend": "pytorch",
        },
    )
    engine = make_sglang_engine(cfg, model_path=str(model_dir), replica="gpu-sglang", seed=0)
    await engine.start()
    yield engine
    await engine.shutdown()


@pytest_asyncio.fixture(loop_scope="module", autouse=True)
async def _leave_engine_ready(request):
    yield
    if "sgl_engine" in request.fixturenames:
        engine = request.getfixturevalue("sgl_engine")
        engine.config.pause_mode = "abort"
        await engine.resume()


async def _update(engine, weights, version: int, *, bucket: int = 4) -> None:
    """The weight-sync sequence of ferryman.sync, the weights in several buckets."""
    await engine.pause(abort=True)
    await engine.release_kv_cache()
    for i in range(0, len(weights), bucket):
        await engine.load_weights(weights[i : i + bucket])
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


class TestSGLangContract(EngineContract):
    log_prob_atol = ATOL

    @pytest.fixture
    def engine(self, sgl_engine):
        return sgl_engine

    @pytest.fixture
    def prompt_ids(self, chat):
        return chat("Repeat the digit 7.")

    @pytest.fixture
    def own_weights(self, own_weights):
        return own_weights


async def test_matches_transformers_reference(sgl_engine, chat, hf_models):
    """Greedy tokens and log-probs agree with transformers on the same GPU (teacher-forced on
    SGLang's tokens; bf16 near-ties aside, the tokens are its argmax)."""
    prompts = [chat("Repeat the digit 7."), chat("What is 3 plus 4?"), [5, 6, 7]]
    outs = await asyncio.gather(*[sgl_engine.generate(f"ref-{i}", p, greedy(16)) for i, p in enumerate(prompts)])
    exact = total = 0
    for p, out in zip(prompts, outs):
        exact += hf_check(hf_models["own"], p, out.token_ids, out.log_probs)
        total += len(out.token_ids)
    assert exact >= 0.8 * total, f"only {exact} of {total} tokens are the reference's argmax"


async def test_log_probs_are_at_the_sampling_temperature(sgl_engine, chat, hf_models):
    """Sampled at temperature 0.7 (top-p/top-k off): each log-prob is log_softmax(logits / 0.7)
    of the token drawn, as the trainer computes it."""
    prompt = chat("Say 3.")
    out = await sgl_engine.generate("temp", prompt, SamplingParams(max_tokens=12, temperature=0.7))
    with torch.no_grad():
        logits = hf_models["own"](input_ids=torch.tensor([prompt + out.token_ids], device="cuda")).logits[0].float()
    lp = torch.log_softmax(logits / 0.7, -1)
    for i, t in enumerate(out.token_ids):  # logits / 0.7: their bf16 differences grow as much
        assert abs(float(lp[len(prompt) + i - 1, t]) - out.log_probs[i]) <= REF_ATOL / 0.7


async def test_partial_rollout_round_trip_same_tokens(sgl_engine, chat):
    """A greedy generation aborted by a sync and resumed by the server client (prompt + tokens
    so far, same request id) gives the tokens of an uninterrupted run; the resumed piece is
    served from the radix cache (cached_tokens) and its tokens carry the new version."""
    engine = sgl_engine
    prompt, ref = await _long_prompt(engine, chat, 96)
    client = ServerClient(LocalRouter([engine.replica]), {engine.replica: engine}, partial_rollout=True)
    v0 = await engine.get_version()
    hits0 = (await engine.stats())["prefix_cache_hit_tokens"]
    seen: list[int] = []
    task = asyncio.ensure_future(client.generate("round-trip", prompt, greedy(96), on_tokens=lambda d: seen.extend(d.token_ids)))
    while len(seen) < 40:
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
    # the resend of prompt + k tokens reused the KV of all but the last of them
    assert (await engine.stats())["prefix_cache_hit_tokens"] - hits0 >= len(prompt) + k - 1


async def test_abort_before_prefill_returns_no_tokens(sgl_engine, chat):
    engine = sgl_engine
    tasks = [asyncio.ensure_future(engine.generate(f"early-{i}", chat(f"Say {i}."), greedy(64))) for i in range(32)]
    await asyncio.sleep(0.002)  # some sent to SGLang, none decoded far
    await engine.pause(abort=True)
    outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert all(o.stop_reason in ("aborted", "stop") for o in outs)
    assert any(o.stop_reason == "aborted" and o.token_ids == [] for o in outs)
    await engine.resume()
    again = await engine.generate("after-early", chat("Say 1."), greedy(4))
    assert again.stop_reason in ("stop", "length")


async def test_weight_load_changes_outputs_and_version(sgl_engine, chat, own_weights, other_weights, hf_models):
    engine = sgl_engine
    prompt = chat("Write the digit 2. Now the digit 5.")
    before = await engine.generate("w-before", prompt, greedy(16))
    v = await engine.get_version()
    await engine.pause(abort=True)
    free0 = torch.cuda.mem_get_info()[0]
    await engine.release_kv_cache()
    freed = torch.cuda.mem_get_info()[0] - free0
    kv_bytes = KV_TOKENS * TINY["num_layers"] * 2 * TINY["num_kv_heads"] * (TINY["hidden_size"] // TINY["num_heads"]) * getattr(torch, DTYPE).itemsize
    assert freed >= kv_bytes // 2, f"release_kv_cache freed {freed} bytes of about {kv_bytes}"
    for i in range(0, len(other_weights), 4):
        await engine.load_weights(other_weights[i : i + 4])
    await engine.set_version(v + 1)
    await engine.resume_kv_cache()
    await engine.resume()
    after = await engine.generate("w-after", prompt, greedy(16))
    assert after.token_ids != before.token_ids
    assert after.versions == [v + 1] * len(after.token_ids)
    hf_check(hf_models["other"], prompt, after.token_ids, after.log_probs)  # SGLang now runs the other model
    await _update(engine, own_weights, v + 2)
    again = await engine.generate("w-again", prompt, greedy(16))
    assert again.token_ids == before.token_ids and again.versions == [v + 2] * len(again.token_ids)
    assert max(abs(a - b) for a, b in zip(again.log_probs, before.log_probs)) <= ATOL


async def _load_through(engine, buf, weight_sets, version: int) -> None:
    """One weight update as a receiver makes it: each set of weights copied into views of the
    one buffer ``buf`` (overwritten between sets) and loaded from those views."""
    await engine.pause(abort=True)
    await engine.release_kv_cache()
    for weights in weight_sets:
        off, views = 0, []
        for name, t in weights:
            view = buf[off : off + t.numel()].view(t.shape)
            view.copy_(t)
            views.append((name, view))
            off += t.numel()
        await engine.load_weights(views)
    await engine.set_version(version)
    await engine.resume_kv_cache()
    await engine.resume()


async def test_weights_from_gpu_buffer_views(sgl_engine, chat, own_weights, other_weights):
    """What the nccl and cuda_ipc receivers hand over: views into one reused CUDA buffer."""
    engine = sgl_engine
    prompt = chat("Say 4.")
    before = await engine.generate("views-before", prompt, greedy(12))
    v = await engine.get_version()
    buf = torch.empty(sum(t.numel() for _, t in other_weights), dtype=torch.float32, device="cuda")  # a receive buffer
    await _load_through(engine, buf, (other_weights, own_weights), v + 1)
    after = await engine.generate("views-after", prompt, greedy(12))
    assert after.token_ids == before.token_ids


# a process that owns a CUDA buffer and hands it out as torch's reduced CUDA tensor (what the
# trainer side of cuda_ipc does), until its stdin closes
_SHARE_BUFFER = """
import base64, pickle, sys, torch
from torch.multiprocessing.reductions import reduce_tensor
buf = torch.zeros(int(sys.argv[1]), dtype=torch.float32, device="cuda")
torch.cuda.synchronize()
print(base64.b64encode(pickle.dumps(reduce_tensor(buf))).decode(), flush=True)
sys.stdin.read()
"""


async def test_weights_from_a_buffer_received_over_cuda_ipc(sgl_engine, chat, own_weights, other_weights):
    """cuda_ipc's receivers hand over views of memory opened from the trainer's process, which
    torch refuses to share again with SGLang's schedulers unless copied (run 2 failed on it)."""
    import base64
    import pickle
    import subprocess
    import sys

    engine = sgl_engine
    prompt = chat("Say 5.")
    before = await engine.generate("ipc-before", prompt, greedy(12))
    v = await engine.get_version()
    n = sum(t.numel() for _, t in other_weights)
    owner = subprocess.Popen([sys.executable, "-c", _SHARE_BUFFER, str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(owner.stdout.readline), 120)
        fn, args = pickle.loads(base64.b64decode(line))
        buf = fn(*args)  # opened from the other process's memory
        await _load_through(engine, buf, (other_weights, own_weights), v + 1)
        after = await engine.generate("ipc-after", prompt, greedy(12))
        assert after.token_ids == before.token_ids
        del buf  # before the owner exits
    finally:
        owner.stdin.close()
        owner.wait(60)


async def test_bad_weights_change_nothing(sgl_engine, chat, own_weights):
    engine = sgl_engine
    prompt = chat("Say 3.")
    before = await engine.generate("bad-before", prompt, greedy(8))
    name, tensor = own_weights[1]
    with pytest.raises(ValueError, match="nothing loaded"):
        await engine.load_weights([(own_weights[0][0], own_weights[0][1] * 3), (name, tensor[:1])])
    with pytest.raises(ValueError, match="unknown parameter"):
        await engine.load_weights([("model.layers.0.not_a_weight", tensor)])
    after = await engine.generate("bad-after", prompt, greedy(8))
    assert after.token_ids == before.token_ids


async def test_radix_cache_hits_on_every_later_turn(sgl_engine, tok, chat):
    """An agent session (four turns, one request id) stays on its replica; every turn after
    the first is served from the radix cache up to what was computed before."""
    engine = sgl_engine
    client = ServerClient(LocalRouter([engine.replica]), {engine.replica: engine}, partial_rollout=True)
    prompt = chat("Repeat the digit 7. Then add 3 plus 4 and say the result.")
    computed = 0
    user = tok.encode("<|im_end|>\n<|im_start|>user\nNow the digit 9.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    for turn in range(4):
        out = await client.generate("session-1", prompt, greedy(24))
        assert out.replica == engine.replica
        if turn:
            assert out.num_cached_prompt_tokens >= computed - 1, f"turn {turn}: {out.num_cached_prompt_tokens} < {computed - 1}"
        computed = len(prompt) + len(out.token_ids)
        prompt = prompt + out.token_ids + user
    await client.drain()
    assert 0 < (await engine.stats())["prefix_cache_hit_rate"] <= 1


async def test_keep_mode_continues_with_the_new_weights(sgl_engine, chat, own_weights, other_weights, hf_models):
    """pause_mode keep: the call stays open through the update and continues with the new
    weights (its KV recomputed by them); later tokens carry the new version."""
    engine = sgl_engine
    prompt, ref = await _long_prompt(engine, chat, 96)
    engine.config.pause_mode = "keep"
    v = await engine.get_version()
    seen: list[int] = []
    task = asyncio.ensure_future(engine.generate("kept", prompt, greedy(96), on_tokens=lambda d: seen.extend(d.token_ids)))
    while len(seen) < 30:
        await asyncio.sleep(0.001)
    await engine.pause(abort=True)
    await asyncio.sleep(0.2)
    assert not task.done()
    await _update_paused(engine, other_weights, v + 1)
    out = await asyncio.wait_for(task, 120)
    assert out.num_aborts == 0 and out.stop_reason in ("length", "stop")
    k = out.versions.index(v + 1)
    assert k >= 30 and out.versions == [v] * k + [v + 1] * (len(out.versions) - k)
    assert out.token_ids[:k] == ref.token_ids[:k]
    hf_check(hf_models["other"], prompt + out.token_ids[:k], out.token_ids[k : k + 8])  # the other model's continuation
    engine.config.pause_mode = "abort"
    await _update(engine, own_weights, v + 2)


async def _update_paused(engine, weights, version):
    await engine.release_kv_cache()
    for i in range(0, len(weights), 4):
        await engine.load_weights(weights[i : i + 4])
    await engine.set_version(version)
    await engine.resume_kv_cache()
    await engine.resume()


async def test_in_place_mode_survives_a_weight_update(sgl_engine, chat, own_weights):
    """pause_mode in_place: SGLang keeps the request in its batch; no memory release (SGLang
    asserts idleness), the load does not flush (SGLang asserts the flush), the radix cache is
    flushed once SGLang is idle again."""
    engine = sgl_engine
    prompt, ref = await _long_prompt(engine, chat, 96)
    engine.config.pause_mode = "in_place"
    v = await engine.get_version()
    seen: list[int] = []
    task = asyncio.ensure_future(engine.generate("in-place", prompt, greedy(96), on_tokens=lambda d: seen.extend(d.token_ids)))
    while len(seen) < 30:
        await asyncio.sleep(0.001)
    await engine.pause(abort=True)
    await asyncio.sleep(0.2)
    n = len(seen)
    await asyncio.sleep(0.2)
    assert len(seen) == n and not task.done(), "in_place pause did not stop generating"
    await _update_paused(engine, own_weights, v + 1)  # own weights: the continuation is unchanged
    out = await asyncio.wait_for(task, 120)
    assert out.token_ids == ref.token_ids and out.num_aborts == 0
    for _ in range(100):
        if not (await engine.stats())["cache_stale"]:
            break
        await asyncio.sleep(0.05)
    assert (await engine.stats())["cache_stale"] == 0.0
