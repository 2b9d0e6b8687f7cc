"""Criteo click logs: readers for real files, a fixed-width record file, a synthetic generator.

Three parts, all numpy and no TensorFlow, so that services and tools can use
them without paying TensorFlow's start-up cost:

* Readers for the two layouts that real Criteo data comes in: Criteo's day
  files (no header, tab-separated: label, 13 integers, 26 hex categoricals,
  empty fields for missing values) and the CSV variant many projects ship
  (header ``label,I1..I13,C1..C26``, integers sometimes written as floats
  such as ``260.0``).  The layout is detected from the first line.  Both
  stream in chunks of ``RECORD_DTYPE`` records and reject a malformed line
  with :class:`MalformedLine`, naming the file and the line number.
* :class:`RecordFile`: a 64-byte header followed by fixed-width records.  A
  shard is ``(offset, length)`` over records (docs/design.md, "Data"), so a worker
  reads its shard with a memory map at a computed byte offset: O(1) to find,
  no scan of the file.
* :func:`generate`: Criteo-like data with a *planted* signal (skewed dense
  features, Zipf-like categorical vocabularies, per-value and crossed-field
  effects on the click logit), so that a model's AUC means something.  The
  output is a pure function of the seed: the same seed gives a byte-identical
  file (given the numpy build: its SIMD exp/log may differ by an ulp across
  CPUs, which can flip a rare label).

Concurrency: everything here is synchronous; a ``RecordFile`` opened read-only
may be shared by threads (reads copy out of the memory map).
"""

from __future__ import annotations

import contextlib
import gzip
import math
import os
import re
import struct
import tempfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, cast

import numpy as np

from pacer.errors import PacerError

NUM_DENSE = 13
NUM_CAT = 26
NUM_COLUMNS = 1 + NUM_DENSE + NUM_CAT

RECORD_DTYPE = np.dtype([("label", "<f4"), ("dense", "<f4", (NUM_DENSE,)), ("cat", "<u4", (NUM_CAT,))])
assert RECORD_DTYPE.itemsize == 160

CSV_HEADER = ("label", *(f"I{i}" for i in range(1, NUM_DENSE + 1)), *(f"C{i}" for i in range(1, NUM_CAT + 1)))

# How many rows each chunk of a reader holds: large enough that numpy's
# per-call overhead vanishes, small enough (~10 MB) to stay cache- and
# memory-friendly when a day file (45M rows) streams through.
DEFAULT_CHUNK_ROWS = 65_536


# --------------------------------------------------------------------- errors


class DataError(PacerError, ValueError):
    """Base of the data errors; a ValueError so that plain callers can catch it as one."""

    code = "bad_data"


class MalformedLine(DataError):
    """A line of a Criteo TSV/CSV file cannot be parsed; names the file and the 1-based line.

    The ``reason`` says what is wrong without quoting the file: a service
    that reads a file a user named must not show a stranger its bytes.
    """

    def __init__(self, path: str | os.PathLike[str], line: int, reason: str):
        super().__init__(f"{os.fspath(path)}:{line}: malformed Criteo line: {reason}")
        self.path = os.fspath(path)
        self.line = line
        self.reason = reason


class BadRecordFile(DataError):
    """A file is not a valid record file: wrong magic, unknown version, other record size, truncated.

    ``reason`` says which, without quoting the file's bytes (see :class:`MalformedLine`).
    """

    def __init__(self, path: str | os.PathLike[str], reason: str):
        super().__init__(f"{os.fspath(path)}: {reason}")
        self.path = os.fspath(path)
        self.reason = reason


# -------------------------------------------------------------------- readers


@dataclass(frozen=True, slots=True)
class Layout:
    """How a Criteo text file is laid out: the delimiter, and the header if any."""

    delimiter: str
    has_header: bool
    # column_order[k] = index in the file of the k-th canonical column
    # (label, I1..I13, C1..C26); the identity unless a header reorders them.
    column_order: tuple[int, ...] = tuple(range(NUM_COLUMNS))

    @property
    def name(self) -> str:
        return "csv" if self.delimiter == "," else "tsv"


