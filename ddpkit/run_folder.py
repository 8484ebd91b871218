"""The folder of one launch: where ranks write their logs, results and error records.

By default a fresh folder in the temporary directory, removed after a clean run and kept (named in the
error) after a failure; only the newest few failed ones are kept, and a folder whose launcher has died
counts as ended. A folder the caller names (``log_dir``) keeps everything but the launcher's own old
files, so a reused folder never hands back a stale result.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import tempfile
from typing import Any

from ddpkit.files import write_atomic

KEEP_FAILED_LOGS = 10  # log folders of failed launches kept in the temp folder, newest first
LOG_PREFIX = "ddpkit-launch-"
_OWN_FILE = re.compile(r"^(rank\d+\.(log|result|error\.json)|progress\.jsonl|fr_rank_\d+)$")


def make_run_dir(log_dir: str | None) -> str:
    """The folder for this launch's logs and results; a given ``log_dir`` keeps everything but our old files."""
    if log_dir is None:
        prune_failed_logs()
        run_dir = tempfile.mkdtemp(prefix=LOG_PREFIX)
        write_atomic(os.path.join(run_dir, "launcher.json"), json.dumps({"pid": os.getpid()}).encode())
        return run_dir
    run_dir = os.path.abspath(log_dir)
    os.makedirs(run_dir, exist_ok=True)
    for name in os.listdir(run_dir):  # a reused folder must not hand back an old result
        if _OWN_FILE.match(name):
            os.remove(os.path.join(run_dir, name))
    return run_dir


def prune_failed_logs(keep: int = KEEP_FAILED_LOGS) -> None:
    """Keep the newest ``keep`` log folders of ended launches (failed, or whose launcher died); drop the rest."""
    root = tempfile.gettempdir()
    ended = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not name.startswith(LOG_PREFIX) or not os.path.isdir(path):
            continue
        if os.path.exists(os.path.join(path, "FAILED")) or not _launcher_alive(path):
            with contextlib.suppress(OSError):
                ended.append((os.path.getmtime(path), path))
    for _, path in sorted(ended, reverse=True)[keep:]:
        shutil.rmtree(path, ignore_errors=True)


def _launcher_alive(run_dir: str) -> bool:
    try:
        with open(os.path.join(run_dir, "launcher.json")) as handle:
            os.kill(int(json.load(handle)["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def read_result(run_dir: str, rank: int) -> Any:
    # Written by our own child process a moment ago: trusted IPC, not a checkpoint from disk.
    with open(os.path.join(run_dir, f"rank{rank}.result"), "rb") as handle:
        return pickle.load(handle)
