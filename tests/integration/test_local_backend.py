"""The local-process backend of the pod-executor, with real supervisor processes.

Pods run tiny ``python -c`` programs (no TensorFlow) so that each test takes
a few seconds.  Every test kills what it started: the ``backend`` fixture
SIGKILLs every supervisor, trainer and agent recorded under its root.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from pacer.contracts.executor import EXIT_REFUSED, PodPhase, PodSpec, PodStatus
from pacer.embedded import find_binary, free_port, http_json
from pacer.errors import Conflict, NotFound
from pacer_services.pod_executor.backends import Backend
from pacer_services.pod_executor.backends.local import LocalBackend
from pacer_services.pod_executor.core import ExitInfo, ExitReason, classify

pytestmark = pytest.mark.timeout(120)

JOB = "j"
WAIT_S = 30.0  # generous: only a broken backend takes this long


def spec(name: str, code: str, *, cpu: float = 1.0, memory_mb: int = 512, agent: list[str] | None = None,
         env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> PodSpec:
    return PodSpec(name=name, job=JOB, node="worker-0", role="worker", index=0, generation=0, cpu=cpu,
                   memory_mb=memory_mb, command=["python", "-c", code, *args], agent=agent or [],
                   env=env or {})


def pod_dir(root: Path, name: str) -> Path:
    return root / JOB / name


def pod_meta(root: Path, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((pod_dir(root, name) / "pod.json").read_text())
    return meta


def _kill_all(root: Path) -> None:
    for f in root.glob("*/*/pod.json"):
        meta = json.loads(f.read_text())
        for key in ("supervisor_pid", "trainer_pid", "agent_pid"):
            pid = meta.get(key)
            if pid:
                with contextlib.suppress(psutil.Error):
                    p = psutil.Process(pid)
                    p.send_signal(signal.SIGCONT)
                    p.kill()
    for child in psutil.Process().children(recursive=True):  # reap our supervisors
        with contextlib.suppress(psutil.Error):
            child.kill()
            child.wait(5)


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[LocalBackend]:
    b = LocalBackend(tmp_path / "pods", poll_s=0.05)
    yield b
    await b.close()
    _kill_all(tmp_path / "pods")


async def wait_status(b: LocalBackend, name: str, pred: Callable[[PodStatus], bool],
                      timeout: float = WAIT_S) -> PodStatus:
    deadline = time.monotonic() + timeout
    while True:
        statuses: list[PodStatus] = await b.list(JOB)
        for st in statuses:
            if st.name == name and pred(st):
                return st
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}: condition not met within {timeout}s: {await b.list(JOB)}")
        await asyncio.sleep(0.05)


async def wait_exit(b: LocalBackend, name: str, timeout: float = WAIT_S) -> PodStatus:
    return await wait_status(b, name, lambda st: st.phase is PodPhase.EXITED, timeout)


async def wait_for(pred: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.05)


def gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def info(st: PodStatus) -> ExitInfo:
    return ExitInfo(code=st.exit_code, signal=st.signal, k8s_reason=st.reason, oom=st.oom)


async def watch_until_exit(b: LocalBackend, name: str) -> list[PodStatus]:
    seen: list[PodStatus] = []

    async def consume() -> None:
        async for st in b.watch():
            if st.name == name:
                seen.append(st)
                if st.phase is PodPhase.EXITED:
                    return

    await asyncio.wait_for(consume(), WAIT_S)
    return seen


# ---------------------------------------------------------------- lifecycle


def test_is_a_backend(tmp_path: Path) -> None:
    b: Backend = LocalBackend(tmp_path)
    assert b.name == "local"


async def test_exit_0_goes_pending_running_exited(backend: LocalBackend) -> None:
    await backend.create(spec("p0", "import time; time.sleep(1.0)"))
    seen = await watch_until_exit(backend, "p0")
    phases = [st.phase for st in seen]
    order = [PodPhase.PENDING, PodPhase.RUNNING, PodPhase.EXITED]
    assert phases == sorted(phases, key=order.index), phases  # never backwards
    assert len(set(phases)) == len(phases), phases  # each phase once
    assert PodPhase.RUNNING in phases and phases[-1] is PodPhase.EXITED  # pending may be too short to see
    last = seen[-1]
    assert last.exit_code == 0 and last.signal is None and not last.oom and last.reason == ""
    assert 0 < last.created_at <= last.started_at <= last.finished_at
    assert last.host and last.cpu == 1.0 and last.memory_mb == 512 and last.peak_rss_bytes > 0
    assert classify(info(last)) is ExitReason.COMPLETED


async def test_exit_code_is_reported(backend: LocalBackend) -> None:
    await backend.create(spec("p3", "import sys; sys.exit(3)"))
    st = await wait_exit(backend, "p3")
    assert st.exit_code == 3 and st.signal is None
    assert classify(info(st)) is ExitReason.USER_ERROR


async def test_create_existing_name_is_conflict(backend: LocalBackend) -> None:
    await backend.create(spec("dup", "import time; time.sleep(30)"))
    with pytest.raises(Conflict):
        await backend.create(spec("dup", "pass"))
    await backend.delete("dup", grace_s=0)
    await wait_exit(backend, "dup")


async def test_logs_and_forget(backend: LocalBackend) -> None:
    await backend.create(spec("log", "print('first'); print('second', flush=True)"))
    await wait_exit(backend, "log")
    assert await backend.logs("log") == "first\nsecond\n"
    assert await backend.logs("log", tail=1) == "second\n"
    assert await backend.logs("nope") == ""
    await backend.forget("log")
    assert not pod_dir(backend.root, "log").exists()
    assert [st.name for st in await backend.list()] == []
    await backend.forget("log")  # unknown: a no-op
    await backend.delete("log")


async def test_forget_of_a_live_pod_is_conflict(backend: LocalBackend) -> None:
    await backend.create(spec("live", "import time; time.sleep(30)"))
    with pytest.raises(Conflict):
        await backend.forget("live")
    await backend.delete("live", grace_s=0)
    await wait_exit(backend, "live")
    await backend.forget("live")


# ---------------------------------------------------------------- limits


async def test_memory_over_the_limit_is_oom_killed(backend: LocalBackend) -> None:
    hog = ("import time\nb = bytearray(300 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
           "time.sleep(60)")
    await backend.create(spec("oom", hog, memory_mb=64))
    st = await wait_exit(backend, "oom")
    assert st.oom and st.reason == "OOMKilled" and st.signal == signal.SIGKILL
    assert st.peak_rss_bytes > 64 << 20
    assert classify(info(st)) is ExitReason.OOM


async def test_a_limit_raised_in_place_lets_the_pod_grow_past_its_old_one(backend: LocalBackend,
                                                                          tmp_path: Path) -> None:
    """Kubernetes' in-place pod resize, locally: the same trainer, never restarted, may now use more."""
    go = tmp_path / "go"
    hog = (f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
           "b = bytearray(200 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
           # held for 10 of the supervisor's 0.1-s memory checks: the limit is enforced (and the peak read)
           # only at those, so a trainer that grew and exited between two would prove nothing (seen in CI)
           "time.sleep(1.0)\nprint('grew', flush=True)")
    await backend.create(spec("grow", hog, memory_mb=96))
    await wait_status(backend, "grow", lambda st: st.phase is PodPhase.RUNNING)
    pid = pod_meta(tmp_path / "pods", "grow")["trainer_pid"]
    await backend.resize("grow", 512)
    listed = {st.name: st for st in await backend.list()}
    assert listed["grow"].memory_mb == 512 and listed["grow"].phase is PodPhase.RUNNING
    go.write_text("")
    st = await wait_exit(backend, "grow")
    assert st.exit_code == 0 and not st.oom and st.peak_rss_bytes > 96 << 20
    assert pod_meta(tmp_path / "pods", "grow")["trainer_pid"] == pid  # the same process: no restart
    assert "grew" in await backend.logs("grow")
    # an exited pod cannot grow, an unknown one is not found
    with pytest.raises(Conflict):
        await backend.resize("grow", 1024)
    with pytest.raises(NotFound):
        await backend.resize("nobody", 1024)


