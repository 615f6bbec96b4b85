"""bench.kernel_regs compiles the prologue GEMV for sm_90 off the GPU and reads its registers
back (ptxas and cuobjdump from the Triton wheel; no GPU)."""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


@pytest.mark.skipif(not all(os.path.exists(os.path.join(BIN, t)) for t in ("ptxas", "cuobjdump")),
                    reason="this Triton wheel has no ptxas / cuobjdump")
def test_registers_of_the_down_projection_with_and_without_the_dead_row_check(tmp_path):
    from engine import ops

    out = tmp_path / "regs.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real compile
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-m", "bench.kernel_regs", "--projections", "down",
                    "--out", str(out)], check=True, cwd=root, env=env, timeout=300,
                   capture_output=True)
    res = json.loads(out.read_text())
    assert res["arch"] == 90 and res["triton"] == triton.__version__
    rows = res["kernels"]
    assert [r["live"] for r in rows] == [False, True]
    for r in rows:
        assert r["tiles"] == list(ops.linear_tiles(1, 576, 1536))
        assert 16 <= r["registers"] <= 255 and r["stack"] >= 0
        assert r["programs_per_sm_by_registers"] == 65536 // (r["registers"] * 32 * 4)
