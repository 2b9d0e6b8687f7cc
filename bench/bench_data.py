"""Data-plane benchmark: readers, the feed's overhead, a mid-shard resume, a huge submit, format parity.

Everything runs the code the services and workers run (``pacer.data.sources``,
``pacer.data.feed``, the models of ``pacer.models``, the job service behind a
real embedded stack) beside a plain baseline, in the same run, so that the
ratios mean something on a shared, noisy machine.  S3 is moto's S3 server on
loopback (no S3-compatible server binary is installable here): its latency
is a loopback HTTP server's, not a region's.

Keys of the JSON line printed last:

``{parquet_local,parquet_s3,csv,tfrecord}_rows_per_s`` and ``baseline_*``
    Pacer: every record of the file read as the workers read them, shard by
    shard (``--shard`` records) in the job's seeded order
    (:func:`pacer.data.feed.read_rows`), all columns.  Baseline: the same
    file read whole by plain pyarrow (``pq.read_table``, ``pyarrow.csv.read_csv``;
    on S3 through s3fs) or, for TFRecord, by ``tf.data.TFRecordDataset`` +
    ``tf.io.parse_example`` in batches of ``--shard``.  Best of ``--repeat``.
``feed_overhead_pct``
    Wide & Deep, batch 256, one process, no PS, so that only the feed
    differs: the worker's own feed (:class:`pacer.trainer.worker.ShardFeed`,
    given consecutive shards of 20 batches at once, reading each ahead over
    the Parquet file, numpy columns fed into the raw-column placeholders) against the same graph built on a ``tf.data`` pipeline over
    the same rows, already in memory (``from_tensor_slices``, the best case
    for tf.data).  Steps/s of each, alternated over ``--pairs`` pairs,
    medians; ``(tf.data / pacer - 1) * 100``.
``resume_mid_shard_s``, ``resume_mid_shard_s3_s``
    A fresh process (a relaunched worker, no warm caches but the OS's)
    opens the dataset and reads the batch at a position in the middle of a
    shard and of a Parquet row group: from before the open to the batch in
    hand (after the interpreter and imports, which a worker pays anyway).
``submit_large_dataset_s``
    ``--large-files`` Parquet files of ``--large-rows`` rows each (>= 10^9
    rows in all; constant columns, so they are small on disk) submitted to a
    real job service, which checks the dataset against the schema and counts
    its rows from the footers, and registers it with the shard service: the
    submit request's wall time.
``auc_parquet_vs_tsv_delta``
    The same generated Criteo rows written as Parquet and as Criteo TSV, one
    epoch of Wide & Deep on each through Pacer's reader with the same seed,
    evaluated on the same held-out rows in the same format: ``|AUC_parquet -
    AUC_tsv|``.

    .venv/bin/python bench/bench_data.py [--rows 200000] [--pairs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
from pacer.data import criteo, formats
from pacer.data.feed import DataRef, read_rows, rows_of, take
from pacer.data.sources import open_source

RESUME = """
import json, sys, time
t0 = time.perf_counter()
from pacer.data.feed import DataRef, read_rows
ref = DataRef.from_json(sys.argv[1])
t1 = time.perf_counter()
src = ref.open()
cols = read_rows(src, int(sys.argv[2]), int(sys.argv[2]) + 256, None, ref.seed)
t2 = time.perf_counter()
print(json.dumps({"imports_s": t1 - t0, "resume_s": t2 - t1, "rows": len(next(iter(cols.values())))}))
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def best(fn: Callable[[], int], repeat: int) -> float:
    """Rows per second of the fastest of ``repeat`` runs of ``fn`` (which returns the rows it read)."""
    rates = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        n = fn()
        rates.append(n / (time.perf_counter() - t0))
    return max(rates)


# ------------------------------------------------------------------ S3 on loopback


@contextlib.contextmanager
def moto_s3() -> Iterator[dict[str, str]]:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ------------------------------------------------------------------ readers


def pacer_read_all(uri: str, fmt: str, shard: int, index_dir: str | None = None) -> int:
    n = 0
    with open_source(uri, fmt, index_dir=index_dir) as src:
        for lo in range(0, src.rows, shard):
            n += rows_of(read_rows(src, lo, lo + shard, None, seed=1))
    return n


