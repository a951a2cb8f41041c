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
then finds that very file, which the process has open already. TE's core library also needs
some of cuDNN's sublibraries by name (``libcudnn_heuristic.so.9``, ...), which the loader would
still take from the system folder (measured: ``/lib/x86_64-linux-gnu/libcudnn_heuristic.so.9:
undefined symbol``), so every ``libcudnn*.so.*`` in torch's folder is opened globally first.
Together these made TE's fused attention and ``train_step`` run on the H200. A ``CUDNN_HOME`` or
``CUDNN_PATH`` that the user set is left as it is, and nothing is preloaded then.
"""

from __future__ import annotations

import ctypes
import glob
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
        _preload_sublibraries(found)
    return found


def _preload_sublibraries(folder: str) -> None:
    """Open torch's cuDNN sublibraries (``libcudnn_graph.so.9``, ``libcudnn_heuristic.so.9``, ...)
    globally, so that TE's core library, which needs some of them by name, gets these and not the
    system's (measured: ``/lib/x86_64-linux-gnu/libcudnn_heuristic.so.9: undefined symbol``).
    The graph library first: the others need it. One that does not open is passed over."""
    names = sorted(glob.glob(os.path.join(folder, "libcudnn*.so.*")), key=lambda p: ("graph" not in p, p))
    for path in names:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass
