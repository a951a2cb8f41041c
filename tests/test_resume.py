"""Kill the main pipeline (real transformers engines, FSDP2 trainer, digits env, inline runtime)
at named points with a real SIGKILL, or stop it with SIGTERM, resume it with
``ferryman train --resume``, and compare with an uninterrupted run of the same seed: the same
step count, the same set of sample ids (``e{epoch}-t{task}``), no sample trained twice. Also: an
engine replica dies mid-run and the run completes with every dispatched trajectory accounted for.

``rollout.total_rollout_steps`` caps admission at exactly the samples the steps consume, so the
uninterrupted run's trained set is deterministic even with staleness and partial rollout."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ferryman.config import load_config
from ferryman.plugins import PluginHost
from ferryman.runner import run

ROOT = Path(__file__).resolve().parents[1]
STEPS, W = 6, 2

# mode (d): staleness and partial rollout, so cuts happen with runs under way; one sequence
# per replica at a time, slow-ish steps and ~10 weight buckets, so there is something to hit
BASE = [
    "runtime=inline",
    "seed=3",
    "rollout.n=2",
    "rollout.max_tokens=8",
    "rollout.num_replicas=2",
    "rollout.max_concurrency_per_replica=1",
    f"rollout.total_rollout_steps={STEPS * W}",
    f"training.ppo_mini_batch_size={W}",
    f"training.total_steps={STEPS}",
    "training.weight_bucket_megabytes=0.04",
    "engine.step_delay_s=0.02",
    "env.num_tasks=5",
    "trainer.lr=1e-3",
    "trackers=[{type: jsonl}]",
    "async_training.staleness_threshold=0.5",
    "async_training.partial_rollout=true",
    "checkpoint.every_steps=1",
    "checkpoint.keep=2",
]
# mode (a), two turns per run: a cut can catch a run with a finished call and one under way
MODE_A = ["async_training.staleness_threshold=0", "async_training.partial_rollout=false", "engine.step_delay_s=0.05", "env.turns=2"]


def _overrides(run_dir: Path, tiny_model: Path, extra: list[str]) -> list[str]:
    return [*BASE, f"run_dir={run_dir}", f"model.path={tiny_model}", "model.build_tiny=false", *extra]


def _run_inline(run_dir: Path, tiny_model: Path, extra: list[str] = (), resume: Path | None = None) -> dict:
    host = PluginHost()
    cfg, _ = load_config(None, _overrides(run_dir, tiny_model, list(extra)), host)
    return run(cfg, host, resume=resume)


def _cli(args: list[str], faults: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """``ferryman train`` in a subprocess (a process the fault may kill)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("FERRYMAN_FAULTS", None)
    if faults:
        env["FERRYMAN_FAULTS"] = faults
    cmd = [sys.executable, "-m", "ferryman.cli", "train", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _trained(summary: dict) -> list[str]:
    return [u for s in summary["steps"] for u in s["sample_uids"]]


def _assert_same_as_uninterrupted(summary: dict, baseline: dict, run_dir: Path) -> None:
    assert [s["step"] for s in summary["steps"]] == list(range(1, STEPS + 1)), "step count"
    uids = _trained(summary)
    assert len(uids) == len(set(uids)), f"a sample was trained twice: {sorted(uids)}"
    assert sorted(uids) == sorted(_trained(baseline)), "not the set of samples of the uninterrupted run"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "each step logged once"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_model) -> dict:
    summary = _run_inline(tmp_path_factory.mktemp("baseline") / "run", tiny_model)
    assert len(_trained(summary)) == STEPS * W
    return summary


