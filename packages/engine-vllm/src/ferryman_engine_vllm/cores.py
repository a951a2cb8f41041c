"""The two ways to host vLLM's engine core under :class:`~ferryman_engine_vllm.engine.VLLMEngine`.

Both take requests by id and report every step's new tokens through one callback,
``on_delta(rid, Delta)``, called on the event loop in the order vLLM produced them; the last
delta of a request has ``finish_reason`` set (``"abort"`` after :meth:`abort`). A failure of
one request goes to ``on_error(rid, exc)``.

:class:`ThreadCore`
    vLLM's ``LLMEngine`` with its in-process core client, stepped by ONE dedicated thread. Every
    call into vLLM (add, abort, step, sleep, collective RPC) runs on that thread, in order, so a
    weight load never overlaps a step and an abort lands between two steps. vLLM's async
    scheduling is off by default here (each step finishes its batch before returning). Requests
    that arrive while a step runs enter vLLM together, just before the next step. By default a
    request is reported once, when it ends (``FINAL_ONLY``): an abort reads the tokens made so
    far from vLLM's request state, and :meth:`ThreadCore.freeze` returns each frozen request's
    token count so that the engine can stamp the tokens made before a weight update with the
    old version. Freezing (keep mode) simply stops stepping: the requests keep their place and
    KV blocks in the scheduler.
:class:`ProcessCore`
    vLLM's ``AsyncLLM``: the engine core runs in a child process and streams outputs back over
    ZeroMQ; freezing uses ``pause_generation(mode="keep")``.

vLLM is imported only when a core starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ferryman.types import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Delta:
    """New output of one request since the previous delta."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str | None = None
    """``None`` while running; then ``stop``, ``length``, ``abort``, ``error``, ``repetition``."""
    num_cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache (reported once, with the first tokens, or with
    the only hand-over of a final-only request)."""
    routed_experts: Any = None
    """``[positions][layers][top_k]`` of the WHOLE sequence, not of this delta: vLLM 0.24 sets
    ``CompletionOutput.routed_experts`` only on a request's last output (``finished``, an
    ``AsyncLLM`` abort included; DELTA kind or not), the concatenation of the prompt's routing
    (from prefill) and one position per decode step: ``prompt + generated - 1`` positions
    (``TokenOutput.routed_experts``). ``LLMEngine`` itself reports nothing for an abort;
    :class:`ThreadCore` builds that last output from vLLM's request state before aborting."""


OnDelta = Callable[[str, Delta], None]
OnError = Callable[[str, BaseException], None]


def vllm_sampling_params(params: SamplingParams, max_tokens: int, *, final_only: bool = False) -> Any:
    """ferryman's sampling parameters as vLLM's (token ids only, one log-prob per token; each
    step's new tokens, or with ``final_only`` the whole output once, when the request ends)."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VSamplingParams(
        n=1,
        max_tokens=int(max_tokens),
        temperature=float(params.temperature),
        top_p=float(params.top_p),
        top_k=int(params.top_k) if params.top_k > 0 else 0,
        seed=params.seed,
        stop_token_ids=[int(t) for t in params.stop_token_ids],
        logprobs=0,
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA,
    )


def _paused_all() -> Any:
    """vLLM's scheduler state that schedules nothing (requests keep their place)."""
    try:
        from vllm.v1.core.sched.interface import PauseState
    except ImportError:  # vLLM's stand-in in the CPU tests
        return "paused_all"
    return PauseState.PAUSED_ALL


def _abort_reason() -> Any:
    """vLLM's finish reason of an abort (its string form is ``"abort"``)."""
    try:
        from vllm.v1.engine import FinishReason
    except ImportError:  # vLLM's stand-in in the CPU tests
        return "abort"
    return FinishReason.ABORT


