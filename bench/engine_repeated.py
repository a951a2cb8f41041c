"""ferryman's vllm engine against raw vLLM, repeated and interleaved, on one GPU (issue 36, item 1).

The engines live side by side on the GPU, each in a server process of its own (vLLM's
sleep-mode memory pool allows one engine per process) that stays up for every repetition of
every workload: ``raw`` (vLLM itself: ``LLM`` for the batch, ``AsyncLLM`` for the agentic
workload), ``thread`` and ``process`` (ferryman's ``VLLMEngine`` with that core).
All three get the same engine arguments (``VLLMEngineConfig.engine_args``; raw without
ferryman's worker extension) and, with ``--kv-cache-gib``, the same KV cache. After one
untimed warm-up per engine, the timed runs go in the order raw, thread, process, process,
thread, raw, raw, ... (each repetition reversed from the one before), and each wrapper's
ratio is its generated tokens/s over raw's in the same repetition.

Workloads (``--workload``, by default both, the batch first):

``batch``
    ``--num-prompts`` random prompts of ``--prompt-len`` tokens, all at once, ``--max-tokens``
    new tokens each at temperature 1. raw: vLLM's offline ``LLM.generate`` (one call); the
    wrappers: one ``VLLMEngine.generate`` per prompt, all gathered.
``agentic``
    ``--sessions`` concurrent sessions of ``--turns`` turns. Every prompt of a repetition
    starts with one shared system prompt; a session's turn t is its turn t-1's prompt plus
    the tokens generated there plus an observation (growing shared prefixes, served by the
    prefix cache). raw: vLLM's own ``AsyncLLM.generate`` (final output only); the wrappers:
    ``ServerClient.generate`` over a ``LocalRouter`` and an ``EngineHandle``, as the
    Rollouter drives it (one request id per session, partial rollout on).

Prompts and sessions are drawn from the repetition's seed: the same for every engine within a
repetition, new in each one (nothing in the prefix cache from an earlier repetition helps).

    python bench/engine_repeated.py run --out-dir /tmp/rep       # both workloads, 5 repetitions
    python bench/engine_repeated.py report /tmp/rep/engine_repeated_batch.json /tmp/rep/engine_repeated_agentic.json \
        --json bench/results/gpu_engine_repeated.json --md bench/results/gpu_engine_repeated.md

``run`` writes its files after every timed run (a stopped command keeps what it measured) and
``DONE`` at the end.
``report`` needs no GPU. Needs a CUDA GPU and vLLM 0.24 for ``run``, with the ferryman
packages importable (installed, or through the paths below).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _sub in ("core", "engine-vllm"):
    _src = str(ROOT / "packages" / _sub / "src")
    if _src not in sys.path:
        sys.path.append(_src)

RAW = "raw"
CORES = ("thread", "process")
WORKLOADS = ("batch", "agentic")
AIM_MEDIAN = 0.95
AIM_EACH = 0.90
TOKEN_LOW, TOKEN_HIGH = 3, 150_000
"""Prompt token ids are drawn from [3, 150000): clear of the tiny tokenizer's specials (0-2)."""


# --------------------------------------------------------------------------- the plan (CPU-tested)


