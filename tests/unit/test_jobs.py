"""Job specs (parsing, validation messages, default plan) and the job lifecycle table."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pacer import codec, errors
from pacer.contracts.jobs import (
    DataFormat,
    JobEvent,
    JobSpec,
    JobState,
    ModelName,
    PlanSource,
    ResourcePlan,
    TrainingMode,
)
from pacer.jobs import (
    TERMINAL,
    TRANSITIONS,
    IllegalJobTransition,
    JobLifecycle,
    JobSpecError,
    JobTrigger,
    default_plan,
    load_job_spec,
    parse_job_spec,
)
from pacer.jobs.limits import MAX_NODES_PER_ROLE
from pacer.jobs.spec import JOB_NAME_MAX_LEN, is_job_name, spec_to_json

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples" / "jobs").glob("*.yaml"))

BASE: dict[str, Any] = {
    "name": "j1",
    "model": "wide_deep",
    "dataset": {"path": "data/train.tsv"},
}


def _with(**changes: Any) -> dict[str, Any]:
    """BASE with dotted-path changes; a value of ``...`` deletes the key."""
    doc = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = doc
        for p in parents:
            if not isinstance(node.get(p), dict):
                node[p] = {} if p != "model" else {"name": "wide_deep"}
            node = node[p]
        if value is ...:
            node.pop(last, None)
        else:
            node[last] = value
    return doc


# ------------------------------------------------------------------ examples


def test_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {"wide_deep.yaml", "xdeepfm_bsp.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_files_parse_and_plan(path: Path) -> None:
    spec = load_job_spec(str(path))
    plan = default_plan(spec)
    assert plan.job == spec.name
    assert plan.workers > spec.backup_workers and plan.ps >= 1


def test_zero_config_example() -> None:
    spec = load_job_spec(str(REPO / "examples/jobs/wide_deep.yaml"))
    assert spec.resources is None and spec.limits is None
    assert spec.dataset.format is DataFormat.CRITEO_TSV
    plan = default_plan(spec)
    assert plan.source is PlanSource.DEFAULT
    assert (plan.workers, plan.ps, plan.worker_cpu, plan.worker_memory_mb) == (2, 2, 1.0, 2048)


def test_bsp_example_has_limits_and_custom_policy() -> None:
    spec = load_job_spec(str(REPO / "examples/jobs/xdeepfm_bsp.yaml"))
    assert spec.model.name is ModelName.XDEEPFM and spec.mode is TrainingMode.BSP
    assert spec.policies.straggler == "my-straggler-policy"
    assert spec.limits is not None and spec.limits.max_ps == 1
    plan = default_plan(spec)
    assert plan.ps == 1 and plan.source is PlanSource.USER
    assert plan.worker_memory_mb == 3072  # the user's value
    assert "max_ps" in plan.reason


# ---------------------------------------------------------------- defaults


def test_defaults() -> None:
    spec = parse_job_spec(BASE)
    assert (spec.epochs, spec.batch_size, spec.mode, spec.backup_workers) == (1, 512, TrainingMode.ASP, 0)
    assert (spec.policies.straggler, spec.policies.optimizer) == ("antdt-nd", "brain")
    assert spec.model.name is ModelName.WIDE_DEEP and spec.model.optimizer == "adagrad"
    assert spec.dataset.name == "train" and spec.dataset.records == 0


@pytest.mark.parametrize(
    ("path", "fmt"),
    [("a.csv", DataFormat.CRITEO_CSV), ("a.tsv.gz", DataFormat.CRITEO_TSV),
     ("day_0.txt", DataFormat.CRITEO_TSV), ("train.rec", DataFormat.RECORD)],
)
def test_format_inferred_from_path(path: str, fmt: DataFormat) -> None:
    assert parse_job_spec(_with(dataset__path=path)).dataset.format is fmt


def test_bare_dataset_path_and_model_map() -> None:
    spec = parse_job_spec({"name": "j", "model": {"name": "dcn", "cross_layers": 0}, "dataset": "x.csv"})
    assert spec.model.name is ModelName.DCN and spec.model.cross_layers == 0
    assert spec.dataset.path == "x.csv"


# ------------------------------------------------------------ YAML and JSON


def test_yaml_and_json_are_equivalent() -> None:
    doc = _with(mode="bsp", backup_workers=1, resources={"workers": 3, "ps_cpu": 0.5},
                limits={"max_cpu": 8}, model={"name": "xdeepfm", "hidden": [8, 4]})
    from_yaml = parse_job_spec(yaml.safe_dump(doc))
    from_json = parse_job_spec(json.dumps(doc))
    assert from_yaml == from_json == parse_job_spec(doc) == parse_job_spec(json.dumps(doc).encode())


def test_spec_to_json_round_trips() -> None:
    for path in EXAMPLES:
        spec = load_job_spec(str(path))
        assert parse_job_spec(spec_to_json(spec)) == spec


@pytest.mark.parametrize("cls", [JobSpec, ResourcePlan, JobEvent])
def test_messages_round_trip_through_the_codec(cls: type[Any]) -> None:
    spec = load_job_spec(str(REPO / "examples/jobs/xdeepfm_bsp.yaml"))
    sample = {
        JobSpec: spec,
        ResourcePlan: default_plan(spec),
        JobEvent: JobEvent("j", JobState.FAILED, 1.5, "boom", previous=JobState.RUNNING),
    }[cls]
    assert codec.decode(cls, codec.encode(sample)) == sample


# ------------------------------------------------------- validation messages

INVALID = [
    # (document, field path the message must start with, text it must contain)
    ({"model": "wide_deep", "dataset": "x"}, "name", "required"),
    (_with(name="has space"), "name", "letters, digits"),
    (_with(name=7), "name", "must be a string"),
    (_with(model=...), "model", "required"),
    (_with(model="gbdt"), "model.name", "must be wide_deep, xdeepfm or dcn, got 'gbdt'"),
    (_with(model={"embed_dim": 4}), "model.name", "required"),
    (_with(model__embed_dim=0), "model.embed_dim", "must be > 0"),
    (_with(model__hash_buckets="many"), "model.hash_buckets", "must be an integer"),
    (_with(model__hidden=[64, -1]), "model.hidden[1]", "must be an integer > 0"),
    (_with(model__cin_layers=5), "model.cin_layers", "must be a list"),
    (_with(model__cross_layers=-1), "model.cross_layers", "must be >= 0"),
    (_with(model__learning_rate=0), "model.learning_rate", "must be > 0"),
    (_with(model__optimizer="rmsprop"), "model.optimizer", "adagrad, adam or sgd"),
    (_with(model__embeddim=4), "model.embeddim", "did you mean 'embed_dim'"),
    (_with(dataset=...), "dataset", "required"),
    (_with(dataset={"test_path": "t.tsv"}), "dataset.path", "required"),
    (_with(dataset__path=""), "dataset.path", "must not be empty"),
    (_with(dataset__format="avro"), "dataset.format", "record, criteo_tsv, criteo_csv, parquet, csv, tsv, tfrecord or stream"),
    (_with(dataset__records=-5), "dataset.records", "must be >= 0"),
    (_with(dataset__name="a.b"), "dataset.name", "letters, digits"),
    (_with(dataset=[1]), "dataset", "must be a map"),
    (_with(epochs=0), "epochs", "must be > 0"),
    (_with(epochs=1.5), "epochs", "must be an integer"),
    (_with(epochs=True), "epochs", "must be an integer"),
    (_with(batch_size=-1), "batch_size", "must be > 0"),
    (_with(mode="sync"), "mode", "must be asp or bsp, got 'sync'"),
    (_with(backup_workers=-1), "backup_workers", "must be >= 0"),
    (_with(backup_workers=1), "backup_workers", "only allowed with mode bsp"),
    (_with(mode="bsp", backup_workers=2, resources={"workers": 2}), "backup_workers", "must be <"),
    (_with(mode="bsp", backup_workers=3, limits={"max_workers": 3}), "backup_workers", "limits.max_workers"),
    (_with(batch_size=2, resources={"workers": 4}), "batch_size", "resources.workers"),
    (_with(policies__straggler=""), "policies.straggler", "letters, digits"),
    (_with(policies__optimiser="x"), "policies.optimiser", "did you mean 'optimizer'"),
    (_with(policies="antdt"), "policies", "must be a map"),
    (_with(resources__workers=0), "resources.workers", "must be > 0"),
    (_with(resources__ps=1.0), "resources.ps", "must be an integer"),
    (_with(resources__worker_cpu=-1), "resources.worker_cpu", "must be > 0"),
    (_with(resources__worker_cpu="2"), "resources.worker_cpu", "must be a number"),
    (_with(resources__worker_memory_mb=0), "resources.worker_memory_mb", "must be > 0"),
    (_with(resources__ps_cpu=float("inf")), "resources.ps_cpu", "must be > 0"),
    (_with(resources__ps_memory_mb=-2), "resources.ps_memory_mb", "must be > 0"),
    (_with(resources__gpus=1), "resources.gpus", "unknown field"),
    (_with(resources={"workers": 8}, limits={"max_workers": 4}), "resources.workers", "exceeds limits.max_workers"),
    (_with(resources={"ps_cpu": 4}, limits={"max_cpu": 2}), "resources.ps_cpu", "exceeds limits.max_cpu"),
    (_with(limits__max_workers=0), "limits.max_workers", "must be > 0"),
    (_with(limits__max_ps="two"), "limits.max_ps", "must be an integer"),
    (_with(limits__max_cpu=0), "limits.max_cpu", "must be > 0"),
    (_with(limits__max_memory_mb=-1), "limits.max_memory_mb", "must be > 0"),
    (_with(limits__max_gpu=1), "limits.max_gpu", "unknown field"),
    (_with(epoch=2), "epoch", "did you mean 'epochs'"),
    (_with(batchsize=2), "batchsize", "did you mean 'batch_size'"),
    (_with(zzz=1), "zzz", "unknown field (known: name, model"),
]


@pytest.mark.parametrize(("doc", "field", "text"), INVALID, ids=[f"{i}-{c[1]}" for i, c in enumerate(INVALID)])
def test_invalid_field_is_named(doc: dict[str, Any], field: str, text: str) -> None:
    with pytest.raises(JobSpecError) as ei:
        parse_job_spec(doc)
    err = ei.value
    assert isinstance(err, errors.ValidationError) and err.code == "invalid"
    hits = [p for p in err.problems if p.startswith(f"{field}: ")]
    assert hits, f"no problem for {field!r} in {err.problems}"
    assert any(text in p for p in hits), err.problems


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(JobSpecError) as ei:
        parse_job_spec(_with(epochs=0, mode="sync", dataset__path=...))
    fields = sorted(p.split(":")[0] for p in ei.value.problems)
    assert fields == ["dataset.path", "epochs", "mode"]
    assert str(ei.value).count("\n") == 2


@pytest.mark.parametrize("text", ["name: [unclosed", "{\"name\": ", "- a\n- b", "42", ""])
def test_not_a_document(text: str) -> None:
    with pytest.raises(JobSpecError, match=r"^spec: "):
        parse_job_spec(text)


# ------------------------------------------------------------ job names

# A job's name names its Kubernetes Service and pods: a DNS-1035 label.
GOOD_NAMES = ["j", "j1", "wide-deep-demo", "a-b-c", "x" * JOB_NAME_MAX_LEN]
BAD_NAMES = {
    "My_Job": "capitals and '_'",
    "myJob": "a capital",
    "my_job": "an underscore",
    "my.job": "a dot",
    "1job": "starts with a digit",
    "-job": "starts with '-'",
    "job-": "ends with '-'",
    "x" * (JOB_NAME_MAX_LEN + 1): "too long for a pod hostname",
    "x" * 64: "longer than a DNS label",
    "job\n": "a trailing newline",
    "": "empty",
}


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_dns_1035_job_names_are_accepted(name: str) -> None:
    assert is_job_name(name)
    assert parse_job_spec(_with(name=name)).name == name


@pytest.mark.parametrize("name", list(BAD_NAMES), ids=list(BAD_NAMES.values()))
def test_job_names_that_are_not_dns_1035_labels_are_refused_with_the_rule(name: str) -> None:
    assert not is_job_name(name)
    with pytest.raises(JobSpecError) as ei:
        parse_job_spec(_with(name=name))
    (problem,) = [p for p in ei.value.problems if p.startswith("name: ")]
    # The message names the rule, says why, and quotes the name.
    assert "DNS-1035 label" in problem
    assert "Kubernetes Service" in problem
    assert f"at most {JOB_NAME_MAX_LEN} lowercase letters, digits or '-'" in problem
    assert "starting with a letter and ending with a letter or digit" in problem
    assert problem.endswith(f"got {name!r}")


def test_a_dns_1035_name_too_long_for_the_pod_hostnames_is_refused_with_the_maximum() -> None:
    # 60 characters: a valid Service name, but <job>-worker-12 would be a 70-character hostname.
    name = "wide-deep-criteo-hourly-retrain-with-backup-workers-and-more"
    assert len(name) == 60 and len(name) <= 63
    with pytest.raises(JobSpecError) as ei:
        parse_job_spec(_with(name=name))
    (problem,) = [p for p in ei.value.problems if p.startswith("name: ")]
    assert "at most 51 lowercase letters" in problem
    assert "<job>-worker-9999" in problem and "63 characters" in problem


def test_the_longest_job_name_fits_the_longest_pod_hostname() -> None:
    assert JOB_NAME_MAX_LEN == 51
    longest = "x" * JOB_NAME_MAX_LEN + f"-worker-{MAX_NODES_PER_ROLE - 1}"
    assert len(longest) == 63  # a DNS label, as Kubernetes wants a pod's hostname


@pytest.mark.parametrize("field", ["resources.workers", "resources.ps", "limits.max_workers", "limits.max_ps"])
def test_more_nodes_than_the_names_allow_are_refused(field: str) -> None:
    section, key = field.split(".")
    with pytest.raises(JobSpecError) as ei:
        parse_job_spec({"name": "j", "model": "wide_deep", "dataset": "d.rec", "batch_size": 100_000,
                        section: {key: MAX_NODES_PER_ROLE + 1}})
    assert f"{field}: must be <= {MAX_NODES_PER_ROLE}, got {MAX_NODES_PER_ROLE + 1}" in ei.value.problems


def test_a_plan_never_has_more_nodes_than_the_names_allow() -> None:
    from pacer.contracts.jobs import PlanSource, ResourcePlan
    from pacer.jobs.limits import clamp

    huge = ResourcePlan(job="j", workers=MAX_NODES_PER_ROLE * 3, ps=MAX_NODES_PER_ROLE + 1, worker_cpu=0.1,
                        worker_memory_mb=128, ps_cpu=0.1, ps_memory_mb=128, source=PlanSource.BRAIN)
    out = clamp(huge, None)
    assert (out.plan.workers, out.plan.ps) == (MAX_NODES_PER_ROLE, MAX_NODES_PER_ROLE)
    assert f"workers clamped to {MAX_NODES_PER_ROLE}, the most a job's pod names allow" in out.notes


def test_example_job_names_are_dns_1035_labels() -> None:
    for path in EXAMPLES:
        assert is_job_name(load_job_spec(str(path)).name), path.name


# ------------------------------------------------------------ default plan


def _plan(**changes: Any) -> ResourcePlan:
    return default_plan(parse_job_spec(_with(**changes)))


def test_default_plan_without_limits() -> None:
    p = _plan()
    assert (p.workers, p.ps, p.worker_cpu, p.worker_memory_mb, p.ps_cpu, p.ps_memory_mb) == (
        2, 2, 1.0, 2048, 1.0, 2048)
    assert p.source is PlanSource.DEFAULT and p.reason


def test_user_resources_win_over_defaults() -> None:
    p = _plan(resources={"workers": 5, "ps_memory_mb": 4096})
    assert (p.workers, p.ps, p.ps_memory_mb, p.worker_memory_mb) == (5, 2, 4096, 2048)
    assert p.source is PlanSource.USER and "workers" in p.reason


def test_default_plan_clamped_by_counts() -> None:
    p = _plan(limits={"max_workers": 1, "max_ps": 1})
    assert (p.workers, p.ps) == (1, 1)
    assert "max_workers" in p.reason and "max_ps" in p.reason


def test_default_plan_clamped_by_total_cpu_and_memory() -> None:
    p = _plan(limits={"max_cpu": 3, "max_memory_mb": 2048})
    assert p.workers * p.worker_cpu + p.ps * p.ps_cpu <= 3
    assert p.workers * p.worker_memory_mb + p.ps * p.ps_memory_mb <= 2048
    assert p.workers >= 1 and p.ps >= 1


def test_default_plan_scales_per_node_amounts_last() -> None:
    p = _plan(limits={"max_cpu": 1})
    assert (p.workers, p.ps) == (1, 1)
    assert p.worker_cpu + p.ps_cpu <= 1 and p.worker_cpu >= 0.1


def test_default_plan_keeps_user_values_and_fits_around_them() -> None:
    p = _plan(resources={"workers": 3, "worker_cpu": 1}, limits={"max_cpu": 4})
    assert (p.workers, p.worker_cpu) == (3, 1.0)
    assert p.ps == 1 and p.ps_cpu == 1.0


def test_default_plan_keeps_backup_workers_below_workers() -> None:
    p = _plan(mode="bsp", backup_workers=2)
    assert p.workers == 3
    p = _plan(mode="bsp", backup_workers=1, limits={"max_cpu": 2})
    assert p.workers == 2 and p.workers > 1


def test_default_plan_names_the_limit_it_cannot_meet() -> None:
    with pytest.raises(JobSpecError, match=r"^limits\.max_cpu: 4 is below"):
        _plan(resources={"workers": 4, "worker_cpu": 1}, limits={"max_cpu": 4})


# --------------------------------------------------------------- lifecycle

EDGES = sorted(TRANSITIONS.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value))


def test_terminal_states_have_no_outgoing_edges() -> None:
    assert TERMINAL == {JobState.COMPLETED, JobState.FAILED, JobState.STOPPED}
    for (src, _trigger), dst in TRANSITIONS.items():
        assert src not in TERMINAL
        assert dst in JobState


def test_the_documented_edges() -> None:
    assert {(s.value, d.value) for (s, _), d in TRANSITIONS.items()} == {
        ("submitted", "planning"), ("planning", "running"), ("running", "completed"),
        ("running", "failed"), ("planning", "failed"), ("submitted", "stopped"),
        ("planning", "stopped"), ("running", "stopped"), ("running", "planning"),
    }


@pytest.mark.parametrize(("edge", "dst"), EDGES, ids=[f"{s.value}-{t.value}" for (s, t), _ in EDGES])
def test_every_legal_edge_works(edge: tuple[JobState, JobTrigger], dst: JobState) -> None:
    src, trigger = edge
    lc = JobLifecycle("j", ["train"], state=src)
    lc.done.add("train")  # so that FINISH's guard holds
    ev = lc.apply(trigger, now=7.0, reason="why")
    assert ev == JobEvent("j", dst, 7.0, "why", previous=src)
    assert lc.state is dst


ILLEGAL = [(s, t) for s in JobState for t in JobTrigger if (s, t) not in TRANSITIONS]


@pytest.mark.parametrize(("state", "trigger"), ILLEGAL, ids=[f"{s.value}-{t.value}" for s, t in ILLEGAL])
def test_everything_else_raises(state: JobState, trigger: JobTrigger) -> None:
    lc = JobLifecycle("j", ["train"], state=state)
    lc.done.add("train")
    with pytest.raises(IllegalJobTransition) as ei:
        lc.apply(trigger, now=1.0, reason="r")
    assert isinstance(ei.value, errors.PacerError) and ei.value.code == "conflict"
    assert lc.state is state


def test_completes_when_every_dataset_is_done() -> None:
    lc, first = JobLifecycle.submitted("j", ["train", "test"], now=0.0)
    assert first.state is JobState.SUBMITTED
    lc.apply(JobTrigger.ACCEPT, 1.0)
    lc.start(2.0)
    with pytest.raises(IllegalJobTransition, match="datasets not done: test, train"):
        lc.apply(JobTrigger.FINISH, 3.0)
    assert lc.dataset_done("train", 3.0) is None
    ev = lc.dataset_done("test", 4.0)
    assert ev is not None and ev.state is JobState.COMPLETED and lc.terminal


def test_datasets_finishing_during_a_replan_complete_on_start() -> None:
    lc = JobLifecycle("j", ["train"], state=JobState.RUNNING)
    lc.apply(JobTrigger.REPLAN, 1.0, "scale up")
    assert lc.dataset_done("train", 2.0) is None
    assert [e.state for e in lc.start(3.0)] == [JobState.RUNNING, JobState.COMPLETED]


def test_fails_with_a_reason_only_on_unretryable_errors() -> None:
    lc = JobLifecycle("j", ["train"], state=JobState.RUNNING)
    assert lc.error(errors.Unavailable("bus down"), 1.0) is None
    assert lc.state is JobState.RUNNING
    with pytest.raises(IllegalJobTransition, match="needs a reason"):
        lc.apply(JobTrigger.FAIL, 1.0)
    ev = lc.error(errors.NotFound("no dataset train"), 2.0)
    assert ev is not None and ev.state is JobState.FAILED
    assert ev.reason == "not_found: no dataset train"
    with pytest.raises(IllegalJobTransition, match="terminal"):
        lc.apply(JobTrigger.STOP, 3.0)


def test_edges_taken_on_a_copy_leave_the_original_as_it_was() -> None:
    """The job service takes edges on a trial copy and keeps it only once the record is stored."""
    lc = JobLifecycle("j", ["train"], state=JobState.RUNNING)
    trial = lc.copy()
    assert trial.dataset_done("train", 1.0) is not None
    assert trial.state is JobState.COMPLETED and trial.done == {"train"}
    assert lc.state is JobState.RUNNING and lc.done == set()


# ------------------------------------------------------- datasets, schemas, export (issue 23)

ADS_SCHEMA = {"label": "click", "weight": "w", "dense": [{"name": "price", "transform": "log1p"}],
              "categorical": [{"name": "user", "buckets": 1000}], "multi_hot": [{"name": "tags", "combiner": "sqrtn"}]}


@pytest.mark.parametrize(("path", "schema", "fmt"), [
    ("s3://b/day=*/part-*.parquet", None, DataFormat.PARQUET),
    ("data/x.tfrecords", None, DataFormat.TFRECORD),
    ("data/x.csv", ADS_SCHEMA, DataFormat.CSV),
    ("data/x.tsv", ADS_SCHEMA, DataFormat.TSV),
    ("data/x.csv", None, DataFormat.CRITEO_CSV),
])
def test_format_inferred_from_path_and_schema(path: str, schema: Any, fmt: DataFormat) -> None:
    doc = _with(dataset__path=path, **({"dataset__schema": schema} if schema else {}))
    assert parse_job_spec(doc).dataset.format is fmt


def test_a_schema_and_reader_options_reach_the_spec() -> None:
    spec = parse_job_spec(_with(dataset__path="d/x.csv", dataset__schema=ADS_SCHEMA,
                                dataset__options={"delimiter": "|", "header": False, "names": ["click", "w"]},
                                export={"path": "s3://models/ads", "every_s": 60}))
    assert spec.dataset.schema["label"] == "click"
    assert spec.dataset.options == {"delimiter": "|", "header": False, "names": ["click", "w"]}
    assert spec.export is not None and (spec.export.path, spec.export.every_s) == ("s3://models/ads", 60.0)
    assert parse_job_spec(spec_to_json(spec)) == spec


@pytest.mark.parametrize(("doc", "path", "needle"), [
    (_with(dataset__schema={"dense": ["x"]}), "dataset.schema.label", "required"),
    (_with(dataset__schema={**ADS_SCHEMA, "multi_hot": [{"name": "tags", "combiner": "max"}]}),
     "dataset.schema.multi_hot[0].combiner", "sum, mean, sqrtn"),
    (_with(dataset__schema="ads.yaml"), "dataset.schema", "must be a map"),
    (_with(dataset__path="x.csv", dataset__schema=ADS_SCHEMA, dataset__options={"delimiter": "ab"}),
     "dataset.options.delimiter", "one character"),
    (_with(dataset__path="x.csv", dataset__schema=ADS_SCHEMA, dataset__options={"header": False}),
     "dataset.options.names", "required when header is false"),
    (_with(dataset__path="x.parquet", dataset__options={"header": True}), "dataset.options", "only for the csv"),
    (_with(export={"every_s": 5}), "export.path", "required"),
    (_with(dataset__path="jetstream://ADS", dataset__options={"start": "latest"}), "dataset.options.start",
     "first, new or a stream sequence"),
    (_with(dataset__path="jetstream://ADS", dataset__options={"idle_close_s": 0}), "dataset.options.idle_close_s",
     "must be > 0"),
    (_with(dataset__path="jetstream://ADS", dataset__options={"header": True}), "dataset.options.header", "unknown field"),
    (_with(dataset__path="jetstream://ADS", epochs=2), "epochs", "must be 1"),
    (_with(dataset__path="jetstream://ADS", dataset__test_path="t.parquet"), "dataset.test_path", "periodic exports"),
    (_with(dataset__path="ADS", dataset__format="stream"), "dataset.path", "jetstream://<STREAM>"),
    (_with(export={"path": "m", "every_s": -1}), "export.every_s", "must be > 0"),
])
def test_bad_dataset_fields_are_named(doc: dict[str, Any], path: str, needle: str) -> None:
    with pytest.raises(JobSpecError) as err:
        parse_job_spec(doc)
    assert any(p.startswith(path + ":") and needle in p for p in err.value.problems), err.value.problems


def test_a_stream_dataset_and_its_options() -> None:
    spec = parse_job_spec(_with(dataset__path="jetstream://ADS", dataset__schema=ADS_SCHEMA,
                                dataset__options={"start": 17, "idle_close_s": 30}, export={"path": "m", "every_s": 60}))
    assert spec.dataset.format is DataFormat.STREAM
    assert spec.dataset.options == {"start": 17, "max_wait_s": 5.0, "idle_close_s": 30.0}
    online = parse_job_spec(_with(dataset__path="jetstream://ADS", dataset__schema=ADS_SCHEMA))
    assert online.dataset.options == {"start": "first", "max_wait_s": 5.0}  # no idle_close_s: runs until stopped
    assert parse_job_spec(spec_to_json(spec)) == spec


def test_a_schema_file_beside_the_spec_is_inlined(tmp_path: Path) -> None:
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "ads.yaml").write_text(yaml.safe_dump({"schema": ADS_SCHEMA}))
    doc = _with(dataset__path="x.parquet", dataset__schema="schemas/ads.yaml")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    spec = load_job_spec(str(tmp_path / "job.yaml"))
    assert spec.dataset.schema["multi_hot"][0]["combiner"] == "sqrtn"
    doc["dataset"]["schema"] = "schemas/missing.yaml"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(JobSpecError, match="cannot read the schema file"):
        load_job_spec(str(tmp_path / "job.yaml"))
