"""What an agent run has generated so far, and how a run resumes from it after a restart.

An agent run (``Env.run``) is a coroutine; a coroutine cannot be saved. What can be saved is
everything it received from the model: the :class:`RunRecorder` sits between the env and the
server client and keeps, per run, each finished ``generate()`` call (a digest of its prompt and
the output: token ids, log-probs, versions) and, for the call under way, the tokens produced so
far (the server client's merged output, or an aborted piece that was held back at a cut).

After a resume the run is started again with the same request id and a :class:`RunLog` to
replay: while the env asks for the same prompts, the recorded outputs are returned at once (no
engine call); the call that was under way at the cut continues from its tokens so far, exactly
like a partial-rollout resume (prompt + tokens so far, smaller budget, pieces merged, one more
``num_aborts``). An env whose next prompt differs from the record has diverged: the rest of the
record is dropped and the run goes on live (counted in ``diverged_runs``).

This is valid for envs that are a deterministic function of the task and the model's outputs
(white-box agent loops); such envs say so with a class attribute ``resumable = True``. A run of
any other env (a black-box agent in a sandbox, whose state outside the tokens is lost) is
re-dispatched from the start instead.
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from dataclasses import dataclass, field, replace
from typing import Any

from ferryman.faults import ahit
from ferryman.streaming import deliver, generate_to, safe_sink
from ferryman.types import Sample, SamplingParams, TokenOutput, Trajectory


def prompt_key(prompt_ids: list[int]) -> tuple[int, str]:
    """(length, 128-bit digest) of a prompt: enough to recognise it, much smaller to keep."""
    try:
        raw = array("q", prompt_ids).tobytes()  # C speed for a list of ints (once per generate call)
    except TypeError:  # e.g. numpy integers
        raw = array("q", (int(t) for t in prompt_ids)).tobytes()
    return len(prompt_ids), hashlib.blake2b(raw, digest_size=16).hexdigest()


def copy_output(out: TokenOutput) -> TokenOutput:
    return replace(
        out,
        token_ids=list(out.token_ids),
        log_probs=list(out.log_probs),
        versions=list(out.versions),
        routed_experts=None if out.routed_experts is None else list(out.routed_experts),
    )


def concat_outputs(first: TokenOutput | None, second: TokenOutput | None) -> TokenOutput:
    """``first`` followed by ``second`` (either may be None); stop reason of the later one.
    ``second`` resumed ``first`` (its prompt held ``first``'s tokens), so its routed experts,
    when it has them, cover both and are kept instead of ``first``'s."""
    if first is None:
        return copy_output(second) if second is not None else TokenOutput()
    if second is None:
        return copy_output(first)
    routed = second.routed_experts if second.routed_experts is not None else first.routed_experts
    return TokenOutput(
        token_ids=first.token_ids + second.token_ids,
        log_probs=first.log_probs + second.log_probs,
        versions=first.versions + second.versions,
        stop_reason=second.stop_reason,
        num_cached_prompt_tokens=first.num_cached_prompt_tokens,
        replica=second.replica or first.replica,
        num_aborts=first.num_aborts + second.num_aborts,
        routed_experts=None if routed is None else list(routed),
    )


@dataclass
class CallRecord:
    """One finished ``generate()`` call of a run."""

    prompt_len: int
    prompt_digest: str
    output: TokenOutput


@dataclass
class RunLog:
    """One agent run's model outputs so far."""

    calls: list[CallRecord] = field(default_factory=list)
    pending: tuple[int, str] | None = None
    """Prompt key of the call under way at the cut (None: the run was between calls)."""
    partial: TokenOutput | None = None
    """What that call had produced before the cut."""

    @property
    def num_tokens(self) -> int:
        n = sum(len(c.output.token_ids) for c in self.calls)
        return n + (len(self.partial.token_ids) if self.partial is not None else 0)


@dataclass
class InFlightSample:
    """A sample being generated: its runs, which are finished, and (after a resume) what to replay."""

    uid: str
    task_index: int
    created_version: int
    run_ids: list[str]
    done: dict[str, list[Trajectory]] = field(default_factory=dict)
    """Finished runs: their trajectory segments (usually one)."""
    failed: list[str] = field(default_factory=list)
    replay: dict[str, RunLog] = field(default_factory=dict)
    """Records for runs that were under way at the cut and have not started again yet."""
    complete: Sample | None = None
    """Set once every run is finished: the sample on its way to the queue."""
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class _Live:
    log: RunLog
    replay: RunLog | None
    prefix: TokenOutput | None = None
    parked: bool = False


class RunRecorder:
    """A GenerateClient for envs: records each run's outputs, replays them after a resume.

    ``client`` is the server client (it may expose ``in_progress``: request id → merged output
    of the call under way, which the recorder reads at a cut). Calls for request ids that were
    not announced with :meth:`begin` pass straight through.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self.runs: dict[str, _Live] = {}
        self.frozen = False
        """At a final cut: an aborted call is held back (parked) instead of being returned to
        the env, which would otherwise take a cut-short answer for a finished one."""
        self.replayed_calls = 0
        self.resumed_calls = 0
        self.diverged_runs = 0

    def begin(self, request_id: str, replay: RunLog | None = None) -> None:
        self.runs[request_id] = _Live(RunLog(), replay if replay is not None and (replay.calls or replay.pending) else None)

    def end(self, request_id: str) -> None:
        self.runs.pop(request_id, None)

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, *, on_tokens: Any = None
    ) -> TokenOutput:
        """``on_tokens`` (:mod:`ferryman.streaming`): the call's tokens as they come (a replayed
        call's at once, a resumed call's recorded prefix first)."""
        if on_tokens is not None:
            on_tokens = safe_sink(on_tokens, f"recorded generate {request_id}")
        live = self.runs.get(request_id)
        if live is None:
            return await generate_to(self.client, request_id, prompt_ids, params, on_tokens)
        await ahit("rollout.generate")
        key = prompt_key(prompt_ids)
        prefix: TokenOutput | None = None
        if live.replay is not None:
            rep = live.replay
            if rep.calls and (rep.calls[0].prompt_len, rep.calls[0].prompt_digest) == key:
                record = rep.calls.pop(0)
                if not rep.calls and rep.pending is None:
                    live.replay = None
                live.log.calls.append(record)
                self.replayed_calls += 1
                out = copy_output(record.output)
                deliver(out, on_tokens)
                return out
            if not rep.calls and rep.pending == key:
                prefix = rep.partial if rep.partial is not None and rep.partial.token_ids else None
            elif rep.calls or rep.pending is not None:
                self.diverged_runs += 1
            live.replay = None
        live.log.pending = key
        live.prefix = prefix
        try:
            out = await self._live_call(request_id, prompt_ids, params, prefix, on_tokens)
        finally:
            in_progress = getattr(self.client, "in_progress", None)
            if isinstance(in_progress, dict):
                in_progress.pop(request_id, None)
        if out.stop_reason == "aborted" and self.frozen:
            live.log.partial = out
            live.parked = True
            await asyncio.Event().wait()  # until the stopping run cancels it
        live.log.calls.append(CallRecord(key[0], key[1], copy_output(out)))
        live.log.pending = None
        live.prefix = None
        return out

    async def _live_call(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, prefix: TokenOutput | None, on_tokens: Any = None
    ) -> TokenOutput:
        if prefix is None:
            return await generate_to(self.client, request_id, prompt_ids, params, on_tokens)
        budget = params.max_tokens - len(prefix.token_ids)
        if budget <= 0:
            out = replace(copy_output(prefix), stop_reason="length")
            deliver(out, on_tokens)
            return out
        self.resumed_calls += 1
        deliver(prefix, on_tokens)
        out = await generate_to(self.client, request_id, list(prompt_ids) + prefix.token_ids, params.replace(max_tokens=budget), on_tokens)
        merged = concat_outputs(prefix, out)
        merged.num_aborts += 1  # the cut interrupted this generation once
        return merged

    def snapshot(self, request_id: str) -> RunLog | None:
        """A copy of what the run ``request_id`` has generated so far (None if not under way)."""
        live = self.runs.get(request_id)
        if live is None:
            return None
        log = RunLog(calls=list(live.log.calls), pending=live.log.pending)
        if live.log.pending is not None:
            if live.parked:
                log.partial = copy_output(live.log.partial) if live.log.partial is not None else None
            else:
                in_progress = getattr(self.client, "in_progress", None)
                current = in_progress.get(request_id) if isinstance(in_progress, dict) else None
                log.partial = concat_outputs(live.prefix, current) if (live.prefix or current) else None
                if log.partial is not None:
                    log.partial.stop_reason = "aborted"
        if live.replay is not None:
            # the run has not caught up with its record yet: what is left of it still counts
            log.calls.extend(live.replay.calls)
            log.pending = live.replay.pending
            log.partial = copy_output(live.replay.partial) if live.replay.partial is not None else None
        return log

    def stats(self) -> dict[str, float]:
        return {
            "replay/replayed_calls": float(self.replayed_calls),
            "replay/resumed_calls": float(self.resumed_calls),
            "replay/diverged_runs": float(self.diverged_runs),
        }
