"""The ``sglang`` rollout engine: :class:`ferryman.protocols.Engine` over an in-process
``sglang.Engine``.

Design
------
:class:`SGLangEngine` keeps ferryman's side of every request (its tokens, log-probs and the
weight version of each token) and the engine's control state (paused, version, memory
released); SGLang's ``Engine`` (tokenizer manager in this process, one scheduler process per
GPU) does the generating. Every request is sent as token ids (``skip_tokenizer_init``) with
``return_logprob=True, logprob_start_len=-1`` (log-probs of the output tokens only: a start
inside the prompt would cap the radix-cache match at that position) under an SGLang request id
of its own, ``<12 hex digits>-<ferryman request id>``: SGLang's scheduler aborts every request
whose id *starts with* the id given, and a fixed-width counter in front makes each id a prefix
of no other.

- ``generate``: checks its input (ValueError, nothing sent to SGLang; prompts as long as
  SGLang's ``max_req_input_len`` or longer included), waits while paused, and
  returns what SGLang answers: ``output_ids``, ``meta_info["output_token_logprobs"]``
  (``(log-prob, token id, None)`` triples), ``cached_tokens`` (radix-cache hit of the prompt),
  ``finish_reason["type"]`` (``stop``/``length``/``abort``) and, for MoE models,
  ``routed_experts``. SGLang streams (``stream=True``) only when the caller takes tokens as
  they come (``on_tokens``) or in ``in_place`` pause mode; otherwise it answers once.
- ``pause(abort=True)``: ``pause_mode: abort`` aborts every in-flight request in SGLang
  (``abort_request`` per id, repeated until SGLang confirms: an abort that overtakes its request
  finds nothing); each returns its tokens so far with ``stop_reason="aborted"``, zero tokens if
  it was not prefilled yet. ``keep`` aborts them the same way inside SGLang but keeps their
  calls open and resubmits them after ``resume()``. ``in_place`` is SGLang's
  ``pause_generation(mode="in_place")``. ``pause(abort=False)`` waits until in-flight requests
  finish. New calls wait for ``resume()``.
- ``release_kv_cache`` / ``resume_kv_cache``: SGLang's ``release_memory_occupation`` /
  ``resume_memory_occupation`` with the ``kv_cache`` tag (and ``weights`` in colocated mode),
  the release only after a radix-cache flush has succeeded (SGLang asserts that its scheduler
  is idle there, and a failed assertion ends the scheduler process).
- ``load_weights``: checked against the checkpoint's names and shapes first, then handed to
  SGLang's ``update_weights_from_tensor`` (one serialized copy per tensor-parallel rank; CUDA
  tensors cross as CUDA IPC handles) without a cache flush; ``set_version`` flushes the radix
  cache once after the last bucket. Flushes wait (up to ``FLUSH_WAIT_S``) for SGLang's
  scheduler to be idle, which a flush needs, except while ``in_place`` keeps requests in it:
  then the flush is immediate (it is refused) and retried when SGLang is next idle.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import itertools
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ferryman.cluster.processes import proc_stat, process_tree
from ferryman.engine_checks import CheckpointSpec, check_bucket, check_generate_request, read_checkpoint_spec
from ferryman.streaming import TokenSink, safe_sink
from ferryman.types import SamplingParams, StopReason, TokenOutput
from ferryman_engine_sglang.api import EXTRA_HINT, SGLangAPI, load_sglang, sglang_available
from ferryman_engine_sglang.config import SGLangEngineConfig

log = logging.getLogger(__name__)

SGLangFactory = Callable[[dict[str, Any]], tuple[Any, SGLangAPI]]
"""Builds ``(sglang_engine, api)`` from the engine kwargs (tests: a fake; default: SGLang)."""

_REASONS: dict[str, StopReason] = {"stop": "stop", "length": "length", "abort": "aborted"}
ABORT_RETRY_S = 0.05
"""How often ``pause(abort=True)`` repeats the aborts SGLang has not confirmed yet."""
ABORT_GRACE_S = 30.0
"""How long ``pause(abort=True)`` waits for SGLang to confirm aborts before answering itself."""
FLUSH_WAIT_S = 10.0
"""How long a waiting radix-cache flush (``flush_cache(timeout_s=...)``, SGLang 0.5.17) waits
for SGLang's scheduler to be fully idle (a flush succeeds only then)."""


