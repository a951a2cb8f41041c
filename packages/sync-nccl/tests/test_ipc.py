"""The ``cuda_ipc`` transport with receivers in this process, on host shared memory (the CPU
form of the same code): casting and splitting, double buffering, checksums, refused buckets, a
raising iterator, engines on another host, config errors (core's WeightSyncContract is in
test_contract.py, for both transports)."""

from __future__ import annotations

import asyncio
import inspect
import os

import pytest
import torch

import ferryman_sync_nccl.ipc as ipc
from ferryman.config import ConfigError, validate_plugin_section
from ferryman.engine_host import EngineHandle
from ferryman.plugins import PluginHost
from ferryman_sync_nccl import IpcSync, IpcSyncConfig, TransferError, hooks
from ferryman_sync_nccl.testing import IPC_CONFIG_DEFAULTS, TensorDictEngine

SHAPES = {"emb": (100, 32), "w1": (32, 64), "b1": (64,), "w2": (64, 32), "count": (2,)}


def _weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randint(0, 1000, s, generator=g) if n == "count" else torch.randn(s, generator=g)) for n, s in SHAPES.items()]


def _buckets(weights, per=2):
    return (weights[i : i + per] for i in range(0, len(weights), per))


def _host() -> PluginHost:
    return PluginHost(load_entry_points=False, extra_plugins=(hooks,))


def _our_files() -> list[str]:
    return [f for f in os.listdir(ipc.shm_dir()) if f.startswith("ferryman-ipc-")]


@pytest.fixture
async def engines():
    host = _host()
    hs = [EngineHandle(f"replica-{i}", engine=TensorDictEngine(SHAPES), plugin_host=host) for i in range(2)]
    yield hs
    for h in hs:
        await h.shutdown()


@pytest.fixture
def make_transport():
    made = []

    def make(**kw):
        kw.setdefault("device", "cpu")
        kw.setdefault("timeout_s", 10)
        kw.setdefault("bucket_megabytes", 1)  # not the 1 GiB default: two such files in /dev/shm per test
        t = IpcSync(IpcSyncConfig(**kw))
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


async def test_casts_splits_reuses_the_session_and_leaves_no_file(engines, make_transport):
    # 4 KiB buckets: "emb" (12.8 KB) is split over four buckets; float32 travels as bfloat16
    t = make_transport(bucket_megabytes=4 / 1024, wire_dtype="bfloat16")
    first = await t.transfer(_buckets(_weights(0)), engines, 1)
    session = t.session
    assert first["sync/connect_s"] > 0 and first["sync/buckets"] >= 5
    assert not [f for f in _our_files() if session.generation in f], "the buffers' names are gone once every receiver mapped them"
    w = _weights(1)
    second = await t.transfer(_buckets(w), engines, 2)
    assert t.session is session and second["sync/connect_s"] == 0.0, "the buffers are handed out once and reused"
    for h in engines:
        got = h._engine.weights
        for name, x in w:
            expect = x.to(torch.bfloat16).to(torch.float32) if x.is_floating_point() else x
            assert torch.equal(got[name], expect), name
        assert h._receivers.by_type["cuda_ipc"].version == 2
    assert second["sync/bytes"] < sum(x.numel() * x.element_size() for _, x in w), "bf16 on the wire"


