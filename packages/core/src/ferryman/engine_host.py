"""Engine replicas as Ray actors, and handles that make local and remote engines look alike.

An engine plugin writes a plain async class (:class:`ferryman.protocols.Engine`); core hosts
it in an async Ray actor (one per replica) and talks to it through an :class:`EngineHandle`.
The handle also verifies weight-bucket checksums on the receiving side, and hosts the engine-side
half of a weight transport that needs one (:meth:`EngineHandle.attach_weight_receiver`).
"""

from __future__ import annotations

import asyncio
import inspect
import os
from typing import Any

from ferryman.protocols import Engine, NamedTensors
from ferryman.streaming import TokenSink, accepts_on_tokens
from ferryman.types import SamplingParams, TokenOutput


class WeightChecksumError(RuntimeError):
    """A weight bucket arrived corrupted."""


def _verify(bucket: NamedTensors, checksum: int | None) -> None:
    if checksum is None:
        return
    from ferryman.defaults.weight_sync import bucket_checksum

    got = bucket_checksum(bucket)
    if got != checksum:
        names = ", ".join(n for n, _ in bucket[:3])
        raise WeightChecksumError(f"weight bucket ({names}, …) checksum {got:#x} != sent {checksum:#x}")


def make_weight_receiver(host: Any, sync_type: str, params: dict[str, Any], *, engine: Engine, replica: str) -> Any:
    """Build the engine-side receiver of weight transport ``sync_type`` around ``engine``
    (the transport plugin's ``WeightSyncSpec.receiver_factory``), on the running loop."""
    spec = host.get("weight_sync", sync_type)
    factory = getattr(spec, "receiver_factory", None)
    if factory is None:
        raise ValueError(f"weight sync {sync_type!r} has no engine-side receiver (its WeightSyncSpec gives no receiver_factory)")
    return factory(params, engine=engine, replica=replica, loop=asyncio.get_running_loop())


async def _close_receiver(receiver: Any) -> None:
    close = getattr(receiver, "close", None)
    if close is not None:
        result = close()
        if inspect.isawaitable(result):
            await result


class WeightReceivers:
    """The weight receivers one replica hosts, one per transport type."""

    def __init__(self) -> None:
        self.by_type: dict[str, Any] = {}

    async def attach(self, host: Any, sync_type: str, params: dict[str, Any], engine: Engine, replica: str) -> None:
        old = self.by_type.pop(sync_type, None)
        if old is not None:
            await _close_receiver(old)
        receiver = make_weight_receiver(host, sync_type, params, engine=engine, replica=replica)
        if inspect.isawaitable(receiver):
            receiver = await receiver
        self.by_type[sync_type] = receiver

    async def close(self) -> None:
        while self.by_type:
            _, receiver = self.by_type.popitem()
            await _close_receiver(receiver)


