"""bench.detok_cost: the three decode paths give the same deltas and are all timed."""

import json

from bench import detok_cost


def test_paths_agree_and_are_timed(tmp_path):
    out = tmp_path / "detok.json"
    assert detok_cost.main(["--streams", "3", "--steps", "5", "--reps", "1", "--ids", "1,3",
                            "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["ids_per_call"] for r in res["runs"]] == [1, 3]
    for r in res["runs"]:
        assert set(r["us_per_step"]) == {"tokenizer", "byte table, windows",
                                         "byte table, new ids"}
        assert all(v > 0 for v in r["us_per_step"].values())
