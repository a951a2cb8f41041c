"""Hugging Face ↔ Megatron-core weight layout (plain torch; no Megatron import).

The unit is an :class:`Entry`: one Megatron parameter (by its *global* name: layer and expert
indices counted over the whole model, as with one pipeline stage and one expert rank) and the
HF tensor(s) it is made of. A model's entries, in the order of the HF checkpoint, come from
:func:`layout`. Per entry:

* :func:`hf_to_megatron` builds the full (unsharded) Megatron tensor from the HF tensors;
  :func:`megatron_to_hf` goes back (exactly: only copies, concatenations and slices).
* :func:`tp_split` cuts a full tensor into this tensor-parallel rank's shard and
  :func:`tp_merge` puts the shards of all ranks together again.

Layouts (Megatron-core 0.19, ``SelfAttention`` / ``MLP`` / ``SequentialMLP``):

* ``linear_qkv`` (``kind="qkv"``): rows grouped by key/value group ``g`` (``num_query_groups``
  of them): ``[q heads of g (heads/groups × head_dim rows), k_g (head_dim), v_g (head_dim)]``.
  Tensor parallelism gives each rank a contiguous run of groups, so a shard is a contiguous
  slice of rows (groups must divide by the TP size).
* ``linear_fc1`` (``kind="fc1"``): ``[gate; up]`` on one rank; with TP each rank holds
  ``[gate shard; up shard]`` (Megatron chunks the local output in two halves).
* column-parallel linears (``kind="column"``) split rows, row-parallel ones (``"row"``)
  columns; norms and the router are replicated.
* embedding / output layer (``kind="vocab"``): rows padded with zeros up to the padded
  vocabulary (:func:`ferryman_trainer_megatron.mapping.padded_vocab_size`), split by rows; the
  padding is stripped again on the way back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from ferryman_trainer_megatron.mapping import ModelShape

__all__ = [
    "Entry",
    "layout",
    "hf_to_megatron",
    "megatron_to_hf",
    "tp_split",
    "tp_merge",
    "hf_shapes",
    "to_global_name",
    "to_local_name",
]

Kind = Literal["replicated", "vocab", "column", "row", "qkv", "fc1"]


@dataclass(frozen=True)
class Entry:
    mg: str
    """Global Megatron name (layer and expert indices over the whole model)."""
    kind: Kind
    hf: tuple[str, ...]
    """HF checkpoint names, in the order they are concatenated (q, k, v / gate, up)."""
    stage: Literal["first", "last", "layer"]
    """Where it lives with pipeline parallelism: the first stage (embedding), the last (final
    norm, output layer) or the stage of ``layer``."""
    layer: int | None = None
    expert: int | None = None
    """Global expert index (expert-parallel ownership); ``None`` for dense parameters."""


def layout(shape: ModelShape, *, transformer_engine: bool = False, critic: bool = False) -> list[Entry]:
    """Every Megatron parameter of a ``GPTModel`` built from ``shape``, in HF checkpoint order.

    ``transformer_engine``: TE fuses the pre-attention norm into ``linear_qkv`` (and, in dense
    layers, the pre-MLP norm into ``linear_fc1``): their weights are named
    ``...linear_qkv.layer_norm_weight`` / ``...linear_fc1.layer_norm_weight``; TE's grouped
    experts are ``mlp.experts.linear_fc1.weight{j}``. ``critic``: no output layer (the value
    head is not an HF parameter)."""
    out: list[Entry] = [Entry("embedding.word_embeddings.weight", "vocab", ("model.embed_tokens.weight",), "first")]
    for i in range(shape.num_layers):
        mg = f"decoder.layers.{i}."
        hf = f"model.layers.{i}."
        attn_norm = "self_attention.linear_qkv.layer_norm_weight" if transformer_engine else "input_layernorm.weight"
        out.append(Entry(mg + attn_norm, "replicated", (hf + "input_layernorm.weight",), "layer", i))
        out.append(Entry(mg + "self_attention.linear_qkv.weight", "qkv",
                         tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv"), "layer", i))
        if shape.qkv_bias:
            out.append(Entry(mg + "self_attention.linear_qkv.bias", "qkv",
                             tuple(hf + f"self_attn.{p}_proj.bias" for p in "qkv"), "layer", i))
        out.append(Entry(mg + "self_attention.linear_proj.weight", "row", (hf + "self_attn.o_proj.weight",), "layer", i))
        if shape.qk_norm:
            out.append(Entry(mg + "self_attention.q_layernorm.weight", "replicated", (hf + "self_attn.q_norm.weight",), "layer", i))
            out.append(Entry(mg + "self_attention.k_layernorm.weight", "replicated", (hf + "self_attn.k_norm.weight",), "layer", i))
        if shape.is_moe:
            # TE does not fuse the norm into a MoE layer
            out.append(Entry(mg + "pre_mlp_layernorm.weight", "replicated", (hf + "post_attention_layernorm.weight",), "layer", i))
            out.append(Entry(mg + "mlp.router.weight", "replicated", (hf + "mlp.gate.weight",), "layer", i))
            for e in range(shape.num_experts or 0):
                fc1, fc2 = (
                    (f"mlp.experts.linear_fc1.weight{e}", f"mlp.experts.linear_fc2.weight{e}")
                    if transformer_engine
                    else (f"mlp.experts.local_experts.{e}.linear_fc1.weight", f"mlp.experts.local_experts.{e}.linear_fc2.weight")
                )
                ex = hf + f"mlp.experts.{e}."
                out.append(Entry(mg + fc1, "fc1", (ex + "gate_proj.weight", ex + "up_proj.weight"), "layer", i, e))
                out.append(Entry(mg + fc2, "row", (ex + "down_proj.weight",), "layer", i, e))
        else:
            mlp_norm = "mlp.linear_fc1.layer_norm_weight" if transformer_engine else "pre_mlp_layernorm.weight"
            out.append(Entry(mg + mlp_norm, "replicated", (hf + "post_attention_layernorm.weight",), "layer", i))
            out.append(Entry(mg + "mlp.linear_fc1.weight", "fc1", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), "layer", i))
            out.append(Entry(mg + "mlp.linear_fc2.weight", "row", (hf + "mlp.down_proj.weight",), "layer", i))
    out.append(Entry("decoder.final_layernorm.weight", "replicated", ("model.norm.weight",), "last"))
    if not shape.tied_embeddings and not critic:
        out.append(Entry("output_layer.weight", "vocab", ("lm_head.weight",), "last"))
    return out


def hf_shapes(entry: Entry, shape: ModelShape) -> list[tuple[int, ...]]:
    """Shapes of the HF tensors of ``entry`` (what :func:`megatron_to_hf` returns)."""
    h, d = shape.hidden_size, shape.head_dim
    name = entry.hf[0]
    if entry.kind == "vocab":
        return [(shape.vocab_size, h)]
    if entry.kind == "qkv":
        q, kv = shape.num_heads * d, shape.num_kv_heads * d
        if name.endswith("bias"):
            return [(q,), (kv,), (kv,)]
        return [(q, h), (kv, h), (kv, h)]
    if entry.kind == "fc1":
        f = shape.moe_ffn_hidden_size if entry.expert is not None else shape.ffn_hidden_size
        return [(f, h), (f, h)]
    if entry.kind == "row":
        if name.endswith("o_proj.weight"):
            return [(h, shape.num_heads * d)]
        f = shape.moe_ffn_hidden_size if entry.expert is not None else shape.ffn_hidden_size
        return [(h, f)]
    # replicated
    if name.endswith("mlp.gate.weight"):
        return [(shape.num_experts, h)]
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return [(d,)]
    return [(h,)]


def _qkv_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    g, hpg, d = shape.num_kv_heads, shape.heads_per_group, shape.head_dim
    rest = q.shape[1:]
    qg = q.reshape(g, hpg * d, *rest)
    kg = k.reshape(g, d, *rest)
    vg = v.reshape(g, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(g * (hpg + 2) * d, *rest)


def _qkv_split(w: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
    g, hpg, d = shape.num_kv_heads, shape.heads_per_group, shape.head_dim
    rest = w.shape[1:]
    grouped = w.reshape(g, (hpg + 2) * d, *rest)
    q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
    return [q.reshape(g * hpg * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)]


def hf_to_megatron(entry: Entry, tensors: list[torch.Tensor], shape: ModelShape, padded_vocab: int) -> torch.Tensor:
    """The full Megatron tensor of ``entry`` from its HF tensors (same dtype)."""
    if len(tensors) != len(entry.hf):
        raise ValueError(f"{entry.mg}: expected {len(entry.hf)} HF tensors, got {len(tensors)}")
    for t, want, name in zip(tensors, hf_shapes(entry, shape), entry.hf, strict=True):
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: shape {tuple(t.shape)} does not match the config ({want})")
    if entry.kind == "qkv":
        return _qkv_merge(*tensors, shape)
    if entry.kind == "fc1":
        return torch.cat(tensors, dim=0)
    if entry.kind == "vocab":
        (t,) = tensors
        if padded_vocab < t.shape[0]:
            raise ValueError(f"{entry.mg}: padded vocabulary {padded_vocab} < {t.shape[0]}")
        out = t.new_zeros((padded_vocab, *t.shape[1:]))
        out[: t.shape[0]] = t
        return out
    return tensors[0].clone()


def megatron_to_hf(entry: Entry, full: torch.Tensor, shape: ModelShape) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of ``entry`` from its full Megatron tensor (views where possible; vocab
    padding stripped)."""
    if entry.kind == "qkv":
        parts = _qkv_split(full, shape)
    elif entry.kind == "fc1":
        parts = list(torch.chunk(full, 2, dim=0))
    elif entry.kind == "vocab":
        parts = [full[: shape.vocab_size]]
    else:
        parts = [full]
    return list(zip(entry.hf, parts, strict=True))


