"""``ferryman`` command line: ``train``, ``eval``, ``export``, ``plugins``, ``config``,
``tiny-model``, ``timeline``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

import yaml


def _cmd_plugins(args: argparse.Namespace) -> int:
    from ferryman.plugins import PluginHost

    print(PluginHost().describe())
    return 0


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    from ferryman.config import load_config
    from ferryman.plugins import PluginHost

    host = PluginHost()
    config, overrides = _split_config(args.config, args.overrides)
    cfg, _ = load_config(config, overrides, host)
    return cfg, host


def _split_config(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """``train`` takes its config file optionally: a first argument like ``key=value`` that is
    not a file is an override (argparse put it in the config slot)."""
    from pathlib import Path

    if config is not None and "=" in config and not Path(config).is_file():
        return None, [config, *overrides]
    return config, list(overrides)


def _load_for_resume(args: argparse.Namespace) -> tuple[Any, Any]:
    """``train --resume RUN_DIR [CONFIG] [overrides]``: the run's own saved config unless a
    config file is given; overrides apply on top (e.g. ``training.total_steps=900``)."""
    from pathlib import Path

    from ferryman.config import ConfigError, load_config
    from ferryman.plugins import PluginHost

    run_dir = Path(args.resume)
    if (run_dir / "pipeline.pkl").is_file():  # a checkpoint directory: RUN_DIR/checkpoints/step-N
        run_dir = run_dir.parent.parent
    config, overrides = _split_config(args.config, args.overrides)
    if config is None:
        config = run_dir / "config.yaml"
        if not config.is_file():
            raise ConfigError(f"--resume {str(run_dir)!r}: no config.yaml there (is it a run directory?)")
    host = PluginHost()
    cfg, _ = load_config(config, [f"run_dir={run_dir}", *overrides], host)
    return cfg, host


def _cmd_config(args: argparse.Namespace) -> int:
    """The validated config, plugin sections with their defaults filled in, after the env was
    built once and checked (a task at least, JSON tasks), as ``train`` does before starting."""
    from ferryman.config import ROLE_OF_SECTION, load_config
    from ferryman.plugins import PluginHost
    from ferryman.runner import check_env, tokenizer_for_checks

    host = PluginHost()
    config, overrides = _split_config(args.config, args.overrides)
    cfg, plugin_cfgs = load_config(config, overrides, host)
    out = cfg.model_dump(mode="json")
    for section in ROLE_OF_SECTION:
        out[section] = plugin_cfgs[section].model_dump(mode="json")
    out["trackers"] = [t.model_dump(mode="json") for t in plugin_cfgs["trackers"]]
    with tokenizer_for_checks(cfg) as tokenizer:
        num_tasks = check_env(cfg, host, plugin_cfgs, tokenizer)
    out["_derived"] = {"mode": cfg.async_training.mode, **cfg.funnel(), "env_tasks": num_tasks}
    print(yaml.safe_dump(out, sort_keys=False), end="")
    return 0


def where_things_go(cfg: Any) -> str:
    """The lines ``ferryman train`` starts with: where metrics, trace, checkpoints and exports go."""
    from pathlib import Path

    run = Path(cfg.run_dir)
    metrics = [str(run / t.get("filename", "metrics.jsonl")) if t.get("type") == "jsonl" else
               str(run / t.get("subdir", "tensorboard")) + " (tensorboard)" if t.get("type") == "tensorboard" else
               f"{t.get('type')}" for t in cfg.trackers]
    ck = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run / "checkpoints"
    every = cfg.checkpoint.every_steps
    when = f"every {every} steps" if every else "on SIGTERM only"
    val = cfg.validation
    lines = [
        f"  metrics:     {', '.join(metrics) or 'nowhere (no tracker)'}",
        f"  trace:       {run / 'trace'}/ (ferryman timeline {run})" if cfg.trace.level != "off" else "  trace:       off",
        f"  checkpoints: {ck}/step-N/ ({when}; resume: ferryman train --resume {run})",
        f"  exports:     ferryman export {run} [--step N] -o {run / 'exports' / 'step-N'}",
    ]
    if val.enabled:
        lines.append(
            f"  validation:  {'before training, ' if val.before_train else ''}"
            f"{f'every {val.every_steps} steps' if val.every_steps else 'not during training'} (val/* metrics)"
        )
    return "\n".join(lines)


def _cmd_train(args: argparse.Namespace) -> int:
    from ferryman.runner import EXIT_STOPPED, run

    cfg, host = _load_for_resume(args) if args.resume is not None else _load(args)
    f = cfg.funnel()
    print(
        f"ferryman: mode ({cfg.async_training.mode}), {cfg.rollout.num_replicas} engine replica(s), "
        f"window {f['window_samples']} samples, max_required {f['max_required_samples']}, "
        f"max_concurrent {f['max_concurrent_samples']}, run_dir {cfg.run_dir}",
        flush=True,
    )
    print(where_things_go(cfg), flush=True)
    summary = run(cfg, host, resume=args.resume)
    steps = summary.get("steps") or []
    if args.resume is not None and not summary.get("resumed"):
        print(f"ferryman: {args.resume} had no checkpoint yet; started over", flush=True)
    if summary.get("resumed"):
        r = summary["resumed"]
        print(f"ferryman: resumed at step {r['step']} from {r['path']}", flush=True)
    if summary.get("stopped"):
        where = summary["checkpoints"][-1]["path"] if summary.get("checkpoints") else "(no checkpoint)"
        print(f"ferryman: stopped at step {len(steps)} on request; checkpoint {where}; continue with: ferryman train --resume {cfg.run_dir}", flush=True)
        return EXIT_STOPPED
    print(f"ferryman: finished {len(steps)} steps in {summary.get('wall_s', 0):.1f}s; metrics in {cfg.run_dir}/metrics.jsonl", flush=True)
    return 0


def _is_run_dir(path: str) -> bool:
    from pathlib import Path

    return (Path(path) / "config.yaml").is_file() and not (Path(path) / "config.json").is_file()


def _cmd_export(args: argparse.Namespace) -> int:
    from ferryman.evaluation.export import export_checkpoint
    from ferryman.plugins import PluginHost
    from ferryman.quiet import quiet_transformers

    quiet_transformers()
    out = export_checkpoint(args.run_dir, args.output, host=PluginHost(), step=args.step, dtype=args.dtype)
    print(f"ferryman: exported step {out['step']} (weight version {out['weight_version']}) of {args.run_dir} to {out['path']}", flush=True)
    print(json.dumps(out, indent=1))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ferryman.config import load_config
    from ferryman.evaluation.export import export_checkpoint, find_step_checkpoint, run_config
    from ferryman.evaluation.offline import evaluate_model, format_table
    from ferryman.checkpoint import read_meta
    from ferryman.plugins import PluginHost

    from ferryman.quiet import quiet_transformers

    quiet_transformers()
    host = PluginHost()
    cfg, plugin_cfgs = load_config(args.config, args.overrides, host)
    model = args.model
    if _is_run_dir(model):  # a run: export the checkpoint (once) to RUN_DIR/exports/step-N
        run_cfg, _ = run_config(model, host)
        step = int(read_meta(find_step_checkpoint(run_cfg, args.step))["step"])
        target = Path(model) / "exports" / f"step-{step}"
        if not (target / "config.json").is_file():
            export_checkpoint(model, target, host=host, step=step)
            print(f"ferryman: exported step {step} of {model} to {target}", flush=True)
        model = str(target)
    elif args.step is not None:
        print("ferryman: error: --step needs a run directory", file=sys.stderr)
        return 2
    result = evaluate_model(model, cfg, host, plugin_cfgs)
    print(format_table(result, cfg.validation.n, model))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model, "config": args.config, "n": cfg.validation.n, "metrics": result.metrics, "tasks": result.tasks}, indent=1))
    print(f"ferryman: results in {out}", flush=True)
    return 0


def _cmd_tiny(args: argparse.Namespace) -> int:
    from ferryman.tiny import build_tiny_model

    from ferryman.tiny import MARKER_FILE

    try:
        path = build_tiny_model(
            args.path, vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers, seed=args.seed,
            preset=args.preset, dtype=args.dtype, max_positions=args.max_positions,
        )
    except (ValueError, FileExistsError) as e:
        print(f"ferryman: error: {e}", file=sys.stderr)
        return 2
    info = json.loads((path / MARKER_FILE).read_text())
    print(json.dumps({"path": str(path), "preset": args.preset, "num_parameters": info["num_parameters"], "vocab_size": info["vocab_size"]}))
    return 0


def _parse_steps(text: str | None) -> tuple[int, int | None]:
    if not text:
        return 1, None
    first, _, last = text.partition(":")
    try:
        return int(first or 1), int(last) if last else None
    except ValueError:
        raise SystemExit(f"ferryman timeline: --steps {text!r}: expected FIRST:LAST, e.g. 3:8") from None


def _cmd_timeline(args: argparse.Namespace) -> int:
    from ferryman import timeline
    from ferryman.trace import TraceError, read_trace, to_chrome

    first, last = _parse_steps(args.steps)
    panels = []
    report = {}
    try:
        for i, run_dir in enumerate(args.run_dirs):
            records = read_trace(run_dir)
            tl = timeline.build(records)
            lo, hi = tl.step_range(first, last) if tl.steps else (tl.t0, tl.end)
            if args.steps:  # the numbers of the drawn steps
                numbers = timeline.stats(tl, lo, hi) if tl.steps else {}
            else:  # the whole run after its first step (warm-up)
                numbers = timeline.stats(tl) if len(tl.steps) > 1 else {}
            if numbers:  # say which steps the rates count: a trace of 30 steps is not "29 steps"
                first_counted = first + numbers["warmup_steps"]
                numbers["counted"] = (
                    f"steps {first_counted}..{first_counted + numbers['steps'] - 1}: steps/samples/syncs and the rates; "
                    f"the trace holds {numbers['trace_steps']} steps, {numbers['trace_samples']} samples, {numbers['trace_syncs']} syncs"
                )
            report[run_dir] = {"mode": tl.mode, **numbers}
            label = args.titles[i] if args.titles and i < len(args.titles) else None
            title = timeline.panel_title(tl, numbers, label) if numbers else (label or timeline.MODE_TITLES.get(tl.mode, tl.mode))
            panels.append((tl, lo, hi, title))
            if args.chrome:
                out = args.chrome if len(args.run_dirs) == 1 else f"{args.chrome.removesuffix('.json')}-{i}.json"
                with open(out, "w") as f:
                    json.dump(to_chrome(records), f)
    except (TraceError, ValueError) as e:
        print(f"ferryman: error: {e}", file=sys.stderr)
        return 2
    try:
        path = timeline.draw(panels, args.output, ncols=args.cols)
    except RuntimeError as e:  # matplotlib missing
        print(f"ferryman: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"chart": str(path), "runs": report}, indent=1, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ferryman", description="Fully asynchronous RL for LLM agents.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("plugins", help="list installed plugins and what they register")
    sp.set_defaults(func=_cmd_plugins)

    for name, func, text in (
        ("train", _cmd_train, "run a training job"),
        ("config", _cmd_config, "print the validated config with derived numbers"),
    ):
        sp = sub.add_parser(name, help=text)
        if name == "train":
            sp.add_argument("config", nargs="?", help="YAML config file (optional; with --resume: default RUN_DIR/config.yaml)")
            sp.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint (or a checkpoint directory)")
        else:
            sp.add_argument("config", help="YAML config file")
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. async_training.staleness_threshold=0.5")
        sp.set_defaults(func=func)

    sp = sub.add_parser("eval", help="evaluate a model directory or a run's checkpoint on a config's validation tasks, without training")
    sp.add_argument("model", metavar="MODEL_DIR|RUN_DIR", help="a Hugging Face model directory, or a run directory (its checkpoint is exported first)")
    sp.add_argument("config", help="YAML config: env, engine, router and the validation section (tasks, n, temperature, max_tokens)")
    sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. validation.n=8")
    sp.add_argument("--step", type=int, help="with a RUN_DIR: the checkpoint of this step (default: the newest)")
    sp.add_argument("-o", "--output", default="eval.json", help="JSON results (default eval.json)")
    sp.set_defaults(func=_cmd_eval)

    sp = sub.add_parser("export", help="write a run checkpoint's policy as a Hugging Face model directory")
    sp.add_argument("run_dir", metavar="RUN_DIR")
    sp.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest)")
    sp.add_argument("-o", "--output", required=True, metavar="DIR", help="output directory (must not exist, or be empty)")
    sp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast the weights (default: as trained, float32)")
    sp.set_defaults(func=_cmd_export)

    sp = sub.add_parser("tiny-model", help="build a tiny Qwen-style model directory")
    sp.add_argument("path")
    from ferryman.tiny import SHAPE_PRESETS

    sp.add_argument("--preset", choices=sorted(SHAPE_PRESETS), help="the shape of a released model (random weights, the tiny vocabulary)")
    sp.add_argument("--vocab-size", type=int, default=160)
    sp.add_argument("--hidden-size", type=int, default=None, help="default 64 (not with --preset)")
    sp.add_argument("--num-layers", type=int, default=None, help="default 2, or the preset's")
    sp.add_argument("--max-positions", type=int, default=None, help="context length (default 512, or the preset's)")
    sp.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="stored weights' dtype (presets only)")
    sp.add_argument("--seed", type=int, default=0)
    sp.set_defaults(func=_cmd_tiny)

    sp = sub.add_parser("timeline", help="draw the seed's chart (Rollouter, queue, Trainer lanes) from runs' traces")
    sp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (several: panels side by side)")
    sp.add_argument("-o", "--output", default="timeline.png", help="image file (default timeline.png)")
    sp.add_argument("--steps", help="draw from the start of local step FIRST to the end of LAST, e.g. 3:8 (default: all)")
    sp.add_argument("--titles", nargs="*", help="panel titles, one per RUN_DIR")
    sp.add_argument("--cols", type=int, default=None, help="panels per row (default 2)")
    sp.add_argument("--chrome", help="also write the trace as a Chrome/Perfetto JSON file (open in ui.perfetto.dev)")
    sp.set_defaults(func=_cmd_timeline)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from ferryman.checkpoint import CheckpointError, RunDiedError
    from ferryman.config import ConfigError
    from ferryman.plugins import PluginError

    try:
        return args.func(args)
    except (ConfigError, PluginError, CheckpointError) as e:
        print(f"ferryman: error: {e}", file=sys.stderr)
        return 2
    except RunDiedError as e:
        print(f"ferryman: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ferryman: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
