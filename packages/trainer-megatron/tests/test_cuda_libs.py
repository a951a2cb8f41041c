"""ferryman_trainer_megatron.cuda_libs: Transformer Engine pointed at torch's loaded cuDNN."""

from __future__ import annotations

import pytest

from ferryman_trainer_megatron import cuda_libs
from ferryman_trainer_megatron.cuda_libs import loaded_library_dir, share_torch_cudnn

SITE = "/opt/venv/lib/python3.12/site-packages/nvidia/cudnn/lib"
MAPS = f"""\
7f0000000000-7f0000001000 r--p 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000002000-7f0000003000 r-xp 00001000 08:01 2222 {SITE}/libcudnn_graph.so.9
7f0000004000-7f0000005000 r--p 00000000 08:01 3333 {SITE}/libcudnn.so.9
7f0000006000-7f0000007000 r--p 00000000 08:01 4444 /lib/x86_64-linux-gnu/libcudnn.so.9.1.0
7f0000008000-7f0000009000 rw-p 00000000 00:00 0
"""


def test_the_first_mapped_libcudnn_names_its_folder_and_sublibraries_do_not_count():
    assert loaded_library_dir(MAPS, "libcudnn") == SITE
    only_sub = "\n".join(line for line in MAPS.splitlines() if "libcudnn.so" not in line)
    assert loaded_library_dir(only_sub, "libcudnn") is None
    assert loaded_library_dir(MAPS, "libcudnn_graph") == SITE
    # a versioned file name (the system's) counts as well; "libcudnn.so" alone (no version) does not
    assert loaded_library_dir("1-2 r--p 0 0:0 1 /lib/x86_64-linux-gnu/libcudnn.so.9.1.0", "libcudnn") == "/lib/x86_64-linux-gnu"
    assert loaded_library_dir("1-2 r--p 0 0:0 1 /lib/libcudnn.so", "libcudnn") is None


@pytest.mark.parametrize("var", ["CUDNN_HOME", "CUDNN_PATH"])
def test_a_cudnn_folder_the_user_set_is_left_as_it_is(monkeypatch, tmp_path, var):
    monkeypatch.delenv("CUDNN_HOME", raising=False)
    monkeypatch.delenv("CUDNN_PATH", raising=False)
    monkeypatch.setenv(var, "/mine")
    maps = tmp_path / "maps"
    maps.write_text(MAPS)
    assert share_torch_cudnn(str(maps)) is None
    assert cuda_libs.os.environ[var] == "/mine"
    other = "CUDNN_PATH" if var == "CUDNN_HOME" else "CUDNN_HOME"
    assert other not in cuda_libs.os.environ


def test_cudnn_path_is_set_to_the_folder_torch_loaded(monkeypatch, tmp_path):
    import torch

    monkeypatch.delenv("CUDNN_HOME", raising=False)
    monkeypatch.delenv("CUDNN_PATH", raising=False)
    # this process's torch may be a CPU build: stand in a cuDNN that torch says it has
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    maps = tmp_path / "maps"
    maps.write_text(MAPS)
    assert share_torch_cudnn(str(maps)) == SITE
    assert cuda_libs.os.environ["CUDNN_PATH"] == SITE


def test_without_cudnn_or_maps_nothing_is_set(monkeypatch, tmp_path):
    import torch

    monkeypatch.delenv("CUDNN_HOME", raising=False)
    monkeypatch.delenv("CUDNN_PATH", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    assert share_torch_cudnn(str(tmp_path / "maps")) is None
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    assert share_torch_cudnn(str(tmp_path / "absent")) is None
    (tmp_path / "maps").write_text("1-2 r--p 0 0:0 1 /usr/lib/libc.so.6\n")
    assert share_torch_cudnn(str(tmp_path / "maps")) is None
    assert "CUDNN_PATH" not in cuda_libs.os.environ


def test_the_sublibraries_in_torchs_folder_are_opened_graph_first_and_a_bad_one_is_passed_over(
    monkeypatch, tmp_path
):
    import torch

    for name in ["libcudnn.so.9", "libcudnn_heuristic.so.9", "libcudnn_graph.so.9", "libcudnn_ops.so.9", "libc.so.6"]:
        (tmp_path / name).write_bytes(b"")
    opened = []

    def fake_cdll(path, mode=0):
        opened.append((path.rsplit("/", 1)[-1], mode))
        if "ops" in path:
            raise OSError("cannot open")

    monkeypatch.setattr(cuda_libs.ctypes, "CDLL", fake_cdll)
    monkeypatch.delenv("CUDNN_HOME", raising=False)
    monkeypatch.delenv("CUDNN_PATH", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    maps = tmp_path / "maps"
    maps.write_text(f"1-2 r--p 0 0:0 1 {tmp_path}/libcudnn.so.9\n")
    assert share_torch_cudnn(str(maps)) == str(tmp_path)
    names = [n for n, _ in opened]
    assert names[0] == "libcudnn_graph.so.9"
    assert sorted(names) == ["libcudnn.so.9", "libcudnn_graph.so.9", "libcudnn_heuristic.so.9", "libcudnn_ops.so.9"]
    assert {m for _, m in opened} == {cuda_libs.ctypes.RTLD_GLOBAL}
