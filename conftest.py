"""Repository-wide pytest setup.

The tests run under ``uv run pytest``. Ray notices ``uv run`` and would start every worker
through ``uv run`` as well, which re-resolves the project and may try to download an
interpreter (fatal offline). The switch is read once, when Ray is first imported, so it is set
here, before any test module imports Ray.
"""

import os

os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
