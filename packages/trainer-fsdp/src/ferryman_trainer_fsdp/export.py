"""The trained actor of a run checkpoint as a Hugging Face model directory (``ferryman export``).

The checkpoint's ``trainer/`` folder is a torch distributed checkpoint (DCP) that each rank
wrote its shards into (:meth:`FSDPTrainerBackend.save_checkpoint`). Here one process reads
it back without a process group (``dcp.load(..., no_dist=True)`` reshards into whole tensors)
into the base model's architecture and saves it with ``save_pretrained`` (safetensors, config,
generation config). With ``dtype`` unset the weights keep the master dtype they were trained
in (float32; float64 with ``param_dtype: float64``), so the exported model is the trainer's to
the bit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def export_hf(checkpoint_dir: str, *, model_path: str, config: Any, out_dir: str, dtype: str | None = None) -> None:
    """Write the actor saved in ``checkpoint_dir`` to ``out_dir`` (see the module docstring)."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    ckpt = Path(checkpoint_dir)
    if not (ckpt / "extra.pt").is_file() or not (ckpt / ".metadata").is_file():
        raise ValueError(f"{ckpt}: not a checkpoint of the fsdp trainer (no .metadata / extra.pt)")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} (allowed: {', '.join(DTYPES)})")
    master = torch.float64 if getattr(config, "param_dtype", "float32") == "float64" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=master)
    try:
        saved = set(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    except Exception as e:  # noqa: BLE001 - e.g. metadata pickled by another torch version
        raise ValueError(
            f"{ckpt}: cannot read the distributed checkpoint's metadata with torch {torch.__version__} "
            f"({e.__class__.__name__}: {e}); was it written by another torch version?"
        ) from None
    # the names the backend saved under (actor.model.<parameter name>); a tied parameter may be
    # saved under one name only, and loading it into that name fills both
    params = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=False).items():
        key = f"actor.model.{name}"
        if key in saved:
            params[name] = tensor
            seen.add(tensor.data_ptr())
    missing = [n for n, t in model.state_dict().items() if t.data_ptr() not in seen]
    if missing:
        raise ValueError(f"{ckpt}: the checkpoint's actor lacks {missing[:5]} (another model than {model_path}?)")
    state = {"actor": {"model": params}}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    with torch.no_grad():
        for name, tensor in params.items():
            if state["actor"]["model"][name] is not tensor:  # dcp.load fills in place; be sure
                tensor.copy_(state["actor"]["model"][name])
    if dtype is not None:
        model = model.to(DTYPES[dtype])
    model.config.use_cache = True
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
