"""Trainer <-> agent IPC: one small shared-memory file, no locks, no syscalls on the hot path.

The trainer (a TF PS or worker process) and its agent sidecar share a file
of :data:`SIZE` bytes, normally under ``/dev/shm`` (:func:`default_path`),
both ``mmap``-ing it.  The trainer uses :class:`TrainerIPC`, the agent
:class:`AgentIPC`.  The per-step cost for the trainer is one
:meth:`TrainerIPC.record_step` (~1 us) and one :meth:`TrainerIPC.check`
(~0.2-0.5 us when no action is due: one int64 write, one int64 read, two
compares; :func:`measure_check_us` measures it).

``iteration`` is the number actions are synchronised on and must never go
down within one trainer incarnation: the global iteration in synchronous
training; in asynchronous PS training either the worker's own step or the
global step read back from the PS (which may jump: see ``late``).  Pass the
same number space to ``check`` and ``record_step``; "applied at iteration
i" means returned by ``check(i)``.

Trainer quick reference::

    ipc = TrainerIPC(path, role="worker")          # path: from the agent's --ipc
    while training:
        it = current_iteration()                    # the number actions synchronise on
        while (action := ipc.check(it)) is not None:   # usually one call, returns None
            apply(action)                           # ADJUST_BS: action.payload["batch_sizes"][node]
            ipc.ack(action, it)
            if action.kind is ActionKind.KILL_RESTART: ipc.mark_exiting(); exit cleanly
        run_step(...)
        ipc.record_step(local_step, it, bpt_s, batch_size, samples)

Concurrency contract
--------------------
* Single writer per field: the trainer region is written only by the
  trainer process, the agent region only by the agent process.  The header
  is written once, by whoever creates the file.
* Multi-field records are read consistently with seqlocks: the writer makes
  a generation counter odd, writes, makes it even; a reader copies the
  record between two reads of the counter and retries unless both are the
  same even value.  ``tgen`` guards the trainer's scalars and ring; ``gen``
  guards the whole agent region.
* Single int64 fields outside a seqlock (``checked_iteration``,
  ``blocked_seq``, ``taken[i]``) are 8-byte aligned and written with one
  8-byte store (``struct`` uses the native code path for ``<q`` on
  little-endian hosts), so they are never torn.
* The barrier handshake relies on stores becoming visible in program order
  within ~microseconds (x86-64 TSO; ``AgentIPC.prepare`` waits ``settle_s``
  after arming before it reads the trainer's position).

Layout (little-endian; offsets in bytes; ``q`` = int64, ``d`` = float64)
-----------------------------------------------------------------------
Header, written once at creation::

    0     8s  magic            b"PACERIPC"
    8     u32 version          1
    12    u32 size             40960 (SIZE)
    16    u32 ring_len         64
    20    u32 slots            8
    24    u32 payload_cap      4096
    28..64    reserved

Trainer region (written only by the trainer)::

    64    q   tgen             seqlock of offsets 72..152 and the ring (odd = writing)
    72    q   pid              trainer process id
    80    16s role             ascii, NUL padded ("worker", "ps", "chief")
    96    q   incarnation      +1 each time a trainer attaches to the file
    104   q   exiting          0 | 1 (mark_exiting)
    112   q   steps_total      step records written by this incarnation (ring head)
    120   q   samples_total    sum of ``samples`` over those steps
    128   q   applied_seq      seq of the last acked action (0: none)
    136   q   applied_iter     iteration at which it was applied (-1: none)
    144   q   reserved
    152   q   checked_iter     argument of the newest check() (-1: none)   [no seqlock]
    160   q   blocked_seq      prepare seq check() is blocked on (0: none) [no seqlock]
    168   8q  taken[8]         action seq the trainer took from slot i     [no seqlock]
    256   ring[64] x 48 bytes: record n is at 256 + (n % 64) * 48:
              +0 q local_step, +8 q iteration, +16 d bpt_s,
              +24 q batch_size, +32 q samples, +40 d wall_ts (unix s)
    3328..4096 reserved

Agent region (written only by the agent)::

    4096  q   gen              seqlock of the whole agent region (odd = writing)
    4104  q   agent_pid
    4112  q   prep_seq         action seq of the current prepare (0: none)
    4120  q   prep_target      its target iteration T
    4128  q   prep_state       0 none | 1 pending | 2 committed | 3 aborted
    4160  slot[8] x 40 bytes:  +0 q action_seq (0: empty), +8 q target_iteration,
              +16 q kind (0 NONE, 1 ADJUST_BS, 2 ADJUST_LR, 3 BACKUP_WORKERS,
              4 KILL_RESTART), +24 q payload_len, +32 q flags (bit 0: no barrier)
    8192  payload[8] x 4096 bytes: slot i's msgpack map at 8192 + i * 4096
    40960 end

Semantics
---------
* Action seqs are positive and increase; the agent assigns them
  (:meth:`AgentIPC.next_seq`).  A slot is free when it is empty or the
  trainer has taken its action (``taken[i] == slot.action_seq``), so an
  action is never overwritten before the trainer has seen it.
* Barrier: while a prepare (seq S, target T) is *pending* and not timed out,
  ``check(i)`` with ``i >= T`` blocks until the agent commits S (the action
  is returned) or aborts it (None), at most ``barrier_timeout_s``; after the
  timeout the trainer treats S as aborted and goes on.  A commit of S that
  arrives later is still delivered, flagged ``late``, so that a committed
  action is never lost on one node while every other node applied it.
* A committed action with target T is returned by the first ``check(i)``
  with ``i >= T``; ``late`` is ``i > T`` (the trainer skipped T, e.g. it
  reads a global step that moves by more than one).
* A prepare is *too late* (``AgentIPC.prepare`` returns False, the agent
  votes no) when the trainer has already checked or recorded an iteration
  ``>= T`` without being blocked by it.
* A trainer that attaches to an existing valid file (a restart) keeps the
  agent region and ``taken[]``: actions it already took are not delivered
  again; its counters and ring restart from zero and ``incarnation`` grows.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import msgpack

from pacer.contracts.agent import ActionKind
from pacer.errors import PacerError

__all__ = [
    "ENV_PATH",
    "SIZE",
    "Action",
    "ActionKind",
    "AgentIPC",
    "IPCError",
    "IPCFull",
    "PayloadTooLarge",
    "StepRecord",
    "TrainerIPC",
    "TrainerState",
    "default_path",
    "measure_check_us",
]

if sys.byteorder != "little":  # pragma: no cover - the layout assumes one-store int64 writes
    raise ImportError("pacer.agent.ipc needs a little-endian host")

MAGIC = b"PACERIPC"
VERSION = 1
RING = 64
SLOTS = 8
PAYLOAD_CAP = 4096
SIZE = 40960
ENV_PATH = "PACER_AGENT_IPC"  # where a trainer launched beside an agent finds the file

# Header.
_HDR = struct.Struct("<8sIIIII")
# Trainer region.
T_GEN = 64
T_PID = 72
T_ROLE = 80
T_INCARNATION = 96
T_EXITING = 104
T_STEPS = 112
T_SAMPLES = 120
T_APPLIED = 128  # applied_seq, applied_iteration
T_CHECKED = 152
T_BLOCKED = 160
T_TAKEN = 168
RING_OFF = 256
STEP_SIZE = 48
_T_SCALARS = struct.Struct("<q16sqqqqqqq")  # at 72: pid, role, incarnation, exiting, steps, samples, applied seq, applied iter, reserved
_T_TAIL = struct.Struct("<qq8q")  # checked, blocked, taken[8] at 152
_STEP = struct.Struct("<qqdqqd")
# Agent region.
A_GEN = 4096
A_PID = 4104
A_PREP = 4112
SLOT_OFF = 4160
SLOT_SIZE = 40
PAYLOAD_OFF = 8192
_PREP = struct.Struct("<qqq")
_SLOT = struct.Struct("<qqqqq")
_SLOTS = struct.Struct("<" + "q" * (5 * SLOTS))

_Q = struct.Struct("<q")
_QQ = struct.Struct("<qq")
_pack_q = _Q.pack_into
_unpack_q = _Q.unpack_from

INT64_MAX = 2**63 - 1

PREP_NONE, PREP_PENDING, PREP_COMMITTED, PREP_ABORTED = 0, 1, 2, 3
FLAG_IMMEDIATE = 1

KIND_CODES: dict[ActionKind, int] = {
    ActionKind.NONE: 0,
    ActionKind.ADJUST_BS: 1,
    ActionKind.ADJUST_LR: 2,
    ActionKind.BACKUP_WORKERS: 3,
    ActionKind.KILL_RESTART: 4,
}
KINDS_BY_CODE: dict[int, ActionKind] = {v: k for k, v in KIND_CODES.items()}

assert _HDR.size <= 64 and T_GEN + 8 + _T_SCALARS.size <= T_CHECKED
assert T_CHECKED + _T_TAIL.size <= RING_OFF and RING_OFF + RING * STEP_SIZE <= A_GEN
assert SLOT_OFF + SLOTS * SLOT_SIZE <= PAYLOAD_OFF and PAYLOAD_OFF + SLOTS * PAYLOAD_CAP == SIZE


class IPCError(PacerError):
    """The IPC file is missing, not a Pacer IPC file, or of another layout version."""

    code = "ipc"


class IPCFull(IPCError):
    """Every action slot holds an action the trainer has not taken yet (commit refused)."""

    code = "ipc_full"
    temporary = True


class PayloadTooLarge(IPCError):
    """An action payload encodes to more than :data:`PAYLOAD_CAP` bytes."""

    code = "invalid"


@dataclass(frozen=True, slots=True)
class Action:
    """An action returned by :meth:`TrainerIPC.check`.

    ``late`` is True when the trainer's iteration was already past
    ``target_iteration`` when the action was returned.
    """

    seq: int
    kind: ActionKind
    target_iteration: int
    payload: dict[str, Any] = field(default_factory=dict)
    late: bool = False


class StepRecord(NamedTuple):
    """One ring entry; ``number`` counts the trainer's records from 0 (a tuple: cheap to build)."""

    number: int
    local_step: int
    iteration: int
    bpt_s: float
    batch_size: int
    samples: int
    wall_ts: float


