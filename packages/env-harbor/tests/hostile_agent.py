"""``AttackAgent``: the hostile suite's agent for training runs. It asks the policy one question
through the proxy (so the trial has tokens to train on), then runs the task's attack
(``solution/solve.sh``) in the environment, like Harbor's oracle. A test helper, not a
shipped agent: ``env.agent: {import_path: hostile_agent:AttackAgent}`` with this directory on
``sys.path``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harbor.agents.base import BaseAgent
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext


class AttackAgent(BaseAgent):
    def __init__(self, logs_dir: Path, model_name: str | None = None, *args: Any, **kwargs: Any) -> None:
        self._task_dir = Path(kwargs.get("task_dir") or "")
        super().__init__(logs_dir, model_name, *args, **kwargs)

    @staticmethod
    def name() -> str:
        return "ferryman-attack"

    def version(self) -> str:
        return "0.1.0"

    async def setup(self, environment: BaseEnvironment) -> None:
        return None

    async def run(self, instruction: str, environment: BaseEnvironment, context: AgentContext) -> None:
        import openai

        base_url = self._extra_env["OPENAI_BASE_URL"]
        model = (self.model_name or "").split("/", 1)[-1]
        async with openai.AsyncOpenAI(base_url=base_url, api_key="ferryman", max_retries=0) as client:
            await client.chat.completions.create(model=model, messages=[{"role": "user", "content": instruction}], max_tokens=8)
        solve = Path(environment.environment_dir).parent / "solution"
        await environment.upload_dir(solve, "/solution")
        await environment.exec("bash /solution/solve.sh > /logs/agent/attack.txt 2>&1", timeout_sec=120)
