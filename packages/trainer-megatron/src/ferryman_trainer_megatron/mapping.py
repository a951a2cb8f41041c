"""Hugging Face model config → Megatron-core ``TransformerConfig`` / ``GPTModel`` keyword
arguments, as plain dicts (nothing here imports Megatron, so the mapping is tested on CPU).

Supported families (``config.model_type``): ``qwen2`` (Qwen2 / Qwen2.5: QKV bias),
``qwen3`` (QK RMSNorm, explicit ``head_dim``, no QKV bias) and ``qwen3_moe`` (Qwen3 attention,
every layer a top-k softmax-routed MoE without shared experts). Anything else, or a feature the
mapping would silently get wrong (sliding-window attention, rope scaling, dense layers inside a
MoE model), is refused with a message naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelShape", "model_shape", "transformer_config_kwargs", "gpt_model_kwargs", "padded_vocab_size", "SUPPORTED"]

SUPPORTED = ("qwen2", "qwen3", "qwen3_moe")


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


@dataclass(frozen=True)
class ModelShape:
    """What the converters and the model builder need to know about an HF checkpoint."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    qkv_bias: bool
    qk_norm: bool
    tied_embeddings: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_experts: int | None = None
    moe_top_k: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_norm_topk_prob: bool = True

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _rope_theta(cfg: Any) -> float:
    # transformers 5 keeps it in rope_parameters; 4.x as a top-level rope_theta
    params = _get(cfg, "rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in (None, "default"):
            raise ValueError(f"rope scaling type {rope_type!r} is not supported by the megatron backend")
        return float(params["rope_theta"])
    scaling = _get(cfg, "rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
        if kind not in (None, "default"):
            raise ValueError(f"rope_scaling {scaling!r} is not supported by the megatron backend")
    theta = _get(cfg, "rope_theta")
    if theta is None:
        raise ValueError("the model config has no rope_theta")
    return float(theta)


def model_shape(cfg: Any) -> ModelShape:
    """Read an HF config (a ``PretrainedConfig`` or its ``to_dict()``) into a :class:`ModelShape`.

    Raises:
        ValueError: an unsupported family or feature, named.
    """
    family = _get(cfg, "model_type")
    if family not in SUPPORTED:
        raise ValueError(f"model_type {family!r} is not supported by the megatron backend (supported: {', '.join(SUPPORTED)})")
    if _get(cfg, "use_sliding_window", False):
        raise ValueError("sliding-window attention (use_sliding_window: true) is not supported by the megatron backend")
    act = _get(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (Qwen models use silu)")
    hidden = int(_get(cfg, "hidden_size"))
    heads = int(_get(cfg, "num_attention_heads"))
    kv = int(_get(cfg, "num_key_value_heads") or heads)
    if heads % kv:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    head_dim = _get(cfg, "head_dim")
    head_dim = int(head_dim) if head_dim else hidden // heads
    num_layers = int(_get(cfg, "num_hidden_layers"))
    moe: dict[str, Any] = {}
    if family == "qwen3_moe":
        if _get(cfg, "mlp_only_layers"):
            raise ValueError("qwen3_moe with dense layers (mlp_only_layers) is not supported")
        if int(_get(cfg, "decoder_sparse_step", 1) or 1) != 1:
            raise ValueError("qwen3_moe with decoder_sparse_step != 1 is not supported")
        if _get(cfg, "shared_expert_intermediate_size"):
            raise ValueError("MoE shared experts are not supported")
        moe = dict(
            num_experts=int(_get(cfg, "num_experts")),
            moe_top_k=int(_get(cfg, "num_experts_per_tok")),
            moe_ffn_hidden_size=int(_get(cfg, "moe_intermediate_size")),
            moe_norm_topk_prob=bool(_get(cfg, "norm_topk_prob", True)),
        )
    return ModelShape(
        family=family,
        vocab_size=int(_get(cfg, "vocab_size")),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        ffn_hidden_size=int(_get(cfg, "intermediate_size")),
        # Qwen2 has biases on q/k/v only; Qwen3 has none (attention_bias false)
        qkv_bias=(family == "qwen2") or bool(_get(cfg, "attention_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        tied_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", 32768)),
        **moe,
    )


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron's vocabulary padding: up to a multiple of ``divisible_by × tp``."""
    multiple = divisible_by * tensor_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def transformer_config_kwargs(shape: ModelShape, trainer: Any) -> dict[str, Any]:
    """Keyword arguments of ``megatron.core.transformer.TransformerConfig`` for ``shape`` and a
    :class:`~ferryman_trainer_megatron.config.MegatronTrainerConfig`.

    ``activation_func`` is given by name (``"silu"``) and ``params_dtype`` as a dtype name, so
    the dict needs neither Megatron nor torch; :func:`ferryman_trainer_megatron.trainer.build_transformer_config`
    resolves both. Dropout is 0 (Megatron's default of 0.1 would make log-probs random).

    Raises:
        ValueError: the parallel sizes do not fit the model (heads, groups, experts), named.
    """
    tp = int(trainer.tensor_parallel_size)
    pp = int(trainer.pipeline_parallel_size)
    if shape.num_heads % tp:
        raise ValueError(f"trainer.tensor_parallel_size {tp} must divide num_attention_heads {shape.num_heads}")
    if shape.num_kv_heads % tp:
        raise ValueError(f"trainer.tensor_parallel_size {tp} must divide num_key_value_heads {shape.num_kv_heads}")
    if shape.ffn_hidden_size % tp:
        raise ValueError(f"trainer.tensor_parallel_size {tp} must divide intermediate_size {shape.ffn_hidden_size}")
    if shape.num_layers % pp:
        raise ValueError(f"trainer.pipeline_parallel_size {pp} must divide num_hidden_layers {shape.num_layers}")
    bf16 = trainer.param_dtype == "bfloat16"
    te = trainer.transformer_impl == "transformer_engine"
    kw: dict[str, Any] = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func="silu",
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        # the local spec has no fused kernels to use; TE brings its own
        bias_activation_fusion=False,
        masked_softmax_fusion=te,
        apply_rope_fusion=te and bool(trainer.rope_fusion),
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=int(trainer.context_parallel_size),
        sequence_parallel=bool(trainer.sequence_parallel),
        expert_model_parallel_size=int(trainer.expert_parallel_size),
        expert_tensor_parallel_size=int(trainer.expert_tensor_parallel_size),
        bf16=bf16,
        params_dtype="bfloat16" if bf16 else "float32",
        pipeline_dtype="bfloat16" if bf16 else "float32",
        # every micro-batch has its own length: pipeline stages exchange shapes first
        variable_seq_lengths=pp > 1,
        # (Megatron refuses variable lengths with the default allgather dispatcher, even dense)
        moe_token_dispatcher_type="alltoall",
        # losses come pre-weighted; no division by micro-batch count or token count inside
        calculate_per_token_loss=True,
        use_cpu_initialization=False,
        perform_initialization=False,  # the weights are overwritten from the checkpoint
    )
    if trainer.recompute == "full":
        # "block": each of the first N layers of a stage is checkpointed on its own. ("uniform"
        # with N = the stage's layers, as this was, makes the whole stage one checkpoint, whose
        # backward holds every layer's activations at once: no saving; found as Megatron's
        # 1.5B / 8k peak of 55 GiB beside FSDP's 31 GiB on the H200.)
        kw.update(recompute_granularity="full", recompute_method="block",
                  recompute_num_layers=min(trainer.recompute_num_layers or shape.num_layers // pp, shape.num_layers // pp))
    elif trainer.recompute == "selective":
        kw.update(recompute_granularity="selective")
    if shape.is_moe:
        ep = int(trainer.expert_parallel_size)
        if shape.num_experts % ep:
            raise ValueError(f"trainer.expert_parallel_size {ep} must divide num_experts {shape.num_experts}")
        kw.update(
            num_moe_experts=shape.num_experts,
            moe_router_topk=shape.moe_top_k,
            moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
            moe_router_score_function="softmax",
            # softmax over the chosen top-k == softmax over all, top-k, renormalised (norm_topk_prob)
            moe_router_pre_softmax=not shape.moe_norm_topk_prob,
            moe_router_load_balancing_type="aux_loss" if trainer.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=float(trainer.moe_aux_loss_coeff),
            moe_grouped_gemm=te,
            moe_router_dtype="fp32",
            moe_enable_routing_replay=bool(trainer.router_replay),
        )
    elif trainer.expert_parallel_size != 1:
        raise ValueError("trainer.expert_parallel_size > 1 needs a MoE model (qwen3_moe)")
    elif trainer.router_replay:
        raise ValueError("trainer.router_replay needs a MoE model (qwen3_moe)")
    return kw


def gpt_model_kwargs(shape: ModelShape, trainer: Any, *, critic: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``GPTModel`` (besides config, layer spec and the pipeline flags).
    The critic never shares its embedding with an output layer (its head is a value head)."""
    return dict(
        vocab_size=padded_vocab_size(shape.vocab_size, trainer.make_vocab_size_divisible_by, trainer.tensor_parallel_size),
        max_sequence_length=shape.max_position_embeddings,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tied_embeddings and not critic,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(shape.rope_theta) if float(shape.rope_theta).is_integer() else shape.rope_theta,
    )


def optimizer_config_kwargs(trainer: Any, *, critic: bool, params_dtype: Any) -> dict[str, Any]:
    """Keyword arguments of Megatron's ``OptimizerConfig`` for the actor (or the critic): Adam with
    decoupled weight decay, the trainer's clipping, and with ``optimizer_offload_fraction > 0``
    Megatron's CPU offload (``HybridDeviceOptimizer``, which needs the precision-aware path of the
    distributed optimizer: the offloaded share's float32 main weights live with its host states)."""
    kw: dict[str, Any] = dict(
        optimizer="adam", lr=trainer.critic_lr if critic else trainer.lr, weight_decay=trainer.weight_decay,
        adam_beta1=trainer.betas[0], adam_beta2=trainer.betas[1], adam_eps=trainer.adam_eps, clip_grad=trainer.grad_clip,
        bf16=trainer.param_dtype == "bfloat16", params_dtype=params_dtype,
        use_distributed_optimizer=trainer.use_distributed_optimizer,
    )
    if trainer.optimizer_offload_fraction > 0:
        kw.update(optimizer_cpu_offload=True, optimizer_offload_fraction=trainer.optimizer_offload_fraction,
                  use_precision_aware_optimizer=True, decoupled_weight_decay=True,
                  overlap_cpu_optimizer_d2h_h2d=True)
    elif trainer.param_remainders:
        # TE's FusedAdam keeps the main weights (master_weights, float32) as 16-bit remainders
        # beside the bf16 parameters; moments stay float32
        kw.update(use_precision_aware_optimizer=True, store_param_remainders=True, decoupled_weight_decay=True)
    return kw
