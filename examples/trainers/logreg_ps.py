"""A user's own trainer: logistic regression with parameter servers, in plain numpy.

Bring-your-own-trainer example (docs/trainers.md).  The job spec runs this
file as both the worker and the PS command::

    trainer:
      command: [python, /path/to/examples/trainers/logreg_ps.py]
      ps_command: [python, /path/to/examples/trainers/logreg_ps.py]

Everything it knows about the job comes from Pacer through
``pacer.trainer.sdk``: its role and the cluster from ``TF_CONFIG``, the
data as shards of the job's dataset (read in place, as columns, in the job's
seeded order), its feature schema, the batch size and learning rate, and
global actions (ADJUST_BS / ADJUST_LR) through the agent beside it.

Model: one weight per hashed categorical value (each categorical column of
the schema x ``--buckets``), one per dense column (``log1p`` where the schema
says so) and a bias; weight ``i`` lives on PS
``i % num_ps``.  Each step a worker pulls the weights its batch touches,
computes the mean log-loss gradient and pushes it; the PS applies Adagrad
(asynchronous, ASP).  The PS speaks ``multiprocessing.connection`` on its
``TF_CONFIG`` address (authenticated with the job name: fine for an
example; a real PS wants a real secret).

The chief (worker 0) evaluates on the held-out data at the end (AUC, log
loss) and reports it with :meth:`pacer.trainer.sdk.Worker.finish`.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import zlib
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import numpy as np
from pacer.data.feed import DataRef
from pacer.data.schema import Schema
from pacer.models.metrics import auc, logloss
from pacer.trainer import sdk

ADAGRAD_INIT = 0.1


def num_weights(schema: Schema, buckets: int) -> int:
    return len(schema.categorical) * buckets + len(schema.dense) + 1  # categoricals, dense, bias


_crc = np.frompyfunc(lambda v: zlib.crc32(str(v).encode()), 1, 1)


def hashed(col: np.ndarray, buckets: int) -> np.ndarray:
    """A categorical column's ids in ``[0, buckets)``: integers modulo, strings by CRC-32."""
    if col.dtype.kind in "iu":
        return np.mod(col.astype(np.int64), buckets)
    return np.mod(_crc(col).astype(np.int64), buckets)


