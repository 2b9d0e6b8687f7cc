"""Flash checkpoint (DLRover-RM §5.2): shm-first save, async persist, shm-then-disk restore.

Shared memory is real: every test gets its own directory under /dev/shm.
The crash test SIGKILLs a real child process in the middle of a persist.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pacer.trainer import flashckpt
from pacer.trainer.flashckpt import FlashCheckpointer, Latest, NoCheckpoint


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    d = base / f"pacer-test-{uuid.uuid4().hex[:10]}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def ckpt(tmp_path: Path, shm_dir: Path) -> Iterator[FlashCheckpointer]:
    c = FlashCheckpointer("job1-ps-0", tmp_path / "disk", shm_dir=shm_dir)
    yield c
    c.close()
    c.cleanup()


def many_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    a: dict[str, np.ndarray] = {
        "f32": rng.standard_normal((17, 5)).astype(np.float32),
        "f64": rng.standard_normal(1000),
        "f16": rng.standard_normal((3, 3, 3)).astype(np.float16),
        "i8": rng.integers(-128, 127, 33, dtype=np.int8),
        "i32": rng.integers(-(2**31), 2**31 - 1, (4, 4), dtype=np.int32),
        "i64": rng.integers(-(2**62), 2**62, 7, dtype=np.int64),
        "u8": rng.integers(0, 255, (2, 3, 4, 5), dtype=np.uint8),
        "u64": rng.integers(0, 2**63, 3, dtype=np.uint64),
        "bool": rng.random(13) > 0.5,
        "c64": (rng.standard_normal(6) + 1j * rng.standard_normal(6)).astype(np.complex64),
        "scalar": np.array(3.25),
        "empty": np.zeros((0, 4), np.float32),
        "bytes": np.array([b"ab", b"cde"]),
        "unicode": np.array(["héllo", "w"]),
        "big_endian": np.arange(5, dtype=">i4"),
        "transposed": rng.standard_normal((6, 4)).astype(np.float32).T,  # not C-contiguous
        "emb/part_0": rng.standard_normal((1000, 8)).astype(np.float32),
    }
    try:
        import ml_dtypes

        a["bf16"] = rng.standard_normal(9).astype(ml_dtypes.bfloat16)
    except ImportError:  # pragma: no cover
        pass
    return a


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert set(a) == set(b)
    for k in a:
        x, y = np.asarray(a[k]), b[k]
        assert x.dtype == y.dtype, k
        assert x.shape == y.shape, k
        assert x.tobytes() == y.tobytes(), k  # bit-exact, NaN-safe


def test_roundtrip_many_dtypes_and_shapes(ckpt: FlashCheckpointer) -> None:
    arrays = many_arrays()
    h = ckpt.save(7, arrays, {"lr": 0.01, "shards": [1, 2]})
    assert ckpt.restore().step == 7  # readable from shm before the persist is done
    assert h.wait(20) and h.ok and h.disk_path == ckpt.ckpt_dir(7)
    for source in ("shm", "disk"):
        r = ckpt.restore(source=source)  # type: ignore[arg-type]
        assert (r.step, r.source, r.meta) == (7, source, {"lr": 0.01, "shards": [1, 2]})
        assert_same(arrays, r.arrays)
        r.arrays["f32"][0, 0] = 42.0  # copies: writable and private
    r = ckpt.restore(copy=False)
    assert_same(arrays, r.arrays)
    assert not r.arrays["f32"].flags.writeable
    with pytest.raises(ValueError):
        ckpt.save(8, {"obj": np.array([object()])}, {})


def test_restore_prefers_shm_and_serves_newer_unpersisted_step(
    ckpt: FlashCheckpointer, monkeypatch: pytest.MonkeyPatch
) -> None:
    a1, a2 = many_arrays(1), many_arrays(2)
    ckpt.save(1, a1, {}).wait(20)
    assert ckpt.latest() == Latest(1, "shm")  # same step on disk: shm wins the tie
    assert ckpt.restore().source == "shm"

    gate = threading.Event()
    real = ckpt._persist

    def slow_persist(job: object) -> Path:
        gate.wait(20)
        return real(job)  # type: ignore[arg-type]

    monkeypatch.setattr(ckpt, "_persist", slow_persist)
    h2 = ckpt.save(2, a2, {"s": 2})
    assert not h2.done
    assert ckpt.latest() == Latest(2, "shm")
    r = ckpt.restore()
    assert (r.step, r.source) == (2, "shm")
    assert_same(a2, r.arrays)
    assert ckpt.restore(1).step == 1  # an older step on request (still in the other slot)
    gate.set()
    assert h2.wait(20)
    assert ckpt._disk_steps() == [1, 2]


def test_restart_without_shm_falls_back_to_disk(tmp_path: Path, shm_dir: Path) -> None:
    arrays = many_arrays(3)
    c = FlashCheckpointer("w", tmp_path / "disk", shm_dir=shm_dir)
    c.save(5, many_arrays(4), {})
    c.save(6, arrays, {"epoch": 1})
    c.close()  # drains the persister
    c.cleanup()  # the machine restarted: tmpfs is empty
    assert not list(shm_dir.iterdir())

    c2 = FlashCheckpointer("w", tmp_path / "disk", shm_dir=shm_dir)
    assert c2.latest() == Latest(6, "disk")
    r = c2.restore()
    assert (r.step, r.source, r.meta) == (6, "disk", {"epoch": 1})
    assert_same(arrays, r.arrays)
    c2.close()


def test_no_checkpoint_raises(ckpt: FlashCheckpointer) -> None:
    assert ckpt.latest() is None
    with pytest.raises(NoCheckpoint):
        ckpt.restore()
    ckpt.save(1, {"x": np.ones(3)}, {}).wait(20)
    with pytest.raises(NoCheckpoint):
        ckpt.restore(2)


CHILD = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import numpy as np
    from pacer.trainer.flashckpt import FlashCheckpointer

    disk, shm = Path(sys.argv[1]), Path(sys.argv[2])
    c = FlashCheckpointer("crashy", disk, shm_dir=shm)
    a = {"w": np.full((512, 1024), 1.0, np.float32), "b": np.arange(100, dtype=np.int64)}
    c.save(1, a, {}).wait(60)
    real_fsync = os.fsync

    def stuck_fsync(fd):  # the second persist stops at its first fsync: data.bin written, no manifest
        print("PERSISTING", flush=True)
        time.sleep(600)

    os.fsync = stuck_fsync
    a = {"w": np.full((512, 1024), 2.0, np.float32), "b": np.arange(100, dtype=np.int64) * 2}
    c.save(2, a, {})
    time.sleep(600)
    """
)


