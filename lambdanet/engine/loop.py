"""The one training loop of every task: :func:`train_epoch` (a pass over batches, resumable at any step) and
:func:`fit` (the epochs of a run: evaluation, logs, checkpoints, early stopping, preemption), driven by a
:class:`lambdanet.engine.contract.Task`."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import Tensor, nn

from lambdanet.engine.checkpoint import rng_state, set_rng_state
from lambdanet.engine.contract import Task
from lambdanet.engine.distributed import DistContext, all_reduce_sum, barrier
from lambdanet.engine.logger import RunLogger
from lambdanet.engine.preempt import Preempted, StopSignals
from lambdanet.engine.state import RunState
from lambdanet.runtime import autocast_context  # the loops' autocast, validated in one place

__all__ = [
    "optimizer_step",
    "NonFiniteLossError",
    "NonFiniteWeightsError",
    "NonFiniteEvalError",
    "TrainingDivergedError",
    "train_epoch",
    "fit",
    "progress_bar",
    "to_device",
]


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite."""

    def __init__(self, epoch: int, step: int, value: float):
        self.epoch, self.step, self.value = epoch, step, value
        super().__init__(f"the training loss became {value} at epoch {epoch + 1}, step {step + 1}")


class NonFiniteWeightsError(NonFiniteLossError):
    """A step's update made the weights NaN or infinite, its loss finite (only the next step's loss would say it):
    found before a checkpoint is written and at an epoch's end, so no checkpoint holds such weights."""

    def __init__(self, epoch: int, step: int):
        self.epoch, self.step, self.value = epoch, step, float("nan")
        RuntimeError.__init__(
            self, f"the weights became NaN or infinite by epoch {epoch + 1}, step {step + 1} (the losses were finite)"
        )


class NonFiniteEvalError(NonFiniteLossError):
    """A task's evaluation of an epoch found a NaN or infinite loss, the training losses finite: the epoch's last
    updates diverged (weights that are finite yet overflow a forward pass). ``epoch_row`` raises it; the epoch is
    not saved."""

    def __init__(self, epoch: int, what: str, value: float):
        self.epoch, self.step, self.value = epoch, -1, value
        RuntimeError.__init__(self, f"the {what} became {value} in the evaluation of epoch {epoch + 1} (the training "
                                    f"losses were finite: the epoch's last updates diverged)")  # fmt: skip


class TrainingDivergedError(RuntimeError):
    """The loss became NaN/inf; the run stopped and kept its last good checkpoint."""


def to_device(x: Tensor, device: torch.device, channels_last: bool = False) -> Tensor:
    x = x.to(device, non_blocking=True)
    return x.contiguous(memory_format=torch.channels_last) if channels_last and x.dim() == 4 else x


def progress_bar(enabled: bool, total: int, initial: int = 0, desc: str = ""):
    """A tqdm bar on stderr when ``enabled`` and stderr is a terminal (a log gets the per-epoch lines, not
    carriage-return redraws); ``None`` otherwise."""
    if not (enabled and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)


def optimizer_step(
    loss: Tensor,
    optimizer: torch.optim.Optimizer,
    *,
    scaler: torch.amp.GradScaler | None = None,
    clip: tuple[nn.Module, float] | None = None,
) -> None:
    """One optimiser step on ``loss``, the same for every task: gradients cleared, back-propagated (scaled by
    ``scaler`` under fp16 autocast), their norm clipped to ``clip = (model, max_norm)`` if given (after
    unscaling), then the step (skipped by the scaler when the gradients are not finite)."""
    optimizer.zero_grad(set_to_none=True)
    (loss if scaler is None else scaler.scale(loss)).backward()
    if clip is not None:
        if scaler is not None:
            scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(clip[0].parameters(), clip[1])
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()


def _carried(sums: dict[str, float], ctx: DistContext) -> tuple[dict[str, float], dict[str, float]]:
    """(the sums of every rank, what this rank carries on with): after the reduction the main process holds
    the totals and the others start again from nothing, so that a later reduction counts each step once."""
    keys = sorted(sums) if ctx.enabled else list(sums)  # the same order on every rank
    total = dict(zip(keys, all_reduce_sum([sums[k] for k in keys], ctx)))
    return total, (dict(total) if ctx.is_main else dict.fromkeys(keys, 0.0))


