"""The proxy end to end: the real OpenAI SDK and real LiteLLM (providers ``openai/`` and
``hosted_vllm/``), streaming and not, multi-turn with tools, against the proxy in front of a tiny
model served by the real transformers engine through core's ServerClient; and the trajectories
the proxy collected train with the FSDP trainer backend.

The tiny model is taught on the spot (at most a few hundred Adam steps, about 10 s of CPU) to
answer "What is 2 plus 3?" with "Let me add." and an ``add`` tool call and, after the tool's
result, "The answer is 5." — in both chat templates (ChatML + hermes, and the qwen3_coder XML
style) — so that greedy decoding exercises real tool calls, and content before them, through
every client, streamed live and not.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network look-up of model prices

openai = pytest.importorskip("openai")
litellm = pytest.importorskip("litellm")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ferryman.batch import build_train_batch  # noqa: E402
from ferryman.client import ServerClient  # noqa: E402
from ferryman.defaults.router import LocalRouter  # noqa: E402
from ferryman.tiny import build_tiny_model  # noqa: E402
from ferryman.types import Sample, SamplingParams  # noqa: E402
from ferryman_engine_hf.engine import HFEngine, HFEngineConfig  # noqa: E402
from ferryman_proxy import ProxyConfig, ProxyServer  # noqa: E402
from ferryman_proxy.agents import ADD_TOOL  # noqa: E402
from ferryman_proxy.templates import QWEN3_CODER_TEMPLATE  # noqa: E402

# LiteLLM's own pydantic models warn at import
pytestmark = pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")

QUESTION = "What is 2 plus 3?"
FINAL = "The answer is 5."
PREAMBLE = "Let me add."
"""Content the policy writes before its tool call (streamed before the call is known)."""
TOOLS = [ADD_TOOL]
TEMPLATES = {"hermes": None, "qwen3_coder": "qwen3_coder"}


def _conversation() -> list[dict[str, Any]]:
    call = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": PREAMBLE, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "5"},
        {"role": "assistant", "content": FINAL},
    ]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    """A tiny model that has memorised the two answers in both templates."""
    base = build_tiny_model(tmp_path_factory.mktemp("proxy-e2e") / "tiny")
    tok = transformers.AutoTokenizer.from_pretrained(base)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    conv = _conversation()
    rows, masks = [], []
    for template in (None, QWEN3_CODER_TEMPLATE):
        ids = tok.apply_chat_template(conv, tools=TOOLS, chat_template=template, tokenize=True, return_dict=False)
        mask = [0] * len(ids)
        for k in (1, 3):
            start = len(tok.apply_chat_template(conv[:k], tools=TOOLS, chat_template=template, add_generation_prompt=True, tokenize=True, return_dict=False))
            end = ids.index(tok.eos_token_id, start)
            mask[start : end + 1] = [1] * (end + 1 - start)
        rows.append(ids)
        masks.append(mask)
    width = max(map(len, rows))
    x = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    att = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    m = torch.tensor([mm + [0] * (width - len(mm)) for mm in masks], dtype=torch.float32)[:, 1:]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(600):
            logits = model(input_ids=x, attention_mask=att).logits[:, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, x[:, 1:, None])[..., 0]
            loss = -(lp * m).sum() / m.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            right = bool(((logits.argmax(-1) == x[:, 1:]) | (m == 0)).all())
            if right and float(loss.detach()) < 0.02:
                break
        else:  # pragma: no cover
            raise AssertionError("the tiny model did not learn the answers")
    finally:
        torch.set_num_threads(threads)
    out = tmp_path_factory.mktemp("proxy-e2e") / "policy"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture
async def stack(policy_dir):
    """``await stack(template)`` -> (ProxyServer, engine): the real engine behind ServerClient."""
    made: list[tuple[ProxyServer, HFEngine]] = []

    async def make(template: str, *, engine_cfg: dict[str, Any] | None = None, partial_rollout: bool = False, wrap: Any = None, **cfg: Any) -> tuple[ProxyServer, HFEngine]:
        engine = HFEngine(HFEngineConfig(**(engine_cfg or {})), model_path=str(policy_dir), replica="hf-0")
        await engine.start()
        client = ServerClient(LocalRouter(["hf-0"]), {"hf-0": wrap(engine) if wrap else engine}, partial_rollout=partial_rollout)
        tok = transformers.AutoTokenizer.from_pretrained(policy_dir)
        parser = "qwen3_coder" if template == "qwen3_coder" else "hermes"
        server = ProxyServer(tokenizer=tok, client=client, config=ProxyConfig(tool_parser=parser, chat_template=TEMPLATES[template], **cfg))
        await server.start()
        made.append((server, engine))
        return server, engine

    yield make
    for server, engine in made:
        await server.stop()
        await engine.shutdown()


GREEDY = SamplingParams(max_tokens=96, temperature=0.0)


# ------------------------------------------------------------------ the clients under test


async def call_openai(sess, messages, stream: bool) -> dict[str, Any]:
    client = openai.AsyncOpenAI(base_url=sess.base_url, api_key="unused", max_retries=0)
    try:
        if not stream:
            resp = await client.chat.completions.create(model=sess.model_name, messages=messages, tools=TOOLS)
            return resp.choices[0].message.model_dump()  # None fields (refusal, audio, ...) included
        msg: dict[str, Any] = {"role": "assistant", "content": None}
        calls: dict[int, dict[str, Any]] = {}
        async for chunk in await client.chat.completions.create(model=sess.model_name, messages=messages, tools=TOOLS, stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is None:
                continue
            if delta.content:
                msg["content"] = (msg["content"] or "") + delta.content
            for tc in delta.tool_calls or ():
                c = calls.setdefault(tc.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                c["id"] = tc.id or c["id"]
                if tc.function is not None:
                    c["function"]["name"] += tc.function.name or ""
                    c["function"]["arguments"] += tc.function.arguments or ""
        if calls:
            msg["tool_calls"] = [calls[i] for i in sorted(calls)]
        return msg
    finally:
        await client.close()


async def call_litellm(provider: str, sess, messages, stream: bool) -> dict[str, Any]:
    kwargs = dict(model=f"{provider}/{sess.model_name}", api_base=sess.base_url, api_key="unused", messages=messages, tools=TOOLS, num_retries=0)
    if not stream:
        resp = await litellm.acompletion(**kwargs)
        return resp.choices[0].message.model_dump()
    chunks = [c async for c in await litellm.acompletion(stream=True, **kwargs)]
    return litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message.model_dump()


CLIENTS = {
    "openai": call_openai,
    "litellm-openai": lambda s, m, st: call_litellm("openai", s, m, st),
    "litellm-hosted_vllm": lambda s, m, st: call_litellm("hosted_vllm", s, m, st),
}


async def tool_agent(call, sess, stream: bool) -> list[dict[str, Any]]:
    """A black-box agent: ask, run the tool calls it gets, ask again, until a plain answer."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    for _ in range(4):
        msg = await call(sess, messages, stream)
        messages.append(msg)
        if not msg.get("tool_calls"):
            return messages
        for tc in msg["tool_calls"]:
            args = json.loads(tc["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": str(args["a"] + args["b"])})
    raise AssertionError("the agent did not finish")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("client", sorted(CLIENTS))
