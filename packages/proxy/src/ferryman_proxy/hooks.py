"""Plugin entry point (``[project.entry-points.ferryman] proxy``): the ``openai_agent`` and
``dataset`` envs.

Importing this module is cheap: aiohttp and transformers load only when an env is built.
"""

from __future__ import annotations

import ferryman
from ferryman.specs import EnvSpec


@ferryman.hookimpl
def ferryman_register_envs() -> list[EnvSpec]:
    from ferryman_proxy.dataset import DatasetEnv, DatasetEnvConfig
    from ferryman_proxy.env import OpenAIAgentEnv, OpenAIAgentEnvConfig

    return [
        EnvSpec(
            "dataset",
            DatasetEnv.from_config,
            DatasetEnvConfig,
            "a data file (jsonl, parquet) and a reward function; single-turn or multi-turn with Python tools (white-box, through the proxy's tokenization)",
        ),
        EnvSpec(
            "openai_agent",
            OpenAIAgentEnv.from_config,
            OpenAIAgentEnvConfig,
            "a black-box Python agent talking to the policy through the OpenAI-compatible proxy",
        )
    ]
