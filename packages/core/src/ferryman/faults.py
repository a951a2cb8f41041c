"""Faults: what counts as a lost replica, and named fault-injection points for tests and benches.

**Lost replicas.** :func:`is_replica_lost` says whether an exception means "this engine replica is
gone" (its Ray actor died, or it raised :class:`ReplicaLostError`). The server client fails such
a request over to another replica; the Synchronizer drops such a replica from weight syncs and
has the router quarantine it.

**Injection points.** Code that wants to be testable under faults calls :func:`hit` (or
:func:`ahit` in async code) with a point name. Nothing happens unless the environment variable
``FERRYMAN_FAULTS`` names that point. Its value is a comma-separated list of rules::

    POINT[@N[+]][:SCOPE]=ACTION

``@N`` fires at the N-th pass through the point in this process (default 1), ``@N+`` at every
pass from the N-th on; ``:SCOPE`` restricts the rule to passes that give that scope (an engine
point gives its replica name). Actions:

``kill``  SIGKILL this process (a crash: nothing is flushed, nothing is cleaned up);
``term``  SIGTERM this process (a polite stop: the run checkpoints and exits);
``raise`` raise :class:`FaultInjected` at the point;
``die``   raise :class:`ReplicaLostError` (an engine replica that is gone; engine points only);
``hang``  never return (async points only; exercises timeouts).

Points in core: ``rollout.generate`` (an agent run calls generate), ``env.run`` (an agent run
starts; scope: the task index), ``engine.generate`` (a replica receives a request; scope: the
replica), ``rollouter.sample`` (the Rollouter starts a sample; scope: the task index),
``trainer.get`` (the trainer took a sample from the queue), ``trainer.step`` (a
trainer step ended), ``sync.bucket`` (a weight bucket is about to be sent), ``checkpoint.write``
(a checkpoint is written but not yet renamed into place).

Example: ``FERRYMAN_FAULTS="engine.generate@20:replica-1=kill,sync.bucket@3=raise"``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger(__name__)

FAULTS_ENV = "FERRYMAN_FAULTS"
ACTIONS = ("kill", "term", "raise", "die", "hang")

T = TypeVar("T")


class ReplicaLostError(RuntimeError):
    """An engine replica is gone (its process died or it was shut down)."""


class FaultInjected(RuntimeError):
    """Raised at an injection point whose rule says ``raise``."""


def is_replica_lost(exc: BaseException) -> bool:
    """True if ``exc`` means the engine replica behind a call no longer exists."""
    if isinstance(exc, ReplicaLostError):
        return True
    if "ray" in sys.modules:
        try:
            from ray.exceptions import ActorUnavailableError, RayActorError
        except ImportError:  # pragma: no cover - other Ray versions
            return False
        return isinstance(exc, RayActorError | ActorUnavailableError)
    return False


@dataclass
class Rule:
    point: str
    at: int
    repeat: bool
    scope: str | None
    action: str

    def matches(self, point: str, scope: str | None, count: int) -> bool:
        if point != self.point or (self.scope is not None and self.scope != scope):
            return False
        return count >= self.at if self.repeat else count == self.at


def parse_rules(text: str) -> list[Rule]:
    """Parse a ``FERRYMAN_FAULTS`` value; ValueError names the bad rule."""
    rules = []
    for raw in (part.strip() for part in text.split(",")):
        if not raw:
            continue
        lhs, sep, action = raw.partition("=")
        if not sep or action not in ACTIONS:
            raise ValueError(f"{FAULTS_ENV}: rule {raw!r}: expected POINT[@N[+]][:SCOPE]=ACTION with ACTION in {ACTIONS}")
        lhs, _, scope = lhs.partition(":")
        point, _, at = lhs.partition("@")
        repeat = at.endswith("+")
        at = at.rstrip("+")
        if not point or (at and not at.isdigit()) or (at and int(at) < 1):
            raise ValueError(f"{FAULTS_ENV}: rule {raw!r}: the point name is empty or N is not a positive integer")
        rules.append(Rule(point, int(at or 1), repeat, scope or None, action))
    return rules


class FaultPlan:
    """The rules of this process and how often each (point, scope) was passed."""

    def __init__(self, rules: list[Rule]) -> None:
        self.rules = rules
        self.points = {r.point for r in rules}
        self.counts: dict[tuple[str, str | None], int] = {}
        self.fired: list[tuple[str, str | None, int, str]] = []
        self._lock = threading.Lock()

    def check(self, point: str, scope: str | None) -> str | None:
        if point not in self.points:
            return None
        with self._lock:
            for key in {(point, None), (point, scope)}:
                self.counts[key] = self.counts.get(key, 0) + 1
            for rule in self.rules:
                if rule.scope is not None and rule.scope != scope:
                    continue
                count = self.counts[(point, rule.scope)]
                if rule.matches(point, scope, count):
                    self.fired.append((point, scope, count, rule.action))
                    return rule.action
        return None


_plan: FaultPlan | None = None
_plan_source: str | None = None


def plan() -> FaultPlan | None:
    """This process's plan, re-read when ``FERRYMAN_FAULTS`` changes; None when unset."""
    global _plan, _plan_source
    text = os.environ.get(FAULTS_ENV, "")
    if text != _plan_source:
        _plan_source = text
        _plan = FaultPlan(parse_rules(text)) if text.strip() else None
    return _plan


