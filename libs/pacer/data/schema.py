"""The feature schema of a dataset: which raw columns a model reads and how.

Pure Python (no TensorFlow), so the job service, the CLI and the SDK can
check a schema without TensorFlow's start-up cost.  The model side
(:mod:`pacer.models.features`) turns a :class:`Schema` into graph ops; all
hashing, vocabulary lookups and transforms happen inside the graph, so
training and the exported SavedModel compute features identically.

A schema names:

* ``label``: the 0/1 click column (float or int);
* ``dense``: numeric columns, each with a transform (``none``, ``log1p`` =
  ``log1p(max(x, 0))``, ``standardize`` = ``(x - mean) / std``); NaN -> 0;
* ``categorical``: one id per row, hashed into ``buckets`` (int columns:
  ``id mod buckets``; string columns: a fingerprint hash) or looked up in a
  ``vocabulary`` (out-of-vocabulary values share one extra id);
* ``multi_hot``: a list of ids per row (tags, history), hashed or looked up
  like ``categorical`` and combined per row by ``sum``, ``mean`` or
  ``sqrtn`` (sum / sqrt(count));
* ``weight``: an optional per-example loss weight column.

``buckets = 0`` and ``embed_dim = 0`` stand for the model's defaults
(``ModelSpec.hash_buckets`` / ``embed_dim``); :meth:`Schema.with_defaults`
fills them in.

Column kinds, as a data source reports them: ``float``, ``int``,
``string``, ``list<float>``, ``list<int>``, ``list<string>``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pacer.errors import ValidationError

TRANSFORMS = ("none", "log1p", "standardize")
COMBINERS = ("sum", "mean", "sqrtn")
KINDS = ("float", "int", "string", "list<float>", "list<int>", "list<string>")
NUMERIC = ("float", "int")
LABEL_NAMES = ("label", "click", "y", "target")
WEIGHT_NAMES = ("weight", "sample_weight")

CRITEO_DENSE = tuple(f"I{i}" for i in range(1, 14))
CRITEO_CAT = tuple(f"C{i}" for i in range(1, 27))


class SchemaError(ValidationError):
    """A schema is invalid; one problem per line, each prefixed by its field path."""

    def __init__(self, problems: Sequence[str]):
        super().__init__("\n".join(problems))
        self.problems = list(problems)


@dataclass(frozen=True, slots=True)
class DenseColumn:
    """A numeric input, transformed in the graph (NaN -> 0 first)."""

    name: str
    transform: str = "none"  # none | log1p | standardize
    mean: float = 0.0  # standardize only
    std: float = 1.0


@dataclass(frozen=True, slots=True)
class CategoricalColumn:
    """One id per row: hashed into ``buckets``, or looked up in ``vocabulary`` (OOV -> one extra id)."""

    name: str
    buckets: int = 0  # 0 = the model's hash_buckets
    embed_dim: int = 0  # 0 = the model's embed_dim
    vocabulary: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ListColumn:
    """A list of ids per row, hashed or looked up like :class:`CategoricalColumn`, combined per row."""

    name: str
    buckets: int = 0
    embed_dim: int = 0
    combiner: str = "mean"  # sum | mean | sqrtn
    vocabulary: tuple[str, ...] = ()


IdColumn = CategoricalColumn | ListColumn


@dataclass(frozen=True, slots=True)
class Schema:
    """Which raw columns a model reads and how (module docstring)."""

    label: str
    dense: tuple[DenseColumn, ...] = ()
    categorical: tuple[CategoricalColumn, ...] = ()
    multi_hot: tuple[ListColumn, ...] = ()
    weight: str = ""

    # ------------------------------------------------------------ plain data

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], where: str = "schema") -> Schema:
        """A schema from plain data (YAML/JSON); every problem is collected and raised once as :class:`SchemaError`.

        ``{label: click, dense: [{name: x, transform: log1p}, "y"],
        categorical: [{name: c, buckets: 1000, embed_dim: 8}, "d"],
        multi_hot: [{name: tags, combiner: sqrtn}], weight: w}``; a bare
        string is a column name with the defaults.
        """
        p = _Problems()
        if not isinstance(raw, Mapping):
            raise SchemaError([f"{where}: must be a map with label, dense, categorical, multi_hot, weight"])
        for key in raw:
            if key not in ("label", "dense", "categorical", "multi_hot", "weight"):
                p.add(f"{where}.{key}", "unknown field (known: label, dense, categorical, multi_hot, weight)")
        label = raw.get("label")
        if label is None:
            p.add(f"{where}.label", "required (the name of the 0/1 label column)")
            label = ""
        elif not _is_name(label):
            p.add(f"{where}.label", "must be a non-empty column name")
            label = ""
        weight = raw.get("weight", "")
        if weight is None:
            weight = ""
        elif weight != "" and not _is_name(weight):
            p.add(f"{where}.weight", "must be a column name")
            weight = ""
        dense = tuple(
            d for i, item in enumerate(_items(p, raw, "dense", where))
            if (d := _dense(p, item, f"{where}.dense[{i}]")) is not None
        )
        cat = tuple(
            c for i, item in enumerate(_items(p, raw, "categorical", where))
            if (c := _categorical(p, item, f"{where}.categorical[{i}]")) is not None
        )
        multi = tuple(
            m for i, item in enumerate(_items(p, raw, "multi_hot", where))
            if (m := _list(p, item, f"{where}.multi_hot[{i}]")) is not None
        )
        if not any(raw.get(k) for k in ("dense", "categorical", "multi_hot")):
            p.add(where, "needs at least one dense, categorical or multi_hot column")
        # Each column plays one role: a name twice is almost always a typo.
        seen: dict[str, str] = {}
        named = [(label, f"{where}.label"), (weight, f"{where}.weight")]
        named += [(d.name, f"{where}.dense[{i}].name") for i, d in enumerate(dense)]
        named += [(c.name, f"{where}.categorical[{i}].name") for i, c in enumerate(cat)]
        named += [(m.name, f"{where}.multi_hot[{i}].name") for i, m in enumerate(multi)]
        for name, path in named:
            if not name:
                continue
            if name in seen:
                p.add(path, f"duplicate column {name!r} (already used by {seen[name]})")
            else:
                seen[name] = path
        p.raise_if_any()
        return cls(label=label, dense=dense, categorical=cat, multi_hot=multi, weight=weight)

    def to_config(self) -> dict[str, Any]:
        """Plain data that :meth:`from_config` turns back into this schema (defaults left out)."""
        out: dict[str, Any] = {"label": self.label}
        if self.dense:
            out["dense"] = [_dense_config(d) for d in self.dense]
        if self.categorical:
            out["categorical"] = [_id_config(c) for c in self.categorical]
        if self.multi_hot:
            out["multi_hot"] = [_id_config(m) for m in self.multi_hot]
        if self.weight:
            out["weight"] = self.weight
        return out

    # ------------------------------------------------------------ derived

    def with_defaults(self, hash_buckets: int, embed_dim: int) -> Schema:
        """Buckets and embedding sizes of 0 replaced by the model's (vocabulary columns: ``len(vocab) + 1``)."""
        if hash_buckets <= 0 or embed_dim <= 0:
            raise ValueError("hash_buckets and embed_dim must be positive")

        def fill(c: Any) -> Any:
            buckets = len(c.vocabulary) + 1 if c.vocabulary else (c.buckets or hash_buckets)
            return replace(c, buckets=buckets, embed_dim=c.embed_dim or embed_dim)

        return replace(
            self,
            categorical=tuple(fill(c) for c in self.categorical),
            multi_hot=tuple(fill(m) for m in self.multi_hot),
        )

    def feature_columns(self) -> tuple[str, ...]:
        """The raw columns that are model inputs (no label, no weight): what serving is fed."""
        return (
            *(d.name for d in self.dense),
            *(c.name for c in self.categorical),
            *(m.name for m in self.multi_hot),
        )

    def columns(self) -> tuple[str, ...]:
        """Every raw column the model reads: the label, the weight (if any), then the features."""
        return (self.label, *((self.weight,) if self.weight else ()), *self.feature_columns())

    def id_columns(self) -> tuple[IdColumn, ...]:
        """The embedded columns in model order: categorical, then multi_hot."""
        return (*self.categorical, *self.multi_hot)

    def check(self, columns: Mapping[str, str]) -> list[str]:
        """Problems of reading a dataset with columns ``name -> kind`` through this schema ([] = fits)."""
        problems: list[str] = []
        have = ", ".join(sorted(columns)) or "no columns"
        wanted: list[tuple[str, str, tuple[str, ...]]] = [("label", self.label, NUMERIC)]
        if self.weight:
            wanted.append(("weight", self.weight, NUMERIC))
        wanted += [("dense", d.name, NUMERIC) for d in self.dense]
        wanted += [("categorical", c.name, ("int", "string")) for c in self.categorical]
        wanted += [("multi_hot", m.name, ("list<int>", "list<string>")) for m in self.multi_hot]
        for role, name, kinds in wanted:
            kind = columns.get(name)
            if kind is None:
                problems.append(f"schema names column {name!r}, which the dataset does not have (it has: {have})")
            elif kind not in kinds:
                problems.append(
                    f"column {name!r} is {kind}, but a {role} column must be {' or '.join(kinds)}"
                )
        return problems

    @classmethod
    def criteo(cls) -> Schema:
        """Criteo's layout: label, I1..I13 (counts, log1p), C1..C26 (ids hashed into the model's buckets)."""
        return cls(
            label="label",
            dense=tuple(DenseColumn(n, "log1p") for n in CRITEO_DENSE),
            categorical=tuple(CategoricalColumn(n) for n in CRITEO_CAT),
        )