async def test_memory_under_the_limit_is_not_killed(backend: LocalBackend) -> None:
    await backend.create(spec("fits", "b = bytearray(20 << 20)", memory_mb=256))
    st = await wait_exit(backend, "fits")
    assert st.exit_code == 0 and not st.oom


BUSY = ("import json, sys, time\nt, c = time.monotonic(), time.process_time()\n"
        "while time.monotonic() - t < 2.0: pass\n"
        "open(sys.argv[1], 'w').write(json.dumps({'cpu': time.process_time() - c, 'wall': time.monotonic() - t}))")


async def test_cpu_limit_throttles_a_busy_loop(backend: LocalBackend) -> None:
    await backend.create(spec("busy", BUSY, cpu=0.2, args=("{pod_dir}/usage.json",)))
    st = await wait_exit(backend, "busy")
    assert st.exit_code == 0
    usage = json.loads((pod_dir(backend.root, "busy") / "usage.json").read_text())
    # ~0.2 when throttled, ~1.0 when not: 0.6 can only fail if throttling does not work.
    assert usage["cpu"] / usage["wall"] < 0.6, usage
    assert st.cpu_throttled_s > 0


async def test_cpu_limits_can_be_disabled(backend: LocalBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACER_CPU_LIMITS", "0")  # read by the supervisor from its environment
    await backend.create(spec("free", BUSY.replace("2.0", "0.5"), cpu=0.2, args=("{pod_dir}/usage.json",)))
    st = await wait_exit(backend, "free")
    assert st.exit_code == 0 and st.cpu_throttled_s == 0


# ---------------------------------------------------------------- failures from outside


async def test_trainer_killed_from_outside(backend: LocalBackend) -> None:
    await backend.create(spec("k9", "import time; time.sleep(60)"))
    await wait_status(backend, "k9", lambda st: st.phase is PodPhase.RUNNING)
    os.kill(pod_meta(backend.root, "k9")["trainer_pid"], signal.SIGKILL)
    st = await wait_exit(backend, "k9")
    assert st.signal == signal.SIGKILL and st.exit_code is None and st.reason == ""
    assert classify(info(st)) is ExitReason.KILLED


async def test_supervisor_killed_is_node_lost_without_orphans(backend: LocalBackend) -> None:
    agent = ["python", "-c", "import time; time.sleep(60)"]
    await backend.create(spec("lost", "import time; time.sleep(60)", agent=agent))
    await wait_status(backend, "lost", lambda st: st.phase is PodPhase.RUNNING)
    meta = pod_meta(backend.root, "lost")
    os.kill(meta["supervisor_pid"], signal.SIGKILL)
    st = await wait_exit(backend, "lost")
    assert st.reason == "NodeLost" and st.signal == signal.SIGKILL
    assert classify(info(st)) is ExitReason.KILLED
    await wait_for(lambda: gone(meta["trainer_pid"]) and gone(meta["agent_pid"]), "trainer and agent die")
    again = await wait_exit(backend, "lost")
    assert again.finished_at == st.finished_at  # recorded once, stable afterwards


# ---------------------------------------------------------------- delete


async def test_delete_stops_a_sleeping_pod(backend: LocalBackend) -> None:
    await backend.create(spec("sleepy", "import time; time.sleep(60)"))
    await wait_status(backend, "sleepy", lambda st: st.phase is PodPhase.RUNNING)
    asked = time.time()
    await backend.delete("sleepy", grace_s=5)
    st = await wait_exit(backend, "sleepy")
    assert st.signal == signal.SIGTERM
    assert st.finished_at - asked < 5 + 3  # well within the grace (+ slack for a busy machine)
    await backend.delete("sleepy")  # exited: a no-op
    await backend.delete("never-was")


async def test_delete_kills_after_the_grace(backend: LocalBackend) -> None:
    stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)"
    await backend.create(spec("stubborn", stubborn))
    await wait_status(backend, "stubborn", lambda st: st.phase is PodPhase.RUNNING)
    await asyncio.sleep(0.5)  # let it install its handler
    asked = time.time()
    await backend.delete("stubborn", grace_s=1)
    st = await wait_exit(backend, "stubborn")
    assert st.signal == signal.SIGKILL
    assert st.finished_at - asked >= 1.0  # the grace was given
    assert st.finished_at - asked < 1 + 10


