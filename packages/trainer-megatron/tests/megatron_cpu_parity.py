"""The megatron backend beside the fsdp backend at the same weights and batch, on two CPU gloo
ranks (torchrun; Megatron's CUDA-only calls patched in this process: megatron_cpu_patches.py):
Megatron at tensor parallel 2, FSDP sharded over the same two ranks, both float32, KL to the
reference and an entropy bonus on. Their log-probs agree, and one PPO step gives the same
loss, KL, entropy and gradient norm; so do the log-probs after the step. Prints
``RESULT <max log-prob diff> <loss diff> <grad-norm rel diff> <log-prob diff after>``.

Tolerance: the two compute in float32 with a different order of operations (fused QKV, TP
partial sums, Megatron's RMSNorm and rotary code): ~1e-6 on the log-probs of 2 layers of
width 32, ~1e-7 on the loss; after one Adam step of lr 1e-3 the weights differ wherever a
gradient is near 0 (Adam's first step is ~lr * sign(g)), which moves log-probs by ~1e-4."""

import math
import os
import shutil
import sys


def main() -> None:
    import megatron_cpu_patches

    megatron_cpu_patches.apply()
    import torch.distributed as dist

    from ferryman.config import AlgorithmConfig
    from ferryman.testing.trainer_contract import fill_train_batch, random_train_batch
    from ferryman.tiny import build_tiny_model
    from ferryman_trainer_fsdp.trainer import FSDPTrainerConfig, make_fsdp_trainer
    from ferryman_trainer_megatron.config import MegatronTrainerConfig
    from ferryman_trainer_megatron.megatron_runtime import MegatronRuntime
    from ferryman_trainer_megatron.trainer import MegatronTrainerBackend

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = megatron_cpu_patches.shared_tempdir("ferryman-parity-")
    path = os.path.join(root, "tiny")
    if rank == 0:
        build_tiny_model(path, vocab_size=160)
    dist.barrier()
    alg = AlgorithmConfig(kl_coef=0.05, kl_type="low_var_kl", entropy_coeff=0.01)
    common = dict(lr=1e-3, grad_clip=1.0, micro_batch_max_tokens=24)
    fsdp = make_fsdp_trainer(FSDPTrainerConfig(**common, param_dtype="float32"), model_path=path, algorithm=alg, seed=0)
    cfg = MegatronTrainerConfig(**common, param_dtype="float32", tensor_parallel_size=world, make_vocab_size_divisible_by=64,
                                use_distributed_optimizer=False)
    meg = MegatronTrainerBackend(cfg, model_path=path, algorithm=alg, seed=0,
                                 runtime=MegatronRuntime(cfg, model_path=path, seed=0, _device="cpu"))
    batch = random_train_batch(160, seed=0)
    lp_f, lp_m = fsdp.compute_log_probs(batch), meg.compute_log_probs(batch)
    lp_diff = (lp_f.double() - lp_m.double()).abs().max().item()
    assert lp_diff < 1e-4, ("log-probs", lp_diff)
    full = fill_train_batch(fsdp, batch)
    m_f, m_m = fsdp.update_actor(full), meg.update_actor(full)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
        assert math.isclose(m_f[key], m_m[key], rel_tol=1e-5, abs_tol=1e-6), (key, m_f[key], m_m[key])
    norm_rel = abs(m_f["actor/grad_norm"] - m_m["actor/grad_norm"]) / m_f["actor/grad_norm"]
    assert norm_rel < 1e-5, ("grad norm", m_f["actor/grad_norm"], m_m["actor/grad_norm"])
    after = (fsdp.compute_log_probs(batch).double() - meg.compute_log_probs(batch).double()).abs().max().item()
    assert after < 2e-3, ("log-probs after one step", after)
    moved = (fsdp.compute_log_probs(batch).double() - lp_f.double()).abs().max().item()
    assert moved > 10 * after, ("the step moved log-probs by less than the backends differ", moved, after)
    loss_diff = abs(m_f["actor/pg_loss"] - m_m["actor/pg_loss"])
    meg.close()
    fsdp.close()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        print(f"RESULT {lp_diff:.3e} {loss_diff:.3e} {norm_rel:.3e} {after:.3e} moved={moved:.3e}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
