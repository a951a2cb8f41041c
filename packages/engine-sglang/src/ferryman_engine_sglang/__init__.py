"""ferryman rollout engine on SGLang (``engine: {type: sglang}``)."""

from ferryman_engine_sglang.config import SGLangEngineConfig
from ferryman_engine_sglang.engine import SGLangEngine, make_sglang_engine

__all__ = ["SGLangEngine", "SGLangEngineConfig", "make_sglang_engine"]
