"""engine.triton_cache_dir: every engine process keeps Triton's compiled kernels there, so a
restart loads them instead of compiling: node actors through their environment from the start,
`tandem serve --colocated` in its own process before the engine is built."""

from __future__ import annotations

import os

from cluster import launcher
from cluster.config import ClusterConfig, apply_overrides
from engine.jit_watch import CACHE_ENV, use_cache_dir
from node_common.node import NOSET_ENV


def test_each_actor_starts_with_the_cache_dir_in_its_environment():
    assert "runtime_env" not in launcher.actor_options(1.0)  # unset: Triton's default
    opts = launcher.actor_options(0.5, True, triton_cache_dir="/cache/triton")
    assert opts["runtime_env"] == {"env_vars": {NOSET_ENV: "1", CACHE_ENV: "/cache/triton"}}


def test_the_config_reaches_both_roles(monkeypatch):
    seen = {}
    monkeypatch.setattr(launcher, "start", lambda *a, **kw: seen.update(kw))
    cfg = apply_overrides(ClusterConfig(), ["engine.triton_cache_dir=/var/cache/triton"])
    launcher.start_from_config(cfg)
    assert seen["triton_cache_dir"] == "/var/cache/triton"
    launcher.start_from_config(ClusterConfig())
    assert seen["triton_cache_dir"] is None


def test_use_cache_dir_sets_tritons_variable_only_when_given(monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    use_cache_dir(None)
    assert CACHE_ENV not in os.environ
    use_cache_dir("/tmp/kernels")
    assert os.environ[CACHE_ENV] == "/tmp/kernels"
