"""Plugin entry point (``[project.entry-points.ferryman] sync_nccl``).

Importing this module is cheap (pydantic and core only): torch.distributed and pyzmq load when a
transport or a receiver is built.
"""

from __future__ import annotations

from typing import Any

import ferryman
from ferryman.specs import WeightSyncSpec

from ferryman_sync_nccl.config import IpcSyncConfig, NcclSyncConfig


def make_transport(config: NcclSyncConfig, **_: Any) -> Any:
    from ferryman_sync_nccl.sender import NcclSync

    return NcclSync(config)


def make_receiver(params: dict[str, Any], *, engine: Any, replica: str, loop: Any = None, **_: Any) -> Any:
    from ferryman_sync_nccl.receiver import WeightReceiver

    receiver = WeightReceiver(params, sink=engine.load_weights, loop=loop, name=replica)
    receiver.start()
    return receiver


def make_ipc_transport(config: IpcSyncConfig, **_: Any) -> Any:
    from ferryman_sync_nccl.ipc import IpcSync

    return IpcSync(config)


def make_ipc_receiver(params: dict[str, Any], *, engine: Any, replica: str, loop: Any = None, **_: Any) -> Any:
    from ferryman_sync_nccl.ipc import IpcReceiver

    receiver = IpcReceiver(params, sink=engine.load_weights, loop=loop, name=replica)
    receiver.start()
    return receiver


@ferryman.hookimpl
def ferryman_register_weight_syncs() -> list[WeightSyncSpec]:
    return [
        WeightSyncSpec(
            "nccl",
            make_transport,
            NcclSyncConfig,
            "bucketed broadcast over a torch.distributed group (NCCL on GPUs, gloo on CPUs), ZeroMQ metadata",
            receiver_factory=make_receiver,
        ),
        WeightSyncSpec(
            "cuda_ipc",
            make_ipc_transport,
            IpcSyncConfig,
            "engines on the trainer's own GPU read double-buffered buckets through CUDA IPC handles (host shared memory on CPUs)",
            receiver_factory=make_ipc_receiver,
        ),
    ]
