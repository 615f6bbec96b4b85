"""`ray job submit` of the serve entrypoint against a local `ray start --head` serves a request."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

RAY = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
TANDEM = shutil.which("tandem", path=os.path.dirname(sys.executable)) or shutil.which("tandem")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(RAY is None or TANDEM is None, reason="ray / tandem executables not found")
def test_ray_job_submit_serves_a_request():
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    env.pop("RAY_ADDRESS", None)
    gcs, dash, grpc_port = _free_port(), _free_port(), _free_port()
    subprocess.run([RAY, "start", "--head", f"--port={gcs}", "--node-ip-address=127.0.0.1",
                    "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=2",
                    "--disable-usage-stats"], env=env, check=True, capture_output=True,
                   timeout=120)
    try:
        job = subprocess.run(
            [RAY, "job", "submit", f"--address=http://127.0.0.1:{dash}", "--", TANDEM, "serve",
             f"--port={grpc_port}", "--set", "metrics.enabled=false",
             "--set", "prefill.kv_cache_bytes=256MiB", "--set", "decode.kv_cache_bytes=256MiB",
             "--set", "model.max_model_len=2048", "--demo", "Say hello.", "--max-tokens=8"],
            env=env, capture_output=True, text=True, timeout=400)
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
    out = job.stdout + job.stderr
    assert job.returncode == 0, out[-3000:]
    assert "succeeded" in out and "Connected to Ray cluster" in out, out[-3000:]
    assert "[8 tokens, finish=length" in out, out[-3000:]