# ---------------------------------------------------------------- adoption


async def test_a_new_backend_adopts_running_pods(backend: LocalBackend) -> None:
    waiter = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.05)\nsys.exit(5)"
    await backend.create(spec("adopt", waiter, args=("{pod_dir}/go",)))
    await wait_status(backend, "adopt", lambda st: st.phase is PodPhase.RUNNING)
    await backend.close()

    second = LocalBackend(backend.root, poll_s=0.05)
    seen: list[PodStatus] = []
    gen = second.watch()
    first = await asyncio.wait_for(anext(gen), WAIT_S)
    assert first.name == "adopt" and first.phase is PodPhase.RUNNING
    (pod_dir(backend.root, "adopt") / "go").touch()

    async def rest() -> None:
        async for st in gen:
            seen.append(st)
            if st.phase is PodPhase.EXITED:
                return

    await asyncio.wait_for(rest(), WAIT_S)
    await gen.aclose()
    assert seen[-1].exit_code == 5
    with pytest.raises(Conflict):
        await second.create(spec("adopt", "pass"))
    await second.close()


# ---------------------------------------------------------------- pod dir and agent


AGENT = ("import pathlib, signal, sys, time\np = pathlib.Path(sys.argv[1])\n"
         "def stop(*_):\n    p.write_text('stopped')\n    sys.exit(0)\n"
         "signal.signal(signal.SIGTERM, stop)\np.write_text('started')\ntime.sleep(60)")

TRAINER = ("import os, pathlib, sys, time\nagent = pathlib.Path(sys.argv[1])\n"
           "while not agent.exists(): time.sleep(0.05)\n"
           "pathlib.Path(os.environ['OUT']).write_text(sys.argv[1])\nprint('agent is up', flush=True)")


