"""bench.common.head_summary: which EAGLE-3 head a figure ran, written into its JSON."""

import json
import shutil


def test_head_summary_names_the_shipped_head_and_tells_heads_apart(tmp_path):
    from bench.common import head_summary
    from engine.loader import ASSETS, SHIPPED_HEADS

    shipped = f"{ASSETS}/{SHIPPED_HEADS['SmolLM2-135M-Instruct']}"
    s = head_summary(shipped)
    with open(f"{shipped}/config.json") as f:
        assert s["draft_vocab_size"] == json.load(f)["draft_vocab_size"]
    assert len(s["weights_sha256"]) == 16
    assert s["trained"]["date"] and s["trained"]["eval_expected_acceptance"] > 1
    assert s["trained"]["unfinished"] is False
    other = tmp_path / "head"
    shutil.copytree(shipped, other)
    with open(other / "model.safetensors", "ab") as f:
        f.write(b"\0")  # other weights, another hash
    (other / "training.json").unlink()
    t = head_summary(str(other))
    assert t["weights_sha256"] != s["weights_sha256"] and "trained" not in t


def test_a_second_head_is_a_figure_3_candidate():
    """`--fig3-candidate head=DIR` runs dynamic K with another head in turns with the first
    (a head A/B at every concurrency): the path passes through as a string field."""
    import pytest

    from bench.common import spec_fields

    assert spec_fields("head=/tmp/heads/old") == {"head": "/tmp/heads/old"}
    assert spec_fields("head=/tmp/h, batch_k=5") == {"head": "/tmp/h", "batch_k": 5}
    with pytest.raises(ValueError, match="not SpecConfig"):
        spec_fields("heads=/tmp/h")
