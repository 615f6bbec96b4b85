"""GPU-only: a speculative engine's token store kernel compiles off the caller's thread.

`lookup.token_store` starts compiling `_store_kernel` (and building its C launcher) on another
thread, so a cold first `generate` of an EAGLE-3 engine does not wait for it. Run in a fresh
process with an empty Triton cache: nothing compiled before, nothing on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = r"""
import json, subprocess, threading
import torch
from engine import jit_watch
from engine.spec import lookup

jit_watch.install()
builds = []  # (thread, command) of every C build (Triton's launcher: gcc)
real = subprocess.check_call
def check_call(cmd, *a, **k):
    builds.append(threading.current_thread().name)
    return real(cmd, *a, **k)
subprocess.check_call = check_call

store = lookup.token_store(64, "cuda")
lookup._await_compile(store.device)
ahead = [e.name for e in jit_watch.since(0)]
ahead_builds = list(builds)
ids = torch.arange(100, 105, device="cuda")
slots = torch.tensor([3, -1, 7, 9, 0], device="cuda")
lookup.store_tokens(store, ids, slots)
torch.cuda.synchronize()
print(json.dumps({"ahead": ahead, "after": [e.name for e in jit_watch.since(0)],
                  "ahead_builds": ahead_builds, "builds": builds,
                  "stored": [int(store[i]) for i in (3, 7, 9, 0)],
                  "spare": int(store[-1])}))
"""


def test_the_store_kernel_compiles_on_another_thread_before_its_first_launch():
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache,
               "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root,
                             capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # Compiled once, ahead of the launch, and not again by it.
    assert [n for n in got["ahead"] if "store" in n] == ["_store_kernel"], got
    assert got["after"] == got["ahead"], got
    # The launcher was built ahead too, off the main thread; the launch built nothing.
    assert got["ahead_builds"] and "MainThread" not in got["ahead_builds"], got
    assert got["builds"] == got["ahead_builds"], got
    assert got["stored"] == [100, 102, 103, 104] and got["spare"] == 101, got
