"""The committed stubs (tandem_proto/) are exactly what tools/gen_proto.py makes of proto/:
this fails when a .proto changes without regenerating, or when a stub is edited by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "tandem_proto"


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools not installed: cannot regenerate")
    out = tmp_path / "tandem_proto"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_proto.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fresh, committed = _tree(out), _tree(GEN)
    differ = sorted(k for k in fresh.keys() | committed.keys() if fresh.get(k) != committed.get(k))
    assert not differ, f"stale stubs {differ}: run `python tools/gen_proto.py` and commit them"
    assert "v1/generation_pb2_grpc.py" in fresh  # the comparison saw the real tree
