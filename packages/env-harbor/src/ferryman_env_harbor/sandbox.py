"""A Docker-free Harbor environment: a persistent Linux namespace sandbox on the host's userland.

Use it in Harbor with ``EnvironmentConfig(import_path="ferryman_env_harbor.sandbox:NamespaceEnvironment")``
(CLI: ``-e ferryman_env_harbor.sandbox:NamespaceEnvironment``).

**What a sandbox is.** ``start()`` makes a private directory, a cgroup with the trial's limits
(:class:`~ferryman_env_harbor.contain.Cgroup`) and one *holder* process in it, ``unshare --mount
--pid --net --uts --ipc --fork --kill-child`` (no ``--net`` with ``network: host``). The holder
mounts a size-limited tmpfs for everything the sandbox may write, builds a root there out of the
host's ``/usr``, ``/etc`` and ``/var`` (each a copy-on-write overlay by default, or read-only
bind mounts), a fresh ``/proc`` (kernel knobs read-only), a small ``/dev`` with its own
``devpts`` (so tmux works), and private ``/tmp``, ``/root``, ``/logs``…; ``pivot_root``s into
it, detaches the host's tree and becomes the reaping init of the namespace. Every ``exec`` joins
the cgroup, enters the namespaces (``nsenter`` on file descriptors we hold, so a recycled pid can
never be entered) and drops capabilities (:data:`~ferryman_env_harbor.contain.CAPS_KEPT`), so
processes the agent leaves running (terminus-2's tmux server) survive between calls. ``stop()``
SIGKILLs the namespace's init through a pidfd, which kills every process in it, and removes the
cgroup and the directory.

**The task's Dockerfile** is carried out without its base image: see
:mod:`ferryman_env_harbor.dockerfile`. ``WORKDIR``, ``COPY``/``ADD`` from ``environment/``,
``ENV``, ``ARG``, ``SHELL``, ``USER``, ``VOLUME`` and ``RUN`` (with the host's tools) are
honoured; anything that needs an image is refused when the environment is created, with a
message naming the instruction; a ``RUN`` that fails raises Harbor's
``SandboxBuildFailedError`` (Harbor's policy: not graded, no valid reward).

**Containment** (the package README says exactly what is and is not contained): only the run's
proxy session is reachable from inside (a forwarder, by path prefix) plus, for tasks that allow
internet, a host-side egress proxy that refuses loopback, private and the host's own addresses;
memory, pids, CPU and storage are limited, a breach fails the trial
(``MemoryLimitExceededError``, ``PidsLimitExceededError``, ``StorageLimitExceededError``); the
host's files are out of reach; the verifier's ``/tests`` are fresh. Processes still run as root
on the host kernel (no user namespace, no VM): a kernel exploit is not contained. It needs root
(or CAP_SYS_ADMIN), util-linux and writable cgroups.

Options (``EnvironmentConfig.kwargs``, CLI ``--ek``): see :class:`NamespaceSandboxOptions`.
"""

from __future__ import annotations

import asyncio
import atexit
import fnmatch
import logging
import os
import posixpath
import shutil
import signal
import tarfile
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from harbor.environments.base import BaseEnvironment, ExecResult, SandboxBuildFailedError
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.environments.options import EnvironmentOptions
from harbor.models.task.config import NetworkMode
from pydantic import Field

from harbor.models.trial.paths import EnvironmentPaths

from ferryman_env_harbor.contain import (
    CAPS_KEPT,
    Cgroup,
    CgroupError,
    EgressProxy,
    Limits,
    MemoryLimitExceededError,
    PidsLimitExceededError,
    SandboxLimitExceeded,
    SessionForwarder,
    StorageLimitExceededError,
    listen_in_netns,
)
from ferryman_env_harbor.dockerfile import DockerfilePlan, UnsupportedDockerfileError, expand, parse_dockerfile

log = logging.getLogger(__name__)

BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
OUTPUT_LIMIT = 16 * 2**20
"""Bytes of stdout/stderr kept per exec (the tail beyond it is dropped)."""
SANDBOX_PREFIX = "ferryman-sbx-"
WATCH_INTERVAL_SEC = 0.1
"""How often a running command's sandbox is checked for a limit breach."""

