"""A rollout engine on plain transformers: continuous batching, log-probs, abort, weight loading.

Design
------
``generate()`` validates its input, waits while the engine is paused, queues a request and
awaits its future. One background asyncio task (the *scheduler*) loops:

1. drop finished requests (storing their token ids and KV in the prefix cache),
2. admit queued requests up to ``max_batch_size`` (unless paused) — new requests join between
   steps (continuous batching),
3. run ONE step for every admitted request in a worker thread while holding the step lock (so a
   weight load never overlaps a step): new requests are prefilled (one forward each, reusing a
   cached prefix when one matches), running requests are decoded together in one batched
   forward over their KV caches, left-padded to a common length with an attention mask and
   explicit position ids,
4. sample one token per request (greedy at temperature 0, else temperature / top-k / top-p with
   the request's own ``torch.Generator`` when it gives a seed), record its log-prob under the
   temperature-scaled distribution and the engine's version, and finish requests on EOS, a stop
   token or their budget.

``pause(abort=True)`` resolves every outstanding request at once with ``stop_reason="aborted"``
and the tokens produced so far (a step still running in the thread is discarded for them).

torch and transformers are imported lazily, so importing this module (and registering the
plugin) stays cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from ferryman.config import PluginConfig
from ferryman.engine_checks import check_generate_request, check_named_tensors
from ferryman.streaming import safe_sink
from ferryman.types import SamplingParams, StopReason, TokenOutput

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)

KV = list[tuple["torch.Tensor", "torch.Tensor"]]
"""One sequence's KV cache: per layer ``(keys, values)``, each ``[1, kv_heads, length, head_dim]``."""


class HFEngineConfig(PluginConfig):
    """Configuration of the ``hf`` engine (section ``engine`` of a run config)."""

    type: Literal["hf"] = "hf"
    """Selects this engine."""
    max_batch_size: int = Field(64, ge=1)
    """Most requests decoded together in one step; further requests wait in a queue."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and activations dtype. Log-probs are always computed in float32."""
    num_threads: int = Field(1, ge=1)
    """torch intra-op threads (``torch.set_num_threads``) for this process."""
    device: str = "cpu"
    """torch device of the model: ``cpu``, ``cuda``, ``cuda:1``, ..."""
    step_delay_s: float = Field(0.0, ge=0.0)
    """Artificial delay added to every step (for tests and benchmarks of async behaviour)."""
    prefix_cache: bool = True
    """Keep the last token ids and KV cache of finished requests by request id, and reuse the KV
    when the next call with that id starts with them (partial-rollout resume, next agent turn)."""
    prefix_cache_max_entries: int = Field(256, ge=1)
    """Most request ids kept in the prefix cache (least recently used dropped first)."""


def make_hf_engine(
    config: HFEngineConfig, *, model_path: str, replica: str = "hf-0", seed: int = 0, **_: Any
) -> HFEngine:
    """Factory registered as the ``hf`` engine. The model is loaded in :meth:`HFEngine.start`."""
    return HFEngine(config, model_path=model_path, replica=replica, seed=seed)


@dataclass
class _Request:
    key: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future[TokenOutput]
    stop_ids: frozenset[int]
    max_tokens: int
    generator: Any = None
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # KV state, touched only by the step thread or by the scheduler between steps
    kv: KV | None = None
    """Own KV cache, or None while the request lives in a row of the batch cache."""
    kv_len: int = 0
    """Tokens covered by the KV cache (prompt + tokens, minus the pending last token)."""
    kv_epoch: int = -1
    prefilled: bool = False
    reuse: tuple[KV, int] | None = None
    """A prefix-cache hit to start from: (cached KV, tokens to reuse)."""
    cached_prompt_tokens: int = 0
    done: bool = False
    on_tokens: Any = None
    """``ferryman.streaming`` sink: each sampled token is delivered as the step ends."""


