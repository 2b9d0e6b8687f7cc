"""pacer.data.sources against an S3 server on loopback (moto's server mode): globs, ranges, indexes, errors."""

from __future__ import annotations

import io
import itertools
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pacer.data.criteo import RecordFile, generate
from pacer.data.sources import AccessDenied, MissingData, open_source, write_tfrecord
from s3_server import S3Server, s3  # noqa: F401

N = 1200


@pytest.fixture(scope="module")
def truth() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    x = rng.normal(size=N).astype(np.float32)
    x[::17] = np.nan
    return {
        "x": x,
        "k": rng.integers(0, 1 << 40, N),
        "s": np.array([f"id{j}" if j % 5 else "" for j in range(N)], dtype=object),
    }


def _table(d: dict[str, np.ndarray], lo: int, hi: int) -> pa.Table:
    x = d["x"][lo:hi]
    return pa.table({"x": pa.array(x, mask=np.isnan(x)), "k": d["k"][lo:hi], "s": list(d["s"][lo:hi])})


def _assert_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray], lo: int, hi: int) -> None:
    assert list(got) == list(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype
        np.testing.assert_array_equal(got[name], w[lo:hi], err_msg=f"{name} [{lo}, {hi})")


def _ranges(rows: int, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return [(0, rows), (rows - 3, rows + 3), *(tuple(sorted(map(int, rng.integers(0, rows + 1, 2)))) for _ in range(25))]


@pytest.fixture(scope="module")
def parquet_glob(s3: S3Server, truth: dict[str, np.ndarray]) -> str:  # noqa: F811
    bucket = s3.bucket("pacer-parquet")
    cuts = [0, 150, 400, 401, 777, 1000, N]
    for n, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        buf = io.BytesIO()
        pq.write_table(_table(truth, lo, hi), buf, row_group_size=50)
        s3.fs.pipe(f"pacer-parquet/day={n // 2}/part-{n:03d}.parquet", buf.getvalue())
    s3.fs.pipe("pacer-parquet/day=0/_SUCCESS", b"")  # not matched by the glob
    return f"{bucket}/day=*/part-*.parquet"


def test_parquet_glob_read_by_ranges(parquet_glob: str, truth: dict[str, np.ndarray]) -> None:
    with open_source(parquet_glob) as src:
        assert src.format == "parquet" and src.rows == N
        assert src.files == tuple(f"s3://pacer-parquet/day={n // 2}/part-{n:03d}.parquet" for n in range(6))
        for lo, hi in _ranges(N, seed=1):
            _assert_equal(src.read(lo, hi), truth, lo, min(hi, N))


def test_resume_mid_row_group_in_a_fresh_source(parquet_glob: str, truth: dict[str, np.ndarray]) -> None:
    """A relaunched worker opens the dataset anew and resumes its shard in the middle of a row group."""
    with open_source(parquet_glob) as first:
        before = first.read(400, 437)
    with open_source(parquet_glob, storage_options={"skip_instance_cache": True}) as relaunched:
        after = relaunched.read(437, 437 + 91)  # 437: row 36 of a 50-row group; crosses into the next file
    _assert_equal(before, truth, 400, 437)
    _assert_equal(after, truth, 437, 528)


def test_csv_and_tfrecord_with_a_local_index_dir(s3: S3Server, truth: dict[str, np.ndarray],  # noqa: F811
                                                  tmp_path: Path) -> None:
    bucket = s3.bucket("pacer-text")
    lines = ["x,k,s"] + [f"{'' if np.isnan(x) else repr(float(x))},{k},{s}" for x, k, s in
                         zip(truth["x"], truth["k"], truth["s"], strict=True)]
    s3.fs.pipe("pacer-text/a.csv", ("\n".join(lines) + "\n").encode())
    rows = [{"x": float(x), "k": int(k), "s": str(s)} for x, k, s in zip(truth["x"], truth["k"], truth["s"], strict=True)]
    write_tfrecord(f"{bucket}/a.tfrecord", rows)
    index_dir = tmp_path / "index"
    for name in ("a.csv", "a.tfrecord"):
        with open_source(f"{bucket}/{name}", index_dir=index_dir) as src:
            assert src.index_built and src.rows == N
            assert [c.kind for c in src.columns] == ["float", "int", "string"]
            for lo, hi in _ranges(N, seed=2):
                _assert_equal(src.read(lo, hi), truth, lo, min(hi, N))
        with open_source(f"{bucket}/{name}", index_dir=index_dir) as again:
            assert not again.index_built  # the index of the same object (same ETag) is re-used
            _assert_equal(again.read(1000, 1100), truth, 1000, 1100)
    assert sorted(p.name.split("-")[0] for p in index_dir.iterdir()) == ["lines", "tfrecord"]


def test_record_file_by_byte_ranges(s3: S3Server, tmp_path: Path) -> None:  # noqa: F811
    bucket = s3.bucket("pacer-records")
    generate(tmp_path / "a.rec", 500, seed=4)
    s3.fs.put_file(str(tmp_path / "a.rec"), "pacer-records/a.rec")
    with RecordFile.open(tmp_path / "a.rec") as rf:
        records = rf.read(0, 500)
    with open_source(f"{bucket}/a.rec") as src:
        assert src.format == "record" and src.rows == 500
        got = src.read(123, 321, ["label", "I4", "C26"])
    np.testing.assert_array_equal(got["label"], records["label"][123:321])
    np.testing.assert_array_equal(got["I4"], records["dense"][123:321, 3])
    np.testing.assert_array_equal(got["C26"], records["cat"][123:321, 25].astype(np.int64))


def test_missing_objects(s3: S3Server) -> None:  # noqa: F811
    bucket = s3.bucket("pacer-empty")
    with pytest.raises(MissingData, match=r"pacer-empty/nope\.parquet: no such file or object"):
        open_source(f"{bucket}/nope.parquet")
    with pytest.raises(MissingData, match="no file or object matches"):
        open_source(f"{bucket}/day=*/part-*.parquet")
    with pytest.raises(MissingData):
        open_source("s3://pacer-no-such-bucket/x.csv")


def test_access_denied(s3: S3Server, parquet_glob: str) -> None:  # noqa: F811
    """With IAM checks on, moto refuses the environment's keys (unknown to its IAM): InvalidAccessKeyId."""
    src = open_source(parquet_glob, storage_options={"skip_instance_cache": True})
    try:
        with s3.enforcing_auth():
            with pytest.raises(AccessDenied, match="access denied") as opening:
                open_source(parquet_glob, storage_options={"skip_instance_cache": True})
            with pytest.raises(AccessDenied) as reading:  # an open source whose credentials stop working
                src.read(900, 1000)
        for e in (opening.value, reading.value):
            assert os.environ["AWS_SECRET_ACCESS_KEY"] not in str(e)
            assert os.environ["AWS_ACCESS_KEY_ID"] not in str(e)
    finally:
        src.close()
    with open_source(parquet_glob, storage_options={"skip_instance_cache": True}) as ok:  # auth off again
        assert ok.rows == N
