"""The notebooks' helpers: fresh folders, clear dependency errors, streamed commands, tables, records."""

import os
import subprocess
import sys
import time

import pytest

from ddpkit.notebook import fresh_dir, requires, run_command, show_table


def test_fresh_dir_empties_what_an_earlier_run_left(tmp_path):
    folder = fresh_dir(tmp_path / "ck")
    (folder / "step-00000012").mkdir()
    again = fresh_dir(tmp_path / "ck")
    assert again == folder and list(again.iterdir()) == []


def test_requires_names_the_cell_to_run_first():
    with pytest.raises(NameError, match="run the cell under 'Kill a rank' first: this one uses ck"):
        requires({"clean": 1}, "clean", "ck", cell="Kill a rank")
    requires({"ck": 1}, "ck", cell="Kill a rank")


def test_run_command_streams_both_streams_in_the_order_written(capsys):
    code = ("import sys, time\nfor i in range(3):\n    print(f'out {i}', flush=True)\n"
            "    print(f'err {i}', file=sys.stderr, flush=True)\n    time.sleep(0.05)\nsys.exit(3)")
    proc = run_command([sys.executable, "-c", code], show=lambda line: "err" not in line)
    assert proc.returncode == 3
    assert proc.stdout.splitlines() == ["out 0", "err 0", "out 1", "err 1", "out 2", "err 2"]
    assert capsys.readouterr().out.splitlines() == ["out 0", "out 1", "out 2"], "shown as it came, filtered"


def test_run_command_kills_a_command_that_runs_too_long():
    with pytest.raises(subprocess.TimeoutExpired):
        run_command([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"], timeout=1)


def test_show_table_aligns_columns():
    text = show_table([{"rank": 0, "device": "cpu"}, {"rank": 1, "device": "cuda:1"}])
    assert text.splitlines() == ["rank  device", "   0     cpu", "   1  cuda:1"]


def test_run_command_says_it_is_alive_when_the_command_is_quiet(capsys):
    proc = run_command([sys.executable, "-c", "import time; time.sleep(1.2); print('done')"], heartbeat_s=0.5)
    out = capsys.readouterr().out.splitlines()
    assert proc.stdout == "done\n" and out[-1] == "done" and any(line.startswith("... still running") for line in out[:-1])


def test_run_command_says_it_is_alive_while_every_line_is_filtered_out(capsys):
    code = "import time\nfor i in range(25):\n    print('hidden', i, flush=True)\n    time.sleep(0.1)"
    proc = run_command([sys.executable, "-c", code], show=lambda line: False, heartbeat_s=1.0)
    out = capsys.readouterr().out
    assert proc.returncode == 0 and "hidden" not in out and out.count("still running") >= 1, out


def test_a_timeout_kills_every_process_the_command_started_even_in_another_session(tmp_path):
    """What torchrun does: its workers run in sessions of their own, so killing torchrun (or its process
    group) leaves them running. The timeout must take the whole tree."""
    pids = tmp_path / "pids"
    script = ("import subprocess, sys, time\n"
              "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
              f"open({str(pids)!r}, 'w').write(str(worker.pid))\n"
              "print('started', flush=True)\n"
              "time.sleep(120)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_command([sys.executable, "-c", script], timeout=4)
    worker = int(pids.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(worker):
        time.sleep(0.05)
    assert not _alive(worker), "the worker in its own session outlived the timeout"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:  # a zombie (killed, not yet reaped by init) is not alive
        return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
