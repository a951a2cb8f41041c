"""The ``cuda_ipc`` weight sync: engine replicas on the trainer's own GPU read every bucket out
of the trainer's memory, with no copy over a link.

The trainer's process owns two bucket buffers. When a session is built each engine process
gets a handle per buffer, once: on the GPU the CUDA IPC handle that
``torch.multiprocessing.reductions.reduce_tensor`` makes (the rebuild function and its
arguments, pickled), on CPUs the name of a file in ``/dev/shm`` that both sides map with
``torch.from_file(shared=True)``. Each receiver maps both buffers (:class:`IpcReceiver`).

A sync reuses the ``nccl`` transport's parts unchanged: the wire format (:class:`~.wire.Packer`,
the lane-sum trailer, :class:`~.wire.Assembler`), the metadata channel (ZeroMQ or TCPStore),
the heartbeats, the reports and the all-or-nothing verdict (:class:`~.sender.BucketSync`).

Per bucket, pipelined, with no CPU↔device synchronisation on the way in steady state: the
trainer packs the bucket into the free buffer and records a CUDA event; the bucket's metadata
(naming the buffer) goes out as soon as that event has completed, while the trainer already
packs the next bucket into the other buffer if it is free. Every receiver checks the checksum
(one wait for the device, only with checksums on), hands the tensors (views of the shared
buffer, or a tensor assembled from pieces) to the engine's ``load_weights``, records an event
after the engine's copies and goes on with the next bucket; it acks a bucket once its event
has completed (acks are cumulative, several done buckets make one ack). A buffer is refilled
only once every receiver has acked the bucket in it, so the trainer runs at most one bucket
ahead of the slowest engine; an ack that does not come within ``timeout_s`` fails the sync.
Only events of one's own process are waited on (never another process's: a dead peer cannot
hold a stream), by polling with a deadline. On CPUs the copies are synchronous: metadata goes
out at once and a receiver acks as soon as it has loaded.

Why these handles. CUDA: the IPC handle is the only way to map another process's device
memory, and torch's reduction also carries the producer-side reference count that keeps the
block alive while consumers map it. Its arguments are plain picklable values; they are pickled
once more and base64-encoded so that ``params`` stay JSON-able (Ray, a pipe, anything). CPU: a
named file in ``/dev/shm`` is a name, so it survives any pickling (Ray's included), unlike
torch's default CPU sharing (``file_descriptor``: a file descriptor that only multiprocessing's
own pickler can pass on) or ``file_system`` (a process-wide strategy switch plus torch's shm
manager daemon); ``multiprocessing.shared_memory`` would register the segment with the
resource tracker of every process that opens it (Python 3.12), which unlinks it when that
process exits. The sender reserves the file's pages (``posix_fallocate``: a full ``/dev/shm``
is a clear error, not a SIGBUS later) and unlinks it as soon as every receiver has mapped it,
so nothing is left behind even if every process is killed.

Engines must share the trainer's device: every receiver compares the sender's host (boot id
and host name) and, for GPU buffers, the GPU's UUID with its own before mapping anything, and
refuses with an error that names the ``nccl`` transport; it then checks a random nonce the
sender wrote into the buffers, so a mapping that is not the same memory is caught too.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import logging
import os
import pickle
import socket
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ferryman_sync_nccl import group as G
from ferryman_sync_nccl.receiver import BucketReceiver, _SyncState
from ferryman_sync_nccl.sender import BucketSync, _Session
from ferryman_sync_nccl.wire import TRAILER_BYTES

if TYPE_CHECKING:  # pragma: no cover
    from ferryman_sync_nccl.config import IpcSyncConfig

log = logging.getLogger(__name__)

SYNC_TYPE = "cuda_ipc"
NONCE_BYTES = 16
USE_NCCL = "use `weight_sync: {type: nccl}` for engines on another GPU or node"

_LOCAL: dict[str, list[torch.Tensor]] = {}
"""GPU buffers by session, for receivers in the trainer's own process (CUDA cannot open an IPC
handle in the process that made it; they use the tensors themselves)."""
_LOCAL_LOCK = threading.Lock()


# --------------------------------------------------------------------------- identity


def host_identity() -> dict[str, str]:
    """This machine as the kernel knows it (boot id) and by name: equal on two processes
    only if they share one host (and one container's view of it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return {"boot_id": boot, "hostname": socket.gethostname()}


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_identity(device: torch.device) -> dict[str, Any]:
    """What a receiver compares with its own before it maps the buffers of ``device``."""
    ident: dict[str, Any] = {"kind": device.type, "host": host_identity()}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        ident.update(uuid=gpu_uuid(index), name=torch.cuda.get_device_name(index), index=index)
    return ident


def local_device(ident: dict[str, Any], replica: str) -> torch.device:
    """The device of this process that holds the sender's buffers, or a ValueError that says why
    there is none and names the ``nccl`` transport."""
    here = host_identity()
    there = ident["host"]
    if here != there:
        raise ValueError(
            f"cuda_ipc: {replica} runs on host {here['hostname']!r} (boot id {here['boot_id'][:8]}), the trainer on "
            f"{there['hostname']!r} (boot id {str(there['boot_id'])[:8]}): cuda_ipc shares the trainer's own memory, "
            f"so its engines must run on the trainer's {'GPU' if ident['kind'] == 'cuda' else 'host'}; {USE_NCCL}"
        )
    if ident["kind"] != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"cuda_ipc: {replica}'s process sees no GPU, the trainer's buffers are on GPU {ident['uuid']} ({ident['name']}); {USE_NCCL}")
    # the engine's GPU is this process's current device (under Ray, the only one it sees);
    # seeing the trainer's GPU as well is not enough: the engine's weights live elsewhere
    here_index = torch.cuda.current_device()
    here_uuid = gpu_uuid(here_index)
    if here_uuid == ident["uuid"]:
        return torch.device("cuda", here_index)
    raise ValueError(
        f"cuda_ipc: {replica} is on a different GPU than the trainer: the trainer's buffers are on GPU {ident['uuid']} "
        f"({ident['name']}), this engine works on cuda:{here_index} = GPU {here_uuid}; cuda_ipc needs every engine on the "
        f"trainer's own GPU; {USE_NCCL}"
    )