def readers(d: Path, args: argparse.Namespace, s3_url: str) -> dict[str, float]:
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    out: dict[str, float] = {}
    pq_path, csv_path, tfr_path = d / "train.parquet", d / "train.csv", d / "train.tfrecord"
    out["parquet_local_rows_per_s"] = best(lambda: pacer_read_all(str(pq_path), "parquet", args.shard), args.repeat)
    out["baseline_parquet_local_rows_per_s"] = best(lambda: pq.read_table(pq_path).num_rows, args.repeat)

    import s3fs

    fs = s3fs.S3FileSystem()
    out["parquet_s3_rows_per_s"] = best(lambda: pacer_read_all(s3_url, "parquet", args.shard), args.repeat)
    out["baseline_parquet_s3_rows_per_s"] = best(
        lambda: pq.read_table(s3_url.removeprefix("s3://"), filesystem=fs).num_rows, args.repeat)

    idx = str(d / "index")
    pacer_read_all(str(csv_path), "criteo_csv", args.shard, idx)  # the index, built once (as at submit)
    out["csv_rows_per_s"] = best(lambda: pacer_read_all(str(csv_path), "criteo_csv", args.shard, idx), args.repeat)
    out["baseline_csv_rows_per_s"] = best(lambda: pacer_csv_baseline(pacsv, csv_path), args.repeat)

    pacer_read_all(str(tfr_path), "tfrecord", args.shard, idx)
    out["tfrecord_rows_per_s"] = best(lambda: pacer_read_all(str(tfr_path), "tfrecord", args.shard, idx), args.repeat)
    out["baseline_tfrecord_rows_per_s"] = best(lambda: tfdata_tfrecord(tfr_path, args.shard), args.repeat)
    return out


def pacer_csv_baseline(pacsv: Any, path: Path) -> int:
    return int(pacsv.read_csv(path).num_rows)


def tfdata_tfrecord(path: Path, batch: int) -> int:
    import tensorflow as tf

    spec: dict[str, Any] = {"label": tf.io.VarLenFeature(tf.int64)}
    spec |= {f"I{i}": tf.io.VarLenFeature(tf.float32) for i in range(1, 14)}
    spec |= {f"C{i}": tf.io.VarLenFeature(tf.string) for i in range(1, 27)}
    ds = tf.data.TFRecordDataset(str(path)).batch(batch).map(lambda x: tf.io.parse_example(x, spec))
    n = 0
    for b in ds.prefetch(2):
        n += int(b["label"].dense_shape[0])
    return n


# ------------------------------------------------------------------ the feed


def feed_overhead(pq_path: Path, args: argparse.Namespace) -> dict[str, float]:
    import tensorflow as tf
    from pacer.data.schema import Schema
    from pacer.models.common import ModelSpec, session_config
    from pacer.models.registry import build
    from pacer.trainer.worker import ShardFeed

    v1 = tf.compat.v1
    spec = ModelSpec(name="wide_deep", hash_buckets=args.hash_buckets)
    schema = Schema.criteo().with_defaults(spec.hash_buckets, spec.embed_dim)
    src = open_source(str(pq_path), "parquet")
    kinds = {c.name: c.kind for c in src.columns}
    names = list(schema.columns())
    steps = args.steps

    def pacer_run() -> float:
        with tf.Graph().as_default():
            raw, _, op = w_and_d(schema, kinds, spec)
            with v1.Session(config=session_config(1)) as sess:
                sess.run([v1.global_variables_initializer(), v1.tables_initializer()])
                feed = ShardFeed(Leases(src.rows, args.batch * 20), src, names, seed=1)  # the worker's feed
                t0 = 0.0
                for done in range(steps + 5):
                    if done == 5:
                        t0 = time.perf_counter()  # after warm-up
                    sess.run(op, raw.feed(feed.batch(args.batch)))
                    feed.commit(report_progress=False)
                feed.close()
                return steps / (time.perf_counter() - t0)

    cols = read_rows(src, 0, src.rows, names, None)

    def tfdata_run() -> float:
        with tf.Graph().as_default():
            v1.set_random_seed(1)
            ds = tf.data.Dataset.from_tensor_slices(_tf_columns(cols)).repeat().batch(args.batch).prefetch(2)
            it = v1.data.make_one_shot_iterator(ds).get_next()
            model = build(spec, schema, it)  # the same model on the iterator's columns
            op = model.train_op()
            with v1.Session(config=session_config(1)) as sess:
                sess.run([v1.global_variables_initializer(), v1.tables_initializer()])
                for _ in range(5):
                    sess.run(op)
                t0 = time.perf_counter()
                for _ in range(steps):
                    sess.run(op)
                return steps / (time.perf_counter() - t0)

    pac, base = [], []
    for i in range(args.pairs):
        for name, fn, acc in (("pacer", pacer_run, pac), ("tf.data", tfdata_run, base))[::1 if i % 2 == 0 else -1]:
            acc.append(fn())
            log(f"feed: {name} {acc[-1]:.1f} steps/s")
    p, b = statistics.median(pac), statistics.median(base)
    return {"steps_per_s_pacer_feed": round(p, 1), "steps_per_s_tfdata": round(b, 1),
            "feed_overhead_pct": round((b / p - 1) * 100, 2)}


