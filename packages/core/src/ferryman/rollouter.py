"""The Rollouter: keeps the engines busy with agent runs, within the staleness quota.

Admission of a new task (one Sample = ``rollout.n`` agent runs of one task) needs, all at once
(seed §06, §07):

* no weight sync in progress (``pause_for_sync`` … ``reset_staleness``);
* ``window_admitted < max_required_samples`` where ``max_required_samples = (1 + staleness) ×
  trigger × require_batches × ppo_mini_batch_size`` and ``window_admitted`` started the window at
  ``num_staleness_sample`` = samples carried over (in flight + queued) at the last sync;
* fewer than ``max_concurrent_samples`` samples in flight.

So between two syncs the Rollouter produces at most ``(1 + s) × W − num_staleness_sample``
samples: what one window over-produced, the next produces less; the total is conserved.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import time
import traceback
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from ferryman import trace
from ferryman.checkpoint import CheckpointError
from ferryman.config import RunFailuresConfig
from ferryman.faults import hit
from ferryman.protocols import Env, GenerateClient, Queue
from ferryman.replay import InFlightSample, RunLog, RunRecorder
from ferryman.types import Sample, SamplingParams, Trajectory, new_id

log = logging.getLogger(__name__)


class RollouterError(RuntimeError):
    """The Rollouter's own machinery failed (see :attr:`Rollouter.failure`)."""


class AgentRunsFailingError(RollouterError):
    """Agent runs fail systematically (``rollout.failures``): the Rollouter stopped. The message
    holds the counts and the first failure's full traceback."""


class UntrainableRunError(ValueError):
    """An agent run returned something that cannot be trained on; ``kind`` names what
    (``no_reward``, ``nonfinite_reward``, ``nonfinite_log_prob``, ``bad_trajectory``)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def check_trainable(traj: Trajectory, request_id: str) -> None:
    """Raise :class:`UntrainableRunError` unless ``traj`` is consistent and its numbers are
    finite: a NaN or infinite reward (or engine log-prob) would turn every advantage of its
    group, and then the whole step's gradient, into NaN."""
    try:
        traj.validate()
    except ValueError as e:
        raise UntrainableRunError("bad_trajectory", str(e)) from None
    if traj.reward is None:
        raise UntrainableRunError("no_reward", f"env returned trajectory {request_id} without a reward")
    if isinstance(traj.reward, bool) or not isinstance(traj.reward, (int, float)):
        raise UntrainableRunError("no_reward", f"env returned trajectory {request_id} with reward {traj.reward!r}: not a number")
    if not math.isfinite(traj.reward):
        raise UntrainableRunError("nonfinite_reward", f"env returned trajectory {request_id} with reward {traj.reward}: not finite")
    for i, lp in enumerate(traj.rollout_log_probs):
        if not math.isfinite(lp):
            raise UntrainableRunError(
                "nonfinite_log_prob", f"trajectory {request_id}: rollout log-prob {lp} at response position {i} is not finite (engine output)"
            )


FAILURE_KINDS = ("error", "timeout", "no_reward", "nonfinite_reward", "nonfinite_log_prob", "bad_trajectory")
"""What ``rollouter/failed/<kind>`` counts: ``error`` is any exception the env raised."""


@dataclass
class WindowRecord:
    """What happened between two syncs (for tests, metrics and the timeline)."""

    version: int
    carried: int
    """``num_staleness_sample`` at the start of the window."""
    admitted: int = 0
    """New samples admitted during the window."""
    quota: int = 0
    """``max_required_samples - carried``: the most the window may admit."""
    dropped: int = 0
    """Samples whose every run failed during the window (their quota slot is given back)."""
    start_time: float = field(default_factory=time.time)


