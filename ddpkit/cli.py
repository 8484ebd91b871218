"""``ddpkit train``: the command line, the same under the ddpkit launcher and under torchrun.

    ddpkit train --world-size 2 --steps 40                 # spawns 2 gloo ranks on this machine
    torchrun --standalone --nproc-per-node 2 -m ddpkit train --steps 40   # each process is one rank

Bad input is refused before any rank starts, as one line on stderr and exit code 2: every flag's
range, every folder and file the run will write or read, and a resume that would change training
(read from the checkpoint's manifest). What only the ranks can find out (say, a checkpoint whose
weights do not reproduce its recorded loss) is reported the same way, one line and exit code 2. A
rank failure prints the launcher's root-cause report; with ``--max-restarts N`` the whole world is
restarted from the newest good checkpoint (the way torchrun's ``--max-restarts`` restarts a job), up
to N times. SIGTERM (or SIGUSR1) to this process, SIGTERM to any one rank or to the whole process group,
is a preemption notice: with a ``--checkpoint-dir``, every rank stops after the same step and saves it,
and the run exits with code 75, the command that resumes it, and a ``PREEMPTED.json`` file in the
checkpoint folder (``preemption.py``); without one, the run stops at once with exit code 143. A
preempted run is never restarted here: the machine is going away.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
import warnings

import torch.distributed as dist

from ddpkit import checkpoint, runtime, state, train
from ddpkit.config import (AMP_MODES, CHECKPOINT_FORMATS, FAIL_MODES, MESH_STRATEGIES, MODELS, PP_SCHEDULES, SHARDED,
                           STRATEGIES, TrainConfig)
from ddpkit.errors import UserError
from ddpkit.failures import LaunchError, knock_on_line, raised_in_collective
from ddpkit.launch import MAX_LOCAL_RANKS, launch
from ddpkit.preemption import (PREEMPTED_EXIT, TERMINATED_EXIT, passed_on_to_ranks, preempted_line, resume_command,
                               torchrun_launcher, write_marker)
from ddpkit.recovery import note_failure_detected

LAUNCHERS = ("ddpkit", "ray")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        print(f"ddpkit: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ddpkit", description="Distributed PyTorch training on real ranks.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    # no abbreviated flags: the printed resume command drops fault flags by their exact names
    p = commands.add_parser("train", help="train a model with DDP on real ranks", allow_abbrev=False)
    d = TrainConfig()
    p.add_argument("--world-size", type=int, default=None, help=f"ranks (default {d.world_size}; torchrun sets it)")
    p.add_argument("--launcher", choices=LAUNCHERS, default="ddpkit",
                   help="ddpkit: the kit's launcher (ranks on this machine); ray: Ray Train's worker group (ddpkit[ray])")
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
    p.add_argument("--strategy", choices=STRATEGIES + MESH_STRATEGIES, default=d.strategy,
                   help="ddp replicates everything; zero1 / zero1-torch shard the optimizer state; fsdp2 shards all; "
                        "hsdp shards within --shard ranks and replicates across --replicate groups")
    p.add_argument("--replicate", type=int, default=d.replicate, help="hsdp: replica groups (default: world / shard)")
    p.add_argument("--shard", type=int, default=d.shard, help="hsdp: ranks per shard group (default: world / replicate)")
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=d.reshard_after_forward,
                   help="fsdp2/hsdp: free each block's gathered parameters after forward (ZeRO-3, FSDP2's default) "
                        "or keep them until backward (--no-reshard-after-forward: ZeRO-2's parameter memory)")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel degree (world = dp x tp x pp; with ddp or fsdp2)")
    p.add_argument("--pp", type=int, default=d.pp, help="pipeline-parallel degree")
    p.add_argument("--pp-schedule", default=d.pp_schedule, metavar="|".join(PP_SCHEDULES),
                   help="pipeline schedule (zero-bubble: ZB-H1, the weight gradients deferred)")
    p.add_argument("--cp", type=int, default=d.cp, help="context-parallel degree (the GPT's sequences split; world = dp x cp x tp x pp)")
    p.add_argument("--experts", type=int, default=d.experts,
                   help="GPT: replace each MLP by a mixture of this many experts (0: the dense MLP)")
    p.add_argument("--top-k", type=int, default=None, help=f"with --experts: experts per token (default {d.top_k})")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="with --experts: an expert takes at most factor x top-k x tokens / experts; the rest are "
                        f"dropped (default {d.capacity_factor})")
    p.add_argument("--ep", type=int, default=d.ep,
                   help="expert-parallel degree: the experts split over ep ranks, tokens sent by all-to-all")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute activations in backward instead of storing them")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-format", choices=CHECKPOINT_FORMATS, default=None,
                   help="full: one file written by rank 0; dcp: shards from every rank (default: the resumed "
                        "checkpoint's format, else dcp for fsdp2 and full otherwise)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument("--checkpoint-every-s", "--save-every-s", dest="checkpoint_every_s", type=float,
                   default=d.checkpoint_every_s,
                   help="also save when this many seconds have passed since the last save (rank 0's clock decides)")
    p.add_argument("--keep-last", type=int, default=d.keep_last)
    p.add_argument("--resume", action="store_true", help="continue from the newest good checkpoint")
    p.add_argument("--overwrite-checkpoints", action="store_true",
                   help="delete the checkpoints already in --checkpoint-dir and start clean")
    p.add_argument("--max-restarts", type=int, default=d.max_restarts)
    p.add_argument("--timeout", type=float, default=d.timeout, help="collective timeout in seconds")
    p.add_argument("--save-timeout", type=float, default=d.save_timeout,
                   help="seconds a checkpoint save may take (its own bound, not --timeout)")
    p.add_argument("--metrics-dir", default=None)
    p.add_argument("--summary-json", default=None)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--nan-guard", action="store_true",
                   help="skip a step with a non-finite or spiking loss; roll back on a second in a row")
    p.add_argument("--spike-factor", type=float, default=d.spike_factor,
                   help="with --nan-guard: a loss above this x the recent median is a spike")
    p.add_argument("--fail-at-step", type=int, default=None)
    p.add_argument("--fail-rank", type=int, default=d.fail_rank)
    p.add_argument("--fail-mode", choices=FAIL_MODES, default=d.fail_mode)
    p.add_argument("--slow-step-s", type=float, default=d.slow_step_s, help="extra seconds per step (--fail-mode slow)")
    c = commands.add_parser("check", help="grade a room's exercise notebooks into a learner x exercise table")
    c.add_argument("paths", nargs="+", help="notebooks (.ipynb) or folders of them (one per learner, or flat)")
    c.add_argument("--jobs", type=int, default=1, help="notebooks graded at once")
    c.add_argument("--out", default="grades", help="folder for grades.csv, grades.md and each results.json")
    c.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every time limit (they are sized from this machine's measured speed)")
    c.add_argument("--memory-gb", type=float, default=6.0,
                   help="resident memory one notebook's grading may use, all its processes together (lower it on a "
                        "small machine, or with --jobs N)")
    e = commands.add_parser("exercises", help="the student bundle, a reset to the stub, the generated notebooks")
    actions = e.add_subparsers(dest="action", required=True, parser_class=_Parser)
    actions.add_parser("export", help="write the student notebooks (no solutions) into a new folder").add_argument("folder")
    r = actions.add_parser("reset", help="put an exercise's stub back in a notebook, keeping the other cells")
    r.add_argument("notebook")
    r.add_argument("--exercise", default=None, help="the exercise id, when the file name does not say")
    b = actions.add_parser("build", help="make exercises/*.ipynb from the masters with otter assign")
    b.add_argument("--check", action="store_true", help="only compare; exit 1 if a student notebook is stale")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """A validated config; under torchrun the world size is torchrun's."""
    world_size = args.world_size
    if runtime.under_torchrun():
        env_world = int(os.environ["WORLD_SIZE"])
        if world_size is not None and world_size != env_world:
            raise ValueError(f"--world-size {world_size} disagrees with torchrun's WORLD_SIZE={env_world}")
        world_size = env_world
    elif world_size is not None and world_size > MAX_LOCAL_RANKS:
        raise ValueError(f"world-size must be at most {MAX_LOCAL_RANKS} on one machine, got {world_size}: "
                         "use torchrun to span machines")
    fields = {k: v for k, v in vars(args).items() if k not in ("command", "launcher")}
    fields["world_size"] = world_size if world_size is not None else TrainConfig.world_size
    routing = [flag for flag, name in (("--top-k", "top_k"), ("--capacity-factor", "capacity_factor")) if fields[name] is not None]
    if routing and not args.experts:  # a dense GPT has no router: the flag would be ignored without a word
        raise ValueError(f"{' and '.join(routing)} shape{'' if len(routing) > 1 else 's'} a mixture of experts: "
                         f"add --experts E, or drop {' and '.join(routing)}")
    for name in ("top_k", "capacity_factor"):
        if fields[name] is None:
            fields[name] = getattr(TrainConfig, name)
    if fields["checkpoint_format"] is None:
        fields["checkpoint_format"] = default_checkpoint_format(args)
    return TrainConfig(**fields)


