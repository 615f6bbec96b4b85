"""`ray job submit` of the serve entrypoint against a local `ray start --head` serves a request."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

RAY = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
TANDEM = shutil.which("tandem", path=os.path.dirname(sys.executable)) or shutil.which("tandem")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _head(env: dict, gcs: int, dash: int) -> subprocess.Popen:
    """A Ray head of this test's own (`--block`: stopping this process stops its processes,
    and only those; `ray stop` would stop every Ray on the machine), once it is up."""
    # Every port of its own: another Ray on this machine holds the defaults (its job agent
    # then cannot bind, and every submission says "No available agent").
    ports = [f"--{name}-port={_free_port()}" for name in (
        "dashboard-agent-listen", "dashboard-agent-grpc", "runtime-env-agent", "metrics-export",
        "ray-client-server")]
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", f"--port={gcs}", "--node-ip-address=127.0.0.1",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", *ports, "--num-cpus=2",
         "--disable-usage-stats"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    for line in head.stdout:  # --block prints this once the head's processes are up
        if "will now block forever" in line:
            threading.Thread(target=head.stdout.read, daemon=True).start()  # keep it drained
            return head
    raise AssertionError(f"ray start exited with {head.wait()}")


def _submit(env: dict, dash: int, argv: list[str]) -> subprocess.CompletedProcess:
    """`ray job submit`, again while the head's job agent is not ready yet (it says so)."""
    end = time.monotonic() + 120
    while True:
        job = subprocess.run([RAY, "job", "submit", f"--address=http://127.0.0.1:{dash}", "--",
                              *argv], env=env, capture_output=True, text=True, timeout=400)
        if "No available agent" not in job.stdout + job.stderr or time.monotonic() > end:
            return job
        time.sleep(1)


@pytest.mark.skipif(RAY is None or TANDEM is None, reason="ray / tandem executables not found")
def test_ray_job_submit_serves_a_request():
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    env.pop("RAY_ADDRESS", None)
    gcs, dash, grpc_port = _free_port(), _free_port(), _free_port()
    head = _head(env, gcs, dash)
    try:
        job = _submit(env, dash, [
            TANDEM, "serve", f"--port={grpc_port}", "--set", "metrics.enabled=false",
            "--set", "prefill.kv_cache_bytes=256MiB", "--set", "decode.kv_cache_bytes=256MiB",
            "--set", "model.max_model_len=2048", "--demo", "Say hello.", "--max-tokens=8"])
    finally:
        head.terminate()
        head.wait(120)
    out = job.stdout + job.stderr
    assert job.returncode == 0, out[-3000:]
    assert "succeeded" in out and "Connected to Ray cluster" in out, out[-3000:]
    assert "[8 tokens, finish=length" in out, out[-3000:]
