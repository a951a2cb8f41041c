"""Plugin entry point (``[project.entry-points.ferryman] engine_sglang``).

Importing this module is cheap and needs no SGLang: SGLang loads only when an engine starts,
so ``ferryman plugins`` lists the engine and ``ferryman config`` validates an sglang config
on a machine without it.
"""

from __future__ import annotations

import ferryman
from ferryman.specs import EngineSpec


@ferryman.hookimpl
def ferryman_register_engines() -> list[EngineSpec]:
    from ferryman_engine_sglang.config import SGLangEngineConfig
    from ferryman_engine_sglang.engine import make_sglang_engine

    return [EngineSpec("sglang", make_sglang_engine, SGLangEngineConfig, "SGLang (GPU): radix cache, memory release, TP inside a replica")]
