"""Config: YAML + dotted overrides, plugin sections by type, errors that name the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ferryman.config import ConfigError, RunConfig, apply_overrides, load_config

from conftest import BASE

ROOT = Path(__file__).resolve().parents[3]


def test_dotted_overrides_parse_values():
    data = apply_overrides({}, ["async_training.staleness_threshold=0.5", "rollout.n=8", "async_training.partial_rollout=true", "run_dir=runs/x"])
    assert data == {"async_training": {"staleness_threshold": 0.5, "partial_rollout": True}, "rollout": {"n": 8}, "run_dir": "runs/x"}


def test_override_without_equals_is_refused():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        apply_overrides({}, ["rollout.n"])


def test_override_into_scalar_is_refused():
    with pytest.raises(ConfigError, match="seed is not a section"):
        apply_overrides({"seed": 1}, ["seed.x=2"])


def test_yaml_and_overrides(tmp_path, host):
    p = tmp_path / "c.yaml"
    p.write_text("seed: 3\nasync_training:\n  trigger_parameter_sync_step: 2\nqueue: {type: local}\n")
    cfg, plugins = load_config(p, BASE + ["async_training.staleness_threshold=0.25"], host)
    assert cfg.seed == 3
    assert cfg.async_training.trigger_parameter_sync_step == 2
    assert cfg.async_training.staleness_threshold == 0.25
    assert cfg.async_training.mode == "c"
    assert plugins["queue"].type == "local"


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["async_training.staleness_threshold=-1"], "async_training.staleness_threshold"),
        (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator: Input should be 'grpo' or 'gae' (allowed: 'grpo' or 'gae')"),
        (["rollout.nn=3"], "rollout.nn: unknown field"),
        (["training.total_steps=zero"], "training.total_steps"),
        (["async_training.partial_rollout=true"], "partial_rollout=True with staleness_threshold=0 is meaningless"),
        (["queue.type=redis"], "queue.type: unknown queue 'redis' (allowed: local, ray)"),
        (["env.num_tasks=0"], "env.num_tasks"),
        (["env.digits=abc"], "env.digits"),
        (["router.sticky_capacity=big"], "router.sticky_capacity"),
        (["trackers=[{type: nope}]"], "trackers.0.type: unknown tracker 'nope'"),
        (["async_training.colocated=true", "async_training.staleness_threshold=0.5"], "colocated=True: generation and training take turns"),
        (["trace.level=verbose"], "trace.level: Input should be 'off', 'basic' or 'detail'"),
        (["training.mismatch_kl_every=-1"], "training.mismatch_kl_every"),
    ],
)
def test_bad_config_names_the_field(host, overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, BASE + overrides, host)
    assert needle in str(e.value)


def test_missing_plugin_type_lists_allowed(host):
    with pytest.raises(ConfigError, match=r"weight_sync.type: missing \(allowed: object_store\)"):
        load_config(None, BASE + ["weight_sync={verify: true}"], host)


def test_unknown_engine_lists_installed(host):
    with pytest.raises(ConfigError, match=r"engine.type: unknown engine 'vllm' \(allowed: echo\)"):
        load_config(None, ["engine={type: vllm}", "trainer={type: echo}"], host)


def test_missing_file_and_bad_yaml(tmp_path, host):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", [], host)
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, [], host)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(lst, [], host)


@pytest.mark.parametrize(
    "knobs,mode",
    [
        ({"trigger_parameter_sync_step": 1, "staleness_threshold": 0}, "a"),
        ({"trigger_parameter_sync_step": 4, "staleness_threshold": 0}, "b"),
        ({"trigger_parameter_sync_step": 2, "staleness_threshold": 0.5}, "c"),
        ({"trigger_parameter_sync_step": 1, "staleness_threshold": 1.0, "partial_rollout": True}, "d"),
    ],
)
def test_three_knobs_give_four_modes(knobs, mode):
    assert RunConfig.model_validate({"async_training": knobs}).async_training.mode == mode


def test_colocated_is_a_mode_of_its_own():
    at = RunConfig.model_validate({"async_training": {"colocated": True, "trigger_parameter_sync_step": 4}}).async_training
    assert at.mode == "colocated"
    assert RunConfig().trace.level == "basic", "every run is traced unless told otherwise"


def test_every_example_config_parses():
    # examples/cluster holds Kubernetes manifests (KubeRay), not run configs
    examples = sorted(p for p in (ROOT / "examples").rglob("*.yaml") if "cluster" not in p.relative_to(ROOT / "examples").parts)
    if not examples:
        pytest.skip("examples are not shipped with this install")
    for path in examples:
        cfg, _ = load_config(path, [], None)
        assert cfg.training.total_steps >= 1, path


# ----------------------------------------------------------------------------- GPU shares


@pytest.mark.parametrize(
    "overrides",
    [
        # one H200: two engine replicas and the Trainer share it
        ["ray_num_gpus=1", "rollout.num_replicas=2", "rollout.num_gpus_per_replica=0.3", "ray.trainer.num_gpus=0.4"],
        # two GPUs: the engines share one, the Trainer has the other
        ["ray_num_gpus=2", "rollout.num_replicas=2", "rollout.num_gpus_per_replica=0.5", "ray.trainer.num_gpus=1"],
        # 3 x 0.6 cannot share, but fit three GPUs one each
        ["ray_num_gpus=3", "rollout.num_replicas=3", "rollout.num_gpus_per_replica=0.6"],
        # no ray_num_gpus: only Ray's own rule is checked
        ["rollout.num_replicas=4", "rollout.num_gpus_per_replica=0.5", "ray.trainer.num_gpus=0.5"],
    ],
)
def test_gpu_shares_that_fit(overrides):
    cfg, _ = load_config(None, overrides)
    assert cfg.ray.trainer.num_gpus <= 1


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["ray_num_gpus=1", "rollout.num_replicas=2", "rollout.num_gpus_per_replica=0.4", "ray.trainer.num_gpus=0.3"], "rollout.num_gpus_per_replica / ray.trainer.num_gpus"),
        (["ray_num_gpus=2", "rollout.num_replicas=3", "rollout.num_gpus_per_replica=0.6"], "rollout.num_gpus_per_replica / ray.trainer.num_gpus"),
        (["ray_num_gpus=1", "rollout.num_gpus_per_replica=1", "ray.trainer.num_gpus=1"], "whole-GPU requests alone take 2"),
        (["rollout.num_gpus_per_replica=1.5"], "rollout.num_gpus_per_replica"),
        (["ray.trainer.num_gpus=2.5"], "ray.trainer.num_gpus"),
    ],
)
def test_gpu_shares_that_cannot_fit_fail_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config(None, overrides)


def test_a_run_directorys_preset_model_section_validates_again():
    """``--resume`` re-reads the run's config.yaml: a tiny_preset model section must validate
    again and mean the same model, whether written whole (older runs) or as given."""
    from ferryman.config import ModelConfig

    m = ModelConfig(path="x", build_tiny=True, tiny_preset="qwen2.5-0.5b", tiny_dtype="bfloat16")
    ModelConfig.model_validate(m.model_dump(mode="json"))  # the whole section, defaults and all
    again = ModelConfig.model_validate(m.model_dump(mode="json", exclude_unset=True))
    assert again.tiny_build_kwargs(0) == m.tiny_build_kwargs(0)
    with pytest.raises(ValueError, match="tiny_hidden_size"):
        ModelConfig(path="x", tiny_preset="qwen2.5-0.5b", tiny_hidden_size=128)