def make_sglang_engine(
    config: SGLangEngineConfig,
    *,
    model_path: str,
    replica: str = "sglang-0",
    seed: int = 0,
    sglang_factory: SGLangFactory | None = None,
    **_: Any,
) -> SGLangEngine:
    """Factory registered as the ``sglang`` engine. SGLang starts in :meth:`SGLangEngine.start`;
    without SGLang installed this raises one line naming the extra to install."""
    if sglang_factory is None and not sglang_available():
        raise RuntimeError(EXTRA_HINT)
    return SGLangEngine(config, model_path=model_path, replica=replica, seed=seed, sglang_factory=sglang_factory)


def _default_factory(kwargs: dict[str, Any]) -> tuple[Any, SGLangAPI]:
    api = load_sglang()
    return api.engine_cls(**kwargs), api


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    budget: int
    on_tokens: TokenSink | None
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cached: int = 0
    routed_experts: Any = None
    rid: str = ""
    """The SGLang request id of the piece running now."""
    seen: int = 0
    """Tokens of the running piece already taken from SGLang's answers."""
    pieces: int = 0
    abort_requested: bool = False
    hold: bool = False
    """Keep mode: the abort is ferryman's own; the call resubmits after ``resume()``."""
    task: asyncio.Task[Any] | None = None
    waiting: bool = False
    """Held by a keep pause, waiting for ``resume()`` (does not count as in flight)."""