@dataclass(frozen=True, slots=True)
class TrainerState:
    """A consistent snapshot of the trainer region (:meth:`AgentIPC.snapshot`)."""

    pid: int
    role: str
    incarnation: int
    exiting: bool
    steps_total: int
    samples_total: int
    applied_seq: int
    applied_iteration: int
    checked_iteration: int
    blocked_seq: int
    steps: tuple[StepRecord, ...]  # oldest first, at most 64

    @property
    def iteration(self) -> int:
        """The trainer's current iteration: newest of check() and record_step() (-1: none)."""
        last = self.steps[-1].iteration if self.steps else -1
        return max(self.checked_iteration, last)


def default_path(job: str, node: str) -> Path:
    """``/dev/shm/pacer-<job>-<node>.ipc`` (the temp dir where there is no /dev/shm)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"pacer-{job}-{node}.ipc"


def _valid_header(buf: Any) -> bool:
    magic, version, size, ring, slots, cap = _HDR.unpack_from(buf, 0)
    return bool(
        magic == MAGIC and version == VERSION and size == SIZE and ring == RING and slots == SLOTS and cap == PAYLOAD_CAP
    )


def _create_file(path: Path) -> None:
    """Write a fresh, zeroed file with its header, atomically (temp file + rename)."""
    buf = bytearray(SIZE)
    _HDR.pack_into(buf, 0, MAGIC, VERSION, SIZE, RING, SLOTS, PAYLOAD_CAP)
    _QQ.pack_into(buf, T_APPLIED, 0, -1)
    _pack_q(buf, T_CHECKED, -1)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buf)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _open_map(path: Path) -> tuple[Any, mmap.mmap, int]:
    try:
        f = open(path, "r+b")  # kept open as long as the map
    except FileNotFoundError:
        raise IPCError(f"{path}: no IPC file") from None
    try:
        st = os.fstat(f.fileno())
        if st.st_size < SIZE:
            raise IPCError(f"{path}: {st.st_size} bytes, not a Pacer IPC file")
        mm = mmap.mmap(f.fileno(), SIZE)
    except BaseException:
        f.close()
        raise
    if not _valid_header(mm):
        mm.close()
        f.close()
        raise IPCError(f"{path}: not a Pacer IPC file of layout version {VERSION}")
    return f, mm, st.st_ino


# ====================================================================== trainer side


class TrainerIPC:
    """The trainer's end.  Not thread-safe: call it from the training loop's thread.

    ``TrainerIPC(path, create=True, role="worker")`` creates the file if it is
    missing (or not a valid IPC file) and otherwise attaches to it in place,
    resetting only the trainer's own counters (see the module docstring).
    With ``create=False`` the file must already exist.
    """

    __slots__ = (
        "_f",
        "_gate",
        "_gen",
        "_mm",
        "_released",
        "_samples",
        "_steps",
        "_stuck",
        "_taken",
        "_tgen",
        "barrier_timeout_s",
        "incarnation",
        "path",
        "role",
    )

    def __init__(
        self,
        path: str | os.PathLike[str],
        create: bool = True,
        role: str = "worker",
        barrier_timeout_s: float = 10.0,
        pid: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.role = role
        self.barrier_timeout_s = barrier_timeout_s
        role_b = role.encode("ascii")
        if len(role_b) > 16:
            raise ValueError("role: at most 16 ascii characters")
        if create:
            try:
                self._f, self._mm, _ = _open_map(self.path)
            except IPCError:
                _create_file(self.path)
                self._f, self._mm, _ = _open_map(self.path)
        else:
            self._f, self._mm, _ = _open_map(self.path)
        mm = self._mm
        tgen = _unpack_q(mm, T_GEN)[0]
        self._tgen = (tgen | 1) + 1  # even, past anything a dead predecessor left
        self.incarnation = _unpack_q(mm, T_INCARNATION)[0] + 1
        self._steps = 0
        self._samples = 0
        self._taken = list(_T_TAIL.unpack_from(mm, T_CHECKED)[2:])
        self._released: set[int] = set()
        self._gen = -1  # cached agent gen; -1 forces the slow path
        self._gate = -1
        self._stuck = -1  # an odd agent gen we gave up waiting on (its writer died)
        _pack_q(mm, T_GEN, self._tgen - 1)  # odd: writing
        _T_SCALARS.pack_into(
            mm, T_PID, os.getpid() if pid is None else pid, role_b, self.incarnation, 0, 0, 0, 0, -1, 0
        )
        _pack_q(mm, T_CHECKED, -1)
        _pack_q(mm, T_BLOCKED, 0)
        _pack_q(mm, T_GEN, self._tgen)

    @classmethod
    def from_env(cls, role: str = "worker", **kw: Any) -> TrainerIPC | None:
        """Attach to ``$PACER_AGENT_IPC`` if it is set (None otherwise)."""
        path = os.environ.get(ENV_PATH)
        return cls(path, role=role, **kw) if path else None

    # ------------------------------------------------------------ per step
    def record_step(
        self,
        local_step: int,
        iteration: int,
        bpt_s: float,
        batch_size: int,
        samples: int,
        wall_ts: float | None = None,
    ) -> None:
        """Append one step to the ring (the agent averages BPT over its last k records)."""
        mm = self._mm
        n = self._steps
        g = self._tgen + 1
        _pack_q(mm, T_GEN, g)
        _STEP.pack_into(
            mm,
            RING_OFF + (n % RING) * STEP_SIZE,
            local_step,
            iteration,
            bpt_s,
            batch_size,
            samples,
            time.time() if wall_ts is None else wall_ts,
        )
        self._steps = n + 1
        self._samples += samples
        _QQ.pack_into(mm, T_STEPS, self._steps, self._samples)
        self._tgen = g + 1
        _pack_q(mm, T_GEN, g + 1)

    def check(self, iteration: int) -> Action | None:
        """The per-step check: the action due at ``iteration``, or None.

        Fast path (nothing changed since the last call and ``iteration`` is
        before every pending target): one store and one load on the map.
        Blocks only at a pending barrier (see the module docstring).  Returns
        at most one action per call; call again to drain several due at once.
        """
        mm = self._mm
        _pack_q(mm, T_CHECKED, iteration)
        if _unpack_q(mm, A_GEN)[0] == self._gen and iteration < self._gate:
            return None
        return self._check_slow(iteration)

    def ack(self, action: Action, iteration: int) -> None:
        """Record that ``action`` was applied at ``iteration`` (the agent reports it)."""
        mm = self._mm
        g = self._tgen + 1
        _pack_q(mm, T_GEN, g)
        _QQ.pack_into(mm, T_APPLIED, action.seq, iteration)
        self._tgen = g + 1
        _pack_q(mm, T_GEN, g + 1)

    def mark_exiting(self) -> None:
        """Tell the agent this trainer is about to exit on purpose (e.g. KILL_RESTART)."""
        mm = self._mm
        g = self._tgen + 1
        _pack_q(mm, T_GEN, g)
        _pack_q(mm, T_EXITING, 1)
        self._tgen = g + 1
        _pack_q(mm, T_GEN, g + 1)

    def close(self) -> None:
        self._mm.close()
        self._f.close()

    def __enter__(self) -> TrainerIPC:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ slow path
    def _read_agent(self) -> tuple[int, tuple[int, ...], tuple[int, ...]] | None:
        """A consistent copy of the agent region's headers, or None if the agent is mid-write for long."""
        mm = self._mm
        deadline = 0.0
        while True:
            g = _unpack_q(mm, A_GEN)[0]
            if not g & 1:
                prep = _PREP.unpack_from(mm, A_PREP)
                slots = _SLOTS.unpack_from(mm, SLOT_OFF)
                if _unpack_q(mm, A_GEN)[0] == g:
                    return g, prep, slots
            elif g == self._stuck:
                return None  # still the generation a dead agent left odd: do not wait again
            # The agent is writing (a few us) -- or died mid-write: do not hang the trainer.
            now = time.monotonic()
            if not deadline:
                deadline = now + 0.002
            elif now > deadline:
                self._stuck = g
                return None
            time.sleep(0)

    def _check_slow(self, iteration: int) -> Action | None:
        mm = self._mm
        blocked_since = 0.0
        blocked_seq = 0
        delay = 0.0001
        try:
            while True:
                view = self._read_agent()
                if view is None:
                    self._gen = -1
                    return None
                g, (prep_seq, prep_target, prep_state), slots = view
                gate = INT64_MAX
                best = -1
                best_key = (INT64_MAX, INT64_MAX)
                taken = self._taken
                for i in range(SLOTS):
                    seq = slots[5 * i]
                    if seq == 0 or taken[i] == seq:
                        continue
                    target = slots[5 * i + 1]
                    if target <= iteration:
                        if (target, seq) < best_key:
                            best, best_key = i, (target, seq)
                    elif target < gate:
                        gate = target
                if best >= 0:
                    action = self._take(best, slots, iteration)
                    if action is not None:
                        return action
                    continue  # the slot changed under us: look again
                barrier = prep_state == PREP_PENDING and prep_seq not in self._released
                if barrier and prep_target <= iteration:
                    now = time.monotonic()
                    if blocked_seq != prep_seq:
                        blocked_seq, blocked_since, delay = prep_seq, now, 0.0001
                        _pack_q(mm, T_BLOCKED, prep_seq)
                    elif now - blocked_since >= self.barrier_timeout_s:
                        self._released.add(prep_seq)  # treat as aborted; a late commit still arrives (late=True)
                        continue
                    # Wait for the agent's commit or abort (any write bumps gen).
                    while _unpack_q(mm, A_GEN)[0] == g and time.monotonic() - blocked_since < self.barrier_timeout_s:
                        time.sleep(delay)
                        delay = min(delay * 2, 0.002)
                    continue
                if barrier and prep_target < gate:
                    gate = prep_target
                self._gen, self._gate = g, gate
                return None
        finally:
            if blocked_seq:
                _pack_q(mm, T_BLOCKED, 0)

    def _take(self, i: int, slots: tuple[int, ...], iteration: int) -> Action | None:
        mm = self._mm
        seq, target, kind, plen, _flags = slots[5 * i : 5 * i + 5]
        raw = mm[PAYLOAD_OFF + i * PAYLOAD_CAP : PAYLOAD_OFF + i * PAYLOAD_CAP + plen] if plen > 0 else b""
        if _unpack_q(mm, SLOT_OFF + i * SLOT_SIZE)[0] != seq:
            return None
        self._taken[i] = seq
        _pack_q(mm, T_TAKEN + 8 * i, seq)
        self._gen = -1  # re-evaluate on the next call
        payload = msgpack.unpackb(raw, raw=False, strict_map_key=False) if raw else {}
        return Action(
            seq=seq,
            kind=KINDS_BY_CODE.get(kind, ActionKind.NONE),
            target_iteration=target,
            payload=payload if isinstance(payload, dict) else {"value": payload},
            late=iteration > target,
        )


