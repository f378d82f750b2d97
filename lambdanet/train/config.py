"""Training configuration: one dataclass, recipes as overrides, YAML files, and a flag per field.

Precedence (later wins): dataclass defaults < ``--recipe`` < the model's paper values that recipe takes <
``--config FILE.yaml`` < command-line flags. :func:`resolve_config` then writes in what the data and the
model imply, so the configuration written to ``<out>/config.yaml`` is exactly what runs; ``--resume``
reloads it.

Recipes:

* ``quick``: small data on a CPU in minutes (AdamW 2e-3, 1 warm-up epoch, cosine, label smoothing 0.1,
  crops with padding, compact model width): the README's main job.
* ``paper90``: App. E.2's 90-epoch ImageNet setup: SGD momentum 0.9, linear warm-up over 5 epochs to
  ``0.1 B / 256``, cosine decay, weight decay 1e-4, label smoothing 0.1, EMA of weights 0.9999, BatchNorm
  decay 0.9999 (PyTorch momentum 1e-4), random crops and flips.
* ``paper350``: ``paper90`` with weight decay 4e-5, 350 epochs, RandAugment with 2 layers, and the
  image size, RandAugment magnitude, dropout and stochastic depth of Tables 19-20 for the model (read from
  its metadata, :data:`RECIPE_MODEL_KEYS`), bf16 autocast (the paper trains with bfloat16 activations).
* ``cifar_repro``: the CIFAR-10 reproduction report: Adam (betas 0.9, 0.9999, L2 1e-4), learning rate
  ramped linearly from 5e-4 to 2.5e-3 over 5 epochs then cosine, batch 128, 90 epochs, label smoothing 0.1.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from lambdanet.runtime import AMP_DTYPES

__all__ = ["RunConfig", "TrainConfig", "RECIPES", "RECIPE_MODEL_KEYS", "RESUME_FREE", "ConfigSource", "resolve_config",
           "add_config_arguments", "load_yaml", "save_yaml", "config_from_args", "config_source_from_args",
           "config_differences", "describe_differences", "model_build_kwargs", "saved_run_config", "field_choices", "flag",
           "option"]


def option(default, help: str, choices: tuple | None = None, *, resume_free: bool = False, **kw):
    """A configuration dataclass field with its one-line ``--help`` text, where closed its choices
    (:func:`add_config_arguments` makes it a flag), and whether ``--resume`` may change it (``resume_free``:
    where and how a run is watched, not what it computes; :meth:`RunConfig.resume_free`)."""
    meta = {"help": help, "choices": choices, "resume_free": resume_free}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


class RunConfig:
    """What every task's configuration dataclass shares (:class:`TrainConfig`,
    :class:`lambdanet.detection.trainer.DetectConfig`): the learning-rate scaling rule and the resume rule."""

    def effective_lr(self) -> float:
        """``lr * batch_size / lr_batch_scale`` (the paper's ``0.1 B / 256``) or ``lr``."""
        return self.lr * self.batch_size / self.lr_batch_scale if self.lr_batch_scale else self.lr

    @classmethod
    def resume_free(cls) -> tuple[str, ...]:
        """The options ``--resume`` may change (declared with ``option(..., resume_free=True)``)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("resume_free"))

    def save_yaml(self, path: str | Path) -> None:
        """``config.yaml``: what runs, which ``--resume`` reloads."""
        save_yaml(dataclasses.replace(self, resume=False), path)

    def check_resume(self) -> int:
        """``--resume`` continues the run in ``out`` as it was configured: only the :meth:`resume_free` options
        and ``epochs`` (more extend the run) may differ from its ``config.yaml``. Returns its epochs."""
        saved = dataclasses.asdict(type(self).resolve(overrides={"out": self.out, "resume": True}))
        free = self.resume_free()
        changed = config_differences(saved, self, ignore=free + ("epochs",))
        if changed:
            raise ValueError(f"--resume cannot change {', '.join(changed)}: {describe_differences(changed)}; only "
                             f"--epochs and {', '.join(flag(k) for k in free if k not in ('resume', 'out'))} may "
                             f"change: drop the others, or start a new run with another --out")
        return int(saved["epochs"])


@dataclass
class TrainConfig(RunConfig):
    """Every option of ``lambdanet train`` (each is also a ``--flag`` and a YAML key; ``null`` = unset)."""

    # model and data
    model: str = option("lambda_resnet26", "registered model name (lambdanet models lists them)")
    model_kwargs: dict = option({}, "architecture options of the model, 'key=value,...' or a YAML mapping "
                                  "(e.g. stage_layers=CCLL); the resolved config adds stem/base_width/img_size")
    pretrained: bool = option(False, "start from the model's published ImageNet weights (lambdanet models --pretrained "
                                   "lists the models that have them), with a new classifier for the data's classes")
    checkpoint: str | None = option(None, "start from weights: timm's checkpoint of the model (.pth, .bin, "
                                        ".safetensors) or a run of lambdanet train (its directory, .safetensors or "
                                        "last.pt; its model, model_kwargs and img_size are taken unless given); "
                                        "another input channel count is adapted, another class count gets a new "
                                        "classifier")
    data: str = option("digits", "dataset: digits, mnist5k, fashion-mnist, cifar10, cifar100 or imagefolder:PATH")
    data_dir: str = option("~/.cache/lambdanet/data", "folder holding (or receiving) downloaded datasets")
    download: bool = option(True, "download a dataset that is not on disk (cifar, fashion-mnist)")
    img_size: int | None = option(None, "training resolution (null: the dataset's, or the model's paper size "
                                      "under a recipe that sets it)")
    val_split: float = option(0.0, "fraction of the training set held out for validation and model selection")
    # recipe
    recipe: str = option("quick", "named recipe whose values the other options override")
    epochs: int = option(15, "training epochs (with --resume: more epochs extend the finished schedule)")
    batch_size: int = option(64, "global batch size (split across torchrun processes)")
    eval_batch_size: int = option(256, "batch size of evaluation")
    optimizer: str = option("adamw", "optimizer", choices=("sgd", "adam", "adamw", "rmsprop"))
    lr: float = option(2e-3, "base learning rate (scaled by batch_size / lr_batch_scale when that is set)")
    lr_batch_scale: int | None = option(None, "linear scaling rule: lr * batch_size / this (the paper's 256)")
    momentum: float = option(0.9, "momentum of SGD and RMSProp")
    nesterov: bool = option(False, "Nesterov momentum for SGD")
    betas: list = option([0.9, 0.999], "Adam/AdamW betas")
    weight_decay: float = option(0.05, "weight decay (not on norms and biases)")
    warmup_epochs: float = option(1.0, "linear learning-rate warm-up, in epochs")
    warmup_start_factor: float = option(0.0, "warm-up starts at lr times this")
    schedule: str = option("cosine", "learning-rate schedule after warm-up", choices=("cosine", "constant", "step"))
    min_lr: float = option(0.0, "final learning rate of the cosine schedule, and floor of the step schedule")
    lr_decay_rate: float = option(0.97, "step schedule: multiply the learning rate by this ...")
    lr_decay_epochs: float = option(2.4, "... every this many epochs")
    label_smoothing: float = option(0.1, "label smoothing of the cross-entropy")
    ema_decay: float | None = option(None, "exponential moving average of the weights (e.g. 0.9999); null: none")
    bn_momentum: float | None = option(None, "BatchNorm running-statistics momentum (TF decay 0.9999 = 1e-4)")
    augment: bool = option(True, "random crops and flips during training")
    randaugment_layers: int = option(0, "RandAugment operations per image (0: off)")
    randaugment_magnitude: int = option(9, "RandAugment magnitude (0-30)")
    drop_rate: float | None = option(None, "dropout before the classifier (null: the model's default)")
    drop_path_rate: float | None = option(None, "stochastic depth rate (null: the model's default)")
    compact_width: int | None = option(16, "base width given to ResNet-style models that do not set base_width "
                                         "(null: the paper's width)")
    # system
    amp: str = option("none", "autocast precision (fp16 needs CUDA)", choices=tuple(AMP_DTYPES))
    channels_last: bool = option(False, "channels_last memory format for model and inputs")
    compile: bool = option(False, "torch.compile the model")
    device: str = option("auto", "device (auto: CUDA when available)", choices=("auto", "cpu", "cuda"),
                         resume_free=True)
    workers: int = option(0, "DataLoader worker processes for file datasets", resume_free=True)
    seed: int = option(0, "seed of initialisation, data order and augmentation")
    sync_bn: bool = option(False, "synchronised BatchNorm across torchrun processes")
    # run
    out: str = option("runs/lambdanet", "run directory (config, metrics, checkpoints, weights, plots, summary)",
                      resume_free=True)
    checkpoint_every: int = option(1, "write last.pt every this many epochs (and at the end)", resume_free=True)
    resume: bool = option(False, "continue the run in --out where it stopped", resume_free=True)
    early_stop_patience: int | None = option(None, "stop after this many epochs without validation improvement "
                                                 "(needs --val-split)")
    tensorboard: bool = option(True, "write TensorBoard event files beside metrics.csv", resume_free=True)
    progress: bool = option(True, "progress bar on stderr", resume_free=True)
    labeled_fraction: float = option(1.0, "semi-supervised: the seeded fraction of training labels kept")
    pseudo_labels: str | None = option(None, "semi-supervised: pseudo-label file from lambdanet pseudo-label")
    max_train_batches: int | None = option(None, "stop each epoch after this many batches (smoke tests)")

    @classmethod
    def resolve(cls, recipe: str | None = None, yaml_values: dict | None = None, overrides: dict | None = None
                ) -> TrainConfig:
        return resolve_config(recipe, yaml_values, overrides)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and the valid values for anything out of range."""
        for name, valid in field_choices().items():
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} must be one of {list(valid)}, got {getattr(self, name)!r}")
        positive = ("epochs", "batch_size", "eval_batch_size", "checkpoint_every")
        for name in positive:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name, what in _OPTIONAL_SIZES.items():
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name} must be a positive int ({what}) or null, got {v!r}")
        for name in ("workers", "randaugment_layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        m = self.randaugment_magnitude
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"randaugment_magnitude must be a non-negative int, got {m!r}")
        if not self.warmup_epochs >= 0:
            raise ValueError(f"warmup_epochs must be >= 0, got {self.warmup_epochs}")
        if not self.lr_decay_epochs > 0:
            raise ValueError(f"lr_decay_epochs must be positive, got {self.lr_decay_epochs}")
        if not 0.0 <= self.val_split < 1.0:
            raise ValueError(f"val_split must be in [0, 1), got {self.val_split}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1) or null, got {self.ema_decay}")
        if self.early_stop_patience is not None and self.val_split == 0.0:
            raise ValueError("early_stop_patience needs a held-out validation set: pass --val-split (e.g. 0.02)")
        from lambdanet.data import list_datasets
        from lambdanet.models import model_info

        model_info(self.model)  # "unknown model ...; registered models: ..."
        if not (self.data.startswith("imagefolder:") or self.data in list_datasets()):
            raise ValueError(f"unknown dataset {self.data!r}; valid: {', '.join(list_datasets())}")
        if not 0.0 < self.labeled_fraction <= 1.0:
            raise ValueError(f"labeled_fraction must be in (0, 1], got {self.labeled_fraction}")
        if self.pretrained and self.checkpoint:
            raise ValueError("pass --pretrained (the published weights) or --checkpoint FILE, not both")
        if self.checkpoint is not None:
            from lambdanet.files import run_file

            if not Path(self.checkpoint).expanduser().exists():
                raise ValueError(f"checkpoint {self.checkpoint!r} does not exist (expected a run directory of lambdanet "
                                 "train or a weights file: .safetensors, .pth, .bin, a run's last.pt)")
            run_file(self.checkpoint)  # a directory without weights: one line naming it
        if not isinstance(self.model_kwargs, dict):
            raise ValueError(f"model_kwargs must be a mapping, got {self.model_kwargs!r}")

    def warnings(self) -> list[str]:
        """Settings that run but are probably not what the user wants."""
        out = []
        if self.warmup_epochs >= self.epochs:
            out.append(f"--epochs {self.epochs} ends inside the {self.warmup_epochs:g}-epoch learning-rate warm-up: "
                       "the schedule never decays and accuracy may stay near chance; train longer (e.g. --epochs "
                       f"{max(15, int(self.warmup_epochs) * 5)}) or pass --warmup-epochs 0")
        return out


