"""The PacerJob CRD: generated from the job-spec contract, checked in as generated, structural, and it takes
what the job-spec parser takes (examples/k8s/pacerjob.yaml among them) and nothing the parser does not know."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from openapi_schema_validator import OAS30Validator
from pacer import codec, k8s_crd
from pacer.contracts.jobs import JobProgress, JobSpec, ResourcePlan
from pacer.jobs import spec as jobspec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "k8s" / "pacerjob.yaml"


def checked_in() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / k8s_crd.CRD_FILE).read_text())
    return doc


def problems(obj: dict[str, Any]) -> list[str]:
    """What the CRD's schema (the checked-in file's) refuses in ``obj``, as ``<path>: <message>``."""
    validator = OAS30Validator(k8s_crd.open_api_schema(checked_in()))
    return [f"{'.'.join(str(p) for p in e.path)}: {e.message}" for e in validator.iter_errors(obj)]


def walk(node: dict[str, Any], path: str = "") -> typing.Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in (node.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}.*")


# ------------------------------------------------------------------ generated, checked in


def test_the_checked_in_crd_is_the_generated_one() -> None:
    assert (ROOT / k8s_crd.CRD_FILE).read_text() == k8s_crd.render(), (
        f"{k8s_crd.CRD_FILE} is stale: run `python -m pacer.k8s_crd write` (make deploy-conf)")


def test_the_check_command_fails_on_a_stale_file(tmp_path: Path) -> None:
    path = tmp_path / "crd.yaml"
    run = [sys.executable, "-m", "pacer.k8s_crd"]
    assert subprocess.run([*run, "write", str(path)], check=False).returncode == 0
    assert subprocess.run([*run, "check", str(path)], check=False).returncode == 0
    path.write_text(path.read_text().replace("pacerjobs", "pacerjob5"))
    stale = subprocess.run([*run, "check", str(path)], capture_output=True, text=True, check=False)
    assert stale.returncode == 1 and "stale" in stale.stderr


# ------------------------------------------------------------------ what it says


def test_names_scope_and_subresources() -> None:
    crd = checked_in()
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "pacerjobs.pacer.io"
    assert (spec["group"], spec["scope"]) == ("pacer.io", "Namespaced")
    assert spec["names"]["kind"] == "PacerJob" and spec["names"]["plural"] == "pacerjobs"
    assert spec["names"]["shortNames"] == ["pj"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert {"phase", "plan", "progress", "conditions", "observedGeneration"} <= set(status)
    condition = status["conditions"]["items"]["properties"]
    assert {"type", "status", "reason", "message", "lastTransitionTime"} <= set(condition)


def test_every_printer_column_points_at_a_field_of_the_schema() -> None:
    """A misspelt jsonPath shows an empty column and no error anywhere."""
    version = checked_in()["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    names = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"Phase", "Progress", "Age"} <= names
    for column in version["additionalPrinterColumns"]:
        node = schema
        for part in column["jsonPath"].lstrip(".").split("."):
            if part == "creationTimestamp" and node is schema["properties"]["metadata"]:
                break  # ObjectMeta: not in a CRD's schema
            assert part in node.get("properties", {}), column
            node = node["properties"][part]


def test_the_spec_schema_is_structural() -> None:
    """What the API server requires of a CRD's schema: a type everywhere (but where unknown fields are kept),
    no $ref, no logical junctors, and x-kubernetes-preserve-unknown-fields only on the contract's free-form
    maps (dict[str, Any]), found here from the dataclasses, not from the converter."""
    schema = k8s_crd.open_api_schema(checked_in())
    preserved = set()
    for path, node in walk(schema):
        assert not {"$ref", "anyOf", "oneOf", "allOf", "not", "$defs", "default"} & set(node), path
        if node.get("x-kubernetes-preserve-unknown-fields"):
            preserved.add(path)
            assert node.get("type") == "object" and "properties" not in node, path
        else:
            assert node.get("type"), f"{path} has no type"
        if node.get("type") == "object" and path not in preserved and path != ".properties.metadata":
            assert "properties" in node or "additionalProperties" in node or path == ".metadata", path
    free_form = {f".spec{p}" for p in free_form_maps(JobSpec)}
    assert free_form == {".spec.dataset.schema", ".spec.dataset.options", ".spec.policies.params"}
    assert preserved == free_form


def free_form_maps(cls: type[Any], prefix: str = "") -> set[str]:
    """Paths of the ``dict[str, Any]`` fields of a message and the messages it holds."""
    out = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner = hints[f.name]
        if typing.get_origin(inner) in (typing.Union, types.UnionType):  # X | None
            (inner,) = [a for a in typing.get_args(inner) if a is not type(None)]
        if typing.get_origin(inner) is dict and typing.get_args(inner)[1] is Any:
            out.add(f"{prefix}.{f.name}")
        elif dataclasses.is_dataclass(inner):
            out |= free_form_maps(inner, f"{prefix}.{f.name}")  # type: ignore[arg-type]
    return out


def test_the_spec_has_every_field_the_parser_knows_and_no_other() -> None:
    """The API server drops fields its schema lacks: a field the parser reads but the CRD does not list would
    vanish from every PacerJob without a word."""
    spec = k8s_crd.open_api_schema(checked_in())["properties"]["spec"]["properties"]
    sections = {"": jobspec.TOP_LEVEL, "model": jobspec.MODEL_FIELDS, "dataset": jobspec.DATASET_FIELDS,
                "policies": jobspec.POLICY_FIELDS, "resources": jobspec.RESOURCE_FIELDS,
                "limits": jobspec.LIMIT_FIELDS, "trainer": jobspec.TRAINER_FIELDS, "export": jobspec.EXPORT_FIELDS}
    for section, fields in sections.items():
        props = spec if not section else spec[section]["properties"]
        assert set(props) == set(fields), (section, set(props) ^ set(fields))


def test_the_status_plan_and_progress_are_the_contracts() -> None:
    status = k8s_crd.open_api_schema(checked_in())["properties"]["status"]["properties"]
    for field, cls in (("plan", ResourcePlan), ("progress", JobProgress)):
        assert set(status[field]["properties"]) == {f.name for f in dataclasses.fields(cls)}, field
    assert status["phase"]["enum"] == ["Pending", "Invalid", "Submitted", "Planning", "Running", "Completed",
                                       "Failed", "Stopped"]


def test_nullable_fields_are_the_contracts_optional_ones() -> None:
    spec = k8s_crd.open_api_schema(checked_in())["properties"]["spec"]["properties"]
    assert spec["resources"]["nullable"] is True and spec["resources"]["properties"]["workers"]["nullable"] is True
    assert "nullable" not in spec["epochs"]
    assert "(default: 512)" in spec["batch_size"]["description"]  # defaults stay for `kubectl explain`


# ------------------------------------------------------------------ the conversion


def test_unions_other_than_x_or_null_are_refused() -> None:
    with pytest.raises(k8s_crd.NotStructural, match="union"):
        k8s_crd.structural({"type": "object", "properties": {
            "x": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}})
    with pytest.raises(k8s_crd.NotStructural, match="no type"):
        k8s_crd.structural({"type": "object", "properties": {"x": {}}})
    with pytest.raises(k8s_crd.NotStructural, match="bytes"):
        k8s_crd.structural({"type": "object", "properties": {"x": {"type": "string", "contentEncoding": "b"}}})


def test_refs_are_inlined() -> None:
    out = k8s_crd.structural(codec.json_schema(JobSpec))
    assert out["properties"]["model"]["properties"]["name"]["enum"] == ["wide_deep", "xdeepfm", "dcn"]
    assert out["properties"]["export"]["nullable"] is True
    assert out["properties"]["export"]["properties"]["path"]["type"] == "string"


# ------------------------------------------------------------------ the example, and what the schema refuses


def example() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return doc


def test_the_example_validates_against_the_crd_and_parses_as_a_job_spec() -> None:
    obj = example()
    assert obj["apiVersion"] == k8s_crd.API_VERSION and obj["kind"] == k8s_crd.KIND
    assert problems(obj) == []
    assert "name" not in obj["spec"]  # the operator names the job (tests/unit/test_operator_core.py)
    parsed = jobspec.parse_job_spec({**obj["spec"], "name": "team-a-wide-deep-demo-0123456789"})
    assert parsed.model.name.value == "wide_deep" and parsed.epochs == 2 and parsed.limits is not None


def test_the_gang_scheduling_example_validates_and_parses() -> None:
    obj: dict[str, Any] = yaml.safe_load((EXAMPLE.parent / "pacerjob-gang.yaml").read_text())
    assert problems(obj) == []
    parsed = jobspec.parse_job_spec({**obj["spec"], "name": obj["metadata"]["name"]})
    assert parsed.scheduling is not None and parsed.scheduling.gang.value == "kueue"
    obj["spec"]["scheduling"]["gang"] = "slurm"
    assert any("spec.scheduling.gang" in p for p in problems(obj))


@pytest.mark.parametrize(("change", "where"), [
    (lambda s: s.update(model="dcn"), "spec.model"),  # a file's shorthand: a map here
    (lambda s: s.update(epochs="two"), "spec.epochs"),
    (lambda s: s["dataset"].update(format="zip"), "spec.dataset.format"),
    (lambda s: s.update(resources={"workers": 1.5}), "spec.resources.workers"),
    (lambda s: s.update(trainer={"command": "python x.py"}), "spec.trainer.command"),
])
def test_the_schema_refuses_wrong_types(change: Any, where: str) -> None:
    obj = example()
    change(obj["spec"])
    found = problems(obj)
    assert any(p.startswith(where + ":") for p in found), found


def test_the_schema_takes_nulls_and_free_form_maps() -> None:
    obj = example()
    obj["spec"].update(resources=None, export=None, policies={"params": {"threshold": 2.5, "names": ["a", 1]}})
    obj["spec"]["dataset"]["schema"] = {"label": "click", "dense": [{"name": "price", "transform": "log1p"}]}
    assert problems(obj) == []
