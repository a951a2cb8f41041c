"""The CUDA path: NCCL between two GPUs, trainer on GPU 0, an engine process on GPU 1.

Runs on a machine with torch alone (no pytest-asyncio, no pydantic, no pyzmq needed: the tests
drive their own event loop, fall back to the TCPStore channel and build the receiver directly).
The same logic runs on CPUs over gloo in test_processes.py and test_inprocess.py.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        PYTHONPATH=packages/sync-nccl/src:packages/core/src python3 -m pytest -m gpu packages/sync-nccl/tests/test_gpu.py -q
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from ferryman_sync_nccl.sender import NcclSync, TransferError
from ferryman_sync_nccl.testing import ProcessEngine, digest, have, transport_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

ENGINE = "ferryman_sync_nccl.testing:TensorDictEngine"
# "embed" (16 MiB in float32 → 8 MiB in bf16) is split over the 4 MiB buckets
SHAPES = {"embed": (8192, 512), **{f"layers.{i}.w": (512, 1536) for i in range(6)}, "layers.0.b": (1536,), "norm": (512,)}
METADATA = "zmq" if have("zmq") else "store"
CORE = have("ferryman.plugins")
# where each side lives (a CPU dry run of this file's logic sets cpu/cpu/gloo)
SENDER, RECEIVER, BACKEND = "cuda:0", "cuda:1", "nccl"


def _child(**kw) -> ProcessEngine:
    cuda_device = torch.device(RECEIVER).index if RECEIVER.startswith("cuda") else None
    return ProcessEngine("rollout-0", ENGINE, {"shapes": SHAPES, "dtype": "bfloat16", "device": RECEIVER, **kw}, cuda_device=cuda_device, plugin_host=CORE)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=SENDER).manual_seed(seed)
    return {n: torch.randn(s, generator=g, device=SENDER) for n, s in SHAPES.items()}


def _on_sender() -> None:
    if SENDER.startswith("cuda"):
        torch.cuda.set_device(torch.device(SENDER))


def test_nccl_sync_casts_splits_and_is_bit_identical():
    async def run() -> None:
        _on_sender()
        child = _child()
        await child.start()
        transport = NcclSync(transport_config(backend=BACKEND, bucket_megabytes=4, wire_dtype="bfloat16", verify=True, metadata=METADATA, timeout_s=60))
        try:
            for version in (1, 2, 3):
                w = _weights(version)
                m = await transport.transfer(iter([list(w.items())]), [child], version)
                assert m["sync/buckets"] >= 4
                assert (m["sync/connect_s"] > 0) == (version == 1), "the group is built once"
                want = digest({n: t.to(torch.bfloat16) for n, t in w.items()})
                assert await child.call("ferryman_sync_nccl.testing:engine_digest") == want, f"version {version} differs"
            state = await child.receiver_state("nccl")
            assert state["version"] == 3 and state["alive"] and state["error"] is None
        finally:
            transport.close()
            await child.shutdown()

    asyncio.run(run())


def test_a_killed_receiver_on_nccl_fails_the_sync_within_the_timeout():
    timeout_s = 10.0

    async def run() -> None:
        _on_sender()
        child = _child(load_delay_s=0.3)
        await child.start()
        transport = NcclSync(transport_config(backend=BACKEND, bucket_megabytes=4, verify=False, metadata=METADATA, timeout_s=timeout_s))
        try:
            await transport.transfer(iter([list(_weights(1).items())]), [child], 1)
            loaded = (await child.stats())["loaded_buckets"]
            task = asyncio.create_task(transport.transfer(iter([list(_weights(2).items())]), [child], 2))
            while (await child.stats())["loaded_buckets"] < loaded + 1:
                await asyncio.sleep(0.02)
            killed = time.monotonic()
            child.kill()
            with pytest.raises(TransferError) as info:
                await asyncio.wait_for(task, timeout_s * 3)
            assert time.monotonic() - killed < timeout_s + 10
            # on gloo the dead peer is seen by its missing heartbeat (~1.5 s, "rollout-0: DEAD"); on
            # 2xH200 (2026-11-30) the report deadline fired first: "rollout-0: no report within
            # 10s (its receiver is dead: no heartbeat)". Either names the replica and its death.
            msg = str(info.value)
            assert "rollout-0" in msg and "dead" in msg.lower(), msg
        finally:
            transport.close()
            await child.shutdown()

    asyncio.run(run())
