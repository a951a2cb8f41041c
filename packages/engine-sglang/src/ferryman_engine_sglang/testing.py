"""A named test double for ``sglang.Engine``, for machines without a GPU.

SGLang cannot run here (CPU-only CI), so :class:`FakeSGLangEngine` stands in for the
``sglang.Engine`` object under a real :class:`~ferryman_engine_sglang.engine.SGLangEngine`,
with the part of its interface that ferryman uses: ``async_generate`` (SGLang's keyword
arguments; unknown ones are a TypeError, unknown sampling-parameter keys too), and a
``tokenizer_manager`` with ``abort_request``, ``pause_generation``, ``continue_generation``,
``flush_cache`` (with 0.5.17's ``timeout_s``: wait for the scheduler to be idle), ``update_weights_from_tensor``, ``release_memory_occupation``,
``resume_memory_occupation``, ``context_len`` and ``max_req_input_len``; :data:`FAKE_IO` holds request objects with
the fields of SGLang's ``io_struct`` classes. It answers the way SGLang 0.5.11-0.5.17 does
where the engine depends on it, including the awkward parts:

* ``meta_info``: ``finish_reason`` dicts (``{"type": "stop", "matched": id}``, ``length``,
  ``{"type": "abort", "message": ...}``), ``completion_tokens``, ``cached_tokens``,
  ``output_token_logprobs`` as ``(log-prob, token id, None)``; streamed answers hold the whole
  output so far, except a streamed abort of a waiting request, which holds the last token only;
  outputs that came while the caller had not read the last are answered as one, the newest;
* one token per running request per step (``step_delay_s`` apart) from a deterministic
  pseudo-model whose scores depend on the loaded weights and the last tokens; log-probs are
  those of the temperature-scaled scores before top-k/top-p, raw scores at temperature 0;
  stop tokens (and EOS) are included; ``max_new_tokens`` ends a request with ``length``;
* the scheduler's length limits: ``max_req_len = min(context_len - 1, max_total_tokens - 1)``,
  ``max_req_input_len = max_req_len - 5``; a prompt of ``max_req_input_len`` tokens or more is
  answered with an abort, ``max_new_tokens`` is clipped to ``max_req_len - len(prompt) - 1``;
* a radix cache at token granularity: ``cached_tokens`` is the longest cached prefix of the
  input (never the whole input); finished and aborted requests are inserted;
* requests reach the scheduler ``admit_delay_s`` after ``async_generate`` (tokenizing); an
  abort for a request that has not reached it finds nothing and is lost, as in SGLang 0.5.11
  (``abort_semantics="0.5.17"``: the call ends with an error instead, as there); the
  scheduler aborts every request whose id *starts with* the given id; a running request
  aborted runs one more step; a waiting one is answered at once with no tokens;
* the scheduler's assertions end it (``crashed``; every later call fails): a cache flush
  requested with a weight load while requests are in it, releasing memory while it is not
  fully idle (``idle_lag_s`` after its last step, as SGLang's ``is_fully_idle``), loading weights into released weight memory, stepping with released memory, a
  weight name the model does not know.

Its scheduler is a task of this process, but it starts one real child process (with a child
of its own) to stand for SGLang's scheduler processes: ``get_all_child_pids`` names it, the
fake scheduler ends (every later call fails) once it is killed, and ``shutdown`` does what
SGLang's does: SIGKILL every descendant of the calling process, its own or not.

Constructing it configures logging as SGLang's ``Engine`` does in the calling process:
``logging.basicConfig(force=True)`` at the ``log_level`` server argument.

The GPU tests run the same engine over real SGLang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import pickle
import random
import signal
import subprocess
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from ferryman_engine_sglang.api import SGLangAPI

SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
        "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
        "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params",
    }
)
"""The fields of SGLang's ``SamplingParams`` (0.5.17)."""


@dataclass(kw_only=True)
class PauseGenerationReqInput:
    mode: str = "abort"


@dataclass(kw_only=True)
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True


@dataclass(kw_only=True)
class ReleaseMemoryOccupationReqInput:
    tags: list[str] | None = None


@dataclass(kw_only=True)
class ResumeMemoryOccupationReqInput:
    tags: list[str] | None = None


