"""``ferryman export`` and ``ferryman eval`` on a real run's checkpoint: the exported directory
loads in transformers with the trainer's log-probs at that step, and eval prints a table and
writes JSON, from the run directory or from the exported model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from ferryman.algorithms import lean_log_probs_from_logits
from ferryman.cli import main
from ferryman.config import AlgorithmConfig, load_config
from ferryman.plugins import PluginHost
from ferryman.runner import run
from ferryman.testing.trainer_contract import random_train_batch
from ferryman_trainer_fsdp.trainer import FSDPTrainerBackend, FSDPTrainerConfig


def test_export_then_eval(tmp_path, tiny_model, capsys):
    host = PluginHost()
    run_dir = tmp_path / "run"
    cfg, _ = load_config(None, [
        "runtime=inline", f"run_dir={run_dir}", f"model.path={tiny_model}", "rollout.n=2", "rollout.max_tokens=2",
        "training.ppo_mini_batch_size=2", "training.total_steps=2", "trainer.lr=1e-2", "checkpoint.every_steps=2",
        # the random model's rewards are mostly equal (no GRPO advantage): the entropy bonus moves it anyway
        "algorithm.entropy_coeff=0.1",
        "env.num_tasks=6", "trackers=[{type: jsonl}]",
    ], host)
    run(cfg, host)
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), "-o", str(out)]) == 0
    info = json.loads((out / "ferryman_export.json").read_text())
    assert info["step"] == 2 and info["weight_version"] == 2
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert main(["export", str(run_dir), "-o", str(out)]) == 2  # not over an existing export
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert main(["export", str(run_dir), "--step", "7", "-o", str(tmp_path / "x")]) == 2
    assert "no checkpoint of that step" in capsys.readouterr().err

    # the trainer at that step: a backend loaded from the checkpoint's trainer/ folder
    ckpt = next((run_dir / "checkpoints").glob("step-*"))
    trainer = FSDPTrainerBackend(FSDPTrainerConfig(micro_batch_max_tokens=1 << 20), model_path=tiny_model, algorithm=AlgorithmConfig(), seed=5)
    try:
        trainer.load_checkpoint(str(ckpt / "trainer"))
        batch = random_train_batch(160, num_groups=2, group_size=2, seed=1)
        expected = trainer.compute_log_probs(batch)
    finally:
        trainer.close()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
    got = torch.zeros_like(expected)
    got[:, 1:] = lean_log_probs_from_logits(logits[:, :-1], batch.input_ids[:, 1:])
    # same float32 weights, same formula (see packages/trainer-fsdp/tests/test_export.py for the bound)
    torch.testing.assert_close(got * batch.attention_mask, expected, rtol=0, atol=4e-5)
    base = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    moved = max(float((a - b).abs().max()) for a, b in zip(base.state_dict().values(), model.state_dict().values()))
    assert moved > 1e-3, "the export is the trained model, not the base"

    # eval: a config with held-out tasks, on the run directory (exported to RUN_DIR/exports) ...
    conf = tmp_path / "eval.yaml"
    conf.write_text(yaml.safe_dump({"env": {"type": "digits", "num_tasks": 6}, "validation": {"env": {"num_tasks": 4}, "n": 3, "max_tokens": 2}}))
    capsys.readouterr()
    assert main(["eval", str(run_dir), str(conf), "-o", str(tmp_path / "a.json")]) == 0
    text = capsys.readouterr().out
    assert "pass@1" in text and "pass@3" in text and "mean response length" in text
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["model"] == str(run_dir / "exports" / "step-2") and a["metrics"]["num_runs"] == 12 and len(a["tasks"]) == 4
    assert 0 <= a["metrics"]["pass@1"] <= a["metrics"]["pass@3"] <= 1
    # ... and on a model directory
    assert main(["eval", str(out), str(conf), "validation.n=1", "-o", str(tmp_path / "b.json")]) == 0
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["metrics"]["num_runs"] == 4 and "pass@1" in b["metrics"]
    assert main(["eval", str(out), str(conf), "--step", "2"]) == 2  # --step needs a run directory