def test_kill_mid_persist_never_yields_a_corrupt_restore(tmp_path: Path, shm_dir: Path) -> None:
    disk = tmp_path / "disk"
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(disk), str(shm_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "PERSISTING"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    leftovers = [n.name for n in disk.iterdir()]
    assert "ckpt-1" in leftovers and "ckpt-2" not in leftovers
    assert any(n.startswith(".tmp-ckpt-2") for n in leftovers)  # the half persist

    # Same machine: shm still holds step 2 (complete: published before the persist began).
    c = FlashCheckpointer("crashy", disk, shm_dir=shm_dir)
    r = c.restore()
    assert (r.step, r.source) == (2, "shm")
    assert np.all(r.arrays["w"] == 2.0)
    # The dead writer's temp dir is reaped; it never counted as a checkpoint.
    assert not any(n.name.startswith(".tmp-") for n in disk.iterdir())

    # Machine restart: shm gone, disk has only the complete step 1.
    c.cleanup()
    c.close()
    c = FlashCheckpointer("crashy", disk, shm_dir=shm_dir)
    r = c.restore()
    assert (r.step, r.source) == (1, "disk")
    assert np.all(r.arrays["w"] == 1.0)
    assert np.array_equal(r.arrays["b"], np.arange(100))
    c.close()


def test_partial_files_are_invisible(ckpt: FlashCheckpointer) -> None:
    good = {"x": np.arange(10.0)}
    ckpt.save(3, good, {}).wait(20)
    # A writer that died mid-copy into shm leaves only a temp name (dead pid).
    (ckpt.shm_dir / f"pacer-flash-{ckpt.name}.B.tmp-999999999-deadbeef").write_bytes(
        b"PACERFC1" + b"\0" * 100
    )
    # A slot whose header is invalid (a recycled file whose writer died mid-copy).
    ckpt.slot_path("B").write_bytes(b"\0" * 4096)
    # A disk checkpoint directory without manifest and a half-written temp dir.
    (ckpt.disk_dir / "ckpt-9").mkdir()
    (ckpt.disk_dir / "ckpt-9" / "data.bin").write_bytes(b"junk")
    (ckpt.disk_dir / ".tmp-ckpt-10.tmp-999999999-deadbeef").mkdir()
    assert ckpt.latest() == Latest(3, "shm")
    r = ckpt.restore()
    assert r.step == 3
    assert_same(good, r.arrays)
    # Truncated shm slot: detected structurally, disk copy of the same step used.
    with open(ckpt.slot_path("A"), "r+b") as f:
        f.truncate(f.seek(0, 2) - 64)  # cuts into the array, not only its padding
    r = ckpt.restore()
    assert (r.step, r.source) == (3, "disk")
    assert_same(good, r.arrays)
    # A new process reaps the dead writer's temps.
    c2 = FlashCheckpointer(ckpt.name, ckpt.disk_dir, shm_dir=ckpt.shm_dir)
    assert not (ckpt.shm_dir / f"pacer-flash-{ckpt.name}.B.tmp-999999999-deadbeef").exists()
    assert not (ckpt.disk_dir / ".tmp-ckpt-10.tmp-999999999-deadbeef").exists()
    c2.close()


def test_keep_prunes_old_disk_checkpoints(tmp_path: Path, shm_dir: Path) -> None:
    c = FlashCheckpointer("p", tmp_path / "disk", shm_dir=shm_dir, keep=2)
    for s in range(1, 6):
        c.save(s * 10, {"x": np.full(100, s)}, {}).wait(20)
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["ckpt-40", "ckpt-50"]
    assert c.restore(40, source="disk").arrays["x"][0] == 4
    c.close()
    c.cleanup()


def test_back_to_back_saves_with_concurrent_readers_are_consistent(ckpt: FlashCheckpointer) -> None:
    names = [f"v{i}" for i in range(6)]
    stop = threading.Event()
    problems: list[str] = []
    seen: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                r = ckpt.restore(source="shm", copy=len(seen) % 2 == 0)
            except NoCheckpoint:
                continue
            seen.append(r.step)
            for n in names:
                if not np.all(r.arrays[n] == r.step):
                    problems.append(f"step {r.step}: {n} holds {np.unique(r.arrays[n])[:3]}")
            del r

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in readers:
        t.start()
    handles = []
    try:
        for step in range(1, 31):
            arrays = {n: np.full(50_000 + 1000 * i, step, np.int32) for i, n in enumerate(names)}
            handles.append(ckpt.save(step, arrays, {"step": step}))
            arrays["v0"][:] = -1  # the caller may reuse its buffers at once
    finally:
        stop.set()
        for t in readers:
            t.join(20)
    assert not problems, problems[:5]
    assert seen
    for h in handles:
        assert h.wait(30)
    assert [h.slot for h in handles[:4]] == ["A", "B", "A", "B"]
    assert ckpt._disk_steps() == [29, 30]
    for step in (29, 30):
        r = ckpt.restore(step, source="disk")
        assert r.meta == {"step": step}
        assert all(np.all(r.arrays[n] == step) for n in names)
    assert ckpt.latest() == Latest(30, "shm")


def test_saves_from_several_threads_are_serialised(ckpt: FlashCheckpointer) -> None:
    handles = []
    lock = threading.Lock()

    def writer(base: int) -> None:
        for i in range(8):
            step = base + i
            h = ckpt.save(step, {"x": np.full(20_000, step, np.int64), "y": np.full(7, -step)}, {})
            with lock:
                handles.append(h)

    ts = [threading.Thread(target=writer, args=(b,)) for b in (100, 200, 300)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert len(handles) == 24 and all(h.wait(30) for h in handles)
    for src in ("shm", "disk"):
        for st, _, _ in ckpt._candidates(src):  # type: ignore[arg-type]
            r = ckpt.restore(st, source=src)  # type: ignore[arg-type]
            assert np.all(r.arrays["x"] == st) and np.all(r.arrays["y"] == -st)
    assert len(ckpt._disk_steps()) == 2


def test_slot_files_are_recycled_unless_a_reader_holds_them(ckpt: FlashCheckpointer) -> None:
    ckpt.save(1, {"x": np.full(1000, 1.0)}, {}).wait(20)
    ckpt.save(2, {"x": np.full(1000, 2.0)}, {}).wait(20)
    inode_a = ckpt.slot_path("A").stat().st_ino
    ckpt.save(3, {"x": np.full(1000, 3.0)}, {}).wait(20)
    assert ckpt.slot_path("A").stat().st_ino == inode_a  # pages reused: memcpy-speed saves
    ckpt.save(4, {"x": np.full(1000, 4.0)}, {}).wait(20)
    held = ckpt.restore(3, copy=False).arrays["x"]  # slot A, mapped
    for s in range(5, 9):  # slot A is reused twice: a fresh file, since a reader holds it
        ckpt.save(s, {"x": np.full(1000, float(s))}, {}).wait(20)
    assert ckpt.slot_path("A").stat().st_ino != inode_a
    assert np.all(held == 3.0)
    assert ckpt.restore().step == 8
    del held
    inode_a = ckpt.slot_path("A").stat().st_ino
    ckpt.save(9, {"x": np.full(1000, 9.0)}, {}).wait(20)
    ckpt.save(10, {"x": np.full(1000, 10.0)}, {}).wait(20)  # reader gone: recycled again
    assert ckpt.slot_path("A").stat().st_ino == inode_a
    assert ckpt.restore().arrays["x"][0] == 10.0


def test_corrupt_disk_data_is_detected_and_previous_used(tmp_path: Path, shm_dir: Path) -> None:
    c = FlashCheckpointer("c", tmp_path / "disk", shm_dir=shm_dir)
    a1, a2 = many_arrays(11), many_arrays(12)
    c.save(1, a1, {}).wait(20)
    c.save(2, a2, {}).wait(20)
    c.cleanup()  # force disk restores
    data = c.ckpt_dir(2) / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[-64 * 20] ^= 0x01  # one bit inside an array
    data.write_bytes(bytes(raw))
    r = c.restore()
    assert (r.step, r.source) == (1, "disk")
    assert_same(a1, r.arrays)
    with pytest.raises(NoCheckpoint, match="CRC"):
        c.restore(2)
    # A damaged manifest is caught by its own checksum.
    man = c.ckpt_dir(1) / "manifest.json"
    man.write_text(man.read_text().replace('"step":1', '"step":2', 1))
    with pytest.raises(NoCheckpoint):
        c.restore()
    c.close()


def test_persist_failure_is_reported(
    ckpt: FlashCheckpointer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(job: object) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "_persist", boom)
    h = ckpt.save(1, {"x": np.ones(4)}, {})
    with pytest.raises(OSError, match="No space"):
        h.wait(20)
    assert h.done and not h.ok
    assert ckpt.restore().step == 1  # the shm copy is still usable
    monkeypatch.undo()
    assert ckpt.save(2, {"x": np.ones(4)}, {}).wait(20)  # the persister lives on


def test_tf_partitioned_variables_roundtrip_into_fresh_graph(ckpt: FlashCheckpointer) -> None:
    tf = pytest.importorskip("tensorflow")
    from pacer.trainer.tfckpt import arrays_to_variables, prepare_snapshot, variables_to_arrays

    tf.compat.v1.disable_eager_execution()

    def build(init: str, snapshot: bool) -> tuple[object, list[object], object, object]:
        g = tf.Graph()
        with g.as_default():
            if init == "random":
                ini = tf.compat.v1.random_uniform_initializer(-1, 1, seed=1)
            else:
                ini = tf.compat.v1.zeros_initializer()
            emb = tf.compat.v1.get_variable(
                "emb", [100, 8], tf.float32, ini, partitioner=tf.compat.v1.fixed_size_partitioner(2)
            )
            w = tf.compat.v1.get_variable("dense/w", [8, 3], tf.float32, ini)
            step = tf.compat.v1.get_variable(
                "global_step", [], tf.int64, tf.compat.v1.zeros_initializer()
            )
            vs = [emb, w, step]
            # A training-like in-place update of every part and of w.
            update = tf.group(*[p.assign_add(tf.ones_like(p)) for p in [*emb, w]])
            init_op = tf.compat.v1.global_variables_initializer()
            if snapshot:
                prepare_snapshot(vs)
        g.finalize()  # neither fetching nor assigning may add ops
        sess = tf.compat.v1.Session(graph=g)
        sess.run(init_op)
        return g, vs, sess, update

    # Source: snapshot (DeepCopy) fetch path.
    g1, vs1, s1, upd1 = build("random", snapshot=True)
    assert sum(op.type == "DeepCopy" for op in g1.get_operations()) == 4  # type: ignore[attr-defined]
    arrays_to_variables(s1, [vs1[2]], {"global_step": np.array(1234, np.int64)})
    arrays = variables_to_arrays(s1, vs1)
    assert sorted(arrays) == ["dense/w", "emb/part_0", "emb/part_1", "global_step"]
    assert arrays["emb/part_0"].shape == (50, 8)
    before = {k: v.copy() for k, v in arrays.items()}
    s1.run(upd1)
    assert_same(before, arrays)  # a snapshot, not a view of the live variables
    ckpt.save(1234, arrays, {}).wait(30)
    ckpt.cleanup()  # restore from disk, into a new graph and session

    # Target: plain fetch path (no snapshot ops on this finalized graph).
    _g2, vs2, s2, upd2 = build("zeros", snapshot=False)
    r = ckpt.restore()
    assert r.source == "disk"
    assert arrays_to_variables(s2, vs2, r.arrays) == list(arrays)
    back = variables_to_arrays(s2, vs2)
    assert_same(arrays, back)
    assert back["global_step"] == 1234
    with pytest.raises(KeyError):
        arrays_to_variables(s2, vs2, {"emb/part_0": arrays["emb/part_0"]})
    with pytest.raises(ValueError):
        arrays_to_variables(s2, vs2, {**arrays, "dense/w": arrays["dense/w"].astype(np.float64)})

    # Zero-copy restore: TF may alias the read-only mapping, and must copy
    # before its first in-place update (the shm checkpoint stays intact).
    ckpt.save(1235, arrays, {}).wait(30)
    zc = ckpt.restore(copy=False)
    assert zc.source == "shm"
    arrays_to_variables(s2, vs2, zc.arrays)
    s2.run(upd2)
    after = variables_to_arrays(s2, vs2)
    np.testing.assert_array_equal(after["dense/w"], arrays["dense/w"] + 1)
    np.testing.assert_array_equal(after["emb/part_1"], arrays["emb/part_1"] + 1)
    assert_same(arrays, ckpt.restore(source="shm").arrays)
    assert_same(arrays, zc.arrays)
    del zc
    s1.close()
    s2.close()


def test_layout_constants_are_stable() -> None:
    # The slot layout is read by other processes (a migrated PS): keep it stable.
    assert (
        flashckpt.MAGIC == b"PACERFC1" and flashckpt.ALIGN == 64 and flashckpt.SLOTS == ("A", "B")
    )
