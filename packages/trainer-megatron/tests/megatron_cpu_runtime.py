"""The real MegatronRuntime + MegatronTrainerBackend on CPU gloo ranks (torchrun), with
Megatron's CUDA-only calls patched in this process only (megatron_cpu_patches.py). Runs the
TrainerContract-like steps that matter: log-probs equal HF's, an update changes the weights and
returns finite metrics, exported weights equal an HF state dict layout, a dist_checkpointing
save/load round trip restores the weights and the optimizer (the next step is the same), and a
critic on the same layout gives its value head over HF's hidden states and trains.
``CHECK_TP`` / ``CHECK_PP`` / ``CHECK_CP`` (default 1) set tensor, pipeline and context
parallelism (context parallel: the local spec's SDPA attention over all-gathered keys and
values, Megatron's rotary embedding on the load-balanced split); the other ranks
are data parallel (plain DDP: the distributed optimizer refuses CPU parameters). With
``CHECK_HANDOFF=DIR`` the run also leaves a checkpoint and the step it took after it in DIR;
with ``CHECK_RESUME_FROM=DIR`` a run (of another layout) loads that checkpoint at the end and
checks that it restores the weights and takes the same step. Prints ``RESULT ok`` (and
``RESULT resumed <layout>``) on success."""

import math
import os
import shutil
import sys

import torch


def check_critic(cfg, path, hf, batch) -> None:
    """A critic on the same layout: its values are its value head over the final hidden states,
    which at the checkpoint's weights are HF's (``values[t]`` is the head's output at ``t - 1``);
    an update changes them. Every last-stage rank checks its own head (tensor-parallel ranks
    must hold the same one)."""
    import torch.nn.functional as F

    from ferryman.config import AlgorithmConfig
    from ferryman.testing.trainer_contract import fill_train_batch
    from ferryman_trainer_megatron.megatron_runtime import MegatronRuntime
    from ferryman_trainer_megatron.trainer import MegatronTrainerBackend

    ccfg = cfg.model_copy(update={"use_critic": True})
    critic = MegatronTrainerBackend(ccfg, model_path=path, algorithm=AlgorithmConfig(kl_coef=0.0), seed=0,
                                    runtime=MegatronRuntime(ccfg, model_path=path, seed=0, _device="cpu"))
    values = critic.compute_values(batch)
    if critic.rt.last:
        head = critic.critic.module.output_layer
        with torch.no_grad():
            hidden = hf.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                              position_ids=batch.position_ids).last_hidden_state
            v = F.linear(hidden, head.weight.float(), head.bias.float())[..., 0]
        ref = F.pad(v[:, :-1], (1, 0)) * batch.attention_mask
        d = (values.double() - ref.double()).abs().max().item()
        assert d < 1e-4, ("critic values", d)
    m = critic.update_critic(fill_train_batch(critic, batch))
    assert all(math.isfinite(x) for x in m.values()) and "critic/vf_loss" in m, m
    assert not torch.equal(values, critic.compute_values(batch)), "update_critic changed nothing"
    critic.close()


