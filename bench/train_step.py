"""Actor update throughput and MFU of the ``fsdp`` and ``megatron`` trainer backends.

Runs the backend's ``update_actor`` (the real code path; fsdp: FSDP2, bf16 compute with fp32
master weights and reduction, activation checkpointing, token-budget micro-batches, gradient
accumulation, clipping, AdamW; megatron: Megatron-core GPTModel, its distributed optimizer,
full recomputation unless ``--no-checkpointing``) on a randomly initialised
Qwen2-architecture model of a chosen shape, and prints tokens/s and MFU. ``--trainer both``
runs fsdp, frees it, then megatron on the same model and batches in the same run, and prints
the megatron / fsdp ratios.

    # one GPU
    torchrun --nproc-per-node 1 bench/train_step.py --shape 1.5b --seq-len 8192
    # megatron beside fsdp, one GPU
    torchrun --nproc-per-node 1 bench/train_step.py --shape 7b --seq-len 8192 --trainer both
    # two GPUs (FSDP over both)
    torchrun --nproc-per-node 2 bench/train_step.py --shape 7b --seq-len 8192
    # megatron on two GPUs, long rows: data parallel 2, then context parallel 2, same run
    torchrun --nproc-per-node 2 bench/train_step.py --shape 1.5b --seq-len 32768 --trainer megatron --megatron-cp 1 2
    # CPU smoke run (gloo), tiny shape (fsdp only: Megatron needs CUDA)
    torchrun --nproc-per-node 2 bench/train_step.py --shape tiny --seq-len 256 --device cpu

MFU counts model FLOPs only (activation recomputation is not credited): per trained token
``6 * N + 12 * L * d * S`` where N is the parameter count without the input embedding, L the
layers, d the hidden size and S the sequence length (the PaLM formula, attention counted
without causal halving). Peak: 989 TFLOP/s dense bf16 per H200 (datasheet), overridable with
``--peak-tflops``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

SHAPES = {
    # Qwen2.5 shapes (hidden, layers, intermediate, heads, kv heads, vocab)
    "tiny": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064),
}


def _log(rank: int, *args: object) -> None:
    if rank == 0:
        print(*args, flush=True)


def build_random_model(shape: str, path: Path, device: str) -> None:
    """Save a random Qwen2 model of ``shape`` (bf16 safetensors) under ``path``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        **SHAPES[shape],
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        tie_word_embeddings=(shape != "7b"),
    )
    init_device = "cuda" if device.startswith("cuda") else "cpu"
    with torch.device(init_device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)


def model_flops_per_token(model_path: Path, seq_len: int) -> tuple[float, int]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    n_total = sum(p.numel() for p in model.parameters())
    n_embed = model.get_input_embeddings().weight.numel()
    # tied embeddings: the shared matrix is used by the LM head, which does count
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    n = n_total if tied else n_total - n_embed
    attn = 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len
    return 6.0 * n + attn, n_total


