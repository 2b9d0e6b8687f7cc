"""scope_checkpoints: which mounts of a pod template become the job's own checkpoint directory."""

from __future__ import annotations

from typing import Any

from pacer_services.pod_executor.backends.kubernetes import scope_checkpoints

ROOT = "/ckpt"


def containers(*mounts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"name": f"c{i}", "volumeMounts": [dict(m) for m in ms]} for i, ms in enumerate(mounts)]


def test_the_mount_at_the_root_becomes_the_jobs_directory() -> None:
    cs = containers([{"name": "ck", "mountPath": "/ckpt/"}, {"name": "data", "mountPath": "/data"}])
    scope_checkpoints(cs, ROOT, "j1")
    assert cs[0]["volumeMounts"] == [{"name": "ck", "mountPath": "/ckpt/j1", "subPath": "j1"},
                                     {"name": "data", "mountPath": "/data"}]


def test_every_mount_of_that_volume_is_narrowed_in_every_container() -> None:
    """Another container (or path) mounting the same volume must not show the whole of it."""
    cs = containers([{"name": "ck", "mountPath": "/ckpt"}], [{"name": "ck", "mountPath": "/mnt/all", "readOnly": True}])
    scope_checkpoints(cs, ROOT, "j1")
    assert cs[1]["volumeMounts"] == [{"name": "ck", "mountPath": "/mnt/all/j1", "subPath": "j1", "readOnly": True}]


def test_a_templates_own_sub_path_is_kept_in_front() -> None:
    cs = containers([{"name": "ck", "mountPath": "/ckpt", "subPath": "team/"}],
                    [{"name": "ck", "mountPath": "/x", "subPathExpr": "$(NS)"}])
    scope_checkpoints(cs, ROOT, "j1")
    assert cs[0]["volumeMounts"][0]["subPath"] == "team/j1"
    assert cs[1]["volumeMounts"][0]["subPathExpr"] == "$(NS)/j1" and "subPath" not in cs[1]["volumeMounts"][0]


def test_nothing_changes_without_a_mount_at_the_root() -> None:
    mounts = [{"name": "ck", "mountPath": "/ckpt-other"}, {"name": "up", "mountPath": "/"}]
    cs = containers(mounts)
    scope_checkpoints(cs, ROOT, "j1")
    assert cs[0]["volumeMounts"] == mounts
