"""``ferryman eval``: the validation of a config, without training, on a model directory.

The engines are the config's (``engine.type``: the transformers engine on CPU, vLLM on a GPU),
``rollout.num_replicas`` of them in this process behind the config's router, with the model
replaced by the one evaluated; the tasks and sampling are the config's ``validation`` section
(held-out ``env`` overrides or ``split``; with neither, the env's own tasks).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ferryman.client import ServerClient
from ferryman.config import ConfigError, RunConfig
from ferryman.engine_host import EngineHandle
from ferryman.evaluation import EvalResult, evaluate, split_env
from ferryman.types import SamplingParams

__all__ = ["evaluate_model", "format_table"]


async def _evaluate(model_dir: str, cfg: RunConfig, host: Any, plugin_cfgs: dict[str, Any]) -> EvalResult:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    v = cfg.validation
    if v.env is not None:
        env = host.create("env", plugin_cfgs["validation_env"], tokenizer=tokenizer, seed=cfg.seed + 1)
    else:
        env = host.create("env", plugin_cfgs["env"], tokenizer=tokenizer, seed=cfg.seed)
        if v.split is not None:
            try:
                _, env = split_env(env, v.split)
            except ValueError as e:
                raise ConfigError(str(e)) from None
    engines = []
    for i in range(cfg.rollout.num_replicas):
        name = f"replica-{i}"
        engine = host.create("engine", plugin_cfgs["engine"], model_path=model_dir, replica=name, seed=cfg.seed + i)
        engines.append(EngineHandle(name, engine=engine))
    try:
        for e in engines:  # one at a time: model loading in one process is not thread-safe
            await e.start()
        router = host.create("router", plugin_cfgs["router"], replicas=[e.name for e in engines], seed=cfg.seed)
        client = ServerClient(router, {e.name: e for e in engines}, partial_rollout=False)
        sampling = SamplingParams(
            max_tokens=v.max_tokens or cfg.rollout.max_tokens,
            temperature=cfg.rollout.temperature if v.temperature is None else v.temperature,
            top_p=v.top_p,
        )
        return await evaluate(env, client, n=v.n, sampling=sampling, num_tasks=v.num_tasks,
                              success_threshold=v.success_threshold, concurrency=v.concurrency, request_prefix="eval")
    finally:
        close = getattr(env, "aclose", None)
        if close is not None:
            await close()
        await asyncio.gather(*(e.shutdown() for e in engines), return_exceptions=True)


def evaluate_model(model_dir: str | Path, cfg: RunConfig, host: Any, plugin_cfgs: dict[str, Any]) -> EvalResult:
    if not (Path(model_dir) / "config.json").is_file():
        raise ConfigError(f"{model_dir}: not a model directory (no config.json)")
    return asyncio.run(_evaluate(str(model_dir), cfg, host, plugin_cfgs))


def format_table(result: EvalResult, n: int, model: str) -> str:
    m = result.metrics
    rows = [
        ("model", model),
        ("tasks", f"{int(m['num_tasks'])}"),
        ("answers per task", f"{n}"),
        ("pass@1", f"{m['pass@1']:.4f}"),
        (f"pass@{n}", f"{m[f'pass@{n}']:.4f}"),
        ("mean reward", f"{m['reward_mean']:.4f}"),
        ("mean response length", f"{m['response_length_mean']:.2f}"),
        ("failed runs", f"{int(m['failed_runs'])}"),
        ("time", f"{m['time_s']:.1f}s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {val}" for k, val in rows)