# --------------------------------------------------------------------------- shared buffers


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class SharedBuffers:
    """The sender's ``n`` buffers of ``nbytes`` bytes on ``device``, and their handles."""

    def __init__(self, n: int, nbytes: int, device: torch.device, generation: str) -> None:
        self.device = device
        self.generation = generation
        self.nbytes = nbytes
        self.paths: list[str] = []
        self.tensors: list[torch.Tensor] = []
        if device.type == "cuda":
            with torch.cuda.device(device):
                self.tensors = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(n)]
            with _LOCAL_LOCK:
                _LOCAL[generation] = self.tensors
        else:
            folder = shm_dir()
            try:
                for i in range(n):
                    path = os.path.join(folder, f"ferryman-ipc-{generation}-{i}")
                    self.paths.append(path)
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                    try:
                        os.posix_fallocate(fd, 0, nbytes)
                    except OSError as e:
                        raise ValueError(
                            f"weight_sync.bucket_megabytes: cannot reserve {n} x {nbytes / 2**20:.1f} MiB of shared memory "
                            f"in {folder} ({e.strerror}); lower bucket_megabytes or give {folder} more room"
                        ) from None
                    finally:
                        os.close(fd)
                    self.tensors.append(torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8))
            except BaseException:
                self.unlink()
                raise

    def handles(self) -> list[dict[str, Any]]:
        """One handle per buffer for one receiver (on the GPU each call makes fresh IPC
        references: one per receiver, as torch's reference counting expects)."""
        if self.device.type != "cuda":
            return [{"kind": "cpu", "path": p, "nbytes": self.nbytes} for p in self.paths]
        from torch.multiprocessing.reductions import reduce_tensor

        out = []
        with torch.cuda.device(self.device):
            for t in self.tensors:
                fn, args = reduce_tensor(t)
                out.append({"kind": "cuda", "nbytes": self.nbytes, "reduced": base64.b64encode(pickle.dumps((fn, args))).decode()})
        return out

    def unlink(self) -> None:
        """Remove the files' names (mappings stay valid); the memory goes with the last one."""
        for p in self.paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        with _LOCAL_LOCK:
            _LOCAL.pop(self.generation, None)
        self.tensors = []


