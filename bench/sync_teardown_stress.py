"""Stress for the ``nccl`` transport's teardown with receivers in this process (gloo on CPUs):
session after session, every other one left with a broadcast in flight on every receiver
(fault injection: the sender announces a bucket and never sends it), the previous session
closed while the next one has just joined beside it, metadata channels mixed. This is the
pattern of the rare CI crash (a SIGSEGV in gloo's ``broadcast`` during a join, right after
another group's receivers lost their store); a crash kills the process (exit 139/134).

    .venv/bin/python bench/sync_teardown_stress.py [--sessions 400] [--seconds 280]

Put another checkout's ``packages/sync-nccl/src`` first on ``PYTHONPATH`` to stress that one.
Run it under load (a busy loop beside it) to shift the timings.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("packages/sync-nccl/src", "packages/core/src"):
    if str(ROOT / sub) not in sys.path:
        sys.path.append(str(ROOT / sub))  # appended: a PYTHONPATH entry wins

import torch  # noqa: E402

import ferryman_sync_nccl  # noqa: E402
import ferryman_sync_nccl.sender as S  # noqa: E402
from ferryman.engine_host import EngineHandle  # noqa: E402
from ferryman.plugins import PluginHost  # noqa: E402
from ferryman_sync_nccl import NcclSync, NcclSyncConfig, TransferError, hooks  # noqa: E402
from ferryman_sync_nccl.testing import TensorDictEngine  # noqa: E402

SHAPES = {"a": (64, 32), "b": (128,)}
REAL_SHIP = S._NcclSession.ship


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(s, generator=g)) for n, s in SHAPES.items()]


def _lost_ship(self, sync, k, slot, buf, used, n, entries):  # noqa: ANN001
    self.channel.publish({"op": "bucket", "sync": sync, "k": k, "nbytes": used, "entries": entries})


async def _session(i: int, fail: bool, connect_s: float) -> tuple[list[EngineHandle], NcclSync]:
    host = PluginHost(load_entry_points=False, extra_plugins=(hooks,))
    engines = [EngineHandle(f"r{j}", engine=TensorDictEngine(SHAPES), plugin_host=host) for j in range(2)]
    t = NcclSync(NcclSyncConfig(backend="gloo", timeout_s=0.4, connect_timeout_s=connect_s, metadata=random.choice(["zmq", "store"]), bucket_megabytes=1 / 1024))
    await t.transfer(iter([_weights(i)]), engines, 1)
    if fail:
        S._NcclSession.ship = _lost_ship
        try:
            await t.transfer(iter([_weights(i + 1)]), engines, 2)
        except TransferError:
            pass
        finally:
            S._NcclSession.ship = REAL_SHIP
    await asyncio.sleep(random.random() * 0.3)
    return engines, t


async def main(args: argparse.Namespace) -> None:
    prev = None
    t0 = time.monotonic()
    i = 0
    while i < args.sessions and time.monotonic() - t0 < args.seconds:
        engines, t = await _session(i, fail=i % 2 == 0, connect_s=args.connect_timeout)
        if prev is not None:
            p_engines, p_t = prev
            p_t.close()
            for h in p_engines:
                await h.shutdown()
        prev = (engines, t)
        i += 1
        if i % 20 == 0:
            alive = sum(x.name.startswith("ferryman-receiver") for x in threading.enumerate())
            print(f"{i} sessions, {time.monotonic() - t0:.0f}s, {alive} receiver threads alive", flush=True)
    if prev is not None:
        prev[1].close()
        for h in prev[0]:
            await h.shutdown()
    print(f"survived {i} sessions in {time.monotonic() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=400)
    ap.add_argument("--seconds", type=float, default=280.0)
    ap.add_argument("--connect-timeout", type=float, default=3.0, help="the join's timeout (the gloo deadline before the fix)")
    args = ap.parse_args()
    faulthandler.enable(all_threads=True)
    print(f"ferryman_sync_nccl from {Path(ferryman_sync_nccl.__file__).resolve().parent}", flush=True)
    asyncio.run(main(args))
