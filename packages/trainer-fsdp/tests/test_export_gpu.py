"""``ferryman export``'s directory served by vLLM (marked ``gpu``; needs vLLM 0.24 and a GPU).

The fsdp trainer trains a tiny random Qwen2 on the CPU, saves a distributed checkpoint, and
``export_hf`` writes it out; vLLM loads the directory (float32) and its prompt log-probs equal
the trainer's at that step within ``REF_ATOL``: the bound the vllm engine's GPU tests measured
between vLLM's kernels (Triton attention, fused RMSNorm/SiLU) and transformers' on such
models, up to about 1e-2. A different model (the untrained base) is far outside it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from ferryman.config import AlgorithmConfig  # noqa: E402
from ferryman.testing.trainer_contract import fill_train_batch, random_train_batch  # noqa: E402
from ferryman.tiny import build_tiny_model  # noqa: E402
from ferryman_trainer_fsdp.export import export_hf  # noqa: E402
from ferryman_trainer_fsdp.trainer import FSDPTrainerConfig, make_fsdp_trainer  # noqa: E402

pytestmark = pytest.mark.gpu
REF_ATOL = 2e-2


def _prompt_log_probs(llm, rows: list[list[int]]) -> list[list[float]]:
    from vllm import SamplingParams, TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], SamplingParams(max_tokens=1, prompt_logprobs=0))
    got = []
    for row, out in zip(rows, outs):
        lps = [0.0]  # position 0 is never scored
        for tok, d in zip(row[1:], out.prompt_logprobs[1:]):
            lps.append(d[tok].logprob)
        got.append(lps)
    return got


def test_vllm_serves_the_export_with_the_trainers_log_probs(tmp_path):
    from vllm import LLM

    model = str(build_tiny_model(tmp_path / "tiny", vocab_size=160, init_std=0.2))
    config = FSDPTrainerConfig(lr=1e-2, micro_batch_max_tokens=1 << 20)
    trainer = make_fsdp_trainer(config, model_path=model, algorithm=AlgorithmConfig(), seed=0)
    try:
        batch = fill_train_batch(trainer, random_train_batch(160, num_groups=2, group_size=2, seed=3))
        trainer.update_actor(batch)
        trainer.update_actor(batch)
        trainer.save_checkpoint(str(tmp_path / "ckpt"))
        trained = trainer.compute_log_probs(batch)
    finally:
        trainer.close()
    export_hf(str(tmp_path / "ckpt"), model_path=model, config=config, out_dir=str(tmp_path / "hf"))
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(model).save_pretrained(tmp_path / "hf")
    rows = [[int(t) for t, m in zip(ids, mask) if m] for ids, mask in zip(batch.input_ids, batch.attention_mask)]
    llm = LLM(model=str(tmp_path / "hf"), dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=256)
    got = _prompt_log_probs(llm, rows)
    # the untrained base (transformers, CPU): the check must tell it from the trained model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = base(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
    untrained = torch.zeros_like(trained)
    untrained[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    worst = worst_base = 0.0
    for i, row in enumerate(rows):
        ref = trained[i, : len(row)].tolist()  # right-padded rows: the unpadded prefix
        worst = max(worst, max(abs(a - b) for a, b in zip(got[i], ref)))
        worst_base = max(worst_base, max(abs(a - b) for a, b in zip(untrained[i, : len(row)].tolist(), ref)))
    print(f"vLLM vs trainer: max |d log-prob| {worst:.2e}; untrained base vs trainer {worst_base:.2e}")
    assert worst <= REF_ATOL
    assert worst_base > 10 * REF_ATOL, "the check must tell the trained model from the base"
