"""The disaggregated router process imports no torch: a fresh process starts the cluster as
`tandem serve` does (the launcher's Ray prefill and decode actors, KV over UCX, the gRPC
router), on the session's Ray instance as `tandem serve` joins one by `RAY_ADDRESS`, serves a
text and a chat request through the SDK with the outputs the engine alone gives, and has
loaded neither torch nor transformers."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("ucxx")

ROOT = Path(__file__).resolve().parents[2]
READY_S = 900.0  # two actors load the model and warm up on a loaded CPU
TEXT = "The three primary colors are"
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a river.<|im_end|>\n<|im_start|>assistant\nNo"}]

# The router process: engine arguments as a process without torch sends them (dtype by name,
# the speculation config as a dict); it says where it serves, then waits for the word to report
# its modules and stop what it started.
ROUTER = """
import asyncio, json, sys, threading
from cluster import launcher
from cluster.config import TransferSection
from cluster.soak_cluster import ENGINE_KW, SPEC_TOKENS
from router.server import GenerationService, start_server

kw = {**ENGINE_KW, "dtype": "float32", "spec": {"num_tokens": SPEC_TOKENS, "dynamic": False}}
cluster = launcher.start(sys.argv[1], kw, transport="ucx",
                         transport_kwargs=TransferSection(checksum=True).transport_kwargs())
loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True).start()
call = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60)

async def boot():
    service = GenerationService(cluster.backend)
    server, port = await start_server(service, "127.0.0.1", 0)
    return service, server, port

try:
    service, server, port = call(boot())
    print("TANDEM " + json.dumps({"port": port}), flush=True)
    sys.stdin.readline()  # the test's requests are done (or it gave up: EOF)
    print("TANDEM " + json.dumps({m: m in sys.modules for m in ("torch", "transformers")}),
          flush=True)
    call(server.stop(0))
    service.close()
finally:
    cluster.shutdown()
    import ray
    ray.shutdown()
"""


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        if line.startswith("TANDEM "):
            out.put(json.loads(line[len("TANDEM "):]))
    out.put(None)


def test_the_disaggregated_router_serves_without_torch(smol_engine, served_cluster):
    import ray

    from cluster.soak_cluster import embedded_export
    from engine import SamplingParams
    from tandem_client import Client

    want = smol_engine.with_config(enable_prefix_caching=False).generate(
        [TEXT, CHAT], SamplingParams(temperature=0, max_tokens=16))
    with tempfile.TemporaryFile("w+") as err:
        # Its own actors on the Ray instance the session's cluster runs on (no second instance
        # to start and stop); it stops only those.
        env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
        proc = subprocess.Popen([sys.executable, "-c", ROUTER, embedded_export()], cwd=ROOT,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                text=True, env=env)
        said: queue.Queue = queue.Queue()
        threading.Thread(target=_lines, args=(proc.stdout, said), daemon=True).start()

        def log() -> str:
            err.seek(0)
            return err.read()[-4000:]

        try:
            try:
                ready = said.get(timeout=READY_S)
            except queue.Empty:
                ready = None
            assert ready is not None, log()
            with Client(f"127.0.0.1:{ready['port']}", timeout=300) as client:
                text = client.complete(TEXT, temperature=0, max_tokens=16)
                chat = client.chat(CHAT, temperature=0, max_tokens=16)
            proc.stdin.write("report\n")
            proc.stdin.flush()
            modules = said.get(timeout=60)
            assert modules == {"torch": False, "transformers": False}, log()
        finally:
            proc.stdin.close()  # EOF: the router stops the cluster it started
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait(60)
    assert list(text.token_ids) == want[0].token_ids and text.text == want[0].text
    assert list(chat.token_ids) == want[1].token_ids and chat.text == want[1].text
    assert proc.returncode == 0
