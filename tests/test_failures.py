"""Root cause vs knock-on: decided by what a rank was doing, not by the words of its message."""

import os
import signal

import pytest

from ddpkit.failures import (LaunchError, RankFailure, brief, exit_failure, own_frames, pick_root_cause,
                             raised_in_collective)

PEER_GONE = "[pair.cc:537] Read error [127.0.0.1]:4242: Connection reset by peer"


def raise_from(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("did not raise")


def user_code_times_out():
    raise TimeoutError("reading shard 3 timed out")


def test_an_error_in_the_ranks_own_code_is_a_cause_whatever_it_says():
    exc = raise_from(user_code_times_out)
    assert not raised_in_collective(exc)  # "timed out" in a user's message is not a collective timeout


def test_root_cause_beats_an_earlier_knock_on():
    knock_on = RankFailure(0, "raised", "RuntimeError", PEER_GONE, time=1.0, knock_on=True)
    cause = RankFailure(1, "raised", "TimeoutError", "reading shard 3 timed out", time=1.5)
    assert pick_root_cause([knock_on, cause]) is cause


def test_a_rank_that_exited_is_the_cause_even_if_noticed_late():
    knock_on = RankFailure(0, "raised", "RuntimeError", PEER_GONE, time=1.0, knock_on=True)
    exited = exit_failure(1, 3, when=2.0)
    assert exited.exc_type == "exit code 3" and not exited.is_knock_on
    assert pick_root_cause([knock_on, exited]) is exited


def test_when_everyone_timed_out_the_stalled_rank_is_the_cause():
    timeout = RankFailure(0, "raised", "RuntimeError", "Timed out waiting 3000ms for recv", time=1.0, knock_on=True)
    stalled = RankFailure(1, "stalled", "stalled", "waited for", time=2.0)
    assert pick_root_cause([timeout, stalled]) is stalled


WATCHDOG_LOG = """[rank1]:[E ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout: \
WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=3000) ran for 3001 milliseconds before timing out.
terminate called after throwing an instance of 'c10::DistBackendError'
"""


def test_a_rank_aborted_by_nccls_watchdog_is_knock_on():
    aborted = exit_failure(1, -signal.SIGABRT, 2.0, WATCHDOG_LOG)
    assert aborted.kind == "killed" and aborted.is_knock_on and "watchdog" in aborted.message
    stalled = RankFailure(0, "stalled", "stalled", "waited for", time=3.0)
    assert pick_root_cause([aborted, stalled]) is stalled
    plain_abort = exit_failure(1, -signal.SIGABRT, 2.0, "Assertion failed\n")
    assert not plain_abort.is_knock_on  # an abort for another reason is a cause


def test_a_stall_watchdog_dump_is_named_stalled():
    log = "step 3\nTimeout (0:00:13)!\nThread 0x1 (most recent call first):\n  File \"x.py\", line 5 in hang\n"
    failure = exit_failure(0, 1, 1.0, log)
    assert failure.kind == "stalled" and "hang" in failure.traceback


def test_signals_are_named():
    assert exit_failure(2, -signal.SIGKILL, 0.0).exc_type == "SIGKILL"


def test_report_separates_cause_knock_on_and_stopped():
    error = LaunchError.from_failures([
        RankFailure(0, "raised", "RuntimeError", PEER_GONE, time=1.0, knock_on=True),
        RankFailure(1, "raised", "ValueError", "bad batch", "Traceback ...\nValueError: bad batch", 1.1),
        RankFailure(2, "stopped", "stopped", "stopped by the launcher", time=2.0),
    ], log_dir="/logs")
    text = str(error)
    assert text.splitlines()[0] == "rank 1 raised: ValueError: bad batch"
    assert error.rank == 1 and not error.is_user_error
    cause_at, knock_at = text.index("ValueError: bad batch"), text.index("knock-on failures")
    assert cause_at < knock_at < text.index("rank 0 raised: RuntimeError")
    assert "stopped by the launcher: rank 2" in text and "/logs" in text


def test_no_failures_is_a_programming_error():
    with pytest.raises(ValueError):
        pick_root_cause([])


GLOO_CALLBACK = ("Got the following error when running the callback: RuntimeError: [/__w/pytorch/pytorch/third_party/"
                 "gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:37794: Connection reset by peer. This is "
                 "typically caused by the peer crashing\n\nAt:\n  /x/ddpkit/metrics.py(88): done")


def test_a_knock_on_message_is_cut_to_its_first_meaningful_line():
    assert brief(GLOO_CALLBACK) == "Read error [127.0.0.1]:37794: Connection reset by peer (pair.cc)"
    timeout = "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv"
    assert brief(timeout) == "Timed out waiting 3000ms for recv (unbound_buffer.cc)"
    assert brief("plain message") == "plain message"
    knock_on = RankFailure(0, "raised", "RuntimeError", GLOO_CALLBACK, knock_on=True)
    cause = RankFailure(1, "raised", "RuntimeError", GLOO_CALLBACK)
    assert "\n" not in knock_on.headline() and "This is typically" not in knock_on.headline()
    assert cause.headline().endswith("done"), "a root cause keeps its whole message"


def test_a_stall_stack_keeps_the_ranks_frames_and_drops_the_launching_process():
    stack = "\n".join([
        "Timeout (0:00:05)!", "Thread 0x1 (most recent call first):",
        '  File "/home/me/nb.py", line 5 in never', f'  File "/x/ddpkit{os.sep}rank.py", line 55 in rank_main',
        '  File "/usr/lib/python3.11/multiprocessing/process.py", line 108 in run',
        '  File "/x/ipykernel/kernelapp.py", line 700 in start', "", "Thread 0x2 (most recent call first):",
        '  File "/x/threading.py", line 320 in wait'])
    kept = own_frames(stack)
    assert "in never" in kept and "rank_main" in kept and "kernelapp" not in kept and "process.py" not in kept
    assert "2 frame(s) of the launching process omitted" in kept and "threading.py" in kept, kept


def test_a_killed_rank_names_its_signal_once():
    killed = exit_failure(1, -signal.SIGKILL, 0.0)
    assert killed.headline().count("SIGKILL") == 1 and "OOM" in killed.headline()
