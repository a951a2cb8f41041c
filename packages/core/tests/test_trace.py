"""The event trace: the tracer's levels and schema, files of several processes merged into one
trace, the instrumented Rollouter / server client / MessageQueue / weight sync, and the numbers
and chart the timeline draws from a trace whose answers were worked out by hand."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ferryman import timeline, trace
from ferryman.cli import main
from ferryman.client import ServerClient
from ferryman.defaults.queue import MessageQueue
from ferryman.defaults.router import LocalRouter
from ferryman.defaults.weight_sync import ObjectStoreSync
from ferryman.engine_host import EngineHandle
from ferryman.rollouter import Rollouter
from ferryman.sync import Synchronizer
from ferryman.testing.doubles import EchoEngine, echo_weights
from ferryman.trace import TraceError, check_record, read_trace
from ferryman.types import SamplingParams

from helpers import EchoEnv


@pytest.fixture(autouse=True)
def _no_tracer_left_behind():
    yield
    trace.close()


def _events(run_dir: Path) -> list[dict]:
    return [r for r in read_trace(run_dir, strict=True) if r["ph"] != "M"]


# ----------------------------------------------------------------------------- the tracer


def test_levels_and_schema(tmp_path):
    trace.configure(tmp_path, "basic", proc="test")
    trace.instant("queue.put", uid="s1", qsize=1, wait=0.0)
    with trace.span("trainer.wait", step=1) as args:
        args["first_of_window"] = True
    trace.complete("client.piece", time.time(), 0.1, trace.DETAIL, request_id="r", replica="x", prompt_tokens=3, tokens=2, stop_reason="stop", cached_tokens=0)
    trace.close()
    recs = read_trace(tmp_path, strict=True)
    assert recs[0]["ph"] == "M" and recs[0]["args"] == {"schema": 1, "level": "basic", "proc": "test"}
    assert [r["name"] for r in recs[1:]] == ["queue.put", "trainer.wait"], "detail records are not written at basic"
    wait = recs[2]
    assert wait["ph"] == "X" and wait["dur"] >= 0 and wait["args"] == {"step": 1, "first_of_window": True}

    detail = tmp_path / "detail"
    trace.configure(detail, "detail", proc="test")
    trace.complete("client.piece", time.time(), 0.1, trace.DETAIL, request_id="r", replica="x", prompt_tokens=3, tokens=2, stop_reason="stop", cached_tokens=0)
    trace.close()
    assert [r["name"] for r in _events(detail)] == ["client.piece"]

    off = tmp_path / "off"
    trace.configure(off, "off")
    trace.instant("queue.put", uid="s1", qsize=1, wait=0.0)
    assert not trace.enabled() and not (off / "trace").exists()


def test_check_record_names_each_problem():
    good = {"ph": "i", "name": "queue.get", "ts": 1.0, "pid": 1, "proc": "q", "args": {"uid": "s", "qsize": 0, "wait": 0.0}}
    assert check_record(good) == []
    assert "unknown event name" in check_record({**good, "name": "queue.peek"})[0]
    assert "missing args ['qsize']" in check_record({**good, "args": {"uid": "s", "wait": 0.0}})[0]
    assert "ph must be 'i'" in check_record({**good, "ph": "X", "dur": 1.0})[0]
    span = {**good, "ph": "X", "name": "trainer.step", "args": {"step": 1, "version": 0}}
    assert "non-negative 'dur'" in check_record(span)[0]
    assert check_record({**span, "dur": 0.5}) == []
    assert "field 'ts'" in check_record({**good, "ts": "now"})[0]


def test_files_of_several_processes_merge_on_one_clock(tmp_path):
    trace.configure(tmp_path, proc="driver")
    trace.instant("run.start", mode="d", funnel={})
    code = (
        "import sys, time; from ferryman import trace\n"
        "trace.configure(sys.argv[1], 'basic', proc='queue')\n"
        "trace.instant('queue.put', uid='s1', qsize=1, wait=0.0)\n"
        "time.sleep(0.01); trace.instant('queue.get', uid='s1', qsize=0, wait=0.0)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60)
    trace.instant("run.end")
    trace.close()
    files = sorted(p.name.split("-")[0] for p in (tmp_path / "trace").glob("*.jsonl"))
    assert files == ["driver", "queue"]
    events = _events(tmp_path)
    assert [e["name"] for e in events] == ["run.start", "queue.put", "queue.get", "run.end"]
    assert len({e["pid"] for e in events}) == 2
    # a process killed mid-write leaves a torn last line: skipped, or reported when strict
    with next((tmp_path / "trace").glob("queue-*.jsonl")).open("a") as f:
        f.write('{"ph": "i", "name": "queue.pu')
    assert len(read_trace(tmp_path)) == 6
    with pytest.raises(TraceError, match="not JSON"):
        read_trace(tmp_path, strict=True)


def test_missing_trace_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(TraceError, match="no trace/ directory"):
        read_trace(tmp_path)
    assert main(["timeline", str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    assert "no trace/ directory" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


async def test_traced_decorator_on_threads_and_coroutines(tmp_path):
    trace.configure(tmp_path, proc="t")

    @trace.traced("sync_phase")
    def work(x):
        time.sleep(0.01)
        return x + 1

    @trace.traced("async_phase")
    async def awork(x):
        await asyncio.sleep(0.01)
        return x * 2

    assert await asyncio.gather(*(asyncio.to_thread(work, i) for i in range(4))) == [1, 2, 3, 4]
    assert await awork(3) == 6
    trace.close()
    phases = sorted(e["args"]["phase"] for e in _events(tmp_path))
    assert phases == ["async_phase"] + ["sync_phase"] * 4
    assert all(e["dur"] >= 0.009 for e in _events(tmp_path))


# ----------------------------------------------------------------------------- instrumentation


class _Backend:
    """Just enough of a trainer backend for the Synchronizer: the echo engine's one weight."""

    def __init__(self) -> None:
        self.shift = 1

    def iter_weight_buckets(self, bucket_bytes):
        yield echo_weights(self.shift)


