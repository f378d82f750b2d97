"""The run directory: one process at a time. ``lambdanet train --out DIR`` holds an exclusive lock on ``DIR/.lock``
for the whole run (rank 0 under torchrun). The lock is an advisory ``flock`` that the operating system drops when
the process ends, even by SIGKILL, so a crashed run can be resumed at once while a live one can never be written by
a second process (duplicate rows in ``metrics.csv``, two trainers on one ``last.pt``)."""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path

from lambdanet.files import PRETRAIN_CHECKPOINT

__all__ = ["RunDirLock", "RunDirBusyError", "checkpoints_in", "check_new_run"]

try:
    import fcntl
except ImportError:  # not POSIX: no locking (documented)
    fcntl = None  # type: ignore[assignment]  # mypy types an imported name as the module, never None


class RunDirBusyError(ValueError):
    """Another live process holds the run directory."""


class RunDirLock:
    """Exclusive, non-blocking lock of a run directory (a context manager); ``acquire`` raises
    :class:`RunDirBusyError` naming the holder's pid when another process has it."""

    def __init__(self, out: str | os.PathLike):
        self.out = Path(out)
        self.path = self.out / ".lock"
        self._fd: int | None = None
        # the folders this lock made (the run's, then its missing parents): left with nothing but the lock, they are
        # removed on release (a sweep's --out/<model> too)
        self._made: list[Path] = []

    def acquire(self) -> RunDirLock:
        if fcntl is None or self._fd is not None:
            return self
        try:
            self._made = list(itertools.takewhile(lambda p: not p.exists(), (self.out, *self.out.parents)))
            self.out.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:  # a folder that cannot be made or written (read-only, /proc, no permission)
            raise ValueError(
                f"--out {self.out} cannot be used as a run directory ({err.strerror or err}: "
                f"{err.filename or self.out}); choose another --out"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirBusyError(
                f"run directory {self.out} is in use by another lambdanet process (pid {holder}); "
                "wait for it to end, or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):  # (a folder removed meanwhile: nothing to tidy)
                if self._made and [p.name for p in self.out.iterdir()] == [self.path.name]:  # a run that wrote
                    self.path.unlink(missing_ok=True)  # nothing (an error before its first file): no empty folder
                    for folder in self._made:  # deepest first; a parent something else wrote in stays (OSError)
                        folder.rmdir()
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def checkpoints_in(out: str | os.PathLike, names: tuple[str, ...] = ("last.pt",)) -> list[str]:
    """The checkpoints among ``names`` that ``out`` holds, which a run can continue from."""
    return [name for name in names if (Path(out) / name).is_file()]


def check_new_run(out: str | os.PathLike, resume: bool, names: tuple[str, ...] = ("last.pt",)) -> None:
    """A run that does not ``resume`` must not write over one: a one-line ``ValueError`` when ``out`` holds
    one of the checkpoints ``names`` or another task's (a pre-training's ``pretrain.pt``), or a finished
    run's ``summary.json`` (its weights and figures) without one."""
    found = checkpoints_in(out, tuple(dict.fromkeys((*names, "last.pt", PRETRAIN_CHECKPOINT))))
    if not resume and found:
        raise ValueError(
            f"{out} already holds a run ({found[0]}); pass --resume to continue it or choose another --out"
        )
    if not resume and (Path(out) / "summary.json").is_file():  # a finished run whose checkpoint was deleted
        raise ValueError(
            f"{out} already holds a finished run (summary.json, no {' or '.join(names)} to continue); choose "
            "another --out, or delete the run's files to train afresh there"
        )
