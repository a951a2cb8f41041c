"""Generation throughput of the vllm, sglang and transformers (hf) engines, one GPU, one run.

Both engines serve the same random model with the shape of Qwen2.5-1.5B (28 layers, hidden
1536, 12 heads / 2 KV heads, vocab 151936, bf16; built here, nothing downloaded) and the same
prompts: ``--num-prompts`` random token-id prompts of ``--prompt-len`` tokens, all submitted at
once through the engines' ``generate()``, each sampling ``--max-tokens`` tokens at temperature 1
(random weights almost never produce EOS, so every request runs its whole budget). Reported per
engine: start time, wall time of the batch, generated tokens/s, and the ratio.

``sglang-raw`` is SGLang's own ``Engine.async_generate`` on the same prompts, all in one batch
call (token ids in, ``return_logprob`` on, as ferryman asks), with the same server arguments as
the ``sglang`` row. ``sglang-raw-each`` is the same with one ``async_generate`` call per prompt, all
at once, as the wrapper (and any server with many callers) makes them: sglang / sglang-raw-each
is the wrapper's own cost, sglang-raw-each / sglang-raw what one batch call gains over separate
requests (the scheduler sees them all in its first step). ``vllm-raw`` likewise is
vLLM's own offline ``LLM.generate`` (the same ``LLMEngine`` step loop as the ``thread`` core) on
the same prompts with the ``vllm`` row's engine arguments and sampling parameters (token ids
in, the sampled token's log-prob out, no detokenizing): vllm / vllm-raw is that wrapper's cost.
``--vllm-async-scheduling on|off`` sets vLLM's async scheduling in every vllm row (row names
get ``+async`` / ``-sync``; ``--vllm-core process`` rows get ``@process``; by default ``vllm-raw`` has vLLM's default, on, and the thread core
off). ``vllm-stream`` is the ``vllm`` row with ``stream_tokens: true`` (every step's tokens handed
over, vLLM's DELTA outputs, against the default's one hand-over per request). vLLM's sleep-mode
memory pool allows one engine per process: run each vllm row in a process of its own
(``--out`` per row, then ``--table a.json b.json ...`` prints the table and the ratios).

    python bench/engine.py --out /tmp/bench-engine.json
    python bench/engine.py --engines vllm --num-prompts 256
    python bench/engine.py --engines sglang,sglang-raw,hf

Needs a CUDA GPU, vLLM 0.24 (vllm rows) or SGLang 0.5.11-0.5.17 (sglang rows) and the ferryman
packages importable (installed, or on PYTHONPATH: packages/core/src, packages/engine-hf/src,
packages/engine-vllm/src, packages/engine-sglang/src).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("core", "engine-hf", "engine-vllm", "engine-sglang"):
    src = str(ROOT / "packages" / sub / "src")
    if src not in sys.path:
        sys.path.append(src)

QWEN25_15B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def build_model(out: Path, seed: int = 0) -> Path:
    """A random Qwen2.5-1.5B-shaped bf16 checkpoint with ferryman's tiny tokenizer."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from ferryman.tiny import build_tiny_model

    if (out / "config.json").exists():
        return out
    tok_dir = build_tiny_model(out.parent / f"{out.name}-tokenizer")
    tmp = out.parent / f".{out.name}.building"
    shutil.rmtree(tmp, ignore_errors=True)
    config = Qwen2Config(**QWEN25_15B, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in tok_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, tmp / f.name)
    del model
    torch.cuda.empty_cache()
    tmp.rename(out)
    return out


async def run_engine(name: str, engine, prompts: list[list[int]], max_tokens: int) -> dict:
    from ferryman.types import SamplingParams

    t0 = time.perf_counter()
    await engine.start()
    started = time.perf_counter() - t0
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=None)
    # warm-up: one short batch (allocator, kernels, CUDA graphs of small batch sizes)
    await asyncio.gather(*[engine.generate(f"warm-{i}", p, params.replace(max_tokens=8)) for i, p in enumerate(prompts[:8])])
    before = await engine.stats()
    t1 = time.perf_counter()
    outs = await asyncio.gather(*[engine.generate(f"{name}-{i}", p, params) for i, p in enumerate(prompts)])
    wall = time.perf_counter() - t1
    tokens = sum(len(o.token_ids) for o in outs)
    stats = await engine.stats()
    await engine.shutdown()
    return {
        "engine": name,
        "start_s": round(started, 1),
        "wall_s": round(wall, 3),
        "generated_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "finished_by_length": sum(o.stop_reason == "length" for o in outs),
        "steps": stats.get("steps"),  # warm-up included
        # of the timed batch: seconds the engine spent inside vLLM's step() (thread core)
        "step_seconds": round(stats["step_seconds"] - before["step_seconds"], 3) if "step_seconds" in stats else None,
    }


