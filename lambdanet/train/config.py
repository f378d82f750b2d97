"""Training configuration: one dataclass, recipes as overrides, YAML files, and a flag per field.

Precedence (later wins): dataclass defaults < ``--recipe`` < ``--config FILE.yaml`` < command-line flags.
The resolved configuration is written to ``<out>/config.yaml`` and reloaded on ``--resume``.

Recipes:

* ``quick``: small data on a CPU in minutes (AdamW 2e-3, 1 warm-up epoch, cosine, label smoothing 0.1,
  crops with padding, compact model width): the README's main job.
* ``paper90``: App. E.2's 90-epoch ImageNet setup: SGD momentum 0.9, linear warm-up over 5 epochs to
  ``0.1 B / 256``, cosine decay, weight decay 1e-4, label smoothing 0.1, EMA of weights 0.9999, BatchNorm
  decay 0.9999 (PyTorch momentum 1e-4), random crops and flips.
* ``paper350``: ``paper90`` with weight decay 4e-5, 350 epochs, RandAugment with 2 layers, and the
  magnitude, dropout and stochastic depth of Table 20 for the model's depth and image size (read from
  the model's metadata), bf16 autocast (the paper trains with bfloat16 activations).
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

__all__ = ["TrainConfig", "RECIPES", "resolve_config", "add_config_arguments", "load_yaml", "save_yaml",
           "config_from_args"]


@dataclass
class TrainConfig:
    """Every option of ``lambdanet train`` (each is also a ``--flag``)."""

    # model and data
    model: str = "lambda_resnet26"
    model_kwargs: dict = field(default_factory=dict)
    data: str = "digits"
    data_dir: str = "~/.cache/lambdanet/data"
    download: bool = True
    img_size: int | None = None
    val_split: float = 0.0
    # recipe
    recipe: str = "quick"
    epochs: int = 15
    batch_size: int = 64
    eval_batch_size: int = 256
    optimizer: str = "adamw"
    lr: float = 2e-3
    lr_batch_scale: int | None = None
    momentum: float = 0.9
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.05
    warmup_epochs: float = 1.0
    warmup_start_factor: float = 0.0
    schedule: str = "cosine"
    min_lr: float = 0.0
    label_smoothing: float = 0.1
    ema_decay: float | None = None
    bn_momentum: float | None = None
    augment: bool = True
    randaugment_layers: int = 0
    randaugment_magnitude: int = 9
    drop_rate: float | None = None
    drop_path_rate: float | None = None
    compact_width: int | None = 16
    # system
    amp: str = "none"
    channels_last: bool = False
    compile: bool = False
    device: str = "auto"
    workers: int = 0
    seed: int = 0
    sync_bn: bool = False
    # run
    out: str = "runs/lambdanet"
    checkpoint_every: int = 1
    resume: bool = False
    early_stop_patience: int | None = None
    tensorboard: bool = True
    progress: bool = True
    labeled_fraction: float = 1.0
    pseudo_labels: str | None = None
    max_train_batches: int | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and the valid values for anything out of range."""
        choices = {"optimizer": ("sgd", "adam", "adamw", "rmsprop"), "schedule": ("cosine", "constant"),
                   "amp": ("none", "bf16", "fp16"), "device": ("auto", "cpu", "cuda"), "recipe": tuple(RECIPES)}
        for name, valid in choices.items():
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} must be one of {list(valid)}, got {getattr(self, name)!r}")
        positive = ("epochs", "batch_size", "eval_batch_size", "checkpoint_every")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
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
        if not isinstance(self.model_kwargs, dict):
            raise ValueError(f"model_kwargs must be a mapping, got {self.model_kwargs!r}")

    def effective_lr(self) -> float:
        """``lr * batch_size / lr_batch_scale`` (the paper's ``0.1 B / 256``) or ``lr``."""
        return self.lr * self.batch_size / self.lr_batch_scale if self.lr_batch_scale else self.lr


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
    """Defaults < recipe < YAML < overrides, validated."""
    yaml_values = dict(yaml_values or {})
    overrides = dict(overrides or {})
    _check_keys(yaml_values, "config file")
    _check_keys(overrides, "overrides")
    name = overrides.get("recipe") or yaml_values.get("recipe") or recipe or "quick"
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; valid recipes: {', '.join(RECIPES)}")
    values = {**RECIPES[name], **yaml_values, **overrides, "recipe": name}
    cfg = TrainConfig(**values)
    cfg.validate()
    return cfg


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


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _optional(conv):
    def parse(text: str):
        return None if text.lower() in ("none", "null") else conv(text)
    parse.__name__ = getattr(conv, "__name__", "value")
    return parse


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per :class:`TrainConfig` field (booleans: ``--flag`` / ``--no-flag``); default ``None``
    means "not given", so recipe and YAML values survive."""
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        args = typing.get_args(hint)
        base = next((a for a in args if a is not type(None)), hint) if args else hint
        optional = type(None) in args
        help_text = f"(default: {f.default if f.default is not dataclasses.MISSING else f.default_factory()})"
        if base is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        elif base is dict or hint is dict:
            parser.add_argument(flag, dest=f.name, type=_parse_mapping, default=None, metavar="MAPPING",
                                help=help_text)
        elif base is list or hint is list:
            parser.add_argument(flag, dest=f.name, type=float, nargs="+", default=None, help=help_text)
        else:
            conv = {int: int, float: float, str: str}.get(base, str)
            parser.add_argument(flag, dest=f.name, type=_optional(conv) if optional else conv, default=None,
                                help=help_text)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Resolve a :class:`TrainConfig` from parsed flags (with ``--config`` and ``--recipe``)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    overrides = {k: v for k, v in vars(args).items() if k in names and v is not None}
    yaml_values = load_yaml(args.config) if getattr(args, "config", None) else {}
    return resolve_config(overrides.get("recipe"), yaml_values, overrides)
