"""What one ``cuda_ipc`` bucket costs on the side channel, counted on CPUs (host shared memory):
TCPStore requests (each a round trip to the store's server) and messages of the sender and of
a receiver, and the waits for the device (``wait_stream``/``wait_event`` calls: free on CPUs,
each one a CPU<->GPU synchronisation on the GPU), per bucket, for both metadata channels.

Counted from outside the transport (wrappers around the channel classes and the wait
functions), so the same script counts any version of ``ferryman_sync_nccl``: put another
checkout's ``packages/sync-nccl/src`` first on ``PYTHONPATH`` to count that one.

    .venv/bin/python bench/ipc_roundtrips.py [--buckets 32] [--engines 2] [--syncs 5] [--verify off]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for sub in ("packages/sync-nccl/src", "packages/core/src"):
    if str(ROOT / sub) not in sys.path:
        sys.path.append(str(ROOT / sub))  # appended: a PYTHONPATH entry wins

import torch  # noqa: E402

import ferryman_sync_nccl  # noqa: E402
import ferryman_sync_nccl.channel as C  # noqa: E402
import ferryman_sync_nccl.group as G  # noqa: E402
from ferryman.engine_host import EngineHandle  # noqa: E402
from ferryman.plugins import PluginHost  # noqa: E402
from ferryman_sync_nccl import IpcSync, IpcSyncConfig, hooks  # noqa: E402
from ferryman_sync_nccl.testing import TensorDictEngine  # noqa: E402

COUNTS: Counter[str] = Counter()


class _Counted:
    def __init__(self, store: Any, side: str) -> None:
        self._store, self._side = store, side

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._store, name)

        def call(*a: Any, **kw: Any) -> Any:
            COUNTS[f"{self._side} store requests"] += 1
            return fn(*a, **kw)

        return call


def _instrument() -> None:
    for cls, side in ((C.StoreSender, "sender"), (C.StoreReceiver, "receiver")):
        init = cls.__init__

        def wrapped(self: Any, store: Any, *a: Any, _init: Any = init, _side: str = side, **kw: Any) -> None:
            _init(self, _Counted(store, _side), *a, **kw)

        cls.__init__ = wrapped  # type: ignore[method-assign]

    def count(cls: Any, name: str, key: str, only_hits: bool = False) -> None:
        fn = getattr(cls, name)

        def wrapped(self: Any, *a: Any, **kw: Any) -> Any:
            out = fn(self, *a, **kw)
            if not only_hits or out is not None:
                COUNTS[key] += 1
            return out

        setattr(cls, name, wrapped)

    count(C.ZmqSender, "publish", "sender messages")
    count(C.ZmqSender, "_recv", "sender messages in", only_hits=True)
    count(C.ZmqReceiver, "send", "receiver messages")
    count(C.StoreSender, "publish", "sender messages")
    count(C.StoreReceiver, "send", "receiver messages")
    for name in ("wait_stream", "wait_event"):
        fn = getattr(G, name)

        def waited(*a: Any, _fn: Any = fn, **kw: Any) -> Any:
            side = "sender" if threading.current_thread().name.startswith("ferryman-sync") else "receiver"
            COUNTS[f"{side} device waits"] += 1
            return _fn(*a, **kw)

        setattr(G, name, waited)  # the transport calls them as G.<name>


async def run(metadata: str, args: argparse.Namespace) -> dict[str, float]:
    per = 64 * 1024  # float32 elements per tensor: 256 KiB
    shapes = {f"w{i}": (per,) for i in range(args.buckets)}
    host = PluginHost(load_entry_points=False, extra_plugins=(hooks,))
    engines = [EngineHandle(f"replica-{i}", engine=TensorDictEngine(shapes), plugin_host=host) for i in range(args.engines)]
    # one tensor per bucket: the bucket is the tensor (plus the 64-byte trailer)
    cfg = IpcSyncConfig(device="cpu", metadata=metadata, bucket_megabytes=0.25, timeout_s=30, verify=args.verify == "on")
    t = IpcSync(cfg)
    g = torch.Generator().manual_seed(0)
    weights = [(n, torch.randn(s, generator=g)) for n, s in shapes.items()]
    try:
        await t.transfer(iter([weights]), engines, 0)  # builds the session: not counted
        COUNTS.clear()
        times = []
        for v in range(1, args.syncs + 1):
            t0 = time.perf_counter()
            m = await t.transfer(iter([weights]), engines, v)
            times.append(time.perf_counter() - t0)
        assert int(m["sync/buckets"]) == args.buckets, m["sync/buckets"]
        for h in engines:
            assert all(torch.equal(h._engine.weights[n], x) for n, x in weights)
    finally:
        t.close()
        for h in engines:
            await h.shutdown()
    n = args.syncs * args.buckets
    out = {k: v / n for k, v in COUNTS.items()}
    for k in [k for k in out if k.startswith("receiver")]:
        out[k] /= args.engines  # per receiver
    out["ms per bucket"] = statistics.median(times) / args.buckets * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--buckets", type=int, default=32)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--verify", choices=("on", "off"), default="on", help="checksums")
    args = ap.parse_args()
    _instrument()
    src = Path(ferryman_sync_nccl.__file__).resolve().parent
    print(f"ferryman_sync_nccl from {src}; {args.engines} in-process engines, {args.buckets} buckets of 256 KiB, {args.syncs} syncs; checksums {args.verify}")
    rows = {md: asyncio.run(run(md, args)) for md in ("zmq", "store")}
    keys = sorted({k for r in rows.values() for k in r})
    print("\n| per bucket | zmq | store |\n|---|---|---|")
    for k in keys:
        print(f"| {k} | {rows['zmq'].get(k, 0.0):.2f} | {rows['store'].get(k, 0.0):.2f} |")
    print("(receiver figures are per receiver; a sync's begin/end/report/cleanup are spread over its buckets)")


if __name__ == "__main__":
    main()