def _open_binary(path: str | os.PathLike[str]) -> IO[bytes]:
    # Criteo publishes its day files gzipped; reading them without unpacking
    # to disk first saves ~10x the space.
    if os.fspath(path).endswith(".gz"):
        return cast(IO[bytes], gzip.open(path, "rb"))
    return open(path, "rb")


def _is_number(tok: str) -> bool:
    try:
        float(tok)
    except ValueError:
        return False
    return True


def detect_layout(path: str | os.PathLike[str]) -> Layout:
    """Look at the first line: tab -> day-file TSV, comma -> CSV; a non-numeric first field -> header."""
    with _open_binary(path) as f:
        first = f.readline().decode("utf-8", errors="replace").rstrip("\r\n")
    if not first:
        raise MalformedLine(path, 1, "empty first line (not a Criteo file?)")
    if "\t" in first:
        delim = "\t"
    elif "," in first:
        delim = ","
    else:
        raise MalformedLine(path, 1, "neither tab- nor comma-separated")
    toks = first.split(delim)
    has_header = not _is_number(toks[0].strip())
    if not has_header:
        return Layout(delim, False)
    if len(toks) != NUM_COLUMNS:
        raise MalformedLine(path, 1, f"header has {len(toks)} columns, expected {NUM_COLUMNS}")
    names = [t.strip().lower() for t in toks]
    canonical = [c.lower() for c in CSV_HEADER]
    if sorted(names) == sorted(canonical):
        # A header lets a producer reorder columns; honour it rather than
        # silently mixing up features.
        order = tuple(names.index(c) for c in canonical)
    else:
        order = tuple(range(NUM_COLUMNS))  # unknown names: trust the position
    return Layout(delim, True, order)


_HEX = re.compile(r"[0-9a-fA-F]+")


def cat_id(token: str) -> int:
    """The uint32 id of a categorical token; 0 is reserved for "missing".

    Criteo's hex hashes keep their value (so ids match other tools reading the
    same files); anything else is hashed with CRC-32.  A present value never
    maps to 0, which would make it indistinguishable from a missing one.
    """
    if not token:
        return 0
    if _HEX.fullmatch(token):
        v = int(token, 16) & 0xFFFFFFFF
    else:
        v = zlib.crc32(token.encode("utf-8")) & 0xFFFFFFFF
    return v or 1


def _parse_label(tok: str) -> float:
    try:
        v = float(tok)  # "1" in day files, sometimes "1.0" in CSV exports
    except ValueError:
        v = math.nan  # float()'s message would quote the token
    if v not in (0.0, 1.0):
        raise ValueError("not 0 or 1")
    return v


class _IdCache(dict[str, int]):
    """token -> id, computed on first sight.

    Real logs repeat a few values a lot (Zipf), so most tokens are dict hits
    resolved in C instead of a regex match and an int() per token.
    """

    def __missing__(self, token: str) -> int:
        v = self[token] = cat_id(token)
        return v


_LABELS = {"0": 0.0, "1": 1.0}
_NAN = float("nan")


