"""The weight-update protocol around a transport plugin (seed §10).

1. the Rollouter stops admitting (and, without partial rollout, waits for active samples);
2. engines pause (abort in-flight generation under partial rollout);
3. engines release KV cache;
4. the transport plugin moves every bucket of full weights to every engine;
5. engines take the new version; all must agree or the sync fails as a whole;
6. engines resume KV cache and generation;
7. the Rollouter resets its staleness accounting and resumes admission.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from ferryman import trace
from ferryman.faults import is_replica_lost, watch
from ferryman.protocols import TrainerBackend, WeightSync


def takes_keyword(fn: Any, name: str) -> bool:
    """Whether callable ``fn`` accepts the keyword argument ``name``."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A weight sync failed; the message says which step and which replica."""


class Synchronizer:
    def __init__(
        self,
        *,
        backend: TrainerBackend,
        transport: WeightSync,
        engines: Sequence[Any],
        rollouter: Any,
        partial_rollout: bool,
        bucket_bytes: int,
        on_synced: Any = None,
        max_transfer_attempts: int = 1,
        on_paused: Any = None,
        on_replica_lost: Any = None,
    ) -> None:
        self.backend = backend
        self.transport = transport
        self.engines = list(engines)
        self.rollouter = rollouter
        self.partial_rollout = partial_rollout
        self.bucket_bytes = bucket_bytes
        self.on_synced = on_synced
        self.history: list[dict[str, float]] = []
        self.max_transfer_attempts = max(1, max_transfer_attempts)
        self.on_paused = on_paused
        """``async (version)``: called when every engine holds ``version`` and is paused and the
        Rollouter admits nothing (the moment a checkpoint cuts the pipeline)."""
        self.on_replica_lost = on_replica_lost
        """``async (replica, error)``: a replica was dropped from syncs (it is gone, or it
        could not take the weights); the caller stops routing to it."""
        self.lost: list[str] = []
        self.transfer_retries = 0
        self.offload_trainer = False
        """Colocated mode: after the weights went out (before the engines take their memory
        back) the trainer backend is offloaded (its optional ``offload()``)."""

    async def _all(self, step: str, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every engine; a replica that is gone is dropped, any other error
        (or every replica gone) fails the sync. Returns the survivors' results."""
        engines = list(self.engines)
        results = await asyncio.gather(*(getattr(e, method)(*args) for e in engines), return_exceptions=True)
        errors = [(e, r) for e, r in zip(engines, results) if isinstance(r, BaseException)]
        if errors and (len(errors) == len(engines) or not all(is_replica_lost(r) for _, r in errors)):
            detail = "; ".join(f"{e.name}: {err!r}" for e, err in errors)
            raise WeightSyncError(f"weight sync step '{step}' failed on {detail}")
        for engine, err in errors:
            await self._drop(engine, f"lost during '{step}': {err!r}")
        return [r for r in results if not isinstance(r, BaseException)]

    async def _drop(self, engine: Any, error: str) -> None:
        """Leave a replica out of this and every later sync (it keeps no mixed weights in use:
        it is gone, or shut down here) and have the router stop using it."""
        log.warning("weight sync: dropping replica %s (%s)", engine.name, error)
        self.engines = [e for e in self.engines if e is not engine]
        self.lost.append(engine.name)
        try:
            await asyncio.wait_for(engine.shutdown(), 30)
        except Exception as e:  # noqa: BLE001 - usually already dead
            log.debug("shutdown of dropped replica %s: %r", engine.name, e)
        if self.on_replica_lost is not None:
            await self.on_replica_lost(engine.name, error)

    async def _transfer(self, version: int) -> dict[str, float]:
        """The transport's transfer, retried as a whole (every bucket to every engine) after a
        failure. The engines stay paused meanwhile, so no one generates from mixed weights. Before
        a retry, replicas that are gone are dropped."""
        for attempt in range(1, self.max_transfer_attempts + 1):
            buckets = watch("sync.bucket", self._buckets())
            try:
                m = await self.transport.transfer(buckets, self.engines, version)
                m["sync/transfer_attempts"] = float(attempt)
                return m
            except Exception as e:
                if attempt == self.max_transfer_attempts:
                    raise WeightSyncError(f"weight transfer for version {version} failed after {attempt} attempt(s): {e!r}") from e
                log.warning("weight transfer for version %d failed (attempt %d): %r; retrying", version, attempt, e)
                self.transfer_retries += 1
                probes = await asyncio.gather(*(asyncio.wait_for(x.get_version(), 30) for x in self.engines), return_exceptions=True)
                gone = [x for x, p in zip(self.engines, probes) if isinstance(p, BaseException)]
                if len(gone) == len(self.engines):
                    raise WeightSyncError(f"weight transfer for version {version}: no replica answers after {e!r}") from e
                for x in gone:
                    await self._drop(x, f"no answer after a failed transfer: {e!r}")
        raise AssertionError("unreachable")  # pragma: no cover

    def _buckets(self) -> Any:
        """The backend's weight buckets, on the device the transport packs from when both
        sides can (a GPU transport and a backend whose ``iter_weight_buckets`` takes
        ``device``: no round trip of the weights through host memory), else on the CPU."""
        device = str(getattr(self.transport, "source_device", "cpu"))
        if device != "cpu" and takes_keyword(self.backend.iter_weight_buckets, "device"):
            return self.backend.iter_weight_buckets(self.bucket_bytes, device=device)
        return self.backend.iter_weight_buckets(self.bucket_bytes)

    @staticmethod
    def _trace_step(step: str, t_perf: float, version: int, **args: Any) -> float:
        """Record the step that began at perf-counter reading ``t_perf``; returns its seconds."""
        dur = time.perf_counter() - t_perf
        trace.complete("sync.step", time.time() - dur, dur, version=version, step=step, **args)
        return dur

    async def _trainer_memory(self, method: str, version: int) -> float:
        """Call the trainer backend's optional ``offload``/``onload`` in a worker thread and
        trace it; 0.0 if the backend has no such method."""
        fn = getattr(self.backend, method, None)
        if fn is None or not callable(fn):
            return 0.0
        t = time.perf_counter()
        await asyncio.to_thread(fn)
        return self._trace_step(f"trainer_{method}", t, version)

    async def wake_trainer(self, version: int) -> dict[str, float]:
        """Colocated mode: bring the trainer's state back to its device (the engines sleep)."""
        return {"sync/trainer_onload_s": await self._trainer_memory("onload", version)}

    async def park_trainer(self, version: int) -> dict[str, float]:
        """Colocated mode: move the trainer's state off its device (the engines will generate)."""
        return {"sync/trainer_offload_s": await self._trainer_memory("offload", version)}

    async def sleep_engines(self, version: int) -> dict[str, float]:
        """Colocated mode: the engines go to sleep (pause without abort, release KV cache) while
        the Trainer trains; the next :meth:`update_weights` wakes them with the new weights."""
        t = time.perf_counter()
        await self._all("pause", "pause", False)
        await self._all("release_kv_cache", "release_kv_cache")
        dur = time.perf_counter() - t
        trace.complete("sync.sleep", time.time() - dur, dur, version=version)
        return {"sync/sleep_s": dur}

    async def update_weights(self, version: int) -> dict[str, float]:
        m: dict[str, float] = {}
        t_all = time.perf_counter()
        t_wall = time.time()
        t = time.perf_counter()
        await self.rollouter.pause_for_sync(not self.partial_rollout)
        m["sync/wait_rollouter_s"] = time.perf_counter() - t
        self._trace_step("wait_rollouter", t, version, wait_for_active=not self.partial_rollout)
        t = t_paused = time.perf_counter()
        await self._all("pause", "pause", self.partial_rollout)
        m["sync/pause_s"] = self._trace_step("pause", t, version, abort=self.partial_rollout)
        t = time.perf_counter()
        await self._all("release_kv_cache", "release_kv_cache")
        m["sync/release_kv_s"] = self._trace_step("release_kv", t, version)
        t = time.perf_counter()
        m.update(await self._transfer(version))
        m["sync/transfer_s"] = self._trace_step("transfer", t, version)
        if self.offload_trainer:
            m.update(await self.park_trainer(version))
        t = time.perf_counter()
        await self._all("set_version", "set_version", version)
        versions = await self._all("get_version", "get_version")
        if any(v != version for v in versions):
            raise WeightSyncError(f"engines disagree after sync to {version}: {dict(zip((e.name for e in self.engines), versions))}")
        m["sync/set_version_s"] = self._trace_step("set_version", t, version)
        if self.on_paused is not None:
            await self.on_paused(version)
        t = time.perf_counter()
        await self._all("resume_kv_cache", "resume_kv_cache")
        await self._all("resume", "resume")
        m["sync/resume_s"] = self._trace_step("resume", t, version)
        # generation stood still from the engines' pause to their resume: pause, KV release,
        # transfer, version check, KV and generation resume (not the transfer alone)
        m["sync/generation_pause_s"] = time.perf_counter() - t_paused
        t = time.perf_counter()
        m["sync/num_staleness_sample"] = float(await self.rollouter.reset_staleness(version))
        m["sync/reset_staleness_s"] = self._trace_step("reset_staleness", t, version)
        m["sync/total_s"] = time.perf_counter() - t_all
        trace.complete("sync.update", t_wall, m["sync/total_s"], version=version)
        m["sync/version"] = float(version)
        m["sync/transfer_retries"] = float(self.transfer_retries)
        m["sync/lost_replicas"] = float(len(self.lost))
        self.history.append(m)
        if self.on_synced is not None:
            self.on_synced(version, m)
        return m

    def close(self) -> None:
        """Release the transport's resources (sockets, process groups), if it holds any."""
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()
