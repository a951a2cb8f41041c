"""The trainer side of the ``nccl`` weight sync: :class:`NcclSync`, a
:class:`ferryman.protocols.WeightSync`.

On its first ``transfer`` (and again after a failure that broke the group, or when the set of
engines changes) it opens a TCPStore and a metadata channel, asks every engine to host a
:class:`~ferryman_sync_nccl.receiver.WeightReceiver` (``engine.attach_weight_receiver``) and
builds the group: rank 0 here, rank ``i + 1`` beside engine ``i``. Later syncs reuse it.

A sync: ``begin`` → for each bucket: pack it into the free one of two buffers (the other is
still being broadcast), publish its metadata, start its broadcast → wait for the last broadcast
→ ``end`` → wait for one report per receiver. It succeeds only if every receiver loaded every
bucket of this version (same counts, checksums verified); otherwise it raises
:class:`TransferError` naming each replica's outcome. A dead or stuck receiver makes a
collective or its report miss the deadline (``timeout_s``), never hang.

All blocking work runs on one sender thread, so the caller's event loop stays free (engines
hosted on the same loop keep loading while the sender sends).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ferryman_sync_nccl import group as G
from ferryman_sync_nccl.channel import StoreSender, ZmqSender
from ferryman_sync_nccl.wire import TRAILER_BYTES, Packer, dtype_of, lane_sums

if TYPE_CHECKING:  # pragma: no cover
    from ferryman_sync_nccl.config import NcclSyncConfig

log = logging.getLogger(__name__)

SYNC_TYPE = "nccl"
ABORT_GRACE_S = 1.5
"""After a failed broadcast, how long to wait for the surviving receivers' reports (and to
watch their heartbeats: they beat every 0.5 s)."""
BYE_WAIT_S = 3.0
"""At close, how long to wait for every receiver's bye before freeing the group and the store
(an idle receiver answers within milliseconds; a broken session waits ABORT_GRACE_S)."""


class TransferError(RuntimeError):
    """A weight sync failed as a whole; the message says why, per replica."""


def default_host() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - Ray is optional here
        pass
    return "127.0.0.1"


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("weight_sync.backend: 'nccl' needs a GPU in the trainer's process (none is visible); use 'gloo' or 'auto'")
    return backend


def _flatten(buckets: Iterable[Any]) -> Iterator[Any]:
    for bucket in buckets:
        yield from bucket


class _Session:
    """One transport session: the TCPStore (master, for heartbeats and the ``store`` channel),
    the metadata channel, two send buffers. Built once, reused by every sync until it breaks or
    is closed. Subclasses add the data plane (:meth:`join`, :meth:`ship`, :meth:`wait_slot`,
    :meth:`drain`)."""

    what = "hand-off"
    """How the data of one bucket travels, for error messages."""
    acks = False
    """Whether the receivers ack every bucket (``cuda_ipc``)."""
    ack_wait_s = 0.0
    """Seconds of the current sync the sender spent waiting for acks."""

    def __init__(self, cfg: Any, names: list[str], device: torch.device, host: str) -> None:
        self.cfg = cfg
        self.names = names
        self.device = device
        self.cuda = device.type == "cuda"
        self.ranks = list(range(1, len(names) + 1))
        self.world_size = len(names) + 1
        self.generation = uuid.uuid4().hex[:12]
        self.host = host
        self.capacity = max(int(cfg.bucket_megabytes * 2**20) // 64 * 64, 64)
        self.store = dist.TCPStore(
            self.host, 0, None, True, G._td(cfg.connect_timeout_s), wait_for_workers=False
        )
        self.channel: Any = ZmqSender(self.host) if cfg.metadata == "zmq" else StoreSender(dist.PrefixStore("ch/", self.store))
        self.bufs: list[torch.Tensor] = []
        self.syncs = 0
        self.broken: str | None = None
        self.joined: list[int] = []
        """The ranks whose receiver said hello (those answer the close with a bye)."""

    def receiver_params(self, index: int) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "host": self.host,
            "store_port": self.store.port,
            "rank": index + 1,
            "world_size": self.world_size,
            "bucket_bytes": self.capacity,
            "timeout_s": self.cfg.timeout_s,
            "connect_timeout_s": self.cfg.connect_timeout_s,
            **self.channel.params(),
        }

    def hellos(self, deadline: float) -> None:
        """Wait for every receiver's hello; raise naming each one that failed or never came."""
        hellos = self.channel.hellos(self.generation, self.ranks, deadline)
        self.joined = sorted(hellos)
        problems = [f"{self.names[r - 1]}: {h['error']}" for r, h in sorted(hellos.items()) if h.get("error")]
        problems += [
            f"{self.names[r - 1]}: its receiver never reported in (could it reach {self.host}:{self.store.port}?)"
            for r in self.ranks
            if r not in hellos
        ]
        if problems:
            raise TransferError("building the weight-sync group failed: " + "; ".join(problems))

    def handshake(self, deadline: float) -> None:
        missing = self.channel.handshake(self.generation, self.ranks, deadline)
        if missing:
            names = ", ".join(self.names[r - 1] for r in missing)
            raise TransferError(f"building the weight-sync group failed: no answer on the metadata channel from {names}")

    def join(self) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def begin(self) -> None:
        """Called on the sender thread at the start of every sync."""
        if self.cuda:
            torch.cuda.set_device(self.device)

    def wait_slot(self, slot: int) -> None:  # pragma: no cover - abstract
        """Block until buffer ``slot`` may be refilled (raise :class:`GroupError` at the deadline)."""
        raise NotImplementedError

    def ship(self, sync: int, k: int, slot: int, buf: torch.Tensor, used: int, n: int, entries: list) -> None:  # pragma: no cover - abstract
        """Publish bucket ``k`` (``used`` data bytes, ``n`` with the trailer, in buffer ``slot``)
        and start sending it."""
        raise NotImplementedError

    def drain(self, acquired: int) -> None:
        """Wait until both buffers are free again (the older one first)."""
        for k in range(acquired, acquired + 2):
            self.wait_slot(k % 2)

    def abort_link(self) -> None:
        """Called when a bucket's hand-off failed (before the receivers are told)."""

    def release_link(self) -> None:
        """Free the data plane (at close, after the receivers' byes)."""

    def heartbeats(self) -> dict[int, int]:
        out = {}
        for r in self.ranks:
            try:
                out[r] = int(self.store.add(f"hb/{r}", 0))
            except Exception:  # noqa: BLE001
                out[r] = -1
        return out

    def close(self) -> None:
        """Tell the receivers to stop and wait (briefly) for their byes: each has then left
        its collectives and freed its side of the group. Only then free ours (the data plane,
        the channel, the store), so a receiver never finds the store or the group gone under it."""
        try:
            self.channel.announce_close()
            if self.joined:
                wait = min(self.cfg.timeout_s, ABORT_GRACE_S if self.broken else BYE_WAIT_S)
                self.channel.byes(self.generation, self.joined, time.monotonic() + wait)
        except Exception:  # noqa: BLE001 - the receivers are gone
            log.debug("announcing the close failed", exc_info=True)
        try:
            self.release_link()
        except Exception:  # noqa: BLE001
            log.debug("freeing the %s failed", self.what, exc_info=True)
        try:
            self.channel.close()
        except Exception:  # noqa: BLE001
            log.debug("closing the metadata channel failed", exc_info=True)
        self.bufs = []
        self.store = None