async def test_a_buffer_is_refilled_only_after_every_receiver_is_done_with_it(make_transport):
    """Slow engines (50 ms per bucket): the sender runs at most one bucket ahead of the slowest
    receiver, and every tensor arrives intact although both buffers are reused many times."""
    host = _host()
    hs = [EngineHandle(f"slow-{i}", engine=TensorDictEngine(SHAPES, load_delay_s=0.05 * (i + 1)), plugin_host=host) for i in range(2)]
    t = make_transport(bucket_megabytes=4 / 1024)
    session_log: list[tuple[str, int]] = []
    real_ship = ipc._IpcSession.ship
    real_wait = ipc._IpcSession.wait_slot

    def ship(self, sync, k, slot, buf, used, n, entries):
        session_log.append(("ship", k))
        real_ship(self, sync, k, slot, buf, used, n, entries)

    def wait_slot(self, slot):
        p = self.pending[slot]
        real_wait(self, slot)
        if p is not None:
            session_log.append(("free", p[1]))

    try:
        ipc._IpcSession.ship, ipc._IpcSession.wait_slot = ship, wait_slot
        w = _weights(5)
        m = await t.transfer(_buckets(w, per=1), hs, 1)
        for h in hs:
            assert all(torch.equal(h._engine.weights[name], x) for name, x in w), h.name
        slowest = hs[1]._engine.loaded_buckets * 0.1
    finally:
        ipc._IpcSession.ship, ipc._IpcSession.wait_slot = real_ship, real_wait
        for h in hs:
            await h.shutdown()
    n = int(m["sync/buckets"])
    assert n >= 6
    ships = [k for op, k in session_log if op == "ship"]
    assert ships == list(range(n))
    for k in range(2, n):
        # bucket k goes into the buffer of bucket k-2: that one was freed (acked by all) first
        assert session_log.index(("free", k - 2)) < session_log.index(("ship", k)), session_log
    # ...and bucket k+1 was packed while the receivers still held bucket k (double buffering)
    assert session_log.index(("ship", 1)) < session_log.index(("free", 0)), session_log
    assert m["sync/receiver_load_s_max"] >= slowest


@pytest.mark.parametrize("metadata", ["zmq", "store"])
@pytest.mark.parametrize("verify", [True, False])
async def test_round_trips_and_device_waits_per_bucket(engines, make_transport, monkeypatch, metadata, verify):
    """What a bucket costs beside its bytes, counted: on ZeroMQ no TCPStore request at all, one
    metadata message from the sender and at most one (cumulative) ack from each receiver; on
    the TCPStore at most 3 + R requests of the sender per bucket (the metadata key, one wait for
    the acks of all R receivers, the deletion of those keys; the protocol before made 2 + 3R:
    a wait, a read and a deletion per receiver). No wait for the device on the sender's side,
    and on a receiver only the checksum's verdict (CPU copies here: the counts are the GPU's)."""
    import ferryman_sync_nccl.group as G

    waits = {"sender": 0, "receiver": 0}
    real = G.wait_stream

    def wait_stream(*a, **kw):
        import threading

        waits["sender" if threading.current_thread().name.startswith("ferryman-sync") else "receiver"] += 1
        return real(*a, **kw)

    shapes = {f"w{i}": (4096,) for i in range(12)}  # 16 KiB each, one per bucket
    host = _host()
    hs = [EngineHandle(f"count-{i}", engine=TensorDictEngine(shapes), plugin_host=host) for i in range(2)]
    t = make_transport(metadata=metadata, verify=verify, bucket_megabytes=16 / 1024)
    w = [(n, torch.full(s, float(i))) for i, (n, s) in enumerate(shapes.items())]
    try:
        await t.transfer(iter([w]), hs, 1)  # builds the session
        monkeypatch.setattr(G, "wait_stream", wait_stream)
        m = await t.transfer(iter([w]), hs, 2)
        in_sync = dict(waits)
        for h in hs:
            assert all(torch.equal(h._engine.weights[n], x) for n, x in w)
    finally:
        for h in hs:
            await h.shutdown()
    b, r = int(m["sync/buckets"]), 2
    assert b == 12
    assert m["sync/sender_messages"] == b + 2  # begin, the buckets, end
    assert m["sync/receiver_messages_max"] <= b  # acks (its report is not counted)
    if metadata == "zmq":
        assert m["sync/sender_store_requests"] == 0 and m["sync/receiver_store_requests_max"] == 0
    else:
        # fixed per sync: begin/end keys and their deletion (4), each receiver's report (2R)
        assert m["sync/sender_store_requests"] <= (3 + r) * b + 4 + 2 * r, m["sync/sender_store_requests"]
    assert in_sync["sender"] == 0, in_sync
    assert in_sync["receiver"] == (r * b if verify else 0), in_sync


