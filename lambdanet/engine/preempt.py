"""Preemption: a run stopped by SIGTERM or SIGINT saves a step-level checkpoint and exits non-zero.

Cluster schedulers stop a job with SIGTERM and kill it with SIGKILL after a grace period; a terminal sends SIGINT
on Ctrl-C. Inside :class:`StopSignals` such a signal only sets a flag; the training loops look at it after every
optimiser step (:meth:`StopSignals.requested`, agreed between the processes of a process group so that all of them
stop after the same step), save the run where it stands, and raise :class:`Preempted`, which the command line
prints as one line and turns into the exit status ``128 + signal number`` (143 for SIGTERM, 130 for SIGINT), as a
shell reports a process killed by that signal. ``--resume`` continues from that step."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import TYPE_CHECKING

from lambdanet.engine.distributed import DistContext, all_reduce_sum

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType
    from typing import Any

    # what signal.signal takes and returns: a function, SIG_DFL / SIG_IGN, or None (one not set from Python)
    _Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None

__all__ = ["Preempted", "StopSignals", "STOP_SIGNALS", "exit_status", "resume_point"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# a second signal this long after the first stops the process at once (Ctrl-C twice); one within it is the
# same signal delivered twice (a terminal signals the whole process group, and the launcher forwards it too)
REPEAT_WINDOW_S = 1.0


class Preempted(RuntimeError):
    """The run was stopped by a signal after saving a checkpoint that ``--resume`` continues from. The
    message names the signal (``SIGTERM`` / ``SIGINT``), as :func:`exit_status` reads it."""

    @classmethod
    def at(cls, sig: signal.Signals, where: str, saved, out=None) -> Preempted:
        """``stopped by SIGTERM <where>: saved <saved>; continue with --resume --out <out>`` (the last part when
        ``out`` is known; ``saved=None``: nothing could be saved)."""
        kept = f"saved {saved}" if saved is not None else "nothing saved (no checkpoint file)"
        resume = f"; continue with --resume --out {out}" if out is not None else ""
        return cls(f"stopped by {sig.name} {where}: {kept}{resume}")


def resume_point(epochs_done: int, partial: dict | None, batches: int = 0) -> str:
    """What a ``resuming ...`` line adds for a checkpoint saved inside an epoch (``epoch_partial``):
    ``", epoch 3 from batch 18"``, ``", epoch 3's end (its 30 batches done)"`` where the stop came after the
    epoch's last batch (``batches``: the epoch's; 0 unknown), or nothing at an epoch's end."""
    if not partial:
        return ""
    if batches and partial["batches"] >= batches:
        return f", epoch {epochs_done + 1}'s end (its {partial['batches']} batches done)"
    return f", epoch {epochs_done + 1} from batch {partial['batches'] + 1}"


def _say(text: str) -> None:
    """``text`` on stderr from a signal handler (a raw write: the stream may be in the middle of a write)."""
    try:
        os.write(2, text.encode())
    except OSError:
        pass


def exit_status(err: Preempted) -> int:
    """``128 + signal number`` of the signal ``err`` names (143 for SIGTERM, 130 for SIGINT)."""
    return 128 + int(next((sig for sig in STOP_SIGNALS if sig.name in str(err)), signal.SIGTERM))


class StopSignals:
    """While entered, SIGTERM and SIGINT set :attr:`received` instead of ending the process; the same or the other
    signal again, more than :data:`REPEAT_WINDOW_S` later, does what it would have done without this guard (Ctrl-C
    twice interrupts a long evaluation or a hung process group). Handlers can only be installed from the main
    thread: elsewhere (a run started from a worker thread) the process keeps its handlers and :meth:`requested`
    reports only what :meth:`request` was told."""

    def __init__(self, notice: bool = False) -> None:
        self.notice = notice  # say on a terminal that the first signal was heard (the stop can wait for an evaluation)
        self.received: signal.Signals | None = None
        self._first = 0.0
        self._previous: dict[signal.Signals, _Handler] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            for outer in self._previous.values():  # nested in another: a signal it caught already counts here
                owner = getattr(outer, "__self__", None)
                if isinstance(owner, StopSignals) and owner.received:
                    self.request(owner.received)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.received is not None and now - self._first > REPEAT_WINDOW_S:  # asked again: stop now
            previous = self._previous.get(signal.Signals(signum), signal.SIG_DFL)
            self.__exit__()
            if callable(previous):
                previous(signum, frame)  # Python's SIGINT handler: KeyboardInterrupt
            else:
                signal.raise_signal(signum)  # the default action: the process ends by this signal
            return
        if self.received is None:
            self._first = now
            if self.notice and os.isatty(2):
                _say(f"\n{signal.Signals(signum).name}: stopping where the run can be saved and resumed (after this "
                     f"step or evaluation); the same again (after a second) stops at once\n")  # fmt: skip
        self.request(signal.Signals(signum))

    def request(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Ask the run to stop after its current step (what a received signal does)."""
        if self.received is None:
            self.received = sig

    def requested(self, ctx: DistContext | None = None) -> signal.Signals | None:
        """The signal the run stops for, or ``None``. In a process group every process must call this after the
        same step: a signal received by any of them stops all (each then reports SIGTERM unless it received
        one itself)."""
        if ctx is None or not ctx.enabled:
            return self.received
        # what this process knew when it entered the reduce: a signal landing while it waits there counts at
        # the next step, as it does for the others (answering with it now would stop this process alone)
        if not all_reduce_sum([float(self.received is not None)], ctx)[0]:
            return None
        self.request(signal.SIGTERM)  # a no-op when this process received a signal itself
        return self.received
