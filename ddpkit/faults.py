"""Fault tolerance on one rank: deliberate faults to practise recovery on, and a limit on stalls.

* :class:`FaultInjection` makes one rank fail once, reproducibly, after a given step: ``raise`` an
  exception, ``exit`` the process, ``kill`` it with SIGKILL (what the OOM killer or a preempted node
  does: no exception, no exit code), ``hang``, or from that step on run ``slow`` (a straggler); or
  send itself ``sigterm``, a preemption notice (``preemption.py``); or make one step's forward ``nan``
  on this rank (a bad batch), or damage every rank's weights for a loss ``spike`` (what the loss guard,
  ``guard.py``, is for). It fails only on the first attempt, so a restarted run can finish.
* :class:`StallWatchdog` bounds every step (and every checkpoint save, by its own limit). A peer's collective timeout catches a rank that hangs,
  but a world of one has no peer, and a rank can hang outside any collective. The watchdog is
  ``faulthandler``'s C-level timer: if the next step does not finish in time, it writes every
  thread's Python stack to stderr and ends the process (it works even when Python itself is stuck).
  The launcher recognises that stack dump and names the rank *stalled*.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import time

import torch

from ddpkit.config import TrainConfig
from ddpkit.hooks import Hook

SPIKE_DAMAGE = 8.0  # --fail-mode spike multiplies every weight by this: the loss jumps and stays up
STALL_MARGIN_S = 10.0  # a step may take the collective timeout plus this (a save: the save timeout plus this)


class InjectedFailure(RuntimeError):
    """Raised by ``--fail-mode raise``: a deliberate, reproducible rank failure."""


class FaultInjection(Hook):
    """The ``--fail-*`` flags, as a hook at the step boundary."""

    def __init__(self, cfg: TrainConfig, attempt: int) -> None:
        self.cfg, self.attempt = cfg, attempt
        self._hook = None  # the forward hook of --fail-mode nan, for one step

    def before_step(self, trainer) -> None:
        cfg, step, rank = self.cfg, trainer.step, trainer.ctx.rank
        if cfg.fail_mode == "spike" and step == cfg.fail_at_step and self.attempt == 0:
            self.damage_weights(trainer)  # every rank: replicas that apply the same update get the same damage
            return
        if cfg.fail_at_step is None or rank != cfg.fail_rank:
            return
        if cfg.fail_mode == "nan":
            if step == cfg.fail_at_step and self.attempt == 0:
                self._hook = self.computing_module(trainer).register_forward_hook(lambda m, i, out: out * float("nan"))
            return
        if cfg.fail_mode == "slow":
            if step >= cfg.fail_at_step:
                with trainer.timer("data_s"):  # a slow input pipeline on this rank only
                    time.sleep(cfg.slow_step_s)
            return
        if step != cfg.fail_at_step or self.attempt != 0:
            return
        print(f"injecting failure ({cfg.fail_mode}) on rank {rank} after step {step}", flush=True)
        trainer.log.event("fault_injected", step, mode=cfg.fail_mode)  # when the fault struck: recovery.py
        if cfg.fail_mode == "sigterm":  # notice of preemption, to this rank only (what a scheduler may send)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if cfg.fail_mode == "raise":
            raise InjectedFailure(f"injected failure after step {step} on rank {rank}")
        if cfg.fail_mode == "exit":
            os._exit(13)
        if cfg.fail_mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang: the other ranks block in the next collective until it times out
            time.sleep(1)

    def after_step(self, trainer, result) -> None:
        if self._hook is not None:  # one bad step only
            self._hook.remove()
            self._hook = None

    @staticmethod
    def computing_module(trainer):
        """The module whose forward this rank runs (inside a DDP wrapper, or a pipeline stage)."""
        return getattr(trainer.model, "module", trainer.model)

    def damage_weights(self, trainer) -> None:
        print(f"injecting failure (spike): weights x {SPIKE_DAMAGE:g} on rank {trainer.ctx.rank} after step "
              f"{trainer.step}", flush=True)
        with torch.no_grad():
            for p in self.computing_module(trainer).parameters():
                p.mul_(SPIKE_DAMAGE)


class StallWatchdog:
    """Ends this process, with every thread's stack, if :meth:`pet` is not called within ``limit_s``.

    A checkpoint save is bounded apart (``--save-timeout``, not the step's limit): a large save can
    take far longer than any step. :meth:`allow` gives the block inside it that long, and the rest of
    the step its ordinary limit again afterwards.
    """

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s

    def pet(self, limit_s: float | None = None) -> None:
        """A step finished: the next one has ``limit_s`` seconds (by default the step limit)."""
        faulthandler.dump_traceback_later(self.limit_s if limit_s is None else limit_s, exit=True, file=sys.stderr)

    @contextlib.contextmanager
    def allow(self, seconds: float):
        """The block may take ``seconds`` (plus the stall margin); then the ordinary limit applies again."""
        self.pet(seconds + STALL_MARGIN_S)
        try:
            yield
        finally:
            self.pet()

    def stop(self) -> None:
        faulthandler.cancel_dump_traceback_later()
