"""Which tensors a weight update may carry: names and shapes read from the checkpoint.

SGLang's model ``load_weights`` runs in the scheduler processes; a name it does not know or a
tensor of the wrong shape fails there after the tensors before it were loaded (and may take
the scheduler down). To keep "bad input changes nothing", every bucket is checked here first
against the checkpoint the engine was started from: the safetensors headers (names, shapes)
of ``model_path``, read without loading any tensor data.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferryman.engine_checks import check_named_tensors

_MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class CheckpointSpec:
    shapes: dict[str, tuple[int, ...]]
    """Parameter name (as in the checkpoint / the trainer's state dict) to shape."""
    vocab_size: int | None
    max_position_embeddings: int | None
    num_layers: int | None
    experts_per_token: int | None
    """MoE models: experts per token (``num_experts_per_tok``), for ``routed_experts``."""


def _header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER:
            raise ValueError(f"{path}: safetensors header of {length} bytes is not plausible")
        return json.loads(f.read(length))


def read_checkpoint_spec(model_path: str | Path) -> CheckpointSpec:
    """Names and shapes of the tensors in ``model_path`` (``*.safetensors``), plus the
    ``lm_head.weight`` a trainer sends for a model with tied embeddings."""
    root = Path(model_path)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {str(root)!r}")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        for name, meta in _header(file).items():
            if name != "__metadata__":
                shapes[name] = tuple(int(d) for d in meta["shape"])
    config: dict[str, Any] = {}
    if (root / "config.json").is_file():
        config = json.loads((root / "config.json").read_text())
    text = config.get("text_config") or config
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings"))
    if tied and "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]

    def num(key: str) -> int | None:
        value = text.get(key)
        return int(value) if value else None

    return CheckpointSpec(
        shapes=shapes,
        vocab_size=num("vocab_size"),
        max_position_embeddings=num("max_position_embeddings"),
        num_layers=num("num_hidden_layers"),
        experts_per_token=num("num_experts_per_tok"),
    )


def check_bucket(named_tensors: Any, spec: CheckpointSpec) -> list[tuple[str, Any]]:
    """Validate a bucket; return it as ``(checkpoint name, tensor)`` pairs. Raises ValueError
    listing every problem when anything is wrong (nothing is loaded then)."""
    try:
        items = list(named_tensors)
    except TypeError:
        raise ValueError(f"load_weights: expected a list of (name, tensor) pairs, got {type(named_tensors).__name__}") from None
    return check_named_tensors(items, spec.shapes, who="load_weights", require_float=True)