def token_prompt(prompt_ids: list[int]) -> Any:
    """A token-id prompt in the form this vLLM version takes."""
    try:
        from vllm.inputs import tokens_input
    except ImportError:  # pragma: no cover - older vLLM
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=list(prompt_ids))
    return tokens_input(list(prompt_ids))


def delta_from_output(out: Any) -> Delta:
    """vLLM ``RequestOutput`` to :class:`Delta` (of the DELTA kind: the step's new tokens; of
    the FINAL_ONLY kind: all of them)."""
    comp = out.outputs[0]
    token_ids = [int(t) for t in comp.token_ids]
    log_probs: list[float] = []
    lps = comp.logprobs
    if token_ids:
        if lps is None or len(lps) < len(token_ids):
            raise RuntimeError(f"vLLM returned {0 if lps is None else len(lps)} log-probs for {len(token_ids)} tokens")
        lps = lps[-len(token_ids) :]
        for i, t in enumerate(token_ids):
            log_probs.append(float(lps[i][t].logprob))
    routed = getattr(comp, "routed_experts", None)
    finish = comp.finish_reason if out.finished else None
    if out.finished and finish is None:
        finish = "abort"
    return Delta(
        token_ids=token_ids,
        log_probs=log_probs,
        finish_reason=None if finish is None else str(finish),
        num_cached_tokens=getattr(out, "num_cached_tokens", None),
        routed_experts=None if routed is None else routed.tolist(),
    )


@dataclass
class _Add:
    """A request waiting to enter vLLM (on the core thread, before the next step)."""

    rid: str
    prompt: Any
    params: Any
    done: asyncio.Future[None]