class _NcclSession(_Session):
    """The ``nccl`` data plane: a process group (rank 0 here), buckets broadcast from it."""

    what = "broadcast"

    def __init__(self, cfg: Any, names: list[str], backend: str, device: torch.device) -> None:
        super().__init__(cfg, names, device, cfg.host or default_host())
        self.backend = backend
        self.group: G.Group | None = None
        self.side: Any = None
        self.works: list[Any] = [None, None]
        self.done: list[Any] = [None, None]  # CUDA: events completing with works[slot]

    def receiver_params(self, index: int) -> dict[str, Any]:
        return {**super().receiver_params(index), "backend": self.backend}

    def join(self) -> float:
        """Rank 0's part of building the group (on the sender thread). Returns seconds taken."""
        t0 = time.perf_counter()
        if self.cuda:
            torch.cuda.set_device(self.device)
        deadline = time.monotonic() + self.cfg.connect_timeout_s
        self.hellos(deadline)
        pg = G.new_group(dist.PrefixStore("pg/", self.store), 0, self.world_size, self.backend, self.cfg.connect_timeout_s)
        self.group = G.Group(pg, self.backend, max(self.cfg.timeout_s, self.cfg.connect_timeout_s))
        self.handshake(deadline)
        # the first collective creates NCCL's communicator: do it now, not inside the first sync
        probe = torch.zeros(64, dtype=torch.uint8, device=self.device)
        G.wait(self.group.broadcast(probe), self.cfg.connect_timeout_s, cuda=self.cuda)
        G.wait_stream(self.device, self.cfg.connect_timeout_s, "the group's first broadcast")
        self.group.set_op_timeout(self.cfg.timeout_s)
        self.bufs = [torch.empty(self.capacity + TRAILER_BYTES, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        return time.perf_counter() - t0

    def begin(self) -> None:
        super().begin()
        self.works = [None, None]
        self.done = [None, None]

    def wait_slot(self, slot: int) -> None:
        # the broadcast that last read this buffer must be over before it is refilled; on
        # the GPU the CPU polls an event (a deadline, and no stream waits on the broadcast,
        # so the next bucket is packed while this one is sent)
        if self.cuda:
            G.wait_event(self.done[slot], self.cfg.timeout_s, "a bucket's broadcast")
        else:
            G.wait(self.works[slot], self.cfg.timeout_s, cuda=False)
        self.works[slot] = self.done[slot] = None

    def ship(self, sync: int, k: int, slot: int, buf: torch.Tensor, used: int, n: int, entries: list) -> None:
        self.channel.publish({"op": "bucket", "sync": sync, "k": k, "nbytes": used, "entries": entries})
        if n:
            assert self.group is not None
            self.works[slot] = self.group.broadcast(buf[:n])
            if self.cuda:
                self.done[slot] = G.completion_event(self.works[slot], self.side)

    def drain(self, acquired: int) -> None:
        super().drain(acquired)
        G.wait_stream(self.device, self.cfg.timeout_s, "the weight broadcast")

    @property
    def pg(self) -> Any:
        return None if self.group is None else self.group.pg

    def abort_link(self) -> None:
        if self.group is not None:
            self.group.abort()

    def release_link(self) -> None:
        # our collectives end (a gloo one at its deadline) before the group is freed, here
        self.works = [None, None]
        self.done = [None, None]
        if self.group is not None:
            if self.broken:
                self.group.abort()
            self.group.release()
            self.group = None


class BucketSync:
    """What the ``nccl`` and ``cuda_ipc`` transports share: the session's lifecycle (built on the
    first ``transfer``, reused, rebuilt when it broke or the engines changed), the sync loop
    (pack into two alternating buffers, publish, hand off, wait for the reports) and the
    all-or-nothing verdict. Subclasses give ``sync_type`` and :meth:`_new_session`.
    ``engines`` given to :meth:`transfer` must have ``attach_weight_receiver(sync_type, params)``
    (core's ``EngineHandle`` does)."""

    sync_type = ""

    def __init__(self, config: Any) -> None:
        self.config = config
        """The transport's config (a pydantic model, or any object with its fields: benchmarks
        run where pydantic is not installed)."""
        self.wire_dtype = dtype_of(self.config.wire_dtype) if self.config.wire_dtype else None
        self._session: _Session | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ferryman-sync-{self.sync_type}")
        self._closed = False

    @classmethod
    def from_config(cls, config: Any, **_: Any) -> BucketSync:
        return cls(config)

    def _new_session(self, names: list[str]) -> _Session:  # pragma: no cover - abstract
        """Build a session (on the sender thread) for engines ``names``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ group
    @property
    def session(self) -> _Session | None:
        return self._session

    async def connect(self, engines: Sequence[Any]) -> float:
        """Build the group with a receiver beside each engine (``transfer`` does this when
        needed). Returns seconds taken."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._drop_session)
        names = [str(getattr(e, "name", f"engine-{i}")) for i, e in enumerate(engines)]
        for e, name in zip(engines, names):
            if not callable(getattr(e, "attach_weight_receiver", None)):
                raise TransferError(f"{name}: this engine handle cannot host a weight receiver (no attach_weight_receiver)")
        session = await loop.run_in_executor(self._executor, self._new_session, names)
        t0 = time.perf_counter()
        try:
            results = await asyncio.gather(
                *(e.attach_weight_receiver(self.sync_type, session.receiver_params(i)) for i, e in enumerate(engines)),
                return_exceptions=True,
            )
            failed = [f"{n}: {_describe(r)}" for n, r in zip(names, results) if isinstance(r, BaseException)]
            if failed:
                raise TransferError("starting the weight receivers failed: " + "; ".join(failed))
            await loop.run_in_executor(self._executor, session.join)
        except BaseException as e:
            session.broken = f"group setup failed: {e!r}"
            await loop.run_in_executor(self._executor, session.close)
            if isinstance(e, G.GroupError):
                raise TransferError(f"building the weight-sync group failed: {e}") from e
            raise
        self._session = session
        return time.perf_counter() - t0

    def _drop_session(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    # ------------------------------------------------------------------ transfer
    async def transfer(self, buckets: Iterator[Any], engines: Sequence[Any], version: int) -> dict[str, float]:
        if self._closed:
            raise TransferError(f"the {self.sync_type} weight sync was closed")
        engines = list(engines)
        if not engines:
            raise TransferError("no engines to send weights to")
        connect_s = 0.0
        s = self._session
        names = [str(getattr(e, "name", f"engine-{i}")) for i, e in enumerate(engines)]
        if s is None or s.broken or s.names != names:
            if s is not None and s.broken:
                log.warning("rebuilding the weight-sync group (it broke: %s)", s.broken)
            connect_s = await self.connect(engines)
        loop = asyncio.get_running_loop()
        metrics = await loop.run_in_executor(self._executor, self._send, buckets, int(version))
        metrics["sync/connect_s"] = connect_s
        return metrics

    def _send(self, buckets: Iterator[Any], version: int) -> dict[str, float]:
        s = self._session
        assert s is not None and s.bufs
        cfg = self.config
        s.begin()
        s.syncs += 1
        sync = s.syncs
        stats0 = dict(s.channel.stats)
        verify = cfg.verify
        packer = Packer(s.capacity, self.wire_dtype)
        acquired = 0

        def acquire() -> torch.Tensor:
            nonlocal acquired
            slot = acquired % 2
            acquired += 1
            s.wait_slot(slot)
            return s.bufs[slot]

        t0 = time.perf_counter()
        s.channel.publish({"op": "begin", "sync": sync, "version": version, "verify": verify})
        n_buckets = 0
        n_bytes = 0
        input_error: BaseException | None = None
        try:
            try:
                for buf, entries, used in packer.pack(_flatten(buckets), acquire):
                    n = used
                    if verify:
                        buf[used : used + TRAILER_BYTES].view(torch.int64).copy_(lane_sums(buf[:used]))
                        n += TRAILER_BYTES
                    s.ship(sync, n_buckets, (acquired - 1) % 2, buf, used, n, [e.to_json() for e in entries])
                    n_buckets += 1
                    n_bytes += used
            except G.GroupError:
                raise
            except Exception as e:  # noqa: BLE001 - the trainer's weights iterator, or a bad tensor
                input_error = e
            s.drain(acquired)
        except G.GroupError as e:
            return self._fail_group(s, sync, version, n_buckets, e)
        send_s = time.perf_counter() - t0
        if input_error is not None:
            s.channel.publish({"op": "abort", "sync": sync, "reason": f"the trainer's weights could not be sent: {input_error!r}", "group_failed": False})
            self._reports(s, sync, min(cfg.timeout_s, ABORT_GRACE_S))  # let the receivers settle
            s.channel.done(sync, n_buckets if s.acks else 0)
            raise TransferError(f"weight sync to version {version}: the trainer's weights could not be sent: {input_error!r}") from input_error
        s.channel.publish({"op": "end", "sync": sync, "version": version, "buckets": n_buckets, "bytes": n_bytes, "tensors": packer.tensors})
        t1 = time.perf_counter()
        reports = self._reports(s, sync, cfg.timeout_s)
        report_s = time.perf_counter() - t1
        s.channel.done(sync, n_buckets if s.acks else 0)
        sent = dict(s.channel.stats)
        expect = {"version": version, "buckets": n_buckets, "bytes": n_bytes, "tensors": packer.tensors}
        problems = []
        alive = self._alive(s, [r for r in s.ranks if r not in reports])
        for rank, name in zip(s.ranks, s.names):
            r = reports.get(rank)
            if r is None:
                state = "alive but stuck" if alive.get(rank) else "dead: no heartbeat"
                problems.append(f"{name}: no report within {cfg.timeout_s:g}s (its receiver is {state})")
                s.broken = f"{name} did not report at version {version}"
            elif not r.get("ok"):
                problems.append(f"{name}: {r.get('error')}")
                if r.get("fatal"):
                    s.broken = f"{name}'s receiver stopped at version {version}"
            else:
                got = {k: r.get(k) for k in expect}
                if got != expect:
                    problems.append(f"{name}: received {got}, sent {expect}")
        if problems:
            ok = [n for rk, n in zip(s.ranks, s.names) if reports.get(rk, {}).get("ok") and not any(p.startswith(f"{n}:") for p in problems)]
            raise TransferError(
                f"weight sync to version {version} failed as a whole: " + "; ".join(problems) + (f" (loaded fully: {', '.join(ok)})" if ok else "")
            )
        total_s = time.perf_counter() - t0
        return {
            "sync/buckets": float(n_buckets),
            "sync/bytes": float(n_bytes),
            "sync/tensors": float(packer.tensors),
            "sync/send_s": send_s,
            "sync/report_wait_s": report_s,
            "sync/update_s": total_s,
            "sync/send_gb_per_s": n_bytes / send_s / 1e9 if send_s > 0 else 0.0,
            "sync/receiver_load_s_max": max(float(r.get("load_s", 0.0)) for r in reports.values()),
            "sync/receiver_wait_s_max": max(float(r.get("wait_s", 0.0)) for r in reports.values()),
            # the side channel's traffic in this sync (store requests are round trips to the
            # TCPStore's server; a receiver's counts are its whole session's, as of its report)
            "sync/ack_wait_s": s.ack_wait_s,
            "sync/sender_messages": float(sent.get("sent", 0) - stats0.get("sent", 0)),
            "sync/sender_store_requests": float(sent.get("store_requests", 0) - stats0.get("store_requests", 0)),
            "sync/receiver_messages_max": max(float(r.get("channel", {}).get("sent", 0)) for r in reports.values()),
            "sync/receiver_store_requests_max": max(float(r.get("channel", {}).get("store_requests", 0)) for r in reports.values()),
        }

    def _reports(self, s: _Session, sync: int, wait_s: float) -> dict[int, dict[str, Any]]:
        return s.channel.collect("report", "sync", sync, s.ranks, time.monotonic() + wait_s)

    @staticmethod
    def _alive(s: _Session, ranks: list[int], since: dict[int, int] | None = None) -> dict[int, bool]:
        """Whether each receiver's heartbeat advanced (since ``since``, else over ~1.2 s)."""
        if not ranks:
            return {}
        if since is None:
            since = s.heartbeats()
            time.sleep(1.2)
        now = s.heartbeats()
        return {r: now.get(r, -1) > since.get(r, -1) >= 0 for r in ranks}

    def _fail_group(self, s: _Session, sync: int, version: int, bucket: int, err: G.GroupError) -> dict[str, float]:
        s.broken = f"{err}"
        s.abort_link()
        beats = s.heartbeats()
        try:
            s.channel.publish({"op": "abort", "sync": sync, "reason": f"the {s.what} failed: {err}", "group_failed": True})
            reports = self._reports(s, sync, ABORT_GRACE_S)
        except Exception:  # noqa: BLE001
            reports = {}
        alive = self._alive(s, s.ranks, since=beats)
        outcome = []
        for rank, name in zip(s.ranks, s.names):
            if rank in reports:
                outcome.append(f"{name}: alive")
            elif alive.get(rank):
                outcome.append(f"{name}: alive (held in the failed {s.what})")
            else:
                outcome.append(f"{name}: DEAD (no heartbeat for {ABORT_GRACE_S:g}s)")
        raise TransferError(
            f"weight sync to version {version} failed: the {s.what} of bucket {bucket} failed ({err}); "
            + "; ".join(outcome)
            + ". No replica's version changed; the group is rebuilt at the next sync."
        ) from err

    def close(self) -> None:
        """Tell the receivers to stop and free the group."""
        if self._closed:
            return
        self._closed = True
        try:
            # bounded: the byes (BYE_WAIT_S), then our collectives' deadline
            self._executor.submit(self._drop_session).result(timeout=max(30.0, float(self.config.timeout_s) + G.RELEASE_GRACE_S + BYE_WAIT_S))
        except Exception:  # noqa: BLE001
            log.debug("closing the %s weight sync failed", self.sync_type, exc_info=True)
        self._executor.shutdown(wait=False)


def _describe(err: BaseException) -> str:
    """An attach failure for the error message: a receiver's own clear ValueError is shown as
    its text, anything else with its type."""
    return str(err) if isinstance(err, ValueError) and str(err) else repr(err)


class NcclSync(BucketSync):
    """The ``nccl`` weight transport: buckets broadcast over a private torch.distributed group."""

    sync_type = SYNC_TYPE

    def __init__(self, config: NcclSyncConfig | Any = None) -> None:
        if config is None:
            from ferryman_sync_nccl.config import NcclSyncConfig

            config = NcclSyncConfig()
        super().__init__(config)

    def _new_session(self, names: list[str]) -> _NcclSession:
        backend = resolve_backend(self.config.backend)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        return _NcclSession(self.config, names, backend, device)

    @property
    def source_device(self) -> str:
        """Where this transport's buffers are, so where the trainer's tensors are best handed
        over (``cuda``: packed on the GPU without a round trip through host memory)."""
        try:
            return "cuda" if resolve_backend(self.config.backend) == "nccl" else "cpu"
        except ValueError:
            return "cpu"