class Lease:
    def __init__(self, shard: int, start: int, end: int) -> None:
        self.shard, self.start, self.end, self.offset = shard, start, end, 0


class Leases:
    """Consecutive shards over and over, handed out at once (the shard service's part is not measured
    here: ``make bench-trainer``'s ``shard_feed_overhead_pct`` is)."""

    def __init__(self, rows: int, size: int) -> None:
        self.rows, self.size, self.k, self.back = rows, size, 0, []  # type: ignore[var-annotated]

    def next(self, wait: bool = True) -> Lease:
        if self.back:
            return self.back.pop()  # type: ignore[no-any-return]
        lo = (self.k * self.size) % (self.rows - self.size)
        self.k += 1
        return Lease(self.k, lo, lo + self.size)

    def put_back(self, lease: Lease) -> None:
        self.back.append(lease)

    def end_of(self, lease: Lease) -> int:
        return lease.end

    def progress(self, lease: Lease, end: int) -> None:
        pass

    def done(self, lease: Lease) -> None:
        pass

    def trained(self, n: int) -> None:
        pass

    def report_soon(self) -> None:
        pass


def w_and_d(schema: Any, kinds: dict[str, str], spec: Any) -> tuple[Any, Any, Any]:
    """In the current graph, seeded: the raw-column placeholders, the model and its train op."""
    import tensorflow as tf
    from pacer.models.features import raw_inputs
    from pacer.models.registry import build

    tf.compat.v1.set_random_seed(1)
    raw = raw_inputs(schema, kinds)
    model = build(spec, schema, raw.tensors)
    return raw, model, model.train_op()


def _tf_columns(cols: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: (v.astype(str) if v.dtype == object else v) for k, v in cols.items()}


# ------------------------------------------------------------------ resume, submit, parity


def resume(ref: DataRef, pos: int, env: dict[str, str]) -> float:
    times = []
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", RESUME, ref.to_json(), str(pos)], capture_output=True,
                             text=True, env={**os.environ, **env}, check=True)
        times.append(json.loads(out.stdout.strip().splitlines()[-1])["resume_s"])
    return round(statistics.median(times), 3)


def submit_large(d: Path, args: argparse.Namespace) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pacer.jobs.client import JobClient
    from pacer_services.cli.stack import Stack

    big = d / "big"
    big.mkdir()
    n = args.large_rows
    table = pa.table({"label": pa.array(np.zeros(n, np.int8)), "x": pa.array(np.ones(n, np.float32)),
                      "c": pa.array(np.full(n, "a", dtype=object), pa.string())})
    pq.write_table(table, big / "part-00000.parquet", row_group_size=1 << 20)
    for k in range(1, args.large_files):
        shutil.copyfile(big / "part-00000.parquet", big / f"part-{k:05d}.parquet")
    rows = n * args.large_files
    spec = (f"name: big\nmodel: wide_deep\nbatch_size: 65536\npolicies: {{optimizer: default}}\n"
            f"dataset:\n  path: {big}/part-*.parquet\n  schema: {{label: label, dense: [x], categorical: [c]}}\n")
    st = Stack(d / "stack", services=["shard", "jobs"], env={"PACER_DATA_ROOTS": str(d)})
    st.start()
    try:
        async def go() -> float:
            from pacer.bus import Bus

            bus = await Bus.connect(st.url, name="bench-data")
            try:
                t0 = time.perf_counter()
                rec = await JobClient(bus, timeout=120.0).submit("big", spec)
                took = time.perf_counter() - t0
                assert rec.records == rows, (rec.records, rows)
                return took
            finally:
                await bus.close()

        took = asyncio.run(go())
    finally:
        st.stop()
    return {"submit_large_dataset_s": round(took, 2), "submit_large_dataset_rows": rows,
            "submit_large_dataset_files": args.large_files}


