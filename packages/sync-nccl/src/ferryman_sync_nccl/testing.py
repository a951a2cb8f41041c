"""Harness for tests and benchmarks of weight syncs (importable by other packages' tests too).

- :class:`TensorDictEngine` is a **test double** (an engine without a model): its "model" is
  a dict of named tensors. ``load_weights`` behaves like a real engine's (checks every name and
  shape first, then copies into the existing tensors, casting dtype), so a transport's work is
  real; it cannot generate.
- :class:`ProcessEngine` runs an engine in its own process and drives it over a pipe, the way
  core's ``EngineHandle`` drives an engine actor: every Engine method, plus
  ``attach_weight_receiver`` (through core's plugin host, as in an ``EngineActor``; or, with
  ``plugin_host=False``, by building this package's receiver directly), ``call`` (run a function
  in the child against the engine) and ``kill`` (SIGKILL, for failure tests).
- :func:`qwen2_shapes` gives the parameter shapes of a Qwen2-style model (Qwen2.5-7B by default).
- :func:`raw_broadcast_rounds` times bare broadcasts between two processes (the benchmark's floor).

Only torch is needed (not core, not pydantic) with ``plugin_host=False``, so the GPU benchmark
runs on a machine that has torch alone.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import multiprocessing as mp
import os
import signal
import threading
import traceback
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ferryman.types import SamplingParams, TokenOutput

QWEN25_7B = {"vocab": 152064, "hidden": 3584, "intermediate": 18944, "layers": 28, "heads": 28, "kv_heads": 4, "tied": False}
SMALL = {"vocab": 4096, "hidden": 256, "intermediate": 704, "layers": 4, "heads": 8, "kv_heads": 2, "tied": False}


def qwen2_shapes(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, tied: bool = False) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a Qwen2 ``state_dict()`` (q/k/v biases, RMSNorm weights)."""
    head_dim = hidden // heads
    kv = kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.q_proj.bias": (hidden,),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "mlp.gate_proj.weight": (intermediate, hidden),
                p + "mlp.up_proj.weight": (intermediate, hidden),
                p + "mlp.down_proj.weight": (hidden, intermediate),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


CONFIG_DEFAULTS: dict[str, Any] = {
    "type": "nccl",
    "backend": "auto",
    "bucket_megabytes": 1024.0,
    "wire_dtype": None,
    "verify": True,
    "metadata": "zmq",
    "host": None,
    "timeout_s": 60.0,
    "connect_timeout_s": 120.0,
}
"""NcclSyncConfig's defaults, for :func:`transport_config` where pydantic is missing (a test
checks that the two agree)."""

IPC_CONFIG_DEFAULTS: dict[str, Any] = {
    "type": "cuda_ipc",
    "device": "auto",
    "bucket_megabytes": 1024.0,
    "wire_dtype": None,
    "verify": True,
    "metadata": "zmq",
    "timeout_s": 60.0,
    "connect_timeout_s": 120.0,
}
"""IpcSyncConfig's defaults, for :func:`ipc_config` where pydantic is missing."""


def _config(cls_name: str, defaults: dict[str, Any], fields: dict[str, Any]) -> Any:
    try:
        from ferryman_sync_nccl import config
    except ImportError:
        from types import SimpleNamespace

        unknown = set(fields) - set(defaults)
        if unknown:
            raise TypeError(f"unknown transport config fields: {sorted(unknown)}") from None
        return SimpleNamespace(**{**defaults, **fields})
    return getattr(config, cls_name)(**fields)


def transport_config(**fields: Any) -> Any:
    """An ``NcclSyncConfig``, or, where core/pydantic cannot be imported (a GPU box with torch
    alone), a namespace with the same fields and defaults."""
    return _config("NcclSyncConfig", CONFIG_DEFAULTS, fields)


def ipc_config(**fields: Any) -> Any:
    """An ``IpcSyncConfig``, or a namespace with its fields and defaults (see
    :func:`transport_config`)."""
    return _config("IpcSyncConfig", IPC_CONFIG_DEFAULTS, fields)


