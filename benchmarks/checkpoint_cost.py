"""Checkpoint save and restore cost, against plain PyTorch, interleaved in one run.

Save: ddpkit's atomic, verified save (hash while writing, fsync of the file, a manifest written and
fsynced last, rename, folder fsyncs, prune) against ``torch.save`` alone and against ``torch.save`` +
``fsync``, the durable minimum any crash-safe save must pay. Target: <= 1.2x the durable minimum.
Restore: verify (re-hash) + ``torch.load(weights_only=True)`` against ``torch.load`` alone.
"""

import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import summarize, write_results  # noqa: E402

from ddpkit import checkpoint  # noqa: E402
from ddpkit.config import TrainConfig  # noqa: E402
from ddpkit.models import build_model  # noqa: E402
from ddpkit.state import rng_state  # noqa: E402
from ddpkit.train import build_optimizer  # noqa: E402


def training_state(hidden_width: int) -> dict:
    """What a trainer saves: weights, AdamW moments, RNG states (about 16 MB at width 1024)."""
    cfg = TrainConfig(hidden_width=hidden_width)
    model = build_model(cfg)
    optimizer = build_optimizer(model, cfg)
    model(torch.randn(4, cfg.input_width)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": [rng_state()]}


def main(repeats: int = 15, hidden_width: int = 1024) -> dict:
    state = training_state(hidden_width)
    times = {"ddpkit": [], "torch_save": [], "torch_save_fsync": [], "ddpkit_load": [], "torch_load": []}
    with tempfile.TemporaryDirectory() as root:
        def ddpkit_save(i):
            return checkpoint.save(os.path.join(root, "ck"), i, state, keep_last=2)

        def plain(i):
            torch.save(state, os.path.join(root, f"plain-{i}.pt"))

        def durable(i):
            with open(os.path.join(root, f"durable-{i}.pt"), "wb") as handle:
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())

        savers = [("ddpkit", ddpkit_save), ("torch_save", plain), ("torch_save_fsync", durable)]
        for i in range(repeats):
            for name, save in savers[i % 3:] + savers[:i % 3]:  # rotate the order: drift hits all alike
                started = time.perf_counter()
                save(i)
                times[name].append(time.perf_counter() - started)
            path = checkpoint.step_dir(os.path.join(root, "ck"), i)
            started = time.perf_counter()
            checkpoint.load(path)
            times["ddpkit_load"].append(time.perf_counter() - started)
            started = time.perf_counter()
            torch.load(os.path.join(root, f"plain-{i}.pt"), weights_only=True)
            times["torch_load"].append(time.perf_counter() - started)
            for name in ("plain", "durable"):
                os.remove(os.path.join(root, f"{name}-{i}.pt"))
        nbytes = (path / checkpoint.STATE_FILE).stat().st_size
    s = {name: summarize(values) for name, values in times.items()}
    return write_results("checkpoint_cost", {
        "bytes": nbytes,
        "save": {"ddpkit_atomic_verified": s["ddpkit"], "torch_save": s["torch_save"],
                 "torch_save_fsync": s["torch_save_fsync"],
                 "ratio_to_torch_save_fsync": s["ddpkit"]["median_s"] / s["torch_save_fsync"]["median_s"],
                 "ratio_to_torch_save": s["ddpkit"]["median_s"] / s["torch_save"]["median_s"],
                 "target_ratio_to_torch_save_fsync": 1.2},
        "restore": {"ddpkit_verify_and_load": s["ddpkit_load"], "torch_load": s["torch_load"],
                    "ratio": s["ddpkit_load"]["median_s"] / s["torch_load"]["median_s"]},
        "note": "ddpkit hashes while writing (a second thread), fsyncs state.pt and manifest.json, "
                "renames the folder and fsyncs both folders; a restore re-hashes the file before loading it",
    })


if __name__ == "__main__":
    main()
