"""``pacer sim --policy MODULE:FUNCTION``: a user's own policy runs in the simulator through the controller core.

And the commands the example files tell a user to run do what the examples
expect (they once named a ``pacer data generate`` that did not exist).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
from pacer.jobs import load_job_spec
from pacer_services.cli.main import main as pacer_main
from pacer_services.simulator import cli

REPO = Path(__file__).resolve().parents[2]
SCENARIO = str(REPO / "examples/sim/antdt-table3-worker.yaml")  # worker-3 persistently 3x slower
USER_POLICY = str(REPO / "examples/policies/restart_slowest.py")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, object] | None, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    last = out.strip().splitlines()[-1] if out.strip() else ""
    return rc, (json.loads(last) if last.startswith("{") else None), err


def test_user_policy_from_a_file_acts_through_the_core(capsys: pytest.CaptureFixture[str]) -> None:
    rc, res, _ = _run(capsys, SCENARIO, "--policy", f"{USER_POLICY}:decide", "--no-ideal", "--json")
    assert rc == 0 and res is not None
    assert res["method"] == "restart-slowest"  # the module's NAME, as its policy service registers it
    assert res["actions"] == {"KILL_RESTART": 1}  # the persistent straggler, once: the cool-down holds the rest
    rc, none, _ = _run(capsys, SCENARIO, "--method", "none", "--no-ideal", "--json")
    assert rc == 0 and none is not None and none["actions"] == {}
    assert res["jct_s"] < none["jct_s"]  # replacing the straggler pays off


def test_user_policy_from_a_module(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_policies.py").write_text(
        "from pacer.contracts.policy import PolicyDecision\n"
        "calls = []\n"
        "def idle(req):\n"
        "    calls.append(req.job)\n"
        "    return PolicyDecision(req.job, 'idle', [], reason='watching')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rc, res, _ = _run(capsys, SCENARIO, "--policy", "my_policies:idle", "--no-ideal", "--json")
    assert rc == 0 and res is not None
    assert res["method"] == "my_policies.idle" and res["actions"] == {}
    assert len(sys.modules["my_policies"].calls) == res["decisions"] > 0


@pytest.mark.parametrize(("ref", "why"), [
    ("no_colon", "expected MODULE:FUNCTION"),
    ("no_such_module_xyz:decide", "cannot import"),
    (f"{USER_POLICY}:missing", "has no function 'missing'"),
    ("examples/policies/nope.py:decide", "no Python file"),
])
def test_bad_policy_reference_is_a_clear_error(capsys: pytest.CaptureFixture[str], ref: str, why: str) -> None:
    rc, res, err = _run(capsys, SCENARIO, "--policy", ref, "--no-ideal")
    assert rc == 2 and res is None
    assert why in err


def test_example_job_commands_produce_the_files_the_spec_names(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = REPO / "examples/jobs/wide_deep.yaml"
    commands = [line.split("pacer ", 1)[1] for line in path.read_text().splitlines()
                if line.startswith("#") and "pacer " in line]
    assert commands, "the example says how to make its data"
    monkeypatch.chdir(tmp_path)
    for command in commands:
        argv = shlex.split(command)
        if argv[0] == "submit":
            continue  # needs a stack: tests/integration/test_example_jobs.py runs every line
        argv[argv.index("--rows") + 1] = "200"  # the same command, smaller
        if "--test-rows" in argv:
            argv[argv.index("--test-rows") + 1] = "50"
        assert pacer_main(argv) == 0, command
    spec = load_job_spec(str(path))
    assert (tmp_path / spec.dataset.path).is_file()
    assert spec.dataset.test_path and (tmp_path / spec.dataset.test_path).is_file()
