"""The locked wheels of a GPU stack, for a GPU machine without internet (this project's H200).

    uv run python tools/gpu_wheels.py list [--extra vllm]          # what would be carried
    uv run python tools/gpu_wheels.py download [--extra vllm] DIR  # DIR/c1 ... DIR/cN, each <= 56 MiB
    ... --extra vllm --extra megatron                              # two stacks in one set
    ... --with harbor --with litellm                               # carry these named ones too
    ... --extra vllm --extra megatron-te     # Transformer Engine: tools/build-te-torch.sh first
    uv run python tools/gpu_wheels.py download --only pyzmq DIR    # only these (of the carried set)

The list is ``uv export --frozen --extra EXTRA`` (the stack, ferryman's own needs, the dev group
for the tests, and the ``gpu-build`` group so the workspace packages can be installed there)
for Linux x86-64 and CPython 3.12, minus what the GPU machine already has at the locked version
(``tools/gpu-machine-packages.txt``), minus the optional packages named with their reasons in
``tools/gpu-not-carried.txt`` (``--with NAME`` carries one of those and what only it needs,
``--all`` all of them). ``download`` fetches exactly those pinned wheels from the
package index, splits any wheel over 56 MiB into parts, and packs the files into folders of at
most 56 MiB, one folder per device call (a call carries 64 MiB). ``DIR/MANIFEST`` lists every
wheel with its sha256; ``tools/gpu-install.sh`` on the GPU machine joins the parts, checks the
hashes and installs them.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from packaging.markers import Marker
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
MACHINE = ROOT / "tools" / "gpu-machine-packages.txt"
NOT_CARRIED = ROOT / "tools" / "gpu-not-carried.txt"
LIMIT = 56 * 2**20
BUILT_HERE = {"transformer-engine-torch": "tools/build-te-torch.sh"}
"""Locked packages published as source only, and the script that builds their wheel into the cache."""
TARGET_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
    "extra": "",
}
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64"] + [
    f"manylinux_2_{n}_x86_64" for n in range(5, 40)
]


def _extras(extra: str | Sequence[str]) -> list[str]:
    return [extra] if isinstance(extra, str) else list(extra)


def not_carried(extra: str | Sequence[str], path: Path = NOT_CARRIED) -> set[str]:
    """Names left behind on purpose for ``extra`` (one extra or several; each name with its
    reason in the file): the names under ``[EXTRA]`` and under ``[all]``."""
    wanted = {"all", *_extras(extra)}
    names: set[str] = set()
    section = "all"
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
            continue
        if section in wanted:
            names.add(canonicalize_name(line))
    return names


def machine_packages(path: Path = MACHINE) -> dict[str, str | None]:
    """Name -> version (None: present, version not known) of what the GPU machine has."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        out[canonicalize_name(name)] = version.strip() or None
    return out


def export(extra: str | Sequence[str]) -> list[tuple[str, str]]:
    """(name, version) pins of the lock's export for ``extra`` (one or several) that apply to
    the GPU machine."""
    cmd = ["uv", "export", "--frozen", "--no-hashes", "--no-emit-workspace", "--no-annotate", "--no-header",
           *(a for e in _extras(extra) for a in ("--extra", e)), "--group", "gpu-build"]
    text = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    pins = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", "-")):
            continue
        req, _, marker = line.partition(";")
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s]+)", req.strip())
        if m is None:
            raise SystemExit(f"gpu_wheels: cannot read the export line {raw!r} (expected NAME==VERSION)")
        if marker.strip() and not Marker(marker.strip()).evaluate(TARGET_ENV):
            continue
        pins.append((canonicalize_name(m.group(1)), m.group(2)))
    return sorted(set(pins))


def carried(
    extra: str | Sequence[str],
    machine: dict[str, str | None] | None = None,
    *,
    everything: bool = False,
    keep: Sequence[str] = (),
) -> list[tuple[str, str]]:
    """The export minus what the machine has at the locked version (or at an unknown one),
    minus the packages of ``tools/gpu-not-carried.txt`` unless ``everything``, or unless named
    in ``keep``. Names in that file (or in ``keep``) but not in the export are an error (the
    file would silently go stale)."""
    machine = machine_packages() if machine is None else machine
    pins = export(extra)
    have = {n for n, _ in pins}
    skip: set[str] = set()
    if not everything:
        skip = not_carried(extra)
        stale = sorted(skip - have)
        if stale:
            raise SystemExit(f"gpu_wheels: {NOT_CARRIED.name} names packages the {'+'.join(_extras(extra))!r} export lacks: {', '.join(stale)}")
        keep_names = {canonicalize_name(k) for k in keep}
        unknown = sorted(keep_names - skip)
        if unknown:
            raise SystemExit(f"gpu_wheels: --with {', '.join(unknown)}: not a package that {NOT_CARRIED.name} leaves behind")
        skip -= keep_names
    return [(n, v) for n, v in pins if not (n in machine and machine[n] in (None, v)) and n not in skip]


def only(pins: list[tuple[str, str]], names: str) -> list[tuple[str, str]]:
    """The pins named in ``names`` (comma-separated); a name the carried set lacks is an error."""
    want = {canonicalize_name(n) for n in names.split(",") if n.strip()}
    missing = sorted(want - {n for n, _ in pins})
    if missing:
        raise SystemExit(f"gpu_wheels: --only names wheels that are not carried: {', '.join(missing)}")
    return [(n, v) for n, v in pins if n in want]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pip_python() -> str:
    """An interpreter with pip: this one, or the base one of this virtual environment (uv's
    environments have no pip)."""
    for exe in (sys.executable, getattr(sys, "_base_executable", ""), shutil.which("python3") or ""):
        if exe and subprocess.run([exe, "-m", "pip", "--version"], capture_output=True).returncode == 0:
            return exe
    raise SystemExit("gpu_wheels: no Python with pip found (pip download fetches the wheels)")


