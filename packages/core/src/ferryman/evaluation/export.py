"""``ferryman export``: a run checkpoint's policy as a Hugging Face model directory.

The trainer plugin that wrote the checkpoint turns its ``trainer/`` folder into weights, config
and generation config (``TrainerSpec.exporter``); this module finds the checkpoint, adds the
run's tokenizer (with its chat template) and ``ferryman_export.json`` (run, step, weight
version), and writes the directory atomically (aside, then renamed).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ferryman.checkpoint import TRAINER_DIR, CheckpointError, CheckpointStore, read_meta
from ferryman.config import ConfigError, load_config

__all__ = ["export_checkpoint", "find_step_checkpoint", "run_config"]


def run_config(run_dir: str | Path, host: Any, overrides: list[str] | None = None) -> tuple[Any, dict[str, Any]]:
    """The run's saved config (``RUN_DIR/config.yaml``), validated."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no config.yaml there (is it a run directory?)")
    return load_config(path, [f"run_dir={run_dir}", *(overrides or [])], host)


def find_step_checkpoint(cfg: Any, step: int | None) -> Path:
    """The checkpoint of ``step`` (default: the newest) of the run ``cfg`` describes."""
    root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run_dir) / "checkpoints"
    store = CheckpointStore(root)
    if step is None:
        latest = store.latest()
        if latest is None:
            raise CheckpointError(f"{root}: no checkpoint yet (set checkpoint.every_steps in the run's config)")
        return latest
    for path in store.list():
        if int(read_meta(path)["step"]) == step:
            return path
    have = [int(read_meta(p)["step"]) for p in store.list()]
    raise CheckpointError(f"--step {step}: no checkpoint of that step in {root} (there are: {have or 'none'})")


def export_checkpoint(run_dir: str | Path, out_dir: str | Path, *, host: Any, step: int | None = None, dtype: str | None = None) -> dict[str, Any]:
    """Export the checkpoint of ``step`` (default: the newest) of the run in ``run_dir`` to
    ``out_dir`` (which must not exist, or be empty). Returns what was written."""
    cfg, plugin_cfgs = run_config(run_dir, host)
    ckpt = find_step_checkpoint(cfg, step)
    meta = read_meta(ckpt)
    trainer_cfg = plugin_cfgs["trainer"]
    spec = host.specs("trainer")[trainer_cfg.type]
    if spec.exporter is None:
        raise ConfigError(f"trainer.type: {trainer_cfg.type!r} cannot export its checkpoints (its TrainerSpec has no exporter)")
    trainer_dir = ckpt / TRAINER_DIR
    if not trainer_dir.is_dir():
        raise CheckpointError(f"{ckpt}: no {TRAINER_DIR}/ folder (the backend saved no checkpoint directory)")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"-o {out}: exists and is not an empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        try:
            spec.exporter(str(trainer_dir), model_path=cfg.model.path, config=trainer_cfg, out_dir=str(tmp), dtype=dtype)
        except (ValueError, OSError) as e:  # the exporter's clear errors: not a traceback
            raise CheckpointError(f"export of {ckpt}: {e}") from e
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(cfg.model.path).save_pretrained(tmp)
        info = {
            "run_dir": str(Path(run_dir).resolve()),
            "checkpoint": str(ckpt.resolve()),
            "step": int(meta["step"]),
            "weight_version": meta.get("version"),
            "base_model": cfg.model.path,
            "trainer": trainer_cfg.type,
            "dtype": dtype or "as trained",
        }
        (tmp / "ferryman_export.json").write_text(json.dumps(info, indent=1))
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {**info, "path": str(out), "files": sorted(p.name for p in out.iterdir())}
