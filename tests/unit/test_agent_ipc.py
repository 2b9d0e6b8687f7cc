"""Trainer <-> agent IPC: layout round trips, the per-step check, the barrier.

Both ends map the same file in this process (the layout does not care which
process maps it); the blocking trainer side runs in a thread.  No wall-clock
limits are asserted: timing is only used to give the other side a chance.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pacer.agent import ipc
from pacer.agent.ipc import Action, AgentIPC, IPCError, IPCFull, PayloadTooLarge, TrainerIPC
from pacer.contracts.agent import ActionKind

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "agent.ipc"


@pytest.fixture
def pair(path: Path) -> Iterator[tuple[TrainerIPC, AgentIPC]]:
    t = TrainerIPC(path, role="worker", barrier_timeout_s=5.0)
    a = AgentIPC(path)
    yield t, a
    a.close()
    t.close()


class Checker(threading.Thread):
    """Calls ``check(iteration)`` in a thread (it may block at a barrier)."""

    def __init__(self, t: TrainerIPC, iteration: int) -> None:
        super().__init__(daemon=True)
        self.t, self.iteration = t, iteration
        self.result: Action | None = None
        self.returned = threading.Event()

    def run(self) -> None:
        self.result = self.t.check(self.iteration)
        self.returned.set()


# ------------------------------------------------------------------ layout


def test_header_and_documented_offsets(path: Path) -> None:
    t = TrainerIPC(path, role="ps")
    raw = path.read_bytes()
    assert len(raw) == ipc.SIZE == 40960
    assert struct.unpack_from("<8sIIIII", raw, 0) == (b"PACERIPC", 1, 40960, 64, 8, 4096)
    assert struct.unpack_from("<q", raw, 72)[0] > 0  # pid
    assert raw[80:96].rstrip(b"\0") == b"ps"
    assert struct.unpack_from("<q", raw, 96)[0] == 1  # incarnation
    t.record_step(7, 70, 0.25, 32, 30, wall_ts=123.5)
    raw = path.read_bytes()
    assert struct.unpack_from("<qq", raw, 112) == (1, 30)  # steps_total, samples_total
    assert struct.unpack_from("<qqdqqd", raw, 256) == (7, 70, 0.25, 32, 30, 123.5)
    t.check(71)
    assert struct.unpack_from("<q", path.read_bytes(), 152)[0] == 71  # checked_iteration
    t.close()


def test_steps_round_trip_and_ring_wraps(pair: tuple[TrainerIPC, AgentIPC]) -> None:
    t, a = pair
    s = a.snapshot()
    assert (s.steps_total, s.steps, s.iteration, s.role, s.exiting) == (0, (), -1, "worker", False)
    for i in range(100):
        t.record_step(i, 1000 + i, 0.01 * (i % 3 + 1), 64, 60, wall_ts=float(i))
    s = a.snapshot()
    assert s.steps_total == 100 and s.samples_total == 6000
    assert len(s.steps) == ipc.RING == 64
    assert [r.number for r in s.steps] == list(range(36, 100))
    last = s.steps[-1]
    assert (last.local_step, last.iteration, last.batch_size, last.samples, last.wall_ts) == (99, 1099, 64, 60, 99.0)
    assert last.bpt_s == pytest.approx(0.01)
    assert s.iteration == a.current_iteration() == 1099
    t.mark_exiting()
    assert a.snapshot().exiting


def test_commit_payload_ack_round_trip(pair: tuple[TrainerIPC, AgentIPC]) -> None:
    t, a = pair
    payload = {"batch_sizes": {"w0": 128, "w1": 96}, "why": "transient straggler", "blob": b"\x00\x01"}
    seq = a.next_seq()
    a.commit(seq, 5, ActionKind.ADJUST_BS, payload)
    assert a.pending() == [(seq, 5)]
    assert t.check(4) is None
    got = t.check(5)
    assert got == Action(seq, ActionKind.ADJUST_BS, 5, payload, late=False)
    assert t.check(5) is None  # taken once
    assert a.pending() == []
    assert a.applied() == (0, -1)
    t.ack(got, 5)
    assert a.applied() == (seq, 5)


def test_action_past_target_is_late(pair: tuple[TrainerIPC, AgentIPC]) -> None:
    t, a = pair
    a.commit(a.next_seq(), 10, ActionKind.ADJUST_LR, {"scale": 0.5})
    got = t.check(13)
    assert got is not None and got.late and got.target_iteration == 10 and got.payload == {"scale": 0.5}


def test_several_due_actions_drain_in_target_order(pair: tuple[TrainerIPC, AgentIPC]) -> None:
    t, a = pair
    a.commit(3, 8, ActionKind.ADJUST_LR, {"scale": 2.0})
    a.commit(4, 6, ActionKind.KILL_RESTART, {}, immediate=True)
    a.commit(5, 50, ActionKind.BACKUP_WORKERS, {"backup": 1})
    got = []
    while (x := t.check(9)) is not None:
        got.append((x.seq, x.kind))
    assert got == [(4, ActionKind.KILL_RESTART), (3, ActionKind.ADJUST_LR)]
    assert t.check(49) is None
    x = t.check(50)
    assert x is not None and x.payload == {"backup": 1}


def test_slots_are_reused_and_never_overwrite_untaken_actions(pair: tuple[TrainerIPC, AgentIPC]) -> None:
    t, a = pair
    for i in range(3 * ipc.SLOTS):  # each taken before the next: slots recycle forever
        seq = a.next_seq()
        a.commit(seq, i, ActionKind.ADJUST_LR, {"i": i})
        x = t.check(i)
        assert x is not None and x.seq == seq and x.payload == {"i": i}
    for i in range(ipc.SLOTS):
        a.commit(a.next_seq(), 1000, ActionKind.ADJUST_LR, {"i": i})
    with pytest.raises(IPCFull):
        a.commit(a.next_seq(), 1000, ActionKind.ADJUST_LR, {})
    seen = []
    while (x := t.check(1000)) is not None:
        seen.append(x.payload["i"])
    assert seen == list(range(ipc.SLOTS))


def test_payload_limit(pair: tuple[TrainerIPC, AgentIPC]) -> None:
    _, a = pair
    with pytest.raises(PayloadTooLarge):
        a.commit(1, 5, ActionKind.ADJUST_BS, {"x": "y" * 5000})
    a.commit(1, 5, ActionKind.ADJUST_BS, {"x": "y" * 4000})


def test_agent_needs_a_valid_file(tmp_path: Path) -> None:
    assert AgentIPC.try_open(tmp_path / "missing") is None
    (tmp_path / "junk").write_bytes(b"x" * ipc.SIZE)
    with pytest.raises(IPCError):
        AgentIPC(tmp_path / "junk")
    # A trainer replaces junk with a valid file.
    TrainerIPC(tmp_path / "junk").close()
    AgentIPC(tmp_path / "junk").close()


def test_restarted_trainer_keeps_taken_actions_and_bumps_incarnation(path: Path) -> None:
    t = TrainerIPC(path)
    a = AgentIPC(path)
    a.commit(1, 3, ActionKind.ADJUST_LR, {"scale": 0.5})
    assert t.check(3) is not None
    t.record_step(3, 3, 0.1, 8, 8)
    t.close()
    t2 = TrainerIPC(path)  # the same file, attached in place
    s = a.snapshot()
    assert (s.incarnation, s.steps_total, s.applied_seq) == (2, 0, 0)
    assert t2.check(3) is None  # already taken by the previous incarnation
    assert not a.replaced()
    a.commit(a.next_seq(), 4, ActionKind.ADJUST_LR, {"scale": 2.0})
    x = t2.check(4)
    assert x is not None and x.seq == 2
    a.close()
    t2.close()


# ------------------------------------------------------------------ the per-step check


def test_check_fast_path_returns_none_in_a_loop(pair: tuple[TrainerIPC, AgentIPC]) -> None:
    t, a = pair
    a.commit(a.next_seq(), 10**9, ActionKind.ADJUST_LR, {})
    t0 = time.perf_counter()
    for i in range(50_000):
        t.record_step(i, i, 0.001, 1, 1)
        assert t.check(i) is None
    per_step_us = (time.perf_counter() - t0) / 50_000 * 1e6
    print(f"record_step + check: {per_step_us:.2f} us")  # informative only
    # A new action invalidates the cached gate at once.
    a.commit(a.next_seq(), 50_000, ActionKind.ADJUST_BS, {"batch_sizes": {}})
    assert t.check(49_999) is None
    assert t.check(50_000) is not None


def test_measure_check_us_reports_a_positive_mean() -> None:
    us = ipc.measure_check_us(20_000)
    print(f"check(): {us:.2f} us")
    assert us > 0


# ------------------------------------------------------------------ the barrier


def test_barrier_blocks_at_target_until_commit(pair: tuple[TrainerIPC, AgentIPC]) -> None:
    t, a = pair
    t.record_step(1, 1, 0.01, 8, 8)
    seq = a.next_seq()
    assert a.prepare(10, seq)
    assert t.check(9) is None  # before T: not held
    c = Checker(t, 10)
    c.start()
    assert not c.returned.wait(0.3)  # held at T
    assert a.snapshot().blocked_seq == seq
    a.commit(seq, 10, ActionKind.ADJUST_BS, {"batch_sizes": {"w0": 32}})
    assert c.returned.wait(5)
    assert c.result == Action(seq, ActionKind.ADJUST_BS, 10, {"batch_sizes": {"w0": 32}}, late=False)
    assert a.snapshot().blocked_seq == 0
    assert a.prepared() == (seq, 10, ipc.PREP_COMMITTED)


def test_abort_releases_the_barrier(pair: tuple[TrainerIPC, AgentIPC]) -> None:
    t, a = pair
    seq = a.next_seq()
    assert a.prepare(5, seq)
    c = Checker(t, 6)  # past T also waits: a trainer may skip T (global step)
    c.start()
    assert not c.returned.wait(0.3)
    assert a.abort(seq)
    assert c.returned.wait(5)
    assert c.result is None
    assert t.check(7) is None  # an aborted prepare never holds again


def test_prepare_is_too_late_once_the_trainer_reached_target(pair: tuple[TrainerIPC, AgentIPC]) -> None:
    t, a = pair
    t.record_step(20, 20, 0.01, 8, 8)
    assert not a.prepare(20, a.next_seq())  # recorded iteration 20 >= T
    assert t.check(21) is None
    assert not a.prepare(21, a.next_seq())  # checked 21 >= T
    assert a.prepare(22, seq := a.next_seq())
    assert a.abort(seq)


def test_barrier_timeout_releases_and_a_late_commit_is_flagged(path: Path) -> None:
    t = TrainerIPC(path, barrier_timeout_s=0.2)
    a = AgentIPC(path)
    seq = a.next_seq()
    assert a.prepare(3, seq)
    assert t.check(3) is None  # held ~0.2 s, then treated as aborted
    assert t.check(4) is None  # and not held again
    a.commit(seq, 3, ActionKind.ADJUST_LR, {"scale": 0.5})
    x = t.check(5)
    assert x is not None and x.late and x.target_iteration == 3
    a.close()
    t.close()


def test_a_new_prepare_replaces_a_pending_one(pair: tuple[TrainerIPC, AgentIPC]) -> None:
    t, a = pair
    s1 = a.next_seq()
    assert a.prepare(5, s1)
    s2 = a.next_seq()
    assert s2 > s1 and a.prepare(8, s2)
    assert t.check(6) is None  # the first barrier is gone with its coordinator
    c = Checker(t, 8)
    c.start()
    assert not c.returned.wait(0.2)
    a.commit(s2, 8, ActionKind.ADJUST_LR, {"scale": 1.5})
    assert c.returned.wait(5) and c.result is not None and c.result.seq == s2


def test_an_agent_that_died_mid_write_does_not_stall_the_trainer(pair: tuple[TrainerIPC, AgentIPC], path: Path) -> None:
    t, a = pair
    a.commit(a.next_seq(), 5, ActionKind.ADJUST_LR, {"scale": 0.5})
    raw = bytearray(path.read_bytes())
    gen = struct.unpack_from("<q", raw, ipc.A_GEN)[0]
    with open(path, "r+b") as f:  # leave the agent region "mid-write", as a kill -9 would
        f.seek(ipc.A_GEN)
        f.write(struct.pack("<q", gen + 1))
    for i in range(100):
        assert t.check(i) is None  # gives up on the odd generation once, then skips it
    a2 = AgentIPC(path)  # a restarted agent closes the generation; the action is there
    x = t.check(100)
    assert x is not None and x.late and x.payload == {"scale": 0.5}
    a2.close()


def test_a_trainer_that_died_mid_write_does_not_hang_the_agent(pair: tuple[TrainerIPC, AgentIPC], path: Path) -> None:
    t, a = pair
    t.record_step(1, 1, 0.1, 8, 8)
    with open(path, "r+b") as f:  # tgen left odd, as a kill -9 inside record_step would
        f.seek(ipc.T_GEN)
        f.write(struct.pack("<q", 3))
    with pytest.raises(IPCError):
        a.snapshot()
    with pytest.raises(IPCError):
        a.current_iteration()
    t2 = TrainerIPC(path)  # the restarted trainer closes the generation
    assert a.snapshot().incarnation == 2
    t2.close()