def iter_criteo(path: str | os.PathLike[str], chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Iterator[np.ndarray]:
    """Stream a Criteo TSV or CSV file (optionally .gz) as chunks of ``RECORD_DTYPE`` records.

    Missing dense values become NaN, missing categoricals 0.  Blank lines are
    skipped; any other line that does not parse raises :class:`MalformedLine`.
    """
    if chunk_rows <= 0:
        raise ValueError("chunk_rows must be positive")
    layout = detect_layout(path)
    order = layout.column_order
    identity = order == tuple(range(NUM_COLUMNS))
    delim = layout.delimiter
    cache = _IdCache()
    cat0 = 1 + NUM_DENSE

    # Rows are gathered as Python lists and turned into arrays once per
    # chunk: one numpy conversion per chunk instead of 40 scalar stores per
    # row.
    labels: list[float] = []
    dense: list[list[float]] = []
    cats: list[list[int]] = []

    def flush() -> np.ndarray:
        out = np.empty(len(labels), dtype=RECORD_DTYPE)
        out["label"] = labels
        out["dense"] = np.array(dense, dtype=np.float32).reshape(-1, NUM_DENSE)
        out["cat"] = np.array(cats, dtype=np.uint32).reshape(-1, NUM_CAT)
        labels.clear()
        dense.clear()
        cats.clear()
        if len(cache) > 1_000_000:  # bounded, so a day file cannot exhaust memory
            cache.clear()
        return out

    with _open_binary(path) as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and layout.has_header:
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise MalformedLine(path, lineno, f"not UTF-8 text ({e.reason})") from None
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            toks = line.split(delim)
            if len(toks) != NUM_COLUMNS:
                raise MalformedLine(path, lineno, f"{len(toks)} fields, expected {NUM_COLUMNS}")
            if not identity:
                toks = [toks[i] for i in order]
            label = _LABELS.get(toks[0])
            if label is None:
                try:
                    label = _parse_label(toks[0])
                except ValueError as e:
                    raise MalformedLine(path, lineno, f"bad label: {e}") from None
            try:
                dtoks = toks[1:cat0]
                # map() runs in C; the comprehension only for rows with gaps.
                row = [float(t) if t else _NAN for t in dtoks] if "" in dtoks else list(map(float, dtoks))
            except ValueError:
                j = next(j for j in range(NUM_DENSE) if not _is_number(toks[1 + j] or "0"))
                raise MalformedLine(path, lineno, f"I{j + 1} is not a number") from None
            labels.append(label)
            dense.append(row)
            cats.append(list(map(cache.__getitem__, toks[cat0:])))
            if len(labels) == chunk_rows:
                yield flush()
    if labels:
        yield flush()


def read_criteo(path: str | os.PathLike[str]) -> np.ndarray:
    """A whole (small) Criteo file as one array; use :func:`iter_criteo` for day files."""
    chunks = list(iter_criteo(path))
    return np.concatenate(chunks) if chunks else np.empty(0, dtype=RECORD_DTYPE)


# ---------------------------------------------------------------- record file

MAGIC = b"PACERREC"
FORMAT_VERSION = 1
HEADER_SIZE = 64
# magic, version, record size, record count; the rest is reserved (zeros)
# so that later versions can add fields without moving the records.
_HEADER = struct.Struct("<8sIIQ")
assert _HEADER.size <= HEADER_SIZE


class RecordFile:
    """A read-only, memory-mapped file of ``RECORD_DTYPE`` records after a 64-byte header.

    ``read(start, end)`` computes the byte offset of ``start`` and copies the
    slice out of the map: O(1) to locate, no scan, so a shard
    ``(offset, length)`` costs the same wherever it lies in the file.
    """

    def __init__(self, path: Path, records: np.ndarray) -> None:
        self.path = path
        self._records = records

    # -- writing

    @staticmethod
    def write(path: str | os.PathLike[str], chunks: Iterable[np.ndarray]) -> int:
        """Write the records of ``chunks`` to ``path`` atomically; returns the record count.

        The data goes to a temporary file in the same directory that is
        fsynced and renamed over ``path``: a reader never sees a half-written
        file, and a crash leaves either the old file or the new one.
        """
        dst = Path(path)
        dst.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
        count = 0
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(b"\0" * HEADER_SIZE)  # the count is known only at the end
                for chunk in chunks:
                    if chunk.dtype != RECORD_DTYPE:
                        raise TypeError(f"chunk dtype {chunk.dtype} is not RECORD_DTYPE")
                    f.write(np.ascontiguousarray(chunk).tobytes())
                    count += len(chunk)
                f.seek(0)
                f.write(_header_bytes(count))
                f.flush()
                os.fsync(f.fileno())
            # mkstemp creates 0600; data files are meant to be shared with
            # the worker processes, which may run as other users.
            os.chmod(tmp, 0o644)
            os.replace(tmp, dst)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        fsync_dir(dst.parent)
        return count

    # -- reading

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> RecordFile:
        p = Path(path)
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(HEADER_SIZE)
        if len(head) < HEADER_SIZE:
            raise BadRecordFile(p, f"{len(head)} bytes, shorter than the {HEADER_SIZE}-byte header")
        magic, version, rec_size, count = _HEADER.unpack_from(head)
        if magic != MAGIC:
            raise BadRecordFile(p, f"not a Pacer record file (its first bytes are not the magic {MAGIC!r})")
        if version != FORMAT_VERSION:
            raise BadRecordFile(p, f"record file version {version}, this reader knows {FORMAT_VERSION}")
        if rec_size != RECORD_DTYPE.itemsize:
            raise BadRecordFile(p, f"record size {rec_size}, expected {RECORD_DTYPE.itemsize}")
        expected = HEADER_SIZE + count * rec_size
        if size != expected:
            what = "truncated" if size < expected else "has trailing bytes"
            raise BadRecordFile(p, f"{what}: {size} bytes, header says {count} records = {expected} bytes")
        if count == 0:
            records = np.empty(0, dtype=RECORD_DTYPE)  # mmap cannot map zero bytes
        else:
            records = np.memmap(p, dtype=RECORD_DTYPE, mode="r", offset=HEADER_SIZE, shape=(count,))
        return cls(p, records)

    def __len__(self) -> int:
        return len(self._records)

    def read(self, start: int, end: int) -> np.ndarray:
        """Records ``[start, end)`` as an in-memory array (a copy: safe after ``close``)."""
        if not 0 <= start <= end <= len(self._records):
            raise IndexError(f"{self.path}: range [{start}, {end}) outside [0, {len(self._records)})")
        return np.array(self._records[start:end])

    def close(self) -> None:
        mm = getattr(self._records, "_mmap", None)
        self._records = np.empty(0, dtype=RECORD_DTYPE)
        if mm is not None:
            mm.close()

    def __enter__(self) -> RecordFile:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _header_bytes(count: int) -> bytes:
    return _HEADER.pack(MAGIC, FORMAT_VERSION, RECORD_DTYPE.itemsize, count).ljust(HEADER_SIZE, b"\0")


def fsync_dir(d: Path) -> None:
    """Make a rename into ``d`` durable: the directory entry is on disk only once ``d`` is synced."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], chunk_rows: int = DEFAULT_CHUNK_ROWS) -> int:
    """Convert a Criteo TSV/CSV (optionally .gz) to a :class:`RecordFile`; returns the record count."""
    return RecordFile.write(dst, iter_criteo(src, chunk_rows))


# ------------------------------------------------------------------ features


def columns_of(records: np.ndarray) -> dict[str, np.ndarray]:
    """Records as the raw columns a source returns: ``label``, ``I1..I13`` float32, ``C1..C26`` int64."""
    cols = {"label": records["label"].astype(np.float32)}
    for j in range(NUM_DENSE):
        cols[CSV_HEADER[1 + j]] = records["dense"][:, j].astype(np.float32)
    for j in range(NUM_CAT):
        cols[CSV_HEADER[1 + NUM_DENSE + j]] = records["cat"][:, j].astype(np.int64)
    return cols


def features(batch: np.ndarray, hash_buckets: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Model inputs of a batch of records: ``(dense [n,13] f32, cat_ids [n,26] i64, labels [n] f32)``.

    Dense: ``log1p(max(x, 0))`` with NaN -> 0, because Criteo counts span six
    orders of magnitude (the usual Criteo transform).  Categoricals: the
    32-bit id modulo ``hash_buckets``, the same bucket count for every field
    (models add a per-field offset, so fields do not share rows).
    """
    if hash_buckets <= 0:
        raise ValueError("hash_buckets must be positive")
    d = batch["dense"]
    d = np.where(np.isnan(d), np.float32(0), np.maximum(d, np.float32(0)))
    dense = np.log1p(d).astype(np.float32, copy=False)
    cat_ids = (batch["cat"].astype(np.int64) % hash_buckets).astype(np.int64, copy=False)
    labels = batch["label"].astype(np.float32, copy=False)
    return dense, cat_ids, labels


def shuffle_within(records: np.ndarray, seed: int) -> np.ndarray:
    """The records of one shard in a seed-determined order (a copy).

    The seed is typically derived from (epoch, shard), so that a re-served
    shard is replayed in the same order and another epoch in another.
    """
    perm = np.random.default_rng(seed).permutation(len(records))
    return records[perm]


# ----------------------------------------------------------------- generator

# Scaled-down Criteo cardinalities (the real C3, C12, C16, C21 have millions
# of values): a few large vocabularies, most small.
VOCAB_SIZES: tuple[int, ...] = (
    1460, 583, 200_000, 100_000, 305, 24, 12_517, 633, 3, 93_145, 5_683, 300_000, 3_194,
    27, 14_992, 150_000, 10, 5_652, 2_173, 4, 250_000, 18, 15, 28_618, 105, 14_257,
)  # fmt: skip
# Fraction missing per categorical field, after the real data (C19, C20,
# C22, C25, C26 are often empty).
CAT_MISSING: tuple[float, ...] = (
    0, 0, 0.03, 0.03, 0, 0.12, 0, 0, 0, 0, 0, 0.03, 0, 0, 0, 0.03, 0, 0, 0.44, 0.44, 0.03, 0.76, 0, 0.03, 0.44, 0.44,
)  # fmt: skip
# Dense features: fraction missing, and log-normal location / scale of the
# count (medians span 1 .. ~3000, as in Criteo's I1..I13).
DENSE_MISSING = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0005, 0.04, 0.45, 0.04, 0.77, 0.22)
DENSE_MU = (0.7, 1.6, 2.0, 1.9, 7.9, 4.4, 2.3, 2.3, 3.7, 0.5, 1.0, 0.2, 1.8)
DENSE_SIGMA = (1.2, 1.8, 1.3, 0.9, 1.7, 1.6, 1.2, 0.9, 1.3, 0.8, 1.0, 1.2, 1.1)
# The crossed effects: pairs of (small-vocabulary) fields whose joint value
# moves the logit beyond the sum of their separate effects.  Only a model
# that crosses features (deep layers, CIN, cross network) can learn them.
CROSSED_PAIRS: tuple[tuple[int, int], ...] = ((5, 13), (8, 16), (19, 21), (0, 24), (4, 22))