def default_checkpoint_format(args: argparse.Namespace) -> str:
    """No --checkpoint-format given: a resume keeps the format of the checkpoint it resumes; a new run
    uses dcp for fsdp2 and hsdp (which can only save shards) and full otherwise."""
    if args.resume and args.checkpoint_dir:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            newest = checkpoint.latest_good(args.checkpoint_dir, deep=False)
        if newest is not None:
            return checkpoint.read_manifest(newest).get("writer", "full")
    return "dcp" if args.strategy in SHARDED else "full"


def check_writable(path: str | None, what: str) -> None:
    """Fail before spawning if a directory cannot be created or written."""
    if path is None:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{what} {path!r} is a file, not a folder: choose a folder")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".ddpkit-write-test-"):
            pass
    except OSError as exc:
        raise ValueError(f"{what} {path!r} is not writable ({exc.strerror}): choose another directory") from None


def check_before_launch(cfg: TrainConfig, attempt: int = 0) -> None:
    """Everything about the run's inputs that can be checked here, before any rank starts."""
    check_writable(cfg.checkpoint_dir, "--checkpoint-dir")
    check_writable(cfg.metrics_dir, "--metrics-dir")
    if cfg.summary_json:
        if os.path.isdir(cfg.summary_json):
            raise ValueError(f"--summary-json {cfg.summary_json!r} is a folder: give a file name, e.g. "
                             f"{os.path.join(cfg.summary_json, 'summary.json')}")
        check_writable(os.path.dirname(os.path.abspath(cfg.summary_json)), "--summary-json folder")
    backend = runtime.resolve_backend(cfg.backend, int(os.environ.get("LOCAL_WORLD_SIZE", cfg.world_size)))
    if cfg.strategy in SHARDED:
        from ddpkit.parallel.fsdp import check_supported

        check_supported("cpu" if backend == "gloo" else "cuda")
    if cfg.max_restarts and not cfg.checkpoint_dir:
        raise ValueError("--max-restarts needs --checkpoint-dir (a restart resumes from a checkpoint)")
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) and not cfg.checkpoint_dir:
        raise ValueError("torchrun --max-restarts needs --checkpoint-dir (a restarted worker resumes from a checkpoint)")
    if not cfg.checkpoint_dir:
        return
    if attempt == 0 and not cfg.resume:
        if checkpoint.list_checkpoints(cfg.checkpoint_dir) and not cfg.overwrite_checkpoints:
            raise ValueError(state.foreign_checkpoints_message(cfg.checkpoint_dir))
        return
    with warnings.catch_warnings():  # the ranks warn about skipped checkpoints (and set them aside) themselves
        warnings.simplefilter("ignore")
        newest = checkpoint.resume_point(cfg.checkpoint_dir, deep=False, set_newer_aside=False)
    if newest is None:
        return
    manifest = checkpoint.read_manifest(newest)
    if manifest.get("writer", "full") != cfg.checkpoint_format:
        raise ValueError(f"the newest checkpoint in {cfg.checkpoint_dir} ({newest.name}) was written with "
                         f"--checkpoint-format {manifest.get('writer', 'full')}: resume with that format "
                         f"(or leave --checkpoint-format out)")
    saved = manifest["meta"]
    if attempt > 0 and not cfg.resume and saved.get("run_id") != state.run_id():
        # a torchrun restart resumes its own run's checkpoints, never another run's
        raise ValueError(state.foreign_checkpoints_message(cfg.checkpoint_dir))
    if {"global_batch_size", "config_digest", "semantics"} <= set(saved):
        state.check_compatible(saved, cfg)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("check", "exercises"):  # an instructor's tools for a room
        from ddpkit.exercises.commands import run_command

        return run_command(args)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if runtime.under_torchrun() else 0
    try:
        cfg = config_from_args(args)
        check_before_launch(cfg, attempt)
        if args.launcher == "ray":
            from ddpkit.engines import ray_launch

            if runtime.under_torchrun():
                raise ValueError("--launcher ray starts its own workers: run it without torchrun")
            ray_launch.check(cfg)
    except (ValueError, UserError) as exc:
        return _refuse(exc)
    if args.launcher == "ray":
        return ray_launch.main(cfg)
    argv = sys.argv[1:] if argv is None else list(argv)
    if runtime.under_torchrun():  # torchrun made us one rank; it also owns restarts
        _run_as_torchrun_worker(restarted(cfg) if attempt > 0 else cfg, attempt, argv)
    for attempt in range(cfg.max_restarts + 1):
        run_cfg = restarted(cfg) if attempt > 0 else cfg
        try:
            with passed_on_to_ranks() as notice:
                summary = launch(train.run, run_cfg, attempt, world_size=cfg.world_size, backend=cfg.backend,
                                 timeout=cfg.timeout, output="all")[0]
            return _preempted(cfg, summary, argv) if summary["preempted_at_step"] is not None else 0
        except LaunchError as exc:
            if exc.is_user_error:  # a restart would fail the same way
                return _refuse(exc.root_cause.message)
            if notice.received or (exc.root_cause.kind, exc.root_cause.exc_type) == ("killed", "SIGTERM"):
                return _stopped_by_notice(cfg, argv, exc)  # notice before the ranks could agree: never restarted
            note_failure_detected(cfg.metrics_dir, attempt)
            print(f"ddpkit: attempt {attempt + 1} failed: {exc}", file=sys.stderr)
            if attempt < cfg.max_restarts:
                print(f"ddpkit: restarting all {cfg.world_size} ranks from the newest good checkpoint "
                      f"(restart {attempt + 1} of {cfg.max_restarts})", file=sys.stderr, flush=True)
    return 1


