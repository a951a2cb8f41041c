"""Where trainer-megatron's log-probs part from trainer-fsdp's: per layer spec and per Transformer
Engine kernel choice, at a real model shape, on one GPU.

The GPU test (packages/trainer-megatron/tests/test_gpu.py) holds the mean |log-prob difference|
at the Qwen2.5-1.5B shape in bf16 to 1e-2. This script shows what each part contributes: FSDP's
log-probs once per dtype, then Megatron's with each variant, one after the other in one process:

- ``local``: the local layer spec (ferryman's SDPA attention);
- ``te``: TE's layer spec as trainer-megatron builds it by default (Megatron's RoPE in torch,
  TE's attention backend chosen by TE);
- ``te-rope-fused``: the same with TE's fused RoPE (``trainer.rope_fusion: true``);
- ``te-unfused-attn``: the default TE spec with TE's attention forced to its unfused backend
  (Megatron's ``attention_backend=unfused``, which sets ``NVTE_*_ATTN`` itself).

In float32 every variant must agree with FSDP to rounding (a wrong weight mapping would not);
in bf16 the differences are rounding carried through the layers, and the variants show which
kernel moves them. Two batches: the GPU test's short one, and one of long rows (hundreds of
tokens) whose mean is steadier. TE's chosen attention backend is printed with each row.

    python bench/megatron_parity.py --json $OUT/megatron_parity.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

VARIANTS = ("local", "te", "te-rope-fused", "te-unfused-attn")


def _te_backend() -> str:
    try:
        from transformer_engine.pytorch.attention.dot_product_attention import (
            _attention_backends as b,
        )
    except ImportError:
        return "-"
    if b.get("use_fused_attention"):
        return f"fused:{b.get('fused_attention_backend')}"
    if b.get("use_flash_attention"):
        return f"flash:{b.get('flash_attention_backend')}"
    return "unfused" if b.get("use_unfused_attention") else "none"


def _mean_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    m = mask.clone().double()
    m[:, 0] = 0  # the first token has no log-prob
    d = (a.double() - b.double()).abs() * m
    return float(d.sum() / m.sum()), float(d.max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2.5-1.5b", help="a shape of ferryman.tiny.build_tiny_model")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None, help="append one JSON line per row")
    args = ap.parse_args()

    from ferryman.config import AlgorithmConfig
    from ferryman.testing.trainer_contract import random_train_batch
    from ferryman.tiny import build_tiny_model
    from ferryman_trainer_fsdp.trainer import FSDPTrainerConfig, make_fsdp_trainer
    from ferryman_trainer_megatron import megatron_runtime
    from ferryman_trainer_megatron.config import MegatronTrainerConfig
    from ferryman_trainer_megatron.factory import make_megatron_trainer
    from transformers import AutoConfig

    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: unknown {v!r} (one of {', '.join(VARIANTS)})")
    alg = AlgorithmConfig(kl_coef=0.0, entropy_coeff=0.0)
    tmp = Path(tempfile.mkdtemp(prefix="ferryman-parity-"))
    path = str(build_tiny_model(tmp / "m", preset=args.preset))
    vocab = AutoConfig.from_pretrained(path).vocab_size
    batches = {
        "short": random_train_batch(vocab, seed=0),
        "long": random_train_batch(vocab, seed=1, num_groups=4, group_size=2, max_prompt=300, max_response=600),
    }
    tokens = {k: int(b.attention_mask.sum()) for k, b in batches.items()}
    print(f"model {args.preset} vocab {vocab}; batch tokens {tokens}", flush=True)
    original_kwargs = megatron_runtime.transformer_config_kwargs
    rows = []
    for dtype in [d for d in args.dtypes.split(",") if d]:
        common = dict(lr=1e-6, grad_clip=1.0, micro_batch_max_tokens=4096, param_dtype=dtype)
        fsdp = make_fsdp_trainer(FSDPTrainerConfig(**common, device="cuda", backend="nccl"), model_path=path, algorithm=alg, seed=0)
        try:
            ref = {k: fsdp.compute_log_probs(b).cpu() for k, b in batches.items()}
        finally:
            fsdp.close()
        for variant in variants:
            impl = "local" if variant == "local" else "transformer_engine"
            if impl == "transformer_engine":
                try:
                    import transformer_engine.pytorch  # noqa: F401
                except ImportError as e:
                    print(f"{dtype:9s} {variant:16s} skipped: {e}", flush=True)
                    continue
                from transformer_engine.pytorch.attention.dot_product_attention import (
                    _attention_backends,
                )

                _attention_backends["backend_selection_requires_update"] = True
                _attention_backends["attention_params"] = None
            # Megatron sets NVTE_{FLASH,FUSED,UNFUSED}_ATTN from its attention_backend when they are
            # unset and refuses other values: each variant starts with them unset
            for k in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
                os.environ.pop(k, None)
            if variant == "te-unfused-attn":
                from megatron.core.transformer.enums import AttnBackend

                megatron_runtime.transformer_config_kwargs = lambda shape, trainer: {
                    **original_kwargs(shape, trainer), "attention_backend": AttnBackend.unfused}
            extra = {"rope_fusion": True} if variant == "te-rope-fused" else {}
            t0 = time.perf_counter()
            try:
                meg = make_megatron_trainer(MegatronTrainerConfig(**common, transformer_impl=impl, **extra),
                                            model_path=path, algorithm=alg, seed=0)
                try:
                    for name, batch in batches.items():
                        lp = meg.compute_log_probs(batch).cpu()
                        mean, mx = _mean_abs(ref[name], lp, batch.attention_mask)
                        row = dict(dtype=dtype, variant=variant, batch=name, tokens=tokens[name], mean_abs=mean, max_abs=mx,
                                   attention=_te_backend() if impl == "transformer_engine" else "sdpa")
                        rows.append(row)
                        print(f"{dtype:9s} {variant:16s} {name:5s} mean |dlogp| {mean:.3e}  max {mx:.3e}  attention {row['attention']}", flush=True)
                finally:
                    meg.close()
            except Exception as e:  # a variant that cannot run (a kernel missing) is a row, not the end
                print(f"{dtype:9s} {variant:16s} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
                rows.append(dict(dtype=dtype, variant=variant, error=f"{type(e).__name__}: {str(e)[:300]}"))
            finally:
                megatron_runtime.transformer_config_kwargs = original_kwargs
            print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