def interleaved_order(variants: Sequence[str], reps: int) -> list[tuple[int, str]]:
    """(repetition, variant) in run order: the variants as given in even repetitions, reversed
    in odd ones (raw, thread, process, process, thread, raw, raw, ...), so that drift over the
    lease falls on every variant alike."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if len(set(variants)) != len(variants) or not variants:
        raise ValueError(f"variants must be distinct and not empty: {list(variants)}")
    order = []
    for r in range(reps):
        for v in (variants if r % 2 == 0 else list(reversed(variants))):
            order.append((r, v))
    return order


def ratios_by_rep(runs: Sequence[dict], *, raw: str = RAW) -> dict[str, list[float]]:
    """Each wrapper variant's tokens/s over raw's of the same repetition, by repetition (timed
    runs only; a repetition missing either side is left out)."""
    timed = [r for r in runs if not r.get("warmup")]
    base = {r["rep"]: r["tokens_per_s"] for r in timed if r["variant"] == raw}
    out: dict[str, list[float]] = {}
    for variant in sorted({r["variant"] for r in timed} - {raw}):
        mine = {r["rep"]: r["tokens_per_s"] for r in timed if r["variant"] == variant}
        out[variant] = [round(mine[k] / base[k], 4) for k in sorted(mine) if k in base and base[k] > 0]
    return out


def summarize(ratios: Sequence[float]) -> dict[str, Any]:
    """Median and range of one row's ratios, and whether it meets the aim."""
    if not ratios:
        raise ValueError("no ratios")
    med = statistics.median(ratios)
    return {
        "ratios": [float(x) for x in ratios],
        "median": round(float(med), 4),
        "min": float(min(ratios)),
        "max": float(max(ratios)),
        "meets_aim": bool(med >= AIM_MEDIAN and min(ratios) >= AIM_EACH),
    }


def validate_results(obj: Any) -> None:
    """Raises ValueError unless ``obj`` has the schema of ``gpu_engine_repeated.json``:
    ``{"device": str, "rows": [{"engine": str, "core": str, "workload": "batch"|"agentic",
    "ratios": [float], "median": float}]}`` (further keys allowed) with the median right."""
    if not isinstance(obj, dict) or not isinstance(obj.get("device"), str) or not obj["device"].strip():
        raise ValueError("results: 'device' must be a non-empty string")
    rows = obj.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ValueError("results: 'rows' must be a non-empty list")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"rows[{i}] is not an object")
        for key, typ in (("engine", str), ("core", str), ("workload", str), ("ratios", list), ("median", float)):
            if not isinstance(row.get(key), typ) or isinstance(row.get(key), bool):
                raise ValueError(f"rows[{i}].{key} must be {typ.__name__}")
        if row["workload"] not in WORKLOADS:
            raise ValueError(f"rows[{i}].workload must be one of {WORKLOADS}")
        if not row["ratios"] or not all(isinstance(x, float) for x in row["ratios"]):
            raise ValueError(f"rows[{i}].ratios must be a non-empty list of floats")
        if abs(statistics.median(row["ratios"]) - row["median"]) > 1e-3:
            raise ValueError(f"rows[{i}].median {row['median']} is not the median of its ratios")


def batch_prompts(n: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(prompt_len)] for _ in range(n)]


@dataclass(frozen=True)
class Session:
    """One agent session: the shared system prompt, its own task, and the observation the
    environment answers after each turn but the last."""

    sid: str
    system: tuple[int, ...]
    task: tuple[int, ...]
    observations: tuple[tuple[int, ...], ...]


def agentic_sessions(n: int, turns: int, *, system_len: int, task_len: int, obs_min: int, obs_max: int,
                     seed: int) -> list[Session]:
    """``n`` sessions of ``turns`` turns, every one starting with the same system prompt."""
    if turns < 1 or n < 1 or not 0 < obs_min <= obs_max:
        raise ValueError("agentic_sessions: n, turns >= 1 and 0 < obs_min <= obs_max")
    rng = random.Random(seed)

    def draw(k: int) -> tuple[int, ...]:
        return tuple(rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(k))

    system = draw(system_len)
    return [
        Session(f"s{seed}-{i}", system, draw(task_len), tuple(draw(rng.randint(obs_min, obs_max)) for _ in range(turns - 1)))
        for i in range(n)
    ]


def longest_context(sessions: Sequence[Session], max_tokens: int) -> int:
    """The most tokens any session's last turn can hold (prompt + its generation)."""
    return max(len(s.system) + len(s.task) + sum(map(len, s.observations)) + max_tokens * (len(s.observations) + 1)
               for s in sessions)


Generate = Callable[[str, int, list[int]], Awaitable[list[int]]]
"""(session id, turn, prompt token ids) -> generated token ids."""


