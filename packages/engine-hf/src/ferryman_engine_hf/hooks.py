"""Plugin entry point (``[project.entry-points.ferryman] engine_hf``).

Importing this module is cheap: torch and transformers load only when an engine is built.
"""

from __future__ import annotations

import ferryman
from ferryman.specs import EngineSpec


@ferryman.hookimpl
def ferryman_register_engines() -> list[EngineSpec]:
    from ferryman_engine_hf.engine import HFEngineConfig, make_hf_engine

    return [EngineSpec("hf", make_hf_engine, HFEngineConfig, "transformers on CPU/GPU")]