def _act(action: str, point: str, scope: str | None) -> None:
    where = f"{point}" + (f"[{scope}]" if scope else "")
    log.warning("fault injected at %s: %s (pid %d)", where, action, os.getpid())
    if action == "kill":
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif action == "raise":
        raise FaultInjected(f"fault injected at {where}")
    elif action == "die":
        raise ReplicaLostError(f"replica lost (fault injected at {where})")


def hit(point: str, scope: Any = None) -> None:
    """A named injection point (synchronous code). A no-op unless a rule names ``point``."""
    p = plan()
    if p is None:
        return
    action = p.check(point, None if scope is None else str(scope))
    if action is not None and action != "hang":
        _act(action, point, None if scope is None else str(scope))


async def ahit(point: str, scope: Any = None) -> None:
    """A named injection point (async code); also supports ``hang``."""
    p = plan()
    if p is None:
        return
    s = None if scope is None else str(scope)
    action = p.check(point, s)
    if action == "hang":
        log.warning("fault injected at %s: hang", point)
        await asyncio.Event().wait()
    elif action is not None:
        _act(action, point, s)


def watch(point: str, items: Iterator[T]) -> Iterator[T]:
    """``items``, passing the injection point ``point`` before each one."""
    for item in items:
        hit(point)
        yield item


def worker_env() -> dict[str, str]:
    """Environment entries that carry the fault plan into Ray workers."""
    text = os.environ.get(FAULTS_ENV)
    return {FAULTS_ENV: text} if text else {}


# --------------------------------------------------------------------------- engine wrapper


class FaultyEngine:
    """An engine seen through the ``engine.generate`` injection point (scope: replica name).

    Used only when ``FERRYMAN_FAULTS`` names that point. ``die`` makes the replica gone, as if
    its process had died: the requests it is serving fail with :class:`ReplicaLostError`, and
    so does every later call; the engine inside is shut down. ``kill`` SIGKILLs the process
    hosting the engine (a Ray engine actor: a real replica death).
    """

    def __init__(self, engine: Any, replica: str) -> None:
        self._engine = engine
        self.replica = replica
        self.lost: ReplicaLostError | None = None
        self._lost_event: asyncio.Event | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def _event(self) -> asyncio.Event:
        if self._lost_event is None:
            self._lost_event = asyncio.Event()
        return self._lost_event

    async def _die(self, error: ReplicaLostError) -> None:
        self.lost = error
        self._event().set()
        try:
            await self._engine.shutdown()
        except Exception as e:  # noqa: BLE001 - it is gone either way
            log.debug("shutdown of lost replica %s: %r", self.replica, e)

    def _check(self) -> None:
        if self.lost is not None:
            raise ReplicaLostError(f"replica {self.replica} is gone: {self.lost}")

    async def generate(self, request_id: str, prompt_ids: list[int], params: Any) -> Any:
        self._check()
        try:
            await ahit("engine.generate", self.replica)
        except ReplicaLostError as e:
            await self._die(e)
            raise
        lost = asyncio.ensure_future(self._event().wait())
        call = asyncio.ensure_future(self._engine.generate(request_id, prompt_ids, params))
        try:
            await asyncio.wait({call, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not call.done():
                call.cancel()
        if self.lost is not None:
            if call.done() and not call.cancelled():
                call.exception()  # consumed: what a gone replica answered does not count
            raise ReplicaLostError(f"replica {self.replica} died while serving {request_id}")
        return call.result()

    async def _forward(self, name: str, *args: Any) -> Any:
        self._check()
        return await getattr(self._engine, name)(*args)

    async def start(self) -> None:
        await self._forward("start")

    async def pause(self, abort: bool) -> None:
        await self._forward("pause", abort)

    async def resume(self) -> None:
        await self._forward("resume")

    async def release_kv_cache(self) -> None:
        await self._forward("release_kv_cache")

    async def resume_kv_cache(self) -> None:
        await self._forward("resume_kv_cache")

    async def load_weights(self, named_tensors: Any) -> None:
        await self._forward("load_weights", named_tensors)

    async def set_version(self, version: int) -> None:
        await self._forward("set_version", version)

    async def get_version(self) -> int:
        return await self._forward("get_version")

    async def stats(self) -> dict[str, float]:
        return await self._forward("stats")

    async def shutdown(self) -> None:
        if self.lost is None:
            await self._engine.shutdown()


def wrap_engine(engine: Any, replica: str) -> Any:
    """``engine`` behind the ``engine.generate`` injection point if a rule names it, else as is."""
    p = plan()
    if p is None or "engine.generate" not in p.points:
        return engine
    return FaultyEngine(engine, replica)


class FaultyEnv:
    """An env whose ``run`` passes the ``env.run`` injection point (scope: task index) first."""

    def __init__(self, env: Any) -> None:
        self._env = env

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def num_tasks(self) -> int:
        return self._env.num_tasks()

    def get_task(self, index: int) -> dict[str, Any]:
        return self._env.get_task(index)

    async def run(self, task: dict[str, Any], request_id: str, client: Any, params: Any) -> Any:
        await ahit("env.run", task.get("index") if isinstance(task, dict) else None)
        return await self._env.run(task, request_id, client, params)


def wrap_env(env: Any) -> Any:
    """``env`` behind the ``env.run`` injection point if a rule names it, else as is."""
    p = plan()
    if p is None or "env.run" not in p.points:
        return env
    return FaultyEnv(env)
