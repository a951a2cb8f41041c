"""HF config -> TransformerConfig / GPTModel keyword mapping, as dicts (no Megatron import),
and the config's validation."""

from __future__ import annotations

import sys

import pytest
from pydantic import ValidationError
from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

from ferryman_trainer_megatron.config import MegatronTrainerConfig
from ferryman_trainer_megatron.mapping import (
    gpt_model_kwargs,
    model_shape,
    optimizer_config_kwargs,
    padded_vocab_size,
    transformer_config_kwargs,
)

QWEN25_15B = dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, intermediate_size=8960, max_position_embeddings=32768,
                  rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)


def test_qwen25_15b_mapping():
    hf = Qwen2Config(**QWEN25_15B)
    shape = model_shape(hf)
    cfg = MegatronTrainerConfig(tensor_parallel_size=2)
    kw = transformer_config_kwargs(shape, cfg)
    assert kw["num_layers"] == 28 and kw["hidden_size"] == 1536 and kw["ffn_hidden_size"] == 8960
    assert kw["num_attention_heads"] == 12 and kw["num_query_groups"] == 2 and kw["kv_channels"] == 128
    assert kw["add_qkv_bias"] is True and kw["add_bias_linear"] is False and kw["qk_layernorm"] is False
    assert kw["normalization"] == "RMSNorm" and kw["layernorm_epsilon"] == 1e-6 and kw["gated_linear_unit"] is True
    assert kw["hidden_dropout"] == 0.0 and kw["attention_dropout"] == 0.0
    assert kw["activation_func"] == "silu" and kw["params_dtype"] == "bfloat16" and kw["bf16"] is True
    assert kw["calculate_per_token_loss"] is True and kw["tensor_model_parallel_size"] == 2
    assert "num_moe_experts" not in kw
    g = gpt_model_kwargs(shape, cfg)
    assert g["share_embeddings_and_output_weights"] is True
    assert g["vocab_size"] == 152064 == padded_vocab_size(151936, 128, 2)
    assert g["rotary_base"] == 1000000 and g["position_embedding_type"] == "rope"
    assert gpt_model_kwargs(shape, cfg, critic=True)["share_embeddings_and_output_weights"] is False


def test_qwen3_has_qk_norm_head_dim_and_no_bias():
    hf = Qwen3Config(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, intermediate_size=96, tie_word_embeddings=False)
    kw = transformer_config_kwargs(model_shape(hf), MegatronTrainerConfig())
    assert kw["qk_layernorm"] is True and kw["add_qkv_bias"] is False and kw["kv_channels"] == 32


@pytest.mark.parametrize("norm_topk", [True, False])
def test_qwen3_moe_router(norm_topk):
    hf = Qwen3MoeConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                        norm_topk_prob=norm_topk)
    kw = transformer_config_kwargs(model_shape(hf), MegatronTrainerConfig(expert_parallel_size=4, router_replay=True))
    assert kw["num_moe_experts"] == 8 and kw["moe_router_topk"] == 2 and kw["moe_ffn_hidden_size"] == 32
    assert kw["moe_router_score_function"] == "softmax"
    # renormalised top-k == softmax over the chosen logits (pre_softmax False)
    assert kw["moe_router_pre_softmax"] is (not norm_topk)
    assert kw["moe_router_load_balancing_type"] == "none" and kw["moe_enable_routing_replay"] is True
    assert kw["expert_model_parallel_size"] == 4
    with pytest.raises(ValueError, match="expert_parallel_size 3"):
        transformer_config_kwargs(model_shape(hf), MegatronTrainerConfig(expert_parallel_size=3))


