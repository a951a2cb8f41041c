"""Routed experts (MoE): one convention from the engine to the TrainBatch. An engine's list is
per position of the whole sequence it ran for a call (prompt + generated, less the last token);
a resumed piece's prompt holds the earlier pieces' tokens, so its list supersedes theirs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from ferryman.batch import build_train_batch
from ferryman.client import ServerClient
from ferryman.defaults.router import LocalRouter
from ferryman.engine_host import EngineHandle
from ferryman.replay import concat_outputs
from ferryman.testing.doubles import EchoEngine
from ferryman.types import Sample, SamplingParams, TokenOutput, Trajectory

LAYERS, TOP_K = 2, 2


def route(i: int, tok: int) -> list[list[int]]:
    """The experts of position ``i`` (token ``tok``): a function of both, so a shift shows."""
    return [[(tok + i + layer) % 8, (tok + i + layer + 1) % 8] for layer in range(LAYERS)]


def routing(seq: list[int]) -> list[list[list[int]]]:
    """What an engine reports for the sequence ``seq`` it ran: every position but the last."""
    return [route(i, tok) for i, tok in enumerate(seq[:-1])]


class MoEEcho:
    """EchoEngine reporting routed experts as vLLM and SGLang do: the whole sequence of the
    call, once, with the answer (``aborted_routing=False``: an abort without it, as vLLM's
    in-process ``LLMEngine`` answers an abort)."""

    def __init__(self, engine: EchoEngine, *, aborted_routing: bool = True) -> None:
        self.engine = engine
        self.aborted_routing = aborted_routing

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> TokenOutput:
        out = await self.engine.generate(request_id, prompt_ids, params)
        if out.stop_reason != "aborted" or self.aborted_routing:
            out.routed_experts = routing(list(prompt_ids) + out.token_ids)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


async def _abort_resume(aborted_routing: bool) -> tuple[TokenOutput, EchoEngine]:
    echo = EchoEngine(step_delay_s=0.01)
    client = ServerClient(LocalRouter(["r0"]), {"r0": EngineHandle("r0", engine=MoEEcho(echo, aborted_routing=aborted_routing))},
                          partial_rollout=True)
    task = asyncio.ensure_future(client.generate("moe-1", [10, 11, 12], SamplingParams(max_tokens=20)))
    await asyncio.sleep(0.055)
    await echo.pause(abort=True)
    await echo.resume()
    out = await asyncio.wait_for(task, 10)
    await client.drain()
    return out, echo


@pytest.mark.parametrize("aborted_routing", [True, False], ids=["abort-reports-routing", "abort-without-routing"])
async def test_a_resumed_piece_supersedes_the_routing_of_the_earlier_ones(aborted_routing):
    out, echo = await _abort_resume(aborted_routing)
    assert out.num_aborts == 1 and len(out.token_ids) == 20
    (_, p1, _), (_, p2, _) = echo.calls
    assert p2 == p1 + out.token_ids[: len(p2) - len(p1)], "the resume prompt holds the earlier tokens"
    seq = [10, 11, 12] + out.token_ids
    # the whole sequence once, aligned with prompt + tokens (appending would repeat the prefix)
    assert out.routed_experts == routing(seq)
    assert len(out.routed_experts) == len(seq) - 1


def test_concat_outputs_keeps_the_later_routing():
    first = TokenOutput([5, 6], [-1.0, -1.0], [0, 0], "aborted", routed_experts=routing([1, 2, 5, 6]))
    second = TokenOutput([7], [-1.0], [1], "stop", routed_experts=routing([1, 2, 5, 6, 7]))
    assert concat_outputs(first, second).routed_experts == routing([1, 2, 5, 6, 7])
    second.routed_experts = None
    assert concat_outputs(first, second).routed_experts == routing([1, 2, 5, 6])


def _traj(rid: str, prompt: list[int], answers: list[list[int]], obs: list[int]) -> Trajectory:
    """A multi-turn trajectory built the usual way: each turn's prompt is the tokens so far."""
    t = Trajectory(request_id=rid, prompt_ids=list(prompt))
    for k, ans in enumerate(answers):
        if k:
            t.append_observation(obs)
        seq = t.prompt_ids + t.response_ids + ans
        t.append_model_tokens(TokenOutput(ans, [-1.0] * len(ans), [0] * len(ans), routed_experts=routing(seq)))
    return t


def test_build_train_batch_fills_routed_experts_aligned_with_the_tokens():
    a = _traj("a", [1, 2, 3], [[4, 5], [6]], obs=[7, 7])
    b = _traj("b", [1], [[9, 9, 9, 9, 9, 9]], obs=[])
    b.append_observation([3, 3])  # template tail after the last answer: never run
    batch = build_train_batch([Sample("u", 0, [a, b])], pad_token_id=0)
    routed = batch.meta["routed_experts"]
    assert routed.dtype == torch.long and routed.shape == (2, batch.input_ids.shape[1], LAYERS, TOP_K)
    for r, t in enumerate((a, b)):
        full = t.prompt_ids + t.response_ids
        n = len(t.extra["routed_experts"])
        assert batch.input_ids[r, :n].tolist() == full[:n]
        assert routed[r, :n].tolist() == [route(i, tok) for i, tok in enumerate(full[:n])]
        # the last model token, observation tail and padding repeat the last reported position
        assert (routed[r, n:] == routed[r, n - 1]).all()
    assert len(a.extra["routed_experts"]) == len(a.prompt_ids) + len(a.response_ids) - 1
    assert len(b.extra["routed_experts"]) == len(b.prompt_ids) + 6 - 1
    # micro-batches cut it like the per-token fields
    for _, mb in batch.micro_batches(max_tokens=batch.input_ids.shape[1]):
        assert mb.meta["routed_experts"].shape[:2] == mb.input_ids.shape


def test_build_train_batch_leaves_routed_experts_out_unless_every_row_has_enough():
    a = _traj("a", [1, 2, 3], [[4, 5]], obs=[])
    plain = Trajectory("p", [1, 2], [8], [1], [-1.0], [0])
    assert "routed_experts" not in build_train_batch([Sample("u", 0, [a, plain])], pad_token_id=0).meta
    # a turn without routing: the earlier list covers only a prefix, short of the last answer
    short = _traj("s", [1, 2, 3], [[4, 5]], obs=[])
    short.append_observation([7])
    short.append_model_tokens(TokenOutput([6], [-1.0], [0]))
    assert "routed_experts" not in build_train_batch([Sample("u", 0, [a, short])], pad_token_id=0).meta
    assert "routed_experts" in build_train_batch([Sample("u", 0, [a])], pad_token_id=0).meta


def test_routed_experts_of_different_shapes_are_an_error():
    a = _traj("a", [1, 2, 3], [[4, 5]], obs=[])
    b = _traj("b", [1, 2, 3], [[4, 5]], obs=[])
    b.extra["routed_experts"] = [pos[:1] for pos in b.extra["routed_experts"]]
    with pytest.raises(ValueError, match="different shapes"):
        build_train_batch([Sample("u", 0, [a, b])], pad_token_id=0)


def test_append_model_tokens_drops_a_routing_longer_than_the_trajectory():
    t = _traj("a", [1, 2, 3], [[4, 5]], obs=[])
    t.append_model_tokens(TokenOutput([6], [-1.0], [0], routed_experts=routing(list(range(40)))))
    assert "routed_experts" not in t.extra
