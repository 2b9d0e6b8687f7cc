"""The batch limits every straggler action respects, in one place: a floor, a cap per device, the global batch.

Whatever policy asked (a built-in one or a user's), the controller core
clamps an ADJUST_BS to these limits before it is carried out
(:meth:`BatchLimits.clamp`) and says so in the decision's reason; the
policies are told them in the request (``min_batch``, ``max_batch``,
``batch_caps``) so that they can plan within them:

* **the global batch** B = sum_i B_i * C_i: a synchronous step trains B
  samples whatever the split (AntDT §V-C), so the learning dynamics do not
  change with a straggler action;
* **a floor** on every B_i: :func:`batch_floor`, at least 1/8 of the even
  split B / n (``FLOOR_FRACTION``) or the job's ``min_batch`` if larger.  A
  worker cut to a batch of 1 (seen: ``lb-bsp`` on a short job) runs tens of
  thousands of steps over the records of its shard, far longer than the
  straggler it was meant to relieve;
* **a cap** per device: the largest B_i its memory holds.  A device group's
  own ``max_batch`` (AntDT-DD's B^max_g, "95 % of device memory") when the
  job has device groups, else :func:`memory_cap` from the workers' memory
  limit and the model.  Seen without it: ``antdt-nd`` and ``pacer-adaptive``
  set a batch of 896 on a device whose cap was 768, an OOM on a real device.

Pure: no IO, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pacer.contracts.jobs import ModelConfig

from .batch import balance

FLOOR_FRACTION = 8  # the floor is the even split B / n divided by this

# What a worker process holds besides a step's per-sample tensors (the design notes' measured ~600 MB
# RSS of a TensorFlow process), and the share of the rest a batch may fill (headroom for the
# allocator's fragmentation and the runtime's own growth).
PROCESS_BASE_MB = 600
MEMORY_USE_FRACTION = 0.9
# Per-sample tensors of a training step, as a multiple of the forward activations: their gradients,
# the optimizer's per-step temporaries and TensorFlow's intermediate copies.
STEP_MEMORY_FACTOR = 4.0
NUM_DENSE, NUM_CAT = 13, 26  # Criteo's columns: the default schema's (input_widths)


def batch_floor(global_batch: int, workers: int, min_batch: int = 1) -> int:
    """The smallest B_i any action may set: 1/8 of the even split, or ``min_batch`` if larger (>= 1)."""
    even = global_batch // max(1, workers)
    return max(1, min_batch, even // FLOOR_FRACTION)


def input_widths(model: ModelConfig, schema: Mapping[str, Any] | None = None) -> tuple[int, int, int]:
    """(dense columns, embedded fields, their embeddings' total width) of the model's input: from the
    job's schema (``dataset.schema``, plain data), Criteo's when it has none."""
    if not schema:
        return NUM_DENSE, NUM_CAT, NUM_CAT * model.embed_dim
    fields = [*(schema.get("categorical") or []), *(schema.get("multi_hot") or [])]
    width = sum(int((f.get("embed_dim") if isinstance(f, Mapping) else 0) or model.embed_dim) for f in fields)
    return len(schema.get("dense") or []), len(fields), width


def sample_bytes(model: ModelConfig, schema: Mapping[str, Any] | None = None) -> float:
    """Bytes one training sample of ``model`` takes in a step (an estimate from the model's sizes).

    Forward activations in float32: the inputs (the dense columns, one int64
    id per embedded field), the gathered embeddings, every dense layer's
    output (Wide&Deep's DNN, DCN's cross layers of the input width),
    xDeepFM's CIN layers (each forms fields x H_{k-1} x D outer products
    before its 1x1 convolution).  Times :data:`STEP_MEMORY_FACTOR` for the
    backward pass and temporaries.  ``schema``: the job's (Criteo's 13 dense
    and 26 categorical columns when absent).
    """
    d = model.embed_dim
    dense, fields, emb = input_widths(model, schema)
    width = dense + emb  # the deep part's input
    floats = dense + emb + width + sum(model.hidden)
    name = getattr(model.name, "value", model.name)
    if name == "dcn":
        floats += model.cross_layers * width
    if name == "xdeepfm":
        prev = fields
        for h in model.cin_layers:
            floats += fields * prev * d + h * d
            prev = h
    return (4.0 * floats + 8.0 * fields) * STEP_MEMORY_FACTOR


def memory_cap(memory_mb: int, model: ModelConfig, schema: Mapping[str, Any] | None = None) -> int:
    """The largest batch a worker with ``memory_mb`` MiB holds for ``model`` on a dataset of ``schema``
    (0: no memory limit known)."""
    if memory_mb <= 0:
        return 0
    usable = max(0.0, (memory_mb - PROCESS_BASE_MB) * MEMORY_USE_FRACTION) * (1 << 20)
    return max(1, int(usable // sample_bytes(model, schema)))


class LimitError(ValueError):
    """No batch sizes within the limits reach the global batch (names the bound), or they cannot be
    reached without changing a worker's gradient accumulation."""


