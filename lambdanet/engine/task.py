"""How a task plugs into the engine: a :class:`Task` subclass (one module: classification in
``lambdanet/train/trainer.py``, detection in ``lambdanet/detection/trainer.py``) and :func:`run`, which does the
rest the same for every task: the process group, the run-directory lock, signals, the resume and new-run rules,
seeding, ``config.yaml``, restoring ``last.pt``, DDP, the loop (:func:`lambdanet.engine.loop.fit`) and the logs.

A task implements:

* ``build_state()``: its data and model, and the :class:`RunState` of a new run (``steps_per_epoch`` set);
* ``batches(state)``: an epoch's batches from the first not yet trained, and ``step_loss(model, batch) -> (loss,
  {name: amount summed over the epoch})``; ``lr`` (step -> rate) or a scheduler in the state;
* ``epoch_row(state, model, result)``: the epoch's metrics (training sums, evaluation), ``epoch_line(row)``;
* ``describe(state)``: the run's first line, and ``finish(state, row, stopped)``: weights, plots and the summary
  (every rank calls it; outputs are the main process's);

and may override ``initialize(state, resumed)`` (work before the epochs, such as a pre-training),
``save_due(epoch)``, ``stops_early(state)``, ``wrap(model)`` and ``diverged_hint``."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
from torch import nn

from lambdanet.layers.impl_tuning import set_impl_tuning
from lambdanet.engine.checkpoint import load_checkpoint
from lambdanet.engine.distributed import DistContext, all_reduce_sum, barrier, cleanup, data_parallel, init_distributed
from lambdanet.engine.logger import RunLogger, truncate_history
from lambdanet.engine.loop import fit
from lambdanet.engine.preempt import StopSignals, resume_point
from lambdanet.engine.rundir import RunDirBusyError, RunDirLock, check_new_run
from lambdanet.engine.state import RunState
from lambdanet.helpers import require

__all__ = ["Task", "run", "check_extras"]


class Task:
    """A task of the engine (see the module's docstring for what a subclass implements)."""

    diverged_hint = "Lower --lr or check the data."
    command = "train"  # the command that runs the task, for messages
    extras: tuple[tuple[str, str], ...] = (("matplotlib", "train"),)  # (module, extra) the task needs: the plots
    lr: Callable[[int], float] | None = None  # the rate of each step (None: the state's scheduler)
    steps_per_epoch: int = 0

    if TYPE_CHECKING:  # every subclass implements these (the module's docstring)

        def build_state(self) -> RunState: ...

        def describe(self, state: RunState) -> str: ...

        def finish(self, state: RunState, row: dict, stopped: bool) -> dict: ...

    def __init__(self, cfg, ctx: DistContext, log: Callable[[str], None], stop: StopSignals | None = None):
        self.cfg, self.ctx, self.log, self.stop = cfg, ctx, log, stop
        self.out = Path(cfg.out)

    @property
    def checkpoint_path(self) -> Path:
        return self.out / "last.pt"

    def save(self, state: RunState) -> None:
        """``last.pt``: the run's state with its configuration."""
        state.save(self.checkpoint_path, self.cfg)

    def initialize(self, state: RunState, resumed: bool) -> None:
        """Work before the epochs, after ``config.yaml`` is written and (``resumed``) ``last.pt`` restored: a
        new run's preparation such as a pre-training; none by default."""

    def save_due(self, epoch: int) -> bool:
        return epoch % getattr(self.cfg, "checkpoint_every", 1) == 0

    def stops_early(self, state: RunState) -> bool:
        return False

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model the loop trains, before the DDP wrap: compiled when the configuration has ``compile`` set."""
        return cast(nn.Module, torch.compile(model)) if getattr(self.cfg, "compile", False) else model


def run(task_cls: type[Task], cfg, log: Callable[[str], None] = print) -> dict:
    """Run ``task_cls`` on the resolved configuration ``cfg`` in this process (one rank under torchrun):
    the run directory locked by the main process (every rank stops when it is busy), SIGTERM / SIGINT turned
    into a step-level checkpoint and :class:`lambdanet.engine.preempt.Preempted`. Returns the summary."""
    ctx = init_distributed(cfg.device)
    finished, lock = False, RunDirLock(cfg.out)
    try:
        busy = None
        if ctx.is_main:
            try:
                lock.acquire()
            except RunDirBusyError as err:
                busy = err
        if all_reduce_sum([float(busy is not None)], ctx)[0]:  # every rank stops when rank 0 could not lock
            raise busy or RunDirBusyError(f"run directory {cfg.out} is in use by another process")
        # implementations by the static policy, not measured: every rank and a resumed run then compute the same
        # function (a measured winner depends on the machine's load at the first call)
        previous = set_impl_tuning("static")
        try:
            with StopSignals() as stop:
                summary = _run(task_cls(cfg, ctx, log if ctx.is_main else (lambda _: None), stop))
        finally:
            set_impl_tuning(previous)
        finished = True
        return summary
    finally:
        lock.release()
        cleanup(ctx, synchronize=finished)


def check_extras(task_cls: type[Task], cfg) -> None:
    """The optional packages a run of ``task_cls`` needs are installed, else a one-line error naming the extra
    (before anything is trained or written)."""
    for module, extra in task_cls.extras:
        require(module, extra, f"lambdanet {task_cls.command}")
    if getattr(cfg, "tensorboard", False):
        require("tensorboard", "train", "--tensorboard (the default; --no-tensorboard turns it off)")


def _run(task: Task) -> dict:
    cfg, ctx, out = task.cfg, task.ctx, task.out
    cfg.validate()
    check_extras(type(task), cfg)
    saved_epochs = cfg.check_resume() if cfg.resume else cfg.epochs
    check_new_run(out, cfg.resume, cfg.CHECKPOINTS)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    state = task.build_state()
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        cfg.save_yaml(out / "config.yaml")
    barrier(ctx)
    resumed = cfg.resume and task.checkpoint_path.is_file()
    if resumed:
        _restore(task, state, saved_epochs)
    task.initialize(state, resumed)
    model = data_parallel(task.wrap(state.model), ctx)
    logger = RunLogger(out, enabled=ctx.is_main, tensorboard=cfg.tensorboard)
    try:
        task.log(task.describe(state))
        row, stopped = fit(task, state, model, ctx=ctx, logger=logger, log=task.log, stop=task.stop)
    finally:
        logger.close()
    return task.finish(state, row, stopped)


def _restore(task: Task, state: RunState, saved_epochs: int) -> None:
    """``--resume``: ``last.pt`` into ``state``; more ``epochs`` than the run was planned with extend it."""
    cfg, out = task.cfg, task.out
    state.load_state_dict(load_checkpoint(task.checkpoint_path, map_location=task.ctx.device))
    if cfg.epochs < state.epoch:
        raise ValueError(f"--epochs {cfg.epochs} is fewer than the {state.epoch} epochs {out} has done")
    if task.ctx.is_main:
        truncate_history(out / "metrics.csv", state.epoch)
    where = resume_point(state.epoch, state.epoch_partial)
    task.log(f"resuming {out}: {state.epoch}/{saved_epochs} epochs done{where}")
    if cfg.epochs != saved_epochs:
        task.log(
            f"extending the run from {saved_epochs} to {cfg.epochs} epochs: the learning-rate schedule is "
            f"recomputed over {cfg.epochs} epochs and continues from epoch {state.epoch}"
        )
