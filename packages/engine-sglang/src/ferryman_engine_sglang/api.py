"""The seam between ferryman and SGLang: everything this package takes from SGLang.

:func:`load_sglang` imports SGLang (only when an engine starts) and returns an
:class:`SGLangAPI`: the ``Engine`` class, the request objects of ``io_struct`` that ferryman
sends to SGLang's tokenizer manager, and the serializer ``update_weights_from_tensor`` uses.
:class:`ferryman_engine_sglang.testing.FakeSGLangEngine` provides the same for CPU tests.

Why the tokenizer manager and not ``Engine``'s own methods: ``sglang.Engine.flush_cache``,
``update_weights_from_tensor``, ``release_memory_occupation`` … run
``loop.run_until_complete`` on the engine's loop, which cannot be done from inside a running
event loop (where every ferryman engine lives). Their bodies are one ``await`` on the
tokenizer manager, which this engine makes itself; ``async_generate`` is async already.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

SUPPORTED = ">=0.5.11,<0.5.18"
"""SGLang releases this engine is written against (they pin torch 2.11 and CUDA 13)."""
EXTRA_HINT = (
    "engine type 'sglang' needs SGLang, which is not installed: uv sync --extra sglang in a ferryman "
    "checkout, or pip install 'ferryman-engine-sglang[sglang]' (Linux x86-64 with an NVIDIA GPU)"
)


@dataclass(frozen=True)
class SGLangAPI:
    engine_cls: Callable[..., Any]
    """``sglang.Engine`` (kwargs: SGLang's ``ServerArgs``)."""
    io: Any
    """Namespace with ``PauseGenerationReqInput``, ``ContinueGenerationReqInput``,
    ``ReleaseMemoryOccupationReqInput``, ``ResumeMemoryOccupationReqInput``,
    ``UpdateWeightsFromTensorReqInput`` (``sglang.srt.managers.io_struct``)."""
    serialize: Callable[[Any], bytes]
    """``MultiprocessingSerializer.serialize``: CUDA tensors cross to the scheduler processes
    as CUDA IPC handles (no copy)."""
    version: str


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def check_version(version: str) -> None:
    if not (0, 5, 11) <= _version_tuple(version) < (0, 5, 18):
        raise RuntimeError(
            f"ferryman's sglang engine supports sglang{SUPPORTED}, found {version}: later releases "
            "change the weight-update protocol (begin/end_weight_update) and internals it uses"
        )


def load_sglang() -> SGLangAPI:
    """Import SGLang; one clear error when it is missing or of another release."""
    if not sglang_available():
        raise RuntimeError(EXTRA_HINT)
    version = importlib.metadata.version("sglang")
    check_version(version)
    # importing SGLang's engine module sets uvloop as the process's event loop policy: keep
    # the caller's
    policy = asyncio.get_event_loop_policy()
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers import io_struct
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    asyncio.set_event_loop_policy(policy)
    # CUDA IPC handles name the device by UUID (SGLang's schedulers patch the receiving side
    # the same way), so a tensor on GPU k here maps to the right GPU there
    monkey_patch_torch_reductions()
    return SGLangAPI(engine_cls=Engine, io=io_struct, serialize=MultiprocessingSerializer.serialize, version=version)