async def test_a_corrupted_bucket_is_caught_by_the_checksum_and_nothing_loads(engines, make_transport, monkeypatch):
    import ferryman_sync_nccl.sender as sender

    t = make_transport(bucket_megabytes=4 / 1024)
    await t.transfer(_buckets(_weights(0)), engines, 1)
    before = [{n: x.clone() for n, x in h._engine.weights.items()} for h in engines]
    real = sender.lane_sums
    monkeypatch.setattr(sender, "lane_sums", lambda data: real(data) + 1)  # fault injection: every trailer is wrong
    with pytest.raises(TransferError, match="checksum mismatch") as info:
        await t.transfer(_buckets(_weights(1)), engines, 2)
    assert "replica-0" in str(info.value) and "replica-1" in str(info.value)
    for h, b in zip(engines, before):
        assert all(torch.equal(b[n], x) for n, x in h._engine.weights.items()), "nothing loaded from a bad bucket"
        assert h._receivers.by_type["cuda_ipc"].version == 1
    monkeypatch.setattr(sender, "lane_sums", real)
    w = _weights(2)
    await t.transfer(_buckets(w), engines, 3)  # the session survives a bad bucket
    for h in engines:
        assert all(torch.equal(h._engine.weights[n], x) for n, x in w)


async def test_a_refused_bucket_fails_the_sync_and_the_next_one_works(engines, make_transport):
    t = make_transport()
    with pytest.raises(TransferError) as info:
        await t.transfer(iter([_weights(0)[1:3], [("emb", torch.zeros(3, 3))]]), engines, 5)
    msg = str(info.value)
    assert "version 5 failed as a whole" in msg and "replica-0" in msg and "replica-1" in msg and "shape" in msg
    session = t.session
    w = _weights(2)
    await t.transfer(_buckets(w), engines, 6)
    assert t.session is session
    for h in engines:
        assert all(torch.equal(h._engine.weights[n], x) for n, x in w)


async def test_an_iterator_that_raises_aborts_the_sync_cleanly(engines, make_transport):
    t = make_transport(metadata="store")

    def broken():
        yield _weights(0)[:2]
        raise RuntimeError("gather failed on rank 3")

    with pytest.raises(TransferError, match="gather failed on rank 3"):
        await t.transfer(broken(), engines, 1)
    w = _weights(3)
    await t.transfer(_buckets(w), engines, 2)
    for h in engines:
        assert all(torch.equal(h._engine.weights[n], x) for n, x in w)


async def test_an_engine_on_another_host_is_refused_at_attach_naming_nccl(engines, make_transport, monkeypatch):
    real = ipc.device_identity

    def elsewhere(device):
        ident = real(device)
        ident["host"] = {"boot_id": "0" * 32, "hostname": "other-node"}
        return ident

    monkeypatch.setattr(ipc, "device_identity", elsewhere)  # the sender's view only
    files = set(_our_files())
    with pytest.raises(TransferError) as info:
        await make_transport().transfer(_buckets(_weights(0)), engines, 1)
    msg = str(info.value)
    assert "starting the weight receivers failed" in msg and "replica-0" in msg and "other-node" in msg
    assert "type: nccl" in msg, msg
    assert set(_our_files()) == files, "a refused session leaves no shared memory behind"
    assert all(h._engine.loaded_buckets == 0 for h in engines)


async def test_buffers_that_are_not_the_same_memory_are_refused(engines, make_transport, monkeypatch):
    real = ipc.open_buffers
    monkeypatch.setattr(ipc, "open_buffers", lambda params, device, replica: [torch.zeros_like(b) for b in real(params, device, replica)])
    with pytest.raises(TransferError, match="not the same memory.*type: nccl"):
        await make_transport().transfer(_buckets(_weights(0)), engines, 1)


