"""Other engines running the kit's jobs: Ray Train's worker group (``ray_launch``) and DeepSpeed's ZeRO
(``deepspeed_run``; as a command for torchrun or DeepSpeed's launcher, ``deepspeed_job``). Both are optional
extras (``ddpkit[ray]``, ``ddpkit[deepspeed]``); nothing here imports them until it is used, and a missing
one is named in one line (:func:`require`). Beside them: ``side_by_side`` runs every engine in one launch,
``traffic`` counts each engine's collectives the same way (torch's Flight Recorder), ``compare`` lays the
ZeRO stages out against the kit's strategies and the memory calculator, and ``seed_rows`` holds the small
runs behind seed 003's comparison table."""

from __future__ import annotations

import importlib
import importlib.util

from ddpkit.errors import UserError

EXTRAS = {"ray": ("ray", "pandas", "pyarrow"), "deepspeed": ("deepspeed", "hjson")}
"""The top-level modules each extra installs (``ray[train]`` brings pandas and pyarrow along)."""


class MissingExtra(UserError):
    """An optional engine is not installed: the message names the extra that installs it."""


def missing(extra: str) -> str | None:
    """None when ``extra``'s modules are installed here, else the one line that says how to install them.
    Looks the modules up without importing them (importing Ray Train takes seconds)."""
    for module in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
            found = False
        if not found:
            return f"this needs {extra} ({module} is not installed): pip install 'ddpkit[{extra}]'"
    return None


def require(extra: str) -> None:
    """Raise :class:`MissingExtra` (one line, naming ``ddpkit[extra]``) unless the engine is installed."""
    reason = missing(extra)
    if reason:
        raise MissingExtra(reason)
