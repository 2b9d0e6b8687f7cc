"""Datasets read in place: a global row range ``[lo, hi)`` -> column arrays, never a copy of the data.

A *source* is one file or a glob of files (``day=*/part-*.parquet``), local or
on any fsspec filesystem (``s3://``, ``gs://``, ``hdfs://``, ``memory://``).
The files are taken in sorted order and their rows numbered globally, so a
shard ``(offset, length)`` of the shard service is a row range here, and a
relaunched worker reads exactly the rows its predecessor would have.
:meth:`Source.read` fetches only the bytes that hold the asked rows:

* **parquet**: row counts and schema come from the footers alone (read in
  parallel for remote URLs).  A read finds the row groups by bisecting the
  cumulative counts and reads only those (and only the asked columns); the
  last row group read is kept, so that consecutive small reads of one row
  group fetch it once.
* **csv / tsv / criteo_tsv / criteo_csv**: a *line index*, built by one
  sequential scan, holds the byte offset (and the 1-based line number) of
  every :data:`STRIDE`-th data line; a read fetches the bytes from the
  indexed line at or before ``lo`` to the one at or after ``hi`` and parses
  them with ``pyarrow.csv`` with fixed column types.  Blank lines are not
  rows; a newline inside a quoted value is not supported (it would be taken
  for a row boundary).  Gzipped text cannot be seeked and is refused.
* **tfrecord** of ``tf.train.Example``: an index holds the offset of every
  record, built by one scan of the TFRecord framing (the length checksum is
  verified, so a file that is not a TFRecord is caught; the data checksum is
  not).  Examples are decoded by the small protobuf wire-format decoder below,
  without TensorFlow (services import this module).
* **record**: Pacer's record files (:class:`pacer.data.criteo.RecordFile`):
  fixed-width records, located by arithmetic; memory-mapped when local, read
  by byte range otherwise.

Where indexes go: with ``index_dir`` (a local directory) each file's index is
a small ``.npy`` named by :func:`index_key`, a hash of the file's URL, size
and mtime/ETag (and of the parsing options), so a changed file gets a new
index and a stale one is never used.  Workers that share ``index_dir`` (a
volume, or the same node) re-use an index built once; a worker without it
rebuilds the index in memory by one scan of its files.  Only offsets are
stored, never data.

Kinds and arrays: ``float`` -> float32 (missing: NaN), ``int`` -> int64
(missing: 0), ``string`` -> object array of str (missing: ""), ``list<k>`` ->
object array of 1-D arrays of kind ``k`` (missing: empty), the kinds of
:mod:`pacer.data.schema`.

Locations and credentials: ``fsspec.core.url_to_fs(uri, **storage_options)``;
credentials and endpoints come from the environment only (``AWS_*`` for
S3), ``storage_options`` carries non-secret options and is never logged.
Errors are :class:`SourceError`\\ s whose messages name the file and say what
is wrong, never quoting the data's bytes or a credential.

Concurrency: a :class:`Source` serializes its reads with a lock (it caches
open files and the last row group); use one per thread for parallel reads.
"""

from __future__ import annotations

import bisect
import contextlib
import csv
import hashlib
import os
import struct
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from pacer.data.criteo import _HEADER as _RECORD_HEADER  # the record file's header layout
from pacer.data.criteo import (
    CSV_HEADER,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    NUM_CAT,
    NUM_DENSE,
    RECORD_DTYPE,
    BadRecordFile,
    DataError,
    RecordFile,
)

FORMATS = ("parquet", "csv", "tsv", "tfrecord", "record", "criteo_tsv", "criteo_csv")
KINDS = ("float", "int", "string", "list<float>", "list<int>", "list<string>")

#: Every STRIDE-th data line of a text file is indexed: a read parses at most
#: 2 * STRIDE lines it does not need, and the index is ~1/STRIDE of the lines.
STRIDE = 4096
#: How many data lines the kinds of a CSV's columns are inferred from.
SAMPLE_LINES = 1000
#: How many records the kinds of a TFRecord's features are inferred from.
SAMPLE_RECORDS = 100

_SCAN_BYTES = 16 << 20  # the read size of an index scan
_OPEN_FILES = 8  # Parquet files kept open per source
_REMOTE_THREADS = 16  # footers / index scans fetched in parallel from object storage
_INDEX_VERSION = 1

T = TypeVar("T")


# --------------------------------------------------------------------- errors


class SourceError(DataError):
    """A dataset cannot be opened or read; ``reason`` says why without quoting its bytes."""

    def __init__(self, path: str, reason: str, *, line: int | None = None):
        where = path if line is None else f"{path}:{line}"
        super().__init__(f"{where}: {reason}")
        self.path = path
        self.reason = reason
        self.line = line


class MissingData(SourceError):
    """No such file or object, or a glob (or directory) that matches nothing."""


class AccessDenied(SourceError):
    """The storage refused: a permission error, an S3 403, bad or missing credentials."""


class CorruptData(SourceError):
    """The bytes are not what the format says: a Parquet footer, a truncated TFRecord, a bad record
    file, a CSV line that does not parse (``line`` is its 1-based number)."""


# -------------------------------------------------------------------- columns


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    kind: str  # one of KINDS


def _empty(kind: str) -> np.ndarray:
    dtype = {"float": np.float32, "int": np.int64}.get(kind, object)
    return np.empty(0, dtype=dtype)


def _object_array(items: Sequence[Any]) -> np.ndarray:
    # Filled one by one: np.array(list_of_equal_length_arrays) would build a 2-D array.
    out = np.empty(len(items), dtype=object)
    for i, x in enumerate(items):
        out[i] = x
    return out


