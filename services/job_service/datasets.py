"""The datasets of a submission, checked where they are: local files under the data roots, object
storage, or a JetStream stream.

Dataset files: a spec's ``dataset.path`` and ``dataset.test_path``
come from whoever holds the API token, and the job service opens them on its
host.  So a local path (or ``file://`` URL, or every file a local glob
matches) may only name a regular file under one of the data roots
(``PACER_DATA_ROOTS``; :func:`dataset_file`): the path is resolved first
(relative to the working directory; ``..`` and every symlink followed) and
the result must lie under a resolved root.  Object storage URLs
(:data:`REMOTE_SCHEMES`) are read with the credentials of this service's
environment (or a mounted Secret), never with any from the spec.  A missing file, a file outside
the roots and one that is not a regular file get the very same error, so
the answer tells nothing about the host beyond the roots; and no error
quotes a file's bytes (:mod:`pacer.data.criteo` says what is wrong with a
line or header, not what it holds).  The record stores the resolved path,
the file that was checked.

A stream dataset (``jetstream://<STREAM>``, :meth:`Datasets.check_stream`)
is checked on the bus instead: the stream exists, has ``allow_direct``, is
not one of Pacer's own; its ``start`` is resolved to a sequence and its
column kinds read from its first samples (or the schema).  It is registered
as a streaming dataset naming the stream, which the shard service then
follows (docs/data.md).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import nats.js.errors
from pacer.bus import Bus
from pacer.contracts.jobs import DataFormat, JobSpec
from pacer.data.stream import parse_stream_uri, stream_uri
from pacer.errors import ValidationError
from pacer.telemetry import Counters

#: Rows of a CSV/TSV/TFRecord dataset parsed at submit (the rest is parsed by the workers that read it).
SAMPLE_ROWS = 1000

#: Object storage a dataset URL may name (read with this service's own credentials; fsspec's protocols).
REMOTE_SCHEMES = ("s3", "s3a", "gs", "gcs", "hdfs", "abfs", "az")


def dataset_file(path: str, roots: Sequence[Path], field: str) -> Path:
    """The resolved path of the dataset file ``path``, if it is a regular file under one of ``roots``
    (resolved directories); else :func:`_refused`.

    Resolve, then check: ``os.path.realpath`` takes a relative path from the
    working directory and follows every ``..`` and symlink, so neither can
    lead out of a root that the check then approves.  Whether the file is
    missing, outside the roots or not a regular file (a directory, a FIFO, a
    device) is not told apart: the same error for all.
    """
    try:
        real = Path(os.path.realpath(path))
        if any(real.is_relative_to(root) for root in roots) and real.is_file():
            return real
    except (OSError, ValueError):  # a component too long, a NUL byte: no such file either
        pass
    raise _refused(path, field)


def _refused(path: str, field: str) -> ValidationError:
    return ValidationError(f"{field}: {path!r} is not a file under the job service's data roots "
                           "(PACER_DATA_ROOTS)")


class Datasets:
    """Checks a spec's datasets for the job service (``data_dir``: indexes and converted files;
    ``data_roots``: where local dataset files may be, ``data_dir`` alone when empty)."""

    def __init__(self, bus: Bus, counters: Counters, data_dir: Path, data_roots: Sequence[Path] = ()) -> None:
        self.bus = bus
        self.counters = counters
        self.data_dir = data_dir
        self.data_roots = tuple(data_roots)

    async def check_stream(self, spec: JobSpec) -> tuple[JobSpec, str, int, dict[str, str]]:
        """A stream dataset, checked: (the spec with ``options.first_seq`` resolved, its URI, the samples
        it holds from there now, the column kinds).

        The stream must exist, be one a job may read
        (:func:`pacer.data.stream.check_data_stream`) and have ``allow_direct`` on (the workers read by
        direct get).  The kinds come from its first samples from ``first_seq``, or from the schema when
        there are none yet (:func:`pacer.data.stream.schema_kinds`); the schema must fit them.
        """
        from pacer.data.schema import Schema
        from pacer.data.stream import StreamError, StreamReader, check_data_stream, schema_kinds

        d = spec.dataset
        try:
            name = check_data_stream(parse_stream_uri(d.path))
        except StreamError as exc:
            raise ValidationError(f"dataset.path: {exc}") from None
        try:
            info = await self.bus.js.stream_info(name)
        except nats.js.errors.NotFoundError:
            self.counters.inc("dataset_unreadable")
            raise ValidationError(f"dataset.path: no JetStream stream {name!r} (create it, with allow_direct, "
                                  "before submitting)") from None
        assert info.state is not None and info.config is not None
        if not info.config.allow_direct:
            raise ValidationError(f"dataset.path: stream {name!r} has allow_direct off; workers read samples by "
                                  f"direct get: turn it on (nats stream edit {name} --allow-direct)")
        first_kept, last = int(info.state.first_seq), int(info.state.last_seq)
        start = d.options.get("start", "first")
        first = max(1, first_kept if start == "first" else last + 1 if start == "new" else int(start))
        if first < first_kept and last >= first:
            raise ValidationError(f"dataset.options.start: stream {name!r} no longer holds sequence {first} "
                                  f"(its first is {first_kept})")
        schema = Schema.from_config(d.schema) if d.schema else Schema.criteo()
        reader = StreamReader(self.bus.nc, self.bus.js, name, first)
        try:
            rows = await reader.refresh()  # the kinds of up to INFER_SAMPLES samples, if there are any
        except StreamError as exc:
            self.counters.inc("dataset_unreadable")
            raise ValidationError(f"dataset.path: {exc}") from None
        kinds = reader.kinds or schema_kinds(schema)
        problems = schema.check(kinds)
        if problems:
            self.counters.inc("dataset_schema_mismatch")
            raise ValidationError("\n".join(f"dataset.schema: {p}" for p in problems))
        spec = replace(spec, dataset=replace(d, options={**d.options, "first_seq": first}))
        return spec, stream_uri(name), rows, kinds

    def index_dir(self) -> Path:
        return (self.data_dir / "index").resolve()

    def check_files(self, spec: JobSpec) -> tuple[str, str, int, dict[str, str]]:
        """The datasets the workers read in place, checked: (data, held-out data, records, columns).

        Reads metadata only where the format has it (Parquet footers, a record
        file's header); a CSV or TFRecord dataset is scanned once for its
        row-offset index, kept under ``<data_dir>/index`` for the workers.
        Only local files under the data roots (module docstring); an error says
        what is wrong with a dataset, never what it holds.
        """
        from pacer.data.schema import Schema

        d = spec.dataset
        schema = Schema.from_config(d.schema) if d.schema else Schema.criteo()
        data_path, records, columns = self._one(spec, d.path, "train", "dataset.path", schema)
        if records == 0:
            raise ValidationError(f"dataset.path: {d.path} holds no records")
        if d.records:
            records = min(records, d.records)
        eval_path = ""
        if d.test_path:
            eval_path, _, _ = self._one(spec, d.test_path, "test", "dataset.test_path", schema)
        return data_path, eval_path, records, columns

    def _one(self, spec: JobSpec, path: str, name: str, field: str,
                     schema: Any) -> tuple[str, int, dict[str, str]]:
        from pacer.data.criteo import MalformedLine, convert
        from pacer.data.sources import SourceError, describe

        fmt = spec.dataset.format
        uri = self._located(path, field)
        if fmt in (DataFormat.CRITEO_TSV, DataFormat.CRITEO_CSV) and uri.endswith(".gz"):
            # gzip cannot be read by row ranges: the one dataset still converted (docs/data.md).
            dst = self.data_dir / "datasets" / spec.name / f"{name}.rec"
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                convert(uri, dst)
            except MalformedLine as exc:
                raise ValidationError(f"{field}: {path!r} is not {fmt.value}: line {exc.line}: {exc.reason}") from None
            except Exception as exc:
                # Only the kind: the messages of gzip, zlib and the codecs may quote the file's bytes.
                raise ValidationError(f"{field}: {path!r} cannot be read as {fmt.value} "
                                      f"({type(exc).__name__})") from None
            uri, fmt = str(dst), DataFormat.RECORD
            spec_fmt = "record"
        else:
            spec_fmt = fmt.value
        try:
            with describe(uri, spec_fmt, index_dir=self.index_dir(),
                          csv_options=dict(spec.dataset.options) or None) as src:
                if self._is_local(uri):  # a glob's matches, each under the roots
                    for f in src.files:
                        dataset_file(f, self._roots(), field)
                columns = {c.name: c.kind for c in src.columns}
                rows = int(src.rows)
                if spec_fmt not in ("parquet", "record"):
                    # Text and Examples carry no types: parse a sample, so that a file in the wrong layout
                    # fails here, with its line, and not in every worker (a bad line deep inside fails the
                    # shard that holds it; docs/data.md).
                    src.read(0, min(rows, SAMPLE_ROWS))
        except SourceError as exc:
            self.counters.inc("dataset_unreadable")
            raise ValidationError(f"{field}: {exc}") from None
        problems = schema.check(columns)
        if problems:
            self.counters.inc("dataset_schema_mismatch")
            raise ValidationError("\n".join(f"dataset.schema: {p}" for p in problems))
        return uri, rows, columns

    def export_location(self, path: str) -> str:
        """Where the chief may write SavedModels: a directory under the data roots (resolved; it may not
        exist yet), or an object-storage URL of :data:`REMOTE_SCHEMES`."""
        if not self._is_local(path):
            return self._located(path, "export.path")
        real = Path(os.path.realpath(path.removeprefix("file://")))
        if not any(real.is_relative_to(root) for root in self._roots()):
            raise ValidationError(f"export.path: {path!r} is not under the job service's data roots "
                                  "(PACER_DATA_ROOTS)")
        return str(real)

    def _roots(self) -> list[Path]:
        return [Path(os.path.realpath(r)) for r in self.data_roots or (self.data_dir,)]

    @staticmethod
    def _is_local(path: str) -> bool:
        return "://" not in path or path.startswith("file://")

    def _located(self, path: str, field: str) -> str:
        """``path`` as the workers will open it: a local path (or glob) resolved under the data roots,
        or an object-storage URL of :data:`REMOTE_SCHEMES`."""
        if not self._is_local(path):
            scheme = path.split("://", 1)[0].lower()
            if scheme not in REMOTE_SCHEMES:
                raise ValidationError(f"{field}: URL scheme {scheme!r} is not one of {', '.join(REMOTE_SCHEMES)}")
            return path
        local = path.removeprefix("file://")
        if glob.has_magic(local):
            # The directory part before the first wildcard must lie under a root; each match is checked too.
            head = local[:min(local.index(ch) for ch in "*?[" if ch in local)]
            base = os.path.dirname(head) or "."
            real = Path(os.path.realpath(base))
            if not any(real.is_relative_to(root) for root in self._roots()):
                raise _refused(path, field)
            return str(real / local[len(base):].lstrip("/")) if base != "." else str(real / local)
        return str(dataset_file(local, self._roots(), field))

