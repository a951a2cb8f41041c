"""Configuration of the ``nccl`` weight sync (the ``weight_sync`` section of a run config)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ferryman.config import PluginConfig


class NcclSyncConfig(PluginConfig):
    """``weight_sync: {type: nccl, ...}``."""

    type: Literal["nccl"] = "nccl"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """The process group's backend: ``nccl`` (GPU buffers, CUDA), ``gloo`` (CPU buffers), or
    ``auto``: nccl when the trainer's process sees a GPU, else gloo. Every receiver uses the same."""
    bucket_megabytes: float = Field(1024.0, gt=0)
    """Size of each of the two send buffers (and receive buffers) in MiB. Tensors are packed
    into buckets of this size; a larger tensor is split across buckets. On 2xH200 a 7B bf16 set
    synced in 1.09x the raw broadcast time with 1024 MiB buckets and 1.40x with 256 MiB
    (bench/results/sync.md)."""
    wire_dtype: Literal["bfloat16", "float16", "float32"] | None = None
    """Cast floating-point tensors to this dtype before sending (e.g. float32 trainer weights to
    bfloat16 engines: half the bytes). ``null`` sends every tensor in its own dtype."""
    verify: bool = True
    """Checksum every bucket (eight int64 lane sums, computed on the device) and check it on
    every receiver before loading; a mismatch fails the sync."""
    metadata: Literal["zmq", "store"] = "zmq"
    """Channel of the bucket metadata and the receivers' reports: ZeroMQ PUB/SUB (+ PUSH/PULL
    for reports), or keys in the group's TCPStore (no pyzmq needed)."""
    host: str | None = None
    """Address the receivers connect to (the trainer's host). ``null``: this node's IP as Ray
    sees it when Ray is running, else 127.0.0.1."""
    timeout_s: float = Field(60.0, gt=0)
    """A collective, a metadata message or a report that does not arrive within this many
    seconds fails the sync (a dead or stuck receiver never hangs the trainer)."""
    connect_timeout_s: float = Field(120.0, gt=0)
    """Time allowed for every receiver to join the group when it is (re)built."""


class IpcSyncConfig(PluginConfig):
    """``weight_sync: {type: cuda_ipc, ...}``: engine replicas on the trainer's own GPU (or, on
    CPUs, the trainer's own host) read each bucket straight out of the trainer's two buffers."""

    type: Literal["cuda_ipc"] = "cuda_ipc"
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where the two shared buffers live: ``cuda`` (the trainer's current GPU; engines must be on
    that GPU), ``cpu`` (host shared memory; engines on any device of this host), or ``auto``:
    cuda when the trainer's process sees a GPU, else cpu."""
    bucket_megabytes: float = Field(1024.0, gt=0)
    """Size of each of the two shared buffers in MiB (the only memory this transport adds: 2 GiB
    at the default, on the one GPU that trainer and engines share). Tensors are packed into
    buckets of this size; a larger tensor is split across buckets. Fewer, larger buckets cost
    less per byte: every bucket has a fixed cost (its metadata, the engine's load call, the ack)."""
    wire_dtype: Literal["bfloat16", "float16", "float32"] | None = None
    """Cast floating-point tensors to this dtype while packing (e.g. float32 trainer weights to
    bfloat16 engines). ``null`` keeps every tensor's dtype."""
    verify: bool = True
    """Checksum every bucket (eight int64 lane sums, on the device) and check it on every
    receiver before loading; a mismatch fails the sync."""
    metadata: Literal["zmq", "store"] = "zmq"
    """Channel of the bucket metadata, the receivers' acks and reports: ZeroMQ, or keys in a
    TCPStore (no pyzmq needed)."""
    timeout_s: float = Field(60.0, gt=0)
    """A bucket not acknowledged by every receiver, a metadata message or a report that does not
    arrive within this many seconds fails the sync (a dead receiver never hangs the trainer)."""
    connect_timeout_s: float = Field(120.0, gt=0)
    """Time allowed for every receiver to attach and report in when the session is (re)built."""