# the size-like options that may be null, and what they count (TrainConfig.validate)
_OPTIONAL_SIZES = {"img_size": "the training resolution in pixels; each model has its own minimum, checked "
                               "before training", "max_train_batches": "batches per epoch",
                   "early_stop_patience": "epochs", "compact_width": "channels", "lr_batch_scale": "a batch size"}


RECIPES: dict[str, dict] = {
    "quick": {},
    "paper90": {"optimizer": "sgd", "lr": 0.1, "lr_batch_scale": 256, "momentum": 0.9, "weight_decay": 1e-4,
                "warmup_epochs": 5.0, "schedule": "cosine", "label_smoothing": 0.1, "ema_decay": 0.9999,
                "bn_momentum": 1e-4, "epochs": 90, "batch_size": 256, "compact_width": None},
    "paper350": {"optimizer": "sgd", "lr": 0.1, "lr_batch_scale": 256, "momentum": 0.9, "weight_decay": 4e-5,
                 "warmup_epochs": 5.0, "schedule": "cosine", "label_smoothing": 0.1, "ema_decay": 0.9999,
                 "bn_momentum": 1e-4, "epochs": 350, "batch_size": 256, "randaugment_layers": 2,
                 "amp": "bf16", "compact_width": None},
    "cifar_repro": {"optimizer": "adam", "lr": 2.5e-3, "warmup_epochs": 5.0, "warmup_start_factor": 0.2,
                    "betas": [0.9, 0.9999], "weight_decay": 1e-4, "schedule": "cosine", "label_smoothing": 0.1,
                    "epochs": 90, "batch_size": 128, "data": "cifar10", "compact_width": None},
}

