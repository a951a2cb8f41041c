"""Core attention for Megatron's local layer spec through ``torch.nn.functional.scaled_dot_product_attention``.

Megatron-core's local spec computes attention with ``DotProductAttention``: it materialises the
scores and probabilities as ``[batch, heads, seq, seq]`` tensors (fp32 softmax inside), so at 8k
tokens one layer of a 1.5B model holds 3 GiB of probabilities and the backward of 28 layers ran
an H200 out of memory (bench/results/gpu_megatron.md). Without Transformer Engine the flash and
memory-efficient kernels are still there in PyTorch: :class:`SDPACoreAttention` is a drop-in
``core_attention`` submodule (same constructor keywords, same ``[seq, batch, heads, dim]`` in
and ``[seq, batch, heads * dim]`` out) that calls SDPA with ``is_causal=True``, which needs no
mask tensor at all. The trainer's rows are right-padded and causal, so real tokens never attend
to padding and the result equals the masked softmax.

With context parallelism (``context_parallel_size > 1``) each rank holds two chunks of every
row (Megatron's load-balanced split); it then all-gathers keys and values over the
context-parallel group and attends with its own queries (:func:`~ferryman_trainer_megatron.context_parallel.context_parallel_attention`).

What it does not do (it raises at construction, naming the setting):
sliding-window attention, softmax offsets (``softmax_type`` other than ``vanilla``), query-key
layer scaling, packed sequences and attention bias (at call time).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ferryman_trainer_megatron.context_parallel import ContextSplit, context_parallel_attention


class SDPACoreAttention(MegatronModule):
    """``core_attention`` of the local spec on PyTorch SDPA (causal, GQA without repeating K/V)."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        if getattr(config, "window_size", None) is not None:
            raise ValueError("sliding-window attention is not supported by the sdpa core attention")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"softmax_type {config.softmax_type!r} is not supported by the sdpa core attention")
        if config.apply_query_key_layer_scaling:
            raise ValueError("apply_query_key_layer_scaling is not supported by the sdpa core attention")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"the sdpa core attention is causal only, got {attn_mask_type}")
        if pg_collection is not None and hasattr(pg_collection, "tp"):
            tp = pg_collection.tp.size()
        else:
            from megatron.core import parallel_state

            tp = parallel_state.get_tensor_model_parallel_world_size()
        self.cp_group = None
        if config.context_parallel_size > 1:
            if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
                self.cp_group = pg_collection.cp
            else:
                from megatron.core import parallel_state

                self.cp_group = parallel_state.get_context_parallel_group()
        if config.num_attention_heads % tp or config.num_query_groups % tp:
            raise ValueError(f"attention heads {config.num_attention_heads} / query groups "
                             f"{config.num_query_groups} do not divide over tensor parallel {tp}")
        self.layer_number = max(1, layer_number)
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """``query`` ``[sq, b, heads, d]``, ``key``/``value`` ``[sk, b, groups, d]``; the causal
        mask is SDPA's own (``attention_mask`` is not read)."""
        if packed_seq_params is not None:
            raise ValueError("packed sequences need transformer_impl: transformer_engine")
        if attention_bias is not None:
            raise ValueError("attention bias is not supported by the sdpa core attention")
        sq, b = query.shape[0], query.shape[1]
        dropout = self.dropout if self.training else 0.0
        if self.cp_group is not None:
            cp = dist.get_world_size(self.cp_group)
            split = ContextSplit(cp, dist.get_rank(self.cp_group), self.cp_group, sq * cp)
            out = context_parallel_attention(query, key, value, split, scale=self.scale, dropout_p=dropout,
                                             enable_gqa=self.groups != self.heads)
        else:
            # [s, b, n, d] -> [b, n, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, dropout_p=dropout,
                                                 enable_gqa=self.groups != self.heads)
        # [b, n, s, d] -> [s, b, n * d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)
