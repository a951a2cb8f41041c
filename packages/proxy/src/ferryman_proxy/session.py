"""One agent run behind the proxy: its trajectory segments, limits and end reason.

A turn (:meth:`Session.chat`) is planned first without touching anything — is the request's
history the recorded conversation plus new messages (``extend``), a repeat of the last request
(``retry``: the agent never saw the last answer, e.g. its client timed out), or something else
(``new``: the agent rewrote its history, so a new trajectory segment starts from a full render)?
Then the engine generates, and only then is the turn committed. A request refused at any point
(bad input, a limit, an engine error) leaves the recorded trajectory exactly as it was.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferryman.client import ReplicaFailedError
from ferryman.protocols import GenerateClient
from ferryman.types import SamplingParams, TokenOutput, Trajectory

from ferryman_proxy.config import ProxyConfig
from ferryman_proxy.errors import ProxyError
from ferryman_proxy.messages import ChatRequest, KnownHistory, history_notes, message_key
from ferryman_proxy.parsers import ParsedOutput, ToolParser
from ferryman_proxy.tokenization import ChatTokenizer, NotIncremental

log = logging.getLogger(__name__)

__all__ = ["Session", "SessionResult", "TurnResult"]


@dataclass
class SessionResult:
    """What an agent run left behind, returned by ``ProxyServer.close_session``."""

    trajectories: list[Trajectory]
    """The run's trajectory segments in order (a new one starts whenever the agent rewrote its
    history); ``reward`` is unset. Empty if no chat completion succeeded."""
    end_reason: str | None
    """Why the proxy ended the session (``max_turns``, ``context_length``, ``no_tool_calls``),
    or ``None`` if the agent stopped on its own."""
    metrics: dict[str, float] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation of the last segment: the agent's last request plus the proxy's answer
    (normalised messages)."""


@dataclass
class TurnResult:
    """One answered request, before it is written as JSON or as an event stream."""

    message: dict[str, Any]
    finish_reason: str
    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float]
    token_texts: list[str] | None
    cached_tokens: int
    engine_s: float
    encode_s: float = 0.0
    """CPU time the tokenizer spent encoding this turn's new text."""
    engine_cpu_s: float = 0.0
    """CPU time of this thread while awaiting the engine (an in-process engine's own work)."""


@dataclass
class _Segment:
    traj: Trajectory
    messages: list[dict[str, Any]]
    keys: list[Any]
    tools: list[dict[str, Any]] | None
    pending: int
    """Backfilled tokens at the end of the response (end-of-turn if the model did not write it,
    then the template's tail), replaced by the in-context tokenization at the next turn."""
    model_wrote_end: bool
    request_keys: list[Any]
    """Keys of the messages of the last request (to recognise a retry)."""
    answer_start: int
    """Response length before the last answer's model tokens (where a retry rewinds to)."""
    routed: list[Any] | None = None
    """Routed experts (MoE) per position of ``prompt_ids + response_ids`` from 0, as the last
    turn that reported them returned them (``TokenOutput.routed_experts``: its prompt was this
    segment's tokens so far); shorter than the segment past that turn's last model token."""
    turns: int = 0

    def truncate(self, n: int) -> None:
        t = self.traj
        del t.response_ids[n:], t.response_mask[n:], t.rollout_log_probs[n:], t.token_versions[n:]
        if self.routed is not None:
            del self.routed[len(t.prompt_ids) + n :]

    def full_ids(self) -> list[int]:
        return self.traj.prompt_ids + self.traj.response_ids


@dataclass
class _Plan:
    kind: str  # "new" | "extend" | "retry"
    prompt_ids: list[int]
    observation: list[int] = field(default_factory=list)
    reason: str = ""
    mismatch_at: int | None = None