GEN_BLOCK_ROWS = 65_536  # fixed, so the output does not depend on any chunk setting
DEFAULT_STRENGTH = 1.0
# The standard deviation of the click logit at strength 1.  Fixing it (the
# random field scales of a seed would otherwise make it vary 1.7..2.2) keeps
# the difficulty equal across seeds: W&D reaches a held-out AUC of 0.77-0.79
# after one epoch of 1M rows; the true probabilities reach ~0.86
# (bench/auc_check.py).
SIGNAL_STD = 1.95
DEFAULT_BASE_CTR = 0.25


def _splitmix32(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, low 32 bits: a cheap, vectorised, well-mixed hash."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return (x & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free form
    return out


class CriteoLikeGenerator:
    """The synthetic "world" of one seed and the rows drawn from it.

    The world (value ids, feature effects, the bias) depends on the seed
    only; rows come in fixed-size blocks, block ``i`` of stream ``s`` drawn
    from its own random stream ``[seed, s + 1, i]``.  So a train file
    (stream 0) and a held-out file (stream 1) share the planted signal but
    not a single row, and any block can be regenerated independently.

    Click logit = bias + strength * norm * (dense effects + per-value
    categorical effects + crossed-pair effects), where ``norm`` brings the
    standard deviation of the bracket to ``SIGNAL_STD`` and the bias is
    solved so the mean CTR is ``base_ctr``.
    """

    def __init__(self, seed: int, strength: float = DEFAULT_STRENGTH, base_ctr: float = DEFAULT_BASE_CTR) -> None:
        if seed < 0:
            raise ValueError("seed must be >= 0")
        if not 0.0 < base_ctr < 1.0:
            raise ValueError("base_ctr must be in (0, 1)")
        self.seed, self.strength, self.base_ctr = seed, float(strength), float(base_ctr)
        rng = np.random.default_rng([seed, 0, 0])

        # Categorical vocabularies: value rank r of field f has probability
        # ~ 1/(r+1)^a (Zipf), a drawn per field so head weights differ.
        # Sampled by the closed-form inverse CDF of the continuous power law
        # on [1, V+1): ~10x faster than a searchsorted over a 300k-entry CDF.
        self.zipf_a = rng.uniform(1.05, 1.35, NUM_CAT)
        vocab = np.asarray(VOCAB_SIZES, dtype=np.float64)
        self._inv_exp = 1.0 / (1.0 - self.zipf_a)
        self._span = (vocab + 1.0) ** (1.0 - self.zipf_a) - 1.0
        self.id_salt = np.uint64(int(rng.integers(0, 2**62)))
        # Per-value effects: most fields matter a little, a few a lot.
        field_scale = rng.choice([0.08, 0.15, 0.3, 0.5], size=NUM_CAT, p=[0.35, 0.3, 0.25, 0.1])
        self.cat_effects = [rng.normal(0.0, field_scale[f], v) for f, v in enumerate(VOCAB_SIZES)]

        # Dense: correlated through one latent factor, as counts of the same
        # impression usually are.
        self.dense_beta = rng.normal(0.0, 0.35, NUM_DENSE) * (rng.random(NUM_DENSE) < 0.7)
        # A U-shaped (or inverted) effect on three features: invisible to a
        # linear model, so the deep parts have something of their own to find.
        self.dense_quad = np.zeros(NUM_DENSE)
        nonlin = rng.choice(NUM_DENSE, 3, replace=False)
        self.dense_quad[nonlin] = rng.choice([-1.0, 1.0], 3) * rng.uniform(0.15, 0.3, 3)

        # Crossed pairs: an effect table over the head values of both fields
        # (ranks beyond K share the last row/column).
        self.cross_k = 24
        self.cross_tables = [rng.normal(0.0, 0.6, (self.cross_k, self.cross_k)) for _ in CROSSED_PAIRS]

        # Calibrate on a sample of the world's own rows (a stream no file uses).
        _, raw = self._draw(np.random.default_rng([seed, 0, 1]), 32_768)
        self.norm = SIGNAL_STD / float(raw.std())
        self.bias = _solve_bias(self.strength * self.norm * raw, base_ctr)

    # -- drawing

    def _draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n rows without labels: (records, raw signal: the logit before norm, strength and bias)."""
        rec = np.zeros(n, dtype=RECORD_DTYPE)
        logit = np.zeros(n, dtype=np.float64)

        # Dense counts: floor(lognormal) with a shared latent factor.
        latent = rng.standard_normal(n)
        z = 0.5 * latent[:, None] + np.sqrt(0.75) * rng.standard_normal((n, NUM_DENSE))
        x = np.floor(np.exp(np.asarray(DENSE_MU) + np.asarray(DENSE_SIGMA) * z) - 0.5)
        x = np.maximum(x, 0.0)
        # I2 carries -1 in places in the real data.
        x[:, 1] = np.where(rng.random(n) < 0.05, -1.0, x[:, 1])
        missing = rng.random((n, NUM_DENSE)) < np.asarray(DENSE_MISSING)
        x[missing] = np.nan
        rec["dense"] = x.astype(np.float32)
        # Effects act on exactly what models see: log1p(max(x,0)), NaN -> 0,
        # standardised by the nominal location/scale.
        t = np.log1p(np.maximum(np.nan_to_num(rec["dense"].astype(np.float64), nan=0.0), 0.0))
        t = (t - np.asarray(DENSE_MU)) / np.asarray(DENSE_SIGMA)
        logit += t @ self.dense_beta + (t * t - 1.0) @ self.dense_quad

        # Categoricals: Zipf ranks -> effects and 32-bit ids.
        # One uniform per cell decides both "missing" (u < m) and, rescaled
        # to [0, 1), the value's rank.
        m = np.asarray(CAT_MISSING)
        u = rng.random((n, NUM_CAT))
        miss = u < m
        v = np.clip((u - m) / (1.0 - m), 0.0, 1.0)
        ranks = np.floor((1.0 + v * self._span) ** self._inv_exp).astype(np.int64) - 1
        ranks = np.clip(ranks, 0, np.asarray(VOCAB_SIZES) - 1)
        ids = _splitmix32((np.arange(NUM_CAT, dtype=np.uint64)[None, :] << np.uint64(40)) ^ ranks.astype(np.uint64) ^ self.id_salt)
        ids[ids == 0] = 1
        ids[miss] = 0
        rec["cat"] = ids
        for f in range(NUM_CAT):
            logit += np.where(miss[:, f], 0.0, self.cat_effects[f][ranks[:, f]])
        k = self.cross_k
        for (a, b), table in zip(CROSSED_PAIRS, self.cross_tables, strict=True):
            ra = np.where(miss[:, a], k - 1, np.minimum(ranks[:, a], k - 1))
            rb = np.where(miss[:, b], k - 1, np.minimum(ranks[:, b], k - 1))
            logit += table[ra, rb]

        return rec, logit

    def block(self, stream: int, index: int, rows: int = GEN_BLOCK_ROWS) -> tuple[np.ndarray, np.ndarray]:
        """Block ``index`` of ``stream``: (records, true click probabilities), ``rows`` <= a full block."""
        if stream < 0 or index < 0:
            raise ValueError("stream and index must be >= 0")
        rng = np.random.default_rng([self.seed, stream + 1, index])
        full, raw = self._draw(rng, GEN_BLOCK_ROWS)
        logit = self.bias + self.strength * self.norm * raw
        full["label"] = (rng.random(GEN_BLOCK_ROWS) < _sigmoid(logit)).astype(np.float32)
        # Always draw a full block, then cut: the first k rows of a file do
        # not depend on how many rows the file has.
        return full[:rows], _sigmoid(logit[:rows])

    def chunks(self, rows: int, stream: int = 0) -> Iterator[np.ndarray]:
        """``rows`` records of ``stream`` in blocks."""
        for i, start in enumerate(range(0, rows, GEN_BLOCK_ROWS)):
            yield self.block(stream, i, min(GEN_BLOCK_ROWS, rows - start))[0]


def _solve_bias(signal: np.ndarray, ctr: float) -> float:
    """The bias b with mean(sigmoid(b + strength * signal)) = ctr, by bisection (monotone in b)."""
    lo, hi = -20.0, 20.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if float(np.mean(_sigmoid(mid + signal))) < ctr:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def generate(
    dst: str | os.PathLike[str],
    rows: int,
    seed: int,
    *,
    stream: int = 0,
    strength: float = DEFAULT_STRENGTH,
    base_ctr: float = DEFAULT_BASE_CTR,
) -> int:
    """Write ``rows`` Criteo-like records with a planted signal to a RecordFile; returns ``rows``.

    The file is a pure function of ``(rows, seed, stream, strength,
    base_ctr)``.  Use another ``stream`` of the same seed for a held-out set
    with the same signal (see :func:`heldout_path`).
    """
    if rows < 0:
        raise ValueError("rows must be >= 0")
    gen = CriteoLikeGenerator(seed, strength, base_ctr)
    return RecordFile.write(dst, gen.chunks(rows, stream))


def heldout_path(path: str | os.PathLike[str]) -> Path:
    """Where ``pacer data gen --test-rows`` puts the held-out split of ``path``: ``path + ".test"``."""
    return Path(os.fspath(path) + ".test")


__all__ = [
    "CSV_HEADER",
    "NUM_CAT",
    "NUM_DENSE",
    "RECORD_DTYPE",
    "BadRecordFile",
    "CriteoLikeGenerator",
    "DataError",
    "Layout",
    "MalformedLine",
    "RecordFile",
    "cat_id",
    "convert",
    "detect_layout",
    "features",
    "generate",
    "heldout_path",
    "iter_criteo",
    "read_criteo",
    "shuffle_within",
]