@pytest.mark.slow
def test_sigkill_at_named_points_then_resume(tmp_path, tiny_model, baseline):
    """One run, SIGKILLed four times in a row at random passes of four points (during generation,
    during a weight transfer, while samples wait in the queue, while a checkpoint is being
    written), each time resumed from the newest checkpoint; the fifth process finishes."""
    rng = random.Random(int(os.environ.get("FERRYMAN_TEST_SEED", "10")))
    run_dir = tmp_path / "run"
    kills = [
        f"rollout.generate@{rng.randint(14, 20)}=kill",  # of 24: after the first checkpoint
        f"sync.bucket@{rng.randint(12, 20)}=kill",  # the 2nd weight transfer of its process
        f"trainer.get@{rng.randint(2, 3)}=kill",
        "checkpoint.write@1=kill",  # the new checkpoint is left half-written in .tmp-…
    ]
    args = _overrides(run_dir, tiny_model, [])
    resumed_at = []
    for stage, fault in enumerate(kills):
        cli = args if stage == 0 else ["--resume", str(run_dir)]
        proc = _cli(cli, fault)
        assert proc.returncode == -signal.SIGKILL, f"{fault}: rc {proc.returncode}\n{proc.stderr[-3000:]}"
        if stage:
            resumed_from = json.loads((run_dir / "run.json").read_text())["resumed_from"]
            resumed_at.append(int(Path(resumed_from).name.split("-")[1]))
    assert list((run_dir / "checkpoints").glob(".tmp-step-*")), "the last kill interrupted a checkpoint write"
    newest = json.loads(sorted((run_dir / "checkpoints").glob("step-*"))[-1].joinpath("meta.json").read_text())
    summary = _run_inline(run_dir, tiny_model, resume=run_dir)
    assert summary["resumed"]["step"] == newest["step"], "the half-written checkpoint was ignored"
    assert resumed_at == sorted(resumed_at)
    _assert_same_as_uninterrupted(summary, baseline, run_dir)
    assert not list((run_dir / "checkpoints").glob(".tmp-step-*")), "leftovers are cleaned up"
    assert len(list((run_dir / "checkpoints").glob("step-*"))) == 2, "checkpoint.keep"


@pytest.mark.slow
def test_sigterm_mid_generation_saves_runs_under_way_and_resumes_on_policy(tmp_path, tiny_model, baseline):
    """Mode (a): SIGTERM while a window is being generated. The stop checkpoint holds the runs
    under way with their tokens so far; the resumed run finishes them, and every step still
    trains only tokens of the weights being trained (the on-policy barrier holds). (With
    admission capped, the uninterrupted set of samples is the same in every mode: the first
    ones in the seeded task order; so the mode (d) baseline is the reference.)"""
    run_dir = tmp_path / "run"
    # 8 calls per window (2 samples x 2 runs x 2 turns): the 22nd is a 2nd turn of window 3
    proc = _cli(_overrides(run_dir, tiny_model, MODE_A), "rollout.generate@22=term")
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "stopped at step" in proc.stdout and "--resume" in proc.stdout
    ckpt = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["kind"] == "stop" and meta["inflight_runs_under_way"] >= 1 and meta["inflight_tokens"] >= 1, meta

    summary = _run_inline(run_dir, tiny_model, MODE_A, resume=run_dir)
    assert summary["resumed"]["kept_tokens"] == meta["inflight_tokens"]
    roll = summary["rollouter"]
    # the runs under way continue from their records: calls finished before the cut are replayed,
    # a call cut mid-generation resumes from its tokens (whether the cut lands mid-call depends on
    # the random model's answer lengths), and no replay diverges
    assert roll["replay/replayed_calls"] + roll["replay/resumed_calls"] >= 1, roll
    assert roll["replay/diverged_runs"] == 0, roll
    _assert_same_as_uninterrupted(summary, baseline, run_dir)
    for step in summary["steps"]:
        assert step["min_token_version"] == step["max_token_version"] == step["version"], step


