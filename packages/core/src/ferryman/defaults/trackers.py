"""Core's metric sinks: ``jsonl`` (one JSON object per step in ``RUN_DIR/metrics.jsonl``),
``console`` (one progress line per step), ``tensorboard`` (event files in
``RUN_DIR/tensorboard``; extra ``tensorboard``) and ``wandb`` (Weights & Biases, offline by
default; extra ``wandb``)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Literal, TextIO

import yaml
from pydantic import Field, model_validator

import ferryman
from ferryman.config import PluginConfig
from ferryman.specs import TrackerSpec


class JsonlTrackerConfig(PluginConfig):
    type: Literal["jsonl"] = "jsonl"
    filename: str = "metrics.jsonl"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` as :class:`JsonlTracker` wrote them, in file order: a run
    directory's ``metrics.jsonl``, or the file itself. A line torn by a kill is skipped; no file,
    no rows. (A resumed run has each step once: the tracker drops the lines after its
    checkpoint's step before it appends.)"""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


class JsonlTracker:
    """Appends one line per step: a JSON object (a non-finite value is written as ``null`` and
    counted in ``metrics/nonfinite``, as JSON has no NaN). ``resume_step``: a run resumed from the checkpoint of that
    step; lines of later steps (logged before a crash, about to be redone) are dropped first."""

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        if resume_step is not None and path.is_file():
            kept = [line for line in path.read_text().splitlines() if line.strip() and _step_of(line) <= resume_step]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(path)
        self._f: TextIO | None = path.open("a", buffering=1)

    @classmethod
    def from_config(cls, config: JsonlTrackerConfig, *, run_dir: str, resume_step: int | None = None, **_: Any) -> JsonlTracker:
        return cls(Path(run_dir) / config.filename, resume_step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._f is None:
            raise RuntimeError("JsonlTracker: log() after close()")
        row: dict[str, Any] = {"step": step, "time": time.time()}
        bad = 0
        for k, v in metrics.items():
            if isinstance(v, float) and not math.isfinite(v):
                v, bad = None, bad + 1  # JSON has no NaN or Infinity: null, and counted
            row[k] = v
        if bad:
            row["metrics/nonfinite"] = bad
        self._f.write(json.dumps(row, sort_keys=True, allow_nan=False, default=_plain) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _plain(v: Any) -> Any:
    """numpy and torch scalars as Python numbers (non-finite as null)."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return str(v)
    return x if math.isfinite(x) else None


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 1 << 62  # a torn line (the process died mid-write): dropped


class ConsoleTrackerConfig(PluginConfig):
    type: Literal["console"] = "console"
    keys: list[str] = Field(
        default_factory=lambda: ["reward/mean", "response/length_mean", "staleness/token_mean", "sync/total_s", "timing/step_s"]
    )
    """Metrics shown on each progress line (when present)."""
    counts: bool = True
    """Also show the agent runs failed and the samples dropped so far (``failed=``,
    ``dropped=``) and the steps skipped for a non-finite gradient (``nonfinite_steps=``)."""


COUNT_KEYS = {
    "rollouter/failed_trajectories": "failed",
    "rollouter/dropped_samples": "dropped",
    "trainer/nonfinite_grad_steps": "nonfinite_steps",
}
"""Counters the console line shows as whole numbers under a short name."""


class ConsoleTracker:
    """One line per step: ``step/total``, samples/s, the ETA and the config's ``keys``; on a
    terminal also a progress bar. Validation metrics (``val/…``) get a line of their own."""

    BAR = 20

    def __init__(self, keys: list[str], stream: TextIO | None = None, total_steps: int | None = None,
                 resume_step: int | None = None, tty: bool | None = None, counts: bool = True) -> None:
        self.keys = keys
        self.stream = stream or sys.stdout
        self.total = total_steps
        self.counts = counts
        self._t0 = time.monotonic()
        self._first_step = resume_step or 0
        """Steps done before this process started (a resume): the ETA uses only this run's."""
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty

    @classmethod
    def from_config(cls, config: ConsoleTrackerConfig, *, total_steps: int | None = None, resume_step: int | None = None, **_: Any) -> ConsoleTracker:
        return cls(config.keys, total_steps=total_steps, resume_step=resume_step, counts=config.counts)

    def progress(self, step: int, elapsed: float) -> list[str]:
        """``step/total``, percent, bar (terminal only) and ETA."""
        if not self.total:
            return [f"step {step:4d}"]
        width = len(str(self.total))
        parts = [f"step {step:{width}d}/{self.total}", f"{100.0 * step / self.total:5.1f}%"]
        if self.tty:
            filled = int(round(self.BAR * min(step, self.total) / self.total))
            parts.insert(1, "[" + "#" * filled + "-" * (self.BAR - filled) + "]")
        done = step - self._first_step
        if done > 0 and step < self.total:
            parts.append(f"ETA {_duration(elapsed / done * (self.total - step))}")
        elif step >= self.total:
            parts.append("done")
        return parts

    def log(self, metrics: dict[str, float], step: int) -> None:
        elapsed = time.monotonic() - self._t0
        if "val/pass@1" in metrics and "reward/mean" not in metrics:
            vals = [f"{k[4:]}={v:.3f}" for k, v in metrics.items() if k.startswith("val/pass@") or k in ("val/reward_mean", "val/response_length_mean")]
            print(f"validation at step {step} (weights v{int(metrics.get('val/weight_version', -1))}): " + "  ".join(vals), file=self.stream, flush=True)
            return
        parts = [*self.progress(step, elapsed), f"t={elapsed:7.1f}s"]
        if "perf/samples_per_s_avg" in metrics:
            parts.append(f"{metrics['perf/samples_per_s_avg']:.2f} samples/s")
        for k in self.keys:
            if k in metrics:
                parts.append(f"{k}={metrics[k]:.3f}")
        if self.counts:
            for k, label in COUNT_KEYS.items():
                v = metrics.get(k)
                if isinstance(v, (int, float)) and math.isfinite(v):
                    parts.append(f"{label}={int(v)}")
        print("  ".join(parts), file=self.stream, flush=True)

    def close(self) -> None:
        self.stream.flush()


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _require(module: str, extra: str, tracker: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"the {tracker!r} tracker needs the {module!r} package: pip install 'ferryman[{extra}]'")


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


class TensorBoardTrackerConfig(PluginConfig):
    type: Literal["tensorboard"] = "tensorboard"
    subdir: str = "tensorboard"
    """Event files go to ``RUN_DIR/<subdir>`` (``tensorboard --logdir RUN_DIR/tensorboard``)."""
    flush_secs: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def installed(self) -> TensorBoardTrackerConfig:
        _require("tensorboard", "tensorboard", "tensorboard")
        return self


class TensorBoardTracker:
    """One scalar per metric and step (``torch.utils.tensorboard.SummaryWriter``)."""

    def __init__(self, log_dir: Path, flush_secs: float = 10.0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._w: Any = SummaryWriter(log_dir=str(log_dir), flush_secs=int(max(1, flush_secs)))

    @classmethod
    def from_config(cls, config: TensorBoardTrackerConfig, *, run_dir: str, **_: Any) -> TensorBoardTracker:
        return cls(Path(run_dir) / config.subdir, config.flush_secs)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._w is None:
            raise RuntimeError("TensorBoardTracker: log() after close()")
        for k, v in _finite(metrics).items():
            self._w.add_scalar(k, v, global_step=step)

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None


class WandbTrackerConfig(PluginConfig):
    type: Literal["wandb"] = "wandb"
    project: str = "ferryman"
    name: str | None = None
    """Run name (default: W&B picks one)."""
    entity: str | None = None
    mode: Literal["offline", "online", "disabled"] = "offline"
    """``offline`` (default) writes ``RUN_DIR/wandb`` with no network; upload later with
    ``wandb sync``. ``online`` needs ``WANDB_API_KEY`` or ``wandb login``."""
    tags: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def installed(self) -> WandbTrackerConfig:
        _require("wandb", "wandb", "wandb")
        return self


class WandbTracker:
    """Logs every step's metrics to a W&B run; the run's config is ``RUN_DIR/config.yaml``."""

    def __init__(self, config: WandbTrackerConfig, run_dir: Path) -> None:
        import wandb

        cfg_file = run_dir / "config.yaml"
        run_cfg = yaml.safe_load(cfg_file.read_text()) if cfg_file.is_file() else {}
        run_dir.mkdir(parents=True, exist_ok=True)
        self._run: Any = wandb.init(
            project=config.project,
            name=config.name,
            entity=config.entity,
            mode=config.mode,
            dir=str(run_dir),
            tags=config.tags or None,
            config=run_cfg,
            reinit="finish_previous",
        )

    @classmethod
    def from_config(cls, config: WandbTrackerConfig, *, run_dir: str, **_: Any) -> WandbTracker:
        return cls(config, Path(run_dir))

    @property
    def dir(self) -> str:
        return str(self._run.dir)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._run is None:
            raise RuntimeError("WandbTracker: log() after close()")
        self._run.log(_finite(metrics), step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


@ferryman.hookimpl
def ferryman_register_trackers() -> list[TrackerSpec]:
    return [
        TrackerSpec("jsonl", JsonlTracker.from_config, JsonlTrackerConfig, "RUN_DIR/metrics.jsonl"),
        TrackerSpec("console", ConsoleTracker.from_config, ConsoleTrackerConfig, "one progress line per step"),
        TrackerSpec(
            "tensorboard", TensorBoardTracker.from_config, TensorBoardTrackerConfig, "TensorBoard event files in RUN_DIR/tensorboard (extra: tensorboard)"
        ),
        TrackerSpec("wandb", WandbTracker.from_config, WandbTrackerConfig, "Weights & Biases, offline by default (extra: wandb)"),
    ]
