"""A node actor reports ready once, with how long its start took, and its /metrics carries that
time (`tandem_ready_seconds`) and the Triton compiles after it."""

from __future__ import annotations

import re

from engine import Engine, jit_watch
from engine.collector import unfreeze
from node_common.node import Node
from tests.helpers import tiny_engine


def test_a_node_reports_ready_once_and_exports_its_time(monkeypatch, capsys):
    monkeypatch.setattr(Engine, "from_pretrained",
                        classmethod(lambda cls, model, **kw: tiny_engine(0)))
    monkeypatch.setattr(jit_watch, "_warn_from", None)
    try:
        node = Node("decode", None, {}, None, "127.0.0.1")
    finally:
        unfreeze()  # the test process goes on discarding engines
    try:
        err = capsys.readouterr().err
        lines = re.findall(r"decode node ready in [\d.]+ s \(load [\d.]+ s, graphs [\d.]+ s\)",
                           err)
        assert len(lines) == 1, err
        get = node.metrics.registry.get_sample_value
        labels = {"role": "decode", "model_name": node.engine.config.model.name}
        assert get("tandem_ready_seconds", labels) == node.engine.ready.total > 0
        assert node.engine.ready.load > 0  # the build counts, not only the preparation
        assert get("tandem_jit_compiles_after_ready_total", labels) == jit_watch.after_ready()
    finally:
        node.loop.stop()
