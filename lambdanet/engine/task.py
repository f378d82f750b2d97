"""How a task plugs into the engine: a :class:`Task` subclass (the ``task.py`` of a folder of
``lambdanet/tasks/``) and :func:`run`, which does the rest the same for every task: the process group, the
run-directory lock, signals, the resume and new-run rules, seeding, ``config.yaml``, restoring ``last.pt``, DDP,
the loop (:func:`lambdanet.engine.loop.fit`) and the logs.

:class:`Task` declares every hook the engine calls, in the order of a run: the abstract ones a task implements
(:meth:`~Task.build_state`, :meth:`~Task.describe`, :meth:`~Task.batches`, :meth:`~Task.step_loss`,
:meth:`~Task.epoch_row`, :meth:`~Task.epoch_line`, :meth:`~Task.finish`) and those with a default it may
override (:meth:`~Task.initialize`, :meth:`~Task.wrap`, :meth:`~Task.save_due`, :meth:`~Task.stops_early`,
:meth:`~Task.save`, ``lr``, ``diverged_hint``)."""

from __future__ import annotations

import copy
import dataclasses
import random
import signal
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from lambdanet.engine.checkpoint import load_checkpoint
from lambdanet.engine.config import RunConfig, data_identity
from lambdanet.engine.contract import Task
from lambdanet.engine.distributed import (
    DistContext,
    all_gather_objects,
    all_reduce_sum,
    barrier,
    cleanup,
    data_parallel,
    init_distributed,
    uses_cuda,
)
from lambdanet.engine.logger import RunLogger, truncate_history
from lambdanet.engine.loop import fit
from lambdanet.engine.preempt import Preempted, StopSignals, resume_point
from lambdanet.engine.rundir import RunDirBusyError, RunDirLock, check_new_run
from lambdanet.engine.state import RunState
from lambdanet.files import RUN_FILES
from lambdanet.helpers import require
from lambdanet.ops.position_lambda.tuning import set_impl_tuning
from lambdanet.runtime import check_amp

C = TypeVar("C", bound=RunConfig)

__all__ = ["Task", "run", "resolved", "check_extras", "check_same_config", "data_identity", "preflight"]


def run(task_cls: type[Task], cfg: RunConfig, log: Callable[[str], None] = print) -> dict:
    """Run ``task_cls`` on the resolved configuration ``cfg`` in this process (one rank under torchrun):
    the run directory locked by the main process (every rank stops when it is busy), SIGTERM / SIGINT turned
    into a step-level checkpoint and :class:`lambdanet.engine.preempt.Preempted`. Returns the summary.
    A configuration built directly rather than by :meth:`RunConfig.resolve` is resolved first (:func:`resolved`)."""
    cfg = resolved(cfg)
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
        check_same_config(cfg, ctx)
        # implementations by the static policy, not measured: every rank and a resumed run then compute the same
        # function (a measured winner depends on the machine's load at the first call)
        previous = set_impl_tuning("static")
        try:
            with StopSignals(notice=ctx.is_main) as stop:
                summary = _run(task_cls(cfg, ctx, log if ctx.is_main else (lambda _: None), stop))
        finally:
            set_impl_tuning(previous)
        finished = True
        return summary
    finally:
        lock.release()
        cleanup(ctx, synchronize=finished)


def check_same_config(cfg: RunConfig, ctx: DistContext) -> None:
    """Every process of a group runs one configuration: a one-line ``ValueError`` naming the options given
    differently (a launcher script that varies them by rank), on every rank; else they would train on mismatched
    shards, or wait for one another forever in a collective that only some reach. The configuration's
    ``PER_PROCESS`` options (each node's own paths, the run folder only the main process writes, loader workers,
    progress output) and the folder of a ``kind:path`` ``data`` (only its kind and last name) may differ."""
    if not ctx.enabled:
        return
    mine = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in type(cfg).PER_PROCESS}
    if isinstance(mine.get("data"), str):  # a path of this node's own (its working directory, its copy): the kind
        mine["data"] = data_identity(mine["data"])
    every = all_gather_objects(mine, ctx)
    differ = [k for k in every[0] if any(other.get(k) != every[0][k] for other in every[1:])]
    if differ:
        ranks = "; ".join(f"{k}: " + ", ".join(f"rank {i} {c.get(k)!r}" for i, c in enumerate(every)) for k in differ)
        raise ValueError(f"the {ctx.world} processes were given different options ({ranks}); give every process "
                         "the same command")  # fmt: skip


def resolved(cfg: C) -> C:
    """``cfg`` ready to run as :meth:`RunConfig.resolve` makes it. One that did not come from ``resolve`` (built
    directly, ``SomeConfig(model=..., epochs=1)``, or a ``dataclasses.replace`` copy of a resolved one) runs its
    field values as they are (its ``recipe`` names a recipe, it does not apply one): a copy of them validated, its
    data path made absolute and what its options imply written in (the task's :meth:`RunConfig.complete`, every
    field counting as given), so that the run it records loads and resumes; one with ``resume`` continues the
    run's ``config.yaml`` with the values given that differ from the defaults (as ``--resume`` with flags). A
    resolved one is unchanged. (A direct fine-tuning configuration names its ``model``: the command line's
    ``--checkpoint`` alone takes the checkpoint's.)"""
    if getattr(cfg, "_resolved", False) or not isinstance(cfg, RunConfig):  # (a stand-in a test passes)
        return cfg
    if cfg.resume:  # the run's config.yaml, with the values given that differ from the defaults over it
        default = type(cfg)()
        given = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        return type(cfg).resolve(overrides={k: v for k, v in given.items() if v != getattr(default, k)})
    cfg = copy.deepcopy(cfg)
    cfg.finalize({f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})  # every field counts as given
    return cfg