_HOLDER_SCRIPT = r"""
set -eu
D="$1"; C="$2"; MODE="$3"; NET="$4"; DIRS="$5"; STORAGE_MB="$6"; SHM_MB="$7"; LINKS="$8"
exec 2>"$C/holder.log"
exec 3>"$C/pid"
read -r hostpid _rest < /proc/self/stat
# all the sandbox can write lives on one size-limited tmpfs (charged to its memory cgroup)
F="$D/fs"
mount -t tmpfs -o "size=${STORAGE_MB}m,mode=755,nosuid,nodev" ferryman-sandbox "$F"
R="$F/root"
mkdir -m 755 "$R" "$F/upper" "$F/work"
mount --bind "$R" "$R"
for d in $DIRS; do mkdir -p "$R/$d"; done
for l in $LINKS; do ln -s "${l#*=}" "$R/${l%%=*}"; done
for dm in proc:555 dev:755 sys:555 tmp:1777 root:700 home:755 run:755 opt:755 srv:755 mnt:755 logs:755; do
  [ -e "$R/${dm%%:*}" ] || mkdir -m "${dm#*:}" "$R/${dm%%:*}"
done
for s in agent verifier artifacts; do mkdir -m 777 "$R/logs/$s"; done
for d in $DIRS; do
  if [ "$MODE" = overlay ]; then
    mkdir -p "$F/upper/$d" "$F/work/$d"
    mount -t overlay overlay -o "lowerdir=/$d,upperdir=$F/upper/$d,workdir=$F/work/$d" "$R/$d"
  else
    mount --bind "/$d" "$R/$d"
    mount -o remount,bind,ro "$R/$d"
  fi
done
mount -t proc -o nosuid,nodev,noexec proc "$R/proc"
# what Docker also protects: kernel knobs read-only, kernel memory and key lists hidden
for p in sys sysrq-trigger bus fs irq; do
  if [ -e "$R/proc/$p" ]; then mount --bind "$R/proc/$p" "$R/proc/$p"; mount -o remount,bind,ro "$R/proc/$p"; fi
done
for p in kcore keys timer_list sched_debug kallsyms; do
  if [ -e "$R/proc/$p" ]; then mount --bind /dev/null "$R/proc/$p"; fi
done
mount -t tmpfs -o mode=755,nosuid tmpfs "$R/dev"
for n in null zero full random urandom tty; do
  touch "$R/dev/$n"
  mount --bind "/dev/$n" "$R/dev/$n"
done
mkdir "$R/dev/pts" "$R/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts "$R/dev/pts"
ln -s pts/ptmx "$R/dev/ptmx"
mount -t tmpfs -o "size=${SHM_MB}m,mode=1777,nosuid,nodev" tmpfs "$R/dev/shm"
ln -s /proc/self/fd "$R/dev/fd"
ln -s /proc/self/fd/0 "$R/dev/stdin"
ln -s /proc/self/fd/1 "$R/dev/stdout"
ln -s /proc/self/fd/2 "$R/dev/stderr"
# the private network's loopback up (SIOCGIFFLAGS / SIOCSIFFLAGS with IFF_UP through perl, which the
# holder needs anyway: no iproute2 needed, which minimal hosts such as the project's GPU machine lack)
if [ "$NET" = 1 ]; then
  perl -e 'use Socket; socket(my $s, PF_INET, SOCK_DGRAM, 0) or die "socket: $!\n";
    my $r = pack("a16 s x22", "lo", 0); ioctl($s, 0x8913, $r) or die "SIOCGIFFLAGS lo: $!\n";
    ioctl($s, 0x8914, pack("a16 s x22", "lo", unpack("x16 s", $r) | 1)) or die "SIOCSIFFLAGS lo: $!\n";'
fi
# the sandbox's root becomes the namespace's root; the host's tree is detached from it, so
# nothing of the host is reachable by path, not even by a chroot escape
cd "$R"
mkdir .oldroot
pivot_root . .oldroot
cd /
umount -l /.oldroot
rmdir /.oldroot
printf '%s\n' "$hostpid" >&3
exec 3>&-
exec perl -e '$SIG{TERM} = "IGNORE"; while (1) { sleep 1 if wait() == -1 }'
"""

_CGROUP_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
"""``sh -c`` prefix that moves itself into the sandbox's cgroups, then execs the rest."""


class NamespaceSandboxOptions(EnvironmentOptions):
    """``kwargs`` of :class:`NamespaceEnvironment`."""

    rootfs: Literal["overlay", "bind"] = Field(
        "overlay",
        description="overlay: the host's /usr, /etc, /var as copy-on-write overlays (writes stay in the sandbox); "
        "bind: read-only bind mounts (writes there fail)",
    )
    host_dirs: list[str] = Field(
        default_factory=lambda: ["usr", "etc", "var"],
        description="top-level host directories visible in the sandbox (plus the /bin, /lib… symlinks into /usr)",
    )
    sandbox_dir: str | None = Field(None, description="where sandbox directories are made (default: the system temp dir)")
    network: Literal["auto", "host", "none"] = Field(
        "auto",
        description="auto: a private network namespace (loopback only; the run's proxy session forwarded in); tasks "
        "that allow internet also get the filtered egress proxy; none: the same, never any egress; host: the host's "
        "network (NOT contained: every host port is reachable; no-network tasks are refused)",
    )
    proxy_url: str | None = Field(
        None,
        description="the run's proxy session (http://127.0.0.1:PORT/sess/SECRET/v1): reachable inside at the same "
        "address, only under its /sess/SECRET/ prefix (HarborEnv sets it per trial)",
    )
    egress_port: int = Field(3128, ge=1, le=65535, description="port of the egress proxy inside the sandbox")
    enforce_limits: bool = Field(True, description="cgroup limits (memory, pids, cpu) and a size-limited storage tmpfs")
    default_cpus: float = Field(1.0, gt=0, description="CPUs when the task's [environment] gives no cpus")
    default_memory_mb: int = Field(2048, ge=16, description="memory when the task gives no memory_mb")
    default_storage_mb: int = Field(2048, ge=8, description="writable storage when the task gives no storage_mb")
    pids_limit: int = Field(1024, ge=8, description="most processes and threads at once")
    shm_mb: int = Field(64, ge=1, description="size of /dev/shm (within the storage limit)")
    fresh_tests: bool = Field(
        True,
        description="when the verifier uploads /tests: kill every process the agent left, remove /tests and stale "
        "reward files first, so the agent's edits cannot change the verdict",
    )
    base_images: list[str] | None = Field(
        None,
        description="glob patterns of FROM images the host's userland may stand in for (None: any image)",
    )
    build_args: dict[str, str] = Field(default_factory=dict, description="values for the Dockerfile's ARGs")
    start_timeout_sec: float = Field(30.0, gt=0, description="how long the holder may take to set up the namespace")