# the values a recipe takes from the model's paper metadata (``ModelInfo.recipe``, Tables 19-20 for
# LambdaResNets): image size, RandAugment magnitude, dropout and stochastic depth depend on the model
RECIPE_MODEL_KEYS: dict[str, tuple[str, ...]] = {
    "paper350": ("img_size", "randaugment_magnitude", "drop_rate", "drop_path_rate"),
}

# what ``--resume`` lets change: how the run is watched and where it runs, never what it computes
RESUME_FREE = TrainConfig.resume_free()


def field_choices() -> dict[str, tuple]:
    """The closed options and their valid values (also the ``--flag`` choices)."""
    out = {f.name: f.metadata["choices"] for f in dataclasses.fields(TrainConfig) if f.metadata.get("choices")}
    out["recipe"] = tuple(RECIPES)
    return out


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of option: value")
    return data


def save_yaml(cfg: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))


def _check_keys(values: dict, source: str) -> None:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{source}: unknown option(s) {unknown}; valid options: {', '.join(sorted(names))}")


def resolve_config(recipe: str | None = None, yaml_values: dict | None = None, overrides: dict | None = None
                   ) -> TrainConfig:
    """The configuration that runs, validated: defaults < recipe < the model's paper values the recipe takes
    (:data:`RECIPE_MODEL_KEYS`) < YAML < overrides; then what the data and model imply (image size, the
    small-image stem, the compact width, the model's own dropout / stochastic depth) is written in, so that
    ``config.yaml`` says exactly what runs.

    With ``checkpoint`` set to what ``lambdanet train`` wrote, the model, its architecture options and the image
    size are the checkpoint's (:func:`_checkpoint_values`; over the recipe and the model's paper values) unless
    given explicitly.

    With ``resume`` set, the run's saved ``config.yaml`` takes the place of defaults and recipe; the trainer
    then refuses any change other than :data:`RESUME_FREE` and more ``epochs``.
    """
    yaml_values = dict(yaml_values or {})
    overrides = dict(overrides or {})
    _check_keys(yaml_values, "config file")
    _check_keys(overrides, "overrides")
    explicit = {**yaml_values, **overrides}
    if explicit.get("resume"):
        out = explicit.get("out", TrainConfig.out)
        saved = saved_run_config(out)
        _check_keys(saved, f"{Path(out) / 'config.yaml'}")
        cfg = TrainConfig(**{**saved, **explicit})
    else:
        explicit = _checkpoint_values(explicit)
        name = explicit.get("recipe") or recipe or "quick"
        if name not in RECIPES:
            raise ValueError(f"unknown recipe {name!r}; valid recipes: {', '.join(RECIPES)}")
        from lambdanet.models import model_info

        model = explicit.get("model") or RECIPES[name].get("model") or TrainConfig.model
        paper = model_info(model).recipe  # "unknown model ...; registered models: ..."
        from_model = {k: paper[k] for k in RECIPE_MODEL_KEYS.get(name, ()) if k in paper}
        cfg = TrainConfig(**{**RECIPES[name], **from_model, **explicit, "recipe": name})
    cfg.validate()
    _resolve_model_values(cfg)  # idempotent: a saved (resolved) configuration stays as it is
    return cfg


