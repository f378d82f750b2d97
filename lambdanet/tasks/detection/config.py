"""The configuration of ``lambdanet detect``: :class:`DetectConfig` (every option, each also a ``--flag`` and a
YAML key), its recipes, App. E.3's learning-rate schedule (:func:`lr_factor`) and the image sizes training and
evaluation resize to.

Recipes:

* ``quick`` (default): the built-in glyph scenes on a CPU in minutes: the backbone (base width 16) first
  pre-trained on glyph crops (:mod:`lambdanet.tasks.detection.pretrain`, the stand-in for ImageNet weights),
  then AdamW at the scenes' own 256 px, anchors 16-256 px, light heads and a proposal budget for a few objects.
* ``paper``: LambdaNetworks App. E.2 (COCO object detection) / Table 6's Mask R-CNN recipe: 1024 px with
  multi-scale jitter 0.1-2.0, SGD momentum 0.9, linear warm-up over 1000 steps to 0.32 per 256 images, the
  learning rate x0.1 at 90%, 95% and 97.5% of the steps, weight decay 4e-5, synchronised BatchNorm.

Scale jitter is torchvision's: each training image's shorter side is resized to a size drawn from
``img_size x [jitter_min, jitter_max]`` (16 steps), the longer side capped at twice that (the paper resizes
and crops to 1024 px; torchvision's transform does the resize).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from torch import nn

from lambdanet.engine.checkpoint import unwrap
from lambdanet.engine.config import RunConfig, changed_by, option, shared
from lambdanet.engine.optim import lr_at
from lambdanet.files import PRETRAIN_CHECKPOINT
from lambdanet.helpers import is_finite_real
from lambdanet.tasks.detection.glyphs import DEFAULT_GLYPHS, GLYPH_SETS
from lambdanet.tasks.detection.pretrain import PretrainConfig, transfer_mismatch

if TYPE_CHECKING:
    from torchvision.models.detection.transform import GeneralizedRCNNTransform

__all__ = [
    "DetectConfig",
    "DETECT_RECIPES",
    "DETECT_CHOICES",
    "DETECT_RESUME_FREE",
    "DETECTOR_LOSSES",
    "QUICK_DETECTOR",
    "QUICK_PRETRAIN_STEPS",
    "PRETRAIN_CHECKPOINT",
    "PRETRAIN_CHECKPOINT_EVERY",
    "RUN_CHECKPOINTS",
    "resolve_detect_config",
    "recipe_values",
    "pretrain_mismatch",
    "quick_backbone_kwargs",
    "lr_factor",
    "train_sizes",
    "max_image_size",
    "set_eval_size",
]

# the losses torchvision's Mask R-CNN returns in training (Faster R-CNN: all but loss_mask)
DETECTOR_LOSSES = ("loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness", "loss_rpn_box_reg")


@dataclass
class DetectConfig(RunConfig):
    """Every option of ``lambdanet detect`` (each is also a ``--flag`` and a YAML key)."""

    backbone: str = option(
        "lambda_resnet26",
        "registered backbone with features_only, or a HaloNet Table 5 preset "
        "(lambdanet.tasks.detection.BACKBONE_PRESETS)",
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

    @classmethod
    def without_implied(cls, file_values: dict, flags: dict) -> dict:
        """A config file's values (a quick run's ``config.yaml``) without the quick recipe's compact backbone
        options where ``--backbone`` changes the backbone (the new one's are implied instead), and without its
        glyph pre-training where a flag changes what decided it (:meth:`complete` decides again)."""
        out = dict(file_values)
        if out.get("recipe", "quick") != "quick":
            return out
        kwargs, backbone = out.get("backbone_kwargs"), out.get("backbone")
        if changed_by(flags, out, "backbone") and isinstance(kwargs, dict) and isinstance(backbone, str):
            implied = quick_backbone_kwargs(backbone)
            kwargs = {k: v for k, v in kwargs.items() if implied.get(k, _MISSING) != v}
            out["backbone_kwargs"] = kwargs
            if not kwargs:  # the quick recipe's own: the new backbone's are implied
                del out["backbone_kwargs"]
        if out.get("pretrain_steps") == QUICK_PRETRAIN_STEPS and changed_by(flags, out, *_PRETRAIN_DECIDED_BY):
            del out["pretrain_steps"]
        return out

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
        super().validate()  # the shared options (epochs, batch sizes, lr, grad_clip, seed, ...) and the types
        if taken := sorted(set(self.backbone_kwargs) & DETECTOR_SETS):
            raise ValueError(f"backbone_kwargs must not set {taken}: the detector and the backbone's pre-training "
                             "set them (features_only=True, num_classes=0, --pretrained-backbone, ...)")  # fmt: skip
        for name, low, note in (
            ("img_size", 1, ""),
            ("eval_every", 0, " (0: after the last epoch only)"),
            ("procs", 0, " (0: auto)"),
            ("warmup_steps", 0, ""),
        ):
            self.check_int(name, low, note)
        self.check_int("max_eval_images", 1, " (test images evaluated)", optional=True)
        world = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun (or local_processes' group)
        if self.batch_size % world:
            raise ValueError(
                f"batch_size {self.batch_size} must be a multiple of the {world} processes (one share "
                f"per process); set --batch-size or --nproc-per-node"
            )
        for name in ("jitter_min", "jitter_max"):
            self.check_number(name, 0, low_open=True, note=" (a scale of img_size)")
        if not self.jitter_min <= self.jitter_max:
            raise ValueError(
                f"jitter_min and jitter_max must satisfy 0 < jitter_min <= jitter_max, got "
                f"{self.jitter_min} and {self.jitter_max}"
            )
        steps = self.lr_steps
        if any(not is_finite_real(f) or not 0 < f < 1 for f in steps) or list(steps) != sorted(steps):
            raise ValueError(f"lr_steps must be increasing fractions in (0, 1), got {steps}")
        self._validate_pretrain()
        if any(k not in DETECTOR_LOSSES or not is_finite_real(v) or v < 0 for k, v in self.loss_weights.items()):
            raise ValueError(
                f"loss_weights must map loss names ({', '.join(DETECTOR_LOSSES)}) to non-negative "
                f"numbers, got {self.loss_weights!r}"
            )
        if not self.masks and "loss_mask" in self.loss_weights:  # Faster R-CNN has no mask loss to weigh
            raise ValueError("loss_weights sets loss_mask, which --no-masks (Faster R-CNN) does not have")
        from lambdanet.tasks.detection.data import list_detection_datasets
        from lambdanet.tasks.detection.model import BACKBONE_PRESETS, detector_options

        detector_options(self.detector)  # unknown keys and bad values, before any model is built
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
DetectConfig.TASK = "detect"
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
PRETRAIN_CHECKPOINT_EVERY = 100  # (PRETRAIN_CHECKPOINT: lambdanet.files's, beside the other run files' names)
RUN_CHECKPOINTS = DetectConfig.CHECKPOINTS = ("last.pt", PRETRAIN_CHECKPOINT)  # what a detect run continues from
DetectConfig.SAVED_DEFAULTS = {"glyphs": "auto"}  # 0.1.0 had no --glyphs: its scenes were the "auto" sets


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
    from lambdanet.tasks.detection.model import BACKBONE_PRESETS
    from lambdanet.models import list_models

    return backbone in BACKBONE_PRESETS or backbone in list_models(task="image")


_MISSING = object()
# what the quick recipe's decision to pre-train the backbone (DetectConfig.complete) reads
_PRETRAIN_DECIDED_BY = (
    "recipe", "pretrained_backbone", "data", "backbone", "backbone_kwargs", "img_size", "jitter_min", "jitter_max"
)  # fmt: skip


def pretrain_mismatch(cfg: DetectConfig) -> str | None:
    """Why the backbone of ``cfg`` cannot take glyph-crop pre-trained weights (``None``: it can)."""
    return transfer_mismatch(
        cfg.backbone, cfg.backbone_kwargs, img_size=PretrainConfig().img_size, max_size=max_image_size(cfg)
    )


# the arguments the detector and the backbone's pre-training take beside the backbone's keyword arguments
# (create_detector, create_feature_backbone, pretrain_backbone): a backbone_kwargs key among them would collide
DETECTOR_SETS = {"num_classes", "features_only", "pretrained", "max_size", "size_divisible", "masks", "min_size",
                 "pretrained_backbone", "options", "seed", "glyphs", "device", "progress", "log", "checkpoint",
                 "checkpoint_every", "stop", "cfg"}  # fmt: skip


def quick_backbone_kwargs(backbone: str) -> dict:
    """The quick recipe's backbone options: the compact width (base_width 16) where the backbone (or the
    model under a preset) takes one, so that a 2-core CPU trains it in minutes."""
    from lambdanet.tasks.detection.model import resolve_backbone
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


def train_sizes(cfg: DetectConfig) -> tuple[int, ...]:
    """The shorter sides training draws from (torchvision picks one per image)."""
    if cfg.jitter_min == cfg.jitter_max:
        return (round(cfg.img_size * cfg.jitter_min),)
    lo, hi = cfg.img_size * cfg.jitter_min, cfg.img_size * cfg.jitter_max
    return tuple(sorted({max(16, round(lo + (hi - lo) * i / 15)) for i in range(16)}))


def max_image_size(cfg: DetectConfig) -> int:
    """The longest image side the detector resizes to (twice the largest shorter side)."""
    return 2 * max(train_sizes(cfg))


def set_eval_size(model: nn.Module, cfg: DetectConfig) -> None:
    """The detector's resizing for its mode: evaluation at ``img_size``, training at :func:`train_sizes`."""
    transform = cast("GeneralizedRCNNTransform", unwrap(model).transform)
    transform.min_size = (cfg.img_size,) if not model.training else train_sizes(cfg)
    transform.max_size = 2 * max(transform.min_size)
