"""The trainer's measured chain length (`ttt.chain_runs`): hits in a row from the first draft
per root, over the roots whose every draft lies in the record."""

from __future__ import annotations

import torch

from cluster.eagle3.ttt import Evaluation, chain_runs, expected_acceptance


def _hits(rows: list[list[int]], L: int) -> list[torch.Tensor]:
    """Per step j, a [1, L - j - 1] hit tensor whose first roots are `rows[r][j]`."""
    out = []
    for j in range(len(rows[0])):
        h = torch.zeros(1, L - j - 1, dtype=torch.bool)
        for r, row in enumerate(rows):
            h[0, r] = bool(row[j])
        out.append(h)
    return out


def test_runs_count_hits_in_a_row_not_hits():
    # three roots: hit hit miss (2), hit miss hit (1), miss hit hit (0)
    hits = _hits([[1, 1, 0], [1, 0, 1], [0, 1, 1]], L=6)
    valid = torch.ones(1, 6, dtype=torch.bool)
    assert chain_runs(hits, valid, 3) == (3.0, 3.0)
    ev = Evaluation([2 / 3] * 3, 1.0 + 3.0 / 3.0)
    # two hits in three at every step, as if independent, reads 2.41: not what ran
    assert ev.entry()["eval_tokens_per_forward"] == 2.0
    assert ev.entry()["eval_expected_acceptance"] == round(expected_acceptance([2 / 3] * 3), 3)
    assert ev.entry()["eval_expected_acceptance"] > 2.4


def test_roots_whose_drafts_leave_the_record_do_not_count():
    hits = _hits([[1, 1, 0], [1, 0, 1], [0, 1, 1]], L=6)
    valid = torch.ones(1, 6, dtype=torch.bool)
    valid[0, 5] = False  # root 2's third draft would predict past the record
    assert chain_runs(hits, valid, 3) == (3.0, 2.0)
    valid[0, 0] = False  # root 0 predicts a prompt token
    assert chain_runs(hits, valid, 3) == (1.0, 1.0)


def test_records_no_longer_than_the_unroll_give_no_roots():
    valid = torch.ones(1, 3, dtype=torch.bool)
    assert chain_runs(_hits([[1, 1, 1]], L=4)[:2], valid, 3) is None