@pytest.mark.parametrize("template", sorted(TEMPLATES))
async def test_sdk_multi_turn_with_tools_is_token_exact(stack, policy_dir, template, client, stream):
    server, engine = await stack(template)
    sess = server.open_session(f"r-{template}-{client}-{stream}", GREEDY)
    messages = await tool_agent(CLIENTS[client], sess, stream)
    result = await server.close_session(sess)

    calls = messages[1]["tool_calls"]
    assert messages[1]["content"] == PREAMBLE
    assert len(calls) == 1 and calls[0]["function"]["name"] == "add" and json.loads(calls[0]["function"]["arguments"]) == {"a": 2, "b": 3}
    assert messages[2]["content"] == "5" and messages[3]["content"] == FINAL
    assert result.end_reason is None and len(result.trajectories) == 1
    assert result.metrics["proxy/turns"] == 2 and result.metrics["proxy/tool_calls"] == 1
    t = result.trajectories[0]
    tok = transformers.AutoTokenizer.from_pretrained(policy_dir)
    want = tok.apply_chat_template(_conversation(), tools=TOOLS, chat_template=server.chat_tokenizer.template, tokenize=True, return_dict=False)
    assert t.prompt_ids + t.response_ids == want, "the trajectory is the whole conversation, token for token"
    generated = tok.decode([i for i, m in zip(t.response_ids, t.response_mask) if m], skip_special_tokens=False)
    assert generated.endswith(FINAL + "<|im_end|>") and generated.count("<|im_end|>") == 2
    assert all(v == 0 for v, m in zip(t.token_versions, t.response_mask) if m)
    assert all(lp < 0 for lp, m in zip(t.rollout_log_probs, t.response_mask) if m)
    # one request id for the whole run: the engine reused its KV cache for the second turn
    assert (await engine.stats())["prefix_cache_hit_tokens"] > 0