def test_a_gpu_receiver_without_a_gpu_is_refused_naming_nccl():
    ident = {"kind": "cuda", "host": ipc.host_identity(), "uuid": "GPU-0000", "name": "NVIDIA H200", "index": 0}
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="different GPU.*type: nccl"):
            ipc.local_device(ident, "replica-0")
    else:
        with pytest.raises(ValueError, match="sees no GPU.*type: nccl"):
            ipc.local_device(ident, "replica-0")


async def test_no_room_for_the_buffers_is_a_clear_error(engines, make_transport, monkeypatch):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ipc.os, "posix_fallocate", full)
    before = set(_our_files())
    with pytest.raises(ValueError, match="weight_sync.bucket_megabytes: cannot reserve 2 x"):
        await make_transport().transfer(_buckets(_weights(0)), engines, 1)
    assert set(_our_files()) == before


async def test_closing_the_transport_stops_every_receiver(engines, make_transport):
    t = make_transport()
    await t.transfer(_buckets(_weights(0)), engines, 1)
    receivers = [h._receivers.by_type["cuda_ipc"] for h in engines]
    assert all(r.alive and r.version == 1 for r in receivers)
    t.close()
    for _ in range(100):
        if not any(r.alive for r in receivers):
            break
        await asyncio.sleep(0.05)
    assert not any(r.alive for r in receivers)
    assert all(r.error is None and r.bufs == [] for r in receivers), [r.error for r in receivers]


def test_registered_beside_nccl_with_its_own_config_and_receiver():
    host = _host()
    spec = host.specs("weight_sync")["cuda_ipc"]
    assert spec.config_cls is IpcSyncConfig and spec.factory is hooks.make_ipc_transport
    assert spec.receiver_factory is hooks.make_ipc_receiver
    assert host.specs("weight_sync")["nccl"].receiver_factory is hooks.make_receiver
    assert IpcSyncConfig().model_dump() == IPC_CONFIG_DEFAULTS


def test_config_is_checked_and_errors_name_the_field():
    host = _host()
    cfg = validate_plugin_section(host, "weight_sync", "weight_sync", {"type": "cuda_ipc", "bucket_megabytes": 64, "device": "cpu"})
    assert isinstance(cfg, IpcSyncConfig) and cfg.bucket_megabytes == 64
    for field, bad in [("device", "tpu"), ("bucket_megabytes", 0), ("wire_dtype", "int8"), ("metadata", "redis"), ("timeout_s", -1)]:
        with pytest.raises(ConfigError, match=f"weight_sync.{field}"):
            validate_plugin_section(host, "weight_sync", "weight_sync", {"type": "cuda_ipc", field: bad})
    with pytest.raises(ConfigError, match="weight_sync.backend"):
        validate_plugin_section(host, "weight_sync", "weight_sync", {"type": "cuda_ipc", "backend": "gloo"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's error")
async def test_cuda_buffers_without_a_gpu_is_a_clear_error(engines, make_transport):
    with pytest.raises(ValueError, match="weight_sync.device: 'cuda' needs a GPU"):
        await make_transport(device="cuda").transfer(iter([]), engines, 1)


def test_storage_device_position_with_torch_and_with_sglangs_wrapper():
    """The receiver overwrites the producer's device index in a reduced CUDA tensor's arguments.
    SGLang's engine processes replace torch's rebuild_cuda_tensor by a ``(*args)`` wrapper
    (sglang.srt.utils.patch_torch): the position must then still be torch's."""
    from torch.multiprocessing import reductions

    real = reductions.rebuild_cuda_tensor
    at = ipc.storage_device_arg(real)
    assert list(inspect.signature(real).parameters)[at] == "storage_device"

    def wrapper(*args):  # what SGLang installs in place of torch's
        return real(*args)

    assert ipc.storage_device_arg(wrapper) == at

    def unknown(a, b, c):
        return a

    with pytest.raises(ValueError, match="storage device"):
        ipc.storage_device_arg(unknown)
