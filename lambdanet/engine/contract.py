"""The contract between the engine and a task: :class:`Task` declares every hook :func:`lambdanet.engine.task.run`
and :func:`lambdanet.engine.loop.fit` call, in the order of a run: the abstract ones a task implements and those
with a default it may override."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import cast

import torch
from torch import Tensor, nn

from lambdanet.engine.config import RunConfig
from lambdanet.engine.distributed import DistContext
from lambdanet.engine.preempt import StopSignals
from lambdanet.engine.state import RunState

__all__ = ["Task"]


class Task(ABC):
    """A task of the engine: what :func:`run` and :func:`lambdanet.engine.loop.fit` call, in the order of a run.

    Set by the engine: ``cfg`` (the task's resolved :class:`~lambdanet.engine.config.RunConfig`), ``ctx`` (this
    process's :class:`~lambdanet.engine.distributed.DistContext`), ``log`` (one line out; silent on the other
    ranks) and ``stop`` (the run's signals). Set by the task in :meth:`build_state`: ``steps_per_epoch``, and
    ``lr`` (step -> rate) unless the state carries a scheduler."""

    diverged_hint = "Lower --lr or check the data."  # the last words of a diverged run's error
    command = "train"  # the command that runs the task, for messages
    extras: tuple[tuple[str, str], ...] = (("matplotlib", "train"),)  # (module, extra) the task needs: the plots
    lr: Callable[[int], float] | None = None  # the rate of each step (None: the state's scheduler steps)
    steps_per_epoch: int = 0  # optimiser steps of one epoch, set by build_state
    superseded: tuple[Path, ...] = ()  # a resumed run's final weights of an earlier end, set by the engine

    def __init__(self, cfg: RunConfig, ctx: DistContext, log: Callable[[str], None], stop: StopSignals | None = None):
        self.cfg, self.ctx, self.log, self.stop = cfg, ctx, log, stop
        self.out = Path(cfg.out)

    @abstractmethod
    def build_state(self) -> RunState:
        """Called first, on every rank, after seeding and before anything is written: the task's data and model
        and the :class:`RunState` of a new run (a resumed run's ``last.pt`` is loaded into it afterwards); sets
        ``steps_per_epoch`` (and ``lr`` where the state has no scheduler)."""

    @abstractmethod
    def describe(self, state: RunState) -> str:
        """Called once before the first epoch: the run's first line of output (model, data, recipe)."""

    @abstractmethod
    def batches(self, state: RunState) -> Iterable:
        """Called at the start of every epoch: its batches from the first not yet trained
        (``state.epoch_partial["batches"]`` of them are done when the epoch resumes), in an order that depends
        only on the seed and the epoch, so that a resumed epoch sees the rest of the same order."""

    @abstractmethod
    def step_loss(self, model: nn.Module, batch) -> tuple[Tensor, dict[str, float]]:
        """Called once per step, under autocast: the loss to back-propagate and the amounts (a number each) the
        engine sums over the epoch and the ranks for :meth:`epoch_row`."""

    @abstractmethod
    def epoch_row(self, state: RunState, model: nn.Module, result: dict) -> dict:
        """Called after every epoch (``result``: ``{"sums", "seconds"}`` of the epoch): its metrics row, the
        task's evaluation included, which ``metrics.csv`` and TensorBoard receive."""

    @abstractmethod
    def epoch_line(self, row: dict) -> str:
        """Called after :meth:`epoch_row`: the epoch's one line of output."""

    @abstractmethod
    def finish(self, state: RunState, row: dict, stopped: bool) -> dict:
        """Called last, on every rank (outputs are the main process's), with the last epoch's row (``{}`` when
        none was left) and whether the run stopped early: weights, plots and the summary it returns."""

    @property
    def checkpoint_path(self) -> Path:
        return self.out / "last.pt"

    def save(self, state: RunState) -> None:
        """Called by the main process when a checkpoint is due: ``last.pt``, the state with its configuration."""
        state.save(self.checkpoint_path, self.cfg)

    def drop_superseded(self) -> None:
        """Called on the main process after each checkpoint: the final weights of the run's earlier end
        (:attr:`superseded`), which a loader of the run directory would prefer to the checkpoint, are removed
        once a checkpoint goes past them; the run's new end writes new ones."""
        if self.superseded:
            for path in self.superseded:
                path.unlink(missing_ok=True)
            self.log(f"removed {', '.join(p.name for p in self.superseded)} of the run's earlier end: last.pt is ahead")
            self.superseded = ()

    def upgrade_checkpoint(self, saved: dict) -> dict:
        """Called on ``--resume`` with the loaded ``last.pt``, before it is restored: the same checkpoint in the
        engine's current format, for a task whose earlier versions saved another (the epoch position
        ``epoch_partial`` as ``{"batches", "sums", "seconds"}``); unchanged by default."""
        return saved

    def initialize(self, state: RunState, resumed: bool) -> None:
        """Called before the epochs, after ``config.yaml`` is written and (``resumed``) ``last.pt`` restored: a
        new run's preparation such as a pre-training; none by default."""

    def save_due(self, epoch: int) -> bool:
        """Called after every epoch (numbered from 1): whether ``last.pt`` is written (it always is at the end)."""
        return epoch % self.cfg.checkpoint_every == 0

    def stops_early(self, state: RunState) -> bool:
        """Called after every epoch and when a run resumes: whether the run ends here (a converged search); never by
        default. It logs nothing: the loop logs :meth:`early_stop_reason` where it stops."""
        return False

    def early_stop_reason(self, state: RunState) -> str:
        """The line the loop logs when :meth:`stops_early` ends the run."""
        return f"stopping early after epoch {state.epoch}"

    def wrap(self, model: nn.Module) -> nn.Module:
        """Called once before the loop: the model it trains, before the DDP wrap (compiled when the configuration
        has ``compile`` set, in its ``compile_mode``: ``"reduce-overhead"`` captures CUDA graphs)."""
        if not self.cfg.compile:
            return model
        mode = None if self.cfg.compile_mode == "default" else self.cfg.compile_mode
        return cast(nn.Module, torch.compile(model, mode=mode))