def cgroup_tag(sandbox_dir: str | Path) -> str:
    """The start of the cgroup names of the sandboxes made in ``sandbox_dir``
    (``ferryman-sbx-<hash of the directory>``): their processes can be found by cgroup, as their
    root and working directory are out of the host's sight."""
    import hashlib

    return SANDBOX_PREFIX + hashlib.sha256(str(Path(sandbox_dir).resolve()).encode()).hexdigest()[:10]


_LIVE: dict[str, NamespaceEnvironment] = {}
"""Started and not yet stopped sandboxes, by directory."""


def live_sandboxes() -> list[str]:
    """Directories of the sandboxes of this process that are started and not stopped."""
    return list(_LIVE)


def live_sessions(trial_name: str) -> list[str]:
    """Session ids of the live sandboxes of the trial ``trial_name``."""
    return [e.session_id for e in list(_LIVE.values()) if e.session_id.startswith(f"{trial_name}__")]


async def stop_sandboxes(prefixes: list[str] | None = None) -> int:
    """Stop and remove every live sandbox of this process whose session id starts with one of
    ``prefixes`` (all of them if None). Returns how many there were."""
    envs = [e for e in list(_LIVE.values()) if prefixes is None or any(e.session_id.startswith(p) for p in prefixes)]
    await asyncio.gather(*(e.stop(delete=True) for e in envs))
    return len(envs)


async def stop_sessions(trial_name: str) -> int:
    """Stop and remove every live sandbox of the trial ``trial_name`` (Harbor names its
    environments ``{trial_name}__…``). Returns how many there were."""
    return await stop_sandboxes([f"{trial_name}__"])


@atexit.register
def _kill_all_at_exit() -> None:
    for env in list(_LIVE.values()):
        env._kill_now()
        shutil.rmtree(env._dir, ignore_errors=True) if env._dir is not None else None


def _safe_tar_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """Harbor's data filter, except that members the filter rejects (absolute or escaping
    links, devices) are skipped rather than aborting the whole transfer."""
    try:
        return tarfile.data_filter(member, dest)
    except tarfile.FilterError:
        return None


