"""Before anything starts: the env is built once and must have a task whose ``get_task(0)`` is
JSON (``ferryman train`` and ``ferryman config``); config errors suggest the field or plugin
name meant, and say when a plugin is there but disabled."""

from __future__ import annotations

import importlib.metadata as md

import pytest

# these build the tiny model (core alone, as in `nox -s core`, has no transformers)
pytest.importorskip("transformers")

from ferryman.cli import main
from ferryman.config import ConfigError, RunConfig, load_config, validate_plugin_section
from ferryman.plugins import PluginHost

from conftest import BASE

PLUGIN = ["engine={type: echo}", "trainer={type: echo}", "runtime=inline"]


@pytest.fixture
def cli_env(monkeypatch, tmp_path):
    """`ferryman` as a user runs it, with the test module as a plugin; model built in tmp."""
    monkeypatch.setenv("FERRYMAN_PLUGINS", "checks_plugin")
    monkeypatch.setenv("FERRYMAN_DISABLE_PLUGINS", "*")  # only core and the test module
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run_dir: {tmp_path / 'run'}\nmodel: {{path: {tmp_path / 'model'}, build_tiny: true}}\nenv: {{type: list_env}}\n")
    return cfg


def test_config_prints_plugin_sections_with_their_defaults(cli_env, capsys):
    assert main(["config", str(cli_env), *PLUGIN]) == 0
    out = capsys.readouterr().out
    # the env's own fields with their defaults (not just `type: list_env`), and the trackers'
    assert "env:\n  type: list_env\n  num_tasks: 3\n  task_kind: json\n" in out
    assert "trackers:\n- type: jsonl\n  filename: metrics.jsonl\n" in out
    assert "env_tasks: 3" in out
    assert not (cli_env.parent / "model").exists(), "config builds nothing in place"


@pytest.mark.parametrize("command", ["config", "train"])
def test_an_env_without_tasks_fails_before_anything_starts(cli_env, capsys, command):
    assert main([command, str(cli_env), *PLUGIN, "env.num_tasks=0"]) == 2
    err = capsys.readouterr().err
    assert "ferryman: error: env: the 'list_env' env has no tasks (num_tasks() returned 0); a run needs at least one" in err
    assert "resume" not in err
    assert not (cli_env.parent / "run").exists(), "no run directory, no Ray, no engine"


def test_a_task_that_is_not_json_fails_before_anything_starts(cli_env, capsys):
    assert main(["config", str(cli_env), *PLUGIN, "env.task_kind=set"]) == 2
    err = capsys.readouterr().err
    assert "env: get_task(0) of the 'list_env' env is not JSON (dict: Object of type set is not JSON serializable)" in err


@pytest.mark.parametrize(
    "override,needle",
    [
        ("rollout.nn=3", "rollout.nn: unknown field (did you mean 'n'?)"),
        ("rolout.n=3", "rolout: unknown field (did you mean 'rollout'?)"),
        ("rollout.failures.max_consecutiv=3", "rollout.failures.max_consecutiv: unknown field (did you mean 'max_consecutive'?)"),
        ("env.num_task=3", "env.num_task: unknown field (did you mean 'num_tasks'?)"),
        ("env.type=digit", "env.type: unknown env 'digit' (did you mean 'digits'?) (allowed: digits, sequence)"),
        ("trackers=[{type: jsnl}]", "trackers.0.type: unknown tracker 'jsnl' (did you mean 'jsonl'?)"),
        ("env.zzz=3", "env.zzz: unknown field\n"),
    ],
)
def test_mistyped_names_get_a_suggestion(host, override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, BASE + [override], host)
    assert needle in str(err.value) + "\n"


def test_a_disabled_plugin_is_named_as_disabled(monkeypatch):
    # a real entry point (as an installed distribution declares it) to the test module
    ep = md.EntryPoint(name="env_lists", value="checks_plugin", group="ferryman")
    monkeypatch.setattr("ferryman.plugins.md.entry_points", lambda group: [ep] if group == "ferryman" else [])
    monkeypatch.setenv("FERRYMAN_DISABLE_PLUGINS", "env_lists")
    host = PluginHost()
    with pytest.raises(ConfigError) as err:
        validate_plugin_section(host, "env", "env", {"type": "list_env"})
    assert "env.type: env 'list_env' is registered by plugin 'env_lists'" in str(err.value)
    assert "disabled by FERRYMAN_DISABLE_PLUGINS=env_lists" in str(err.value)
    monkeypatch.delenv("FERRYMAN_DISABLE_PLUGINS")
    assert "list_env" in PluginHost().specs("env")


def test_run_refuses_an_env_without_tasks_before_the_run_directory(tmp_path, host):
    from ferryman.runner import run

    import checks_plugin

    host = PluginHost(load_entry_points=False, extra_plugins=(checks_plugin,))
    cfg, _ = load_config(None, [*PLUGIN, f"run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'm'}", "model.build_tiny=true",
                                "env={type: list_env, num_tasks: 0}"], host)
    assert isinstance(cfg, RunConfig)
    with pytest.raises(ConfigError, match="has no tasks"):
        run(cfg, host)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("verbose", [False, True])
def test_rays_token_authentication_warning_shows_only_with_verbose(verbose, capsys):
    import logging

    auth = pytest.importorskip("ray._private.authentication.authentication_token_setup")
    from ferryman.runner import RAY_AUTH_LOGGER, quiet_ray_auth_warning

    logger = logging.getLogger(RAY_AUTH_LOGGER)
    old, old_ferryman = logger.level, logging.getLogger("ferryman").level
    logging.getLogger("ferryman").setLevel(logging.DEBUG if verbose else logging.WARNING)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        quiet_ray_auth_warning()
        auth._warn_token_auth_enabled()  # what ray.init calls for a new local cluster
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
        logging.getLogger("ferryman").setLevel(old_ferryman)
    assert bool(seen) == verbose and all("Token authentication is enabled" in m for m in seen)
