"""The feature schema (no TensorFlow): parsing from plain data with every problem reported once,
round trips, defaults, checking a dataset's columns, and inferring a first schema."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from pacer.data.schema import (
    CategoricalColumn,
    DenseColumn,
    ListColumn,
    Schema,
    SchemaError,
    infer_schema,
)
from pacer.errors import ValidationError

ROOT = Path(__file__).resolve().parents[2]

FULL = {
    "label": "click",
    "dense": [{"name": "x", "transform": "log1p"}, "y", {"name": "z", "transform": "standardize", "mean": 2.0,
                                                           "std": 0.5}],
    "categorical": [{"name": "c", "buckets": 1000, "embed_dim": 8}, "d", {"name": "v", "vocabulary": ["a", "b"]}],
    "multi_hot": [{"name": "tags", "combiner": "sqrtn"}, {"name": "ids", "combiner": "sum", "buckets": 50}],
    "weight": "w",
}


def problems(raw: object) -> list[str]:
    with pytest.raises(SchemaError) as exc:
        Schema.from_config(raw)  # type: ignore[arg-type]
    return exc.value.problems


def test_from_config_reads_names_and_maps() -> None:
    s = Schema.from_config(FULL)
    assert s.label == "click" and s.weight == "w"
    assert s.dense == (DenseColumn("x", "log1p"), DenseColumn("y"), DenseColumn("z", "standardize", 2.0, 0.5))
    assert s.categorical == (
        CategoricalColumn("c", 1000, 8), CategoricalColumn("d"), CategoricalColumn("v", vocabulary=("a", "b"))
    )
    assert s.multi_hot == (ListColumn("tags", combiner="sqrtn"), ListColumn("ids", 50, 0, "sum"))
    assert s.columns() == ("click", "w", "x", "y", "z", "c", "d", "v", "tags", "ids")
    assert s.feature_columns() == ("x", "y", "z", "c", "d", "v", "tags", "ids")


@pytest.mark.parametrize("schema", [Schema.from_config(FULL), Schema.criteo(),
                                    Schema.from_config({"label": "y", "multi_hot": ["t"]})])
def test_to_config_round_trips(schema: Schema) -> None:
    assert Schema.from_config(schema.to_config()) == schema
    # ... also through YAML, as a job spec carries it.
    assert Schema.from_config(yaml.safe_load(yaml.safe_dump(schema.to_config()))) == schema


def test_with_defaults_fills_buckets_and_dims() -> None:
    s = Schema.from_config(FULL).with_defaults(hash_buckets=77, embed_dim=4)
    assert [(c.buckets, c.embed_dim) for c in s.categorical] == [(1000, 8), (77, 4), (3, 4)]  # vocab: 2 + OOV
    assert [(m.buckets, m.embed_dim) for m in s.multi_hot] == [(77, 4), (50, 4)]
    with pytest.raises(ValueError):
        s.with_defaults(0, 4)


def test_criteo_schema_and_example_file_agree() -> None:
    s = Schema.criteo()
    assert s.label == "label"
    assert [d.name for d in s.dense] == [f"I{i}" for i in range(1, 14)]
    assert all(d.transform == "log1p" for d in s.dense)
    assert [c.name for c in s.categorical] == [f"C{i}" for i in range(1, 27)]
    assert all(c.buckets == 0 and c.embed_dim == 0 for c in s.categorical)
    raw = yaml.safe_load((ROOT / "examples/schemas/criteo.yaml").read_text())
    assert Schema.from_config(raw) == s


def test_every_problem_is_reported_at_once_with_its_path() -> None:
    got = problems({
        "dense": [{"name": "x", "transform": "log"}, {"name": "s", "transform": "standardize", "std": 0}],
        "categorical": ["c", {"name": "d", "buckets": -3}, {"name": "e", "embed_dim": "big"},
                        {"name": "v", "vocabulary": ["a", "a"]}, {"name": "u", "vocabulary": ["a"], "buckets": 5}],
        "multi_hot": [{"name": "t", "combiner": "max"}, {"name": "c"}],
        "colour": "red",
    })
    assert "schema.colour: unknown field (known: label, dense, categorical, multi_hot, weight)" in got
    assert "schema.label: required (the name of the 0/1 label column)" in got
    assert "schema.dense[0].transform: must be one of none, log1p, standardize (got 'log')" in got
    assert "schema.dense[1].std: must be > 0" in got
    assert "schema.categorical[1].buckets: must be >= 0 (0 = the model's hash_buckets)" in got
    assert "schema.categorical[2].embed_dim: must be an integer >= 0 (0 = the model's embed_dim)" in got
    assert "schema.categorical[3].vocabulary: has duplicates: a" in got
    assert any(p.startswith("schema.categorical[4].buckets: must be 0 or 2") for p in got)
    assert "schema.multi_hot[0].combiner: must be one of sum, mean, sqrtn (got 'max')" in got
    assert "schema.multi_hot[1].name: duplicate column 'c' (already used by schema.categorical[0].name)" in got
    assert len(got) == 10, got


def test_unknown_keys_duplicates_and_empty_schemas_are_refused() -> None:
    assert problems({"label": "y", "dense": [{"name": "x", "scale": 2}]}) == [
        "schema.dense[0].scale: unknown field (known: name, transform, mean, std)"
    ]
    assert problems({"label": "y", "dense": ["x"], "weight": "y"}) == [
        "schema.weight: duplicate column 'y' (already used by schema.label)"
    ]
    assert problems({"label": "y", "dense": ["x", "x"]}) == [
        "schema.dense[1].name: duplicate column 'x' (already used by schema.dense[0].name)"
    ]
    assert problems({"label": "y"}) == ["schema: needs at least one dense, categorical or multi_hot column"]
    assert problems({"label": "y", "dense": []}) == ["schema: needs at least one dense, categorical or multi_hot column"]
    assert problems({"label": "", "dense": [3]}) == [
        "schema.label: must be a non-empty column name", "schema.dense[0]: must be a column name or a map with a name"
    ]
    assert problems({"label": "y", "dense": "x"}) == ["schema.dense: must be a list of columns (names or maps)"]
    assert problems(["y"]) == ["schema: must be a map with label, dense, categorical, multi_hot, weight"]
    assert problems({"label": "y", "dense": [{"name": "x", "mean": 1}]}) == [
        "schema.dense[0]: mean and std apply only to transform: standardize"
    ]


def test_the_field_path_prefix_is_the_callers() -> None:
    with pytest.raises(ValidationError) as exc:  # the job spec's checker catches ValidationError
        Schema.from_config({"dense": ["x"]}, where="dataset.schema")
    assert str(exc.value) == "dataset.schema.label: required (the name of the 0/1 label column)"


def test_check_names_missing_columns_and_kind_mismatches() -> None:
    s = Schema.from_config(FULL)
    kinds = {"click": "int", "w": "float", "x": "float", "y": "int", "z": "float", "c": "int", "d": "string",
             "v": "string", "tags": "list<string>", "ids": "list<int>"}
    assert s.check(kinds) == []
    bad = dict(kinds, x="string", c="float", tags="string", click="string")
    del bad["w"]
    assert s.check(bad) == [
        "column 'click' is string, but a label column must be float or int",
        "schema names column 'w', which the dataset does not have (it has: c, click, d, ids, tags, v, x, y, z)",
        "column 'x' is string, but a dense column must be float or int",
        "column 'c' is float, but a categorical column must be int or string",
        "column 'tags' is string, but a multi_hot column must be list<int> or list<string>",
    ]


def test_infer_schema_decides_per_column_and_says_why() -> None:
    cols = {"I1": "float", "count": "int", "user_id": "int", "itemId": "int", "width": "int", "city": "string",
            "tags": "list<string>", "hist": "list<int>", "emb": "list<float>", "Click": "int", "weight": "float"}
    s, decisions = infer_schema(cols)
    assert s.label == "Click" and s.weight == "weight"
    assert [d.name for d in s.dense] == ["I1", "count", "width"]
    assert all(d.transform == "none" for d in s.dense)
    assert [c.name for c in s.categorical] == ["user_id", "itemId", "city"]
    assert [(m.name, m.combiner) for m in s.multi_hot] == [("tags", "mean"), ("hist", "mean")]
    assert decisions[0] == "Click: label (int)"
    assert "I1: dense float, no transform (use log1p for counts, standardize for wide ranges)" in decisions
    assert "user_id: categorical int (an id by its name), hashed into the model's buckets" in decisions
    assert "width: dense int, no transform (if it is an id, make it categorical)" in decisions
    assert "emb: skipped (list<float> is neither a dense nor an id column)" in decisions
    assert len(decisions) == len(cols)
    assert s.check(cols) == []
    assert Schema.from_config(s.to_config()) == s
    # A named label wins; a missing one is an error naming the columns.
    assert infer_schema({"a": "float", "b": "int"}, label="b")[0].label == "b"
    with pytest.raises(SchemaError, match="no column named label/click/y/target"):
        infer_schema({"a": "float"})
    with pytest.raises(SchemaError, match="no column 'q'"):
        infer_schema({"a": "float"}, label="q")


def test_schema_module_does_not_import_tensorflow() -> None:
    import subprocess

    code = "import sys, pacer.data.schema; assert 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
