"""Ray GPU shares on a CPU machine: Ray's GPUs are logical, so a local Ray told it has one GPU
places two engine replicas at 0.3 and the Trainer at 0.4 on it exactly as on an H200 (the
engines and the trainer still compute on the CPU here). The run reports what every run reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ferryman.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_fractional_gpu_shares_place_engines_and_trainer_on_one_gpu(tmp_path, tiny_model, capsys):
    import ray

    if ray.is_initialized():  # a Ray left by an earlier test has no GPU: this run starts its own
        ray.shutdown()
    run_dir = tmp_path / "run"
    rc = main(
        [
            "train",
            str(ROOT / "examples" / "tiny_digits.yaml"),
            f"run_dir={run_dir}",
            f"model.path={tiny_model}",
            "model.build_tiny=false",
            "training.total_steps=3",
            "ray_num_gpus=1",
            "rollout.num_gpus_per_replica=0.3",
            "ray.trainer.num_gpus=0.4",
            "training.mismatch_kl_every=1",
            "checkpoint.every_steps=0",
            "trackers=[{type: jsonl}]",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [int(g) for g in summary["trainer_gpu_ids"]] == [0], "the Trainer actor got a share of the one GPU"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    for key in (
        "perf/generated_tokens_per_s", "perf/samples_per_s_avg", "trainer/idle_ratio", "rollouter/idle_ratio",
        "sync/generation_pause_s", "partial/resumed_share", "memory/trainer_rss_peak_gb",
        "memory/engine_rss_peak_gb/replica-0", "memory/engine_rss_peak_gb/replica-1", "mismatch/abs_diff_mean",
    ):
        assert key in last, key
    assert last["perf/generated_tokens_per_s_avg"] > 0 and last["memory/engine_rss_peak_gb/replica-0"] > 0.05
    assert last["sync/generation_pause_s"] >= last["sync/transfer_s"]
    report = summary["report"]
    assert report["steps_reported"] == 3 and report["generated_tokens_per_s"] > 0
    assert report["engine_rss_peak_gb/replica-1"] > 0.05