async def test_pipeline_records_rollouter_client_queue_and_sync(tmp_path):
    """A real Rollouter, server client, MessageQueue and Synchronizer on echo engines, partial
    rollout on: every record is schema-valid, aborts are recorded and resumed trajectories end
    with tokens of two versions."""
    trace.configure(tmp_path, proc="test")
    engines = {f"r{i}": EngineHandle(f"r{i}", engine=EchoEngine(step_delay_s=0.01)) for i in range(2)}
    client = ServerClient(LocalRouter(list(engines)), engines, partial_rollout=True)
    queue = MessageQueue(6)
    r = Rollouter(env=EchoEnv(), client=client, queue=queue, n=2, sampling=SamplingParams(max_tokens=8), max_required_samples=6, max_concurrent_samples=3)
    sync = Synchronizer(backend=_Backend(), transport=ObjectStoreSync(), engines=list(engines.values()), rollouter=r, partial_rollout=True, bucket_bytes=1 << 20)
    fit = asyncio.create_task(r.fit())
    for version in (1, 2):
        for _ in range(2):
            assert await asyncio.wait_for(queue.get(), 10) is not None
        await asyncio.sleep(0.03)  # samples in flight: the sync cuts them
        await sync.update_weights(version)
    await asyncio.sleep(0.2)
    await r.stop()
    fit.cancel()
    trace.close()

    events = _events(tmp_path)
    names = {e["name"] for e in events}
    expected = {"rollouter.sample", "rollouter.traj", "rollouter.window", "client.generate", "client.abort", "client.resume"}
    assert expected | {"queue.put", "queue.get", "sync.update", "sync.step"} <= names
    steps = [e["args"]["step"] for e in events if e["name"] == "sync.step" and e["args"]["version"] == 1]
    assert steps == ["wait_rollouter", "pause", "release_kv", "transfer", "set_version", "resume", "reset_staleness"]
    gets = [e for e in events if e["name"] == "queue.get"]
    assert len(gets) == 4 and all(e["args"]["qsize"] >= 0 for e in gets)
    # every abort belongs to a trajectory that finished with tokens of more than one version
    trajs = {e["args"]["request_id"]: e for e in events if e["name"] == "rollouter.traj"}
    aborted = {e["args"]["request_id"] for e in events if e["name"] == "client.abort"}
    assert aborted, "the syncs cut generations in flight"
    finished = [rid for rid in aborted if rid in trajs and trajs[rid]["args"]["ok"]]
    assert finished and all(trajs[rid]["args"]["max_version"] > trajs[rid]["args"]["min_version"] for rid in finished)
    assert all(trajs[rid]["args"]["aborts"] >= 1 for rid in finished)
    windows = [e["args"] for e in events if e["name"] == "rollouter.window"]
    assert [w["version"] for w in windows] == [1, 2]