def open_buffers(params: dict[str, Any], device: torch.device, replica: str) -> list[torch.Tensor]:
    """The receiver's views of the sender's buffers."""
    if device.type == "cuda" and int(params["pid"]) == os.getpid():
        with _LOCAL_LOCK:
            local = _LOCAL.get(str(params["generation"]))
        if local is None:
            raise ValueError(f"cuda_ipc: {replica}: the trainer's buffers of session {params['generation']} are gone")
        return list(local)
    out = []
    for h in params["buffers"]:
        nbytes = int(h["nbytes"])
        if h["kind"] == "cpu":
            if not os.path.exists(h["path"]):
                raise ValueError(
                    f"cuda_ipc: {replica} cannot see the trainer's shared memory {h['path']} (another container or "
                    f"machine?); {USE_NCCL}"
                )
            out.append(torch.from_file(h["path"], shared=True, size=nbytes, dtype=torch.uint8))
            continue
        fn, args = pickle.loads(base64.b64decode(h["reduced"]))
        args = list(args)
        # the producer's device index means nothing here (CUDA_VISIBLE_DEVICES may differ):
        # the GPU was matched by UUID
        args[storage_device_arg(fn)] = device.index
        with torch.cuda.device(device):
            out.append(fn(*args))
    return out


# where torch.multiprocessing.reductions.rebuild_cuda_tensor takes the storage's device: (tensor_cls,
# tensor_size, tensor_stride, tensor_offset, storage_cls, dtype, storage_device, ...)
_STORAGE_DEVICE_ARG = 6


def storage_device_arg(fn: Any) -> int:
    """The position of ``storage_device`` among the arguments of ``fn``, the rebuild function
    of a reduced CUDA tensor. In SGLang's engine processes torch's ``rebuild_cuda_tensor`` is
    replaced by a wrapper of ``(*args)`` that passes them on (``sglang.srt.utils.patch_torch``),
    so the name is not always in the signature; the position is then torch's."""
    params = list(inspect.signature(fn).parameters.values())
    names = [p.name for p in params]
    if "storage_device" in names:
        return names.index("storage_device")
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return _STORAGE_DEVICE_ARG
    raise ValueError(f"cuda_ipc: cannot find the storage device among the arguments of {fn!r}")


def _nonce_bytes(buf: torch.Tensor) -> bytes:
    return bytes(buf[:NONCE_BYTES].cpu().tolist())


# --------------------------------------------------------------------------- sender


