"""``export_hf``: a distributed checkpoint of the fsdp trainer becomes a Hugging Face directory
that transformers loads, with the trainer's weights to the bit and the trainer's log-probs."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from ferryman.algorithms import lean_log_probs_from_logits
from ferryman.config import AlgorithmConfig
from ferryman.testing.trainer_contract import collect_weights, fill_train_batch, random_train_batch
from ferryman.tiny import build_tiny_model
from ferryman_trainer_fsdp.export import export_hf
from ferryman_trainer_fsdp.trainer import FSDPTrainerConfig, make_fsdp_trainer

torch.set_num_threads(1)
VOCAB = 160


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", vocab_size=VOCAB))


def plain_log_probs(model, batch):
    """The trainer's formula (same function, same inputs) on the loaded model's logits."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
        lp = lean_log_probs_from_logits(logits[:, :-1], batch.input_ids[:, 1:])
    out = torch.zeros(batch.input_ids.shape, dtype=lp.dtype)
    out[:, 1:] = lp
    return out * batch.attention_mask


@pytest.mark.parametrize("tied", [True, False])
def test_export_is_the_trainers_model(model_dir, tmp_path, tied):
    path = model_dir
    if not tied:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(1)
        cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=False)
        Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "untied")
        path = str(tmp_path / "untied")
    config = FSDPTrainerConfig(lr=1e-2, micro_batch_max_tokens=1 << 20)
    trainer = make_fsdp_trainer(config, model_path=path, algorithm=AlgorithmConfig(), seed=0)
    try:
        batch = fill_train_batch(trainer, random_train_batch(VOCAB, num_groups=2, group_size=2, seed=3))
        trainer.update_actor(batch)
        trainer.update_actor(batch)
        trainer.save_checkpoint(str(tmp_path / "ckpt"))
        trained = trainer.compute_log_probs(batch)
        weights = collect_weights(trainer)
    finally:
        trainer.close()
    assert not torch.allclose(trained, batch.old_log_probs, atol=1e-3), "training moved the model"

    export_hf(str(tmp_path / "ckpt"), model_path=path, config=config, out_dir=str(tmp_path / "hf"))
    files = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json"} <= files
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is tied
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    sd = loaded.state_dict()
    for name, t in weights.items():  # float32 master weights, bit for bit
        assert torch.equal(sd[name], t), name
    if tied:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    # the same weights through the same formula in one process: measured bit-equal (0.0). The
    # bound allows only what a different summation order could change (e.g. a GEMM kernel that
    # picks another path for FSDP's differently aligned parameter views): float32 dot products
    # of length <= 128 (the MLP width) err by at most 128 * 2^-24 ~ 8e-6 of the sum of |terms|
    # per layer, log-probs of this model's logits (|z| < 1) by twice the logits' error over
    # two layers: < 4e-5
    mine = plain_log_probs(loaded, batch)
    torch.testing.assert_close(mine, trained, rtol=0, atol=4e-5)


def test_export_bfloat16_and_bad_input(model_dir, tmp_path):
    config = FSDPTrainerConfig(lr=1e-2)
    trainer = make_fsdp_trainer(config, model_path=model_dir, algorithm=AlgorithmConfig(), seed=0)
    try:
        trainer.save_checkpoint(str(tmp_path / "ckpt"))
        weights = collect_weights(trainer)
    finally:
        trainer.close()
    export_hf(str(tmp_path / "ckpt"), model_path=model_dir, config=config, out_dir=str(tmp_path / "bf16"), dtype="bfloat16")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    sd = loaded.state_dict()
    assert all(torch.equal(sd[k], w.to(torch.bfloat16)) for k, w in weights.items())
    with pytest.raises(ValueError, match="not a checkpoint of the fsdp trainer"):
        export_hf(str(tmp_path), model_path=model_dir, config=config, out_dir=str(tmp_path / "x"))
    with pytest.raises(ValueError, match="dtype"):
        export_hf(str(tmp_path / "ckpt"), model_path=model_dir, config=config, out_dir=str(tmp_path / "y"), dtype="int8")
