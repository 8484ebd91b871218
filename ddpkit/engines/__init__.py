"""Other engines running the kit's jobs: Ray Train's worker group (``ray_launch``) and DeepSpeed's ZeRO
(``deepspeed_run``). Both are optional extras (``ddpkit[ray]``, ``ddpkit[deepspeed]``); nothing here
imports them until it is used, and a missing one is named in one line (:func:`require`)."""

from __future__ import annotations

import importlib

from ddpkit.errors import UserError

EXTRAS = {"ray": ("ray.train.torch", "ray"), "deepspeed": ("deepspeed", "deepspeed")}


class MissingExtra(UserError):
    """An optional engine is not installed: the message names the extra that installs it."""


def missing(extra: str) -> str | None:
    """None when ``extra``'s engine imports here, else the one line that says how to install it."""
    module, _ = EXTRAS[extra]
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"this needs {extra} ({exc.name or module} is not installed): pip install 'ddpkit[{extra}]'"
    return None


def require(extra: str) -> None:
    """Raise :class:`MissingExtra` (one line, naming ``ddpkit[extra]``) unless the engine imports."""
    reason = missing(extra)
    if reason:
        raise MissingExtra(reason)
