"""Backbone pre-training on glyph crops: a warm start for detection on a CPU budget.

LambdaNetworks Table 6 trains its detectors from scratch for 130k steps of batch 256 at 1024 px (App. E.2);
``lambdanet detect``'s quick recipe has minutes of a 2-core CPU, in which a detector whose backbone starts
from random weights barely begins to tell glyphs apart. So on the glyph scenes it first trains the backbone
as a classifier of single glyphs: :class:`GlyphCrops` renders one glyph of the train pool per image (the
scene renderer with one small or medium object on the same textured backgrounds), and
:func:`pretrain_backbone` trains ``create_model(backbone, num_classes=...)`` on them (AdamW, cosine
schedule; the accuracy on crops of the test glyphs is logged) and returns its body's state dict, which the
detector's ``features_only`` backbone loads (the parameter names agree; the classifier is left out).
:func:`transfer_mismatch` tells beforehand whether a backbone's weights carry over (layers sized by the
input, like global relative tables, do not); :func:`load_backbone_weights` loads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset

from lambdanet.tasks.detection.glyphs import (
    DEFAULT_GLYPHS,
    GlyphPool,
    GlyphSceneConfig,
    glyph_categories,
    render_scene,
    resolve_glyph_sources,
)
from lambdanet.helpers import check_choice, check_positive_int
from lambdanet.runtime import AMP_DTYPES
from lambdanet.models.pretrained import load_state
from lambdanet.engine.checkpoint import CheckpointError, load_checkpoint
from lambdanet.engine.distributed import DistContext, barrier, data_parallel
from lambdanet.engine.loop import progress_bar, train_epoch
from lambdanet.engine.optim import build_optimizer, lr_at
from lambdanet.engine.preempt import Preempted
from lambdanet.engine.state import RunState
from lambdanet.tasks.classification.metrics import evaluate

__all__ = [
    "PretrainConfig",
    "GlyphCrops",
    "pretrain_backbone",
    "transfer_mismatch",
    "load_backbone_weights",
    "batch_share",
]


@dataclass(frozen=True)
class PretrainConfig:
    """Glyph-crop pre-training (:func:`pretrain_backbone`).

    Attributes:
        steps: optimizer steps.
        batch_size: crops per step.
        img_size: side of the crops.
        lr: AdamW's peak learning rate (linear warm-up over ``warmup_steps``, then cosine decay to 0).
        weight_decay: AdamW's weight decay (not on norms and biases).
        warmup_steps: warm-up steps.
        eval_images: test-glyph crops the accuracy is measured on.
        channels_last: train in the channels-last memory format (as the detector's
            ``DetectorOptions.channels_last``).
        workers: processes rendering the crops ahead of the training (0: rendered in the training loop;
            on a 2-core CPU a worker only contends with the training, on a GPU it hides the rendering).
        amp: autocast of the training steps, ``"none"``, ``"bf16"`` or ``"fp16"`` (CUDA; with a loss scaler), as
            the detector's ``--amp``.
    """

    steps: int = 1200
    batch_size: int = 64
    img_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.05
    warmup_steps: int = 50
    eval_images: int = 512
    channels_last: bool = False
    workers: int = 0
    amp: str = "none"

    def __post_init__(self):
        for name, low in (("steps", 1), ("batch_size", 1), ("img_size", 1), ("eval_images", 1), ("workers", 0)):
            value, kind = getattr(self, name), "positive" if low else "non-negative"
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"PretrainConfig.{name} must be a {kind} int, got {value!r}")
        if not isinstance(self.channels_last, bool):
            raise ValueError(f"PretrainConfig.channels_last must be true or false, got {self.channels_last!r}")
        check_choice(self.amp, "PretrainConfig.amp", list(AMP_DTYPES))
        if self.img_size < 32:
            raise ValueError(f"PretrainConfig.img_size must be at least 32, got {self.img_size}")
        if self.lr <= 0 or self.weight_decay < 0 or self.warmup_steps < 0:
            raise ValueError(
                f"PretrainConfig needs lr > 0, weight_decay >= 0 and warmup_steps >= 0, got "
                f"{self.lr}, {self.weight_decay}, {self.warmup_steps}"
            )


def crop_scene_config(img_size: int, glyphs: str = DEFAULT_GLYPHS) -> GlyphSceneConfig:
    """One object per image, small or medium: mask areas from 1.5% to 45% of the crop."""
    area = img_size * img_size
    return GlyphSceneConfig(
        image_size=img_size,
        glyphs=glyphs,
        max_objects=1,
        large_prob=0.0,
        small_prob=0.5,
        small_area=(0.015 * area, 0.08 * area),
        medium_area=(0.08 * area, 0.45 * area),
    )


class GlyphCrops(Dataset):
    """``length`` single-glyph images of one split's glyph pool: ``(image [3, S, S] in [0, 1], label)``
    (0-based category, :func:`lambdanet.tasks.detection.data.glyph_categories`); image ``i`` is rendered from a
    generator seeded by ``(seed, i)``, so a crop is the same on every call and machine."""

    def __init__(self, split: str, length: int, *, img_size: int = 64, seed: int = 0, glyphs: str = DEFAULT_GLYPHS):
        sources = resolve_glyph_sources(glyphs)
        self.pool = GlyphPool(sources, split)
        self.categories = glyph_categories(sources)
        self.config = crop_scene_config(img_size, glyphs)
        self.length, self.seed = length, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        if not 0 <= i < self.length:
            raise IndexError(f"index {i} out of range for {self.length} crops")
        rng = np.random.default_rng([self.seed, i])
        while True:  # a glyph too thin for its drawn area can be skipped by the renderer: draw again
            image, _, labels = render_scene(self.pool, self.config, rng)  # 3 s s uint8
            if labels:
                return torch.from_numpy(image).float() / 255, labels[0]  # 3 s s in [0, 1]


def batch_share(batch_size: int, rank: int, world: int) -> tuple[int, int]:
    """(first, count): process ``rank`` of ``world`` takes items ``first .. first + count - 1`` of every batch;
    the shares partition the batch in order and differ by at most one item."""
    base, extra = divmod(batch_size, world)
    return rank * base + min(rank, extra), base + (rank < extra)


def _accuracy(
    model: nn.Module, data: GlyphCrops, batch_size: int, mean: Tensor, std: Tensor, rank: int = 0, world: int = 1
) -> float:
    """Top-1 on ``data`` (the classifier's :func:`lambdanet.tasks.classification.metrics.evaluate` on the
    normalised crops); in a process group each process classifies every ``world``-th crop and the counts are
    summed."""
    mine = range(rank, len(data), world)  # batched by hand: a DataLoader's iterator would draw a seed from the RNG
    crops = (zip(*(data[i] for i in mine[start : start + batch_size])) for start in range(0, len(mine), batch_size))
    normalised = (((torch.stack(x).to(mean.device) - mean) / std, torch.tensor(y)) for x, y in crops)  # b c s s
    return evaluate(model, normalised, device=mean.device, ctx=DistContext(rank, world, device=mean.device))["top1"]


def _classifier_name_kwargs(backbone: str, model_kwargs: dict, img_size: int) -> tuple[str, dict]:
    from lambdanet.tasks.detection.model import resolve_backbone
    from lambdanet.models import model_args

    name, kwargs = resolve_backbone(backbone, model_kwargs)
    if "img_size" in model_args(name):
        kwargs["img_size"] = img_size
    return name, kwargs


def transfer_mismatch(backbone: str, backbone_kwargs: dict, *, img_size: int, max_size: int) -> str | None:
    """``None`` when the weights of the classifier :func:`pretrain_backbone` trains on ``img_size`` crops fit
    the detector's backbone built for inputs up to ``max_size``, else the first tensor that does not fit
    (both built on the meta device: no memory, a fraction of a second)."""
    from lambdanet.tasks.detection.model import create_feature_backbone
    from lambdanet.models import create_model

    name, kwargs = _classifier_name_kwargs(backbone, dict(backbone_kwargs), img_size)
    with torch.device("meta"):
        classifier = create_model(name, num_classes=10, **kwargs).state_dict()
        body = create_feature_backbone(backbone, max_size=max_size, **backbone_kwargs)[0].state_dict()
    misfit = _misfit(body, classifier)
    return None if misfit is None else f"{misfit} in the {img_size} px classifier"


def _misfit(target: dict[str, Tensor], weights: dict[str, Tensor]) -> str | None:
    """The first tensor of ``target`` that ``weights`` lacks or holds with another shape, as ``"key (shape)
    is (shape) / absent"``; ``None`` when all fit."""
    for key, value in target.items():
        if key not in weights or weights[key].shape != value.shape:
            return f"{key} {tuple(value.shape)} is {tuple(weights[key].shape) if key in weights else 'absent'}"
    return None


