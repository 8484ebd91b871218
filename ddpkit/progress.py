"""Live progress of a run while its ranks work: a bar and a loss plot in Jupyter, text lines elsewhere.

Two halves, one file between them:

* **rank 0 reports.** The launcher hands rank 0 a path in ``DDPKIT_PROGRESS_FILE``; the trainer appends
  one JSON line per optimizer step (step, total steps, global loss). Without that variable (torchrun,
  the CLI, tests) reporting does nothing.
* **the launching process shows.** The launcher's monitor polls between its other work and calls
  :meth:`Display.poll`, which reads the new lines and redraws: an ``ipywidgets`` progress bar and an
  SVG loss plot in a Jupyter or Colab kernel (cheap to redraw, so the ranks keep the CPU), or a text
  line every few seconds when nobody is watching a widget (papermill, nbval, a terminal).

The mode is ``DDPKIT_PROGRESS`` (``widget``, ``text`` or ``off``) when set, else ``widget`` in a Jupyter
kernel that has ipywidgets and ``off`` in a plain Python process (the CLI prints its own table). A run
that reports nothing (a function that is not a trainer) still gets a text heartbeat after a few silent
seconds in ``text`` mode, so no cell looks dead.
"""

from __future__ import annotations

import html
import json
import math
import os
import sys
import time
from typing import Any

ENV_FILE = "DDPKIT_PROGRESS_FILE"
ENV_MODE = "DDPKIT_PROGRESS"
MODES = ("widget", "text", "off")
POLL_S = 0.1  # read the progress file at most this often (the monitor passes every few ms)
REDRAW_S = 0.25  # widget redraws at most this often
TEXT_EVERY_S = 2.0  # a text line after this long without other output
HEARTBEAT_S = 4.0  # "still running" after this long with nothing to report


class Reporter:
    """Rank 0's side: one JSON line per step, to the file the launcher named (or nothing)."""

    def __init__(self, path: str | None) -> None:
        self.handle = open(path, "a", buffering=1) if path else None  # noqa: SIM115 - closed in close()

    @classmethod
    def from_env(cls, is_main: bool) -> Reporter:
        return cls(os.environ.get(ENV_FILE) if is_main else None)

    def step(self, step: int, total: int, loss: float, run: str = "") -> None:
        """One step's line; ``run`` names the run (several trainers in one cell are told apart by it)."""
        if self.handle is not None:
            self.handle.write(json.dumps({"step": step, "total": total, "loss": loss, "t": time.time(), "run": run}) + "\n")

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def resolve_mode(requested: str = "auto") -> str:
    """``widget``, ``text`` or ``off`` (see the module docstring)."""
    mode = os.environ.get(ENV_MODE, "auto") if requested == "auto" else requested
    if mode not in (*MODES, "auto"):
        raise ValueError(f"progress must be one of auto, {', '.join(MODES)}, got {mode!r} "
                         f"(check the {ENV_MODE} environment variable)")
    if mode != "auto":
        return mode
    return "widget" if _in_jupyter_kernel() and _has_widgets() else "off"


def _in_jupyter_kernel() -> bool:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and hasattr(shell, "kernel")


def _has_widgets() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


class Display:
    """The launching process's side: follows the progress file, shows it (see the module docstring)."""

    def __init__(self, path: str, mode: str, world_size: int) -> None:
        self.path, self.mode, self.world_size = path, mode, world_size
        self.started = self.last_output = time.monotonic()
        self.last_draw = self.last_poll = 0.0
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.total, self.run = 0, ""
        self.handle = None
        self.partial = ""
        self.widgets: Any = None
        self.shown_step: int | None = None  # the last step a text line showed

    def note_output(self) -> None:
        """The ranks' own output was just shown: text mode need not add a line for a while."""
        self.last_output = time.monotonic()

    def poll(self, final: bool = False) -> None:
        now = time.monotonic()
        if self.mode == "off" or (not final and now - self.last_poll < POLL_S):
            return
        self.last_poll = now
        fresh = self._read()
        if self.mode == "widget":
            if (fresh or final) and self.losses and (final or now - self.last_draw > REDRAW_S):
                self._draw_widget(final)
                self.last_draw = now
            elif not self.losses and not final and now - self.last_output > HEARTBEAT_S:
                self._heartbeat(now)  # no widget until the first step: imports, rendezvous, compiling
            return
        quiet = now - self.last_output
        if final:  # finish what text lines started
            if self.shown_step is not None and self.shown_step != self.steps[-1]:
                print(self._text_line(), flush=True)
            return
        if self.losses and fresh and quiet > TEXT_EVERY_S:
            print(self._text_line(), flush=True)
            self.last_output, self.shown_step = now, self.steps[-1]
        elif not self.losses and quiet > HEARTBEAT_S:
            self._heartbeat(now)

    def _heartbeat(self, now: float) -> None:
        print(f"[ddpkit] {self.world_size} rank(s) running, {now - self.started:.0f} s", flush=True)
        self.last_output = now

    def close(self) -> None:
        self.poll(final=True)
        if self.handle is not None:
            self.handle.close()
            self.handle = None

    # ------------------------------------------------------------------ reading

    def _read(self) -> bool:
        if self.handle is None:
            if not os.path.exists(self.path):
                return False
            self.handle = open(self.path)  # noqa: SIM115 - closed in close()
        data = self.partial + self.handle.read()
        *lines, self.partial = data.split("\n")
        for line in lines:
            if line:
                event = json.loads(line)
                if self.steps and event["step"] <= self.steps[-1]:  # a function that trains several runs in turn:
                    self.steps, self.losses = [], []  # the plot follows the run now training
                self.steps.append(event["step"])
                self.losses.append(event["loss"])
                self.total, self.run = event["total"], event.get("run", "")
        return bool(lines)

    # ------------------------------------------------------------------ showing

    def _text_line(self) -> str:
        elapsed = time.monotonic() - self.started
        return (f"[ddpkit] step {self.steps[-1]}/{self.total}  loss {self.losses[-1]:.4f}  "
                f"(first {self.losses[0]:.4f})  {elapsed:.1f} s{f'  [{self.run}]' if self.run else ''}")

    def _draw_widget(self, final: bool) -> None:
        import ipywidgets as w
        from IPython.display import display

        if self.widgets is None:
            bar = w.IntProgress(min=0, max=max(1, self.total), description="training",
                                layout=w.Layout(width="420px"))
            label, plot = w.HTML(), w.HTML()
            self.widgets = (bar, label, plot)
            display(w.VBox([w.HBox([bar, label]), plot]))
        bar, label, plot = self.widgets
        bar.max, bar.value = max(1, self.total), self.steps[-1]
        if final:
            bar.bar_style = "success" if self.steps[-1] >= self.total else "warning"
        label.value = (f"&nbsp;{html.escape(self.run) + ' · ' if self.run else ''}step {self.steps[-1]}/{self.total} · "
                       f"loss {self.losses[-1]:.4f} · "
                       f"{time.monotonic() - self.started:.1f} s")
        plot.value = loss_svg(self.steps, self.losses, self.total)


