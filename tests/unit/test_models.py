"""The three models build from a feature schema in graph mode with deterministic names, spread
their embeddings over PS tasks, compute Criteo's features exactly as the record pipeline did,
learn planted signals (Criteo-like and a custom schema with every column type), and the numpy
metrics agree with their definitions."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf
from pacer.data import criteo
from pacer.data.schema import Schema
from pacer.models.common import ModelSpec, field_embeddings, session_config
from pacer.models.features import Features, RawInputs, raw_inputs
from pacer.models.metrics import auc, logloss
from pacer.models.registry import MODELS, ModelGraph, build

v1 = tf.compat.v1
NAMES = sorted(MODELS)
CRITEO = Schema.criteo()
CRITEO_KINDS = {"label": "float", **{f"I{i}": "float" for i in range(1, 14)}, **{f"C{i}": "int" for i in range(1, 27)}}

Columns = dict[str, np.ndarray]


def criteo_columns(records: np.ndarray) -> Columns:
    """Record-file records as the columns a source returns: label, I1..I13 float32, C1..C26 int64."""
    cols: Columns = {"label": records["label"].astype(np.float32)}
    for i in range(13):
        cols[f"I{i + 1}"] = records["dense"][:, i].astype(np.float32)
    for i in range(26):
        cols[f"C{i + 1}"] = records["cat"][:, i].astype(np.int64)
    return cols


def take(cols: Columns, s: slice) -> Columns:
    return {k: v[s] for k, v in cols.items()}


def build_on(spec: ModelSpec, schema: Schema = CRITEO, kinds: dict[str, str] = CRITEO_KINDS,
             partitions: int = 1, **kw: Any) -> tuple[ModelGraph, RawInputs]:
    raw = raw_inputs(schema, kinds)
    return build(spec, schema, raw.tensors, num_ps_partitions=partitions, **kw), raw


def variables_of(spec: ModelSpec, partitions: int = 1) -> list[tuple[str, list[int]]]:
    with tf.Graph().as_default():
        model, _ = build_on(spec, partitions=partitions)
        model.train_op()
        return [(v.name, v.shape.as_list()) for v in v1.global_variables()]


@pytest.mark.parametrize("name", NAMES)
def test_builds_with_deterministic_variable_names(name: str) -> None:
    spec = ModelSpec(name=name, hash_buckets=500)
    first, second = variables_of(spec), variables_of(spec)
    assert first == second
    model_vars = [n for n, _ in first if not n.startswith(("beta", "global_step"))]
    assert all(n.startswith(f"{name}/") for n in model_vars), model_vars
    assert any(n.endswith("embeddings/part_0:0") for n, _ in first)  # partitioned even into 1 part
    # The Criteo layout of before the schema: one [26 * buckets, dim] table, checkpoints stay readable.
    assert (next(n for n, _ in first if n.endswith("embeddings/part_0:0")), [26 * 500, 8]) in first


@pytest.mark.parametrize("name", NAMES)
def test_embeddings_are_partitioned_across_ps_tasks(name: str) -> None:
    spec = ModelSpec(name=name, hash_buckets=500, embed_dim=4)
    schema = Schema.from_config({**CRITEO.to_config(), "categorical": [
        *(f"C{i}" for i in range(1, 26)), {"name": "C26", "vocabulary": ["a", "b"]}]})
    with tf.Graph().as_default() as g:
        setter = v1.train.replica_device_setter(ps_tasks=2, worker_device="/job:worker/task:0")
        with v1.device(setter):
            model, _ = build_on(spec, schema, {**CRITEO_KINDS, "C26": "string"}, partitions=2)
        assert model.embedding_tables
        for table in model.embedding_tables:
            parts = list(table)
            assert len(parts) == 2
            assert sum(p.shape[0] for p in parts) == 25 * 500 + 3
            devices = {p.device for p in parts}
            assert devices == {"/job:ps/task:0", "/job:ps/task:1"}, devices
        emb = [t for t in model.embedding_tables if t.get_shape().as_list()[1] == 4]
        assert len(emb) == 1  # one [sum of buckets, dim] table shared by all fields
        # The vocabulary table is no variable: it stays with the worker, which initialises it.
        tables = [op for op in g.get_operations() if op.type == "HashTableV2"]
        assert tables and all(op.device == "/job:worker/task:0" for op in tables)


def test_unknown_model_and_bad_spec_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown model"), tf.Graph().as_default():
        build_on(ModelSpec(name="deepfm"))
    with pytest.raises(ValueError, match="optimizer"):
        ModelSpec(optimizer="rmsprop")
    assert ModelSpec(hidden=[8, 4]).hidden == (8, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no input for the label"), tf.Graph().as_default():
        build(ModelSpec(), CRITEO, raw_inputs(CRITEO, CRITEO_KINDS, with_label=False).tensors)


def test_criteo_schema_gives_the_record_pipelines_features(tmp_path: Path) -> None:
    """In-graph features of record-file columns == pacer.data.criteo.features(): same ids, so
    models trained before the schema keep their meaning."""
    path = tmp_path / "c.rec"
    criteo.generate(path, 700, seed=3)
    with criteo.RecordFile.open(path) as rf:
        records = rf.read(0, len(rf))
    records["dense"][:5, 0] = np.nan  # missing counts
    records["dense"][5:10, 1] = -3.0  # Criteo has a few negatives
    dense, cat_ids, labels = criteo.features(records, 1009)
    with tf.Graph().as_default():
        model, raw = build_on(ModelSpec(hash_buckets=1009))
        f = model.features
        ids = tf.stack([field[0] for field in f.fields], axis=1)
        with v1.Session(config=session_config(1)) as sess:
            got_dense, got_ids, got_labels = sess.run([f.dense, ids, f.labels], raw.feed(criteo_columns(records)))
    assert [field[1:] for field in f.fields] == [(1009, 8, "")] * 26
    np.testing.assert_array_equal(got_ids, cat_ids)
    np.testing.assert_allclose(got_dense, dense, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got_labels, labels)


# --------------------------------------------------------- training on Criteo

HASH = 5_000


@pytest.fixture(scope="module")
def data() -> dict[str, Columns]:
    gen = criteo.CriteoLikeGenerator(4)
    return {"train": criteo_columns(gen.block(0, 0, 60_000)[0]), "test": criteo_columns(gen.block(1, 0, 20_000)[0])}


def fit(spec: ModelSpec, schema: Schema, kinds: dict[str, str], train: Columns, test: Columns, steps: int,
        batch: int = 256) -> tuple[float, float, float]:
    """Held-out (loss before, loss after, AUC after) of ``steps`` batches, on 2 PS partitions."""
    n = len(train[schema.label])
    with tf.Graph().as_default():
        v1.set_random_seed(0)
        model, raw = build_on(spec, schema, kinds, partitions=2)
        op = model.train_op()
        with v1.Session(config=session_config(1)) as sess:
            sess.run([v1.global_variables_initializer(), v1.tables_initializer()])
            before = sess.run(model.loss, raw.feed(test))
            for i in range(steps):
                a = i * batch % (n - batch)
                sess.run(op, raw.feed(take(train, slice(a, a + batch))))
            after, probs = sess.run([model.loss, model.probs], raw.feed(test))
    return float(before), float(after), auc(test[schema.label], probs)


@pytest.mark.parametrize("name", ["xdeepfm", "dcn"])
def test_short_training_lowers_the_held_out_loss(name: str, data: dict[str, Columns]) -> None:
    spec = ModelSpec(name=name, hash_buckets=HASH)
    before, after, score = fit(spec, CRITEO, CRITEO_KINDS, data["train"], data["test"], steps=120)
    assert after < before - 0.03, (before, after)
    # DCN has no per-id linear part, so after 120 steps it sits near 0.60
    # (xDeepFM ~0.71); both approach W&D with a full epoch (bench/auc_check.py).
    assert score > 0.57, score


def test_wide_deep_learns_the_planted_signal(data: dict[str, Columns]) -> None:
    spec = ModelSpec(name="wide_deep", hash_buckets=HASH)
    steps = len(data["train"]["label"]) // 256  # one epoch
    before, after, score = fit(spec, CRITEO, CRITEO_KINDS, data["train"], data["test"], steps=steps)
    assert after < before - 0.05, (before, after)
    assert score > 0.68, score


def test_loss_scale_multiplies_the_training_loss() -> None:
    cols = criteo_columns(criteo.CriteoLikeGenerator(2).block(0, 0, 64)[0])
    with tf.Graph().as_default():
        scale = v1.placeholder(tf.float32, [], name="loss_scale")
        model, raw = build_on(ModelSpec(name="dcn", hash_buckets=100), loss_scale=scale)
        weighted = model.weighted_loss(3.0)
        with v1.Session(config=session_config(1)) as sess:
            sess.run(v1.global_variables_initializer())
            loss, train_loss, w = sess.run(
                [model.loss, model.train_loss, weighted], {**raw.feed(cols), scale: 0.25}
            )
    assert train_loss == pytest.approx(0.25 * loss, rel=1e-6)
    assert w == pytest.approx(3.0 * loss, rel=1e-6)


# ------------------------------------------------------- a schema of its own

CUSTOM = Schema.from_config({
    "label": "click",
    "dense": [{"name": "price", "transform": "log1p"}, {"name": "age", "transform": "standardize", "mean": 40,
                                                          "std": 12}],
    "categorical": [{"name": "city", "buckets": 211}, {"name": "device", "vocabulary": ["ios", "android", "web"]}],
    "multi_hot": [{"name": "tags", "combiner": "sum", "buckets": 101},
                  {"name": "genres", "combiner": "mean", "vocabulary": [f"g{i}" for i in range(8)]},
                  {"name": "recent", "combiner": "sqrtn", "buckets": 301}],
    "weight": "w",
})
CUSTOM_KINDS = {"click": "int", "price": "float", "age": "int", "city": "string", "device": "string",
                "tags": "list<string>", "genres": "list<string>", "recent": "list<int>", "w": "float"}


def custom_data(n: int, seed: int) -> Columns:
    """Rows with a planted signal in every column type (the same effects for every seed)."""
    fx = np.random.default_rng(99)
    city_fx, tag_fx, genre_fx, item_fx = fx.normal(0, 1.2, 60), fx.normal(0, 1, 40), fx.normal(0, 1, 9), \
        fx.normal(0, 1, 500)
    dev_fx = {"ios": 0.6, "android": -0.4, "web": 0.0, "tv": 1.0}  # "tv" is out of vocabulary
    rng = np.random.default_rng(seed)
    price = rng.lognormal(3, 1.5, n).astype(np.float32)
    price[rng.random(n) < 0.05] = np.nan
    age = rng.integers(18, 80, n)
    city = rng.integers(0, 60, n)
    device = rng.choice(list(dev_fx), n)
    tags = [rng.integers(0, 40, rng.integers(0, 5)) for _ in range(n)]  # some rows have no tags
    genres = [rng.integers(0, 9, rng.integers(1, 4)) for _ in range(n)]  # g8 is out of vocabulary
    recent = [rng.integers(0, 500, rng.integers(0, 8)) for _ in range(n)]
    logit = (0.4 * (np.log1p(np.nan_to_num(price)) - 3) + 0.03 * (age - 40) + city_fx[city]
             + np.array([dev_fx[d] for d in device]) + np.array([tag_fx[t].sum() for t in tags])
             + np.array([genre_fx[g].mean() for g in genres]) + np.array([item_fx[r].sum() / np.sqrt(max(len(r), 1))
                                                                          for r in recent]) - 1.0)
    click = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)

    def objects(rows: list[np.ndarray], fmt: str) -> np.ndarray:
        out = np.empty(n, dtype=object)
        out[:] = [np.array([fmt.format(v) for v in r], dtype=object) for r in rows]
        return out

    recent_col = np.empty(n, dtype=object)
    recent_col[:] = recent
    return {
        "click": click, "price": price, "age": age, "city": np.array([f"city-{c}" for c in city], dtype=object),
        "device": device.astype(object), "tags": objects(tags, "t{}"), "genres": objects(genres, "g{}"),
        "recent": recent_col, "w": rng.uniform(0.5, 2.0, n).astype(np.float32),
    }


@pytest.fixture(scope="module")
def custom() -> dict[str, Columns]:
    return {"train": custom_data(8_000, 1), "test": custom_data(3_000, 2)}


@pytest.mark.parametrize("name", NAMES)
def test_every_model_learns_a_custom_schema(name: str, custom: dict[str, Columns]) -> None:
    spec = ModelSpec(name=name, hash_buckets=1000, embed_dim=4, hidden=(32, 16), learning_rate=0.1)
    before, after, score = fit(spec, CUSTOM, CUSTOM_KINDS, custom["train"], custom["test"], steps=300, batch=128)
    assert after < before - 0.05, (before, after)
    assert score > 0.75, score  # ~0.80 after 300 steps


def test_weighted_loss_is_the_weighted_mean(custom: dict[str, Columns]) -> None:
    cols = take(custom["test"], slice(0, 200))
    with tf.Graph().as_default():
        model, raw = build_on(ModelSpec(hash_buckets=100), CUSTOM, CUSTOM_KINDS)
        with v1.Session(config=session_config(1)) as sess:
            sess.run([v1.global_variables_initializer(), v1.tables_initializer()])
            loss, p = sess.run([model.loss, model.probs], raw.feed(cols))
    y, w = cols["click"], cols["w"]
    per = -(y * np.log(p) + (1 - y) * np.log(1 - p))
    assert loss == pytest.approx(float((w * per).sum() / w.sum()), rel=1e-4)
    assert loss != pytest.approx(float(per.mean()), rel=1e-4)


def test_list_combiners_and_empty_lists() -> None:
    """sum / mean / sqrtn of a list's rows; an empty list gives zeros; fields keep their own rows."""
    with tf.Graph().as_default():
        ids = tf.RaggedTensor.from_row_lengths(tf.constant([1, 2, 3, 0], tf.int64), tf.constant([2, 0, 2], tf.int64))
        single = tf.constant([4, 0, 1], tf.int64)
        got = {}
        for combiner in ("sum", "mean", "sqrtn"):
            f = Features(tf.zeros([3, 0]), [(single, 5, 2, ""), (ids, 4, 2, combiner)])
            with v1.variable_scope(combiner):
                table_init = v1.constant_initializer(np.arange(18, dtype=np.float32).reshape(9, 2))
                emb, _ = field_embeddings(f, None, initializer=table_init)
            got[combiner] = emb
        with v1.Session(config=session_config(1)) as sess:
            sess.run(v1.global_variables_initializer())
            out = sess.run(got)
    rows = np.arange(18, dtype=np.float32).reshape(9, 2)
    for combiner, emb in out.items():
        assert emb.shape == (3, 2, 2)
        np.testing.assert_array_equal(emb[:, 0], rows[[4, 0, 1]])  # the single field: rows 0..4
        lst = rows[5:]  # the list field: rows 5..8 (offset by the single field's 5 buckets)
        total = np.stack([lst[1] + lst[2], np.zeros(2), lst[3] + lst[0]])
        div = {"sum": 1.0, "mean": 2.0, "sqrtn": np.sqrt(2.0)}[combiner]
        np.testing.assert_allclose(emb[:, 1], total / div, rtol=1e-6)


