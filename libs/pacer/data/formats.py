"""Criteo-like rows in the formats users keep their data in: Parquet, CSV/TSV, TFRecord.

``pacer data gen OUT`` writes the generator's rows (:mod:`pacer.data.criteo`)
in the format OUT's name says, so that a demo, a test or a benchmark can
train the same rows from any format: the columns are Criteo's (``label``,
``I1..I13``, ``C1..C26``), dense values float with missing ones empty
(null), categorical values as Criteo's 8-digit hex tokens.  A record file
keeps the categorical values as integers instead; the two give the same
model quality, not the same hash ids.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pacer.data.criteo import CSV_HEADER, NUM_CAT, NUM_DENSE

#: Rows per Parquet row group written here (a row group is the unit a shard read fetches).
ROW_GROUP_ROWS = 65_536
TEXT_FORMATS = {"csv": (",", True), "tsv": ("\t", False)}


def format_of(path: str | os.PathLike[str]) -> str:
    """``parquet``, ``csv``, ``tsv``, ``tfrecord`` or ``record`` from a file name."""
    name = os.fspath(path).lower()
    for fmt, ends in (("parquet", (".parquet", ".pq")), ("csv", (".csv",)), ("tsv", (".tsv", ".txt")),
                      ("tfrecord", (".tfrecord", ".tfrecords", ".tfr"))):
        if name.endswith(ends):
            return fmt
    return "record"


def heldout_name(path: str | os.PathLike[str]) -> str:
    """The held-out split beside ``path``: ``train.parquet`` -> ``train.test.parquet`` (a record
    file: ``train.rec.test``, as :func:`pacer.data.criteo.heldout_path`).  URLs too."""
    return with_suffix_tag(path, "test") if format_of(path) != "record" else f"{os.fspath(path)}.test"


def with_suffix_tag(path: str | os.PathLike[str], tag: str) -> str:
    """``dir/name.ext`` -> ``dir/name.<tag>.ext`` on the text of ``path`` (so URLs keep their ``//``)."""
    text = os.fspath(path)
    head, _, name = text.rpartition("/")
    stem, dot, ext = name.rpartition(".")
    new = f"{stem}.{tag}.{ext}" if dot and stem else f"{name}.{tag}"
    return f"{head}/{new}" if head or text.startswith("/") else new


def criteo_table(records: np.ndarray) -> Any:
    """A pyarrow Table of record-file rows: label int, I1..I13 float (null = missing), C1..C26 hex strings."""
    import pyarrow as pa

    cols: dict[str, Any] = {"label": pa.array(records["label"].astype(np.int32))}
    dense = records["dense"]
    for j in range(NUM_DENSE):
        x = dense[:, j]
        cols[CSV_HEADER[1 + j]] = pa.array(x, mask=np.isnan(x), type=pa.float32())
    cat = records["cat"]
    for j in range(NUM_CAT):
        cols[CSV_HEADER[1 + NUM_DENSE + j]] = pa.array(np.char.mod("%08x", cat[:, j]).astype(object), type=pa.string())
    return pa.table(cols)


def write_criteo(path: str | os.PathLike[str], chunks: Iterable[np.ndarray], fmt: str | None = None) -> int:
    """Write record-file rows (``criteo.RECORD_DTYPE`` chunks) to ``path`` as ``fmt`` (default: from the
    name); returns the row count.  ``path`` may be an fsspec URL (``s3://bucket/key``: credentials from
    the environment).  Written to a temporary name, then renamed (uploaded whole to a URL)."""
    fmt = fmt or format_of(path)
    return _written(path, lambda tmp: _write_as(tmp, chunks, fmt))


def write_table(path: str | os.PathLike[str], table: Any) -> int:
    """Write a pyarrow Table as Parquet to ``path`` (a local path or fsspec URL); returns its rows."""
    import pyarrow.parquet as pq

    def write(tmp: Path) -> int:
        pq.write_table(table, tmp, row_group_size=ROW_GROUP_ROWS)
        return int(table.num_rows)

    return _written(path, write)


def _write_as(tmp: Path, chunks: Iterable[np.ndarray], fmt: str) -> int:
    if fmt == "parquet":
        return _write_parquet(tmp, chunks)
    if fmt in TEXT_FORMATS:
        return _write_text(tmp, chunks, *TEXT_FORMATS[fmt])
    if fmt == "tfrecord":
        return _write_tfrecord(tmp, chunks)
    raise ValueError(f"cannot write {fmt!r} here (record files: pacer.data.criteo.RecordFile.write)")


def _written(path: str | os.PathLike[str], write: Any) -> int:
    """``write(tmp)`` to a local temporary file, then moved to ``path`` (renamed, or uploaded to a URL)."""
    import tempfile

    target = os.fspath(path)
    remote = "://" in target and not target.startswith("file://")
    local = Path(target.removeprefix("file://"))
    tmpdir = tempfile.mkdtemp(prefix="pacer-gen-") if remote else None
    if not remote:
        local.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tmpdir, "part") if tmpdir else local.with_name(f".{local.name}.tmp-{os.getpid()}")
    try:
        rows = int(write(tmp))
        if remote:
            import fsspec

            fs, key = fsspec.core.url_to_fs(target)
            fs.makedirs(key.rsplit("/", 1)[0], exist_ok=True)  # on S3: the bucket, if it is missing
            fs.put_file(str(tmp), key)
        else:
            os.replace(tmp, local)
    finally:
        tmp.unlink(missing_ok=True)
        if tmpdir:
            os.rmdir(tmpdir)
    return rows


