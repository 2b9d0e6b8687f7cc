"""deploy/README.md's table of what runs says what the overlays render: replicas, updates, images."""

from __future__ import annotations

from typing import Any

from .deploy_support import DEPLOY, env_of, needs_kubectl, one, render

WORKLOADS = {"Deployment", "StatefulSet"}


def table() -> dict[str, dict[str, str]]:
    """The rows of the README's "What runs" table, by workload."""
    text = (DEPLOY / "README.md").read_text()
    section = text.split("## What runs", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")), strict=True)) for ln in lines[2:]]
    return {r["workload"]: r for r in rows}


def image_name(ref: str) -> str:
    """Repository name of an image reference, without registry and tag."""
    return ref.rsplit("/", 1)[-1].split("@", 1)[0].split(":", 1)[0]


def updates(obj: dict[str, Any]) -> str:
    spec = obj["spec"]
    strategy = spec.get("strategy") if obj["kind"] == "Deployment" else spec.get("updateStrategy")
    return (strategy or {}).get("type", "RollingUpdate")  # Kubernetes' default for both kinds


@needs_kubectl
def test_the_readme_table_matches_every_workload_of_both_overlays() -> None:
    rows = table()
    for overlay in ("dev", "prod"):
        docs = render(overlay)
        rendered = {d["metadata"]["name"]: d for d in docs if d["kind"] in WORKLOADS}
        documented = {name for name, r in rows.items() if r["kind"] in WORKLOADS}
        assert documented == set(rendered), (overlay, documented ^ set(rendered))
        for name, obj in rendered.items():
            row = rows[name]
            assert row["kind"] == obj["kind"], name
            assert int(row[overlay]) == obj["spec"].get("replicas", 1), (overlay, name)
            assert row["updates"] == updates(obj), (overlay, name)
            images = {image_name(c["image"]) for c in obj["spec"]["template"]["spec"]["containers"]}
            assert images == {row["image"]}, (overlay, name, images)
        trainer = env_of(one(docs, "Deployment", "pod-executor")["spec"]["template"]["spec"]["containers"][0])
        assert image_name(trainer["PACER_TRAINER_IMAGE"]) == rows["training pods"]["image"], overlay
