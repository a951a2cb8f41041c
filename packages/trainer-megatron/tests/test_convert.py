"""HF <-> Megatron layout: exact round trips on random tensors of real (small) shapes, TP split
and merge, GQA grouping of QKV, gate/up, vocabulary padding, global/local names."""

from __future__ import annotations

import pytest
import torch

from ferryman_trainer_megatron.convert import (
    hf_shapes, hf_to_megatron, layout, megatron_to_hf, to_global_name, to_local_name, tp_merge, tp_split,
)
from ferryman_trainer_megatron.mapping import ModelShape, padded_vocab_size


def shape(**kw) -> ModelShape:
    base = dict(family="qwen2", vocab_size=151, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2,
                head_dim=8, ffn_hidden_size=96, qkv_bias=True, qk_norm=False, tied_embeddings=False,
                rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=128)
    base.update(kw)
    return ModelShape(**base)


SHAPES = {
    "qwen2": shape(),
    "qwen2-tied": shape(tied_embeddings=True),
    "qwen3": shape(family="qwen3", qkv_bias=False, qk_norm=True, head_dim=16),
    "qwen3_moe": shape(family="qwen3_moe", qkv_bias=False, qk_norm=True, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32),
}


def random_hf(s: ModelShape, te: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for e in layout(s, transformer_engine=te):
        for name, shp in zip(e.hf, hf_shapes(e, s), strict=True):
            out[name] = torch.randn(shp, generator=g)
    return out


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("te", [False, True])
def test_round_trip_through_tp_shards_is_exact(name, tp, te):
    s = SHAPES[name]
    hf = random_hf(s, te)
    padded = padded_vocab_size(s.vocab_size, 16, tp)
    back = {}
    for e in layout(s, transformer_engine=te):
        full = hf_to_megatron(e, [hf[n] for n in e.hf], s, padded)
        shards = [tp_split(e, full, tp, r) for r in range(tp)]
        if tp > 1 and e.kind != "replicated":
            assert all(sh.numel() * tp == full.numel() for sh in shards), e.mg
        merged = tp_merge(e, shards)
        assert torch.equal(merged, full), e.mg
        back.update(megatron_to_hf(e, merged, s))
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_hf_names_cover_a_real_transformers_checkpoint(tmp_path):
    """The layout's HF names are exactly the tensors transformers writes, for each family."""
    from safetensors import safe_open
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from ferryman_trainer_megatron.mapping import model_shape

    common = dict(vocab_size=151, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=48, max_position_embeddings=64)
    models = [
        Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True)),
        Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)),
        Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)),
    ]
    for i, m in enumerate(models):
        m.save_pretrained(tmp_path / str(i))
        with safe_open(str(tmp_path / str(i) / "model.safetensors"), "pt") as f:
            on_disk = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        s = model_shape(m.config)
        names = {n: shp for e in layout(s) for n, shp in zip(e.hf, hf_shapes(e, s), strict=True)}
        # tied checkpoints may still carry lm_head.weight; the layout leaves it out
        expected = {k: v for k, v in on_disk.items() if not (s.tied_embeddings and k == "lm_head.weight")}
        assert names == expected, type(m).__name__


def test_qkv_layout_groups_query_heads_with_their_kv_head():
    s = shape(num_heads=4, num_kv_heads=2, head_dim=1, hidden_size=4, qkv_bias=True)
    e = next(e for e in layout(s) if e.mg.endswith("linear_qkv.bias"))
    q = torch.tensor([10.0, 11.0, 12.0, 13.0])  # heads 0..3: 0,1 in group 0; 2,3 in group 1
    k = torch.tensor([20.0, 21.0])
    v = torch.tensor([30.0, 31.0])
    full = hf_to_megatron(e, [q, k, v], s, 0)
    assert full.tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    # TP 2: each rank one whole group
    assert tp_split(e, full, 2, 1).tolist() == [12, 13, 21, 31]


def test_fc1_shards_hold_their_gate_and_up_halves():
    s = shape(ffn_hidden_size=4, hidden_size=1)
    e = next(e for e in layout(s) if e.mg.endswith("mlp.linear_fc1.weight"))
    gate = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    up = torch.tensor([[5.0], [6.0], [7.0], [8.0]])
    full = hf_to_megatron(e, [gate, up], s, 0)
    assert tp_split(e, full, 2, 0).flatten().tolist() == [1, 2, 5, 6]
    assert tp_split(e, full, 2, 1).flatten().tolist() == [3, 4, 7, 8]


def test_vocab_padding_is_zero_and_stripped():
    s = shape()
    e = layout(s)[0]
    emb = torch.randn(151, 64)
    padded = padded_vocab_size(151, 128, 2)
    assert padded == 256
    full = hf_to_megatron(e, [emb], s, padded)
    assert full.shape == (256, 64) and torch.equal(full[151:], torch.zeros(105, 64))
    ((name, back),) = megatron_to_hf(e, full, s)
    assert name == "model.embed_tokens.weight" and torch.equal(back, emb)


def test_wrong_hf_shape_is_refused_with_the_name():
    s = shape()
    e = layout(s)[0]
    with pytest.raises(ValueError, match="model.embed_tokens.weight"):
        hf_to_megatron(e, [torch.zeros(150, 64)], s, 256)


def test_global_and_local_names():
    assert to_global_name("decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.weight", 8, 4) == \
        "decoder.layers.11.mlp.experts.local_experts.5.linear_fc1.weight"
    assert to_global_name("decoder.layers.0.mlp.experts.linear_fc2.weight2", 2, 6) == "decoder.layers.2.mlp.experts.linear_fc2.weight8"
    assert to_global_name("embedding.word_embeddings.weight", 5, 5) == "embedding.word_embeddings.weight"
    g = "decoder.layers.11.self_attention.linear_qkv.weight"
    assert to_global_name(to_local_name(g, 8, 0), 8, 0) == g


def test_tied_and_critic_layouts_have_no_output_layer():
    assert layout(SHAPES["qwen2"])[-1].mg == "output_layer.weight"
    assert layout(SHAPES["qwen2-tied"])[-1].mg == "decoder.final_layernorm.weight"
    assert layout(SHAPES["qwen2"], critic=True)[-1].mg == "decoder.final_layernorm.weight"