def _newest_good(cfg: TrainConfig):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return checkpoint.latest_good(cfg.checkpoint_dir, deep=False)


def _preempted(cfg: TrainConfig, summary: dict, argv: list[str], launcher: list[str] | None = None) -> int:
    """One line and a marker file: where the run stopped, which checkpoint a resume starts from, the
    command that resumes it; the preempted exit code."""
    newest, saved = _newest_good(cfg), summary["emergency_checkpoint_step"] is not None
    command = resume_command(argv, launcher)
    write_marker(cfg.checkpoint_dir, summary["preempted_at_step"], saved, newest.name if newest else None, command)
    print(preempted_line(summary["preempted_at_step"], saved, str(newest) if newest else None, command,
                         under_torchrun=launcher is not None), file=sys.stderr, flush=True)
    return PREEMPTED_EXIT


def _stopped_by_notice(cfg: TrainConfig, argv: list[str], exc: LaunchError) -> int:
    """SIGTERM ended the ranks before they could agree on a step (during start-up, or with no checkpoint
    folder to save to): one line, and 75 (resume from the newest good checkpoint) or 143 (nothing to resume)."""
    if not cfg.checkpoint_dir:
        print(f"ddpkit: stopped by SIGTERM (no --checkpoint-dir, so nothing was saved): {exc.root_cause.headline()}",
              file=sys.stderr, flush=True)
        return TERMINATED_EXIT
    newest, command = _newest_good(cfg), resume_command(argv)
    write_marker(cfg.checkpoint_dir, None, False, newest.name if newest else None, command)
    print(f"ddpkit: preempted before the ranks could agree on a step to save; the newest good checkpoint is "
          f"{newest or 'none (the resume starts at step 0)'}; resume with: {command}", file=sys.stderr, flush=True)
    return PREEMPTED_EXIT