def auc_parity(d: Path, args: argparse.Namespace) -> dict[str, float]:
    import tensorflow as tf
    from pacer.data.schema import Schema
    from pacer.models.common import ModelSpec, session_config
    from pacer.models.metrics import auc

    v1 = tf.compat.v1
    spec = ModelSpec(name="wide_deep", hash_buckets=args.hash_buckets)
    schema = Schema.criteo().with_defaults(spec.hash_buckets, spec.embed_dim)
    out = {}
    for fmt, train, test in (("parquet", d / "train.parquet", d / "test.parquet"),
                             ("criteo_tsv", d / "train.tsv", d / "test.tsv")):
        with open_source(str(train), fmt, index_dir=str(d / "index")) as src, \
                open_source(str(test), fmt, index_dir=str(d / "index")) as tst:
            kinds = {c.name: c.kind for c in src.columns}
            with tf.Graph().as_default():
                raw, model, op = w_and_d(schema, kinds, spec)
                with v1.Session(config=session_config(2)) as sess:
                    sess.run([v1.global_variables_initializer(), v1.tables_initializer()])
                    for lo in range(0, src.rows, args.batch):
                        sess.run(op, raw.feed(read_rows(src, lo, lo + args.batch, None, seed=1)))
                    cols = tst.read(0, tst.rows)
                    probs = np.concatenate([sess.run(model.probs, raw.feed(take(cols, s, s + 8192)))
                                            for s in range(0, tst.rows, 8192)])
                    out[fmt] = float(auc(np.asarray(cols["label"], np.float32), probs))
        log(f"auc {fmt}: {out[fmt]:.4f}")
    return {"auc_parquet": round(out["parquet"], 4), "auc_tsv": round(out["criteo_tsv"], 4),
            "auc_parquet_vs_tsv_delta": round(abs(out["parquet"] - out["criteo_tsv"]), 4)}


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--tfrecord-rows", type=int, default=50_000)
    p.add_argument("--test-rows", type=int, default=20_000)
    p.add_argument("--shard", type=int, default=5120)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--hash-buckets", type=int, default=100_000)
    p.add_argument("--large-files", type=int, default=200)
    p.add_argument("--large-rows", type=int, default=5_000_000)
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="pacer-bench-data-") as tmp, moto_s3() as s3env:
        d = Path(tmp)
        t0 = time.perf_counter()
        gen = criteo.CriteoLikeGenerator(1)
        rows = np.concatenate(list(gen.chunks(args.rows, 0)))
        test = np.concatenate(list(gen.chunks(args.test_rows, 1)))
        formats.write_criteo(d / "train.parquet", [rows])
        formats.write_criteo(d / "train.csv", [rows])
        formats.write_criteo(d / "train.tsv", [rows])
        formats.write_criteo(d / "train.tfrecord", [rows[:args.tfrecord_rows]])
        formats.write_criteo(d / "test.parquet", [test])
        formats.write_criteo(d / "test.tsv", [test])
        s3_url = "s3://pacer-bench/clicks/train.parquet"
        formats.write_criteo(s3_url, [rows])
        log(f"data written in {time.perf_counter() - t0:.1f}s")
        result: dict[str, Any] = {"rows": args.rows, "tfrecord_rows": args.tfrecord_rows, "shard": args.shard}
        result |= readers(d, args, s3_url)
        log(json.dumps(result))
        result |= feed_overhead(d / "train.parquet", args)
        # A position inside a row group (65,536 rows) and a shard: the batch a relaunched worker reads first.
        mid = min(65_536 + 5120 * 3 + 777, args.rows - 300)
        result["resume_mid_shard_s"] = resume(DataRef(str(d / "train.parquet"), "parquet", seed=1), mid, {})
        result["resume_mid_shard_s3_s"] = resume(DataRef(s3_url, "parquet", seed=1), mid, s3env)
        result |= auc_parity(d, args)
        result |= submit_large(d, args)
        for k, v in list(result.items()):
            if k.startswith("baseline_") and result.get(k.removeprefix("baseline_")):
                result[f"ratio_{k.removeprefix('baseline_')}"] = round(result[k.removeprefix("baseline_")] / v, 3)
            if isinstance(v, float) and k.endswith("rows_per_s"):
                result[k] = round(v)
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
