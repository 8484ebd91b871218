"""``ddpkit train``: the command line, the same under the ddpkit launcher and under torchrun.

    ddpkit train --world-size 2 --steps 40                 # spawns 2 gloo ranks on this machine
    torchrun --standalone --nproc-per-node 2 -m ddpkit train --steps 40   # each process is one rank

Bad input is refused before any rank starts, as one line on stderr and exit code 2. A rank failure
prints the launcher's root-cause report; with ``--max-restarts N`` the whole world is restarted from
the newest good checkpoint (the way torchrun's ``--max-restarts`` restarts a job), up to N times.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from ddpkit import runtime, train
from ddpkit.launch import launch
from ddpkit.config import AMP_MODES, FAIL_MODES, MODELS, TrainConfig
from ddpkit.failures import LaunchError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        print(f"ddpkit: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ddpkit", description="Distributed PyTorch training on real ranks.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = commands.add_parser("train", help="train a model with DDP on real ranks")
    d = TrainConfig()
    p.add_argument("--world-size", type=int, default=None, help=f"ranks (default {d.world_size}; torchrun sets it)")
    p.add_argument("--backend", choices=runtime.BACKENDS, default=d.backend)
    p.add_argument("--model", choices=MODELS, default=d.model)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size)
    p.add_argument("--grad-accum", type=int, default=d.grad_accum)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--amp", choices=AMP_MODES, default=d.amp)
    p.add_argument("--dataset-size", type=int, default=d.dataset_size)
    p.add_argument("--num-workers", type=int, default=d.num_workers)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument("--keep-last", type=int, default=d.keep_last)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--max-restarts", type=int, default=d.max_restarts)
    p.add_argument("--timeout", type=float, default=d.timeout, help="collective timeout in seconds")
    p.add_argument("--metrics-dir", default=None)
    p.add_argument("--summary-json", default=None)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--fail-at-step", type=int, default=None)
    p.add_argument("--fail-rank", type=int, default=d.fail_rank)
    p.add_argument("--fail-mode", choices=FAIL_MODES, default=d.fail_mode)
    p.add_argument("--slow-step-s", type=float, default=d.slow_step_s, help="extra seconds per step (--fail-mode slow)")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """A validated config; under torchrun the world size is torchrun's."""
    world_size = args.world_size
    if runtime.under_torchrun():
        env_world = int(os.environ["WORLD_SIZE"])
        if world_size is not None and world_size != env_world:
            raise ValueError(f"--world-size {world_size} disagrees with torchrun's WORLD_SIZE={env_world}")
        world_size = env_world
    fields = {k: v for k, v in vars(args).items() if k != "command"}
    fields["world_size"] = world_size if world_size is not None else TrainConfig.world_size
    return TrainConfig(**fields)


def check_writable(path: str | None, what: str) -> None:
    """Fail before spawning if a directory cannot be created or written."""
    if path is None:
        return
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".ddpkit-write-test-"):
            pass
    except OSError as exc:
        raise ValueError(f"{what} {path!r} is not writable ({exc.strerror}): choose another directory") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        check_writable(cfg.checkpoint_dir, "--checkpoint-dir")
        check_writable(cfg.metrics_dir, "--metrics-dir")
        if cfg.summary_json:
            check_writable(os.path.dirname(os.path.abspath(cfg.summary_json)), "--summary-json folder")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.world_size))
        runtime.resolve_backend(cfg.backend, local_world)
        if cfg.max_restarts and not cfg.checkpoint_dir:
            raise ValueError("--max-restarts needs --checkpoint-dir (a restart resumes from a checkpoint)")
    except ValueError as exc:
        print(f"ddpkit: error: {exc}", file=sys.stderr)
        return 2
    if runtime.under_torchrun():  # torchrun made us one rank; it also owns restarts
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        launch(train.run, cfg.replace(resume=cfg.resume or attempt > 0), attempt,
                      backend=cfg.backend, timeout=cfg.timeout)
        return 0
    for attempt in range(cfg.max_restarts + 1):
        run_cfg = cfg.replace(resume=cfg.resume or attempt > 0)
        try:
            launch(train.run, run_cfg, attempt, world_size=cfg.world_size, backend=cfg.backend,
                          timeout=cfg.timeout, output="all")
            return 0
        except LaunchError as exc:
            print(f"ddpkit: attempt {attempt + 1} failed: {exc}", file=sys.stderr)
            if attempt < cfg.max_restarts:
                print(f"ddpkit: restarting all {cfg.world_size} ranks from the newest good checkpoint "
                      f"(restart {attempt + 1} of {cfg.max_restarts})", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
