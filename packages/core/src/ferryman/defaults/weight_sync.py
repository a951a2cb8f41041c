"""Core's default weight transport: buckets through Ray's object store (shared memory on one
machine), or handed over directly to in-process engines. No NCCL needed.

Each bucket is put once and every engine loads the same object; a per-bucket checksum is
computed on the sender and verified by the receiving engine handle when ``verify`` is on.
``engines`` are :class:`ferryman.engine_host.EngineHandle` objects.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import ferryman
from ferryman.config import PluginConfig
from ferryman.protocols import NamedTensors
from ferryman.specs import WeightSyncSpec


class ObjectStoreSyncConfig(PluginConfig):
    type: Literal["object_store"] = "object_store"
    verify: bool = True
    """Check a CRC32 of every bucket on the receiving side."""


def bucket_checksum(bucket: NamedTensors) -> int:
    """CRC32 over names and raw bytes of a bucket (dtype-agnostic, bf16 included)."""
    import torch

    crc = 0
    for name, t in bucket:
        crc = zlib.crc32(name.encode(), crc)
        raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        crc = zlib.crc32(raw.numpy().tobytes(), crc)
    return crc


class ObjectStoreSync:
    def __init__(self, verify: bool = True) -> None:
        self.verify = verify

    @classmethod
    def from_config(cls, config: ObjectStoreSyncConfig, **_: Any) -> ObjectStoreSync:
        return cls(config.verify)

    async def transfer(self, buckets: Iterator[NamedTensors], engines: Sequence[Any], version: int) -> dict[str, float]:
        n_buckets = 0
        n_bytes = 0
        pack_s = 0.0
        send_s = 0.0
        remote = any(getattr(e, "is_remote", False) for e in engines)
        if remote:
            import ray
        for bucket in buckets:
            t0 = time.perf_counter()
            crc = bucket_checksum(bucket) if self.verify else None
            n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            # put once into the object store; every replica reads the same object
            payload: Any = ray.put(bucket) if remote else bucket
            t1 = time.perf_counter()
            await asyncio.gather(*(e.load_weights(payload, checksum=crc) for e in engines))
            send_s += time.perf_counter() - t1
            pack_s += t1 - t0
            n_buckets += 1
        return {
            "sync/buckets": float(n_buckets),
            "sync/bytes": float(n_bytes),
            "sync/pack_s": pack_s,
            "sync/send_load_s": send_s,
        }


@ferryman.hookimpl
def ferryman_register_weight_syncs() -> list[WeightSyncSpec]:
    return [WeightSyncSpec("object_store", ObjectStoreSync.from_config, ObjectStoreSyncConfig, "buckets through Ray's object store; no NCCL")]
