"""``ddpkit check`` and ``ddpkit exercises ...``: argument checks in one line (exit 2), then the work."""

from __future__ import annotations

import sys


def _refuse(message: str) -> int:
    print(f"ddpkit: error: {message}", file=sys.stderr)
    return 2


def run_command(args) -> int:
    if args.command == "check":
        if args.jobs < 1:
            return _refuse(f"--jobs must be at least 1, got {args.jobs}")
        if args.time_scale <= 0:
            return _refuse(f"--time-scale must be above 0, got {args.time_scale}")
        if not 0.5 <= args.memory_gb <= 1024:
            return _refuse(f"--memory-gb must be between 0.5 and 1024, got {args.memory_gb:g}")
        from ddpkit.exercises.grading import main

        return main(args.paths, jobs=args.jobs, out=args.out, time_scale=args.time_scale, memory_gb=args.memory_gb)
    try:
        import otter  # noqa: F401
    except ImportError:
        return _refuse("the exercises commands use otter-grader: pip install 'ddpkit[grader]'")
    from ddpkit.exercises import autograde, bundle

    if not (autograde.EXERCISES_DIR / "solutions").is_dir():
        return _refuse(f"ddpkit exercises {args.action} works from a clone of the repository (it reads exercises/solutions/, "
                       f"not in this install): git clone https://github.com/ddpkit/ddpkit and run it there")
    try:
        if args.action == "export":
            folder = bundle.export(args.folder)
            print(f"student bundle written to {folder} (no solutions)")
        elif args.action == "reset":
            count = bundle.reset(args.notebook, args.exercise)
            print(f"{args.notebook}: {count} cell(s) back to the stub")
        elif args.action == "build":
            stale = bundle.build_students(check=args.check)
            if args.check and stale:
                print(f"stale student notebooks (run ddpkit exercises build): {', '.join(stale)}")
                return 1
    except (ValueError, KeyError) as exc:
        return _refuse(str(exc).strip("'\""))
    return 0
