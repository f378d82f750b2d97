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

    @property
    def model_suites(self) -> tuple[str, ...]:
        return ("hybrid26",) if self.quick else self.suites


Log = Callable[[str], None]
PartResult = tuple[dict[str, list[dict]], list[str]]  # rows per output file, lines of bench.md


class Part(NamedTuple):
    """A benchmark part: its function and the peer packages (import names) it compares against."""

    run: Callable[[BenchSettings, Path, Log], PartResult]
    peers: Callable[[BenchSettings], tuple[str, ...]]