def _run_as_torchrun_worker(cfg: TrainConfig, attempt: int, argv: list[str]) -> None:
    """Train as the rank torchrun made this process, then end it with ``os._exit``.

    Like the launcher's ranks, a worker leaves after a final barrier without tearing its process group
    down: a teardown at interpreter exit can abort ("terminate called without an active exception") or,
    seen once with torch 2.4.1 under torchrun's restarts, hang. Exit codes: 0 done, 2 a user error
    (one line), 75 preempted (an emergency checkpoint was saved), 1 anything else (with its traceback).
    """
    code = 1
    runtime.die_with_parent()  # a worker never outlives its torchrun agent, however the agent ended
    try:
        ctx = runtime.init_process_group(runtime.RankContext.from_env(cfg.backend), cfg.timeout)
        summary = train.run(ctx, cfg, attempt)
        dist.barrier()
        code = 0
        # notice to this worker alone: its agent sees a failure (a restart with --max-restarts, else exit 1);
        # notice from its agent (a shutdown or a scale-up): the agent reads no code of a worker it stopped
        if summary["preempted_at_step"] is not None:
            code = _preempted(cfg, summary, argv, torchrun_launcher(argv)) if ctx.is_main else PREEMPTED_EXIT
    except UserError as exc:
        code = _refuse(exc)
    except BaseException as exc:  # noqa: BLE001 - reported here, then the process ends
        if raised_in_collective(exc):  # a peer went away: say so in one line, torchrun names the cause
            print(knock_on_line(exc), file=sys.stderr)
        else:
            traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def restarted(cfg: TrainConfig) -> TrainConfig:
    """The config of a restart: it resumes from the newest good checkpoint of this run."""
    return cfg.replace(resume=True, overwrite_checkpoints=False)


def _refuse(reason: object) -> int:
    print(f"ddpkit: error: {reason}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