async def test_colocated_sleep_pauses_engines_without_abort(tmp_path):
    trace.configure(tmp_path, proc="test")
    engine = EchoEngine(step_delay_s=0.01)
    handle = EngineHandle("r0", engine=engine)
    sync = Synchronizer(backend=_Backend(), transport=ObjectStoreSync(), engines=[handle], rollouter=None, partial_rollout=False, bucket_bytes=1)
    running = asyncio.create_task(handle.generate("r-1", [1, 2], SamplingParams(max_tokens=5)))
    await asyncio.sleep(0.015)
    m = await sync.sleep_engines(0)
    out = await running
    assert out.stop_reason == "length" and len(out.token_ids) == 5, "sleep waits for generation in flight, never aborts it"
    assert engine._paused and m["sync/sleep_s"] > 0
    trace.close()
    (sleep,) = [e for e in _events(tmp_path) if e["name"] == "sync.sleep"]
    assert sleep["args"]["version"] == 0


# ----------------------------------------------------------------------------- the numbers


def _rec(ph, name, ts, dur=None, **args):
    r = {"ph": ph, "name": name, "ts": ts, "pid": 1, "proc": "synthetic", "args": args}
    if dur is not None:
        r["dur"] = dur
    return r


def synthetic_trace() -> list[dict]:
    """Two trainer steps, four samples (one resumed across a sync, one never taken), waits of
    each kind.

    time  100        104 105 106     109  110 111 112
    traj  T1 ====================|
          T2   [101 ====== 103]
          T3                    [106 ==x===== 110]          (aborted at 107)
          T4                           [108 =========== 111.3]
    train                  [104-105]          [109 ===== 111]
    sync                      [105-105.5]                 [111-111.5], waits for T4 until 111.3
    """
    T = "rollouter.traj"
    return [
        _rec("i", "run.start", 100.0, mode="d", funnel={}),
        _rec("X", T, 100.0, 4.0, uid="s1", request_id="r1", ok=True, min_version=0, max_version=0, tokens=10, aborts=0),
        _rec("X", T, 101.0, 2.0, uid="s2", request_id="r2", ok=True, min_version=0, max_version=0, tokens=10, aborts=0),
        _rec("X", T, 106.0, 4.0, uid="s3", request_id="r3", ok=True, min_version=0, max_version=1, tokens=12, aborts=1),
        _rec("X", T, 108.0, 3.3, uid="s4", request_id="r4", ok=True, min_version=1, max_version=1, tokens=5, aborts=0),
        _rec("i", "client.abort", 107.0, request_id="r3", replica="x", tokens=4, version=0),
        _rec("X", "rollouter.blocked", 104.0, 2.0, reason="quota"),
        _rec("i", "queue.put", 103.0, uid="s2", qsize=1, wait=0.0),
        _rec("i", "queue.put", 104.0, uid="s1", qsize=2, wait=0.0),
        _rec("i", "queue.get", 104.2, uid="s2", qsize=1, wait=0.0),
        _rec("i", "queue.get", 104.5, uid="s1", qsize=0, wait=0.0),
        _rec("i", "queue.put", 110.0, uid="s3", qsize=1, wait=0.0),
        _rec("i", "queue.get", 110.1, uid="s3", qsize=0, wait=0.0),
        _rec("i", "queue.put", 111.3, uid="s4", qsize=1, wait=0.0),
        _rec("i", "trainer.take", 104.2, uid="s2", version=0, min_version=0, max_version=0, aborts=0, tokens=10, token_versions={"0": 10}),
        _rec("i", "trainer.take", 104.5, uid="s1", version=0, min_version=0, max_version=0, aborts=0, tokens=10, token_versions={"0": 10}),
        _rec("i", "trainer.take", 110.1, uid="s3", version=1, min_version=0, max_version=1, aborts=1, tokens=12, token_versions={"0": 4, "1": 8}),
        _rec("X", "trainer.step", 100.0, 5.5, step=1, version=0),
        _rec("X", "trainer.wait", 100.0, 4.0, step=1, first_of_window=True),
        _rec("X", "trainer.train", 104.0, 1.0, step=1, version=0, local_step=1, samples=2, tokens=20),
        _rec("X", "sync.update", 105.0, 0.5, version=1),
        _rec("X", "sync.step", 105.0, 0.0, version=1, step="wait_rollouter", wait_for_active=True),
        _rec("X", "trainer.step", 105.5, 6.0, step=2, version=1),
        _rec("X", "trainer.wait", 105.5, 3.5, step=2, first_of_window=True),
        _rec("X", "trainer.train", 109.0, 2.0, step=2, version=1, local_step=1, samples=1, tokens=12),
        _rec("X", "sync.update", 111.0, 0.5, version=2),
        _rec("X", "sync.step", 111.0, 0.3, version=2, step="wait_rollouter", wait_for_active=True),
        _rec("X", "sync.step", 111.3, 0.2, version=2, step="transfer"),
    ]