async def run_session(generate: Generate, session: Session) -> dict[str, Any]:
    """Drive one session: each turn's prompt is the previous one + its generation + the
    observation. Returns the generated tokens and each turn's prompt length."""
    history = list(session.system) + list(session.task)
    generated = 0
    prompt_lens = []
    turns = len(session.observations) + 1
    for t in range(turns):
        prompt_lens.append(len(history))
        out = await generate(session.sid, t, history)
        generated += len(out)
        history = history + list(out)
        if t < turns - 1:
            history += list(session.observations[t])
    return {"generated": generated, "prompt_lens": prompt_lens}


async def run_agentic(generate: Generate, sessions: Sequence[Session]) -> dict[str, Any]:
    t0 = time.perf_counter()
    done = await asyncio.gather(*[run_session(generate, s) for s in sessions])
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "generated_tokens": sum(d["generated"] for d in done),
            "prompt_tokens": sum(sum(d["prompt_lens"]) for d in done), "requests": sum(len(d["prompt_lens"]) for d in done)}


def workload_spec(args: argparse.Namespace, workload: str, rep: int, warmup: bool) -> dict[str, Any]:
    """What one run generates (a warm-up: a smaller load, of a seed no timed run uses)."""
    seed = 1_000_003 + rep if warmup else args.seed * 1000 + rep
    if workload == "batch":
        return {"workload": "batch", "seed": seed, "num_prompts": min(args.num_prompts, args.max_num_seqs) if warmup else args.num_prompts,
                "prompt_len": args.prompt_len, "max_tokens": 64 if warmup else args.max_tokens}
    return {"workload": "agentic", "seed": seed, "sessions": args.sessions, "turns": 2 if warmup else args.turns,
            "system_len": args.system_len, "task_len": args.task_len, "obs_min": args.obs_min, "obs_max": args.obs_max,
            "max_tokens": 32 if warmup else args.max_tokens_turn}


# --------------------------------------------------------------------------- the report (CPU-tested)


def build_report(files: Sequence[dict]) -> dict[str, Any]:
    """``gpu_engine_repeated.json`` from the ``run`` files (one per workload, one device)."""
    devices = {f["device"] for f in files}
    if len(devices) != 1:
        raise ValueError(f"the runs come from different devices: {sorted(devices)}")
    rows = []
    for f in files:
        for core, ratios in sorted(ratios_by_rep(f["runs"]).items()):
            if not ratios:
                continue
            rows.append({"engine": "vllm", "core": core, "workload": f["workload"], **summarize(ratios)})
    obj = {"device": devices.pop(), "rows": rows}
    validate_results(obj)
    return obj