async def test_litellm_rollout_details_like_terminus(stack):
    """What Harbor's terminus-2 does with ``collect_rollout_details``: ``logprobs=True`` and
    ``extra_body={"return_token_ids": True}`` through LiteLLM's ``hosted_vllm`` provider."""
    server, _ = await stack("hermes")
    sess = server.open_session("r-terminus", GREEDY)
    resp = await litellm.acompletion(
        model=f"hosted_vllm/{sess.model_name}",
        api_base=sess.base_url,
        api_key="unused",
        messages=[{"role": "user", "content": QUESTION}],
        tools=TOOLS,
        logprobs=True,
        extra_body={"return_token_ids": True, "session_id": "ignored"},
    )
    choice = resp.choices[0]
    token_ids = choice.provider_specific_fields["token_ids"]
    logprobs = [e["logprob"] for e in choice.logprobs["content"]]
    t = (await server.close_session(sess)).trajectories[0]
    n = len(token_ids)
    assert resp.prompt_token_ids == t.prompt_ids
    assert token_ids == t.response_ids[:n] and t.response_mask[:n] == [1] * n
    assert logprobs == pytest.approx(t.rollout_log_probs[:n])


async def test_context_limit_reaches_litellm_as_context_window_error(stack):
    server, _ = await stack("hermes", max_total_tokens=300)
    sess = server.open_session("r-ctx", GREEDY)
    with pytest.raises(litellm.ContextWindowExceededError):
        await litellm.acompletion(
            model=f"openai/{sess.model_name}", api_base=sess.base_url, api_key="unused", num_retries=0,
            messages=[{"role": "user", "content": "word " * 400}],
        )
    assert (await server.close_session(sess)).end_reason == "context_length"


# ------------------------------------------------------------------ the collected trajectories train


async def test_collected_trajectories_train(stack, policy_dir):
    """Trajectories collected through the proxy go through core's build_train_batch into the FSDP
    backend: its log-probs at the masked positions equal the engine's (the tokens are exactly
    the ones generated, at the right places), and a few GRPO updates raise the log-likelihood
    of the rewarded run's tokens and lower the other's."""
    from ferryman import algorithms as algo
    from ferryman.config import AlgorithmConfig
    from ferryman_trainer_fsdp.trainer import FSDPTrainerConfig, make_fsdp_trainer

    server, _ = await stack("hermes")
    runs = []
    for i, question in enumerate([QUESTION, "What is 7 plus 1?"]):
        sess = server.open_session(f"r-train-{i}", SamplingParams(max_tokens=48, temperature=1.0, seed=i))
        client = openai.AsyncOpenAI(base_url=sess.base_url, api_key="unused", max_retries=0)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": question}]
        resp = await client.chat.completions.create(model=sess.model_name, messages=msgs, tools=TOOLS)
        msgs += [resp.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
        await client.chat.completions.create(model=sess.model_name, messages=msgs, tools=TOOLS)
        await client.close()
        (traj,) = (await server.close_session(sess)).trajectories
        traj.reward = 1.0 if i == 0 else 0.0
        runs.append(traj)
    batch = build_train_batch([Sample(uid="s0", task_index=0, trajectories=runs)], pad_token_id=0)
    batch.meta["temperature"] = 1.0
    mask = batch.loss_mask
    assert mask.sum() > 0 and (mask.sum(-1) > 0).all()

    backend = make_fsdp_trainer(FSDPTrainerConfig(lr=1e-3, num_threads=1), model_path=str(policy_dir), algorithm=AlgorithmConfig(), seed=0)
    try:
        lp = backend.compute_log_probs(batch)
        assert torch.allclose(lp[mask > 0], batch.rollout_log_probs[mask > 0], atol=1e-4), "trainer and engine disagree on the tokens"
        batch.old_log_probs = batch.rollout_log_probs.clone()
        batch.advantages = algo.compute_grpo_advantages(batch.scores, batch.group_index, mask, norm_by_std=True)
        before = (lp * mask).sum(-1)
        for _ in range(3):
            metrics = backend.update_actor(batch)
        assert all(map(lambda v: v == v, metrics.values()))  # finite, no NaN
        after = (backend.compute_log_probs(batch) * mask).sum(-1)
        assert after[0] > before[0] and after[1] < before[1]
    finally:
        backend.close()


# ------------------------------------------------------------------ the openai_agent env in a run


def test_openai_agent_env_in_an_inline_run(policy_dir, tmp_path):
    """The ``openai_agent`` env (a black-box OpenAI-SDK agent per run, behind the proxy) in a
    short inline run with the FSDP trainer: samples made of proxy trajectories reach the
    trainer, which takes its steps."""
    import math

    import ferryman
    from ferryman.config import load_config
    from ferryman.plugins import PluginHost
    from ferryman.runner import run

    produced = []

    class Capture:
        @ferryman.hookimpl
        def ferryman_on_sample_produced(self, sample):
            produced.append(sample)

    host = PluginHost(extra_plugins=(Capture(),))
    overrides = [
        "runtime=inline",
        f"run_dir={tmp_path / 'run'}",
        f"model.path={policy_dir}",
        "rollout.n=2",
        "rollout.max_tokens=64",
        "rollout.temperature=0.3",
        "rollout.num_replicas=1",
        "rollout.max_concurrency_per_replica=2",
        "training.ppo_mini_batch_size=1",
        "training.total_steps=2",
        "trainer.lr=1e-3",
        "trackers=[{type: jsonl}]",
        "env={type: openai_agent, tasks: [{a: 2, b: 3}, {a: 7, b: 1}], proxy: {max_turns: 3}}",
    ]
    cfg, _ = load_config(None, overrides, host)
    summary = run(cfg, host)
    assert len(summary["steps"]) == 2
    trajs = [t for s in produced for t in s.trajectories]
    assert trajs and all(t.request_id.startswith("r-") and sum(t.response_mask) > 0 for t in trajs)
    assert all(t.metrics["proxy/turns"] >= 1 and t.reward is not None for t in trajs)
    assert any(t.metrics["proxy/tool_calls"] >= 1 for t in trajs), "the policy called the add tool"
    assert any(t.reward == 1.0 for t in trajs), "and solved 2 plus 3"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["reward/mean"]) for r in rows)


