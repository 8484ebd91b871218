"""Check for notebook 01's exercise: a config digest that identifies a run.

The contract: ``config_digest(config: dict) -> str``. Two processes must compute the same digest for the
same config (a resume is checked against it); the order of the keys must not matter; changing any value
must change it. Python's ``hash()`` fails the first rule: it is salted per process. The check computes
the digest here and in a fresh Python process with another ``PYTHONHASHSEED``: that process loads the
same module file the function came from (the learner's code, as the grader runs it) and calls the same
function by its qualified name, so what runs there is what ran here, helpers and imports included. Only
a function without a module file (typed into an interpreter) is rebuilt there from its source text.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap

from ddpkit.exercises import Result, graded, not_implemented

CONFIG = {"model": "gpt", "lr": 0.001, "micro_batch_size": 8, "grad_accum": 2, "seed": 17, "layers": [2, 4]}


def _in_fresh_process(fn, config: dict) -> str:
    module = inspect.getmodule(fn)
    path = getattr(module, "__file__", None)
    qualname = getattr(fn, "__qualname__", "")
    argument = f"json.loads({json.dumps(json.dumps(config))})"
    if path and os.path.isfile(path) and "<" not in qualname:  # the module as it ran here, loaded from its file
        program = ("import importlib.util, json, sys\n"
                   f"spec = importlib.util.spec_from_file_location({module.__name__!r}, {path!r})\n"
                   "module = importlib.util.module_from_spec(spec)\n"
                   f"sys.modules[{module.__name__!r}] = module\n"
                   "spec.loader.exec_module(module)\n"
                   "fn = module\n"
                   f"for part in {qualname!r}.split('.'):\n    fn = getattr(fn, part)\n"
                   f"print(fn({argument}))")
    else:
        source = textwrap.dedent(inspect.getsource(fn))
        program = f"import hashlib, json\n{source}\nprint({fn.__name__}({argument}))"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, env=env)
    if proc.returncode:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["failed"])[-1])
    return proc.stdout.strip().splitlines()[-1]


@graded("01_config_digest", "config_digest")
def check_config_digest(fn) -> Result:
    try:
        here = fn(dict(CONFIG))
    except NotImplementedError:
        return not_implemented(getattr(fn, "__name__", "config_digest"))
    except Exception as exc:  # noqa: BLE001
        return Result(False, f"config_digest raised {type(exc).__name__}: {str(exc)[:100]}")
    if not isinstance(here, str) or not here:
        return Result(False, f"config_digest returned {here!r}: return a string (a hex digest)")
    reordered = dict(reversed(list(CONFIG.items())))
    if fn(reordered) != here:
        return Result(False, "the same items in another key order got another digest: what is hashed must not "
                             "depend on the order of the keys")
    for key, value in (("lr", 0.002), ("seed", 18), ("layers", [2, 5])):
        if fn({**CONFIG, key: value}) == here:
            return Result(False, f"changing {key} from {CONFIG[key]!r} to {value!r} did not change the digest: hash every value")
    try:
        there = _in_fresh_process(fn, CONFIG)
    except Exception as exc:  # noqa: BLE001
        return Result(False, f"config_digest could not run in a fresh process ({str(exc)[:80]}): does it depend on "
                             f"something only this process has?")
    if there != here:
        return Result(False, "another process computed another digest for the same config: hash() is salted per "
                             "process (PYTHONHASHSEED), a digest must be the same everywhere")
    return Result(True, "the same digest in two processes, insensitive to key order, and different for any changed value")
