"""The ``vllm`` rollout engine: :class:`ferryman.protocols.Engine` over vLLM's engine.

Design
------
:class:`VLLMEngine` keeps ferryman's side of every request (its tokens, log-probs and the
weight version of each token) and the engine's control state (paused, version, KV released);
a *core* (:mod:`ferryman_engine_vllm.cores`) hosts vLLM and hands each request's tokens back,
step by step or (the thread core's default) once, when the request ends. Tokens are stamped
with the engine's version when they reach the event loop; the version changes only while the
engine is paused, after in-flight output has been delivered, and a ``keep`` freeze records how
many tokens each frozen request had made, so every token carries the version of the weights
that made it.

- ``generate``: checks its input (ValueError, nothing sent to vLLM), waits while paused, sends
  the prompt token ids to vLLM under a unique internal id, and returns when vLLM finishes the
  request. vLLM's automatic prefix caching makes a resend of ``prompt + tokens so far`` (partial
  rollout) or the next agent turn prefill only the new tokens; ``num_cached_prompt_tokens``
  reports the hit.
- ``pause(abort=True)``: ``pause_mode: abort`` aborts every in-flight request in vLLM; each
  ``generate`` returns its tokens so far with ``stop_reason="aborted"``. ``pause_mode: keep``
  freezes them inside vLLM instead (they resume with the new weights, KV recomputed).
  ``pause(abort=False)`` waits until in-flight requests finish. New calls wait for ``resume``.
- ``release_kv_cache`` / ``resume_kv_cache``: vLLM sleep (KV cache freed; weights kept
  resident at level 1, re-allocated empty at level 2) and wake-up, when ``sleep_mode`` is on.
- ``load_weights``: checked against the checkpoint's names and shapes first, then sent to every
  worker of the replica (``collective_rpc``) where the model's ``load_weights`` takes them.
  The prefix cache is reset before the next generation (``set_version``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import Any

from ferryman.engine_checks import CheckpointSpec, check_bucket, check_generate_request, read_checkpoint_spec
from ferryman.types import SamplingParams, StopReason, TokenOutput
from ferryman_engine_vllm.config import VLLMEngineConfig
from ferryman_engine_vllm.cores import Delta, OnDelta, OnError, ProcessCore, ThreadCore

log = logging.getLogger(__name__)

CoreFactory = Callable[[OnDelta, OnError], Any]
"""Builds a core from the engine's two callbacks (see :mod:`ferryman_engine_vllm.cores`)."""

_REASONS: dict[str, StopReason] = {"stop": "stop", "length": "length", "abort": "aborted", "repetition": "stop"}
ABORT_GRACE_S = 30.0
"""How long ``pause(abort=True)`` waits for vLLM to confirm aborts before answering itself."""


def make_vllm_engine(
    config: VLLMEngineConfig,
    *,
    model_path: str,
    replica: str = "vllm-0",
    seed: int = 0,
    core_factory: CoreFactory | None = None,
    **_: Any,
) -> VLLMEngine:
    """Factory registered as the ``vllm`` engine. vLLM starts in :meth:`VLLMEngine.start`."""
    if core_factory is None and find_spec("vllm") is None:
        from ferryman.plugins import PluginError

        from ferryman_engine_vllm.config import INSTALL_HINT

        raise PluginError(f"engine.type 'vllm' needs 'vllm', which is not installed: {INSTALL_HINT}")
    return VLLMEngine(config, model_path=model_path, replica=replica, seed=seed, core_factory=core_factory)


@dataclass
class _Request:
    rid: str
    request_id: str
    prompt_len: int
    future: asyncio.Future[TokenOutput]
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cached: int = 0
    routed_experts: Any = None
    abort_requested: bool = False
    marks: list[tuple[int, int]] = field(default_factory=list)
    """(tokens made, version) at each ``keep`` freeze: a core that reports a request only when
    it ends tells the engine how many of its tokens the old weights made."""