class SGLangEngine:
    """A :class:`ferryman.protocols.Engine` replica on SGLang."""

    def __init__(
        self,
        config: SGLangEngineConfig,
        *,
        model_path: str,
        replica: str = "sglang-0",
        seed: int = 0,
        sglang_factory: SGLangFactory | None = None,
    ) -> None:
        self.config = config
        self.model_path = str(model_path)
        self.replica = replica
        self.seed = int(seed)
        self._factory = sglang_factory or _default_factory
        self._sgl: Any = None
        self._api: SGLangAPI | None = None
        self._spec: CheckpointSpec | None = None
        self.max_context: int | None = None
        self.max_prompt: int | None = None
        """Prompts must be shorter than this: SGLang's ``max_req_input_len``,
        ``min(context_len - 1, KV cache pool - 1) - 5``; longer ones it aborts."""
        self.vocab_size: int | None = None
        self.tp_size = config.tensor_parallel_size

        self._version = 0
        self._started = False
        self._closed = False
        self._paused = False
        self._frozen = False
        self._kv_released = False
        self._weights_released = False
        self._weights_dirty = False
        self._cache_stale = False
        self._resumed: asyncio.Event | None = None
        self._drained: asyncio.Event | None = None
        self._ids = itertools.count()
        self._active: dict[str, _Request] = {}
        """Requests with a piece running in SGLang, by SGLang request id."""
        self._calls: set[_Request] = set()
        self._background: set[asyncio.Task[Any]] = set()
        self._blocked = 0

        self._num_requests = 0
        self._num_aborted = 0
        self._num_pieces = 0
        self._generated = 0
        self._prompt_tokens = 0
        self._hit_tokens = 0
        self._weight_loads = 0
        self._tensors_loaded = 0
        self._load_seconds = 0.0
        self._flushes_refused = 0
        self._flush_waits = False
        """SGLang's ``flush_cache`` takes ``timeout_s`` (0.5.17; earlier ones flush at once or refuse)."""
        self._flushing = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Read the checkpoint's tensor names and start SGLang. Idempotent."""
        if self._started:
            return
        if self._closed:
            raise RuntimeError("SGLangEngine: start() after shutdown()")
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._spec = await asyncio.to_thread(read_checkpoint_spec, self.model_path)
        self.vocab_size = self._spec.vocab_size
        kwargs = self.config.engine_kwargs(model_path=self.model_path, seed=self.seed)
        # built on the event loop's thread, which blocks while SGLang starts its scheduler
        # processes (once): SGLang's Engine takes the running loop as its own and registers its
        # signal handlers only on the main thread, so it is not built in a worker thread
        with _root_logging_kept(self.config.log_level):
            self._sgl, self._api = self._factory(kwargs)
        tm = self._sgl.tokenizer_manager
        context = getattr(tm, "context_len", None)
        self.max_context = int(context) if context else self._spec.max_position_embeddings
        # the scheduler's limits (set on the tokenizer manager once it is ready): it aborts a
        # prompt of max_req_input_len tokens or more and clips max_new_tokens to
        # max_req_len - len(prompt) - 1, where max_req_len = max_req_input_len + 5
        limit = getattr(tm, "max_req_input_len", None)
        self.max_prompt = int(limit) if limit else self.max_context - 6
        with contextlib.suppress(TypeError, ValueError):
            self._flush_waits = "timeout_s" in inspect.signature(tm.flush_cache).parameters
        self._started = True
        log.info(
            "SGLang engine %s started (sglang %s, context %s, prompts < %s tokens)",
            self.replica, self._api.version, self.max_context, self.max_prompt,
        )

    async def shutdown(self) -> None:
        """Answer every outstanding call as aborted and stop SGLang: this replica's SGLang
        processes only (``sglang.Engine.shutdown`` would kill every child of this process)."""
        if self._closed:
            return
        self._closed = True
        if self._resumed is not None:
            self._resumed.set()
        for req in list(self._active.values()):
            req.abort_requested = True
            if req.task is not None:
                req.task.cancel()
        if self._sgl is not None:
            sgl, self._sgl = self._sgl, None
            try:
                await asyncio.to_thread(_stop_sglang, sgl)
            except Exception:
                log.exception("SGLang engine %s: stopping SGLang failed", self.replica)

    # ------------------------------------------------------------------ generation
    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, *, on_tokens: TokenSink | None = None
    ) -> TokenOutput:
        """Generate a continuation of ``prompt_ids``; see :class:`ferryman.protocols.Engine`."""
        self._validate(prompt_ids, params)
        if not self._started:
            raise RuntimeError("SGLangEngine.generate: call `await engine.start()` first")
        await self._wait_resumed()
        budget = params.max_tokens
        if self.max_prompt is not None:
            # within SGLang's clip (max_req_len - len - 1 = max_prompt + 4 - len), and small
            # enough that a keep-mode resubmission (prompt + tokens so far) is a prompt it takes
            budget = min(budget, self.max_prompt - len(prompt_ids))
        sink = safe_sink(on_tokens, f"sglang engine {self.replica}") if on_tokens is not None else None
        req = _Request(request_id, [int(t) for t in prompt_ids], params, budget, sink)
        self._num_requests += 1
        self._prompt_tokens += len(prompt_ids)
        self._calls.add(req)
        assert self._drained is not None
        self._drained.clear()
        try:
            while True:
                reason = await self._piece(req)
                if reason != "held":
                    break
                req.waiting = True
                self._notify_drained()
                try:
                    await self._wait_resumed()  # keep pause: resubmitted after resume()
                except RuntimeError:  # shut down meanwhile
                    reason = "aborted"
                    break
                req.waiting = False
                self._drained.clear()
        finally:
            self._calls.discard(req)
            self._notify_drained()
        if reason == "aborted":
            self._num_aborted += 1
        return TokenOutput(
            token_ids=list(req.tokens),
            log_probs=list(req.log_probs),
            versions=list(req.versions),
            stop_reason=reason,
            routed_experts=req.routed_experts,
            num_cached_prompt_tokens=req.cached,
            replica=self.replica,
        )

    async def _wait_resumed(self) -> None:
        assert self._resumed is not None
        self._blocked += 1
        try:
            while self._paused and not self._closed:
                await self._resumed.wait()
        finally:
            self._blocked -= 1
        if self._closed:
            raise RuntimeError("SGLangEngine.generate: the engine was shut down")

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        check_generate_request(
            "SGLangEngine.generate", prompt_ids, params, vocab_size=self.vocab_size, max_context=self.max_context
        )
        if self.max_prompt is not None and len(prompt_ids) >= self.max_prompt:
            raise ValueError(
                f"SGLangEngine.generate: prompt of {len(prompt_ids)} tokens is too long for SGLang, which takes "
                f"prompts of fewer than {self.max_prompt} tokens (its max_req_input_len: the context of "
                f"{self.max_context} positions and the KV cache pool, less 6)"
            )
        bad_stop = [t for t in params.stop_token_ids if int(t) < 0]
        if bad_stop:
            raise ValueError(f"SGLangEngine.generate: negative stop token ids {bad_stop[:5]}")

    def sampling_params(self, params: SamplingParams, max_new_tokens: int) -> dict[str, Any]:
        """ferryman's sampling parameters as SGLang's (its ``SamplingParams`` fields)."""
        sp: dict[str, Any] = {
            "max_new_tokens": int(max_new_tokens),
            "temperature": float(params.temperature),
            "top_p": float(params.top_p),
            "top_k": int(params.top_k),
            "stop_token_ids": [int(t) for t in params.stop_token_ids],
            # the stop token (or EOS) is part of the output, as ferryman's engines return it
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }
        if params.seed is not None:
            sp["sampling_seed"] = int(params.seed)
        return sp

    async def _piece(self, req: _Request) -> StopReason | str:
        """Run one SGLang request for ``req`` (the first, or a resubmission after a keep
        pause); returns the stop reason, or ``"held"`` when a keep pause took it."""
        remaining = req.budget - len(req.tokens)
        if remaining <= 0:
            return "length"
        req.rid = f"{next(self._ids):012x}-{req.request_id}"
        req.seen = 0
        req.abort_requested = req.hold = False
        first = req.pieces == 0
        req.pieces += 1
        self._num_pieces += 1
        stream = req.on_tokens is not None or self.config.pause_mode == "in_place"
        kwargs: dict[str, Any] = {
            "input_ids": req.prompt + req.tokens,
            "sampling_params": self.sampling_params(req.params, remaining),
            "return_logprob": True,
            "logprob_start_len": -1,
            "rid": req.rid,
            "stream": stream,
        }
        if self.config.return_routed_experts:
            kwargs["return_routed_experts"] = True
        self._active[req.rid] = req
        # the SGLang call runs in a task of its own: a caller that gives up (cancels) must not
        # cancel SGLang's generator, which would forget the request while its scheduler keeps
        # running it; the request is aborted in SGLang instead, and the task ends by itself
        task = asyncio.get_running_loop().create_task(self._consume(req, kwargs, stream), name=f"sglang-{req.rid}")
        req.task = task
        try:
            out = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                req.abort_requested = True
                with contextlib.suppress(Exception):
                    self._sgl.tokenizer_manager.abort_request(rid=req.rid)
                task.add_done_callback(_swallow)
            raise
        meta = out.get("meta_info", {}) if out is not None else {}
        if first:
            req.cached = int(meta.get("cached_tokens") or 0)
        self._hit_tokens += int(meta.get("cached_tokens") or 0)
        routed = meta.get("routed_experts")
        if routed is not None:
            # the piece's whole sequence (its input_ids hold the earlier pieces' tokens):
            # replaces an earlier piece's (TokenOutput.routed_experts)
            req.routed_experts = self._decode_routed(routed)
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if out is None or kind is None:
            kind = "abort"  # the call ended without SGLang's answer (abort before it was scheduled)
        if kind == "abort" and not req.abort_requested:
            message = finish.get("message") if isinstance(finish, dict) else finish
            raise RuntimeError(f"SGLang aborted request {req.request_id}: {message}")
        reason = _REASONS.get(str(kind))
        if reason is None:
            raise RuntimeError(f"SGLang ended request {req.request_id} with {finish!r}")
        if reason == "aborted" and req.hold and not self._closed:
            return "held"
        return reason

    async def _consume(self, req: _Request, kwargs: dict[str, Any], stream: bool) -> dict[str, Any] | None:
        """The SGLang call of one piece; takes its tokens as they come. ``None`` when SGLang
        refused a request that ferryman had asked it to abort before it was scheduled."""
        last: dict[str, Any] | None = None
        try:
            if req.abort_requested:  # aborted before this task ran: nothing was sent
                return None
            result = await self._sgl.async_generate(**kwargs)
            if stream:
                # closed on the way out, error or not: SGLang's generator holds its
                # model_update_lock (reader) until it is closed
                async with contextlib.aclosing(result):
                    async for out in result:
                        self._take(req, out)
                        last = out
            else:
                self._take(req, result)
                last = result
        except asyncio.CancelledError:
            if not req.abort_requested:
                raise
        except Exception:
            # an abort that reached SGLang before its request did ends the call with an error
            # (0.5.17: RequestAbortedError): the request was not prefilled
            if not req.abort_requested:
                raise
        finally:
            self._active.pop(req.rid, None)
            self._after_piece()
        return last

    def _take(self, req: _Request, out: dict[str, Any]) -> None:
        """Append the tokens of one SGLang answer that ``req`` has not seen yet.

        ``output_ids`` and ``meta_info["output_token_logprobs"]`` hold the whole piece so far in
        SGLang's default streaming and in a final answer, but only the newest tokens with
        ``incremental_streaming_output`` and in a streamed abort answer; ``completion_tokens``
        is always the whole count, so the new tokens are the last ``completion_tokens - seen``
        of each. A streamed abort answer holds the last token id only but the log-probs of the
        whole piece: when more than one token is new there (answers coalesced while ferryman
        had not read them), the token ids are those of the ``(log-prob, token id, None)``
        entries."""
        meta = out.get("meta_info") or {}
        ids = list(out.get("output_ids") or [])
        total = int(meta.get("completion_tokens", len(ids)) or 0)
        new = total - req.seen
        if new <= 0:
            return
        lps = meta.get("output_token_logprobs") or []
        if len(ids) < new and len(lps) >= total and all(e[1] is not None for e in lps[req.seen : total]):
            ids = [int(e[1]) for e in lps[:total]]
        if len(ids) < new:
            raise RuntimeError(f"SGLang answered {len(ids)} token ids for {new} new tokens of {req.request_id}")
        new_ids = ids[req.seen : total] if len(ids) >= total else ids[len(ids) - new :]
        if len(lps) < new:
            raise RuntimeError(f"SGLang answered {len(lps)} log-probs for {new} new tokens of {req.request_id}")
        new_lps = lps[req.seen : total] if len(lps) >= total else lps[len(lps) - new :]
        values: list[float] = []
        for t, entry in zip(new_ids, new_lps):
            lp, tid = entry[0], entry[1]
            if tid is not None and int(tid) != int(t):
                raise RuntimeError(f"SGLang's log-prob entry is for token {tid}, the output token is {t}")
            if lp is None:
                raise RuntimeError(f"SGLang gave no log-prob for token {t} of {req.request_id}")
            values.append(float(lp))
        tokens = [int(t) for t in new_ids]
        versions = [self._version] * len(tokens)
        req.tokens.extend(tokens)
        req.log_probs.extend(values)
        req.versions.extend(versions)
        req.seen = total
        self._generated += len(tokens)
        if req.on_tokens is not None:
            req.on_tokens(TokenOutput(tokens, values, versions))

    def _decode_routed(self, value: Any) -> Any:
        """SGLang's routed experts (base64 of int32 ``[positions, layers, top_k]``, or a list)
        as ``[positions][layers][top_k]`` lists."""
        if not isinstance(value, (str, bytes)):
            return value.tolist() if hasattr(value, "tolist") else value
        import base64

        import numpy as np

        assert self._spec is not None
        flat = np.frombuffer(base64.b64decode(value), dtype=np.int32)
        layers, k = self._spec.num_layers, self._spec.experts_per_token
        if not layers or not k or flat.size % (layers * k):
            raise RuntimeError(f"routed experts: {flat.size} values do not split into {layers} layers x {k} experts")
        return flat.reshape(-1, layers, k).tolist()

    def _notify_drained(self) -> None:
        if self._drained is not None and all(r.waiting for r in self._calls):
            self._drained.set()

    def _after_piece(self) -> None:
        if self._active or self._frozen:
            return
        if self._cache_stale and not self._closed and not self._frozen:
            # in_place kept requests through a weight load: flush at the first idle moment
            task = asyncio.get_running_loop().create_task(self._retry_flush())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _retry_flush(self) -> None:
        if self._flushing or not self._cache_stale or self._active:
            return
        self._flushing = True  # one flush at a time: SGLang refuses a second while one waits
        try:
            if await self._flush(wait=not self._frozen):
                self._cache_stale = False
        finally:
            self._flushing = False

    # ------------------------------------------------------------------ control
    async def pause(self, abort: bool) -> None:
        """Stop starting requests; see :class:`ferryman.protocols.Engine` and ``pause_mode``."""
        self._require_started("pause")
        assert self._resumed is not None and self._drained is not None
        self._paused = True
        self._resumed.clear()
        if not abort:
            await self._drained.wait()
            return
        mode = self.config.pause_mode
        if mode == "in_place":
            if self._active and not self._frozen:
                await self._tm.pause_generation(self._io.PauseGenerationReqInput(mode="in_place"))
                self._frozen = True
            return
        pending = list(self._active.values())
        for req in pending:
            req.abort_requested = True
            req.hold = mode == "keep"
        await self._abort(pending)

    async def _abort(self, pending: list[_Request]) -> None:
        deadline = time.monotonic() + ABORT_GRACE_S
        while True:
            live = [r for r in pending if r.rid in self._active and r.task is not None and not r.task.done()]
            if not live:
                return
            if time.monotonic() > deadline:  # pragma: no cover - SGLang did not confirm in time
                for req in live:
                    log.warning("SGLang did not confirm the abort of %s; answering with its tokens so far", req.request_id)
                    req.task.cancel()  # type: ignore[union-attr]
                return
            for req in live:
                self._tm.abort_request(rid=req.rid)
            await asyncio.wait([r.task for r in live], timeout=ABORT_RETRY_S)  # type: ignore[misc]

    async def resume(self) -> None:
        self._require_started("resume")
        assert self._resumed is not None
        if self._frozen:
            await self._tm.continue_generation(self._io.ContinueGenerationReqInput())
            self._frozen = False
        self._paused = False
        self._resumed.set()

    async def release_kv_cache(self) -> None:
        """Free SGLang's KV cache (and, with ``release_weights``, the weights) until
        :meth:`resume_kv_cache`. SGLang asserts that its scheduler is idle here: while requests
        are kept by an ``in_place`` pause (until ``resume()``, even when none of ferryman's is
        left in SGLang), nothing is released."""
        self._require_started("release_kv_cache")
        if self._kv_released:
            return
        if self._active or self._frozen:
            log.info(
                "SGLang engine %s keeps its KV cache: paused in place with %d requests in it", self.replica, len(self._active)
            )
            return
        if not self.config.memory_saver:
            await self._flush(wait=True)
            return
        # SGLang asserts that its scheduler is fully idle before it releases memory (a failed
        # assertion ends the scheduler process): a flush succeeds only then, so it goes first
        if not await self._flush(wait=True):
            raise RuntimeError(
                f"SGLang engine {self.replica}: KV cache not released: SGLang's scheduler did not become idle "
                f"(its cache flush was refused{f' for {FLUSH_WAIT_S:g} s' if self._flush_waits else ''})"
            )
        tags = ["kv_cache", "weights"] if self.config.release_weights else ["kv_cache"]
        await self._tm.release_memory_occupation(self._io.ReleaseMemoryOccupationReqInput(tags=tags), None)
        self._kv_released = True
        self._weights_released = self.config.release_weights

    async def resume_kv_cache(self) -> None:
        self._require_started("resume_kv_cache")
        await self._resume_weights()
        if self._kv_released:
            await self._tm.resume_memory_occupation(self._io.ResumeMemoryOccupationReqInput(tags=["kv_cache"]), None)
            self._kv_released = False

    async def _resume_weights(self) -> None:
        if self._weights_released:
            await self._tm.resume_memory_occupation(self._io.ResumeMemoryOccupationReqInput(tags=["weights"]), None)
            self._weights_released = False

    async def load_weights(self, named_tensors: Any) -> None:
        """Load one bucket of full tensors (checkpoint / state-dict names, with or without the
        leading ``model.``). Every name and shape is checked first: on any problem a
        ValueError is raised and nothing is loaded. The tensors may be views of a transport's
        receive buffer: SGLang has copied them into the model when this returns."""
        self._require_started("load_weights")
        assert self._spec is not None and self._api is not None
        bucket = check_bucket(named_tensors, self._spec)
        if not bucket:
            return
        await self._resume_weights()
        t = time.perf_counter()
        bucket = _on_gpu(bucket)
        payload = [self._api.serialize(bucket) for _ in range(self.tp_size)]
        obj = self._io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=payload, load_format=None, flush_cache=False)
        # one flush after the last bucket (set_version), not one per bucket; a flush here
        # would also fail an assertion in SGLang's scheduler while in_place requests wait
        self._weights_dirty = True
        success, message = await self._tm.update_weights_from_tensor(obj, None)
        if not success:
            raise RuntimeError(f"SGLang engine {self.replica} failed to load weights: {message}")
        self._load_seconds += time.perf_counter() - t
        self._weight_loads += 1
        self._tensors_loaded += len(bucket)

    async def set_version(self, version: int) -> None:
        """Finish a weight update: the radix cache (KV computed with the old weights) is
        flushed (waiting for SGLang to be idle; immediate while ``in_place`` keeps requests,
        then retried when idle); tokens generated from now on carry ``version``."""
        self._require_started("set_version")
        if self._weights_dirty:
            if not await self._flush(wait=not self._frozen):
                # in_place: the paused requests hold KV; flushed when SGLang is next idle
                self._cache_stale = True
                log.warning("SGLang engine %s could not flush its radix cache (requests in it); retrying when idle", self.replica)
            self._weights_dirty = False
        self._version = int(version)

    async def _flush(self, *, wait: bool) -> bool:
        """Flush SGLang's radix cache; ``wait``: let SGLang wait up to ``FLUSH_WAIT_S`` for its
        scheduler to be idle first (immediate on SGLang releases without that)."""
        if wait and self._flush_waits:
            out = await self._tm.flush_cache(timeout_s=FLUSH_WAIT_S)
        else:
            out = await self._tm.flush_cache()
        ok = bool(getattr(out, "success", out))
        if not ok:
            self._flushes_refused += 1
        return ok

    async def get_version(self) -> int:
        return self._version

    async def stats(self) -> dict[str, float]:
        return {
            "in_flight": float(len(self._calls)),
            "in_sglang": float(len(self._active)),
            "waiting": float(self._blocked),
            "total_generated_tokens": float(self._generated),
            "num_aborted": float(self._num_aborted),
            "num_requests": float(self._num_requests),
            "num_pieces": float(self._num_pieces),
            "prompt_tokens": float(self._prompt_tokens),
            "prefix_cache_hit_tokens": float(self._hit_tokens),
            "prefix_cache_hit_rate": float(self._hit_tokens / self._prompt_tokens) if self._prompt_tokens else 0.0,
            "version": float(self._version),
            "paused": 1.0 if self._paused else 0.0,
            "kv_released": 1.0 if self._kv_released else 0.0,
            "weights_released": 1.0 if self._weights_released else 0.0,
            "cache_stale": 1.0 if self._cache_stale else 0.0,
            "flushes_refused": float(self._flushes_refused),
            "weight_loads": float(self._weight_loads),
            "tensors_loaded": float(self._tensors_loaded),
            "weight_load_seconds": float(self._load_seconds),
        }

    # ------------------------------------------------------------------ helpers
    @property
    def _tm(self) -> Any:
        return self._sgl.tokenizer_manager

    @property
    def _io(self) -> Any:
        assert self._api is not None
        return self._api.io

    def _require_started(self, what: str) -> None:
        if not self._started or self._closed:
            raise RuntimeError(f"SGLangEngine.{what}: call `await engine.start()` first")


