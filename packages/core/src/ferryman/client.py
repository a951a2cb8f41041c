"""The server client: what envs call to generate.

It asks the router for a replica (sticky on the trajectory's request id), calls the engine, and
releases the replica in ``finally`` without making the caller wait. Under partial rollout an
``aborted`` answer (a weight sync cut the generation) is resumed transparently: the prompt plus
the tokens so far are sent again under the same request id (same replica, prefix cache reused),
the budget shrinks by what was already generated, and the pieces are merged with their
log-probs and per-token versions. ``routed_experts`` (MoE) is per position of the whole
sequence a piece ran (its prompt holds the earlier pieces' tokens), so the latest piece that
reports it supersedes the earlier ones. The env sees one ``generate()`` call.

Streaming (optional): ``generate(..., on_tokens=sink)`` delivers the merged generation to
``sink`` as it grows (:mod:`ferryman.streaming`): piece by piece as the engine produces them
when the engine can stream, else each piece whole when it returns. The concatenation of what
``sink`` receives is exactly the returned output's tokens (a resumed generation continues the
stream). If a replica fails after it delivered tokens, those tokens are kept and the generation
resumes from them on another replica (as after an abort), so nothing is delivered twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ferryman import trace
from ferryman.protocols import Router
from ferryman.streaming import TokenSink, accepts_on_tokens, safe_sink
from ferryman.types import SamplingParams, TokenOutput

log = logging.getLogger(__name__)


class ReplicaFailedError(RuntimeError):
    """Every retry of a request failed on the replicas available."""


class _Piece:
    """The tokens one engine call delivered through ``on_tokens``, forwarded to the caller."""

    def __init__(self, sink: TokenSink) -> None:
        self.sink = sink
        self.token_ids: list[int] = []
        self.log_probs: list[float] = []
        self.versions: list[int] = []
        self.routed: list[Any] | None = None

    def __call__(self, delta: TokenOutput) -> None:
        if not delta.token_ids:
            return
        self.token_ids.extend(delta.token_ids)
        self.log_probs.extend(delta.log_probs)
        self.versions.extend(delta.versions)
        if delta.routed_experts is not None:
            self.routed = list(delta.routed_experts)  # the whole sequence so far: supersedes
        self.sink(delta)

    def output(self) -> TokenOutput:
        """What was delivered, as an aborted piece (to resume from after a replica failed)."""
        return TokenOutput(list(self.token_ids), list(self.log_probs), list(self.versions), "aborted", routed_experts=self.routed)


class ServerClient:
    def __init__(
        self,
        router: Router,
        engines: dict[str, Any],
        *,
        partial_rollout: bool,
        max_failovers: int = 2,
    ) -> None:
        self.router = router
        self.engines = engines
        self.partial_rollout = partial_rollout
        self.max_failovers = max_failovers
        self._pending_releases: set[asyncio.Task[None]] = set()
        self.num_calls = 0
        self.num_resumes = 0
        self.num_failovers = 0
        self.generated_tokens = 0
        """Tokens the engines generated for this client, aborted-and-resumed pieces included."""
        self.in_progress: dict[str, TokenOutput] = {}
        """Request id → merged output so far of a ``generate()`` under way (read at checkpoints)."""

    def _release_later(self, request_id: str, replica: str) -> None:
        task = asyncio.ensure_future(self.router.release(request_id, replica))
        self._pending_releases.add(task)
        task.add_done_callback(self._pending_releases.discard)

    async def _acquire(self, request_id: str) -> str:
        """Ask the router for a replica. If the caller is cancelled while a (remote) router is
        deciding, the replica it still hands out afterwards is released, so no slot leaks."""
        decision = asyncio.ensure_future(self.router.acquire(request_id))
        try:
            return await asyncio.shield(decision)
        except asyncio.CancelledError:

            def release_if_granted(fut: asyncio.Future[str]) -> None:
                if not fut.cancelled() and fut.exception() is None:
                    self._release_later(request_id, fut.result())

            decision.add_done_callback(release_if_granted)
            raise

    async def _generate_once(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: TokenSink | None = None
    ) -> tuple[TokenOutput, bool]:
        """One piece, failing over to another replica when one errors. Returns the piece and
        whether it is what a failed replica had already streamed (to be resumed from)."""
        failures = 0
        while True:
            replica = await self._acquire(request_id)
            piece = _Piece(sink) if sink is not None else None
            try:
                engine = self.engines[replica]
                kw: dict[str, Any] = {"on_tokens": piece} if piece is not None and accepts_on_tokens(engine) else {}
                if trace.enabled(trace.DETAIL):
                    out = await self._traced_call(replica, request_id, prompt_ids, params, kw)
                else:
                    out = await engine.generate(request_id, prompt_ids, params, **kw)
                if piece is not None:
                    self._deliver_rest(piece, out, request_id)
                return out, False
            except (ValueError, TypeError):
                raise  # bad input: the same everywhere, do not fail over
            except Exception as e:  # noqa: BLE001 - a replica died or errored
                failures += 1
                self.num_failovers += 1
                log.warning("replica %s failed on %s: %r", replica, request_id, e)
                await self.router.report_failure(replica, repr(e))
                if piece is not None and piece.token_ids:
                    # already streamed: keep those tokens and resume from them elsewhere
                    out = piece.output()
                    out.replica = replica
                    return out, True
                if failures > self.max_failovers:
                    raise ReplicaFailedError(f"request {request_id} failed on {failures} replicas: {e!r}") from e
            finally:
                self._release_later(request_id, replica)

    @staticmethod
    def _deliver_rest(piece: _Piece, out: TokenOutput, request_id: str) -> None:
        n = len(piece.token_ids)
        if out.token_ids[:n] != piece.token_ids:
            raise RuntimeError(
                f"request {request_id}: the engine streamed tokens that are not a prefix of the tokens it returned "
                f"({n} streamed, {len(out.token_ids)} returned)"
            )
        if len(out.token_ids) > n:
            rest = TokenOutput(
                out.token_ids[n:], out.log_probs[n:], out.versions[n:],
                routed_experts=list(out.routed_experts) if out.routed_experts is not None else None,
            )
            piece.sink(rest)

    async def _traced_call(
        self, replica: str, request_id: str, prompt_ids: list[int], params: SamplingParams, kw: dict[str, Any]
    ) -> TokenOutput:
        with trace.span("client.piece", trace.DETAIL, request_id=request_id, replica=replica, prompt_tokens=len(prompt_ids)) as sp:
            sp.update(tokens=0, stop_reason="error", cached_tokens=0)
            out = await self.engines[replica].generate(request_id, prompt_ids, params, **kw)
            sp.update(tokens=len(out.token_ids), stop_reason=out.stop_reason, cached_tokens=out.num_cached_prompt_tokens)
            return out

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, *, on_tokens: TokenSink | None = None
    ) -> TokenOutput:
        """Generate, resuming across aborts. ``on_tokens``: receives the generation as it grows
        (see the module docstring); its exceptions are logged and otherwise ignored."""
        if not prompt_ids:
            raise ValueError("generate: prompt_ids is empty")
        if params.max_tokens < 1:
            raise ValueError(f"generate: max_tokens must be >= 1, got {params.max_tokens}")
        self.num_calls += 1
        merged = TokenOutput()
        self.in_progress[request_id] = merged
        budget = params.max_tokens
        pieces = 0
        t0 = time.monotonic()
        t_wall = time.time()
        sink = safe_sink(on_tokens, f"generate {request_id}") if on_tokens is not None else None
        while True:
            out, salvaged = await self._generate_once(request_id, list(prompt_ids) + merged.token_ids, params.replace(max_tokens=budget), sink)
            pieces += 1
            self.generated_tokens += len(out.token_ids)
            merged.token_ids.extend(out.token_ids)
            merged.log_probs.extend(out.log_probs)
            merged.versions.extend(out.versions)
            if out.routed_experts is not None:
                # the piece's prompt held the earlier pieces' tokens: its routing covers them too
                # (TokenOutput.routed_experts), so it replaces theirs; a piece without routing
                # (an abort the engine did not report it for) keeps the earlier, shorter list
                merged.routed_experts = list(out.routed_experts)
            if pieces == 1:
                merged.num_cached_prompt_tokens = out.num_cached_prompt_tokens
            merged.replica = out.replica
            budget -= len(out.token_ids)
            if out.stop_reason == "aborted" and (self.partial_rollout or salvaged):
                if budget <= 0:
                    merged.stop_reason = "length"
                    break
                if not salvaged:
                    merged.num_aborts += 1
                self.num_resumes += 1
                if trace.enabled():
                    last = merged.versions[-1] if merged.versions else -1
                    trace.instant("client.abort", request_id=request_id, replica=out.replica, tokens=len(merged.token_ids), version=last)
                    trace.instant("client.resume", request_id=request_id, budget=budget)
                continue
            merged.stop_reason = out.stop_reason
            break
        if trace.enabled():
            vs = merged.versions
            trace.complete(
                "client.generate", t_wall, time.time() - t_wall, request_id=request_id, replica=merged.replica, tokens=len(vs),
                pieces=pieces, stop_reason=merged.stop_reason, min_version=min(vs, default=-1), max_version=max(vs, default=-1),
            )
        self.in_progress.pop(request_id, None)
        log.debug("generate %s: %d tokens in %d pieces, %.3fs", request_id, len(merged.token_ids), pieces, time.monotonic() - t0)
        return merged

    def stats(self) -> dict[str, float]:
        return {
            "client/calls": float(self.num_calls),
            "client/resumes": float(self.num_resumes),
            "client/failovers": float(self.num_failovers),
        }

    async def drain(self) -> None:
        """Wait for fire-and-forget releases (tests, shutdown)."""
        if self._pending_releases:
            await asyncio.gather(*list(self._pending_releases), return_exceptions=True)
