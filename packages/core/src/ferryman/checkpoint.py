"""Checkpoints of the whole pipeline, as one consistent cut, and resuming from them.

What a checkpoint holds
-----------------------
``RUN_DIR/checkpoints/step-00000012/``:

* ``trainer/``: the trainer backend's state: ``backend.save_checkpoint(dir)`` when the backend
  has it (the ``fsdp`` backend writes a sharded torch distributed checkpoint), otherwise
  ``state.pt`` from ``state_dict_for_checkpoint()``;
* ``pipeline.pkl``: the trainer loop (step, weight version, the record of every trained step,
  samples taken from the queue but not yet trained), the MessageQueue's samples, and the
  Rollouter: task order, cursor, epoch and shuffle RNG (the data-loader position), version,
  staleness window and counters, and every sample in flight: its finished trajectories and,
  for each run under way, every model output so far (:class:`ferryman.replay.RunLog`: token
  ids, log-probs, per-token versions);
* ``meta.json``: a readable summary.

Where the cut is taken
----------------------
A checkpoint is cut at a weight sync, after every engine holds the new version and before any
resumes, with the Rollouter admitting nothing (``Synchronizer.on_paused``). There the trainer's
weights *are* the engines' weights (nothing trained since), so restoring the trainer and pushing
its weights restores the engines too. Without partial rollout the Rollouter has waited for its
samples, so nothing is in flight; with partial rollout the runs under way are parked on the
paused engines with their tokens so far in the server client. A sample whose last run just
finished may be on its way into the queue: it is kept as in flight unless the queue snapshot
(taken after the Rollouter's) has it, so it is neither lost nor doubled.

On SIGTERM the trainer stops at the next sync boundary (at once with ``trigger = 1``, also while
it waits for samples): the Rollouter stops admitting and holds back aborted generations
(:meth:`ferryman.rollouter.Rollouter.freeze`), the engines abort what they are doing, and the
same state is saved, with the samples the trainer had already taken.

Writes are atomic: a checkpoint is written into ``.tmp-step-…`` and renamed into place; a
leftover temporary directory (a crash mid-write) is ignored and later removed. Only the newest
``checkpoint.keep`` are kept.

Resuming (``ferryman train --resume RUN_DIR``): the trainer loads its state and step records,
pushes its weights to the engines under the saved version, the queue gets its samples back, and
the Rollouter continues from its cursor and accounting; each sample in flight starts again,
skipping its finished runs, and each run under way replays its record and continues its
unfinished generation from the tokens so far (envs with ``resumable = True``; runs of other envs
are re-dispatched from the start and counted in ``rollouter/redispatched_runs``). Sample ids are
``e{epoch}-t{task}``, so the trained set can be compared with an uninterrupted run's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ferryman.faults import hit
from ferryman.types import Sample

log = logging.getLogger(__name__)

FORMAT = 1
PIPELINE_FILE = "pipeline.pkl"
META_FILE = "meta.json"
TRAINER_DIR = "trainer"
_STEP_DIR = re.compile(r"^step-(\d+)$")

class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or does not fit this run."""


class RunDiedError(RuntimeError):
    """A part of the pipeline died or failed; the run was stopped and can resume from its last
    checkpoint (the message says which and how)."""


class TrainerDiedError(RunDiedError):
    """The trainer process died; the run was stopped and can resume from its last checkpoint."""


class RollouterDiedError(RunDiedError):
    """The Rollouter (its process, or its own machinery) failed; the run was stopped and can
    resume from its last checkpoint."""


class TrainingStalledError(RunDiedError):
    """The trainer skipped step after step for non-finite gradients (it trains nothing): the
    run was stopped (``training.max_nonfinite_grad_steps``)."""


# --------------------------------------------------------------------------- the trainer backend's part


def save_trainer_state(backend: Any, path: Path) -> None:
    """Write the backend's state under ``path`` (a directory it creates)."""
    path.mkdir(parents=True, exist_ok=True)
    save = getattr(backend, "save_checkpoint", None)
    if callable(save):
        save(str(path))
        return
    import torch

    torch.save(backend.state_dict_for_checkpoint(), path / "state.pt")


def load_trainer_state(backend: Any, path: Path) -> None:
    """Load what :func:`save_trainer_state` wrote."""
    if (path / "state.pt").is_file():
        import torch

        backend.load_checkpoint_state(torch.load(path / "state.pt", weights_only=False))
        return
    load = getattr(backend, "load_checkpoint", None)
    if not callable(load):
        raise CheckpointError(f"{path}: no state.pt, and trainer backend {type(backend).__name__} has no load_checkpoint()")
    load(str(path))