def tp_split(entry: Entry, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This tensor-parallel rank's shard of a full Megatron tensor (a contiguous copy)."""
    if tp == 1:
        return full.contiguous()
    if entry.kind in ("vocab", "column", "qkv"):
        if full.shape[0] % tp:
            raise ValueError(f"{entry.mg}: {full.shape[0]} rows do not split over {tp} ranks")
        return torch.chunk(full, tp, dim=0)[rank].contiguous()
    if entry.kind == "row":
        if full.shape[1] % tp:
            raise ValueError(f"{entry.mg}: {full.shape[1]} columns do not split over {tp} ranks")
        return torch.chunk(full, tp, dim=1)[rank].contiguous()
    if entry.kind == "fc1":
        gate, up = torch.chunk(full, 2, dim=0)
        if gate.shape[0] % tp:
            raise ValueError(f"{entry.mg}: {gate.shape[0]} rows do not split over {tp} ranks")
        return torch.cat([torch.chunk(gate, tp, dim=0)[rank], torch.chunk(up, tp, dim=0)[rank]], dim=0).contiguous()
    return full.contiguous()


def tp_merge(entry: Entry, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full Megatron tensor from the shards of every tensor-parallel rank, in rank order.
    Replicated tensors: the first shard (all are equal)."""
    if len(shards) == 1:
        return shards[0]
    if entry.kind in ("vocab", "column", "qkv"):
        return torch.cat(shards, dim=0)
    if entry.kind == "row":
        return torch.cat(shards, dim=1)
    if entry.kind == "fc1":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return shards[0]


_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")
_LOCAL_EXPERT = re.compile(r"(mlp\.experts\.local_experts\.)(\d+)(\.)")
_TE_EXPERT = re.compile(r"(mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


def to_global_name(local: str, layer_offset: int, expert_offset: int) -> str:
    """A name of one rank's ``state_dict()`` (layers counted within its pipeline stage, experts
    within its expert-parallel rank) → the global name of :func:`layout`."""
    m = _LAYER.match(local)
    if not m:
        return local
    name = f"{m.group(1)}{int(m.group(2)) + layer_offset}{m.group(3)}"
    name = _LOCAL_EXPERT.sub(lambda e: f"{e.group(1)}{int(e.group(2)) + expert_offset}{e.group(3)}", name)
    return _TE_EXPERT.sub(lambda e: f"{e.group(1)}{int(e.group(2)) + expert_offset}", name)


def to_local_name(global_name: str, layer_offset: int, expert_offset: int) -> str:
    """Inverse of :func:`to_global_name`."""
    return to_global_name(global_name, -layer_offset, -expert_offset)
