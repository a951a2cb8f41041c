"""Receivers in separate engine processes, driven by core's Synchronizer, for both transports on
CPUs: ``nccl`` over gloo and ``cuda_ipc`` over host shared memory (the CPU form of the GPU
code). Received tensors are bit-identical over three syncs with one group (one hand-out of the
buffers), versions agree on every replica, and a receiver killed mid-sync yields a clear error
within the timeout naming it DEAD while no version changes (the survivor gets the next sync)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from ferryman.sync import Synchronizer, WeightSyncError
from ferryman_sync_nccl import IpcSync, IpcSyncConfig, NcclSync, NcclSyncConfig
from ferryman_sync_nccl.testing import FixedWeightsBackend, RollouterDouble, digest, start_engines, stop_engines

SHAPES = {f"layers.{i}.w": (64, 1024) for i in range(12)} | {"embed": (3000, 256), "norm": (256,), "step": ()}
TRANSPORTS = ["nccl", "cuda_ipc"]


def _transport(kind: str, timeout_s: float, **kw):
    if kind == "nccl":
        return NcclSync(NcclSyncConfig(backend="gloo", bucket_megabytes=0.5, timeout_s=timeout_s, **kw))
    return IpcSync(IpcSyncConfig(device="cpu", bucket_megabytes=0.5, timeout_s=timeout_s, **kw))


@pytest.mark.slow
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_engine_processes_receive_bit_identical_weights_and_agree_on_versions(kind):
    engines = await start_engines(2, SHAPES)
    transport = _transport(kind, 20)
    backend, rollouter = FixedWeightsBackend(SHAPES), RollouterDouble()
    sync = Synchronizer(backend=backend, transport=transport, engines=engines, rollouter=rollouter, partial_rollout=True, bucket_bytes=1 << 20)
    try:
        for version in (1, 2, 3):
            backend.new_weights(version)
            m = await sync.update_weights(version)
            assert m["sync/version"] == version and m["sync/buckets"] >= 9  # "embed" (3 MB) split over 6+ buckets
            expect = digest(backend.weights)
            for e in engines:
                assert await e.call("ferryman_sync_nccl.testing:engine_digest") == expect, f"{e.name} differs at {version}"
        assert [await e.get_version() for e in engines] == [3, 3]
        assert rollouter.reset_to == [1, 2, 3]
        connects = [h["sync/connect_s"] for h in sync.history]
        assert connects[0] > 0 and connects[1:] == [0.0, 0.0], "one group (one hand-out of the buffers) for all syncs"
        # the last sync compared in full, not only by digest
        got = await engines[1].call("ferryman_sync_nccl.testing:engine_weights")
        assert all(torch.equal(got[n], t) for n, t in backend.weights.items())
        states = [await e.receiver_state(kind) for e in engines]
        assert all(s["version"] == 3 and s["alive"] and s["error"] is None for s in states), states
    finally:
        sync.close()
        await stop_engines(engines)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "metadata"), [("nccl", "zmq"), ("cuda_ipc", "store")])
async def test_a_receiver_killed_mid_sync_fails_it_within_the_timeout_and_survivors_recover(kind, metadata):
    timeout_s = 4.0
    engines = await start_engines(2, SHAPES, load_delay_s=0.2)
    transport = _transport(kind, timeout_s, metadata=metadata)
    backend, rollouter = FixedWeightsBackend(SHAPES), RollouterDouble()
    sync = Synchronizer(backend=backend, transport=transport, engines=engines, rollouter=rollouter, partial_rollout=True, bucket_bytes=1 << 20)
    try:
        backend.new_weights(1)
        await sync.update_weights(1)
        victim = engines[1]
        loaded_v1 = (await victim.stats())["loaded_buckets"]
        backend.new_weights(2)
        task = asyncio.create_task(sync.update_weights(2))
        while (await victim.stats())["loaded_buckets"] < loaded_v1 + 2:  # two buckets of version 2 are in
            await asyncio.sleep(0.02)
        assert not task.done()
        killed_at = time.monotonic()
        victim.kill()
        with pytest.raises(WeightSyncError) as info:
            await asyncio.wait_for(task, timeout_s * 3)
        elapsed = time.monotonic() - killed_at
        assert elapsed < timeout_s + 4.0, f"the error took {elapsed:.1f}s"
        msg = str(info.value)
        assert "version 2" in msg and "replica-1: DEAD" in msg and "replica-0: alive" in msg, msg
        if kind == "cuda_ipc":
            assert "not acknowledged within" in msg, msg
        assert await engines[0].get_version() == 1, "no replica takes a version that not all of them got"
        # the survivor alone: the group is rebuilt (fresh buffers) and the next sync lands
        backend.new_weights(3)
        sync.engines = [engines[0]]
        m = await sync.update_weights(3)
        assert m["sync/connect_s"] > 0
        assert await engines[0].call("ferryman_sync_nccl.testing:engine_digest") == digest(backend.weights)
        assert await engines[0].get_version() == 3
    finally:
        sync.close()
        await stop_engines(engines)
