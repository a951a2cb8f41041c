"""The Synchronizer asks the trainer backend for its weight buckets on the device the transport
packs from (its ``source_device``) when the backend takes a ``device`` keyword, and on the CPU
otherwise. The transport here is core's object-store sync with a GPU-like ``source_device``
(it sends whatever tensors it gets; nothing here needs a GPU), the engines core's EchoEngine."""

from __future__ import annotations

import torch

from ferryman.defaults.weight_sync import ObjectStoreSync
from ferryman.engine_host import EngineHandle
from ferryman.sync import Synchronizer, takes_keyword
from ferryman.testing.doubles import EchoEngine


class _Rollouter:
    async def pause_for_sync(self, wait_for_active: bool) -> float:
        return 0.0

    async def reset_staleness(self, version: int) -> int:
        return 0


class _DeviceAwareBackend:
    """Named stand-in for a trainer backend whose iter_weight_buckets takes ``device``."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def iter_weight_buckets(self, bucket_bytes: int, *, device: str = "cpu"):
        self.asked.append(device)
        yield [("shift", torch.tensor([2.0]))]


class _PlainBackend:
    """Named stand-in for a backend with the protocol's one-argument iter_weight_buckets."""

    def __init__(self) -> None:
        self.calls = 0

    def iter_weight_buckets(self, bucket_bytes: int):
        self.calls += 1
        yield [("shift", torch.tensor([5.0]))]


class _GpuSideSync(ObjectStoreSync):
    source_device = "cuda"


async def _update(backend, transport) -> list[EngineHandle]:
    engines = [EngineHandle("r0", engine=EchoEngine(step_delay_s=0.001))]
    sync = Synchronizer(backend=backend, transport=transport, engines=engines, rollouter=_Rollouter(),
                        partial_rollout=True, bucket_bytes=1 << 20)
    await sync.update_weights(1)
    return engines


async def test_a_gpu_transport_gets_the_buckets_on_its_device_from_a_backend_that_can():
    backend = _DeviceAwareBackend()
    engines = await _update(backend, _GpuSideSync())
    assert backend.asked == ["cuda"]
    assert float(engines[0]._engine.weights["shift"]) == 2.0 and await engines[0].get_version() == 1


async def test_a_cpu_transport_or_a_backend_without_the_keyword_gets_cpu_buckets():
    backend = _DeviceAwareBackend()
    await _update(backend, ObjectStoreSync())  # no source_device: the CPU
    assert backend.asked == ["cpu"]
    plain = _PlainBackend()
    engines = await _update(plain, _GpuSideSync())  # the keyword is not offered: not passed
    assert plain.calls == 1 and float(engines[0]._engine.weights["shift"]) == 5.0


def test_takes_keyword():
    def f(a, *, device="cpu"):
        return a

    def g(a):
        return a

    def h(a, **kw):
        return a

    assert takes_keyword(f, "device") and not takes_keyword(g, "device") and takes_keyword(h, "device")
    assert not takes_keyword(object(), "device")