@pytest.mark.slow
def test_an_engine_replica_dies_and_the_run_completes(tmp_path, tiny_model, baseline):
    """replica-1 dies at its 5th request (the requests it serves fail; it answers nothing more):
    the router quarantines it, its requests are retried on replica-0, weight syncs go on without
    it, and every dispatched trajectory is trained."""
    os.environ["FERRYMAN_FAULTS"] = "engine.generate@5:replica-1=die"
    try:
        summary = _run_inline(tmp_path / "run", tiny_model)
    finally:
        del os.environ["FERRYMAN_FAULTS"]
    _assert_same_as_uninterrupted(summary, baseline, tmp_path / "run")
    r = summary["rollouter"]
    assert summary["lost_replicas"] == ["replica-1"]
    trained_trajectories = 2 * STEPS * W
    assert r["rollouter/failed_trajectories"] == 0
    assert r["rollouter/runs_dispatched"] == r["rollouter/runs_finished"] == trained_trajectories
    assert all(s["sync/lost_replicas"] == 1.0 for s in summary["syncs"][-2:])


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_on_ray_a_replica_and_the_trainer_are_killed_and_the_run_resumes(request, tmp_path, tiny_model, baseline):
    """Local Ray: replica-1's actor process is SIGKILLed at its 6th request, then the trainer's
    actor process at the end of step 3. The run stops cleanly (TrainerDiedError naming the
    checkpoint), and ``--resume`` on Ray finishes it with the uninterrupted run's samples."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("starts local Ray twice (several minutes on 2 busy cores); select with -m slow")
    from ferryman.checkpoint import TrainerDiedError

    run_dir = tmp_path / "run"
    ray_args = ["runtime=ray", "ray_num_cpus=2"]
    os.environ["FERRYMAN_FAULTS"] = "engine.generate@6:replica-1=kill,trainer.step@3=kill"
    try:
        with pytest.raises(TrainerDiedError, match="--resume"):
            _run_inline(run_dir, tiny_model, ray_args)
    finally:
        del os.environ["FERRYMAN_FAULTS"]
    assert "resume" in json.loads((run_dir / "summary.json").read_text())["error"]
    summary = _run_inline(run_dir, tiny_model, ray_args, resume=run_dir)
    assert summary["resumed"]["step"] == 2  # step 3's checkpoint was due after the kill point
    _assert_same_as_uninterrupted(summary, baseline, run_dir)


@pytest.mark.slow
def test_the_rollouter_fails_the_run_stops_and_resumes(tmp_path, tiny_model, baseline):
    """The Rollouter's own machinery raises when it starts its 9th sample (after the first
    checkpoints): the trainer is not left waiting for samples that never come; the run stops
    with an error naming the checkpoint, and ``--resume`` finishes it with the uninterrupted
    run's samples."""
    from ferryman.checkpoint import RollouterDiedError

    run_dir = tmp_path / "run"
    os.environ["FERRYMAN_FAULTS"] = "rollouter.sample@9=raise"
    try:
        with pytest.raises(RollouterDiedError, match="Rollouter failed.*FaultInjected.*--resume"):
            _run_inline(run_dir, tiny_model)
    finally:
        del os.environ["FERRYMAN_FAULTS"]
    error = json.loads((run_dir / "summary.json").read_text())["error"]
    assert "checkpoints/step-" in error, error
    summary = _run_inline(run_dir, tiny_model, resume=run_dir)
    assert summary["resumed"]["step"] >= 1
    _assert_same_as_uninterrupted(summary, baseline, run_dir)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_on_ray_the_rollouter_actor_is_killed_and_the_run_stops(tmp_path, tiny_model):
    """Local Ray: the Rollouter actor's process is SIGKILLed when it starts its 5th sample. The
    driver does not hang on the trainer (which waits for samples): it stops the run and names
    the Rollouter and the way to resume; ``ferryman train`` exits with status 1."""
    run_dir = tmp_path / "run"
    args = [*_overrides(run_dir, tiny_model, ["runtime=ray", "ray_num_cpus=2"])]
    proc = _cli(args, "rollouter.sample@5=kill", timeout=400)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # the way to go on: --resume from a checkpoint, or (none saved yet) a new run, said so
    assert "the Rollouter failed" in proc.stderr, proc.stderr[-3000:]
    assert "--resume" in proc.stderr or "no checkpoint was saved" in proc.stderr, proc.stderr[-3000:]
    assert "Rollouter failed" in json.loads((run_dir / "summary.json").read_text())["error"]