def _checkpoint_values(explicit: dict) -> dict:
    """Fine-tuning from what ``lambdanet train`` wrote (``checkpoint``: a run directory, its safetensors weights
    or its ``last.pt``) builds the checkpoint's model: ``explicit`` with the model, its architecture options
    (``model_kwargs``, stem and width included) and its image size filled in from the checkpoint's header
    (:func:`lambdanet.train.load.checkpoint_settings`) where not given. Given ``model_kwargs`` override single
    options; a given ``img_size`` builds the model at that size; another ``model`` is refused."""
    ckpt = explicit.get("checkpoint")
    given = explicit.get("model_kwargs") or {}
    if not ckpt or explicit.get("pretrained") or not isinstance(given, dict):
        return explicit  # nothing to take, or an error validate() reports
    from lambdanet.models import model_args
    from lambdanet.train.load import checkpoint_settings

    settings = checkpoint_settings(ckpt)
    if settings is None:  # timm's weights, or a file the weight loader will report on
        return explicit
    model = settings["model"]
    if explicit.get("model") not in (None, model):
        raise ValueError(f"model {explicit['model']!r} does not match checkpoint {str(ckpt)!r}, which holds "
                         f"{model!r}: drop --model to fine-tune the checkpoint's model")
    kwargs = dict(settings["model_kwargs"])
    for key in ("drop_rate", "drop_path_rate"):  # regularisation, not architecture: the new run's own
        kwargs.pop(key, None)  # (its flags, its recipe's paper values, or the model's defaults)
    if explicit.get("img_size") is not None:
        kwargs.pop("img_size", None)  # built at the size asked for (global attention must then fit it)
    accepted = model_args(model)
    for key in ("stem", "base_width"):  # the checkpoint's own, never the small-image / compact defaults
        if key in accepted:
            kwargs.setdefault(key, None)
    out = {**explicit, "model": model, "model_kwargs": {**kwargs, **given}}
    if explicit.get("img_size") is None and settings["image_size"] is not None:
        out["img_size"] = settings["image_size"]
    return out


