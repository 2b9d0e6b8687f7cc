"""Flash checkpoint vs tf.compat.v1 Saver, in one process, on one graph (DLRover-RM §5.2).

Builds a single-process graph with ``param_mb`` MiB of float32 embedding
tables (4 tables, each partitioned in 2, like a PS-sharded model), then, in
the same run:

* saver_ckpt_save_s: ``Saver(sharded=True).save`` to a temp dir on disk
  (median of ``repeats``, after one untimed warm-up save);
* flash_ckpt_save_s: the flash save's critical path, i.e. the training pause:
  ``variables_to_arrays`` (one sess.run) + ``FlashCheckpointer.save`` (copy into
  a tmpfs slot), median of ``repeats`` after two warm-up saves (one per slot;
  the first save into a slot also allocates its tmpfs pages, reported as
  flash_ckpt_first_save_s);
  flash_ckpt_save_plain_fetch_s is the same with a plain variable fetch
  instead of the DeepCopy snapshot fetch;
* flash_ckpt_persist_s: the background persist (copy to disk + CRC-32 +
  fsync + rename), waited for between saves so timings do not overlap;
* flash_ckpt_restore_shm_s / flash_ckpt_restore_disk_s / saver_restore_s:
  restore into the live variables, end to end.  Before each disk restore the
  checkpoint files are fsynced and evicted from the page cache with
  ``posix_fadvise(DONTNEED)`` (only our own files), so disk means disk.

Note the Saver does not fsync; the flash persist does, in the background.

Usage: python bench/bench_flashckpt.py [--param-mb 256] [--repeats 3]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
from pacer.trainer.flashckpt import FlashCheckpointer

TABLES = 4
DIM = 64
PARTITIONS = 2


def _evict(path: Path) -> None:
    """Write back and drop our own files from the page cache (no global drop_caches)."""
    for p in [path] if path.is_file() else sorted(path.rglob("*")):
        if not p.is_file():
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _digest(arrays: dict[str, np.ndarray]) -> int:
    crc = 0
    for k in sorted(arrays):
        crc = zlib.crc32(np.ascontiguousarray(arrays[k]).tobytes(), crc)
    return crc


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def measure(param_mb: int = 256, repeats: int = 3) -> dict[str, Any]:
    import tensorflow as tf
    from pacer.trainer.tfckpt import arrays_to_variables, prepare_snapshot, variables_to_arrays

    tf.compat.v1.disable_eager_execution()
    rows = param_mb * 2**20 // (TABLES * DIM * 4)
    g = tf.Graph()
    with g.as_default(), tf.compat.v1.device("/cpu:0"):
        for t in range(TABLES):
            tf.compat.v1.get_variable(
                f"emb{t}",
                [rows, DIM],
                tf.float32,
                tf.compat.v1.random_uniform_initializer(-0.05, 0.05),
                partitioner=tf.compat.v1.fixed_size_partitioner(PARTITIONS),
            )
        variables = tf.compat.v1.global_variables()
        init = tf.compat.v1.global_variables_initializer()
        saver = tf.compat.v1.train.Saver(sharded=True, max_to_keep=2)
        prepare_snapshot(variables)  # the DeepCopy fetch ops (see tfckpt's docstring)
    g.finalize()  # nothing below may add ops: saves must not grow the graph
    sess = tf.compat.v1.Session(graph=g)
    sess.run(init)
    total_mb = sum(int(np.prod(v.shape)) * 4 for v in variables) / 2**20

    work = Path(tempfile.mkdtemp(prefix="pacer-bench-flash-"))
    shm_base = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
    shm_dir = shm_base / f"pacer-bench-flash-{uuid.uuid4().hex[:8]}"
    out: dict[str, Any] = {}
    ck: FlashCheckpointer | None = None
    try:
        # Saver and flash are measured alternately, repeat by repeat, so that
        # both see the same background load on this shared machine.
        (work / "saver").mkdir()
        prefix = str(work / "saver" / "model")
        ck = FlashCheckpointer("bench", work / "flash", shm_dir=shm_dir, keep=2)
        saver.save(sess, prefix, global_step=0, write_meta_graph=False)  # warm-up
        first = []
        step = 0
        for _ in range(2):  # warm-up: one save per slot, allocating its tmpfs pages
            step += 1
            t0 = time.perf_counter()
            h = ck.save(step, variables_to_arrays(sess, variables), {"step": step})
            first.append(time.perf_counter() - t0)
            h.wait()

        saver_save: list[float] = []
        fetch: list[float] = []
        copy: list[float] = []
        save: list[float] = []
        persist: list[float] = []
        plain: list[float] = []  # the same critical path with a plain variable fetch
        path = ""
        expect = _digest(variables_to_arrays(sess, variables))
        for i in range(1, repeats + 1):
            t0 = time.perf_counter()
            path = saver.save(sess, prefix, global_step=i, write_meta_graph=False)
            saver_save.append(time.perf_counter() - t0)

            step += 1
            t0 = time.perf_counter()
            arrays = variables_to_arrays(sess, variables)
            t1 = time.perf_counter()
            h = ck.save(step, arrays, {"step": step})
            t2 = time.perf_counter()
            fetch.append(t1 - t0)
            copy.append(t2 - t1)
            save.append(t2 - t0)
            del arrays
            h.wait()
            assert h.persist_s is not None
            persist.append(h.persist_s)

            step += 1
            t0 = time.perf_counter()
            arrays = variables_to_arrays(sess, variables, snapshot=False)
            h = ck.save(step, arrays, {"step": step})
            plain.append(time.perf_counter() - t0)
            del arrays
            h.wait()

        zeros = {v.op.name: np.zeros(v.shape, np.float32) for v in variables}
        saver_restore: list[float] = []
        restore_shm: list[float] = []
        restore_shm_zc: list[float] = []
        restore_disk: list[float] = []
        for _ in range(repeats):
            arrays_to_variables(sess, variables, zeros)  # each restore must bring values back
            _evict(work / "saver")
            t0 = time.perf_counter()
            saver.restore(sess, path)
            saver_restore.append(time.perf_counter() - t0)
            if _digest(variables_to_arrays(sess, variables)) != expect:
                raise AssertionError("Saver restore differs from the saved variables")

            for kind, times in (
                ("shm", restore_shm),
                ("zc", restore_shm_zc),
                ("disk", restore_disk),
            ):
                arrays_to_variables(sess, variables, zeros)
                if kind == "disk":
                    _evict(work / "flash")
                t0 = time.perf_counter()
                if kind == "disk":
                    r = ck.restore(source="disk")
                else:  # zc: zero copy, TF may alias the read-only mapping (see tfckpt)
                    r = ck.restore(source="shm", copy=kind == "shm")
                arrays_to_variables(sess, variables, r.arrays)
                times.append(time.perf_counter() - t0)
                assert r.step == step, (kind, r.step, step)
                del r
                if _digest(variables_to_arrays(sess, variables)) != expect:
                    raise AssertionError(f"flash restore ({kind}) differs from the saved variables")

        out = {
            "param_mb": round(total_mb, 1),
            "variables": len(variables),
            "repeats": repeats,
            "saver_ckpt_save_s": _median(saver_save),
            "flash_ckpt_save_s": _median(save),
            "flash_ckpt_fetch_s": _median(fetch),
            "flash_ckpt_copy_s": _median(copy),
            "flash_ckpt_save_plain_fetch_s": _median(plain),
            "flash_ckpt_first_save_s": round(min(first), 4),
            "flash_ckpt_persist_s": _median(persist),
            "flash_ckpt_restore_shm_s": _median(restore_shm),
            "flash_ckpt_restore_shm_zero_copy_s": _median(restore_shm_zc),
            "flash_ckpt_restore_disk_s": _median(restore_disk),
            "saver_restore_s": _median(saver_restore),
        }
        out["flash_ckpt_speedup"] = round(out["saver_ckpt_save_s"] / out["flash_ckpt_save_s"], 2)
        out["flash_vs_saver_restore_speedup"] = round(
            out["saver_restore_s"] / out["flash_ckpt_restore_shm_s"], 2
        )
    finally:
        sess.close()
        if ck is not None:
            ck.close()
            ck.cleanup()
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--param-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    print(json.dumps(measure(a.param_mb, a.repeats)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