# ====================================================================== agent side


class AgentIPC:
    """The agent's end.  Use from one thread (the agent's event loop)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._f, self._mm, self._ino = _open_map(self.path)
        g = _unpack_q(self._mm, A_GEN)[0]
        self._gen = g + 1 if g & 1 else g  # a predecessor died mid-write: close its generation
        _pack_q(self._mm, A_GEN, self._gen)
        _pack_q(self._mm, A_PID, os.getpid())

    @classmethod
    def try_open(cls, path: str | os.PathLike[str]) -> AgentIPC | None:
        """Attach if the trainer has created the file, else None (the agent polls)."""
        try:
            return cls(path)
        except IPCError:
            return None

    def replaced(self) -> bool:
        """True if the path now names another file (a trainer re-created it): reopen."""
        try:
            return os.stat(self.path).st_ino != self._ino
        except FileNotFoundError:
            return True

    def close(self) -> None:
        self._mm.close()
        self._f.close()

    # ------------------------------------------------------------ reads
    def _stable_tgen(self, deadline: float) -> int:
        """Wait (spinning, at most until ``deadline``) for an even ``tgen``; raise if it stays odd."""
        mm = self._mm
        while True:
            g = int(_unpack_q(mm, T_GEN)[0])
            if not g & 1:
                return g
            if time.monotonic() > deadline:
                # A trainer writes for microseconds; this one died or stopped mid-write.
                raise IPCError(f"{self.path}: trainer region stays mid-write (trainer died while writing?)")
            time.sleep(0)

    def snapshot(self) -> TrainerState:
        """A consistent copy of the trainer region, ring oldest first."""
        mm = self._mm
        deadline = time.monotonic() + 0.005
        while True:
            g = self._stable_tgen(deadline)
            scal = _T_SCALARS.unpack_from(mm, T_PID)
            ring = mm[RING_OFF : RING_OFF + RING * STEP_SIZE]
            if _unpack_q(mm, T_GEN)[0] == g:
                break
        pid, role_b, incarnation, exiting, steps_total, samples_total, applied_seq, applied_iter, _ = scal
        checked, blocked = _QQ.unpack_from(mm, T_CHECKED)
        first = max(0, steps_total - RING)
        recs = list(_STEP.iter_unpack(ring))
        steps = tuple(StepRecord(n, *recs[n % RING]) for n in range(first, steps_total))
        return TrainerState(
            pid=pid,
            role=role_b.rstrip(b"\0").decode("ascii", "replace"),
            incarnation=incarnation,
            exiting=bool(exiting),
            steps_total=steps_total,
            samples_total=samples_total,
            applied_seq=applied_seq,
            applied_iteration=applied_iter,
            checked_iteration=checked,
            blocked_seq=blocked,
            steps=steps,
        )

    def steps_total(self) -> int:
        """Cheap: step records written by the current trainer incarnation."""
        return int(_unpack_q(self._mm, T_STEPS)[0])

    def current_iteration(self) -> int:
        """The trainer's newest iteration: max of its last check() and last recorded step (-1: none)."""
        mm = self._mm
        checked = _unpack_q(mm, T_CHECKED)[0]
        deadline = time.monotonic() + 0.005
        while True:
            g = self._stable_tgen(deadline)
            n = _unpack_q(mm, T_STEPS)[0]
            last = _unpack_q(mm, RING_OFF + ((n - 1) % RING) * STEP_SIZE + 8)[0] if n > 0 else -1
            if _unpack_q(mm, T_GEN)[0] == g:
                return int(max(checked, last, _unpack_q(mm, T_CHECKED)[0]))

    def applied(self) -> tuple[int, int]:
        """(seq, iteration) of the last action the trainer acked; (0, -1) if none."""
        s = self.snapshot()
        return s.applied_seq, s.applied_iteration

    def last_seq(self) -> int:
        """The highest action seq the file has seen (prepares, slots, taken, applied)."""
        mm = self._mm
        prep_seq = _unpack_q(mm, A_PREP)[0]
        slots = _SLOTS.unpack_from(mm, SLOT_OFF)
        taken = _T_TAIL.unpack_from(mm, T_CHECKED)[2:]
        applied = _unpack_q(mm, T_APPLIED)[0]
        return int(max(prep_seq, applied, *slots[0::5], *taken))

    def next_seq(self) -> int:
        return self.last_seq() + 1

    def pending(self) -> list[tuple[int, int]]:
        """(seq, target) of committed actions the trainer has not taken yet."""
        mm = self._mm
        slots = _SLOTS.unpack_from(mm, SLOT_OFF)
        taken = _T_TAIL.unpack_from(mm, T_CHECKED)[2:]
        return [
            (slots[5 * i], slots[5 * i + 1])
            for i in range(SLOTS)
            if slots[5 * i] and taken[i] != slots[5 * i]
        ]

    def prepared(self) -> tuple[int, int, int]:
        """(seq, target, state) of the current prepare; state: 0 none, 1 pending, 2 committed, 3 aborted."""
        seq, target, state = _PREP.unpack_from(self._mm, A_PREP)
        return int(seq), int(target), int(state)

    # ------------------------------------------------------------ writes
    def _begin(self) -> None:
        self._gen += 1
        _pack_q(self._mm, A_GEN, self._gen)

    def _end(self) -> None:
        self._gen += 1
        _pack_q(self._mm, A_GEN, self._gen)

    def prepare(self, target: int, seq: int, settle_s: float = 0.001) -> bool:
        """Arm the barrier at ``target`` for action ``seq``; False if it is too late.

        A pending prepare replaces the previous one (whose coordinator is
        gone).  Too late: the trainer has already checked or recorded an
        iteration >= ``target`` without being held by this barrier; the
        prepare is then withdrawn (state aborted) and nothing waits on it.
        """
        if seq <= 0:
            raise ValueError("action seq must be > 0")
        if self.current_iteration() >= target:
            return False
        self._begin()
        _PREP.pack_into(self._mm, A_PREP, seq, target, PREP_PENDING)
        self._end()
        # Let the trainer's in-flight store of checked_iter land (see the concurrency contract).
        time.sleep(settle_s)
        if _unpack_q(self._mm, T_BLOCKED)[0] == seq:
            return True  # the trainer is already waiting at T for us: in time
        if self.current_iteration() >= target:
            self._set_prep_state(seq, PREP_ABORTED)
            return False
        return True

    def commit(self, seq: int, target: int, kind: ActionKind, payload: dict[str, Any] | bytes | None = None, immediate: bool = False) -> None:
        """Deliver action ``seq`` for ``target`` (idempotent for a seq already in a slot).

        Marks the matching prepare committed, releasing the barrier.  Raises
        :class:`IPCFull` if all slots hold untaken actions and
        :class:`PayloadTooLarge` for payloads over 4 KiB.
        """
        if seq <= 0:
            raise ValueError("action seq must be > 0")
        data = payload if isinstance(payload, bytes) else msgpack.packb(payload or {}, use_bin_type=True)
        if len(data) > PAYLOAD_CAP:
            raise PayloadTooLarge(f"action payload is {len(data)} bytes, at most {PAYLOAD_CAP}")
        mm = self._mm
        slots = _SLOTS.unpack_from(mm, SLOT_OFF)
        if seq in slots[0::5]:
            return
        taken = _T_TAIL.unpack_from(mm, T_CHECKED)[2:]
        free = [i for i in range(SLOTS) if slots[5 * i] == 0 or taken[i] == slots[5 * i]]
        if not free:
            raise IPCFull(f"{self.path}: {SLOTS} actions wait for the trainer")
        i = free[0]
        prep_seq, prep_target, _ = _PREP.unpack_from(mm, A_PREP)
        self._begin()
        mm[PAYLOAD_OFF + i * PAYLOAD_CAP : PAYLOAD_OFF + i * PAYLOAD_CAP + len(data)] = data
        _SLOT.pack_into(mm, SLOT_OFF + i * SLOT_SIZE, seq, target, KIND_CODES[ActionKind(kind)], len(data), FLAG_IMMEDIATE if immediate else 0)
        if prep_seq == seq:
            _PREP.pack_into(mm, A_PREP, seq, prep_target, PREP_COMMITTED)
        self._end()

    def abort(self, seq: int) -> bool:
        """Release the barrier of prepare ``seq`` without an action; False if it is not the pending one."""
        return self._set_prep_state(seq, PREP_ABORTED)

    def _set_prep_state(self, seq: int, state: int) -> bool:
        prep_seq, target, cur = _PREP.unpack_from(self._mm, A_PREP)
        if prep_seq != seq or cur != PREP_PENDING:
            return False
        self._begin()
        _PREP.pack_into(self._mm, A_PREP, seq, target, state)
        self._end()
        return True


# ====================================================================== benchmark


def measure_check_us(n: int = 200_000, path: str | os.PathLike[str] | None = None) -> float:
    """Mean cost (us) of one ``TrainerIPC.check`` when no action is due.

    An agent is attached with one action committed far in the future, so the
    measured path is the real steady-state one (cached gate, fast path).
    Used by the trainer benchmark as ``agent_step_check_us`` (target < 50 us).
    """
    tmp = None
    if path is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, tmp = tempfile.mkstemp(prefix="pacer-bench-", suffix=".ipc", dir=base)
        os.close(fd)
        os.unlink(tmp)
        path = tmp
    trainer = TrainerIPC(path, role="worker")
    agent = AgentIPC(path)
    try:
        agent.commit(agent.next_seq(), INT64_MAX - 1, ActionKind.ADJUST_LR, {"scale": 1.0})
        check = trainer.check
        check(0)
        t0 = time.perf_counter()
        for i in range(1, n + 1):
            if check(i) is not None:  # pragma: no cover - nothing is due
                raise AssertionError("measure_check_us: an action was due")
        elapsed = time.perf_counter() - t0
    finally:
        agent.close()
        trainer.close()
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return elapsed / n * 1e6