def render_md(report: dict[str, Any], files: Sequence[dict], command: str) -> str:
    lines = [
        "# vllm engine against raw vLLM, repeated and interleaved (issue 36, item 1)",
        "",
        f"Device (nvidia-smi): **{report['device']}**.",
        "",
        "Command (one coordinator for both workloads; the engines stay up from the first run to the last):",
        "",
        "```",
        command,
        "```",
        "",
        f"Aim: wrapper/raw >= {AIM_MEDIAN} at the median and >= {AIM_EACH} in every repetition.",
        "",
        "| core | workload | median | range | repetitions | meets the aim |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(f"| {row['core']} | {row['workload']} | {row['median']:.3f} | {row['min']:.3f}-{row['max']:.3f} | "
                     f"{len(row['ratios'])} | {'yes' if row['meets_aim'] else 'no'} |")
    for f in files:
        a = f["args"]
        timed = [r for r in f["runs"] if not r.get("warmup")]
        variants = list(f["variants"])
        lines += ["", f"## {f['workload']}", ""]
        if f["workload"] == "batch":
            lines.append(f"{a['num_prompts']} prompts x {a['prompt_len']} tokens, {a['max_tokens']} new tokens each, "
                         "temperature 1, all at once. raw: `LLM.generate`.")
        else:
            lines.append(f"{a['sessions']} concurrent sessions x {a['turns']} turns, {a['max_tokens_turn']} new tokens a turn; "
                         f"shared system prompt {a['system_len']} tokens, task {a['task_len']}, observations "
                         f"{a['obs_min']}-{a['obs_max']} tokens. raw: `AsyncLLM.generate`; wrappers through `ServerClient`.")
        walls = [r["wall_s"] for r in timed]
        if walls:
            lines.append(f"Timed runs: {len(timed)}, each {min(walls):.1f}-{max(walls):.1f} s of generation; one warm-up "
                         "per engine before them, not counted.")
        lines += ["", "Engine settings as vLLM resolved them:", ""]
        for v in variants:
            lines.append(f"- {v}: start {f['servers'][v].get('start_s')} s, {json.dumps(f['servers'][v].get('resolved'))}")
        lines += ["", "| rep | order | " + " | ".join(f"{v} tokens/s" for v in variants) + " | "
                  + " | ".join(f"{c}/raw" for c in variants if c != RAW) + " |",
                  "|---" * (2 + len(variants) + len(variants) - 1) + "|"]
        for k in sorted({r["rep"] for r in timed}):
            by = {r["variant"]: r for r in timed if r["rep"] == k}
            order = " ".join(r["variant"] for r in sorted((r for r in timed if r["rep"] == k), key=lambda r: r["seq"]))
            cells = [f"{by[v]['tokens_per_s']:.0f}" if v in by else "-" for v in variants]
            rcells = [f"{by[c]['tokens_per_s'] / by[RAW]['tokens_per_s']:.3f}" if c in by and RAW in by else "-"
                      for c in variants if c != RAW]
            lines.append(f"| {k} | {order} | " + " | ".join(cells) + " | " + " | ".join(rcells) + " |")
        lines += ["", "Per run (timed): wall s, CPU s of the server's processes (front end and vLLM's), s inside "
                  "vLLM's `step()` (thread core):", ""]
        for r in timed:
            lines.append(f"- rep {r['rep']} {r['variant']}: {r['wall_s']:.2f} s wall, {r['generated_tokens']} tokens, "
                         f"{r.get('cpu_s')} CPU s, step() {r.get('step_seconds')}")
    lines += ["", "SGLang rows were not run here (another wheel stack, another lease).", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the servers (GPU)


def engine_config(args: argparse.Namespace, core: str = "thread"):
    from ferryman_engine_vllm import VLLMEngineConfig

    return VLLMEngineConfig(
        core=core,
        dtype="bfloat16",
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else None,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )


def resolved(vllm_config: Any) -> dict[str, Any]:
    """The scheduler and cache settings an engine runs with, as vLLM resolved them."""
    sc, cc = vllm_config.scheduler_config, vllm_config.cache_config
    return {"max_num_batched_tokens": sc.max_num_batched_tokens, "max_num_seqs": sc.max_num_seqs,
            "async_scheduling": getattr(sc, "async_scheduling", None), "enable_prefix_caching": cc.enable_prefix_caching,
            "num_gpu_blocks": cc.num_gpu_blocks, "block_size": cc.block_size,
            "cudagraph_mode": str(getattr(vllm_config.compilation_config, "cudagraph_mode", None))}


def cpu_seconds() -> float:
    """CPU time of this process and its children (the process core's and AsyncLLM's engine core)."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


class Server:
    """One engine: ``raw-llm`` (vLLM's LLM), ``raw-async`` (vLLM's AsyncLLM), ``thread``, ``process``."""

    def __init__(self, kind: str, args: argparse.Namespace) -> None:
        self.kind = kind
        self.args = args
        self.model = str(Path(args.workdir) / "qwen2.5-1.5b-random")
        self.llm: Any = None
        self.engine: Any = None
        self.client: Any = None

    def _raw_kwargs(self) -> dict[str, Any]:
        kwargs = engine_config(self.args).engine_args(model_path=self.model, seed=0)
        kwargs.pop("worker_extension_cls", None)  # ferryman's weight-loading hooks: not used by raw vLLM
        return kwargs

    async def start(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        if self.kind == "raw-llm":
            from vllm import LLM

            self.llm = LLM(**self._raw_kwargs())
            cfg = self.llm.llm_engine.vllm_config
        elif self.kind == "raw-async":
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._raw_kwargs(), disable_log_stats=True))
            cfg = self.llm.vllm_config
        else:
            from ferryman.client import ServerClient
            from ferryman.defaults.router import LocalRouter
            from ferryman.engine_host import EngineHandle
            from ferryman_engine_vllm import make_vllm_engine

            self.engine = make_vllm_engine(engine_config(self.args, self.kind), model_path=self.model, replica="replica-0", seed=0)
            await self.engine.start()
            handle = EngineHandle("replica-0", engine=self.engine)
            # as runner.build_rollouter builds it (one replica, partial rollout on)
            self.client = ServerClient(LocalRouter(["replica-0"]), {"replica-0": handle}, partial_rollout=True)
            core = self.engine._core  # noqa: SLF001 - a benchmark reads vLLM's resolved settings for the record
            cfg = core._engine.vllm_config if self.kind == "thread" else core._llm.vllm_config  # noqa: SLF001
        return {"start_s": round(time.perf_counter() - t0, 1), "resolved": resolved(cfg)}

    def _vllm_params(self, max_tokens: int) -> Any:
        from ferryman.types import SamplingParams
        from ferryman_engine_vllm.cores import vllm_sampling_params

        # exactly the vLLM sampling parameters the thread core sends (one log-prob a token,
        # token ids only, the output once, when the request ends)
        return vllm_sampling_params(SamplingParams(max_tokens=max_tokens, temperature=1.0), max_tokens, final_only=True)

    async def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        from ferryman.types import SamplingParams

        params = SamplingParams(max_tokens=spec["max_tokens"], temperature=1.0)
        # seconds inside vLLM's step(), counted by the thread core (the process core's step
        # runs in vLLM's own process, uncounted)
        steps0 = self.engine._core.step_seconds if self.kind == "thread" else None  # noqa: SLF001
        cpu0 = cpu_seconds()
        if spec["workload"] == "batch":
            prompts = batch_prompts(spec["num_prompts"], spec["prompt_len"], spec["seed"])
            t0 = time.perf_counter()
            if self.kind == "raw-llm":
                from vllm.inputs import TokensPrompt

                outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], self._vllm_params(spec["max_tokens"]),
                                         use_tqdm=False)
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            elif self.kind == "raw-async":
                outs = await asyncio.gather(*[self._async_one(f"b{spec['seed']}-{i}", p, spec["max_tokens"]) for i, p in enumerate(prompts)])
                tokens = sum(map(len, outs))
            else:
                outs = await asyncio.gather(*[self.engine.generate(f"b{spec['seed']}-{i}", p, params) for i, p in enumerate(prompts)])
                tokens = sum(len(o.token_ids) for o in outs)
            res = {"wall_s": time.perf_counter() - t0, "generated_tokens": tokens, "requests": len(prompts)}
        else:
            sessions = agentic_sessions(spec["sessions"], spec["turns"], system_len=spec["system_len"], task_len=spec["task_len"],
                                        obs_min=spec["obs_min"], obs_max=spec["obs_max"], seed=spec["seed"])
            if self.kind == "raw-async":
                async def gen(sid: str, turn: int, prompt: list[int]) -> list[int]:
                    return await self._async_one(f"{sid}-{turn}", prompt, spec["max_tokens"])
            elif self.kind in CORES:
                async def gen(sid: str, turn: int, prompt: list[int]) -> list[int]:
                    return (await self.client.generate(sid, prompt, params)).token_ids
            else:
                raise ValueError(f"{self.kind} does not run the agentic workload")
            res = await run_agentic(gen, sessions)
        res["tokens_per_s"] = res["generated_tokens"] / res["wall_s"]
        res["cpu_s"] = round(cpu_seconds() - cpu0, 2)
        if steps0 is not None:
            res["step_seconds"] = round(self.engine._core.step_seconds - steps0, 3)  # noqa: SLF001 - thread core's counter
        return res

    async def _async_one(self, request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
        from ferryman_engine_vllm.cores import token_prompt

        final = None
        async for out in self.llm.generate(token_prompt(prompt), self._vllm_params(max_tokens), request_id=request_id):
            final = out
        return list(final.outputs[0].token_ids)

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()
        elif self.kind == "raw-async" and self.llm is not None:
            self.llm.shutdown()


async def serve(kind: str, args: argparse.Namespace, result_fd: int) -> None:
    """Start the engine, answer ``{"cmd": "run", "spec": ...}`` lines from stdin with one JSON
    line each on ``result_fd``, until ``{"cmd": "quit"}``."""
    loop = asyncio.get_running_loop()
    out = os.fdopen(result_fd, "w", buffering=1)

    def reply(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    server = Server(kind, args)
    try:
        reply({"ready": True, **await server.start()})
    except Exception as exc:  # noqa: BLE001 - told to the coordinator
        reply({"ready": False, "error": repr(exc)})
        raise
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        try:
            reply({"ok": True, **await server.run(cmd["spec"])})
        except Exception as exc:  # noqa: BLE001
            reply({"ok": False, "error": repr(exc)})
    await server.stop()
    reply({"bye": True})


# --------------------------------------------------------------------------- the coordinator


def read_device() -> str:
    """The GPU as nvidia-smi names it (name, total memory), never a default string."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout.strip()
    if not out:
        raise RuntimeError("nvidia-smi named no GPU")
    return " / ".join(line.strip() for line in out.splitlines())


class Proc:
    """A server process, its commands on stdin and its answers on a pipe of their own (vLLM
    writes its logs to stdout)."""

    def __init__(self, variant: str, kind: str, args: argparse.Namespace, log: Path) -> None:
        self.variant = variant
        r, w = os.pipe()
        argv = [sys.executable, __file__, "serve", "--kind", kind, "--result-fd", str(w)] + server_argv(args)
        self.log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT, pass_fds=(w,),
                                  text=True, start_new_session=True)
        os.close(w)
        self.r = os.fdopen(r, "r")

    def answer(self, timeout: float) -> dict[str, Any]:
        ready, _, _ = select.select([self.r], [], [], timeout)
        if not ready:
            raise TimeoutError(f"{self.variant}: no answer within {timeout:.0f} s")
        line = self.r.readline()
        if not line:
            raise RuntimeError(f"{self.variant}: the server exited (exit {self.p.poll()}; see its log)")
        return json.loads(line)

    def ask(self, obj: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()
        return self.answer(timeout)

    def close(self) -> None:
        try:
            if self.p.poll() is None:
                self.ask({"cmd": "quit"}, 30)
        except Exception:  # noqa: BLE001
            pass
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            pass
        import signal

        try:  # whatever is left of the server's session: vLLM's engine core process too
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait()
        self.log.close()


SERVER_FLAGS = ("workdir", "gpu_memory_utilization", "kv_cache_gib", "max_model_len", "max_num_seqs", "max_num_batched_tokens")


def server_argv(args: argparse.Namespace) -> list[str]:
    out = []
    for name in SERVER_FLAGS:
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def build_model(workdir: str) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from engine import build_model as build  # bench/engine.py's random Qwen2.5-1.5B shape

    build(Path(workdir) / "qwen2.5-1.5b-random")


RAW_KIND = {"batch": "raw-llm", "agentic": "raw-async"}
"""The raw vLLM engine each workload is compared with."""


def start_servers(kinds: list[str], args: argparse.Namespace, logs: Path, say: Callable[[str], None]) -> tuple[dict[str, Proc], dict]:
    """One server per kind: the first of ``args.start_first`` alone (it fills vLLM's compile
    cache), then the others together (each KV cache has its size given, so none sizes itself
    from what the others hold while they start); one at a time without ``--kv-cache-gib``."""
    first = args.start_first if args.start_first in kinds else kinds[0]
    waves = [[first], [k for k in kinds if k != first]] if args.kv_cache_gib else [[k] for k in kinds]
    procs: dict[str, Proc] = {}
    info: dict[str, dict] = {}
    for wave in waves:
        for k in wave:
            procs[k] = Proc(k, k, args, logs / f"server_{k}.log")
        for k in wave:
            ans = procs[k].answer(args.start_timeout_s)
            if not ans.get("ready"):
                raise RuntimeError(f"{k} did not start: {ans.get('error')}")
            info[k] = {"kind": k, "start_s": ans["start_s"], "resolved": ans["resolved"]}
            say(f"{k} up in {ans['start_s']} s: {ans['resolved']}")
    return procs, info


def coordinate(args: argparse.Namespace) -> int:
    """Every workload of ``--workload`` (comma-separated) on one set of engines: raw's for each
    workload, the two cores shared; one results file per workload in ``--out-dir``."""
    t_start = time.monotonic()
    device = read_device()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    workloads = args.workload.split(",")
    variants = args.variants.split(",")
    if not set(workloads) <= set(WORKLOADS) or not workloads:
        raise SystemExit(f"--workload: some of {WORKLOADS}, got {workloads}")
    if RAW not in variants or not set(variants) <= {RAW, *CORES}:
        raise SystemExit(f"--variants: raw and some of {CORES}, got {variants}")

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.0f}s] {msg}", flush=True)

    subprocess.run([sys.executable, __file__, "build", "--workdir", args.workdir], check=True)
    if "agentic" in workloads:
        sessions = agentic_sessions(args.sessions, args.turns, system_len=args.system_len, task_len=args.task_len,
                                    obs_min=args.obs_min, obs_max=args.obs_max, seed=0)
        need = longest_context(sessions, args.max_tokens_turn)
        if need > args.max_model_len:
            raise SystemExit(f"a session reaches {need} tokens > --max-model-len {args.max_model_len}")
    kinds = [RAW_KIND[w] for w in workloads if RAW in variants] + [v for v in variants if v != RAW]
    procs: dict[str, Proc] = {}
    status = 0
    try:
        procs, info = start_servers(kinds, args, out_dir, say)
        seq = 0
        for workload in workloads:
            kind_of = {v: RAW_KIND[workload] if v == RAW else v for v in variants}
            doc: dict[str, Any] = {"device": device, "workload": workload, "command": " ".join(sys.argv), "args": vars(args),
                                   "variants": variants, "servers": {v: info[kind_of[v]] for v in variants}, "runs": []}
            path = out_dir / f"engine_repeated_{workload}.json"
            path.write_text(json.dumps(doc, indent=1))
            plan = [(-1, v, True) for v in variants] + [(r, v, False) for r, v in interleaved_order(variants, args.reps)]
            try:
                for rep, v, warm in plan:
                    if time.monotonic() - t_start > args.deadline_s:
                        say(f"deadline of {args.deadline_s} s reached: stopping before {workload} rep {rep} {v}")
                        doc["stopped_at_deadline"] = True
                        break
                    spec = workload_spec(args, workload, max(rep, 0), warm)
                    ans = procs[kind_of[v]].ask({"cmd": "run", "spec": spec}, args.run_timeout_s)
                    if not ans.get("ok"):
                        raise RuntimeError(f"{workload} {v} rep {rep}: {ans.get('error')}")
                    row = {"seq": seq, "rep": rep, "variant": v, "warmup": warm, **{k: x for k, x in ans.items() if k != "ok"}}
                    seq += 1
                    doc["runs"].append(row)
                    path.write_text(json.dumps(doc, indent=1))
                    say(f"{workload} {'warm-up' if warm else f'rep {rep}'} {v}: {row['tokens_per_s']:.0f} tokens/s "
                        f"({row['generated_tokens']} tokens in {row['wall_s']:.2f} s, {row['cpu_s']} CPU s"
                        f"{', step() ' + str(row['step_seconds']) + ' s' if 'step_seconds' in row else ''})")
            except Exception as exc:  # noqa: BLE001 - recorded; the next workload still runs
                say(f"{workload} failed: {exc!r}")
                doc["error"] = repr(exc)
                path.write_text(json.dumps(doc, indent=1))
                status = 1
            for core, rs in ratios_by_rep(doc["runs"]).items():
                if rs:
                    sm = summarize(rs)
                    say(f"{workload} {core}/raw: median {sm['median']:.3f}, range {sm['min']:.3f}-{sm['max']:.3f}, "
                        f"ratios {rs} -> aim {'met' if sm['meets_aim'] else 'missed'}")
    finally:
        for p in procs.values():
            p.close()
        (out_dir / "DONE").write_text(str(status))
    return status