# --------------------------------------------------------------------------- files


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStore:
    """A directory of checkpoints ``step-NNNNNNNN/``, written atomically, newest ``keep`` kept."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = max(1, keep)

    def list(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir() and (p / PIPELINE_FILE).is_file():
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        done = self.list()
        return done[-1] if done else None

    def write(self, step: int, writer: Callable[[Path], None]) -> Path:
        """Run ``writer(tmp_dir)`` then rename ``tmp_dir`` to ``step-NNNNNNNN``; prune."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.remove_leftovers()
        tmp = self.root / f".tmp-step-{step:08d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        final = self.root / f"step-{step:08d}"
        try:
            writer(tmp)
            hit("checkpoint.write")
            _fsync_dir(tmp)
            old = None
            if final.exists():  # a resumed run saving a step again: swap, then drop the old one
                old = self.root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.prune()
        return final

    def prune(self) -> list[Path]:
        done = self.list()
        removed = done[: max(0, len(done) - self.keep)]
        for p in removed:
            shutil.rmtree(p, ignore_errors=True)
        return removed

    def remove_leftovers(self) -> None:
        """Temporary directories of interrupted writes."""
        if self.root.is_dir():
            for p in self.root.iterdir():
                if p.name.startswith((".tmp-step-", ".old-step-")):
                    shutil.rmtree(p, ignore_errors=True)


def find_checkpoint(path: str | Path, checkpoint_dir: str | None = None) -> Path:
    """The checkpoint to resume from: ``path`` itself if it is one, else the newest one in
    ``path/checkpoints`` (or ``checkpoint_dir``). CheckpointError if there is none."""
    p = Path(path)
    if (p / PIPELINE_FILE).is_file():
        return p
    roots = [Path(checkpoint_dir)] if checkpoint_dir else []
    roots.append(p / "checkpoints")
    for root in roots:
        latest = CheckpointStore(root).latest()
        if latest is not None:
            return latest
    where = " or ".join(str(r) for r in roots)
    raise CheckpointError(f"no checkpoint to resume from in {where}")


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / META_FILE).read_text())


def load_pipeline(path: Path) -> dict[str, Any]:
    try:
        with open(Path(path) / PIPELINE_FILE, "rb") as f:
            state = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        raise CheckpointError(f"{path}: cannot read {PIPELINE_FILE}: {e}") from e
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {state.get('format')!r}, this ferryman reads {FORMAT}")
    return state


# --------------------------------------------------------------------------- the checkpointer


async def push_weights(synchronizer: Any, version: int) -> dict[str, float]:
    """Give every engine the trainer's current weights under ``version`` (at a resume, before
    anything generates). Uses the Synchronizer's transfer (retries, lost replicas dropped)."""
    await synchronizer._all("pause", "pause", False)
    await synchronizer._all("release_kv_cache", "release_kv_cache")
    m = await synchronizer._transfer(version)
    await synchronizer._all("set_version", "set_version", version)
    await synchronizer._all("resume_kv_cache", "resume_kv_cache")
    await synchronizer._all("resume", "resume")
    return m