# ------------------------------------------------------- embedding widths

MIXED = Schema.from_config({**CUSTOM.to_config(), "categorical": [
    {"name": "city", "buckets": 211, "embed_dim": 8}, {"name": "device", "vocabulary": ["ios", "android", "web"]}]})


@pytest.mark.parametrize("name", ["wide_deep", "dcn"])
def test_mixed_embedding_widths_get_one_table_each(name: str, custom: dict[str, Columns]) -> None:
    spec = ModelSpec(name=name, hash_buckets=1000, embed_dim=4, hidden=(32, 16), learning_rate=0.1)
    with tf.Graph().as_default():
        build_on(spec, MIXED, CUSTOM_KINDS, partitions=2)
        shapes = {v.name: v.shape.as_list() for v in v1.global_variables()}
    prefix = f"{name}/deep/" if name == "wide_deep" else f"{name}/"
    # d4: device (3 + 1), tags (101), genres (8 + 1), recent (301); d8: city (211); 2 parts each.
    assert shapes[f"{prefix}embeddings_d4/part_0:0"][1] == 4
    assert sum(s[0] for n, s in shapes.items() if "embeddings_d4/" in n) == 4 + 101 + 9 + 301
    assert sum(s[0] for n, s in shapes.items() if "embeddings_d8/" in n) == 211
    assert not any("/embeddings/" in n for n in shapes)
    before, after, _ = fit(spec, MIXED, CUSTOM_KINDS, custom["train"], custom["test"], steps=300, batch=128)
    assert after < before - 0.05, (before, after)


