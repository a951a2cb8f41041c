"""ferryman-sync-nccl in whole runs on CPUs.

``nccl`` over gloo: the main job on local Ray with ``weight_sync: {type: nccl}`` (receivers
inside the engine actors, the sender inside the trainer actor), and an inline run (receivers
beside in-process transformers engines, on the run's event loop).

``cuda_ipc`` on host shared memory (the CPU form of the GPU code): the main job on local Ray
(the buffers made in the trainer actor, their handles handed to the engine actors through
Ray), and inline, where it trains exactly as core's object-store sync does: same seed, same
losses and rewards at every step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("ferryman_sync_nccl")


def _model_numbers(path: Path) -> tuple[int, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    seen, n, size = set(), 0, 0
    for t in model.state_dict().values():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        n += 1
        size += t.numel() * t.element_size()
    return n, size


def _check_syncs(run_dir: Path, steps: int, tiny_model: Path) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    n_tensors, n_bytes = _model_numbers(tiny_model)
    for r in rows:
        assert r["sync/version"] == r["step"]
        assert r["sync/tensors"] == n_tensors and r["sync/bytes"] >= n_bytes, "every weight went over the wire"
        assert r["sync/buckets"] >= 2
    assert rows[0]["sync/connect_s"] > 0
    assert all(r["sync/connect_s"] == 0.0 for r in rows[1:]), "one group for the whole run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(summary["syncs"]) == steps


@pytest.mark.slow
def test_main_job_on_ray_with_the_nccl_sync_over_gloo(tmp_path, tiny_model, capsys):
    from ferryman.cli import main

    run_dir = tmp_path / "run"
    rc = main(
        [
            "train",
            str(ROOT / "examples" / "tiny_digits.yaml"),
            f"run_dir={run_dir}",
            f"model.path={tiny_model}",
            "model.build_tiny=false",
            "training.total_steps=3",
            "engine.step_delay_s=0.005",
            "trackers=[{type: jsonl}]",
            "weight_sync={type: nccl, backend: gloo, bucket_megabytes: 0.0625, timeout_s: 30}",
        ]
    )
    assert rc == 0
    assert "finished 3 steps" in capsys.readouterr().out
    _check_syncs(run_dir, 3, tiny_model)


@pytest.mark.slow
def test_inline_run_with_the_nccl_sync_and_store_metadata(tmp_path, tiny_model):
    from ferryman.config import load_config
    from ferryman.plugins import PluginHost
    from ferryman.runner import run

    host = PluginHost()
    cfg, _ = load_config(
        None,
        [
            "runtime=inline",
            f"run_dir={tmp_path / 'run'}",
            f"model.path={tiny_model}",
            "rollout.n=2",
            "rollout.max_tokens=4",
            "rollout.num_replicas=2",
            "training.ppo_mini_batch_size=2",
            "training.total_steps=3",
            "engine.step_delay_s=0.002",
            "trackers=[{type: jsonl}]",
            "weight_sync={type: nccl, backend: gloo, metadata: store, bucket_megabytes: 0.0625, timeout_s: 30}",
        ],
        host,
    )
    run(cfg, host)
    _check_syncs(tmp_path / "run", 3, tiny_model)


IPC = "weight_sync={type: cuda_ipc, device: cpu, bucket_megabytes: 0.0625, timeout_s: 30}"


@pytest.mark.slow
def test_main_job_on_ray_with_the_cuda_ipc_sync_on_host_memory(tmp_path, tiny_model, capsys):
    from ferryman.cli import main

    run_dir = tmp_path / "run"
    rc = main(
        [
            "train",
            str(ROOT / "examples" / "tiny_digits.yaml"),
            f"run_dir={run_dir}",
            f"model.path={tiny_model}",
            "model.build_tiny=false",
            "training.total_steps=3",
            "engine.step_delay_s=0.005",
            "trackers=[{type: jsonl}]",
            IPC,
        ]
    )
    assert rc == 0
    assert "finished 3 steps" in capsys.readouterr().out
    _check_syncs(run_dir, 3, tiny_model)


def _inline(run_dir: Path, tiny_model: Path, weight_sync: str) -> list[dict]:
    from ferryman.config import load_config
    from ferryman.plugins import PluginHost
    from ferryman.runner import run

    host = PluginHost()
    cfg, _ = load_config(
        str(ROOT / "examples" / "tiny_digits.yaml"),
        [
            "runtime=inline",
            f"run_dir={run_dir}",
            f"model.path={tiny_model}",
            "model.build_tiny=false",
            # generation and training take turns, one replica generates one sequence at a time:
            # the run is a function of the seed, so two transports that deliver the same
            # weights give the same numbers
            "async_training.colocated=true",
            "async_training.staleness_threshold=0",
            "async_training.partial_rollout=false",
            "rollout.n=4",
            "rollout.num_replicas=1",
            "rollout.max_concurrency_per_replica=1",
            "training.ppo_mini_batch_size=4",
            "training.total_steps=4",
            "trackers=[{type: jsonl}]",
            weight_sync,
        ],
        host,
    )
    run(cfg, host)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_inline_run_with_cuda_ipc_trains_as_the_object_store_sync_does(tmp_path, tiny_model):
    ipc = _inline(tmp_path / "ipc", tiny_model, IPC)
    ref = _inline(tmp_path / "ref", tiny_model, "weight_sync={type: object_store}")
    _check_syncs(tmp_path / "ipc", 4, tiny_model)
    keys = [k for k in ref[0] if k.startswith(("actor/", "reward/", "response_length/")) and isinstance(ref[0][k], float)]
    assert "reward/mean" in keys and any(k.startswith("actor/") for k in keys), keys
    for step, (a, b) in enumerate(zip(ipc, ref), 1):
        for k in keys:
            assert a[k] == b[k], f"step {step}: {k} = {a[k]} over cuda_ipc, {b[k]} over the object store"
