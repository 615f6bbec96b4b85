"""Prometheus' own checker on what the deployment ships: `promtool check rules` on the alert
rules and `promtool check metrics` (exposition-format lint) on each component's /metrics text,
after it has seen requests, speculation and transfers. promtool comes with `make venv` (from
Debian's prometheus package; no wheel ships it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from engine.metrics import Metrics, RequestTimer
from tests.deploy.chart import ROOT

PROMTOOL = shutil.which("promtool", path=os.path.dirname(sys.executable)) or \
    shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing: run make venv "
                                "on a Debian-based machine (apt-get download prometheus)")


def _promtool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, timeout=60)


def test_the_alert_rules_pass_promtool():
    r = _promtool("check", "rules", os.path.join(ROOT, "deploy", "prometheus", "alerts.yaml"))
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
    assert b"SUCCESS" in r.stdout


def component_metrics(role: str) -> Metrics:
    """A component's metrics as its process builds them: a node's watch its engine, prepared
    before it serves (on the CPU nothing is captured), so they carry time to ready and the
    compiles after it."""
    m = Metrics(role)
    if role != "router":
        from engine.collector import unfreeze
        from tests.helpers import tiny_engine

        eng = tiny_engine(0)
        try:
            eng.prepare_to_serve()
        finally:
            unfreeze()  # the test process goes on collecting what it discards
        m.watch_engine(eng)
    return m


@pytest.mark.parametrize("role", ["router", "prefill", "decode"])
def test_each_components_exposition_passes_promtool(role):
    m = component_metrics(role)
    timer = RequestTimer(m, prompt_tokens=12)
    timer.token(1)
    timer.token(3)
    timer.finish("stop")
    m.observe_spec([4, 4, 4], [3, 2, 1])
    m.observe_transfer(1 << 20, 0.002, ok=True, path="ucx")
    m.observe_transfer(1 << 20, 0.002, ok=False, path="ucx")
    m.errors.labels(m.role, "INVALID_ARGUMENT").inc()
    r = _promtool("check", "metrics", stdin=m.exposition())
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()


def test_promtool_catches_a_bad_exposition():
    """Negative control: a gauge named like a counter is refused."""
    bad = b"# HELP x_total a gauge\n# TYPE x_total gauge\nx_total 1\n"
    r = _promtool("check", "metrics", stdin=bad)
    assert r.returncode != 0