def preflight(task_cls: type[Task], cfg: RunConfig) -> int:
    """The checks before anything of a run is written, the same for every task, in every process of
    :func:`run` (a launcher of local processes calls it once first, so that a user error is one line, not one
    per process): the configuration's ranges, the extras, the resume rule, the new-run rule. Returns the
    epochs the run was planned with (``--resume``: its saved ``config.yaml``'s)."""
    cfg.validate()
    check_amp(cfg.amp, "cuda" if uses_cuda(cfg.device) else "cpu")  # before a loss scaler is built (torch warns)
    check_extras(task_cls, cfg)
    saved_epochs = cfg.check_resume() if cfg.resume else cfg.epochs
    check_new_run(cfg.out, cfg.resume, cfg.CHECKPOINTS)
    return saved_epochs


def check_extras(task_cls: type[Task], cfg: RunConfig) -> None:
    """The optional packages a run of ``task_cls`` needs are installed, else a one-line error naming the extra
    (before anything is trained or written)."""
    for module, extra in task_cls.extras:
        require(module, extra, f"lambdanet {task_cls.command}")
    if cfg.tensorboard:
        require("tensorboard", "train", "--tensorboard (the default; --no-tensorboard turns it off)")


def _run(task: Task) -> dict:
    cfg, ctx, out = task.cfg, task.ctx, task.out
    saved_epochs = preflight(type(task), cfg)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    state = task.build_state()
    resumed = cfg.resume and task.checkpoint_path.is_file()
    if resumed:  # before config.yaml is written: a refused --epochs leaves the run as it was
        _restore(task, state, saved_epochs)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        cfg.save_yaml(out / "config.yaml")
        # the rows of the epochs last.pt holds: a resumed run redoes the later ones, and a new run starts with none
        # (an earlier attempt in this folder that died before its first checkpoint left its rows)
        truncate_history(out / "metrics.csv", state.epoch)
    barrier(ctx)
    task.initialize(state, resumed)
    model = data_parallel(task.wrap(state.model), ctx)
    # the same for TensorBoard: what an earlier attempt logged from the first epoch this run trains on is hidden
    logger = RunLogger(out, enabled=ctx.is_main, tensorboard=cfg.tensorboard, first_epoch=state.epoch + 1)
    try:
        if cfg.compile_mode != "default" and not cfg.compile:  # the mode is saved, and kept by --resume, all the same
            task.log(f"warning: --compile-mode {cfg.compile_mode} has no effect without --compile")
        task.log(task.describe(state))
        row, stopped = fit(task, state, model, ctx=ctx, logger=logger, log=task.log, stop=task.stop)
    finally:
        logger.close()
    try:
        return task.finish(state, row, stopped)
    except KeyboardInterrupt:  # Ctrl-C twice in the final evaluation: the last epoch is saved, --resume ends the run
        raise Preempted.at(signal.SIGINT, "in the run's final evaluation", task.checkpoint_path, cfg.out) from None


def _restore(task: Task, state: RunState, saved_epochs: int) -> None:
    """``--resume``: ``last.pt`` into ``state``; more ``epochs`` than the run was planned with extend it."""
    cfg, out = task.cfg, task.out
    state.load_state_dict(task.upgrade_checkpoint(load_checkpoint(task.checkpoint_path, map_location=task.ctx.device)))
    if cfg.epochs < state.epoch:
        raise ValueError(f"--epochs {cfg.epochs} is fewer than the {state.epoch} epochs {out} has done")
    if cfg.epochs == state.epoch and state.epoch_partial:  # its weights hold steps of the next epoch
        raise ValueError(
            f"--epochs {cfg.epochs} is fewer than {out} has trained: {state.epoch} epochs and "
            f"{state.epoch_partial['batches']} batches of epoch {state.epoch + 1}; give --epochs {state.epoch + 1} "
            "or more"
        )
    where = resume_point(state.epoch, state.epoch_partial, task.steps_per_epoch)
    task.log(f"resuming {out}: {state.epoch}/{saved_epochs} epochs done{where}")
    if cfg.epochs > state.epoch and not state.epoch_partial and task.stops_early(state):  # fit ends it at once
        task.log(f"{out} stopped early after epoch {state.epoch} and its rule to stop still holds: it ends there "
                 f"(--epochs {cfg.epochs} trains nothing more)")  # fmt: skip
    elif cfg.epochs != saved_epochs:
        task.log(
            f"{'extending' if cfg.epochs > saved_epochs else 'shortening'} the run from {saved_epochs} to "
            f"{cfg.epochs} epochs: the learning-rate schedule is recomputed over {cfg.epochs} epochs and continues "
            f"from epoch {state.epoch}"
        )
    # the final weights and summary of the run's earlier end (a shorter or early-stopped run) stop being its end at
    # the first checkpoint past it (Task.drop_superseded): a loader of the run directory prefers them to last.pt, a
    # sweep takes the summary for the run's result
    ends = (*(name for name in RUN_FILES if name != "last.pt"), "summary.json")
    final = [out / name for name in ends if (out / name).is_file()]
    if final and state.epoch < cfg.epochs:
        task.superseded = tuple(final)
