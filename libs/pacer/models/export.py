"""A trained model as a SavedModel for serving: raw columns in, click probability out.

The serving graph is built by the same code as the training graph
(:func:`pacer.models.registry.inference` over
:func:`pacer.models.features.transform`), so hashing, vocabulary lookups and
dense transforms are the ones the model was trained with.  Only the
variable *values* travel from training: :func:`model_values` reads them
from a training session (partitioned tables joined back into one logical
tensor each), :func:`export_saved_model` writes them into a fresh,
unpartitioned serving graph.

The SavedModel has one signature, ``serving_default``:

* inputs: every feature column of the schema by its name (no label, no
  weight): scalar columns ``[batch]`` (float32 / int64 / string, by the
  column's kind), list columns padded ``[batch, None]`` (int64 padded with
  ``-1``, string with ``""``, on the right);
* outputs: ``{"probability": [batch] float32}``.

It loads with TensorFlow 2 (``tf.saved_model.load(path).signatures
["serving_default"](**columns)``, which also runs the table initialiser)
and with ``tf.compat.v1.saved_model.load(sess, ["serve"], path)``, and
TensorFlow Serving reads it as any v1 SavedModel.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from pacer.data.criteo import fsync_dir
from pacer.data.schema import Schema
from pacer.models.common import ModelSpec, session_config
from pacer.models.features import serving_inputs
from pacer.models.registry import MODELS, inference

v1 = tf.compat.v1

_PART = re.compile(r"/part_\d+$")


def logical_name(var: Any) -> str:
    """A variable's name without ``:0`` and, for a part of a partitioned variable, without ``/part_N``."""
    info = var._get_save_slice_info() if hasattr(var, "_get_save_slice_info") else None
    if info is not None:
        return str(info.full_name)
    return _PART.sub("", var.op.name)


def _offset(var: Any) -> int:
    info = var._get_save_slice_info() if hasattr(var, "_get_save_slice_info") else None
    if info is not None:
        return int(info.var_offset[0])
    m = re.search(r"/part_(\d+)$", var.op.name)
    return int(m.group(1)) if m else 0


def model_values(sess: Any, graph: tf.Graph | None = None, scope: str | None = None) -> dict[str, np.ndarray]:
    """The logical value of every trainable model variable, by name (``wide_deep/deep/embeddings``...).

    A partitioned variable's parts (row blocks of ``fixed_size_partitioner``)
    are concatenated along axis 0 in offset order, so the result does not
    depend on the PS count.  Only variables under ``scope`` (default: any
    model's scope, ``wide_deep/``, ``dcn/``...) count: no global step, no
    optimiser slots.
    """
    g = graph if graph is not None else sess.graph
    scopes = (scope,) if scope else tuple(MODELS)
    variables = [
        v for v in g.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES)
        if v.op.name.split("/", 1)[0] in scopes
    ]
    arrays = sess.run({v.op.name: v for v in variables}) if variables else {}
    parts: dict[str, list[tuple[int, np.ndarray]]] = {}
    for v in variables:
        parts.setdefault(logical_name(v), []).append((_offset(v), arrays[v.op.name]))
    out: dict[str, np.ndarray] = {}
    for name, ps in parts.items():
        ps.sort(key=lambda p: p[0])
        out[name] = ps[0][1] if len(ps) == 1 else np.concatenate([a for _, a in ps], axis=0)
    return out


class CheckpointValues(Mapping[str, np.ndarray]):
    """The logical variable values of a TF checkpoint (``Saver`` prefix, e.g. ``.../model-1200``), read lazily.

    A partitioned variable is saved as slices of its full name, and the
    reader joins them: ``values["wide_deep/deep/embeddings"]`` is the whole
    table whatever the PS count at training.  Pass it as ``values`` to
    :func:`export_saved_model` to export without a live training session
    (only the variables the model needs are read; optimiser slots are not).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._reader = tf.train.load_checkpoint(os.fspath(path))
        self._shapes: dict[str, list[int]] = dict(self._reader.get_variable_to_shape_map())

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._shapes:
            raise KeyError(name)
        return np.asarray(self._reader.get_tensor(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


def export_saved_model(
    export_dir: str | os.PathLike[str],
    spec: ModelSpec,
    schema: Schema,
    kinds: Mapping[str, str],
    values: Mapping[str, np.ndarray],
    meta: Mapping[str, Any] | None = None,
) -> Path:
    """Write the model with variable values ``values`` (:func:`model_values`, :class:`CheckpointValues`) as a SavedModel.

    ``export_dir`` must not exist yet: give a new directory per export, e.g.
    ``<exports>/<global step>`` (TensorFlow Serving loads the highest number
    under ``<exports>``).  The SavedModel is written to
    ``<export_dir>.tmp-<pid>`` and renamed into place, so a reader never sees
    a half-written export.  ``kinds`` are the dataset's column kinds (as
    for :func:`pacer.models.features.raw_inputs`); they decide the input
    dtypes.  ``meta`` (e.g. the global step) is written beside it as
    ``pacer.json``, inside the same rename.  Returns ``export_dir``.
    """
    dest = Path(export_dir)
    if dest.exists():
        raise FileExistsError(f"{dest} exists; exports go to a new directory each (e.g. <dir>/<step>)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)  # a leftover of this very pid: nobody else writes it
    graph = tf.Graph()
    try:
        with graph.as_default():
            inputs = serving_inputs(schema, kinds)
            _, _, probs = inference(spec, schema, inputs, num_ps_partitions=1)
            probability = tf.identity(probs, name="probability")
            variables = graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
            feeds: dict[tf.Tensor, np.ndarray] = {}
            assigns = []
            missing = []
            with tf.name_scope("restore_values"):
                for var in variables:
                    name = logical_name(var)
                    if name not in values:
                        missing.append(name)
                        continue
                    shape = var.shape.as_list()
                    value = np.asarray(values[name])
                    if list(value.shape) != shape:
                        raise ValueError(f"{name}: value of shape {list(value.shape)}, the model needs {shape} "
                                         "(another spec or schema than at training?)")
                    # Through a placeholder: the values never become graph constants.
                    ph = v1.placeholder(var.dtype.base_dtype, shape)
                    assigns.append(var.assign(ph))
                    feeds[ph] = value.astype(var.dtype.base_dtype.as_numpy_dtype, copy=False)
            if missing:
                raise KeyError(f"no value for variable(s) {', '.join(sorted(missing))}")
            signature = v1.saved_model.signature_def_utils.build_signature_def(
                inputs={n: v1.saved_model.utils.build_tensor_info(t) for n, t in inputs.items()},
                outputs={"probability": v1.saved_model.utils.build_tensor_info(probability)},
                method_name=v1.saved_model.signature_constants.PREDICT_METHOD_NAME,
            )
            main_op = v1.tables_initializer(name="init_tables")
            with v1.Session(graph=graph, config=session_config(1)) as sess:
                sess.run(assigns, feeds)
                builder = v1.saved_model.Builder(str(tmp))
                builder.add_meta_graph_and_variables(
                    sess,
                    [v1.saved_model.tag_constants.SERVING],
                    signature_def_map={"serving_default": signature},
                    main_op=main_op,  # the vocabulary tables, initialised on load
                    strip_default_attrs=True,
                )
                builder.save()
        if meta is not None:
            (tmp / "pacer.json").write_text(json.dumps(dict(meta), sort_keys=True))
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        raise
    fsync_dir(dest.parent)
    return dest