def _split_lists(flat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return _object_array(np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else [])


# ------------------------------------------------------------------ locations


@dataclass(frozen=True, slots=True)
class _File:
    path: str  # the filesystem's path (no protocol)
    url: str  # what Source.files shows: a local path or a full URL
    size: int
    version: str  # mtime or ETag: part of an index key


@contextlib.contextmanager
def _storage_errors(where: str) -> Iterator[None]:
    """Storage exceptions -> SourceErrors; their text (which may quote a server's reply) is dropped."""
    try:
        yield
    except SourceError:
        raise
    except FileNotFoundError:
        raise MissingData(where, "no such file or object") from None
    except PermissionError as e:
        raise AccessDenied(where, f"access denied ({_error_code(e)}): check the credentials in the environment and the bucket's policy") from None
    except Exception as e:
        if type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
            raise AccessDenied(where, "access denied: no credentials found in the environment") from None
        raise


def _error_code(e: BaseException) -> str:
    # s3fs chains the botocore ClientError; its error code (not its message) is safe to show.
    cause = e.__cause__ or e.__context__
    response = getattr(cause, "response", None)
    if isinstance(response, Mapping):
        code = response.get("Error", {}).get("Code")
        if code:
            return str(code)
    return type(e).__name__


def _is_local(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def _has_magic(path: str) -> bool:
    return any(c in path for c in "*?[")


def _file_of(fs: Any, path: str, info: Mapping[str, Any]) -> _File:
    url = path if _is_local(fs) else fs.unstrip_protocol(path)
    version = info.get("ETag") or info.get("mtime") or info.get("LastModified") or info.get("created") or ""
    return _File(path, url, int(info.get("size") or 0), str(version))


def _visible(path: str) -> bool:
    # Spark and Hive put _SUCCESS, _metadata and .crc files beside the data.
    return not path.rstrip("/").rsplit("/", 1)[-1].startswith(("_", "."))


def _resolve(uri: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, list[_File]]:
    """The filesystem and the sorted files of ``uri`` (a file, a glob, or a directory of files)."""
    import fsspec

    with _storage_errors(uri):
        fs, path = fsspec.core.url_to_fs(uri, **dict(storage_options or {}))
        if _has_magic(path):
            infos = fs.glob(path, detail=True)
        else:
            info = fs.info(path)
            infos = {path: info} if info["type"] != "directory" else fs.find(path, detail=True)
            infos = {p: i for p, i in infos.items() if p == path or _visible(p)}
        files = [_file_of(fs, p, i) for p, i in sorted(infos.items()) if i.get("type") != "directory"]
    if not files:
        raise MissingData(uri, "no file or object matches")
    return fs, files


def _parallel(fs: Any, fn: Callable[[_File], T], files: Sequence[_File]) -> list[T]:
    """``fn`` over ``files``: in a small thread pool on object storage, where each call waits on the network."""
    if _is_local(fs) or len(files) < 2:
        return [fn(f) for f in files]
    with ThreadPoolExecutor(min(_REMOTE_THREADS, len(files)), thread_name_prefix="pacer-source") as pool:
        return list(pool.map(fn, files))


def _read_range(fs: Any, f: _File, start: int, end: int) -> bytes:
    with _storage_errors(f.url):
        data = fs.cat_file(f.path, start=start, end=end)
    if len(data) != end - start:
        raise CorruptData(f.url, f"file changed or truncated: expected bytes {start}..{end}, got {len(data)}")
    return bytes(data)


def _refuse_gzip(fmt: str, files: Sequence[_File]) -> None:
    for f in files:
        if f.path.endswith(".gz"):
            what = "gzip text" if fmt != "tfrecord" else "a gzipped TFRecord"
            raise SourceError(f.url, f"{what} cannot be read by row ranges; unpack it or use Parquet")


# -------------------------------------------------------------------- indexes


def index_key(kind: str, f: _File, params: str = "") -> str:
    """The file name of ``f``'s index: its kind and a hash of the URL, size, version and parse options."""
    h = hashlib.sha256("\0".join((str(_INDEX_VERSION), kind, f.url, str(f.size), f.version, params)).encode())
    return f"{kind}-{h.hexdigest()[:40]}.npy"


class _IndexStore:
    """Indexes as ``.npy`` files under ``index_dir`` (written atomically), or nowhere (built each open)."""

    def __init__(self, index_dir: str | os.PathLike[str] | None):
        self.dir = Path(index_dir) if index_dir is not None else None

    def get(self, key: str, build: Callable[[], np.ndarray]) -> tuple[np.ndarray, bool]:
        """The index named ``key``, and whether it was built (a scan) rather than loaded."""
        path = self.dir / key if self.dir is not None else None
        if path is not None:
            with contextlib.suppress(OSError, ValueError):  # missing or damaged: rebuild it
                return np.asarray(np.load(path, allow_pickle=False), dtype=np.int64), False
        index = build()
        if path is not None:
            self._save(path, index)
        return index, True

    @staticmethod
    def _save(path: Path, index: np.ndarray) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                np.save(out, index, allow_pickle=False)
            os.chmod(tmp, 0o644)  # shared with workers that may run as other users
            os.replace(tmp, path)  # concurrent builders write the same bytes; the last rename wins
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


# ---------------------------------------------------------------- base source


class Source:
    """Rows ``[lo, hi)`` of a dataset as columns; subclasses read one *piece* (a file or row group)."""

    def __init__(self, uri: str, fmt: str, fs: Any, files: Sequence[_File], columns: Sequence[Column],
                 piece_rows: Sequence[int], index_built: bool = False):
        self.uri = uri
        self.format = fmt
        self.files: tuple[str, ...] = tuple(f.url for f in files)
        self.columns: tuple[Column, ...] = tuple(columns)
        #: whether opening this source scanned a file to build an index (False: all loaded, or none needed)
        self.index_built = index_built
        self._fs = fs
        self._files = list(files)
        self._kinds = {c.name: c.kind for c in self.columns}
        self._starts = [0, *np.cumsum(piece_rows, dtype=np.int64).tolist()]
        self.rows: int = self._starts[-1]
        self._lock = threading.Lock()

    def read(self, lo: int, hi: int, columns: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Rows ``[lo, hi)`` in global order (``hi`` clamped to :attr:`rows`), as ``{column: array}``."""
        if lo < 0 or hi < lo:
            raise ValueError(f"bad row range [{lo}, {hi})")
        names = self._names(columns)
        hi = min(hi, self.rows)
        parts: list[dict[str, np.ndarray]] = []
        with self._lock:
            p = bisect.bisect_right(self._starts, lo) - 1
            while lo < hi and p < len(self._starts) - 1 and self._starts[p] < hi:
                base = self._starts[p]
                a, b = max(lo, base) - base, min(hi, self._starts[p + 1]) - base
                if b > a:
                    parts.append(self._read_piece(p, a, b, names))
                p += 1
        if not parts:
            return {n: _empty(self._kinds[n]) for n in names}
        if len(parts) == 1:
            return parts[0]
        return {n: np.concatenate([part[n] for part in parts]) for n in names}

    def _names(self, columns: Sequence[str] | None) -> list[str]:
        if columns is None:
            return [c.name for c in self.columns]
        unknown = [n for n in columns if n not in self._kinds]
        if unknown:
            raise SourceError(self.uri, f"no column {unknown[0]!r} (columns: {', '.join(self._kinds)})")
        return list(columns)

    def _read_piece(self, piece: int, a: int, b: int, names: Sequence[str]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def close(self) -> None:
        """Release open files and caches (idempotent)."""

    def __enter__(self) -> Source:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.format} {self.uri!r}: {len(self.files)} files, {self.rows} rows>"


# -------------------------------------------------------------------- parquet


def _arrow_kind(t: Any) -> str | None:
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        return _arrow_kind(t.value_type)
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return "int"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "string"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        inner = _arrow_kind(t.value_type)
        return f"list<{inner}>" if inner is not None and not inner.startswith("list") else None
    return None


def _arrow_to_numpy(arr: Any, kind: str, where: str, name: str) -> np.ndarray:
    """An Arrow (chunked) array as the numpy array of ``kind`` (see the module docstring)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if kind == "float":
        return np.asarray(pc.cast(arr, pa.float32()).to_numpy(zero_copy_only=False), dtype=np.float32)
    if kind == "int":
        return np.asarray(pc.fill_null(pc.cast(arr, pa.int64()), 0).to_numpy(zero_copy_only=False), dtype=np.int64)
    if kind == "string":
        if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
            try:
                arr = pc.cast(arr, pa.string())
            except pa.ArrowInvalid:
                raise CorruptData(where, f"column {name!r} holds bytes that are not UTF-8 text") from None
        return np.asarray(pc.fill_null(arr, "").to_numpy(zero_copy_only=False), dtype=object)
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
    flat = _arrow_to_numpy(pc.list_flatten(arr), kind[5:-1], where, name)
    return _split_lists(flat, lengths)


def _table_columns(table: Any, names: Sequence[str], kinds: Mapping[str, str], where: str) -> dict[str, np.ndarray]:
    return {n: _arrow_to_numpy(table.column(n), kinds[n], where, n) for n in names}


class ParquetSource(Source):
    """Parquet files: metadata from the footers, reads by row group (see the module docstring)."""

    def __init__(self, uri: str, fs: Any, files: Sequence[_File]):
        metas = _parallel(fs, lambda f: self._footer(fs, f), files)
        columns = self._columns(files, metas)
        self._metas = metas
        # Pieces are row groups: (file, row group) for every row group of every file, in order.
        self._pieces = [(i, g) for i, md in enumerate(metas) for g in range(md.num_row_groups)]
        rows = [metas[i].row_group(g).num_rows for i, g in self._pieces]
        super().__init__(uri, "parquet", fs, files, columns, rows)
        self._open: OrderedDict[int, Any] = OrderedDict()  # file index -> ParquetFile, LRU
        self._last: tuple[int, frozenset[str], Any] | None = None  # (piece, columns, Table)

    @staticmethod
    def _footer(fs: Any, f: _File) -> Any:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            with _storage_errors(f.url):
                if _is_local(fs):
                    return pq.read_metadata(f.path)
                with fs.open(f.path, "rb", cache_type="none") as handle:
                    return pq.read_metadata(handle)
        except pa.ArrowInvalid:
            raise CorruptData(f.url, "not a Parquet file or its footer is corrupt") from None

    @staticmethod
    def _columns(files: Sequence[_File], metas: Sequence[Any]) -> list[Column]:
        schema = metas[0].schema.to_arrow_schema()
        columns = []
        for field in schema:
            kind = _arrow_kind(field.type)
            if kind is None:
                raise SourceError(files[0].url, f"column {field.name!r} has unsupported type {field.type}")
            columns.append(Column(field.name, kind))
        for f, md in zip(files[1:], metas[1:], strict=True):
            other = md.schema.to_arrow_schema()
            if other.names != schema.names or [_arrow_kind(t) for t in other.types] != [c.kind for c in columns]:
                raise SourceError(f.url, f"its columns differ from those of {files[0].url}")
        return columns

    def _parquet_file(self, i: int) -> Any:
        import pyarrow.parquet as pq

        pf = self._open.get(i)
        if pf is not None:
            self._open.move_to_end(i)
            return pf
        f = self._files[i]
        with _storage_errors(f.url):
            source = f.path if _is_local(self._fs) else self._fs.open(f.path, "rb", cache_type="none")
            pf = pq.ParquetFile(source, metadata=self._metas[i])  # the footer is not read again
        self._open[i] = pf
        if len(self._open) > _OPEN_FILES:
            _, old = self._open.popitem(last=False)
            old.close()
        return pf

    def _read_piece(self, piece: int, a: int, b: int, names: Sequence[str]) -> dict[str, np.ndarray]:
        import pyarrow as pa

        last = self._last
        if last is None or last[0] != piece or not last[1].issuperset(names):
            i, g = self._pieces[piece]
            url = self._files[i].url
            try:
                with _storage_errors(url):
                    table = self._parquet_file(i).read_row_group(g, columns=list(names))
            except pa.ArrowInvalid:
                raise CorruptData(url, f"row group {g} cannot be read (the file changed, or is corrupt)") from None
            last = self._last = (piece, frozenset(names), table)
        url = self._files[self._pieces[piece][0]].url
        return _table_columns(last[2].slice(a, b - a), names, self._kinds, url)

    def close(self) -> None:
        for pf in self._open.values():
            pf.close()
        self._open.clear()
        self._last = None


# ----------------------------------------------------------------------- text


@dataclass(frozen=True, slots=True)
class _TextLayout:
    delimiter: str
    header: bool  # line 1 of every file is a header, not data
    names: tuple[str, ...]
    kinds: tuple[str, ...]


def _lines(a: np.ndarray, final: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, ends, non_blank) of the lines of ``a``, which begins at a line start.

    A line ends at its ``\\n`` (excluded); with ``final``, bytes after the last
    ``\\n`` are a line too.  A line that is empty or a lone ``\\r`` is blank.
    """
    ends = np.flatnonzero(a == 10)
    tail = int(ends[-1]) + 1 if len(ends) else 0
    if final and len(a) > tail:
        ends = np.append(ends, len(a))
    starts = np.empty_like(ends)
    starts[:1] = 0
    starts[1:] = ends[:-1] + 1
    length = ends - starts
    last_byte = a[np.maximum(ends - 1, 0)] if len(a) else np.empty(0, np.uint8)
    return starts, ends, (length > 1) | ((length == 1) & (last_byte != 13))


def _scan_text(handle: Any, header: bool) -> np.ndarray:
    """One pass over a text file: rows (2, n+1) = [[rows, offset of row 0, row STRIDE, ...], [0, their 1-based lines]]."""
    offsets: list[np.ndarray] = []
    numbers: list[np.ndarray] = []
    rows = base = lineno = 0
    carry = b""
    while True:
        chunk = handle.read(_SCAN_BYTES)
        final = not chunk
        buf = carry + chunk if carry else chunk
        starts, ends, data = _lines(np.frombuffer(buf, np.uint8), final)
        line = lineno + 1 + np.arange(len(starts))
        if header:
            data &= line != 1
        n = int(data.sum())
        keep = (rows + np.arange(n)) % STRIDE == 0
        offsets.append(base + starts[data][keep])
        numbers.append(line[data][keep])
        rows += n
        lineno += len(starts)
        if final:
            break
        consumed = int(ends[-1]) + 1 if len(ends) else 0
        carry = buf[consumed:]
        base += consumed
    return np.stack([np.concatenate([[rows], *offsets]), np.concatenate([[0], *numbers])]).astype(np.int64)


def _criteo_kind(name: str) -> str:
    return "int" if name == "label" else "float" if name.startswith("I") else "string"


_ARROW_KINDS = {"float": "float32", "int": "int64", "string": "string"}
_CSV_OPTIONS = frozenset({"delimiter", "header", "names", "kinds"})


def _head(fs: Any, f: _File, lines: int) -> bytes:
    """The first ``lines`` lines of ``f`` (all of it if it has fewer)."""
    buf = b""
    with _storage_errors(f.url), fs.open(f.path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            buf += chunk
            if buf.count(b"\n") >= lines:
                break
    ends = _lines(np.frombuffer(buf, np.uint8), final=True)[1]
    return buf[: int(ends[lines - 1]) + 1] if len(ends) >= lines else buf


def _split_line(raw: bytes, delimiter: str, url: str, line: int) -> list[str]:
    try:
        text = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise CorruptData(url, "not UTF-8 text", line=line) from None
    return next(csv.reader([text], delimiter=delimiter), [])


def _text_layout(fmt: str, fs: Any, first: _File, options: Mapping[str, Any]) -> _TextLayout:
    """Delimiter, header, names and kinds: fixed for the Criteo formats, else from options and a sample."""
    if fmt == "criteo_tsv":
        return _TextLayout("\t", False, CSV_HEADER, tuple(map(_criteo_kind, CSV_HEADER)))
    if fmt == "criteo_csv":
        buf = _head(fs, first, 1)
        names = tuple(n.strip() for n in _split_line(buf, ",", first.url, 1))
        if names and _parses(names[0], float):  # no header (a label first): Criteo's columns in Criteo's order
            return _TextLayout(",", False, CSV_HEADER, tuple(map(_criteo_kind, CSV_HEADER)))
        if sorted(names) != sorted(CSV_HEADER):
            raise SourceError(first.url, f"the header is not Criteo's ({CSV_HEADER[0]}, {CSV_HEADER[1]}..{CSV_HEADER[-1]})")
        return _TextLayout(",", True, names, tuple(map(_criteo_kind, names)))
    unknown = set(options) - _CSV_OPTIONS
    if unknown:
        raise ValueError(f"unknown csv_options: {', '.join(sorted(unknown))}")
    delimiter = str(options.get("delimiter", "\t" if fmt == "tsv" else ","))
    header = bool(options.get("header", True))
    buf = _head(fs, first, SAMPLE_LINES + 1)
    starts, ends, _ = _lines(np.frombuffer(buf, np.uint8), final=True)
    file_names = _split_line(buf[: int(ends[0])], delimiter, first.url, 1) if header and len(ends) else None
    names = tuple(str(n).strip() for n in (options.get("names") or file_names or ()))
    if not names:
        raise SourceError(first.url, "the column names are unknown: set csv_options names (the file has no header)")
    if file_names is not None and len(names) != len(file_names):
        raise SourceError(first.url, f"{len(names)} names given, the header has {len(file_names)}")
    if len(set(names)) != len(names):
        raise SourceError(first.url, "the column names are not unique")
    data_start = 0 if not header else int(starts[1]) if len(starts) > 1 else len(buf)
    kinds = _infer_text_kinds(buf[data_start:], names, delimiter, first.url, 2 if header else 1)
    overrides = dict(options.get("kinds") or {})
    for name, kind in overrides.items():
        if name not in names or kind not in _ARROW_KINDS:
            raise ValueError(f"csv_options kinds: {name!r}: not a column, or {kind!r} not one of {', '.join(_ARROW_KINDS)}")
    return _TextLayout(delimiter, header, names, tuple(overrides.get(n, k) for n, k in zip(names, kinds, strict=True)))


def _infer_text_kinds(sample: bytes, names: Sequence[str], delimiter: str, url: str, line0: int) -> list[str]:
    """int if every sampled value is an integer, float if a number or empty, else string."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    try:
        table = pacsv.read_csv(
            pa.BufferReader(sample),
            read_options=pacsv.ReadOptions(column_names=list(names)),
            parse_options=pacsv.ParseOptions(delimiter=delimiter),
            convert_options=pacsv.ConvertOptions(null_values=[""], strings_can_be_null=False),
        )
    except pa.ArrowInvalid:
        raise _bad_line(sample, url, line0, delimiter, names, {}) from None
    kinds = []
    for col in table.columns:
        t = col.type
        if pa.types.is_integer(t):
            kinds.append("int" if col.null_count == 0 else "float")
        elif pa.types.is_floating(t) or pa.types.is_null(t):
            kinds.append("float")
        else:
            kinds.append("string")
    return kinds


def _bad_line(buf: bytes, url: str, line0: int, delimiter: str, names: Sequence[str], kinds: Mapping[str, str]) -> CorruptData:
    """The error for the first line of ``buf`` (line ``line0`` of ``url``) that does not parse."""
    starts, ends, data = _lines(np.frombuffer(buf, np.uint8), final=True)
    for k in np.flatnonzero(data):
        line = line0 + int(k)
        fields = _split_line(buf[int(starts[k]) : int(ends[k])], delimiter, url, line)
        if len(fields) != len(names):
            return CorruptData(url, f"{len(fields)} fields, expected {len(names)}", line=line)
        for name, value in zip(names, fields, strict=True):
            kind = kinds.get(name)
            if kind in ("int", "float") and value and not _parses(value, int if kind == "int" else float):
                return CorruptData(url, f"column {name!r} is not {'an int' if kind == 'int' else 'a number'}", line=line)
    return CorruptData(url, f"lines {line0}..{line0 + len(starts) - 1} cannot be parsed as CSV")


def _parses(value: str, parse: Callable[[str], object]) -> bool:
    try:
        parse(value)
    except ValueError:
        return False
    return True


class TextSource(Source):
    """CSV/TSV files read by row ranges through a line index (see the module docstring)."""

    def __init__(self, uri: str, fmt: str, fs: Any, files: Sequence[_File], store: _IndexStore,
                 options: Mapping[str, Any]):
        _refuse_gzip(fmt, files)
        layout = self._layout = _text_layout(fmt, fs, files[0], options)
        params = f"{layout.delimiter!r}|{layout.header}|{STRIDE}"

        def scan(f: _File) -> np.ndarray:
            with _storage_errors(f.url), fs.open(f.path, "rb") as handle:
                return _scan_text(handle, layout.header)

        indexes = _parallel(fs, lambda f: store.get(index_key("lines", f, params), lambda: scan(f)), files)
        self._index = [ix for ix, _ in indexes]
        columns = [Column(n, k) for n, k in zip(layout.names, layout.kinds, strict=True)]
        rows = [int(ix[0, 0]) for ix in self._index]
        super().__init__(uri, fmt, fs, files, columns, rows, index_built=any(built for _, built in indexes))

    def _read_piece(self, piece: int, a: int, b: int, names: Sequence[str]) -> dict[str, np.ndarray]:
        f, ix = self._files[piece], self._index[piece]
        offsets, lines = ix[0, 1:], ix[1, 1:]
        block, end_block = a // STRIDE, -(-b // STRIDE)
        end = int(offsets[end_block]) if end_block < len(offsets) else f.size
        buf = _read_range(self._fs, f, int(offsets[block]), end)
        starts, ends, data = _lines(np.frombuffer(buf, np.uint8), final=True)
        first = a - block * STRIDE
        rows = np.flatnonzero(data)[first : first + b - a]
        if len(rows) != b - a:
            raise CorruptData(f.url, "the file changed since it was indexed")
        lo, hi = int(starts[rows[0]]), int(ends[rows[-1]]) + 1
        return self._parse(buf[lo:hi], f.url, int(lines[block]) + int(rows[0]), b - a, names)

    def _parse(self, buf: bytes, url: str, line0: int, rows: int, names: Sequence[str]) -> dict[str, np.ndarray]:
        import pyarrow as pa
        import pyarrow.csv as pacsv

        layout = self._layout
        kinds = {n: self._kinds[n] for n in names}
        try:
            table = pacsv.read_csv(
                pa.BufferReader(buf),
                read_options=pacsv.ReadOptions(column_names=list(layout.names)),
                parse_options=pacsv.ParseOptions(delimiter=layout.delimiter),
                convert_options=pacsv.ConvertOptions(
                    column_types={n: _ARROW_KINDS[k] for n, k in kinds.items()},
                    include_columns=list(names),
                    null_values=[""],
                    strings_can_be_null=False,
                    quoted_strings_can_be_null=False,
                ),
            )
        except pa.ArrowInvalid:
            raise _bad_line(buf, url, line0, layout.delimiter, layout.names, kinds) from None
        if table.num_rows != rows:
            raise CorruptData(url, f"lines {line0}..: {table.num_rows} rows parsed, expected {rows}")
        return _table_columns(table, names, kinds, url)


# ------------------------------------------------------------------- tfrecord

_TFR_HEAD = struct.Struct("<QI")  # length, masked CRC-32C of the length; then data, masked CRC of data
_FLOAT32 = struct.Struct("<f")
_LIST_FIELDS = {1: "string", 2: "float", 3: "int"}  # Feature's oneof: bytes_list, float_list, int64_list
_MASK64 = (1 << 64) - 1


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


_CRC32C = _crc32c_table()


def _masked_crc(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C (Castagnoli), rotated and offset as in TensorFlow's crc32c::Mask."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _scan_tfrecord(handle: Any, url: str) -> np.ndarray:
    """One pass over the framing: the offset of every record, then the end of the last one."""
    offsets = [0]
    base = 0
    carry = b""
    while True:
        chunk = handle.read(_SCAN_BYTES)
        buf = carry + chunk if carry else chunk
        pos, size = 0, len(buf)
        while pos + _TFR_HEAD.size <= size:
            length, crc = _TFR_HEAD.unpack_from(buf, pos)
            if _masked_crc(buf[pos : pos + 8]) != crc:
                raise CorruptData(url, f"record {len(offsets) - 1}: bad length checksum at byte {base + pos} (not a TFRecord file?)")
            end = pos + _TFR_HEAD.size + length + 4
            if end > size:
                break
            pos = end
            offsets.append(base + pos)
        if not chunk:
            if pos < size:
                raise CorruptData(url, f"record {len(offsets) - 1} is truncated ({size - pos} bytes at the end)")
            return np.asarray(offsets, dtype=np.int64)
        carry = buf[pos:]
        base += pos


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    result, shift = b & 0x7F, 7
    while True:
        pos += 1
        b = buf[pos]
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos + 1
        shift += 7


def _skip(buf: bytes, pos: int, wire: int) -> int:
    if wire == 0:
        return _varint(buf, pos)[1]
    if wire == 1:
        return pos + 8
    if wire == 2:
        n, pos = _varint(buf, pos)
        return pos + n
    if wire == 5:
        return pos + 4
    raise ValueError(f"wire type {wire}")


def _example(buf: bytes, pos: int, end: int, names: dict[bytes, str]) -> dict[str, tuple[int, int, int]]:
    """A serialized ``tf.train.Example``: feature name -> (list field, start, end of the list's bytes).

    Example{features = 1: Features{feature = 1: map<string, Feature>}}; a map
    entry is {key = 1, value = 2}; Feature is a oneof of bytes_list = 1,
    float_list = 2, int64_list = 3.  Unknown fields are skipped.
    """
    out: dict[str, tuple[int, int, int]] = {}
    while pos < end:
        tag, pos = _varint(buf, pos)
        if tag != 0x0A:  # Example.features
            pos = _skip(buf, pos, tag & 7)
            continue
        n, pos = _varint(buf, pos)
        features_end = pos + n
        while pos < features_end:
            if buf[pos] != 0x0A:  # Features.feature (a map entry)
                tag, pos = _varint(buf, pos)
                pos = _skip(buf, pos, tag & 7)
                continue
            n = buf[pos + 1]
            n, pos = (n, pos + 2) if n < 0x80 else _varint(buf, pos + 1)
            entry_end = pos + n
            # The common layout, read inline (a call per varint would double the cost):
            # 0A <short key> 12 <short Feature: tag <short list>>.
            k = buf[pos + 1]
            if (buf[pos] == 0x0A and k < 0x80 and buf[pos + 2 + k] == 0x12 and buf[pos + 3 + k] < 0x80
                    and pos + 4 + k + buf[pos + 3 + k] == entry_end):
                key = buf[pos + 2 : pos + 2 + k]
                p = pos + 4 + k
                if p == entry_end:  # an empty Feature
                    value = (0, 0, 0)
                elif buf[p + 1] < 0x80:
                    value = (buf[p] >> 3, p + 2, p + 2 + buf[p + 1])
                else:
                    size, q = _varint(buf, p + 1)
                    value = (buf[p] >> 3, q, q + size)
            else:
                key, value = _map_entry(buf, pos, entry_end)
            pos = entry_end
            name = names.get(key)
            if name is None:
                name = names[key] = key.decode("utf-8")
            out[name] = value
    if pos != end:
        raise ValueError("overruns the record")
    return out


def _map_entry(buf: bytes, pos: int, end: int) -> tuple[bytes, tuple[int, int, int]]:
    """A map entry {key = 1: string, value = 2: Feature} in any layout."""
    key = b""
    value = (0, 0, 0)
    while pos < end:
        tag, pos = _varint(buf, pos)
        if tag == 0x0A:
            n, pos = _varint(buf, pos)
            key = buf[pos : pos + n]
            pos += n
        elif tag == 0x12:
            n, pos = _varint(buf, pos)
            if n:
                field, p = _varint(buf, pos)
                size, p = _varint(buf, p)
                value = (field >> 3, p, p + size)
            pos += n
        else:
            pos = _skip(buf, pos, tag & 7)
    return key, value


def _floats(buf: bytes, pos: int, end: int) -> np.ndarray:
    parts = []
    while pos < end:
        tag, pos = _varint(buf, pos)
        if tag == 0x0A:  # packed
            n, pos = _varint(buf, pos)
            parts.append(np.frombuffer(buf, "<f4", n // 4, pos))
            pos += n
        elif tag == 0x0D:
            parts.append(np.frombuffer(buf, "<f4", 1, pos))
            pos += 4
        else:
            pos = _skip(buf, pos, tag & 7)
    return np.concatenate(parts).astype(np.float32) if parts else np.empty(0, np.float32)


def _ints(buf: bytes, pos: int, end: int) -> list[int]:
    out = []
    while pos < end:
        tag, pos = _varint(buf, pos)
        if tag == 0x0A:  # packed
            n, pos = _varint(buf, pos)
            stop = pos + n
            while pos < stop:
                v, pos = _varint(buf, pos)
                out.append(v - (1 << 64) if v >> 63 else v)
        elif tag == 0x08:
            v, pos = _varint(buf, pos)
            out.append(v - (1 << 64) if v >> 63 else v)
        else:
            pos = _skip(buf, pos, tag & 7)
    return out


def _strings(buf: bytes, pos: int, end: int) -> list[str]:
    out = []
    while pos < end:
        tag, pos = _varint(buf, pos)
        if tag == 0x0A:
            n, pos = _varint(buf, pos)
            out.append(buf[pos : pos + n].decode("utf-8"))
            pos += n
        else:
            pos = _skip(buf, pos, tag & 7)
    return out


def _values(buf: bytes, field: int, start: int, end: int) -> Any:
    """The values of one feature: a float32 array, or a list of ints or strs."""
    if field == 2:
        return _floats(buf, start, end)
    if field == 3:
        return _ints(buf, start, end)
    return _strings(buf, start, end)


def _decode_column(buf: bytes, feats: Sequence[Mapping[str, tuple[int, int, int]]], name: str, kind: str,
                   where: Callable[[int], str]) -> np.ndarray:
    """Column ``name`` of decoded examples ``feats`` as the numpy array of ``kind``."""
    scalar = not kind.startswith("list")
    base = kind if scalar else kind[5:-1]
    expected = {"string": 1, "float": 2, "int": 3}[base]
    missing: Any = {"float": np.float32("nan"), "int": 0, "string": ""}[base]
    out: list[Any] = []
    for i, feat in enumerate(feats):
        field, start, end = feat.get(name, (0, 0, 0))
        if start == end:  # absent, or an empty list of any type
            out.append(missing if scalar else _values(b"", expected, 0, 0))
            continue
        if field != expected:
            raise CorruptData(where(i), f"feature {name!r} is a {_LIST_FIELDS.get(field, '?')} list, expected {base} (kinds come from the first records)")
        if scalar and buf[start] == 0x0A and buf[start + 1] == end - start - 2:  # one packed value (or string)
            if field == 2 and end - start == 6:
                out.append(_FLOAT32.unpack_from(buf, start + 2)[0])
                continue
            if field == 1:
                out.append(buf[start + 2 : end].decode("utf-8"))
                continue
            if field == 3:
                v, p = _varint(buf, start + 2)
                if p == end:
                    out.append(v - (1 << 64) if v >> 63 else v)
                    continue
        values = _values(buf, field, start, end)
        if not scalar:
            out.append(values)
        elif len(values) == 1:
            out.append(values[0])
        else:
            raise CorruptData(where(i), f"feature {name!r} has {len(values)} values, expected 1 (kinds come from the first records)")
    if scalar:
        return np.array(out, dtype={"float": np.float32, "int": np.int64, "string": object}[base])
    dtype = {"float": np.float32, "int": np.int64, "string": object}[base]
    return _object_array([np.asarray(v, dtype=dtype) for v in out])


class TFRecordSource(Source):
    """TFRecord files of ``tf.train.Example`` read through a record index (see the module docstring)."""

    def __init__(self, uri: str, fs: Any, files: Sequence[_File], store: _IndexStore):
        _refuse_gzip("tfrecord", files)

        def scan(f: _File) -> np.ndarray:
            with _storage_errors(f.url), fs.open(f.path, "rb") as handle:
                return _scan_tfrecord(handle, f.url)

        indexes = _parallel(fs, lambda f: store.get(index_key("tfrecord", f), lambda: scan(f)), files)
        self._index = [ix for ix, _ in indexes]
        self._keys: dict[bytes, str] = {}  # interned feature names
        columns = self._infer(fs, files)
        super().__init__(uri, "tfrecord", fs, files, columns, [len(ix) - 1 for ix in self._index],
                         index_built=any(built for _, built in indexes))

    def _infer(self, fs: Any, files: Sequence[_File]) -> list[Column]:
        """Kinds from the first records: scalar if no record has more than one value."""
        i = next((i for i, ix in enumerate(self._index) if len(ix) > 1), None)
        if i is None:
            return []
        buf, feats = self._examples(fs, files[i], i, 0, min(SAMPLE_RECORDS, len(self._index[i]) - 1))
        fields: dict[str, int] = {}
        multi: set[str] = set()
        for feat in feats:
            for name, (field, start, end) in feat.items():
                if start == end:
                    fields.setdefault(name, 0)
                    continue
                if not fields.get(name):
                    fields[name] = field
                if len(_values(buf, field, start, end)) > 1:
                    multi.add(name)
        columns = []
        for name, field in fields.items():
            base = _LIST_FIELDS.get(field, "float")  # never a value in the sample: a float list
            columns.append(Column(name, base if field and name not in multi else f"list<{base}>"))
        return columns

    def _examples(self, fs: Any, f: _File, piece: int, a: int, b: int) -> tuple[bytes, list[dict[str, tuple[int, int, int]]]]:
        offsets = self._index[piece]
        start = int(offsets[a])
        buf = _read_range(fs, f, start, int(offsets[b]))
        feats = []
        for k in range(a, b):
            pos = int(offsets[k]) - start + _TFR_HEAD.size
            end = int(offsets[k + 1]) - start - 4
            try:
                feats.append(_example(buf, pos, end, self._keys))
            except (IndexError, ValueError):  # UnicodeDecodeError is a ValueError
                raise CorruptData(f.url, f"record {k} is not a valid tf.train.Example") from None
        return buf, feats

    def _read_piece(self, piece: int, a: int, b: int, names: Sequence[str]) -> dict[str, np.ndarray]:
        f = self._files[piece]
        buf, feats = self._examples(self._fs, f, piece, a, b)

        def where(i: int) -> str:
            return f"{f.url}: record {a + i}"

        try:
            return {n: _decode_column(buf, feats, n, self._kinds[n], where) for n in names}
        except (IndexError, ValueError) as e:
            if isinstance(e, SourceError):
                raise
            raise CorruptData(f.url, f"records {a}..{b - 1}: a feature's values cannot be decoded") from None


def _encode_varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | 2) + _encode_varint(len(payload)) + payload


def _encode_feature(value: Any) -> bytes:
    """A Feature: floats -> float_list, ints and bools -> int64_list, str/bytes -> bytes_list."""
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value]
    if isinstance(value, np.ndarray):
        kind = value.dtype.kind
    else:
        first = values[0] if values else 0.0
        kind = "f" if isinstance(first, (float, np.floating)) else "i" if isinstance(first, (int, np.integer)) else "U"
    if kind == "f":
        body = np.asarray(values, dtype="<f4").tobytes()
        return _field(2, _field(1, body) if values else b"")
    if kind in "iub":
        body = b"".join(_encode_varint(int(v) & _MASK64) for v in values)
        return _field(3, _field(1, body) if values else b"")
    return _field(1, b"".join(_field(1, v if isinstance(v, bytes) else str(v).encode("utf-8")) for v in values))


def encode_example(row: Mapping[str, Any]) -> bytes:
    """A serialized ``tf.train.Example`` of ``{name: value or list of values}`` (see :func:`write_tfrecord`)."""
    entries = (_field(1, _field(1, name.encode("utf-8")) + _field(2, _encode_feature(v))) for name, v in row.items())
    return _field(1, b"".join(entries))


def write_tfrecord(path: str | os.PathLike[str], rows: Iterable[Mapping[str, Any]], *,
                   storage_options: Mapping[str, Any] | None = None) -> int:
    """Write ``rows`` as a TFRecord file of Examples, without TensorFlow; returns the row count.

    For tests and benchmarks: the checksums are computed in pure Python (~10 MB/s).
    """
    import fsspec

    count = 0
    with fsspec.open(os.fspath(path), "wb", **dict(storage_options or {})) as out:
        for row in rows:
            data = encode_example(row)
            head = struct.pack("<Q", len(data))
            out.write(head + struct.pack("<I", _masked_crc(head)) + data + struct.pack("<I", _masked_crc(data)))
            count += 1
    return count


# --------------------------------------------------------------- record files

_RECORD_COLUMNS = (
    Column("label", "float"),
    *(Column(f"I{j}", "float") for j in range(1, NUM_DENSE + 1)),
    *(Column(f"C{j}", "int") for j in range(1, NUM_CAT + 1)),
)


class _RemoteRecords:
    """A record file on object storage: its header checked, its records fetched by byte range."""

    def __init__(self, fs: Any, f: _File):
        head = _read_range(fs, f, 0, HEADER_SIZE) if f.size >= HEADER_SIZE else b""
        if len(head) < HEADER_SIZE:
            raise BadRecordFile(f.url, f"{f.size} bytes, shorter than the {HEADER_SIZE}-byte header")
        magic, version, rec_size, count = _RECORD_HEADER.unpack_from(head)
        if magic != MAGIC or version != FORMAT_VERSION or rec_size != RECORD_DTYPE.itemsize:
            raise BadRecordFile(f.url, "not a Pacer record file of this version (magic, version or record size)")
        if f.size != HEADER_SIZE + count * rec_size:
            raise BadRecordFile(f.url, f"{f.size} bytes, the header says {count} records")
        self._fs, self._file = fs, f
        self._count: int = count

    def __len__(self) -> int:
        return self._count

    def read(self, start: int, end: int) -> np.ndarray:
        size = RECORD_DTYPE.itemsize
        data = _read_range(self._fs, self._file, HEADER_SIZE + start * size, HEADER_SIZE + end * size)
        return np.frombuffer(data, dtype=RECORD_DTYPE)


class RecordSource(Source):
    """Pacer record files: label and I1..I13 float, C1..C26 int (the categorical ids)."""

    def __init__(self, uri: str, fs: Any, files: Sequence[_File]):
        self._readers: list[RecordFile | _RemoteRecords] = []
        for f in files:
            try:
                with _storage_errors(f.url):
                    self._readers.append(RecordFile.open(f.path) if _is_local(fs) else _RemoteRecords(fs, f))
            except BadRecordFile as e:
                self.close()
                raise CorruptData(f.url, e.reason) from None
        super().__init__(uri, "record", fs, files, _RECORD_COLUMNS, [len(r) for r in self._readers])

    def _read_piece(self, piece: int, a: int, b: int, names: Sequence[str]) -> dict[str, np.ndarray]:
        records = self._readers[piece].read(a, b)
        out: dict[str, np.ndarray] = {}
        for name in names:
            if name == "label":
                out[name] = records["label"].astype(np.float32)
            elif name[0] == "I":
                out[name] = records["dense"][:, int(name[1:]) - 1].astype(np.float32)
            else:
                out[name] = records["cat"][:, int(name[1:]) - 1].astype(np.int64)
        return out

    def close(self) -> None:
        for r in self._readers:
            if isinstance(r, RecordFile):
                r.close()


# ---------------------------------------------------------------------- entry


def infer_source_format(uri: str) -> str:
    """The format a name says: .parquet/.pq, .csv, .tsv/.txt, .tfrecord(s)/.tfr (``.gz`` and glob
    characters at the end ignored); anything else is a record file."""
    name = os.fspath(uri).lower().rstrip("*?]/")
    name = name.removesuffix(".gz").rstrip("*?]")
    for fmt, ends in (("parquet", (".parquet", ".pq")), ("csv", (".csv",)), ("tsv", (".tsv", ".txt")),
                      ("tfrecord", (".tfrecord", ".tfrecords", ".tfr"))):
        if name.endswith(ends):
            return fmt
    return "record"


def open_source(uri: str | os.PathLike[str], fmt: str | None = None, *, index_dir: str | os.PathLike[str] | None = None,
                storage_options: Mapping[str, Any] | None = None,
                csv_options: Mapping[str, Any] | None = None) -> Source:
    """Open the dataset at ``uri`` (a file, a glob or a directory; local or an fsspec URL) for reads.

    ``fmt`` is one of :data:`FORMATS`; by default the first file's name says
    (:func:`infer_source_format`).  ``index_dir`` keeps the CSV and TFRecord
    indexes for re-use; ``csv_options`` (csv/tsv only): ``delimiter``,
    ``header`` (default True), ``names`` (required without a header; renames
    with one), ``kinds`` ({name: float|int|string}, over the inferred ones).
    """
    uri = os.fspath(uri)
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: one of {', '.join(FORMATS)}")
    fs, files = _resolve(uri, storage_options)
    fmt = fmt or infer_source_format(files[0].path)
    if csv_options and fmt not in ("csv", "tsv"):
        raise ValueError(f"csv_options do not apply to format {fmt!r}")
    store = _IndexStore(index_dir)
    if fmt == "parquet":
        return ParquetSource(uri, fs, files)
    if fmt == "tfrecord":
        return TFRecordSource(uri, fs, files, store)
    if fmt == "record":
        return RecordSource(uri, fs, files)
    return TextSource(uri, fmt, fs, files, store, csv_options or {})


def describe(uri: str | os.PathLike[str], fmt: str | None = None, *, index_dir: str | os.PathLike[str] | None = None,
             storage_options: Mapping[str, Any] | None = None,
             csv_options: Mapping[str, Any] | None = None) -> Source:
    """Files, rows and columns of a dataset: :func:`open_source`, which reads only the footers of
    Parquet files and the headers of record files, and builds (or loads) the CSV/TFRecord indexes.
    The returned source is open: close it, or use it to read."""
    return open_source(uri, fmt, index_dir=index_dir, storage_options=storage_options, csv_options=csv_options)


__all__ = [
    "FORMATS",
    "KINDS",
    "STRIDE",
    "AccessDenied",
    "Column",
    "CorruptData",
    "MissingData",
    "ParquetSource",
    "RecordSource",
    "Source",
    "SourceError",
    "TFRecordSource",
    "TextSource",
    "describe",
    "encode_example",
    "index_key",
    "infer_source_format",
    "open_source",
    "write_tfrecord",
]