# ------------------------------------------------------------------ live streaming


class _NoStreaming:
    """The real engine seen through the plain protocol (``generate`` without ``on_tokens``):
    an engine that cannot stream."""

    def __init__(self, engine: HFEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, request_id, prompt_ids, params):
        return await self._engine.generate(request_id, prompt_ids, params)


async def _stream_turn(client: str, sess, messages, engine: HFEngine, on_first_content=None) -> tuple[dict[str, Any], list[tuple[str, float]]]:
    """One streamed turn through a real SDK: the message (content and tool calls as the client
    assembles them) and, per content chunk, its text and the engine's generated-token count
    when it arrived."""
    content, got, calls = "", [], {}

    async def seen(text: str) -> None:
        nonlocal content
        if not got and on_first_content is not None:
            await on_first_content()
        content += text
        got.append((text, (await engine.stats())["total_generated_tokens"]))

    if client == "openai":
        oc = openai.AsyncOpenAI(base_url=sess.base_url, api_key="unused", max_retries=0)
        try:
            async for chunk in await oc.chat.completions.create(model=sess.model_name, messages=messages, tools=TOOLS, stream=True):
                delta = chunk.choices[0].delta if chunk.choices else None
                if delta is not None and delta.content:
                    await seen(delta.content)
                for tc in (delta.tool_calls if delta is not None else None) or ():
                    calls[tc.index] = {"name": tc.function.name, "arguments": json.loads(tc.function.arguments)}
        finally:
            await oc.close()
    else:
        chunks = []
        async for chunk in await litellm.acompletion(
            model=f"hosted_vllm/{sess.model_name}", api_base=sess.base_url, api_key="unused", messages=messages, tools=TOOLS,
            num_retries=0, stream=True,
        ):
            chunks.append(chunk)
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is not None and delta.content:
                await seen(delta.content)
        built = litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message
        for i, tc in enumerate(built.tool_calls or ()):
            calls[i] = {"name": tc.function.name, "arguments": json.loads(tc.function.arguments)}
    msg: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg, got


async def _json_turn(sess, messages) -> dict[str, Any]:
    oc = openai.AsyncOpenAI(base_url=sess.base_url, api_key="unused", max_retries=0)
    try:
        m = (await oc.chat.completions.create(model=sess.model_name, messages=messages, tools=TOOLS)).choices[0].message
    finally:
        await oc.close()
    msg: dict[str, Any] = {"role": "assistant", "content": m.content}
    if m.tool_calls:
        msg["tool_calls"] = [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in m.tool_calls]
    return msg


def _as_request(msg: dict[str, Any]) -> dict[str, Any]:
    """An assembled answer as the agent sends it back."""
    out: dict[str, Any] = {"role": "assistant", "content": msg["content"]}
    if msg.get("tool_calls"):
        out["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
            for i, c in enumerate(msg["tool_calls"])
        ]
    return out


