"""``pacer up``'s context file: the CLI reaches a TLS, secured stack with no NATS setting at all.

A real embedded stack (nats-server with TLS and users, the job service) is
started as ``pacer up`` starts it; the ``pacer`` CLI then runs as a separate
process with no ``PACER_NATS_*`` variable: it finds URL, user, password and
CA in the context file (named by ``PACER_CONTEXT`` or found as
``./.pacer/context.json``), and fails without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pacer import security
from pacer_services.cli.main import up_banner
from pacer_services.cli.stack import Stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("up")
    saved = os.environ.pop("PACER_NATS_TLS", None)  # the default: TLS on
    st = Stack(root / ".pacer", services=["jobs"]).start(ready_timeout=90)
    try:
        yield st
    finally:
        st.stop()
        if saved is not None:
            os.environ["PACER_NATS_TLS"] = saved


def cli(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PACER_NATS_", "PACER_CONTEXT"))}
    return subprocess.run([sys.executable, "-m", "pacer_services.cli.main", *args], cwd=cwd,
                          env={**clean, **env}, capture_output=True, text=True, timeout=60)


def test_the_stack_is_tls_by_default_and_writes_a_private_context(stack: Stack) -> None:
    assert stack.ca_file is not None and stack.bare_url.startswith("nats://")
    ctx = json.loads(stack.context_file.read_text())
    assert ctx["url"] == stack.bare_url and ctx["user"] == "admin"
    assert ctx["password"] == stack.passwords["admin"] and Path(ctx["ca"]).read_bytes() == stack.ca_file.read_bytes()
    assert stack.context_file.stat().st_mode & 0o077 == 0
    conf = (stack.data_dir / "nats" / "nats-server.conf").read_text()
    assert "tls {" in conf


def test_pacer_up_prints_where_the_credentials_are_never_the_password(stack: Stack) -> None:
    lines = up_banner(stack, "8750")
    text = "\n".join(lines)
    for pw in stack.passwords.values():
        assert pw not in text
    # Nor the API token: the dashboard's sign-in and the CLI's PACER_API_TOKEN_FILE read its private file.
    assert stack.api_token and stack.api_token not in text
    assert stack.api_token_file.read_text().strip() == stack.api_token
    assert stack.api_token_file.stat().st_mode & 0o077 == 0
    assert f"PACER_API_TOKEN_FILE={stack.api_token_file.resolve()}" in text
    exports = [line for line in lines if line.startswith("export ")]
    assert exports == [f"export PACER_CONTEXT={stack.context_file.resolve()} PACER_NATS_URL={stack.bare_url}"
                       "   # Ctrl-C stops everything"]
    assert str(stack.ca_file.resolve()) in text  # type: ignore[union-attr]


def test_the_cli_connects_through_the_context(stack: Stack, tmp_path: Path) -> None:
    named = cli("jobs", "--json", "--nats", stack.bare_url, cwd=tmp_path, PACER_CONTEXT=str(stack.context_file))
    assert named.returncode == 0, named.stderr
    assert json.loads(named.stdout) == []  # a new stack has no jobs
    # `pacer up`'s default data dir, from the directory it ran in: ./.pacer/context.json
    found = cli("jobs", "--json", "--nats", stack.bare_url, cwd=stack.data_dir.parent)
    assert found.returncode == 0, found.stderr
    # `pacer status` takes its default URL from the context too: it connects and asks (this stack has no
    # shard service, so nobody answers) instead of failing to connect
    status = cli("status", "nope", "ds", cwd=stack.data_dir.parent)
    assert "NoRespondersError" in status.stderr and "Authorization" not in status.stderr, status.stderr
    # without the context: no credentials, no CA -- the stack refuses
    bare = cli("jobs", "--json", "--nats", stack.bare_url, cwd=tmp_path)
    assert bare.returncode != 0


def test_explicit_settings_win_over_the_context(stack: Stack, tmp_path: Path) -> None:
    env = {"PACER_CONTEXT": str(stack.context_file)}
    opts = security.connect_options(stack.bare_url, env)
    assert opts["user"] == "admin" and "tls" in opts
    opts = security.connect_options(stack.bare_url, {**env, "PACER_NATS_USER": "jobs", "PACER_NATS_PASSWORD": "x"})
    assert opts["user"] == "jobs" and opts["inbox_prefix"] == "_INBOX_jobs"
    url = security.with_credentials(stack.bare_url, "api", "y")
    assert security.connect_options(url, {**env, "PACER_NATS_USER": "jobs"})["user"] == "api"
    # a context is for its own server only: another server never gets the admin password
    assert "user" not in security.connect_options("nats://10.0.0.9:4222", env)
    bad = tmp_path / "broken.json"
    bad.write_text("{")
    with pytest.raises(security.ValidationError):
        security.connect_options(stack.bare_url, {"PACER_CONTEXT": str(bad)})


def test_two_tls_stacks_in_one_process_each_keep_their_ca(tmp_path: Path) -> None:
    """PACER_NATS_CA names one CA; a client of either stack still verifies against that stack's own."""
    import asyncio

    from pacer.bus import Bus

    a = Stack(tmp_path / "a", services=[], tls=True).start()
    b = Stack(tmp_path / "b", services=[], tls=True).start()
    try:
        assert a.ca_file != b.ca_file and a.ca_file is not None and b.ca_file is not None
        assert a.ca_file.read_bytes() != b.ca_file.read_bytes()
        assert os.environ["PACER_NATS_CA"] == str(b.ca_file)

        async def reach(url: str) -> bool:
            bus = await Bus.connect(url, name="two", connect_timeout=3)
            try:
                return bool(bus.nc.is_connected)
            finally:
                await bus.close()

        assert asyncio.run(reach(a.url)) and asyncio.run(reach(b.url))
    finally:
        b.stop()
        a.stop()
    assert os.environ.get("PACER_NATS_CA") != str(a.ca_file)  # restored, not left pointing at a stopped stack


@pytest.mark.slow
def test_pacer_up_itself_prints_no_password_and_the_cli_gets_in_with_its_exports(tmp_path: Path) -> None:
    """The real ``pacer up`` process: its output holds no NATS password; its export line is enough."""
    import signal

    from pacer.embedded import free_port

    port, api = free_port(), free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PACER_NATS_", "PACER_CONTEXT"))}
    up = subprocess.Popen([sys.executable, "-m", "pacer_services.cli.main", "up", "--data-dir", str(tmp_path / "d"),
                           "--port", str(port)], env={**clean, "PACER_API_PORT": str(api)},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    try:
        assert up.stdout is not None
        for line in up.stdout:
            out.append(line)
            if line.startswith("export "):
                break
        export = out[-1]
        assert export.startswith("export PACER_CONTEXT="), "".join(out)
        ctx = json.loads((tmp_path / "d" / "context.json").read_text())
        assert ctx["password"] and all(ctx["password"] not in line for line in out)
        assert ctx["ca"] and ctx["ca"] in "".join(out)  # the CA path is printed
        env = dict(kv.split("=", 1) for kv in export.split("#")[0].split()[1:])
        jobs = cli("jobs", "--json", "--nats", env["PACER_NATS_URL"], cwd=tmp_path, **env)
        assert jobs.returncode == 0 and json.loads(jobs.stdout) == [], jobs.stderr
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