class _IpcSession(_Session):
    """The ``cuda_ipc`` data plane: two shared buffers; a bucket is handed off by publishing
    its metadata (once the device has packed it) and is free again once every receiver acked
    it."""

    what = "hand-off"
    acks = True

    def __init__(self, cfg: Any, names: list[str], device: torch.device) -> None:
        super().__init__(cfg, names, device, "127.0.0.1")  # every receiver is on this host
        self.pid = os.getpid()
        try:
            self.shared = SharedBuffers(2, self.capacity + TRAILER_BYTES, device, self.generation)
            self.bufs = self.shared.tensors
            nonce = os.urandom(NONCE_BYTES)
            self.nonce = nonce.hex()
            for b in self.bufs:
                b[:NONCE_BYTES].copy_(torch.frombuffer(bytearray(nonce), dtype=torch.uint8))
            if self.cuda:
                torch.cuda.synchronize(device)
            self.identity = device_identity(device)
            self._handles = [self.shared.handles() for _ in names]
        except BaseException:
            super().close()
            if hasattr(self, "shared"):
                self.shared.close()
            raise
        self.pending: list[tuple[int, int] | None] = [None, None]
        """Per buffer, the (sync, bucket) handed off in it and not yet acked by every receiver."""
        self._unpublished: deque[tuple[Any, dict[str, Any], float]] = deque()
        """Packed buckets whose packing the device may still be doing: (event, metadata, deadline)."""
        self.ack_wait_s = 0.0

    def receiver_params(self, index: int) -> dict[str, Any]:
        return {
            **super().receiver_params(index),
            "device": self.identity,
            "buffers": self._handles[index],
            "nonce": self.nonce,
            "pid": self.pid,
        }

    def join(self) -> float:
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.cfg.connect_timeout_s
        self.hellos(deadline)
        self.handshake(deadline)
        self.shared.unlink()  # every receiver has mapped the buffers
        self._handles = []
        return time.perf_counter() - t0

    def begin(self) -> None:
        super().begin()
        self.pending = [None, None]
        self._unpublished.clear()
        self.ack_wait_s = 0.0

    def _publish_ready(self) -> None:
        """Publish, in order, the buckets the device has finished packing."""
        while self._unpublished:
            ev, msg, deadline = self._unpublished[0]
            if ev is not None and not ev.query():
                if time.monotonic() > deadline:
                    raise G.GroupError(f"packing bucket {msg['k']}: not done on the device within {self.cfg.timeout_s:g}s")
                return
            self._unpublished.popleft()
            self.channel.publish(msg)

    def wait_slot(self, slot: int) -> None:
        """Block until every receiver acked the bucket last handed off in ``slot`` (publishing
        packed buckets meanwhile), or raise :class:`GroupError` after ``timeout_s``."""
        p = self.pending[slot]
        if p is None:
            self._publish_ready()
            return
        sync, k = p
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            self._publish_ready()
            if not self._unpublished:
                # nothing else to do: wait for the acks themselves (a message wakes us)
                if self.channel.acked(sync, k, self.ranks, deadline):
                    break
            elif self.channel.acked(sync, k, self.ranks, 0.0):
                break
            else:
                time.sleep(G.POLL_S)  # the device is still packing: look again soon
            if time.monotonic() > deadline:
                missing = [self.names[r - 1] for r in self.channel.unacked(sync, k, self.ranks)]
                raise G.GroupError(f"bucket {k} not acknowledged within {self.cfg.timeout_s:g}s by {', '.join(missing) or 'every receiver'}")
        self.pending[slot] = None
        self.ack_wait_s += time.perf_counter() - t0

    def ship(self, sync: int, k: int, slot: int, buf: torch.Tensor, used: int, n: int, entries: list) -> None:
        # the receivers read the buffer as soon as they hear of it: its metadata goes out once
        # the device has packed it (at once on CPUs); meanwhile the next bucket may be packed
        msg = {"op": "bucket", "sync": sync, "k": k, "slot": slot, "nbytes": used, "entries": entries}
        self.pending[slot] = (sync, k)
        ev = None
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
        self._unpublished.append((ev, msg, time.monotonic() + self.cfg.timeout_s))
        self._publish_ready()

    def close(self) -> None:
        super().close()
        self.shared.close()
        if self.cuda:
            try:
                torch.cuda.ipc_collect()
            except Exception:  # noqa: BLE001
                pass


class IpcSync(BucketSync):
    """The ``cuda_ipc`` weight transport (see the module doc)."""

    sync_type = SYNC_TYPE

    def __init__(self, config: IpcSyncConfig | Any = None) -> None:
        if config is None:
            from ferryman_sync_nccl.config import IpcSyncConfig

            config = IpcSyncConfig()
        super().__init__(config)

    def _new_session(self, names: list[str]) -> _IpcSession:
        return _IpcSession(self.config, names, resolve_device(self.config.device))

    @property
    def source_device(self) -> str:
        """Where the shared buffers are, so where the trainer's tensors are best handed over
        (``cuda``: packed on the GPU, no round trip through host memory)."""
        try:
            return resolve_device(self.config.device).type
        except ValueError:
            return "cpu"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("weight_sync.device: 'cuda' needs a GPU in the trainer's process (none is visible); use 'cpu' or 'auto'")
        return torch.device("cuda", torch.cuda.current_device())
    if device != "cpu":
        raise ValueError(f"weight_sync.device: {device!r} (allowed: auto, cuda, cpu)")
    return torch.device("cpu")