def add_server_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workdir", default="/tmp/ferryman-bench-engine")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.2,
                    help="each engine's share (four engines live on the GPU together; with --kv-cache-gib only "
                         "checked against the memory free at its start)")
    ap.add_argument("--kv-cache-gib", type=float, default=12.0, help="each engine's KV cache (0: from the share)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384,
                    help="the same for every engine (vLLM's LLM picks 16384 on a GPU of >= 70 GiB, AsyncLLM 2048)")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help="start the engines and time them, interleaved")
    run.add_argument("--workload", default="batch,agentic", help="comma-separated: batch, agentic (run in this order)")
    run.add_argument("--variants", default="raw,thread,process")
    run.add_argument("--start-first", default="thread", help="the engine started alone, before the others start together")
    run.add_argument("--reps", type=int, default=5)
    run.add_argument("--seed", type=int, default=1)
    run.add_argument("--num-prompts", type=int, default=1024)
    run.add_argument("--prompt-len", type=int, default=128)
    run.add_argument("--max-tokens", type=int, default=320)
    run.add_argument("--sessions", type=int, default=256)
    run.add_argument("--turns", type=int, default=8)
    run.add_argument("--max-tokens-turn", type=int, default=128)
    run.add_argument("--system-len", type=int, default=256)
    run.add_argument("--task-len", type=int, default=64)
    run.add_argument("--obs-min", type=int, default=16)
    run.add_argument("--obs-max", type=int, default=64)
    run.add_argument("--start-timeout-s", type=float, default=300)
    run.add_argument("--run-timeout-s", type=float, default=180)
    run.add_argument("--deadline-s", type=float, default=1e9, help="start no run after this many seconds")
    run.add_argument("--out-dir", required=True, help="engine_repeated_<workload>.json, the servers' logs, DONE at the end")
    add_server_args(run)
    srv = sub.add_parser("serve", help="(internal) one engine server")
    srv.add_argument("--kind", required=True, choices=["raw-llm", "raw-async", *CORES])
    srv.add_argument("--result-fd", type=int, required=True)
    add_server_args(srv)
    bld = sub.add_parser("build", help="(internal) build the random model")
    bld.add_argument("--workdir", required=True)
    rep = sub.add_parser("report", help="gpu_engine_repeated.json and .md from run files")
    rep.add_argument("files", nargs="+")
    rep.add_argument("--json", required=True)
    rep.add_argument("--md", required=True)
    rep.add_argument("--command", default="", help="the command(s) to quote in the md")
    args = ap.parse_args(argv)
    if args.what == "run":
        return coordinate(args)
    if args.what == "serve":
        asyncio.run(serve(args.kind, args, args.result_fd))
        return 0
    if args.what == "build":
        build_model(args.workdir)
        return 0
    files = [json.loads(Path(f).read_text()) for f in args.files]
    report = build_report(files)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    Path(args.md).write_text(render_md(report, files, args.command or "\n".join(dict.fromkeys(f["command"] for f in files))))
    for row in report["rows"]:
        print(f"{row['core']} {row['workload']}: median {row['median']:.3f}, range {row['min']:.3f}-{row['max']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