def infer_schema(columns: Mapping[str, str], label: str | None = None) -> tuple[Schema, list[str]]:
    """A first schema for a dataset with columns ``name -> kind``, and one human line per decision.

    The label is ``label`` if given, else a column named label/click/y/target
    (any case).  float -> dense (no transform: say ``log1p`` for counts);
    int -> dense, unless its name has an ``id`` word (``user_id``, ``itemId``)
    -> categorical; string -> categorical (hashed); list<int>/list<string>
    -> multi_hot (mean); a numeric column named weight/sample_weight -> the
    weight.  Raises :class:`SchemaError` when no label is found.
    """
    if label is None:
        by_lower = {n.lower(): n for n in columns}
        label = next((by_lower[c] for c in LABEL_NAMES if c in by_lower), None)
        if label is None:
            raise SchemaError([
                f"schema.label: no column named {'/'.join(LABEL_NAMES)}; name the label column "
                f"(columns: {', '.join(columns) or 'none'})"
            ])
    elif label not in columns:
        raise SchemaError([f"schema.label: no column {label!r} (columns: {', '.join(columns) or 'none'})"])
    if columns[label] not in NUMERIC:
        raise SchemaError([f"schema.label: column {label!r} is {columns[label]}, a label must be float or int"])
    decisions = [f"{label}: label ({columns[label]})"]
    dense: list[DenseColumn] = []
    cat: list[CategoricalColumn] = []
    multi: list[ListColumn] = []
    weight = ""
    for name, kind in columns.items():
        if name == label:
            continue
        if not weight and name.lower() in WEIGHT_NAMES and kind in NUMERIC:
            weight = name
            decisions.append(f"{name}: example weight ({kind})")
        elif kind == "float":
            dense.append(DenseColumn(name))
            decisions.append(f"{name}: dense float, no transform (use log1p for counts, standardize for wide ranges)")
        elif kind == "int" and _has_id_word(name):
            cat.append(CategoricalColumn(name))
            decisions.append(f"{name}: categorical int (an id by its name), hashed into the model's buckets")
        elif kind == "int":
            dense.append(DenseColumn(name))
            decisions.append(f"{name}: dense int, no transform (if it is an id, make it categorical)")
        elif kind == "string":
            cat.append(CategoricalColumn(name))
            decisions.append(f"{name}: categorical string, hashed into the model's buckets")
        elif kind in ("list<int>", "list<string>"):
            multi.append(ListColumn(name))
            decisions.append(f"{name}: multi_hot {kind}, hashed, combined by mean")
        else:
            decisions.append(f"{name}: skipped ({kind} is neither a dense nor an id column)")
    if not (dense or cat or multi):
        raise SchemaError(["schema: no usable feature column besides the label"])
    schema = Schema(label, tuple(dense), tuple(cat), tuple(multi), weight)
    return schema, decisions