def test_synthetic_trace_is_schema_valid():
    assert all(check_record(r) == [] for r in synthetic_trace())


def test_idle_ratios_and_staleness_histograms_by_hand():
    tl = timeline.build(synthetic_trace())
    s = timeline.stats(tl, 100.0, 112.0)
    assert s["range_s"] == pytest.approx(12.0)
    # trainer busy: training [104,105] + [109,111], weight updates [105,105.5] + [111.3,111.5]
    assert s["trainer_idle_ratio"] == pytest.approx(1 - 3.7 / 12)
    # rollouter busy [100,104] ∪ [101,103] ∪ [106,110] ∪ [108,111.3] = 4 + 5.3 of 12 s
    assert s["rollouter_idle_ratio"] == pytest.approx(1 - 9.3 / 12)
    # sample staleness = trainer version - oldest token version: s1 0, s2 0, s3 1
    assert s["staleness_sample_hist"] == {0: 2, 1: 1}
    # token staleness: s1, s2: 20 tokens of lag 0; s3: 8 tokens of lag 0 and 4 of lag 1
    assert s["staleness_token_hist"] == {0: 28, 1: 4}
    assert s["stale_sample_ratio"] == pytest.approx(1 / 3)
    assert s["partial_ratio"] == pytest.approx(1 / 3)
    assert s["version_span_mean"] == pytest.approx(1 / 3) and s["version_span_max"] == 1
    assert s["samples"] == 3 and s["steps"] == 2
    assert s["samples_per_s"] == pytest.approx(3 / 12) and s["tokens_per_s"] == pytest.approx(32 / 12)
    # waits: first batch 4 + 3.5; active tasks 0.3 (the second sync waits for T4);
    # last batch: quota-blocked [104,106] with nothing in flight, minus the sync [105,105.5]
    assert s["waits_s"] == pytest.approx({timeline.WAIT_FIRST: 7.5, timeline.WAIT_ACTIVE: 0.3, timeline.WAIT_LAST: 1.5})
    # sync time: the weight update after its wait for the Rollouter, 0.5 and 0.2 s
    assert s["syncs"] == 2 and s["sync_mean_s"] == pytest.approx(0.35)
    assert s["sync_steps_mean_s"] == pytest.approx({"transfer": 0.2, "wait_rollouter": 0.15})
    # queue length: 1 on [103,104], 2 on [104,104.2], 1 on [104.2,104.5], 1 on [110,110.1],
    # 1 on [111.3,112] (s4 is never taken)
    assert s["queue_len_mean"] == pytest.approx((1 + 0.4 + 0.3 + 0.1 + 0.7) / 12)


