"""Metric sinks: the TensorBoard tracker writes event files TensorBoard reads back; the W&B
tracker logs an offline run whose records hold the values; a missing package is a config error
naming the tracker and the extra to install."""

from __future__ import annotations

import importlib.util
import struct
import time
from pathlib import Path

import pytest

from ferryman.config import ConfigError, load_config
from ferryman.plugins import PluginHost

from conftest import BASE

STEPS = [{"reward/mean": 0.25, "staleness/token_hist/1": 3.0}, {"reward/mean": 0.5, "staleness/token_hist/1": 1.0}, {"reward/mean": 0.75, "nan/dropped": float("nan")}]


def _tracker(host: PluginHost, tmp_path: Path, spec: str):
    cfg, plugins = load_config(None, BASE + [f"trackers=[{spec}]", f"run_dir={tmp_path}"], host)
    return host.create("tracker", plugins["trackers"][0], run_dir=cfg.run_dir)


def test_tensorboard_event_files_read_back(host, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = _tracker(host, tmp_path, "{type: tensorboard}")
    for step, m in enumerate(STEPS, 1):
        t.log(m, step)
    t.close()
    with pytest.raises(RuntimeError, match="after close"):
        t.log({"x": 1.0}, 4)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["reward/mean", "staleness/token_hist/1"], "non-finite values are not logged"
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("staleness/token_hist/1")] == [(1, 3.0), (2, 1.0)]


def _wandb_records(path: Path) -> list:
    """Records of an offline W&B run file: a LevelDB-style log (32 KiB blocks, 7-byte chunk
    headers: crc32, length, type full/first/middle/last) of protobuf ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", "W&B run file header"
    block, pos, chunks, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # still being written
            break
        body = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            out.append(body)
        elif kind == 2:
            chunks = body
        elif kind == 3:
            chunks += body
        elif kind == 4:
            out.append(chunks + body)
    recs = []
    for raw in out:
        r = pb.Record()
        r.ParseFromString(raw)
        recs.append(r)
    return recs


@pytest.mark.slow
def test_wandb_offline_run_holds_the_values(host, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "config.yaml").write_text("seed: 7\n")
    t = _tracker(host, tmp_path, "{type: wandb, project: test, mode: offline}")
    for step, m in enumerate(STEPS, 1):
        t.log(m, step)
    t.close()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # W&B's service process may still be writing the file after finish() returned (seen on a
    # loaded machine): wait for the run's exit record
    deadline = time.monotonic() + 30
    while True:
        recs = _wandb_records(run_file)
        if any(r.WhichOneof("record_type") == "exit" for r in recs) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    history = []
    for r in recs:
        if r.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): i.value_json for i in r.history.item}
            history.append((int(items["_step"]), float(items["reward/mean"])))
    assert history == [(1, 0.25), (2, 0.5), (3, 0.75)]
    configs = [r.config for r in recs if r.WhichOneof("record_type") == "config"] + [r.run.config for r in recs if r.WhichOneof("record_type") == "run"]
    assert any(i.key == "seed" and i.value_json == "7" for c in configs for i in c.update), "the run's config.yaml is the W&B config"


@pytest.mark.parametrize("name,extra", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_missing_package_is_a_config_error(host, monkeypatch, name, extra):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == name else real(mod, *a))
    with pytest.raises(ConfigError, match=rf"trackers\.0: .*'{name}' tracker needs the '{name}' package: pip install 'ferryman\[{extra}\]'"):
        load_config(None, BASE + [f"trackers=[{{type: {name}}}]"], host)


def test_jsonl_lines_are_json_with_nonfinite_values_as_null(tmp_path):
    import json

    from ferryman.defaults.trackers import JsonlTracker

    t = JsonlTracker(tmp_path / "metrics.jsonl")
    t.log({"reward/mean": float("nan"), "actor/grad_norm": float("inf"), "loss": 0.5}, 1)
    t.log({"loss": 0.25}, 2)
    t.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()

    def strict(text):  # what JSON allows: no NaN / Infinity literals
        return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))

    rows = [strict(line) for line in lines]
    assert rows[0]["reward/mean"] is None and rows[0]["actor/grad_norm"] is None and rows[0]["loss"] == 0.5
    assert rows[0]["metrics/nonfinite"] == 2
    assert "metrics/nonfinite" not in rows[1]


def test_console_line_shows_failed_and_dropped_counts():
    import io

    from ferryman.defaults.trackers import ConsoleTracker

    out = io.StringIO()
    ConsoleTracker(["reward/mean"], stream=out).log(
        {"reward/mean": 0.5, "rollouter/failed_trajectories": 7.0, "rollouter/dropped_samples": 2.0}, 3
    )
    line = out.getvalue()
    assert "reward/mean=0.500" in line and "failed=7" in line and "dropped=2" in line


def test_console_line_has_step_of_total_rate_eta_and_a_bar_on_a_terminal(monkeypatch):
    import io

    from ferryman.defaults import trackers

    clock = iter([100.0, 110.0, 130.0, 140.0])
    monkeypatch.setattr(trackers.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    t = trackers.ConsoleTracker(["reward/mean"], stream=out, total_steps=10, tty=True)
    t.log({"reward/mean": 0.5, "perf/samples_per_s_avg": 2.25}, step=2)  # 10 s for 2 steps
    t.log({"val/pass@1": 0.25, "val/pass@4": 0.5, "val/weight_version": 2.0}, step=2)
    t.log({"reward/mean": 0.75}, step=10)
    first, val, last = out.getvalue().splitlines()
    assert first.startswith("step  2/10  [####----------------]   20.0%")
    assert "ETA 40s" in first and "2.25 samples/s" in first and "reward/mean=0.500" in first
    assert val == "validation at step 2 (weights v2): pass@1=0.250  pass@4=0.500"
    assert "done" in last and "[####################]" in last
    # not a terminal: no bar; a resumed run's ETA counts only its own steps
    out = io.StringIO()
    clock2 = iter([0.0, 30.0])
    monkeypatch.setattr(trackers.time, "monotonic", lambda: next(clock2))
    t = trackers.ConsoleTracker([], stream=out, total_steps=100, resume_step=50, tty=False)
    t.log({}, step=60)  # 10 steps in 30 s, 40 to go
    line = out.getvalue()
    assert "[" not in line and "step  60/100" in line and "ETA 2m00s" in line


def test_read_metrics_gives_the_rows_written_and_skips_a_torn_line(tmp_path):
    from ferryman.defaults.trackers import JsonlTracker, read_metrics

    assert read_metrics(tmp_path) == []  # no file yet
    t = JsonlTracker(tmp_path / "metrics.jsonl")
    t.log({"a": 1.0}, step=1)
    t.log({"a": 2.0}, step=2)
    t.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "a": 3.')  # a kill in the middle of a line
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["a"]) for r in rows] == [(1, 1.0), (2, 2.0)]
    assert read_metrics(tmp_path / "metrics.jsonl") == rows