async def test_pod_dir_substitution_and_the_agent(backend: LocalBackend) -> None:
    await backend.create(spec("sidecar", TRAINER, args=("{pod_dir}/agent.txt",),
                              env={"OUT": "{pod_dir}/out.txt"},
                              agent=["python", "-c", AGENT, "{pod_dir}/agent.txt"]))
    st = await wait_exit(backend, "sidecar")
    d = pod_dir(backend.root, "sidecar")
    assert st.exit_code == 0
    assert (d / "out.txt").read_text() == str(d / "agent.txt")  # argv and env substituted
    meta = pod_meta(backend.root, "sidecar")
    await wait_for(lambda: gone(meta["agent_pid"]), "the agent is stopped when the trainer ends")
    assert (d / "agent.txt").read_text() == "stopped"  # by SIGTERM, not SIGKILL
    assert await backend.logs("sidecar") == "agent is up\n"
    assert await backend.logs("sidecar", container="agent") == ""


@pytest.fixture
def bus_of_one_user(tmp_path: Path) -> Iterator[int]:
    """A nats-server (its port) that admits only the user ``agent-j`` with the password "current"."""
    port, monitor = free_port(), free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(f"listen: 127.0.0.1:{port}\nhttp: 127.0.0.1:{monitor}\n"
                    'authorization { users = [ { user: "agent-j", password: "current" } ] }\n')
    server = subprocess.Popen([find_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + WAIT_S
        while http_json(f"http://127.0.0.1:{monitor}/healthz")[0] != 200:
            assert time.monotonic() < deadline, "nats-server not up"
            time.sleep(0.05)
        yield port
    finally:
        server.terminate()
        server.wait(10)


async def test_a_pod_whose_agent_the_bus_refuses_for_good_ends_with_exit_refused(
        backend: LocalBackend, bus_of_one_user: int) -> None:
    """A torn-down job's pod or an expired token: the real agent gives up after --give-up-refused and the
    pod stops its trainer (which would wait for the bus for ever) and ends with EXIT_REFUSED."""
    agent = [sys.executable, "-m", "pacer.agent.main", "--job", JOB, "--node", "worker-0",
             "--ipc", "{pod_dir}/trainer.ipc", "--nats", f"nats://agent-j:expired@127.0.0.1:{bus_of_one_user}",
             "--give-up-refused", "2"]
    await backend.create(spec("refused", "import time; time.sleep(120)", agent=agent))
    st = await wait_exit(backend, "refused", timeout=60)
    assert st.exit_code == EXIT_REFUSED and classify(info(st)) is ExitReason.REFUSED, st
    assert f"exiting with {EXIT_REFUSED}" in await backend.logs("refused", container="agent")


async def test_unstartable_command_is_a_config_error(backend: LocalBackend) -> None:
    bad = PodSpec(name="bad", job=JOB, node="worker-0", role="worker", index=0, generation=0, cpu=1.0,
                  memory_mb=128, command=["/nonexistent/binary"])
    await backend.create(bad)
    st = await wait_exit(backend, "bad")
    assert st.exit_code == 127 and classify(info(st)) is ExitReason.CONFIG_ERROR
    assert "cannot start" in await backend.logs("bad")


# ---------------------------------------------------------------- cluster


def test_cluster_is_stable_and_gives_ports(tmp_path: Path) -> None:
    b = LocalBackend(tmp_path)
    c = b.cluster("job", 2, 3)
    assert len(c.ps) == 2 and len(c.workers) == 3
    assert b.pod_port(c, "ps", 1) == int(c.ps[1].split(":")[1])
    assert b.pod_port(c, "worker", 2) == int(c.workers[2].split(":")[1])
    assert len({b.pod_port(c, "ps", i) for i in range(2)} | {b.pod_port(c, "worker", i) for i in range(3)}) == 5


async def test_the_one_machine_is_this_host_with_what_live_pods_hold(backend: LocalBackend) -> None:
    """Nothing is reserved locally (the whole host is free), a live pod's limits count as its job's;
    a placement is ignored: the pod runs here all the same."""
    import socket
    from dataclasses import replace

    await backend.create(replace(spec("p-held", "import time; time.sleep(30)", cpu=0.5, memory_mb=256),
                                 machine="elsewhere"))
    (m,) = await backend.machines()
    assert m.name == socket.gethostname() and m.cpu == float(os.cpu_count() or 1)
    assert (m.free_cpu, m.free_memory_mb) == (m.cpu, m.memory_mb)
    assert m.held_cpu == {JOB: 0.5} and m.held_memory_mb == {JOB: 256}
    await backend.delete("p-held", grace_s=0.5)
    await wait_exit(backend, "p-held")
    (m,) = await backend.machines()
    assert m.held_cpu == {}
