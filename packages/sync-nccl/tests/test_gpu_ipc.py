"""``cuda_ipc`` on CUDA: the trainer (this process) and engine processes on one GPU.

Runs on a machine with torch alone (no pytest-asyncio, no pydantic, no pyzmq needed: the tests
drive their own event loop, fall back to the TCPStore channel and build the receiver directly).
The same logic runs on CPUs over host shared memory in test_ipc.py and test_ipc_processes.py.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        PYTHONPATH=packages/sync-nccl/src:packages/core/src python3 -m pytest -m gpu packages/sync-nccl/tests/test_gpu_ipc.py -q
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import ferryman_sync_nccl.ipc as ipc
from ferryman_sync_nccl.ipc import IpcReceiver, IpcSync
from ferryman_sync_nccl.sender import TransferError
from ferryman_sync_nccl.testing import ProcessEngine, TensorDictEngine, digest, have, ipc_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

ENGINE = "ferryman_sync_nccl.testing:TensorDictEngine"
# "embed" (16 MiB in float32 -> 8 MiB in bf16) is split over the 4 MiB buckets
SHAPES = {"embed": (8192, 512), **{f"layers.{i}.w": (512, 1536) for i in range(6)}, "layers.0.b": (1536,), "norm": (512,)}


METADATA = "zmq" if have("zmq") else "store"


def _child(name: str = "rollout-0", gpu: int = 0, **kw) -> ProcessEngine:
    return ProcessEngine(name, ENGINE, {"shapes": SHAPES, "dtype": "bfloat16", "device": f"cuda:{gpu}", **kw}, cuda_device=gpu, plugin_host=False)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda:0").manual_seed(seed)
    return {n: torch.randn(s, generator=g, device="cuda:0") for n, s in SHAPES.items()}


def _transport(**kw) -> IpcSync:
    kw.setdefault("bucket_megabytes", 4)
    kw.setdefault("timeout_s", 30)
    return IpcSync(ipc_config(device="cuda", metadata=METADATA, **kw))


class _LocalHandle:
    """An engine in this process, hosting the receiver the way core's local EngineHandle does."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.engine = TensorDictEngine(SHAPES, dtype="bfloat16", device="cuda:0")
        self.receiver: IpcReceiver | None = None

    async def attach_weight_receiver(self, sync_type: str, params: dict) -> None:
        assert sync_type == "cuda_ipc"
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = IpcReceiver(params, sink=self.engine.load_weights, loop=asyncio.get_running_loop(), name=self.name).start()


def test_two_engine_processes_on_the_trainers_gpu_get_bit_identical_weights():
    async def run() -> None:
        torch.cuda.set_device(0)
        children = [_child(f"rollout-{i}") for i in range(2)]
        await asyncio.gather(*(c.start() for c in children))
        local = _LocalHandle("rollout-local")  # and one in this process (no IPC handle: the tensors themselves)
        transport = _transport(wire_dtype="bfloat16", verify=True)
        try:
            for version in (1, 2, 3):
                w = _weights(version)
                m = await transport.transfer(iter([list(w.items())]), [*children, local], version)
                assert m["sync/buckets"] >= 4
                assert (m["sync/connect_s"] > 0) == (version == 1), "buffers are handed out once"
                want = digest({n: t.to(torch.bfloat16) for n, t in w.items()})
                for c in children:
                    assert await c.call("ferryman_sync_nccl.testing:engine_digest") == want, f"{c.name} differs at {version}"
                assert digest(local.engine.weights) == want
            states = [await c.receiver_state("cuda_ipc") for c in children]
            assert all(s["version"] == 3 and s["alive"] and s["error"] is None for s in states), states
        finally:
            transport.close()
            local.receiver.close()
            await asyncio.gather(*(c.shutdown() for c in children))

    asyncio.run(run())


def test_a_corrupted_bucket_loads_nothing_on_the_gpu(monkeypatch):
    import ferryman_sync_nccl.sender as sender

    async def run() -> None:
        torch.cuda.set_device(0)
        child = _child()
        await child.start()
        transport = _transport(verify=True)
        try:
            await transport.transfer(iter([list(_weights(1).items())]), [child], 1)
            before = await child.call("ferryman_sync_nccl.testing:engine_digest")
            real = sender.lane_sums
            monkeypatch.setattr(sender, "lane_sums", lambda data: real(data) + 1)
            with pytest.raises(TransferError, match="checksum mismatch"):
                await transport.transfer(iter([list(_weights(2).items())]), [child], 2)
            assert await child.call("ferryman_sync_nccl.testing:engine_digest") == before
        finally:
            transport.close()
            await child.shutdown()

    asyncio.run(run())


def test_an_engine_on_another_gpu_is_refused_naming_nccl(monkeypatch):
    """With two GPUs, a real engine on GPU 1; with one, the trainer's GPU claims another UUID."""
    two = torch.cuda.device_count() >= 2
    if not two:
        real = ipc.device_identity
        monkeypatch.setattr(ipc, "device_identity", lambda device: {**real(device), "uuid": "GPU-00000000-0000-0000-0000-000000000000"})

    async def run() -> None:
        torch.cuda.set_device(0)
        child = _child(gpu=1 if two else 0)
        await child.start()
        transport = _transport()
        try:
            with pytest.raises(TransferError) as info:
                await transport.transfer(iter([list(_weights(1).items())]), [child], 1)
            msg = str(info.value)
            assert "rollout-0 is on a different GPU" in msg and "type: nccl" in msg, msg
            assert (await child.stats())["loaded_buckets"] == 0
        finally:
            transport.close()
            await child.shutdown()

    asyncio.run(run())


def test_a_killed_receiver_on_the_gpu_fails_the_sync_within_the_timeout():
    timeout_s = 10.0

    async def run() -> None:
        torch.cuda.set_device(0)
        child = _child(load_delay_s=0.3)
        await child.start()
        transport = _transport(verify=False, timeout_s=timeout_s)
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
            assert time.monotonic() - killed < timeout_s + 5
            msg = str(info.value)
            assert "rollout-0" in msg and "dead" in msg.lower(), msg
        finally:
            transport.close()
            await child.shutdown()

    asyncio.run(run())