def sparse_rows(cols: dict[str, np.ndarray], schema: Schema,
                buckets: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each record as (weight id, value) pairs: one per categorical and dense column, and the bias; its label."""
    labels = np.asarray(cols[schema.label], dtype=np.float32)
    n, ncat = len(labels), len(schema.categorical)
    ids, vals = [], []
    for f, c in enumerate(schema.categorical):
        ids.append(hashed(cols[c.name], buckets) + f * buckets)
        vals.append(np.ones(n, np.float32))
    for j, d in enumerate(schema.dense):
        x = np.nan_to_num(np.asarray(cols[d.name], dtype=np.float32))
        if d.transform == "log1p":
            x = np.log1p(np.maximum(x, 0))
        elif d.transform == "standardize":
            x = (x - d.mean) / d.std
        ids.append(np.full(n, ncat * buckets + j, np.int64))
        vals.append(x.astype(np.float32))
    ids.append(np.full(n, ncat * buckets + len(schema.dense), np.int64))
    vals.append(np.ones(n, np.float32))
    return np.stack(ids, axis=1), np.stack(vals, axis=1), labels


# ---------------------------------------------------------------------- PS


def serve_ps(env: sdk.TrainerEnv, buckets: int) -> int:
    """Hold weights ``i`` with ``i % num_ps == index`` and serve pulls and pushes until killed."""
    nps = len(env.ps)
    schema = DataRef.from_json(env.data_ref).feature_schema() if env.data_ref else Schema.criteo()
    size = -(-num_weights(schema, buckets) // nps)
    weights = np.zeros(size, np.float64)
    accum = np.full(size, ADAGRAD_INIT, np.float64)
    lock = threading.Lock()
    port = int(env.address.rsplit(":", 1)[1])
    listener = Listener(("", port), authkey=env.job.encode())
    print(f"{env.node}: serving {size} weights on port {port}", flush=True)

    def handle(conn: Connection) -> None:
        with conn:
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    return
                if msg[0] == "pull":
                    conn.send(weights[msg[1]])
                elif msg[0] == "push":
                    _, idx, grad, lr = msg
                    with lock:
                        accum[idx] += grad * grad
                        weights[idx] -= lr * grad / np.sqrt(accum[idx])
                    conn.send(True)

    while True:
        conn = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


class PSClient:
    """A worker's connections to every PS (retried until the PS listens)."""

    def __init__(self, env: sdk.TrainerEnv, timeout_s: float = 120.0) -> None:
        self.nps = len(env.ps)
        self.conns: list[Connection] = []
        for addr in env.ps:
            host, port = addr.rsplit(":", 1)
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    self.conns.append(Client((host, int(port)), authkey=env.job.encode()))
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)

    def _split(self, ids: np.ndarray) -> list[np.ndarray]:
        return [np.flatnonzero(ids % self.nps == p) for p in range(self.nps)]

    def pull(self, ids: np.ndarray) -> np.ndarray:
        out = np.empty(len(ids), np.float64)
        parts = self._split(ids)
        for p, sel in enumerate(parts):
            self.conns[p].send(("pull", ids[sel] // self.nps))
        for p, sel in enumerate(parts):
            out[sel] = self.conns[p].recv()
        return out

    def push(self, ids: np.ndarray, grad: np.ndarray, lr: float) -> None:
        parts = self._split(ids)
        for p, sel in enumerate(parts):
            self.conns[p].send(("push", ids[sel] // self.nps, grad[sel], lr))
        for p in range(self.nps):
            self.conns[p].recv()


# ------------------------------------------------------------------ worker


def step(ps: PSClient, cols: dict[str, np.ndarray], schema: Schema, buckets: int, lr: float) -> float:
    """One asynchronous SGD step on a batch of columns; returns the batch's log loss before the update."""
    ids, vals, labels = sparse_rows(cols, schema, buckets)
    uniq, inv = np.unique(ids, return_inverse=True)
    inv = inv.reshape(ids.shape)
    w = ps.pull(uniq)
    probs = 1.0 / (1.0 + np.exp(-(w[inv] * vals).sum(axis=1)))
    g_row = (probs - labels) / len(labels)  # d mean-loss / d logit
    grad = np.bincount(inv.ravel(), weights=(g_row[:, None] * vals).ravel(), minlength=len(uniq))
    ps.push(uniq, grad, lr)
    return logloss(labels, probs)


def evaluate(ps: PSClient, held_out: DataRef, schema: Schema, buckets: int, batch: int = 4096) -> dict[str, float]:
    probs, labels = [], []
    with held_out.open() as src:
        for s in range(0, src.rows, batch):
            ids, vals, y = sparse_rows(src.read(s, min(s + batch, src.rows)), schema, buckets)
            uniq, inv = np.unique(ids, return_inverse=True)
            w = ps.pull(uniq)
            probs.append(1.0 / (1.0 + np.exp(-(w[inv.reshape(ids.shape)] * vals).sum(axis=1))))
            labels.append(y)
    p, y = np.concatenate(probs), np.concatenate(labels)
    return {"auc": auc(y, p), "logloss": logloss(y, p), "eval_records": len(y)}


def train(w: sdk.Worker, buckets: int, step_ms: float) -> dict[str, Any]:
    ps = PSClient(w.env)
    schema = w.schema
    samples, loss = 0, float("nan")
    for shard in w.shards():
        # Each batch is records [lo, hi): the shard's end can move while it is read (the shard service
        # gives its tail to an idle worker), and then exactly [offset, new end) must have been trained
        # here.  w.read's seeded order keeps that true (it permutes only within aligned blocks); a
        # permutation of the whole shard would train some of the stolen tail and skip some of the head.
        for lo, hi in w.batches(shard):
            t0 = time.perf_counter()
            w.check()  # global actions land here, before the step of their iteration
            loss = step(ps, w.read(lo, hi), schema, buckets, w.learning_rate)
            if step_ms:  # emulate a heavier model (tests: lets an action arrive mid-training)
                time.sleep(max(0.0, step_ms / 1000 - (time.perf_counter() - t0)))
            samples += hi - lo
            w.step_done(samples=hi - lo)
    result: dict[str, Any] = {"samples": samples, "last_loss": loss, "batch_size": w.batch_size,
                              "learning_rate": w.learning_rate, "generation": w.env.generation}
    if w.env.is_chief and w.env.eval_data:
        result.update(evaluate(ps, w.data.with_uri(w.env.eval_data), schema, buckets))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buckets", type=int, default=1 << 14, help="hash buckets per categorical field")
    ap.add_argument("--step-ms", type=float, default=0.0, help="make each step last at least this long")
    args = ap.parse_args(argv)
    env = sdk.TrainerEnv.from_env()
    if env.role == "ps":
        return serve_ps(env, args.buckets)
    with sdk.Worker(env) as w:  # KILL_RESTART leaves through here: exit 75, relaunched by Pacer
        w.finish(**train(w, args.buckets, args.step_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
