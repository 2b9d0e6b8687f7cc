"""An S3-compatible server on loopback for tests: moto's server mode, as s3fs's own tests use it.

The ``s3`` fixture starts ``moto.server.ThreadedMotoServer`` on a free
loopback port and points the AWS environment at it (``AWS_ENDPOINT_URL``,
dummy keys, ``us-east-1``), so that code under test finds the endpoint and
credentials the way it would in production: from the environment only.  The
environment is restored at the end.  Test modules import it with
``from s3_server import s3  # noqa: F401`` (``tests/`` is on ``sys.path``,
as for ``fake_k8s``).

moto accepts any credentials unless IAM checks are on:
:meth:`S3Server.enforcing_auth` turns them on for a block, so that the
dummy keys (unknown to moto's IAM) are refused with ``InvalidAccessKeyId``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

_ENV = {
    "AWS_ACCESS_KEY_ID": "testing-key-id",
    "AWS_SECRET_ACCESS_KEY": "testing-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_UNSET = ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_SECURITY_TOKEN")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class S3Server:
    endpoint: str
    fs: Any  # s3fs.S3FileSystem

    def bucket(self, name: str) -> str:
        """Create bucket ``name`` (>= 3 characters) if it is missing; returns ``s3://name``."""
        if not self.fs.exists(name):
            self.fs.mkdir(name)
        return f"s3://{name}"

    @contextlib.contextmanager
    def enforcing_auth(self) -> Iterator[None]:
        """Within the block, the server checks signatures and IAM policies (moto's reset-auth API)."""
        previous = self._reset_auth("0")
        try:
            yield
        finally:
            self._reset_auth(previous)

    def _reset_auth(self, count: str) -> str:
        # text/plain: as a form, Flask would swallow the body that moto reads as the count.
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=count.encode(), method="POST",
                                     headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return str(json.load(resp)["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"])


@contextlib.contextmanager
def s3_server() -> Iterator[S3Server]:
    """A moto S3 server on loopback with the AWS environment pointing at it."""
    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {**_ENV, "AWS_ENDPOINT_URL": endpoint}
    saved = {k: os.environ.get(k) for k in (*env, *_UNSET)}
    os.environ.update(env)
    for k in _UNSET:
        os.environ.pop(k, None)
    s3fs.S3FileSystem.clear_instance_cache()  # instances cache the endpoint they were made with
    try:
        yield S3Server(endpoint, s3fs.S3FileSystem())
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server
