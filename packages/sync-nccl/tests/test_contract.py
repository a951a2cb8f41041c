"""Core's WeightSyncContract for both transports, with receivers in this process: ``nccl``
(threads of a gloo group) and ``cuda_ipc`` (host shared memory, the CPU form of the GPU code)."""

from __future__ import annotations

import pytest
import torch

from ferryman.engine_host import EngineHandle
from ferryman.testing import WeightSyncContract
from ferryman.testing.doubles import EchoEngine
from ferryman_sync_nccl import IpcSync, IpcSyncConfig, NcclSync, NcclSyncConfig
from ferryman_sync_nccl.testing import TensorDictEngine


class _Handles:
    def __init__(self):
        self.handles = []

    async def close(self):
        for h in self.handles:
            await h.shutdown()


def _transport(kind: str, **kw):
    if kind == "nccl":
        return NcclSync(NcclSyncConfig(backend="gloo", timeout_s=10, **kw))
    return IpcSync(IpcSyncConfig(device="cpu", timeout_s=10, **kw))


class TestContractEcho(WeightSyncContract):
    """With core's EchoEngine (one weight), ZeroMQ metadata."""

    @pytest.fixture(params=["nccl", "cuda_ipc"])
    def transport(self, request):
        t = _transport(request.param, metadata="zmq", bucket_megabytes=1)
        yield t
        t.close()

    @pytest.fixture
    def weights(self):
        return [("shift", torch.tensor([3.0]))]

    @pytest.fixture
    async def make_engines(self):
        made = _Handles()

        async def make(k):
            engines = [EngineHandle(f"e{i}", engine=EchoEngine()) for i in range(k)]
            for e in engines:
                await e.start()
            made.handles += engines
            return engines

        yield make
        await made.close()

    @pytest.fixture
    def read_weights(self):
        async def read(handle):
            return dict(handle._engine.weights)

        return read


SHAPES = {"emb": (64, 16), "layer.w": (300, 40), "layer.b": (40,), "steps": ()}


class TestContractTensorDict(WeightSyncContract):
    """With a many-tensor engine, small buckets (a tensor split across buckets), checksums, and
    the TCPStore metadata channel."""

    @pytest.fixture(params=["nccl", "cuda_ipc"])
    def transport(self, request):
        t = _transport(request.param, metadata="store", bucket_megabytes=16 / 1024)
        yield t
        t.close()

    @pytest.fixture
    def weights(self):
        g = torch.Generator().manual_seed(1)
        return [(n, torch.randn(s, generator=g)) for n, s in SHAPES.items()]

    @pytest.fixture
    async def make_engines(self):
        made = _Handles()

        async def make(k):
            engines = [EngineHandle(f"e{i}", engine=TensorDictEngine(SHAPES)) for i in range(k)]
            made.handles += engines
            return engines

        yield make
        await made.close()

    @pytest.fixture
    def read_weights(self):
        async def read(handle):
            return dict(handle._engine.weights)

        return read