@dataclass(kw_only=True)
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: list[bytes]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    disable_draft_model: bool | None = None
    torch_empty_cache: bool = False


FAKE_IO = SimpleNamespace(
    PauseGenerationReqInput=PauseGenerationReqInput,
    ContinueGenerationReqInput=ContinueGenerationReqInput,
    ReleaseMemoryOccupationReqInput=ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput=ResumeMemoryOccupationReqInput,
    UpdateWeightsFromTensorReqInput=UpdateWeightsFromTensorReqInput,
)


def fake_serialize(named_tensors: Any) -> bytes:
    """Stands in for ``MultiprocessingSerializer.serialize`` (which sends CUDA IPC handles):
    the tensors' values, pickled."""
    return pickle.dumps([(str(n), t.detach().cpu().clone()) for n, t in named_tensors])


class SchedulerCrashed(RuntimeError):
    """The fake scheduler failed an assertion (real SGLang would have lost its scheduler)."""


@dataclass
class _Req:
    rid: str
    input_ids: list[int]
    sp: dict[str, Any]
    stream: bool
    routed: bool
    rng: random.Random
    queue: asyncio.Queue[dict[str, Any] | None]
    output: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, int, None]] = field(default_factory=list)
    cached: int = 0
    in_scheduler: bool = False
    running: bool = False
    to_finish: bool = False
    finished: bool = False
    abort_requested: bool = False


class FakeTokenizerManager:
    """The tokenizer manager part of :class:`FakeSGLangEngine` (see the module docstring)."""

    def __init__(self, engine: FakeSGLangEngine) -> None:
        self._e = engine
        self.context_len = engine.context_len
        self.max_req_input_len = engine.max_req_len - 5
        self.rid_to_state: dict[str, _Req] = {}
        self._flush_pending = False

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self._e.calls.append(("abort_request", rid, abort_all))
        if not abort_all and rid not in self.rid_to_state:
            return  # an id it does not know (yet) is ignored
        if self._e.abort_semantics == "0.5.17" and not abort_all:
            self.rid_to_state[rid].abort_requested = True  # checked before it is sent on
        self._e._send(lambda: self._e._sched_abort(rid, abort_all))

    async def pause_generation(self, obj: PauseGenerationReqInput) -> None:
        assert isinstance(obj, PauseGenerationReqInput), obj
        self._e.calls.append(("pause_generation", obj.mode))
        self._e.is_pause = True
        if obj.mode == "abort":
            self.abort_request(abort_all=True)
        else:
            self._e._send(lambda: setattr(self._e, "engine_paused", True))

    async def continue_generation(self, obj: ContinueGenerationReqInput) -> None:
        assert isinstance(obj, ContinueGenerationReqInput), obj
        self._e.calls.append(("continue_generation",))
        self._e.is_pause = False
        self._e._send(lambda: setattr(self._e, "engine_paused", False))
        self._e._wake()

    async def flush_cache(self, timeout_s: float | None = None) -> Any:
        e = self._e
        e._check_alive()
        e.flush_timeouts.append(timeout_s)
        if self._flush_pending:
            e.calls.append(("flush_cache", False))
            return SimpleNamespace(success=False, message="Another flush_cache is already in progress.")
        if timeout_s and timeout_s > 0 and not e.idle():  # 0.5.17's deferred flush
            loop = asyncio.get_running_loop()
            deadline = loop.time() + float(timeout_s)
            self._flush_pending = True
            try:
                while not e.idle() and loop.time() < deadline:
                    await asyncio.sleep(0.001)
                    e._check_alive()
            finally:
                self._flush_pending = False
        ok = e.idle()
        e.calls.append(("flush_cache", ok))
        if ok:
            e.cache.clear()
        return SimpleNamespace(success=ok, message="" if ok else "Cache not flushed because there are pending requests.")

    async def update_weights_from_tensor(self, obj: UpdateWeightsFromTensorReqInput, request: Any = None) -> tuple[bool, str]:
        e = self._e
        assert isinstance(obj, UpdateWeightsFromTensorReqInput), obj
        e._check_alive()
        if len(obj.serialized_named_tensors) != e.tp_size:
            e._crash(f"{len(obj.serialized_named_tensors)} payloads for tp_size {e.tp_size}")
        bucket = pickle.loads(obj.serialized_named_tensors[0])
        for other in obj.serialized_named_tensors[1:]:
            if [n for n, _ in pickle.loads(other)] != [n for n, _ in bucket]:
                e._crash("the tensor-parallel ranks got different buckets")
        e.calls.append(("update_weights_from_tensor", [n for n, _ in bucket], obj.flush_cache, obj.load_format))
        await asyncio.sleep(0)
        if "weights" in e.released:
            e._crash("load_weights into released weight memory")
        for name, tensor in bucket:
            if name not in e.weights:
                e._crash(f"model.load_weights: unknown parameter {name}")
            e.weights[name] = float(tensor.double().sum().item())
        if obj.flush_cache:
            if not e.idle():
                e._crash("Cache flush failed after updating weights")
            e.cache.clear()
        return True, "Success"

    async def release_memory_occupation(self, obj: ReleaseMemoryOccupationReqInput, request: Any = None) -> None:
        e = self._e
        assert isinstance(obj, ReleaseMemoryOccupationReqInput), obj
        e._check_alive()
        e.calls.append(("release_memory_occupation", list(obj.tags or [])))
        if not e.idle():
            e._crash("release_memory_occupation should be called only when server is idle.")
        tags = obj.tags or ["kv_cache", "weights", "cuda_graph"]
        e.released.update(tags)
        if "kv_cache" in tags:
            e.cache.clear()

    async def resume_memory_occupation(self, obj: ResumeMemoryOccupationReqInput, request: Any = None) -> None:
        e = self._e
        assert isinstance(obj, ResumeMemoryOccupationReqInput), obj
        e._check_alive()
        e.calls.append(("resume_memory_occupation", list(obj.tags or [])))
        for tag in obj.tags or ["kv_cache", "weights", "cuda_graph"]:
            if tag not in e.released:
                e._crash(f"resume_memory_occupation({tag}) of memory that was not released")
            e.released.discard(tag)