def _resolve_model_values(cfg: TrainConfig) -> None:
    """Write in what the data and the model imply (in place): ``img_size`` from the dataset, and in
    ``model_kwargs`` (unless given) the small-image stem for images up to 64 px, the compact width and the
    image size where the model takes them; ``drop_rate`` / ``drop_path_rate`` from the model's defaults."""
    from lambdanet.data import dataset_spec
    from lambdanet.models import model_args, model_info

    accepted = model_args(cfg.model)
    if cfg.img_size is None:  # published weights: the size they were trained at (global attention is sized by it)
        cfg.img_size = model_info(cfg.model).input_size if cfg.pretrained else dataset_spec(cfg.data).image_size
    kwargs = dict(cfg.model_kwargs)
    for key in ("drop_rate", "drop_path_rate"):
        if key in kwargs:
            if getattr(cfg, key) is not None and getattr(cfg, key) != kwargs[key]:
                raise ValueError(f"{key} is given twice: {flag(key)} {getattr(cfg, key)} and "
                                 f"model_kwargs {key}={kwargs[key]}; give it once")
            setattr(cfg, key, kwargs.pop(key))
        if getattr(cfg, key) is None:
            setattr(cfg, key, float(accepted.get(key) or 0.0))
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
        raise ValueError("model_kwargs must not set in_chans or num_classes: the model takes the data's channels "
                         "(digits, mnist5k, fashion-mnist: 1; cifar10/100, imagefolder: 3) and classes; weights from "
                         "--checkpoint or --pretrained with other channels have their input convolution adapted, "
                         "with other classes get a new classifier")
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(f"model {cfg.model!r} does not take {unknown}; it accepts: {', '.join(accepted)}")
    cfg.model_kwargs = kwargs


