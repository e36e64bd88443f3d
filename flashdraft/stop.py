"""Graceful stop: SIGTERM (SLURM, Kubernetes and spot preemption; torchrun forwards it to every
rank) and SIGINT (Ctrl-C) end `train`, `generate` and `cache` after the unit of work in flight,
with what they finished on disk, instead of at once.

While a `StopRequests` block is active the two signals are only recorded; the command's loop
looks at `requested` after each unit, writes its resumable state and raises
`flashdraft.errors.Interrupted` (exit status 128 + signal: 143, 130). A second signal while that
state is written is recorded too and changes nothing, so it cannot cut a checkpoint short
(SIGKILL still stops at once: what was finished before stays whole).

Under torchrun every rank gets the signal. `train` agrees on the stop step every step (one
scalar all-reduce, its ranks being in lockstep anyway); `generate` and `cache`, whose ranks run
at their own pace, agree once at the end, where they met before: a rank that got no signal
finishes its share first, then all stop together.
"""

from __future__ import annotations

import os
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequests:
    """Record SIGTERM/SIGINT instead of dying, inside a `with` block (restoring the handlers
    after). `unit`: what finishes before the stop, for the line printed when the signal comes."""

    def __init__(self, unit: str, prefix: str = "") -> None:
        self.unit, self.prefix = unit, prefix
        self.signum: int | None = None
        self._repeated = False
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame) -> None:
        # os.write, not print: a handler that prints while the interrupted code prints fails
        # with a reentrant-call error
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            line = f"{name}: stopping after the {self.unit} in flight, its state saved for a re-run"
        elif not self._repeated:
            self._repeated = True
            line = (
                f"{name} again: still stopping after the {self.unit} in flight, its state is being written "
                f"(SIGKILL stops at once and loses it)"
            )
        else:
            return
        os.write(2, f"\n{self.prefix}{line}\n".encode())

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for s in SIGNALS:
                # a signal the parent ignores stays ignored (a background job of a script ignores
                # SIGINT, as Python itself honours)
                if signal.getsignal(s) is not signal.SIG_IGN:
                    self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
