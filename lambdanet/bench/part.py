"""What a part of ``lambdanet bench`` (:mod:`lambdanet.bench.runner`) is: a function of the run's
:class:`BenchSettings`, its output folder and a progress log that returns its rows per output file and its section
of ``bench.md`` (:data:`PartResult`), and the peer packages it compares against (:class:`Part`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

__all__ = ["BenchSettings", "Part", "PartResult", "Log", "DEFAULT_SUITES"]

DEFAULT_SUITES = ("table13", "hybrid26", "mobilenet", "halonet")


@dataclass(frozen=True)
class BenchSettings:
    """The options of a bench run that the parts read (``quick``: tiny sizes, a smoke test)."""

    device: str = "cpu"
    quick: bool = False
    suites: tuple[str, ...] = DEFAULT_SUITES
    img_size: int = 224
    batch_size: int = 8
    repeats: int = 5
    amp: str = "none"
    channels_last: bool = False
    compile: bool = False
    layers: tuple[str, ...] | None = None
    given: frozenset[str] = frozenset()  # the options set by the user: --quick keeps them

    def value(self, name: str, quick):
        """The option ``name``: the user's value where given (:attr:`given`), else ``quick`` under ``--quick``, else
        its default."""
        return getattr(self, name) if name in self.given or not self.quick else quick

    @property
    def model_suites(self) -> tuple[str, ...]:
        return self.value("suites", ("hybrid26",))


Log = Callable[[str], None]
PartResult = tuple[dict[str, list[dict]], list[str]]  # rows per output file, lines of bench.md


class Part(NamedTuple):
    """A benchmark part: its function, the peer packages (import names) it compares against, and the options of
    :class:`BenchSettings` it reads beyond ``device`` and ``quick`` (recorded in its section of ``bench.md``; one
    that no part of a run reads is a warning)."""

    run: Callable[[BenchSettings, Path, Log], PartResult]
    peers: Callable[[BenchSettings], tuple[str, ...]]
    reads: tuple[str, ...] = ()