def test_xdeepfm_refuses_mixed_widths() -> None:
    with pytest.raises(ValueError, match="xdeepfm needs one embed_dim for all categorical columns; got city=8, "
                                         "device=4"), tf.Graph().as_default():
        build_on(ModelSpec(name="xdeepfm", embed_dim=4), MIXED, CUSTOM_KINDS)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("config", [
    {"label": "click", "categorical": ["city"], "multi_hot": ["tags"]},  # no dense feature: a bias only
    {"label": "click", "dense": ["price", "age"]},  # no embedding at all
])
def test_schemas_without_dense_or_without_ids_build(name: str, config: dict[str, Any],
                                                    custom: dict[str, Columns]) -> None:
    schema = Schema.from_config(config)
    spec = ModelSpec(name=name, hash_buckets=50, embed_dim=4, hidden=(8,))
    with tf.Graph().as_default():
        if name == "xdeepfm" and "categorical" not in config:
            with pytest.raises(ValueError, match="xdeepfm needs at least one categorical"):
                build_on(spec, schema, CUSTOM_KINDS)
            return
        model, raw = build_on(spec, schema, CUSTOM_KINDS)
        op = model.train_op()
        with v1.Session(config=session_config(1)) as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(op, raw.feed(take(custom["train"], slice(0, 64))))
            p = sess.run(model.probs, raw.feed(take(custom["test"], slice(0, 10))))
    assert p.shape == (10,) and np.all(np.isfinite(p))


# --------------------------------------------------------------------- metrics


def test_auc_matches_the_pairwise_definition_with_ties() -> None:
    rng = np.random.default_rng(0)
    y = rng.random(300) < 0.3
    s = rng.integers(0, 10, 300).astype(float)  # many ties
    pos, neg = s[y], s[~y]
    pairwise = ((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])).mean()
    assert auc(y, s) == pytest.approx(pairwise)
    assert auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert auc([1, 1, 0, 0], [0.1, 0.2, 0.3, 0.4]) == 0.0
    assert auc([0, 1, 0, 1], [0.5] * 4) == 0.5
    assert np.isnan(auc([1, 1], [0.2, 0.3]))


def test_logloss() -> None:
    assert logloss([1, 0], [0.5, 0.5]) == pytest.approx(np.log(2))
    assert logloss([1], [0.0]) == pytest.approx(-np.log(1e-7))  # clipped, finite
