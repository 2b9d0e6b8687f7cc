"""pacer.data.sources on local files (and fsspec's memory://): every format, by row ranges, and its errors."""

from __future__ import annotations

import gzip
import itertools
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pacer.data import sources
from pacer.data.criteo import CSV_HEADER, RecordFile, cat_id, generate
from pacer.data.sources import (
    AccessDenied,
    Column,
    CorruptData,
    MissingData,
    SourceError,
    describe,
    infer_source_format,
    open_source,
    write_tfrecord,
)

N = 1500
SECRET = "tok-SECRET-bytes"  # a value that must never appear in an error message


# ---------------------------------------------------------------- test data


@pytest.fixture(scope="module")
def data() -> dict[str, np.ndarray]:
    """Ground truth: scalar and list columns with missing values, as Source.read returns them."""
    rng = np.random.default_rng(7)
    f = rng.normal(size=N).astype(np.float32)
    f[rng.random(N) < 0.1] = np.nan
    i = rng.integers(-(10**12), 10**12, N)
    s = np.array([f"tok{k}" if k % 11 else "" for k in range(N)], dtype=object)
    lf = _lists([rng.random(k % 4).astype(np.float32) for k in range(N)])
    li = _lists([rng.integers(0, 99, k % 3) for k in range(N)])
    ls = _lists([np.array([f"v{k}", "w"][: k % 3], dtype=object) for k in range(N)])
    return {"f": f, "i": i, "s": s, "lf": lf, "li": li, "ls": ls}


def _lists(items: list[np.ndarray]) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    for k, x in enumerate(items):
        out[k] = x
    return out


def _table(d: Mapping[str, np.ndarray], lo: int, hi: int) -> pa.Table:
    f = d["f"][lo:hi]
    s = d["s"][lo:hi]
    return pa.table({
        "f": pa.array(f, mask=np.isnan(f), type=pa.float32()),
        "i": pa.array(d["i"][lo:hi]),
        "s": pa.array(list(s), mask=s == "", type=pa.string()),
        "lf": pa.array([list(x) for x in d["lf"][lo:hi]], type=pa.list_(pa.float32())),
        "li": pa.array([list(x) for x in d["li"][lo:hi]], type=pa.list_(pa.int64())),
        "ls": pa.array([list(x) for x in d["ls"][lo:hi]], type=pa.list_(pa.string())),
    })


def _example_rows(d: Mapping[str, np.ndarray]) -> Iterator[dict[str, Any]]:
    """Rows for a TFRecord; a missing scalar is an absent feature."""
    for k in range(N):
        row: dict[str, Any] = {}
        if not np.isnan(d["f"][k]):
            row["f"] = float(d["f"][k])
        row["i"] = int(d["i"][k])
        if d["s"][k]:
            row["s"] = d["s"][k]
        row["lf"] = d["lf"][k]
        row["li"] = d["li"][k]
        row["ls"] = list(d["ls"][k])
        yield row


def _write_text(path: Path, d: Mapping[str, np.ndarray], delimiter: str, header: bool, lo: int = 0, hi: int = N) -> None:
    with open(path, "w", newline="") as out:
        if header:
            out.write(delimiter.join(("f", "i", "s")) + "\n")
        for k in range(lo, hi):
            f = "" if np.isnan(d["f"][k]) else repr(float(d["f"][k]))
            out.write(f"{f}{delimiter}{d['i'][k]}{delimiter}{d['s'][k]}\n")


