"""ferryman-sync-nccl: the ``nccl`` and ``cuda_ipc`` weight syncs.

The trainer's process broadcasts full weights in double-buffered buckets over a private
torch.distributed group (NCCL on GPUs, gloo on CPUs) to a :class:`WeightReceiver` beside every
engine replica; bucket metadata and the receivers' reports travel over ZeroMQ (or the group's
TCPStore). ``cuda_ipc`` (:class:`IpcSync`) hands engines on the trainer's own GPU the same
buckets through two shared buffers instead (CUDA IPC; host shared memory on CPUs). Core's
:class:`ferryman.sync.Synchronizer` runs the update protocol around both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["GroupError", "IpcReceiver", "IpcSync", "IpcSyncConfig", "NcclSync", "NcclSyncConfig", "TransferError", "WeightReceiver", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from ferryman_sync_nccl.config import IpcSyncConfig, NcclSyncConfig
    from ferryman_sync_nccl.group import GroupError
    from ferryman_sync_nccl.ipc import IpcReceiver, IpcSync
    from ferryman_sync_nccl.receiver import WeightReceiver
    from ferryman_sync_nccl.sender import NcclSync, TransferError


def __getattr__(name: str) -> Any:
    # torch (and pydantic) load on first use: the plugin host imports only ``hooks``, and the
    # transport and receiver modules need torch alone (benchmarks run where core cannot)
    if name in ("NcclSyncConfig", "IpcSyncConfig"):
        from ferryman_sync_nccl import config

        return getattr(config, name)
    if name in ("IpcSync", "IpcReceiver"):
        from ferryman_sync_nccl import ipc

        return getattr(ipc, name)
    if name in ("NcclSync", "TransferError"):
        from ferryman_sync_nccl import sender

        return getattr(sender, name)
    if name == "WeightReceiver":
        from ferryman_sync_nccl.receiver import WeightReceiver

        return WeightReceiver
    if name == "GroupError":
        from ferryman_sync_nccl.group import GroupError

        return GroupError
    raise AttributeError(name)
