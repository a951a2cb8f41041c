"""What async buys: one long-tailed agent workload, run colocated and in modes (a)–(d).

The workload is the ``digits`` task played as a multi-turn agent (``--turns`` turns) by the
tiny model through the real pipeline: transformers engine replicas (continuous batching), the
server client with partial-rollout resume, the MessageQueue, the FSDP2 trainer (gloo, world
size 1), the object-store weight sync. Between turns the agent "runs a tool": it sleeps for a
share of its run's *agent latency*. Latencies are long-tailed like SWE runs: a run's latency is
the median × a lognormal factor (σ 0.25), and one run in ``--tail-every`` takes ``--tail-x`` ×
the median. Each task's k-th run gets the same latency in every mode (the Rollouter admits tasks
in the same seeded order), so every mode sees the same workload.

Resources: every mode runs on one local Ray instance over the same CPU cores (``--cpus``), with
the Rollouter, the MessageQueue, the engine replicas and the Trainer as Ray actors (separate
processes, as on a cluster). As with GPUs, colocated mode gives all the cores to generation
while it generates (``--cpus`` engine replicas) and the engines sleep while the Trainer trains;
the sync wakes them. Modes (a)–(d) split the cores: ``--cpus / 2`` engine replicas and the
Trainer, running at once. The trainer uses one torch thread in every mode (more threads made the
tiny model's steps slower in a trial here). The total number of agent runs in flight is the same
(``--concurrency`` samples) in every mode.

Sizing: fully async is meant to run with rollout capacity at least the Trainer's consumption,
so that the Trainer never waits. The defaults give the Trainer enough work per sample
(``--ppo-epochs`` passes over each mini-batch, 4 turns of 32 tokens per run) and the Rollouter
enough room (``--staleness``) for that on 2 cores; every mode runs the same workload. Too
little trainer work (the old defaults: 1 epoch, 2 turns of 16 tokens) leaves (d) bounded by the
staleness quota (Little's law: at most ``(1 + s) × window`` samples in flight or queued, each
taking the mean sample latency), with the Trainer idle however the pipeline behaves.

Fair comparison (seed §06): one train batch is ``--window`` samples for every mode.
Colocated, (b), (c), (d) sync once per window (``trigger = window / mini-batch``); (a) syncs
after every mini-batch. Throughput and idle ratios come from each run's trace, measured from
the end of the first window to the end of the last step.

    .venv/bin/python bench/modes.py                       # about 15 minutes on 2 busy cores
    .venv/bin/python bench/modes.py --modes colocated,d --steps 8 --quick   # a smoke run
    .venv/bin/python bench/modes.py --redraw              # table and charts again from the traces
    bench/gpu_modes.sh                                    # the same on one GPU: --stack gpu

``--stack gpu`` runs the same workload with vLLM engine replicas and the FSDP2 trainer sharing one
GPU (weights over ``cuda_ipc``) on a random model of a real shape (``--preset``, default
qwen2.5-0.5b); every mode uses the same replicas on the same GPU (colocated takes turns on it,
(a)-(d) overlap on it), so ``--cpus`` only sizes Ray's CPU pool.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HERE = str(Path(__file__).resolve().parent)
# the workload's env is a plugin module in bench/: FERRYMAN_PLUGINS registers it in this process
# and in every Ray actor (which find it on PYTHONPATH)
sys.path.insert(0, HERE)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
os.environ["FERRYMAN_PLUGINS"] = ",".join(p for p in (os.environ.get("FERRYMAN_PLUGINS"), "longtail_env") if p)

from ferryman import timeline  # noqa: E402
from ferryman.config import load_config  # noqa: E402
from ferryman.plugins import PluginHost  # noqa: E402
from ferryman.runner import run  # noqa: E402
from ferryman.trace import TraceError, read_trace  # noqa: E402


# --------------------------------------------------------------------------- the modes


def mode_overrides(mode: str, window: int, mini: int, staleness: float) -> list[str]:
    """``mode`` is colocated, a, b, c or d; ``c@S`` / ``d@S`` use staleness threshold ``S``."""
    mode, _, own = mode.partition("@")
    staleness = float(own) if own else staleness
    trigger = window // mini
    return {
        "colocated": ["async_training.colocated=true", f"async_training.trigger_parameter_sync_step={trigger}"],
        "a": ["async_training.trigger_parameter_sync_step=1"],
        "b": [f"async_training.trigger_parameter_sync_step={trigger}"],
        "c": [f"async_training.trigger_parameter_sync_step={trigger}", f"async_training.staleness_threshold={staleness}"],
        "d": [
            f"async_training.trigger_parameter_sync_step={trigger}",
            f"async_training.staleness_threshold={staleness}",
            "async_training.partial_rollout=true",
        ],
    }[mode]


GPU_EXAMPLE = ROOT / "examples" / "gpu" / "one_gpu.yaml"


def gpu_engine(eager: bool) -> dict[str, Any]:
    """The vLLM engine section of ``examples/gpu/one_gpu.yaml`` (so that the modes run the
    engines as the pipeline run does: CUDA graphs, memory sizes), with a context long enough for
    the agent's turns; ``eager``: no CUDA graphs (faster start, slower decoding)."""
    import yaml

    engine = dict(yaml.safe_load(GPU_EXAMPLE.read_text())["engine"])
    engine["max_model_len"] = 1024
    if eager:
        engine["enforce_eager"] = True
        engine.pop("engine_kwargs", None)
    return engine


