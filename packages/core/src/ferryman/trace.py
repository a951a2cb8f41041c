"""The event trace: one JSON line per span or event, one file per process, merged by the reader.

Every run writes ``RUN_DIR/trace/<process>-<pid>.jsonl``. Each process (the driver, and with
``runtime: ray`` the Rollouter, Trainer and MessageQueue actors) configures its own tracer with
:func:`configure`; code anywhere in that process records through the module functions
(:func:`span`, :func:`complete`, :func:`instant`), which cost one attribute check when tracing is
off. Timestamps are ``time.time()`` (seconds since the epoch), so files from processes of one
machine merge onto one time axis; :func:`read_trace` merges them.

Record layout (``SCHEMA_VERSION`` 1)::

    {"ph": "X", "name": "trainer.train", "ts": 1718000000.123, "dur": 0.250,
     "pid": 4242, "proc": "trainer", "args": {"step": 3, "version": 2, ...}}

``ph`` is ``"X"`` for a span (``ts`` = start, ``dur`` = seconds), ``"i"`` for an instant and
``"M"`` for the header record that opens each file (``name`` ``"process"``, ``args`` with
``schema``, ``level`` and ``proc``). ``name`` is ``<role>.<what>``; the roles are ``rollouter``,
``client``, ``queue``, ``trainer``, ``sync`` and ``run``. :data:`EVENTS` lists every name with
the arguments it always carries and the level it is recorded at; ``tests`` check every record
against it.

Levels: ``off`` (nothing), ``basic`` (default; what the timeline, the idle ratios and the
staleness histograms need: a handful of records per sample and per trainer step), ``detail``
(adds one span per engine call, including each piece of a resumed generation). The measured cost is in ``bench/results/trace_overhead.md``.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

SCHEMA_VERSION = 1
LEVELS = {"off": 0, "basic": 1, "detail": 2}
OFF, BASIC, DETAIL = 0, 1, 2

# name -> (ph, level, required args). The reader's schema check and the docs use this table.
EVENTS: dict[str, tuple[str, int, tuple[str, ...]]] = {
    # driver
    "run.start": ("i", BASIC, ("mode", "funnel")),
    "run.end": ("i", BASIC, ()),
    # Rollouter
    "rollouter.sample": ("X", BASIC, ("uid", "task_index", "version", "queued")),
    "rollouter.traj": ("X", BASIC, ("uid", "request_id", "ok", "min_version", "max_version", "tokens", "aborts")),
    "rollouter.blocked": ("X", BASIC, ("reason",)),
    "rollouter.window": ("i", BASIC, ("version", "carried", "quota")),
    # server client
    "client.generate": ("X", BASIC, ("request_id", "replica", "tokens", "pieces", "stop_reason", "min_version", "max_version")),
    "client.abort": ("i", BASIC, ("request_id", "replica", "tokens", "version")),
    "client.resume": ("i", BASIC, ("request_id", "budget")),
    "client.piece": ("X", DETAIL, ("request_id", "replica", "prompt_tokens", "tokens", "stop_reason", "cached_tokens")),
    # MessageQueue
    "queue.put": ("i", BASIC, ("uid", "qsize", "wait")),
    "queue.get": ("i", BASIC, ("uid", "qsize", "wait")),
    # Trainer
    "trainer.wait": ("X", BASIC, ("step", "first_of_window")),
    "trainer.take": ("i", BASIC, ("uid", "version", "min_version", "max_version", "aborts", "tokens", "token_versions")),
    "trainer.train": ("X", BASIC, ("step", "version", "local_step", "samples", "tokens")),
    "trainer.step": ("X", BASIC, ("step", "version")),
    "trainer.phase": ("X", BASIC, ("phase",)),
    # weight sync (runs in the Trainer's process)
    "sync.update": ("X", BASIC, ("version",)),
    "sync.step": ("X", BASIC, ("version", "step")),
    "sync.sleep": ("X", BASIC, ("version",)),
    # validation (runs where the Rollouter runs; never queued or trained on)
    "validation.run": ("X", BASIC, ("step", "version", "pass_at_1", "runs")),
}


class Tracer:
    """Writes records of one process to one file. Thread-safe (trainer phases run in threads).

    Records are buffered and written when the buffer holds ``buffer_records`` records, when
    ``flush_interval_s`` passed since the last write, on :meth:`flush` and on :meth:`close`
    (also at interpreter exit).
    """

    def __init__(
        self,
        path: str | Path | None,
        level: int | str = BASIC,
        proc: str = "main",
        *,
        buffer_records: int = 256,
        flush_interval_s: float = 1.0,
    ) -> None:
        self.level = LEVELS[level] if isinstance(level, str) else int(level)
        self.proc = proc
        self.pid = os.getpid()
        self.path = Path(path) if path is not None else None
        self._buf: list[str] = []
        self._lock = threading.Lock()
        self._buffer_records = buffer_records
        self._flush_interval_s = flush_interval_s
        self._last_flush = time.monotonic()
        self.records_written = 0
        if self.path is None:
            self.level = OFF
        if self.level > OFF and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            header = {
                "ph": "M",
                "name": "process",
                "ts": time.time(),
                "pid": self.pid,
                "proc": proc,
                "args": {"schema": SCHEMA_VERSION, "level": level_name(self.level), "proc": proc},
            }
            self._buf.append(json.dumps(header))
            self.flush()

    def enabled(self, level: int = BASIC) -> bool:
        return self.level >= level

    def _emit(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=_jsonable)
        with self._lock:
            self._buf.append(line)
            due = len(self._buf) >= self._buffer_records or time.monotonic() - self._last_flush >= self._flush_interval_s
        if due:
            self.flush()

    def instant(self, name: str, level: int = BASIC, ts: float | None = None, **args: Any) -> None:
        if self.level < level:
            return
        self._emit({"ph": "i", "name": name, "ts": time.time() if ts is None else ts, "pid": self.pid, "proc": self.proc, "args": args})

    def complete(self, name: str, start: float, dur: float, level: int = BASIC, **args: Any) -> None:
        """A span measured by the caller: ``start`` is a ``time.time()`` reading."""
        if self.level < level:
            return
        self._emit({"ph": "X", "name": name, "ts": start, "dur": max(0.0, dur), "pid": self.pid, "proc": self.proc, "args": args})

    @contextmanager
    def span(self, name: str, level: int = BASIC, **args: Any) -> Iterator[dict[str, Any]]:
        """Time the ``with`` block; the yielded dict is the record's ``args`` (add to it)."""
        if self.level < level:
            yield args
            return
        t0 = time.time()
        try:
            yield args
        finally:
            self.complete(name, t0, time.time() - t0, level, **args)

    def flush(self) -> None:
        if self.path is None:
            return
        with self._lock:
            lines, self._buf = self._buf, []
            self._last_flush = time.monotonic()
            if not lines:
                return
            with self.path.open("a") as f:
                f.write("\n".join(lines) + "\n")
            self.records_written += len(lines)

    def close(self) -> None:
        self.flush()


