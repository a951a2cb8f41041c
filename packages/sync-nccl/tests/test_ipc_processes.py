"""``cuda_ipc`` with engines in their own processes (host shared memory, the CPU form of the
GPU code), driven by core's Synchronizer: bit-identical weights over three syncs with buffers
handed out once, versions agree on every replica, and a receiver killed mid-sync fails the sync
within the timeout naming it DEAD while no version changes (the survivor gets the next one)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from ferryman.sync import Synchronizer, WeightSyncError
from ferryman_sync_nccl import IpcSync, IpcSyncConfig
from ferryman_sync_nccl.testing import FixedWeightsBackend, RollouterDouble, digest, start_engines, stop_engines

SHAPES = {f"layers.{i}.w": (64, 1024) for i in range(12)} | {"embed": (3000, 256), "norm": (256,), "step": ()}


@pytest.mark.slow
async def test_engine_processes_get_bit_identical_weights_and_agree_on_versions():
    engines = await start_engines(2, SHAPES)
    transport = IpcSync(IpcSyncConfig(device="cpu", bucket_megabytes=0.5, timeout_s=20))
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
        assert connects[0] > 0 and connects[1:] == [0.0, 0.0], "buffers handed out once for all syncs"
        got = await engines[1].call("ferryman_sync_nccl.testing:engine_weights")
        assert all(torch.equal(got[n], t) for n, t in backend.weights.items())
        states = [await e.receiver_state("cuda_ipc") for e in engines]
        assert all(s["version"] == 3 and s["alive"] and s["error"] is None for s in states), states
    finally:
        sync.close()
        await stop_engines(engines)


@pytest.mark.slow
async def test_a_receiver_killed_mid_sync_fails_it_within_the_timeout_and_the_survivor_recovers():
    timeout_s = 4.0
    engines = await start_engines(2, SHAPES, load_delay_s=0.2)
    transport = IpcSync(IpcSyncConfig(device="cpu", bucket_megabytes=0.5, timeout_s=timeout_s, metadata="store"))
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
        assert "acknowledged" in msg, msg
        assert await engines[0].get_version() == 1, "no replica takes a version that not all of them got"
        backend.new_weights(3)
        sync.engines = [engines[0]]
        m = await sync.update_weights(3)
        assert m["sync/connect_s"] > 0, "a new session (fresh buffers) for the survivor"
        assert await engines[0].call("ferryman_sync_nccl.testing:engine_digest") == digest(backend.weights)
        assert await engines[0].get_version() == 3
    finally:
        sync.close()
        await stop_engines(engines)
