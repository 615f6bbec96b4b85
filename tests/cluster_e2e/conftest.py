"""One disaggregated cluster for the cluster tests that share its settings."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def served_cluster():
    """Ray prefill and decode actors, KV over UCX with checksums, the gRPC router
    (`cluster.soak.Served`), over the embedded model exported to safetensors once: the same
    weights and outputs, loaded in seconds, so a killed actor is back quickly. Every test
    leaves it serving. (`tandem serve` loading the GGUF itself:
    tests/cluster/test_serve_drain.py.)"""
    pytest.importorskip("ray")
    pytest.importorskip("ucxx")
    from cluster import soak

    s = soak.Served(soak.embedded_export())
    yield s
    s.close()