def have(module: str) -> bool:
    """Whether ``module`` can be imported here (a GPU box may have torch alone)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def digest(tensors: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """Per-tensor eight int64 lane sums of the raw bytes (equal iff bit-identical, with
    overwhelming probability); computed where the tensors are, returned as plain lists."""
    out = {}
    for name, t in tensors.items():
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        pad = (-raw.numel()) % 64
        if pad:
            raw = torch.cat([raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)])
        out[name] = raw.view(torch.int64).view(-1, 8).sum(0).tolist() if raw.numel() else [0] * 8
    return out


class TensorDictEngine:
    """Test double: an engine whose model is ``weights`` (name → tensor). See the module doc."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], *, dtype: str = "float32", device: str = "cpu", load_delay_s: float = 0.0) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dt = getattr(torch, dtype)
        self.weights = {n: torch.zeros(s, dtype=dt, device=self.device) for n, s in shapes.items()}
        self.load_delay_s = load_delay_s
        self.version = 0
        self.loaded_buckets = 0
        self.loaded_tensors = 0

    async def start(self) -> None:
        return None

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> TokenOutput:
        raise RuntimeError("TensorDictEngine is a test double for weight syncs; it does not generate")

    async def pause(self, abort: bool) -> None:
        return None

    async def resume(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def load_weights(self, named_tensors: Any) -> None:
        items = list(named_tensors)
        for name, t in items:
            if name not in self.weights:
                raise ValueError(f"TensorDictEngine.load_weights: unknown weight {name!r}; nothing loaded")
            if tuple(self.weights[name].shape) != tuple(t.shape):
                raise ValueError(f"TensorDictEngine.load_weights: {name}: shape {tuple(t.shape)} != {tuple(self.weights[name].shape)}; nothing loaded")
        if self.load_delay_s:
            await asyncio.sleep(self.load_delay_s)
        with torch.no_grad():
            for name, t in items:
                self.weights[name].copy_(t)
        self.loaded_buckets += 1
        self.loaded_tensors += len(items)

    async def set_version(self, version: int) -> None:
        self.version = int(version)

    async def get_version(self) -> int:
        return self.version

    async def stats(self) -> dict[str, float]:
        return {"version": float(self.version), "loaded_buckets": float(self.loaded_buckets), "loaded_tensors": float(self.loaded_tensors)}

    async def shutdown(self) -> None:
        return None


def _resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------- child process


RECEIVERS = {"nccl": "ferryman_sync_nccl.receiver:WeightReceiver", "cuda_ipc": "ferryman_sync_nccl.ipc:IpcReceiver"}
"""This package's receivers, for :class:`_DirectReceivers`."""


class _DirectReceivers:
    """Receivers built without core's plugin host (this package's own: ``nccl``, ``cuda_ipc``)."""

    def __init__(self) -> None:
        self.by_type: dict[str, Any] = {}

    async def attach(self, host: Any, sync_type: str, params: dict[str, Any], engine: Any, replica: str) -> None:
        if sync_type not in RECEIVERS:
            raise ValueError(f"without the plugin host only {', '.join(RECEIVERS)} receivers can be built, not {sync_type!r}")
        old = self.by_type.pop(sync_type, None)
        if old is not None:
            await _closed(old)
        cls = _resolve(RECEIVERS[sync_type])
        self.by_type[sync_type] = cls(params, sink=engine.load_weights, loop=asyncio.get_running_loop(), name=replica).start()

    async def close(self) -> None:
        while self.by_type:
            await _closed(self.by_type.popitem()[1])


async def _closed(receiver: Any) -> None:
    """Close a receiver and wait for its thread (its ``close`` returns an awaitable on a loop)."""
    result = receiver.close()
    if result is not None and hasattr(result, "__await__"):
        await result


def _child_main(conn: Any, factory: str, kwargs: dict[str, Any], name: str, cuda_device: int | None, threads: int, plugin_host: bool) -> None:
    torch.set_num_threads(threads)
    if cuda_device is not None:
        torch.cuda.set_device(cuda_device)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    engine = _resolve(factory)(**kwargs)
    host: Any = None
    receivers: Any
    if plugin_host:
        from ferryman.engine_host import WeightReceivers
        from ferryman.plugins import PluginHost

        host = PluginHost()
        receivers = WeightReceivers()
    else:
        receivers = _DirectReceivers()
    send_lock = threading.Lock()

    def reply(msg: tuple) -> None:
        with send_lock:
            conn.send(msg)

    async def handle(call_id: int, method: str, args: tuple, kw: dict) -> None:
        try:
            if method == "attach_weight_receiver":
                result = await receivers.attach(host, args[0], args[1], engine, name)
            elif method == "receiver_state":
                r = receivers.by_type.get(args[0])
                result = None if r is None else {"version": r.version, "error": r.error, "alive": r.alive, "syncs": r.syncs, "failed_syncs": r.failed_syncs}
            elif method == "call":
                result = _resolve(args[0])(engine, **kw)
                if asyncio.iscoroutine(result):
                    result = await result
            else:
                if method == "shutdown":
                    await receivers.close()
                result = await getattr(engine, method)(*args, **kw)
            reply((call_id, True, result))
        except BaseException as e:  # noqa: BLE001 - sent back to the caller
            reply((call_id, False, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))
        if method == "shutdown":
            loop.call_soon(loop.stop)

    def reader() -> None:
        while True:
            try:
                call_id, method, args, kw = conn.recv()
            except (EOFError, OSError):
                loop.call_soon_threadsafe(loop.stop)
                return
            asyncio.run_coroutine_threadsafe(handle(call_id, method, args, kw), loop)

    threading.Thread(target=reader, daemon=True).start()
    reply((0, True, os.getpid()))
    loop.run_forever()
    os._exit(0)  # receiver threads may still sit in a collective


class EngineProcessError(RuntimeError):
    """A call into an engine process failed, or the process died."""


PRELOAD = ["torch", "torch.distributed", "ferryman.plugins", "ferryman.engine_host", "ferryman_sync_nccl.testing", "ferryman_sync_nccl.receiver", "ferryman_sync_nccl.ipc"]
"""Modules the fork server imports once, so that each engine process starts in a fraction of
a second instead of importing torch again."""


def _context(start_method: str) -> Any:
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


class ProcessEngine:
    """An engine replica in its own process, with the async methods of an engine handle.
    ``factory`` is ``"module:callable"`` building the engine from ``kwargs`` in the child.
    Processes come from a fork server that has torch imported (no CUDA initialised), or are
    spawned (``start_method="spawn"``)."""

    def __init__(
        self,
        name: str,
        factory: str,
        kwargs: dict[str, Any] | None = None,
        *,
        cuda_device: int | None = None,
        threads: int = 1,
        start_method: str = "forkserver",
        plugin_host: bool = True,
    ) -> None:
        self.name = name
        ctx = _context(start_method)
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_child_main, args=(child, factory, kwargs or {}, name, cuda_device, threads, plugin_host), daemon=True, name=f"engine-{name}"
        )
        self._ids = itertools.count(1)
        self._futures: dict[int, asyncio.Future] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = None
        self.pid: int | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.process.start()
        ready: asyncio.Future = self._loop.create_future()
        self._futures[0] = ready
        threading.Thread(target=self._reader, daemon=True).start()
        self.pid = await asyncio.wait_for(ready, 120)

    def _reader(self) -> None:
        while True:
            try:
                call_id, ok, value = self._conn.recv()
            except (EOFError, OSError):
                self.process.join(5)
                self._dead = f"{self.name}: engine process died (exit code {self.process.exitcode})"
                for fut in list(self._futures.values()):
                    self._resolve(_set_error, fut, EngineProcessError(self._dead))
                self._futures.clear()
                return
            fut = self._futures.pop(call_id, None)
            if fut is not None:
                if ok:
                    self._resolve(_set_result, fut, value)
                else:
                    self._resolve(_set_error, fut, EngineProcessError(f"{self.name}: {value}"))

    def _resolve(self, fn: Any, fut: asyncio.Future, value: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, fut, value)  # type: ignore[union-attr]
        except RuntimeError:  # the caller's loop is closed: nobody waits any more
            pass

    async def _call(self, method: str, *args: Any, **kw: Any) -> Any:
        if self._dead:
            raise EngineProcessError(self._dead)
        assert self._loop is not None, "start() first"
        call_id = next(self._ids)
        fut = self._loop.create_future()
        self._futures[call_id] = fut
        with self._lock:
            self._conn.send((call_id, method, args, kw))
        return await fut

    # the Engine methods, as on core's EngineHandle
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> TokenOutput:
        return await self._call("generate", request_id, prompt_ids, params)

    async def pause(self, abort: bool) -> None:
        await self._call("pause", abort)

    async def resume(self) -> None:
        await self._call("resume")

    async def release_kv_cache(self) -> None:
        await self._call("release_kv_cache")

    async def resume_kv_cache(self) -> None:
        await self._call("resume_kv_cache")

    async def load_weights(self, bucket: Any, checksum: int | None = None) -> None:
        await self._call("load_weights", bucket)

    async def set_version(self, version: int) -> None:
        await self._call("set_version", version)

    async def get_version(self) -> int:
        return await self._call("get_version")

    async def stats(self) -> dict[str, float]:
        return await self._call("stats")

    async def attach_weight_receiver(self, sync_type: str, params: dict[str, Any]) -> None:
        await self._call("attach_weight_receiver", sync_type, params)

    async def receiver_state(self, sync_type: str = "nccl") -> dict[str, Any] | None:
        return await self._call("receiver_state", sync_type)

    async def call(self, fn: str, **kwargs: Any) -> Any:
        """Run ``fn(engine, **kwargs)`` (``"module:function"``, may be async) in the child."""
        return await self._call("call", fn, **kwargs)

    async def shutdown(self) -> None:
        if self._dead or not self.process.is_alive():
            return
        try:
            await asyncio.wait_for(self._call("shutdown"), 30)
        except (EngineProcessError, asyncio.TimeoutError):
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.kill()

    def kill(self) -> None:
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.join(10)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_error(fut: asyncio.Future, err: BaseException) -> None:
    if not fut.done():
        fut.set_exception(err)