class NamespaceEnvironment(BaseEnvironment):
    """Harbor environment in a persistent Linux namespace on the host's userland (no Docker)."""

    options_model = NamespaceSandboxOptions
    options: NamespaceSandboxOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._plan: DockerfilePlan | None = None
        self._dir: Path | None = None
        self._root: Path | None = None
        self._ctl: Path | None = None
        self._holder: asyncio.subprocess.Process | None = None
        self._init_pid: int | None = None
        self._pidfd: int | None = None
        self._ns_fds: dict[str, int] = {}
        self._netns = False
        self._image_env: dict[str, str] = {"PATH": BASE_PATH}
        self._image_workdir = "/"
        self._image_user: str | None = None
        self._homes: dict[str, str] = {"root": "/root", "0": "/root"}
        self._exec_groups: set[int] = set()
        self._cgroup: Cgroup | None = None
        self._net_env: dict[str, str] = {}
        """The egress proxy's variables (every exec and RUN sees them)."""
        self._limits: Limits | None = None
        self._violation: SandboxLimitExceeded | None = None
        self._forwarder: SessionForwarder | None = None
        self._egress: EgressProxy | None = None
        super().__init__(*args, **kwargs)
        if self.options.proxy_url is not None:
            _parse_proxy_url(self.options.proxy_url)  # a bad URL is refused when the environment is made

    # ------------------------------------------------------------------ Harbor's surface
    @staticmethod
    def type() -> str:
        return "ferryman-namespace"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        options = getattr(self, "options", None)
        network = options.network if options is not None else "auto"
        return EnvironmentCapabilities(disable_internet=network != "host")

    def _validate_definition(self) -> None:
        env_dir = Path(self.environment_dir)
        for name in ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml"):
            if (env_dir / name).exists():
                raise UnsupportedDockerfileError(
                    f"{env_dir / name}: docker compose environments are not supported by the ferryman namespace sandbox "
                    "(services need images); use the docker environment for this task"
                )
        dockerfile = env_dir / "Dockerfile"
        if not dockerfile.is_file():
            image = self.task_env_config.docker_image
            if image:
                raise UnsupportedDockerfileError(
                    f"task environment: docker_image {image!r} without environment/Dockerfile is not supported by the "
                    "ferryman namespace sandbox (it has no images); add a Dockerfile or use an image-based environment"
                )
            raise FileNotFoundError(f"{dockerfile}: no Dockerfile (the namespace sandbox builds the task from it)")
        plan = parse_dockerfile(dockerfile)
        patterns = self.options.base_images
        if patterns is not None and not any(fnmatch.fnmatchcase(plan.base_image or "", p) for p in patterns):
            raise UnsupportedDockerfileError(
                f"{dockerfile}: FROM {plan.base_image} is not one of the base images the host's userland may stand in "
                f"for (base_images={patterns})"
            )
        self._plan = plan

    def _want_netns(self) -> bool:
        return self.options.network != "host"

    def _want_egress(self) -> bool:
        """Whether the task may reach the internet (through the filtered egress proxy)."""
        if self.options.network != "auto":
            return False
        # the policy Harbor resolved for this role, or (if built without one) the task's baseline
        modes = (self.network_policy.network_mode, self.task_env_config.network_mode)
        return NetworkMode.NO_NETWORK not in modes and NetworkMode.ALLOWLIST not in modes

    def resolved_limits(self) -> Limits:
        """The task's [environment] cpus, memory_mb and storage_mb (the options' defaults where
        it gives none) and the pids limit."""
        t = self.task_env_config
        o = self.options
        return Limits(cpus=float(t.cpus or o.default_cpus), memory_mb=int(t.memory_mb or o.default_memory_mb),
                      storage_mb=int(t.storage_mb or o.default_storage_mb), pids=o.pids_limit)

    @property
    def cgroup(self) -> Cgroup | None:
        """The sandbox's cgroup while it runs (None without limits)."""
        return self._cgroup

    async def start(self, force_build: bool) -> None:
        if self._holder is not None:
            raise RuntimeError(f"sandbox {self.session_id}: already started")
        base = self.options.sandbox_dir or tempfile.gettempdir()
        Path(base).mkdir(parents=True, exist_ok=True)
        self._dir = Path(tempfile.mkdtemp(prefix=SANDBOX_PREFIX, dir=base))
        _LIVE[str(self._dir)] = self
        self._root = self._dir / "fs"  # a mount point inside the namespace only; empty on the host
        self._root.mkdir()
        self._ctl = self._dir / "ctl"
        self._ctl.mkdir()
        dirs = [d.strip("/") for d in self.options.host_dirs if d.strip("/")]
        for d in dirs:
            if not Path("/", d).is_dir() or any(c in d for c in " =\t\n"):
                raise SandboxBuildFailedError(f"namespace sandbox: host_dirs entry {d!r} is not a directory on the host")
        self._netns = self._want_netns()
        self._limits = self.resolved_limits()
        if self.options.enforce_limits:
            try:
                self._cgroup = Cgroup(f"{cgroup_tag(base)}-{self._dir.name.removeprefix(SANDBOX_PREFIX)}", self._limits)
            except CgroupError as e:
                raise SandboxBuildFailedError(f"namespace sandbox: {e} (or set enforce_limits: false)") from None
        await self._start_holder(dirs)
        await self._start_network()
        await self._build()

    async def _start_network(self) -> None:
        """The proxy-session forwarder and, for tasks that allow internet, the egress proxy,
        each listening inside the sandbox's network namespace."""
        if not self._netns:
            return
        netns = self._ns_fds["net"]
        if self.options.proxy_url is not None:
            host, port, prefix = _parse_proxy_url(self.options.proxy_url)
            sock = listen_in_netns(netns, host, port)
            self._forwarder = SessionForwarder(sock, (host, port), prefix)
            await self._forwarder.start()
        if self._want_egress():
            sock = listen_in_netns(netns, "127.0.0.1", self.options.egress_port)
            self._egress = EgressProxy(sock)
            await self._egress.start()
            url = f"http://127.0.0.1:{self.options.egress_port}"
            for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
                self._net_env[k] = url
            self._net_env["NO_PROXY"] = self._net_env["no_proxy"] = "127.0.0.1,localhost,::1"

    def network_counters(self) -> dict[str, int]:
        """What the forwarder and the egress proxy let through or refused so far."""
        out: dict[str, int] = {}
        for prefix, part in (("forward", self._forwarder), ("egress", self._egress)):
            if part is not None:
                out.update({f"{prefix}/{k}": v for k, v in part.counters.items()})
        return out

    async def _start_holder(self, dirs: list[str]) -> None:
        assert self._dir is not None and self._ctl is not None and self._limits is not None
        links = [f"{name}={os.readlink(Path('/', name))}" for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
                 if Path("/", name).is_symlink()]
        storage = self._limits.storage_mb if self.options.enforce_limits else 1 << 20
        argv = [*self._cgroup_prefix(), "setpriv", "--pdeathsig", "KILL", "--", "unshare", "--mount", "--pid", "--fork",
                "--kill-child", "--propagation", "private", "--uts", "--ipc"]
        if self._netns:
            argv.append("--net")
        argv += ["--", "/bin/sh", "-c", _HOLDER_SCRIPT, "holder", str(self._dir), str(self._ctl),
                 self.options.rootfs, "1" if self._netns else "0", " ".join(dirs), str(storage),
                 str(min(self.options.shm_mb, storage)), " ".join(links)]
        # stdio on /dev/null: an inherited pipe would keep readers waiting on the namespace forever
        spawn = asyncio.ensure_future(asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL, start_new_session=True, cwd="/",
        ))
        try:
            self._holder = await asyncio.shield(spawn)
        except asyncio.CancelledError:
            self._holder = await spawn  # known, so that stop() kills it
            raise
        pid_file = self._ctl / "pid"
        deadline = time.monotonic() + self.options.start_timeout_sec
        while not (pid_file.exists() and pid_file.read_bytes().endswith(b"\n")):
            if self._holder.returncode is not None or time.monotonic() > deadline:
                log_text = (self._ctl / "holder.log").read_text(errors="replace") if (self._ctl / "holder.log").exists() else ""
                raise SandboxBuildFailedError(
                    f"namespace sandbox could not start (holder exit code {self._holder.returncode}; it needs root or "
                    f"CAP_SYS_ADMIN, util-linux unshare and {'overlayfs' if self.options.rootfs == 'overlay' else 'bind mounts'}): "
                    f"{log_text.strip()[-2000:] or 'no output'}"
                )
            await asyncio.sleep(0.005)
        init_pid = int(pid_file.read_text().strip())
        # hold the namespace by file descriptors: entering them can never reach a recycled pid
        pidfd = os.pidfd_open(init_pid)
        with open(f"/proc/{init_pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        if ppid != self._holder.pid:
            os.close(pidfd)
            raise SandboxBuildFailedError(f"namespace sandbox: pid {init_pid} is not the holder's child")
        self._pidfd = pidfd
        self._init_pid = init_pid
        kinds = {"mnt": "mnt", "pid": "pid"}
        if self._netns:
            kinds["net"] = "net"
        for key, ns in kinds.items():
            self._ns_fds[key] = os.open(f"/proc/{init_pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC)

    async def stop(self, delete: bool) -> None:
        """Kill every process of the sandbox; with ``delete``, remove its directory. Safe to call
        more than once and concurrently (Harbor stops in a shielded task; a cancelled rollout
        may stop the same sandbox)."""
        self._kill_namespace()
        for part in (self._forwarder, self._egress):
            if part is not None:
                await part.close()
        self._forwarder = self._egress = None
        holder = self._holder
        if holder is not None:
            try:
                await asyncio.wait_for(holder.wait(), 10)
            except TimeoutError:  # pragma: no cover - the kernel kills a namespace with its init
                log.warning("sandbox %s: holder did not exit after its namespace was killed", self.session_id)
            self._holder = None
        if self._cgroup is not None:
            cgroup, self._cgroup = self._cgroup, None
            await asyncio.to_thread(cgroup.remove)
        directory = self._dir
        if directory is not None:
            if delete:
                await asyncio.to_thread(shutil.rmtree, directory, True)
                self._dir = None
            _LIVE.pop(str(directory), None)

    def _kill_namespace(self) -> None:
        """SIGKILL the namespace's init (the kernel then kills every process in it) and any
        exec still running; close the namespace descriptors. Idempotent. The holder (unshare)
        exits by itself once its child is gone; it is left to the event loop to reap (killing it
        through ``Process.kill`` here could reap it behind the loop's back)."""
        if self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except OSError:  # already gone
                pass
            os.close(self._pidfd)
            self._pidfd = None
        for pgid in list(self._exec_groups):
            self._killpg(pgid)
        if self._holder is not None and self._holder.returncode is None:
            # the holder's process group holds unshare and the namespace's init: this also ends a
            # namespace whose start was cancelled before its init was known
            self._killpg(self._holder.pid)
        for fd in self._ns_fds.values():
            os.close(fd)
        self._ns_fds.clear()
        self._init_pid = None

    def _kill_now(self) -> None:
        """At interpreter exit: the namespace and the holder, synchronously."""
        self._kill_namespace()
        if self._cgroup is not None:
            self._cgroup.remove()

    # ------------------------------------------------------------------ running things inside
    def _require_started(self) -> None:
        if self._pidfd is None or self._root is None:
            raise RuntimeError(f"sandbox {self.session_id}: not started (or already stopped)")

    def _cgroup_prefix(self) -> list[str]:
        if self._cgroup is None:
            return []
        return ["/bin/sh", "-c", _CGROUP_JOIN, "cgroup-join", *self._cgroup.procs_files, "--"]

    def _nsenter_argv(self, user: str | None) -> tuple[list[str], list[int]]:
        """The command prefix that runs argv inside: join the cgroup, enter the namespaces (the
        mount namespace's root is the sandbox's root), drop capabilities to ``CAPS_KEPT``, and
        switch user if asked."""
        fds = list(self._ns_fds.values())
        argv = [*self._cgroup_prefix(), "nsenter", f"--mount=/proc/self/fd/{self._ns_fds['mnt']}",
                f"--pid=/proc/self/fd/{self._ns_fds['pid']}"]
        if "net" in self._ns_fds:
            argv.append(f"--net=/proc/self/fd/{self._ns_fds['net']}")
        argv += ["--", "/usr/bin/setpriv", "--bounding-set", "-all," + ",".join(f"+{c}" for c in CAPS_KEPT), "--"]
        if user is not None:
            argv += ["/usr/sbin/chroot", f"--userspec={user}", "/"]
        return argv, fds

    async def _spawn(
        self,
        inner: list[str],
        *,
        user: str | None = None,
        timeout_sec: float | None = None,
        stdin_path: Path | None = None,
        keep_stdout: Path | None = None,
    ) -> ExecResult:
        """Run ``inner`` (argv inside the sandbox). Output goes to files, not pipes: a process
        the command leaves in the background must not keep the call waiting."""
        self._require_started()
        assert self._ctl is not None
        argv, fds = self._nsenter_argv(user)
        token = uuid.uuid4().hex
        out_path = keep_stdout or self._ctl / f"{token}.out"
        err_path = self._ctl / f"{token}.err"
        with open(out_path, "wb") as fo, open(err_path, "wb") as fe, (
            open(stdin_path, "rb") if stdin_path is not None else open(os.devnull, "rb")
        ) as fi:
            # shielded: a cancellation during the spawn would make asyncio kill and reap the child
            # behind its own back; instead the spawn finishes and the command is killed below
            spawn = asyncio.ensure_future(
                asyncio.create_subprocess_exec(
                    *argv, *inner, stdin=fi, stdout=fo, stderr=fe, pass_fds=fds, start_new_session=True, cwd="/"
                )
            )
            try:
                proc = await asyncio.shield(spawn)
            except asyncio.CancelledError:
                proc = await spawn
                self._killpg(proc.pid)
                await proc.wait()
                raise
        self._exec_groups.add(proc.pid)
        try:
            try:
                rc = await asyncio.wait_for(proc.wait(), timeout_sec) if timeout_sec else await proc.wait()
            except TimeoutError:
                self._killpg(proc.pid)
                await proc.wait()
                raise RuntimeError(f"Command timed out after {timeout_sec} seconds") from None
            except asyncio.CancelledError:
                self._killpg(proc.pid)
                try:  # reaped by the loop, not behind its back (SIGKILL: this is quick)
                    await asyncio.shield(proc.wait())
                except asyncio.CancelledError:
                    pass
                raise
            stdout = None if keep_stdout is not None else _read_tail(out_path)
            stderr = _read_tail(err_path)
        finally:
            self._exec_groups.discard(proc.pid)
            for p in (err_path,) if keep_stdout is not None else (out_path, err_path):
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
        return ExecResult(stdout=stdout or None, stderr=stderr or None, return_code=rc)

    @staticmethod
    def _killpg(pgid: int) -> None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:  # the group is gone
            pass

    async def _home(self, user: str | None) -> str:
        if user is None:
            return "/root"
        name = user.split(":", 1)[0]
        if name not in self._homes:
            res = await self._spawn(["/usr/bin/getent", "passwd", name])
            fields = (res.stdout or "").strip().split(":")
            self._homes[name] = fields[5] if len(fields) > 5 and fields[5] else "/"
        return self._homes[name]

    @staticmethod
    def _user_spec(user: str | int | None) -> str | None:
        if user is None:
            return None
        s = str(user)
        return None if s in ("root", "0", "0:0", "root:root") else s

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        resolved = self._resolve_user(user)
        spec = self._user_spec(resolved) if resolved is not None else self._image_user
        variables = {"PATH": BASE_PATH, "HOME": await self._home(spec), **self._net_env, **self._image_env}
        variables.update(self._merge_env(env) or {})
        workdir = cwd or self.task_env_config.workdir or self._image_workdir
        inner = ["/usr/bin/env", "-i", "-C", workdir, *(f"{k}={v}" for k, v in variables.items()), "/bin/bash", "-c", command]
        self._raise_violation()
        # while the command runs, a breach is noticed within WATCH_INTERVAL_SEC and ends it
        watch = asyncio.ensure_future(self._watch_limits()) if self._cgroup is not None else None
        try:
            result = await self._spawn(inner, user=spec, timeout_sec=timeout_sec)
        except asyncio.CancelledError:
            raise
        except Exception:
            self._check_limits()  # a limit hit during a command that timed out is the reason
            raise
        finally:
            if watch is not None:
                watch.cancel()
        self._check_limits()
        return result

    # ------------------------------------------------------------------ limits
    def _raise_violation(self) -> None:
        if self._violation is not None:
            raise type(self._violation)(str(self._violation))

    async def _watch_limits(self) -> None:
        while self._violation is None:
            await asyncio.sleep(WATCH_INTERVAL_SEC)
            self._detect_breach()

    def _check_limits(self) -> None:
        """Record the first limit the sandbox hit, kill what is left running in it (a fork bomb
        stops burning its CPU share at once) and raise it; later execs raise it again, so an
        agent that catches it cannot carry on and the trial fails with the reason."""
        self._detect_breach()
        self._raise_violation()

    def _detect_breach(self) -> None:
        if self._violation is None and self._cgroup is not None and self._limits is not None:
            ev = self._cgroup.events()
            lim = self._limits
            if ev["oom_kill"]:
                self._violation = MemoryLimitExceededError(
                    f"sandbox memory limit exceeded: {lim.memory_mb} MiB (+{lim.storage_mb} MiB storage tmpfs); the kernel "
                    f"killed {ev['oom_kill']} process(es)")
            elif ev["pids_max"]:
                self._violation = PidsLimitExceededError(
                    f"sandbox process limit exceeded: {lim.pids} processes/threads; {ev['pids_max']} fork(s) refused")
            elif self._storage_full():
                self._violation = StorageLimitExceededError(f"sandbox storage limit exceeded: {lim.storage_mb} MiB full")
            if self._violation is not None:
                log.warning("sandbox %s: %s", self.session_id, self._violation)
                self._kill_all_but_init()

    def _storage_full(self) -> bool:
        if self._init_pid is None or not self.options.enforce_limits:
            return False
        try:
            st = os.statvfs(f"/proc/{self._init_pid}/root/")
        except OSError:
            return False
        return st.f_bavail == 0

    def _kill_all_but_init(self) -> None:
        """SIGKILL every process in the sandbox's cgroup except its init (host pids)."""
        if self._cgroup is None:
            return
        procs = Path(self._cgroup.procs_files[0])
        for _ in range(100):
            try:
                pids = [int(x) for x in procs.read_text().split()]
            except OSError:
                return
            pids = [p for p in pids if p not in (self._init_pid, self._holder.pid if self._holder else None)]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.002)

    # ------------------------------------------------------------------ files
    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        target = posixpath.normpath(target_path)
        self._check_abs(target)
        await self._put_tar(lambda tf: tf.add(str(source_path), arcname=posixpath.basename(target)), posixpath.dirname(target))

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        target = posixpath.normpath(target_dir)
        self._check_abs(target)
        if target == str(EnvironmentPaths.tests_dir) and self.options.fresh_tests:
            await self._verify_barrier()
        source = Path(source_dir)
        if not source.is_dir():
            raise FileNotFoundError(f"upload_dir: {source} is not a directory")

        def add(tf: tarfile.TarFile) -> None:
            for child in sorted(source.iterdir()):
                tf.add(str(child), arcname=child.name)

        await self._put_tar(add, target)

    async def _verify_barrier(self) -> None:
        """Before the verifier's tests arrive (the agent has stopped): kill every process left in
        the sandbox (a daemon that would rewrite the tests or the reward), remove /tests
        (planted conftest.py, pre-edited scripts) and stale reward files."""
        self._kill_all_but_init()
        paths = EnvironmentPaths
        res = await self._spawn(["/bin/sh", "-c", 'kill -9 -1 2>/dev/null; rm -rf -- "$1" "$2" "$3" || exit 1',
                                 "barrier", str(paths.tests_dir), str(paths.reward_text_path), str(paths.reward_json_path)])
        if res.return_code != 0:
            raise RuntimeError(f"could not clear {paths.tests_dir} before verification: {res.stderr or res.stdout}")

    async def _put_tar(self, fill: Any, target_dir: str) -> None:
        self._require_started()
        assert self._ctl is not None
        tar_path = self._ctl / f"{uuid.uuid4().hex}.tar"
        try:
            with tarfile.open(tar_path, "w") as tf:
                fill(tf)
            res = await self._spawn(
                ["/bin/sh", "-c", 'mkdir -p "$1" && exec tar -xf - --no-same-owner -C "$1"', "upload", target_dir],
                stdin_path=tar_path,
            )
        finally:
            tar_path.unlink(missing_ok=True)
        if res.return_code != 0:
            raise RuntimeError(f"upload to {target_dir} failed (exit {res.return_code}): {res.stderr or res.stdout}")

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        self._check_abs(source_path)
        assert self._ctl is not None
        tmp = self._ctl / f"{uuid.uuid4().hex}.dl"
        try:
            res = await self._spawn(["/bin/cat", "--", source_path], keep_stdout=tmp)
            if res.return_code != 0:
                raise FileNotFoundError(f"download of {source_path} failed (exit {res.return_code}): {res.stderr}")
            target = Path(target_path)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(tmp), target)
        finally:
            tmp.unlink(missing_ok=True)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        self._check_abs(source_dir)
        assert self._ctl is not None
        tmp = self._ctl / f"{uuid.uuid4().hex}.tar"
        try:
            res = await self._spawn(["/bin/tar", "-cf", "-", "-C", source_dir, "."], keep_stdout=tmp)
            if res.return_code != 0:
                raise FileNotFoundError(f"download of {source_dir} failed (exit {res.return_code}): {res.stderr}")
            target = Path(target_dir)
            target.mkdir(parents=True, exist_ok=True)

            def extract() -> None:
                with tarfile.open(tmp) as tf:
                    tf.extractall(target, filter=_safe_tar_filter)

            await asyncio.to_thread(extract)
        finally:
            tmp.unlink(missing_ok=True)

    @staticmethod
    def _check_abs(path: str) -> None:
        if not posixpath.isabs(path):
            raise ValueError(f"sandbox paths must be absolute, got {path!r}")

    # ------------------------------------------------------------------ the Dockerfile
    async def _build(self) -> None:
        plan = self._plan
        assert plan is not None
        build_args = dict(self.options.build_args)
        args: dict[str, str] = {}
        env: dict[str, str] = {"PATH": BASE_PATH}
        workdir = "/"
        shell = ["/bin/sh", "-c"]
        user: str | None = None
        context = Path(self.environment_dir).resolve()

        def fail(ins: Any, why: str) -> SandboxBuildFailedError:
            return SandboxBuildFailedError(f"{plan.path}: line {ins.lineno}: {ins.text[:200]!r}: {why}")

        for ins in plan.instructions:
            scope = {**args, **env}
            kw = ins.keyword
            if kw == "FROM":
                continue
            if kw == "ARG":
                for a in ins.args:
                    name, has_default, default = a.partition("=")
                    args[name] = build_args.get(name, expand(default, scope) if has_default else "")
            elif kw == "ENV":
                for a in ins.args:
                    name, _, value = a.partition("=")
                    env[name] = expand(value, scope)
            elif kw == "WORKDIR":
                workdir = posixpath.normpath(posixpath.join(workdir, expand(ins.args[0], scope)))
                await self._checked(["/bin/mkdir", "-p", workdir], fail, ins, "mkdir")
            elif kw == "VOLUME":
                for v in ins.args:
                    path = posixpath.normpath(posixpath.join(workdir, expand(v, scope)))
                    await self._checked(["/bin/mkdir", "-p", path], fail, ins, "mkdir")
            elif kw == "SHELL":
                shell = list(ins.args)
            elif kw == "USER":
                user = self._user_spec(expand(ins.args[0], scope))
            elif kw in ("COPY", "ADD"):
                await self._copy_in(ins, scope, context, workdir, fail)
            elif kw == "RUN":
                argv = list(ins.args) if ins.exec_form else [*shell, ins.args[0]]
                run_env = {**self._net_env, **args, **env}
                home = await self._home(user)
                inner = ["/usr/bin/env", "-i", "-C", workdir, f"HOME={home}", *(f"{k}={v}" for k, v in run_env.items()), *argv]
                res = await self._spawn(inner, user=user)
                if res.return_code != 0:
                    tail = (res.stderr or res.stdout or "no output").strip()[-1500:]
                    raise fail(ins, f"exited with code {res.return_code}: {tail}")
        self._image_env = env
        self._image_workdir = workdir
        self._image_user = user

    async def _checked(self, inner: list[str], fail: Any, ins: Any, what: str) -> None:
        """Run a build step's helper command; a failure names the Dockerfile line."""
        res = await self._spawn(inner)
        if res.return_code != 0:
            raise fail(ins, f"{what} failed (exit {res.return_code}): {(res.stderr or '').strip()[-500:]}")

    async def _copy_in(self, ins: Any, scope: dict[str, str], context: Path, workdir: str, fail: Any) -> None:
        sources = [expand(s, scope) for s in ins.args[:-1]]
        dest = expand(ins.args[-1], scope)
        dest_is_dir = dest.endswith("/") or len(sources) > 1
        dest = posixpath.normpath(posixpath.join(workdir, dest))
        matched: list[Path] = []
        for src in sources:
            pattern = str(context / src.lstrip("/"))
            hits = sorted(Path(p) for p in _glob(pattern))
            if not hits:
                raise fail(ins, f"source {src!r} not found in the build context {context}")
            for hit in hits:
                if not hit.resolve().is_relative_to(context):
                    raise fail(ins, f"source {src!r} is outside the build context {context}")
            matched.extend(hits)
        if len(matched) > 1:
            dest_is_dir = True
        targets: list[str] = []
        for src in matched:
            if src.is_dir():
                await self.upload_dir(src, dest)
                targets.append(dest)
            elif ins.keyword == "ADD" and tarfile.is_tarfile(src):
                with tempfile.TemporaryDirectory(dir=self._ctl) as tmp:
                    with tarfile.open(src) as tf:
                        tf.extractall(tmp, filter=_safe_tar_filter)
                    await self.upload_dir(tmp, dest)
                targets.append(dest)
            else:
                target = posixpath.join(dest, src.name) if dest_is_dir else dest
                await self.upload_file(src, target)
                targets.append(target)
        for flag, tool in (("chown", "/bin/chown"), ("chmod", "/bin/chmod")):
            value = ins.flags.get(flag)
            if value:
                await self._checked([tool, "-R", expand(value, scope), *targets], fail, ins, flag)