def loss_svg(steps: list[int], losses: list[float], total: int, width: int = 420, height: int = 150) -> str:
    """A small line plot of loss against step, as inline SVG: a title, labelled axes, the value range.
    A non-finite loss (a NaN or inf step, as notebook 14 provokes) breaks the line there and is named in
    red under the title: an SVG point that is not a number would make the browser drop the whole line."""
    left, right, top, bottom = 48, 10, 22, 30
    finite = [v for v in losses if math.isfinite(v)] or [0.0]
    lo, hi = min(finite), max(finite)
    span = (hi - lo) or max(abs(hi), 1e-12) * 0.1
    first = min(steps[0], 1)
    x_span = max(total, steps[-1]) - first or 1

    def xy(step: int, loss: float) -> str:
        x = left + (step - first) / x_span * (width - left - right)
        y = top + (hi - loss) / span * (height - top - bottom)
        return f"{x:.1f},{y:.1f}"

    runs, bad = [[]], []
    for step, loss in zip(steps, losses):
        if math.isfinite(loss):
            runs[-1].append(xy(step, loss))
        else:
            bad.append(step)
            runs.append([])
    lines = "".join(f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{" ".join(run)}"/>'
                    for run in runs if run)
    note = (f'<text x="{width - right}" y="{top + 10}" text-anchor="end" fill="#d62728">non-finite loss at step '
            f'{bad[0]}{f" and {len(bad) - 1} more" if len(bad) > 1 else ""}</text>' if bad else "")
    axis = 'stroke="#888" stroke-width="1"'
    return (f'<svg width="{width}" height="{height}" style="font: 11px sans-serif">'
            f'<text x="{width / 2}" y="13" text-anchor="middle">rank 0: global loss per step (live)</text>'
            f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" {axis}/>'
            f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" {axis}/>'
            f'<text x="{left - 4}" y="{top + 4}" text-anchor="end">{hi:.3g}</text>'
            f'<text x="{left - 4}" y="{height - bottom}" text-anchor="end">{lo:.3g}</text>'
            f'<text x="{left}" y="{height - 12}">{first}</text>'
            f'<text x="{width - right}" y="{height - 12}" text-anchor="end">{max(total, steps[-1])}</text>'
            f'<text x="{(left + width) / 2}" y="{height - 2}" text-anchor="middle">optimizer step</text>'
            f'<text x="12" y="{(top + height - bottom) / 2}" text-anchor="middle" '
            f'transform="rotate(-90 12 {(top + height - bottom) / 2})">loss</text>'
            f'{note}{lines}</svg>')


class heartbeat:  # noqa: N801 - used as a context manager, like contextlib's
    """``with heartbeat("importing matplotlib"):`` prints the label at once and then, from a background
    thread, a "still ..." line every ``every_s`` seconds until the block ends: for a cell whose work
    prints nothing for a while (imports, a computation) and would otherwise look hung. The launcher's
    own runs need none (they show progress, or a heartbeat of their own, after ``HEARTBEAT_S``)."""

    def __init__(self, label: str, every_s: float = HEARTBEAT_S) -> None:
        self.label, self.every_s = label, every_s

    def __enter__(self) -> "heartbeat":
        import threading

        print(f"{self.label} ...", flush=True)
        self.started, self.done = time.monotonic(), threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)
        self.thread.start()
        return self

    def _beat(self) -> None:
        while not self.done.wait(self.every_s):
            print(f"... still {self.label} ({time.monotonic() - self.started:.0f} s)", flush=True)

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
