"""Training configuration: one dataclass, recipes as overrides, YAML files, and a flag per field.

Precedence (later wins): dataclass defaults < ``--recipe`` < the model's paper values that recipe takes <
``--config FILE.yaml`` < command-line flags. :func:`resolve_config` then writes in what the data and the model
imply, so the configuration written to ``<out>/config.yaml`` is exactly what runs; ``--resume`` reloads it.

Recipes:

* ``quick``: small data on a CPU in minutes (AdamW 2e-3, 1 warm-up epoch, cosine, label smoothing 0.1, crops with
  padding, compact model width): the README's main job.
* ``paper90``: App. E.2's 90-epoch ImageNet setup: SGD momentum 0.9, linear warm-up over 5 epochs to ``0.1 B /
  256``, cosine decay, weight decay 1e-4, label smoothing 0.1, EMA of weights 0.9999, BatchNorm decay 0.9999
  (PyTorch momentum 1e-4), random crops and flips.
* ``paper350``: ``paper90`` with weight decay 4e-5, 350 epochs, RandAugment with 2 layers, and the image size,
  RandAugment magnitude, dropout and stochastic depth of Tables 19-20 for the model (read from its metadata,
  :data:`RECIPE_MODEL_KEYS`), bf16 autocast (the paper trains with bfloat16 activations).
* ``cifar_repro``: the CIFAR-10 reproduction report: Adam (betas 0.9, 0.9999, L2 1e-4), learning rate ramped
  linearly from 5e-4 to 2.5e-3 over 5 epochs then cosine, batch 128, 90 epochs, label smoothing 0.1."""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, cast

from lambdanet.engine.config import RunConfig, config_source_from_args, flag, option, shared
from lambdanet.files import check_path_given, run_file, weights_file_kind
from lambdanet.models import model_args, model_info
from lambdanet.tasks.classification.datasets import dataset_spec, list_datasets
from lambdanet.tasks.classification.implied import RECIPE_MODEL_KEYS, checkpoint_values, without_implied

__all__ = [
    "TrainConfig",
    "RECIPES",
    "RECIPE_MODEL_KEYS",
    "RESUME_FREE",
    "resolve_config",
    "config_from_args",
    "model_build_kwargs",
    "recipe_values",
]