STOP_WAIT_S = 60.0
"""How long :func:`_stop_sglang` waits for SGLang's killed processes to be gone (SGLang: 60 s)."""


def _stop_sglang(sgl: Any) -> None:
    """What ``sglang.Engine.shutdown`` (0.5.17) does, its processes only. Its last step,
    ``kill_process_tree(os.getpid(), include_parent=False)``, SIGKILLs every child of this
    process: other replicas' SGLang schedulers, vLLM engine cores. Here: stop its subprocess
    watchdog (which would otherwise answer the deaths below with SIGQUIT to this process),
    close its RPC socket, stop its weight-cache daemons (SIGTERM first, as it does), then
    SIGKILL the processes it started (``get_all_child_pids``: schedulers, data-parallel
    controller, detokenizer) with their descendants, wait until they are gone, and drop the
    ``atexit`` hook that would run ``Engine.shutdown`` at exit. An SGLang without
    ``get_all_child_pids`` gets its own ``shutdown``."""
    child_pids = getattr(sgl, "get_all_child_pids", None)
    if child_pids is None:
        log.warning("this SGLang cannot name its own processes: its shutdown kills every child of this process")
        sgl.shutdown()
        return
    watchdog = getattr(getattr(sgl, "tokenizer_manager", None), "_subprocess_watchdog", None)
    if watchdog is not None:
        watchdog.stop()
    rpc = getattr(sgl, "send_to_rpc", None)
    if rpc is not None:
        rpc.close(linger=0)
        sgl.send_to_rpc = None
    daemons = getattr(sgl, "_weight_cache_daemon_procs", None)
    if daemons:
        sgl._terminate_weight_cache_daemons(daemons)
        sgl._weight_cache_daemon_procs = []
    pids = process_tree(*(int(p) for p in child_pids()))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + STOP_WAIT_S
    while True:
        left = [pid for pid in pids if _running(pid)]
        if not left:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"SGLang's processes {left} still there {STOP_WAIT_S:g} s after SIGKILL")
        time.sleep(0.05)
    atexit.unregister(sgl.shutdown)


