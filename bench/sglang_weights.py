"""Weight loading into the sglang engine: the two ways SGLang takes new weights, one run.

The model is bench/engine.py's random Qwen2.5-1.5B-shaped bf16 checkpoint (3.1 GB of weights);
one ``SGLangEngine`` serves both paths. Each path loads the full weights ``--repeats`` times
(after one warm-up load) in buckets of ``--bucket-mb``:

``tensor``
    what the ``nccl`` and ``cuda_ipc`` receivers do: ``SGLangEngine.load_weights`` on CUDA
    tensors already in this process (views of one buffer), i.e. SGLang's
    ``update_weights_from_tensor`` (CUDA IPC handles to the scheduler, which copies them into
    the model). This is the engine side only: the transport's own broadcast comes before it
    (``bench/sync.py`` measures that).
``distributed`` (needs 2 GPUs)
    SGLang's own group: this process (GPU 1) is rank 0 of a group joined by the scheduler
    (``init_weights_update_group``) and broadcasts each bucket flattened, SGLang's
    ``update_weights_from_distributed(load_format="flattened_bucket")`` receiving and loading
    it: the whole trainer-to-engine move, as a dedicated transport would do it.

    python bench/sglang_weights.py --out /tmp/bench-sglang-weights.json
    python bench/sglang_weights.py --paths tensor          # one GPU

Needs SGLang 0.5.11-0.5.17 and the ferryman sources on PYTHONPATH (packages/core/src,
packages/engine-sglang/src).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("core", "engine-sglang"):
    src = str(ROOT / "packages" / sub / "src")
    if src not in sys.path:
        sys.path.append(src)


def _bench_engine():
    spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "bench" / "engine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def buckets_of(named, limit_bytes):
    out, cur, size = [], [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > limit_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += nbytes
    if cur:
        out.append(cur)
    return out


async def tensor_path(engine, weights, bucket_bytes, repeats):
    import torch

    buf = torch.empty(sum(t.numel() for _, t in weights), dtype=torch.bfloat16, device="cuda:0")
    views, off = [], 0
    for name, t in weights:
        v = buf[off : off + t.numel()].view(t.shape)
        v.copy_(t)
        views.append((name, v))
        off += t.numel()
    buckets = buckets_of(views, bucket_bytes)
    times = []
    for i in range(repeats + 1):
        await engine.pause(abort=False)
        t0 = time.perf_counter()
        for b in buckets:
            await engine.load_weights(b)
        await engine.set_version(i + 1)
        dt = time.perf_counter() - t0
        await engine.resume()
        if i:
            times.append(dt)
    return times, len(buckets)


async def distributed_path(engine, weights, bucket_bytes, repeats):
    import torch
    import torch.distributed as dist
    from sglang.srt.utils.common import init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    io = engine._api.io
    tm = engine._sgl.tokenizer_manager
    on1 = [(n, t.to("cuda:1")) for n, t in weights]
    buckets = buckets_of(on1, bucket_bytes)
    from ferryman.cluster.connect import free_port

    port = free_port()
    group = "ferryman_bench"
    obj = io.InitWeightsUpdateGroupReqInput(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, group_name=group, backend="nccl")
    torch.cuda.set_device(1)
    joined = asyncio.ensure_future(tm.init_weights_update_group(obj, None))
    pg = await asyncio.to_thread(
        init_custom_process_group, backend="nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name=group
    )
    result = await joined
    ok = result[0] if isinstance(result, tuple) else getattr(result, "success", True)
    if not ok:
        raise RuntimeError(f"init_weights_update_group failed: {result}")
    times = []
    for i in range(repeats + 1):
        await engine.pause(abort=False)
        t0 = time.perf_counter()
        for b in buckets:
            flat = FlattenedTensorBucket(named_tensors=b).get_flattened_tensor()
            req = io.UpdateWeightsFromDistributedReqInput(
                names=[n for n, _ in b],
                dtypes=[str(t.dtype).removeprefix("torch.") for _, t in b],
                shapes=[list(t.shape) for _, t in b],
                group_name=group,
                flush_cache=False,
                load_format="flattened_bucket",
            )
            recv = asyncio.ensure_future(tm.update_weights_from_distributed(req, None))
            await asyncio.to_thread(lambda: (dist.broadcast(flat, src=0, group=pg), torch.cuda.synchronize(1)))
            out = await recv
            if not (out[0] if isinstance(out, tuple) else out.success):
                raise RuntimeError(f"update_weights_from_distributed failed: {out}")
        # the radix-cache flush that set_version does after load_weights (this path bypasses
        # load_weights, so set_version does not flush), timed as there: a waiting flush, not
        # flush_cache=True on the last bucket, whose failure is an assertion that ends SGLang's
        # scheduler if it is not fully idle yet
        flushed = await tm.flush_cache(timeout_s=10.0)
        if not getattr(flushed, "success", flushed):
            raise RuntimeError(f"flush_cache after the distributed update failed: {flushed}")
        await engine.set_version(100 + i)
        dt = time.perf_counter() - t0
        await engine.resume()
        if i:
            times.append(dt)
    return times, len(buckets)


async def main_async(args) -> list[dict]:
    import torch
    import transformers

    from ferryman.types import SamplingParams
    from ferryman_engine_sglang import SGLangEngineConfig, make_sglang_engine

    model_dir = _bench_engine().build_model(Path(args.workdir) / "qwen2.5-1.5b-random")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    weights = [(k, v.detach().cuda()) for k, v in model.state_dict().items()]
    del model
    total = sum(t.numel() * t.element_size() for _, t in weights)
    cfg = SGLangEngineConfig(dtype="bfloat16", mem_fraction_static=0.5, memory_saver=False, cuda_graph=False)
    engine = make_sglang_engine(cfg, model_path=str(model_dir), replica="bench-weights", seed=0)
    await engine.start()
    prompt = list(range(10, 42))
    ref = await engine.generate("ref", prompt, SamplingParams(max_tokens=16, temperature=0.0))
    print(f"model {model_dir} | {total / 1e9:.2f} GB bf16 | GPUs {torch.cuda.device_count()} x {torch.cuda.get_device_name()}", flush=True)
    rows = []
    for path in args.paths.split(","):
        if path == "distributed" and torch.cuda.device_count() < 2:
            print("distributed: skipped (needs 2 GPUs: NCCL puts no two ranks on one device)", flush=True)
            continue
        fn = {"tensor": tensor_path, "distributed": distributed_path}[path]
        times, n = await fn(engine, weights, args.bucket_mb * 2**20, args.repeats)
        again = await engine.generate(f"after-{path}", prompt, SamplingParams(max_tokens=16, temperature=0.0))
        best = min(times)
        row = {
            "path": path,
            "buckets": n,
            "load_s_best": round(best, 3),
            "load_s_all": [round(t, 3) for t in times],
            "gb_per_s": round(total / best / 1e9, 2),
            "same_greedy_after": again.token_ids == ref.token_ids,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    await engine.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", default="tensor,distributed")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/ferryman-bench-engine")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = asyncio.run(main_async(args))
    print("\n| path | buckets | full load, best (s) | GB/s | greedy unchanged |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['buckets']} | {r['load_s_best']} | {r['gb_per_s']} | {r['same_greedy_after']} |")
    by = {r["path"]: r for r in rows}
    if len(by) == 2:
        print(f"\ntensor / distributed load time: {by['tensor']['load_s_best'] / by['distributed']['load_s_best']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