class Session:
    """A session: created only by the rollout side (``ProxyServer.open_session``) and reachable
    only through its unguessable secret, ``base_url = f"{server.url}/sess/{secret}/v1"``."""

    def __init__(
        self,
        *,
        secret: str,
        request_id: str,
        params: SamplingParams,
        base_url: str,
        model_name: str,
        client: GenerateClient | None,
        chat_tokenizer: ChatTokenizer,
        parser: ToolParser,
        config: ProxyConfig,
    ) -> None:
        self.secret = secret
        self.request_id = request_id
        self.params = params
        self.base_url = base_url
        self.model_name = model_name
        self.client = client
        self.end_reason: str | None = None
        self.closed = False
        self.in_flight = 0
        """Requests of this session being handled now (the server's per-session limit)."""
        self.bucket: tuple[float, float] | None = None
        """The rate limit's token bucket: (tokens, monotonic time of the last refill)."""
        self._ct = chat_tokenizer
        self._parser = parser
        self._config = config
        self._lock = asyncio.Lock()
        self._done: list[_Segment] = []
        self._current: _Segment | None = None
        self.turns = 0
        self.known = KnownHistory()
        """The last answered request's messages and tools as received and as normalised, to
        skip re-validating the history the agent sends again (``messages.KnownHistory``)."""
        self._consecutive_no_tool = 0
        self._last_prompt_len = 0
        self._sampling_cache: tuple[SamplingParams, Any, SamplingParams] | None = None
        self.counters: dict[str, float] = {
            "turns": 0,
            "segments": 0,
            "history_mismatches": 0,
            "retries": 0,
            "tool_calls": 0,
            "tool_parse_errors": 0,
            "tool_choice_unmet": 0,
            "answers_without_tool_call": 0,
            "bad_requests": 0,
            "refused_requests": 0,
            "engine_errors": 0,
            "rate_limited": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "full_retokenizations": 0,
            "stop_string_cuts": 0,
            "tool_call_id_mismatches": 0,
            "unparsed_arguments": 0,
            "tokenize_s": 0.0,
            "tokenize_cpu_s": 0.0,
            "engine_s": 0.0,
        }

    # ------------------------------------------------------------------ results
    def result(self) -> SessionResult:
        segments = [*self._done, *([self._current] if self._current is not None else [])]
        trajs = []
        for i, seg in enumerate(segments):
            t = seg.traj
            t.extra.update({"segment": i, "num_segments": len(segments), "turns": seg.turns})
            if seg.routed is not None:
                t.extra["routed_experts"] = list(seg.routed)
            trajs.append(t)
        metrics = {f"proxy/{k}": float(v) for k, v in self.counters.items()}
        metrics["proxy/segments"] = float(len(segments))
        return SessionResult(
            trajectories=trajs,
            end_reason=self.end_reason,
            metrics=metrics,
            messages=list(self._current.messages) if self._current is not None else [],
        )

    def _end(self, reason: str) -> None:
        if self.end_reason is None:
            self.end_reason = reason

    def _refuse_if_ended(self) -> None:
        if self.closed:
            raise ProxyError(404, "this session is closed", code="session_not_found")
        if self.end_reason is not None:
            self.counters["refused_requests"] += 1
            if self.end_reason == "context_length":
                raise ProxyError(
                    400,
                    f"This model's maximum context length is {self._config.max_total_tokens} tokens. However, your "
                    f"messages resulted in {self._last_prompt_len} tokens. The session has ended.",
                    code="context_length_exceeded",
                    param="messages",
                )
            raise ProxyError(400, f"The session has ended ({self.end_reason}); no further requests are served.", code="session_ended")

    # ------------------------------------------------------------------ planning (no state changes)
    def _plan(self, req: ChatRequest, keys: list[Any]) -> _Plan:
        seg = self._current
        ct = self._ct
        msgs, tools = req.messages, req.tools
        if seg is not None and tools == seg.tools:
            k = len(seg.keys)
            if not ct.incremental:
                return self._plan_full(req, seg)
            if len(keys) >= k and keys[:k] == seg.keys:
                head = msgs[:1] if msgs[0]["role"] == "system" else []
                try:
                    delta = ct.delta_ids(head, seg.messages[-1], msgs[k:], tools)
                except NotIncremental as e:
                    return self._plan_new(req, "template_not_incremental: " + str(e), k)
                except Exception as e:  # noqa: BLE001 - a template error on the agent's input
                    raise ProxyError(400, f"the chat template could not render the messages: {e}", param="messages") from None
                obs = delta[1:] if seg.model_wrote_end else delta
                ids = seg.full_ids()  # the one copy of the conversation this turn makes
                del ids[len(ids) - seg.pending :]
                ids += obs
                return _Plan("extend", ids, observation=obs)
            if keys == seg.request_keys:
                return _Plan("retry", seg.full_ids()[: len(seg.traj.prompt_ids) + seg.answer_start])
            first = next((i for i, (a, b) in enumerate(zip(keys, seg.keys)) if a != b), min(len(keys), k))
            return self._plan_new(req, "history_changed", first)
        if seg is not None:
            return self._plan_new(req, "tools_changed", None)
        return self._plan_new(req, "", None)

    def _plan_new(self, req: ChatRequest, reason: str, at: int | None) -> _Plan:
        try:
            ids = self._ct.full_ids(req.messages, req.tools, True)
        except Exception as e:  # noqa: BLE001
            raise ProxyError(400, f"the chat template could not render the messages: {e}", param="messages") from None
        return _Plan("new", ids, reason=reason, mismatch_at=at)

    def _plan_full(self, req: ChatRequest, seg: _Segment) -> _Plan:
        """Fallback for templates without the prefix property: full re-tokenization, kept only if
        it extends the recorded tokens."""
        plan = self._plan_new(req, "history_changed", None)
        old = seg.full_ids()
        old = old[: len(old) - seg.pending]  # the backfilled tail is re-tokenized in context
        if len(plan.prompt_ids) > len(old) and plan.prompt_ids[: len(old)] == old:
            return _Plan("extend", plan.prompt_ids, observation=plan.prompt_ids[len(old) :], reason="full")
        plan.reason = "retokenized_prefix_differs"
        return plan

    # ------------------------------------------------------------------ a turn
    def _sampling(self, req: ChatRequest, budget: int) -> SamplingParams:
        key = (req.temperature, req.top_p, req.max_tokens, budget, tuple(req.stop), req.seed)
        cached = self._sampling_cache
        if cached is not None and cached[0] is self.params and cached[1] == key:
            return cached[2]  # agents send the same options every turn
        params = self._make_sampling(req, budget)
        self._sampling_cache = (self.params, key, params)
        return params

    def _make_sampling(self, req: ChatRequest, budget: int) -> SamplingParams:
        p = self.params
        if self._config.sampling_from == "request":
            temperature = p.temperature if req.temperature is None else req.temperature
            top_p = p.top_p if req.top_p is None else req.top_p
        else:
            temperature, top_p = p.temperature, p.top_p
        max_tokens = min(req.max_tokens or p.max_tokens, p.max_tokens, budget)
        stop_ids = set(p.stop_token_ids) | set(self._ct.stop_token_ids)
        for s in req.stop:
            ids = self._ct.encode(s)
            if len(ids) == 1:
                stop_ids.add(ids[0])
        return dataclasses.replace(
            p,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            stop_token_ids=sorted(stop_ids),
            seed=req.seed if req.seed is not None else p.seed,
        )

    async def chat(
        self,
        req: ChatRequest,
        *,
        on_tokens: Callable[[TokenOutput], None] | None = None,
        on_prompt: Callable[[list[int]], None] | None = None,
    ) -> TurnResult:
        """Answer one request. ``on_tokens``: given to the generate client (which must accept it)
        to receive the tokens as they are generated; ``on_prompt``: called with the turn's
        prompt ids just before generation starts. Neither changes what is recorded."""
        async with self._lock:
            self._refuse_if_ended()
            limit = self._config.max_turns
            if limit is not None and self.turns >= limit:
                self._end("max_turns")
                self._refuse_if_ended()
            if self.client is None:
                raise ProxyError(500, "the session has no generate client", type="server_error")
            t0, c0 = time.perf_counter(), time.thread_time()
            enc0 = self._ct.encode_s
            keys = req.keys if len(req.keys) == len(req.messages) else [message_key(m) for m in req.messages]
            plan = self._plan(req, keys)
            prompt = plan.prompt_ids
            budget = self.params.max_tokens
            self._last_prompt_len = len(prompt)
            if self._config.max_total_tokens is not None:
                room = self._config.max_total_tokens - len(prompt)
                if room < 1:
                    self._end("context_length")
                    self._refuse_if_ended()
                budget = min(budget, room)
            params = self._sampling(req, budget)
            self.counters["tokenize_s"] += time.perf_counter() - t0
            self.counters["tokenize_cpu_s"] += time.thread_time() - c0
            encode_s = self._ct.encode_s - enc0
            t_engine, c_engine = time.perf_counter(), time.thread_time()
            if on_prompt is not None:
                on_prompt(prompt)
            try:
                if on_tokens is not None:
                    out = await self.client.generate(self.request_id, prompt, params, on_tokens=on_tokens)  # type: ignore[call-arg]
                else:
                    out = await self.client.generate(self.request_id, prompt, params)
            except ValueError as e:
                self.counters["engine_errors"] += 1
                raise ProxyError(400, f"the engine refused the request: {e}") from None
            except ReplicaFailedError as e:
                self.counters["engine_errors"] += 1
                raise ProxyError(503, f"no engine replica could serve the request: {e}", type="server_error") from None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - an engine failure is the server's, not the agent's
                self.counters["engine_errors"] += 1
                log.warning("session %s: generate failed: %r", self.request_id, e)
                raise ProxyError(502, f"the engine failed: {e!r}", type="server_error") from None
            engine_s = time.perf_counter() - t_engine
            engine_cpu_s = time.thread_time() - c_engine
            self.counters["engine_s"] += engine_s
            if self.closed:
                raise ProxyError(404, "this session was closed while the request ran", code="session_not_found")
            turn = self._commit(req, keys, plan, out, engine_s)
            turn.encode_s = encode_s
            turn.engine_cpu_s = engine_cpu_s
            return turn

    def _cut_at_stop(self, ids: list[int], text: str, stops: list[str]) -> tuple[list[int], str] | None:
        hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
        if not hits:
            return None
        at, s = min(hits)
        for k in range(1, len(ids) + 1):
            if s in self._ct.decode(ids[:k]):
                return ids[:k], text[:at]
        return None  # pragma: no cover - the whole decode contains it

    def _commit(self, req: ChatRequest, keys: list[Any], plan: _Plan, out: TokenOutput, engine_s: float) -> TurnResult:
        ct = self._ct
        ids, lps, vers = list(out.token_ids), list(out.log_probs), list(out.versions)
        routed = list(out.routed_experts) if out.routed_experts is not None else None
        stop_cut = False
        body_ids = ids[:-1] if ids and ids[-1] in ct.stop_token_ids else ids
        text = ct.decode(body_ids)
        if req.stop:
            cut = self._cut_at_stop(ids, text, req.stop)
            if cut is not None:
                kept, text = cut
                n = len(kept)
                ids, lps, vers = ids[:n], lps[:n], vers[:n]
                stop_cut = True
                self.counters["stop_string_cuts"] += 1

        parsed = ParsedOutput(content=text or None) if req.tool_choice == "none" else self._parser.parse(text, req.tools)
        if parsed.error is not None:
            self.counters["tool_parse_errors"] += 1
        if req.tool_choice not in ("none", "auto") and not parsed.tool_calls:
            self.counters["tool_choice_unmet"] += 1  # "required" or a named function: no guided decoding here
        if parsed.tool_calls:
            finish = "tool_calls"
        elif not stop_cut and out.stop_reason in ("length", "aborted"):
            finish = "length"
        else:
            finish = "stop"
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        # the answer as normalize_message would make it of the message sent back (built directly,
        # without writing the arguments as JSON and reading them again)
        answer: dict[str, Any] = {"role": "assistant", "content": parsed.content or ""}
        if parsed.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
            answer["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.tool_calls
            ]

        # ---- commit: from here on nothing can fail
        seg = self._current
        first_new = {"new": 0, "extend": len(seg.keys) if seg is not None else 0}.get(plan.kind, len(req.messages))
        for key, n in history_notes(req.messages, first_new).items():
            self.counters[key] += n
        if plan.kind == "new":
            if seg is not None:
                self._done.append(seg)
                self.counters["history_mismatches"] += 1
                self._write_debug(plan, req, seg)
            seg = _Segment(
                traj=Trajectory(request_id=self.request_id, prompt_ids=list(plan.prompt_ids)),
                messages=[],
                keys=[],
                tools=req.tools,
                pending=0,
                model_wrote_end=True,
                request_keys=[],
                answer_start=0,
            )
            self._current = seg
        elif plan.kind == "extend":
            assert seg is not None
            seg.truncate(len(seg.traj.response_ids) - seg.pending)
            seg.traj.append_observation(plan.observation)
            if plan.reason == "full":
                self.counters["full_retokenizations"] += 1
        else:
            assert seg is not None
            seg.truncate(seg.answer_start)
            self.counters["retries"] += 1
        seg.answer_start = len(seg.traj.response_ids)
        if routed is not None:
            # this turn's prompt (plan.prompt_ids) is the segment's tokens so far: the routing
            # covers them and the answer (cut at a stop string: its positions past the cut go)
            seg.routed = routed[: len(plan.prompt_ids) + len(ids)]
        seg.traj.append_model_tokens(
            TokenOutput(token_ids=ids, log_probs=lps, versions=vers, stop_reason=out.stop_reason, num_aborts=out.num_aborts)
        )
        wrote_end = bool(ids) and ids[-1] == ct.turn_end_id
        backfill = ([] if wrote_end else [ct.turn_end_id]) + list(ct.tail_ids)
        seg.traj.append_observation(backfill)
        seg.pending = len(backfill)
        seg.model_wrote_end = wrote_end
        seg.messages = [*req.messages, answer]
        seg.keys = [*keys, message_key(answer)]
        # the answer as sent: an agent that sends it back unchanged is not validated again
        self.known = KnownHistory([*req.raw_messages, message], seg.messages, seg.keys, req.raw_tools, req.tools)
        seg.request_keys = keys
        seg.tools = req.tools
        seg.turns += 1

        self.turns += 1
        c = self.counters
        c["turns"] += 1
        c["prompt_tokens"] += len(plan.prompt_ids)
        c["completion_tokens"] += len(ids)
        c["tool_calls"] += len(parsed.tool_calls)
        if parsed.tool_calls:
            self._consecutive_no_tool = 0
        else:
            c["answers_without_tool_call"] += 1
            self._consecutive_no_tool += 1
            lim = self._config.max_consecutive_no_tool
            if lim is not None and self._consecutive_no_tool >= lim:
                self._end("no_tool_calls")
        return TurnResult(
            message=message,
            finish_reason=finish,
            prompt_ids=plan.prompt_ids,
            completion_ids=ids,
            log_probs=lps,
            token_texts=[ct.token_text(t) for t in ids] if req.logprobs else None,
            cached_tokens=out.num_cached_prompt_tokens,
            engine_s=engine_s,
        )

    # ------------------------------------------------------------------ debugging
    def _write_debug(self, plan: _Plan, req: ChatRequest, old: _Segment) -> None:
        folder = Path(self._config.debug_dir or os.path.join(tempfile.gettempdir(), "ferryman-proxy"))
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.request_id)[:80]
        path = folder / f"{safe}-segment{len(self._done)}-{uuid.uuid4().hex[:8]}.json"
        record = {
            "request_id": self.request_id,
            "reason": plan.reason,
            "new_segment": len(self._done),
            "first_differing_message": plan.mismatch_at,
            "tools_changed": old.tools != req.tools,
            "recorded_messages": old.messages,
            "received_messages": req.messages,
            "recorded_tokens": len(old.traj.prompt_ids) + len(old.traj.response_ids),
            "time": time.time(),
        }
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record, indent=1, ensure_ascii=False, default=str))
            log.info("session %s: history changed (%s); new segment, details in %s", self.request_id, plan.reason, path)
        except OSError as e:  # pragma: no cover - best effort
            log.warning("session %s: could not write the mismatch record %s: %r", self.request_id, path, e)
