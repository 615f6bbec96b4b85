"""The soak's accounting (cluster/soak_report.py), on made-up streams: what counts as a lost or
duplicated token, and which waits count as a fault's pause."""

from __future__ import annotations

from cluster.soak import Record, SoakConfig, compare, pauses, schedule


def test_lost_duplicated_and_differing_tokens():
    want = [1, 2, 3, 4, 5, 6]
    assert compare(want, want, whole=True) == (0, 0, False)
    assert compare([1, 2, 3, 3, 4, 5, 6], want, whole=True) == (0, 1, True)  # a resend
    assert compare([1, 2, 4, 5, 6], want, whole=True) == (1, 0, True)  # a gap
    assert compare([1, 2, 9, 4, 5, 6], want, whole=True)[2]  # another token
    # a stream that ended early is held to the reference's head only
    assert compare([1, 2, 3], want, whole=False) == (0, 0, False)
    assert compare([1, 2, 3], want, whole=True) == (3, 0, True)
    assert compare([1, 3], want, whole=False) == (1, 0, True)


def test_a_faults_pause_is_the_longest_wait_of_the_streams_it_hit():
    hit = Record(0, None, start=0.0, times=[1.0, 2.0, 9.0, 9.5], end=9.5)  # 7 s across it
    started_in_outage = Record(1, None, start=4.0, times=[8.0, 8.5], end=8.5)  # waited 4 s
    calm = Record(2, None, start=20.0, times=[20.5, 21.0, 21.2], end=21.2)
    faults = [{"at_s": 3.0, "recovered_s": 4.0, "resumed_s": 6.0}]
    (fault,), base = pauses([hit, started_in_outage, calm], faults, end=30.0)
    assert fault["live_streams"] == 2
    assert (fault["pause_p50_s"], fault["pause_max_s"]) == (5.5, 7.0)
    assert base == {"streams": 1, "pause_p50_s": 0.5, "pause_p99_s": 0.5}


def test_faults_are_spread_over_the_run():
    cfg = SoakConfig(seconds=100, faults=("decode", "router"), rounds=2)
    assert schedule(cfg) == [(20.0, "decode"), (40.0, "router"), (60.0, "decode"),
                             (80.0, "router")]