def test_misfits_are_named():
    shape = model_shape(Qwen2Config(**QWEN25_15B))
    with pytest.raises(ValueError, match="num_key_value_heads 2"):
        transformer_config_kwargs(shape, MegatronTrainerConfig(tensor_parallel_size=4))
    with pytest.raises(ValueError, match="pipeline_parallel_size 3"):
        transformer_config_kwargs(shape, MegatronTrainerConfig(pipeline_parallel_size=3))
    with pytest.raises(ValueError, match="needs a MoE"):
        transformer_config_kwargs(shape, MegatronTrainerConfig(router_replay=True))
    with pytest.raises(ValueError, match="not supported"):
        model_shape({**Qwen2Config(**QWEN25_15B).to_dict(), "model_type": "llama"})
    with pytest.raises(ValueError, match="sliding-window"):
        model_shape(Qwen2Config(**QWEN25_15B, use_sliding_window=True))


def test_config_validates_without_megatron():
    cfg = MegatronTrainerConfig(tensor_parallel_size=2, sequence_parallel=True, transformer_impl="transformer_engine",
                                recompute="full", recompute_num_layers=4)
    assert cfg.model_parallel_size == 2
    assert MegatronTrainerConfig(num_workers=4, tensor_parallel_size=2).num_workers == 4  # 2 replicas of TP 2
    # context parallelism with the local spec's SDPA attention, or with Transformer Engine's
    cp = MegatronTrainerConfig(context_parallel_size=2, tensor_parallel_size=2, num_workers=8)
    assert cp.model_parallel_size == 4
    assert MegatronTrainerConfig(context_parallel_size=2, transformer_impl="transformer_engine", local_attention="dot_product")
    for bad, field in [({"sequence_parallel": True}, "sequence_parallel"),
                       ({"sequence_parallel": True, "tensor_parallel_size": 2}, "sequence_parallel"),  # local spec
                       ({"context_parallel_size": 2, "local_attention": "dot_product"}, "context_parallel_size"),
                       ({"num_workers": 6, "context_parallel_size": 4}, "num_workers"),
                       ({"recompute_num_layers": 2}, "recompute_num_layers"), ({"betas": (0.9, 1.0)}, "beta"),
                       ({"device": "cpu"}, "device"), ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
                       ({"num_workers": 3, "tensor_parallel_size": 2}, "num_workers"), ({"num_gpus_per_worker": 0}, "num_gpus_per_worker"),
                       ({"local_attention": "flash"}, "local_attention"),
                       ({"optimizer_offload_fraction": 1.5}, "optimizer_offload_fraction"),
                       ({"optimizer_offload_fraction": 0.5, "use_distributed_optimizer": False}, "optimizer_offload_fraction")]:
        with pytest.raises(ValidationError, match=field):
            MegatronTrainerConfig(**bad)


def test_full_recompute_checkpoints_each_layer_of_a_stage():
    shape = model_shape(Qwen2Config(**QWEN25_15B))  # 28 layers
    every = transformer_config_kwargs(shape, MegatronTrainerConfig(recompute="full", pipeline_parallel_size=2))
    assert (every["recompute_granularity"], every["recompute_method"], every["recompute_num_layers"]) == ("full", "block", 14)
    some = transformer_config_kwargs(shape, MegatronTrainerConfig(recompute="full", recompute_num_layers=8))
    assert (some["recompute_method"], some["recompute_num_layers"]) == ("block", 8)
    assert "recompute_method" not in transformer_config_kwargs(shape, MegatronTrainerConfig(recompute="selective"))


def test_optimizer_config_and_cpu_offload():
    import torch

    plain = optimizer_config_kwargs(MegatronTrainerConfig(lr=2e-6, critic_lr=3e-6, betas=(0.8, 0.99)), critic=False,
                                    params_dtype=torch.bfloat16)
    assert plain["lr"] == 2e-6 and (plain["adam_beta1"], plain["adam_beta2"]) == (0.8, 0.99) and plain["bf16"]
    assert "optimizer_cpu_offload" not in plain
    critic = optimizer_config_kwargs(MegatronTrainerConfig(critic_lr=3e-6), critic=True, params_dtype=torch.bfloat16)
    assert critic["lr"] == 3e-6
    off = optimizer_config_kwargs(MegatronTrainerConfig(optimizer_offload_fraction=0.25), critic=False,
                                  params_dtype=torch.bfloat16)
    assert off["optimizer_cpu_offload"] and off["optimizer_offload_fraction"] == 0.25
    assert off["use_precision_aware_optimizer"] and off["use_distributed_optimizer"]
    try:  # with megatron-core installed (the trainer_megatron nox session): its own checks accept both
        from megatron.core.optimizer import OptimizerConfig
    except ImportError:
        return
    assert OptimizerConfig(**plain).optimizer_cpu_offload is False
    cfg = OptimizerConfig(**off)
    assert cfg.optimizer_cpu_offload and cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8


