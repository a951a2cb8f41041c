"""Cluster placement without a cluster: the capacity check, the bundles a config asks for, the
address a run joins, and the config errors (the two-node runs are in tests/test_cluster.py)."""

from __future__ import annotations

import pytest

from ferryman.cluster import ClusterCapacityError, NodeInfo, check_capacity, plan_placement, resolve_address
from ferryman.config import ConfigError, load_config

GPU_NODES = [
    NodeInfo("a" * 16, "10.0.0.1", {"CPU": 16, "GPU": 8, "accelerator_type:H100": 1}),
    NodeInfo("b" * 16, "10.0.0.2", {"CPU": 16, "GPU": 8, "accelerator_type:H100": 1, "rollout_node": 1}),
]


def test_a_run_that_fits_gets_a_layout():
    layout = check_capacity(GPU_NODES, engine_bundle={"CPU": 1, "GPU": 2}, num_engines=8, trainer_bundle={"CPU": 4})
    assert sum(layout["engines"].values()) == 8 and layout["trainer"] in {"a" * 16, "b" * 16}


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        (dict(engine_bundle={"CPU": 1, "GPU": 2}, num_engines=9), "missing GPU: 18 wanted, 16 in the cluster"),
        # the trainer's GPU leaves 15: one replica short
        (dict(engine_bundle={"GPU": 2}, num_engines=8, trainer_bundle={"GPU": 1}), "the nodes hold 7 besides the trainer's {GPU: 1}"),
        # tensor parallel 16 on nodes of 8: a replica never spans nodes
        (dict(engine_bundle={"GPU": 16}, num_engines=1), "no node can hold one engine replica's {GPU: 16} (GPU: 16 wanted, at most 8 on one node)"),
        (dict(engine_bundle={"GPU": 4}, num_engines=3, strategy="STRICT_SPREAD"), "3 nodes that each hold one bundle are needed"),
        (dict(engine_bundle={"GPU": 4}, num_engines=3, strategy="STRICT_PACK"), "one node that holds them all is needed"),
        (dict(engine_bundle={"GPU": 1, "rollout_node": 1}, num_engines=2), "missing rollout_node: 2 wanted, 1 in the cluster"),
        (dict(engine_bundle={"GPU": 1, "accelerator_type:A100": 0.001}, num_engines=1), "needs resource 'accelerator_type:A100' and no node has it"),
        (dict(engine_bundle={"GPU": 1}, num_engines=1, trainer_bundle={"GPU": 9}), "no node can hold the trainer's {GPU: 9} (GPU: 9 wanted, at most 8 on one node)"),
    ],
)
def test_what_does_not_fit_is_named(kw, says):
    with pytest.raises(ClusterCapacityError) as e:
        check_capacity(GPU_NODES, **kw)
    assert says in str(e.value), str(e.value)
    assert "10.0.0.1" in str(e.value) and "10.0.0.2" in str(e.value), "the nodes are listed"
    assert isinstance(e.value, ConfigError)


def test_strategies_that_fit():
    assert check_capacity(GPU_NODES, engine_bundle={"GPU": 4}, num_engines=2, strategy="STRICT_PACK")
    assert check_capacity(GPU_NODES, engine_bundle={"GPU": 8}, num_engines=2, strategy="STRICT_SPREAD")
    # the trainer's bundle goes where the engines leave room
    check_capacity(GPU_NODES, engine_bundle={"GPU": 8}, num_engines=1, trainer_bundle={"GPU": 8})
    with pytest.raises(ClusterCapacityError):
        check_capacity(GPU_NODES, engine_bundle={"GPU": 8}, num_engines=2, trainer_bundle={"GPU": 1})
    with pytest.raises(ClusterCapacityError, match="no alive node"):
        check_capacity([], engine_bundle={"CPU": 1}, num_engines=1)


def test_bundles_from_the_config():
    cfg, _ = load_config(None, [
        "rollout.num_replicas=4", "rollout.num_gpus_per_replica=2", "ray.engine.num_cpus=2", "ray.engine.accelerator_type=H100",
        "ray.engine.resources={rollout_node: 1}", "ray.trainer.num_gpus=1", "ray.trainer.num_cpus=4", "ray.placement_strategy=SPREAD",
    ])
    plan = plan_placement(cfg)
    assert plan.engine_bundle == {"CPU": 2.0, "GPU": 2.0, "rollout_node": 1.0, "accelerator_type:H100": 0.001}
    assert plan.trainer_bundle == {"CPU": 4.0, "GPU": 1.0}
    assert plan.num_engines == 4 and plan.strategy == "SPREAD" and plan.local_cpus() == 12
    default, _ = load_config(None, [])
    assert plan_placement(default).engine_bundle == {} and plan_placement(default).trainer_bundle == {}, "nothing reserved on a laptop"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("ray.placement_strategy=SOMEWHERE", "ray.placement_strategy"),
        ("ray.engine.resources={GPU: 1}", "ray.engine.resources"),
        ("ray.trainer.resources={x: 0}", "ray.trainer.resources"),
        ("ray.address=' '", "ray.address"),
        ("ray.engine.num_cpus=-1", "ray.engine.num_cpus"),
        ("ray.nodes=3", "ray.nodes"),
    ],
)
def test_bad_ray_sections_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [override])


def test_the_address_a_run_joins(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert resolve_address(None) is None  # a local Ray
    assert resolve_address("auto") == "auto"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # what `ray job submit` sets
    assert resolve_address(None) == "10.0.0.1:6379"
    assert resolve_address("ray://head:10001") == "ray://head:10001", "the config wins"


@pytest.mark.parametrize(("address", "says"), [("127.0.0.1:1", "nothing answers at '127.0.0.1:1'"), ("ray://127.0.0.1:1", "nothing answers"), ("headnode", "is not 'auto'")])
def test_a_cluster_address_nothing_answers_at_fails_fast(address, says):
    """``ray.init`` would retry a dead address for minutes: the run says so at once."""
    import socket

    with socket.socket() as s:  # make sure port 1 refuses (nothing listens on it)
        assert s.connect_ex(("127.0.0.1", 1)) != 0
    from ferryman.cluster import connect

    with pytest.raises(ConfigError, match="ray.address") as e:
        connect(address, num_cpus=1, namespace=None, env_vars={})
    assert says in str(e.value)


def test_under_ray_job_submit_the_jobs_own_env_vars_win(monkeypatch):
    """Ray refuses a driver runtime env that sets a variable the submitted job's runtime env
    sets too: those are left to the job."""
    import json

    from ferryman.cluster import job_env_vars

    ours = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert job_env_vars(ours) == ours
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"env_vars": {"OMP_NUM_THREADS": "8"}, "working_dir": "x"}}))
    assert job_env_vars(ours) == {"TOKENIZERS_PARALLELISM": "false"}
