"""The state of a run, for every task: :class:`RunState`, whose ``state_dict`` is the checkpoint (``last.pt``)
and whose ``load_state_dict`` is ``--resume``, one symmetric pair."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.swa_utils import AveragedModel

from lambdanet.engine.checkpoint import CheckpointError, rng_state, save_checkpoint, set_rng_state, unwrap
from lambdanet.engine.distributed import DistContext, all_gather_objects
from lambdanet.engine.optim import load_optimizer_state

__all__ = ["RunState"]


def _no_best() -> dict:
    return {"score": -math.inf, "epoch": 0}


def _own_rng(state: dict) -> dict:
    """This process's RNG states in a checkpoint: its own entry of ``rng_ranks`` when a process group of this
    size saved it, else the main process's ``rng`` (a run of one process, of another number of processes, or
    of an earlier version, which kept the main process's only)."""
    ranks = state.get("rng_ranks")
    grouped = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
    return ranks[rank] if ranks and len(ranks) == world else state["rng"]


# torch's load_state_dict message for a tensor of another shape: the key, the checkpoint's and the model's shapes
_SIZE_MISMATCH = (
    r"size mismatch for ([\w.]+): copying a param with shape torch\.Size\((\[[^]]*\])\) from checkpoint, "
    r"the shape in current model is torch\.Size\((\[[^]]*\])\)"
)


@dataclass
class RunState:
    """Everything a run carries from one step to the next: the weights, optimiser, schedule, EMA and loss
    scaler (``None`` where a task has none), the counters, the best score so far and, through ``state_dict``,
    the random generators (every process's, after :meth:`gather_rng`). ``load_state_dict`` restores it
    exactly; counters a checkpoint lacks (written by another task, or by an earlier version) keep their
    defaults."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    ema: AveragedModel | None = None
    scaler: torch.amp.GradScaler | None = None
    epoch: int = 0  # epochs completed
    step: int = 0  # optimiser steps taken (tasks that schedule the rate themselves)
    train_time_s: float = 0.0
    samples_seen: int = 0
    best: dict = field(default_factory=_no_best)
    bad_epochs: int = 0  # epochs since the best score (early stopping)
    epoch_partial: dict | None = None  # a preempted epoch: its batches done and running sums
    # (step, every process's RNG states) gathered by gather_rng for a save at that step
    _rng_ranks: tuple[int, list[dict]] | None = field(default=None, init=False, repr=False, compare=False)

    def gather_rng(self, ctx: DistContext) -> None:
        """Every process of a group calls this (a collective) right before the main one saves: the checkpoint
        of this step then keeps each process's RNG states, not the main one's alone, and a resumed group draws
        what it would have drawn (each process's draws can depend on its data, as a sampling of training
        targets from the model's own outputs does, so the processes' generators drift apart). One process:
        nothing to gather."""
        self._rng_ranks = (self.step, all_gather_objects(rng_state(), ctx)) if ctx.enabled else None

    def share_ema(self, ctx: DistContext) -> None:
        """Every process of a group calls this (a collective) before the EMA is evaluated: the main process's EMA
        buffers (BatchNorm statistics) on all. Each process's EMA averages its own model's statistics, which DDP
        hands out from the main process before each forward and each process's batch then moves, so the copies
        drift apart; an evaluation sharded over the processes then measured a mix of models, neither the one the
        checkpoint keeps (the main one's), and a resumed group (every process given that one) measured another.
        The parameters are the same everywhere already. One process, or no EMA: nothing to do."""
        if ctx.enabled and self.ema is not None:
            for buffer in self.ema.module.buffers():
                dist.broadcast(buffer, 0)

    def state_dict(self, **extra) -> dict:
        """The checkpoint: every component's state, the counters, the RNG states, and ``extra`` (the run's
        configuration and whatever else its task keeps there)."""

        def of(component):
            return component.state_dict() if component is not None else None

        return {
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": of(self.scheduler),
            "ema": of(self.ema),
            "scaler": of(self.scaler),
            "epoch": self.epoch,
            "step": self.step,
            "train_time_s": self.train_time_s,
            "samples_seen": self.samples_seen,
            "best": dict(self.best),
            "bad_epochs": self.bad_epochs,
            "epoch_partial": self.epoch_partial,
            "rng": rng_state(),
            **({"rng_ranks": self._rng_ranks[1]} if self._rng_ranks and self._rng_ranks[0] == self.step else {}),
            **extra,
        }

    def save(self, path: str | os.PathLike, cfg=None, **extra) -> None:
        """Write :meth:`state_dict` atomically to ``path`` with the run's configuration ``cfg`` (a dataclass,
        stored as ``config``) and ``extra``."""
        config = {"config": dataclasses.asdict(cfg)} if cfg is not None else {}
        save_checkpoint(self.state_dict(**config, **extra), path)

    def load_state_dict(self, state: dict) -> None:
        try:
            unwrap(self.model).load_state_dict(state["model"])
        except RuntimeError as err:  # torch lists every mismatch over many lines: the first, in one
            found = re.search(_SIZE_MISMATCH, str(err))
            if found is None:
                raise
            key, saved, now = found.groups()
            raise CheckpointError(
                f"the checkpoint's model does not fit the one this run builds now: {key} {saved} in the checkpoint, "
                f"{now} now (have the data's classes or channels changed since it was saved?)"
            ) from None
        load_optimizer_state(self.optimizer, state["optimizer"], unwrap(self.model))  # 0.1's groups regrouped
        for name in ("scheduler", "ema", "scaler"):
            component = getattr(self, name)
            if component is not None and state.get(name):
                component.load_state_dict(state[name])
        # the checkpoints of lambdanet <= 0.1 kept no step count where a per-step schedule counted the steps
        self.epoch = int(state.get("epoch", 0))
        self.step = int(state.get("step", (state.get("scheduler") or {}).get("last_epoch", 0)))
        self.train_time_s = float(state.get("train_time_s", 0.0))
        self.samples_seen = int(state.get("samples_seen", 0))
        self.best, self.bad_epochs = dict(state.get("best") or _no_best()), int(state.get("bad_epochs", 0))
        self.epoch_partial = state.get("epoch_partial")  # absent at epoch ends (and from older runs)
        set_rng_state(_own_rng(state))  # this process's, where the checkpoint has every process's

    def record(self, score: float, **reported: float) -> bool:
        """Count a finished epoch whose selection score (higher is better) is ``score``; a new best keeps the
        metrics the task reports for it (``reported``) in :attr:`best`. Before the first recorded epoch (``best``
        of epoch 0, as earlier versions saved it with a placeholder score of -1) any score is the best. Returns
        whether this epoch is the new best (the task then keeps its weights)."""
        if score > self.best["score"] or not self.best["epoch"]:
            self.best, self.bad_epochs = {"score": score, **reported, "epoch": self.epoch}, 0
            return True
        self.bad_epochs += 1
        return False