def test_hooks_import_nothing_heavy():
    import subprocess

    code = ("import sys, ferryman_trainer_megatron.hooks as h; "
            "bad = [m for m in ('torch', 'megatron', 'transformers') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_registered_through_the_plugin_host_and_a_run_config_parses():
    from ferryman.plugins import PluginHost

    host = PluginHost()
    spec = host.get("trainer", "megatron")
    assert spec.config_cls is MegatronTrainerConfig
    assert host.owner("trainer", "megatron").distribution == "ferryman-trainer-megatron"


def test_te_rope_fusion_is_off_unless_asked_and_needs_te():
    shape = model_shape(Qwen2Config(**QWEN25_15B))
    te = MegatronTrainerConfig(transformer_impl="transformer_engine")
    assert transformer_config_kwargs(shape, te)["apply_rope_fusion"] is False
    assert transformer_config_kwargs(shape, te)["masked_softmax_fusion"] is True
    fused = MegatronTrainerConfig(transformer_impl="transformer_engine", rope_fusion=True)
    assert transformer_config_kwargs(shape, fused)["apply_rope_fusion"] is True
    assert transformer_config_kwargs(shape, MegatronTrainerConfig())["apply_rope_fusion"] is False
    with pytest.raises(ValidationError, match="rope_fusion"):
        MegatronTrainerConfig(rope_fusion=True)


def test_param_remainders_default_to_te_bf16_without_offload_and_name_what_they_lack():
    import torch

    te = MegatronTrainerConfig(transformer_impl="transformer_engine")
    assert te.param_remainders
    kw = optimizer_config_kwargs(te, critic=False, params_dtype=torch.bfloat16)
    assert kw["use_precision_aware_optimizer"] and kw["store_param_remainders"] and kw["use_distributed_optimizer"]
    assert "optimizer_cpu_offload" not in kw
    # off: the local spec, float32 parameters, no distributed optimizer, offload (which is precision-aware on its own)
    for off in [MegatronTrainerConfig(), MegatronTrainerConfig(transformer_impl="transformer_engine", param_dtype="float32"),
                MegatronTrainerConfig(transformer_impl="transformer_engine", use_distributed_optimizer=False),
                MegatronTrainerConfig(transformer_impl="transformer_engine", optimizer_param_remainders=False)]:
        assert not off.param_remainders
        assert "use_precision_aware_optimizer" not in optimizer_config_kwargs(off, critic=False, params_dtype=torch.bfloat16)
    offloaded = MegatronTrainerConfig(transformer_impl="transformer_engine", optimizer_offload_fraction=0.3)
    assert not offloaded.param_remainders
    assert "store_param_remainders" not in optimizer_config_kwargs(offloaded, critic=False, params_dtype=torch.bfloat16)
    with pytest.raises(ValidationError, match="optimizer_param_remainders.*transformer_impl: transformer_engine"):
        MegatronTrainerConfig(optimizer_param_remainders=True)
    with pytest.raises(ValidationError, match="param_dtype: bfloat16.*use_distributed_optimizer"):
        MegatronTrainerConfig(transformer_impl="transformer_engine", optimizer_param_remainders=True,
                              param_dtype="float32", use_distributed_optimizer=False)
    try:  # megatron-core and TE both installed: Megatron's own checks accept it
        from megatron.core.optimizer import OptimizerConfig
        from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: F401
    except ImportError:
        return
    assert OptimizerConfig(**kw).use_precision_aware_optimizer_no_fp8_or_ds_fp8
