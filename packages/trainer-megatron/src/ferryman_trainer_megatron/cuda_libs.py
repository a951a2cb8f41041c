"""One cuDNN per process: Transformer Engine pointed at the cuDNN that torch has loaded.

TE finds cuDNN by itself when it is imported (``transformer_engine/common/__init__.py``,
``_load_cuda_library("cudnn")``): ``$CUDNN_HOME``, ``$CUDNN_PATH``, ``$CUDA_HOME``,
``$CUDA_PATH`` and ``/usr/local/cuda`` searched for ``libcudnn.so*``, then ``dlopen("libcudnn.so")``.
torch's pip wheels bring their own cuDNN (``nvidia/cudnn/lib/libcudnn.so.9``, with no unversioned
``libcudnn.so``), so on a machine that also has a system cuDNN, TE opens the system's file while
torch has its own loaded already: two cuDNN builds in one process. Measured on the H200
(TE 2.19, torch 2.11 + CUDA 13): TE's fused attention then fails with ``undefined symbol
_ZTVN5cudnn7backend12OperationSetE``, or, with torch's folder first on ``LD_LIBRARY_PATH`` (which
``dlopen("libcudnn.so")`` still passes over), ``CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED``.

:func:`share_torch_cudnn` sets ``CUDNN_PATH`` to the folder of the ``libcudnn.so.N`` that torch
has loaded, before Megatron (whose ``dist_checkpointing`` imports TE) is imported. TE's search
then finds that very file, which the process has open already. A ``CUDNN_HOME`` or ``CUDNN_PATH``
that the user set is left as it is.
"""

from __future__ import annotations

import os
import re

__all__ = ["loaded_library_dir", "share_torch_cudnn"]

_MAPS = "/proc/self/maps"


def loaded_library_dir(maps: str, soname_stem: str) -> str | None:
    """The folder of the first mapped file named ``<soname_stem>.so.<N>[...]`` in the text of
    ``/proc/<pid>/maps`` (``libcudnn`` finds ``.../libcudnn.so.9`` and not ``libcudnn_ops.so.9``),
    or None."""
    pattern = re.compile(rf"(/\S*/){re.escape(soname_stem)}\.so\.\d[\d.]*$")
    for line in maps.splitlines():
        m = pattern.search(line.strip())
        if m:
            return m.group(1).rstrip("/")
    return None


def share_torch_cudnn(maps_path: str = _MAPS) -> str | None:
    """Set ``CUDNN_PATH`` to the folder of torch's loaded cuDNN (see the module's text); returns
    that folder, or None where nothing was set: the user set ``CUDNN_HOME``/``CUDNN_PATH``, torch
    has no cuDNN (a CPU build), or the mapping cannot be read (not Linux)."""
    if os.environ.get("CUDNN_HOME") or os.environ.get("CUDNN_PATH"):
        return None
    import torch

    try:
        if not torch.backends.cudnn.is_available():
            return None
        torch.backends.cudnn.version()  # loads it where torch loads cuDNN lazily
        with open(maps_path) as f:
            found = loaded_library_dir(f.read(), "libcudnn")
    except OSError:
        return None
    if found is not None:
        os.environ["CUDNN_PATH"] = found
    return found