def load_backbone_weights(body: nn.Module, weights: dict[str, Tensor]) -> None:
    """Load :func:`pretrain_backbone`'s weights into a detector's ``features_only`` backbone (every tensor of
    ``body`` must be among them with its shape)."""
    state = body.state_dict()
    if (misfit := _misfit(state, weights)) is not None:
        raise ValueError(f"pre-trained weights do not fit the backbone: {misfit} in them")
    load_state(body, {k: weights[k] for k in state}, source="the glyph pre-training's weights")


def _process_group(device: torch.device) -> DistContext:
    """This process's place in the running process group (rank 0 of 1 without one)."""
    grouped = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
    return DistContext(rank, world, device=device)


def _identity(backbone: str, model_kwargs: dict, seed: int, glyphs: str, cfg: PretrainConfig) -> dict:
    """What must agree for a saved pre-training to continue: workers and progress only change how it runs; ``amp``
    ``"none"`` is left out, as the versions before the option wrote it, so that their ``pretrain.pt`` continues."""
    config = {k: v for k, v in asdict(cfg).items() if k != "workers" and (k, v) != ("amp", "none")}
    return {"backbone": backbone, "model_kwargs": dict(model_kwargs), "seed": seed, "glyphs": glyphs, "config": config}


def pretrain_backbone(
    backbone: str,
    cfg: PretrainConfig = PretrainConfig(),
    *,
    seed: int = 0,
    glyphs: str = DEFAULT_GLYPHS,
    device: str | torch.device = "cpu",
    progress: bool = True,
    log: Callable[[str], None] = print,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 100,
    stop=None,
    **model_kwargs,
) -> tuple[dict[str, Tensor], dict]:
    """Train ``create_model(backbone, num_classes=<glyph categories>, **model_kwargs)`` on :class:`GlyphCrops`
    of the train glyphs for ``cfg.steps`` steps; returns (its state dict without the classifier, ``{"
    pretrain_accuracy": top-1 on test-glyph crops, "pretrain_time_s": seconds}``). ``backbone`` may be a
    :data:`lambdanet.tasks.detection.model.BACKBONE_PRESETS` name; ``model_kwargs`` override its options.

    With ``checkpoint``, the main process saves the training there every ``checkpoint_every`` steps, and a
    call that finds it continues from it (to the same weights as a run that never stopped; the file must
    come from the same backbone, options and seed); the caller deletes it once the weights are kept.
    ``stop`` (a :class:`lambdanet.engine.preempt.StopSignals`) is asked after every step: once a signal has
    arrived, the training is saved to ``checkpoint`` and :class:`~lambdanet.engine.preempt.Preempted` raised."""
    name, kwargs = _classifier_name_kwargs(backbone, model_kwargs, cfg.img_size)
    device = torch.device(device)
    ctx = _process_group(device)
    rank, world = ctx.rank, ctx.world
    if cfg.batch_size < world:
        raise ValueError(f"PretrainConfig.batch_size {cfg.batch_size} must be at least the {world} processes")
    check_positive_int(checkpoint_every, "checkpoint_every")
    first, share = batch_share(cfg.batch_size, rank, world)
    train = GlyphCrops("train", cfg.steps * cfg.batch_size, img_size=cfg.img_size, seed=seed, glyphs=glyphs)
    test = GlyphCrops("test", cfg.eval_images, img_size=cfg.img_size, seed=seed, glyphs=glyphs)
    model, layout, mean, std = _classifier(name, kwargs, len(train.categories), cfg, device, seed)
    optimizer = build_optimizer(model, name="adamw", lr=cfg.lr, weight_decay=cfg.weight_decay)
    state = RunState(model, optimizer, scaler=torch.amp.GradScaler("cuda") if cfg.amp == "fp16" else None)
    done = _continued(checkpoint, identity := _identity(backbone, model_kwargs, seed, glyphs, cfg), state, device)
    log(
        f"pre-training {backbone} on {cfg.steps} x {cfg.batch_size} glyph crops ({cfg.img_size} px, "
        f"{len(train.categories)} classes)"
    )
    if done:
        log(f"continuing the pre-training from {checkpoint}: {done}/{cfg.steps} steps done")

    def step_loss(run: nn.Module, batch) -> tuple[Tensor, dict]:
        images, labels = batch  # b 3 s s, b
        images = ((images.to(device) - mean) / std).contiguous(memory_format=layout)  # b 3 s s, as the detector's
        # DDP averages over processes: weigh each share's mean by its size, for the mean over the batch
        return nn.functional.cross_entropy(run(images), labels.to(device)) * (share * world / cfg.batch_size), {}

    def save(state: RunState) -> None:
        state.save(cast("str | Path", checkpoint), identity=identity)  # passed on only with a checkpoint

    bar = progress_bar(progress, cfg.steps, done, "pre-training the backbone on glyph crops")
    result = train_epoch(
        state,
        data_parallel(model, ctx),
        _crop_loader(train, cfg, done, first, share, seed),
        step_loss,
        ctx=ctx,
        total=cfg.steps,
        amp=cfg.amp,
        lr=lambda step: cfg.lr * lr_at(step, cfg.steps, cfg.warmup_steps),
        stop=stop,
        bar=bar,  # warm-up, then cosine to 0
        save=save if checkpoint is not None else None,
        save_every=checkpoint_every,
    )
    if bar is not None:
        bar.close()
    if result is None:
        if checkpoint is not None and rank == 0:
            save(state)
        barrier(ctx)  # the others wait for the main process's save (the first to end stops the rest)
        raise Preempted.at(stop.received, f"in the pre-training after step {state.step}/{cfg.steps}", checkpoint)
    _share_buffers(model, world)
    seconds = result["seconds"]
    accuracy = _accuracy(model, test, cfg.batch_size, mean, std, rank, world)
    log(f"pre-trained in {seconds:.0f}s: top-1 {accuracy:.1%} on {len(test)} crops of test glyphs")
    head = {k for k in model.state_dict() if k.split(".")[0] in ("fc", "head", "classifier")}
    weights = {k: v.cpu().contiguous() for k, v in model.state_dict().items() if k not in head}
    return weights, {"pretrain_accuracy": accuracy, "pretrain_time_s": seconds}


