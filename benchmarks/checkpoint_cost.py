"""Atomic + fsynced + sha256-verified checkpoint save against plain torch.save of the same state,
interleaved in one run; and restore (verify + weights_only load) against plain torch.load.
Target: save <= 1.2x plain."""

import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import summarize, write_results  # noqa: E402

from ddpkit import checkpoint, train  # noqa: E402
from ddpkit.state import rng_state  # noqa: E402
from ddpkit.config import TrainConfig  # noqa: E402
from ddpkit.models import build_model  # noqa: E402


def main(repeats: int = 10) -> None:
    cfg = TrainConfig(hidden_width=1024)
    model = build_model(cfg)
    opt = train.build_optimizer(model, cfg)
    model(torch.randn(4, cfg.input_width)).sum().backward()
    opt.step()  # so the optimizer has its moments
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": [rng_state()]}
    saves, plain_saves, loads, plain_loads = [], [], [], []
    with tempfile.TemporaryDirectory() as root:
        for i in range(repeats):
            t = time.perf_counter()
            path = checkpoint.save(os.path.join(root, "ddpkit"), i, state, keep_last=2)
            saves.append(time.perf_counter() - t)
            plain = os.path.join(root, f"plain-{i}.pt")
            t = time.perf_counter()
            torch.save(state, plain)
            plain_saves.append(time.perf_counter() - t)
            t = time.perf_counter()
            checkpoint.load(path)
            loads.append(time.perf_counter() - t)
            t = time.perf_counter()
            torch.load(plain, weights_only=True)
            plain_loads.append(time.perf_counter() - t)
            os.remove(plain)
        nbytes = (path / checkpoint.STATE_FILE).stat().st_size
    s, p = summarize(saves), summarize(plain_saves)
    write_results("checkpoint_cost", {
        "bytes": nbytes,
        "save": {"ddpkit_atomic_verified": s, "plain_torch_save": p, "ratio_median": s["median_s"] / p["median_s"],
                 "target_ratio": 1.2},
        "restore": {"ddpkit_verify_and_load": summarize(loads), "plain_torch_load": summarize(plain_loads)},
        "note": "ddpkit's save adds fsync of file and folders, a sha256 pass and a rename; plain torch.save does none",
    })


if __name__ == "__main__":
    main()
