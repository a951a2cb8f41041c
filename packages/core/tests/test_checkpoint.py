"""Pipeline checkpoints without a model: the Rollouter's state and its runs in flight are cut
(at a partial-rollout sync, and by a freeze outside a sync) and restored into fresh objects; the
samples that come out, and every trajectory's tokens, equal those of an uninterrupted run. Plus
the run recorder's replay, and the checkpoint directory's atomic writes and pruning.

EchoEngine (core's test double) is deterministic: a trajectory's tokens depend only on its
prompt, so a resumed trajectory can be compared token for token."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from ferryman.checkpoint import CheckpointError, CheckpointStore, find_checkpoint
from ferryman.client import ServerClient
from ferryman.defaults.queue import MessageQueue
from ferryman.defaults.router import LocalRouter
from ferryman.engine_host import EngineHandle
from ferryman.replay import RunLog, RunRecorder
from ferryman.rollouter import Rollouter
from ferryman.testing.doubles import EchoEngine
from ferryman.types import SamplingParams

from helpers import EchoEnv

W = 2  # samples per "trainer step"


class Pipeline:
    """Rollouter + queue + two EchoEngine replicas; ``step()`` plays the trainer: take W
    samples, then a weight sync (partial rollout: abort, or wait for the active samples)."""

    def __init__(self, partial: bool, env: EchoEnv, version: int = 0) -> None:
        self.partial = partial
        self.raw = {f"r{i}": EchoEngine(step_delay_s=0.004) for i in range(2)}
        for e in self.raw.values():
            e.version = version
        self.engines = {n: EngineHandle(n, engine=e) for n, e in self.raw.items()}
        self.queue = MessageQueue(4)
        self.r = Rollouter(
            env=env, client=ServerClient(LocalRouter(list(self.engines)), self.engines, partial_rollout=partial),
            queue=self.queue, n=2, sampling=SamplingParams(max_tokens=12), max_required_samples=4 if partial else 2,
            max_concurrent_samples=1 if partial else 2, total_samples=12, seed=7,
        )
        self.version = version
        self.trained: list = []
        self.fit: asyncio.Task | None = None

    def start(self) -> None:
        self.fit = asyncio.create_task(self.r.fit())

    async def step(self, cut: bool = False):
        self.trained += [await asyncio.wait_for(self.queue.get(), 20) for _ in range(W)]
        if cut:
            await self.generating()
        await self.r.pause_for_sync(not self.partial)
        await asyncio.gather(*(e.pause(self.partial) for e in self.engines.values()))
        self.version += 1
        for e in self.engines.values():
            await e.set_version(self.version)
        state = None
        if cut:  # the Synchronizer's on_paused moment
            state = (await self.r.checkpoint_state(self.version), await self.queue.snapshot())
        for e in self.engines.values():
            await e.resume()
        await self.r.reset_staleness(self.version)
        return state

    async def generating(self) -> None:
        """Wait until some run has a generation under way (so that a cut catches one)."""
        for _ in range(400):
            if any(live.log.pending for live in self.r.recorder.runs.values()):
                return
            await asyncio.sleep(0.005)

    async def freeze_cut(self):
        """A stop outside a sync: freeze, abort the engines, cut."""
        await self.generating()
        await self.r.freeze()
        await asyncio.gather(*(e.pause(True) for e in self.engines.values()))
        await asyncio.sleep(0.05)
        return await self.r.checkpoint_state(None), await self.queue.snapshot()

    async def close(self) -> None:
        await self.r.stop()
        if self.fit is not None:
            self.fit.cancel()
            await asyncio.gather(self.fit, return_exceptions=True)


def _tokens(samples) -> dict[str, list[list[int]]]:
    return {s.uid: [t.response_ids for t in s.trajectories] for s in samples}


async def _uninterrupted(partial: bool, steps: int) -> list:
    p = Pipeline(partial, EchoEnv(num_tasks=5, turns=2))
    p.start()
    for _ in range(steps):
        await p.step()
    await p.close()
    return p.trained


async def _resumed(partial: bool, steps: int, cut_step: int, freeze: bool, env: EchoEnv):
    first = Pipeline(partial, EchoEnv(num_tasks=5, turns=2))
    first.start()
    for i in range(1, cut_step + 1):
        state = await first.step(cut=(i == cut_step and not freeze))
    if freeze:
        state = await first.freeze_cut()
    await first.close()
    rstate, queued = pickle.loads(pickle.dumps(state))  # it goes to disk in a real run
    assert any(item["logs"] for item in rstate["inflight"]), "the cut should catch runs under way"

    second = Pipeline(partial, env, version=first.version)
    for s in queued:
        await second.queue.put(s)
    exclude = {s.uid for s in queued} | {s.uid for s in first.trained}
    info = await second.r.restore_state(rstate, sorted(exclude))
    second.start()
    for _ in range(steps - cut_step):
        await second.step()
    await second.close()
    # whether the cut caught a generation part-way (tokens out, then aborted): only then is a
    # call resumed from its recorded prefix (a loaded machine may cut only between calls)
    had_partial = any(rec.partial is not None and rec.partial.token_ids
                      for item in rstate["inflight"] for rec in item["logs"].values())
    return first.trained + second.trained, info, second.r, had_partial


@pytest.mark.parametrize("partial,freeze", [(True, False), (True, True), (False, True)], ids=["sync-cut", "freeze-partial", "freeze-on-policy"])
async def test_resume_gives_the_same_samples_and_tokens(partial, freeze):
    steps, cut = 5, 2
    expected = await _uninterrupted(partial, steps)
    trained, info, r, had_partial = await _resumed(partial, steps, cut, freeze, EchoEnv(num_tasks=5, turns=2))
    uids = [s.uid for s in trained]
    assert len(uids) == len(set(uids)), "a sample trained twice"
    assert sorted(uids) == sorted(s.uid for s in expected), "the same set of samples"
    assert _tokens(trained) == _tokens(expected), "resumed trajectories equal uninterrupted ones"
    assert info["replayed_runs"] >= 1 and info["redispatched_runs"] == 0
    assert r.recorder.resumed_calls >= (1 if had_partial else 0) and r.recorder.diverged_runs == 0
    assert any(t.num_aborts for s in trained for t in s.trajectories)


async def test_runs_of_a_black_box_env_are_redispatched_and_counted():
    class BlackBox(EchoEnv):
        resumable = False

    steps, cut = 4, 2
    expected = await _uninterrupted(True, steps)
    trained, info, r, _ = await _resumed(True, steps, cut, True, BlackBox(num_tasks=5, turns=2))
    assert sorted(s.uid for s in trained) == sorted(s.uid for s in expected)
    assert info["redispatched_runs"] >= 1 and info["replayed_runs"] == 0 and info["discarded_tokens"] > 0
    assert r.total_redispatched_runs == info["redispatched_runs"]
    assert r.recorder.replayed_calls == 0
    assert _tokens(trained) == _tokens(expected), "a re-run from scratch gives the same tokens here"


async def test_recorder_replays_finished_calls_and_detects_divergence():
    engine = EchoEngine()
    client = ServerClient(LocalRouter(["r0"]), {"r0": EngineHandle("r0", engine=engine)}, partial_rollout=False)
    rec = RunRecorder(client)
    params = SamplingParams(max_tokens=3)
    rec.begin("a")
    first = await rec.generate("a", [1, 2], params)
    await rec.generate("a", [1, 2, *first.token_ids, 9], params)
    log = rec.snapshot("a")
    rec.end("a")
    assert len(log.calls) == 2 and log.pending is None and log.num_tokens == 6
    calls = len(engine.calls)

    rec.begin("a", log)
    again = await rec.generate("a", [1, 2], params)
    assert again.token_ids == first.token_ids and len(engine.calls) == calls, "replayed, not generated"
    await rec.generate("a", [1, 2, *first.token_ids, 8], params)  # a different prompt: diverged
    assert rec.diverged_runs == 1 and len(engine.calls) == calls + 1
    assert await rec.generate("b", [4], params) is not None  # not announced: passes through


async def test_recorder_streams_live_replayed_and_resumed_calls():
    """Through the recorder, ``on_tokens`` gets exactly each call's tokens: as the engine makes
    them (live), at once (replayed), the recorded prefix first and then the rest (resumed)."""
    from ferryman.replay import prompt_key
    from ferryman.types import TokenOutput

    engine = EchoEngine(step_delay_s=0.001)
    client = ServerClient(LocalRouter(["r0"]), {"r0": EngineHandle("r0", engine=engine)}, partial_rollout=False)
    rec = RunRecorder(client)
    params = SamplingParams(max_tokens=6)

    def joined(ds):
        return [t for d in ds for t in d.token_ids], [v for d in ds for v in d.versions]

    rec.begin("a")
    live: list[TokenOutput] = []
    first = await rec.generate("a", [1, 2], params, on_tokens=live.append)
    assert len(live) == 6 and joined(live) == (first.token_ids, first.versions), "one token at a time from the engine"
    log = rec.snapshot("a")
    rec.end("a")

    rec.begin("a", log)
    replayed: list[TokenOutput] = []
    again = await rec.generate("a", [1, 2], params, on_tokens=replayed.append)
    assert joined(replayed) == (again.token_ids, again.versions) == (first.token_ids, first.versions)
    rec.end("a")

    cut = TokenOutput(first.token_ids[:2], first.log_probs[:2], first.versions[:2], "aborted")
    rec.begin("a", RunLog(pending=prompt_key([1, 2]), partial=cut))
    resumed: list[TokenOutput] = []
    out = await rec.generate("a", [1, 2], params, on_tokens=resumed.append)
    assert rec.resumed_calls == 1 and out.token_ids == first.token_ids
    assert joined(resumed)[0] == out.token_ids and resumed[0].token_ids == first.token_ids[:2], "the prefix first, each token once"


def _writer(tag: str):
    def write(tmp):
        (tmp / "pipeline.pkl").write_bytes(pickle.dumps({"format": 1, "tag": tag}))

    return write


def test_store_writes_atomically_and_keeps_the_newest(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep=2)
    assert store.latest() is None
    with pytest.raises(CheckpointError, match="no checkpoint"):
        find_checkpoint(tmp_path)
    for step in (1, 2, 3):
        store.write(step, _writer(str(step)))
    assert [p.name for p in store.list()] == ["step-00000002", "step-00000003"]

    def crash(tmp):
        (tmp / "pipeline.pkl").write_bytes(b"half")
        raise KeyboardInterrupt  # dies mid-write

    with pytest.raises(KeyboardInterrupt):
        store.write(4, crash)
    assert store.latest().name == "step-00000003" and not list((tmp_path / "ck").glob(".tmp-*"))
    # a temporary directory left by a SIGKILL is ignored, and removed by the next write
    (tmp_path / "ck" / ".tmp-step-00000004-dead").mkdir()
    (tmp_path / "ck" / ".tmp-step-00000004-dead" / "pipeline.pkl").write_bytes(b"x")
    assert find_checkpoint(tmp_path, str(tmp_path / "ck")).name == "step-00000003"
    store.write(3, _writer("3 again"))  # the same step again (a resumed run): replaced
    assert pickle.loads((store.latest() / "pipeline.pkl").read_bytes())["tag"] == "3 again"
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000002", "step-00000003"]
    assert find_checkpoint(store.latest()) == store.latest()


def test_config_checkpoint_section_and_fault_knobs(host):
    from ferryman.config import ConfigError, load_config

    BASE = ["engine={type: echo}", "trainer={type: echo}"]  # as in conftest (another package's conftest may shadow that module name)

    cfg, _ = load_config(None, [*BASE, "checkpoint.every_steps=4", "async_training.trigger_parameter_sync_step=2",
                                "rollout.run_timeout_s=30", "training.weight_sync_attempts=2"], host)
    assert cfg.checkpoint.every_steps == 4 and cfg.checkpoint.keep == 2 and cfg.rollout.run_timeout_s == 30.0
    with pytest.raises(ConfigError, match="checkpoint.every_steps: 3 is not a multiple"):
        load_config(None, [*BASE, "checkpoint.every_steps=3", "async_training.trigger_parameter_sync_step=2"], host)
    for bad, field in (("checkpoint.keep=0", "checkpoint.keep"), ("rollout.run_timeout_s=0", "rollout.run_timeout_s"),
                       ("training.weight_sync_attempts=0", "training.weight_sync_attempts"), ("checkpoint.evry_steps=1", "checkpoint.evry_steps")):
        with pytest.raises(ConfigError, match=field):
            load_config(None, [*BASE, bad], host)


def test_resume_of_something_that_is_not_a_run_is_a_clear_error(tmp_path, capsys):
    from ferryman.cli import main

    assert main(["train", "--resume", str(tmp_path / "nowhere")]) == 2
    assert "no config.yaml" in capsys.readouterr().err