# ---------------------------------------------------------------- parsing


class _Problems:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, path: str, message: str) -> None:
        self.items.append(f"{path}: {message}")

    def raise_if_any(self) -> None:
        if self.items:
            raise SchemaError(self.items)


def _is_name(v: Any) -> bool:
    return isinstance(v, str) and v.strip() == v and v != ""


def _has_id_word(name: str) -> bool:
    # Words of snake_case, kebab-case and camelCase names: user_id, item-id, itemId, ID.
    words = re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name)
    return any(w.lower() in ("id", "ids") for w in words)


def _items(p: _Problems, raw: Mapping[str, Any], key: str, where: str) -> list[Any]:
    v = raw.get(key)
    if v is None:
        return []
    if isinstance(v, str) or not isinstance(v, Sequence):
        p.add(f"{where}.{key}", "must be a list of columns (names or maps)")
        return []
    return list(v)


def _entry(p: _Problems, item: Any, path: str, fields: tuple[str, ...]) -> dict[str, Any] | None:
    """``item`` as a map with a valid ``name`` and only ``fields``; None when unusable."""
    if isinstance(item, str):
        item = {"name": item}
    if not isinstance(item, Mapping):
        p.add(path, "must be a column name or a map with a name")
        return None
    ok = True
    for key in item:
        if key not in fields:
            p.add(f"{path}.{key}", f"unknown field (known: {', '.join(fields)})")
            ok = False
    if not _is_name(item.get("name")):
        p.add(f"{path}.name", "required: a non-empty column name")
        return None
    return dict(item) if ok else None