class ThreadCore:
    """vLLM's in-process ``LLMEngine``, stepped by one dedicated thread."""

    def __init__(
        self,
        engine_args: dict[str, Any],
        on_delta: OnDelta,
        on_error: OnError,
        *,
        step_delay_s: float = 0.0,
        stream_tokens: bool = False,
    ) -> None:
        self._engine_args = dict(engine_args)
        self._on_delta = on_delta
        self._on_error = on_error
        self._step_delay_s = step_delay_s
        self._stream = stream_tokens
        self._engine: Any = None
        self._ex: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pump_task: asyncio.Task[None] | None = None
        self._work = asyncio.Event()
        self._pending: list[_Add] = []
        """Requests taken but not yet in vLLM: they enter it together before the next step."""
        self._orphans: list[str] = []
        """Requests in vLLM whose caller gave up while they were entering: aborted next step."""
        self._frozen = False
        self._live: set[str] = set()
        self.max_model_len = 0
        self.steps = 0
        self.step_seconds = 0.0

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        assert self._loop is not None and self._ex is not None
        return await self._loop.run_in_executor(self._ex, fn, *args)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-core")
        self._engine = await self._call(self._build)
        self.max_model_len = int(self._engine.model_config.max_model_len)
        if not self._stream and getattr(getattr(self._engine, "output_processor", None), "request_states", None) is None:
            log.warning("this vLLM's LLMEngine has no output_processor.request_states: the thread core streams every step's tokens")
            self._stream = True
        self._pump_task = self._loop.create_task(self._pump(), name="vllm-core-pump")

    def _build(self) -> Any:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        # async_scheduling as configured, or vLLM's default (on where vLLM supports it): with it a
        # batch may still be on the GPU when step() returns, and every weight load, sleep,
        # wake-up, cache reset and keep freeze drains it first (_drain_on_thread)
        args = EngineArgs(**dict(self._engine_args))
        vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        return LLMEngine(
            vllm_config=vllm_config,
            executor_class=Executor.get_class(vllm_config),
            log_stats=False,
            multiprocess_mode=False,
        )

    # ------------------------------------------------------------------ vLLM's request state
    def _states(self, rid: str) -> list[Any]:
        """vLLM's output-side state of request ``rid`` (under its internal ids)."""
        op = self._engine.output_processor
        return [st for iid in list(op.external_req_ids.get(rid, ())) if (st := op.request_states.get(iid)) is not None]

    def _made(self, rids: list[str]) -> dict[str, int]:
        """Tokens made so far by each of ``rids`` that vLLM still holds."""
        out = {}
        for rid in rids:
            states = self._states(rid)
            if states:
                out[rid] = sum(st.detokenizer.num_output_tokens() for st in states)
        return out

    # ------------------------------------------------------------------ stepping
    def _step(self, adds: list[_Add], orphans: list[str]) -> tuple[list[BaseException | None], list[tuple[str, Delta | BaseException]], bool]:
        if orphans:
            self._engine.abort_request(orphans)
        added: list[BaseException | None] = []
        for item in adds:
            try:
                # vLLM appends a random suffix to the id it uses inside; outputs carry this one
                self._engine.add_request(item.rid, item.prompt, item.params)
                added.append(None)
            except Exception as exc:  # noqa: BLE001 - reported to that request
                added.append(exc)
        if not self._has_work():
            return added, [], False
        result = self._one_step()
        return added, result, self._has_work()

    def _one_step(self) -> list[tuple[str, Delta | BaseException]]:
        t0 = time.perf_counter()
        outs = self._engine.step()
        result: list[tuple[str, Delta | BaseException]] = []
        for out in outs:
            try:
                result.append((out.request_id, delta_from_output(out)))
            except Exception as exc:  # noqa: BLE001 - reported to that request
                result.append((out.request_id, exc))
        if self._step_delay_s:
            time.sleep(self._step_delay_s)
        self.steps += 1
        self.step_seconds += time.perf_counter() - t0
        return result

    def _inner(self) -> Any:
        """vLLM's ``EngineCore`` inside the in-process client (None without one)."""
        return getattr(self._engine.engine_core, "engine_core", None)

    def _has_work(self) -> bool:
        if self._engine.has_unfinished_requests():
            return True
        core = self._inner()
        return bool(core is not None and (core.scheduler.has_requests() or getattr(core, "batch_queue", None)))

    def _drain_on_thread(self) -> list[tuple[str, Delta | BaseException]]:
        """With async scheduling a batch may still be on the GPU after ``step()`` returned:
        finish it, scheduling nothing new meanwhile, and return its outputs. Nothing to do
        without async scheduling (each step's batch is done when it returns)."""
        core = self._inner()
        if core is None or not getattr(core, "batch_queue", None):
            return []
        sched = core.scheduler
        before = sched.pause_state
        sched.set_pause_state(_paused_all())
        result: list[tuple[str, Delta | BaseException]] = []
        try:
            while core.batch_queue:
                result.extend(self._one_step())
        finally:
            sched.set_pause_state(before)
        return result

    def _quiet_on_thread(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[list[tuple[str, Delta | BaseException]], Any]:
        drained = self._drain_on_thread()
        return drained, fn(*args)

    async def _quiet(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the core thread with no batch on the GPU; the tokens of the batch
        finished first are handed out before this returns (with the version they were made at)."""
        drained, value = await self._call(self._quiet_on_thread, fn, args)
        self._deliver(drained)
        return value

    def _deliver(self, results: list[tuple[str, Delta | BaseException]]) -> None:
        for rid, res in results:
            if rid not in self._live:
                continue
            if isinstance(res, BaseException):
                self._live.discard(rid)
                self._on_error(rid, res)
                continue
            if res.finish_reason is not None:
                self._live.discard(rid)
            self._on_delta(rid, res)

    async def _pump(self) -> None:
        while True:
            await self._work.wait()
            if self._frozen:
                self._work.clear()
                continue
            adds, self._pending = self._pending, []
            orphans, self._orphans = self._orphans, []
            try:
                added, results, more = await self._call(self._step, adds, orphans)
            except Exception as exc:  # noqa: BLE001 - the engine failed: fail every request
                log.exception("vLLM engine step failed")
                for item in adds:
                    if not item.done.done():
                        item.done.set_result(None)  # its request fails with the others, below
                for rid in list(self._live):
                    self._live.discard(rid)
                    self._on_error(rid, RuntimeError(f"vLLM engine step failed: {exc!r}"))
                self._work.clear()
                continue
            for item, err in zip(adds, added, strict=True):
                if item.done.done():  # the caller gave up while it entered vLLM
                    if err is None:
                        self._orphans.append(item.rid)
                elif err is None:
                    item.done.set_result(None)
                else:
                    self._live.discard(item.rid)
                    item.done.set_exception(err)
            self._deliver(results)
            if not more and not self._pending and not self._orphans:
                self._work.clear()

    # ------------------------------------------------------------------ requests
    async def add(self, rid: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int) -> None:
        """Queue a request; it enters vLLM before the next step (this returns once it has)."""
        assert self._loop is not None
        item = _Add(rid, token_prompt(prompt_ids), vllm_sampling_params(params, max_tokens, final_only=not self._stream),
                    self._loop.create_future())
        self._live.add(rid)
        self._pending.append(item)
        self._work.set()
        try:
            await item.done
        except BaseException:
            self._live.discard(rid)
            if item in self._pending:  # not sent yet
                self._pending.remove(item)
            raise

    def _abort_on_thread(self, rids: list[str]) -> dict[str, Delta]:
        """The final output of every request of ``rids`` that vLLM still runs (its tokens so
        far: ``LLMEngine`` reports none for an abort), then the abort itself."""
        reason = _abort_reason()
        outs: dict[str, Delta] = {}
        for rid in rids:
            for st in self._states(rid):
                out = st.make_request_output([], None, reason, None)
                if out is not None:
                    outs[rid] = delta_from_output(out)
        self._engine.abort_request(rids)
        return outs

    async def abort(self, rids: list[str]) -> None:
        live = [r for r in rids if r in self._live]
        if not live:
            return
        queued = {item.rid: item for item in self._pending}
        sent = []
        for rid in live:
            item = queued.get(rid)
            if item is None:
                sent.append(rid)
                continue
            self._pending.remove(item)  # never reached vLLM
            self._live.discard(rid)
            if not item.done.done():
                item.done.set_result(None)
            self._on_delta(rid, Delta([], [], "abort"))
        if not sent:
            return
        partial = await self._call(self._abort_on_thread, sent)
        for rid in sent:
            # a request vLLM no longer held had finished: its output comes from the pump
            if rid in self._live and rid in partial:
                self._live.discard(rid)
                self._on_delta(rid, partial[rid])

    async def freeze(self) -> dict[str, int]:
        """Stop stepping; requests stay scheduled with their KV blocks. Returns the tokens each
        frozen request has made so far (all of them already handed out when streaming)."""
        self._frozen = True
        # after the step in progress, whose outputs the pump hands out first (and, with async
        # scheduling, the batch still on the GPU)
        return await self._quiet(self._made, sorted(self._live))

    async def unfreeze(self) -> None:
        self._frozen = False
        self._work.set()

    def in_flight_tokens(self) -> int:
        """Tokens made so far by the requests in flight (read without waiting for the core
        thread: a step may be adding to them)."""
        if self._engine is None:
            return 0
        try:
            states = list(self._engine.output_processor.request_states.values())
            return sum(st.detokenizer.num_output_tokens() for st in states)
        except (AttributeError, RuntimeError):
            return 0

    # ------------------------------------------------------------------ memory and weights
    async def sleep(self, level: int) -> None:
        await self._quiet(self._engine.sleep, level)

    async def wake_up(self, tags: list[str] | None) -> None:
        await self._quiet(self._engine.wake_up, tags)

    async def load_weights(self, bucket: list[tuple[str, Any]]) -> None:
        await self._quiet(self._engine.collective_rpc, "ferryman_load_weights", None, (bucket,))

    async def reset_prefix_cache(self, reset_running: bool) -> bool:
        return bool(await self._quiet(self._engine.reset_prefix_cache, reset_running))

    async def shutdown(self) -> None:
        if self._pump_task is not None:
            self._pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pump_task
        if self._engine is not None:
            engine, self._engine = self._engine, None

            def close() -> None:
                engine.engine_core.shutdown()
                import gc

                import torch

                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()

            with contextlib.suppress(Exception):
                await self._call(close)
            del engine
        if self._ex is not None:
            self._ex.shutdown(wait=True)
            self._ex = None


class ProcessCore:
    """vLLM's ``AsyncLLM`` (engine core in a child process)."""

    def __init__(self, engine_args: dict[str, Any], on_delta: OnDelta, on_error: OnError) -> None:
        self._engine_args = dict(engine_args)
        self._on_delta = on_delta
        self._on_error = on_error
        self._llm: Any = None
        self._queues: dict[str, Any] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}
        self.max_model_len = 0
        self.steps = 0
        self.step_seconds = 0.0

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = dict(self._engine_args)
        kwargs.setdefault("disable_log_stats", True)
        args = AsyncEngineArgs(**kwargs)
        self._llm = AsyncLLM.from_engine_args(args)
        self.max_model_len = int(self._llm.model_config.max_model_len)

    def _deliver(self, rid: str, out: Any) -> bool:
        """Hand one output to the engine; True when it finished the request."""
        try:
            delta = delta_from_output(out)
        except Exception as exc:  # noqa: BLE001
            self._queues.pop(rid, None)
            self._on_error(rid, exc)
            return True
        finished = delta.finish_reason is not None
        if finished:
            self._queues.pop(rid, None)
        self._on_delta(rid, delta)
        return finished

    async def _read(self, rid: str, q: Any) -> None:
        try:
            while rid in self._queues:
                out = q.get_nowait() or await q.get()
                if self._deliver(rid, out):
                    break
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            self._queues.pop(rid, None)
            self._on_error(rid, exc)
        finally:
            self._readers.pop(rid, None)
            with contextlib.suppress(Exception):
                q.close()

    async def add(self, rid: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int) -> None:
        sp = vllm_sampling_params(params, max_tokens)
        q = await self._llm.add_request(rid, token_prompt(prompt_ids), sp)
        self._queues[rid] = q
        self._readers[rid] = asyncio.get_running_loop().create_task(self._read(rid, q), name=f"vllm-read-{rid}")

    async def abort(self, rids: list[str]) -> None:
        live = [r for r in rids if r in self._queues]
        if live:
            await self._llm.abort(live)

    async def freeze(self) -> None:
        await self._llm.pause_generation(mode="keep", clear_cache=False)
        # outputs vLLM produced before the pause but that no reader has taken yet
        for rid, q in list(self._queues.items()):
            out = q.get_nowait()
            if out is not None and self._deliver(rid, out):
                task = self._readers.pop(rid, None)
                if task is not None:
                    task.cancel()

    async def unfreeze(self) -> None:
        await self._llm.resume_generation()

    async def sleep(self, level: int) -> None:
        await self._llm.sleep(level)

    async def wake_up(self, tags: list[str] | None) -> None:
        await self._llm.wake_up(tags)

    async def load_weights(self, bucket: list[tuple[str, Any]]) -> None:
        from ferryman_engine_vllm.worker import encode_bucket

        encoded = await asyncio.to_thread(encode_bucket, bucket)
        await self._llm.collective_rpc("ferryman_load_weights", args=(encoded,))

    async def reset_prefix_cache(self, reset_running: bool) -> bool:
        return bool(await self._llm.reset_prefix_cache(reset_running))

    async def shutdown(self) -> None:
        for task in list(self._readers.values()):
            task.cancel()
        self._readers.clear()
        self._queues.clear()
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown()