def model_build_kwargs(cfg: TrainConfig) -> dict:
    """The keyword arguments of ``create_model(cfg.model, ...)`` for a resolved ``cfg`` (beyond classes and
    channels): ``model_kwargs`` plus the dropout / stochastic depth the model takes."""
    from lambdanet.models import model_args

    accepted = model_args(cfg.model)
    kwargs = dict(cfg.model_kwargs)
    for key in ("drop_rate", "drop_path_rate"):
        if key in accepted and getattr(cfg, key) is not None:
            kwargs[key] = getattr(cfg, key)
    return kwargs


def saved_run_config(out: str | Path) -> dict:
    """The ``config.yaml`` of the run in ``out`` (``ValueError`` if there is no run to resume)."""
    out = Path(out)
    if not (out / "config.yaml").exists() or not (out / "last.pt").exists():
        raise ValueError(f"nothing to resume in {out}: it needs config.yaml and last.pt from an earlier run")
    return load_yaml(out / "config.yaml")


def config_differences(saved: dict, cfg, ignore: tuple[str, ...] = RESUME_FREE) -> dict[str, tuple]:
    """``{field: (saved value, new value)}`` for every field of ``cfg`` (a :class:`TrainConfig` or another
    options dataclass) that differs from ``saved`` (a field missing there counts as its default)."""
    now = dataclasses.asdict(cfg)
    default = dataclasses.asdict(type(cfg)())
    return {k: (saved.get(k, default[k]), v) for k, v in now.items()
            if k not in ignore and saved.get(k, default[k]) != v}


def flag(name: str) -> str:
    """``--flag`` spelling of a :class:`TrainConfig` field."""
    return "--" + name.replace("_", "-")


def describe_differences(changed: dict[str, tuple]) -> str:
    """``--lr 0.5 (the run has 0.002), ...`` for the output of :func:`config_differences`."""
    return ", ".join(f"{flag(k)} {new!r} (the run has {old!r})" for k, (old, new) in changed.items())


@dataclass(frozen=True)
class ConfigSource:
    """What the user asked for (recipe, YAML values, explicit overrides), before resolution: a sweep
    resolves it once per (model, learning rate)."""

    recipe: str | None = None
    yaml_values: dict = field(default_factory=dict)
    overrides: dict = field(default_factory=dict)

    def resolve(self, **changes) -> TrainConfig:
        return resolve_config(self.recipe, self.yaml_values, {**self.overrides, **changes})


# ---------------------------------------------------------------------------------------------------------
# command-line flags generated from the fields


