"""``lambdanet detect``: train and evaluate Mask R-CNN / Faster R-CNN over a lambdanet backbone with
``lambdanet train``'s machinery (recipes, YAML, a flag per option, AMP, atomic checkpoints, ``--resume``,
torchrun with synchronised BatchNorm, progress bars, CSV / TensorBoard metrics, plots) and a ``summary.json``
with COCO box and mask AP (pycocotools) as fractions: :class:`DetectionTask` on the engine and
:func:`train_detector`, its entry. The options and recipes are :mod:`lambdanet.tasks.detection.config`'s.

Without torchrun, a CPU run trains on several local processes (:func:`local_processes`, ``--procs``): a
detector's small operations keep cores busier as data-parallel processes than as intra-op threads.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from lambdanet.tasks.classification.data import epoch_seed
from lambdanet.engine.checkpoint import export_safetensors, unwrap
from lambdanet.engine.distributed import (
    DistContext,
    all_threads_on_main,
    check_cuda,
    convert_sync_batchnorm,
    in_process_group,
    launch_local,
    threads_per_process,
    usable_cores,
    uses_cuda,
)
from lambdanet.engine.logger import read_history, read_json, write_json
from lambdanet.engine.loop import TrainingDivergedError
from lambdanet.engine.optim import build_optimizer
from lambdanet.engine.preempt import Preempted, StopSignals
from lambdanet.engine.state import RunState
from lambdanet.engine.task import Task, preflight, resolved, run

# the names lambdanet.detection.trainer had are importable from here (the noqa ones are not used here)
from lambdanet.tasks.detection.config import (
    DETECT_CHOICES,
    DETECT_RECIPES,
    DETECT_RESUME_FREE,
    DETECTOR_LOSSES,  # noqa: F401
    PRETRAIN_CHECKPOINT,
    PRETRAIN_CHECKPOINT_EVERY,
    QUICK_DETECTOR,  # noqa: F401
    QUICK_PRETRAIN_STEPS,  # noqa: F401
    RUN_CHECKPOINTS,  # noqa: F401
    DetectConfig,
    lr_factor,
    max_image_size,
    pretrain_mismatch,  # noqa: F401
    quick_backbone_kwargs,
    recipe_values,  # noqa: F401
    resolve_detect_config,
    set_eval_size,
    train_sizes,
)
from lambdanet.tasks.detection.data import GlyphSceneConfig, build_detection_datasets, detection_loader
from lambdanet.tasks.detection.draw import draw_predictions, plot_detection_history
from lambdanet.tasks.detection.glyphs import resolve_glyph_sources

# the rest of what lambdanet.detection.trainer had (its old path is this module), for one release
from lambdanet.engine.logger import plot_history  # noqa: E402, F401
from lambdanet.engine.optim import lr_at  # noqa: E402, F401
from lambdanet.engine.rundir import check_new_run  # noqa: E402, F401
from lambdanet.tasks.detection.glyphs import DEFAULT_GLYPHS, GLYPH_SETS  # noqa: E402, F401
from lambdanet.tasks.detection.pretrain import (
    PretrainConfig,
    load_backbone_weights,
    pretrain_backbone,
    upgrade_detection_checkpoint,
)

if TYPE_CHECKING:
    from lambdanet.tasks.detection.model import FeaturePyramidBackbone

__all__ = [
    "DetectConfig",
    "DETECT_RECIPES",
    "DETECT_CHOICES",
    "DETECT_RESUME_FREE",
    "resolve_detect_config",
    "train_detector",
    "DetectionTask",
    "local_processes",
    "quick_backbone_kwargs",
    "lr_factor",
    "build_detector",
    "glyph_note",
    "plot_detection_history",
    "draw_predictions",
]


def build_detector(cfg: DetectConfig, num_classes: int) -> nn.Module:
    """The detector of ``cfg`` for ``num_classes`` object categories, built at ``img_size``
    (:func:`~lambdanet.tasks.detection.config.set_eval_size` switches it to the jittered sizes for training)."""
    from lambdanet.tasks.detection.model import create_detector, detector_options

    options = detector_options(cfg.detector)
    return create_detector(
        cfg.backbone,
        num_classes,
        masks=cfg.masks,
        min_size=cfg.img_size,
        max_size=max_image_size(cfg),
        pretrained_backbone=cfg.pretrained_backbone,
        options=options,
        **cfg.backbone_kwargs,
    )


def _evaluate(model: nn.Module, test, cfg: DetectConfig, ctx: DistContext) -> dict:
    """COCO AP of ``model`` on ``test`` (its first ``max_eval_images``) at ``img_size``."""
    from lambdanet.tasks.detection.evaluate import evaluate_detector

    plain = unwrap(model)
    plain.eval()
    set_eval_size(plain, cfg)
    data: Any = test  # Any: a Subset of it gets its categories
    if cfg.max_eval_images is not None:  # the first images, with the categories (for the COCO ground truth)
        data = torch.utils.data.Subset(test, range(min(cfg.max_eval_images, len(test))))
        data.categories = test.categories
    with torch.no_grad():
        return evaluate_detector(
            plain, data, batch_size=cfg.eval_batch_size, device=ctx.device, progress=cfg.progress and ctx.is_main
        )


def glyph_note(glyphs: str) -> str:
    """The line a glyphs run prints about its glyph sets: with ``auto``, which ones this machine gave it, and
    when Fashion-MNIST's Debian package is missing, that the documented figures were measured with it (the
    handwritten strokes of mnist5k make a harder mask task: the quick recipe's mask AP is 0.19 there, 0.27
    with Fashion-MNIST; docs/detection.md)."""
    sources = resolve_glyph_sources(glyphs)
    line = f"glyphs: {'+'.join(sources)}" + (" (auto)" if glyphs == "auto" else "")
    if glyphs == "auto" and "fashion-mnist" not in sources:
        line += (
            "; Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist): docs/detection.md's "
            "figures use digits+fashion-mnist, on which masks score higher"
        )
    return line


def local_processes(cfg: DetectConfig) -> int:
    """How many local processes :func:`train_detector` trains ``cfg`` with: 1 inside a process group (torchrun
    started this one), ``cfg.procs`` when set, else on a GPU 1 and on a CPU one per 4 images of the batch (the
    BatchNorm statistics of each process need a few images) up to the usable cores, and dividing the batch."""
    if in_process_group():
        return 1
    if cfg.procs:
        return cfg.procs
    if uses_cuda(cfg.device):
        return 1
    procs = max(1, min(usable_cores(), cfg.batch_size // 4))
    while cfg.batch_size % procs:
        procs -= 1
    return procs


def train_detector(cfg: DetectConfig, log: Callable[[str], None] = print) -> dict:
    """Train and evaluate on the engine (:class:`DetectionTask`), without torchrun on :func:`local_processes`
    processes (the main one's output printed); returns the summary written to ``<out>/summary.json``."""
    cfg = resolved(cfg)  # a configuration built directly: its processes and batch checked as it runs
    procs = local_processes(cfg)
    if procs == 1:
        return run(DetectionTask, cfg, log)
    preflight(DetectionTask, cfg)  # once here, in the launching process: a user error is one line, not one per process
    if cfg.batch_size % procs:
        raise ValueError(
            f"batch_size {cfg.batch_size} must be a multiple of procs {procs} (one share per "
            f"process); set --procs or --batch-size"
        )
    check_cuda(cfg.device)  # (before counting GPUs: their number is no question without one)
    if uses_cuda(cfg.device) and procs > torch.cuda.device_count():
        raise ValueError(f"procs {procs} needs one GPU per process, {torch.cuda.device_count()} visible")
    log(f"detect: {procs} local processes, {threads_per_process(procs)} threads each")
    launch_local(_process_main, (cfg,), procs, relay=(TrainingDivergedError, Preempted), stopped=Preempted)
    summary = read_json(Path(cfg.out) / "summary.json")  # an AP not measured (no object of a size class) is null
    return {k: float("nan") if v is None and "_AP" in k else v for k, v in summary.items()}  # NaN, as in one process


def _process_main(cfg: DetectConfig) -> None:
    """One process of :func:`launch_local`'s group. A signal the launcher forwards while this process sets up
    or finishes does not kill it: caught here, it stops the training at its first step (or, after the last,
    changes nothing)."""
    with StopSignals():
        train_detector(cfg)


def _pretrain(
    model: nn.Module, cfg: DetectConfig, ctx: DistContext, log: Callable[[str], None], stop: StopSignals | None = None
) -> dict:
    """Pre-train the detector's backbone on glyph crops (:mod:`lambdanet.tasks.detection.pretrain`) and load it."""
    settings = PretrainConfig(  # the detector's layout and precision
        steps=cfg.pretrain_steps,
        workers=cfg.workers,
        channels_last=bool(cfg.detector.get("channels_last")),
        amp=cfg.amp,
    )
    weights, info = pretrain_backbone(
        cfg.backbone,
        settings,
        seed=cfg.seed,
        glyphs=cfg.glyphs,
        device=ctx.device,
        progress=cfg.progress and ctx.is_main,
        log=log,
        checkpoint=Path(cfg.out) / PRETRAIN_CHECKPOINT,
        checkpoint_every=PRETRAIN_CHECKPOINT_EVERY,
        stop=stop,
        **cfg.backbone_kwargs,
    )
    load_backbone_weights(cast("FeaturePyramidBackbone", model.backbone).body, weights)
    return info


class DetectionTask(Task):
    """Mask R-CNN / Faster R-CNN on a detection dataset (:class:`DetectConfig`): the detector's summed losses
    (``loss_weights``), App. E.3's warm-up and step schedule, COCO AP when :meth:`DetectConfig.evaluates_after`,
    a checkpoint every epoch; before the first epoch, the backbone's glyph-crop pre-training."""

    cfg: DetectConfig
    diverged_hint = "Lower --lr or raise --warmup-steps."
    command = "detect"
    extras = (("matplotlib", "train"), ("pycocotools", "detect"))

    def upgrade_checkpoint(self, saved: dict) -> dict:
        """An earlier version's checkpoint in today's form; one that names its categories (since 0.2.0) must
        find the same ones, in the same order, in the data (renumbered category ids would relabel the run)."""
        mine = self._categories()
        if isinstance(saved.get("categories"), list) and saved["categories"] != mine:
            raise ValueError(
                f"{self.checkpoint_path} was trained on the categories {saved['categories']} (label k is the k-th), "
                f"{self.cfg.data} now has {mine}: resume on the same data, or start a new run"
            )
        return upgrade_detection_checkpoint(saved)

    def save(self, state: RunState) -> None:
        """``last.pt`` with the configuration and the categories of the labels (``[[id, name], ...]``)."""
        state.save(self.checkpoint_path, self.cfg, categories=self._categories())

    def _categories(self) -> list:
        ids = getattr(self.train_set, "category_ids", None) or range(1, self.train_set.num_classes + 1)
        return [[int(i), str(name)] for i, name in zip(ids, self.train_set.categories)]

    def build_state(self) -> RunState:
        cfg, ctx, out = self.cfg, self.ctx, self.out
        self.train_set, self.test = build_detection_datasets(
            cfg.data,
            seed=cfg.seed,
            progress=cfg.progress and ctx.is_main,
            config=GlyphSceneConfig(glyphs=cfg.glyphs),
            masks=cfg.masks,
        )
        model = build_detector(cfg, self.train_set.num_classes)
        if cfg.sync_bn and ctx.enabled:
            model = convert_sync_batchnorm(model, ctx.device)
        model = model.to(ctx.device)
        if not cfg.resume and ctx.is_main and (out / "pretrain.json").exists():
            (out / "pretrain.json").unlink()  # left by an earlier attempt that ended before its first checkpoint
        self.loader = detection_loader(
            self.train_set, ctx, cfg.batch_size // ctx.world, seed=cfg.seed, workers=cfg.workers, train=True
        )
        if len(self.loader) == 0:  # the last incomplete batch is dropped: no step would run
            n, world = len(self.train_set), ctx.world
            share = f" ({cfg.batch_size // world} for each of {world} processes, which draw {-(-n // world)})"
            raise ValueError(
                f"batch_size={cfg.batch_size}{share if world > 1 else ''} is larger than the {n} training images of "
                f"{cfg.data}; lower --batch-size"
            )
        self.steps_per_epoch = per_epoch = (
            len(self.loader) if cfg.max_train_batches is None else min(len(self.loader), cfg.max_train_batches)
        )
        self.lr = lambda step: (
            cfg.effective_lr() * lr_factor(step, cfg.epochs * per_epoch, cfg.warmup_steps, cfg.lr_steps)
        )
        self.metrics: dict = {}
        scaler = torch.amp.GradScaler("cuda") if cfg.amp == "fp16" else None
        return RunState(model, build_optimizer(model, cfg), scaler=scaler)

    def initialize(self, state: RunState, resumed: bool) -> None:
        """The glyph-crop pre-training (every process, each on its share of the crops), saved as an epoch-0
        checkpoint: a crash in epoch 1 does not cost it. Its own checkpoint goes once ``last.pt`` holds it
        (also after a crash between the two files)."""
        cfg, out = self.cfg, self.out
        if cfg.pretrain_steps and not resumed:
            try:
                info = _pretrain(unwrap(state.model), cfg, self.ctx, self.log, self.stop)
            except Preempted as err:
                raise Preempted(f"{err}; continue with --resume --out {out}") from None
            state.gather_rng(self.ctx)  # each process's generators, as the pre-training left them
            if self.ctx.is_main:
                write_json(info, out / "pretrain.json")
                self.save(state)
        if self.ctx.is_main:
            (out / PRETRAIN_CHECKPOINT).unlink(missing_ok=True)

    def batches(self, state: RunState):
        loader, cfg = self.loader, self.cfg
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(state.epoch)
        else:  # the shuffle (and the workers' seeds) are a function of (seed, epoch): a resumed run draws the same
            loader.generator.manual_seed(epoch_seed(cfg.seed, state.epoch))
        set_eval_size(state.model, cfg)  # the model is in training mode by now: the jittered sizes
        # a preempted epoch: its first batches were trained (drawn in the same order, skipped)
        yield from itertools.islice(loader, int((state.epoch_partial or {}).get("batches", 0)), None)

    def step_loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, dict]:
        device = self.ctx.device
        images = [img.to(device) for img in batch[0]]
        targets = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in t.items()} for t in batch[1]]
        losses = model(images, targets)
        loss = sum(self.cfg.loss_weights.get(k, 1.0) * v for k, v in losses.items())
        return loss, {**{k: float(v.detach()) for k, v in losses.items()}, "n": 1}

    def epoch_row(self, state: RunState, model: nn.Module, result: dict) -> dict:
        """The epoch's mean losses (unweighted) and rate, and COCO AP when due (the main process's)."""
        sums = dict(result["sums"])
        count = max(sums.pop("n", 0), 1)
        row = {f"train_{k}": v / count for k, v in sums.items()} | {
            "train_loss": sum(sums.values()) / count,
            "lr": state.optimizer.param_groups[0]["lr"],
        }
        if self.cfg.evaluates_after(state.epoch):
            with all_threads_on_main(self.ctx):
                self.metrics = _evaluate(state.model, self.test, self.cfg, self.ctx) if self.ctx.is_main else {}
            row.update(self.metrics)
        return {**row, "train_time_s": state.train_time_s}

    def epoch_line(self, row: dict) -> str:
        return (
            f"epoch {row['epoch']}/{self.cfg.epochs}: loss {row['train_loss']:.3f}"
            + (f", box AP {row['bbox_AP']:.3f}" if "bbox_AP" in row else "")
            + (f", mask AP {row['segm_AP']:.3f}" if "segm_AP" in row else "")
            + f" ({row['train_time_s']:.0f}s)"
        )

    def describe(self, state: RunState) -> str:
        cfg, model = self.cfg, unwrap(state.model)
        self.params = sum(p.numel() for p in model.parameters())
        self.backbone_params = sum(p.numel() for p in cast("FeaturePyramidBackbone", model.backbone).body.parameters())
        return (
            f"detect: {cfg.backbone} {'Mask' if cfg.masks else 'Faster'} R-CNN, {self.params / 1e6:.2f}M "
            f"parameters (backbone {self.backbone_params / 1e6:.2f}M), {len(self.train_set)} train / "
            f"{len(self.test)} test images, {self.train_set.num_classes} classes, train sizes "
            f"{list(train_sizes(cfg))}" + (f"\n{glyph_note(cfg.glyphs)}" if cfg.data == "glyphs" else "")
        )

    def finish(self, state: RunState, row: dict, stopped: bool) -> dict:
        if not self.ctx.is_main:
            return {}
        with all_threads_on_main(self.ctx):
            return self._outputs(state)

    def _outputs(self, state: RunState) -> dict:
        """The main process's outputs after the last epoch: weights, plots, the picture, ``summary.json``."""
        cfg, out, model, test = self.cfg, self.out, state.model, self.test
        metrics = self.metrics or _evaluate(model, test, cfg, self.ctx)  # resumed after the last epoch: evaluate
        export_safetensors(unwrap(model), out / "model.safetensors", {"backbone": cfg.backbone})
        plots = plot_detection_history(read_history(out / "metrics.csv"), out)
        picture = draw_predictions(
            unwrap(model), test, out / "predictions.png", cfg, self.ctx.device, count=min(4, cfg.max_eval_images or 4)
        )
        pretrained = read_json(out / "pretrain.json") if (out / "pretrain.json").is_file() else {}
        summary = {
            "backbone": cfg.backbone,
            "backbone_kwargs": cfg.backbone_kwargs,
            "masks": cfg.masks,
            "data": cfg.data,
            "recipe": cfg.recipe,
            "epochs": state.epoch,
            "params": self.params,
            **({"glyphs": "+".join(resolve_glyph_sources(cfg.glyphs))} if cfg.data == "glyphs" else {}),
            "backbone_params": self.backbone_params,
            **pretrained,
            "train_time_s": state.train_time_s,
            **metrics,
            "plots": [p.name for p in plots] + [picture.name],
        }
        write_json(summary, out / "summary.json")
        sizes = "/".join(f"{metrics.get(f'bbox_AP_{s}', float('nan')):.3f}" for s in ("small", "medium", "large"))
        self.log(
            f"done: box AP {metrics.get('bbox_AP', float('nan')):.3f}"
            + (f", mask AP {metrics['segm_AP']:.3f}" if "segm_AP" in metrics else "")
            + f" (AP_s/m/l {sizes}), {state.train_time_s:.0f}s training -> {out}"
        )
        return summary
