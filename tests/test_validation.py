"""Validation during training, end to end (transformers engines, FSDP2 trainer, digits env, one
asyncio loop): it runs before training and every N steps at one weight version, the version it
is tagged with; it never reaches the queue or the training set; its metrics reach the trackers
and its spans the timeline."""

from __future__ import annotations

import json

from ferryman import timeline
from ferryman.config import load_config
from ferryman.plugins import PluginHost
from ferryman.runner import run
from ferryman.trace import read_trace


def test_validation_runs_at_one_version_and_never_trains(tmp_path, tiny_model):
    host = PluginHost()
    cfg, _ = load_config(None, [
        "runtime=inline", f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model}",
        "rollout.n=2", "rollout.max_tokens=4", "rollout.num_replicas=2", "rollout.max_concurrency_per_replica=2",
        "training.ppo_mini_batch_size=2", "training.total_steps=4", "engine.step_delay_s=0.01", "trainer.lr=1e-3",
        # mode (d): stale samples and partial rollout, so a careless validation would span versions
        "async_training.staleness_threshold=1", "async_training.partial_rollout=true",
        "env.num_tasks=12", "validation.split=0.25", "validation.every_steps=2", "validation.before_train=true",
        "validation.n=3", "validation.temperature=1.0", "validation.max_tokens=2",
        "trackers=[{type: jsonl}]",
    ], host)
    summary = run(cfg, host)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [x for x in lines if "val/pass@1" in x]
    train = [x for x in lines if "reward/mean" in x]
    assert [x["step"] for x in val] == [0, 2, 4] and len(train) == 4
    for x in val:
        assert x["val/num_tasks"] == 3 and x["val/num_runs"] == 9  # 25% of 12 tasks, n = 3
        assert x["val/pass@3"] >= x["val/pass@1"] and 0 <= x["val/reward_mean"] <= 1
        assert 1 <= x["val/response_length_mean"] <= 2
        # every token from the version it is tagged with
        assert x["val/min_version"] == x["val/max_version"] == x["val/weight_version"]
    assert [x["val/weight_version"] for x in val] == [0, 2, 4]  # trigger 1: version = step
    # nothing of it was queued or trained: the trained samples are the 8 training samples
    uids = [u for s in summary["steps"] for u in s["sample_uids"]]
    assert len(uids) == len(set(uids)) == 8
    assert all(int(u.split("-t")[1]) < 9 for u in uids), "held-out tasks (9..11) never train"
    records = read_trace(tmp_path / "run")
    puts = [r for r in records if r["name"] == "queue.put"]
    assert {r["args"]["uid"] for r in puts} >= set(uids) and all(r["args"]["uid"].startswith("e") for r in puts)
    assert not [r for r in records if r["name"] == "rollouter.traj" and r["args"]["request_id"].startswith("val")]
    # its own lane in the timeline
    tl = timeline.build(records)
    assert [b.label for b in tl.validations] == ["0", "2", "4"]
    timeline.draw([(tl, tl.t0, tl.end, "validation")], tmp_path / "chart.png")
    assert (tmp_path / "chart.png").stat().st_size > 0