class Rollouter:
    def __init__(
        self,
        *,
        env: Env,
        client: GenerateClient,
        queue: Queue,
        n: int,
        sampling: SamplingParams,
        max_required_samples: int,
        max_concurrent_samples: int,
        total_samples: int | None = None,
        seed: int = 0,
        on_sample: Any = None,
        shuffle: bool = True,
        run_timeout_s: float | None = None,
        failures: RunFailuresConfig | None = None,
    ) -> None:
        if max_required_samples < 1 or max_concurrent_samples < 1:
            raise ValueError("Rollouter: max_required_samples and max_concurrent_samples must be >= 1")
        self.env = env
        self.client = client
        self.queue = queue
        self.n = n
        self.sampling = sampling
        self.max_required_samples = max_required_samples
        self.max_concurrent_samples = max_concurrent_samples
        self.total_samples = total_samples
        self.on_sample = on_sample
        self.run_timeout_s = run_timeout_s
        self.failures = failures or RunFailuresConfig()
        """When failing agent runs stop the Rollouter (:class:`AgentRunsFailingError`)."""
        self.recorder = RunRecorder(client)
        """What envs generate through: keeps each run's outputs so far for checkpoints."""
        self.inflight: dict[str, InFlightSample] = {}
        self._rng = random.Random(seed)
        self._shuffle = shuffle
        self._order: list[int] = []
        self._cursor = 0
        self.epoch = 0

        self.version = 0
        self.window_admitted = 0
        self.windows: list[WindowRecord] = [WindowRecord(version=0, carried=0, quota=max_required_samples)]
        self.active: dict[str, asyncio.Task[None]] = {}
        self._delivering: set[str] = set()
        """Samples in ``active`` whose ``queue.put`` has been called: they count as queued."""
        self.paused = False
        self.stopped = False
        self.failure: BaseException | None = None
        """An unexpected error of the Rollouter's own machinery (not of an agent run: those are
        counted and dropped). It stops admission and :meth:`fit` raises it."""
        self._cond: asyncio.Condition | None = None
        self._fit_task: asyncio.Task[None] | None = None

        self.total_admitted = 0
        self.total_produced = 0
        self.total_dropped_samples = 0
        self.total_failed_trajectories = 0
        self.total_timed_out_trajectories = 0
        self.total_runs_dispatched = 0
        self.total_runs_finished = 0
        self.total_redispatched_runs = 0
        self.failed_by_kind: Counter[str] = Counter()
        self.consecutive_failures = 0
        self._recent_failed: deque[bool] = deque(maxlen=self.failures.window)
        self.first_failure: str | None = None
        """The first failed agent run: its request id and full traceback."""
        self._failures_unlogged = 0
        self._failure_logged_at = 0.0
        self._failures_traced = 0
        self._wake: asyncio.Task[None] | None = None
        self.max_active_seen = 0
        self._busy_s = 0.0
        self._busy_since: float | None = None
        self._start = time.monotonic()

    # ---------------------------------------------------------------- admission
    @property
    def cond(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def _can_admit(self) -> bool:
        if self.stopped:
            return True
        if self.paused or len(self.active) >= self.max_concurrent_samples:
            return False
        if self.total_samples is not None and self.total_admitted >= self.total_samples:
            return False
        return self.window_admitted < self.max_required_samples

    def _next_task_index(self) -> int:
        num = self.env.num_tasks()
        if num < 1:
            raise ValueError("env has no tasks")
        if self._cursor >= len(self._order):
            self._order = list(range(num))
            if self._shuffle:
                self._rng.shuffle(self._order)
            self._cursor = 0
            self.epoch += 1
        idx = self._order[self._cursor]
        self._cursor += 1
        return idx

    def _mark_activity(self) -> None:
        now = time.monotonic()
        if self.active and self._busy_since is None:
            self._busy_since = now
        elif not self.active and self._busy_since is not None:
            self._busy_s += now - self._busy_since
            self._busy_since = None

    async def fit(self) -> None:
        """Admit tasks until stopped (or ``total_samples`` were admitted and finished)."""
        cond = self.cond
        while True:
            async with cond:
                blocked, t_block = self._blocked_reason(), time.time()
                await cond.wait_for(self._can_admit)
                if blocked is not None:
                    trace.complete("rollouter.blocked", t_block, time.time() - t_block, reason=blocked)
                if self.stopped:
                    break
                index = self._next_task_index()
                self.window_admitted += 1
                self.total_admitted += 1
                self.windows[-1].admitted += 1
                uid = self.sample_uid(index)
                state = InFlightSample(uid, index, self.version, [new_id("r-") for _ in range(self.n)], timings={"generate_start": time.time()})
                self.inflight[uid] = state
                self.active[uid] = asyncio.create_task(self._run_sample(uid, index, self.version, state))
                self.max_active_seen = max(self.max_active_seen, len(self.active))
                self._mark_activity()
            if self.total_samples is not None and self.total_admitted >= self.total_samples:
                async with cond:
                    await cond.wait_for(lambda: self.stopped or not self.active)
                break
        if isinstance(self.failure, RollouterError):
            raise self.failure
        if self.failure is not None:
            raise RollouterError(f"the Rollouter failed: {self.failure!r}") from self.failure

    def sample_uid(self, index: int) -> str:
        """A sample's identity: epoch and task index (deterministic for a seed; a resumed run
        produces the same ids)."""
        return f"e{self.epoch}-t{index}"

    async def _run_one(self, task: dict[str, Any], request_id: str) -> list[Trajectory] | None:
        """One agent run: its trajectory, or its segments (an env may return a list)."""
        try:
            self.total_runs_dispatched += 1
            result = await asyncio.wait_for(self.env.run(task, request_id, self.recorder, self.sampling), self.run_timeout_s)
            trajs = list(result) if isinstance(result, (list, tuple)) else [result]
            if not trajs:
                raise UntrainableRunError("bad_trajectory", f"env returned no trajectory for {request_id}")
            for traj in trajs:
                if not isinstance(traj, Trajectory):
                    raise UntrainableRunError("bad_trajectory", f"env returned {type(traj).__name__} for {request_id}, not a Trajectory")
                check_trainable(traj, request_id)
            for traj in trajs:
                traj.run_id = request_id  # segments of one run count as one run in training
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed agent run is counted and dropped
            self._run_failed(request_id, e)
            return None
        self.consecutive_failures = 0
        self._recent_failed.append(False)
        return trajs

    # ---------------------------------------------------------------- failed runs
    def _run_failed(self, request_id: str, e: BaseException) -> None:
        """Count a failed agent run, log it (rate-limited) and stop the Rollouter when runs
        fail systematically (``rollout.failures``)."""
        self.total_failed_trajectories += 1
        if isinstance(e, TimeoutError):
            self.total_timed_out_trajectories += 1
            kind = "timeout"
        else:
            kind = getattr(e, "kind", "error")
        self.failed_by_kind[kind] += 1
        self.consecutive_failures += 1
        self._recent_failed.append(True)
        if self.first_failure is None:
            self.first_failure = f"agent run {request_id} ({kind}):\n" + "".join(traceback.format_exception(e)).rstrip()
        self._log_failure(request_id, kind, e)
        reason = self._systematic_failure()
        if reason is not None and self.failure is None and not self.stopped:
            self.failure = AgentRunsFailingError(
                f"agent runs are failing systematically: {reason} ({self.total_failed_trajectories} failed, "
                f"{self.total_runs_finished} succeeded so far; by kind: {dict(self.failed_by_kind)}); "
                f"limits: rollout.failures.max_consecutive / max_ratio.\nfirst failure, {self.first_failure}"
            )
            log.error("Rollouter: %s; stopping", reason)
            # the sample of this run ends soon (its other runs too): its cleanup stops admission
            # and wakes fit(); do it now in case every other sample is blocked
            self.stopped = True
            self._wake = asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self.cond:
            self.cond.notify_all()

    def _systematic_failure(self) -> str | None:
        f = self.failures
        if f.max_consecutive is not None and self.consecutive_failures >= f.max_consecutive:
            return f"{self.consecutive_failures} agent runs in a row failed"
        recent = self._recent_failed
        if f.max_ratio is not None and len(recent) == recent.maxlen:
            ratio = sum(recent) / len(recent)
            if ratio > f.max_ratio:
                return f"{ratio:.0%} of the last {len(recent)} finished agent runs failed (limit {f.max_ratio:.0%})"
        return None

    def _log_failure(self, request_id: str, kind: str, e: BaseException) -> None:
        """The first ``log_first`` failures one by one with their traceback; then one line at
        most every ``log_every_s`` with the count since the previous line."""
        f, now = self.failures, time.monotonic()
        n = self.total_failed_trajectories
        if n <= f.log_first:
            log.warning("agent run %s failed (%s): %r", request_id, kind, e, exc_info=(type(e), e, e.__traceback__))
            if n == f.log_first:
                log.warning("further failed agent runs are counted, with one line at most every %gs", f.log_every_s)
            self._failure_logged_at = now
            return
        self._failures_unlogged += 1
        if now - self._failure_logged_at >= f.log_every_s:
            log.warning(
                "%d more agent runs failed in the last %.0fs (%d failed and %d succeeded in all; by kind %s; latest %s: %r)",
                self._failures_unlogged, now - self._failure_logged_at, n, self.total_runs_finished,
                dict(self.failed_by_kind), request_id, e,
            )
            self._failures_unlogged = 0
            self._failure_logged_at = now

    def _trace_failed(self) -> bool:
        """Whether this failed run (or dropped sample) still goes into the trace."""
        if self._failures_traced >= self.failures.trace_max:
            return False
        self._failures_traced += 1
        return True

    async def _traced_run_one(self, task: dict[str, Any], request_id: str, uid: str) -> Any:
        """``_run_one`` recorded as a ``rollouter.traj`` span (with its versions and tokens)."""
        if not trace.enabled():
            return await self._run_one(task, request_id)
        t0 = time.time()
        result: Any = None
        try:
            result = await self._run_one(task, request_id)
            return result
        finally:
            segs = [] if result is None else (result if isinstance(result, list) else [result])
            if segs or self._trace_failed():  # failures past rollout.failures.trace_max are only counted
                vs = [v for t in segs for v, mk in zip(t.token_versions, t.response_mask) if mk]
                trace.complete(
                    "rollouter.traj", t0, time.time() - t0, uid=uid, request_id=request_id, ok=bool(segs),
                    min_version=min(vs, default=-1), max_version=max(vs, default=-1), tokens=len(vs),
                    aborts=sum(t.num_aborts for t in segs),
                )

    def _blocked_reason(self) -> str | None:
        """Why a new task cannot be admitted now (None: it can)."""
        if self._can_admit():
            return None
        if self.paused:
            return "paused"
        if self.window_admitted >= self.max_required_samples:
            return "quota"
        if len(self.active) >= self.max_concurrent_samples:
            return "concurrency"
        return "total"

    async def _run_tracked(self, task: dict[str, Any], state: InFlightSample, request_id: str) -> list[Trajectory] | None:
        """One run of a sample, recorded; after a resume a finished run is not run again."""
        if request_id in state.done:
            return state.done[request_id]
        if request_id in state.failed:
            return None
        self.recorder.begin(request_id, state.replay.pop(request_id, None))
        try:
            traj = await self._traced_run_one(task, request_id, state.uid)
        finally:
            self.recorder.end(request_id)
        if traj is None:
            state.failed.append(request_id)
        else:
            state.done[request_id] = traj
            self.total_runs_finished += 1
        return traj

    async def _run_sample(self, uid: str, index: int, version: int, state: InFlightSample | None = None) -> None:
        put_ok = False
        t0 = time.time()
        try:
            hit("rollouter.sample", index)
            task = self.env.get_task(index)
            if state is None:
                state = InFlightSample(uid, index, version, [new_id("r-") for _ in range(self.n)], timings={"generate_start": t0})
            self.inflight[uid] = state
            t0 = state.timings.get("generate_start", t0)
            results = await asyncio.gather(*(self._run_tracked(task, state, rid) for rid in state.run_ids))
            trajs = [t for run in results if run is not None for t in run]
            if not trajs:
                self.total_dropped_samples += 1
                return
            sample = Sample(
                uid=uid,
                task_index=index,
                trajectories=trajs,
                created_version=version,
                timings={"generate_start": t0, "generate_end": time.time()},
                dropped=sum(1 for run in results if run is None),
            )
            state.complete = sample
            if self.on_sample is not None:
                self.on_sample(sample)
            # from here the sample counts as queued, not in flight (see reset_staleness)
            self._delivering.add(uid)
            put_ok = await self.queue.put(sample)
            if put_ok:
                self.total_produced += 1
        except Exception as e:  # noqa: BLE001 - not an agent run's error (those never get here)
            if not self.stopped and self.failure is None:
                # e.g. the data set, the queue or an on_sample hook failing: retrying the next
                # task would fail the same way, so the Rollouter stops and fit() raises it
                log.error("Rollouter: sample %s failed outside its agent runs: %r", uid, e)
                self.failure = e
        finally:
            if trace.enabled() and (put_ok or self._trace_failed()):
                trace.complete("rollouter.sample", t0, time.time() - t0, uid=uid, task_index=index, version=version, queued=put_ok)
            async with self.cond:
                self.active.pop(uid, None)
                self._delivering.discard(uid)
                self.inflight.pop(uid, None)
                if self.failure is not None:
                    self.stopped = True
                if not put_ok and not self.stopped:
                    # nothing reached the trainer: give the quota slot back so no window starves
                    self.window_admitted -= 1
                    self.windows[-1].dropped += 1
                self._mark_activity()
                self.cond.notify_all()

    # ---------------------------------------------------------------- sync protocol
    async def pause_for_sync(self, wait_for_active: bool) -> float:
        """Stop admitting. ``wait_for_active`` (no partial rollout): also wait until every
        sample in flight is finished and queued ("wait active task finish"). Returns the wait."""
        t0 = time.monotonic()
        async with self.cond:
            self.paused = True
            if wait_for_active:
                await self.cond.wait_for(lambda: not self.active or self.stopped)
        return time.monotonic() - t0

    async def reset_staleness(self, version: int) -> int:
        """After a sync: in-flight and queued samples count toward the new window; resume.
        Returns ``num_staleness_sample``."""
        async with self.cond:
            self.version = version
            # queue first, then the samples in flight that have not started their put: a sample
            # whose put landed in the queue but has not returned yet is still in ``active``, and
            # counting ``len(active) + qsize`` would count it twice (and shrink the next quota)
            queued = await self.queue.qsize()
            carried = queued + sum(1 for uid in self.active if uid not in self._delivering)
            self.window_admitted = carried
            self.windows.append(
                WindowRecord(version=version, carried=carried, quota=max(0, self.max_required_samples - carried))
            )
            self.paused = False
            self.cond.notify_all()
            trace.instant("rollouter.window", version=version, carried=carried, quota=self.windows[-1].quota)
            return carried

    # ---------------------------------------------------------------- checkpoints, faults
    async def checkpoint_state(self, sync_version: int | None = None) -> dict[str, Any]:
        """This Rollouter's part of a checkpoint (see :mod:`ferryman.checkpoint`); call it while
        admission is paused and the engines are paused."""
        return capture_rollouter(self, sync_version)

    async def restore_state(self, state: dict[str, Any], queued_uids: list[str]) -> dict[str, float]:
        """Continue from a checkpoint (before ``fit()``); returns what was re-dispatched."""
        return await restore_rollouter(self, state, set(queued_uids))

    async def freeze(self) -> None:
        """For a final checkpoint: admit nothing more, and hold back (rather than finish) any
        generation that the engines abort from now on."""
        async with self.cond:
            self.paused = True
            self.recorder.frozen = True

    async def quarantine_replica(self, replica: str, error: str) -> None:
        """Stop routing to a replica that was lost or left behind by a weight sync."""
        router = getattr(self.client, "router", None)
        if router is not None:
            await router.report_failure(replica, error)
            await router.remove_replica(replica)

    async def stop(self, cancel: bool = True) -> None:
        async with self.cond:
            self.stopped = True
            self.cond.notify_all()
        tasks = list(self.active.values())
        if cancel:
            for t in tasks:
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        close = getattr(self.env, "aclose", None)  # an env holding servers or sandboxes releases them
        if close is not None:
            await close()
        trace.flush()

    # ---------------------------------------------------------------- reporting
    def stats(self) -> dict[str, float]:
        now = time.monotonic()
        busy = self._busy_s + ((now - self._busy_since) if self._busy_since is not None else 0.0)
        elapsed = max(now - self._start, 1e-9)
        return {
            "rollouter/version": float(self.version),
            "rollouter/active": float(len(self.active)),
            "rollouter/window_admitted": float(self.window_admitted),
            "rollouter/total_admitted": float(self.total_admitted),
            "rollouter/total_produced": float(self.total_produced),
            "rollouter/dropped_samples": float(self.total_dropped_samples),
            "rollouter/failed_trajectories": float(self.total_failed_trajectories),
            "rollouter/timed_out_trajectories": float(self.total_timed_out_trajectories),
            **{f"rollouter/failed/{k}": float(self.failed_by_kind[k]) for k in FAILURE_KINDS},
            "rollouter/runs_dispatched": float(self.total_runs_dispatched),
            "rollouter/runs_finished": float(self.total_runs_finished),
            "rollouter/redispatched_runs": float(self.total_redispatched_runs),
            "rollouter/max_active_seen": float(self.max_active_seen),
            "rollouter/idle_ratio": 1.0 - busy / elapsed,
            "rollouter/elapsed_s": elapsed,
            "rollouter/generated_tokens": float(getattr(self.client, "generated_tokens", 0)),
            "rollouter/epoch": float(self.epoch),
            **(self.env.stats() if callable(getattr(self.env, "stats", None)) else {}),
            **self.recorder.stats(),
        }

    def window_log(self) -> list[dict[str, Any]]:
        return [vars(w).copy() for w in self.windows]


ROLLOUTER_COUNTERS = (
    "total_admitted",
    "total_produced",
    "total_dropped_samples",
    "total_failed_trajectories",
    "total_timed_out_trajectories",
    "total_runs_dispatched",
    "total_runs_finished",
    "total_redispatched_runs",
    "max_active_seen",
)


# --------------------------------------------------------------------------- checkpoint state
# (here, not in ferryman.checkpoint: the checkpoint module knows nothing of the Rollouter's
# internals, and imports stay one-way, rollouter -> checkpoint)


def capture_rollouter(r: Any, sync_version: int | None) -> dict[str, Any]:
    """The Rollouter's state (data-loader position, accounting, samples in flight). Call with
    admission paused and the engines paused; ``sync_version``: the version being synced when
    the cut is taken inside a sync (the restore then resets staleness to it)."""
    inflight = []
    for uid, st in r.inflight.items():
        logs: dict[str, RunLog] = {}
        for rid in st.run_ids:
            if rid in st.done or rid in st.failed:
                continue
            record = r.recorder.snapshot(rid)
            if record is None:
                record = st.replay.get(rid)  # restored, not yet started again
            if record is not None:
                logs[rid] = record
        inflight.append(
            {
                "uid": uid,
                "task_index": st.task_index,
                "created_version": st.created_version,
                "run_ids": list(st.run_ids),
                "done": dict(st.done),
                "failed": list(st.failed),
                "logs": logs,
                "complete": st.complete is not None,
                "timings": dict(st.timings),
            }
        )
    return {
        "version": r.version,
        "sync_version": sync_version,
        "order": list(r._order),
        "cursor": r._cursor,
        "epoch": r.epoch,
        "rng": r._rng.getstate(),
        "n": r.n,
        "window_admitted": r.window_admitted,
        "windows": [dataclasses.asdict(w) for w in r.windows],
        "counters": {name: getattr(r, name) for name in ROLLOUTER_COUNTERS},
        "inflight": inflight,
    }


async def restore_rollouter(r: Any, state: dict[str, Any], exclude_uids: set[str]) -> dict[str, float]:
    """Put a captured state back into a fresh Rollouter (before ``fit()``) and start its samples
    in flight again. Samples whose uid is in ``exclude_uids`` (already queued, taken or trained)
    are not restarted. Returns counts for the log and the summary."""
    if state["n"] != r.n:
        raise CheckpointError(f"rollout.n: the checkpoint has {state['n']} runs per sample, this run {r.n}")
    num_tasks = r.env.num_tasks()
    if state["order"] and max(state["order"]) >= num_tasks:
        raise CheckpointError(f"env: the checkpoint's task order reaches task {max(state['order'])}, this env has {num_tasks} tasks")
    r._order = list(state["order"])
    r._cursor = state["cursor"]
    r.epoch = state["epoch"]
    r._rng.setstate(state["rng"])
    r.version = state["version"]
    r.window_admitted = state["window_admitted"]
    r.windows = [WindowRecord(**w) for w in state["windows"]]
    for name, value in state["counters"].items():
        setattr(r, name, value)
    resumable = bool(getattr(r.env, "resumable", False))
    info = {"restored_samples": 0.0, "replayed_runs": 0.0, "redispatched_runs": 0.0, "discarded_tokens": 0.0, "kept_tokens": 0.0}
    for item in state["inflight"]:
        if item["uid"] in exclude_uids:
            continue
        st = InFlightSample(
            uid=item["uid"],
            task_index=item["task_index"],
            created_version=item["created_version"],
            run_ids=list(item["run_ids"]),
            done=dict(item["done"]),
            failed=list(item["failed"]),
            timings=dict(item["timings"]),
        )
        for rid, record in item["logs"].items():
            if resumable:
                st.replay[rid] = record
                info["replayed_runs"] += 1
                info["kept_tokens"] += record.num_tokens
            else:
                # a black-box run cannot be replayed (its sandbox is gone): start it afresh
                st.run_ids[st.run_ids.index(rid)] = new_id("r-")
                info["redispatched_runs"] += 1
                info["discarded_tokens"] += record.num_tokens
        r.inflight[st.uid] = st
        r.active[st.uid] = asyncio.create_task(r._run_sample(st.uid, st.task_index, st.created_version, st))
        info["restored_samples"] += 1
    r.total_redispatched_runs += int(info["redispatched_runs"])
    # a replayed run continues a dispatch counted before the cut; it is counted again when it starts
    r.total_runs_dispatched -= int(info["replayed_runs"])
    r.max_active_seen = max(r.max_active_seen, len(r.active))
    if state["sync_version"] is not None:
        await r.reset_staleness(state["sync_version"])
    else:
        async with r.cond:
            r.paused = False
            r.cond.notify_all()
    return info