def sglang_config(args: argparse.Namespace):
    from ferryman_engine_sglang import SGLangEngineConfig

    return SGLangEngineConfig(
        dtype="bfloat16",
        mem_fraction_static=args.gpu_memory_utilization,
        context_length=args.prompt_len + args.max_tokens + 16,
        max_running_requests=max(256, args.num_prompts),
        cuda_graph=not args.enforce_eager,
        memory_saver=False,
    )


async def run_sglang_raw(prompts: list[list[int]], max_tokens: int, args: argparse.Namespace, model_dir: Path, *,
                         each: bool = False) -> dict:
    """SGLang's own Engine on the same prompts: one batched async_generate call, or (``each``)
    one call per prompt, all at once."""
    from ferryman_engine_sglang.api import load_sglang

    api = load_sglang()
    kwargs = sglang_config(args).engine_kwargs(model_path=str(model_dir), seed=0)
    t0 = time.perf_counter()
    engine = api.engine_cls(**kwargs)  # on the loop thread, as SGLangEngine.start does
    started = time.perf_counter() - t0
    sp = {"max_new_tokens": max_tokens, "temperature": 1.0, "no_stop_trim": True, "skip_special_tokens": False}
    await engine.async_generate(input_ids=prompts[:8], sampling_params={**sp, "max_new_tokens": 8}, return_logprob=True)
    t1 = time.perf_counter()
    if each:
        outs = await asyncio.gather(*[
            engine.async_generate(input_ids=p, sampling_params=sp, return_logprob=True, logprob_start_len=-1) for p in prompts
        ])
    else:
        outs = await engine.async_generate(input_ids=prompts, sampling_params=sp, return_logprob=True, logprob_start_len=-1)
    wall = time.perf_counter() - t1
    tokens = sum(len(o["output_ids"]) for o in outs)
    await asyncio.to_thread(engine.shutdown)
    return {
        "engine": "sglang-raw-each" if each else "sglang-raw",
        "start_s": round(started, 1),
        "wall_s": round(wall, 3),
        "generated_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "finished_by_length": sum(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs),
        "steps": None,
    }


def vllm_config(args: argparse.Namespace, *, stream: bool = False):
    from ferryman_engine_vllm import VLLMEngineConfig

    return VLLMEngineConfig(
        core=args.vllm_core,
        stream_tokens=stream,
        async_scheduling={"on": True, "off": False}.get(args.vllm_async_scheduling),
        dtype="bfloat16",
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.prompt_len + args.max_tokens + 16,
        max_num_seqs=max(256, args.num_prompts),
        enforce_eager=args.enforce_eager,
    )


def run_vllm_raw(prompts: list[list[int]], max_tokens: int, args: argparse.Namespace, model_dir: Path) -> dict:
    """vLLM's own offline LLM on the same prompts: one generate() call over all of them."""
    from vllm import LLM
    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = vllm_config(args).engine_args(model_path=str(model_dir), seed=0)
    kwargs.pop("worker_extension_cls", None)  # ferryman's weight-loading hooks: not used here
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    started = time.perf_counter() - t0

    def sp(n: int) -> VSamplingParams:
        return VSamplingParams(max_tokens=n, temperature=1.0, logprobs=0, detokenize=False, skip_special_tokens=False)

    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:8]], sp(8), use_tqdm=False)
    t1 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp(max_tokens), use_tqdm=False)
    wall = time.perf_counter() - t1
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {
        "engine": "vllm-raw" + sched_suffix(args),
        "start_s": round(started, 1),
        "wall_s": round(wall, 3),
        "generated_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "finished_by_length": sum(o.outputs[0].finish_reason == "length" for o in outs),
        "steps": None,
    }
    del llm
    return res


def sched_suffix(args: argparse.Namespace) -> str:
    """Row-name suffix of a vllm row run with --vllm-async-scheduling on / off."""
    return {"on": "+async", "off": "-sync"}.get(args.vllm_async_scheduling, "")


def free_gpu() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


