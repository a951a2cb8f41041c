"""Benchmark of the ``cuda_ipc`` weight sync (ferryman-sync-nccl) against a plain
device-to-device copy of the same bytes, on one GPU, in one run.

This process is the trainer; an engine process on the same GPU is the rollout side, hosting a
model-shaped parameter dict (``TensorDictEngine``: the Qwen2.5-7B names and shapes, bf16) and
the ``cuda_ipc`` receiver, attached the way a run attaches it (one IPC handle per buffer, once).
Random bf16 weights of the same shapes live in this process. Printed, side by side:

- **copy, one block**: ``dst.copy_(src)`` of one flat buffer of the same number of bytes, in
  this process (the bandwidth floor of moving those bytes once on this GPU);
- **copy, per tensor**: the same tensors copied one by one into a second set of the same
  shapes, in this process (what loading them in place would cost with no transport at all);
- **ours**: ``IpcSync.transfer`` of the parameter set: pack each bucket into one of the two
  shared buffers, publish its metadata, the engine process checks it (checksums on), loads it
  through ``load_weights`` straight out of the shared buffer and acks it; the call returns
  when the engine has reported the version loaded. With checksums off and on, for each bucket
  size. Each bucket is copied twice (packed, then loaded): 2x a single copy is the floor.

The ratio ``ours / copy`` is the figure asked for. After the last sync the engine's parameters
are checked bit for bit against the sent ones (per-tensor lane sums on both sides); the exit
status is 1 if they differ.

Needs torch only (no Ray, no pydantic) and pyzmq for the ZeroMQ channel, the transport's
default: where pyzmq cannot be imported the script installs it from a wheel under ``--wheels``
(default: ``.gpuwheels*`` folders of this checkout, then ``$WHEEL_DIR`` or ``/root/w``), and
refuses to run without it unless ``--metadata store`` is asked for. One call, at most about 3
minutes (``--time-limit``, default 170 s: past it the script stops itself, keeping what it
measured), prints the ratio to the copy for 512 MiB and 1 GiB buckets:

    # here (once): the pyzmq wheel of the lock, 1 MiB
    uv run python tools/gpu_wheels.py download --only pyzmq .gpuwheels-zmq
    # on the GPU machine
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python3 bench/gpu_sync_ipc.py --json $OUT/gpu_sync_ipc.json
    # CPU (host shared memory), a small Qwen2-shaped set:
    .venv/bin/python bench/gpu_sync_ipc.py --device cpu
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for sub in ("packages/sync-nccl/src", "packages/core/src"):
    p = str(ROOT / sub)
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "packages/sync-nccl/src"), str(ROOT / "packages/core/src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)



def _ensure_zmq(argv: list[str]) -> str | None:
    """Make pyzmq importable (here and in the engine process): install its wheel from the
    wheel folders into a private directory if needed. Returns where it came from."""
    try:
        import zmq  # noqa: F401

        return "installed"
    except ImportError:
        pass
    import glob
    import tempfile
    import zipfile

    roots = [a.split("=", 1)[1] for a in argv if a.startswith("--wheels=")]
    roots += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--wheels"]
    roots += sorted(glob.glob(str(ROOT / ".gpuwheels*"))) + [os.environ.get("WHEEL_DIR", "/root/w")]
    for root in roots:
        wheels = sorted(glob.glob(os.path.join(root, "**", "pyzmq-*.whl"), recursive=True))
        if not wheels:
            continue
        target = tempfile.mkdtemp(prefix="ferryman-zmq-")
        try:  # a wheel is a zip of what goes into site-packages (pyzmq's bundles libzmq)
            with zipfile.ZipFile(wheels[-1]) as z:
                z.extractall(target)
        except (OSError, zipfile.BadZipFile) as e:
            print(f"unpacking {wheels[-1]} failed: {e}", flush=True)
            continue
        sys.path.insert(0, target)
        os.environ["PYTHONPATH"] = os.pathsep.join([target, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return wheels[-1]
    return None


ZMQ_FROM = _ensure_zmq(sys.argv[1:])

import torch  # noqa: E402

from ferryman_sync_nccl.ipc import IpcSync  # noqa: E402
from ferryman_sync_nccl.testing import ProcessEngine, QWEN25_7B, SMALL, digest, have, ipc_config, qwen2_shapes  # noqa: E402

ENGINE = "ferryman_sync_nccl.testing:TensorDictEngine"
MODELS = {"7b": QWEN25_7B, "small": SMALL}


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _time(fn: Any, reps: int, warmup: int, cuda: bool) -> list[float]:
    out = []
    for i in range(warmup + reps):
        _sync(cuda)
        t0 = time.perf_counter()
        fn()
        _sync(cuda)
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def copies(params: dict[str, torch.Tensor], args: argparse.Namespace) -> dict[str, list[float]]:
    """The baselines: one flat copy of the same bytes, and the same tensors copied one by one."""
    cuda = args.device == "cuda"
    nbytes = sum(t.numel() * t.element_size() for t in params.values())
    dev = next(iter(params.values())).device
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    src.random_(0, 255)
    one = _time(lambda: dst.copy_(src), args.reps, args.warmup, cuda)
    del src, dst
    twins = {n: torch.empty_like(t) for n, t in params.items()}

    def per_tensor() -> None:
        for n, t in params.items():
            twins[n].copy_(t)

    per = _time(per_tensor, args.reps, args.warmup, cuda)
    assert all(torch.equal(twins[n], t) for n, t in list(params.items())[:3])
    del twins
    if cuda:
        torch.cuda.empty_cache()
    return {"copy_one_s": one, "copy_per_tensor_s": per}


async def ours(child: ProcessEngine, named: list, args: argparse.Namespace, bucket_mb: float, metadata: str, first_version: int) -> dict[str, Any]:
    cfg = ipc_config(device=args.device, bucket_megabytes=bucket_mb, verify=False, metadata=metadata, timeout_s=120.0, connect_timeout_s=300.0)
    transport = IpcSync(cfg)
    out: dict[str, Any] = {}
    version = first_version
    try:
        for verify in args.verify_modes:
            cfg.verify = verify
            updates, sends, loads, acks, connect = [], [], [], [], 0.0
            for i in range(args.warmup + args.reps):
                _sync(args.device == "cuda")
                t0 = time.perf_counter()
                m = await transport.transfer(iter([named]), [child], version)
                dt = time.perf_counter() - t0
                version += 1
                connect = max(connect, m["sync/connect_s"])
                if i >= args.warmup:
                    updates.append(dt)
                    sends.append(m["sync/send_s"])
                    loads.append(m["sync/receiver_load_s_max"])
                    acks.append(m.get("sync/ack_wait_s", float("nan")))
            traffic = {k.split("/", 1)[1]: m[k] for k in ("sync/sender_messages", "sync/sender_store_requests", "sync/receiver_messages_max", "sync/receiver_store_requests_max") if k in m}
            out["verify" if verify else "plain"] = {"update_s": updates, "send_s": sends, "load_s": loads, "ack_wait_s": acks, "buckets": m["sync/buckets"], "connect_s": connect, "traffic": traffic}
        out["last_version"] = version - 1
    finally:
        transport.close()
    return out


async def main(args: argparse.Namespace, res: dict[str, Any]) -> dict[str, Any]:
    cuda = args.device == "cuda"
    torch.set_num_threads(args.threads)
    if args.metadata == "zmq" and not have("zmq"):
        raise SystemExit("pyzmq cannot be imported and no pyzmq wheel was found (see --wheels); --metadata store runs without it")
    metadata = args.metadata if args.metadata != "auto" else ("zmq" if have("zmq") else "store")
    spec = dict(MODELS[args.model])
    if args.layers is not None:
        spec["layers"] = args.layers
    shapes = qwen2_shapes(**spec)
    dev = f"cuda:{args.gpu}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(args.gpu)
    torch.manual_seed(0)
    params = {n: torch.randn(s, dtype=torch.bfloat16, device=dev) for n, s in shapes.items()}
    named = list(params.items())
    nbytes = sum(t.numel() * t.element_size() for t in params.values())
    print(f"parameter set: {args.model} ({spec['layers']} layers), {len(named)} tensors, {nbytes / 1e9:.3f} GB bf16", flush=True)
    print(f"buffers on {dev}, metadata {metadata} (pyzmq: {ZMQ_FROM or 'none'}); the engine is a separate process on the same device", flush=True)
    res.update({"bytes": nbytes, "tensors": len(named), "model": args.model, "layers": spec["layers"], "metadata": metadata, "runs": []})
    res.update(copies(params, args))
    gb = nbytes / 1e9
    one, per = _med(res["copy_one_s"]), _med(res["copy_per_tensor_s"])
    print(f"copy, one block: {one * 1e3:.2f} ms ({gb / one:.1f} GB/s); copy, per tensor: {per * 1e3:.2f} ms ({gb / per:.1f} GB/s)", flush=True)

    child = ProcessEngine(
        "rollout-0", ENGINE, {"shapes": shapes, "dtype": "bfloat16", "device": dev},
        cuda_device=args.gpu if cuda else None, threads=args.threads, plugin_host=False,
    )
    t = time.perf_counter()
    await child.start()
    res["_children"] = [child.pid] if child.pid else []
    print(f"engine process up in {time.perf_counter() - t:.1f}s", flush=True)
    try:
        version = 1
        for bucket_mb in args.bucket_mb:
            r = await ours(child, named, args, bucket_mb, metadata, version)
            version = r.pop("last_version") + 1
            res["runs"].append({"bucket_mb": bucket_mb, **r})
            print(f"\n### bucket {bucket_mb:g} MiB ({next(iter(r.values()))['buckets']:.0f} buckets)")
            print("| what | median | GB/s | vs one-block copy | vs per-tensor copy |")
            print("|---|---|---|---|---|")
            print(f"| copy, one block | {one * 1e3:.2f} ms | {gb / one:.1f} | 1.00x | |")
            print(f"| copy, per tensor | {per * 1e3:.2f} ms | {gb / per:.1f} | {per / one:.2f}x | 1.00x |")
            for key, label in (("plain", "checksums off"), ("verify", "checksums on")):
                if key in r:
                    upd = _med(r[key]["update_s"])
                    print(f"| cuda_ipc update ({label}) | {upd * 1e3:.2f} ms | {gb / upd:.1f} | **{upd / one:.2f}x** | **{upd / per:.2f}x** |")
            print(f"(buffers handed out once in {max(x['connect_s'] for x in r.values()):.2f}s, not counted)")
            for key, x in r.items():
                nb = max(float(x["buckets"]), 1.0)
                per_b = ", ".join(f"{k} {v / nb:.2f}" for k, v in x["traffic"].items())
                print(f"per bucket ({key}): {per_b}; sender waited for acks {_med(x['ack_wait_s']) * 1e3:.2f} ms of the update")
            res["partial"] = True
            _write(args, res)
            sys.stdout.flush()
        res.pop("partial", None)
        print("\nratio to a one-block copy (median update / copy):")
        for run in res["runs"]:
            parts = [f"{lab} {_med(run[k]['update_s']) / one:.2f}x" for k, lab in (("plain", "checksums off"), ("verify", "checksums on")) if k in run]
            print(f"  {run['bucket_mb']:g} MiB buckets: " + ", ".join(parts))
        want = digest(params)
        got = await child.call("ferryman_sync_nccl.testing:engine_digest")
        res["bit_identical"] = got == want
        print(f"\nreceived parameters bit-identical to the sent ones: {'yes' if res['bit_identical'] else 'NO'}", flush=True)
        if cuda:
            res["peak_trainer_gib"] = torch.cuda.max_memory_allocated() / 2**30
            print(f"peak memory allocated in this process: {res['peak_trainer_gib']:.1f} GiB", flush=True)
    finally:
        await child.shutdown()
    return res


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if gpu else "cpu")
    ap.add_argument("--model", choices=tuple(MODELS), default=None, help="parameter shapes (default: 7b on cuda, small on cpu)")
    ap.add_argument("--layers", type=int, default=None, help="override the number of layers")
    ap.add_argument("--bucket-mb", default=None, help="comma-separated bucket sizes in MiB (default: 512,1024 on cuda; 4 on cpu)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--verify", choices=("off", "on", "both"), default="both", help="checksums per bucket")
    ap.add_argument("--metadata", choices=("auto", "zmq", "store"), default="auto", help="auto: zmq if pyzmq is importable, else the TCPStore")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the raw timings here (after each bucket size too)")
    ap.add_argument("--wheels", default=None, help="folder with a pyzmq wheel, used when pyzmq cannot be imported")
    ap.add_argument("--time-limit", type=float, default=170.0, help="seconds; past it the script stops (engine process included), keeping what it measured")
    args = ap.parse_args(argv)
    args.model = args.model or ("7b" if args.device == "cuda" else "small")
    args.bucket_mb = [float(x) for x in (args.bucket_mb or ("512,1024" if args.device == "cuda" else "4")).split(",")]
    args.verify_modes = {"off": [False], "on": [True], "both": [False, True]}[args.verify]
    if args.device == "cuda" and not gpu:
        ap.error("--device cuda needs a GPU")
    return args


def _write(args: argparse.Namespace, res: dict[str, Any]) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps({k: v for k, v in res.items() if not k.startswith("_")}, indent=1))


def _watchdog(args: argparse.Namespace, res: dict[str, Any]) -> None:
    """Past ``--time-limit``: write what was measured, kill the engine process and exit."""
    import signal
    import threading

    def fire() -> None:
        print(f"\ntime limit of {args.time_limit:g}s reached: stopping (results so far kept)", flush=True)
        res["timed_out"] = True
        try:
            _write(args, res)
        finally:
            for child in res.get("_children", []):
                try:
                    os.kill(child, signal.SIGKILL)
                except OSError:
                    pass
            os._exit(124)

    t = threading.Timer(args.time_limit, fire)
    t.daemon = True
    t.start()


if __name__ == "__main__":
    args = parse()
    print(f"python {platform.python_version()}, torch {torch.__version__}, " + (torch.cuda.get_device_name(args.gpu) if args.device == "cuda" else f"{os.cpu_count()} CPUs"), flush=True)
    res: dict[str, Any] = {}
    _watchdog(args, res)
    asyncio.run(main(args, res))
    res.pop("_children", None)
    _write(args, res)
    sys.exit(0 if res.get("bit_identical") else 1)
