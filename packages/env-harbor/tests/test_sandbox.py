"""The namespace sandbox on its own: build from a Dockerfile, exec, files, isolation, cleanup."""

from __future__ import annotations

import asyncio
import io
import os
import socket
import tarfile
import time
from pathlib import Path

import pytest
from harbor.environments.base import SandboxBuildFailedError
from harbor.models.task.config import EnvironmentConfig as TaskEnvironmentConfig
from harbor.models.task.config import NetworkMode, NetworkPolicy
from harbor.models.trial.paths import TrialPaths

from ferryman_env_harbor.dockerfile import UnsupportedDockerfileError
from ferryman_env_harbor.sandbox import NamespaceEnvironment, live_sandboxes, stop_sessions

from .conftest import processes_under


def make_env(tmp_path: Path, sandbox_dir: Path, dockerfile: str, files: dict[str, bytes | str] | None = None,
             network_mode: NetworkMode = NetworkMode.PUBLIC, session: str = "t__env", **kwargs) -> NamespaceEnvironment:
    env_dir = tmp_path / "environment"
    env_dir.mkdir(exist_ok=True)
    (env_dir / "Dockerfile").write_text(dockerfile)
    for name, content in (files or {}).items():
        p = env_dir / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content.encode() if isinstance(content, str) else content)
    trial_dir = tmp_path / "trial"
    trial_dir.mkdir(exist_ok=True)
    return NamespaceEnvironment(
        environment_dir=env_dir,
        environment_name="t",
        session_id=session,
        trial_paths=TrialPaths(trial_dir=trial_dir),
        task_env_config=TaskEnvironmentConfig(network_mode=network_mode),
        network_policy=NetworkPolicy(network_mode=network_mode),  # as a Trial resolves it
        sandbox_dir=str(sandbox_dir),
        **kwargs,
    )


def tar_bytes(members: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


DOCKERFILE = """\
FROM ubuntu:24.04
ARG GREETING=hello
ARG OVERRIDDEN=default
ENV APP_HOME=/app LEVEL="two words"
ENV PATH=/opt/tools:$PATH
WORKDIR ${APP_HOME}
COPY src/ ./src/
COPY --chmod=700 run.sh /usr/local/bin/
ADD bundle.tgz /app/bundle/
RUN echo "$GREETING $OVERRIDDEN" > greeting.txt && mkdir -p /opt/tools
VOLUME /data
RUN useradd -m -u 4242 worker 2>/dev/null || true
CMD ["sleep", "infinity"]
"""


async def test_builds_from_the_dockerfile_and_execs_inside(tmp_path, sandbox_dir):
    env = make_env(
        tmp_path, sandbox_dir, DOCKERFILE,
        {"src/main.py": "print('hi')\n", "src/pkg/util.py": "X = 1\n", "run.sh": "#!/bin/sh\necho ran\n",
         "bundle.tgz": tar_bytes({"inner/readme.txt": "from the tarball\n"})},
        build_args={"OVERRIDDEN": "given"},
    )
    await env.start(force_build=False)
    try:
        r = await env.exec("pwd; cat greeting.txt; echo $LEVEL; echo $PATH; ls src src/pkg; cat bundle/inner/readme.txt; run.sh; "
                           "test -d /data && echo data-ok")
        assert r.return_code == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0] == "/app"
        assert lines[1] == "hello given"
        assert lines[2] == "two words"
        assert lines[3].startswith("/opt/tools:/usr/local/sbin")
        assert "main.py" in lines and "util.py" in lines
        assert "from the tarball" in r.stdout and "ran" in lines and "data-ok" in lines
        mode = (await env.exec("stat -c %a /usr/local/bin/run.sh")).stdout.strip()
        assert mode == "700"
        # per-call cwd and env, stderr and exit code
        r = await env.exec("echo $FOO; pwd; echo err >&2; exit 7", cwd="/tmp", env={"FOO": "bar"})
        assert (r.stdout, r.stderr, r.return_code) == ("bar\n/tmp\n", "err\n", 7)
        # the sandbox is a fresh root: the host's working tree is not there, /proc is its own
        r = await env.exec(f"test -e {Path(__file__).parent} && echo visible; ls /proc | grep -c '^[0-9]'")
        assert "visible" not in r.stdout and int(r.stdout.split()[-1]) < 10
        # a user made by the Dockerfile's RUN exists in the sandbox only
        r = await env.exec("id -u; echo $HOME", user="worker")
        assert r.stdout.split() == ["4242", "/home/worker"]
    finally:
        await env.stop(delete=True)


