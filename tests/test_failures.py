import signal

import pytest

from ddpkit.failures import LaunchError, RankFailure, exit_failure, pick_root_cause

PEER_GONE = "[pair.cc:537] Read error [127.0.0.1]:4242: Connection reset by peer"


def test_root_cause_beats_an_earlier_knock_on():
    knock_on = RankFailure(0, "raised", "RuntimeError", PEER_GONE, time=1.0)
    cause = RankFailure(1, "raised", "ValueError", "bad batch", time=1.5)
    assert knock_on.is_knock_on and not cause.is_knock_on
    assert pick_root_cause([knock_on, cause]) is cause


def test_a_rank_that_exited_is_the_cause_even_if_noticed_late():
    knock_on = RankFailure(0, "raised", "RuntimeError", PEER_GONE, time=1.0)
    exited = exit_failure(1, 3, when=2.0)
    assert exited.exc_type == "exit code 3"
    assert pick_root_cause([knock_on, exited]) is exited


def test_when_everyone_timed_out_the_stalled_rank_is_the_cause():
    timeout = RankFailure(0, "raised", "RuntimeError", "Timed out waiting 3000ms for recv", time=1.0)
    stalled = RankFailure(1, "stalled", "stalled", "waited for", time=2.0)
    assert pick_root_cause([timeout, stalled]) is stalled


def test_signals_are_named():
    assert exit_failure(2, -signal.SIGKILL, 0.0).exc_type == "SIGKILL"


def test_report_separates_cause_knock_on_and_stopped():
    error = LaunchError.from_failures([
        RankFailure(0, "raised", "RuntimeError", PEER_GONE, time=1.0),
        RankFailure(1, "raised", "ValueError", "bad batch", "Traceback ...\nValueError: bad batch", 1.1),
        RankFailure(2, "stopped", "stopped", "stopped by the launcher", time=2.0),
    ], log_dir="/logs")
    text = str(error)
    assert text.splitlines()[0] == "rank 1 raised: ValueError: bad batch"
    assert error.rank == 1
    cause_at, knock_at = text.index("ValueError: bad batch"), text.index("knock-on failures")
    assert cause_at < knock_at < text.index("rank 0 raised: RuntimeError")
    assert "stopped by the launcher: rank 2" in text and "/logs" in text


def test_no_failures_is_a_programming_error():
    with pytest.raises(ValueError):
        pick_root_cause([])
