"""A model trained on partitioned tables, exported as a SavedModel, scores a test set in a fresh
process (raw columns in: strings hashed and looked up inside the SavedModel) exactly as the
training process did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf
from pacer.data.schema import Schema
from pacer.models.common import ModelSpec, session_config
from pacer.models.export import CheckpointValues, export_saved_model, model_values
from pacer.models.features import INT_PAD, STRING_PAD, raw_inputs
from pacer.models.metrics import auc
from pacer.models.registry import MODELS, build

v1 = tf.compat.v1

SCHEMA = Schema.from_config({
    "label": "click",
    "dense": [{"name": "price", "transform": "log1p"}, "score"],
    "categorical": ["city", {"name": "device", "vocabulary": ["ios", "android", "web"]}, "shop"],
    "multi_hot": [{"name": "tags", "combiner": "sqrtn"}, {"name": "recent", "combiner": "sum", "buckets": 97}],
    "weight": "w",
})
KINDS = {"click": "float", "price": "float", "score": "float", "city": "string", "device": "string", "shop": "int",
         "tags": "list<string>", "recent": "list<int>", "w": "float"}


def make_data(n: int, seed: int) -> dict[str, np.ndarray]:
    fx = np.random.default_rng(7)
    city_fx, shop_fx, tag_fx, item_fx = fx.normal(0, 1, 40), fx.normal(0, 1, 30), fx.normal(0, 1, 25), \
        fx.normal(0, 1, 200)
    dev_fx = {"ios": 0.5, "android": -0.5, "web": 0.0, "tv": 0.8}  # "tv": out of vocabulary
    rng = np.random.default_rng(seed)
    price = rng.lognormal(2, 1, n).astype(np.float32)
    score = rng.normal(0, 1, n).astype(np.float32)
    city, shop = rng.integers(0, 40, n), rng.integers(0, 30, n) * 1_000_003  # large raw int ids
    device = rng.choice(list(dev_fx), n)
    tags = [rng.integers(0, 25, rng.integers(0, 4)) for _ in range(n)]
    recent = [rng.integers(0, 200, rng.integers(0, 6)) for _ in range(n)]
    logit = (0.3 * (np.log1p(price) - 2) + 0.5 * score + city_fx[city] + shop_fx[shop // 1_000_003]
             + np.array([dev_fx[d] for d in device]) + np.array([tag_fx[t].sum() / np.sqrt(max(len(t), 1))
                                                                 for t in tags])
             + np.array([item_fx[r].sum() for r in recent]) - 0.8)
    tags_col = np.empty(n, dtype=object)
    tags_col[:] = [np.array([f"tag{t}" for t in ts], dtype=object) for ts in tags]
    recent_col = np.empty(n, dtype=object)
    recent_col[:] = recent
    return {
        "click": (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32),
        "price": price, "score": score, "city": np.array([f"c{c}" for c in city], dtype=object),
        "device": device.astype(object), "shop": shop.astype(np.int64), "tags": tags_col, "recent": recent_col,
        "w": rng.uniform(0.5, 1.5, n).astype(np.float32),
    }


def padded(col: np.ndarray, pad: Any, dtype: Any) -> np.ndarray:
    width = max((len(x) for x in col), default=0)
    out: np.ndarray = np.full((len(col), width), pad, dtype=dtype)
    for i, x in enumerate(col):
        out[i, : len(x)] = x
    return out


# The serving side, in a fresh process: only TensorFlow and the SavedModel, no Pacer code.
SERVE = r"""
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np, tensorflow as tf
data = np.load(sys.argv[1], allow_pickle=False)
inputs = {k[3:]: tf.constant(data[k]) for k in data.files if k.startswith("in_")}
out = {}
for path in sys.argv[2:]:
    f = tf.saved_model.load(path).signatures["serving_default"]
    out[path] = f(**inputs)["probability"].numpy().tolist()
