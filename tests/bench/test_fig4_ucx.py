"""Figure 4's UCX rows (`bench.fig4_kv_transfer.ucx_transfer`) on host buffers: the plumbing that
otherwise runs only on a two-GPU machine, so a slip there cannot cost that run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 1 << 20

SCRIPT = """
import json, sys
from types import SimpleNamespace
from bench.fig4_kv_transfer import ucx_transfer
res = ucx_transfer(SimpleNamespace(fig4_reps=2), [2 << 20, 8 << 20], ("cpu", "cpu"))
print("RESULT " + json.dumps(res))
"""


def test_fig4_ucx_rows_on_the_host():
    pytest.importorskip("ucxx")
    # Its own process: ucxx binds to the first event loop that uses it.
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    res = json.loads(line.removeprefix("RESULT "))
    assert "error" not in res, res.get("error")
    rows = res["rows"]
    assert [r["bytes"] for r in rows] == [2 * MIB, 8 * MIB]
    for r in rows:
        # Host caches in two processes cannot pull: the headline is the message path.
        assert r["path"] == r["messages_path"] and r["gb_s"] == r["messages_gb_s"] > 0
        paths = [x["path"] for x in r["raw"]]
        assert paths.count("direct") == 1 and paths.count("staged") == 3, paths
        assert set(r["traces"]) >= {"direct", "staged, 1 chunk(s)", "staged, 8 chunk(s)"}
    scattered = res["scattered_ids"]
    assert scattered["bytes"] == 8 * MIB and scattered["messages_gb_s"] > 0
    assert scattered["path"].startswith("staged")
    assert res["sender"] == "cpu" and res["receiver"].startswith("cpu")