def _parse_proxy_url(url: str) -> tuple[str, int, str]:
    """(host, port, path prefix) of a proxy session URL ``http://HOST:PORT/sess/SECRET/v1``;
    the host must be a loopback address (the forwarder listens there inside the sandbox)."""
    import ipaddress
    from urllib.parse import urlsplit

    u = urlsplit(url)
    parts = [p for p in u.path.split("/") if p]
    if u.scheme != "http" or not u.hostname or u.port is None or len(parts) < 2 or parts[0] != "sess":
        raise ValueError(f"proxy_url {url!r}: expected http://127.0.0.1:PORT/sess/SECRET/v1")
    host = "127.0.0.1" if u.hostname == "localhost" else u.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"proxy_url {url!r}: the proxy must listen on a loopback address for the sandbox forwarder")
    return host, u.port, f"/sess/{parts[1]}/"


def _glob(pattern: str) -> list[str]:
    import glob

    return glob.glob(pattern) if glob.has_magic(pattern) else ([pattern] if os.path.lexists(pattern) else [])


def _read_tail(path: Path) -> str:
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size > OUTPUT_LIMIT:
            f.seek(size - OUTPUT_LIMIT)
        return f.read().decode(errors="replace")


__all__ = ["NamespaceEnvironment", "NamespaceSandboxOptions", "UnsupportedDockerfileError", "cgroup_tag", "live_sandboxes"]