async def start_engines(n: int, shapes: dict[str, tuple[int, ...]], **engine_kw: Any) -> list[ProcessEngine]:
    """``n`` :class:`TensorDictEngine` replicas (``replica-0``...), each in its own process."""
    engines = [ProcessEngine(f"replica-{i}", "ferryman_sync_nccl.testing:TensorDictEngine", {"shapes": shapes, **engine_kw}) for i in range(n)]
    await asyncio.gather(*(e.start() for e in engines))
    return engines


async def stop_engines(engines: list[ProcessEngine]) -> None:
    await asyncio.gather(*(e.shutdown() for e in engines), return_exceptions=True)


class FixedWeightsBackend:
    """Trainer-backend double for core's Synchronizer: streams a dict of full float32 tensors
    (``new_weights(seed)`` draws them) in buckets, as ``iter_weight_buckets`` does."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.shapes = shapes
        self.weights: dict[str, torch.Tensor] = {}

    def new_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.weights = {n: torch.randn(s, generator=g) for n, s in self.shapes.items()}

    def iter_weight_buckets(self, bucket_bytes: int) -> Any:
        bucket, size = [], 0
        for name, t in self.weights.items():
            if bucket and size + t.numel() * 4 > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, t))
            size += t.numel() * 4
        if bucket:
            yield bucket


class RollouterDouble:
    """Rollouter double: the two calls core's Synchronizer makes (records the resets)."""

    def __init__(self) -> None:
        self.reset_to: list[int] = []

    async def pause_for_sync(self, wait_for_active: bool) -> float:
        return 0.0

    async def reset_staleness(self, version: int) -> int:
        self.reset_to.append(version)
        return 0