@dataclass(frozen=True, slots=True)
class Clamped:
    """Batch sizes within the limits, and one note per worker whose B_i changed (empty: unchanged)."""

    batch_sizes: dict[str, int]
    accumulations: dict[str, int]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """The limits of one job's batch sizes (module docstring)."""

    global_batch: int
    floor: int = 1
    cap: int = 0  # every worker's (0: none)
    caps: Mapping[str, int] = field(default_factory=dict)  # per worker (a device group's); 0 or absent: ``cap``

    def hi(self, worker: str) -> int:
        """Worker ``worker``'s cap (0: none): the lower of its own and the job's."""
        own = [c for c in (self.caps.get(worker, 0), self.cap) if c > 0]
        return min(own) if own else 0

    def violations(self, sizes: Mapping[str, int], accs: Mapping[str, int]) -> list[str]:
        """What of ``sizes`` is outside the limits, one line each (empty: within them)."""
        out = []
        for w, b in sizes.items():
            hi = self.hi(w)
            if b < self.floor:
                out.append(f"{w}: B_i {b} < floor {self.floor}")
            if hi and b > hi:
                out.append(f"{w}: B_i {b} > cap {hi}")
        total = sum(b * accs.get(w, 1) for w, b in sizes.items())
        if sizes and total != self.global_batch:
            out.append(f"sum of B_i * C_i {total} != global batch {self.global_batch}")
        return out

    def clamp(self, sizes: Mapping[str, int], accs: Mapping[str, int]) -> Clamped:
        """``sizes`` within the limits, as close to the policy's intent as the limits allow.

        Within the limits already: unchanged.  Else the global batch is
        split again in the proportions the policy asked for, each worker
        within [floor, cap] (:func:`.batch.balance` with the asked sizes as
        the "speeds": it minimises max_i B_i / asked_i, so the workers the
        policy gave more keep more).  Raises :class:`LimitError` when no
        split within the limits reaches the global batch, or when a worker
        accumulates gradients (C_i > 1: the controller does not rewrite a
        policy's accumulation steps; AntDT-DD plans within the caps itself).
        """
        sizes, accs = dict(sizes), {w: accs.get(w, 1) for w in sizes}
        if not self.violations(sizes, accs):
            return Clamped(sizes, accs)
        if any(c != 1 for c in accs.values()):
            raise LimitError("outside the limits with gradient accumulation: " + "; ".join(
                self.violations(sizes, accs)))
        names = sorted(sizes)
        his = [self.hi(w) or self.global_batch for w in names]
        lo = [self.floor] * len(names)
        if sum(lo) > self.global_batch:
            raise LimitError(f"{len(names)} workers x floor {self.floor} > global batch {self.global_batch}")
        if sum(his) < self.global_batch:
            raise LimitError(f"the workers' caps sum to {sum(his)} < global batch {self.global_batch}")
        asked = [max(0.5, float(sizes[w])) for w in names]  # a worker asked to take 0 still gets the floor
        new = dict(zip(names, balance(self.global_batch, asked, lo=lo, hi=his), strict=True))
        notes = tuple(f"{w} {sizes[w]} -> {new[w]}" + (" (cap)" if sizes[w] > (self.hi(w) or math.inf)
                                                        else " (floor)" if sizes[w] < self.floor else "")
                      for w in names if new[w] != sizes[w])
        return Clamped(new, accs, notes)


__all__ = ["FLOOR_FRACTION", "BatchLimits", "Clamped", "LimitError", "batch_floor", "memory_cap", "sample_bytes"]