def _parse_mapping(text: str) -> dict:
    """``'{stage_layers: LLLL, layer_kwargs: {r: 7}}'`` or ``'stage_layers=LLLL,base_width=16'``."""
    if "=" in text and not text.strip().startswith("{"):
        out = {}
        for part in text.split(","):
            key, _, value = part.partition("=")
            out[key.strip()] = yaml.safe_load(value)
        return out
    value = yaml.safe_load(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a mapping like 'key=value,...' or '{{key: value}}', got {text!r}")
    return value


def _optional(conv):
    def parse(text: str):
        return None if text.lower() in ("none", "null") else conv(text)
    parse.__name__ = getattr(conv, "__name__", "value")
    return parse


def recipe_values() -> dict[str, dict]:
    """Per recipe, the values of :class:`TrainConfig` it runs with before the data and the model are known;
    the options a recipe takes from the model (:data:`RECIPE_MODEL_KEYS`) read ``"the model's"``."""
    base = dataclasses.asdict(TrainConfig())
    out = {}
    for name, values in RECIPES.items():
        out[name] = {**base, **values, "recipe": name}
        out[name].update({k: "the model's" for k in RECIPE_MODEL_KEYS.get(name, ())})
    return out


def _shown(value) -> str:
    return "null" if value is None else str(value)


def describe_default(name: str, values: dict[str, dict], default_recipe: str) -> str:
    """``default: X`` when every recipe runs ``name`` with the same value, else the default recipe's value and
    each other recipe's (``default: 1200 (quick recipe); paper: 0``), so ``--help`` shows what will run."""
    first = _shown(values[default_recipe][name])
    others = [f"{recipe}: {_shown(v[name])}" for recipe, v in values.items()
              if recipe != default_recipe and _shown(v[name]) != first]
    if name == "recipe" or not others:
        return f"default: {first}"
    return f"default: {first} ({default_recipe} recipe); " + "; ".join(others)


def add_config_arguments(parser: argparse.ArgumentParser, config_cls: type = None,
                         choices: dict[str, tuple] | None = None, recipes: dict[str, dict] | None = None,
                         default_recipe: str = "quick") -> None:
    """One ``--flag`` per field of ``config_cls`` (default :class:`TrainConfig`, whose closed options are
    :func:`field_choices` and recipes :func:`recipe_values`; another dataclass passes its own ``choices`` and
    ``recipes``, name -> the values it runs with) with its one-line help (:func:`option` metadata), choices and
    default as the recipes set it (:func:`describe_default`; booleans: ``--flag`` / ``--no-flag``); the parsed
    default is ``None`` = "not given", so recipe and YAML values survive."""
    config_cls = TrainConfig if config_cls is None else config_cls
    hints = typing.get_type_hints(config_cls)
    choices = field_choices() if config_cls is TrainConfig else dict(choices or {})
    if recipes is None:
        recipes = recipe_values() if config_cls is TrainConfig else {
            default_recipe: dataclasses.asdict(config_cls())}
    for f in dataclasses.fields(config_cls):
        hint = hints[f.name]
        args = typing.get_args(hint)
        base = next((a for a in args if a is not type(None)), hint) if args else hint
        optional = type(None) in args
        help_text = f"{f.metadata['help']} ({describe_default(f.name, recipes, default_recipe)})"
        if base is bool:
            parser.add_argument(flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        elif base is dict or hint is dict:
            parser.add_argument(flag(f.name), dest=f.name, type=_parse_mapping, default=None, metavar="MAPPING",
                                help=help_text)
        elif base is list or hint is list:
            parser.add_argument(flag(f.name), dest=f.name, type=float, nargs="+", default=None, metavar="X",
                                help=help_text)
        else:
            conv = {int: int, float: float, str: str}.get(base, str)
            parser.add_argument(flag(f.name), dest=f.name, type=_optional(conv) if optional else conv, default=None,
                                choices=choices.get(f.name), help=help_text,
                                metavar="{" + ",".join(choices[f.name]) + "}" if f.name in choices else None)


def config_source_from_args(args: argparse.Namespace, config_cls: type = None) -> ConfigSource:
    """What the flags (and ``--config FILE``) ask for, before resolution: the flags of ``config_cls``'s fields
    (default :class:`TrainConfig`) that were given, the YAML file's values and the recipe asked for."""
    names = {f.name for f in dataclasses.fields(config_cls or TrainConfig)}
    overrides = {k: v for k, v in vars(args).items() if k in names and v is not None}
    yaml_values = load_yaml(args.config) if getattr(args, "config", None) else {}
    return ConfigSource(overrides.get("recipe"), yaml_values, overrides)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Resolve a :class:`TrainConfig` from parsed flags (with ``--config`` and ``--recipe``)."""
    return config_source_from_args(args).resolve()