def _classifier(
    name: str, kwargs: dict, num_classes: int, cfg: PretrainConfig, device: torch.device, seed: int
) -> tuple[nn.Module, torch.memory_format, Tensor, Tensor]:
    """The classifier to pre-train (initialised from ``seed``) in the detector's memory layout, the layout, and
    the mean and std ``[1, 3, 1, 1]`` its inputs are normalised with (the detector's)."""
    from lambdanet.tasks.detection.model import input_normalization
    from lambdanet.models import create_model

    torch.manual_seed(seed)
    model = create_model(name, num_classes=num_classes, **kwargs).to(device)
    layout = torch.channels_last if cfg.channels_last else torch.contiguous_format
    model.to(memory_format=layout)
    mean, std = (torch.tensor(v, device=device).view(1, 3, 1, 1) for v in input_normalization(model))  # 1 3 1 1
    return model, layout, mean, std


def _share_buffers(model: nn.Module, world: int) -> None:
    """BatchNorm statistics: the main process's everywhere (as DDP hands them out every step)."""
    if world > 1:
        for buffer in model.buffers():
            dist.broadcast(buffer, 0)


def upgrade_detection_checkpoint(saved: dict) -> dict:
    """A detection or pre-training checkpoint of lambdanet <= 0.1 in the engine's format: a preempted epoch's
    sums without the count of batches ``n``, and the pre-training's seconds as ``time_s``."""
    partial, out = saved.get("epoch_partial"), dict(saved)
    if partial:
        out["epoch_partial"] = {**partial, "sums": {"n": partial["batches"], **partial.get("sums", {})}}
    if "time_s" in saved and "train_time_s" not in saved:
        out["train_time_s"] = saved["time_s"]
    return out