def _recorded(result) -> list[tuple]:
    return [(t.prompt_ids, t.response_ids, t.response_mask, t.rollout_log_probs, t.token_versions) for t in result.trajectories]


@pytest.mark.parametrize("client", ["openai", "litellm"])
@pytest.mark.parametrize("template", sorted(TEMPLATES))
async def test_live_stream_arrives_during_generation_and_equals_the_json_answer(stack, template, client):
    """Content chunks reach a real SDK while the engine is still generating (a per-step delay
    makes generation take ~0.5 s a turn); the streamed content before a tool call, the tool call,
    and the final answer equal the non-streamed answers, and the trajectories are identical."""
    server, engine = await stack(template, engine_cfg={"step_delay_s": 0.02})
    streamed, plain = server.open_session(f"s-{template}-{client}", GREEDY), server.open_session(f"j-{template}-{client}", GREEDY)
    ask = [{"role": "user", "content": QUESTION}]
    generated_before = (await engine.stats())["total_generated_tokens"]
    first, got1 = await _stream_turn(client, streamed, ask, engine)
    turn1_tokens = (await engine.stats())["total_generated_tokens"] - generated_before
    assert first["content"] == PREAMBLE and first["tool_calls"] == [{"name": "add", "arguments": {"a": 2, "b": 3}}]
    assert len(got1) >= 2, "the content came in several chunks"
    assert got1[0][1] - generated_before < turn1_tokens / 2, "the first content chunk arrived long before generation ended"
    assert got1[-1][1] - generated_before < turn1_tokens, "all of the content before the call arrived while the call was being generated"

    follow = [*ask, _as_request(first), {"role": "tool", "tool_call_id": "call_0", "content": "5"}]
    second, got2 = await _stream_turn(client, streamed, follow, engine)
    assert second == {"role": "assistant", "content": FINAL} and len(got2) >= 2

    assert await _json_turn(plain, ask) == first
    assert await _json_turn(plain, follow) == second
    a, b = await server.close_session(streamed), await server.close_session(plain)
    assert _recorded(a) == _recorded(b), "streaming records exactly the tokens, masks, log-probs and versions of the JSON path"
    assert server.counters["live_streams"] == 2 and server.counters["stream_mismatches"] == 0


async def test_live_stream_across_a_weight_sync_sends_each_token_once(stack):
    """A weight sync aborts the generation after the first content chunk (partial rollout):
    the resumed generation continues the same stream; the content is the non-streamed one, and
    the trajectory has the same tokens, now with two weight versions."""
    server, engine = await stack("hermes", engine_cfg={"step_delay_s": 0.02}, partial_rollout=True)
    sess, plain = server.open_session("s-sync", GREEDY), server.open_session("j-sync", GREEDY)
    ask = [{"role": "user", "content": QUESTION}]

    async def weight_sync() -> None:
        await engine.pause(abort=True)
        await engine.set_version(1)
        await engine.resume()

    msg, got = await _stream_turn("openai", sess, ask, engine, on_first_content=weight_sync)
    assert msg == await _json_turn(plain, ask)
    assert msg["content"] == PREAMBLE and len(got) >= 2
    (t,) = (await server.close_session(sess)).trajectories
    (ref,) = (await server.close_session(plain)).trajectories
    assert t.response_ids == ref.response_ids and t.response_mask == ref.response_mask
    assert t.rollout_log_probs == pytest.approx(ref.rollout_log_probs, abs=1e-5)
    model = [v for v, m in zip(t.token_versions, t.response_mask) if m]
    k = model.index(1)
    assert 0 < k and model == [0] * k + [1] * (len(model) - k), "aborted mid-answer and resumed under the new version"


async def test_engine_without_streaming_still_streams_at_the_end(stack):
    """An engine without ``on_tokens``: the stream is the same, it just starts when the engine
    is done (so the timing check above would fail for it)."""
    server, engine = await stack("hermes", engine_cfg={"step_delay_s": 0.01}, wrap=_NoStreaming)
    sess = server.open_session("s-nostream", GREEDY)
    before = (await engine.stats())["total_generated_tokens"]
    msg, got = await _stream_turn("openai", sess, [{"role": "user", "content": QUESTION}], engine)
    total = (await engine.stats())["total_generated_tokens"] - before
    assert msg["content"] == PREAMBLE and msg["tool_calls"][0]["name"] == "add"
    assert got[0][1] - before == total, "nothing arrived before the engine finished"
    await server.close_session(sess)
