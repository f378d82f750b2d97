"""Optimisers, the warm-up + cosine schedule and the exponential moving average of weights."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

__all__ = [
    "OPTIMIZERS",
    "no_weight_decay_names",
    "param_groups",
    "load_optimizer_state",
    "build_optimizer",
    "build_scheduler",
    "build_ema",
    "set_bn_momentum",
    "lr_at",
]

OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop")  # build_optimizer's names


def no_weight_decay_names(model: nn.Module) -> set[str]:
    """The parameter names (``fnmatch`` patterns, as timm reads them) that ``model`` and its submodules exclude
    from weight decay through timm's ``no_weight_decay()`` method (position embeddings and relative-position
    tables of lambdanet's backbones), prefixed with where the submodule sits."""
    names: set[str] = set()
    for prefix, module in model.named_modules():
        method = getattr(module, "no_weight_decay", None)
        if callable(method):
            names |= {f"{prefix}.{n}" if prefix else n for n in method()}
    return names


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups, with weight decay and without: none on normalisation parameters and biases (1-d tensors) and
    on the parameters the model names in ``no_weight_decay()`` (:func:`no_weight_decay_names`), as timm's
    ``param_groups_weight_decay``."""
    excluded = no_weight_decay_names(model)
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            skip = p.ndim <= 1 or any(fnmatch.fnmatchcase(name, pattern) for pattern in excluded)
            (no_decay if skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict, model: nn.Module) -> None:
    """``optimizer.load_state_dict(saved)``, also for a checkpoint of lambdanet <= 0.1, whose two groups split
    the parameters by dimension alone (:func:`param_groups` now also keeps position embeddings from decay): its
    per-parameter state is then moved to where each parameter is now. Another mismatch is a one-line
    ``ValueError``."""
    sizes = [len(g["params"]) for g in saved["param_groups"]]
    if sizes == [len(g["params"]) for g in optimizer.param_groups]:
        optimizer.load_state_dict(saved)
        return
    params = [p for p in model.parameters() if p.requires_grad]
    old_order = [p for p in params if p.ndim > 1] + [p for p in params if p.ndim <= 1]
    if sizes != [len(old_order) - sum(p.ndim <= 1 for p in params), sum(p.ndim <= 1 for p in params)]:
        raise ValueError(
            f"the checkpoint's optimiser has parameter groups of {sizes} parameters, this model's has "
            f"{[len(g['params']) for g in optimizer.param_groups]}: it was saved for another model or version"
        )
    old_index = {id(p): i for i, p in enumerate(old_order)}
    new_params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {
        k: saved["state"][old_index[id(p)]] for k, p in enumerate(new_params) if old_index[id(p)] in saved["state"]
    }
    groups, start = [], 0
    for old, group in zip(saved["param_groups"], optimizer.param_groups):
        n = len(group["params"])
        groups.append({**old, "weight_decay": group["weight_decay"], "params": list(range(start, start + n))})
        start += n
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def build_optimizer(
    model: nn.Module,
    cfg=None,
    *,
    name: str | None = None,
    lr: float | None = None,
    weight_decay: float | None = None,
    momentum: float | None = None,
    nesterov: bool | None = None,
    betas: tuple[float, float] | None = None,
) -> torch.optim.Optimizer:
    """The optimiser of every task, over :func:`param_groups`: SGD (momentum), Adam (L2 weight decay, as the
    reproduction report), AdamW or RMSProp. Its settings come from a run configuration ``cfg`` (its
    ``optimizer``, ``effective_lr()``, ``weight_decay``, ``momentum``, ``nesterov``, ``betas``) or from the
    keywords, which override it (without either: momentum 0.9, no Nesterov, betas (0.9, 0.999))."""
    if cfg is not None:
        name = name or cfg.optimizer
        lr = lr if lr is not None else cfg.effective_lr()
        weight_decay = weight_decay if weight_decay is not None else cfg.weight_decay
    momentum = momentum if momentum is not None else cfg.momentum if cfg is not None else 0.9
    nesterov = nesterov if nesterov is not None else bool(cfg is not None and cfg.nesterov)
    betas = betas if betas is not None else (cfg.betas[0], cfg.betas[1]) if cfg is not None else (0.9, 0.999)
    # lr and weight_decay come from cfg or the keywords: float from here on
    groups = param_groups(model, cast(float, weight_decay))
    if name == "sgd":
        return torch.optim.SGD(groups, lr=cast(float, lr), momentum=momentum, nesterov=nesterov)
    if name in ("adam", "adamw"):
        return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(groups, lr=cast(float, lr), betas=betas)
    if name == "rmsprop":
        return torch.optim.RMSprop(groups, lr=cast(float, lr), momentum=momentum, alpha=0.9, eps=1e-3)
    raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {name!r}")


def lr_at(
    step: int,
    total_steps: int,
    warmup_steps: int,
    *,
    start_factor: float = 0.0,
    min_factor: float = 0.0,
    schedule: str = "cosine",
    decay_rate: float = 1.0,
    decay_steps: int = 1,
    milestones: Sequence[float] = (),
    linear_lr: bool = False,
) -> float:
    """Multiplier of the base learning rate at optimiser step ``step`` (0-based): the one schedule function of
    every task. Linear warm-up from ``start_factor`` to 1 over ``warmup_steps`` (reaching 1 at the last warm-up
    step; with ``linear_lr``, torch's ``LinearLR`` phase: ``start_factor`` at step 0, 1 at step ``warmup_steps``),
    then ``"cosine"`` decay to ``min_factor`` over the remaining steps, ``"constant"``, ``"step"``: times
    ``decay_rate`` every ``decay_steps`` steps (MobileNet's "x0.97 every 2.4 epochs" style), never below
    ``min_factor``, or ``"multistep"``: times ``decay_rate`` at each fraction ``milestones`` of ``total_steps``
    (Mask R-CNN's x0.1 steps)."""
    if warmup_steps > 0 and step < warmup_steps:
        return start_factor + (1.0 - start_factor) * (step + (0 if linear_lr else 1)) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "step":
        return max(min_factor, decay_rate ** ((step - warmup_steps) // max(1, decay_steps)))
    if schedule == "multistep":
        return decay_rate ** sum(step >= f * total_steps for f in milestones)
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg, steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-step schedule: ``cfg.warmup_epochs`` of linear warm-up, then ``cfg.schedule`` (cosine to
    ``cfg.min_lr``, constant, or step decay by ``cfg.lr_decay_rate`` every ``cfg.lr_decay_epochs``)."""
    total = cfg.epochs * steps_per_epoch
    warmup = int(round(cfg.warmup_epochs * steps_per_epoch))
    min_factor = cfg.min_lr / cfg.effective_lr()
    decay_steps = max(1, int(round(cfg.lr_decay_epochs * steps_per_epoch)))

    def factor(step: int) -> float:
        return lr_at(
            step,
            total,
            warmup,
            start_factor=cfg.warmup_start_factor,
            min_factor=min_factor,
            schedule=cfg.schedule,
            decay_rate=cfg.lr_decay_rate,
            decay_steps=decay_steps,
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_ema(model: nn.Module, decay: float) -> AveragedModel:
    """EMA of the weights and buffers (``torch.optim.swa_utils``): ``ema = decay * ema + (1 - decay) * w``."""
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)


def set_bn_momentum(model: nn.Module, momentum: float) -> None:
    """BatchNorm running-statistics momentum (PyTorch convention: TF decay 0.9999 = momentum 1e-4)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.momentum = momentum