@dataclass
class _PrefixEntry:
    token_ids: list[int]
    kv: KV
    kv_len: int
    epoch: int


@dataclass
class _Batch:
    keys: list[int]
    kv: KV
    """Per layer ``[B, kv_heads, length, head_dim]``, rows right-aligned (left padding)."""
    mask: Any
    """``[B, length]`` attention mask (1 real, 0 padding)."""


class HFEngine:
    """A :class:`ferryman.protocols.Engine` running a transformers causal LM in-process."""

    def __init__(self, config: HFEngineConfig, *, model_path: str, replica: str = "hf-0", seed: int = 0) -> None:
        self.config = config
        self.model_path = str(model_path)
        self.replica = replica
        self.seed = int(seed)
        self.model: Any = None
        self.eos_token_ids: frozenset[int] = frozenset()
        self.vocab_size = 0
        self.max_context: int | None = None
        self._cache_kw = "past_key_values"
        self._gen: Any = None
        self._device: Any = None

        self._version = 0
        self._weights_epoch = 0
        self._kv_enabled = True
        self._started = False
        self._closed = False
        self._paused = False
        self._keys = itertools.count()

        self._waiting: deque[_Request] = deque()
        self._active: list[_Request] = []
        self._batch: _Batch | None = None
        self._prefix: OrderedDict[str, _PrefixEntry] = OrderedDict()
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._blocked = 0

        self._wakeup: asyncio.Event | None = None
        self._resumed: asyncio.Event | None = None
        self._step_lock: asyncio.Lock | None = None
        self._loop_task: asyncio.Task[None] | None = None

        self._num_requests = 0
        self._num_aborted = 0
        self._generated = 0
        self._hit_tokens = 0
        self._steps = 0
        self._step_seconds = 0.0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Load the model (in a worker thread) and start the scheduler. Idempotent."""
        if self._started:
            return
        if self._closed:
            raise RuntimeError("HFEngine: start() after shutdown()")
        import torch

        torch.set_num_threads(self.config.num_threads)
        self._wakeup = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._step_lock = asyncio.Lock()
        await asyncio.to_thread(self._load_model)
        self._gen = torch.Generator(device="cpu")
        self._gen.manual_seed(self.seed)
        self._started = True
        self._loop_task = asyncio.get_running_loop().create_task(self._scheduler(), name=f"hf-engine-{self.replica}")

    def _load_model(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.config.dtype]
        self._device = torch.device(self.config.device)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
        model.to(device=self._device, dtype=dtype)
        model.eval()
        model.requires_grad_(False)
        self.model = model

        eos: set[int] = set()
        sources: list[Any] = [model.config]
        try:
            sources.append(GenerationConfig.from_pretrained(self.model_path))
        except (OSError, ValueError):
            pass
        for src in sources:
            value = getattr(src, "eos_token_id", None)
            if isinstance(value, int):
                eos.add(value)
            elif isinstance(value, (list, tuple)):
                eos.update(int(v) for v in value)
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.max_context = getattr(model.config, "max_position_embeddings", None)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    async def shutdown(self) -> None:
        """Abort everything outstanding, stop the scheduler and drop the model."""
        if self._closed:
            return
        self._closed = True
        for req in [*self._active, *self._waiting]:
            self._finish(req, "aborted")
        self._waiting.clear()
        if self._resumed is not None:
            self._resumed.set()
        if self._wakeup is not None:
            self._wakeup.set()
        if self._loop_task is not None:
            # let a step that is running in the worker thread finish before dropping the model
            await asyncio.wait({self._loop_task}, timeout=60)
            if not self._loop_task.done():
                self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
        self._active.clear()
        self._batch = None
        self._prefix.clear()
        self._notify_drained()
        model, self.model = self.model, None
        if model is not None and self._device is not None and self._device.type == "cuda":
            import torch

            del model
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ generation
    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, *, on_tokens: Any = None
    ) -> TokenOutput:
        """Generate a continuation of ``prompt_ids``; see :class:`ferryman.protocols.Engine`.
        ``on_tokens`` (optional, :mod:`ferryman.streaming`) receives each token as its step ends."""
        self._validate(prompt_ids, params)
        if not self._started:
            raise RuntimeError("HFEngine.generate: call `await engine.start()` first")
        assert self._resumed is not None and self._wakeup is not None
        self._blocked += 1
        try:
            while self._paused and not self._closed:
                await self._resumed.wait()
        finally:
            self._blocked -= 1
        if self._closed:
            raise RuntimeError("HFEngine.generate: the engine was shut down")

        budget = params.max_tokens
        if self.max_context is not None:
            budget = min(budget, self.max_context - len(prompt_ids))
        req = _Request(
            key=next(self._keys),
            request_id=request_id,
            prompt=list(prompt_ids),
            params=params,
            future=asyncio.get_running_loop().create_future(),
            stop_ids=self.eos_token_ids | frozenset(params.stop_token_ids),
            max_tokens=budget,
            on_tokens=safe_sink(on_tokens, f"HFEngine {self.replica} {request_id}") if on_tokens is not None else None,
        )
        if params.seed is not None and params.temperature > 0:
            import torch

            req.generator = torch.Generator(device="cpu")
            req.generator.manual_seed(int(params.seed))
        self._num_requests += 1
        self._waiting.append(req)
        self._wakeup.set()
        try:
            return await req.future
        except asyncio.CancelledError:
            # the caller gave up: drop the request at the next step boundary
            req.done = True
            with contextlib.suppress(ValueError):
                self._waiting.remove(req)
            raise

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        check_generate_request(
            "HFEngine.generate", prompt_ids, params, vocab_size=self.vocab_size, max_context=self.max_context
        )

    def _finish(self, req: _Request, reason: StopReason) -> None:
        if req.done:
            return
        req.done = True
        if reason == "aborted":
            self._num_aborted += 1
        if not req.future.done():
            req.future.set_result(
                TokenOutput(
                    token_ids=list(req.tokens),
                    log_probs=list(req.log_probs),
                    versions=list(req.versions),
                    stop_reason=reason,
                    num_cached_prompt_tokens=req.cached_prompt_tokens,
                    replica=self.replica,
                )
            )
        self._notify_drained()

    def _fail(self, req: _Request, exc: BaseException) -> None:
        if req.done:
            return
        req.done = True
        if not req.future.done():
            req.future.set_exception(exc)
        self._notify_drained()

    def _in_flight(self) -> int:
        return sum(1 for r in self._active if not r.done)

    def _notify_drained(self) -> None:
        if self._drain_waiters and self._in_flight() == 0:
            waiters, self._drain_waiters = self._drain_waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)

    # ------------------------------------------------------------------ scheduler
    async def _scheduler(self) -> None:
        assert self._wakeup is not None and self._step_lock is not None
        try:
            while not self._closed:
                self._sweep()
                if not self._paused:
                    while self._waiting and len(self._active) < self.config.max_batch_size:
                        req = self._waiting.popleft()
                        if not req.done:
                            self._admit(req)
                if not self._active:
                    self._wakeup.clear()
                    if self._waiting and not self._paused:
                        continue
                    await self._wakeup.wait()
                    continue
                batch = list(self._active)
                async with self._step_lock:
                    version = self._version
                    started = time.perf_counter()
                    try:
                        results = await asyncio.to_thread(self._step, batch)
                    except Exception as exc:  # noqa: BLE001 - report to the callers, keep serving
                        log.exception("HFEngine %s: a generation step failed", self.replica)
                        for req in batch:
                            req.kv = None
                            self._fail(req, exc)
                        self._batch = None
                        continue
                    finally:
                        self._step_seconds += time.perf_counter() - started
                self._steps += 1
                for req, (token, log_prob) in zip(batch, results):
                    if req.done:  # aborted or cancelled while the step ran
                        continue
                    req.tokens.append(token)
                    req.log_probs.append(log_prob)
                    req.versions.append(version)
                    self._generated += 1
                    if req.on_tokens is not None:
                        req.on_tokens(TokenOutput(token_ids=[token], log_probs=[log_prob], versions=[version]))
                    if token in req.stop_ids:
                        self._finish(req, "stop")
                    elif len(req.tokens) >= req.max_tokens:
                        self._finish(req, "length")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # pragma: no cover - a bug; do not leave callers hanging
            log.exception("HFEngine %s: scheduler crashed", self.replica)
            for req in [*self._active, *self._waiting]:
                self._fail(req, RuntimeError(f"HFEngine scheduler crashed: {exc!r}"))
            raise

    def _admit(self, req: _Request) -> None:
        entry = self._prefix.pop(req.request_id, None)
        if entry is not None and self._prefix_usable(entry.epoch):
            common = 0
            for a, b in zip(entry.token_ids, req.prompt):
                if a != b:
                    break
                common += 1
            reuse = min(common, len(req.prompt) - 1, entry.kv_len)
            if reuse > 0:
                req.reuse = (entry.kv, reuse)
                req.cached_prompt_tokens = reuse
                self._hit_tokens += reuse
        self._active.append(req)

    def _prefix_usable(self, epoch: int) -> bool:
        return self.config.prefix_cache and self._kv_enabled and epoch == self._weights_epoch

    def _sweep(self) -> None:
        """Between steps: drop finished requests, keeping their prefix for a later call."""
        if not any(r.done for r in self._active):
            return
        keep: list[_Request] = []
        for req in self._active:
            if not req.done:
                keep.append(req)
                continue
            if req.prefilled and self._prefix_usable(req.kv_epoch):
                # a row of the batch cache is copied out; the request's own tensors are kept as is
                kv = self._own_kv(req, clone=req.kv is None)
                if kv is not None:
                    self._prefix[req.request_id] = _PrefixEntry(req.prompt + req.tokens, kv, req.kv_len, req.kv_epoch)
                    self._prefix.move_to_end(req.request_id)
                    while len(self._prefix) > self.config.prefix_cache_max_entries:
                        self._prefix.popitem(last=False)
            req.kv = None
            req.reuse = None
        self._active = keep
        if not keep:
            self._batch = None

    def _own_kv(self, req: _Request, *, clone: bool = False) -> KV | None:
        """The request's KV as its own tensors (sliced out of the batch cache if it lives there)."""
        if req.kv is not None:
            return [(k.clone(), v.clone()) for k, v in req.kv] if clone else req.kv
        batch = self._batch
        if batch is None or req.key not in batch.keys:
            return None
        row = batch.keys.index(req.key)
        out = []
        for k, v in batch.kv:
            ks = k[row : row + 1, :, k.shape[2] - req.kv_len :, :]
            vs = v[row : row + 1, :, v.shape[2] - req.kv_len :, :]
            out.append((ks.clone(), vs.clone()) if clone else (ks, vs))
        return out

    # ------------------------------------------------------------------ the step (worker thread)
    def _step(self, batch: list[_Request]) -> list[tuple[int, float]]:
        import torch

        if torch.get_num_threads() != self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        with torch.inference_mode():
            rows: dict[int, Any] = {}
            for req in batch:
                if not req.prefilled:
                    rows[req.key] = self._prefill(req)
            running = [r for r in batch if r.prefilled and r.key not in rows]
            if running:
                logits = self._decode(running)
                for i, req in enumerate(running):
                    rows[req.key] = logits[i]
            out = [self._sample(rows[req.key], req) for req in batch]
        if self.config.step_delay_s > 0:
            time.sleep(self.config.step_delay_s)
        return out

    def _forward(self, input_ids: Any, position_ids: Any, attention_mask: Any, kv: KV | None) -> tuple[Any, KV]:
        from transformers import DynamicCache

        cache = DynamicCache()
        if kv is not None:
            for layer, (k, v) in enumerate(kv):
                cache.update(k, v, layer)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        return out.logits[:, -1, :].float().cpu(), _cache_tensors(cache)

    def _prefill(self, req: _Request) -> Any:
        import torch

        start, past = 0, None
        if req.reuse is not None:
            cached, start = req.reuse
            past = [(k[:, :, :start, :], v[:, :, :start, :]) for k, v in cached]
            req.reuse = None
        ids = torch.tensor([req.prompt[start:]], dtype=torch.long, device=self._device)
        pos = torch.arange(start, len(req.prompt), dtype=torch.long, device=self._device).unsqueeze(0)
        logits, kv = self._forward(ids, pos, None, past)
        req.kv = kv
        req.kv_len = len(req.prompt)
        req.kv_epoch = self._weights_epoch
        req.prefilled = True
        return logits[0]

    def _decode(self, running: list[_Request]) -> Any:
        import torch

        keys = [r.key for r in running]
        batch = self._batch
        if batch is None or batch.keys != keys:
            batch = self._rebatch(running)
        ones = torch.ones((len(running), 1), dtype=batch.mask.dtype, device=self._device)
        mask = torch.cat([batch.mask, ones], dim=1)
        ids = torch.tensor([[r.tokens[-1]] for r in running], dtype=torch.long, device=self._device)
        pos = torch.tensor([[r.kv_len] for r in running], dtype=torch.long, device=self._device)
        logits, kv = self._forward(ids, pos, mask, batch.kv)
        self._batch = _Batch(keys=keys, kv=kv, mask=mask)
        for r in running:
            r.kv_len += 1
        return logits

    def _rebatch(self, running: list[_Request]) -> _Batch:
        """Stack the running requests' caches into one left-padded batch cache."""
        import torch

        own = [self._own_kv(r) for r in running]
        if any(kv is None for kv in own):  # pragma: no cover - invariant
            raise RuntimeError("HFEngine: a running request lost its KV cache")
        length = max(r.kv_len for r in running)
        mask = torch.zeros((len(running), length), dtype=torch.long, device=self._device)
        for i, r in enumerate(running):
            mask[i, length - r.kv_len :] = 1
        stacked: KV = []
        for layer in range(len(own[0])):  # type: ignore[arg-type]
            k0, v0 = own[0][layer]  # type: ignore[index]
            k = k0.new_zeros((len(running), k0.shape[1], length, k0.shape[3]))
            v = v0.new_zeros((len(running), v0.shape[1], length, v0.shape[3]))
            for i, r in enumerate(running):
                rk, rv = own[i][layer]  # type: ignore[index]
                k[i, :, length - r.kv_len :, :] = rk[0]
                v[i, :, length - r.kv_len :, :] = rv[0]
            stacked.append((k, v))
        for r in running:
            r.kv = None  # now lives in the batch
        return _Batch(keys=[r.key for r in running], kv=stacked, mask=mask)

    def _sample(self, logits: Any, req: _Request) -> tuple[int, float]:
        import torch

        p = req.params
        if p.temperature == 0:
            token = int(torch.argmax(logits).item())
            return token, float(torch.log_softmax(logits, dim=-1)[token].item())
        scaled = logits / p.temperature
        log_probs = torch.log_softmax(scaled, dim=-1)
        filtered = scaled
        if 0 < p.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, p.top_k).values[-1]
            filtered = filtered.masked_fill(filtered < kth, float("-inf"))
        if p.top_p < 1.0:
            probs_sorted, order = torch.sort(torch.softmax(filtered, dim=-1), descending=True)
            before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
            drop = before >= p.top_p
            drop[0] = False
            filtered = filtered.clone()
            filtered[order[drop]] = float("-inf")
        probs = torch.softmax(filtered, dim=-1)
        token = int(torch.multinomial(probs, 1, generator=req.generator or self._gen).item())
        return token, float(log_probs[token].item())

    # ------------------------------------------------------------------ control
    async def pause(self, abort: bool) -> None:
        """Stop admitting requests. ``abort=True``: every outstanding request (running or queued)
        returns now with ``stop_reason="aborted"`` and its tokens so far. ``abort=False``: wait
        until the running requests finish (queued ones wait for :meth:`resume`)."""
        self._require_started("pause")
        assert self._resumed is not None and self._wakeup is not None
        self._paused = True
        self._resumed.clear()
        if abort:
            for req in [*self._active, *self._waiting]:
                self._finish(req, "aborted")
            self._waiting.clear()
            self._wakeup.set()
            return
        if self._in_flight() == 0:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(waiter)
        await waiter

    async def resume(self) -> None:
        self._require_started("resume")
        assert self._resumed is not None and self._wakeup is not None
        self._paused = False
        self._resumed.set()
        self._wakeup.set()

    async def release_kv_cache(self) -> None:
        """Drop the prefix cache and stop filling it until :meth:`resume_kv_cache`. KV of
        requests still running is kept (they need it); pause first to free everything."""
        self._require_started("release_kv_cache")
        assert self._step_lock is not None
        self._kv_enabled = False
        self._prefix.clear()
        async with self._step_lock:
            if self._in_flight() == 0:
                self._batch = None
                for req in self._active:
                    req.kv = None
            if self._device is not None and self._device.type == "cuda":
                import torch

                torch.cuda.empty_cache()

    async def resume_kv_cache(self) -> None:
        self._require_started("resume_kv_cache")
        self._kv_enabled = True

    async def load_weights(self, named_tensors: Any) -> None:
        """Copy full tensors into the model's parameters by name.

        Names are those of the model's ``state_dict()`` (``model.layers.0...``,
        ``lm_head.weight``); names without the leading ``model.`` are accepted too. Every name
        and shape is checked first: on an unknown name, a shape mismatch or a non-tensor a
        ValueError is raised and nothing is changed. Cached prefixes are invalidated.
        """
        self._require_started("load_weights")
        import torch

        assert self._step_lock is not None
        targets = dict(self.model.state_dict(keep_vars=True))
        checked = check_named_tensors(
            list(named_tensors), {k: tuple(v.shape) for k, v in targets.items()}, who="HFEngine.load_weights"
        )
        plan = [(targets[name], tensor) for name, tensor in checked]

        def copy() -> None:
            with torch.no_grad():
                for target, tensor in plan:
                    target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))

        async with self._step_lock:
            await asyncio.to_thread(copy)
            self._weights_epoch += 1
            self._prefix.clear()

    async def set_version(self, version: int) -> None:
        self._version = int(version)

    async def get_version(self) -> int:
        return self._version

    async def stats(self) -> dict[str, float]:
        in_flight = self._in_flight()
        return {
            "in_flight": float(in_flight),
            "waiting": float(sum(1 for r in self._waiting if not r.done) + self._blocked),
            "total_generated_tokens": float(self._generated),
            "num_aborted": float(self._num_aborted),
            "num_requests": float(self._num_requests),
            "prefix_cache_hit_tokens": float(self._hit_tokens),
            "prefix_cache_entries": float(len(self._prefix)),
            "version": float(self._version),
            "steps": float(self._steps),
            "step_seconds": float(self._step_seconds),
            "paused": 1.0 if self._paused else 0.0,
        }

    def _require_started(self, what: str) -> None:
        if not self._started or self.model is None:
            raise RuntimeError(f"HFEngine.{what}: call `await engine.start()` first")


def _cache_tensors(cache: Any) -> KV:
    """Per-layer (keys, values) of a transformers cache object, across cache layouts."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache))  # transformers < 4.56
