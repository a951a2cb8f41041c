"""Context parallelism against data parallelism on the same two ranks (torchrun, 2 processes):
the real MegatronRuntime at ``context_parallel_size: 2``, then at data parallel 2, each from the
same checkpoint and batch (rows of up to ~170 tokens, so each rank's chunks are long). At CP 2
the log-probs equal HF's; one PPO step gives the loss, gradient norm and weight update of the
DP 2 step. Run by test_gpu.py on two GPUs (``CP_IMPL``: ``local`` — the SDPA core attention over
all-gathered keys and values — or ``transformer_engine`` — TE's own context-parallel attention);
``CP_DEVICE=cpu`` runs the local spec on gloo ranks with Megatron's CUDA-only calls patched
(megatron_cpu_patches.py). Prints ``RESULT <impl> <lp diff> <loss rel> <norm rel> <update rel>``.

Tolerances (float32 on both sides; ``CP_TOL_SCALE`` widens them): the two layouts add the same
terms in another order (attention over two key blocks, gradients summed over two ranks), a few
float32 ulps of values of order 1, so 1e-5 relative for the step and 1e-4 for log-probs against
HF (whose kernels differ) as in the other CPU checks. TE computes float32 GEMMs in TF32 unless
told otherwise (10 bits of mantissa): its checks are scaled by 100."""

import math
import os
import sys

import torch


def main() -> None:
    device = os.environ.get("CP_DEVICE", "cuda")
    impl = os.environ.get("CP_IMPL", "local")
    if device == "cpu":
        import megatron_cpu_patches

        megatron_cpu_patches.apply()
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    import megatron_cpu_patches  # shared_tempdir
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from ferryman.config import AlgorithmConfig
    from ferryman.testing.trainer_contract import collect_weights, fill_train_batch, hf_reference_log_probs, random_train_batch
    from ferryman.tiny import build_tiny_model
    from ferryman_trainer_megatron.config import MegatronTrainerConfig
    from ferryman_trainer_megatron.megatron_runtime import MegatronRuntime
    from ferryman_trainer_megatron.trainer import MegatronTrainerBackend

    dist.init_process_group("gloo" if device == "cpu" else "nccl")
    rank = dist.get_rank()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    scale = float(os.environ.get("CP_TOL_SCALE", "100" if impl == "transformer_engine" else "1"))
    root = megatron_cpu_patches.shared_tempdir("ferryman-cp-")
    path = os.path.join(root, "tiny")
    if rank == 0:
        build_tiny_model(path, vocab_size=160)
    dist.barrier()
    batch = random_train_batch(160, seed=0, max_prompt=40, max_response=120)
    alg = AlgorithmConfig(kl_coef=0.0)

    def backend(cp: int) -> MegatronTrainerBackend:
        cfg = MegatronTrainerConfig(param_dtype="float32", context_parallel_size=cp, transformer_impl=impl, lr=1e-3,
                                    make_vocab_size_divisible_by=64, micro_batch_max_tokens=512,
                                    use_distributed_optimizer=device == "cuda")
        rt = MegatronRuntime(cfg, model_path=path, seed=0, _device=device)
        return MegatronTrainerBackend(cfg, model_path=path, algorithm=alg, seed=0, runtime=rt)

    results = {}
    for cp in (2, 1):
        b = backend(cp)
        try:
            w0 = collect_weights(b)
            lp = b.compute_log_probs(batch)
            full = fill_train_batch(b, batch) if cp == 2 else results[2]["full"]
            m = b.update_actor(full)
            results[cp] = {"lp": lp, "full": full, "m": m, "w0": w0, "w": collect_weights(b)}
        finally:
            b.close()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lp_diff = (results[2]["lp"].double() - hf_reference_log_probs(hf, batch)).abs().max().item()
    m2, m1 = results[2]["m"], results[1]["m"]
    loss_rel = abs(m2["actor/pg_loss"] - m1["actor/pg_loss"]) / max(abs(m1["actor/pg_loss"]), 1e-6)
    norm_rel = abs(m2["actor/grad_norm"] - m1["actor/grad_norm"]) / m1["actor/grad_norm"]
    # the two steps' updates, |Δw_cp2 - Δw_dp2| / |Δw_dp2| over all weights
    w0, w2, w1 = results[2]["w0"], results[2]["w"], results[1]["w"]
    num = sum(float((w2[k] - w1[k]).double().pow(2).sum()) for k in w1)
    den = sum(float((w1[k] - w0[k]).double().pow(2).sum()) for k in w1)
    w_diff = math.sqrt(num / den)
    if rank == 0:
        print(f"RESULT {impl} {lp_diff:.3e} {loss_rel:.3e} {norm_rel:.3e} {w_diff:.3e}", flush=True)
    assert all(math.isfinite(v) for v in m2.values()), m2
    assert lp_diff < 1e-4 * scale, ("log-probs at CP 2 against HF", lp_diff)
    assert loss_rel < 1e-5 * scale and norm_rel < 1e-5 * scale, ("CP 2 step against DP 2", m2, m1)
    # A first Adam step moves each weight by about lr in the sign of its gradient, so a wrong
    # gradient moves many by that much (a relative difference of order 1). A gradient that is
    # rounding noise on both sides (the key bias: softmax does not see a shift shared by all
    # keys) also flips: a handful of such elements give ~1e-5 here.
    assert w_diff < 1e-3 * scale, ("update of the weights, CP 2 against DP 2", w_diff)
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
