"""``lambdanet detect``: train and evaluate Mask R-CNN / Faster R-CNN over a lambdanet backbone with
``lambdanet train``'s machinery (recipes, YAML, a flag per option, AMP, atomic checkpoints, ``--resume``,
torchrun with synchronised BatchNorm, progress bars, CSV / TensorBoard metrics, plots) and a ``summary.json``
with COCO box and mask AP (pycocotools) as fractions.

Recipes:

* ``quick`` (default): the built-in glyph scenes on a CPU in minutes: the backbone (base width 16) first
  pre-trained on glyph crops (:mod:`lambdanet.detection.pretrain`, the stand-in for ImageNet weights), then
  AdamW at the scenes' own 256 px, anchors 16-256 px, light heads and a proposal budget for a few objects.
* ``paper``: LambdaNetworks App. E.2 (COCO object detection) / Table 6's Mask R-CNN recipe: 1024 px with
  multi-scale jitter 0.1-2.0, SGD momentum 0.9, linear warm-up over 1000 steps to 0.32 per 256 images, the
  learning rate x0.1 at 90%, 95% and 97.5% of the steps, weight decay 4e-5, synchronised BatchNorm.

Without torchrun, a CPU run trains on several local processes (:func:`local_processes`, ``--procs``): a
detector's small operations keep cores busier as data-parallel processes than as intra-op threads.

Scale jitter is torchvision's: each training image's shorter side is resized to a size drawn from
``img_size x [jitter_min, jitter_max]`` (16 steps), the longer side capped at twice that (the paper resizes
and crops to 1024 px; torchvision's transform does the resize).
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from lambdanet.data import epoch_seed
from lambdanet.detection.glyphs import DEFAULT_GLYPHS, GLYPH_SETS, resolve_glyph_sources
from lambdanet.detection.pretrain import PretrainConfig
from lambdanet.engine.checkpoint import export_safetensors, unwrap
from lambdanet.engine.distributed import (
    DistContext,
    all_threads_on_main,
    convert_sync_batchnorm,
    in_process_group,
    launch_local,
    threads_per_process,
    usable_cores,
    uses_cuda,
)
from lambdanet.engine.logger import plot_history, read_history, read_json, write_json
from lambdanet.engine.loop import TrainingDivergedError
from lambdanet.engine.optim import build_optimizer, lr_at
from lambdanet.engine.preempt import Preempted, StopSignals
from lambdanet.engine.rundir import check_new_run
from lambdanet.engine.state import RunState
from lambdanet.engine.task import Task, check_extras, run
from lambdanet.engine.config import RunConfig, option, shared

if TYPE_CHECKING:
    from torchvision.models.detection.transform import GeneralizedRCNNTransform

    from lambdanet.detection.model import FeaturePyramidBackbone

__all__ = [
    "DetectConfig",
    "DETECT_RECIPES",
    "DETECT_CHOICES",
    "DETECT_RESUME_FREE",
    "resolve_detect_config",
    "train_detector",
    "local_processes",
    "quick_backbone_kwargs",
    "lr_factor",
    "plot_detection_history",
    "draw_predictions",
]


# the losses torchvision's Mask R-CNN returns in training (Faster R-CNN: all but loss_mask)
DETECTOR_LOSSES = ("loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness", "loss_rpn_box_reg")


@dataclass
class DetectConfig(RunConfig):
    """Every option of ``lambdanet detect`` (each is also a ``--flag`` and a YAML key)."""

    backbone: str = option(
        "lambda_resnet26",
        "registered backbone with features_only, or a HaloNet Table 5 preset (lambdanet.detection.BACKBONE_PRESETS)",
    )
    backbone_kwargs: dict = option({}, "create_model options of the backbone, 'key=value,...' or a YAML mapping")
    pretrained_backbone: bool = option(False, "start the backbone from its published ImageNet weights")
    pretrain_steps: int = option(
        0,
        "first pre-train the backbone as a classifier of glyph crops for this many "
        "steps (the offline stand-in for ImageNet weights; 0: none)",
    )
    masks: bool = option(True, "Mask R-CNN (instance masks); --no-masks: Faster R-CNN")
    detector: dict = option({}, "DetectorOptions overrides (anchor_sizes, representation_size, ...)")
    data: str = option("glyphs", "glyphs (built-in offline scenes of digit / Fashion-MNIST glyphs) or coco:DIR")
    glyphs: str = option(
        DEFAULT_GLYPHS,
        "the glyph sets of the glyphs data and its pre-training crops (auto: digits "
        "with Fashion-MNIST where its Debian package is installed, else with mnist5k)",
        choices=GLYPH_SETS,
    )
    recipe: str = shared("recipe", "quick")
    img_size: int = option(256, "shorter image side in training and evaluation (the longer capped at 2x)")
    jitter_min: float = option(1.0, "multi-scale jitter: smallest scale of img_size in training")
    jitter_max: float = option(1.0, "multi-scale jitter: largest scale of img_size in training")
    epochs: int = shared("epochs", 9)
    batch_size: int = shared("batch_size", 8)
    eval_batch_size: int = shared("eval_batch_size", 8, "images per forward pass in evaluation (per process)")
    optimizer: str = shared("optimizer", "adamw")
    lr: float = shared("lr", 1e-3)
    lr_batch_scale: int | None = shared("lr_batch_scale", None)
    momentum: float = shared("momentum", 0.9)
    weight_decay: float = shared("weight_decay", 1e-4)
    warmup_steps: int = option(100, "linear warm-up steps from lr / 1000 (the paper: 1000)")
    lr_steps: list = option([0.75, 0.9], "fractions of the steps after which the rate is multiplied by 0.1")
    loss_weights: dict = option(
        {},
        "weights of the detector's losses in the sum it trains on ("
        + ", ".join(DETECTOR_LOSSES)
        + "; 1 where not given); the logs show them unweighted",
    )
    grad_clip: float | None = shared("grad_clip", 10.0)
    amp: str = shared("amp", "none")
    sync_bn: bool = shared("sync_bn", False)
    eval_every: int = option(
        0, "also evaluate (COCO AP) every this many epochs (0: after the last only)", resume_free=True
    )
    max_train_batches: int | None = shared("max_train_batches", None)
    max_eval_images: int | None = option(None, "evaluate on the first this many test images (smoke tests)")
    seed: int = option(0, "random seed (data generation, initialisation, order)")
    workers: int = shared("workers", 0)
    procs: int = option(
        0,
        "local training processes when not started by torchrun (data parallel, the cores "
        "shared out; 0: auto, on a CPU one per 4 images of the batch up to the usable cores, "
        "on a GPU 1)",
        resume_free=True,
    )
    device: str = shared("device", "auto")
    progress: bool = shared("progress", True)
    tensorboard: bool = shared("tensorboard", True)
    out: str = shared("out", "runs/detect")
    resume: bool = shared(
        "resume", False, "continue the run in --out from its last.pt (or, stopped in the pre-training, its pretrain.pt)"
    )

    @classmethod
    def recipe_values(cls, name: str, explicit: dict) -> dict:
        """The recipe with ``explicit`` over it; the quick recipe's detector options and compact backbone
        (:func:`quick_backbone_kwargs`) unless given."""
        values = {**DETECT_RECIPES[name], "recipe": name, **explicit}
        values["detector"] = {
            **(QUICK_DETECTOR if name == "quick" else {}),
            **DETECT_RECIPES[name].get("detector", {}),
            **explicit.get("detector", {}),
        }
        if name == "quick" and "backbone_kwargs" not in explicit:
            values["backbone_kwargs"] = quick_backbone_kwargs(values.get("backbone", DetectConfig.backbone))
        return values

    def complete(self, explicit: dict) -> None:
        """The quick recipe pre-trains the backbone on glyph crops where nothing else initialises it and its
        weights carry over (validated without: switching it on needs only the rule's own conditions)."""
        if (
            self.recipe == "quick"
            and not self.resume
            and "pretrain_steps" not in explicit
            and not self.pretrained_backbone
            and self.data == "glyphs"
            and pretrain_mismatch(self) is None
        ):
            self.pretrain_steps = QUICK_PRETRAIN_STEPS

    @classmethod
    def recipe_table(cls) -> dict[str, dict]:
        """:meth:`RunConfig.recipe_table` with the quick recipe's pre-training on the default glyphs data,
        without building a model (:meth:`complete` checks the backbone takes it)."""
        table = super().recipe_table()
        if table["quick"]["data"] == "glyphs":
            table["quick"]["pretrain_steps"] = QUICK_PRETRAIN_STEPS
        return table

    def evaluates_after(self, epoch: int) -> bool:
        """Whether the run evaluates COCO AP after ``epoch`` (1-based): the last, and every ``eval_every``."""
        return epoch == self.epochs or bool(self.eval_every) and epoch % self.eval_every == 0

    def validate(self) -> None:
        for name, low, note in (
            ("epochs", 1, ""),
            ("batch_size", 1, ""),
            ("eval_batch_size", 1, ""),
            ("img_size", 1, ""),
            ("eval_every", 0, " (0: after the last epoch only)"),
            ("procs", 0, " (0: auto)"),
        ):
            self.check_int(name, low, note)
        world = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun (or local_processes' group)
        if self.batch_size % world:
            raise ValueError(
                f"batch_size {self.batch_size} must be a multiple of the {world} processes (one share "
                f"per process); set --batch-size or --nproc-per-node"
            )
        super().validate()
        if not 0 < self.jitter_min <= self.jitter_max:
            raise ValueError(
                f"jitter_min and jitter_max must satisfy 0 < jitter_min <= jitter_max, got "
                f"{self.jitter_min} and {self.jitter_max}"
            )
        if self.lr <= 0 or self.warmup_steps < 0:
            raise ValueError(f"lr must be positive and warmup_steps non-negative, got {self.lr}, {self.warmup_steps}")
        if any(not 0 < f < 1 for f in self.lr_steps) or list(self.lr_steps) != sorted(self.lr_steps):
            raise ValueError(f"lr_steps must be increasing fractions in (0, 1), got {self.lr_steps}")
        self._validate_pretrain()
        if not isinstance(self.backbone_kwargs, dict) or not isinstance(self.detector, dict):
            raise ValueError("backbone_kwargs and detector must be mappings")
        if not isinstance(self.loss_weights, dict) or any(
            k not in DETECTOR_LOSSES or isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0
            for k, v in self.loss_weights.items()
        ):
            raise ValueError(
                f"loss_weights must map loss names ({', '.join(DETECTOR_LOSSES)}) to non-negative "
                f"numbers, got {self.loss_weights!r}"
            )
        from lambdanet.detection.data import list_detection_datasets
        from lambdanet.detection.model import BACKBONE_PRESETS

        if not _known_backbone(self.backbone):
            raise ValueError(
                f"unknown backbone {self.backbone!r}: a registered model (lambdanet models) or one of "
                f"the presets {', '.join(BACKBONE_PRESETS)}"
            )
        if not (self.data.startswith("coco:") or self.data in list_detection_datasets()):
            raise ValueError(f"unknown detection dataset {self.data!r}; valid: {', '.join(list_detection_datasets())}")

    def _validate_pretrain(self) -> None:
        """The glyph-crop pre-training's options against the data, the backbone and pretrained weights."""
        self.check_int("pretrain_steps", 0)
        if self.pretrain_steps and self.pretrained_backbone:
            raise ValueError(
                "pretrain_steps and pretrained_backbone both initialise the backbone: choose one "
                "(--pretrain-steps 0 with --pretrained-backbone)"
            )
        if self.pretrain_steps and self.data != "glyphs":
            raise ValueError(
                f"pretrain_steps pre-trains on glyph crops, which only the glyphs data has; with "
                f"data {self.data!r} use --pretrain-steps 0 (or --pretrained-backbone)"
            )
        if self.pretrain_steps and _known_backbone(self.backbone) and (mismatch := pretrain_mismatch(self)):
            raise ValueError(
                f"glyph-crop pre-training cannot initialise backbone {self.backbone!r}: {mismatch} "
                "(layers sized by the input do not carry over); use --pretrain-steps 0"
            )


# LambdaNetworks App. E.2, "COCO object detection" (Table 6): the Mask R-CNN recipe at 1024 px
DETECT_RECIPES: dict[str, dict] = {
    "quick": {},
    "paper": {
        "img_size": 1024,
        "jitter_min": 0.1,
        "jitter_max": 2.0,
        "optimizer": "sgd",
        "momentum": 0.9,
        "lr": 0.32,
        "lr_batch_scale": 256,
        "warmup_steps": 1000,
        "lr_steps": [0.9, 0.95, 0.975],
        "weight_decay": 4e-5,
        "sync_bn": True,
        "batch_size": 64,
        "grad_clip": None,
        "epochs": 282,  # at least 130k steps of batch 256 on COCO train2017 (118,287 images), from scratch
        "detector": {"anchor_sizes": [32, 64, 128, 256, 512]},
    },
}
DetectConfig.RECIPES = DETECT_RECIPES
DETECT_CHOICES = DetectConfig.choices()
DETECT_RESUME_FREE = DetectConfig.resume_free()

# the quick recipe's detector for the 256 px glyph scenes (objects 8-240 px): anchors one octave below
# torchvision's 800 px defaults; light heads and few proposals (1-6 objects per image need no 1024-wide box
# head nor 2000 proposals, and on a CPU the RoI heads' cost is proportional to both)
QUICK_DETECTOR = {
    "anchor_sizes": [16, 32, 64, 128, 256],
    "fpn_channels": 64,
    "representation_size": 256,
    "mask_head_channels": 64,
    "rpn_batch_size_per_image": 128,
    "box_batch_size_per_image": 64,
    "rpn_pre_nms_top_n": [600, 300],
    "rpn_post_nms_top_n": [300, 150],
    "channels_last": True,
}
# the quick recipe's glyph-crop pre-training steps on the glyph scenes (none on other data, with
# --pretrained-backbone, or for a backbone whose weights do not carry over from crops to scenes)
QUICK_PRETRAIN_STEPS = PretrainConfig().steps
# a run's pre-training saves itself here this often (steps), and --resume continues it; gone once last.pt holds it
PRETRAIN_CHECKPOINT, PRETRAIN_CHECKPOINT_EVERY = "pretrain.pt", 100
RUN_CHECKPOINTS = DetectConfig.CHECKPOINTS = ("last.pt", PRETRAIN_CHECKPOINT)  # what a detect run continues from


def resolve_detect_config(
    recipe: str | None = None, yaml_values: dict | None = None, overrides: dict | None = None
) -> DetectConfig:
    """:meth:`DetectConfig.resolve <lambdanet.engine.config.RunConfig.resolve>`: defaults < recipe < YAML <
    overrides; with ``resume``, the run's saved ``config.yaml`` in place of defaults and recipe."""
    return DetectConfig.resolve(recipe, yaml_values, overrides)


def recipe_values() -> dict[str, dict]:
    """Per recipe, the :class:`DetectConfig` values it runs with on the default backbone and data, as
    :func:`resolve_detect_config` settles them (what ``--help`` shows)."""
    return DetectConfig.recipe_table()


def _known_backbone(backbone: str) -> bool:
    from lambdanet.detection.model import BACKBONE_PRESETS
    from lambdanet.models import list_models

    return backbone in BACKBONE_PRESETS or backbone in list_models(task="image")


def pretrain_mismatch(cfg: DetectConfig) -> str | None:
    """Why the backbone of ``cfg`` cannot take glyph-crop pre-trained weights (``None``: it can)."""
    from lambdanet.detection.pretrain import transfer_mismatch

    return transfer_mismatch(
        cfg.backbone, cfg.backbone_kwargs, img_size=PretrainConfig().img_size, max_size=_max_size(cfg)
    )


def quick_backbone_kwargs(backbone: str) -> dict:
    """The quick recipe's backbone options: the compact width (base_width 16) where the backbone (or the
    model under a preset) takes one, so that a 2-core CPU trains it in minutes."""
    from lambdanet.detection.model import resolve_backbone
    from lambdanet.models import model_args

    if not _known_backbone(backbone):
        return {}  # validate() names the valid backbones
    return {"base_width": 16} if "base_width" in model_args(resolve_backbone(backbone, {})[0]) else {}


def lr_factor(step: int, total: int, warmup: int, steps: list[float]) -> float:
    """App. E.3's schedule through :func:`lambdanet.engine.optim.lr_at`: linear warm-up from 1/1000 to 1 over
    ``warmup`` steps (torch's ``LinearLR`` phase), then x0.1 after each fraction in ``steps``."""
    return lr_at(
        step, total, warmup, start_factor=1e-3, schedule="multistep", decay_rate=0.1, milestones=steps, linear_lr=True
    )


def build_detector(cfg: DetectConfig, num_classes: int) -> nn.Module:
    from lambdanet.detection.model import DetectorOptions, create_detector

    overrides: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.detector.items()}
    options = DetectorOptions(**overrides)
    # built at img_size; _set_eval_size switches the transform to the jittered sizes for training
    return create_detector(
        cfg.backbone,
        num_classes,
        masks=cfg.masks,
        min_size=cfg.img_size,
        max_size=_max_size(cfg),
        pretrained_backbone=cfg.pretrained_backbone,
        options=options,
        **cfg.backbone_kwargs,
    )


def _train_sizes(cfg: DetectConfig) -> tuple[int, ...]:
    """The shorter sides training draws from (torchvision picks one per image)."""
    if cfg.jitter_min == cfg.jitter_max:
        return (round(cfg.img_size * cfg.jitter_min),)
    lo, hi = cfg.img_size * cfg.jitter_min, cfg.img_size * cfg.jitter_max
    return tuple(sorted({max(16, round(lo + (hi - lo) * i / 15)) for i in range(16)}))


def _max_size(cfg: DetectConfig) -> int:
    """The longest image side the detector resizes to (twice the largest shorter side)."""
    return 2 * max(_train_sizes(cfg))


def _set_eval_size(model: nn.Module, cfg: DetectConfig) -> None:
    """Evaluation at ``img_size`` (training draws from the jittered sizes)."""
    transform = cast("GeneralizedRCNNTransform", unwrap(model).transform)
    transform.min_size = (cfg.img_size,) if not model.training else _train_sizes(cfg)
    transform.max_size = 2 * max(transform.min_size)


def _loader(dataset, cfg: DetectConfig, ctx: DistContext, train: bool):
    from torch.utils.data import DataLoader, DistributedSampler

    from lambdanet.detection.targets import collate_detection

    sampler: DistributedSampler | None
    sampler = DistributedSampler(dataset, ctx.world, ctx.rank, shuffle=train, seed=cfg.seed) if ctx.enabled else None
    per_rank = cfg.batch_size // ctx.world if train else cfg.eval_batch_size
    g = torch.Generator().manual_seed(cfg.seed)
    return DataLoader(
        dataset,
        batch_size=per_rank,
        shuffle=train and sampler is None,
        sampler=sampler,
        collate_fn=collate_detection,
        num_workers=cfg.workers,
        generator=g,
        drop_last=train,
    )


def _evaluate(model: nn.Module, test, cfg: DetectConfig, ctx: DistContext) -> dict:
    from lambdanet.detection.evaluate import evaluate_detector

    plain = unwrap(model)
    plain.eval()
    _set_eval_size(plain, cfg)
    data: Any = test  # Any: a Subset of it gets its categories
    if cfg.max_eval_images is not None:  # the first images, with the categories (for the COCO ground truth)
        data = torch.utils.data.Subset(test, range(min(cfg.max_eval_images, len(test))))
        data.categories = test.categories
    with torch.no_grad():
        return evaluate_detector(
            plain, data, batch_size=cfg.eval_batch_size, device=ctx.device, progress=_bars(cfg, ctx)
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


def _bars(cfg: DetectConfig, ctx: DistContext) -> bool:
    """Progress bars: asked for, on the main process, and on a terminal (redirected to a log, carriage-return
    redraws would only fill it; the per-epoch lines say what a log needs)."""
    return cfg.progress and ctx.is_main and sys.stderr.isatty()


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
    procs = local_processes(cfg)
    if procs == 1:
        return run(DetectionTask, cfg, log)
    check_extras(DetectionTask, cfg)
    check_new_run(cfg.out, cfg.resume, RUN_CHECKPOINTS)  # a user error is one line here, not one per process
    if cfg.resume:
        cfg.check_resume()
    if cfg.batch_size % procs:
        raise ValueError(
            f"batch_size {cfg.batch_size} must be a multiple of procs {procs} (one share per "
            f"process); set --procs or --batch-size"
        )
    if uses_cuda(cfg.device) and procs > torch.cuda.device_count():
        raise ValueError(f"procs {procs} needs one GPU per process, {torch.cuda.device_count()} visible")
    log(f"detect: {procs} local processes, {threads_per_process(procs)} threads each")
    launch_local(_process_main, (cfg,), procs, relay=(TrainingDivergedError, Preempted))
    return read_json(Path(cfg.out) / "summary.json")


def _process_main(cfg: DetectConfig) -> None:
    """One process of :func:`launch_local`'s group. A signal the launcher forwards while this process sets up
    or finishes does not kill it: caught here, it stops the training at its first step (or, after the last,
    changes nothing)."""
    with StopSignals():
        train_detector(cfg)


def _pretrain(
    model: nn.Module, cfg: DetectConfig, ctx: DistContext, log: Callable[[str], None], stop: StopSignals | None = None
) -> dict:
    """Pre-train the detector's backbone on glyph crops (:mod:`lambdanet.detection.pretrain`) and load it."""
    from lambdanet.detection.pretrain import load_backbone_weights, pretrain_backbone

    settings = PretrainConfig(
        steps=cfg.pretrain_steps, workers=cfg.workers, channels_last=bool(cfg.detector.get("channels_last"))
    )  # the detector's layout
    weights, info = pretrain_backbone(
        cfg.backbone,
        settings,
        seed=cfg.seed,
        glyphs=cfg.glyphs,
        device=ctx.device,
        progress=_bars(cfg, ctx),
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

    diverged_hint = "Lower --lr or raise --warmup-steps."
    command = "detect"
    extras = (("matplotlib", "train"), ("pycocotools", "detect"))

    def build_state(self) -> RunState:
        from lambdanet.detection.data import GlyphSceneConfig, build_detection_datasets

        cfg, ctx, out = self.cfg, self.ctx, self.out
        self.train_set, self.test = build_detection_datasets(
            cfg.data, seed=cfg.seed, progress=_bars(cfg, ctx), config=GlyphSceneConfig(glyphs=cfg.glyphs)
        )
        model = build_detector(cfg, self.train_set.num_classes)
        if cfg.sync_bn and ctx.enabled:
            model = convert_sync_batchnorm(model, ctx.device)
        model = model.to(ctx.device)
        if not cfg.resume and ctx.is_main and (out / "pretrain.json").exists():
            (out / "pretrain.json").unlink()  # left by an earlier attempt that ended before its first checkpoint
        self.loader = _loader(self.train_set, cfg, ctx, train=True)
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
        _set_eval_size(state.model, cfg)  # the model is in training mode by now: the jittered sizes
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
        count = max(sums.pop("n"), 1)
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
            f"{list(_train_sizes(cfg))}" + (f"\n{glyph_note(cfg.glyphs)}" if cfg.data == "glyphs" else "")
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


def plot_detection_history(history: list[dict], out: Path) -> list[Path]:
    """``loss.png`` (training losses) and ``ap.png`` (box / mask AP) per epoch."""
    losses = tuple(sorted({k for r in history for k in r if k.startswith("train_loss")}))
    aps = tuple(k for k in ("bbox_AP", "bbox_AP50", "segm_AP", "segm_AP50") if any(k in r for r in history))
    return plot_history(history, out, (("loss.png", losses, "loss"), ("ap.png", aps, "COCO AP")))


def _category(dataset, label: int) -> str:
    """The name of 1-based ``label`` (the dataset's ``categories``), else the number."""
    names = getattr(dataset, "categories", None)
    return str(names[label - 1]) if names and 0 < label <= len(names) else str(label)


def draw_predictions(
    model: nn.Module, dataset, path: Path, cfg: DetectConfig, device, count: int = 4, score: float = 0.5
) -> Path:
    """Boxes (labelled with category names and scores) and masks of the detections above ``score`` on the
    first ``count`` test images, side by side, saved as one PNG."""
    from torchvision.utils import draw_bounding_boxes, draw_segmentation_masks, make_grid, save_image

    model.eval()
    _set_eval_size(model, cfg)
    tiles = []
    with torch.no_grad():
        for i in range(min(count, len(dataset))):
            image, _ = dataset[i]
            pred = model([image.to(device)])[0]
            keep = pred["scores"] >= score
            canvas = (image.clamp(0, 1) * 255).to(torch.uint8).cpu()
            if "masks" in pred and keep.any():
                canvas = draw_segmentation_masks(canvas, pred["masks"][keep, 0].cpu() > 0.5, alpha=0.4)
            labels = [
                f"{_category(dataset, int(c))} {s:.2f}" for c, s in zip(pred["labels"][keep], pred["scores"][keep])
            ]
            canvas = draw_bounding_boxes(canvas, pred["boxes"][keep].cpu(), labels=labels, colors="yellow")
            tiles.append(canvas.float() / 255)
    size = max(t.shape[-1] for t in tiles), max(t.shape[-2] for t in tiles)
    tiles = [nn.functional.pad(t, (0, size[0] - t.shape[-1], 0, size[1] - t.shape[-2])) for t in tiles]
    save_image(make_grid(tiles, nrow=len(tiles), padding=2), path)
    return path