# --------------------------------------------------------------------------- receiver


class IpcReceiver(BucketReceiver):
    """The ``cuda_ipc`` receiver: maps the sender's two buffers (once, here, in
    ``attach_weight_receiver``) and, for every bucket, checks and loads it straight out of
    the shared buffer, and acks it once the engine's copies out of it are done (while it
    already takes the next bucket)."""

    def __init__(self, params: dict[str, Any], *, sink: Callable[[list[tuple[str, torch.Tensor]]], Any], loop: asyncio.AbstractEventLoop | None = None, name: str = "receiver") -> None:
        # refuse before connecting anywhere: a wrong device is the user's config, not the network
        self.device = local_device(params["device"], name)
        bufs = open_buffers(params, self.device, name)
        want = bytes.fromhex(str(params["nonce"]))
        if any(_nonce_bytes(b) != want for b in bufs):
            raise ValueError(f"cuda_ipc: {name} mapped the trainer's buffers but does not see the trainer's data in them (not the same memory); {USE_NCCL}")
        super().__init__(params, sink=sink, loop=loop, name=name)
        self.bufs = bufs

    def _join(self) -> None:
        self.channel.send({"op": "hello", "generation": self.generation, "rank": self.rank, "name": self.name})
        self.channel.handshake(self.generation, self.rank, time.monotonic() + self.connect_timeout_s)
        self.ready.set()

    def _bucket(self, msg: dict[str, Any], st: _SyncState) -> None:
        k = int(msg["k"])
        st.buckets += 1
        st.bytes += int(msg["nbytes"])
        self._consume(self.bufs[int(msg["slot"])], msg, st)
        # the engine's copies out of the buffer are queued: the buffer is acked once they are
        # done (CPU copies are done already); meanwhile the next bucket is taken
        ev = None
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
        st.loads.append((k, ev, time.monotonic() + self.timeout_s))
        self._ack_done(st)

    def _ack_done(self, st: _SyncState, wait: bool = False) -> None:
        """Ack, in one go, the buckets whose copies the device has finished (``wait``: all of
        them, waiting with a deadline)."""
        last = None
        t0 = time.perf_counter()
        while st.loads:
            k, ev, deadline = st.loads[0]
            if ev is not None and not ev.query():
                if time.monotonic() > deadline:
                    raise G.GroupError(f"loading bucket {k}: not done on the device within {self.timeout_s:g}s")
                if not wait:
                    break
                time.sleep(G.POLL_S)
                continue
            st.loads.popleft()
            last = k
        if wait:
            st.wait_s += time.perf_counter() - t0
        if last is not None:
            self.channel.ack(st.sync, st.acked + 1, last, self.rank)
            st.acked = last

    def _next(self, st: _SyncState) -> dict[str, Any] | None:
        """The next metadata message (None after ``timeout_s``), acking buckets as their copies
        finish while waiting for it."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if not st.loads:
                return self.channel.recv(max(deadline - time.monotonic(), 0.0))
            msg = self.channel.recv(0.0)
            self._ack_done(st)
            if msg is not None:
                return msg
            if time.monotonic() > deadline:
                return None
            time.sleep(G.POLL_S)

    def _drain(self, st: _SyncState) -> None:
        self._ack_done(st, wait=True)

    def _on_exit(self) -> None:
        # copies out of the shared buffers may still be queued (a sync that failed midway):
        # let them finish before the mappings go
        try:
            G.wait_stream(self.device, self.timeout_s, "the last copies out of the shared buffers")
        except G.GroupError:
            log.warning("weight receiver %s: copies out of the shared buffers still running at exit", self.name)
        super()._on_exit()

    def _settle(self, st: _SyncState) -> None:
        self._ack_done(st, wait=True)