# The TF1 loader reads the same SavedModel (and runs its table initialiser: main_op).
with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
    meta = tf.compat.v1.saved_model.load(sess, ["serve"], sys.argv[2])
    sig = meta.signature_def["serving_default"]
    feed = {sig.inputs[k].name: data["in_" + k] for k in sig.inputs}
    out["v1"] = sess.run(sig.outputs["probability"].name, feed).tolist()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, np.ndarray]]:
    """Per model: (SavedModel path, the training process's probabilities on the test set)."""
    root = tmp_path_factory.mktemp("exports")
    train, test = make_data(6000, 1), make_data(2000, 2)
    test_features = {k: v for k, v in test.items() if k not in ("click", "w")}
    out = {}
    for name in sorted(MODELS):
        spec = ModelSpec(name=name, hash_buckets=500, embed_dim=4, hidden=(16,), learning_rate=0.1)
        with tf.Graph().as_default() as g:
            v1.set_random_seed(0)
            raw = raw_inputs(SCHEMA, KINDS)
            model = build(spec, SCHEMA, raw.tensors, num_ps_partitions=2)  # parts to concatenate on export
            op = model.train_op(v1.train.get_or_create_global_step())
            serve_raw = raw_inputs(SCHEMA, KINDS, with_label=False)
            with v1.Session(config=session_config(1)) as sess:
                sess.run([v1.global_variables_initializer(), v1.tables_initializer()])
                for i in range(150):
                    a = i * 128 % (6000 - 128)
                    sess.run(op, raw.feed({k: v[a: a + 128] for k, v in train.items()}))
                probs = sess.run(model.probs, raw.feed(test))
                values = model_values(sess, g)
                (root / "ckpt").mkdir(exist_ok=True)
                ckpt = v1.train.Saver().save(sess, str(root / "ckpt" / name), global_step=150)
        # A checkpoint holds the same logical values (the reader joins the partitions).
        from_ckpt = CheckpointValues(ckpt)
        for k, v in values.items():
            np.testing.assert_array_equal(from_ckpt[k], v)
        assert serve_raw.tensors.keys() == test_features.keys()
        # Logical (joined) tables, no optimiser slots or global step.
        assert values[f"{name}/embeddings" if name != "wide_deep" else "wide_deep/deep/embeddings"].shape == (
            500 + 4 + 500 + 500 + 97, 4)
        assert not any("Adagrad" in k or "global_step" in k for k in values)
        out[name] = (export_saved_model(root / name / "1", spec, SCHEMA, KINDS, values), probs)
    # Inputs as a client sends them: lists padded on the right.
    np.savez(root / "test.npz", labels=test["click"], **{  # type: ignore[arg-type]
        "in_price": test["price"], "in_score": test["score"], "in_city": test["city"].astype(str),
        "in_device": test["device"].astype(str), "in_shop": test["shop"],
        "in_tags": padded(test["tags"], STRING_PAD, object).astype(str),
        "in_recent": padded(test["recent"], INT_PAD, np.int64),
    })
    return out


def test_saved_model_scores_like_the_training_process(exported: dict[str, tuple[Path, np.ndarray]]) -> None:
    root = next(iter(exported.values()))[0].parents[1]
    paths = [str(p) for p, _ in exported.values()]
    proc = subprocess.run([sys.executable, "-c", SERVE, str(root / "test.npz"), *paths],
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    served = json.loads(proc.stdout.strip().splitlines()[-1])
    labels = np.load(root / "test.npz")["labels"]
    for name, (path, probs) in exported.items():
        got = np.asarray(served[str(path)], dtype=np.float32)
        assert got.shape == probs.shape
        np.testing.assert_allclose(got, probs, atol=1e-5)
        trained, serving = auc(labels, probs), auc(labels, got)
        assert trained > 0.7, (name, trained)
        assert abs(serving - trained) < 0.001, (name, serving, trained)
    first = next(iter(exported.values()))[1]
    np.testing.assert_allclose(np.asarray(served["v1"], dtype=np.float32), first, atol=1e-5)


def test_export_is_atomic_and_refuses_wrong_values(tmp_path: Path,
                                                   exported: dict[str, tuple[Path, np.ndarray]]) -> None:
    path = exported["dcn"][0]
    assert sorted(os.listdir(path.parent)) == ["1"]  # renamed into place, no .tmp-<pid> left over
    spec = ModelSpec(name="dcn", hash_buckets=500, embed_dim=4, hidden=(16,))
    with pytest.raises(FileExistsError, match="new directory"):
        export_saved_model(path, spec, SCHEMA, KINDS, {})
    with pytest.raises(KeyError, match="no value for variable"):
        export_saved_model(tmp_path / "x", spec, SCHEMA, KINDS, {})
    assert os.listdir(tmp_path) == []  # the failed export left nothing behind
    values = {"dcn/embeddings": np.zeros((10, 4), np.float32)}
    with pytest.raises(ValueError, match=r"dcn/embeddings: value of shape \[10, 4\]"):
        export_saved_model(tmp_path / "y", spec, SCHEMA, KINDS, values)
