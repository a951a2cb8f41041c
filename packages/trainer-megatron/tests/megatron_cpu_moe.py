"""Qwen3-MoE on the real MegatronRuntime on CPU gloo ranks (torchrun), expert parallel over all
ranks, with Megatron's CUDA-only calls patched in this process (megatron_cpu_patches.py):
log-probs equal HF's; the exported weights (experts gathered from their expert-parallel ranks)
are HF's; with ``router_replay`` the trainer's forward takes the experts given in
``batch.meta["routed_experts"]``: HF's own choice gives HF's log-probs, another choice moves
them; an update changes the weights. ``CHECK_CP=2``: the same with the sequence split over the
ranks by context parallelism as well (each rank's routers then see its own positions, and the
replayed experts are split the same way). Prints ``RESULT ok`` on success."""

import os
import shutil
import sys

import torch


def hf_routing(hf, batch, top_k):
    """[B, T, layers, top-k] experts HF's routers chose (softmax top-k of the router logits)."""
    with torch.no_grad():
        out = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                 output_router_logits=True)
    b, t = batch.input_ids.shape
    per_layer = [lg.view(b, t, -1).softmax(-1).topk(top_k, dim=-1).indices for lg in out.router_logits]
    return torch.stack(per_layer, dim=2), out.logits


def main() -> None:
    import megatron_cpu_patches

    megatron_cpu_patches.apply()
    import torch.distributed as dist
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from ferryman.config import AlgorithmConfig
    from ferryman.testing.trainer_contract import collect_weights, fill_train_batch, random_train_batch, reference_log_probs
    from ferryman_trainer_megatron.config import MegatronTrainerConfig
    from ferryman_trainer_megatron.megatron_runtime import MegatronRuntime
    from ferryman_trainer_megatron.trainer import MegatronTrainerBackend

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab, top_k = 160, 2
    path = megatron_cpu_patches.shared_tempdir("ferryman-moe-")
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=top_k,
        norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=False))
    with torch.no_grad():  # distinct experts and a router that prefers some of them
        for p in hf.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    hf.eval()
    if rank == 0:
        hf.save_pretrained(path)
    dist.barrier()
    alg = AlgorithmConfig(kl_coef=0.0)
    cp = int(os.environ.get("CHECK_CP", "1"))
    cfg = MegatronTrainerConfig(param_dtype="float32", expert_parallel_size=world, context_parallel_size=cp, make_vocab_size_divisible_by=64, lr=1e-3,
                                micro_batch_max_tokens=24, use_distributed_optimizer=False, router_replay=True)
    backend = MegatronTrainerBackend(cfg, model_path=path, algorithm=alg, seed=0,
                                     runtime=MegatronRuntime(cfg, model_path=path, seed=0, _device="cpu"))
    batch = random_train_batch(vocab, seed=0)
    routed, logits = hf_routing(hf, batch, top_k)
    ref = reference_log_probs(logits, batch)
    batch.meta["routed_experts"] = routed
    lp = backend.compute_log_probs(batch)
    d = (lp.double() - ref).abs().max().item()
    assert d < 1e-4, ("replayed HF routing", d)
    # another choice of experts (the two HF ranked last): the log-probs follow the replay
    other = routed.clone()
    other[...] = (routed + top_k) % 4  # a disjoint pair of the 4 experts
    lp_other = backend.compute_log_probs(type(batch)(**{**batch.__dict__, "meta": {**batch.meta, "routed_experts": other}}))
    moved = (lp_other.double() - ref).abs().max().item()
    assert moved > 1e-2, ("replay of other experts changed nothing", moved)
    w0 = collect_weights(backend)
    from safetensors.torch import load_file

    sd = load_file(os.path.join(path, "model.safetensors"))
    assert set(w0) == set(sd), sorted(set(w0) ^ set(sd))
    for k in sd:
        assert torch.equal(w0[k], sd[k]), k
    full = fill_train_batch(backend, batch)
    m = backend.update_actor(full)
    w1 = collect_weights(backend)
    assert any(not torch.equal(w0[k], w1[k]) for k in w0 if ".experts." in k), "the experts did not train"
    backend.close()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        print("RESULT ok", d, moved, m["actor/pg_loss"], m["actor/grad_norm"], flush=True)
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
