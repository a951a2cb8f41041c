"""The engine side of the ``nccl`` weight sync: :class:`WeightReceiver`.

It lives where an engine replica lives (inside its Ray actor, in the engine's process, or in
the trainer's process for local engines), built by the plugin's ``receiver_factory`` when the
transport calls ``engine.attach_weight_receiver``. A background thread joins the group, then
waits for syncs: for each bucket it starts the receive into the free one of two buffers before
loading the previous bucket (so receiving bucket k+1 overlaps loading bucket k), checks the
bucket's checksum, and hands the tensors to the engine's ``load_weights`` on the engine's
event loop. Whole tensors are views of the receive buffer; a tensor split across buckets is
assembled first. At the end it reports what it loaded (or why not) to the sender.

On the GPU, receives run on the process group's NCCL stream and loads on the engine's stream;
the group orders a receive after earlier work of the stream that issued it, so a buffer is
overwritten only after the copies out of it (engines load on the device's default stream).

Teardown. Only the receiver's own thread frees its group, and only once no collective of the
group is in flight (:meth:`~ferryman_sync_nccl.group.Group.release`); it then says ``bye`` to
the sender, which frees its side of the group and its store only after every receiver said bye
(or a short grace passed). :meth:`BucketReceiver.close` asks the thread to stop (it notices
within :data:`IDLE_POLL_S` when idle) and waits for it to end, with a bound: awaited on an
event loop it does not block the loop (the engine may still be loading a bucket on it).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ferryman_sync_nccl import group as G
from ferryman_sync_nccl.channel import ChannelClosed, StoreReceiver, ZmqReceiver
from ferryman_sync_nccl.wire import TRAILER_BYTES, Assembler, Entry, lane_sums

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
IDLE_POLL_S = 0.2
"""How often an idle receiver looks whether it was asked to close."""
CLOSE_GRACE_S = 5.0
"""How much longer than ``timeout_s`` :meth:`BucketReceiver.close` waits for the thread to end."""


class _Broken(RuntimeError):
    """The group or the channel failed: this receiver stops."""


class BucketReceiver:
    """What the receivers of the ``nccl`` and ``cuda_ipc`` transports share: the sender's store
    and metadata channel, the thread that waits for syncs, the heartbeat, checking and loading
    one bucket, and the report. Subclasses give :meth:`_join` and :meth:`_sync`.

    ``params`` come from the sender (``_Session.receiver_params``); ``sink(named_tensors)``
    loads one bucket (an engine's ``load_weights``; may be async) and is run on ``loop`` when
    given, else on the receiver's thread.
    """

    def __init__(self, params: dict[str, Any], *, sink: Callable[[list[tuple[str, torch.Tensor]]], Any], loop: asyncio.AbstractEventLoop | None = None, name: str = "receiver") -> None:
        self.params = dict(params)
        self.sink = sink
        self.loop = loop
        self.name = name
        self.rank = int(params["rank"])
        self.world_size = int(params["world_size"])
        self.generation = str(params["generation"])
        self.timeout_s = float(params["timeout_s"])
        self.connect_timeout_s = float(params["connect_timeout_s"])
        self.bucket_bytes = int(params["bucket_bytes"])
        if not hasattr(self, "device"):
            self.device = torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.error: str | None = None
        """Why the receiver stopped (None while it runs or after a clean close)."""
        self.ready = threading.Event()
        self.version: int | None = None
        """Version of the last sync it loaded completely."""
        self.syncs = 0
        self.failed_syncs = 0
        self._closed = threading.Event()
        self._sender_gone = threading.Event()
        self._hb_stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hb_thread: threading.Thread | None = None
        self._own_loop: asyncio.AbstractEventLoop | None = None
        self.bufs: list[torch.Tensor] = []
        # the parts that fail at once on a wrong address or a missing library fail here, in
        # the caller (attach_weight_receiver), not later in the thread
        self.store = dist.TCPStore(str(params["host"]), int(params["store_port"]), None, False, G._td(self.connect_timeout_s))
        if params["metadata"] == "zmq":
            self.channel: Any = ZmqReceiver(self.params)
        else:
            self.channel = StoreReceiver(dist.PrefixStore("ch/", self.store), self.rank)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> BucketReceiver:
        self._thread = threading.Thread(target=self._run, name=f"ferryman-receiver-{self.name}", daemon=True)
        self._thread.start()
        self._hb_thread = threading.Thread(target=self._heartbeat, name=f"ferryman-receiver-hb-{self.name}", daemon=True)
        self._hb_thread.start()
        return self

    def _heartbeat(self) -> None:
        """Count up ``hb/<rank>`` in the sender's store while this receiver runs, so the
        sender can tell a dead receiver from one stuck in a broken collective."""
        try:
            store = dist.TCPStore(str(self.params["host"]), int(self.params["store_port"]), None, False, G._td(self.connect_timeout_s))
            while not self._hb_stop.is_set():
                store.add(f"hb/{self.rank}", 1)
                self._hb_stop.wait(HEARTBEAT_S)
        except Exception:  # noqa: BLE001 - the sender's store is gone: this session is over
            self._sender_gone.set()

    def close(self, timeout_s: float | None = None) -> Any:
        """Ask the receiver to stop and wait until its thread has ended (it frees its group
        there, after the group's last collective), at most ``timeout_s`` (default
        ``timeout_s + CLOSE_GRACE_S``: a sync in progress ends within its own deadlines).
        Called on a running event loop it returns an awaitable to await instead of blocking
        the loop; a thread still running at the bound is left to finish by itself (logged)."""
        self._closed.set()
        self._hb_stop.set()
        bound = self.timeout_s + CLOSE_GRACE_S if timeout_s is None else timeout_s
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None and self._thread is not threading.current_thread():
            return loop.run_in_executor(None, self._wait_ended, bound)
        self._wait_ended(bound)
        return None

    def _wait_ended(self, bound: float) -> bool:
        deadline = time.monotonic() + bound
        for t in (self._thread, self._hb_thread):
            if t is not None and t is not threading.current_thread():
                t.join(max(deadline - time.monotonic(), 0.0))
        if self.alive:
            log.warning("weight receiver %s: its thread is still running %.0fs after close (it frees its group itself when its collective ends)", self.name, bound)
            return False
        return True

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            if self.cuda:
                torch.cuda.set_device(self.device)
            self._join()
            while not self._closed.is_set():
                msg = self.channel.recv(IDLE_POLL_S)
                if msg is None:
                    if self._sender_gone.is_set():
                        raise ChannelClosed("the sender is gone (its store stopped answering)")
                    continue
                op = msg.get("op")
                if op == "begin":
                    self._sync(msg)
                elif op == "close":
                    break
        except Exception as e:  # noqa: BLE001 - the thread's last word
            self.error = f"{type(e).__name__}: {e}"
            if not self._closed.is_set():
                log.warning("weight receiver %s stopped: %s", self.name, self.error)
            self._on_error()
        finally:
            self.ready.set()
            try:
                self._on_exit()  # frees the group (after its last collective)
            finally:
                self._hb_stop.set()
                try:  # (also after an error: the group is freed either way)
                    self.channel.send({"op": "bye", "generation": self.generation, "rank": self.rank})
                except Exception:  # noqa: BLE001 - the sender is gone
                    pass
                try:
                    self.channel.close()
                except Exception:  # noqa: BLE001
                    pass
                if self._own_loop is not None:
                    self._own_loop.close()

    def _join(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _sync(self, begin: dict[str, Any]) -> None:
        """One sync, from ``begin`` to ``end`` (or ``abort``/``close``)."""
        st = _SyncState(begin["sync"], int(begin["version"]), bool(begin["verify"]))
        st.stats0 = dict(getattr(self.channel, "stats", {}))
        try:
            while True:
                msg = self._next(st)
                if msg is None:
                    raise _Broken(f"no metadata from the sender within {self.timeout_s:g}s during the sync to version {st.version}")
                op = msg.get("op")
                if op == "bucket":
                    if msg.get("sync") != st.sync or msg.get("k") != st.buckets:
                        raise _Broken(f"metadata out of order: expected bucket {st.buckets} of sync {st.sync}, got {msg.get('k')} of {msg.get('sync')}")
                    self._bucket(msg, st)
                elif op == "end":
                    self._drain(st)
                    if st.error is None and st.assembler.incomplete():
                        st.error = f"tensors still incomplete at the end: {', '.join(st.assembler.incomplete()[:5])}"
                    self._report(st)
                    return
                elif op == "abort":
                    st.error = f"aborted by the sender: {msg.get('reason')}"
                    st.fatal = bool(msg.get("group_failed"))
                    self._report(st)
                    if st.fatal:
                        raise _Broken(st.error)
                    self._settle(st)
                    return
                elif op == "close":
                    self._closed.set()
                    return
        except (G.GroupError, _Broken, ChannelClosed) as e:
            raise self._stopped(st, e) from e

    def _next(self, st: _SyncState) -> dict[str, Any] | None:
        """The next metadata message of a sync, or None after ``timeout_s``."""
        return self.channel.recv(self.timeout_s)

    def _bucket(self, msg: dict[str, Any], st: _SyncState) -> None:  # pragma: no cover - abstract
        """Bucket ``msg["k"]`` was announced: receive it (count it in ``st``) and load it."""
        raise NotImplementedError

    def _drain(self, st: _SyncState) -> None:
        """The sync's ``end`` came: finish what is still in flight."""

    def _settle(self, st: _SyncState) -> None:
        """The sender aborted the sync (its group is fine): leave nothing in flight."""

    def _on_error(self) -> None:
        """The receiver thread stopped on an error."""

    def _on_exit(self) -> None:
        """The receiver thread ends (after :meth:`_on_error` if it failed): free what it
        holds, here in its own thread."""
        self.bufs = []

    # ------------------------------------------------------------------ one sync
    def _stopped(self, st: _SyncState, e: BaseException) -> _Broken:
        """The group or the channel failed mid-sync: report (fatal) if not yet done; returns
        the error that ends the receiver's thread."""
        if not st.reported:
            st.error = st.error or f"{e}"
            st.fatal = True  # this receiver stops: the sender must rebuild the group
            try:
                self._report(st)
            except Exception:  # noqa: BLE001
                pass
        return _Broken(f"{e}")

    def _consume(self, buf: torch.Tensor, msg: dict[str, Any], st: _SyncState) -> None:
        """Check bucket ``msg`` (now in ``buf``) against its checksum and load it; any problem
        is recorded in ``st.error`` and nothing more is loaded in this sync."""
        if st.error is not None:
            return  # keep receiving (the sender needs every receiver) but load nothing more
        used = int(msg["nbytes"])
        k = int(msg["k"])
        if st.verify:
            same = (lane_sums(buf[:used]) == buf[used : used + TRAILER_BYTES].view(torch.int64)).all()
            # the verdict is read on the CPU: one wait for the device (the data, then the sums),
            # with a deadline
            G.wait_stream(self.device, self.timeout_s, f"checking bucket {k}")
            if not bool(same):
                st.error = f"bucket {k}: checksum mismatch (the data arrived corrupted)"
                return
        try:
            named = st.assembler.unpack(buf, [Entry.from_json(row) for row in msg["entries"]])
            if named:
                t = time.perf_counter()
                self._load(named)
                st.load_s += time.perf_counter() - t
                st.tensors += len(named)
        except Exception as e:  # noqa: BLE001 - the engine refused the bucket
            names = ", ".join(n for n, *_ in msg["entries"][:3])
            st.error = f"loading bucket {k} ({names}, ...) failed: {e!r}"

    def _load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        async def call() -> None:
            result = self.sink(named)
            if inspect.isawaitable(result):
                await result

        if self.loop is not None:
            asyncio.run_coroutine_threadsafe(call(), self.loop).result(self.timeout_s)
            return
        if self._own_loop is None:
            self._own_loop = asyncio.new_event_loop()
        self._own_loop.run_until_complete(call())

    def _report(self, st: _SyncState) -> None:
        ok = st.error is None
        if ok:
            self.version = st.version
            self.syncs += 1
        else:
            self.failed_syncs += 1
        st.reported = True
        self.channel.send(
            {
                "op": "report",
                "sync": st.sync,
                "rank": self.rank,
                "name": self.name,
                "ok": ok,
                "error": st.error,
                "fatal": st.fatal,
                "version": st.version,
                "buckets": st.buckets,
                "bytes": st.bytes,
                "tensors": st.tensors,
                "load_s": st.load_s,
                "wait_s": st.wait_s,
                # this sync's traffic on the side channel, up to this report
                "channel": {k: v - st.stats0.get(k, 0) for k, v in getattr(self.channel, "stats", {}).items()},
            }
        )


class WeightReceiver(BucketReceiver):
    """The ``nccl`` receiver: joins the group as rank ``params["rank"]`` and receives every
    bucket by broadcast into one of two buffers of its own."""

    def __init__(self, params: dict[str, Any], *, sink: Callable[[list[tuple[str, torch.Tensor]]], Any], loop: asyncio.AbstractEventLoop | None = None, name: str = "receiver") -> None:
        self.backend = str(params["backend"])
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.group: G.Group | None = None
        super().__init__(params, sink=sink, loop=loop, name=name)

    @property
    def pg(self) -> Any:
        """The process group (None before the join and once freed)."""
        return None if self.group is None else self.group.pg

    def _on_error(self) -> None:
        if self.group is not None:
            self.group.abort()

    def _on_exit(self) -> None:
        super()._on_exit()
        if self.group is not None:
            # wait for the group's collectives to end (a gloo one ends at its deadline), then
            # free it in this thread; never while one of them runs
            self.group.release()

    def _join(self) -> None:
        self.channel.send({"op": "hello", "generation": self.generation, "rank": self.rank, "name": self.name})
        pg = G.new_group(dist.PrefixStore("pg/", self.store), self.rank, self.world_size, self.backend, self.connect_timeout_s)
        self.group = G.Group(pg, self.backend, max(self.timeout_s, self.connect_timeout_s))
        self.channel.handshake(self.generation, self.rank, time.monotonic() + self.connect_timeout_s)
        probe = torch.zeros(64, dtype=torch.uint8, device=self.device)
        G.wait(self.group.broadcast(probe), self.connect_timeout_s, cuda=self.cuda)
        G.wait_stream(self.device, self.connect_timeout_s, "the group's first broadcast")
        # the join may take connect_timeout_s; from now on a collective ends within timeout_s
        self.group.set_op_timeout(self.timeout_s)
        self.bufs = [torch.empty(self.bucket_bytes + TRAILER_BYTES, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self.ready.set()

    def _bucket(self, msg: dict[str, Any], st: _SyncState) -> None:
        slot = st.buckets % 2
        n = int(msg["nbytes"]) + (TRAILER_BYTES if st.verify else 0)
        # start receiving bucket k into the free buffer, then load bucket k-1
        assert self.group is not None
        work = self.group.broadcast(self.bufs[slot][:n]) if n else None
        st.buckets += 1
        st.bytes += int(msg["nbytes"])
        if st.pending is not None:
            self._finish(st.pending, st)
        st.pending = (msg, work, slot)

    def _drain(self, st: _SyncState) -> None:
        if st.pending is not None:
            self._finish(st.pending, st)
            st.pending = None
        G.wait_stream(self.device, self.timeout_s, "loading the last bucket")

    def _settle(self, st: _SyncState) -> None:
        if st.pending is not None:
            G.wait(st.pending[1], self.timeout_s, cuda=self.cuda)

    def _finish(self, pending: tuple[dict[str, Any], Any, int], st: _SyncState) -> None:
        msg, work, slot = pending
        t = time.perf_counter()
        G.wait(work, self.timeout_s, cuda=self.cuda)
        st.wait_s += time.perf_counter() - t
        self._consume(self.bufs[slot], msg, st)


class _SyncState:
    def __init__(self, sync: int, version: int, verify: bool) -> None:
        self.sync = sync
        self.version = version
        self.verify = verify
        self.assembler = Assembler()
        self.buckets = 0
        self.bytes = 0
        self.tensors = 0
        self.load_s = 0.0
        self.wait_s = 0.0
        self.error: str | None = None
        self.fatal = False
        self.reported = False
        self.pending: Any = None
        """nccl: the bucket received last, not yet loaded (message, work, buffer)."""
        self.loads: deque[tuple[int, Any, float]] = deque()
        """cuda_ipc: buckets loaded (copies queued) and not yet acked (bucket, event, deadline)."""
        self.acked = -1
        """cuda_ipc: the last bucket acked."""
        self.stats0: dict[str, int] = {}
        """The side channel's counts when the sync began."""
