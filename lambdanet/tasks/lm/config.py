"""The configuration of ``lambdanet lm train``: :class:`LMConfig` (every option, also a ``--flag`` and a YAML key)
and its recipes (:attr:`LMConfig.RECIPES`)."""

from __future__ import annotations

from dataclasses import dataclass

from lambdanet.engine.config import RunConfig, changed_by, option, shared
from lambdanet.helpers import is_finite_real
from lambdanet.models import list_models
from lambdanet.models.lm_zoo import pin_lm_kwargs, saved_lm
from lambdanet.tasks.lm.data import DATA_HELP

__all__ = ["LMConfig"]


_MISSING = object()


@dataclass
class LMConfig(RunConfig):
    """Every option of ``lambdanet lm train`` (each is also a ``--flag`` and a YAML key; ``null`` = unset).

    Recipes: ``quick`` (the default: ``lambda_lm_tiny`` at context 256, 1,200 steps of 16 sequences: 1.645 bits per
    byte in 8 minutes on 2 CPU cores), ``long`` (the same model, 3,000 steps of 32 sequences: 1.317, below gzip -9's
    1.61 on the standard library, in 34 minutes on 2 CPU cores; docs/language_models.md) and ``long_small``
    (``lambda_lm_small``, context 512, 15,000 steps of 32: a GPU's recipe, days on a CPU)."""

    TASK = "lm"
    RECIPES = {
        "quick": {},
        "long": {
            "epochs": 15,
            "steps_per_epoch": 200,
            "batch_size": 32,
            "warmup_steps": 200,
        },
        "long_small": {
            "model": "lambda_lm_small",
            "context": 512,
            "epochs": 30,
            "steps_per_epoch": 500,
            "batch_size": 32,
            "lr": 1e-3,
            "warmup_steps": 500,
        },
    }

    model: str = option("lambda_lm_tiny", "registered language model (lambdanet models '*_lm_*' lists them)")
    model_kwargs: dict = option({}, "architecture options of the model, 'key=value,...' or a YAML mapping")
    data: str = option("stdlib", DATA_HELP)
    vocab_size: int = option(256, "vocabulary of the model (256: bytes); the corpus's bytes must be below it")
    context: int = option(256, "training sequence length in bytes")
    recipe: str = shared("recipe", "quick")
    epochs: int = shared("epochs", 8)
    steps_per_epoch: int = option(150, "optimiser steps per epoch")
    batch_size: int = shared("batch_size", 16, "global batch of sequences per step (split across torchrun processes)")
    optimizer: str = shared("optimizer", "adamw")
    lr: float = shared("lr", 3e-3, "peak learning rate (scaled by batch_size / lr_batch_scale when that is set)")
    lr_batch_scale: int | None = shared("lr_batch_scale", None)
    betas: list = shared("betas", [0.9, 0.95])
    weight_decay: float = shared("weight_decay", 0.1)
    warmup_steps: int = option(100, "linear learning-rate warm-up, in steps")
    min_lr: float = option(
        3e-4, "final learning rate of the cosine schedule, at lr's scale: --lr-batch-scale scales it as it scales lr"
    )
    grad_clip: float | None = shared("grad_clip", 1.0)
    amp: str = shared("amp", "none")
    compile: bool = shared("compile", False)
    compile_mode: str = shared("compile_mode", "default")
    device: str = shared("device", "auto")
    seed: int = option(0, "seed of initialisation and of the training windows")
    eval_bytes: int | None = option(
        131072, "bytes of the validation split evaluated after each epoch (null: all; the end of the run evaluates all)"
    )
    eval_batch_size: int = shared("eval_batch_size", 16, "sequences per evaluation batch")
    out: str = shared("out", "runs/lm")
    checkpoint_every: int = shared("checkpoint_every", 1)
    checkpoint_steps: int = shared("checkpoint_steps", 0)
    resume: bool = shared("resume", False)
    tensorboard: bool = shared("tensorboard", True)
    progress: bool = shared("progress", True)

    def validate(self) -> None:
        super().validate()  # the shared options (epochs, batch sizes, lr, betas, grad_clip, seed, ...)
        for name in ("vocab_size", "context", "steps_per_epoch"):
            self.check_int(name)
        self.check_int("warmup_steps", 0)
        if self.model not in list_models("*_lm_*"):
            raise ValueError(f"model must be a language model, one of {list_models('*_lm_*')}, got {self.model!r}")
        self.check_number("min_lr", 0, self.lr, note=" (the cosine schedule's floor, at most lr)")
        self.check_int("eval_bytes", 2, " (null: all)", optional=True)
        if "vocab_size" in self.model_kwargs:  # an option of its own, which the run records
            raise ValueError("model_kwargs must not set vocab_size: use --vocab-size (vocab_size: in a config file)")

    @classmethod
    def recipe_values(cls, name: str, explicit: dict) -> dict:
        """The recipe with ``explicit`` over it; an ``lr`` given below the recipe's ``min_lr`` with no ``min_lr``
        gets a floor of ``lr / 10`` (nanoGPT's ratio, the defaults' own), not a refusal of a floor never named."""
        values = super().recipe_values(name, explicit)
        lr, floor = values.get("lr", cls.lr), values.get("min_lr", cls.min_lr)
        if "min_lr" not in explicit and is_finite_real(lr) and is_finite_real(floor) and 0 < lr < floor:
            values["min_lr"] = lr / 10
        return values

    @classmethod
    def without_implied(cls, file_values: dict, flags: dict) -> dict:
        """A config file's values without the options its ``lambda_lm_<size>`` wrote out
        (:func:`~lambdanet.models.lm_zoo.pin_lm_kwargs`) where ``--model`` changes the model: they are that
        model's defaults, not options the user gave."""
        out, model, kwargs = dict(file_values), file_values.get("model"), file_values.get("model_kwargs")
        if changed_by(flags, out, "model") and isinstance(model, str) and isinstance(kwargs, dict):
            # a key the pin writes back, with the same value, when it is left out is the model's default
            out["model_kwargs"] = {
                k: v
                for k, v in kwargs.items()
                if pin_lm_kwargs(model, {n: w for n, w in kwargs.items() if n != k}).get(k, _MISSING) != v
            }
        return out

    def complete(self, explicit: dict) -> None:
        """The model as the run records it: a resumed run written before ``lambda_lm_<size>``'s default moved is
        the model it trained (:func:`~lambdanet.models.lm_zoo.saved_lm`); options whose default moved are written
        out (:func:`~lambdanet.models.lm_zoo.pin_lm_kwargs`)."""
        super().complete(explicit)
        if self.resume:
            self.model, self.model_kwargs = saved_lm(self.model, self.model_kwargs)
        self.model_kwargs = pin_lm_kwargs(self.model, self.model_kwargs)
