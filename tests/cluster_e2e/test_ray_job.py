"""The README's `ray job submit` of `tandem serve`, as written there, against the session's own
Ray head with token auth on (`ray_nodes`): it serves a request; without the token, or with
another, the submission is refused. (`tandem serve` joining without it:
tests/cluster/test_ray_head.py.)"""

from __future__ import annotations

import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from tests.cluster_e2e.ray_nodes import RAY, TANDEM, RayNodes, client_env, free_port, retry_agent

README = Path(__file__).resolve().parents[2] / "README.md"
# The README's placeholders, and what this test puts in their place.
HEAD, TOKEN_FILE, TOPOLOGY = "http://HEAD:8265", "/path/to/token", "my-topology.yaml"


def readme_submit() -> tuple[dict[str, str], list[str]]:
    """The variables the README's Ray job block exports and its `ray job submit` command."""
    text = README.read_text()
    at = text.index("\nray job submit ")
    block = text[text.rindex("```sh\n", 0, at):text.index("```", at)]
    env, argv = {}, []
    for line in block.splitlines()[1:]:
        words = shlex.split(line, comments=True)
        if words[:1] == ["export"]:
            env.update(w.split("=", 1) for w in words[1:])
        elif words[:3] == ["ray", "job", "submit"]:
            argv = words
    return env, argv


def _filled(argv: list[str], nodes: RayNodes, topology: Path) -> list[str]:
    """The README's command with this cluster, executables and topology in place."""
    assert {HEAD, TOPOLOGY, "tandem"} <= set(argv), argv  # the README still says so
    place = {"ray": RAY, HEAD: nodes.dashboard, "tandem": TANDEM, TOPOLOGY: str(topology)}
    return [place.get(w, w) for w in argv]


def _submit(env: dict, argv: list[str]) -> tuple[int, str]:
    job = retry_agent(lambda: subprocess.run(argv, env=env, capture_output=True, text=True,
                                             timeout=500))
    return job.returncode, job.stdout + job.stderr


def test_readme_exports_the_token_settings():
    env, argv = readme_submit()
    assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": TOKEN_FILE}
    assert argv[:3] == ["ray", "job", "submit"] and "--" in argv


def test_readme_ray_job_submit_serves_with_token_auth_on(ray_nodes, tmp_path):
    from cluster import soak

    readme_env, argv = readme_submit()
    topology = tmp_path / "my-topology.yaml"
    # The embedded model's safetensors export: the same model, its actors up without parsing
    # the GGUF (`tandem serve` reading the GGUF itself: tests/cluster/test_serve_drain.py).
    topology.write_text(yaml.safe_dump({
        "model": {"path": soak.embedded_export(), "max_model_len": 2048},
        "router": {"port": free_port(), "http_port": 0},
        "prefill": {"kv_cache_bytes": "256MiB"}, "decode": {"kv_cache_bytes": "256MiB"},
        "metrics": {"enabled": False}}))
    nodes = ray_nodes
    argv = _filled(argv, nodes, topology) + ["--demo", "Say hello.", "--max-tokens=8"]
    env = {**client_env(), **readme_env, "RAY_AUTH_TOKEN_PATH": nodes.token_path}
    # The three submissions at once, each its own `ray job submit` process (the refused ones
    # start no job, so they do not contend with the one that serves).
    with ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(_submit, e, argv) for e in (
            client_env(), {**client_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
            env)]
    refused, wrong, (code, out) = [r.result() for r in runs]
    assert refused[0] != 0 and "Missing authentication token" in refused[1], refused[1][-3000:]
    assert wrong[0] != 0 and "Invalid authentication token" in wrong[1], wrong[1][-3000:]
    assert code == 0, out[-3000:]
    assert "succeeded" in out and "Connected to Ray cluster" in out, out[-3000:]
    assert "[8 tokens, finish=length" in out, out[-3000:]
