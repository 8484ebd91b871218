"""Check for notebook 01's exercise: a config digest that identifies a run.

The contract: ``config_digest(config: dict) -> str``. Two processes must compute the same digest for the
same config (a resume is checked against it); the order of the keys must not matter; changing any value
must change it. Python's ``hash()`` fails the first rule: it is salted per process. The check computes
the digest in one process, and in a fresh Python interpreter with another ``PYTHONHASHSEED`` that loads
the same code (the learner's module, helpers and imports included), and compares. The config holds a
value drawn for this run, so no digest can be known in advance.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

from ddpkit.exercises import Result, graded, learner, not_implemented

CONFIG = {"model": "gpt", "lr": 0.001, "micro_batch_size": 8, "grad_accum": 2, "seed": 17, "layers": [2, 4]}

_FRESH = """import importlib, importlib.util, json, os, sys
fd, path, name, refs = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
config = json.loads(sys.stdin.read())
if name in refs:
    module_name, _, qualname = refs[name].partition(":")
    fn = importlib.import_module(module_name)
    for part in qualname.split("."):
        fn = getattr(fn, part)
else:
    spec = importlib.util.spec_from_file_location("submission", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["submission"] = module
    spec.loader.exec_module(module)
    fn = getattr(module, name)
os.write(fd, ("\\n" + json.dumps(str(fn(config))) + "\\n").encode())
"""


def _in_fresh_process(fn, config: dict) -> str:
    """The digest in a new interpreter (another hash seed) that loads the learner's code; what it wrote last."""
    session = learner.SESSION
    if session is None or not isinstance(fn, learner.LearnerRef):
        raise RuntimeError("the fresh process needs the learner's code as the grader holds it")
    read, write = os.pipe()
    env = {**os.environ, "PYTHONHASHSEED": str(secrets.randbelow(2**31) + 1),
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with open(os.path.join(session.logdir or session.workdir, "fresh.log"), "ab") as log:
        proc = subprocess.Popen([sys.executable, "-c", _FRESH, str(write), session.submission, fn.name,
                                 json.dumps(session.refs)], stdin=subprocess.PIPE, stdout=log, stderr=log,
                                cwd=session.workdir, env=env, pass_fds=(write,))
    os.close(write)
    try:
        proc.communicate(json.dumps(config).encode(), timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        os.close(read)
        raise RuntimeError("no answer within 60 s") from None
    chunks = []
    while True:
        chunk = os.read(read, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read)
    lines = [line for line in b"".join(chunks).decode(errors="replace").splitlines() if line.strip()]
    if proc.returncode or not lines:
        raise RuntimeError(f"exit code {proc.returncode}")
    return str(json.loads(lines[-1]))


@graded("01_config_digest", "config_digest")
def check_config_digest(fn) -> Result:
    config = {**CONFIG, "run": secrets.token_hex(4)}  # drawn now: no digest can be known in advance
    reordered = dict(reversed(list(config.items())))
    changed = [(key, value, {**config, key: value}) for key, value in (("lr", 0.002), ("seed", 18), ("layers", [2, 5]))]
    try:
        here, again, *others = learner.many(fn, [(dict(config),), (reordered,), *((c,) for _, _, c in changed)])
    except NotImplementedError:
        return not_implemented(getattr(fn, "__name__", "config_digest"))
    except learner.Raised as exc:
        return Result(False, exc.sentence("config_digest"))
    except Exception as exc:  # noqa: BLE001 - called here, outside the sandbox
        return Result(False, f"config_digest raised {type(exc).__name__}: {learner.short(str(exc))}")
    if not isinstance(here, str) or not here:
        return Result(False, f"config_digest returned {type(here).__name__}: return a string (a hex digest)")
    if again != here:
        return Result(False, "the same items in another key order got another digest: what is hashed must not "
                             "depend on the order of the keys")
    for (key, value, _), other in zip(changed, others):
        if other == here:
            return Result(False, f"changing {key} from {config[key]!r} to {value!r} did not change the digest: hash every value")
    try:
        there = _in_fresh_process(fn, config)
    except Exception as exc:  # noqa: BLE001
        return Result(False, f"config_digest could not run in a fresh process ({learner.short(str(exc), 60)}): does it "
                             f"depend on something only this process has?")
    if there != here:
        return Result(False, "another process computed another digest for the same config: hash() is salted per "
                             "process (PYTHONHASHSEED), a digest must be the same everywhere")
    return Result(True, "the same digest in two processes, insensitive to key order, and different for any changed value")