def level_name(level: int) -> str:
    return {v: k for k, v in LEVELS.items()}[level]


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


# ----------------------------------------------------------------------------- process tracer

_OFF = Tracer(None, OFF)
_current: Tracer = _OFF


def configure(run_dir: str | Path, level: int | str = BASIC, proc: str = "main") -> Tracer:
    """Make this process record into ``run_dir/trace/<proc>-<pid>.jsonl`` (``level`` ``off``
    turns tracing off). Calling it again with the same directory, level and process name keeps
    the current tracer; otherwise the current one is closed first."""
    global _current
    lvl = LEVELS[level] if isinstance(level, str) else int(level)
    if lvl == OFF:
        close()
        return _current
    path = Path(run_dir) / "trace" / f"{proc}-{os.getpid()}.jsonl"
    if _current.path == path and _current.level == lvl:
        return _current
    close()
    _current = Tracer(path, lvl, proc)
    return _current


def get() -> Tracer:
    return _current


def close() -> None:
    """Flush and stop tracing in this process."""
    global _current
    _current.close()
    _current = _OFF


atexit.register(lambda: _current.flush())


def enabled(level: int = BASIC) -> bool:
    return _current.level >= level


def instant(name: str, level: int = BASIC, **args: Any) -> None:
    if _current.level >= level:
        _current.instant(name, level, **args)


def complete(name: str, start: float, dur: float, level: int = BASIC, **args: Any) -> None:
    if _current.level >= level:
        _current.complete(name, start, dur, level, **args)


def span(name: str, level: int = BASIC, **args: Any) -> Any:
    return _current.span(name, level, **args)


def flush() -> None:
    _current.flush()


