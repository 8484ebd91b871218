"""Shared helpers: run the real CLI in a subprocess, read its summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Headless: notebook kernels started by this session (papermill, nbval) show progress as text lines.
os.environ.setdefault("DDPKIT_PROGRESS", "text")


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def run_cli(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m ddpkit <args>`` as a new user would run it."""
    return subprocess.run([sys.executable, "-m", "ddpkit", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or cli_env(), cwd=REPO)


def train_summary(tmp_path: Path, name: str, *args: str) -> dict:
    """Run ``ddpkit train`` and return its --summary-json."""
    path = tmp_path / f"{name}.json"
    proc = run_cli("train", "--summary-json", str(path), *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(path.read_text())


@pytest.fixture
def summary(tmp_path):
    return lambda name, *args: train_summary(tmp_path, name, *args)