def download(
    extra: str | Sequence[str],
    out: Path,
    cache: Path,
    everything: bool = False,
    keep: Sequence[str] = (),
    names: str | None = None,
) -> None:
    pins = carried(extra, everything=everything, keep=keep)
    if names:
        pins = only(pins, names)
    cache.mkdir(parents=True, exist_ok=True)
    # a wheel already in the cache is used as it is: one built here from a source-only release
    # (tools/build-te-torch.sh) has no index to come from
    want = [(n, str(Version(v))) for n, v in pins]
    wheels = _cached(cache)
    fetch = [(n, v) for (n, v), k in zip(pins, want, strict=True) if k not in wheels and n not in BUILT_HERE]
    if fetch:
        _pip_download(fetch, cache)
        wheels = _cached(cache)
    missing = [f"{n}=={v}" for n, v in want if (n, v) not in wheels]
    if missing:
        hint = f" (source-only releases are built into {cache} first: {', '.join(f'{n}: {BUILT_HERE[n]}' for n, _ in want if n in BUILT_HERE)})" if any(n in BUILT_HERE for n, _ in want) else ""
        raise SystemExit(f"gpu_wheels: no wheel downloaded for {', '.join(missing)}{hint}")
    sizes = pack([wheels[k] for k in want], out)
    print(f"{len(pins)} wheels, {sum(sizes) / 2**20:.0f} MiB in {len(sizes)} folders under {out} (MANIFEST in c1)")
    for i, s in enumerate(sizes, 1):
        print(f"  c{i}: {s / 2**20:.1f} MiB")


def _cached(cache: Path) -> dict[tuple[str, str], Path]:
    """The wheels in ``cache`` by (name, version)."""
    out = {}
    for w in cache.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(w.name)
        out[(name, str(version))] = w
    return out


def _pip_download(pins: list[tuple[str, str]], cache: Path) -> None:
    """``pip download`` of exactly these pinned wheels for the GPU machine into ``cache``."""
    reqs = cache / "requirements.txt"
    reqs.write_text("".join(f"{n}=={v}\n" for n, v in pins))
    cmd = [_pip_python(), "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", "-d", str(cache), "-r", str(reqs)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd += ["--platform", "any"]
    subprocess.run(cmd, check=True)


def pack(wheels: list[Path], out: Path, limit: int = LIMIT) -> list[int]:
    """Split each wheel over ``limit`` bytes into ``NAME.partNN`` and pack all files into
    ``out/c1``, ``out/c2``, ... of at most ``limit`` bytes each (first fit, largest first);
    ``out/c1/MANIFEST`` holds each wheel's sha256 and name. Returns the folders' sizes."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpuwheels-"))
    files: list[tuple[str, Path]] = []  # (name in the folders, source)
    manifest = []
    for w in wheels:
        manifest.append(f"{_sha256(w)}  {w.name}")
        if w.stat().st_size <= limit:
            files.append((w.name, w))
            continue
        with w.open("rb") as f:
            k = 0
            while block := f.read(limit):
                part = tmp / f"{w.name}.part{k:02d}"
                part.write_bytes(block)
                files.append((part.name, part))
                k += 1
    folders: list[list[tuple[str, Path]]] = []
    sizes: list[int] = []
    for name, src in sorted(files, key=lambda f: (-f[1].stat().st_size, f[0])):
        size = src.stat().st_size
        for i, used in enumerate(sizes):
            if used + size <= limit:
                folders[i].append((name, src))
                sizes[i] += size
                break
        else:
            folders.append([(name, src)])
            sizes.append(size)
    for i, group in enumerate(folders, 1):
        d = out / f"c{i}"
        d.mkdir()
        for name, src in group:
            shutil.copyfile(src, d / name)
    if not folders:
        (out / "c1").mkdir()
    (out / "c1" / "MANIFEST").write_text("".join(f"{m}\n" for m in manifest))
    shutil.rmtree(tmp)
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="print NAME==VERSION of every wheel that would be carried")
    ls.add_argument("--extra", action="append", help="a root extra (repeatable; default vllm)")
    ls.add_argument("--with", dest="keep", action="append", default=[], metavar="NAME", help="also carry this package of tools/gpu-not-carried.txt (repeatable)")
    ls.add_argument("--all", action="store_true", help="also the packages of tools/gpu-not-carried.txt")
    dl = sub.add_parser("download", help="download and pack the wheels into DIR/c1 ... DIR/cN")
    dl.add_argument("--extra", action="append", help="a root extra (repeatable; default vllm)")
    dl.add_argument("--with", dest="keep", action="append", default=[], metavar="NAME", help="also carry this package of tools/gpu-not-carried.txt (repeatable)")
    dl.add_argument("--all", action="store_true", help="also the packages of tools/gpu-not-carried.txt")
    dl.add_argument("--cache", default=str(ROOT / ".gpuwheels-cache"), help="download cache (default .gpuwheels-cache)")
    dl.add_argument("--only", default=None, help="comma-separated names: download only these of the carried wheels")
    dl.add_argument("dir", nargs="?", default=str(ROOT / ".gpuwheels"))
    args = p.parse_args(argv)
    extras = args.extra or ["vllm"]
    if args.cmd == "list":
        for n, v in carried(extras, everything=args.all, keep=args.keep):
            print(f"{n}=={v}")
        return 0
    download(extras, Path(args.dir), Path(args.cache), everything=args.all, keep=args.keep, names=args.only)
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
