"""bench/engine_repeated.py's CPU-side logic: the interleaved order, the ratios and their
median, the results file's schema, the agentic sessions and their driver."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("engine_repeated", ROOT / "bench" / "engine_repeated.py")
er = importlib.util.module_from_spec(_spec)
sys.modules["engine_repeated"] = er  # dataclasses look their module up there
_spec.loader.exec_module(er)


def test_order_is_raw_wrapper_wrapper_raw():
    order = er.interleaved_order(["raw", "thread", "process"], 5)
    assert [v for _, v in order[:7]] == ["raw", "thread", "process", "process", "thread", "raw", "raw"]
    assert [r for r, _ in order] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3
    for v in ("raw", "thread", "process"):
        assert sum(1 for _, x in order if x == v) == 5
    with pytest.raises(ValueError):
        er.interleaved_order(["raw", "raw"], 2)
    with pytest.raises(ValueError):
        er.interleaved_order(["raw"], 0)


def _runs(tps: dict[str, list[float]]) -> list[dict]:
    runs = [{"rep": -1, "variant": v, "warmup": True, "tokens_per_s": 1.0} for v in tps]  # warm-ups never count
    for v, xs in tps.items():
        runs += [{"rep": k, "variant": v, "warmup": False, "tokens_per_s": x} for k, x in enumerate(xs)]
    return runs


def test_ratios_pair_each_rep_with_its_raw():
    runs = _runs({"raw": [100, 200, 100, 100, 50], "thread": [95, 190, 100, 80, 50], "process": [90, 200]})
    r = er.ratios_by_rep(runs)
    assert r["thread"] == [0.95, 0.95, 1.0, 0.8, 1.0]
    assert r["process"] == [0.9, 1.0]
    s = er.summarize(r["thread"])
    assert s["median"] == 0.95 and s["min"] == 0.8 and s["max"] == 1.0
    assert s["meets_aim"] is False  # one repetition under 0.90
    assert er.summarize([0.96, 0.91, 1.2])["meets_aim"] is True
    assert er.summarize([0.94, 0.99, 0.93])["meets_aim"] is False  # median under 0.95
    with pytest.raises(ValueError):
        er.summarize([])


def _file(workload: str, device: str = "NVIDIA H100 80GB HBM3, 81559 MiB") -> dict:
    return {"device": device, "workload": workload, "runs": _runs({"raw": [100, 100, 100, 100, 100],
                                                                    "thread": [99, 97, 101, 96, 98],
                                                                    "process": [91, 92, 95, 93, 94]})}


def test_report_schema_and_device():
    rep = er.build_report([_file("batch"), _file("agentic")])
    assert rep["device"] == "NVIDIA H100 80GB HBM3, 81559 MiB"
    assert {(r["core"], r["workload"]) for r in rep["rows"]} == {(c, w) for c in ("thread", "process") for w in ("batch", "agentic")}
    for row in rep["rows"]:
        assert row["engine"] == "vllm" and len(row["ratios"]) == 5
    json.loads(json.dumps(rep))
    er.validate_results(rep)
    bad = json.loads(json.dumps(rep))
    bad["rows"][0]["median"] = 0.5
    with pytest.raises(ValueError, match="median"):
        er.validate_results(bad)
    for broken in ({"rows": rep["rows"]}, {"device": "", "rows": rep["rows"]}, {"device": "x", "rows": []},
                   {"device": "x", "rows": [{**rep["rows"][0], "workload": "chat"}]},
                   {"device": "x", "rows": [{**rep["rows"][0], "ratios": [1]}]}):
        with pytest.raises(ValueError):
            er.validate_results(broken)
    with pytest.raises(ValueError, match="different devices"):
        er.build_report([_file("batch"), _file("agentic", device="NVIDIA H200, 143771 MiB")])


def test_md_names_device_and_each_rep(tmp_path):
    files = [_file("batch"), _file("agentic")]
    for f, w in zip(files, ("batch", "agentic"), strict=True):
        f.update(variants=["raw", "thread", "process"], command=f"engine_repeated.py run --workload {w}",
                 servers={v: {"start_s": 1.0, "resolved": {}} for v in ("raw", "thread", "process")},
                 args={"num_prompts": 4, "prompt_len": 2, "max_tokens": 3, "sessions": 2, "turns": 8, "max_tokens_turn": 4,
                       "system_len": 1, "task_len": 1, "obs_min": 1, "obs_max": 2})
        for i, r in enumerate(f["runs"]):
            r.update(seq=i, wall_s=12.0, generated_tokens=10)
    md = er.render_md(er.build_report(files), files, "cmd")
    assert "NVIDIA H100 80GB HBM3, 81559 MiB" in md and "SGLang rows were not run" in md
    assert "| 3 | " in md and "0.960" in md  # rep 3: thread 96 / raw 100


def test_sessions_share_and_grow_their_prefixes():
    sessions = er.agentic_sessions(256, 8, system_len=16, task_len=4, obs_min=2, obs_max=5, seed=3)
    assert len(sessions) == 256 and len({s.sid for s in sessions}) == 256
    assert len({s.system for s in sessions}) == 1 and len({s.task for s in sessions}) > 1
    assert all(len(s.observations) == 7 and all(2 <= len(o) <= 5 for o in s.observations) for s in sessions)
    assert all(er.TOKEN_LOW <= t < er.TOKEN_HIGH for s in sessions for o in (s.system, s.task, *s.observations) for t in o)
    again = er.agentic_sessions(256, 8, system_len=16, task_len=4, obs_min=2, obs_max=5, seed=3)
    assert again == sessions
    assert er.agentic_sessions(256, 8, system_len=16, task_len=4, obs_min=2, obs_max=5, seed=4)[0].system != sessions[0].system

    prompts: dict[str, list[list[int]]] = {}

    async def generate(sid: str, turn: int, prompt: list[int]) -> list[int]:
        prompts.setdefault(sid, []).append(list(prompt))
        assert turn == len(prompts[sid]) - 1
        await asyncio.sleep(0)
        return [7 + turn] * 3  # three tokens a turn

    res = asyncio.run(er.run_agentic(generate, sessions))
    assert res["generated_tokens"] == 256 * 8 * 3 and res["requests"] == 256 * 8
    for s in sessions:
        ps = prompts[s.sid]
        assert len(ps) == 8
        assert ps[0] == list(s.system) + list(s.task)
        for t in range(7):  # turn t+1 = turn t's prompt + its 3 tokens + observation t
            assert ps[t + 1] == ps[t] + [7 + t] * 3 + list(s.observations[t])
    longest = max(len(prompts[s.sid][-1]) + 3 for s in sessions)
    assert er.longest_context(sessions, 3) >= longest
    with pytest.raises(ValueError):
        er.agentic_sessions(1, 0, system_len=1, task_len=1, obs_min=1, obs_max=1, seed=0)


def test_default_agentic_fits_the_context():
    # `run`'s defaults: 256 sessions x 8 turns, system 256, task 64, observations 32-128, 128 tokens a turn
    sessions = er.agentic_sessions(256, 8, system_len=256, task_len=64, obs_min=32, obs_max=128, seed=1)
    assert er.longest_context(sessions, 128) <= 4096
