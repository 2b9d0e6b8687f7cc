"""Job specs written to hurt (issue 21, findings 8 and 9): what reading one may cost.

A spec comes from anyone with the API token, and the API, the job service
and the CLI all read it with :func:`pacer.jobs.spec.load_spec_document`.
Each test here is an attack the old reader let through: an alias bomb
(1.4 KB that unfold into 10^20 strings: were it expanded anywhere, the
test could not end, so that it ends at all shows it was refused
unexpanded), nesting deep enough to overflow the stack, a text or a number
too large, a path the OS cannot take, a message as long as the value it
complains about.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pacer.jobs import spec as specs
from pacer.jobs.spec import JobSpecError, parse_job_spec, spec_to_json

ROOT = Path(__file__).resolve().parents[2]

BASE = "model: dcn\ndataset: {path: data/train.rec}\n"
ALIASES = "aliases are not allowed in a job spec"


def bomb(levels: int, width: int = 10) -> str:
    """YAML anchors ``a0`` .. ``a<levels>``, each a list of ``width`` aliases of the one before:
    ``*a<levels>`` stands for ``width ** levels`` strings.  Under an ignored key, so that only
    its use (``*a<levels>``) matters."""
    lines = ['bomb: &a0 ["lol"]'] + [f"bomb{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]"
                                     for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_in_name_is_refused_unexpanded() -> None:
    text = bomb(20) + BASE + "name: *a20\n"  # 10^20 strings: no machine could print them
    assert len(text) < 2000
    with pytest.raises(JobSpecError, match=ALIASES) as err:
        parse_job_spec(text)
    assert len(str(err.value)) < 200  # one line naming the problem, not the value


def test_an_alias_bomb_in_policy_params_is_refused() -> None:
    """Finding 8: a list of aliases of a long string passed every check, then filled a reply."""
    text = (f"name: params-bomb\n{BASE}policies:\n  params:\n    big: &s \"{'x' * 1000}\"\n"
            f"    k: [{', '.join(['*s'] * 2000)}]\n")
    with pytest.raises(JobSpecError, match=ALIASES):
        parse_job_spec(text)


@pytest.mark.parametrize("text", [
    f"base: &b {{epochs: 2}}\nname: small\n{BASE}<<: *b\n",  # a merge key: an alias too
    "name: &n small\nmodel: dcn\ndataset: {path: *n}\n",
])
def test_every_alias_is_refused_even_a_harmless_one(text: str) -> None:
    with pytest.raises(JobSpecError, match=ALIASES):
        parse_job_spec(text)


@pytest.mark.parametrize("text", [
    "[" * 400_000 + "]" * 400_000,  # flow style: what JSON sends
    "name: " + "[" * 400_000,  # not even closed
    "a:\n" + "".join(" " * i + "- \n" for i in range(1, 2000)),  # block style
])
def test_deep_nesting_is_a_spec_error_not_a_recursion_error(text: str) -> None:
    with pytest.raises(JobSpecError, match="spec: "):
        parse_job_spec(text)


def test_nesting_is_counted_exactly() -> None:
    def nested(depth: int) -> str:
        return "[" * (depth - 1) + "1" + "]" * (depth - 1)  # the top map is level 1

    assert specs.load_spec_document(f"a: {nested(specs.MAX_SPEC_DEPTH)}")
    with pytest.raises(JobSpecError, match=f"nested deeper than {specs.MAX_SPEC_DEPTH} levels"):
        specs.load_spec_document(f"a: {nested(specs.MAX_SPEC_DEPTH + 1)}")


def test_a_spec_over_256_kib_is_refused_before_it_is_read() -> None:
    padding = "#" + "x" * 1000 + "\n"
    text = f"name: big\n{BASE}" + padding * (256 * 1024 // len(padding) + 1)
    with pytest.raises(JobSpecError, match=f"larger than the {256 * 1024} a spec may have"):
        parse_job_spec(text)
    with pytest.raises(JobSpecError, match="larger than"):
        parse_job_spec(text.encode())


def test_an_overlong_number_is_refused() -> None:
    """YAML 1.1 reads 1:2:3:... as one base-60 integer: 20000 parts would cost seconds to build."""
    with pytest.raises(JobSpecError, match="a number of 59999 characters"):
        parse_job_spec(f"{BASE}name: " + ":".join(["59"] * 20_000) + "\n")
    with pytest.raises(JobSpecError, match="a number of"):
        parse_job_spec(f"{BASE}name: {'9' * 5000}\n")  # more digits than int() converts


def test_a_message_quotes_a_bad_value_shortened() -> None:
    huge = json.dumps({"name": list(range(20_000)), "model": "dcn", "dataset": "x" * 100_000})
    with pytest.raises(JobSpecError) as err:
        parse_job_spec(huge)
    assert err.value.problems[0].startswith("name: must be a string, got list [0, 1, 2")
    assert len(str(err.value)) < 500


@pytest.mark.parametrize(("path", "why"), [
    ("/data/" + "x" * 4995, "dataset.path: at most 4096 characters, got 5001"),
    ("data/tr\0ain.rec", "dataset.path: must not contain a NUL character"),
])
def test_a_dataset_path_the_os_cannot_take_is_refused(path: str, why: str) -> None:
    text = json.dumps({"name": "paths", "model": "dcn", "dataset": {"path": path}})
    with pytest.raises(JobSpecError) as err:
        parse_job_spec(text)
    assert why in err.value.problems
    text = json.dumps({"name": "paths", "model": "dcn", "dataset": {"path": "ok.rec", "test_path": path}})
    with pytest.raises(JobSpecError, match=r"dataset\.test_path: "):
        parse_job_spec(text)


def test_what_specs_need_still_reads() -> None:
    """The examples, JSON, a spec written back by spec_to_json, and an anchor that is never used."""
    for path in sorted((ROOT / "examples" / "jobs").glob("*.yaml")):
        specs.load_job_spec(str(path))  # a schema file it names is read, as the CLI does
    spec = parse_job_spec(f"name: ok\n{BASE}policies: {{params: {{threshold: 2.5, nodes: [a, b]}}}}\n")
    assert parse_job_spec(spec_to_json(spec)) == spec
    assert parse_job_spec(f"name: &n ok\n{BASE}").name == "ok"
    assert specs.load_spec_document("") is None