class VLLMEngine:
    """A :class:`ferryman.protocols.Engine` replica on vLLM."""

    def __init__(
        self,
        config: VLLMEngineConfig,
        *,
        model_path: str,
        replica: str = "vllm-0",
        seed: int = 0,
        core_factory: CoreFactory | None = None,
    ) -> None:
        self.config = config
        self.model_path = str(model_path)
        self.replica = replica
        self.seed = int(seed)
        self._core_factory = core_factory
        """Builds the vLLM host from (on_delta, on_error); default: from ``config.core``."""
        self._core: Any = None
        self._spec: CheckpointSpec | None = None
        self.max_context: int | None = None
        self.vocab_size: int | None = None

        self._version = 0
        self._started = False
        self._closed = False
        self._paused = False
        self._frozen = False
        self._kv_released = False
        self._weights_dirty = False
        self._resumed: asyncio.Event | None = None
        self._drained: asyncio.Event | None = None
        self._ids = itertools.count()
        self._requests: dict[str, _Request] = {}
        self._blocked = 0

        self._num_requests = 0
        self._num_aborted = 0
        self._generated = 0
        self._prompt_tokens = 0
        self._hit_tokens = 0
        self._weight_loads = 0
        self._tensors_loaded = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Read the checkpoint's tensor names and start vLLM. Idempotent."""
        if self._started:
            return
        if self._closed:
            raise RuntimeError("VLLMEngine: start() after shutdown()")
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._spec = await asyncio.to_thread(read_checkpoint_spec, self.model_path)
        self.vocab_size = self._spec.vocab_size
        if self._core_factory is not None:
            self._core = self._core_factory(self._on_delta, self._on_error)
        else:
            args = self.config.engine_args(model_path=self.model_path, seed=self.seed)
            if self.config.core == "thread":
                self._core = ThreadCore(args, self._on_delta, self._on_error, step_delay_s=self.config.step_delay_s,
                                        stream_tokens=self.config.stream_tokens)
            else:
                self._core = ProcessCore(args, self._on_delta, self._on_error)
        await self._core.start()
        self.max_context = int(self._core.max_model_len) or self._spec.max_position_embeddings
        self._started = True
        log.info("vLLM engine %s started (%s core, max_model_len %s)", self.replica, self.config.core, self.max_context)

    async def shutdown(self) -> None:
        """Answer every outstanding call as aborted and stop vLLM."""
        if self._closed:
            return
        self._closed = True
        for req in list(self._requests.values()):
            self._finish(req, "aborted")
        if self._resumed is not None:
            self._resumed.set()
        if self._core is not None and self._started:
            await self._core.shutdown()

    # ------------------------------------------------------------------ generation
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> TokenOutput:
        """Generate a continuation of ``prompt_ids``; see :class:`ferryman.protocols.Engine`."""
        self._validate(prompt_ids, params)
        if not self._started:
            raise RuntimeError("VLLMEngine.generate: call `await engine.start()` first")
        assert self._resumed is not None and self._drained is not None
        self._blocked += 1
        try:
            while self._paused and not self._closed:
                await self._resumed.wait()
        finally:
            self._blocked -= 1
        if self._closed:
            raise RuntimeError("VLLMEngine.generate: the engine was shut down")

        budget = params.max_tokens
        if self.max_context is not None:
            budget = min(budget, self.max_context - len(prompt_ids))
        rid = f"{request_id}#{next(self._ids)}"
        req = _Request(rid, request_id, len(prompt_ids), asyncio.get_running_loop().create_future())
        self._requests[rid] = req
        self._drained.clear()
        self._num_requests += 1
        self._prompt_tokens += len(prompt_ids)
        try:
            await self._core.add(rid, [int(t) for t in prompt_ids], params, budget)
        except BaseException:
            self._requests.pop(rid, None)
            self._notify_drained()
            raise
        if req.abort_requested and not req.future.done():
            # pause(abort=True) ran while vLLM was still taking the request
            await self._core.abort([rid])
        try:
            return await req.future
        except asyncio.CancelledError:
            # the caller gave up: stop the request in vLLM
            if self._requests.pop(rid, None) is not None:
                self._notify_drained()
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._core.abort([rid]))
            raise

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        check_generate_request(
            "VLLMEngine.generate", prompt_ids, params, vocab_size=self.vocab_size, max_context=self.max_context
        )
        bad_stop = [t for t in params.stop_token_ids if int(t) < 0]
        if bad_stop:
            raise ValueError(f"VLLMEngine.generate: negative stop token ids {bad_stop[:5]}")

    def _on_delta(self, rid: str, delta: Delta) -> None:
        req = self._requests.get(rid)
        if req is None or req.future.done():
            return
        n = len(delta.token_ids)
        if n:
            req.tokens.extend(delta.token_ids)
            req.log_probs.extend(delta.log_probs)
            for made, version in req.marks:
                if made > len(req.versions):
                    req.versions.extend([version] * (min(made, len(req.tokens)) - len(req.versions)))
            req.versions.extend([self._version] * (len(req.tokens) - len(req.versions)))
            self._generated += n
        if delta.num_cached_tokens is not None and delta.num_cached_tokens != req.cached:
            self._hit_tokens += delta.num_cached_tokens - req.cached
            req.cached = delta.num_cached_tokens
        if delta.routed_experts is not None:
            req.routed_experts = delta.routed_experts  # the whole sequence's (Delta.routed_experts)
        if delta.finish_reason is None:
            return
        reason = _REASONS.get(delta.finish_reason)
        if reason is None:
            self._on_error(rid, RuntimeError(f"vLLM ended request {req.request_id} with {delta.finish_reason!r}"))
            return
        self._finish(req, reason)

    def _on_error(self, rid: str, exc: BaseException) -> None:
        req = self._requests.pop(rid, None)
        if req is not None and not req.future.done():
            req.future.set_exception(exc)
        self._notify_drained()

    def _finish(self, req: _Request, reason: StopReason) -> None:
        self._requests.pop(req.rid, None)
        if not req.future.done():
            if reason == "aborted":
                self._num_aborted += 1
            req.future.set_result(
                TokenOutput(
                    token_ids=list(req.tokens),
                    log_probs=list(req.log_probs),
                    versions=list(req.versions),
                    stop_reason=reason,
                    routed_experts=req.routed_experts,
                    num_cached_prompt_tokens=req.cached,
                    replica=self.replica,
                )
            )
        self._notify_drained()

    def _notify_drained(self) -> None:
        if not self._requests and self._drained is not None:
            self._drained.set()

    # ------------------------------------------------------------------ control
    async def pause(self, abort: bool) -> None:
        """Stop starting requests; see :class:`ferryman.protocols.Engine` and ``pause_mode``."""
        self._require_started("pause")
        assert self._resumed is not None and self._drained is not None
        self._paused = True
        self._resumed.clear()
        if abort and self.config.pause_mode == "keep":
            if not self._frozen:
                made = await self._core.freeze()
                self._frozen = True
                for rid, count in (made or {}).items():
                    req = self._requests.get(rid)
                    if req is not None:
                        req.marks.append((int(count), self._version))
            return
        if not abort:
            await self._drained.wait()
            return
        pending = list(self._requests.values())
        for req in pending:
            req.abort_requested = True
        if pending:
            await self._core.abort([r.rid for r in pending])
            _, late = await asyncio.wait([r.future for r in pending], timeout=ABORT_GRACE_S)
            for req in pending:
                if not req.future.done():  # pragma: no cover - vLLM did not confirm in time
                    log.warning("vLLM did not confirm the abort of %s; answering with its tokens so far", req.request_id)
                    self._finish(req, "aborted")

    async def resume(self) -> None:
        self._require_started("resume")
        assert self._resumed is not None
        if self._frozen:
            await self._core.unfreeze()
            self._frozen = False
        self._paused = False
        self._resumed.set()

    async def release_kv_cache(self) -> None:
        """Free vLLM's KV cache (sleep) until :meth:`resume_kv_cache`. Requests kept by a
        ``keep`` pause still need theirs: then only the prefix cache is reset later."""
        self._require_started("release_kv_cache")
        if self._kv_released:
            return
        if not self.config.sleep_mode or self._requests:
            if self._requests:
                log.info("vLLM engine %s keeps its KV cache: %d requests are frozen in it", self.replica, len(self._requests))
            return
        await self._core.sleep(self.config.sleep_level)
        # the weights come back at once (level 1: copied back; level 2: empty memory) so that
        # load_weights has somewhere to write; the KV cache stays freed
        await self._core.wake_up(["weights"])
        self._kv_released = True

    async def resume_kv_cache(self) -> None:
        self._require_started("resume_kv_cache")
        if self._kv_released:
            await self._core.wake_up(["kv_cache"])
            self._kv_released = False

    async def load_weights(self, named_tensors: Any) -> None:
        """Load one bucket of full tensors (checkpoint / state-dict names, with or without the
        leading ``model.``). Every name and shape is checked first: on any problem a
        ValueError is raised and nothing is loaded."""
        self._require_started("load_weights")
        assert self._spec is not None
        bucket = check_bucket(named_tensors, self._spec)
        if not bucket:
            return
        self._weights_dirty = True
        await self._core.load_weights(bucket)
        self._weight_loads += 1
        self._tensors_loaded += len(bucket)

    async def set_version(self, version: int) -> None:
        """Finish a weight update: KV computed with the old weights is dropped from the prefix
        cache (and, for requests frozen by a ``keep`` pause, recomputed when they resume)."""
        self._require_started("set_version")
        if self._weights_dirty:
            ok = await self._core.reset_prefix_cache(bool(self._requests))
            if not ok:
                log.warning("vLLM engine %s could not reset its prefix cache after a weight load", self.replica)
            self._weights_dirty = False
        self._version = int(version)

    async def get_version(self) -> int:
        return self._version

    async def stats(self) -> dict[str, float]:
        core = self._core
        counter = getattr(core, "in_flight_tokens", None)
        in_flight_tokens = counter() if counter is not None else sum(len(r.tokens) for r in self._requests.values())
        return {
            "in_flight": float(len(self._requests)),
            "in_flight_tokens": float(in_flight_tokens),
            "waiting": float(self._blocked),
            "total_generated_tokens": float(self._generated),
            "num_aborted": float(self._num_aborted),
            "num_requests": float(self._num_requests),
            "prompt_tokens": float(self._prompt_tokens),
            "prefix_cache_hit_tokens": float(self._hit_tokens),
            "prefix_cache_hit_rate": float(self._hit_tokens / self._prompt_tokens) if self._prompt_tokens else 0.0,
            "version": float(self._version),
            "paused": 1.0 if self._paused else 0.0,
            "kv_released": 1.0 if self._kv_released else 0.0,
            "weight_loads": float(self._weight_loads),
            "tensors_loaded": float(self._tensors_loaded),
            "steps": float(getattr(core, "steps", 0) or 0),
            "step_seconds": float(getattr(core, "step_seconds", 0.0) or 0.0),
        }

    def _require_started(self, what: str) -> None:
        if not self._started or self._closed:
            raise RuntimeError(f"VLLMEngine.{what}: call `await engine.start()` first")
