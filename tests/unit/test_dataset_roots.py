"""Which files a job may name, and what an error may say of them (issue 21, finding 2).

The job service opens a spec's dataset files on its own host, so
:func:`pacer_services.job_service.datasets.dataset_file` lets a path name only a
regular file under a data root, resolved first (``..`` and symlinks), with
one error for missing and forbidden alike; the readers of
:mod:`pacer.data.criteo` say what is wrong with a file without quoting it.
The same attacks through the HTTP API: tests/integration/test_api_hostile.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from pacer.data import criteo
from pacer.data.criteo import BadRecordFile, MalformedLine, RecordFile
from pacer.errors import ValidationError
from pacer_services.job_service import app as jobs_app
from pacer_services.job_service import datasets

SECRET = "TOPSECRET-0123456789"


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """``root/`` (the data root) with a good file and links in and out; ``outside/`` beside it."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (root / "sub" / "good.rec").write_text("x")
    (outside / "secret.rec").write_text(SECRET)
    (root / "escape.rec").symlink_to(outside / "secret.rec")
    (root / "escape-dir").symlink_to(outside)
    (root / "inside.rec").symlink_to(root / "sub" / "good.rec")
    os.mkfifo(root / "fifo.rec")
    return {"root": root.resolve(), "outside": outside.resolve()}


def refusal(path: str, roots: list[Path]) -> str:
    with pytest.raises(ValidationError) as err:
        datasets.dataset_file(path, roots, "dataset.path")
    return err.value.message.replace(repr(path), "<path>")


def test_only_regular_files_under_a_root_are_named(tree: dict[str, Path]) -> None:
    root = tree["root"]
    name = datasets.dataset_file
    assert name(str(root / "sub" / "good.rec"), [root], "dataset.path") == root / "sub" / "good.rec"
    # A link inside the root to a file inside it is that file.
    assert name(str(root / "inside.rec"), [root], "dataset.path") == root / "sub" / "good.rec"


def test_missing_and_forbidden_get_one_and_the_same_answer(tree: dict[str, Path]) -> None:
    root, outside = tree["root"], tree["outside"]
    missing = refusal(str(root / "absent.rec"), [root])
    assert missing == "dataset.path: <path> is not a file under the job service's data roots (PACER_DATA_ROOTS)"
    forbidden = [
        "/etc/passwd",  # absolute, outside
        str(outside / "secret.rec"),
        f"{root}/../outside/secret.rec",  # .. out of the root
        f"{root}/sub/../../outside/secret.rec",
        str(root / "escape.rec"),  # a symlink in the root, to a file outside
        str(root / "escape-dir" / "secret.rec"),  # through a symlinked directory
        str(root / "sub"),  # a directory
        str(root / "fifo.rec"),  # a FIFO: opening it would block the reader
        str(root / ("x" * 300)),  # a component too long for the OS
        f"{root}-evil/x.rec",  # a sibling whose name starts like the root's
    ]
    for path in forbidden:
        assert refusal(path, [root]) == missing, path


def test_relative_paths_are_taken_from_the_working_directory(tree: dict[str, Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    root = tree["root"]
    monkeypatch.chdir(root)
    assert datasets.dataset_file("sub/good.rec", [root], "dataset.path") == root / "sub" / "good.rec"
    refusal("../outside/secret.rec", [root])
    monkeypatch.chdir(tree["outside"])
    refusal("secret.rec", [root])


def test_no_error_quotes_a_file(tmp_path: Path) -> None:
    """Old messages quoted the magic (``b'root:x:0'`` from /etc/passwd) and the tokens of a line."""
    rec = tmp_path / "not.rec"
    rec.write_text(SECRET * 10)
    with pytest.raises(BadRecordFile) as err:
        RecordFile.open(rec)
    assert "TOPSECRE" not in str(err.value) and "not a Pacer record file" in err.value.reason
    good = "1\t" + "\t".join(["5"] * 13) + "\t" + "\t".join(["68fd1e64"] * 26)
    for bad, reason in ((f"{SECRET}\t" + good[2:], "bad label: not 0 or 1"),
                        (good.replace("\t5\t", f"\t{SECRET}\t", 1), "I1 is not a number")):
        tsv = tmp_path / "day.tsv"
        tsv.write_text(f"{good}\n{bad}\n")
        with pytest.raises(MalformedLine) as line_err:
            criteo.read_criteo(tsv)
        assert line_err.value.reason == reason and SECRET not in str(line_err.value)


def test_the_roots_come_from_pacer_data_roots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PACER_DATA_ROOTS", raising=False)
    config = jobs_app.JobServiceConfig.from_env
    assert config().data_roots == ()  # the data dir alone
    monkeypatch.setenv("PACER_DATA_ROOTS", os.pathsep.join(["/data/a", "", "rel/b", " "]))
    assert config().data_roots == (Path("/data/a"), Path("rel/b"))


def test_the_embedded_stack_roots_are_where_it_started_and_its_data_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `pacer up` and `pacer demo` give the job service unless PACER_DATA_ROOTS is set."""
    from pacer_services.cli import stack as stack_mod

    envs: list[dict[str, str]] = []

    class NoProcess:
        def __init__(self, argv: list[str], env: dict[str, str], **kw: Any) -> None:
            envs.append(env)

    class Server:
        url = "nats://127.0.0.1:4222"

    monkeypatch.setattr(stack_mod.subprocess, "Popen", NoProcess)
    monkeypatch.delenv("PACER_DATA_ROOTS", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".pacer").mkdir()  # what start() makes first
    st = stack_mod.Stack(Path(".pacer"), services=["jobs"], secure=False, tls=False, nats=Server())  # type: ignore[arg-type]
    st.start_service("jobs")
    assert envs[-1]["PACER_DATA_ROOTS"] == os.pathsep.join([str(tmp_path), str(tmp_path / ".pacer")])
    monkeypatch.setenv("PACER_DATA_ROOTS", "/srv/data")
    st.start_service("jobs")
    assert envs[-1]["PACER_DATA_ROOTS"] == "/srv/data"
