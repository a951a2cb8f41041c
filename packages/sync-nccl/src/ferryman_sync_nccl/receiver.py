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
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ferryman_sync_nccl import group as G
from ferryman_sync_nccl.channel import ChannelClosed, StoreReceiver, ZmqReceiver
from ferryman_sync_nccl.wire import TRAILER_BYTES, Assembler, Entry, lane_sums

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5


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
        self._thread: threading.Thread | None = None
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
        threading.Thread(target=self._heartbeat, name=f"ferryman-receiver-hb-{self.name}", daemon=True).start()
        return self

    def _heartbeat(self) -> None:
        """Count up ``hb/<rank>`` in the sender's store while this receiver runs, so the
        sender can tell a dead receiver from one stuck in a broken collective."""
        try:
            store = dist.TCPStore(str(self.params["host"]), int(self.params["store_port"]), None, False, G._td(self.connect_timeout_s))
            while not self._closed.is_set() and self._thread is not None and self._thread.is_alive():
                store.add(f"hb/{self.rank}", 1)
                self._closed.wait(HEARTBEAT_S)
        except Exception:  # noqa: BLE001 - the sender's store is gone: this session is over
            self._sender_gone.set()

    def close(self, timeout_s: float = 0.3) -> None:
        """Stop; a thread blocked in a collective ends at the group's timeout."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            if self.cuda:
                torch.cuda.set_device(self.device)
            self._join()
            while not self._closed.is_set():
                msg = self.channel.recv(None)
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
                self.channel.close()
            except Exception:  # noqa: BLE001
                pass
            if self._own_loop is not None:
                self._own_loop.close()
            self._on_exit()

    def _join(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _sync(self, begin: dict[str, Any]) -> None:
        """One sync, from ``begin`` to ``end`` (or ``abort``/``close``)."""
        st = _SyncState(begin["sync"], int(begin["version"]), bool(begin["verify"]))
        try:
            while True:
                msg = self.channel.recv(self.timeout_s)
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
        """The receiver thread ends (after :meth:`_on_error` if it failed)."""
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
            # the comparison reads the data on the CPU: first make sure it came (with a deadline)
            G.wait_stream(self.device, self.timeout_s, f"receiving bucket {k}")
            sent = buf[used : used + TRAILER_BYTES].view(torch.int64)
            if not torch.equal(lane_sums(buf[:used]), sent):
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
            }
        )


class WeightReceiver(BucketReceiver):
    """The ``nccl`` receiver: joins the group as rank ``params["rank"]`` and receives every
    bucket by broadcast into one of two buffers of its own."""

    def __init__(self, params: dict[str, Any], *, sink: Callable[[list[tuple[str, torch.Tensor]]], Any], loop: asyncio.AbstractEventLoop | None = None, name: str = "receiver") -> None:
        self.backend = str(params["backend"])
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.pg: Any = None
        super().__init__(params, sink=sink, loop=loop, name=name)

    def _on_error(self) -> None:
        if self.cuda:
            G.abort(self.pg)

    def _on_exit(self) -> None:
        super()._on_exit()
        if self.error is None:
            G.shutdown(self.pg)

    def _join(self) -> None:
        self.channel.send({"op": "hello", "generation": self.generation, "rank": self.rank, "name": self.name})
        self.pg = G.new_group(dist.PrefixStore("pg/", self.store), self.rank, self.world_size, self.backend, self.connect_timeout_s)
        self.channel.handshake(self.generation, self.rank, time.monotonic() + self.connect_timeout_s)
        probe = torch.zeros(64, dtype=torch.uint8, device=self.device)
        G.wait(G.broadcast(self.pg, probe), self.connect_timeout_s, cuda=self.cuda)
        G.wait_stream(self.device, self.connect_timeout_s, "the group's first broadcast")
        self.bufs = [torch.empty(self.bucket_bytes + TRAILER_BYTES, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self.ready.set()

    def _bucket(self, msg: dict[str, Any], st: _SyncState) -> None:
        slot = st.buckets % 2
        n = int(msg["nbytes"]) + (TRAILER_BYTES if st.verify else 0)
        # start receiving bucket k into the free buffer, then load bucket k-1
        work = G.broadcast(self.pg, self.bufs[slot][:n]) if n else None
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