class EngineActor:
    """Ray actor body: builds one engine replica from its plugin and forwards calls to it."""

    def __init__(self, engine_cfg: dict[str, Any], *, model_path: str, replica: str, seed: int, num_threads: int = 1) -> None:
        import torch

        torch.set_num_threads(num_threads)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from ferryman.config import validate_plugin_section
        from ferryman.plugins import PluginHost
        from ferryman.quiet import quiet_transformers

        quiet_transformers()
        host = PluginHost()
        cfg = validate_plugin_section(host, "engine", "engine", engine_cfg)
        self.replica = replica
        from ferryman.faults import wrap_engine

        self.engine: Engine = wrap_engine(host.create("engine", cfg, model_path=model_path, replica=replica, seed=seed), replica)
        self._host = host
        self._receivers = WeightReceivers()

    async def start(self) -> None:
        await self.engine.start()

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> TokenOutput:
        out = await self.engine.generate(request_id, prompt_ids, params)
        out.replica = self.replica
        return out

    async def pause(self, abort: bool) -> None:
        await self.engine.pause(abort)

    async def resume(self) -> None:
        await self.engine.resume()

    async def release_kv_cache(self) -> None:
        await self.engine.release_kv_cache()

    async def resume_kv_cache(self) -> None:
        await self.engine.resume_kv_cache()

    async def load_weights(self, bucket: NamedTensors, checksum: int | None = None) -> None:
        _verify(bucket, checksum)
        await self.engine.load_weights(bucket)

    async def set_version(self, version: int) -> None:
        await self.engine.set_version(version)

    async def get_version(self) -> int:
        return await self.engine.get_version()

    async def stats(self) -> dict[str, float]:
        return await self.engine.stats()

    async def attach_weight_receiver(self, sync_type: str, params: dict[str, Any]) -> None:
        await self._receivers.attach(self._host, sync_type, params, self.engine, self.replica)

    async def peak_memory(self) -> dict[str, float]:
        from ferryman.metrics import peak_memory

        return peak_memory("engine")

    async def shutdown(self) -> None:
        await self._receivers.close()
        await self.engine.shutdown()

    def node(self) -> dict[str, str]:
        """Where this replica runs: Ray node id and address."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "address": ray.util.get_node_ip_address()}


class EngineHandle:
    """Uniform async access to one replica, local (an engine object) or remote (a Ray actor)."""

    def __init__(self, name: str, *, engine: Engine | None = None, actor: Any = None, plugin_host: Any = None) -> None:
        if (engine is None) == (actor is None):
            raise ValueError("EngineHandle: give exactly one of engine= or actor=")
        self.name = name
        self._engine = engine
        self._actor = actor
        self._plugin_host = plugin_host
        """Where a local engine's weight receivers come from (default: a PluginHost())."""
        self._receivers = WeightReceivers()

    @property
    def is_remote(self) -> bool:
        return self._actor is not None

    async def _call(self, method: str, *args: Any) -> Any:
        if self._actor is not None:
            return await getattr(self._actor, method).remote(*args)
        return await getattr(self._engine, method)(*args)

    async def start(self) -> None:
        await self._call("start")

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, *, on_tokens: TokenSink | None = None
    ) -> TokenOutput:
        """``on_tokens`` (:mod:`ferryman.streaming`) reaches a local engine that can stream; a
        Ray actor's tokens are not streamed across the actor boundary (the caller gets the
        whole piece when it returns)."""
        if on_tokens is not None and self._actor is None and accepts_on_tokens(self._engine):
            out = await self._engine.generate(request_id, prompt_ids, params, on_tokens=on_tokens)  # type: ignore[union-attr]
        else:
            out = await self._call("generate", request_id, prompt_ids, params)
        out.replica = self.name
        return out

    async def pause(self, abort: bool) -> None:
        await self._call("pause", abort)

    async def resume(self) -> None:
        await self._call("resume")

    async def release_kv_cache(self) -> None:
        await self._call("release_kv_cache")

    async def resume_kv_cache(self) -> None:
        await self._call("resume_kv_cache")

    async def load_weights(self, bucket: Any, checksum: int | None = None) -> None:
        if self._actor is not None:
            await self._actor.load_weights.remote(bucket, checksum)
        else:
            _verify(bucket, checksum)
            await self._engine.load_weights(bucket)  # type: ignore[union-attr]

    async def set_version(self, version: int) -> None:
        await self._call("set_version", version)

    async def get_version(self) -> int:
        return await self._call("get_version")

    async def stats(self) -> dict[str, float]:
        return await self._call("stats")

    async def peak_memory(self) -> dict[str, float]:
        """Peak memory of the process this replica runs in (:func:`ferryman.metrics.peak_memory`,
        keys ``engine_rss_peak_gb`` and, on a GPU, ``engine_device_peak_gb``). An engine that
        runs its model in child processes (SGLang, vLLM's ``core: process``, tensor parallel)
        has its device memory there, which ``engine_device_peak_gb`` does not see and
        ``engine_device_used_gb`` (NVML, over the process tree) does."""
        if self._actor is not None:
            return await self._actor.peak_memory.remote()
        from ferryman.metrics import peak_memory

        return peak_memory("engine")

    async def attach_weight_receiver(self, sync_type: str, params: dict[str, Any]) -> None:
        """Transport-side receiver setup: build weight transport ``sync_type``'s engine-side
        receiver (``WeightSyncSpec.receiver_factory``) from ``params`` where this replica lives
        (inside its actor, or here for a local engine). It replaces an earlier receiver of the
        same type and is closed when the engine shuts down."""
        if self._actor is not None:
            await self._actor.attach_weight_receiver.remote(sync_type, params)
            return
        if self._plugin_host is None:
            from ferryman.plugins import PluginHost

            self._plugin_host = PluginHost()
        await self._receivers.attach(self._plugin_host, sync_type, params, self._engine, self.name)  # type: ignore[arg-type]

    async def shutdown(self) -> None:
        if self._actor is None:
            await self._receivers.close()
        await self._call("shutdown")


def spawn_engine_actors(
    engine_cfg: dict[str, Any], *, model_path: str, num_replicas: int, seed: int, num_threads: int = 1,
    num_gpus: float = 0.0,
    actor_options: Any = None,
) -> list[EngineHandle]:
    """Start ``num_replicas`` engine actors (not yet started: call ``start()`` on each). Each
    actor reserves ``num_gpus`` GPUs (Ray then sets its ``CUDA_VISIBLE_DEVICES``), unless
    ``actor_options(i)`` gives replica ``i``'s Ray actor options (resources and scheduling
    strategy: its placement-group bundle, see :mod:`ferryman.cluster`)."""
    import ray

    actor_cls = ray.remote(num_cpus=0, max_concurrency=10_000)(EngineActor)
    handles = []
    for i in range(num_replicas):
        name = f"replica-{i}"
        opts = actor_options(i) if actor_options is not None else {"num_gpus": num_gpus}
        actor = actor_cls.options(name=None, **opts).remote(
            engine_cfg, model_path=model_path, replica=name, seed=seed + i, num_threads=num_threads
        )
        handles.append(EngineHandle(name, actor=actor))
    return handles
