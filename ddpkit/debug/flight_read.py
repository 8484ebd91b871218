"""Reading Flight Recorder dumps: each rank's ring as plain data, and gloo's group table as torch's analyzer expects it.

A rank's dump (``fr_rank_<rank>`` in the run folder, written by :func:`ddpkit.debug.flight.dump`) is the
pickled dict that ``torch._C._distributed_c10d._dump_fr_trace()`` returns: its ``entries`` (the ring, one
dict per collective) and its ``pg_config`` (the process groups) among others. torch's analyzer reads
dumps with ``pickle.load``; here they are read by an unpickler that accepts plain data only.

Two details of gloo dumps (torch 2.13) that the analyzer does not expect, handled by :func:`gloo_pg_config`:
the process-group table (``pg_config``) of a gloo rank's dump holds a single entry keyed ``''``, while
every recorded collective names its group (``'0'`` for the default group). The analyzer looks groups
up by that name (its ``build_groups_memberships`` describes a table that the NCCL backend fills in as
it creates communicators), so it fails with a ``KeyError`` on gloo dumps as they are.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle

from ddpkit.files import write_atomic

DUMP_PREFIX = "fr_rank_"


def has_dumps(folder: str) -> bool:
    """True when ``folder`` holds at least one rank's dump."""
    with contextlib.suppress(OSError):
        return any(n.startswith(DUMP_PREFIX) and n[len(DUMP_PREFIX):].isdigit() for n in os.listdir(folder))
    return False


class _PlainData(pickle.Unpickler):
    """A dump holds dicts, lists, strings and numbers only: refuse anything that would run code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"a Flight Recorder dump should hold plain data, not {module}.{name}")


def read_dumps(folder: str) -> dict[int, dict]:
    """Every rank's dump in ``folder``, by rank."""
    dumps = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith(DUMP_PREFIX) and name[len(DUMP_PREFIX):].isdigit():
            with open(os.path.join(folder, name), "rb") as handle:
                dumps[int(name[len(DUMP_PREFIX):])] = _PlainData(io.BytesIO(handle.read())).load()
    if not dumps:
        raise FileNotFoundError(f"no {DUMP_PREFIX}<rank> files in {folder}")
    return dumps


def gloo_pg_config(dump: dict, world: list[int]) -> dict:
    """``dump`` with its process-group table keyed by group name, as the analyzer expects.

    On gloo, ``pg_config`` holds a single entry keyed ``''``, while every recorded collective names its
    group: ``'0'`` for the default group, ``'1'``, ``'2'``... for groups made later. The analyzer looks
    groups up by that name and fails with a ``KeyError``; so the placeholder becomes ``'0'``, and every
    group the entries name gets an entry. Ranks: the placeholder's list when it has one, else ``world``
    (a group made by ``new_group()`` without ranks was dumped with ``[]``, which means every rank).
    """
    config = dict(dump["pg_config"])
    placeholder = config.pop("", None)
    ranks = placeholder["ranks"] if placeholder and placeholder.get("ranks", "[]") != "[]" else str(list(world))
    for entry in dump["entries"]:
        name, desc = entry["process_group"]
        config.setdefault(name, {"name": name, "desc": desc, "ranks": ranks})
    if placeholder is not None:
        config.setdefault("0", {"name": "0", "desc": "default_pg", "ranks": ranks})
    return {**dump, "pg_config": config}


def write_fixed(folder: str, out: str) -> str:
    """Copy the dumps in ``folder`` to ``out`` with :func:`gloo_pg_config` applied, so that torch's own
    command, ``torchfrtrace out``, can analyze them. Returns ``out``."""
    raw = read_dumps(folder)
    os.makedirs(out, exist_ok=True)
    for rank, dump in raw.items():
        write_atomic(os.path.join(out, f"{DUMP_PREFIX}{rank}"), pickle.dumps(gloo_pg_config(dump, sorted(raw))))
    return out
