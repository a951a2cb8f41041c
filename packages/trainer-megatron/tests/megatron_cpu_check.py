"""Real Megatron-core on CPU ranks (gloo), for the converter and mapping tests: run by
test_megatron_cpu.py under torchrun when megatron-core is installed.

Megatron has no CPU path; three CUDA-only calls are patched *in this process only* so that a
forward runs on the CPU: ``torch.cuda.current_device`` (the rotary embedding moves its
frequencies there), the model-parallel RNG tracker's ``fork`` (a no-op: dropout is 0) and an
explicit causal mask (the default one is allocated on CUDA). MoE layers use the allgather
dispatcher here (alltoall creates a CUDA stream); the trainer uses alltoall.

For every family it builds the HF model with random weights, converts them with
ferryman_trainer_megatron.convert into this rank's tensor-parallel shard of a GPTModel, runs
both, and checks (1) the gathered Megatron logits against HF's, (2) the vocab-parallel
log-probs over Megatron's own logits shard against a full log-softmax of HF's logits, and
(3) the TP gather + re-split of ``iter_hf_weights``' math (tp_merge/megatron_to_hf) reproduces
the HF tensors exactly; (4) the same shard with the SDPA core attention (the trainer's default for
the local spec) gives HF's logits too. Prints one ``RESULT family max_logit_diff max_lp_diff
max_sdpa_logit_diff`` line per family.
"""

import contextlib
import os
import sys

import torch

torch.cuda.current_device = lambda: "cpu"
torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
from megatron.core import parallel_state as ps, tensor_parallel  # noqa: E402

ps.initialize_model_parallel(tensor_model_parallel_size=world, expert_tensor_parallel_size=1)
tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from transformers import (  # noqa: E402
    Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM,
)

import megatron_cpu_patches  # noqa: E402  (shared_tempdir only: this script patches its own three calls)
from ferryman_trainer_megatron.config import MegatronTrainerConfig  # noqa: E402
from ferryman_trainer_megatron.convert import hf_to_megatron, layout, megatron_to_hf, to_global_name, tp_merge, tp_split  # noqa: E402
from ferryman_trainer_megatron.mapping import gpt_model_kwargs, model_shape, padded_vocab_size, transformer_config_kwargs  # noqa: E402
from ferryman_trainer_megatron.megatron_runtime import build_transformer_config, with_sdpa_attention  # noqa: E402
from ferryman_trainer_megatron.vocab_parallel import vocab_parallel_log_probs_and_entropy, vocab_range  # noqa: E402

common = dict(vocab_size=151, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=48, max_position_embeddings=64)
torch.manual_seed(0)
models = {
    "qwen2-tied": Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True)),
    "qwen2": Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False)),
    "qwen3": Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16)),
    "qwen3_moe": Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, head_dim=8, moe_intermediate_size=16, num_experts=4,
                                                    num_experts_per_tok=2, norm_topk_prob=True)),
}
for family, hf in models.items():
    with torch.no_grad():  # random everything (biases and norms too), the same on every rank
        for p in hf.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    hf.eval()
    cfg = MegatronTrainerConfig(param_dtype="float32", make_vocab_size_divisible_by=64, tensor_parallel_size=world)
    shape = model_shape(hf.config)
    kw = transformer_config_kwargs(shape, cfg)
    kw["use_cpu_initialization"] = True
    if shape.is_moe:
        kw["moe_token_dispatcher_type"] = "allgather"
    spec = get_gpt_layer_local_spec(num_experts=shape.num_experts, moe_grouped_gemm=False, qk_layernorm=shape.qk_norm,
                                    normalization="RMSNorm")
    model = GPTModel(build_transformer_config(kw), spec, pre_process=True, post_process=True, **gpt_model_kwargs(shape, cfg))
    entries = {e.mg: e for e in layout(shape)}
    names = {n for n, _ in model.named_parameters()}
    assert names == set(entries), (family, sorted(names ^ set(entries)))
    padded = padded_vocab_size(shape.vocab_size, 64, world)
    # the checkpoint's own names (transformers 5 fuses MoE experts in memory, not on disk)
    from safetensors.torch import load_file

    ckpt = megatron_cpu_patches.shared_tempdir("ferryman-mcore-check-")
    if rank == 0:  # transformers writes on the main process only
        hf.save_pretrained(ckpt)
    dist.barrier()
    sd = load_file(os.path.join(ckpt, "model.safetensors"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            e = entries[to_global_name(n, 0, 0)]
            tp = 1 if e.expert is not None else world  # experts: expert TP 1
            p.copy_(tp_split(e, hf_to_megatron(e, [sd[x] for x in e.hf], shape, padded), tp, rank if tp > 1 else 0))
    model.eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape.vocab_size, (2, 12), generator=g)
    pos = torch.arange(12).expand(2, 12)
    mask = torch.ones(1, 1, 12, 12, dtype=torch.bool).triu(1)
    extra = {"padding_mask": torch.zeros(2, 12, dtype=torch.bool)} if shape.is_moe else {}
    with torch.no_grad():
        shard = model(ids, pos, mask, **extra)  # [b, s, V_pad / tp]
        ref = hf(input_ids=ids).logits
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard.contiguous())
    logit_diff = (torch.cat(parts, -1)[..., : shape.vocab_size] - ref).abs().max().item()
    # the trainer's default core attention (PyTorch SDPA, causal by itself: no mask) on the same
    # shard of the weights gives the same logits
    sdpa = GPTModel(build_transformer_config(kw), with_sdpa_attention(spec), pre_process=True, post_process=True,
                    **gpt_model_kwargs(shape, cfg))
    sdpa.load_state_dict(model.state_dict())
    sdpa.eval()
    with torch.no_grad():
        sdpa_shard = sdpa(ids, pos, None, **extra)
    sdpa_parts = [torch.empty_like(sdpa_shard) for _ in range(world)]
    dist.all_gather(sdpa_parts, sdpa_shard.contiguous())
    sdpa_diff = (torch.cat(sdpa_parts, -1)[..., : shape.vocab_size] - ref).abs().max().item()
    start, _ = vocab_range(padded, world, rank)
    lp, _ = vocab_parallel_log_probs_and_entropy(shard[:, :-1], ids[:, 1:], vocab_start=start, vocab_size=shape.vocab_size,
                                                 group=dist.group.WORLD if world > 1 else None, chunk_tokens=5)
    ref_lp = torch.log_softmax(ref[:, :-1].double(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    lp_diff = (lp.double() - ref_lp).abs().max().item()
    # export math: gather the TP shards of every parameter, merge, back to HF: exact
    with torch.no_grad():
        for n, p in model.named_parameters():
            e = entries[n]
            if e.expert is None and world > 1 and e.kind != "replicated":
                got = [torch.empty_like(p) for _ in range(world)]
                dist.all_gather(got, p.detach().contiguous())
                full = tp_merge(e, got)
            else:
                full = p.detach()
            for hf_name, t in megatron_to_hf(e, full, shape):
                assert torch.equal(t, sd[hf_name]), (family, hf_name)
    if rank == 0:
        print(f"RESULT {family} {logit_diff:.3e} {lp_diff:.3e} {sdpa_diff:.3e}", flush=True)
dist.destroy_process_group()
sys.exit(0)