def main() -> None:
    # here, not at import time: dist_checkpointing's first save starts a multiprocessing Manager
    # by spawn, whose child imports this file again as __mp_main__ (and needs none of this)
    import megatron_cpu_patches

    megatron_cpu_patches.apply()
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from ferryman.config import AlgorithmConfig
    from ferryman.testing.trainer_contract import collect_weights, fill_train_batch, hf_reference_log_probs, random_train_batch
    from ferryman.tiny import build_tiny_model
    from ferryman_trainer_megatron.config import MegatronTrainerConfig
    from ferryman_trainer_megatron.megatron_runtime import MegatronRuntime
    from ferryman_trainer_megatron.trainer import MegatronTrainerBackend

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tp = int(os.environ.get("CHECK_TP", "1"))
    pp = int(os.environ.get("CHECK_PP", "1"))
    cp = int(os.environ.get("CHECK_CP", "1"))
    handoff = os.environ.get("CHECK_HANDOFF")  # write: a checkpoint and the step taken after it
    resume_from = os.environ.get("CHECK_RESUME_FROM")  # read: one written by a run of another layout
    root = megatron_cpu_patches.shared_tempdir("ferryman-mrt-")
    if rank == 0:
        build_tiny_model(os.path.join(root, "tiny"), vocab_size=160)
    dist.barrier()
    path = os.path.join(root, "tiny")
    cfg = MegatronTrainerConfig(param_dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                context_parallel_size=cp, make_vocab_size_divisible_by=64, lr=1e-3,
                                micro_batch_max_tokens=24, use_distributed_optimizer=False)
    alg = AlgorithmConfig(kl_coef=0.05)
    backend = MegatronTrainerBackend(cfg, model_path=path, algorithm=alg, seed=0,
                                     runtime=MegatronRuntime(cfg, model_path=path, seed=0, _device="cpu"))
    batch = random_train_batch(160, seed=0)
    lp = backend.compute_log_probs(batch)

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = hf_reference_log_probs(hf, batch)
    d = (lp.double() - ref).abs()
    if d.max() > 1e-4:
        print("DIFF", d.max(dim=1).values.tolist(), batch.attention_mask.sum(-1).tolist(), flush=True)
    assert d.max().item() < 1e-4, d.max().item()
    w0 = collect_weights(backend)
    hf_sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert set(w0) == set(hf_sd), sorted(set(w0) ^ set(hf_sd))
    for k in hf_sd:
        assert torch.equal(w0[k], hf_sd[k]), k
    full = fill_train_batch(backend, batch)
    ckpt = os.path.join(root, "ckpt")
    backend.save_checkpoint(ckpt)
    m = backend.update_actor(full)
    assert all(math.isfinite(v) for v in m.values()) and "actor/pg_loss" in m and "actor/grad_norm" in m, m
    w1 = collect_weights(backend)
    assert any(not torch.equal(w0[k], w1[k]) for k in w0), "update changed nothing"
    backend.update_actor(full)  # an optimizer that stepped: its states go into the next checkpoint
    ckpt2 = os.path.join(root, "ckpt2")
    backend.save_checkpoint(ckpt2)
    w2 = collect_weights(backend)
    m3 = backend.update_actor(full)
    w3 = collect_weights(backend)
    if handoff and rank == 0:
        shutil.copytree(ckpt2, os.path.join(handoff, "ckpt2"))
        layout = f"tp{tp}-pp{pp}-cp{cp}-dp{dist.get_world_size() // (tp * pp * cp)}"
        torch.save({"full": full, "w2": w2, "w3": w3, "m3": m3, "layout": layout}, os.path.join(handoff, "state.pt"))
    backend.load_checkpoint(ckpt2)
    assert all(torch.equal(collect_weights(backend)[k], w2[k]) for k in w2), "load did not restore"
    m3b = backend.update_actor(full)
    w3b = collect_weights(backend)
    for k in w3:
        torch.testing.assert_close(w3b[k], w3[k], atol=1e-6, rtol=1e-5)
    # the step after the restore is the same step: same loss and gradient norm
    assert math.isclose(m3b["actor/pg_loss"], m3["actor/pg_loss"], rel_tol=1e-5, abs_tol=1e-6), (m3, m3b)
    assert math.isclose(m3b["actor/grad_norm"], m3["actor/grad_norm"], rel_tol=1e-5), (m3, m3b)
    backend.load_checkpoint(ckpt)
    assert all(torch.equal(collect_weights(backend)[k], w0[k]) for k in w0)
    if resume_from:
        # a checkpoint written by a run of another layout (other DP / TP / PP sizes): the
        # weights it saved come back, and the next step is the step that run took
        saved = torch.load(os.path.join(resume_from, "state.pt"), weights_only=False)
        backend.load_checkpoint(os.path.join(resume_from, "ckpt2"))
        got = collect_weights(backend)
        assert all(torch.equal(got[k], saved["w2"][k]) for k in saved["w2"]), "load on another layout did not restore"
        m4 = backend.update_actor(saved["full"])
        w4 = collect_weights(backend)
        for k in w4:
            torch.testing.assert_close(w4[k], saved["w3"][k], atol=1e-6, rtol=1e-5)
        assert math.isclose(m4["actor/pg_loss"], saved["m3"]["actor/pg_loss"], rel_tol=1e-5, abs_tol=1e-6), (m4, saved["m3"])
        assert math.isclose(m4["actor/grad_norm"], saved["m3"]["actor/grad_norm"], rel_tol=1e-5), (m4, saved["m3"])
        if rank == 0:
            print("RESULT resumed", saved["layout"], m4["actor/pg_loss"], m4["actor/grad_norm"], flush=True)
    backend.close()
    check_critic(cfg, path, hf, batch)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        print("RESULT ok", m["actor/pg_loss"], m["actor/grad_norm"], flush=True)
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
