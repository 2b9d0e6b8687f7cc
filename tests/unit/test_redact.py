"""pacer.redact: credentials masked in what users are shown, everything else left alone."""

from __future__ import annotations

import json

import pytest
from pacer import authjwt, redact, security

TOKEN = authjwt.agent_token("s3cret-of-the-executor", "j1", incarnation=authjwt.incarnation(1.7e9),
                            expires=1_800_000_000)


@pytest.mark.parametrize(("shown", "want"), [
    # A pod's URL (launch.py), alone, in a cluster list, inside the worker's JSON config.
    (security.with_credentials("nats://nats:4222", "agent-j1", TOKEN), "nats://agent-j1:***@nats:4222"),
    (f"nats://agent-j1:{TOKEN}@a:1,nats://agent-j1:{TOKEN}@b:2", "nats://agent-j1:***@a:1,nats://agent-j1:***@b:2"),
    (json.dumps({"nats_url": f"nats://agent-j1:{TOKEN}@nats:4222", "node": "worker-0"}),
     '{"nats_url": "nats://agent-j1:***@nats:4222", "node": "worker-0"}'),
    # Settings named like a credential, in env, YAML, JSON and flag form; an empty one keeps the next line.
    ("PACER_NATS_PASSWORD=hunter2 PACER_NATS_USER=agent", "PACER_NATS_PASSWORD=*** PACER_NATS_USER=agent"),
    ("PACER_AGENT_TOKEN_SECRET=\nPYTHONUNBUFFERED=1", "PACER_AGENT_TOKEN_SECRET=\nPYTHONUNBUFFERED=1"),
    ('{"user": "agent-j1", "pass": "tok"}', '{"user": "agent-j1", "pass": "***"}'),
    ("password: hunter2", "password: ***"),
    ("--password hunter2 --nats-password=x", "--password *** --nats-password=***"),
    ("issuer-seed: SAX", "issuer-seed: ***"),
])
def test_credentials_are_masked_and_the_user_kept(shown: str, want: str) -> None:
    assert redact.text(shown) == want
    assert redact.text(want) == want  # masking twice changes nothing


def test_an_nkey_seed_is_masked_by_its_form_but_a_public_key_is_not() -> None:
    kp = authjwt.KeyPair.create(authjwt.PREFIX_ACCOUNT)
    assert redact.text(f"seed {kp.seed} key {kp.public_key}") == f"seed *** key {kp.public_key}"


@pytest.mark.parametrize("plain", [
    "nats://nats:4222", "http://host:8080/path@x", "step 10 loss=0.3 lr: 0.01", "seed: 42", "bypass: 3",
    "reason: OOMKilled", "worker-0 exited 1",
])
def test_what_is_no_credential_is_left_alone(plain: str) -> None:
    assert redact.text(plain) == plain


def test_data_masks_credential_keys_and_every_string() -> None:
    env = {"PACER_NATS_URL": f"nats://agent-j1:{TOKEN}@h:1", "PACER_NATS_PASSWORD": "x", "n": 3, "seed": 7,
           "issuer-seed": "SA...", "nested": [("password=y",)], "empty_password": ""}
    assert redact.data(env) == {"PACER_NATS_URL": "nats://agent-j1:***@h:1", "PACER_NATS_PASSWORD": "***", "n": 3,
                                "seed": 7, "issuer-seed": "***", "nested": [("password=***",)], "empty_password": ""}