async def main_async(args: argparse.Namespace) -> list[dict]:
    import torch

    model_dir = build_model(Path(args.workdir) / "qwen2.5-1.5b-random")
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 150_000) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    print(
        f"model {model_dir} | GPU {torch.cuda.get_device_name()} | {args.num_prompts} prompts x {args.prompt_len} "
        f"tokens, {args.max_tokens} new tokens each, temperature 1",
        flush=True,
    )
    results = []
    for name in args.engines.split(","):
        if name in ("vllm", "vllm-stream"):
            from ferryman_engine_vllm import make_vllm_engine

            cfg = vllm_config(args, stream=name == "vllm-stream")
            engine = make_vllm_engine(cfg, model_path=str(model_dir), replica="bench-vllm", seed=0)
        elif name == "vllm-raw":
            res = run_vllm_raw(prompts, args.max_tokens, args, model_dir)
            free_gpu()
            print(json.dumps(res), flush=True)
            results.append(res)
            continue
        elif name == "sglang":
            from ferryman_engine_sglang import make_sglang_engine

            engine = make_sglang_engine(sglang_config(args), model_path=str(model_dir), replica="bench-sglang", seed=0)
        elif name in ("sglang-raw", "sglang-raw-each"):
            res = await run_sglang_raw(prompts, args.max_tokens, args, model_dir, each=name == "sglang-raw-each")
            free_gpu()
            print(json.dumps(res), flush=True)
            results.append(res)
            continue
        elif name == "hf":
            from ferryman_engine_hf.engine import HFEngineConfig, make_hf_engine

            cfg = HFEngineConfig(device="cuda", dtype="bfloat16", max_batch_size=args.num_prompts, prefix_cache=False)
            engine = make_hf_engine(cfg, model_path=str(model_dir), replica="bench-hf", seed=0)
        else:
            raise SystemExit(f"unknown engine {name!r} (vllm, vllm-stream, vllm-raw, sglang, sglang-raw, sglang-raw-each, hf)")
        label = name
        if name.startswith("vllm"):
            label += sched_suffix(args) + ("@process" if args.vllm_core == "process" else "")
        res = await run_engine(label, engine, prompts, args.max_tokens)
        del engine
        free_gpu()
        print(json.dumps(res), flush=True)
        results.append(res)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="vllm,hf")
    ap.add_argument("--vllm-core", default="thread", choices=["thread", "process"])
    ap.add_argument("--vllm-async-scheduling", default="default", choices=["default", "on", "off"],
                    help="vLLM's async scheduling in every vllm row (default: each row's own: vLLM's LLM turns it on, "
                         "the thread core off)")
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile / CUDA graphs")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default="/tmp/ferryman-bench-engine")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="only print the table of these --out files' rows")
    args = ap.parse_args()
    if args.table:
        results = [r for f in args.table for r in json.loads(Path(f).read_text())["results"]]
        args.out = None
    else:
        results = asyncio.run(main_async(args))
    by = {r["engine"]: r for r in results}
    print("\n| engine | start (s) | batch wall (s) | generated tokens | tokens/s | engine steps | s inside step() |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['engine']} | {r['start_s']} | {r['wall_s']} | {r['generated_tokens']} | {r['tokens_per_s']} | "
              f"{r.get('steps') or ''} | {r.get('step_seconds') or ''} |")
    if "vllm" in by and "hf" in by:
        print(f"\nvllm / hf tokens/s: {by['vllm']['tokens_per_s'] / by['hf']['tokens_per_s']:.1f}x")
    for a, b in (("vllm", "vllm-raw"), ("vllm-stream", "vllm-raw"), ("vllm", "vllm-stream"), ("vllm", "vllm-raw-sync"),
                 ("vllm+async", "vllm-raw"), ("vllm+async", "vllm"), ("vllm-raw", "vllm-raw-sync"),
                 ("vllm@process", "vllm-raw"), ("vllm-stream@process", "vllm-raw")):
        if a in by and b in by:
            print(f"{a} / {b} tokens/s: {by[a]['tokens_per_s'] / by[b]['tokens_per_s']:.3f}x")
    if "sglang" in by and "sglang-raw" in by:
        print(f"sglang / sglang-raw tokens/s: {by['sglang']['tokens_per_s'] / by['sglang-raw']['tokens_per_s']:.3f}x")
    if "sglang" in by and "sglang-raw-each" in by:
        print(f"sglang / sglang-raw-each tokens/s: {by['sglang']['tokens_per_s'] / by['sglang-raw-each']['tokens_per_s']:.3f}x")
    if "sglang-raw-each" in by and "sglang-raw" in by:
        print(f"sglang-raw-each / sglang-raw tokens/s: {by['sglang-raw-each']['tokens_per_s'] / by['sglang-raw']['tokens_per_s']:.3f}x")
    if "sglang" in by and "hf" in by:
        print(f"sglang / hf tokens/s: {by['sglang']['tokens_per_s'] / by['hf']['tokens_per_s']:.1f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
