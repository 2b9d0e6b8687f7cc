"""Does one epoch of single-process training over generated Criteo-like data reach the project's AUC bar?

The bar (docs/design.md, "Data"): Wide & Deep reaches held-out AUC >= 0.70 after
one epoch over 1M generated rows, batch 256.  For every model this prints
one JSON line: model, rows, held-out AUC and log loss, training steps/s, and
the oracle AUC (the generator's true click probabilities on the same
held-out rows: the ceiling no model can pass).

    .venv/bin/python bench/auc_check.py [--rows 1000000] [--models wide_deep,xdeepfm,dcn]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from pacer.data import criteo
from pacer.data.feed import take
from pacer.data.schema import Schema
from pacer.models import metrics
from pacer.models.common import ModelSpec, session_config
from pacer.models.features import raw_inputs
from pacer.models.registry import MODELS, build

v1 = tf.compat.v1


def oracle_auc(seed: int, strength: float, test: np.ndarray, rows: int) -> float:
    gen = criteo.CriteoLikeGenerator(seed, strength)
    probs = np.concatenate([p for _, p in (gen.block(1, i, min(criteo.GEN_BLOCK_ROWS, rows - s))
                                           for i, s in enumerate(range(0, rows, criteo.GEN_BLOCK_ROWS)))])
    return metrics.auc(test["label"], probs)


def run_model(name: str, train: dict[str, np.ndarray], test: dict[str, np.ndarray],
              args: argparse.Namespace) -> dict[str, object]:
    spec = ModelSpec(name=name, hash_buckets=args.hash_buckets, learning_rate=args.lr)
    schema = Schema.criteo()
    kinds = {k: "float" if v.dtype.kind == "f" else "int" for k, v in train.items()}
    n = len(train["label"])
    with tf.Graph().as_default():
        v1.set_random_seed(args.seed)
        raw = raw_inputs(schema, kinds)
        model = build(spec, schema, raw.tensors)
        train_op = model.train_op()
        with v1.Session(config=session_config(args.threads)) as sess:
            sess.run([v1.global_variables_initializer(), v1.tables_initializer()])
            steps = 0
            t0 = time.perf_counter()
            for start in range(0, n, args.batch):
                sess.run(train_op, raw.feed(take(train, start, start + args.batch)))
                steps += 1
            train_s = time.perf_counter() - t0
            probs = np.concatenate([sess.run(model.probs, raw.feed(take(test, s, s + 8192)))
                                    for s in range(0, len(test["label"]), 8192)])
    return {
        "model": name,
        "rows": n,
        "auc": round(metrics.auc(test["label"], probs), 4),
        "logloss": round(metrics.logloss(test["label"], probs), 4),
        "steps_per_s": round(steps / train_s, 1),
        "train_s": round(train_s, 1),
        "batch": args.batch,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--test-rows", type=int, default=200_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--strength", type=float, default=criteo.DEFAULT_STRENGTH)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--hash-buckets", type=int, default=100_000)
    p.add_argument("--lr", type=float, default=ModelSpec().learning_rate)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-dir", default=None, help="keep the generated files here (default: a temp dir)")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(args.data_dir or tmp)
        d.mkdir(parents=True, exist_ok=True)
        train_path = d / f"gen-s{args.seed}-x{args.strength}-{args.rows}.rec"
        test_path = criteo.heldout_path(train_path).with_name(train_path.name + f".{args.test_rows}.test")
        t0 = time.perf_counter()
        if not train_path.exists():
            criteo.generate(train_path, args.rows, args.seed, strength=args.strength)
        if not test_path.exists():
            criteo.generate(test_path, args.test_rows, args.seed, stream=1, strength=args.strength)
        gen_s = time.perf_counter() - t0
        with criteo.RecordFile.open(train_path) as rf:
            train = criteo.columns_of(rf.read(0, len(rf)))
        with criteo.RecordFile.open(test_path) as rf:
            test_records = rf.read(0, len(rf))
        test = criteo.columns_of(test_records)
        ceiling = oracle_auc(args.seed, args.strength, test_records, len(test_records))
        print(json.dumps({"data": str(train_path), "generate_s": round(gen_s, 1), "train_ctr": round(float(train["label"].mean()), 4),
                          "oracle_auc": round(ceiling, 4)}), file=sys.stderr)
        for name in args.models.split(","):
            out = run_model(name.strip(), train, test, args)
            out["oracle_auc"] = round(ceiling, 4)
            print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