@dataclass
class TrainConfig(RunConfig):
    """Every option of ``lambdanet train`` (each is also a ``--flag`` and a YAML key; ``null`` = unset)."""

    # may differ between the processes of a group: each node's own copies of the data and of the weights
    PER_PROCESS: ClassVar[frozenset[str]] = RunConfig.PER_PROCESS | {"data_dir", "checkpoint", "pseudo_labels"}
    PATHS: ClassVar[tuple[str, ...]] = ("data_dir", "checkpoint", "pseudo_labels")

    # model and data
    model: str = option("lambda_resnet26", "registered model name (lambdanet models lists them)")
    model_kwargs: dict = option(
        {},
        "architecture options of the model, 'key=value,...' or a YAML mapping "
        "(e.g. stage_layers=CCLL); the resolved config adds stem/base_width/img_size",
    )
    pretrained: bool = option(
        False,
        "start from the model's published ImageNet weights (lambdanet models --pretrained "
        "lists the models that have them), with a new classifier for the data's classes",
    )
    checkpoint: str | None = option(
        None,
        "start from weights: timm's checkpoint of the model (.pth, .bin, "
        ".safetensors) or a run of lambdanet train (its directory, .safetensors or "
        "last.pt; its model, model_kwargs and img_size are taken unless given); "
        "another input channel count is adapted, another class count gets a new "
        "classifier",
    )
    data: str = option("digits", "dataset: digits, mnist5k, fashion-mnist, cifar10, cifar100 or imagefolder:PATH")
    data_dir: str = option(
        "~/.cache/lambdanet/data", "folder holding (or receiving) downloaded datasets", resume_free=True
    )
    download: bool = option(True, "download a dataset that is not on disk (cifar, fashion-mnist)")
    img_size: int | None = option(
        None,
        "training resolution (unset: a --checkpoint run's, the model's paper size under a recipe that sets it, "
        "else the dataset's; given as null: the dataset's, or the size of published weights fine-tuned)",
    )
    val_split: float = option(0.0, "fraction of the training set held out for validation and model selection")
    # recipe
    recipe: str = shared("recipe", "quick")
    epochs: int = shared("epochs", 15)
    batch_size: int = shared("batch_size", 64)
    eval_batch_size: int = shared("eval_batch_size", 256)
    optimizer: str = shared("optimizer", "adamw")
    lr: float = shared("lr", 2e-3)
    lr_batch_scale: int | None = shared("lr_batch_scale", None)
    momentum: float = shared("momentum", 0.9)
    nesterov: bool = option(False, "Nesterov momentum for SGD")
    betas: list = shared("betas", [0.9, 0.999])
    weight_decay: float = shared("weight_decay", 0.05)
    warmup_epochs: float = option(1.0, "linear learning-rate warm-up, in epochs")
    warmup_start_factor: float = option(0.0, "warm-up starts at lr times this")
    schedule: str = option("cosine", "learning-rate schedule after warm-up", choices=("cosine", "constant", "step"))
    min_lr: float = option(0.0, "final learning rate of the cosine schedule, and floor of the step schedule")
    lr_decay_rate: float = option(0.97, "step schedule: multiply the learning rate by this ...")
    lr_decay_epochs: float = option(2.4, "... every this many epochs")
    label_smoothing: float = option(0.1, "label smoothing of the cross-entropy")
    mixup: float = option(
        0.0, "Mixup: each batch blended with itself reversed, weight ~ Beta(alpha, alpha); this is alpha (0: off)"
    )
    cutmix: float = option(
        0.0,
        "CutMix: a box of each image pasted from the reversed batch, area ~ Beta(alpha, alpha); this is alpha "
        "(0: off; with --mixup, each batch takes one of the two at random)",
    )
    ema_decay: float | None = option(None, "exponential moving average of the weights (e.g. 0.9999); null: none")
    bn_momentum: float | None = option(None, "BatchNorm running-statistics momentum (TF decay 0.9999 = 1e-4)")
    augment: bool = option(True, "random crops and flips during training")
    randaugment_layers: int = option(0, "RandAugment operations per image (0: off)")
    randaugment_magnitude: int = option(9, "RandAugment magnitude (0-30; 31, HaloNet H7's, is also the strongest)")
    drop_rate: float | None = option(None, "dropout before the classifier (null: the model's default)")
    drop_path_rate: float | None = option(None, "stochastic depth rate (null: the model's default)")
    compact_width: int | None = option(
        16, "base width given to ResNet-style models that do not set base_width (null: the paper's width)"
    )
    # system
    amp: str = shared("amp", "none")
    channels_last: bool = option(False, "channels_last memory format for model and inputs")
    compile: bool = shared("compile", False)
    compile_mode: str = shared("compile_mode", "default")
    device: str = shared("device", "auto")
    workers: int = shared("workers", 0, "DataLoader worker processes for file datasets")
    seed: int = option(0, "seed of initialisation, data order and augmentation")
    sync_bn: bool = shared("sync_bn", False)
    # run
    out: str = shared("out", "runs/lambdanet")
    checkpoint_every: int = shared("checkpoint_every", 1)
    checkpoint_steps: int = shared("checkpoint_steps", 0)
    resume: bool = shared("resume", False)
    early_stop_patience: int | None = option(
        None, "stop after this many epochs without validation improvement (needs --val-split)"
    )
    tensorboard: bool = shared("tensorboard", True)
    progress: bool = shared("progress", True)
    labeled_fraction: float = option(1.0, "semi-supervised: the seeded fraction of training labels kept")
    pseudo_labels: str | None = option(None, "semi-supervised: pseudo-label file from lambdanet pseudo-label")
    max_train_batches: int | None = shared("max_train_batches", None)

    @classmethod
    def recipe_values(cls, name: str, explicit: dict) -> dict:
        """The recipe, the model's paper values it takes (:data:`RECIPE_MODEL_KEYS`), ``explicit``; fine-tuning a
        run of ``lambdanet train`` takes its model, options and image size (:func:`.implied.checkpoint_values`)."""
        explicit = checkpoint_values(explicit)
        model = explicit.get("model") or RECIPES[name].get("model") or TrainConfig.model
        paper = model_info(model).recipe  # "unknown model ...; registered models: ..."
        from_model = {k: paper[k] for k in RECIPE_MODEL_KEYS.get(name, ()) if k in paper}
        return {**RECIPES[name], **from_model, **explicit, "recipe": name}

    @classmethod
    def without_implied(cls, file_values: dict, flags: dict) -> dict:
        return without_implied(file_values, flags)  # the rules: lambdanet.tasks.classification.implied

    def complete(self, explicit: dict) -> None:
        resolve_model_values(self)

    @classmethod
    def recipe_table(cls) -> dict[str, dict]:
        return recipe_values()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and the valid values for anything out of range (the shared
        options: :meth:`RunConfig.validate <lambdanet.engine.config.RunConfig.validate>`)."""
        super().validate()
        for name, what in _OPTIONAL_SIZES.items():
            self.check_int(name, 1, f" ({what})", optional=True)
        for name in ("randaugment_layers", "randaugment_magnitude"):
            self.check_int(name, 0)
        if self.randaugment_magnitude > MAX_RANDAUGMENT_MAGNITUDE:
            raise ValueError(
                f"randaugment_magnitude must be at most {MAX_RANDAUGMENT_MAGNITUDE} (torchvision's scale is 0-30, "
                f"HaloNet H7's recipe takes 31; both are the strongest), got {self.randaugment_magnitude}"
            )
        self._validate_schedule()
        self._validate_regularisation()
        if self.early_stop_patience is not None and self.val_split == 0.0:
            raise ValueError("early_stop_patience needs a held-out validation set: pass --val-split (e.g. 0.02)")
        model_info(self.model)  # "unknown model ...; registered models: ..."
        if not (self.data.startswith("imagefolder:") or self.data in list_datasets()):
            raise ValueError(f"unknown dataset {self.data!r}; valid: {', '.join(list_datasets())}")
        self.check_number("labeled_fraction", 0, 1, low_open=True)
        for name, what in (
            ("pseudo_labels", "the file lambdanet pseudo-label wrote"),
            ("data_dir", "a dataset folder"),
        ):
            if getattr(self, name) is not None:  # '' is no path (null leaves it out), never the working folder
                check_path_given(getattr(self, name), name, f"give {what}, or leave it out")
        if self.pretrained and self.checkpoint:
            raise ValueError("pass --pretrained (the published weights) or --checkpoint FILE, not both")
        if self.checkpoint is not None:
            if not Path(self.checkpoint).expanduser().exists():
                raise ValueError(
                    f"checkpoint {self.checkpoint!r} does not exist (expected a run directory of "
                    "lambdanet train or a weights file: .safetensors, .pth, .bin, a run's last.pt)"
                )
            weights = run_file(self.checkpoint)  # a directory without weights: one line naming it
            if weights.is_file() and (kind := weights_file_kind(weights)) not in (None, "safetensors"):
                raise ValueError(
                    f"checkpoint {self.checkpoint!r} is {kind} (expected a run directory of lambdanet train or a "
                    "weights file: .safetensors, .pth, .bin, a run's last.pt)"
                )

    def _validate_schedule(self) -> None:
        """The learning-rate schedule's options (lr itself is a shared option)."""
        self.check_number("warmup_epochs", 0)
        self.check_number("warmup_start_factor", 0, 1, note=" (a fraction of lr)")
        self.check_number("lr_decay_rate", 0, 1, low_open=True, note=" (the step schedule's factor)")
        self.check_number("lr_decay_epochs", 0, low_open=True)
        peak = self.effective_lr()
        self.check_number("min_lr", 0, peak, note=" (at most the learning rate the schedule starts from)")

    def _validate_regularisation(self) -> None:
        """Validation split, label smoothing, Mixup / CutMix, EMA, BatchNorm momentum, dropout rates."""
        self.check_number("val_split", 0, 1, high_open=True)
        self.check_number("label_smoothing", 0, 1, high_open=True)
        for name in ("mixup", "cutmix"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < math.inf:
                raise ValueError(
                    f"{name} must be a non-negative number (the alpha of Beta(alpha, alpha); 0: off), got {value!r}"
                )
        self.check_number("ema_decay", 0, 1, low_open=True, high_open=True, optional=True)
        self.check_number("bn_momentum", 0, 1, low_open=True, high_open=True, optional=True, note=" (1 - TF's decay)")
        for name in ("drop_rate", "drop_path_rate"):
            self.check_number(name, 0, 1, high_open=True, optional=True)

    def warnings(self) -> list[str]:
        """Settings that run but are probably not what the user wants."""
        out = []
        if self.warmup_epochs >= self.epochs:
            out.append(
                f"--epochs {self.epochs} ends inside the {self.warmup_epochs:g}-epoch learning-rate warm-up: "
                "the schedule never decays and accuracy may stay near chance; train longer (e.g. --epochs "
                f"{max(15, int(self.warmup_epochs) * 5)}) or pass --warmup-epochs 0"
            )
        return out


# RandAugment's largest magnitude: torchvision's 31 bins (0-30) widened by one for HaloNet H7's recipe
# (data.rand_augment); 30 and 31 are both the strongest
MAX_RANDAUGMENT_MAGNITUDE = 31
# the size-like options that may be null, and what they count (TrainConfig.validate)
_OPTIONAL_SIZES = {
    "img_size": "the training resolution in pixels; each model has its own minimum, checked before training",
    "early_stop_patience": "epochs",
    "compact_width": "channels",
}


_PAPER90 = {
    "optimizer": "sgd",
    "lr": 0.1,
    "lr_batch_scale": 256,
    "momentum": 0.9,
    "weight_decay": 1e-4,
    "warmup_epochs": 5.0,
    "schedule": "cosine",
    "label_smoothing": 0.1,
    "ema_decay": 0.9999,
    "bn_momentum": 1e-4,
    "epochs": 90,
    "batch_size": 256,
    "compact_width": None,
}
RECIPES: dict[str, dict] = {
    "quick": {},
    "paper90": _PAPER90,
    "paper350": {**_PAPER90, "weight_decay": 4e-5, "epochs": 350, "randaugment_layers": 2, "amp": "bf16"},
    "cifar_repro": {
        "optimizer": "adam",
        "lr": 2.5e-3,
        "warmup_epochs": 5.0,
        "warmup_start_factor": 0.2,
        "betas": [0.9, 0.9999],
        "weight_decay": 1e-4,
        "schedule": "cosine",
        "label_smoothing": 0.1,
        "epochs": 90,
        "batch_size": 128,
        "data": "cifar10",
        "compact_width": None,
    },
}

TrainConfig.RECIPES = RECIPES
TrainConfig.TASK = "classify"
# what ``--resume`` lets change: how the run is watched and where it runs, never what it computes
RESUME_FREE = TrainConfig.resume_free()


def resolve_config(
    recipe: str | None = None, yaml_values: dict | None = None, overrides: dict | None = None
) -> TrainConfig:
    """:meth:`TrainConfig.resolve <lambdanet.engine.config.RunConfig.resolve>`: defaults < recipe < the model's
    paper values the recipe takes (:data:`RECIPE_MODEL_KEYS`) < YAML < overrides; then what the data and model
    imply (image size, the small-image stem, the compact width, the model's own dropout / stochastic depth)
    is written in. With ``checkpoint`` set to what ``lambdanet train`` wrote, the model, its architecture
    options and the image size are the checkpoint's unless given explicitly."""
    return TrainConfig.resolve(recipe, yaml_values, overrides)


def resolve_model_values(cfg: TrainConfig) -> None:
    """Write in what the data and the model imply (in place): ``img_size`` from the dataset, and in
    ``model_kwargs`` (unless given) the small-image stem for images up to 64 px, the compact width and the
    image size where the model takes them; ``drop_rate`` / ``drop_path_rate`` from the model's defaults."""
    accepted = model_args(cfg.model)
    if cfg.img_size is None:  # published weights, or a timm checkpoint of their architecture: the size they were
        # trained at (global attention is sized by it); a lambdanet run's weights have set it from their metadata
        info = model_info(cfg.model)
        published = cfg.pretrained or (cfg.checkpoint is not None and info.pretrained is not None)
        cfg.img_size = info.input_size if published else dataset_spec(cfg.data).image_size
    kwargs = dict(cfg.model_kwargs)
    for key in ("drop_rate", "drop_path_rate"):
        if key in kwargs:
            if getattr(cfg, key) is not None and getattr(cfg, key) != kwargs[key]:
                raise ValueError(
                    f"{key} is given twice: {flag(key)} {getattr(cfg, key)} and "
                    f"model_kwargs {key}={kwargs[key]}; give it once"
                )
            setattr(cfg, key, kwargs.pop(key))
        if getattr(cfg, key) is None:
            setattr(cfg, key, float(cast("float | None", accepted.get(key)) or 0.0))
    if cfg.drop_path_rate and "drop_path_rate" not in accepted:
        raise ValueError(f"model {cfg.model!r} has no stochastic depth; drop_path_rate must be 0 or null")
    if cfg.drop_rate and "drop_rate" not in accepted:
        raise ValueError(f"model {cfg.model!r} has no dropout; drop_rate must be 0 or null")
    if "stem" in accepted and "stem" not in kwargs and cfg.img_size <= 64:
        kwargs["stem"] = "cifar"
    if cfg.compact_width and "base_width" in accepted and "base_width" not in kwargs:
        kwargs["base_width"] = cfg.compact_width
    if "img_size" in accepted and "img_size" not in kwargs:
        kwargs["img_size"] = cfg.img_size
    if "in_chans" in kwargs or "num_classes" in kwargs:
        raise ValueError(
            "model_kwargs must not set in_chans or num_classes: the model takes the data's channels "
            "(digits, mnist5k, fashion-mnist: 1; cifar10/100, imagefolder: 3) and classes; weights from "
            "--checkpoint or --pretrained with other channels have their input convolution adapted, "
            "with other classes get a new classifier"
        )
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(f"model {cfg.model!r} does not take {unknown}; it accepts: {', '.join(accepted)}")
    cfg.model_kwargs = kwargs


def model_build_kwargs(cfg: TrainConfig) -> dict:
    """The keyword arguments of ``create_model(cfg.model, ...)`` for a resolved ``cfg`` (beyond classes and
    channels): ``model_kwargs`` plus the dropout / stochastic depth the model takes."""
    accepted = model_args(cfg.model)
    kwargs = dict(cfg.model_kwargs)
    for key in ("drop_rate", "drop_path_rate"):
        if key in accepted and getattr(cfg, key) is not None:
            kwargs[key] = getattr(cfg, key)
    return kwargs


def recipe_values() -> dict[str, dict]:
    """Per recipe, the values of :class:`TrainConfig` it runs with before the data and the model are known;
    the options a recipe takes from the model (:data:`RECIPE_MODEL_KEYS`) read ``"the model's"``."""
    base = dataclasses.asdict(TrainConfig())
    return {
        name: {**base, **values, "recipe": name, **dict.fromkeys(RECIPE_MODEL_KEYS.get(name, ()), "the model's")}
        for name, values in RECIPES.items()
    }


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Resolve a :class:`TrainConfig` from parsed flags (with ``--config`` and ``--recipe``)."""
    return config_source_from_args(args, TrainConfig).resolve()