# functions run in an engine process through ProcessEngine.call


def engine_digest(engine: TensorDictEngine) -> dict[str, list[int]]:
    return digest(engine.weights)


def engine_weights(engine: TensorDictEngine) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for n, t in engine.weights.items()}


# bare broadcasts between two processes: the floor a weight sync is compared with


def raw_store(host: str = "127.0.0.1") -> Any:
    """A TCPStore master for :func:`raw_broadcast_rounds` (its ``.port`` goes to the peer)."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(host, 0, None, True, datetime.timedelta(seconds=300), wait_for_workers=False)


def raw_broadcast_rounds(
    _engine: Any = None,
    *,
    rank: int,
    backend: str,
    nbytes: int,
    chunk_bytes: int,
    rounds: int,
    warmup: int = 2,
    store: Any = None,
    host: str = "127.0.0.1",
    port: int = 0,
    device: str = "cpu",
) -> list[float]:
    """``rounds`` timed broadcasts of ``nbytes`` from rank 0 to rank 1 in messages of
    ``chunk_bytes`` (0: one message) over a fresh group of two, after ``warmup`` untimed
    ones. A round ends when rank 1 has everything: it answers with a one-byte broadcast of its
    own, which rank 0 waits for. Both ranks call this (rank 1 through ``ProcessEngine.call``;
    the engine argument is unused); rank 0's list of seconds is the measurement."""
    import datetime

    import torch.distributed as dist

    from ferryman_sync_nccl import group as G

    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    if store is None:
        store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=300))
    pg = G.new_group(dist.PrefixStore("raw/", store), rank, 2, backend, 300.0)
    cuda = dev.type == "cuda"
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    ack = torch.zeros(64, dtype=torch.uint8, device=dev)
    step = chunk_bytes if chunk_bytes > 0 else nbytes
    times: list[float] = []
    import time

    for i in range(warmup + rounds):
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        works = [G.broadcast(pg, buf[off : off + step], root=0) for off in range(0, nbytes, step)]
        for w in works:
            G.wait(w, 300.0, cuda=cuda)
        G.wait(G.broadcast(pg, ack, root=1), 300.0, cuda=cuda)
        if cuda:
            torch.cuda.synchronize(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    G.shutdown(pg)
    return times
