"""The run configuration every task shares: a typed dataclass of :func:`option` fields (each a ``--flag``, a YAML
key and a line of ``--help``), recipes as named overrides, and one :meth:`RunConfig.resolve`.

Precedence (later wins): dataclass defaults < the recipe (and what the task derives from it) < ``--config
FILE.yaml`` < command-line flags (a mapping flag, ``--model-kwargs``, updates the file's mapping key by key); the
task then completes the configuration (what the data and model imply), so that ``<out>/config.yaml`` says exactly
what runs. Such a file given to ``--config`` with a flag that changes what implied a value (``--img-size``,
``--model``) has that value implied again (:meth:`RunConfig.without_implied`). With ``--resume`` the run's
``config.yaml`` takes the place of defaults and recipe, and only the options declared ``resume_free`` and
``epochs`` may change. The command-line flags generated from the fields are :mod:`lambdanet.engine.flags`
(importable from here as well)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from lambdanet.engine.flags import THREADS_HELP as THREADS_HELP  # the flags live there, importable from here
from lambdanet.engine.flags import _parse_mapping as _parse_mapping
from lambdanet.engine.flags import add_config_arguments, add_threads_argument, flag, given_flags
from lambdanet.engine.flags import describe_default as describe_default
from lambdanet.engine.optim import OPTIMIZERS
from lambdanet.engine.rundir import checkpoints_in
from lambdanet.engine.values import check_number, check_types, load_run_yaml, load_yaml, save_yaml
from lambdanet.files import RUN_TASKS, absolute_data, check_output_dir, run_task
from lambdanet.helpers import check_int, is_finite_real
from lambdanet.runtime import AMP_DTYPES

__all__ = [
    "option",
    "shared",
    "RunConfig",
    "ConfigSource",
    "load_yaml",
    "load_run_yaml",
    "save_yaml",
    "check_number",
    "config_differences",
    "flag",
    "describe_differences",
    "add_config_arguments",
    "add_threads_argument",
    "config_source_from_args",
]


def option(default, help: str, choices: tuple | None = None, *, resume_free: bool = False, **kw):
    """A configuration dataclass field with its one-line ``--help`` text, where closed its choices
    (:func:`add_config_arguments` makes it a flag), and whether ``--resume`` may change it (``resume_free``:
    where and how a run is watched, not what it computes; :meth:`RunConfig.resume_free`)."""
    meta = {"help": help, "choices": choices, "resume_free": resume_free}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


# The options more than one task's configuration declares: each one's help, closed choices and resume rule, once
# (a task declares those it has). ``resume_free``: where and how a run is watched, never what it computes.
SHARED_OPTIONS: dict[str, tuple[str, tuple | None, bool]] = {
    "recipe": ("named recipe whose values the other options override", None, False),
    "epochs": ("training epochs (with --resume: more extend the run, its schedule recomputed over them)", None, False),
    "batch_size": ("global batch size (split across torchrun processes)", None, False),
    "eval_batch_size": ("batch size of evaluation", None, False),
    "optimizer": ("optimizer", OPTIMIZERS, False),
    "lr": ("base learning rate (scaled by batch_size / lr_batch_scale when that is set)", None, False),
    "lr_batch_scale": ("linear scaling rule: lr * batch_size / this (the papers' recipes: 256)", None, False),
    "momentum": ("momentum of SGD and RMSProp", None, False),
    "betas": ("Adam/AdamW betas", None, False),
    "weight_decay": ("weight decay (not on norms, biases and other 1-d parameters)", None, False),
    "grad_clip": ("clip the gradient norm to this (null or 0: no clipping)", None, False),
    "amp": ("autocast precision (fp16 needs CUDA)", tuple(AMP_DTYPES), False),
    "compile": ("torch.compile the model", None, False),
    "compile_mode": (
        "torch.compile's mode with --compile: default, reduce-overhead (CUDA graphs: fewer launches for small "
        "steps) or max-autotune",
        ("default", "reduce-overhead", "max-autotune"),
        False,
    ),
    "sync_bn": ("synchronised BatchNorm across torchrun processes", None, False),
    "max_train_batches": ("stop each epoch after this many batches (smoke tests)", None, False),
    "device": ("device (auto: CUDA when available)", ("auto", "cpu", "cuda"), True),
    "workers": ("data-loading worker processes", None, True),
    "out": ("run directory (config, metrics, checkpoints, weights, plots, summary)", None, True),
    "checkpoint_every": ("write last.pt every this many epochs (and at the end)", None, True),
    "checkpoint_steps": (
        "also write last.pt at every this many optimiser steps of the run, across the epochs' ends (0: at the "
        "epochs' ends only); a crash (SIGKILL, power) then loses fewer than these steps",
        None,
        True,
    ),
    "resume": ("continue the run in --out where it stopped", None, True),
    "tensorboard": ("write TensorBoard event files to <out>/tb, beside metrics.csv", None, True),
    "progress": ("progress bar on stderr (on a terminal; a log gets one line per epoch)", None, True),
}


def shared(name: str, default, help: str | None = None):
    """The :func:`option` of the shared option ``name`` (:data:`SHARED_OPTIONS`) with this task's ``default``;
    ``help`` replaces the shared text where the task means more by it (what its --resume reads, a batch of
    sequences)."""
    text, choices, resume_free = SHARED_OPTIONS[name]
    return option(default, help or text, choices, resume_free=resume_free)


class RunConfig:
    """The base of every task's configuration dataclass (the ``config.py`` of a task): recipes, the one
    resolution, the resume rule, the learning-rate scaling rule. A subclass sets :attr:`RECIPES` and may
    override :meth:`recipe_values` (what a recipe runs with) and :meth:`complete` (what the data and model
    imply); it has the fields ``recipe``, ``epochs``, ``out`` and ``resume``."""

    RECIPES: ClassVar[dict[str, dict]] = {"quick": {}}
    CHECKPOINTS: ClassVar[tuple[str, ...]] = ("last.pt",)  # what a run continues from
    TASK: ClassVar[str | None] = None  # the key of lambdanet.files.RUN_TASKS of the runs it makes
    PER_PROCESS: ClassVar[frozenset[str]] = frozenset({"out", "workers", "progress", "tensorboard"})  # may differ
    PATHS: ClassVar[tuple[str, ...]] = ()  # file or folder options made absolute (``~`` expanded) once resolved
    # what a saved config.yaml that lacks an option ran with, where that is not the option's default today (the
    # option came later, fixing the behaviour of the runs before it)
    SAVED_DEFAULTS: ClassVar[dict[str, Any]] = {}

    # Options the engine reads that not every task offers, with what a task without them runs as: a task that
    # offers one declares it as a dataclass field (``shared(name, default)``), which takes the place of this.
    checkpoint_every: int = 1
    checkpoint_steps: int = 0
    compile: bool = False
    compile_mode: str = "default"
    tensorboard: bool = False
    grad_clip: float | None = None
    momentum: float = 0.9
    nesterov: bool = False
    betas: tuple[float, float] | list[float] = (0.9, 0.999)

    if TYPE_CHECKING:  # what every subclass, a dataclass, declares (not fields of this class)
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
        recipe: str
        epochs: int
        batch_size: int
        lr: float
        lr_batch_scale: int | None
        optimizer: str
        weight_decay: float
        amp: str
        device: str
        seed: int
        progress: bool
        out: str
        resume: bool

    @classmethod
    def resolve(cls, recipe: str | None = None, yaml_values: dict | None = None, overrides: dict | None = None):
        """The configuration that runs, validated and completed (see the module's docstring). With ``resume``,
        a mapping given (``model_kwargs``, ...) updates the saved one."""
        for values, source in ((yaml_values or {}, "config file"), (overrides or {}, "overrides")):
            _check_keys(cls, values, source)
            check_types(cls, values)  # before the recipe and the task read them
        explicit = merge_values(cls.without_implied(yaml_values or {}, overrides or {}), overrides or {})
        if explicit.get("resume"):
            out = Path(explicit.get("out", cls.out))
            if (out / "config.yaml").is_file():  # another command's run (its own checkpoint or none) is named as such
                _refuse_other_task(cls, out)
            if not (out / "config.yaml").is_file() or not checkpoints_in(out, cls.CHECKPOINTS):
                raise ValueError(
                    f"nothing to resume in {out}: it needs config.yaml and "
                    f"{' or '.join(cls.CHECKPOINTS)} from an earlier run"
                )
            cfg = cls(**merge_values(_saved_config(cls, out / "config.yaml"), explicit))
        else:
            name = explicit.get("recipe") or recipe or "quick"
            if name not in cls.RECIPES:
                raise ValueError(f"unknown recipe {name!r}; valid recipes: {', '.join(cls.RECIPES)}")
            cfg = cls(**cls.recipe_values(name, explicit))
        cfg.finalize(explicit)
        return cfg

    def finalize(self, explicit: dict) -> None:
        """The end of every resolution (:meth:`resolve`, and :func:`lambdanet.engine.task.resolved` for a
        configuration built directly), in place: the data path made absolute, the values validated, ``out``
        checked, what the ``explicit`` values imply written in (:meth:`complete`), the configuration marked
        resolved."""
        names = [name for name in ("data", *self.PATHS) if hasattr(self, name)]
        for name, value in self.absolute_paths({name: getattr(self, name) for name in names}).items():
            setattr(self, name, value)
        self.validate()
        # --out, or the nearest of its parents that exists, a file: every worker process of a run would fail
        check_output_dir(self.out, "--out", "a folder for the run")
        self.complete(explicit)
        self._resolved = True  # engine.task.run resolves a configuration built directly

    @classmethod
    def without_implied(cls, file_values: dict, flags: dict) -> dict:
        """``file_values`` (a ``--config`` file's) without the values its own options imply where ``flags`` change
        those options, so that they are implied again from the flags. A run's ``config.yaml`` writes out what its
        options implied (a model's derived architecture options, its image size): taken as given, they would
        outlast the flag that changes them. A value equal to what the file's options imply is taken as implied
        (the same whether written by a run or by hand), and only where a flag changes what implies it, so an
        unchanged file runs as before. The task says what implies what; here: nothing."""
        return dict(file_values)

    @classmethod
    def absolute_paths(cls, values: dict) -> dict:
        """``values`` (option: value) with ``data``'s path and the :attr:`PATHS` options that are relative made
        absolute, found from any working directory later (``--resume``, ``eval``, a sweep's rerun); ``~`` paths
        stay as written (each machine expands its own), as do ``''`` (refused later) and hub ids. The rule for a
        run's configuration, and for comparing one saved by an earlier version (which kept them as given)."""
        out = dict(values)
        if isinstance(out.get("data"), str):
            out["data"] = absolute_data(out["data"])
        for name in cls.PATHS:
            path = out.get(name)
            if (
                isinstance(path, str)
                and path
                and not path.startswith(("hf-hub:", "~"))
                and not Path(path).is_absolute()
            ):
                out[name] = str(Path(path).absolute())
        return out

    @classmethod
    def recipe_values(cls, name: str, explicit: dict) -> dict:
        """The field values of recipe ``name`` with the ``explicit`` ones over them."""
        return {**cls.RECIPES[name], **explicit, "recipe": name}

    def complete(self, explicit: dict) -> None:
        """Write in what the options imply (in place, idempotent: a saved configuration stays as it is)."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and the valid values for anything out of range: every field's
        type (:func:`check_types`), the closed choices and the ranges of the shared options this task has
        (:meth:`check_shared`); a task's own ``validate`` adds its options' ranges."""
        check_types(type(self), {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        for name, valid in self.choices().items():
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} must be one of {list(valid)}, got {getattr(self, name)!r}")
        self.check_shared()

    def check_shared(self) -> None:
        """The ranges of the options several tasks share (:data:`SHARED_OPTIONS`) and of ``seed``, for those
        this configuration has (a ``ValueError`` naming the first out of range)."""
        names = {f.name for f in dataclasses.fields(self)}
        for name, low, note, optional in _SHARED_INTS:
            if name in names:
                self.check_int(name, low, note, optional=optional)
        if "seed" in names:  # the engine seeds numpy, whose seeds are 32-bit
            self.check_int("seed", 0, " below 2**32", high=2**32 - 1)
        for name, low, high, low_open, high_open, optional, note in _SHARED_NUMBERS:
            if name in names:
                self.check_number(name, low, high, low_open=low_open, high_open=high_open, optional=optional, note=note)
        if "betas" in names:
            betas = self.betas
            if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(_is_fraction(b) for b in betas):
                raise ValueError(f"betas must be two numbers in [0, 1) (Adam's beta1 beta2), got {betas!r}")

    def check_int(
        self, name: str, low: int = 1, note: str = "", *, optional: bool = False, high: int | None = None
    ) -> None:
        """Raise ``ValueError`` unless option ``name`` is an int >= ``low`` (1: positive, 0: non-negative) and <=
        ``high`` where given, or ``None`` where ``optional``; ``note`` (`` (0: auto)``) follows the kind in the
        message."""
        check_int(getattr(self, name), name, low, high, note=note, optional=optional, plain=True)

    def check_number(self, name: str, low: float | None = None, high: float | None = None, **kw) -> None:
        """:func:`check_number` of option ``name`` (its keywords: ``low_open``, ``high_open``, ``optional``,
        ``note``)."""
        check_number(getattr(self, name), name, low, high, **kw)

    @classmethod
    def choices(cls) -> dict[str, tuple]:
        """The closed options and their valid values (also the ``--flag`` choices)."""
        out = {f.name: f.metadata["choices"] for f in dataclasses.fields(cls) if f.metadata.get("choices")}
        return out | {"recipe": tuple(cls.RECIPES)}

    @classmethod
    def recipe_table(cls) -> dict[str, dict]:
        """Per recipe, the values it runs with on the defaults (what ``--help`` shows)."""
        return {name: {**dataclasses.asdict(cls()), **cls.recipe_values(name, {})} for name in cls.RECIPES}

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
        if "data" in changed and data_identity(str(saved["data"])) == data_identity(str(getattr(self, "data", ""))):
            del changed["data"]  # the same dataset, moved or mounted elsewhere (coco:/mnt/a/coco -> coco:/data/coco)
        if changed:
            folder = "data" in changed and ":" in str(changed["data"][0])  # kind:path
            moved = " (a dataset moved elsewhere keeps its folder's name)" if folder else ""
            raise ValueError(
                f"--resume cannot change {', '.join(changed)}: {describe_differences(changed)}{moved}; only "
                f"--epochs and {', '.join(flag(k) for k in free if k not in ('resume', 'out'))} may "
                f"change: drop the others, or start a new run with another --out"
            )
        return int(saved["epochs"])


def data_identity(data: str) -> str:
    """What of a ``data`` value must agree between runs or processes that claim the same data: a ``kind:path``'s
    kind and the folder's last name (``coco:/mnt/a/coco`` and ``coco:/data/coco`` are one dataset at two mount
    points), a built-in name whole."""
    kind, sep, path = data.partition(":")
    return f"{kind}:{Path(path).name}" if sep else kind


def merge_values(base: dict, over: dict) -> dict:
    """``over``'s values on ``base``'s; a mapping option (``model_kwargs``, ...) given in both is ``base``'s
    updated key by key (a flag's ``--model-kwargs se=true`` keeps the config file's or the saved run's other keys)."""
    merged = dict(base)
    for k, v in over.items():
        merged[k] = {**base[k], **v} if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return merged


def changed_by(flags: dict, values: dict, *names: str) -> bool:
    """Whether ``flags`` give one of ``names`` another value than ``values`` (:meth:`RunConfig.without_implied`)."""
    return any(name in flags and flags[name] != values.get(name) for name in names)


def _is_fraction(value) -> bool:
    """A real number (not a bool) in [0, 1)."""
    return is_finite_real(value) and 0 <= value < 1


def _refuse_other_task(cls: type[RunConfig], out: Path) -> None:
    """A one-line ``ValueError`` when the run in ``out`` is another command's (its ``config.yaml`` tells), naming
    it and the command that continues it."""
    if cls.TASK is not None and (found := run_task(out)) not in (None, cls.TASK):
        kind, writer = RUN_TASKS[found][:2]
        raise ValueError(
            f"nothing to resume in {out} for {RUN_TASKS[cls.TASK][1]}: it is {kind} ({writer}); continue it with "
            f"{writer} --resume --out {out}"
        ) from None


def _saved_config(cls: type[RunConfig], path: Path) -> dict:
    """The options of a run's ``config.yaml`` that ``--resume`` continues it with, each checked (a one-line
    ``ValueError`` naming the file: it is empty, not YAML, or holds an unknown option or a value out of range)."""
    saved = {**cls.SAVED_DEFAULTS, **load_run_yaml(path)}
    _check_keys(cls, saved, str(path))
    try:
        check_types(cls, saved)
        cls(**saved).validate()
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return saved


def _check_keys(cls: type, values: dict, source: str) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    if unknown := sorted(set(values) - names):
        raise ValueError(f"{source}: unknown option(s) {unknown}; valid options: {', '.join(sorted(names))}")


# the shared int options: (name, lowest value, note, may be null)
_SHARED_INTS = (
    ("epochs", 1, "", False),
    ("batch_size", 1, "", False),
    ("eval_batch_size", 1, "", False),
    ("checkpoint_every", 1, "", False),
    ("checkpoint_steps", 0, " (0: at the epochs' ends only)", False),
    ("workers", 0, "", False),
    ("max_train_batches", 1, " (batches per epoch)", True),
    ("lr_batch_scale", 1, " (a batch size)", True),
)
# the shared real options: (name, low, high, low open, high open, may be null, note)
_SHARED_NUMBERS = (
    ("lr", 0, None, True, False, False, ""),
    ("momentum", 0, 1, False, True, False, ""),
    ("weight_decay", 0, None, False, False, False, ""),
    ("grad_clip", 0, None, False, False, True, " (0: no clipping)"),
)


def config_differences(saved: dict, cfg, ignore: tuple[str, ...] = ()) -> dict[str, tuple]:
    """``{field: (saved value, new value)}`` for every field of the configuration ``cfg`` that differs from
    ``saved`` (a field missing there counts as its default), except ``ignore``."""
    default = dataclasses.asdict(type(cfg)())
    return {
        k: (saved.get(k, default[k]), v)
        for k, v in dataclasses.asdict(cfg).items()
        if k not in ignore and saved.get(k, default[k]) != v
    }


def describe_differences(changed: dict[str, tuple]) -> str:
    """``--lr 0.5 (the run has 0.002), ...`` for the output of :func:`config_differences`."""
    return ", ".join(f"{flag(k)} {new!r} (the run has {old!r})" for k, (old, new) in changed.items())


@dataclass(frozen=True)
class ConfigSource:
    """What the user asked for (recipe, YAML values, explicit overrides) of a ``config_cls``, before
    resolution: a sweep resolves it once per (model, learning rate)."""

    config_cls: type
    recipe: str | None = None
    yaml_values: dict = field(default_factory=dict)
    overrides: dict = field(default_factory=dict)

    def resolve(self, **changes):
        return self.config_cls.resolve(self.recipe, self.yaml_values, {**self.overrides, **changes})


def config_source_from_args(args: argparse.Namespace, config_cls: type) -> ConfigSource:
    """What the flags (and ``--config FILE``) ask for, before resolution: the flags of ``config_cls``'s fields
    that were given, the YAML file's values and the recipe asked for."""
    names, given = {f.name for f in dataclasses.fields(config_cls)}, given_flags(args)
    # a flag given as null (--ema-decay null) wins over the recipe and the file, as any flag does
    overrides = {k: v for k, v in vars(args).items() if k in names and (v is not None or k in given)}
    yaml_values = load_yaml(args.config) if getattr(args, "config", None) is not None else {}  # '': refused
    return ConfigSource(config_cls, overrides.get("recipe"), yaml_values, overrides)
