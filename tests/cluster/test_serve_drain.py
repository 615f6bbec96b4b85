"""`tandem serve` as users run it: gRPC and the OpenAI-compatible HTTP API (through the
official `openai` package) give the same output; on SIGTERM the running streams of both finish
within the grace period and the process exits 0 without a traceback."""

from __future__ import annotations

import os
import re
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
def test_serve_answers_grpc_and_openai_then_drains_both_on_sigterm(tmp_path):
    """The HTTP API is on by default beside gRPC and gives its output, whole and streamed (the
    official `openai` package); on SIGTERM a running gRPC stream and a running SSE stream both
    finish within the grace period and the process exits 0 without a traceback."""
    openai = pytest.importorskip("openai")
    port = _free_port()
    target = f"127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([TANDEM, "serve", "--colocated", f"--port={port}", "--http-port=0",
                             "--set", "metrics.enabled=false", "--set", "model.max_model_len=512",
                             "--set", "router.drain_grace_s=60"], stdout=log, stderr=log)
    try:
        _wait_serving(proc, target)
        log.seek(0)
        found = re.search(r"OpenAI-compatible API on http://127\.0\.0\.1:(\d+)/v1", log.read())
        assert found, "the HTTP port is not announced"
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{found[1]}/v1", api_key="none",
                            max_retries=0, timeout=120)
        model = api.models.list().data[0].id
        chat = [{"role": "user", "content": "Write one sentence about the sea."}]
        with Client(target, retries=0, resume=False) as c:
            ref = c.complete(messages=chat, temperature=0, max_tokens=20)
            whole = api.chat.completions.create(model=model, messages=chat, temperature=0,
                                                max_tokens=20)
            assert whole.choices[0].message.content == ref.text
            sse = api.chat.completions.create(model=model, messages=chat, temperature=0,
                                              max_tokens=20, stream=True)
            parts = [next(iter(sse))]
            stream = c.generate("Once upon a time", temperature=0, max_tokens=48,
                                ignore_eos=True)
            chunks = [next(stream)]
            proc.send_signal(signal.SIGTERM)
            chunks += list(stream)
            parts += list(sse)
        assert chunks[-1].finish_reason == "length"
        assert sum(len(ch.token_ids) for ch in chunks) == 48
        assert "".join(p.choices[0].delta.content or "" for p in parts) == ref.text
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    log.seek(0)
    out = log.read()
    assert "draining: " in out and "stopped" in out, out[-2000:]
    assert "Traceback" not in out, out[-3000:]