def wall(mono: float) -> float:
    """Turn a ``time.monotonic()`` reading into ``time.time()`` (for spans timed with monotonic)."""
    return time.time() - (time.monotonic() - mono)


F = TypeVar("F", bound=Callable[..., Any])


def traced(phase: str, name: str = "trainer.phase", level: int = BASIC) -> Callable[[F], F]:
    """Decorator: record each call of a (sync or async) function as a span ``name`` with
    ``args.phase = phase``."""

    def deco(fn: F) -> F:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def awrapper(*a: Any, **k: Any) -> Any:
                if _current.level < level:
                    return await fn(*a, **k)
                t0 = time.time()
                try:
                    return await fn(*a, **k)
                finally:
                    _current.complete(name, t0, time.time() - t0, level, phase=phase)

            return awrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            if _current.level < level:
                return fn(*a, **k)
            t0 = time.time()
            try:
                return fn(*a, **k)
            finally:
                _current.complete(name, t0, time.time() - t0, level, phase=phase)

        return wrapper  # type: ignore[return-value]

    return deco


# ----------------------------------------------------------------------------- reading


class TraceError(ValueError):
    """A trace directory is missing, empty or malformed."""


def trace_files(run_dir: str | Path) -> list[Path]:
    d = Path(run_dir) / "trace"
    if not d.is_dir():
        raise TraceError(f"{str(run_dir)!r} has no trace/ directory (was the run traced? trace.level must not be 'off')")
    files = sorted(d.glob("*.jsonl"))
    if not files:
        raise TraceError(f"{str(d)!r} holds no *.jsonl trace files")
    return files


def read_trace(run_dir: str | Path, *, strict: bool = False) -> list[dict[str, Any]]:
    """All records of a run (every process's file), sorted by start time.

    A line that is not valid JSON is skipped (a process killed mid-write leaves at most its last
    line torn) unless ``strict``; ``strict`` also checks every record against :data:`EVENTS`.
    """
    records: list[dict[str, Any]] = []
    for path in trace_files(run_dir):
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    if strict:
                        raise TraceError(f"{path}:{lineno}: not JSON: {e}") from None
                    continue
                if strict:
                    problems = check_record(rec)
                    if problems:
                        raise TraceError(f"{path}:{lineno}: {'; '.join(problems)}")
                records.append(rec)
    records.sort(key=lambda r: r.get("ts", 0.0))
    return records


def check_record(rec: Any) -> list[str]:
    """Problems of one record against the schema (empty when it is valid)."""
    if not isinstance(rec, dict):
        return ["record is not an object"]
    problems = []
    for key, typ in (("ph", str), ("name", str), ("ts", (int, float)), ("pid", int), ("proc", str), ("args", dict)):
        if not isinstance(rec.get(key), typ):
            problems.append(f"field {key!r} missing or of the wrong type")
    if problems:
        return problems
    if rec["ph"] == "M":
        if rec["name"] != "process" or rec["args"].get("schema") != SCHEMA_VERSION:
            problems.append(f"header record must be 'process' with schema {SCHEMA_VERSION}")
        return problems
    spec = EVENTS.get(rec["name"])
    if spec is None:
        return [f"unknown event name {rec['name']!r}"]
    ph, _, required = spec
    if rec["ph"] != ph:
        problems.append(f"{rec['name']}: ph must be {ph!r}, got {rec['ph']!r}")
    if ph == "X" and not (isinstance(rec.get("dur"), (int, float)) and rec["dur"] >= 0):
        problems.append(f"{rec['name']}: span without a non-negative 'dur'")
    missing = [a for a in required if a not in rec["args"]]
    if missing:
        problems.append(f"{rec['name']}: missing args {missing}")
    return problems


def to_chrome(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The records as a Chrome / Perfetto trace (open in ui.perfetto.dev or chrome://tracing)."""
    out = []
    for r in records:
        if r.get("ph") == "M":
            out.append({"ph": "M", "name": "process_name", "pid": r["pid"], "tid": 0, "args": {"name": r["args"].get("proc", "")}})
            continue
        role = r["name"].split(".", 1)[0]
        ev = {"ph": r["ph"], "name": r["name"], "cat": role, "ts": r["ts"] * 1e6, "pid": r["pid"], "tid": role, "args": r.get("args", {})}
        if r["ph"] == "X":
            ev["dur"] = r["dur"] * 1e6
        else:
            ev["s"] = "t"
        out.append(ev)
    return {"traceEvents": out, "displayTimeUnit": "ms"}
