"""A named test double for vLLM's engine core, for machines without a GPU.

vLLM cannot run here (CPU-only CI), so :class:`FakeVLLMCore` stands in for
:class:`~ferryman_engine_vllm.cores.ThreadCore` / :class:`~ferryman_engine_vllm.cores.ProcessCore`
under a real :class:`~ferryman_engine_vllm.engine.VLLMEngine`, so that the engine's own logic
(request accounting, version stamping, pause / abort / keep, sleep and wake-up ordering, weight
checks, prefix-cache accounting) is tested on CPU. It behaves like vLLM's core where the engine
depends on it, and refuses what vLLM would not survive:

* one token per request per step (``step_delay_s`` apart), greedy or sampled from a
  deterministic pseudo-model whose scores depend on the loaded weights and the last tokens;
  log-probs are those of the temperature-scaled scores;
* stop tokens (and EOS) end a request and are included; ``max_tokens`` ends it with ``length``;
* block-aligned prefix caching of prompt + generated tokens, ``num_cached_tokens`` reported once;
* ``sleep(level)`` frees the KV cache (and at level 2 discards the weights): stepping a request
  or loading weights while the needed memory is asleep is an error;
* ``freeze`` keeps requests without stepping; ``reset_prefix_cache(reset_running=True)``
  marks frozen requests for recomputation;
* ``final_only=True`` reports a request once, when it ends, as the thread core does by default
  (an abort hands over the tokens so far; ``freeze`` returns each request's token count).

The GPU tests run the same engine over real vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from dataclasses import dataclass, field
from typing import Any

from ferryman.types import SamplingParams
from ferryman_engine_vllm.cores import Delta, OnDelta, OnError


@dataclass
class _FakeRequest:
    rid: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    rng: random.Random
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    cached: int = 0
    reported_cache: bool = False


class FakeVLLMCore:
    """Test double for vLLM's engine core (see the module docstring)."""

    def __init__(
        self,
        on_delta: OnDelta,
        on_error: OnError,
        *,
        vocab_size: int,
        initial_weights: dict[str, float],
        eos_id: int = 2,
        max_model_len: int = 512,
        step_delay_s: float = 0.002,
        block_size: int = 4,
        final_only: bool = False,
    ) -> None:
        self.final_only = final_only
        self._on_delta = on_delta
        self._on_error = on_error
        self.vocab_size = vocab_size
        self.weights = dict(initial_weights)
        """Parameter name to checksum (sum of the tensor) of what was loaded."""
        self.eos_id = eos_id
        self.max_model_len = max_model_len
        self.step_delay_s = step_delay_s
        self.block_size = block_size
        self.requests: dict[str, _FakeRequest] = {}
        self.frozen = False
        self.asleep: set[str] = set()
        self.discarded: set[str] = set()
        """Parameters whose memory a level-2 sleep discarded and that were not loaded since."""
        self.cache: set[tuple[int, ...]] = set()
        self.calls: list[tuple[Any, ...]] = []
        """Control calls in order: ("abort", ids), ("freeze",), ("sleep", level), ..."""
        self.recompute: set[str] = set()
        self.steps = 0
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    # ------------------------------------------------------------------ the pseudo-model
    def _key(self) -> float:
        return round(sum(self.weights.values()), 3)

    def _scores(self, context: list[int]) -> list[float]:
        rng = random.Random(hash((self._key(), tuple(context[-3:]))))
        return [rng.gauss(0.0, 2.0) for _ in range(self.vocab_size)]

    @staticmethod
    def _log_softmax(xs: list[float]) -> list[float]:
        m = max(xs)
        z = m + math.log(sum(math.exp(x - m) for x in xs))
        return [x - z for x in xs]

    def _next(self, req: _FakeRequest) -> tuple[int, float]:
        scores = self._scores(req.prompt + req.tokens)
        t = req.params.temperature
        if t == 0:
            token = max(range(len(scores)), key=scores.__getitem__)
            return token, self._log_softmax(scores)[token]
        lp = self._log_softmax([s / t for s in scores])
        token = req.rng.choices(range(len(lp)), weights=[math.exp(x) for x in lp])[0]
        return token, lp[token]

    # ------------------------------------------------------------------ core interface
    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def _cached_prefix(self, ids: list[int]) -> int:
        best = 0
        for end in range(self.block_size, len(ids), self.block_size):  # never the whole prompt
            if tuple(ids[:end]) in self.cache:
                best = end
        return best

    def _remember(self, ids: list[int]) -> None:
        for end in range(self.block_size, len(ids) + 1, self.block_size):
            self.cache.add(tuple(ids[:end]))

    async def add(self, rid: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int) -> None:
        await asyncio.sleep(0)
        if rid in self.requests:
            raise RuntimeError(f"fake vLLM core: request id {rid} already running")
        seed = params.seed if params.seed is not None else random.randrange(2**31)
        req = _FakeRequest(rid, list(prompt_ids), params, max_tokens, random.Random(seed))
        req.cached = self._cached_prefix(req.prompt)
        self.requests[rid] = req
        self._wake.set()

    async def _run(self) -> None:
        while True:
            if not self.requests or self.frozen:
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(self.step_delay_s)
            if self.frozen:
                continue
            self.steps += 1
            for req in list(self.requests.values()):
                if req.rid not in self.requests:
                    continue
                if self.asleep or self.discarded:
                    del self.requests[req.rid]
                    self._on_error(req.rid, RuntimeError("fake vLLM core: stepped while asleep"))
                    continue
                if req.rid in self.recompute:
                    self.recompute.discard(req.rid)  # KV of prompt + tokens rebuilt with the current weights
                token, lp = self._next(req)
                req.tokens.append(token)
                req.log_probs.append(lp)
                finish = None
                if token == self.eos_id or token in req.params.stop_token_ids:
                    finish = "stop"
                elif len(req.tokens) >= req.max_tokens:
                    finish = "length"
                cached = None
                if not req.reported_cache:
                    cached, req.reported_cache = req.cached, True
                if finish is not None:
                    del self.requests[req.rid]
                    self._remember(req.prompt + req.tokens)
                if not self.final_only:
                    self._on_delta(req.rid, Delta([token], [lp], finish, cached))
                elif finish is not None:
                    self._on_delta(req.rid, Delta(list(req.tokens), list(req.log_probs), finish, req.cached))

    async def abort(self, rids: list[str]) -> None:
        await asyncio.sleep(0)
        self.calls.append(("abort", list(rids)))
        for rid in rids:
            req = self.requests.pop(rid, None)
            if req is not None:
                self._remember(req.prompt + req.tokens)
                if self.final_only:
                    self._on_delta(rid, Delta(list(req.tokens), list(req.log_probs), "abort", req.cached))
                else:
                    self._on_delta(rid, Delta([], [], "abort"))

    async def freeze(self) -> dict[str, int]:
        self.calls.append(("freeze",))
        self.frozen = True
        return {rid: len(req.tokens) for rid, req in self.requests.items()}

    def in_flight_tokens(self) -> int:
        return sum(len(req.tokens) for req in self.requests.values())

    async def unfreeze(self) -> None:
        self.calls.append(("unfreeze",))
        self.frozen = False
        self._wake.set()

    async def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))
        if self.requests:
            raise RuntimeError("fake vLLM core: sleep with requests in flight would abort them")
        self.asleep = {"weights", "kv_cache"}
        self.cache.clear()
        if level == 2:
            self.discarded = set(self.weights)

    async def wake_up(self, tags: list[str] | None) -> None:
        self.calls.append(("wake_up", tags))
        for tag in tags or ["weights", "kv_cache"]:
            self.asleep.discard(tag)

    async def load_weights(self, bucket: list[tuple[str, Any]]) -> None:
        self.calls.append(("load_weights", [name for name, _ in bucket]))
        if "weights" in self.asleep:
            raise RuntimeError("fake vLLM core: load_weights while the weights are asleep")
        for name, tensor in bucket:
            self.weights[name] = float(tensor.double().sum().item())
            self.discarded.discard(name)

    async def reset_prefix_cache(self, reset_running: bool) -> bool:
        self.calls.append(("reset_prefix_cache", reset_running))
        if self.requests and not reset_running:
            return False
        self.cache.clear()
        self.recompute.update(self.requests)
        return True

    async def shutdown(self) -> None:
        self.calls.append(("shutdown",))
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