def test_timeline_model_of_the_synthetic_trace():
    tl = timeline.build(synthetic_trace())
    assert tl.mode == "d" and tl.t0 == 100.0
    by_rid = {t.request_id: t for t in tl.trajs}
    assert by_rid["r3"].resumed_from == 107.0 and by_rid["r1"].resumed_from is None
    assert {c.uid: c.kind for c in tl.cells} == {"s1": "fresh", "s2": "fresh", "s3": "resumed", "s4": "untaken"}
    assert {c.uid: c.get for c in tl.cells} == {"s1": 104.5, "s2": 104.2, "s3": 110.1, "s4": None}
    assert [(b.start, b.end) for b in tl.syncs] == [(105.0, 105.5), (111.3, 111.5)]
    assert [(w.kind, w.start, w.end) for w in tl.waits if w.kind == timeline.WAIT_LAST] == [
        (timeline.WAIT_LAST, 104.0, 105.0),
        (timeline.WAIT_LAST, 105.5, 106.0),
    ]
    assert tl.step_range(2) == (105.5, 111.5)
    # default range: after the first step (warm-up) to the end of the last
    s = timeline.stats(tl)
    assert s["range_s"] == pytest.approx(111.5 - 105.5) and s["steps"] == 1
    # the whole trace is counted too, and the warm-up step left out of the rates is named
    assert (s["warmup_steps"], s["trace_steps"], s["trace_samples"], s["trace_syncs"]) == (1, 2, 3, 2)
    assert timeline.stats(tl, 100.0, 112.0)["warmup_steps"] == 0
    assert timeline.sample_kind(3, 3, 3) == "fresh"
    assert timeline.sample_kind(3, 1, 1) == "stale"
    assert timeline.sample_kind(3, 1, 2) == "resumed"


def test_timeline_command_renders_a_png_and_a_chrome_trace(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "trace").mkdir()
    header = {"ph": "M", "name": "process", "ts": 99.0, "pid": 1, "proc": "synthetic", "args": {"schema": 1, "level": "basic", "proc": "synthetic"}}
    lines = [json.dumps(header)] + [json.dumps(r) for r in synthetic_trace()]
    (tmp_path / "trace" / "synthetic-1.jsonl").write_text("\n".join(lines) + "\n")
    png, chrome = tmp_path / "chart.png", tmp_path / "trace.json"
    assert main(["timeline", str(tmp_path), "-o", str(png), "--chrome", str(chrome)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    report = json.loads(capsys.readouterr().out)
    run = report["runs"][str(tmp_path)]
    assert run["mode"] == "d"
    assert (run["steps"], run["trace_steps"], run["trace_samples"], run["trace_syncs"]) == (1, 2, 3, 2)
    assert run["counted"] == "steps 2..2: steps/samples/syncs and the rates; the trace holds 2 steps, 3 samples, 2 syncs"
    events = json.loads(chrome.read_text())["traceEvents"]
    assert any(e["name"] == "trainer.train" and e["dur"] == pytest.approx(1e6) for e in events)


def test_version_counts_per_sample():
    from ferryman.metrics import mismatch_metrics, version_counts

    versions = torch.tensor([[-1, 2, 2, 3], [-1, 3, 3, -1], [-1, 1, -1, -1]])
    mask = (versions >= 0).float()
    groups = torch.tensor([0, 0, 1])
    assert version_counts(versions, mask, groups, 2) == [{2: 2, 3: 3}, {1: 1}]
    rollout = torch.zeros(3, 4)
    trainer_lp = torch.full((3, 4), -0.1)
    m = mismatch_metrics(rollout, trainer_lp, mask, versions, version=3)
    d = torch.tensor(-0.1)
    assert m["mismatch/kl_k1"] == pytest.approx(0.1)
    assert m["mismatch/kl_k3"] == pytest.approx(float(torch.expm1(d) - d))
    assert m["mismatch/kl_k3_fresh"] == pytest.approx(m["mismatch/kl_k3"]) and "mismatch/kl_k3_stale" in m
