"""ferryman: fully asynchronous reinforcement learning for LLM agents."""

from ferryman.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["hookimpl", "__version__"]