async def test_overlay_keeps_the_host_untouched(tmp_path, sandbox_dir):
    env = make_env(tmp_path, sandbox_dir, "FROM scratch\nRUN echo sandboxed > /usr/local/ferryman-overlay-probe\n")
    await env.start(force_build=False)
    try:
        r = await env.exec("cat /usr/local/ferryman-overlay-probe && echo x >> /etc/hostname.ferryman && echo ok")
        assert r.stdout.split() == ["sandboxed", "ok"]
        assert not Path("/usr/local/ferryman-overlay-probe").exists()
        assert not Path("/etc/hostname.ferryman").exists()
    finally:
        await env.stop(delete=True)


async def test_read_only_bind_mode_refuses_writes(tmp_path, sandbox_dir):
    env = make_env(tmp_path, sandbox_dir, "FROM scratch\n", rootfs="bind")
    await env.start(force_build=False)
    try:
        r = await env.exec("touch /usr/local/ferryman-probe")
        assert r.return_code != 0 and "Read-only" in (r.stderr or "")
        assert (await env.exec("touch /tmp/ok && echo ok")).stdout == "ok\n"
    finally:
        await env.stop(delete=True)


async def test_processes_persist_between_execs_and_background_ones_do_not_block(tmp_path, sandbox_dir):
    env = make_env(tmp_path, sandbox_dir, "FROM scratch\n")
    await env.start(force_build=False)
    try:
        t0 = time.monotonic()
        r = await env.exec("sleep 300 & echo started")  # keeps its stdout open: must not block
        assert r.stdout == "started\n" and time.monotonic() - t0 < 5
        r = await env.exec("setsid sleep 301 < /dev/null > /dev/null 2>&1 & sleep 0.2; pgrep -f '[s]leep 301'")
        pid = r.stdout.strip()
        assert pid
        r = await env.exec(f"kill -0 {pid} && echo alive")  # a later exec sees it: the namespace persists
        assert r.stdout == "alive\n"
        assert processes_under(sandbox_dir)  # it lives in the sandbox, seen from the host
    finally:
        await env.stop(delete=True)
    assert not processes_under(sandbox_dir)


async def test_exec_timeout_kills_the_command(tmp_path, sandbox_dir):
    env = make_env(tmp_path, sandbox_dir, "FROM scratch\n")
    await env.start(force_build=False)
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="timed out after 1 seconds"):
            await env.exec("sleep 60; echo never > /tmp/never", timeout_sec=1)
        assert time.monotonic() - t0 < 10
        await asyncio.sleep(0.2)
        assert (await env.exec("pgrep -f '[s]leep 60' || echo none")).stdout.strip() == "none"
    finally:
        await env.stop(delete=True)


async def test_cancelling_an_exec_kills_it(tmp_path, sandbox_dir):
    env = make_env(tmp_path, sandbox_dir, "FROM scratch\n")
    await env.start(force_build=False)
    try:
        task = asyncio.create_task(env.exec("sleep 61"))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)
        assert (await env.exec("pgrep -f '[s]leep 61' || echo none")).stdout.strip() == "none"
    finally:
        await env.stop(delete=True)


async def test_upload_download_round_trip(tmp_path, sandbox_dir):
    env = make_env(tmp_path, sandbox_dir, "FROM scratch\n")
    src = tmp_path / "up"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha")
    (src / "sub" / "b.bin").write_bytes(bytes(range(256)))
    os.chmod(src / "a.txt", 0o751)
    await env.start(force_build=False)
    try:
        await env.upload_dir(src, "/tests")
        await env.upload_file(src / "a.txt", "/deep/er/renamed.txt")
        r = await env.exec("cat /tests/a.txt /deep/er/renamed.txt; echo; stat -c %a /tests/a.txt; wc -c < /tests/sub/b.bin")
        assert r.stdout.split() == ["alphaalpha", "751", "256"]
        await env.exec("mkdir -p /logs/verifier && echo 0.5 > /logs/verifier/reward.txt && ln -s /etc/shadow /logs/verifier/link")
        out = tmp_path / "down"
        await env.download_dir("/logs/verifier", out)
        assert (out / "reward.txt").read_text() == "0.5\n"
        assert not (out / "link").exists()  # an absolute link out of the sandbox is not followed or kept
        await env.download_file("/tests/sub/b.bin", tmp_path / "x" / "b.bin")
        assert (tmp_path / "x" / "b.bin").read_bytes() == bytes(range(256))
        # a symlink planted inside resolves inside the sandbox, never to the host's file
        await env.exec("ln -s /etc/ferryman-secret /tmp/secret && echo sandbox-side > /etc/ferryman-secret")
        await env.download_file("/tmp/secret", tmp_path / "secret")
        assert (tmp_path / "secret").read_text() == "sandbox-side\n"
        with pytest.raises(FileNotFoundError):
            await env.download_file("/no/such/file", tmp_path / "nothing")
    finally:
        await env.stop(delete=True)