def _running(pid: int) -> bool:
    """Not gone and not a zombie (a zombie holds no memory; its parent reaps it)."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


@contextlib.contextmanager
def _root_logging_kept(sglang_level: str) -> Any:
    """Keep this process's root logger through SGLang's start: its ``configure_logger`` runs
    ``logging.basicConfig(force=True)`` here, which closes and replaces the root handlers and
    sets the root level to SGLang's ``log_level``. The handlers are taken off the root logger
    meanwhile (so they are not closed), put back with the level after, and SGLang's loggers in
    this process get its level on the ``sglang`` logger instead."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    for handler in handlers:
        root.removeHandler(handler)
    try:
        yield
    finally:
        for handler in list(root.handlers):  # SGLang's
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        with contextlib.suppress(ValueError, TypeError):
            logging.getLogger("sglang").setLevel(sglang_level.upper())


def _swallow(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _on_gpu(bucket: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The bucket as tensors of this process's GPU memory: they cross to SGLang's schedulers as
    CUDA IPC handles (CPU tensors would go through shared-memory file descriptors). CUDA
    tensors are copied too: those of a ``cuda_ipc`` sync are views of memory this process
    received from the trainer's, which torch refuses to share again ("Attempted to send CUDA
    tensor received from another process"). One bucket's worth of GPU memory, held until SGLang
    has loaded it."""
    import torch

    if not torch.cuda.is_available():
        return bucket
    device = torch.device("cuda", torch.cuda.current_device())
    out = [(name, t.clone() if t.is_cuda else t.to(device)) for name, t in bucket]
    torch.cuda.current_stream().synchronize()
    return out
