"""Renders the Helm chart (deploy/helm/tandem) with the helm CLI of the dev extra."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHART = os.path.join(ROOT, "deploy", "helm", "tandem")
HELM = shutil.which("helm", path=os.path.dirname(sys.executable)) or shutil.which("helm")
needs_helm = pytest.mark.skipif(HELM is None, reason="helm not installed (dev extra helm-binary)")


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60)


def render_list(*sets: str, values: str | None = None) -> list[dict]:
    """Every object `helm template` renders with these `--set`s (and values file)."""
    args = ["template", "demo", CHART]
    for s in sets:
        args += ["--set", s]
    if values:
        args += ["-f", values]
    done = helm(*args)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def render(*sets: str, values: str | None = None) -> dict[str, dict]:
    """The rendered objects by kind (the chart renders one of each)."""
    docs = render_list(*sets, values=values)
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), [d["kind"] for d in docs]
    return by_kind


def lint(*sets: str) -> subprocess.CompletedProcess:
    args = ["lint", "--strict", CHART]
    for s in sets:
        args += ["--set", s]
    return helm(*args)
