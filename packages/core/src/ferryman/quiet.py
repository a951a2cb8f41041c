"""Quieter third-party libraries in a run's log (imported by the runner, the engine actors and the
CLI; a leaf module so that none of them imports another for it)."""

from __future__ import annotations


def quiet_transformers() -> None:
    """No weight-loading progress bars in a run's log (one per actor and replica otherwise)."""
    try:
        import transformers.utils.logging as tlog
    except ImportError:  # pragma: no cover
        return
    tlog.disable_progress_bar()
