"""Core's own implementations pass the contract suites that plugins also run."""

from __future__ import annotations

import pytest
import torch

from ferryman.defaults.queue import MessageQueue
from ferryman.defaults.router import LocalRouter
from ferryman.defaults.weight_sync import ObjectStoreSync
from ferryman.engine_host import EngineHandle
from ferryman.testing import QueueContract, RouterContract, WeightSyncContract
from ferryman.testing.doubles import EchoEngine


class TestMessageQueueContract(QueueContract):
    @pytest.fixture
    def make_queue(self):
        return MessageQueue


class TestLocalRouterContract(RouterContract):
    @pytest.fixture
    def make_router(self):
        return lambda replicas: LocalRouter(list(replicas))


class TestObjectStoreSyncContract(WeightSyncContract):
    @pytest.fixture
    def transport(self):
        return ObjectStoreSync(verify=True)

    @pytest.fixture
    def weights(self):
        return [("shift", torch.tensor([3.0]))]

    @pytest.fixture
    def make_engines(self):
        async def make(k):
            engines = [EngineHandle(f"e{i}", engine=EchoEngine()) for i in range(k)]
            for e in engines:
                await e.start()
            return engines

        return make

    @pytest.fixture
    def read_weights(self):
        async def read(handle):
            return dict(handle._engine.weights)

        return read


async def test_checksum_mismatch_is_detected():
    from ferryman.engine_host import WeightChecksumError

    h = EngineHandle("e", engine=EchoEngine())
    with pytest.raises(WeightChecksumError):
        await h.load_weights([("shift", torch.tensor([3.0]))], checksum=12345)
    assert h._engine.weights["shift"].item() == 1.0