def gpu_stack(args: argparse.Namespace) -> list[str]:
    """``--stack gpu``: vLLM engine replicas and the FSDP2 trainer on one GPU (Ray GPU shares),
    weights over CUDA IPC. Every mode uses the same replicas on the same GPU: colocated takes
    turns on it, (a)-(d) overlap on it. vLLM keeps its memory in every mode (``sleep_mode:
    false``: the GPU has room for both), so colocated pays for taking turns, not for moving
    memory."""
    share = round(0.6 / args.gpu_replicas, 3)
    return [
        "ray_num_gpus=1",
        "ray.trainer.num_gpus=0.4",
        f"rollout.num_gpus_per_replica={share}",
        "engine=" + json.dumps(gpu_engine(args.eager)),
        # the example's learning rate: at 1e-4 a 0.5B shape's policy collapses within a few steps
        # (bench/results/sequence_cpu.md), and the answers' lengths, so the workload, with it
        f"trainer={{type: fsdp, device: cuda, backend: nccl, param_dtype: bfloat16, lr: 5.0e-6, ppo_epochs: {args.ppo_epochs}}}",
        "weight_sync={type: cuda_ipc}",
    ]


def resources(mode: str, args: argparse.Namespace) -> list[str]:
    if args.stack == "gpu":
        return [
            f"rollout.num_replicas={args.gpu_replicas}",
            f"rollout.max_concurrency_per_replica={max(1, args.concurrency // args.gpu_replicas)}",
        ]
    # torch threads do not speed up the tiny model (seen in a trial: with 2 threads its update
    # steps took 1-2 s, with 1 thread 0.1-0.2 s, on this busy machine): one thread in every mode
    replicas = args.cpus if mode == "colocated" else max(1, args.cpus // 2)
    mode = mode.partition("@")[0]
    trainer_threads = 1
    per_replica = max(1, args.concurrency // replicas)
    return [
        f"rollout.num_replicas={replicas}",
        f"rollout.max_concurrency_per_replica={per_replica}",
        f"trainer_threads={trainer_threads}",
        "engine_threads=1",
    ]


def run_mode(mode: str, args: argparse.Namespace, model: Path, out: Path) -> tuple[dict[str, Any], timeline.Timeline]:
    host = PluginHost()
    run_dir = out / (f"run-{mode}" if args.trace_level == "basic" else f"run-{mode}-{args.trace_level}")
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    base = [
        f"runtime={args.runtime}",
        f"seed={args.seed}",
        f"run_dir={run_dir}",
        f"model.path={model}",
        f"rollout.n={args.n}",
        f"rollout.max_tokens={args.max_tokens}",
        "rollout.temperature=1.0",
        f"training.ppo_mini_batch_size={args.mini}",
        f"training.total_steps={args.steps}",
        f"trainer={{type: fsdp, lr: 1.0e-4, ppo_epochs: {args.ppo_epochs}}}",
        "engine={type: hf}",
        (
            f"env={{type: longtail_digits, num_tasks: 64, turns: {args.turns}, median_s: {args.median_s}, "
            f"tail_every: {args.tail_every}, tail_x: {args.tail_x}}}"
        ),
        "trackers=[{type: jsonl}]",
        f"trace.level={args.trace_level}",
    ]
    if args.runtime == "inline":
        base.append("queue={type: local}")
    if args.stack == "gpu":
        base += gpu_stack(args)
    cfg, _ = load_config(None, base + resources(mode, args) + mode_overrides(mode, args.window, args.mini, args.staleness), host)
    t0 = time.time()
    run(cfg, host)
    wall = time.time() - t0
    tl = timeline.build(read_trace(run_dir, strict=True))
    s = timeline.stats(tl, skip_steps=args.window // args.mini)
    s["wall_s"] = wall
    return s, tl


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="colocated,a,b,c,d,d@1,d@2", help="d@1: mode (d) with staleness_threshold 1")
    p.add_argument("--window", type=int, default=8, help="samples per train batch (between two syncs, except (a))")
    p.add_argument("--mini", type=int, default=2, help="ppo_mini_batch_size (samples per local step)")
    p.add_argument("--steps", type=int, default=32, help="local trainer steps per mode (the first window is warm-up)")
    p.add_argument("--staleness", type=float, default=3.0, help="staleness_threshold of (c) and (d)")
    p.add_argument("--n", type=int, default=2, help="trajectories per sample")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per turn")
    p.add_argument("--median-s", type=float, default=0.8)
    p.add_argument("--tail-every", type=int, default=10)
    p.add_argument("--tail-x", type=float, default=10.0)
    p.add_argument("--cpus", type=int, default=2, help="CPU cores the run may use (colocated: all per phase; async: half each)")
    p.add_argument("--concurrency", type=int, default=32, help="samples in flight at most (all replicas together)")
    p.add_argument("--runtime", choices=["ray", "inline"], default="ray")
    p.add_argument("--trace-level", choices=["basic", "detail"], default="basic", help="(the numbers come from the trace)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=64, help="tiny model hidden size")
    p.add_argument("--layers", type=int, default=2, help="tiny model layers")
    p.add_argument("--ppo-epochs", type=int, default=4, help="trainer passes over each mini-batch (trainer work per sample)")
    p.add_argument("--stack", choices=["cpu", "gpu"], default="cpu",
                   help="cpu: transformers engines and the FSDP trainer on CPU cores; gpu: vLLM engines and the FSDP "
                        "trainer sharing one GPU, weights over cuda_ipc (bench/gpu_modes.sh)")
    p.add_argument("--preset", default=None, help="model shape preset (ferryman.tiny.SHAPE_PRESETS; --stack gpu: qwen2.5-0.5b)")
    p.add_argument("--gpu-replicas", type=int, default=2, help="--stack gpu: vLLM replicas sharing the GPU")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench-modes"))
    p.add_argument("--png", default=str(ROOT / "bench" / "results" / "modes.png"))
    p.add_argument("--chart-seconds", type=float, default=None, help="time span of each panel (default: two windows of steps)")
    p.add_argument("--quick", action="store_true", help="shorter latencies (smoke test)")
    p.add_argument("--redraw", action="store_true", help="no runs: numbers and charts from the traces already in --out")
    p.add_argument("--lenient", action="store_true",
                   help="with --redraw: also the traces of modes stopped before their last step (torn last lines skipped); "
                        "modes without a trace or a trainer step are left out of the table")
    p.add_argument("--no-chart", action="store_true", help="the table only")
    p.add_argument("--prepare", action="store_true", help="only build the model (and exit)")
    p.add_argument("--eager", action="store_true", help="--stack gpu: vLLM without CUDA graphs")
    args = p.parse_args(argv)
    if args.window % args.mini:
        p.error("--window must be a multiple of --mini")
    if args.quick:
        args.median_s = 0.1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.stack == "gpu" and args.preset is None:
        args.preset = "qwen2.5-0.5b"
    model = out / (f"model-{args.preset}" if args.preset else f"tiny-model-h{args.hidden}-l{args.layers}")
    if not (model / "config.json").is_file():
        from ferryman.tiny import build_tiny_model

        if args.preset:
            build_tiny_model(model, preset=args.preset, dtype="bfloat16", seed=args.seed)
        else:
            build_tiny_model(model, hidden_size=args.hidden, num_layers=args.layers, seed=args.seed)
    if args.prepare:
        print(f"model: {model}")
        return 0

    if args.runtime == "ray" and not args.redraw:
        import logging

        import ray

        from ferryman.cluster.connect import no_uv_run_workers

        no_uv_run_workers()
        ray.init(
            num_cpus=args.cpus,
            **({"num_gpus": 1} if args.stack == "gpu" else {}),
            include_dashboard=False,
            logging_level=logging.WARNING,
            runtime_env={
                "env_vars": {
                    "TOKENIZERS_PARALLELISM": "false",
                    "OMP_NUM_THREADS": "1",
                    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
                    "FERRYMAN_PLUGINS": os.environ["FERRYMAN_PLUGINS"],
                    "PYTHONPATH": os.environ["PYTHONPATH"],
                }
            },
        )
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results: dict[str, dict[str, Any]] = {}
    tls: dict[str, timeline.Timeline] = {}
    for mode in modes:
        print(f"== mode {mode}", flush=True)
        if args.redraw:  # numbers and chart again from the traces of an earlier run
            run_dir = out / (f"run-{mode}" if args.trace_level == "basic" else f"run-{mode}-{args.trace_level}")
            try:
                tls[mode] = timeline.build(read_trace(run_dir, strict=not args.lenient))
                results[mode] = {**timeline.stats(tls[mode], skip_steps=args.window // args.mini), "wall_s": float("nan")}
            except (TraceError, ValueError) as e:
                if not args.lenient:
                    raise
                print(f"   no numbers: {e}", flush=True)
                tls.pop(mode, None)
                continue
        else:
            results[mode], tls[mode] = run_mode(mode, args, model, out)
        r = results[mode]
        print(
            f"   {r['samples_per_s']:.3f} samples/s, trainer idle {r['trainer_idle_ratio']:.3f}, "
            f"rollouter idle {r['rollouter_idle_ratio']:.3f}, {r['steps']} steps measured, wall {r['wall_s']:.1f}s",
            flush=True,
        )

    # the table
    def ratio(mode: str, ref: str) -> str:
        if ref not in results:
            return "-"
        return f"{results[mode]['samples_per_s'] / max(results[ref]['samples_per_s'], 1e-12):.2f}x"

    modes = [m for m in modes if m in results]
    header = (
        "| mode | samples/s | tokens/s | trainer idle | rollouter idle | stale samples | resumed samples "
        "| waits (first / last / active) s | vs colocated | vs (a) |"
    )
    lines = [header, "|" + "---|" * 10]
    for mode in modes:
        r = results[mode]
        w = r["waits_s"]
        lines.append(
            f"| {mode} | {r['samples_per_s']:.3f} | {r['tokens_per_s']:.0f} | {100 * r['trainer_idle_ratio']:.1f}% | "
            f"{100 * r['rollouter_idle_ratio']:.1f}% | {100 * r['stale_sample_ratio']:.0f}% | {100 * r['partial_ratio']:.0f}% | "
            f"{w[timeline.WAIT_FIRST]:.1f} / {w[timeline.WAIT_LAST]:.1f} / {w[timeline.WAIT_ACTIVE]:.1f} | "
            f"{ratio(mode, 'colocated')} | {ratio(mode, 'a')} |"
        )
    print("\n".join(lines))
    print(json.dumps({m: {k: v for k, v in r.items()} for m, r in results.items()}, indent=1, default=str))

    if args.no_chart or not modes:
        return 0 if modes else 1
    # the chart: the four modes side by side, each over the same trainer steps (the same samples:
    # two windows after the first), so the x axes show how long each mode took for them
    skip = args.window // args.mini
    spans = {m: tls[m].step_range(skip + 1, skip + 2 * skip) for m in modes}
    if args.chart_seconds:
        spans = {m: (lo, lo + args.chart_seconds) for m, (lo, _) in spans.items()}
    four = [m for m in ("a", "b", "c", "d") if m in modes]
    if four:
        panels = [(tls[m], *spans[m], timeline.panel_title(tls[m], results[m])) for m in four]
        print("chart:", timeline.draw(panels, args.png, ncols=2))
    if "colocated" in modes:
        col_png = Path(args.png).with_name(Path(args.png).stem + "-colocated.png")
        panel = (tls["colocated"], *spans["colocated"], timeline.panel_title(tls["colocated"], results["colocated"]))
        print("chart:", timeline.draw([panel], col_png, ncols=1))
    print(f"load average: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
