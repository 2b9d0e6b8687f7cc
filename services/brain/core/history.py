"""The config DB's data model: what the brain remembers of a finished job, and the similarity query.

A :class:`JobHistory` holds a finished job's metadata features (model family
and sizes, the dataset it trained on, batch size, mode), the plans it ran with
in order (the last one is the configuration it ended with), the profiles
observed under them and the coefficients its model ended with (the
calibrated DLRover-RM Eq. 1-6, :mod:`.fitting`).  DLRover-RM Alg. 1 ("identify top-k similar jobs of J
with metadata") ranks these records by similarity to a new job
(:func:`top_k_similar`); DLRover 2023 §4.3 names the most telling feature,
"completed jobs that are using the same table in their training".

Similarity is computed per feature type, then combined (DLRover-RM §4.3,
"calculates the similarity in each type of feature"):

* categorical (model family, dataset, mode, optimizer): 1 if equal, else 0;
* positive size (embedding width, hash buckets, records, batch size):
  min(a, b) / max(a, b), so doubling a size costs the same at any scale;
* layer list (DNN widths): size similarity of the total width times that of
  the depth; the architecture knob of the family (DCN cross layers, xDeepFM
  CIN maps) likewise, compared only between jobs of the same family;
* the combined score is the weighted mean over the features both jobs have
  (an unknown record count, 0, is left out), in [0, 1].

Storage is the service's business: records convert to and from plain dicts
(:meth:`JobHistory.to_dict`, :meth:`JobHistory.from_dict`) of JSON/msgpack
types.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pacer.contracts.jobs import JobSpec, ModelName, PlanSource, ResourcePlan

from .calibration import Calibration
from .fitting import Coefficients

# Weights of the features in the combined similarity.  The model family and
# the dataset decide most of a job's resource shape (DLRover 2023 §4.3);
# sizes refine it.
DEFAULT_WEIGHTS: Mapping[str, float] = {
    "model": 3.0,
    "dataset": 2.0,
    "embed_dim": 1.0,
    "hash_buckets": 1.0,
    "records": 1.0,
    "hidden": 1.0,
    "arch": 0.5,
    "batch_size": 1.0,
    "mode": 0.5,
    "optimizer": 0.5,
}


@dataclass(frozen=True, slots=True)
class JobFeatures:
    """The metadata of a job that similarity looks at (known before it runs)."""

    model: str
    embed_dim: int = 8
    hash_buckets: int = 100_000
    hidden: tuple[int, ...] = (64, 32)
    cross_layers: int = 3
    cin_layers: tuple[int, ...] = (16, 16)
    optimizer: str = "adagrad"
    dataset: str = ""  # the table: the dataset file's name without its directory
    records: int = 0  # 0 = unknown
    batch_size: int = 512
    mode: str = "asp"

    @classmethod
    def from_spec(cls, spec: JobSpec, records: int | None = None) -> JobFeatures:
        """Features of a submitted job; ``records`` overrides the spec's (0 = unknown)."""
        m = spec.model
        return cls(
            model=m.name.value,
            embed_dim=m.embed_dim,
            hash_buckets=m.hash_buckets,
            hidden=tuple(m.hidden),
            cross_layers=m.cross_layers,
            cin_layers=tuple(m.cin_layers),
            optimizer=m.optimizer,
            dataset=posixpath.basename(spec.dataset.path.replace("\\", "/")),
            records=spec.dataset.records if records is None else records,
            batch_size=spec.batch_size,
            mode=spec.mode.value,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "embed_dim": self.embed_dim, "hash_buckets": self.hash_buckets,
            "hidden": list(self.hidden), "cross_layers": self.cross_layers,
            "cin_layers": list(self.cin_layers), "optimizer": self.optimizer,
            "dataset": self.dataset, "records": self.records, "batch_size": self.batch_size,
            "mode": self.mode,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> JobFeatures:
        return cls(
            model=str(d["model"]),
            embed_dim=int(d.get("embed_dim", 8)),
            hash_buckets=int(d.get("hash_buckets", 100_000)),
            hidden=tuple(int(x) for x in d.get("hidden", (64, 32))),
            cross_layers=int(d.get("cross_layers", 3)),
            cin_layers=tuple(int(x) for x in d.get("cin_layers", (16, 16))),
            optimizer=str(d.get("optimizer", "adagrad")),
            dataset=str(d.get("dataset", "")),
            records=int(d.get("records", 0)),
            batch_size=int(d.get("batch_size", 512)),
            mode=str(d.get("mode", "asp")),
        )


@dataclass(frozen=True, slots=True)
class ObservedProfile:
    """What a job used at one moment under one of its plans (from the monitor's statistics)."""

    at: float  # seconds since the job started
    workers: int
    ps: int
    worker_cpu: float  # w-hat: cores one worker uses
    ps_cpu_total: float  # s_total-hat: cores all PS use
    throughput: float  # samples/s of the job
    worker_rss_mb: float = 0.0  # largest worker RSS
    ps_rss_mb: float = 0.0  # largest PS RSS

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at, "workers": self.workers, "ps": self.ps, "worker_cpu": self.worker_cpu,
            "ps_cpu_total": self.ps_cpu_total, "throughput": self.throughput,
            "worker_rss_mb": self.worker_rss_mb, "ps_rss_mb": self.ps_rss_mb,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ObservedProfile:
        return cls(
            at=float(d["at"]), workers=int(d["workers"]), ps=int(d["ps"]),
            worker_cpu=float(d["worker_cpu"]), ps_cpu_total=float(d["ps_cpu_total"]),
            throughput=float(d["throughput"]), worker_rss_mb=float(d.get("worker_rss_mb", 0.0)),
            ps_rss_mb=float(d.get("ps_rss_mb", 0.0)),
        )


def plan_to_dict(plan: ResourcePlan) -> dict[str, Any]:
    return {
        "job": plan.job, "workers": plan.workers, "ps": plan.ps, "worker_cpu": plan.worker_cpu,
        "worker_memory_mb": plan.worker_memory_mb, "ps_cpu": plan.ps_cpu,
        "ps_memory_mb": plan.ps_memory_mb, "source": plan.source.value, "reason": plan.reason,
    }


def plan_from_dict(d: Mapping[str, Any]) -> ResourcePlan:
    return ResourcePlan(
        job=str(d["job"]), workers=int(d["workers"]), ps=int(d["ps"]),
        worker_cpu=float(d["worker_cpu"]), worker_memory_mb=int(d["worker_memory_mb"]),
        ps_cpu=float(d["ps_cpu"]), ps_memory_mb=int(d["ps_memory_mb"]),
        source=PlanSource(d.get("source", PlanSource.BRAIN.value)), reason=str(d.get("reason", "")),
    )


@dataclass(frozen=True, slots=True)
class JobHistory:
    """One finished job in the config DB."""

    job: str
    features: JobFeatures
    plans: tuple[ResourcePlan, ...]  # in the order applied; the last is the job's final configuration
    profiles: tuple[ObservedProfile, ...] = ()
    throughput: float = 0.0  # samples/s observed under the final plan
    finished_at: float = 0.0  # unix seconds
    succeeded: bool = True
    coefficients: Coefficients | None = None  # its fitted calibrated DLRover-RM model, for a warm start
    calibration: Calibration | None = None  # what its CPU readings said (.calibration), for a warm start

    @property
    def final_plan(self) -> ResourcePlan | None:
        """The configuration the job ended with: A^i of DLRover-RM Alg. 1."""
        return self.plans[-1] if self.plans else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "features": self.features.to_dict(),
            "plans": [plan_to_dict(p) for p in self.plans],
            "profiles": [p.to_dict() for p in self.profiles],
            "throughput": self.throughput,
            "finished_at": self.finished_at,
            "succeeded": self.succeeded,
            **({"coefficients": self.coefficients.to_dict()} if self.coefficients is not None else {}),
            **({"calibration": self.calibration.to_dict()} if self.calibration is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> JobHistory:
        return cls(
            job=str(d["job"]),
            features=JobFeatures.from_dict(d["features"]),
            plans=tuple(plan_from_dict(p) for p in d.get("plans", ())),
            profiles=tuple(ObservedProfile.from_dict(p) for p in d.get("profiles", ())),
            throughput=float(d.get("throughput", 0.0)),
            finished_at=float(d.get("finished_at", 0.0)),
            succeeded=bool(d.get("succeeded", True)),
            coefficients=Coefficients.from_dict(d["coefficients"]) if d.get("coefficients") else None,
            calibration=Calibration.from_dict(d["calibration"]) if d.get("calibration") else None,
        )


# ---------------------------------------------------------------- similarity


def size_similarity(a: float, b: float) -> float:
    """min / max of two sizes >= 0: 1 when equal, 0.5 when one is twice the other; 0 vs 0 is 1."""
    if a <= 0 and b <= 0:
        return 1.0
    if a <= 0 or b <= 0:
        return 0.0
    return min(a, b) / max(a, b)


def layers_similarity(a: Iterable[int], b: Iterable[int]) -> float:
    """Similarity of two layer-width lists: of their total widths times of their depths."""
    la, lb = list(a), list(b)
    return size_similarity(sum(la), sum(lb)) * size_similarity(len(la), len(lb))


def feature_similarities(a: JobFeatures, b: JobFeatures) -> dict[str, float]:
    """Similarity per feature in [0, 1]; features one of the jobs does not know are absent."""
    out = {
        "model": float(a.model == b.model),
        "dataset": float(a.dataset == b.dataset and a.dataset != ""),
        "embed_dim": size_similarity(a.embed_dim, b.embed_dim),
        "hash_buckets": size_similarity(a.hash_buckets, b.hash_buckets),
        "hidden": layers_similarity(a.hidden, b.hidden),
        "batch_size": size_similarity(a.batch_size, b.batch_size),
        "mode": float(a.mode == b.mode),
        "optimizer": float(a.optimizer == b.optimizer),
    }
    if a.records > 0 and b.records > 0:
        out["records"] = size_similarity(a.records, b.records)
    if a.model == b.model == ModelName.DCN.value:
        out["arch"] = size_similarity(a.cross_layers + 1, b.cross_layers + 1)
    elif a.model == b.model == ModelName.XDEEPFM.value:
        out["arch"] = layers_similarity(a.cin_layers, b.cin_layers)
    return out


def similarity(a: JobFeatures, b: JobFeatures, weights: Mapping[str, float] = DEFAULT_WEIGHTS) -> float:
    """Combined similarity in [0, 1]: the weighted mean of :func:`feature_similarities`."""
    parts = feature_similarities(a, b)
    total = sum(weights.get(k, 0.0) for k in parts)
    if total <= 0:
        return 0.0
    return sum(weights.get(k, 0.0) * v for k, v in parts.items()) / total


@dataclass(frozen=True, slots=True)
class Similar:
    """A record of the config DB and its similarity to the job asked about."""

    history: JobHistory
    similarity: float
    per_feature: dict[str, float] = field(default_factory=dict)


def top_k_similar(features: JobFeatures, histories: Iterable[JobHistory], k: int, *,
                  min_similarity: float = 0.0,
                  weights: Mapping[str, float] = DEFAULT_WEIGHTS) -> list[Similar]:
    """The ``k`` records most similar to ``features``, most similar first (DLRover-RM Alg. 1, line 1).

    Only jobs that succeeded and have a plan count, and only at
    ``min_similarity`` or above.  Ties go to the newer job, then to the job
    name, so the answer never depends on the order of ``histories``.
    """
    if k <= 0:
        return []
    scored = []
    for h in histories:
        if not h.succeeded or h.final_plan is None:
            continue
        s = similarity(features, h.features, weights)
        if s >= min_similarity:
            scored.append(Similar(h, s, feature_similarities(features, h.features)))
    scored.sort(key=lambda x: (-x.similarity, -x.history.finished_at, x.history.job))
    return scored[:k]
