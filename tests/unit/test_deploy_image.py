"""The container image (docker/): its basics, the healthcheck script, and that kustomize's image rewrite touches only
the trainer image's env.  (How these tests render the overlays: deploy_support.)"""

from __future__ import annotations

import yaml

from .deploy_support import ROOT, render

DOCKERFILE = ROOT / "docker" / "Dockerfile"


# --------------------------------------------------------------- image


def test_dockerfile() -> None:
    """The image basics; the two targets (slim service, trainer) are checked in test_packaging."""
    assert DOCKERFILE.is_file()
    lines = [ln.strip() for ln in DOCKERFILE.read_text().splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines[0].startswith("FROM python:3.11-slim")
    users = [ln.split(None, 1)[1] for ln in lines if ln.upper().startswith("USER ")]
    assert users, "no USER instruction"
    final = users[-1].split(":")[0]
    assert final not in {"root", "0"}, "image runs as root"
    assert any(ln.startswith('RUN pip install -c constraints.txt ".[') for ln in lines)
    assert (ROOT / "docker" / "healthcheck.py").is_file()
    assert (ROOT / "docker" / "Dockerfile.dockerignore").is_file()
    # The image's UID is what the manifests' runAsUser expects.
    assert final == "10001"


def test_only_image_names_are_rewritten_in_env() -> None:
    """base/kustomizeconfig.yaml lets `images:` rewrite env values equal to an image name: only the trainer's."""
    images = yaml.safe_load((ROOT / "deploy" / "base" / "kustomization.yaml").read_text())["images"]
    rewritten = {f"{i.get('newName', i['name'])}:{i['newTag']}" for i in images}
    seen = 0
    for ov in ("dev", "prod"):
        for doc in render(ov):
            if doc.get("kind") != "Deployment":
                continue
            for c in doc["spec"]["template"]["spec"]["containers"]:
                for e in c.get("env", []):
                    if e["name"] == "PACER_TRAINER_IMAGE":
                        seen += 1
                        assert e["value"] in rewritten
                    else:
                        assert e.get("value") not in rewritten, (ov, doc["metadata"]["name"], e)
    assert seen == 2


def test_healthcheck_parses() -> None:
    src = (ROOT / "docker" / "healthcheck.py").read_text()
    compile(src, "healthcheck.py", "exec")
