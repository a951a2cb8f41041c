"""The main job on a two-node Ray cluster started on this machine (``ray start --head`` and a
second ``ray start --address=...`` with custom resources of its own; see
:mod:`ferryman.testing.ray_cluster`): the run joins it (``ray.address=auto`` with
``$RAY_ADDRESS``, as under ``ray job submit``), its roles land where their resources force
them, and a worker node that dies mid-run takes its replica with it while the run finishes with
every sample trained exactly once. A cluster that cannot hold the run is refused before anything
starts. Each test has a cluster of its own, stopped in teardown whatever happens."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ferryman.testing.ray_cluster import LocalRayCluster

ROOT = Path(__file__).resolve().parents[1]
STEPS, W = 8, 3


def _args(run_dir: Path, tiny_model: Path, extra: list[str]) -> list[str]:
    return [
        "train", str(ROOT / "examples/tiny_digits.yaml"),
        f"run_dir={run_dir}", f"model.path={tiny_model}", "model.build_tiny=false",
        f"training.total_steps={STEPS}", f"training.ppo_mini_batch_size={W}", f"rollout.total_rollout_steps={STEPS * W}",
        "rollout.n=4", "rollout.max_concurrency_per_replica=4", "checkpoint.every_steps=0", "trackers=[{type: jsonl}]",
        "env.num_tasks=40", *extra,
    ]


def _train(cluster: LocalRayCluster, args: list[str], timeout: float = 400) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ferryman.cli", *args], env=cluster.driver_env(), cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 400) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


def _node_with(summary: dict, resource: str) -> str:
    (node,) = [n["node_id"] for n in summary["cluster"]["nodes"] if n["resources"].get(resource)]
    return node


def _trained(summary: dict) -> list[str]:
    return [u for s in summary["steps"] for u in s["sample_uids"]]


@pytest.fixture
def cluster(tmp_path):
    c = LocalRayCluster(tmp_path, head_cpus=1, head_resources={"trainer_node": 1})
    with c:
        yield c


@pytest.mark.timeout(900)
def test_roles_land_on_the_nodes_their_resources_force(cluster, tmp_path, tiny_model):
    """Engines need ``rollout_node`` (only the worker has it), the trainer ``trainer_node`` (only
    the head); the Rollouter and the queue stay on the driver's node (the head). Weights go by
    the ``nccl`` transport (gloo on CPU): the engines on the worker node (127.0.0.2) reach the
    rendezvous and the metadata channel at the trainer node's address."""
    worker = cluster.add_node(num_cpus=2, resources={"rollout_node": 2})
    run_dir = tmp_path / "run"
    extra = [
        "ray.address=auto", "ray.engine.resources={rollout_node: 1}", "ray.trainer.resources={trainer_node: 1}",
        "weight_sync={type: nccl, backend: gloo, timeout_s: 60}",
    ]
    rc, out, err = _finish(_train(cluster, _args(run_dir, tiny_model, extra)))
    assert rc == 0, err[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    where = {role: p["node_id"] for role, p in summary["placement"].items()}
    rollout_node, trainer_node = _node_with(summary, "rollout_node"), _node_with(summary, "trainer_node")
    assert rollout_node != trainer_node
    assert where["replica-0"] == where["replica-1"] == rollout_node
    assert where["trainer"] == trainer_node and where["rollouter"] == trainer_node, where
    assert summary["placement"]["replica-0"]["address"] == worker.ip, "the worker node's own address"
    assert len(summary["steps"]) == STEPS and len(set(_trained(summary))) == STEPS * W
    assert len(summary["syncs"]) >= STEPS - 1 and summary["lost_replicas"] == []
    assert summary["placement"]["trainer"]["address"] == cluster.head_ip != worker.ip


@pytest.mark.timeout(900)
def test_a_cluster_that_cannot_hold_the_run_is_refused_before_anything_starts(cluster, tmp_path, tiny_model):
    """Three replicas that each need a ``rollout_node`` on a cluster that has two: a clear error
    naming what is missing (exit 2), not a placement group pending for ever."""
    cluster.add_node(num_cpus=2, resources={"rollout_node": 2})
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    extra = ["rollout.num_replicas=3", "ray.engine.resources={rollout_node: 1}"]
    rc, out, err = _finish(_train(cluster, _args(run_dir, tiny_model, extra)), timeout=300)
    assert rc == 2, err[-3000:]
    assert "cannot hold this run" in err and "missing rollout_node: 3 wanted, 2 in the cluster" in err, err[-3000:]
    assert "Traceback" not in err
    assert not (run_dir / "metrics.jsonl").exists()
    assert time.monotonic() - t0 < 240


@pytest.mark.timeout(900)
def test_a_worker_node_dies_its_replica_is_quarantined_and_the_run_finishes(cluster, tmp_path, tiny_model):
    """``STRICT_SPREAD``: replica-0 and replica-1 on different nodes, the trainer on the head.
    The worker node is killed (raylet and workers, SIGKILL) after the second trainer step: the
    replica there is lost, its requests fail over to the other replica, weight syncs drop it,
    and the run trains every admitted sample once: nothing lost, nothing twice."""
    worker = cluster.add_node(num_cpus=1)
    run_dir = tmp_path / "run"
    extra = [
        "ray.placement_strategy=STRICT_SPREAD", "ray.engine.num_cpus=1", "ray.trainer.resources={trainer_node: 1}",
        # generation (4 tokens of 1 s) much slower than a trainer step: each window's requests
        # are still in flight when the previous step's metrics are written, so the kill
        # catches some on the lost replica (at 0.3 s a token, the windows were done by then)
        "engine.step_delay_s=1.0", "rollout.max_tokens=4",
    ]
    proc = _train(cluster, _args(run_dir, tiny_model, extra))
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before the node could be killed"
    cluster.kill_node(worker)
    rc, out, err = _finish(proc)
    assert rc == 0, err[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    lost_node = next(n["node_id"] for n in summary["cluster"]["nodes"] if not n["alive"])
    on_worker = [r for r, p in summary["placement"].items() if r.startswith("replica-") and p["node_id"] == lost_node]
    assert len(on_worker) == 1, summary["placement"]
    assert summary["lost_replicas"] == on_worker, "weight syncs dropped the lost replica"
    r = summary["rollouter"]
    assert r["client/failovers"] >= 1, "the requests the lost replica was serving went elsewhere"
    assert r["rollouter/failed_trajectories"] == 0 and r["rollouter/dropped_samples"] == 0
    uids = _trained(summary)
    assert [s["step"] for s in summary["steps"]] == list(range(1, STEPS + 1))
    assert len(uids) == len(set(uids)) == STEPS * W, "nothing trained twice, nothing lost"
    trajectories = STEPS * W * 4
    assert r["rollouter/runs_dispatched"] == r["rollouter/runs_finished"] == trajectories


def test_the_kuberay_example_is_a_valid_run():
    """The RayJob's entrypoint parses (as the shell splits it) into a valid run config whose
    custom resources are the ones its pod groups advertise."""
    import shlex

    import yaml

    from ferryman.cluster import plan_placement
    from ferryman.config import load_config

    job, _pvc = yaml.safe_load_all((ROOT / "examples/cluster/rayjob.yaml").read_text())
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["ferryman", "train"]
    config = ROOT / "examples" / Path(argv[2]).name
    cfg, _ = load_config(config, argv[3:])
    plan = plan_placement(cfg)
    groups = {g["groupName"]: json.loads(json.loads(g["rayStartParams"]["resources"])) for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert plan.engine_bundle["rollout_node"] == 1 and groups["rollout"]["rollout_node"] >= 1
    assert plan.trainer_bundle == {"trainer_node": 1.0} and groups["trainer"] == {"trainer_node": 1}
    replicas = {g["groupName"]: g["replicas"] for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert cfg.rollout.num_replicas <= replicas["rollout"] * groups["rollout"]["rollout_node"]


@pytest.mark.timeout(1200)
def test_the_trainers_node_dies_the_run_stops_and_resumes_on_a_new_cluster(tmp_path, tiny_model):
    """The trainer on the worker node (``trainer_node``), the engines on the head
    (``rollout_node``), a checkpoint every step. The worker node is killed after step 3: the
    run stops (exit 1) naming the trainer and the checkpoint to resume from. ``--resume`` on a
    new cluster (one node that has both resources, another address) finishes the run: every
    step once, every sample trained once."""
    run_dir = tmp_path / "run"
    extra = [
        "ray.engine.resources={rollout_node: 1}", "ray.engine.num_cpus=0.5", "ray.trainer.resources={trainer_node: 1}",
        "checkpoint.every_steps=1", "checkpoint.keep=2",
    ]
    with LocalRayCluster(tmp_path, head_cpus=1, head_resources={"rollout_node": 2}) as first:
        worker = first.add_node(num_cpus=1, resources={"trainer_node": 1})
        proc = _train(first, _args(run_dir, tiny_model, extra))
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before the node could be killed"
        first.kill_node(worker)
        rc, out, err = _finish(proc)
    assert rc == 1, err[-4000:]
    assert "the trainer died" in err and "--resume" in err and "checkpoints/step-" in err, err[-3000:]
    error = json.loads((run_dir / "summary.json").read_text())["error"]
    assert "checkpoints/step-" in error

    with LocalRayCluster(tmp_path, head_cpus=2, head_resources={"rollout_node": 2, "trainer_node": 1}) as second:
        rc, out, err = _finish(_train(second, ["train", "--resume", str(run_dir)]))
    assert rc == 0, err[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed"]["step"] >= 2
    assert [s["step"] for s in summary["steps"]] == list(range(1, STEPS + 1))
    uids = _trained(summary)
    assert len(uids) == len(set(uids)) == STEPS * W, "nothing trained twice, nothing lost"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "each step logged once"
