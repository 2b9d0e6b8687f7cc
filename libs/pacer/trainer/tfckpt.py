"""TensorFlow adapter for the flash checkpoint (DLRover-RM §5.2): variables <-> named arrays.

``variables_to_arrays`` fetches every variable in ONE ``Session.run`` (one
round trip per PS; not a transaction, see Concurrency) and names each array
by ``var.op.name``; a partitioned variable is
expanded into its parts (``emb/part_0``, ``emb/part_1``...), which are
ordinary variables, so a checkpoint taken on one PS set restores into a
graph that partitions the same way.

Why snapshot ops: fetching a variable directly makes the session copy its
buffer into a freshly allocated numpy array (the tensor is shared with the
variable, so it cannot be handed over).  Fetching ``DeepCopy(read)`` instead
yields a tensor nobody else holds, which the session hands to numpy without
a copy; measured on this machine class (2 cores) that halves or better the
fetch of 256 MB (0.02-0.05 s vs 0.07-0.12 s), and the fetch is about half of
the flash save's pause (the other half is the copy into shared memory).  The
ops are built once per graph, colocated with their variable (on its PS), by
``prepare_snapshot`` or lazily by the first ``variables_to_arrays`` while the
graph is not finalized; on a finalized graph without them the plain fetch is
used.

``arrays_to_variables`` assigns them back in ONE ``Session.run`` without
adding ops to the graph: it feeds each variable's initializer with the value
(exactly what ``tf.Variable.load`` does, batched), so it also works on a
finalized graph such as the one a ``MonitoredTrainingSession`` owns.  Fed
read-only arrays from ``FlashCheckpointer.restore(copy=False)`` are zero
copy: TF may adopt the fed buffer as the variable's storage and copies it
before the first in-place update (verified for assign_add, SGD, Adagrad,
Adam, scatter_add/update); until then the shm slot stays pinned, and the
writer uses a fresh file for that slot.

Concurrency: both calls are as safe as the session they use.  A snapshot is
not atomic with respect to *other* workers' concurrent updates on the PS
(asynchronous PS training has no global step barrier); take it between this
worker's steps, or pause the job, when that matters.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import tensorflow as tf


def flatten_variables(variables: Iterable[Any]) -> list[Any]:
    """Variables, with every partitioned variable replaced by its parts, in order."""
    out: list[Any] = []
    for v in variables:
        if hasattr(v, "op") and hasattr(v, "initializer"):
            out.append(v)
        else:  # PartitionedVariable (not exported under tf.compat.v1): iterates over its parts
            out.extend(flatten_variables(v))
    return out


def _named(variables: Iterable[Any]) -> list[tuple[str, Any]]:
    vs = flatten_variables(variables)
    names = [v.op.name for v in vs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"variables listed twice: {dup}")
    return list(zip(names, vs, strict=True))


# graph -> {variable name: DeepCopy tensor}; weak so dropped graphs are freed.
_snapshots: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_snap_lock = threading.Lock()


def _snapshot_tensor(name: str, v: Any, build: bool) -> Any | None:
    g = v.graph
    with _snap_lock:
        cache = _snapshots.setdefault(g, {})
        t = cache.get(name)
        if t is None and build and not g.finalized:
            with (
                g.as_default(),
                tf.compat.v1.colocate_with(v),
                tf.name_scope("pacer_flash_snapshot/"),
            ):
                t = tf.raw_ops.DeepCopy(x=v.read_value())
            cache[name] = t
        return t


def prepare_snapshot(variables: Iterable[Any]) -> None:
    """Build the snapshot ops now (call before the graph is finalized)."""
    for name, v in _named(variables):
        if _snapshot_tensor(name, v, build=True) is None:
            raise RuntimeError(f"{name}: graph is finalized; call prepare_snapshot before that")


def variables_to_arrays(
    sess: tf.compat.v1.Session, variables: Iterable[Any], *, snapshot: bool = True
) -> dict[str, np.ndarray]:
    """``{var.op.name: value}`` for all ``variables``, fetched with one ``sess.run``.

    ``snapshot``: fetch through the (cached) DeepCopy ops, see the module
    docstring; False fetches the variables themselves (the read op TF cached
    when each was built).  Either way repeated saves add nothing to the graph.
    """
    named = _named(variables)
    if not named:
        return {}
    fetches = []
    for name, v in named:
        t = _snapshot_tensor(name, v, build=True) if snapshot else None
        fetches.append(v if t is None else t)
    values = sess.run(fetches)
    return {n: np.asarray(x) for (n, _), x in zip(named, values, strict=True)}


def arrays_to_variables(
    sess: tf.compat.v1.Session,
    variables: Iterable[Any],
    arrays: Mapping[str, np.ndarray],
    *,
    strict: bool = True,
) -> list[str]:
    """Assign ``arrays[var.op.name]`` to each variable in one ``sess.run``; returns names assigned.

    ``strict``: every variable must have an array (else KeyError).  Shapes
    and dtypes must match exactly: a silent cast could lose precision.
    """
    # Usually one round; a second only when two variables share one
    # initial-value tensor (a tensor can be fed once per run).
    rounds: list[tuple[list[Any], dict[Any, np.ndarray]]] = []
    done = []
    for name, v in _named(variables):
        if name not in arrays:
            if strict:
                raise KeyError(f"checkpoint has no array for variable {name!r}")
            continue
        value = np.asarray(arrays[name])
        want_dtype = v.dtype.base_dtype.as_numpy_dtype
        if value.dtype != np.dtype(want_dtype):
            raise ValueError(
                f"{name}: checkpoint dtype {value.dtype}, variable dtype {np.dtype(want_dtype)}"
            )
        shape = v.shape
        if not shape.is_compatible_with(value.shape):
            raise ValueError(f"{name}: checkpoint shape {value.shape}, variable shape {shape}")
        init = v.initializer
        target = init.inputs[1]  # the initial value: fed, so its producer never runs
        if not init.graph.is_feedable(target):
            raise ValueError(
                f"{name}: initial value is not feedable; cannot assign without new ops"
            )
        free = [r for r in rounds if target not in r[1]]
        if not free:
            rounds.append(([], {}))
            free = rounds[-1:]
        free[0][0].append(init)
        free[0][1][target] = value
        done.append(name)
    for ops, feed in rounds:
        sess.run(ops, feed_dict=feed)
    return done


# "emb/part_3" and an optimizer slot of it, "emb/part_3/Adagrad" (full name "emb/Adagrad").
_PART = re.compile(r"^(.*)/part_(\d+)(/.*)?$")


def repartition(arrays: Mapping[str, np.ndarray], variables: Iterable[Any]) -> dict[str, np.ndarray]:
    """Arrays saved from one PS set -> the arrays for ``variables`` of another.

    Embedding tables are split along axis 0 (``fixed_size_partitioner``) into
    as many parts as there are PS tasks, so a checkpoint of 2 PS names
    ``emb/part_0..1`` and a graph for 3 PS wants ``emb/part_0..2``: the saved
    parts are concatenated in part order into the full table, and each new
    part takes its rows by its slice info (``var_offset``, ``var_shape``),
    exactly what ``Saver`` does with its slice records.  Variables that are
    not partitioned are passed through by name.
    """
    parts: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name, a in arrays.items():
        m = _PART.match(name)
        if m:
            parts.setdefault(m.group(1) + (m.group(3) or ""), []).append((int(m.group(2)), a))
    full: dict[str, np.ndarray] = {}
    out: dict[str, np.ndarray] = {}
    for name, v in _named(variables):
        info = getattr(v, "_save_slice_info", None)
        if info is None:
            if name not in arrays:
                raise KeyError(f"checkpoint has no array for variable {name!r}")
            out[name] = arrays[name]
            continue
        base = info.full_name
        if base not in full:
            if base not in parts:
                raise KeyError(f"checkpoint has no parts of partitioned variable {base!r}")
            full[base] = np.concatenate([a for _, a in sorted(parts[base], key=lambda p: p[0])], axis=0)
        src = full[base]
        if list(src.shape) != list(info.full_shape):
            raise ValueError(f"{base}: checkpoint shape {list(src.shape)} != graph shape {list(info.full_shape)}")
        begin = info.var_offset[0]
        out[name] = src[begin:begin + info.var_shape[0]]
    return out
