"""A short `tandem soak`: a few greedy streams through the real SDK while the decode actor, the
prefill actor and the router each die once and the UCX links are dropped once; every stream
that completed is the fault-free output, and no KV block is left in use."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray")
pytest.importorskip("ucxx")

from cluster import soak  # noqa: E402


@pytest.fixture(scope="module")
def served(served_cluster):
    return served_cluster


def test_a_short_soak_loses_nothing_and_leaks_nothing(served, tmp_path):
    # The faults come one after another, each once the last one's streams move again, and the
    # streams go on until the last has: a short planned run still puts every fault under load.
    cfg = soak.SoakConfig(streams=4, seconds=6, cancel_fraction=0.25, seed=1, prompts=8,
                          min_tokens=16, max_tokens=40, drain_s=60, progress_s=0)
    result = soak.soak(served.target, cfg, served)
    (tmp_path / "soak.json").write_text(json.dumps(result, indent=1))
    why = soak.summary(result)
    assert [f["kind"] for f in result["faults"]] == list(soak.FAULTS), why
    assert all("error" not in f for f in result["faults"]), why
    assert result["tokens"]["lost"] == 0 and result["tokens"]["duplicated"] == 0, why
    assert result["outputs_differing"] == 0, (why, result["differing"])
    assert result["completed_streams"] > 0 and not result["reference"]["failed"], why
    assert result["leaked_blocks"] == 0, result["actors"]
    # every fault was live under some stream, and each stream ended as one of these
    assert all(f["live_streams"] > 0 for f in result["faults"]), why
    assert set(result["outcomes"]) <= {"completed", "cancelled"}, (why, result["failures"])