def train_epoch(
    state: RunState,
    model: nn.Module,
    batches: Iterable,
    step_loss: Callable[[nn.Module, Any], tuple[Tensor, dict[str, float]]],
    *,
    ctx: DistContext,
    total: int,
    amp: str = "none",
    clip: float | None = None,
    lr: Callable[[int], float] | None = None,
    stop: StopSignals | None = None,
    bar=None,
    save: Callable[[RunState], None] | None = None,
    save_every: int = 0,
    save_at_step: bool = False,
) -> dict | None:
    """One epoch of ``total`` optimiser steps, or the rest of one that stopped (``state.epoch_partial``).
    ``batches`` yields the epoch's batches from the first not yet trained (the task positions its loader);
    ``step_loss(model, batch) -> (loss, {name: amount})`` runs under autocast, and the amounts are summed over the
    epoch and the ranks. Each step: learning rate ``lr(state.step)`` (else ``state.scheduler`` steps after it), the
    non-finite guard (:class:`NonFiniteLossError` before the step would spoil the weights), the step
    (:func:`optimizer_step`, ``clip`` the gradient norm), the EMA update, ``state.step + 1``. Every ``save_every``
    steps of the epoch, its last excepted, the main process calls ``save(state)`` with ``state.epoch_partial``
    saying where the epoch stands (and every process's generators gathered: :meth:`RunState.gather_rng`);
    ``save_at_step``: at every ``save_every``-th step of the run instead (``state.step``, across the epochs' ends,
    the last step of an epoch included), and every process calls ``save`` (which writes on the main one). ``stop``
    (:class:`lambdanet.engine.preempt.StopSignals`) is asked after every step: on a signal the pass ends there and
    returns ``None``, ``state.epoch_partial`` set (the generators gathered). Returns ``{"sums", "seconds"}`` of
    the whole epoch, ``state.epoch_partial`` cleared."""
    partial = state.epoch_partial or {}
    done = int(partial.get("batches", 0))
    saved = {k: float(v) for k, v in partial.get("sums", {}).items()}
    sums = saved if ctx.is_main else dict.fromkeys(saved, 0.0)  # the main process carries every rank's sums
    start = time.perf_counter() - float(partial.get("seconds", 0.0))
    model.train()
    trained = done
    for i, batch in enumerate(batches, start=done):
        if i >= total:
            break
        if lr is not None:
            for group in state.optimizer.param_groups:
                group["lr"] = lr(state.step)
        with autocast_context(ctx.device, amp):
            loss, amounts = step_loss(model, batch)
        if not torch.isfinite(loss):
            raise NonFiniteLossError(state.epoch, i, float(loss.detach()))
        optimizer_step(loss, state.optimizer, scaler=state.scaler, clip=(model, clip) if clip else None)
        if state.scheduler is not None:
            state.scheduler.step()
        if state.ema is not None:
            state.ema.update_parameters(model)
        state.step += 1
        trained = i + 1
        for k, v in amounts.items():
            sums[k] = sums.get(k, 0.0) + v
        if bar is not None:
            bar.update()
            bar.set_postfix(
                loss=f"{float(loss.detach()):.3f}", lr=f"{state.optimizer.param_groups[0]['lr']:.2e}", refresh=False
            )
        signalled = stop is not None and stop.requested(ctx) is not None
        due = (
            save is not None
            and save_every > 0
            and (state.step % save_every == 0 if save_at_step else (i + 1) % save_every == 0 and i + 1 < total)
        )
        if signalled or due:
            _check_weights(model, state.epoch, i)  # the same on every process: their weights are one
            total_sums, sums = _carried(sums, ctx)
            state.epoch_partial = {"batches": i + 1, "sums": total_sums, "seconds": time.perf_counter() - start}
            state.gather_rng(ctx)  # every process's generators for the checkpoint of this step (a collective)
            if signalled:
                return None
            if ctx.is_main or save_at_step:
                cast("Callable[[RunState], None]", save)(state)  # not None: without a signal the test above needs it
            state.epoch_partial = None
    if trained > done:  # before the epoch's save (or a failed evaluation's)
        _check_weights(model, state.epoch, trained - 1)
    state.epoch_partial = None
    return {"sums": _carried(sums, ctx)[0], "seconds": time.perf_counter() - start}


