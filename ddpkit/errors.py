"""Errors a user can fix, kept apart from bugs.

A wrong flag, a folder that holds another run's checkpoints, a checkpoint that would silently change
training: the message says what to change, so it is shown as **one line** (never a traceback), and
restarting the job would only fail the same way. Such errors derive from :class:`UserError`. The
launcher records the distinction in each rank's error report, the command line prints a user error as
``ddpkit: error: ...`` with exit code 2, and ``--max-restarts`` does not retry it.
"""

from __future__ import annotations


class UserError(RuntimeError):
    """A failure caused by input (a flag, a folder, a checkpoint) whose message names the fix."""