def _continued(checkpoint: str | Path | None, identity: dict, state: RunState, device: torch.device) -> int:
    """The steps done of the pre-training saved in ``checkpoint``, restored into ``state`` (with the RNG states
    and where the pass stands); 0 without one. Another pre-training's file is a one-line error."""
    if checkpoint is None or not Path(checkpoint).is_file():
        return 0
    saved = load_checkpoint(checkpoint, map_location=device)
    if saved.get("identity") != identity:
        raise CheckpointError(
            f"{checkpoint} holds another pre-training ({saved.get('identity')}), not "
            f"{identity}; delete it to start over"
        )
    state.load_state_dict(upgrade_detection_checkpoint(saved))
    if state.epoch_partial is None:  # lambdanet <= 0.1 kept the steps and the seconds only
        state.epoch_partial = {"batches": state.step, "seconds": state.train_time_s, "sums": {}}
    return state.step


def _crop_loader(train: GlyphCrops, cfg: PretrainConfig, done: int, first: int, share: int, seed: int) -> DataLoader:
    """This process's share of every batch from step ``done`` on: crops in order (crop i is the same wherever
    it is rendered), by workers ahead of the training if any, with a generator of its own (starting the
    loader leaves the global RNG alone: the same after a continued run)."""
    mine = Subset(train, [step * cfg.batch_size + first + j for step in range(done, cfg.steps) for j in range(share)])
    return DataLoader(
        mine,
        batch_size=share,
        num_workers=cfg.workers,
        prefetch_factor=4 if cfg.workers else None,
        generator=torch.Generator().manual_seed(seed),
    )