def _check_weights(model: nn.Module, epoch: int, step: int) -> None:
    """Raise :class:`NonFiniteWeightsError` unless every weight of ``model`` is finite (one host sync)."""
    weights = [p.detach() for p in model.parameters()]
    if weights and not bool(torch.stack([torch.isfinite(p).all() for p in weights]).all()):
        raise NonFiniteWeightsError(epoch, step)


def fit(
    task: Task,
    state: RunState,
    model: nn.Module,
    *,
    ctx: DistContext,
    logger: RunLogger,
    log: Callable[[str], None],
    stop: StopSignals | None = None,
) -> tuple[dict, bool]:
    """The epochs left of ``task``'s run (:class:`lambdanet.engine.contract.Task`): each trained
    (:func:`train_epoch`), turned into a metrics row (``task.epoch_row``: its evaluation included), logged
    and checkpointed when ``task.save_due`` (and at the end or an early stop). A signal saves the step and
    raises :class:`Preempted`; a non-finite loss raises :class:`TrainingDivergedError` naming the last good
    checkpoint. Returns (the last epoch's row, ``{}`` when none was left; whether the run stopped early)."""
    cfg, path = task.cfg, task.checkpoint_path
    # a run resumed at the end of an epoch that stopped it early (stopped by a signal there, or extended) ends there
    stopped = state.epoch > 0 and not state.epoch_partial and _stops_early(task, state, log)
    row, last_saved = {}, state.epoch
    saved_at = [_position(task, state)]  # where last.pt stands, for the divergence message (step saves update it)
    while state.epoch < cfg.epochs and not stopped:
        bar = progress_bar(
            cfg.progress and ctx.is_main,
            task.steps_per_epoch,
            int((state.epoch_partial or {}).get("batches", 0)),
            f"epoch {state.epoch + 1}/{cfg.epochs}",
        )
        try:
            result = train_epoch(state, model, task.batches(state), task.step_loss, **_epoch_options(task, saved_at),
                                 ctx=ctx, stop=stop, bar=bar)  # fmt: skip
        except NonFiniteLossError as err:
            raise _diverged(task, err, saved_at[0]) from None
        finally:
            if bar is not None:
                bar.close()
        if result is None:  # a signal: save where the epoch stands, then stop
            _write(task, state)
            barrier(ctx)  # the others wait for the save: a process that ends first gets the rest stopped
            raise Preempted.at(
                cast(signal.Signals, cast(StopSignals, stop).received),
                f"in epoch {state.epoch + 1}/{cfg.epochs} after batch "
                f"{cast(dict, state.epoch_partial)['batches']}/{task.steps_per_epoch}",
                path,
                cfg.out,
            )
        try:
            evaluated = _epoch_row(task, state, model, result, log)  # state.epoch now counts the epoch
        except NonFiniteEvalError as err:
            raise _diverged(task, err, saved_at[0]) from None
        row = {"epoch": state.epoch, **evaluated}
        stopped = _stops_early(task, state, log)
        logger.log_epoch(row)
        log(task.epoch_line(row))
        if task.save_due(state.epoch) or state.epoch == cfg.epochs or stopped:  # the same on every process
            _save(task, state)
            last_saved, saved_at[0] = state.epoch, _position(task, state)
        barrier(ctx)
        if stop is not None and stop.requested(ctx) is not None:  # a signal while it evaluated or saved
            _stop_after_epoch(task, state, stop, saved=last_saved == state.epoch)
    return row, stopped


def _stops_early(task: Task, state: RunState, log: Callable[[str], None]) -> bool:
    """``task.stops_early(state)``, its reason logged where it is true (the one place the loop says it)."""
    if not task.stops_early(state):
        return False
    log(task.early_stop_reason(state))
    return True


def _diverged(task: Task, err: NonFiniteLossError, saved_at: str) -> TrainingDivergedError:
    """The run's one-line error for a divergence: what became non-finite, where the last good checkpoint stands."""
    path = task.checkpoint_path
    where = "no checkpoint had been written yet"
    if path.is_file():
        where = f"the last good checkpoint is {path} ({saved_at})"
    return TrainingDivergedError(f"{err}; training stopped, {where}. {task.diverged_hint}")