class Checkpointer:
    """Takes and restores checkpoints for one Trainer (see the module docstring).

    ``rollouter`` is the Rollouter or a proxy with the same async methods
    (``checkpoint_state``, ``restore_state``, ``freeze``); ``queue`` a Queue; ``synchronizer``
    the Trainer's Synchronizer (its ``on_paused`` is set here).
    """

    def __init__(
        self,
        config: Any,
        *,
        run_dir: str | Path,
        backend: Any,
        queue: Any,
        synchronizer: Any,
        rollouter: Any,
        settle_s: float = 0.2,
    ) -> None:
        self.config = config
        self.store = CheckpointStore(Path(config.dir) if config.dir else Path(run_dir) / "checkpoints", config.keep)
        self.every = int(config.every_steps)
        self.backend = backend
        self.queue = queue
        self.synchronizer = synchronizer
        self.rollouter = rollouter
        self.settle_s = settle_s
        self.trainer: Any = None
        self._cut: dict[str, Any] | None = None
        self.saved: list[dict[str, Any]] = []
        self.restored: dict[str, Any] | None = None
        synchronizer.on_paused = self.on_paused

    def attach(self, trainer: Any) -> None:
        self.trainer = trainer

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    # ------------------------------------------------------------------ cutting
    async def _capture(self, sync_version: int | None) -> dict[str, Any]:
        t0 = time.monotonic()
        rollouter = await self.rollouter.checkpoint_state(sync_version)
        queued = list(await self.queue.snapshot())  # after the Rollouter's: see the module doc
        return {"rollouter": rollouter, "queue": queued, "capture_s": time.monotonic() - t0}

    async def on_paused(self, version: int) -> None:
        """Synchronizer hook: the moment of a consistent cut. Captures one if a checkpoint is
        due after the step under way (or a stop was asked for)."""
        t = self.trainer
        if t is not None and (self.due(t.global_step + 1) or t.stop_requested):
            self._cut = await self._capture(version)

    async def after_step(self) -> None:
        """End of a trainer step: write the cut captured during its sync, or cut now for a stop."""
        hit("trainer.step")
        t = self.trainer
        kind = None
        if self._cut is not None:
            cut, self._cut = self._cut, None
            kind = "stop" if t.stop_requested else "periodic"
            await self._save(cut, kind)
        if t.stop_requested and t.local_trigger_step == 0 and kind != "stop":
            # asked to stop after the cut of this step (or none was due): cut again, now, so
            # that what was generated since is kept too
            await self.save_final()

    async def save_final(self) -> Path:
        """Cut now, outside a sync (a stop): the trainer must be at a sync boundary."""
        t = self.trainer
        if t.local_trigger_step != 0:
            raise CheckpointError("a checkpoint outside a sync needs the trainer at a sync boundary")
        await self.rollouter.freeze()
        await self.synchronizer._all("pause", "pause", True)
        await asyncio.sleep(self.settle_s)  # let aborted generations reach their runs
        return await self._save(await self._capture(None), "stop")

    async def _save(self, cut: dict[str, Any], kind: str) -> Path:
        t = self.trainer
        step = t.global_step
        pending = list(t.pending_samples)
        pipeline = {
            "format": FORMAT,
            "kind": kind,
            "step": step,
            "created_at": time.time(),
            "trainer": {
                "global_step": step,
                "current_param_version": t.current_param_version,
                "local_trigger_step": t.local_trigger_step,
                "step_records": [dict(r) for r in t.step_records],
                "pending": pending,
            },
            "rollouter": cut["rollouter"],
            "queue": cut["queue"],
        }
        inflight = cut["rollouter"]["inflight"]
        meta = {
            "format": FORMAT,
            "kind": kind,
            "step": step,
            "version": t.current_param_version,
            "created_at": pipeline["created_at"],
            "queued": [s.uid for s in cut["queue"]],
            "pending": [s.uid for s in pending],
            "inflight": [i["uid"] for i in inflight],
            "inflight_runs_under_way": sum(len(i["logs"]) for i in inflight),
            "inflight_tokens": sum(rl.num_tokens for i in inflight for rl in i["logs"].values()),
            "cursor": cut["rollouter"]["cursor"],
            "epoch": cut["rollouter"]["epoch"],
        }

        def write(tmp: Path) -> None:
            save_trainer_state(self.backend, tmp / TRAINER_DIR)
            with open(tmp / PIPELINE_FILE, "wb") as f:
                pickle.dump(pipeline, f, protocol=pickle.HIGHEST_PROTOCOL)
                f.flush()
                os.fsync(f.fileno())
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1))

        t0 = time.monotonic()
        path = await asyncio.to_thread(self.store.write, step, write)
        meta.update({"path": str(path), "write_s": time.monotonic() - t0, "capture_s": cut["capture_s"]})
        self.saved.append({k: meta[k] for k in ("path", "kind", "step", "version", "write_s", "capture_s", "inflight_runs_under_way")})
        log.info("checkpoint %s (%s): step %d, %d queued, %d in flight", path, kind, step, len(meta["queued"]), len(meta["inflight"]))
        return path

    # ------------------------------------------------------------------ resuming
    async def restore(self, path: str | Path) -> dict[str, Any]:
        """Continue from the checkpoint at ``path``: trainer, engines, queue, Rollouter. Call
        before the Rollouter's ``fit()`` starts."""
        path = Path(path)
        t0 = time.monotonic()
        pipeline = load_pipeline(path)
        await asyncio.to_thread(load_trainer_state, self.backend, path / TRAINER_DIR)
        t = self.trainer
        ts = pipeline["trainer"]
        t.global_step = ts["global_step"]
        t.current_param_version = ts["current_param_version"]
        t.local_trigger_step = ts["local_trigger_step"]
        t.step_records = list(ts["step_records"])
        t.pending_samples = list(ts["pending"])
        await push_weights(self.synchronizer, t.current_param_version)
        queued: list[Sample] = pipeline["queue"]
        for sample in queued:
            if not await self.queue.put(sample):
                raise CheckpointError("the queue closed while it was being refilled")
        exclude = {s.uid for s in queued} | {s.uid for s in t.pending_samples}
        exclude |= {u for rec in t.step_records for u in rec.get("sample_uids", ())}
        info = await self.rollouter.restore_state(pipeline["rollouter"], sorted(exclude))
        self.restored = {
            "path": str(path),
            "kind": pipeline["kind"],
            "step": t.global_step,
            "version": t.current_param_version,
            "queued": len(queued),
            "pending": len(t.pending_samples),
            **info,
            "restore_s": time.monotonic() - t0,
        }
        log.info("resumed from %s: %s", path, self.restored)
        return self.restored