class FakeWatchdog:
    """Stands in for SGLang's ``SubprocessWatchdog`` (``stop()`` only)."""

    stopped = False

    def stop(self) -> None:
        self.stopped = True


class FakeSGLangEngine:
    """Test double for ``sglang.Engine`` (see the module docstring)."""

    def __init__(
        self,
        server_args: dict[str, Any],
        *,
        vocab_size: int,
        initial_weights: dict[str, float],
        eos_id: int = 2,
        context_len: int = 512,
        max_total_tokens: int = 65536,
        step_delay_s: float = 0.002,
        admit_delay_s: float = 0.001,
        num_layers: int = 2,
        experts_per_token: int = 2,
        abort_semantics: str = "0.5.11",
        idle_lag_s: float = 0.0,
    ) -> None:
        # as SGLang's Engine does in the calling process (configure_logger)
        logging.basicConfig(
            level=getattr(logging, str(server_args.get("log_level", "info")).upper()), format="[%(asctime)s] %(message)s", force=True
        )
        self.server_args = dict(server_args)
        self.tp_size = int(server_args.get("tp_size", 1))
        self.vocab_size = vocab_size
        self.weights = dict(initial_weights)
        """Parameter name to checksum (sum of the tensor) of what was loaded."""
        self.eos_id = eos_id
        self.context_len = context_len
        self.max_total_tokens = max_total_tokens
        """Size of the KV cache pool in tokens."""
        self.max_req_len = min(context_len - 1, max_total_tokens - 1)
        self.step_delay_s = step_delay_s
        self.admit_delay_s = admit_delay_s
        self.num_layers = num_layers
        self.experts_per_token = experts_per_token
        self.abort_semantics = abort_semantics
        """``0.5.11``: an abort that reaches the scheduler before its request is lost.
        ``0.5.17``: the tokenizer manager marks the request and ends it with an error before
        sending it on (``RequestAbortedError``)."""
        self.idle_lag_s = idle_lag_s
        """The scheduler is fully idle only this long after its last step (SGLang: its last
        batch and the overlap scheduler's result queue are cleared a loop iteration later)."""
        self._busy_until = 0.0
        self.tokenizer_manager = FakeTokenizerManager(self)
        self.calls: list[tuple[Any, ...]] = []
        """Control calls in order: ("abort_request", rid, abort_all), ("flush_cache", ok), ..."""
        self.flush_timeouts: list[float | None] = []
        """The ``timeout_s`` of every ``flush_cache`` call."""
        self.generate_kwargs: list[dict[str, Any]] = []
        """The keyword arguments of every ``async_generate`` call."""
        self.prefix_aborted: list[tuple[str, str]] = []
        """(abort id, request id) where an abort hit a request through a prefix match only."""
        self.cache: set[tuple[int, ...]] = set()
        self.released: set[str] = set()
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.is_pause = False
        self.engine_paused = False
        self.crashed: str | None = None
        self.steps = 0
        self._shut_down = False
        self._task: asyncio.Task[None] | None = None
        self._work: asyncio.Event | None = None
        # its "scheduler process", with a child of its own (ends with this process: stdin EOF)
        self._procs = [
            subprocess.Popen(
                ["sh", "-c", "exec 3<&0; cat <&3 & wait"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        ]
        self.tokenizer_manager._subprocess_watchdog = FakeWatchdog()
        self._unpaused: asyncio.Event | None = None

    @classmethod
    def factory(cls, made: list[FakeSGLangEngine] | None = None, **kwargs: Any) -> Any:
        """An ``sglang_factory`` for :func:`~ferryman_engine_sglang.engine.make_sglang_engine`;
        the engines it builds are appended to ``made``."""

        def build(server_args: dict[str, Any]) -> tuple[FakeSGLangEngine, SGLangAPI]:
            engine = cls(server_args, **kwargs)
            if made is not None:
                made.append(engine)
            return engine, SGLangAPI(engine_cls=cls, io=FAKE_IO, serialize=fake_serialize, version="0.5.17-fake")

        return build

    # ------------------------------------------------------------------ the pseudo-model
    def _scores(self, context: list[int]) -> list[float]:
        key = round(sum(self.weights.values()), 3)
        rng = random.Random(hash((key, tuple(context[-3:]))))
        return [rng.gauss(0.0, 2.0) for _ in range(self.vocab_size)]

    @staticmethod
    def _log_softmax(xs: list[float]) -> list[float]:
        m = max(xs)
        z = m + math.log(sum(math.exp(x - m) for x in xs))
        return [x - z for x in xs]

    def _next(self, req: _Req) -> tuple[int, float]:
        scores = self._scores(req.input_ids + req.output)
        t = float(req.sp.get("temperature", 1.0))
        if t < 1e-6:
            lp = self._log_softmax(scores)
            token = max(range(len(scores)), key=scores.__getitem__)
            return token, lp[token]
        lp = self._log_softmax([s / t for s in scores])
        allowed = sorted(range(len(lp)), key=lambda i: -lp[i])
        top_k = int(req.sp.get("top_k", -1))
        if top_k > 0:
            allowed = allowed[:top_k]
        top_p, mass, kept = float(req.sp.get("top_p", 1.0)), 0.0, []
        for i in allowed:
            kept.append(i)
            mass += math.exp(lp[i])
            if mass >= top_p:
                break
        token = req.rng.choices(kept, weights=[math.exp(lp[i]) for i in kept])[0]
        return token, lp[token]  # SGLang: log-prob before the truncation

    # ------------------------------------------------------------------ the scheduler
    def _ensure_loop(self) -> None:
        if self._task is None:
            self._work = asyncio.Event()
            self._unpaused = asyncio.Event()
            self._unpaused.set()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _wake(self) -> None:
        if self._work is not None:
            self._work.set()

    def _send(self, fn: Any) -> None:
        """A message to the scheduler: handled a moment later, in order."""
        self._ensure_loop()
        asyncio.get_running_loop().call_soon(fn)
        self._wake()

    def _check_alive(self) -> None:
        if self.shut_down:
            raise SchedulerCrashed("fake SGLang scheduler process is gone")
        if self.crashed is not None:
            raise SchedulerCrashed(f"fake SGLang scheduler is dead: {self.crashed}")

    def _crash(self, why: str) -> None:
        self.crashed = why
        for req in self.waiting + self.running:
            req.finished = True
            req.queue.put_nowait(None)
        self.waiting, self.running = [], []
        raise SchedulerCrashed(f"fake SGLang scheduler: {why}")

    def idle(self) -> bool:
        if self.waiting or self.running:
            return False
        return self._task is None or asyncio.get_running_loop().time() >= self._busy_until

    def _match(self, ids: list[int]) -> int:
        best = 0
        for end in range(1, len(ids)):  # never the whole input
            if tuple(ids[:end]) in self.cache:
                best = end
        return best

    def _insert(self, ids: list[int]) -> None:
        for end in range(1, len(ids) + 1):
            self.cache.add(tuple(ids[:end]))

    def _answer(self, req: _Req, finish: dict[str, Any] | None, *, abort_in_queue: bool = False) -> None:
        total = len(req.output)
        ids = list(req.output)
        if abort_in_queue and req.stream:
            ids = ids[-1:]  # SGLang's streamed abort answer: the last token only
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finish,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": total,
            "cached_tokens": req.cached,
            "output_token_logprobs": list(req.logprobs),
            "weight_version": "default",
        }
        if req.routed and finish is not None:
            import base64

            import numpy as np

            positions = len(req.input_ids) + total - 1
            flat = np.arange(positions * self.num_layers * self.experts_per_token, dtype=np.int32) % 7
            meta["routed_experts"] = base64.b64encode(flat.tobytes()).decode()
        if finish is not None or req.stream:
            req.queue.put_nowait({"output_ids": ids, "meta_info": meta})
        if finish is not None:
            req.finished = True
            self.tokenizer_manager.rid_to_state.pop(req.rid, None)
            req.queue.put_nowait(None)

    def _sched_abort(self, rid: str, abort_all: bool) -> None:
        for req in list(self.waiting):
            if abort_all or req.rid.startswith(rid):
                if req.rid != rid and not abort_all:
                    self.prefix_aborted.append((rid, req.rid))
                self.waiting.remove(req)
                self._answer(req, {"type": "abort", "message": "Abort in waiting queue"}, abort_in_queue=True)
        for req in self.running:
            if abort_all or req.rid.startswith(rid):
                if req.rid != rid and not abort_all:
                    self.prefix_aborted.append((rid, req.rid))
                req.to_finish = True  # runs one more step

    async def _run(self) -> None:
        assert self._work is not None
        while True:
            if self._scheduler_gone():
                return
            if self.crashed or self.engine_paused or not (self.waiting or self.running):
                self._work.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._work.wait(), 0.05)
                continue
            await asyncio.sleep(self.step_delay_s)
            if self.crashed or self.engine_paused:
                continue
            if self.released & {"kv_cache", "weights"}:
                with contextlib.suppress(SchedulerCrashed):
                    self._crash(f"stepped with released memory {sorted(self.released)}")
                continue
            self.steps += 1
            self._busy_until = asyncio.get_running_loop().time() + self.idle_lag_s
            for req in self.waiting:  # prefill
                req.cached = self._match(req.input_ids)
                req.running = True
                self.running.append(req)
            self.waiting = []
            for req in list(self.running):
                token, lp = self._next(req)
                req.output.append(token)
                req.logprobs.append((lp, token, None))
                finish = None
                stops = set(req.sp.get("stop_token_ids") or [])
                if req.to_finish:
                    finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                elif token == self.eos_id or token in stops:
                    finish = {"type": "stop", "matched": token}
                elif len(req.output) >= int(req.sp.get("max_new_tokens", 128)):
                    finish = {"type": "length", "length": len(req.output)}
                if finish is not None:
                    self.running.remove(req)
                    self._insert(req.input_ids + req.output)
                self._answer(req, finish)

    # ------------------------------------------------------------------ sglang.Engine API
    async def async_generate(
        self,
        prompt: Any = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
        image_data: Any = None,
        audio_data: Any = None,
        video_data: Any = None,
        mm_hashes: Any = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        token_ids_logprob: Any = None,
        lora_path: Any = None,
        custom_logit_processor: Any = None,
        require_reasoning: bool = False,
        return_hidden_states: Any = False,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        stream: bool = False,
        bootstrap_host: Any = None,
        bootstrap_port: Any = None,
        bootstrap_room: Any = None,
        routed_dp_rank: Any = None,
        disagg_prefill_dp_rank: Any = None,
        data_parallel_rank: Any = None,
        external_trace_header: Any = None,
        rid: str | None = None,
        session_params: Any = None,
        priority: Any = None,
        session_id: Any = None,
    ) -> Any:
        call = dict(locals())
        call.pop("self")
        self._check_alive()
        self._ensure_loop()
        self.generate_kwargs.append(call)
        sp = dict(sampling_params or {})
        unknown = sorted(set(sp) - SAMPLING_KEYS)
        if unknown:
            raise TypeError(f"SamplingParams.__init__() got unexpected keyword arguments {unknown}")
        if prompt is not None or input_ids is None:
            raise ValueError("fake SGLang: ferryman sends token ids only")
        if "weights" in self.released:
            self._crash("generate with released weights")
        if rid is None:
            rid = f"auto-{len(self.generate_kwargs)}"
        if rid in self.tokenizer_manager.rid_to_state:
            raise ValueError(f"Duplicate request ID: {rid}")
        if len(input_ids) >= self.context_len:
            raise ValueError("The input is longer than the model's context length")
        bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input ids out of the vocabulary: {bad[:3]}")
        seed = sp.get("sampling_seed")
        req = _Req(rid, list(input_ids), sp, stream, return_routed_experts, random.Random(seed if seed is not None else random.randrange(2**31)), asyncio.Queue())
        self.tokenizer_manager.rid_to_state[rid] = req
        gen = self._generate(req)
        if stream:
            return gen
        return await gen.__anext__()

    async def _generate(self, req: _Req) -> Any:
        try:
            while self.is_pause:  # the tokenizer manager holds new requests while paused
                await asyncio.sleep(0.001)
            await asyncio.sleep(self.admit_delay_s)  # tokenizing, sending
            if req.abort_requested:
                raise RuntimeError(f"Request {req.rid} was aborted")  # 0.5.17's RequestAbortedError
            if req.finished:
                return
            self._check_alive()
            req.in_scheduler = True
            # the scheduler's handle_generate_request: clip max_new_tokens, refuse long prompts
            room = self.max_req_len - len(req.input_ids) - 1
            req.sp["max_new_tokens"] = max(0, min(int(req.sp.get("max_new_tokens", 128)), room))
            limit = self.tokenizer_manager.max_req_input_len
            if len(req.input_ids) >= limit:
                message = f"Input length ({len(req.input_ids)} tokens) exceeds the maximum allowed length ({limit} tokens)."
                self._answer(req, {"type": "abort", "message": message, "status_code": 400, "err_type": "BadRequestError"})
            else:
                self.waiting.append(req)
            self._wake()
            last, done = None, False
            while not done:
                item = await req.queue.get()
                if item is None:
                    break
                while not req.queue.empty():  # SGLang answers the newest of the outputs waiting
                    more = req.queue.get_nowait()
                    if more is None:
                        done = True
                        break
                    item = more
                if req.stream:
                    yield item
                last = item
            if last is None:
                raise SchedulerCrashed(f"fake SGLang scheduler is dead: {self.crashed}")
            if not req.stream:
                yield last
        finally:
            self.tokenizer_manager.rid_to_state.pop(req.rid, None)

    def _scheduler_gone(self) -> bool:
        """Its scheduler process was killed: the fake scheduler ends (within 50 ms)."""
        if all(p.poll() is None for p in self._procs):
            return False
        self._shut_down = True
        for req in self.waiting + self.running:
            req.finished = True
            req.queue.put_nowait(None)
        self.waiting, self.running = [], []
        return True

    @property
    def shut_down(self) -> bool:
        """Shut down, or its scheduler process is gone."""
        return self._shut_down or any(p.poll() is not None for p in self._procs)

    def get_all_child_pids(self) -> list[int]:
        """The processes it started (``sglang.Engine.get_all_child_pids``)."""
        return [p.pid for p in self._procs]

    def shutdown(self) -> None:
        """As ``sglang.Engine.shutdown``: stop the watchdog, then SIGKILL every descendant of
        this process (``kill_process_tree(os.getpid(), include_parent=False)``), its own or not."""
        self.tokenizer_manager._subprocess_watchdog.stop()
        from ferryman.cluster.processes import process_tree

        for pid in process_tree(os.getpid()) - {os.getpid()}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in self._procs:
            p.wait()
        self._shut_down = True
        if self._task is not None:
            self._task.get_loop().call_soon_threadsafe(self._task.cancel)