def make_batch(rows: int, seq_len: int, vocab: int, prompt_len: int, seed: int):
    from ferryman.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=g)
    attn = torch.ones(rows, seq_len, dtype=torch.long)
    pos = torch.arange(seq_len).expand(rows, seq_len).clone()
    loss_mask = torch.zeros(rows, seq_len, dtype=torch.float32)
    loss_mask[:, prompt_len:] = 1.0
    old = -torch.rand(rows, seq_len, generator=g) * 5 * loss_mask
    adv = torch.randn(rows, 1, generator=g).expand(rows, seq_len) * loss_mask
    return TrainBatch(
        input_ids=ids,
        attention_mask=attn,
        position_ids=pos,
        loss_mask=loss_mask,
        rollout_log_probs=old.clone(),
        token_versions=torch.zeros(rows, seq_len, dtype=torch.long),
        scores=torch.zeros(rows),
        group_index=torch.arange(rows),
        old_log_probs=old,
        advantages=adv.contiguous(),
        meta={"num_mini_batches": 1, "temperature": 1.0},
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--rows-per-rank", type=int, default=4, help="sequences per rank per optimizer step")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps (after one warm-up)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-checkpointing", action="store_true", help="turn activation checkpointing off")
    ap.add_argument("--checkpoint-layers", type=int, default=None,
                    help="recompute only the first N decoder layers (default: all; see FSDPTrainerConfig.checkpoint_layers)")
    ap.add_argument("--offload-optimizer", action="store_true")
    ap.add_argument("--megatron-offload-fraction", type=float, default=0.0,
                    help="megatron: share of the optimizer (main weights, Adam states) kept and stepped in host memory")
    ap.add_argument("--megatron-impl", choices=("local", "transformer_engine"), default="local",
                    help="megatron: trainer.transformer_impl (transformer_engine needs the megatron-te extra)")
    ap.add_argument("--megatron-cp", type=int, nargs="+", default=[1],
                    help="megatron: trainer.context_parallel_size; several values are measured one after the other in "
                         "this run (the world must be a multiple of each; the rest is data parallel)")
    ap.add_argument("--model-dir", default=None, help="reuse a model saved by an earlier run")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--json", default=None, help="append the result as one JSON line to this file")
    ap.add_argument("--trainer", choices=("fsdp", "megatron", "both"), default="fsdp",
                    help="which backend to measure; both: fsdp, then megatron, in this run")
    args = ap.parse_args()
    if args.trainer != "fsdp" and not args.device.startswith("cuda"):
        ap.error(f"--trainer {args.trainer} needs --device cuda (Megatron-core has no CPU path)")

    from ferryman.config import AlgorithmConfig
    from ferryman_trainer_fsdp.trainer import FSDPTrainerBackend, FSDPTrainerConfig

    cuda = args.device.startswith("cuda")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    model_dir = Path(args.model_dir) if args.model_dir else Path(tempfile.gettempdir()) / f"ferryman-bench-{args.shape}"
    if rank == 0 and not (model_dir / "config.json").exists():
        t0 = time.perf_counter()
        build_random_model(args.shape, model_dir, args.device)
        _log(rank, f"built random {args.shape} model in {time.perf_counter() - t0:.1f} s -> {model_dir}")
    dist.barrier()

    flops_per_token, n_params = model_flops_per_token(model_dir, args.seq_len)
    vocab = SHAPES[args.shape]["vocab_size"]
    rows = args.rows_per_rank * world
    prompt_len = args.seq_len // 8

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    def build(trainer: str, cp: int = 1):
        if trainer == "fsdp":
            cfg = FSDPTrainerConfig(
                lr=1e-6,
                device=args.device,
                backend="nccl" if cuda else "gloo",
                param_dtype="bfloat16" if cuda else "float32",
                reduce_dtype="float32",
                activation_checkpointing=not args.no_checkpointing,
                checkpoint_layers=None if args.no_checkpointing else args.checkpoint_layers,
                offload_optimizer=args.offload_optimizer,
                micro_batch_max_tokens=args.seq_len,
                grad_clip=1.0,
            )
            return FSDPTrainerBackend(cfg, model_path=str(model_dir), algorithm=AlgorithmConfig(), seed=0)
        from ferryman_trainer_megatron.factory import make_megatron_trainer

        return make_megatron_trainer(megatron_config(cp), model_path=str(model_dir), algorithm=AlgorithmConfig(), seed=0)

    def megatron_config(cp: int = 1):
        from ferryman_trainer_megatron.config import MegatronTrainerConfig

        return MegatronTrainerConfig(
            lr=1e-6,
            param_dtype="bfloat16",
            recompute="none" if args.no_checkpointing else "full",
            recompute_num_layers=None if args.no_checkpointing else args.checkpoint_layers,
            micro_batch_max_tokens=args.seq_len,
            grad_clip=1.0,
            use_distributed_optimizer=True,
            optimizer_offload_fraction=args.megatron_offload_fraction,
            transformer_impl=args.megatron_impl,
            context_parallel_size=cp,
        )

    def label(r: dict) -> str:
        if r["trainer"] == "fsdp" or len(args.megatron_cp) == 1:
            return r["trainer"]
        return f"megatron cp{r['context_parallel']}"

    def measure(trainer: str, cp: int = 1) -> dict:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        backend = build(trainer, cp)
        load_s = time.perf_counter() - t0
        name = label({"trainer": trainer, "context_parallel": cp})
        _log(rank, f"[{name}] loaded over {world} rank(s) in {load_s:.1f} s")
        times = []
        for step in range(args.steps + 1):
            batch = make_batch(rows, args.seq_len, vocab, prompt_len, seed=step)
            sync()
            t = time.perf_counter()
            metrics = backend.update_actor(batch)
            sync()
            dt = time.perf_counter() - t
            _log(rank, f"[{name}] step {step}{' (warm-up)' if step == 0 else ''}: {dt:.2f} s, "
                       f"grad_norm {metrics.get('actor/grad_norm', float('nan')):.3f}")
            if step > 0:
                times.append(dt)
        mean = sum(times) / len(times)
        tokens = rows * args.seq_len  # every position is computed forward and backward
        tok_s = tokens / mean
        mfu = tok_s * flops_per_token / (args.peak_tflops * 1e12 * world) if cuda else float("nan")
        peak_mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        backend.close()
        del backend
        if cuda:
            torch.cuda.empty_cache()
        return {
            "trainer": trainer,
            "shape": args.shape,
            "params": n_params,
            "world": world,
            "seq_len": args.seq_len,
            "rows_per_step": rows,
            "activation_checkpointing": not args.no_checkpointing,
            "checkpoint_layers": "none" if args.no_checkpointing else (
                "all" if args.checkpoint_layers is None else args.checkpoint_layers),
            "offload_optimizer": args.offload_optimizer if trainer == "fsdp" else args.megatron_offload_fraction,
            "transformer_impl": args.megatron_impl if trainer == "megatron" else None,
            "context_parallel": cp if trainer == "megatron" else None,
            # float32 main weights kept as 16-bit remainders of the bf16 ones (TE's FusedAdam)
            "optimizer_param_remainders": megatron_config(cp).param_remainders if trainer == "megatron" else None,
            "step_s": round(mean, 4),
            "tokens_per_s": round(tok_s, 1),
            "tokens_per_s_per_gpu": round(tok_s / world, 1),
            "mfu": round(mfu, 4),
            "peak_mem_gib_rank0": round(peak_mem, 2),
            "load_s": round(load_s, 1),
        }

    runs = [("fsdp", 1)] if args.trainer in ("fsdp", "both") else []
    if args.trainer in ("megatron", "both"):
        runs += [("megatron", cp) for cp in args.megatron_cp]
    results = [measure(t, cp) for t, cp in runs]
    for result in results:
        _log(rank, "RESULT " + json.dumps(result))
        if rank == 0 and args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")
    base = results[0]  # every other row against the first
    for r in results[1:]:
        _log(rank, f"RATIO {label(r)}/{label(base)} tokens/s {r['tokens_per_s'] / base['tokens_per_s']:.3f}, "
                   f"peak memory {r['peak_mem_gib_rank0'] / base['peak_mem_gib_rank0']:.3f}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
