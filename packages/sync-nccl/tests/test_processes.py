"""Receivers in separate engine processes over gloo, driven by core's Synchronizer: received
tensors are bit-identical, versions agree, and a receiver killed mid-sync yields a clear error
within the timeout (and the group is rebuilt for the survivors)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from ferryman.sync import Synchronizer, WeightSyncError
from ferryman_sync_nccl import NcclSync, NcclSyncConfig
from ferryman_sync_nccl.testing import FixedWeightsBackend, RollouterDouble, digest, start_engines, stop_engines

SHAPES = {f"layers.{i}.w": (64, 1024) for i in range(12)} | {"embed": (3000, 256), "norm": (256,), "step": ()}


@pytest.mark.slow
async def test_engine_processes_receive_bit_identical_weights_and_agree_on_versions():
    engines = await start_engines(2, SHAPES)
    transport = NcclSync(NcclSyncConfig(backend="gloo", bucket_megabytes=0.5, timeout_s=20))
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
        assert connects[0] > 0 and connects[1:] == [0.0, 0.0], "one group for all syncs"
        # the last sync compared in full, not only by digest
        got = await engines[1].call("ferryman_sync_nccl.testing:engine_weights")
        assert all(torch.equal(got[n], t) for n, t in backend.weights.items())
    finally:
        sync.close()
        await stop_engines(engines)


@pytest.mark.slow
async def test_a_receiver_killed_mid_sync_fails_it_within_the_timeout_and_survivors_recover():
    timeout_s = 4.0
    T0 = time.monotonic()
    def mark(what):
        print(f"[{time.monotonic() - T0:7.2f}s] {what}", flush=True)
    engines = await start_engines(2, SHAPES, load_delay_s=0.2)
    mark("spawned")
    transport = NcclSync(NcclSyncConfig(backend="gloo", bucket_megabytes=0.5, timeout_s=timeout_s))
    backend, rollouter = FixedWeightsBackend(SHAPES), RollouterDouble()
    sync = Synchronizer(backend=backend, transport=transport, engines=engines, rollouter=rollouter, partial_rollout=True, bucket_bytes=1 << 20)
    try:
        backend.new_weights(1)
        await sync.update_weights(1)
        mark("v1")
        victim = engines[1]
        loaded_v1 = (await victim.stats())["loaded_buckets"]
        backend.new_weights(2)
        task = asyncio.create_task(sync.update_weights(2))
        while (await victim.stats())["loaded_buckets"] < loaded_v1 + 2:  # two buckets of version 2 are in
            await asyncio.sleep(0.02)
        assert not task.done()
        mark("kill")
        killed_at = time.monotonic()
        victim.kill()
        with pytest.raises(WeightSyncError) as info:
            await asyncio.wait_for(task, timeout_s * 3)
        elapsed = time.monotonic() - killed_at
        mark("failed")
        assert elapsed < timeout_s + 4.0, f"the error took {elapsed:.1f}s"
        msg = str(info.value)
        assert "version 2" in msg and "replica-1: DEAD" in msg and "replica-0: alive" in msg, msg
        assert await engines[0].get_version() == 1, "no replica takes a version that not all of them got"
        # the survivor alone: the group is rebuilt and the next sync lands
        backend.new_weights(3)
        sync.engines = [engines[0]]
        m = await sync.update_weights(3)
        mark("v3")
        assert m["sync/connect_s"] > 0
        assert await engines[0].call("ferryman_sync_nccl.testing:engine_digest") == digest(backend.weights)
        assert await engines[0].get_version() == 3
    finally:
        sync.close()
        mark("closed")
        await stop_engines(engines)
        mark("stopped")
