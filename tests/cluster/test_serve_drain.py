"""`tandem serve` on SIGTERM: health goes NOT_SERVING, the running stream finishes within the
grace period, the process exits 0 without a traceback."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from tandem_client import Client

TANDEM = shutil.which("tandem", path=os.path.dirname(sys.executable)) or shutil.which("tandem")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(target: str) -> int | None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(
                service="tandem.v1.Generation"), timeout=2).status
    except grpc.RpcError:
        return None


def _wait_serving(proc, target: str, timeout: float = 300.0) -> None:
    from grpc_health.v1 import health_pb2

    end = time.monotonic() + timeout
    while _health(target) != health_pb2.HealthCheckResponse.SERVING:
        assert proc.poll() is None, "tandem serve exited before it served"
        assert time.monotonic() < end, "tandem serve did not come up"
        time.sleep(0.2)


@pytest.mark.skipif(TANDEM is None, reason="the tandem executable is not installed")
def test_sigterm_drains_the_running_stream_then_exits_cleanly(tmp_path):
    port = _free_port()
    target = f"127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([TANDEM, "serve", "--colocated", f"--port={port}",
                             "--set", "metrics.enabled=false", "--set", "model.max_model_len=512",
                             "--set", "router.drain_grace_s=60"], stdout=log, stderr=log)
    try:
        _wait_serving(proc, target)
        with Client(target, retries=0, resume=False) as c:
            stream = c.generate("Once upon a time", temperature=0, max_tokens=48,
                                ignore_eos=True)
            chunks = [next(stream)]
            proc.send_signal(signal.SIGTERM)
            chunks += list(stream)
        assert chunks[-1].finish_reason == "length"
        assert sum(len(ch.token_ids) for ch in chunks) == 48
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    log.seek(0)
    out = log.read()
    assert "draining: 1 streams in flight" in out and "stopped" in out, out[-2000:]
    assert "Traceback" not in out, out[-3000:]