def assert_columns(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype, name
        assert len(g) == len(w), name
        if w.dtype == object and any(isinstance(x, np.ndarray) for x in w):
            for a, b in zip(g, w, strict=True):
                assert a.dtype == b.dtype, name
                np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            np.testing.assert_array_equal(g, w, err_msg=name)


def check_ranges(src: sources.Source, want: Mapping[str, np.ndarray], seed: int = 0, count: int = 40) -> None:
    """Arbitrary [lo, hi) reads equal the same slice of the whole data; so does the whole."""
    rows = len(next(iter(want.values())))
    assert src.rows == rows
    whole = src.read(0, rows)
    assert list(whole) == [c.name for c in src.columns]
    assert_columns({k: whole[k] for k in want}, want)
    every = list(want)
    rng = np.random.default_rng(seed)
    ranges = [(0, 1), (rows - 1, rows), (0, rows + 10), (rows, rows + 5)]
    ranges += [tuple(sorted(rng.integers(0, rows + 1, 2))) for _ in range(count)]
    ranges += [(lo, lo + int(rng.integers(1, 20))) for lo in rng.integers(0, rows, count // 2)]
    for lo, hi in ranges:
        assert_columns(src.read(lo, hi, every), {k: v[lo:hi] for k, v in want.items()})
    names = list(want)[::-2]
    assert_columns(src.read(5, 9, names), {k: want[k][5:9] for k in names})


def _parquet_dir(tmp: Path, d: Mapping[str, np.ndarray], cuts: list[int], row_group: int = 64) -> Path:
    for n, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        part = tmp / f"day={n // 2}" / f"part-{n:03d}.parquet"
        part.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(_table(d, lo, hi), part, row_group_size=row_group)
    return tmp


# -------------------------------------------------------------------- tests


@pytest.mark.parametrize(("uri", "fmt"), [
    ("data/train.parquet", "parquet"), ("s3://b/day=*/part-*.pq", "parquet"), ("x.CSV", "csv"),
    ("x.csv.gz", "csv"), ("a/*.tsv", "tsv"), ("day_0.txt", "tsv"), ("x.tfrecord", "tfrecord"),
    ("x.tfrecords.gz", "tfrecord"), ("x.tfr", "tfrecord"), ("x.rec", "record"), ("x", "record"),
    ("gs://b/data/*.parquet*", "parquet"),
])
def test_infer_source_format(uri: str, fmt: str) -> None:
    assert infer_source_format(uri) == fmt


def test_parquet_many_files_and_row_groups(tmp_path: Path, data: dict[str, np.ndarray]) -> None:
    root = _parquet_dir(tmp_path, data, [0, 100, 100, 613, 1000, N], row_group=64)  # one file is empty
    with open_source(str(root / "day=*/part-*.parquet")) as src:
        assert src.format == "parquet"
        assert len(src.files) == 5 and list(src.files) == sorted(src.files)
        assert src.columns == (Column("f", "float"), Column("i", "int"), Column("s", "string"),
                               Column("lf", "list<float>"), Column("li", "list<int>"), Column("ls", "list<string>"))
        check_ranges(src, data)
    with open_source(root) as whole:  # a directory: the files under it
        assert whole.rows == N and len(whole.files) == 5


def test_parquet_reads_each_row_group_once_for_small_consecutive_reads(tmp_path: Path, data: dict[str, np.ndarray],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    pq.write_table(_table(data, 0, N), tmp_path / "a.parquet", row_group_size=500)
    calls: list[int] = []
    real = pq.ParquetFile.read_row_group

    def counting(self: pq.ParquetFile, i: int, *args: Any, **kwargs: Any) -> pa.Table:
        calls.append(i)
        return real(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    with open_source(tmp_path / "a.parquet") as src:
        for lo in range(0, 600, 10):
            assert_columns(src.read(lo, lo + 10, ["i"]), {"i": data["i"][lo : lo + 10]})
    assert calls == [0, 1]


def test_describe_parquet_reads_footers_only(tmp_path: Path, data: dict[str, np.ndarray],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cuts = list(range(0, 1000, 5))
    for n, lo in enumerate(cuts):
        pq.write_table(_table(data, lo, lo + 5), tmp_path / f"part-{n:04d}.parquet")

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("describe() read data")

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", forbidden)
    monkeypatch.setattr(pq.ParquetFile, "read", forbidden)
    monkeypatch.setattr(pq, "read_table", forbidden)
    with describe(str(tmp_path / "*.parquet")) as src:
        assert len(src.files) == 200
        assert src.rows == 1000
        assert [c.name for c in src.columns] == ["f", "i", "s", "lf", "li", "ls"]


def test_parquet_unsupported_column_type(tmp_path: Path) -> None:
    t = pa.table({"x": [1.0], "when": pa.array([0], type=pa.timestamp("s"))})
    pq.write_table(t, tmp_path / "t.parquet")
    with pytest.raises(SourceError, match=r"column 'when' has unsupported type timestamp"):
        open_source(tmp_path / "t.parquet")


def test_parquet_files_with_other_columns_are_refused(tmp_path: Path) -> None:
    pq.write_table(pa.table({"x": [1.0]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"y": [1.0]}), tmp_path / "b.parquet")
    with pytest.raises(SourceError, match="columns differ"):
        open_source(tmp_path / "*.parquet")


def test_parquet_corrupt_footer(tmp_path: Path, data: dict[str, np.ndarray]) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(_table(data, 0, 100), path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CorruptData, match=r"bad\.parquet: not a Parquet file or its footer is corrupt") as e:
        open_source(path)
    assert e.value.code == "bad_data" and isinstance(e.value, ValueError)
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(CorruptData, match="not a Parquet file"):
        open_source(tmp_path / "empty.parquet")


def test_missing_file_and_empty_glob(tmp_path: Path) -> None:
    with pytest.raises(MissingData, match="no such file or object"):
        open_source(tmp_path / "nope.parquet")
    with pytest.raises(MissingData, match="no file or object matches"):
        open_source(str(tmp_path / "day=*/part-*.parquet"))
    with pytest.raises(MissingData):
        open_source("memory://no-such-bucket/x.csv")


def test_unknown_column_and_bad_range(tmp_path: Path, data: dict[str, np.ndarray]) -> None:
    pq.write_table(_table(data, 0, 10), tmp_path / "a.parquet")
    with open_source(tmp_path / "a.parquet") as src:
        with pytest.raises(SourceError, match="no column 'nope'"):
            src.read(0, 1, ["nope"])
        with pytest.raises(ValueError):
            src.read(5, 4)
        empty = src.read(20, 30)
        assert {k: (v.dtype, len(v)) for k, v in empty.items()} == {
            "f": (np.float32, 0), "i": (np.int64, 0), "s": (object, 0), "lf": (object, 0), "li": (object, 0),
            "ls": (object, 0)}


def _scalars(d: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"f": d["f"], "i": d["i"], "s": d["s"]}


def test_csv_with_header_index_built_once_and_reused(tmp_path: Path, data: dict[str, np.ndarray],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "STRIDE", 64)  # many index entries on a small file
    for n, (lo, hi) in enumerate([(0, 700), (700, 701), (701, N)]):
        _write_text(tmp_path / f"part-{n}.csv", data, ",", True, lo, hi)
    index_dir = tmp_path / "index"
    with open_source(str(tmp_path / "part-*.csv"), index_dir=index_dir) as src:
        assert src.index_built
        assert src.columns == (Column("f", "float"), Column("i", "int"), Column("s", "string"))
        check_ranges(src, _scalars(data))
    assert len(list(index_dir.glob("lines-*.npy"))) == 3
    with open_source(str(tmp_path / "part-*.csv"), index_dir=index_dir) as again:
        assert not again.index_built  # loaded, no scan
        check_ranges(again, _scalars(data), seed=1, count=5)
    # A changed file gets a new index (its size and mtime are in the key).
    _write_text(tmp_path / "part-1.csv", data, ",", True, 700, 702)
    os.utime(tmp_path / "part-1.csv", (1, 1))
    with open_source(str(tmp_path / "part-*.csv"), index_dir=index_dir) as changed:
        assert changed.index_built and changed.rows == N + 1
    assert len(list(index_dir.glob("lines-*.npy"))) == 4


def test_tsv_without_header_needs_names(tmp_path: Path, data: dict[str, np.ndarray],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "STRIDE", 100)
    path = tmp_path / "a.tsv"
    _write_text(path, data, "\t", False)
    with open_source(path, csv_options={"header": False, "names": ["f", "i", "s"]}) as src:
        assert src.format == "tsv"
        check_ranges(src, _scalars(data))
    with pytest.raises(SourceError, match="set csv_options names"):
        open_source(path, csv_options={"header": False})
    with open_source(path, csv_options={"header": False, "names": ["f", "i", "s"], "kinds": {"i": "string"}}) as src:
        assert src.read(0, 2)["i"].tolist() == [str(x) for x in data["i"][:2]]


def test_csv_int_column_with_empty_cells_is_float_and_blank_lines_are_not_rows(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_bytes(b"a,b\r\n1,x\r\n\r\n,y\r\n3,\n\n")
    with open_source(path) as src:
        assert src.columns == (Column("a", "float"), Column("b", "string"))
        got = src.read(0, 10)
    np.testing.assert_array_equal(got["a"], np.array([1, np.nan, 3], dtype=np.float32))
    assert got["b"].tolist() == ["x", "y", ""]


def test_csv_malformed_line_names_file_and_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "STRIDE", 16)
    path = tmp_path / "a.csv"
    lines = ["a,b"] + [f"{k},{SECRET}" for k in range(1200)]
    lines[1057] = f"1057,{SECRET},extra"  # line 1058 of the file (after the lines that kinds are inferred from)
    lines[1080] = f"{SECRET},x"  # line 1081: not an int
    path.write_text("\n".join(lines) + "\n")
    with open_source(path) as src:
        assert src.read(1000, 1050)["a"].tolist() == list(range(1000, 1050))
        with pytest.raises(CorruptData) as e:
            src.read(1040, 1070)
        assert e.value.line == 1058 and e.value.reason == "3 fields, expected 2"
        assert str(e.value).startswith(f"{path}:1058: ")
        with pytest.raises(CorruptData) as e:
            src.read(1075, 1090, ["a"])
        assert e.value.line == 1081 and "column 'a' is not an int" in e.value.reason
        assert SECRET not in str(e.value)
    lines[5] = "5"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CorruptData, match=r"a\.csv:6: 1 fields, expected 2"):  # in the sample: at open
        open_source(path)


def test_gzip_text_is_refused(tmp_path: Path) -> None:
    with gzip.open(tmp_path / "a.csv.gz", "wt") as out:
        out.write("a\n1\n")
    with pytest.raises(SourceError, match="gzip text cannot be read by row ranges; unpack it or use Parquet"):
        open_source(tmp_path / "a.csv.gz")


def _criteo_lines(records: np.ndarray) -> list[list[str]]:
    rows = []
    for r in records:
        dense = ["" if np.isnan(x) else str(int(x)) for x in r["dense"]]
        cats = ["" if c == 0 else f"{c:08x}" for c in r["cat"]]
        rows.append([str(int(r["label"])), *dense, *cats])
    return rows


def _criteo_want(records: np.ndarray) -> dict[str, np.ndarray]:
    want: dict[str, np.ndarray] = {"label": records["label"].astype(np.int64)}
    for j in range(13):
        want[f"I{j + 1}"] = records["dense"][:, j].astype(np.float32)
    for j in range(26):
        want[f"C{j + 1}"] = np.array(["" if c == 0 else f"{c:08x}" for c in records["cat"][:, j]], dtype=object)
    return want


def test_criteo_tsv_and_csv(tmp_path: Path) -> None:
    generate(tmp_path / "r.rec", 300, seed=3)
    with RecordFile.open(tmp_path / "r.rec") as rf:
        records = rf.read(0, 300)
    records["dense"] = np.floor(records["dense"])  # Criteo's dense values are integers
    lines = _criteo_lines(records)
    (tmp_path / "day_0").write_text("".join("\t".join(row) + "\n" for row in lines))
    (tmp_path / "day_0.csv").write_text(",".join(CSV_HEADER) + "\n" + "".join(",".join(row) + "\n" for row in lines))
    want = _criteo_want(records)
    for path, fmt in ((tmp_path / "day_0", "criteo_tsv"), (tmp_path / "day_0.csv", "criteo_csv")):
        with open_source(path, fmt) as src:
            assert [c.name for c in src.columns] == list(CSV_HEADER)
            assert {c.kind for c in src.columns[1:14]} == {"float"} and src.columns[0].kind == "int"
            check_ranges(src, want, count=10)
            assert [cat_id(x) for x in src.read(0, 5, ["C3"])["C3"]] == records["cat"][:5, 2].tolist()
    with pytest.raises(SourceError, match="not Criteo's"):
        _write_text(tmp_path / "other.csv", {"f": np.zeros(1), "i": np.zeros(1, int), "s": np.array(["a"])}, ",", True,
                    0, 1)
        open_source(tmp_path / "other.csv", "criteo_csv")


def test_tfrecord_round_trip_and_index_reuse(tmp_path: Path, data: dict[str, np.ndarray]) -> None:
    write_tfrecord(tmp_path / "a-0.tfrecord", list(_example_rows(data))[:900])
    write_tfrecord(tmp_path / "a-1.tfrecord", list(_example_rows(data))[900:])
    index_dir = tmp_path / "index"
    with open_source(str(tmp_path / "a-*.tfrecord"), index_dir=index_dir) as src:
        assert src.index_built
        # In the order the features first appear: row 0 has no "s".
        assert src.columns == (Column("f", "float"), Column("i", "int"), Column("lf", "list<float>"),
                               Column("li", "list<int>"), Column("ls", "list<string>"), Column("s", "string"))
        check_ranges(src, data)
    with open_source(str(tmp_path / "a-*.tfrecord"), index_dir=index_dir) as again:
        assert not again.index_built
        check_ranges(again, data, seed=2, count=5)


def test_tfrecord_written_by_tensorflow(tmp_path: Path, data: dict[str, np.ndarray]) -> None:
    tf = pytest.importorskip("tensorflow")
    rows = list(_example_rows(data))[:200]

    def feature(v: Any) -> Any:
        values = list(v) if isinstance(v, (list, np.ndarray)) else [v]
        if isinstance(v, float) or (isinstance(v, np.ndarray) and v.dtype.kind == "f"):
            return tf.train.Feature(float_list=tf.train.FloatList(value=values))
        if isinstance(v, int) or (isinstance(v, np.ndarray) and v.dtype.kind == "i"):
            return tf.train.Feature(int64_list=tf.train.Int64List(value=values))
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[str(x).encode() for x in values]))

    with tf.io.TFRecordWriter(str(tmp_path / "tf.tfrecord")) as w:
        for row in rows:
            ex = tf.train.Example(features=tf.train.Features(feature={k: feature(v) for k, v in row.items()}))
            w.write(ex.SerializeToString())
    with open_source(tmp_path / "tf.tfrecord") as src:
        assert {c.name: c.kind for c in src.columns} == {
            "f": "float", "i": "int", "s": "string", "lf": "list<float>", "li": "list<int>", "ls": "list<string>"}
        want = {c.name: data[c.name][:200] for c in src.columns}
        check_ranges(src, want, count=10)
    # And TensorFlow reads (and checksums) what write_tfrecord wrote.
    write_tfrecord(tmp_path / "ours.tfrecord", rows)
    # TensorFlow's own record reader (a plain iterator: other tests may have left eager execution off).
    parsed = [tf.train.Example.FromString(r) for r in tf.compat.v1.io.tf_record_iterator(str(tmp_path / "ours.tfrecord"))]
    assert len(parsed) == 200
    assert list(parsed[3].features.feature["li"].int64_list.value) == data["li"][3].tolist()
    assert parsed[1].features.feature["s"].bytes_list.value == [b"tok1"]


def test_tfrecord_truncated_and_not_a_tfrecord(tmp_path: Path, data: dict[str, np.ndarray]) -> None:
    path = tmp_path / "a.tfrecord"
    write_tfrecord(path, list(_example_rows(data))[:10])
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(CorruptData, match=r"a\.tfrecord: record 9 is truncated"):
        open_source(path)
    (tmp_path / "b.tfrecord").write_bytes(b"not a tfrecord file at all")
    with pytest.raises(CorruptData, match="record 0: bad length checksum"):
        open_source(tmp_path / "b.tfrecord")
    write_tfrecord(tmp_path / "c.tfrecord", [{"a": 1.0}] * 150 + [{"a": [1.0, 2.0]}])  # past the sampled records
    with open_source(tmp_path / "c.tfrecord") as src:
        assert src.columns == (Column("a", "float"),)
        with pytest.raises(CorruptData, match="record 150: feature 'a' has 2 values, expected 1"):
            src.read(100, 151)
    with pytest.raises(ValueError, match="csv_options do not apply"):
        open_source(tmp_path / "c.tfrecord", csv_options={"header": False})


def test_record_files(tmp_path: Path) -> None:
    generate(tmp_path / "a.rec", 700, seed=5)
    generate(tmp_path / "b.rec", 333, seed=6)
    with RecordFile.open(tmp_path / "a.rec") as a, RecordFile.open(tmp_path / "b.rec") as b:
        records = np.concatenate([a.read(0, len(a)), b.read(0, len(b))])
    want: dict[str, np.ndarray] = {"label": records["label"]}
    want |= {f"I{j + 1}": records["dense"][:, j].copy() for j in range(13)}
    want |= {f"C{j + 1}": records["cat"][:, j].astype(np.int64) for j in range(26)}
    with describe(str(tmp_path / "*.rec")) as src:
        assert src.format == "record"
        check_ranges(src, want, count=15)
    (tmp_path / "bad.rec").write_bytes(b"\0" * 100)
    with pytest.raises(CorruptData, match="not a Pacer record file"):
        open_source(tmp_path / "bad.rec")


def test_fsspec_memory_filesystem(data: dict[str, np.ndarray]) -> None:
    """The remote code paths (byte ranges, thread pools, full URLs) on fsspec's in-memory filesystem."""
    fs = fsspec.filesystem("memory")
    root = "memory://pacer-test-sources"
    try:
        for n, (lo, hi) in enumerate([(0, 400), (400, N)]):
            with fs.open(f"{root}/pq/part-{n}.parquet", "wb") as out:
                pq.write_table(_table(data, lo, hi), out, row_group_size=100)
        write_tfrecord(f"{root}/a.tfrecord", _example_rows(data))
        with fs.open(f"{root}/a.csv", "wb") as out:
            out.write(b"f,i,s\n")
            for k in range(N):
                f = "" if np.isnan(data["f"][k]) else repr(float(data["f"][k]))
                out.write(f"{f},{data['i'][k]},{data['s'][k]}\n".encode())
        with open_source(f"{root}/pq/*.parquet") as src:
            assert [f.rsplit("/", 2)[-2:] for f in src.files] == [["pq", "part-0.parquet"], ["pq", "part-1.parquet"]]
            assert all(f.startswith("memory://") for f in src.files)
            check_ranges(src, data, count=10)
        with open_source(f"{root}/a.tfrecord") as src:
            check_ranges(src, data, count=10)
        with open_source(f"{root}/a.csv") as src:
            check_ranges(src, _scalars(data), count=10)
    finally:
        fs.rm(root.removeprefix("memory://"), recursive=True)


def test_error_classes() -> None:
    for cls in (MissingData, AccessDenied, CorruptData):
        e = cls("s3://b/k", "what is wrong")
        assert isinstance(e, SourceError) and isinstance(e, ValueError)
        assert e.code == "bad_data" and e.reason == "what is wrong" and str(e) == "s3://b/k: what is wrong"
