"""The jobs of ``examples/jobs/``, run exactly as their comments tell a user to run them.

Each example's comment block lists the commands (``#   pacer ...``); this test
runs those lines, unchanged, with the venv's ``pacer`` in a fresh directory
(``examples/`` linked into it) against a real embedded stack started there, as
``pacer up`` would be: job service, pod-executor with real TensorFlow PS and
worker processes, shard service, monitor.  S3 is moto's S3 server on loopback
(no S3-compatible server binary is installable here); the credentials reach
the stack, the pods and the commands through the environment only.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import job_client, running_stack
from pacer.contracts.jobs import JobRecord, JobState
from s3_server import S3Server, s3  # noqa: F401  (the module-scoped S3 server fixture)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "jobs"
PACER = Path(sys.executable).with_name("pacer")


def commands_of(example: Path) -> list[list[str]]:
    """The ``pacer`` command lines of an example's comments, in order."""
    return [shlex.split(m.group(1)) for line in example.read_text().splitlines()
            if (m := re.match(r"#\s+(pacer\s.*)$", line))]


AWS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")


def aws_env() -> dict[str, str]:
    """The S3 server's environment (set by the ``s3`` fixture): what a user exports for the stack and the CLI."""
    return {k: os.environ[k] for k in AWS}


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("user")
    (d / "examples").symlink_to(ROOT / "examples")
    return d


@pytest.fixture(scope="module")
def stack(user_dir: Path, s3: S3Server) -> Iterator[object]:  # noqa: F811
    """``pacer up`` in the user's directory: its relative paths (data/, exports/) are the stack's too."""
    old = os.getcwd()
    os.chdir(user_dir)
    try:
        env = {**aws_env(), "PACER_BATCHES_PER_SHARD": "10", "PACER_DATA_ROOTS": str(user_dir)}
        with running_stack(user_dir / ".pacer", ["shard", "monitor", "jobs", "executor"], env) as st:
            yield st
    finally:
        os.chdir(old)


def run_example(name: str, stack: object, user_dir: Path) -> list[str]:
    cmds = commands_of(EXAMPLES / name)
    assert cmds and cmds[-1][:2] == ["pacer", "submit"], cmds
    env = {**os.environ, **aws_env(), "PACER_NATS_URL": stack.url}  # type: ignore[attr-defined]
    outputs = []
    for argv in cmds:
        proc = subprocess.run([str(PACER), *argv[1:]], cwd=user_dir, env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, f"{shlex.join(argv)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        outputs.append(proc.stdout)
    return outputs


def record(stack: object, job: str, timeout: float = 120.0) -> JobRecord:
    """The job's record once the chief's result is in it (the job completes when its data is done; the
    chief's result, with its evaluation and export, follows)."""
    async def get() -> JobRecord:
        async with job_client(stack.url, "examples-test") as c:  # type: ignore[attr-defined]
            deadline = time.monotonic() + timeout
            while True:
                rec: JobRecord = await c.get(job)
                if rec.result or rec.state is not JobState.COMPLETED or time.monotonic() > deadline:
                    return rec
                await asyncio.sleep(0.5)

    return asyncio.run(get())


def check_export(rec: JobRecord) -> None:
    """The SavedModel the record names loads in a fresh process and scores raw rows."""
    assert rec.exported and Path(rec.exported, "saved_model.pb").exists(), rec
    code = ("import sys, tensorflow as tf; m = tf.saved_model.load(sys.argv[1]); "
            "print(sorted(m.signatures['serving_default'].structured_input_signature[1]))")
    out = subprocess.run([sys.executable, "-c", code, rec.exported], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return None


def test_wide_deep_example_trains_criteo_text_in_place(stack: object, user_dir: Path) -> None:
    run_example("wide_deep.yaml", stack, user_dir)
    rec = record(stack, "wide-deep-demo")
    assert rec.state is JobState.COMPLETED, rec.reason
    assert rec.data_path == str(user_dir / "data" / "train.tsv")  # the text itself, not a converted copy
    assert not (user_dir / ".pacer" / "datasets").exists()
    assert rec.records == 100_000 and rec.result["auc"] > 0.65, rec.result


def test_parquet_on_s3_example(stack: object, user_dir: Path) -> None:
    run_example("parquet_s3.yaml", stack, user_dir)
    rec = record(stack, "parquet-s3")
    assert rec.state is JobState.COMPLETED, rec.reason
    assert rec.records == 40_000 and rec.data_path.startswith("s3://"), rec
    assert rec.result["eval_records"] == 5_000 and rec.result["auc"] > 0.6, rec.result
    check_export(rec)


def test_own_schema_example(stack: object, user_dir: Path) -> None:
    out = run_example("own_schema.yaml", stack, user_dir)
    rec = record(stack, "ads-own-schema")
    assert rec.state is JobState.COMPLETED, rec.reason
    assert rec.columns["tags"] == "list<string>" and rec.columns["user"] == "string", rec.columns
    # The planted signal (pacer.data.formats.ads_table) is learnt through every kind of column.
    assert rec.result["auc"] > 0.7, rec.result
    check_export(rec)
    assert out[0]  # the generator's JSON line


def test_schema_inference_prints_its_decisions(user_dir: Path) -> None:
    data = user_dir / "infer.parquet"
    subprocess.run([str(PACER), "data", "gen", "--kind", "ads", str(data), "--rows", "1000"], check=True,
                   capture_output=True, timeout=300)
    out = subprocess.run([str(PACER), "data", "schema", str(data)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "label: click" in out.stdout and "tags" in out.stdout, out.stdout
