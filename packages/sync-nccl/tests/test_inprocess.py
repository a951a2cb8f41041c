"""The transport's behaviour with receivers in this process (threads of one gloo group):
dtype casting, split tensors, group reuse, and every failure path that must end in a clear
error without breaking the next sync."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ferryman.config import ConfigError, validate_plugin_section
from ferryman.engine_host import EngineHandle
from ferryman.plugins import PluginHost
from ferryman_sync_nccl import NcclSync, NcclSyncConfig, TransferError
from ferryman_sync_nccl import hooks
from ferryman_sync_nccl.testing import TensorDictEngine

SHAPES = {"emb": (100, 32), "w1": (32, 64), "b1": (64,), "w2": (64, 32), "count": (2,)}


def _weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, s in SHAPES.items():
        out.append((n, torch.randint(0, 1000, s, generator=g) if n == "count" else torch.randn(s, generator=g)))
    return out


def _buckets(weights, per=2):
    return (weights[i : i + per] for i in range(0, len(weights), per))


@pytest.fixture
async def engines():
    host = PluginHost(load_entry_points=False, extra_plugins=(hooks,))
    hs = [EngineHandle(f"replica-{i}", engine=TensorDictEngine(SHAPES), plugin_host=host) for i in range(2)]
    yield hs
    for h in hs:
        await h.shutdown()


@pytest.fixture
def make_transport():
    made = []

    def make(**kw):
        kw.setdefault("backend", "gloo")
        kw.setdefault("timeout_s", 10)
        t = NcclSync(NcclSyncConfig(**kw))
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


async def test_casts_splits_and_reuses_the_group(engines, make_transport):
    # 4 KiB buckets: "emb" (12.8 KB) is split over four buckets; float32 travels as bfloat16
    t = make_transport(bucket_megabytes=4 / 1024, wire_dtype="bfloat16")
    first = await t.transfer(_buckets(_weights(0)), engines, 1)
    session = t.session
    assert first["sync/connect_s"] > 0 and first["sync/buckets"] >= 5
    w = _weights(1)
    second = await t.transfer(_buckets(w), engines, 2)
    assert t.session is session and second["sync/connect_s"] == 0.0, "the group is built once and reused"
    for h in engines:
        got = h._engine.weights
        for name, x in w:
            expect = x.to(torch.bfloat16).to(torch.float32) if x.is_floating_point() else x
            assert torch.equal(got[name], expect), name
    assert second["sync/bytes"] < sum(x.numel() * x.element_size() for _, x in w), "bf16 on the wire"


async def test_a_receiver_that_refuses_a_bucket_fails_the_sync_and_the_next_one_works(engines, make_transport):
    t = make_transport()
    bad = [("emb", torch.zeros(3, 3))]  # wrong shape: the engine refuses it
    with pytest.raises(TransferError) as info:
        await t.transfer(iter([_weights(0)[1:3], bad]), engines, 5)
    msg = str(info.value)
    assert "version 5 failed as a whole" in msg and "replica-0" in msg and "replica-1" in msg and "shape" in msg
    session = t.session
    w = _weights(2)
    await t.transfer(_buckets(w), engines, 6)
    assert t.session is session, "a refused bucket does not break the group"
    for h in engines:
        assert all(torch.equal(h._engine.weights[n], x) for n, x in w)


async def test_an_iterator_that_raises_aborts_the_sync_cleanly(engines, make_transport):
    t = make_transport()

    def broken():
        yield _weights(0)[:2]
        raise RuntimeError("gather failed on rank 3")

    with pytest.raises(TransferError, match="gather failed on rank 3"):
        await t.transfer(broken(), engines, 1)
    w = _weights(3)
    await t.transfer(_buckets(w), engines, 2)
    for h in engines:
        assert all(torch.equal(h._engine.weights[n], x) for n, x in w)


async def test_a_corrupted_bucket_is_caught_by_the_checksum(engines, make_transport, monkeypatch):
    import ferryman_sync_nccl.sender as sender

    t = make_transport(verify=True)
    await t.transfer(_buckets(_weights(0)), engines, 1)
    before = {n: x.clone() for n, x in engines[0]._engine.weights.items()}
    real = sender.lane_sums
    monkeypatch.setattr(sender, "lane_sums", lambda data: real(data) + 1)  # fault injection: wrong trailer
    with pytest.raises(TransferError, match="checksum mismatch"):
        await t.transfer(_buckets(_weights(1)), engines, 2)
    assert all(torch.equal(before[n], x) for n, x in engines[0]._engine.weights.items()), "nothing loaded from a bad bucket"


async def test_without_checksums(engines, make_transport):
    t = make_transport(verify=False, metadata="store")
    w = _weights(4)
    m = await t.transfer(_buckets(w, per=10), engines, 1)
    assert m["sync/buckets"] == 1
    for h in engines:
        assert all(torch.equal(h._engine.weights[n], x) for n, x in w)


async def test_engines_that_cannot_host_a_receiver_get_a_clear_error(make_transport):
    class Bare:
        name = "bare-0"

    with pytest.raises(TransferError, match="bare-0: this engine handle cannot host a weight receiver"):
        await make_transport().transfer(iter([]), [Bare()], 1)


async def test_a_receiver_that_never_joins_fails_the_connect_within_the_timeout(make_transport):
    class Silent:
        """Accepts the receiver params and never starts a receiver."""

        name = "silent-0"

        async def attach_weight_receiver(self, sync_type, params):
            return None

    t = make_transport(connect_timeout_s=1.5)
    started = asyncio.get_running_loop().time()
    with pytest.raises(TransferError, match="silent-0: its receiver never reported in"):
        await t.transfer(iter([]), [Silent()], 1)
    assert asyncio.get_running_loop().time() - started < 10


def test_config_is_checked_and_errors_name_the_field():
    host = PluginHost(load_entry_points=False, extra_plugins=(hooks,))
    cfg = validate_plugin_section(host, "weight_sync", "weight_sync", {"type": "nccl", "bucket_megabytes": 64, "metadata": "store"})
    assert isinstance(cfg, NcclSyncConfig) and cfg.bucket_megabytes == 64
    with pytest.raises(ConfigError, match="weight_sync.backend"):
        validate_plugin_section(host, "weight_sync", "weight_sync", {"type": "nccl", "backend": "mpi"})
    with pytest.raises(ConfigError, match="weight_sync.bucket_megabytes"):
        validate_plugin_section(host, "weight_sync", "weight_sync", {"type": "nccl", "bucket_megabytes": 0})
    with pytest.raises(ConfigError, match="weight_sync.wire_dtype"):
        validate_plugin_section(host, "weight_sync", "weight_sync", {"type": "nccl", "wire_dtype": "int8"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's error")
async def test_nccl_without_a_gpu_is_a_clear_error(engines, make_transport):
    with pytest.raises(ValueError, match="needs a GPU"):
        await make_transport(backend="nccl").transfer(iter([]), engines, 1)


@pytest.mark.parametrize("metadata", ["zmq", "store"])
async def test_closing_the_transport_returns_once_every_receiver_left_and_freed_its_group(engines, make_transport, metadata):
    # the close is a handshake: close -> each receiver leaves, frees its group, says bye ->
    # only then the sender frees its group and its store (no receiver finds the store gone)
    t = make_transport(metadata=metadata)
    await t.transfer(_buckets(_weights(0)), engines, 1)
    receivers = [h._receivers.by_type["nccl"] for h in engines]
    assert all(r.alive and r.version == 1 and r.pg is not None for r in receivers)
    t.close()
    assert not any(r.alive for r in receivers), "close returned before the receivers left"
    assert all(r.error is None for r in receivers), [r.error for r in receivers]
    assert all(r.pg is None for r in receivers), "each receiver freed its group in its own thread"
    assert t.session is None


@pytest.mark.parametrize("metadata", ["zmq", "store"])
async def test_closing_an_engine_stops_its_receiver_and_frees_its_group_before_close_returns(engines, make_transport, metadata):
    # an idle receiver (even one on the TCPStore channel, which used to block in a day-long
    # wait for the next key) notices the close at once; the engine's shutdown awaits its thread
    t = make_transport(metadata=metadata)
    await t.transfer(_buckets(_weights(0)), engines, 1)
    receivers = [h._receivers.by_type["nccl"] for h in engines]
    started = asyncio.get_running_loop().time()
    for h in engines:
        await h.shutdown()
    assert asyncio.get_running_loop().time() - started < 3
    assert not any(r.alive for r in receivers)
    assert all(r.pg is None and r.error is None for r in receivers), [r.error for r in receivers]


async def test_a_group_is_freed_only_after_its_last_collective_ended(engines, make_transport, monkeypatch):
    """Fault injection: the sender announces a bucket and never broadcasts it, so every receiver
    is left with a broadcast in flight when its wait gives up. That broadcast ends at the
    group's own deadline (timeout_s, not the 30 s join timeout), and only then is the group
    freed, by the receiver's thread; the engine's shutdown waits for that."""
    import ferryman_sync_nccl.group as G
    import ferryman_sync_nccl.sender as sender

    started: list[tuple[object, object]] = []  # (group, work) of every broadcast
    real_broadcast = G.broadcast

    def broadcast(pg, tensor, root=0):
        work = real_broadcast(pg, tensor, root)
        started.append((pg, work))
        return work

    freed: list[bool] = []  # per group freed: had all its collectives ended?
    real_free = G._free

    def free(pg):
        freed.append(all(w.is_completed() for g, w in started if g is pg))
        real_free(pg)

    monkeypatch.setattr(G, "broadcast", broadcast)
    monkeypatch.setattr(G, "_free", free, raising=False)
    t = make_transport(timeout_s=1.0, connect_timeout_s=30)
    await t.transfer(_buckets(_weights(0)), engines, 1)
    receivers = [h._receivers.by_type["nccl"] for h in engines]

    def lost(self, sync, k, slot, buf, used, n, entries):
        self.channel.publish({"op": "bucket", "sync": sync, "k": k, "nbytes": used, "entries": entries})

    monkeypatch.setattr(sender._NcclSession, "ship", lost)
    with pytest.raises(TransferError):
        await t.transfer(_buckets(_weights(1)), engines, 2)
    assert all(r.error and "collective failed" in r.error for r in receivers), [r.error for r in receivers]
    t0 = asyncio.get_running_loop().time()
    for h in engines:
        await h.shutdown()
    assert asyncio.get_running_loop().time() - t0 < 10, "the broadcast in flight ended at timeout_s, not at the 30 s join timeout"
    assert not any(r.alive for r in receivers) and all(r.pg is None for r in receivers)
    assert len(freed) >= 2 and all(freed), "a group was freed while one of its collectives ran"
    for h in engines:
        assert all(torch.equal(h._engine.weights[n], x) for n, x in _weights(0)), "version 1 stays loaded"