async def test_every_sandbox_gets_a_private_loopback_unless_network_host(tmp_path, sandbox_dir):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    probe = f"(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo reached || echo unreachable"
    try:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        isolated = make_env(tmp_path / "a", sandbox_dir, "FROM scratch\n", network_mode=NetworkMode.NO_NETWORK)
        shared = make_env(tmp_path / "b", sandbox_dir, "FROM scratch\n", network="host")
        await isolated.start(force_build=False)
        await shared.start(force_build=False)
        try:
            assert (await isolated.exec(probe)).stdout == "unreachable\n"
            public = make_env(tmp_path / "a", sandbox_dir, "FROM scratch\n", session="t__public")
            await public.start(force_build=False)
            try:  # a task that allows internet is just as cut off from the host's loopback
                assert (await public.exec(probe)).stdout == "unreachable\n"
            finally:
                await public.stop(delete=True)
            assert (await shared.exec(probe)).stdout == "reached\n"
            # the private network still has a working loopback
            r = await isolated.exec("python3 -c \"import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
                                    "c=socket.create_connection(s.getsockname()); print('loopback-ok')\"")
            assert r.stdout == "loopback-ok\n", r.stderr
        finally:
            await isolated.stop(delete=True)
            await shared.stop(delete=True)
    finally:
        server.close()


def test_host_network_option_refuses_no_network_tasks(tmp_path, sandbox_dir):
    with pytest.raises(ValueError, match="no-network"):
        make_env(tmp_path, sandbox_dir, "FROM scratch\n", network_mode=NetworkMode.NO_NETWORK, network="host")


async def test_failing_run_names_the_line(tmp_path, sandbox_dir):
    env = make_env(tmp_path, sandbox_dir, "FROM ubuntu\nWORKDIR /w\nRUN echo about to fail >&2; exit 5\n")
    with pytest.raises(SandboxBuildFailedError) as e:
        await env.start(force_build=False)
    await env.stop(delete=True)
    assert "line 3" in str(e.value) and "exited with code 5" in str(e.value) and "about to fail" in str(e.value)


def test_unsupported_dockerfile_is_refused_at_creation(tmp_path, sandbox_dir):
    with pytest.raises(UnsupportedDockerfileError, match="COPY --from=build"):
        make_env(tmp_path, sandbox_dir, "FROM ubuntu\nCOPY --from=build /a /b\n")


def test_base_image_allow_list(tmp_path, sandbox_dir):
    make_env(tmp_path, sandbox_dir, "FROM ubuntu:24.04\n", base_images=["ubuntu:*", "python:3.*"])
    with pytest.raises(UnsupportedDockerfileError, match="nvidia/cuda"):
        make_env(tmp_path, sandbox_dir, "FROM nvidia/cuda:12.4\n", base_images=["ubuntu:*"])


def test_compose_and_image_only_tasks_are_refused(tmp_path, sandbox_dir):
    env_dir = tmp_path / "environment"
    env_dir.mkdir()
    (env_dir / "docker-compose.yaml").write_text("services: {}\n")
    with pytest.raises(UnsupportedDockerfileError, match="docker compose"):
        NamespaceEnvironment(environment_dir=env_dir, environment_name="t", session_id="t__env",
                             trial_paths=TrialPaths(trial_dir=tmp_path), task_env_config=TaskEnvironmentConfig())
    (env_dir / "docker-compose.yaml").unlink()
    with pytest.raises(UnsupportedDockerfileError, match="docker_image 'python:3.12'"):
        NamespaceEnvironment(environment_dir=env_dir, environment_name="t", session_id="t__env",
                             trial_paths=TrialPaths(trial_dir=tmp_path),
                             task_env_config=TaskEnvironmentConfig(docker_image="python:3.12"))


def test_unknown_option_is_refused(tmp_path, sandbox_dir):
    with pytest.raises(ValueError, match="rootfs"):
        make_env(tmp_path, sandbox_dir, "FROM scratch\n", rootfs="zfs")


async def test_stop_is_idempotent_and_stop_sessions_reaps_by_trial(tmp_path, sandbox_dir):
    envs = []
    for i, session in enumerate(["trial-a__env", "trial-a__verifier", "trial-b__env"]):
        (tmp_path / str(i)).mkdir()
        envs.append(make_env(tmp_path / str(i), sandbox_dir, "FROM scratch\n", session=session))
    await asyncio.gather(*(e.start(force_build=False) for e in envs))
    await envs[0].exec("setsid sleep 302 < /dev/null > /dev/null 2>&1 &")
    assert len([d for d in live_sandboxes() if d.startswith(str(sandbox_dir))]) == 3
    assert await stop_sessions("trial-a") == 2
    assert [d for d in live_sandboxes() if d.startswith(str(sandbox_dir))] == [str(envs[2]._dir)]
    await asyncio.gather(envs[2].stop(delete=True), envs[2].stop(delete=True))
    await envs[0].stop(delete=True)  # again: nothing left to do
    with pytest.raises(RuntimeError, match="not started"):
        await envs[0].exec("true")
