"""Which tensors a weight update may carry: names and shapes read from the checkpoint.

vLLM's model ``load_weights`` stops at the first unknown name, after loading the tensors
before it. To keep "bad input changes nothing", every bucket is checked first against the
checkpoint the engine was started from: the safetensors headers (names, shapes) of
``model_path``, read without loading any tensor data.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferryman.engine_checks import check_named_tensors


@dataclass(frozen=True)
class CheckpointSpec:
    shapes: dict[str, tuple[int, ...]]
    """Parameter name (as in the checkpoint / the trainer's state dict) to shape."""
    vocab_size: int | None
    max_position_embeddings: int | None


def _safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 100 * 2**20:
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
        for name, meta in _safetensors_header(file).items():
            if name == "__metadata__":
                continue
            shapes[name] = tuple(int(d) for d in meta["shape"])
    config: dict[str, Any] = {}
    if (root / "config.json").is_file():
        config = json.loads((root / "config.json").read_text())
    text_config = config.get("text_config") or config
    if text_config.get("tie_word_embeddings", config.get("tie_word_embeddings")) and "lm_head.weight" not in shapes:
        embed = shapes.get("model.embed_tokens.weight")
        if embed is not None:
            shapes["lm_head.weight"] = embed
    vocab = text_config.get("vocab_size")
    positions = text_config.get("max_position_embeddings")
    return CheckpointSpec(
        shapes=shapes,
        vocab_size=int(vocab) if vocab else None,
        max_position_embeddings=int(positions) if positions else None,
    )


def check_bucket(named_tensors: Any, spec: CheckpointSpec) -> list[tuple[str, Any]]:
    """Validate a bucket; return it as ``(checkpoint name, tensor)`` pairs.

    Raises ValueError listing every problem (not a pair, not a tensor, unknown name, wrong
    shape, not floating point) when anything is wrong.
    """
    try:
        items = list(named_tensors)
    except TypeError:
        raise ValueError(f"load_weights: expected a list of (name, tensor) pairs, got {type(named_tensors).__name__}") from None
    return check_named_tensors(items, spec.shapes, who="load_weights", require_float=True)
