"""A user's own trainer: logistic regression with parameter servers, in plain numpy.

Bring-your-own-trainer example (docs/trainers.md).  The job spec runs this
file as both the worker and the PS command::

    trainer:
      command: [python, /path/to/examples/trainers/logreg_ps.py]
      ps_command: [python, /path/to/examples/trainers/logreg_ps.py]

Everything it knows about the job comes from Pacer through
``pacer.trainer.sdk``: its role and the cluster from ``TF_CONFIG``, the
data as shards of the job's record file, the batch size and learning rate,
and global actions (ADJUST_BS / ADJUST_LR) through the agent beside it.

Model: one weight per hashed categorical value (26 fields x ``--buckets``),
one per dense feature (``log1p``) and a bias; weight ``i`` lives on PS
``i % num_ps``.  Each step a worker pulls the weights its batch touches,
computes the mean log-loss gradient and pushes it; the PS applies Adagrad
(asynchronous, ASP).  The PS speaks ``multiprocessing.connection`` on its
``TF_CONFIG`` address (authenticated with the job name: fine for an
example; a real PS wants a real secret).

The chief (worker 0) evaluates on the held-out file at the end (AUC, log
loss) and reports it with :meth:`pacer.trainer.sdk.Worker.finish`.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import numpy as np
from pacer.data.criteo import NUM_CAT, NUM_DENSE, RecordFile, features
from pacer.models.metrics import auc, logloss
from pacer.trainer import sdk

ADAGRAD_INIT = 0.1


def num_weights(buckets: int) -> int:
    return NUM_CAT * buckets + NUM_DENSE + 1  # categoricals, dense, bias


def sparse_rows(records: np.ndarray, buckets: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each record as 40 (weight id, value) pairs, and its label."""
    dense, cat, labels = features(records, buckets)
    n = len(labels)
    cat_ids = cat + np.arange(NUM_CAT, dtype=np.int64) * buckets
    dense_ids = np.broadcast_to(NUM_CAT * buckets + np.arange(NUM_DENSE, dtype=np.int64), (n, NUM_DENSE))
    bias = np.full((n, 1), NUM_CAT * buckets + NUM_DENSE, dtype=np.int64)
    ids = np.concatenate([cat_ids, dense_ids, bias], axis=1)
    vals = np.concatenate([np.ones((n, NUM_CAT), np.float32), dense, np.ones((n, 1), np.float32)], axis=1)
    return ids, vals, labels


# ---------------------------------------------------------------------- PS


def serve_ps(env: sdk.TrainerEnv, buckets: int) -> int:
    """Hold weights ``i`` with ``i % num_ps == index`` and serve pulls and pushes until killed."""
    nps = len(env.ps)
    size = -(-num_weights(buckets) // nps)
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


def step(ps: PSClient, records: np.ndarray, buckets: int, lr: float) -> float:
    """One asynchronous SGD step on ``records``; returns the batch's log loss before the update."""
    ids, vals, labels = sparse_rows(records, buckets)
    uniq, inv = np.unique(ids, return_inverse=True)
    inv = inv.reshape(ids.shape)
    w = ps.pull(uniq)
    probs = 1.0 / (1.0 + np.exp(-(w[inv] * vals).sum(axis=1)))
    g_row = (probs - labels) / len(labels)  # d mean-loss / d logit
    grad = np.bincount(inv.ravel(), weights=(g_row[:, None] * vals).ravel(), minlength=len(uniq))
    ps.push(uniq, grad, lr)
    return logloss(labels, probs)


def evaluate(ps: PSClient, path: str, buckets: int, batch: int = 4096) -> dict[str, float]:
    rf = RecordFile.open(path)
    probs, labels = [], []
    for s in range(0, len(rf), batch):
        ids, vals, y = sparse_rows(rf.read(s, min(s + batch, len(rf))), buckets)
        uniq, inv = np.unique(ids, return_inverse=True)
        w = ps.pull(uniq)
        probs.append(1.0 / (1.0 + np.exp(-(w[inv.reshape(ids.shape)] * vals).sum(axis=1))))
        labels.append(y)
    p, y = np.concatenate(probs), np.concatenate(labels)
    return {"auc": auc(y, p), "logloss": logloss(y, p), "eval_records": len(y)}


def train(w: sdk.Worker, buckets: int, step_ms: float) -> dict[str, Any]:
    ps = PSClient(w.env)
    samples, loss = 0, float("nan")
    for shard in w.shards():
        # Each batch is records [lo, hi) in record order: the shard's end can move while it is read (the
        # shard service gives its tail to an idle worker), and then exactly [offset, new end) must have
        # been trained here.  A permutation of the whole shard would train some of the stolen tail and
        # leave some of the kept head untrained.
        for lo, hi in w.batches(shard):
            t0 = time.perf_counter()
            w.check()  # global actions land here, before the step of their iteration
            loss = step(ps, w.read(lo, hi), buckets, w.learning_rate)
            if step_ms:  # emulate a heavier model (tests: lets an action arrive mid-training)
                time.sleep(max(0.0, step_ms / 1000 - (time.perf_counter() - t0)))
            samples += hi - lo
            w.step_done(samples=hi - lo)
    result: dict[str, Any] = {"samples": samples, "last_loss": loss, "batch_size": w.batch_size,
                              "learning_rate": w.learning_rate, "generation": w.env.generation}
    if w.env.is_chief and w.env.eval_data:
        result.update(evaluate(ps, w.env.eval_data, buckets))
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