def _stop_after_epoch(task: Task, state: RunState, stop: StopSignals, saved: bool) -> None:
    """Raise :class:`Preempted` at the end of the epoch a signal came in (saved first where it was not)."""
    if not saved:
        _save(task, state)
    barrier(task.ctx)
    cfg = task.cfg
    last = " (the last), before the run's final evaluation" if state.epoch == cfg.epochs else ""
    where = f"after epoch {state.epoch}/{cfg.epochs}{last}"
    raise Preempted.at(cast(signal.Signals, stop.received), where, task.checkpoint_path, cfg.out)


def _epoch_options(task: Task, saved_at: list[str]) -> dict:
    """:func:`train_epoch`'s options from the run's configuration. ``save`` is what every process calls at each
    ``checkpoint_steps``-th optimiser step of the run (the generators gathered, ``state.epoch_partial`` set): the
    main process writes the run's checkpoint where the epoch stands, as a signal does, also after an epoch's last
    step (the evaluation that follows is then covered too); ``saved_at[0]`` says where."""
    cfg = task.cfg

    def save(state: RunState) -> None:
        _write(task, state)
        saved_at[0] = _position(task, state)

    return dict(total=task.steps_per_epoch, amp=cfg.amp, clip=cfg.grad_clip, lr=task.lr, save=save,
                save_every=cfg.checkpoint_steps, save_at_step=True)  # fmt: skip


def _position(task: Task, state: RunState) -> str:
    """Where a checkpoint of ``state`` stands, for the divergence message: ``"epoch 2"`` at an epoch's end,
    ``"epoch 3 after batch 1/30"`` inside one (a step save, or the step-level checkpoint a run resumed from)."""
    if not state.epoch_partial:
        return f"epoch {state.epoch}"
    return f"epoch {state.epoch + 1} after batch {state.epoch_partial['batches']}/{task.steps_per_epoch}"


def _save(task: Task, state: RunState) -> None:
    """The run's checkpoint where it stands (every process gathers its generators; the main one writes)."""
    state.gather_rng(task.ctx)
    _write(task, state)


def _write(task: Task, state: RunState) -> None:
    """The main process writes the run's checkpoint as ``state`` stands (no collective: the generators were
    gathered before) and drops the final weights it supersedes; the other processes do nothing."""
    if task.ctx.is_main:
        task.save(state)
        task.drop_superseded()


def _epoch_row(task: Task, state: RunState, model: nn.Module, result: dict, log: Callable[[str], None]) -> dict:
    """The epoch just trained closed (``state.epoch`` counts it) and ``task.epoch_row`` (its evaluation). Where the
    evaluation fails or is stopped (Ctrl-C twice), the epoch's training is saved first, as a signal after its last
    batch saves it: ``--resume`` evaluates it again instead of training it again. In a process group the main
    process saves it (its state is the group's; every process's generators are gathered before the evaluation,
    the one collective a save needs, since the others may have failed) when its evaluation raises: its own
    failure, or a peer's that the backend reports to it (gloo: the connection closed)."""
    counters = state.epoch, state.train_time_s, state.samples_seen, dict(state.best), state.bad_epochs
    rng = rng_state()  # the generators as the epoch's training left them
    state.gather_rng(task.ctx)  # every process's, for that save (no-op in one process)
    state.share_ema(task.ctx)  # the EMA evaluated on every process is the one the checkpoint keeps
    state.epoch += 1
    state.train_time_s += result["seconds"]
    try:
        return task.epoch_row(state, model, result)
    except BaseException as err:
        state.epoch, state.train_time_s, state.samples_seen, state.best, state.bad_epochs = counters
        set_rng_state(rng)  # what the evaluation drew is drawn again when it runs again
        if isinstance(err, NonFiniteEvalError):
            raise  # the weights diverged: nothing to save
        state.epoch_partial = {"batches": task.steps_per_epoch, "sums": result["sums"], "seconds": result["seconds"]}
        _write(task, state)  # no collective here: the other processes may be gone
        where = f"while evaluating epoch {state.epoch + 1}/{task.cfg.epochs}"
        if isinstance(err, KeyboardInterrupt):
            raise Preempted.at(signal.SIGINT, where, task.checkpoint_path, task.cfg.out) from None
        log(f"{where}: the epoch's training is saved in {task.checkpoint_path}; --resume evaluates it again")
        raise