def _write_parquet(path: Path, chunks: Iterable[np.ndarray]) -> int:
    import pyarrow.parquet as pq

    writer = None
    rows = 0
    try:
        for chunk in _rechunk(chunks, ROW_GROUP_ROWS):
            table = criteo_table(chunk)
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema)
            writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
            rows += len(chunk)
    finally:
        if writer is not None:
            writer.close()
    return rows


def _write_text(path: Path, chunks: Iterable[np.ndarray], delimiter: str, header: bool) -> int:
    import pyarrow.csv as pacsv

    rows = 0
    with open(path, "wb") as f:
        for i, chunk in enumerate(chunks):
            opts = pacsv.WriteOptions(include_header=header and i == 0, delimiter=delimiter,
                                      quoting_style="none")
            pacsv.write_csv(criteo_table(chunk), f, opts)
            rows += len(chunk)
    return rows


def _write_tfrecord(path: Path, chunks: Iterable[np.ndarray]) -> int:
    from pacer.data.sources import write_tfrecord

    def rows() -> Iterator[dict[str, Any]]:
        for chunk in chunks:
            for row in criteo_table(chunk).to_pylist():
                yield {k: ([] if v is None else [v]) for k, v in row.items()}

    return int(write_tfrecord(path, rows()))


def _rechunk(chunks: Iterable[np.ndarray], size: int) -> Iterator[np.ndarray]:
    """The same rows in chunks of exactly ``size`` (the last may be shorter)."""
    buf: list[np.ndarray] = []
    held = 0
    for c in chunks:
        buf.append(c)
        held += len(c)
        while held >= size:
            allrows = np.concatenate(buf)
            yield allrows[:size]
            rest = allrows[size:]
            buf, held = [rest], len(rest)
    if held:
        yield np.concatenate(buf)


# ------------------------------------------------------------- an ads dataset

#: The columns of :func:`ads_table`, as ``pacer data schema`` would see them.
ADS_TAGS = 64
ADS_DEVICES = ("ios", "android", "web", "tv")


def ads_table(rows: int, seed: int, stream: int = 0) -> Any:
    """A click log unlike Criteo's, with a planted signal: every kind of column a schema can name.

    ``click`` (label), ``price`` (float, log-normal), ``hour`` (int 0-23),
    ``user`` (string, Zipf-like), ``ad`` (int id), ``device`` (string from
    :data:`ADS_DEVICES`), ``tags`` (a list of 0-5 strings), ``weight`` (float).
    The click logit sums a per-user, per-ad, per-device and per-tag effect, a
    price slope and an hour cycle; ``stream`` 1 of the same seed is a held-out
    split with the same signal.
    """
    import pyarrow as pa

    fx = np.random.default_rng([seed, 99])  # the signal: the same for every stream
    users, ads = 5000, 2000
    user_fx, ad_fx = fx.normal(0, 0.8, users), fx.normal(0, 0.8, ads)
    dev_fx, tag_fx = fx.normal(0, 0.5, len(ADS_DEVICES)), fx.normal(0, 0.6, ADS_TAGS)
    rng = np.random.default_rng([seed, stream])
    user = np.minimum(rng.zipf(1.3, rows) - 1, users - 1)
    ad = np.minimum(rng.zipf(1.2, rows) - 1, ads - 1)
    device = rng.integers(0, len(ADS_DEVICES), rows)
    price = rng.lognormal(1.0, 1.0, rows).astype(np.float32)
    hour = rng.integers(0, 24, rows)
    counts = rng.integers(0, 6, rows)
    flat = rng.integers(0, ADS_TAGS, int(counts.sum()))
    splits = np.concatenate([[0], np.cumsum(counts)])
    tag_sum = np.add.reduceat(np.concatenate([tag_fx[flat], [0.0]]), splits[:-1]) * (counts > 0)
    logit = (user_fx[user] + ad_fx[ad] + dev_fx[device] + tag_sum - 0.4 * np.log1p(price)
             + 0.5 * np.sin(hour / 24 * 2 * np.pi) - 1.0)
    click = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int32)
    tags = pa.ListArray.from_arrays(pa.array(splits, pa.int32()),
                                    pa.array(np.char.mod("t%d", flat).astype(object), pa.string()))
    return pa.table({
        "click": click, "price": price, "hour": hour.astype(np.int64),
        "user": pa.array(np.char.mod("u%d", user).astype(object), pa.string()), "ad": ad.astype(np.int64),
        "device": pa.array(np.asarray(ADS_DEVICES, dtype=object)[device], pa.string()),
        "tags": tags, "weight": rng.uniform(0.5, 1.5, rows).astype(np.float32),
    })