def _int(p: _Problems, d: Mapping[str, Any], key: str, path: str, hint: str) -> int:
    v = d.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, int):
        p.add(f"{path}.{key}", f"must be an integer >= 0 ({hint})")
        return 0
    if v < 0:
        p.add(f"{path}.{key}", f"must be >= 0 ({hint})")
        return 0
    return v


def _float(p: _Problems, d: Mapping[str, Any], key: str, path: str, default: float) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        p.add(f"{path}.{key}", "must be a finite number")
        return default
    return float(v)


def _vocabulary(p: _Problems, d: Mapping[str, Any], path: str) -> tuple[str, ...]:
    v = d.get("vocabulary", ())
    if v is None:
        return ()
    if isinstance(v, str) or not isinstance(v, Sequence):
        p.add(f"{path}.vocabulary", "must be a list of strings")
        return ()
    # Ints are accepted and kept as their decimal text: int columns are looked up by it.
    if not all(isinstance(x, str | int) and not isinstance(x, bool) for x in v):
        p.add(f"{path}.vocabulary", "must be a list of strings")
        return ()
    vocab = tuple(str(x) for x in v)
    if len(set(vocab)) != len(vocab):
        dup = sorted({x for x in vocab if vocab.count(x) > 1})
        p.add(f"{path}.vocabulary", f"has duplicates: {', '.join(dup[:5])}")
    return vocab


def _ids(p: _Problems, d: Mapping[str, Any], path: str) -> tuple[int, int, tuple[str, ...]]:
    buckets = _int(p, d, "buckets", path, "0 = the model's hash_buckets")
    embed = _int(p, d, "embed_dim", path, "0 = the model's embed_dim")
    vocab = _vocabulary(p, d, path)
    if vocab and buckets not in (0, len(vocab) + 1):
        p.add(f"{path}.buckets", f"must be 0 or {len(vocab) + 1} (the vocabulary's size + 1 for unknown values)")
    return buckets, embed, vocab


def _dense(p: _Problems, item: Any, path: str) -> DenseColumn | None:
    d = _entry(p, item, path, ("name", "transform", "mean", "std"))
    if d is None:
        return None
    transform = d.get("transform", "none")
    if transform not in TRANSFORMS:
        p.add(f"{path}.transform", f"must be one of {', '.join(TRANSFORMS)} (got {transform!r})")
        transform = "none"
    mean = _float(p, d, "mean", path, 0.0)
    std = _float(p, d, "std", path, 1.0)
    if std <= 0:
        p.add(f"{path}.std", "must be > 0")
        std = 1.0
    if transform != "standardize" and ("mean" in d or "std" in d):
        p.add(path, "mean and std apply only to transform: standardize")
    return DenseColumn(d["name"], transform, mean, std)


def _categorical(p: _Problems, item: Any, path: str) -> CategoricalColumn | None:
    d = _entry(p, item, path, ("name", "buckets", "embed_dim", "vocabulary"))
    if d is None:
        return None
    buckets, embed, vocab = _ids(p, d, path)
    return CategoricalColumn(d["name"], buckets, embed, vocab)


def _list(p: _Problems, item: Any, path: str) -> ListColumn | None:
    d = _entry(p, item, path, ("name", "buckets", "embed_dim", "combiner", "vocabulary"))
    if d is None:
        return None
    buckets, embed, vocab = _ids(p, d, path)
    combiner = d.get("combiner", "mean")
    if combiner not in COMBINERS:
        p.add(f"{path}.combiner", f"must be one of {', '.join(COMBINERS)} (got {combiner!r})")
        combiner = "mean"
    return ListColumn(d["name"], buckets, embed, combiner, vocab)


def _dense_config(d: DenseColumn) -> str | dict[str, Any]:
    if d.transform == "none":
        return d.name
    out: dict[str, Any] = {"name": d.name, "transform": d.transform}
    if d.transform == "standardize":
        out["mean"], out["std"] = d.mean, d.std
    return out


def _id_config(c: IdColumn) -> str | dict[str, Any]:
    out: dict[str, Any] = {"name": c.name}
    if c.buckets:
        out["buckets"] = c.buckets
    if c.embed_dim:
        out["embed_dim"] = c.embed_dim
    if isinstance(c, ListColumn) and c.combiner != "mean":
        out["combiner"] = c.combiner
    if c.vocabulary:
        out["vocabulary"] = list(c.vocabulary)
    return out if len(out) > 1 else c.name
